"""``strideweave.torch.Trainer`` (docs/guide.md, "Fine-tuning with Trainer"): transformers' ``Trainer`` training a
model whose experts are offloaded, with ``max_grad_norm``, ``gradient_accumulation_steps``, a warm-up schedule,
``save_steps`` and ``resume_from_checkpoint``.

* ``test_trainer_parity``: three steps of ``strideweave.torch.Trainer`` on a tiny Mixtral and DeepSeek-V3 opened
  by ``from_pretrained`` under a budget below experts + gradients + moments, against ``transformers.Trainer`` on
  the untouched in-RAM model with torch's AdamW (``optim="adamw_torch"``), same arguments and data. A callback
  records each step's clipped gradients on both sides and the reference's optimizer state; every weight must lie
  within the bound propagated step by step from the gradients' measured differences (the derivation:
  tests/test_torch_optim.py, ``propagate_adamw``).
* ``test_resume_is_bit_identical``: 4 steps uninterrupted against 2 steps, stopped, then the model opened from
  ``checkpoint-2`` and ``train(resume_from_checkpoint=...)``: the saved model, the weights and the experts bit
  for bit.
* What is required of the user (Note [What Trainer cannot see] in python/strideweave/torch/_trainer.py): resuming
  a model that was not opened from the checkpoint is refused, naming the way to do it.

Seeds: models as in tests/test_torch_optim.py (``BASE_SEED + crc32(family)``); the data from that seed + 500;
Trainer's own seed 0. Each test prints them.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import hf_families as zoo
import strideweave.torch as swt
from test_torch_optim import U, expert_bytes, named_weights, propagate_adamw, seed_of

pytest.importorskip("accelerate")

STEPS = 3
BATCH, SEQ, ACCUM = 4, 16, 2  # 64 tokens a micro-batch, 128 (token, expert) pairs over 8 experts


def dataset(seed: int, rows: int) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, zoo.VOCAB, (rows, SEQ), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def arguments(out: str, steps: int, **kw) -> transformers.TrainingArguments:
    options = dict(per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, max_steps=steps,
                   learning_rate=1e-2, warmup_steps=1, lr_scheduler_type="linear", weight_decay=0.01,
                   max_grad_norm=0.5, optim="adamw_torch", seed=0, data_seed=0, logging_steps=1, report_to=[],
                   use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, save_strategy="no")
    return transformers.TrainingArguments(out, **dict(options, **kw))


class Recorder(transformers.TrainerCallback):
    """Each step's clipped gradients (after Trainer's clipping, before the step) and, for the reference, the
    weights before and after and the optimizer's state after the step."""

    def __init__(self, bindings: dict, reference: bool):
        self.bindings, self.reference = bindings, reference
        self.steps: list = []

    def grads(self, model) -> dict:
        out = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
        for path, b in self.bindings.items():
            for pn in b.parameter_names:
                out[f"{path}.{pn}"] = b.gather(pn, grad=True).double()
        return out

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.steps.append({"grads": self.grads(model), "before": named_weights(model, self.bindings)})

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        step = self.steps[-1]
        step["after"] = named_weights(model, self.bindings)
        step["lr"] = optimizer.param_groups[0]["lr"]
        if self.reference:
            params = dict(model.named_parameters())
            step["state"] = {n: {k: (v.detach().clone() if torch.is_tensor(v) else v)
                                 for k, v in optimizer.state[p].items()} for n, p in params.items()
                             if p in optimizer.state}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    return {f: zoo.saved(f, root, seed_of(f))["float32"] for f in ("mixtral", "deepseek_v3")}


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_trainer_parity(family, folders, tmp_path):
    seed = seed_of(family)
    print(f"family={family} model seed={seed} data seed={seed + 500} trainer seed=0")
    folder = folders[family]
    data = dataset(seed + 500, BATCH * ACCUM * STEPS)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    budget = expert_bytes(reference, family) // 4  # weights + gradients + two moments: 16x the budget
    ref_rec = Recorder({}, reference=True)
    transformers.Trainer(reference, arguments(str(tmp_path / "ref"), STEPS), train_dataset=data,
                         callbacks=[ref_rec]).train()

    model = swt.from_pretrained(folder, budget)
    bindings = swt.offloaded_experts(model)
    rec = Recorder(bindings, reference=False)
    trainer = swt.Trainer(model, arguments(str(tmp_path / "ours"), STEPS), train_dataset=data, callbacks=[rec])
    assert isinstance(trainer, transformers.Trainer)
    trainer.train()
    opt = trainer.optimizer.optimizer  # accelerate's wrapper around it
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__module__.startswith("strideweave")
    assert len(ref_rec.steps) == len(rec.steps) == STEPS
    assert [s["lr"] for s in rec.steps] == [s["lr"] for s in ref_rec.steps]

    # Trainer's groups: weight decay for weights and experts, none for biases and norms (as the reference's).
    decay = set(trainer.get_decay_parameter_names(model))
    bound: dict = {}
    for s, (mine, ref) in enumerate(zip(rec.steps, ref_rec.steps)):
        assert set(mine["grads"]) == set(ref["grads"])
        for n, g in ref["grads"].items():
            delta = (mine["grads"][n] - g).abs()
            # The gradients agree within the Float32 parity bound (1e-5 of the largest magnitude, 2x once the
            # weights have moved; tests/test_hf_families.py), after each side's clipping.
            assert float(delta.max()) <= (1 if s == 0 else 2) * 1e-5 * float(g.abs().max()) + 4 * U * float(
                g.abs().max()), f"step {s} {n}"
            propagate_adamw(bound, n, delta, ref["state"][n], ref["lr"], (0.9, 0.999), 1e-8, ref["after"][n],
                            ref["before"][n])
        moved_experts = [n for n in ref["grads"] if ".experts." in n]
        assert moved_experts, "the experts had gradients"
    got, want = rec.steps[-1]["after"], ref_rec.steps[-1]["after"]
    assert set(got) == set(want)
    for n, w in want.items():
        excess = float(((got[n] - w).abs() - bound[n]["Dw"]).max())
        assert excess <= 0, f"{family} {n}: exceeds its bound by {excess:.3e}"
    # Trainer's grouping: the experts' tiled tensors in the group with weight decay, none in the other.
    tiled = opt.tiled_param_groups
    in_decay = [i for i, g in enumerate(opt.param_groups) if g["weight_decay"] == 0.01]
    assert len(in_decay) == 1
    for path, b in bindings.items():
        for r, t in b.tiled.items():
            where = [i for i, group in enumerate(tiled) if any(x is t for x in group)]
            assert where == in_decay, (path, r, where)
    # and the torch parameters as the reference's Trainer groups them
    for i, g in enumerate(opt.param_groups):
        names = {n for n, p in model.named_parameters() if any(p is q for q in g["params"])}
        assert all((n in decay) == (i in in_decay) for n in names), i


def test_resume_is_bit_identical(folders, tmp_path):
    family = "mixtral"
    seed = seed_of(family)
    print(f"family={family} model seed={seed} data seed={seed + 500} trainer seed=0")
    folder = folders[family]
    data = dataset(seed + 500, BATCH * ACCUM * 4)
    budget = 1 << 16

    def run(out, stop_at=None, resume=None, source=folder):
        model = swt.from_pretrained(source, budget)
        callbacks = []
        if stop_at is not None:
            class Stop(transformers.TrainerCallback):
                def on_step_end(self, args, state, control, **kw):
                    if state.global_step == stop_at:
                        control.should_training_stop = True

            callbacks.append(Stop())
        args = arguments(out, 4, save_strategy="steps", save_steps=2)
        trainer = swt.Trainer(model, args, train_dataset=data, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        return model, swt.offloaded_experts(model)

    whole, whole_b = run(str(tmp_path / "whole"))
    run(str(tmp_path / "cut"), stop_at=2)
    ckpt = str(tmp_path / "cut" / "checkpoint-2")
    assert sorted(f for f in os.listdir(ckpt) if f.startswith(("optimizer", "tiled_state", "scheduler", "model"))) \
        == ["model-00001-of-00001.safetensors", "model.safetensors.index.json", "optimizer.pt", "scheduler.pt",
            "tiled_state.0.safetensors"]
    resumed, resumed_b = run(str(tmp_path / "cut"), resume=ckpt, source=ckpt)
    a, b = named_weights(whole, whole_b), named_weights(resumed, resumed_b)
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    # The checkpoint written at step 4 reloads in transformers as those weights.
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "cut" / "checkpoint-4"))
    for n, p in again.named_parameters():
        assert torch.equal(p.detach().double(), b[n]), n


def test_resuming_a_model_not_opened_from_the_checkpoint_is_refused(folders, tmp_path):
    folder = folders["mixtral"]
    data = dataset(seed_of("mixtral") + 500, BATCH * ACCUM * 2)
    model = swt.from_pretrained(folder, 1 << 16)
    args = arguments(str(tmp_path / "a"), 2, save_strategy="steps", save_steps=2)
    swt.Trainer(model, args, train_dataset=data).train()
    ckpt = str(tmp_path / "a" / "checkpoint-2")
    other = swt.from_pretrained(folder, 1 << 16)  # opened from the original folder, not the checkpoint
    before = named_weights(other, swt.offloaded_experts(other))
    trainer = swt.Trainer(other, arguments(str(tmp_path / "a"), 4, save_strategy="no"), train_dataset=data)
    with pytest.raises(ValueError, match="resumes by being opened from the checkpoint folder itself"):
        trainer.train(resume_from_checkpoint=ckpt)
    after = named_weights(other, swt.offloaded_experts(other))
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_step_in_backward_gives_the_same_model(folders, tmp_path):
    """Trainer(step_in_backward=True) with 2 micro-batches a step (the first under no_step()) and max_grad_norm=0
    ends with the weights of the same Trainer stepping after backward, bit for bit (docs/guide.md, "Stepping in
    backward"); with clipping on, it is refused at construction."""
    family = "mixtral"
    seed = seed_of(family)
    print(f"family={family} model seed={seed} data seed={seed + 700} trainer seed=0")
    folder = folders[family]
    data = dataset(seed + 700, BATCH * ACCUM * STEPS)
    budget = expert_bytes(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), family) // 4
    weights = {}
    for sib in (False, True):
        model = swt.from_pretrained(folder, budget)
        trainer = swt.Trainer(model, arguments(str(tmp_path / str(sib)), STEPS, max_grad_norm=0.0),
                              train_dataset=data, step_in_backward=sib)
        trainer.train()
        opt = trainer.optimizer.optimizer
        assert opt.step_in_backward is sib
        stepped = sum(tg.engine.stats()["tiles_stepped_in_backward"] for tg in opt._tiled_groups if tg.engine)
        assert (stepped > 0) is sib
        weights[sib] = named_weights(model, swt.offloaded_experts(model))
    assert weights[False].keys() == weights[True].keys()
    for name, w in weights[False].items():
        assert torch.equal(w, weights[True][name]), name  # bound 0: the same updates
    model = swt.from_pretrained(folder, budget)
    with pytest.raises(ValueError, match="cannot clip by the total norm: set max_grad_norm=0"):
        swt.Trainer(model, arguments(str(tmp_path / "clip"), STEPS), train_dataset=data, step_in_backward=True)
