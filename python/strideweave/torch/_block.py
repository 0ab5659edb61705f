"""``MoEBlock``: a transformers sparse-MoE block over ``strideweave.moe.SparseMoE``, for blocks built by hand
(docs/guide.md, "SparseMoE"). ``MoEBlock`` derives from ``torch.nn.Module``, so it is defined on first access.
"""

from __future__ import annotations

from typing import Any

from ._bridge import _leaf_grads, _sw, _torch, _torch_dtype, from_torch, to_torch

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
            grads = _leaf_grads((xs, rs), ctx.inputs, ctx.needs_input_grad[:2])
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

    MoEBlock.__module__ = "strideweave.torch"
    _CLASSES.update(MoEBlock=MoEBlock, Function=_SparseMoEFunction)
    return _CLASSES
