"""The bridge to PyTorch (docs/guide.md, "PyTorch").

``to_torch(t)`` and ``from_torch(x)`` share memory through DLPack both ways, never copying: the result's data
pointer is the argument's, and a write on either side is seen on the other. Float32, BFloat16, Float16, Int32 and
Bool travel (``torch.float32``, ``torch.bfloat16``, ``torch.float16``, ``torch.int32``, ``torch.bool``); shapes,
strides and offsets are kept (a transposed tensor stays transposed). What cannot be shared without a copy is
refused with the reason and changes nothing.

Only data crosses: ``from_torch`` refuses a tensor that requires grad (``x.detach()`` is the same memory without
its history), and ``to_torch`` gives a tensor that takes no part in StrideWeave's autograd.

``MoEBlock`` (a ``torch.nn.Module`` over ``strideweave.moe.SparseMoE``) and ``offload_experts(model, checkpoint,
budget)`` put a transformers Mixtral / Qwen2-MoE / Qwen3-MoE model's experts in StrideWeave, under one residency
budget, and leave the rest of the model in PyTorch (docs/guide.md, "Offloading the experts of a transformers
model").

PyTorch is optional: ``import strideweave`` never imports this module, and this module imports torch only when one
of its functions runs (``MoEBlock`` derives from ``torch.nn.Module``, so it is defined on first access).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from ._core import Tensor, from_dlpack

if TYPE_CHECKING:  # the annotations only; nothing imports torch before a function runs
    import torch as _torch_module

__all__ = ["MoEBlock", "from_torch", "offload_experts", "to_torch"]

# The dtypes that travel, by the names of both sides (torch's attribute name, StrideWeave's DType name).
_DTYPES = (("float32", "Float32"), ("bfloat16", "BFloat16"), ("float16", "Float16"), ("int32", "Int32"),
           ("bool", "Bool"))


def _torch() -> Any:
    """The torch module, imported on first use; without PyTorch, an ImportError that says what to install."""
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise ImportError("strideweave.torch needs PyTorch (pip install torch); the rest of strideweave does "
                          "not") from e


def to_torch(t: Tensor) -> "_torch_module.Tensor":
    """A ``torch.Tensor`` over ``t``'s memory, no copy: same data pointer, shape and strides.

    ``t`` must be a tensor over a ``CPU`` carrier whose layout a stride list describes (one leaf per mode, or
    modes whose leaves coalesce). The export holds the memory: the torch tensor stays valid after the carrier is
    released. Memory shared copy-on-write (a projection of a resident tile) is made private to the carrier first,
    so torch's writes reach that tensor alone.

    TypeError when ``t`` is not a strideweave Tensor; BufferError when its memory cannot be shared without a copy
    (another carrier kind, a layout without strides, an immutable tensor, which torch would be free to write).
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"to_torch: expected a strideweave Tensor, got {type(t).__name__}")
    torch = _torch()
    if not t.is_mutable():
        raise BufferError(f"to_torch: the {t.dtype().name} tensor of layout {t.layout} is immutable and PyTorch has no "
                          "read-only tensors, so its writes would change memory that must not change; "
                          "torch.from_dlpack(t.__dlpack__(max_version=(1, 0), copy=True)) gives torch a copy")
    try:
        return torch.from_dlpack(t)
    except BufferError as e:
        raise BufferError(f"to_torch: {e}") from e


def from_torch(x: "_torch_module.Tensor") -> Tensor:
    """A StrideWeave ``Tensor`` over ``x``'s memory, no copy: same data pointer, shape and strides.

    The tensor lives on a ``CPU`` carrier that borrows the memory and keeps ``x``'s storage alive. ``x`` must be
    a dense (strided) CPU tensor of a dtype that travels, with no zero extent, and must not require grad. Once
    PyTorch moves or frees the storage's memory (a ``resize_`` past its size), every use of the tensor raises
    RuntimeError; ``x.set_`` leaves it over the imported bytes (docs/guide.md, "PyTorch").

    TypeError when ``x`` is not a ``torch.Tensor`` or its dtype has no StrideWeave counterpart; ValueError when it
    requires grad; BufferError when its memory cannot be shared (another device, a sparse layout, an empty shape).
    """
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"from_torch: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in {getattr(torch, name) for name, _ in _DTYPES}:
        raise TypeError(f"from_torch: {x.dtype} has no StrideWeave dtype (shared: "
                        f"{', '.join('torch.' + name for name, _ in _DTYPES)}; "
                        "x.to(torch.float32) converts into a new tensor)")
    if x.device.type != "cpu":
        raise BufferError(f"from_torch: the tensor is on device {x.device}; StrideWeave shares CPU memory only "
                          "(x.cpu() copies it)")
    if x.layout != torch.strided:
        raise BufferError(f"from_torch: a {x.layout} tensor has no strides to share (x.to_dense() copies it)")
    if x.requires_grad:
        raise ValueError(f"from_torch: the tensor of shape {tuple(x.shape)} requires grad, and its autograd history "
                         "would not cross; x.detach() is the same memory without it")
    return from_dlpack(x)


# ---------------------------------------------------------------------------------------------------------------
# A transformers sparse-MoE block over strideweave.moe.SparseMoE (docs/guide.md, "Offloading the experts of a
# transformers model").
#
# Note [The MoE block in torch.autograd]
# MoEBlock.forward hands the block's tokens x (T, H) and the router weight (E, H) to SparseMoE through from_torch
# (detached, no copy), runs the routing and the experts in StrideWeave with StrideWeave's autograd recording, and
# returns the output through to_torch (no copy). One torch.autograd.Function node stands between the two graphs:
# its backward brings torch's cotangent across (from_torch), runs StrideWeave's backward over the recorded graph
# and gives torch the gradients StrideWeave left on its two leaves (x.grad, router_weight.grad), converted
# explicitly when their dtype is not the one torch requires. The experts' gradients never cross: StrideWeave's
# backward accumulates them into the tiled gradients of SparseMoE's w1, w2, w3, under the block's residency
# budget. That backward frees the StrideWeave graph (a second backward through the same forward raises). With
# torch's grad mode off, or when neither x nor the router weight requires grad, StrideWeave records nothing.
# ---------------------------------------------------------------------------------------------------------------


def _sw() -> Any:
    """The strideweave package."""
    return importlib.import_module("strideweave")


def _torch_dtype(dtype: Any) -> Any:
    """torch's dtype for a StrideWeave DType that travels."""
    torch = _torch()
    for torch_name, sw_name in _DTYPES:
        if dtype.name == sw_name:
            return getattr(torch, torch_name)
    raise TypeError(f"{dtype.name} has no torch dtype")


_CLASSES: dict = {}  # "MoEBlock", "Function": the classes deriving from torch's, defined on first use


def _classes() -> dict:
    """MoEBlock and its autograd Function, defined the first time they are needed (torch is imported lazily)."""
    if _CLASSES:
        return _CLASSES
    torch = _torch()

    class _SparseMoEFunction(torch.autograd.Function):
        """out = block's SparseMoE(x, router_weight), recorded by StrideWeave (Note [The MoE block in
        torch.autograd])."""

        @staticmethod
        def forward(ctx: Any, x: Any, router_weight: Any, block: Any) -> Any:  # type: ignore[override]
            sw = _sw()
            xs, rs = from_torch(x.detach()), from_torch(router_weight.detach())
            previous = sw.is_grad_enabled()
            sw.set_grad_enabled(True)
            try:
                out = block._run(xs, rs)
            finally:
                sw.set_grad_enabled(previous)
            ctx.graph = (xs, rs, out)
            ctx.inputs = ((tuple(x.shape), x.dtype), (tuple(router_weight.shape), router_weight.dtype))
            ctx.block = block
            return to_torch(out)

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:  # type: ignore[override]
            if ctx.graph is None:
                raise RuntimeError("MoEBlock: a second backward through one forward of the block; the first one "
                                   "freed its StrideWeave graph (retain_graph is not supported by MoEBlock)")
            xs, rs, out = ctx.graph
            ctx.graph = None
            out.backward(from_torch(grad_out.detach().contiguous()))
            ctx.block._after_backward()
            grads = []
            for leaf, (shape, dtype), needed in zip((xs, rs), ctx.inputs, ctx.needs_input_grad[:2]):
                grad = leaf.grad if needed else None
                if grad is None:
                    grads.append(torch.zeros(shape, dtype=dtype) if needed else None)
                    continue
                g = to_torch(grad)
                grads.append(g if g.dtype == dtype else g.to(dtype))  # explicit: torch requires the input's dtype
            return grads[0], grads[1], None

    class MoEBlock(torch.nn.Module):
        """A transformers sparse-MoE block whose routing and experts run in StrideWeave (a ``SparseMoE``).

        ``forward(hidden_states)`` takes (batch, seq, H) and returns (batch, seq, H) in the block's dtype, as
        transformers' blocks do. The hidden states' and the router weight's gradients flow back to torch; the
        experts' gradients stay tiled in StrideWeave (``block.moe.w1.grad``, ``w2.grad``, ``w3.grad``).

        ``moe``: the ``strideweave.moe.SparseMoE``. ``gate``: the router, a module whose ``weight`` Parameter is
        the (E, H) router weight (transformers' router module is kept as it is, so its forward hooks still see
        router outputs), or an (E, H) torch tensor, held as the Parameter ``gate.weight`` (same memory).
        ``shared_expert`` and ``shared_expert_gate`` (Qwen2-MoE): torch modules, ``out = experts(x) +
        sigmoid(shared_expert_gate(x)) * shared_expert(x)``. ``jitter_noise``: Mixtral's training-mode jitter,
        applied in torch as transformers applies it. ``prefetch_next``: set by ``offload_experts(prefetch=True)``.
        """

        def __init__(self, moe: Any, gate: Any, *, shared_expert: Any = None, shared_expert_gate: Any = None,
                     jitter_noise: float = 0.0) -> None:
            sw = _sw()
            if not isinstance(moe, sw.moe.SparseMoE):
                raise TypeError(f"MoEBlock: moe must be a strideweave.moe.SparseMoE, got {type(moe).__name__}")
            dtype = _torch_dtype(moe.dtype)
            if isinstance(gate, torch.Tensor):  # a Parameter is held as it is, a tensor as a Parameter over it
                router = torch.nn.Module()
                router.weight = gate if isinstance(gate, torch.nn.Parameter) else torch.nn.Parameter(gate.detach())
                gate = router
            if not isinstance(gate, torch.nn.Module) or not isinstance(getattr(gate, "weight", None),
                                                                       torch.nn.Parameter):
                raise TypeError("MoEBlock: gate must be a torch module with a Parameter `weight` or a torch tensor, "
                                f"got {type(gate).__name__}")
            expected = (moe.num_experts, moe.hidden_size)
            if tuple(gate.weight.shape) != expected:
                raise ValueError(f"MoEBlock: the router weight has shape {tuple(gate.weight.shape)}, the experts "
                                 f"need (num_experts, hidden) = {expected}")
            if gate.weight.dtype != dtype:
                raise TypeError(f"MoEBlock: the router weight is {gate.weight.dtype}, the experts {dtype} "
                                "(nothing converts implicitly)")
            if (shared_expert is None) != (shared_expert_gate is None):
                raise ValueError("MoEBlock: shared_expert and shared_expert_gate come together (Qwen2-MoE) or not "
                                 "at all")
            if not (isinstance(jitter_noise, (int, float)) and not isinstance(jitter_noise, bool)
                    and 0.0 <= jitter_noise < 1.0):
                raise ValueError(f"MoEBlock: jitter_noise must be a number in [0, 1), got {jitter_noise!r}")
            super().__init__()
            self.moe = moe
            self.gate = gate
            if shared_expert is not None:
                self.shared_expert = shared_expert
                self.shared_expert_gate = shared_expert_gate
            else:
                self.shared_expert = self.shared_expert_gate = None
            self.top_k = moe.top_k
            self.jitter_noise = float(jitter_noise)
            self.dtype = dtype
            self.prefetch_next: Any = None  # the block whose backward runs after this one's (offload_experts)
            self._record_routing = False  # keep each forward's routing: another block prefetches it
            self._last_indices: Any = None  # this block's routing of its latest forward (when recorded)

        def forward(self, hidden_states: Any) -> Any:
            sw = _sw()
            if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 \
                    or hidden_states.shape[-1] != self.moe.hidden_size:
                got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else \
                    type(hidden_states).__name__
                raise ValueError(f"MoEBlock: hidden_states must be (batch, seq, {self.moe.hidden_size}), got {got}")
            if hidden_states.dtype != self.dtype:
                raise TypeError(f"MoEBlock: hidden_states are {hidden_states.dtype}, the block {self.dtype} "
                                "(nothing converts implicitly)")
            batch, seq, hidden = hidden_states.shape
            if self.training and self.jitter_noise > 0:  # transformers' Mixtral: the same draw, out of place
                hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                    1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            x = hidden_states.reshape(-1, hidden).contiguous()
            if self.gate._forward_hooks or self.gate._forward_pre_hooks:
                # Someone records the router's outputs (transformers' output_router_logits): the router module
                # runs in torch too, so its hooks see what transformers' block would give them, with torch's
                # autograd for a loss built on them. The block's routing is StrideWeave's all the same.
                self.gate(x)
            weight = self.gate.weight
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                out = _SparseMoEFunction.apply(x, weight, self)
            else:
                with sw.no_grad():
                    out = to_torch(self._run(from_torch(x.detach()), from_torch(weight.detach())))
            if self.shared_expert is not None:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return out.reshape(batch, seq, hidden)

        def _run(self, xs: Any, rs: Any) -> Any:
            """The SparseMoE's forward on StrideWeave tensors (recording when StrideWeave's grad mode is on)."""
            if not self._record_routing:
                return self.moe(xs, rs)
            _, weights, indices = self.moe.route(xs, rs)
            self._last_indices = indices
            return self.moe.experts(xs, weights, indices)

        def _after_backward(self) -> None:
            """Starts promoting the experts the next block's backward will need (offload_experts(prefetch=True)):
            torch's backward of the layer between (attention, norms) runs while they arrive."""
            nxt = self.prefetch_next
            if nxt is not None and nxt._last_indices is not None:
                nxt.moe.prefetch(nxt._last_indices)

        def zero_expert_grads(self) -> None:
            """Drops the experts' tiled gradients (``moe.w1.grad`` etc. become None); torch's ``zero_grad`` does
            not reach them."""
            for w in (self.moe.w1, self.moe.w2, self.moe.w3):
                w.grad = None

        def extra_repr(self) -> str:
            m = self.moe
            return (f"experts={m.num_experts}, top_k={m.top_k}, hidden={m.hidden_size}, "
                    f"intermediate={m.intermediate_size}, dtype={m.dtype.name}, normalize={m.normalize}")

    MoEBlock.__module__ = __name__
    _CLASSES.update(MoEBlock=MoEBlock, Function=_SparseMoEFunction)
    return _CLASSES


def __getattr__(name: str) -> Any:
    """``MoEBlock`` derives from ``torch.nn.Module``: it is defined (torch imported) on first access."""
    if name == "MoEBlock":
        return _classes()["MoEBlock"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# transformers' sparse-MoE block classes (transformers 5.x) and what their checkpoints call the experts
# (docs/guide.md, "Offloading the experts of a transformers model"). Qwen2-MoE and Qwen3-MoE save the same names.
_QWEN_NAMES = ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
               "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
               "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight")
_MOE_BLOCKS = {
    # block class name: (family, (gate w1, up w3, down w2) names, shared expert)
    "MixtralSparseMoeBlock": ("Mixtral", ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
                                          "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
                                          "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight"), False),
    "Qwen2MoeSparseMoeBlock": ("Qwen2-MoE", _QWEN_NAMES, True),
    "Qwen3MoeSparseMoeBlock": ("Qwen3-MoE", _QWEN_NAMES, False),
}


def _check_expert_tensors(ckpt: Any, names: list, shape: tuple, dtype: Any, what: str) -> None:
    """ValueError/TypeError naming the first tensor of `names` missing from `ckpt` or of another shape/dtype."""
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise ValueError(f"offload_experts: the checkpoint has no tensor {missing[0]!r} ({what}; {len(missing)} of "
                         f"{len(names)} such names missing)")
    for n in names:
        if tuple(ckpt.shape(n)) != shape:
            raise ValueError(f"offload_experts: {n!r} has shape {tuple(ckpt.shape(n))}, the model's {what} "
                             f"{shape}")
        if ckpt.dtype(n).name != dtype.name:
            raise TypeError(f"offload_experts: {n!r} is {ckpt.dtype(n).name}, the model's {what} {dtype.name} "
                            "(nothing converts implicitly)")


def offload_experts(model: Any, checkpoint: Any, budget: Any, *, layers: Any = None,
                    prefetch: bool = False) -> list:
    """Replaces the sparse-MoE blocks of a transformers Mixtral, Qwen2-MoE or Qwen3-MoE ``*ForCausalLM`` with
    ``MoEBlock``s whose experts are the checkpoint's tensors, opened where they lie, under one residency budget.

    ``checkpoint``: the model's safetensors (a file, a folder as ``save_pretrained`` writes it, or an open
    ``strideweave.safetensors`` Checkpoint). ``budget``: a ``strideweave.ResidencyBudget`` or a byte count for a
    new one; every block's expert weights and their gradients draw from it. ``layers``: the layer indices to
    replace (default: every sparse-MoE layer). ``prefetch``: in backward, each block, once its own backward is
    done, starts promoting the experts that the next block's backward needs (the routing that block recorded in
    forward, ``SparseMoE.prefetch``), so they arrive while torch runs the layer in between.

    The router module (its weight Parameter, the same object) and Qwen2-MoE's shared expert move into the new
    block; the model's experts module is dropped with the old block (its memory freed when nothing else holds
    it); everything else stays as it is. Returns the new blocks in layer order. Errors change nothing: TypeError
    for a model of another kind or dtype mismatches, ValueError for a missing tensor, a shape mismatch or a
    layer that is not a sparse-MoE block, IndexError for a layer out of range.
    """
    torch = _torch()
    sw = _sw()
    MoEBlock = _classes()["MoEBlock"]
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(decoder, torch.nn.ModuleList):
        raise TypeError(f"offload_experts: {type(model).__name__} is not a transformers *ForCausalLM with "
                        "model.layers (Mixtral, Qwen2-MoE or Qwen3-MoE)")
    sparse = [i for i, layer in enumerate(decoder) if type(getattr(layer, "mlp", None)).__name__ in _MOE_BLOCKS]
    if layers is None:
        if not sparse:
            raise TypeError(f"offload_experts: {type(model).__name__} has no sparse-MoE block of a supported "
                            f"family ({', '.join(sorted(_MOE_BLOCKS))})")
        selected = sparse
    else:
        if isinstance(layers, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in layers):
            raise TypeError(f"offload_experts: layers must be a list of layer indices, got {layers!r}")
        selected = sorted(set(layers))
        for i in selected:
            if not 0 <= i < len(decoder):
                raise IndexError(f"offload_experts: layer {i} is out of range (the model has {len(decoder)} layers)")
            if i not in sparse:
                kind = type(getattr(decoder[i], "mlp", None)).__name__
                raise ValueError(f"offload_experts: layer {i}'s mlp is a {kind}, not a sparse-MoE block of a "
                                 "supported family")
    if not isinstance(prefetch, bool):
        raise TypeError(f"offload_experts: prefetch must be a bool, got {type(prefetch).__name__}")
    act = getattr(getattr(model, "config", None), "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"offload_experts: the experts' activation is {act!r}; SparseMoE computes SwiGLU (silu)")
    if isinstance(budget, bool) or not isinstance(budget, (int, sw.ResidencyBudget)):
        raise TypeError(f"offload_experts: budget must be a strideweave.ResidencyBudget or a byte count, got "
                        f"{type(budget).__name__}")
    if isinstance(checkpoint, sw.safetensors.Checkpoint):
        ckpt = checkpoint
    elif isinstance(checkpoint, (str, os.PathLike)):
        ckpt = sw.safetensors.open(checkpoint)
    else:
        raise TypeError(f"offload_experts: checkpoint must be a path or a strideweave.safetensors Checkpoint, got "
                        f"{type(checkpoint).__name__}")

    # Every check before anything changes; the blocks are built, then swapped in together.
    plans = []
    for i in selected:
        block = decoder[i].mlp
        family, (gate_name, up_name, down_name), shared = _MOE_BLOCKS[type(block).__name__]
        experts = block.experts
        params = dict(experts.named_parameters())
        if set(params) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"offload_experts: layer {i}'s experts hold {sorted(params)}; SparseMoE takes "
                             "gate_up_proj and down_proj only (no bias)")
        num_experts, two_i, hidden = params["gate_up_proj"].shape
        inter = two_i // 2
        dtype = params["gate_up_proj"].dtype
        sw_dtype = next((getattr(sw.DType, sw_name) for torch_name, sw_name in _DTYPES[:3]
                         if dtype == getattr(torch, torch_name)), None)  # the three float dtypes
        if sw_dtype is None:
            raise TypeError(f"offload_experts: layer {i}'s experts are {dtype}; SparseMoE takes Float32, BFloat16 "
                            "or Float16")
        if tuple(params["down_proj"].shape) != (num_experts, hidden, inter) or params["down_proj"].dtype != dtype:
            raise ValueError(f"offload_experts: layer {i}'s down_proj is {tuple(params['down_proj'].shape)} "
                             f"{params['down_proj'].dtype}, gate_up_proj {tuple(params['gate_up_proj'].shape)}")
        router = block.gate
        if tuple(router.weight.shape) != (num_experts, hidden) or router.weight.dtype != dtype:
            raise TypeError(f"offload_experts: layer {i}'s router weight is {tuple(router.weight.shape)} "
                            f"{router.weight.dtype}, its experts need ({num_experts}, {hidden}) {dtype}")
        names = [[n.format(layer=i, expert=e) for e in range(num_experts)] for n in (gate_name, up_name, down_name)]
        _check_expert_tensors(ckpt, names[0], (inter, hidden), sw_dtype, f"layer {i} gate projection (w1)")
        _check_expert_tensors(ckpt, names[1], (inter, hidden), sw_dtype, f"layer {i} up projection (w3)")
        _check_expert_tensors(ckpt, names[2], (hidden, inter), sw_dtype, f"layer {i} down projection (w2)")
        if family == "Mixtral":
            top_k, normalize, routing_dtype = block.top_k, True, None  # Float32 routing weights
            jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        else:
            top_k, normalize, routing_dtype = router.top_k, bool(router.norm_topk_prob), sw_dtype
            jitter = 0.0
        tile_bytes = inter * hidden * params["gate_up_proj"].element_size()
        plans.append((i, block, names, top_k, normalize, routing_dtype, jitter, shared, tile_bytes))

    # Each call holds one expert's three weight tiles resident at once: a smaller budget could never run.
    need = max(3 * plan[-1] for plan in plans)
    max_bytes = budget.max_bytes if isinstance(budget, sw.ResidencyBudget) else budget
    if max_bytes < need:
        raise ValueError(f"offload_experts: a budget of {max_bytes} bytes cannot hold one expert's three weight "
                         f"tiles ({need} bytes), which every call of a block needs resident at once")
    budget_obj = budget if isinstance(budget, sw.ResidencyBudget) else sw.ResidencyBudget(budget)
    new_blocks = []
    for i, block, names, top_k, normalize, routing_dtype, jitter, shared, _ in plans:
        w1, w3, w2 = (ckpt.tiled(n) for n in names)
        moe = sw.moe.SparseMoE(w1, w2, w3, top_k, normalize=normalize, routing_dtype=routing_dtype,
                               budget=budget_obj)
        new = MoEBlock(moe, block.gate, shared_expert=block.shared_expert if shared else None,
                       shared_expert_gate=block.shared_expert_gate if shared else None, jitter_noise=jitter)
        new.train(block.training)
        new_blocks.append(new)
    if prefetch:
        for later, earlier in zip(new_blocks[1:], new_blocks[:-1]):
            later.prefetch_next = earlier  # backward runs the layers in reverse order
            earlier._record_routing = True
    for (i, *_), new in zip(plans, new_blocks):
        decoder[i].mlp = new  # the old block (and its experts module) goes with its last reference
    return new_blocks
