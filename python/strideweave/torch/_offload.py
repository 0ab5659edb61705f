"""Finding a transformers model's experts modules and binding them to a checkpoint's tiles: ``offload_experts`` and
``offloaded_experts`` (docs/guide.md, "Opening a Hugging Face MoE bigger than RAM")."""

from __future__ import annotations

import gc
import os
import re
from typing import Any, Optional

from ._bridge import _sw, _torch
from ._experts import OffloadedExperts
from .families import family_of

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.")


def model_type_of(model: Any) -> str:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    return getattr(text, "model_type", None) or getattr(config, "model_type", "") or ""


def experts_modules(model: Any) -> list:
    """[(path, module, family, block)] of the model's experts modules, in module order: those declared with
    transformers' ``use_experts_implementation``, Llama4's and DBRX's. ``block``: the module whose forward is
    replaced (Llama4's MoE block), else None."""
    family = family_of(model_type_of(model))
    found = []
    for path, m in model.named_modules():
        cls = type(m)
        if cls.__name__ == "Llama4TextMoe":
            found.append((path + ".experts", m.experts, family_of("llama4"), m))
        elif cls.__name__ == "DbrxExperts":
            found.append((path, m, family_of("dbrx"), None))
        elif hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and \
                hasattr(getattr(cls, "forward", None), "__wrapped__"):
            found.append((path, m, family, None))
    return found


def layer_of(path: str) -> Optional[int]:
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def offloaded_experts(model: Any) -> dict:
    """{module path: OffloadedExperts} of the model's bound experts modules, in module order."""
    out = {}
    for path, m in model.named_modules():
        b = m.__dict__.get("_strideweave")
        if isinstance(b, OffloadedExperts):
            out[path] = b
    return out


def _budget_of(budget: Any, what: str) -> Any:
    sw = _sw()
    if isinstance(budget, bool) or not isinstance(budget, (int, sw.ResidencyBudget)):
        raise TypeError(f"{what}: budget must be a strideweave.ResidencyBudget or a byte count, got "
                        f"{type(budget).__name__}")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"{what}: budget must be a byte count >= 1, got {budget}")
    return budget


def _checkpoint_of(checkpoint: Any, what: str) -> Any:
    sw = _sw()
    if isinstance(checkpoint, sw.safetensors.Checkpoint):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        return sw.safetensors.open(checkpoint)
    raise TypeError(f"{what}: checkpoint must be a path or a strideweave.safetensors Checkpoint, got "
                    f"{type(checkpoint).__name__}")


def select(model: Any, layers: Any, what: str) -> list:
    """The experts modules of the selected layers (every one by default); errors name what is wrong."""
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: expected a transformers model (a torch.nn.Module), got {type(model).__name__}")
    found = experts_modules(model)
    if not found:
        raise TypeError(f"{what}: {type(model).__name__} has no experts module StrideWeave knows (transformers' "
                        "use_experts_implementation experts, Llama4, DBRX); for a block of your own, build "
                        "strideweave.torch.MoEBlock over strideweave.moe.SparseMoE")
    if layers is None:
        return found
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__") or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise TypeError(f"{what}: layers must be a list of layer indices, got {layers!r}")
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    count = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layers", None)
    by_layer = {layer_of(p): (p, m, f, b) for p, m, f, b in found}
    selected = []
    for i in sorted(set(layers)):
        if count is not None and not 0 <= i < count:
            raise IndexError(f"{what}: layer {i} is out of range (the model has {count} layers)")
        if i not in by_layer:
            raise ValueError(f"{what}: layer {i} has no experts module (MoE layers: "
                             f"{sorted(k for k in by_layer if k is not None)})")
        selected.append(by_layer[i])
    return selected


def offload_experts(model: Any, checkpoint: Any, budget: Any, *, layers: Any = None, prefetch: bool = False,
                    mutable: bool = False, process_group: Any = None) -> list:
    """Binds the experts modules of a transformers model (loaded by transformers) to the checkpoint's tensors,
    opened where they lie, under one residency budget; their weights are freed. Returns the bindings
    (``OffloadedExperts``) in module order.

    ``checkpoint``: the model's safetensors (a file, a folder as ``save_pretrained`` writes it, or an open
    ``strideweave.safetensors`` Checkpoint). ``budget``: a ``strideweave.ResidencyBudget`` or a byte count for a
    new one; every bound module's expert weights and their gradients draw from it. ``layers``: the layer indices
    to bind (default: every MoE layer). ``prefetch``: in backward, each layer, once its own backward is done,
    starts promoting the experts the previous layer's backward needs. ``mutable``: evicted dirty tiles are written
    into the checkpoint's files (default: a scratch overlay; the files are never written). ``process_group``: each
    rank of this ``torch.distributed`` group owns a contiguous share of every module's experts (as in
    ``from_pretrained``; the weights transformers loaded are dropped on every rank).

    Errors change nothing: TypeError for a model without an experts module StrideWeave knows, an argument of the
    wrong kind or a dtype mismatch; ValueError for a missing tensor, a shape mismatch, a budget below one expert
    or a layer without experts; IndexError for a layer out of range.
    """
    what = "offload_experts"
    selected = select(model, layers, what)
    if any("_strideweave" in m.__dict__ for _, m, _, _ in selected):
        raise ValueError(f"{what}: {type(model).__name__}'s experts are already offloaded")
    if not isinstance(prefetch, bool):
        raise TypeError(f"{what}: prefetch must be a bool, got {type(prefetch).__name__}")
    _budget_of(budget, what)
    from ._distributed import check_group, refuse_unsupported, shard
    if check_group(process_group, what) is not None:
        refuse_unsupported(selected, what)
    ckpt = _checkpoint_of(checkpoint, what)
    bindings = bind_all(model, selected, ckpt, budget, prefetch=prefetch, mutable=mutable, what=what)
    if process_group is not None:
        shard(model, bindings, process_group)
    gc.collect()  # the dropped expert weights go now, not at the next collection
    return bindings


def bind_all(model: Any, selected: list, ckpt: Any, budget: Any, *, prefetch: bool, mutable: bool,
             what: str) -> list:
    """Checks every module against the checkpoint first, then binds them all (nothing changes on error)."""
    from ._experts import ExpertsSpec, attach
    from ._guards import install_guards
    sw = _sw()
    plans = []
    for path, m, family, block in selected:
        try:
            spec = ExpertsSpec(m, family.outside if family else None)
        except TypeError as e:
            raise TypeError(f"{what}: {path}: {e}") from None
        plans.append((path, m, family, block, spec))
    # Every module's names, shapes and dtypes are checked by building its binding; a budget below one expert's
    # tiles could never run.
    max_bytes = budget.max_bytes if isinstance(budget, sw.ResidencyBudget) else budget
    budget_obj = budget if isinstance(budget, sw.ResidencyBudget) else sw.ResidencyBudget(budget)
    bindings = []
    try:
        for path, m, family, block, spec in plans:
            bindings.append(OffloadedExperts(m, path, layer_of(path), family, spec, ckpt, budget_obj, mutable))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None
    need = max(b.expert_bytes for b in bindings)
    if max_bytes < need:
        raise ValueError(f"{what}: a budget of {max_bytes} bytes cannot hold one expert's weight tiles ({need} "
                         "bytes), which every call needs resident at once")
    for (path, m, family, block, spec), b in zip(plans, bindings):
        attach(m, b)
        if block is not None:  # Llama4: the block's forward runs the experts sparsely
            block.forward = (lambda binding, blk: lambda hidden_states: binding.llama4_block(blk, hidden_states))(
                b, block)
    if prefetch:
        for later, earlier in zip(bindings[1:], bindings[:-1]):
            later.prefetch_next = earlier  # backward runs the layers in reverse order
            earlier.record_routing = True
    install_guards(model)
    return bindings
