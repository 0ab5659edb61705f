"""``from_pretrained``: a transformers MoE model opened without ever allocating its experts (docs/guide.md,
"Opening a Hugging Face MoE bigger than RAM").

Note [Opening without the experts]
transformers builds a model on the meta device and then loads the checkpoint's tensors into its parameters. While
it builds the model, the experts classes' ``__init__`` is wrapped: after the class's own initialisation, the
selected modules' weight parameters become plain meta tensors (not parameters), so transformers' loader has
nothing to load them into: the checkpoint's expert tensors are left where they lie (transformers reports them as
unexpected keys; we check that each one is a tensor a binding uses) and no expert weight is ever allocated or
initialised. Everything else loads as transformers loads it (names converted, weights tied, buffers made). The
modules are then bound to the checkpoint's tiles (``bind_all``). Which module is which is known from a first build
of the same config on the meta device (it costs no memory): the experts modules are constructed in module order
(checked after loading). The wrap is on the classes for the duration of the call; it acts only in the calling
thread (a model of the same classes built by another thread meanwhile is built as usual), and calls of
``from_pretrained`` take turns (one lock).

Quantized checkpoints (a ``quantization_config`` with ``quant_method`` "fp8" or "mxfp4"): transformers is asked to
dequantize what it loads (``dequantize=True``, what it does on a CPU anyway; on an accelerator it would otherwise
replace the experts modules by its own quantized ones, which hold the experts' weights). Its weight conversions
(``Fp8Dequantize``, ``Mxfp4Dequantize``) only run for tensors whose target is a parameter of the model, so the
experts' quantized tensors and scales are never read by transformers either (its non-expert FP8 linears are, and
are dequantized into the model's dtype). The experts are bound to the quantized tensors and dequantized on promotion
(Note [Quantized experts] in ``_experts.py``). transformers removes ``quantization_config`` from the dequantized
model's config; the checkpoint's is kept as ``model._strideweave_quantization`` (``save_pretrained(quantize=True)``
writes it back).
"""

from __future__ import annotations

import contextlib
import logging as _logging
import os
import threading
import warnings
from typing import Any

from ._bridge import _sw, _torch
from ._offload import _budget_of, bind_all, experts_modules, select

_LOCK = threading.Lock()  # one from_pretrained at a time wraps the experts classes


@contextlib.contextmanager
def _without_weights(classes: dict, selected: set, order: list) -> Any:
    """While active, the `order`-th constructed experts module whose path is in `selected` gets its weights as
    plain meta tensors (Note [Opening without the experts])."""
    counter = [0]
    originals = {}
    loader = threading.get_ident()

    def wrap(cls: type, names: tuple, dbrx: bool) -> Any:
        original = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if threading.get_ident() != loader:
                return
            i = counter[0]
            counter[0] += 1
            if i >= len(order) or order[i] not in selected:
                return
            holder = self.mlp if dbrx else self
            meta = {}
            for n in names:
                t = getattr(holder, n)
                delattr(holder, n)
                placeholder = _torch().empty(tuple(t.shape), dtype=t.dtype, device="meta")
                object.__setattr__(holder, n, placeholder)
                meta[("mlp." + n) if dbrx else n] = placeholder
            self.__dict__["_strideweave_meta"] = meta

        return original, __init__

    own = {cls: "__init__" in cls.__dict__ for cls in classes}
    for cls in classes:
        dbrx = cls.__name__ == "DbrxExperts"
        names = ("w1", "v1", "w2") if dbrx else ("gate_up_proj", "down_proj")
        originals[cls], cls.__init__ = wrap(cls, names, dbrx)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if own[cls]:
                cls.__init__ = original
            else:
                del cls.__init__  # it was inherited: the class is left as it was


def from_pretrained(path: Any, budget: Any, *, torch_dtype: Any = None, layers: Any = None, prefetch: bool = False,
                    mutable: bool = False, process_group: Any = None, **kwargs: Any) -> Any:
    """The transformers ``*ForCausalLM`` of the checkpoint folder `path` (``AutoModelForCausalLM`` semantics,
    `kwargs` passed on), with every MoE layer's experts bound to the checkpoint's tensors where they lie and never
    allocated: opening costs the non-expert weights, plus what the budget lets the experts hold, plus a fixed
    overhead (docs/guide.md).

    ``budget``: a ``strideweave.ResidencyBudget`` or a byte count (every bound module's expert weights and their
    gradients draw from it). ``torch_dtype``: the non-expert weights' dtype (default: the checkpoint's); the
    experts are the checkpoint's and must be of it, except quantized ones (FP8, MXFP4), dequantized on promotion
    into the model's BFloat16 or Float32. ``layers``: the layers whose experts are bound (the others are
    loaded by transformers, in RAM). ``prefetch`` and ``mutable``: as in ``offload_experts``. ``process_group``: a
    ``torch.distributed`` process group of which every rank opens the same checkpoint: each rank then owns and
    computes a contiguous share of every MoE layer's experts (``binding.experts_range``) and never reads the others'
    (docs/guide.md, "Fine-tuning on several processes or hosts"; Note [Experts across ranks] in ``_distributed``).

    Errors: TypeError for a model without an experts module StrideWeave knows (naming its class), arguments of the
    wrong kind and dtype mismatches; ValueError for missing tensors and shape mismatches; IndexError for a layer
    out of range.
    """
    torch = _torch()
    import transformers
    what = "from_pretrained"
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a checkpoint folder, got {type(path).__name__}")
    _budget_of(budget, what)
    if not isinstance(prefetch, bool):
        raise TypeError(f"{what}: prefetch must be a bool, got {type(prefetch).__name__}")
    if not isinstance(mutable, bool):
        raise TypeError(f"{what}: mutable must be a bool, got {type(mutable).__name__}")
    from ._distributed import check_group, refuse_unsupported, shard
    check_group(process_group, what)
    if "dtype" in kwargs:  # transformers' own name for it
        if torch_dtype is not None:
            raise TypeError(f"{what}: give torch_dtype or dtype, not both")
        torch_dtype = kwargs.pop("dtype")
        torch_dtype = None if torch_dtype == "auto" else torch_dtype
    if torch_dtype is not None and not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"{what}: torch_dtype must be a torch.dtype or None, got {torch_dtype!r}")
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{what}: {folder!r} is not a folder (a checkpoint as save_pretrained writes it)")
    config_kwargs = {k: kwargs[k] for k in ("trust_remote_code", "revision") if k in kwargs}
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(folder, **config_kwargs)
    quantization = _quantization_of(config)
    if quantization is not None and "quantization_config" not in kwargs:
        kwargs["quantization_config"] = _dequantizing(quantization)
    with torch.device("meta"):
        probe = transformers.AutoModelForCausalLM.from_config(config)
    selected = select(probe, layers, what)
    if process_group is not None:
        refuse_unsupported(selected, what)
    order = [p for p, _, _, _ in experts_modules(probe)]
    classes = {type(m): None for _, m, _, _ in experts_modules(probe)}
    del probe
    sw = _sw()
    block = (quantization or {}).get("weight_block_size") if (quantization or {}).get("quant_method") == "fp8" else None
    ckpt = sw.safetensors.open(folder, fp8_block=tuple(int(b) for b in block) if block else None)
    hf_logger = _logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(_logging.ERROR)  # the experts' tensors are unexpected keys by design; checked below
    try:
        with _LOCK, _without_weights(classes, {p for p, _, _, _ in selected}, order), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=torch_dtype if torch_dtype is not None else "auto",
                output_loading_info=True, **kwargs)
    finally:
        hf_logger.setLevel(level)
    selected = select(model, layers, what)
    # The modules left without weights are exactly the selected ones (the probe built them in the same order).
    chosen = {p for p, _, _, _ in selected}
    for p, m, _, _ in experts_modules(model):
        if ("_strideweave_meta" in m.__dict__) != (p in chosen):
            raise RuntimeError(f"{what}: {type(model).__name__} built its experts modules in another order than "
                               f"the same config on the meta device ({p}); nothing was bound")
    bindings = bind_all(model, selected, ckpt, budget, prefetch=prefetch, mutable=mutable, what=what)
    if process_group is not None:
        shard(model, bindings, process_group)
    used = {n for b in bindings for names in b.checkpoint_names.values() for n in names}
    used |= {f"{b.name}.{p}" for b in bindings for p in b.parameter_names}  # as transformers names them
    for b in bindings:  # the quantized tensors' scales, MXFP4's blocks
        for n, q in b.quantized.items():
            used |= {q.scale, n + "_blocks", n + "_scales"}
    unexpected = [k for k in info.get("unexpected_keys", ()) if k not in used]
    missing = [k for k in info.get("missing_keys", ())]
    if unexpected or missing:
        warnings.warn(f"{what}: {len(missing)} weights of {type(model).__name__} were not in the checkpoint "
                      f"(initialised: {missing[:5]}) and {len(unexpected)} checkpoint tensors were not used "
                      f"({unexpected[:5]})", stacklevel=2)
    if quantization is not None:
        model.__dict__["_strideweave_quantization"] = quantization
    return model.eval()


def _quantization_of(config: Any) -> Any:
    """The checkpoint's ``quantization_config`` as a dict when it is FP8 or MXFP4 (the formats StrideWeave reads),
    else None (any other method is transformers' business)."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    d = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    return d if d.get("quant_method") in ("fp8", "mxfp4") else None


def _dequantizing(quantization: dict) -> Any:
    """The transformers quantization config asking to dequantize the checkpoint's `quantization` at load."""
    import transformers
    if quantization["quant_method"] == "fp8":
        return transformers.FineGrainedFP8Config(
            activation_scheme=quantization.get("activation_scheme", "dynamic"),
            weight_block_size=tuple(quantization.get("weight_block_size") or (128, 128)),
            modules_to_not_convert=quantization.get("modules_to_not_convert"), dequantize=True)
    return transformers.Mxfp4Config(modules_to_not_convert=quantization.get("modules_to_not_convert"),
                                    dequantize=True)
