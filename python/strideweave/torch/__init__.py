"""The bridge to PyTorch and transformers (docs/guide.md, "PyTorch" and "Opening a Hugging Face MoE bigger than
RAM").

* ``to_torch(t)``, ``from_torch(x)``: memory shared both ways through DLPack, never copied (``_bridge``).
* ``from_pretrained(path, budget, ...)``: a transformers MoE model whose experts are tiles of its checkpoint,
  never allocated (``_loading``); ``offload_experts(model, checkpoint, budget, ...)`` binds the experts of a model
  transformers already loaded (``_offload``); ``offloaded_experts(model)`` lists the bindings.
* ``save_pretrained(model, folder, max_shard_size=...)``: the whole model written back, experts streamed from their
  tiles (``_saving``).
* The experts implementation registered in transformers' experts interface (``_experts``), the families as
  declarations (``families``), the refusals of dtype changes and of a state dict without experts (``_guards``).
* ``MoEBlock``: a sparse-MoE block over ``strideweave.moe.SparseMoE`` for blocks built by hand (``_block``).
* ``SGD``, ``Adam``, ``AdamW``: torch optimizers over a whole model, its offloaded experts stepped by
  ``strideweave.optim``; ``clip_grad_norm_`` over torch's and the tiled expert gradients (``_optim``).
* ``process_group=`` of ``from_pretrained``/``offload_experts``: experts sharded across the ranks of a
  ``torch.distributed`` group, tokens exchanged by ``all_to_all``; ``all_reduce_gradients(model)`` averages the
  gradients; ``expert_share(E, rank, N)`` is a rank's share (``_distributed``).

PyTorch is optional: ``import strideweave`` never imports this package, and this package imports torch (and
transformers) only when one of its functions runs (``MoEBlock`` derives from ``torch.nn.Module``, and the
optimizers from ``torch.optim``'s classes, so they are defined on first access).
"""

from __future__ import annotations

from typing import Any

from ._bridge import from_torch, to_torch
from ._distributed import all_reduce_gradients, expert_share
from ._loading import from_pretrained
from ._offload import offload_experts, offloaded_experts
from ._optim import clip_grad_norm_
from ._saving import save_pretrained

__all__ = ["Adam", "AdamW", "MoEBlock", "SGD", "all_reduce_gradients", "clip_grad_norm_", "expert_share",
           "from_pretrained", "from_torch", "offload_experts", "offloaded_experts", "save_pretrained",
           "to_torch", "Trainer"]


def __getattr__(name: str) -> Any:
    """``MoEBlock`` derives from ``torch.nn.Module``, ``SGD``/``Adam``/``AdamW`` from torch's optimizers: each is
    defined (torch imported) on first access."""
    if name == "MoEBlock":
        from ._block import _classes
        return _classes()["MoEBlock"]
    if name in ("SGD", "Adam", "AdamW"):
        from ._optim import _classes as _optimizers
        return _optimizers()[name]
    if name == "Trainer":  # derives from transformers.Trainer
        from ._trainer import _classes as _trainer
        return _trainer()["Trainer"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
