"""Expert parallelism and data parallelism over ``torch.distributed`` (docs/guide.md, "Fine-tuning on several
processes or hosts").

Note [Experts across ranks]
A model opened with ``from_pretrained(..., process_group=group)`` (or bound by ``offload_experts(...,
process_group=group)``) on every rank of `group` (world size N) gives rank r the contiguous share of every bound
experts module's E experts ``[floor(E r / N), floor(E (r + 1) / N))`` (``expert_share``; E need not be a multiple of
N, and a share may be empty when E < N), recorded as ``binding.experts_range``. Each rank binds the whole tiled
tensors over the same checkpoint, read-only, with its own overlay and its own budget: binding reads headers only,
and a tile is read when it is promoted, which only the owner ever asks for (routing, computation, the optimizer's
step, the clipping norm and the 1/N scaling all visit owned tiles alone: only those ever get a gradient).

The experts' forward (``experts_forward``) runs after the family's own router, on the interface's
``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``:
  1. the T k (token, expert) pairs are ordered by owning rank (stable), their counts exchanged
     (``all_to_all_single`` of N counts), then the experts' indices and the pairs' hidden rows
     (``all_to_all_single`` with variable split sizes);
  2. each rank computes its experts on the rows it received, each row its own token with routing weight 1, through
     the binding's own computation (the C++ SparseMoE node, or the per-expert math): tiles, budget and weight
     gradients are the engine's;
  3. the outputs return by the reverse exchange, and the sending rank combines them with its routing weights:
     ``out[t] = sum_j w[t, j] y[t, j]`` (accumulated in Float32).
The two exchanges of hidden rows are one autograd Function (``_Exchange``) whose backward is the reverse exchange,
so backward mirrors forward: the output gradients travel to the owners, the engine's backward adds each owned
expert's weight gradient over the rows of every rank, and the input gradients travel back. The routing weights
never leave their rank (their gradient is ``<grad_out[t], y[t, j]>``, torch's autograd on the combination). Every
rank runs the same collectives in the same order (a rank that receives no rows still takes part: its empty
output stays linked to its empty input, so its backward runs the reverse exchanges too).

Gradients (``all_reduce_gradients``): the torch parameters (everything but the experts: embeddings, attention,
norms, routers, shared experts, expert biases) are replicated and their gradients averaged by one
``all_reduce`` (SUM, then / N) per dtype over the flattened gradients; a parameter whose gradient is None on every
rank stays None. With each rank's loss the mean over its own tokens (the same count on every rank), the gradient
of the mean over the global batch is the average of the ranks' gradients: for a replicated parameter that is the
average, and for an owned expert, whose gradient already sums the contributions of every rank's tokens (each
scaled by its rank's 1 / T_r), it is that sum times 1 / N: ``all_reduce_gradients`` multiplies the owned tiles'
gradients by 1 / N (``strideweave.optim.scale_grads``). DDP is not used: its bucketed all-reduces run from
autograd hooks while backward also runs the experts' exchanges on the same group, and it would have to skip the
experts (they are not parameters) anyway; one explicit call between backward and the step keeps the order of
collectives identical on every rank and composes with gradient accumulation (call it once, after the last
micro-batch).

Clipping (``clip_grad_norm_`` in ``_optim``): the replicated parameters' norms are computed locally (their
gradients are the same on every rank after ``all_reduce_gradients``), counted once; the tiled gradients' p-th
powers of norms are summed over the ranks (each expert is owned by one rank: counted once) by an ``all_reduce`` in
Float64 (MAX for the infinity norm); the total, and so the clipping factor, is the same on every rank.
"""

from __future__ import annotations

from typing import Any, Optional

from ._bridge import _sw, _torch

__all__ = ["all_reduce_gradients", "expert_share"]

GROUP_ATTR = "_strideweave_process_group"  # on the model: the group it was opened with


def expert_share(experts: int, rank: int, world_size: int) -> range:
    """The experts rank `rank` of `world_size` owns out of `experts`: ``range(floor(E r / N), floor(E (r + 1) /
    N))`` (contiguous; the shares of all ranks partition ``range(E)``)."""
    return range(experts * rank // world_size, experts * (rank + 1) // world_size)


def check_group(process_group: Any, what: str) -> Any:
    """`process_group` if it is a usable ``torch.distributed`` process group (None stays None); TypeError or
    RuntimeError saying what is wrong otherwise."""
    if process_group is None:
        return None
    torch = _torch()
    dist = torch.distributed
    if not dist.is_available():
        raise RuntimeError(f"{what}: process_group given, but this PyTorch has no torch.distributed")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{what}: process_group must be a torch.distributed.ProcessGroup (such as "
                        f"torch.distributed.group.WORLD), got {type(process_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialized (call torch.distributed.init_process_group "
                           "first)")
    return process_group


def refuse_unsupported(selected: list, what: str) -> None:
    """Expert parallelism runs the experts on transformers' interface and DBRX; Llama4's input-scaled experts are
    not sharded yet (TypeError, before anything is loaded)."""
    for path, _, family, block in selected:
        if block is not None or (family is not None and family.name == "llama4"):
            raise TypeError(f"{what}: {path}: Llama4's experts cannot be sharded across ranks yet (process_group "
                            "supports the families on transformers' experts interface and DBRX)")


def shard(model: Any, bindings: list, process_group: Any) -> None:
    """Gives each binding its rank's share of experts (Note [Experts across ranks]) and records the group on the
    model."""
    dist = _torch().distributed
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    for b in bindings:
        b.process_group = process_group
        b.experts_range = expert_share(b.spec.experts, rank, world)
    model.__dict__[GROUP_ATTR] = process_group


def group_of(model: Any) -> Any:
    """The process group `model` was opened with, else None."""
    return model.__dict__.get(GROUP_ATTR)


def world_size_of(process_group: Any) -> int:
    return 1 if process_group is None else _torch().distributed.get_world_size(process_group)


_CLASSES: dict = {}


def _classes() -> dict:
    """The exchange's autograd Function, defined on first use (torch is imported lazily)."""
    if _CLASSES:
        return _CLASSES
    torch = _torch()
    dist = torch.distributed

    class _Exchange(torch.autograd.Function):
        """``all_to_all_single`` of rows: `send[r]` rows of `x` to rank r, `recv[r]` rows from it; backward is the
        reverse exchange of the gradient."""

        @staticmethod
        def forward(ctx: Any, x: Any, send: list, recv: list, group: Any) -> Any:  # type: ignore[override]
            ctx.send, ctx.recv, ctx.group = send, recv, group
            out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
            dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
            return out, None, None, None

    _CLASSES["Exchange"] = _Exchange
    return _CLASSES


def experts_forward(binding: Any, x: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts of a sharded binding on this rank's tokens `x` (T, H): pairs sent to their owners, computed
    there, returned and combined (Note [Experts across ranks]). Collective: every rank of the group calls it, for
    the same module, in the same order."""
    torch = _torch()
    dist = torch.distributed
    group = binding.process_group
    world = dist.get_world_size(group)
    E, H = binding.spec.experts, binding.spec.hidden
    k = top_k_index.shape[-1]
    index = top_k_index.reshape(-1).long()
    weights = top_k_weights.reshape(-1)
    T = x.shape[0]
    with torch.no_grad():
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= E):
            raise ValueError(f"{binding.name}: routed expert indices must lie in [0, {E}), got "
                             f"[{int(index.min())}, {int(index.max())}]")
        ends = torch.tensor([E * (r + 1) // world for r in range(world)], dtype=torch.int64)
        owner = torch.bucketize(index, ends, right=True)  # the r with floor(E r / N) <= e < floor(E (r + 1) / N)
        order = torch.argsort(owner, stable=True)
        send_t = torch.bincount(owner, minlength=world).to(torch.int64)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=group)
        send, recv = send_t.tolist(), recv_t.tolist()
        ids = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(ids, index[order].contiguous(), recv, send, group=group)
        tokens = order // k
    exchange = _classes()["Exchange"]
    received = exchange.apply(x[tokens], send, recv, group)
    y = _local(binding, received, ids).to(x.dtype)
    back = exchange.apply(y, recv, send, group)
    contribution = back.float() * weights[order].float()[:, None]
    out = torch.zeros((T, H), dtype=torch.float32).index_add(0, tokens, contribution)
    return out.to(x.dtype)


def _local(binding: Any, x: Any, ids: Any) -> Any:
    """The owned experts on the received rows `x` (R, H), row i for expert ids[i] with routing weight 1, by the
    binding's own computation. An empty share of rows gives an empty output still linked to `x` (so backward
    runs the reverse exchange on this rank as on the others)."""
    torch = _torch()
    from ._experts import _classes as _experts_classes, _dispatch
    R = x.shape[0]
    if R == 0:
        return x * 0
    lo, hi = binding.experts_range.start, binding.experts_range.stop
    if int(ids.min()) < lo or int(ids.max()) >= hi:
        raise RuntimeError(f"{binding.name}: received rows for experts [{int(ids.min())}, {int(ids.max())}], this "
                           f"rank owns [{lo}, {hi}) (the ranks disagree on the number of experts or ranks)")
    ones = torch.ones((R, 1), dtype=torch.float32)
    fns = _experts_classes()
    if binding.native:
        return fns["Native"].apply(x, ones, binding, ids.view(R, 1))
    module = binding._module_ref
    biases = (getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)) \
        if binding.spec.has_bias else (None, None)
    return fns["Math"].apply(x, ones.reshape(-1).to(x.dtype), biases[0], biases[1], binding,
                             _dispatch(ids.view(R, 1), 1), False)


def all_reduce_gradients(model: Any, process_group: Any = None) -> None:
    """Averages the gradients of a model opened with a process group over its ranks (Note [Experts across ranks]):
    every torch parameter's gradient (replicated parameters) by one all-reduce per dtype, SUM then / N (a gradient
    None on every rank stays None; None on some ranks counts as zeros there), and each owned expert's tiled
    gradient, which already sums every rank's tokens, multiplied by 1 / N. With each rank's loss the mean over its
    own tokens (the same number on every rank), the result is the gradient of the mean loss over the global batch,
    as one process would compute it. Call it once after backward (after the last micro-batch when accumulating)
    and before ``clip_grad_norm_`` and the optimizer's step; it is collective (every rank calls it).

    `process_group`: default the group the model was opened with. TypeError for anything but a model; ValueError
    for a model opened without a process group and none given, or experts whose optimizer steps in backward (they
    would be stepped before the average).
    """
    torch = _torch()
    sw = _sw()
    what = "strideweave.torch.all_reduce_gradients"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: expected a model (a torch.nn.Module), got {type(model).__name__}")
    group = check_group(process_group, what) if process_group is not None else group_of(model)
    if group is None:
        raise ValueError(f"{what}: {type(model).__name__} was not opened with a process group and none was given")
    from ._offload import offloaded_experts
    tiled = [t for b in offloaded_experts(model).values() for t in b.tiled.values()]
    for t in tiled:
        if sw._core._steps_in_backward(t):
            raise ValueError(f"{what}: the experts' optimizer has step_in_backward=True: each expert is stepped in "
                             "backward before the gradients are averaged (build it with step_in_backward=False; "
                             "nothing was reduced)")
    dist = torch.distributed
    world = dist.get_world_size(group)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
        chosen = [p for p, h in zip(params, present.tolist()) if h]
        by_dtype: dict = {}
        for p in chosen:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            ps = by_dtype[dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world)
            offset = 0
            for p in ps:
                n = p.numel()
                value = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += n
    with_grad = [t for t in tiled if t.grad is not None]
    if world > 1 and with_grad:
        sw.optim.scale_grads(with_grad, 1.0 / world)


def global_tiled_norm(local: float, norm_type: float, group: Any) -> float:
    """The norm of the tiled gradients of every rank from this rank's `local` norm: ``(sum_r local_r^p)^(1/p)``, or
    the largest for the infinity norm (an all-reduce in Float64; collective)."""
    torch = _torch()
    dist = torch.distributed
    inf = norm_type == float("inf")
    value = torch.tensor([local if inf else local ** norm_type], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    total = float(value[0])
    return total if inf else total ** (1.0 / norm_type)


def sharded_group(bindings: Any) -> Optional[Any]:
    """The process group of the first sharded binding among `bindings`, else None."""
    for b in bindings:
        g = getattr(b, "process_group", None)
        if g is not None:
            return g
    return None
