"""The dtype of a BFloat16 tiled weight's gradient (docs/guide.md, "Tiled gradients of 16-bit parameters"; Note
[Tiled gradients of 16-bit parameters] in cpp/src/tiled/gradient_dtypes.cpp).

A BFloat16 TiledEvictable keeps its .grad in BFloat16, tile for tile as the weight (PyTorch keeps a BFloat16
parameter's .grad in BFloat16 too): a SparseMoE call's dW is computed in Float32 and added into the BFloat16 .grad
tile in Float32, rounded once (nearest even). PyTorch's AccumulateGrad instead adds a dW already rounded to BFloat16
(two roundings). A Float32 .grad the caller sets before backward is kept and accumulated in Float32.

The checks are bit for bit: each backward's Float32 contribution c_j is measured on its own (a fresh block whose
.grad is a Float32 zero: 0 + c_j is exact), and the reference applies exactly the stated roundings to those c_j in
torch. All routes are given (``SparseMoE.experts``), every expert routed in every backward, so no tile stays an
implicit zero and no top-k tie arises.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import strideweave as sw
from strideweave import DType, friendly
from strideweave.carriers.tiled_evictable import ResidencyBudget, TiledEvictable

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261231
E, H, I, T = 4, 16, 24, 24
NAMES = ("w1", "w2", "w3")


def tiled(stack, budget=None):
    """(rows, cols, E) over a TiledEvictable of BFloat16 row-major (out, in) tiles, tile e = stack[e]."""
    e, r, c = stack.shape
    tier = sw.move(friendly.tensor(stack.reshape(-1).astype(ml_dtypes.bfloat16)), sw.FileBacked(dtype=DType.BFloat16))
    carrier = TiledEvictable(sw.CPU(0, dtype=DType.BFloat16), tier.carrier, (1, 1, e), (r, c, 1),
                             residency_budget=budget)
    return sw.Tensor(carrier, 0, sw.Layout(sw.Shape(r, c, e), sw.Stride(c, 1, r * c)))


def float32_zero_grad(full, budget=None):
    """A Float32 .grad of zeros with the weight's grid, tiles and layout (its own scratch file, the same budget)."""
    tier = sw.move(friendly.tensor(np.zeros(full.size(), np.float32)), sw.FileBacked())
    c = TiledEvictable(sw.CPU(0), tier.carrier, full.carrier.grid_shape, full.carrier.tile_shape,
                       residency_budget=budget)
    return sw.Tensor(c, 0, full.layout)


def problem(seed, steps):
    """BFloat16 expert weights and `steps` backwards' inputs: x (BFloat16 values), routes (every expert routed),
    routing weights, cotangent (BFloat16 values, so the products below are exact)."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    bf = lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    weights = (bf(rng.standard_normal((E, I, H)) / np.sqrt(H)), bf(rng.standard_normal((E, H, I)) / np.sqrt(I)),
               bf(rng.standard_normal((E, I, H)) / np.sqrt(H)))
    out = []
    for _ in range(steps):
        idx = np.stack([rng.choice(E, 2, replace=False) for _ in range(T)]).astype(np.int32)
        assert set(idx.reshape(-1).tolist()) == set(range(E))
        w = rng.uniform(0.2, 0.8, (T, 2)).astype(np.float32)
        w[:, 1] = 1 - w[:, 0]
        out.append((bf(rng.standard_normal((T, H))), idx, w, bf(rng.standard_normal((T, H)))))
    return weights, out


def block(weights, budget=None, float32_grad=False):
    moe = sw.moe.SparseMoE(*(tiled(w, budget) for w in weights), top_k=2, budget=budget)
    if float32_grad:
        for n in NAMES:
            getattr(moe, n).grad = float32_zero_grad(getattr(moe, n), budget)
    return moe


def call(moe, step):
    """sum(experts(x) * g): its cotangent into the block is g exactly."""
    x, idx, w, g = step
    out = moe.experts(friendly.tensor(x.astype(ml_dtypes.bfloat16)), friendly.tensor(w),
                      friendly.tensor(idx, dtype=DType.Int32))
    return sw.reduce_sum(sw.elementwise_mul(out, friendly.tensor(g.astype(ml_dtypes.bfloat16))), "t h ->")


def grads(moe):
    """{name: (E, rows, cols) torch tensor of the .grad's own dtype}, read slot by slot."""
    out = {}
    for n in NAMES:
        a = np.ascontiguousarray(np.asarray(getattr(moe, n).grad).transpose(2, 0, 1))
        out[n] = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 \
            else torch.from_numpy(a)
    return out


def contribution(weights, step):
    """One backward's Float32 contribution to each weight: a fresh block with a Float32 zero .grad (0 + c = c)."""
    moe = block(weights, float32_grad=True)
    call(moe, step).backward()
    g = grads(moe)
    assert all(t.dtype == torch.float32 for t in g.values())
    return g


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                                              b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


def test_bfloat16_gradients_accumulate_as_torch_accumulategrad_does():
    """Three backwards into the BFloat16 .grad against a BFloat16 nn.Parameter per weight whose .grad torch's
    autograd accumulates (AccumulateGrad: a BFloat16 dW added to the BFloat16 .grad, rounded once), fed the same
    per-backward dW: bit for bit."""
    weights, steps = problem(BASE_SEED, 3)
    cs = [contribution(weights, s) for s in steps]
    moe = block(weights)
    params = {n: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16))
              for n, w in zip(NAMES, weights)}
    for step, c in zip(steps, cs):
        call(moe, step).backward()
        got = grads(moe)
        for n in NAMES:
            # The call's dW is a BFloat16 product (Float32 sums over the call's tokens, rounded once), as a
            # BFloat16 matmul in torch gives it: exact in BFloat16, so its cast below is exact.
            assert torch.equal(c[n], c[n].to(torch.bfloat16).float()), n
            (params[n].float() * c[n]).sum().backward()  # d/dP = bf16(c) = c: AccumulateGrad adds it
            g = getattr(moe, n).grad
            assert g.dtype() is DType.BFloat16 and g.carrier.dtype() is DType.BFloat16
            assert g.carrier.tile_shape == getattr(moe, n).carrier.tile_shape
            assert same_bits(got[n], params[n].grad), n
    # The .grad is rounded at every backward: a Float32 sum of the three rounded once would differ somewhere.
    once = {n: (cs[0][n] + cs[1][n] + cs[2][n]).to(torch.bfloat16) for n in NAMES}
    assert any(not torch.equal(params[n].grad, once[n]) for n in NAMES)


def test_two_calls_in_one_backward_round_once_per_call():
    """Each SparseMoE call adds its dW into the held .grad itself (in place, or through its tile's projection): a
    weight used by two calls inside one backward is rounded once per call, in backward's order (the later call
    first)."""
    weights, steps = problem(BASE_SEED + 1, 3)
    c = [contribution(weights, s) for s in steps]
    moe = block(weights)
    call(moe, steps[0]).backward()
    sw.add(call(moe, steps[1]), call(moe, steps[2])).backward()
    got = grads(moe)
    for n in NAMES:
        first = c[0][n].to(torch.bfloat16)
        want = ((first.float() + c[2][n]).to(torch.bfloat16).float() + c[1][n]).to(torch.bfloat16)
        assert same_bits(got[n], want), n
    # ... which a single rounding of the backward's Float32 sum would not give here (the check can tell)
    once = {n: (c[0][n].to(torch.bfloat16).float() + (c[1][n] + c[2][n])).to(torch.bfloat16) for n in NAMES}
    assert any(not torch.equal(got[n], once[n]) for n in NAMES)


def test_gradient_tiles_take_the_weights_bytes_in_the_budget():
    """Every expert routed: after backward the budget holds each weight tile and its gradient tile, the gradient
    in BFloat16 (as many bytes as the weight), against twice that for a Float32 .grad."""
    weights, steps = problem(BASE_SEED + 2, 1)
    weight_bytes = sum(w.size for w in weights) * 2
    for float32_grad, grad_bytes in ((False, weight_bytes), (True, 2 * weight_bytes)):
        budget = ResidencyBudget(1 << 30)
        moe = block(weights, budget, float32_grad)
        call(moe, steps[0]).backward()
        stats = budget.stats()
        assert stats["resident_bytes"] == weight_bytes + grad_bytes, (float32_grad, stats)
        assert stats["resident_tiles"] == 2 * 3 * E and stats["evictions"] == 0


@pytest.mark.parametrize("experts_held", [None, 1.5], ids=["unbounded", "budget"])
def test_a_float32_grad_set_before_backward_accumulates_in_float32(experts_held):
    weights, steps = problem(BASE_SEED + 3, 3)
    cs = [contribution(weights, s) for s in steps]
    one_expert = 3 * (2 * I * H) * (2 + 4)  # one expert's weight tiles and Float32 gradient tiles
    budget = ResidencyBudget(int(experts_held * one_expert)) if experts_held else None
    moe = block(weights, budget, float32_grad=True)
    ref = {n: torch.zeros_like(cs[0][n]) for n in NAMES}
    for step, c in zip(steps, cs):
        call(moe, step).backward()
        got = grads(moe)
        for n in NAMES:
            ref[n] = ref[n] + c[n]  # Float32 additions, one per backward
            assert getattr(moe, n).grad.dtype() is DType.Float32
            assert same_bits(got[n], ref[n]), n
    if budget is not None:
        assert budget.stats()["evictions"] > 0 and budget.stats()["peak_bytes"] <= budget.max_bytes


def test_optimizers_step_bfloat16_gradients_like_torch():
    """sw.optim.SGD (momentum, weight decay) on BFloat16 weights with their BFloat16 .grad from SparseMoE, against
    torch.optim.SGD on Float32 copies (torch's Float32 state), the weight rounded to BFloat16 after each step, as
    tests/test_optim.py states for 16-bit weights: bit for bit."""
    weights, steps = problem(BASE_SEED + 4, 2)
    moe = block(weights)
    hyper = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    opt = sw.optim.SGD([moe.w1, moe.w2, moe.w3], **hyper)
    params = {n: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w))) for n, w in zip(NAMES, weights)}
    ref = torch.optim.SGD(list(params.values()), foreach=False, **hyper)
    for step in steps:
        opt.zero_grad()
        call(moe, step).backward()
        g = grads(moe)
        for n in NAMES:
            assert g[n].dtype == torch.bfloat16
            params[n].grad = g[n].float()
        opt.step()
        ref.step()
        with torch.no_grad():
            for p in params.values():
                p.copy_(p.to(torch.bfloat16).float())
        for n in NAMES:
            got = torch.from_numpy(np.asarray(getattr(moe, n)).astype(np.float32).transpose(2, 0, 1).copy())
            assert torch.equal(got, params[n].detach()), n


def test_offloaded_hf_experts_keep_bfloat16_gradients(tmp_path):
    """strideweave.torch: a BFloat16 Qwen3-MoE's bound experts get BFloat16 gradient tiles, and gather(grad=True)
    gives them in the module's dtype."""
    import hf_models
    from strideweave.torch import offload_experts
    folder = hf_models.saved_models("qwen3_moe", tmp_path, seed=0)["bfloat16"]
    model = hf_models.load_model("qwen3_moe", folder, experts_implementation="eager")
    bindings = offload_experts(model, folder, budget=1 << 30)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=ids).loss.backward()
    for b in bindings:
        for role, t in b.tiled.items():
            assert t.dtype() is DType.BFloat16 and t.grad.dtype() is DType.BFloat16, (b.name, role)
            assert t.grad.carrier.tile_shape == t.carrier.tile_shape
        for name in ("gate_up_proj", "down_proj"):
            g = b.gather(name, grad=True)
            assert g.dtype == torch.bfloat16 and bool(g.abs().max() > 0), (b.name, name)
