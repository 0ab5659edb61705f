"""``strideweave.torch.Trainer``: transformers' ``Trainer`` for a model whose experts are offloaded (docs/guide.md,
"Fine-tuning with Trainer").

Note [What Trainer cannot see]
transformers' ``Trainer`` reaches a model's weights through ``model.parameters()`` and its state dict, and the
offloaded experts are neither. What it does on its own with such a model: it steps a ``strideweave.torch``
optimizer given in ``optimizers=`` (that optimizer steps the experts too), drives its ``param_groups`` with its
scheduler, accumulates gradients (tiled gradients accumulate like torch's) and calls ``model.zero_grad()``
(which drops the experts' gradients too, ``_guards``). What it cannot do by public means, and this subclass does:

* clipping (``max_grad_norm``): ``Trainer`` clips ``model.parameters()`` only; here ``_clip_grad_norm`` and
  ``_get_grad_norm`` use ``strideweave.torch.clip_grad_norm_`` (torch's and the tiled gradients together);
* saving (``save_steps``, ``save_model``): ``Trainer`` calls the model's ``save_pretrained`` with its state dict,
  which would leave the experts out (refused, ``_guards``); here the model is written by
  ``strideweave.torch.save_pretrained`` (experts streamed from their tiles), its files moved into the output folder;
* the optimizer's state: ``Trainer`` ``torch.save``s ``optimizer.state_dict()``, which cannot hold tiled moments
  without gathering them; here ``optimizer.save_state(folder)`` / ``load_state(folder)`` stream them;
* resuming: ``Trainer`` loads a checkpoint's weights into ``model.parameters()``; the experts cannot be loaded
  that way, so the model must be opened from the checkpoint folder itself
  (``strideweave.torch.from_pretrained(checkpoint)``), which ``_load_from_checkpoint`` checks (``ValueError``
  otherwise, nothing loaded); the optimizer's and scheduler's states and the RNG are then restored by ``Trainer``.

Without an ``optimizers=`` pair, ``create_optimizer`` builds a ``strideweave.torch.AdamW`` with ``Trainer``'s own
groups (weight decay for the weights and experts, none for biases and norms) and ``TrainingArguments``' learning
rate, betas and epsilon. A model without offloaded experts is trained exactly as ``transformers.Trainer`` trains it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from ._bridge import _torch

_CLASSES: dict = {}


def _bound(model: Any) -> dict:
    from ._offload import offloaded_experts
    return offloaded_experts(model) if model is not None else {}


def _inner(optimizer: Any) -> Any:
    """The strideweave.torch optimizer under accelerate's wrapper, or None."""
    from ._optim import _Bridge
    opt = getattr(optimizer, "optimizer", optimizer)
    return opt if isinstance(opt, _Bridge) else None


def _classes() -> dict:
    if _CLASSES:
        return _CLASSES
    torch = _torch()
    import transformers
    from transformers.trainer import SCHEDULER_NAME

    class Trainer(transformers.Trainer):
        """transformers' ``Trainer`` that trains offloaded experts too (Note [What Trainer cannot see]).

        ``Trainer(..., step_in_backward=False, state_dtype=None)``: the options of the ``strideweave.torch.AdamW``
        that ``create_optimizer`` builds (docs/guide.md, "Stepping in backward"). With ``step_in_backward`` the
        micro-batches before the last of each accumulation run under ``no_step()``, the logged ``grad_norm`` is
        the torch parameters' alone (the experts' gradients are consumed in backward), and ``max_grad_norm`` must
        be 0 (``ValueError`` otherwise: clipping by the total norm needs every gradient first)."""

        def __init__(self, *args: Any, step_in_backward: bool = False, state_dtype: Any = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._step_in_backward, self._state_dtype = bool(step_in_backward), state_dtype
            if self._step_in_backward and self.args.max_grad_norm and self.args.max_grad_norm > 0:
                raise ValueError(f"strideweave.torch.Trainer: step_in_backward=True steps each expert in backward, "
                                 f"before the other gradients exist, so it cannot clip by the total norm: set "
                                 f"max_grad_norm=0 in TrainingArguments (got {self.args.max_grad_norm})")

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            opt = _inner(self.optimizer)
            if opt is not None and opt.step_in_backward and not self.accelerator.sync_gradients:
                with opt.no_step():  # a micro-batch before the last: accumulate only
                    return super().training_step(model, inputs, num_items_in_batch)
            return super().training_step(model, inputs, num_items_in_batch)

        def create_optimizer(self, model: Any = None) -> Any:
            model = self.model if model is None else model
            if self.optimizer is not None or not _bound(model):
                return super().create_optimizer(model)
            from ._optim import _classes as optim_classes
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            experts = list(_bound(model).values())
            groups = [{"params": [p for n, p in named if n in decay] + experts,
                       "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            self.optimizer = optim_classes()["AdamW"](
                groups, lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon, state_folder=getattr(self, "_strideweave_scratch", None)
                or tempfile.mkdtemp(prefix=".strideweave-optimizer-"), state_dtype=self._state_dtype,
                step_in_backward=self._step_in_backward)
            return self.optimizer

        def train(self, *args: Any, **kwargs: Any) -> Any:
            # accelerate round-trips the optimizer's state dict when it wraps it (device placement); with tiled
            # parameters that dict streams their state to files, so it needs a folder: a scratch one, removed after.
            scratch = None
            opt = _inner(self.optimizer)
            if opt is not None and opt.state_folder is None:
                scratch = opt.state_folder = tempfile.mkdtemp(prefix=".strideweave-optimizer-",
                                                              dir=self.args.output_dir if os.path.isdir(
                                                                  self.args.output_dir) else None)
            self._strideweave_scratch = scratch
            try:
                return super().train(*args, **kwargs)
            finally:
                opt = _inner(self.optimizer)
                if scratch is not None:
                    if opt is not None and opt.state_folder == scratch:
                        opt.state_folder = None
                    shutil.rmtree(scratch, ignore_errors=True)

        def _clip_grad_norm(self, model: Any) -> Any:
            if not _bound(self.model):
                return super()._clip_grad_norm(model)
            from ._optim import clip_grad_norm_
            return clip_grad_norm_(self.model, self.args.max_grad_norm)

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            opt = _inner(self.optimizer)
            if grad_norm is None and _bound(self.model) and not (opt is not None and opt.step_in_backward):
                from ._optim import clip_grad_norm_
                grad_norm = clip_grad_norm_(self.model, float("inf"))
            return super()._get_grad_norm(model, grad_norm=grad_norm)

        def _save(self, output_dir: Any = None, state_dict: Any = None) -> None:
            if not _bound(self.model):
                return super()._save(output_dir, state_dict)
            from ._saving import save_pretrained
            output_dir = os.fspath(output_dir if output_dir is not None else self.args.output_dir)
            if not self.args.should_save:
                return
            os.makedirs(output_dir, exist_ok=True)
            # The whole model into a fresh folder beside the files (atomic there), then each file moved in: the
            # output folder may hold other files (checkpoint-N folders, a tokenizer) that must stay.
            staging = os.path.join(output_dir, f".strideweave-model-{os.getpid()}")
            try:
                save_pretrained(self.model, staging)
                names = sorted(os.listdir(staging))
                index = "model.safetensors.index.json"
                for stale in os.listdir(output_dir):  # shards of an earlier save that the new index does not name
                    if stale.startswith("model") and stale.endswith(".safetensors") and stale not in names:
                        os.remove(os.path.join(output_dir, stale))
                for name in [n for n in names if n != index] + [index]:  # the index last
                    os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            opt = _inner(self.optimizer)
            if opt is None:
                return super()._save_optimizer_and_scheduler(output_dir)
            if self.args.should_save:
                opt.save_state(output_dir)  # optimizer.pt + the tiled state streamed beside it
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

        def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
            opt = _inner(self.optimizer)
            if checkpoint is None or opt is None:
                return super()._load_optimizer_and_scheduler(checkpoint)
            opt.load_state(checkpoint)
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                         weights_only=True))

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            model = self.model if model is None else model
            bound = _bound(model)
            if not bound:
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
            folder = os.path.realpath(resume_from_checkpoint)
            for b in bound.values():
                for names in b.checkpoint_names.values():
                    where = os.path.realpath(b.checkpoint.file_of(names[0]))
                    if os.path.dirname(where) != folder:
                        raise ValueError(
                            f"Trainer: resuming from {resume_from_checkpoint}, but the experts of {b.name} are "
                            f"tiles of {where}; a model with offloaded experts resumes by being opened from the "
                            "checkpoint folder itself: strideweave.torch.from_pretrained(checkpoint, budget), then "
                            "a new optimizer, Trainer and train(resume_from_checkpoint=checkpoint)")
            # Opened from that folder: its weights are the checkpoint's; nothing to load.

    Trainer.__module__ = "strideweave.torch"
    _CLASSES["Trainer"] = Trainer
    return _CLASSES
