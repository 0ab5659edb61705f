"""strideweave.moe.SparseMoE against a Float64 NumPy reference of the same block (docs/guide.md, "SparseMoE").

The reference computes the exact block (routing, experts, and every gradient by hand) in Float64 and, beside each
value, a magnitude: the same computation on absolute values, where each nonlinearity is replaced by a bound of its
size and of its derivative (|silu(z)| <= |z|, |silu'(z)| <= 1.1, |silu''(z)| <= 0.5). To first order, a rounding
of relative size u of an intermediate q (|q| <= its magnitude) moves every later quantity by at most u times that
quantity's magnitude, since the magnitudes bound the absolute values of the linear maps that carry the error on.
`tolerance` states the resulting bound.
"""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, friendly
from strideweave.carriers.tiled_evictable import ResidencyBudget, TiledEvictable

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261902
U32 = 2.0**-24
UNIT = {DType.Float32: 2.0**-24, DType.BFloat16: 2.0**-8, DType.Float16: 2.0**-11}
NP = {DType.Float32: np.float32, DType.BFloat16: ml_dtypes.bfloat16, DType.Float16: np.float16}
DTYPES = [DType.Float32, DType.BFloat16, DType.Float16]
T, H, I, E = 20, 24, 40, 6


# ---------------------------------------------------------------- building blocks


def as_dtype(a, dtype):
    """`a` rounded to `dtype`, as a Float64 array (the values the block sees)."""
    return np.asarray(a, dtype=np.float64).astype(NP[dtype]).astype(np.float64)


def tiled(stack, dtype, *, row_major=True, budget=None):
    """A full (rows, cols, E) tensor over a TiledEvictable (CPU primary, FileBacked secondary), tile e = stack[e].

    Row-major tiles are PyTorch's (out, in) order (strides (cols, 1, rows*cols)); otherwise column-major.
    """
    e, r, c = stack.shape
    data = stack.reshape(-1) if row_major else np.ascontiguousarray(stack.transpose(0, 2, 1)).reshape(-1)
    tier = sw.move(friendly.tensor(data.astype(NP[dtype])), sw.FileBacked(dtype=dtype))
    carrier = TiledEvictable(sw.CPU(0, dtype=dtype), tier.carrier, (1, 1, e), (r, c, 1), residency_budget=budget)
    strides = (c, 1, r * c) if row_major else (1, r, r * c)
    return sw.Tensor(carrier, 0, sw.Layout(sw.Shape(r, c, e), sw.Stride(*strides)))


def dense(a, dtype):
    return friendly.tensor(np.asarray(a).astype(NP[dtype]))


def values(t):
    return np.asarray(t).astype(np.float64)


def silu(z):
    return z / (1 + np.exp(-z))


def dsilu(z):
    s = 1 / (1 + np.exp(-z))
    return s * (1 + z * (1 - s))


def softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class Reference:
    """The block in Float64: values and magnitudes (see the module docstring) of the output and every gradient."""

    def __init__(self, x, router, w1, w2, w3, g, k, normalize, weights=None):
        t_, h_ = x.shape
        e_ = router.shape[0]
        ax, ar = np.abs(x), np.abs(router)
        self.logits = x @ router.T
        self.logits_mag = ax @ ar.T
        p = softmax(self.logits)
        order = np.argsort(-p, axis=1, kind="stable")
        idx = order[:, :k]
        top = np.take_along_axis(p, idx, 1)
        s = top.sum(axis=1, keepdims=True)
        w = top / s if normalize else top
        if weights is not None:  # a given routing (the expert part alone): these weights for the same experts
            w = weights
        self.probs, self.indices, self.weights = p, idx, w
        kth = np.take_along_axis(p, order[:, k - 1:k], 1)[:, 0]
        # With k = E every expert is chosen: no tie can change the set (the order does not matter to the sum).
        self.margin = kth - np.take_along_axis(p, order[:, k:k + 1], 1)[:, 0] if k < e_ else np.full(t_, np.inf)
        out, out_m = np.zeros((t_, h_)), np.zeros((t_, h_))
        dx, dx_m = np.zeros((t_, h_)), np.zeros((t_, h_))
        dw, dw_m = np.zeros_like(w), np.zeros_like(w)
        d = {n: np.zeros_like(a) for n, a in (("w1", w1), ("w2", w2), ("w3", w3))}
        dm = {n: np.zeros_like(a) for n, a in (("w1", w1), ("w2", w2), ("w3", w3))}
        for t in range(t_):
            for j in range(k):
                e = idx[t, j]
                a1, a2, a3 = np.abs(w1[e]), np.abs(w2[e]), np.abs(w3[e])
                h1, h1m = w1[e] @ x[t], a1 @ ax[t]
                h3, h3m = w3[e] @ x[t], a3 @ ax[t]
                act, act_m = silu(h1), 1.1 * h1m
                hh, hh_m = act * h3, act_m * h3m
                y, y_m = w2[e] @ hh, a2 @ hh_m
                out[t] += w[t, j] * y
                out_m[t] += w[t, j] * y_m
                dw[t, j] = g[t] @ y
                dw_m[t, j] = np.abs(g[t]) @ y_m
                dy, dy_m = g[t] * w[t, j], np.abs(g[t]) * w[t, j]
                d["w2"][e] += np.outer(dy, hh)
                dm["w2"][e] += np.outer(dy_m, hh_m)
                da, da_m = w2[e].T @ dy, a2.T @ dy_m
                dh3, dh3_m = da * act, da_m * act_m
                dh1, dh1_m = da * h3 * dsilu(h1), da_m * h3m * (1.1 + 0.5 * h1m)
                d["w1"][e] += np.outer(dh1, x[t])
                dm["w1"][e] += np.outer(dh1_m, ax[t])
                d["w3"][e] += np.outer(dh3, x[t])
                dm["w3"][e] += np.outer(dh3_m, ax[t])
                dx[t] += w1[e].T @ dh1 + w3[e].T @ dh3
                dx_m[t] += a1.T @ dh1_m + a3.T @ dh3_m
        self.dx_experts, self.dx_experts_m = dx.copy(), dx_m.copy()  # x's gradient through the experts alone
        if normalize:
            dtop = (dw - (dw * w).sum(axis=1, keepdims=True)) / s
            dtop_m = (dw_m + (dw_m * w).sum(axis=1, keepdims=True)) / s
        else:
            dtop, dtop_m = dw, dw_m
        dp, dp_m = np.zeros_like(p), np.zeros_like(p)
        np.put_along_axis(dp, idx, dtop, 1)
        np.put_along_axis(dp_m, idx, dtop_m, 1)
        dl = p * (dp - (dp * p).sum(axis=1, keepdims=True))
        dl_m = p * (dp_m + (dp_m * p).sum(axis=1, keepdims=True))
        dx += dl @ router
        dx_m += dl_m @ ar
        self.out, self.out_m = out, out_m
        self.dw, self.dw_m = dw, dw_m
        self.dx, self.dx_m = dx, dx_m
        self.drouter, self.drouter_m = dl.T @ x, dl_m.T @ ax
        self.dweights = d
        self.dweights_m = dm


def tolerance(mag, dtype, routing_dtype, ref, inner, routed=True):
    """The bound on |computed - exact| for a quantity of magnitude `mag`.

    * Each rounding to the block's dtype (unit u) of an intermediate, and each Float32 sum of at most `inner` terms
      (gamma_inner <= (inner + 1) 2^-24 while inner 2^-24 < 0.01), moves the result by at most that unit times its
      magnitude. No path has more than 16 such steps (h1, h3, silu, their product, y, the scaled y, the output add;
      dY, dA, the silu gradient's two factors, dW or dx_e, the tiled gradient's Float32 sum and the leaf's
      rounding; the logits, their cast and the softmax for the routing), so 16 units, times 1.1 for the
      second-order terms (16 u <= 0.07 for bf16), bound the sum.
    * When the block routes (`routed`), the routing weights carry the error of the logits: each logit is off by
      at most e_L = (u + H 2^-24) max |x||R| (a Float32 sum rounded to the block's dtype), so each probability by
      a relative 2 e_L (plus the softmax's own (E + 2) 2^-24) and a normalised weight by twice that; the routing
      cast adds u_route. Everything downstream is linear in the weights with the magnitudes computed here, and a
      weight's error reaches the logits' gradient twice (through dw and through p), hence 4 delta_w. Given
      weights (the expert part alone) are exact inputs.
    """
    u = UNIT[dtype]
    e_l = (u + H * U32) * ref.logits_mag.max()
    delta_w = 4 * (2 * e_l + (E + 2) * U32) + (UNIT[routing_dtype] if routing_dtype != DType.Float32 else 0)
    return (1.1 * 16 * (u + (inner + 1) * U32) + (4 * delta_w if routed else 0)) * mag + 1e-30


def check_margin(ref, dtype):
    """The test must not sit on a top-k tie: the k-th probability must beat the (k+1)-th by more than the
    probabilities' error bound (relative 2 e_L + (E + 2) 2^-24 each, see `tolerance`)."""
    u = UNIT[dtype]
    e_l = (u + H * U32) * ref.logits_mag.max()
    err = (2 * e_l + (E + 2) * U32) * 2 * ref.probs.max(axis=1)
    bad = np.nonzero(ref.margin <= err)[0]
    if bad.size:
        pytest.fail(f"routing within its error bound of a tie for tokens {bad.tolist()}: margins "
                    f"{ref.margin[bad].tolist()} <= {err[bad].tolist()}")


def problem(seed, dtype, k):
    """Inputs rounded to `dtype`, with tokens whose top-k routing is clear of ties (chosen from a larger pool)."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    w1 = as_dtype(rng.standard_normal((E, I, H)) / np.sqrt(H), dtype)
    w3 = as_dtype(rng.standard_normal((E, I, H)) / np.sqrt(H), dtype)
    w2 = as_dtype(rng.standard_normal((E, H, I)) / np.sqrt(I), dtype)
    router = as_dtype(rng.standard_normal((E, H)) * 2 / np.sqrt(H), dtype)
    pool = as_dtype(rng.standard_normal((8 * T, H)), dtype)
    probe = Reference(pool, router, w1, w2, w3, np.zeros((8 * T, H)), k, True)
    u = UNIT[dtype]
    e_l = (u + H * U32) * probe.logits_mag.max()
    clear = probe.margin > 4 * (2 * e_l + (E + 2) * U32) * probe.probs.max(axis=1)
    chosen = np.nonzero(clear)[0][:T]
    assert chosen.size == T, f"only {chosen.size} of {8 * T} tokens route clear of ties (seed {seed})"
    x = pool[chosen]
    g = rng.standard_normal((T, H)).astype(np.float32).astype(np.float64)
    return x, router, w1, w2, w3, g


def build(w1, w2, w3, dtype, *, row_major=True, budget=None, **options):
    t1 = tiled(w1, dtype, row_major=row_major)
    t2 = tiled(w2, dtype, row_major=row_major)
    t3 = tiled(w3, dtype, row_major=row_major)
    return sw.moe.SparseMoE(t1, t2, t3, budget=budget, **options)


def routed_block(seed, dtype=DType.Float32):
    """A top-2 block over a fresh problem, its inputs as tensors, and their routing (logits, weights, indices)."""
    x, router, w1, w2, w3, _ = problem(seed, dtype, 2)
    moe = build(w1, w2, w3, dtype, top_k=2)
    xt, rt = dense(x, dtype), dense(router, dtype)
    return moe, x, xt, rt, moe.route(xt, rt)


def run(moe, x, router, g, dtype):
    xt, rt = dense(x, dtype), dense(router, dtype)
    out = moe(xt, rt)
    out.backward(friendly.tensor(g.astype(np.float32)))
    return out, xt, rt


def grads_of(moe):
    """Each expert's dW (E, rows, cols) from the tiled .grad (read slot by slot: no tile moves)."""
    out = {}
    for name in ("w1", "w2", "w3"):
        grad = getattr(moe, name).grad
        out[name] = values(grad).transpose(2, 0, 1)
    return out


def assert_within(name, got, want, bound):
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{name}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(got {got[worst]!r}, want {want[worst]!r})")


def check_all(moe, out, xt, rt, ref, dtype, routing_dtype, k, routed=True):
    """The output, x.grad, and the second input's gradient (router_weight's, or the given weights' when not
    `routed`) and every expert's dW, each within `tolerance`."""
    tol = lambda m: tolerance(m, dtype, routing_dtype, ref, max(H, I, T * k), routed)  # noqa: E731
    assert_within("out", values(out), ref.out, tol(ref.out_m))
    if routed:
        assert_within("x.grad", values(xt.grad), ref.dx, tol(ref.dx_m))
        assert_within("router_weight.grad", values(rt.grad), ref.drouter, tol(ref.drouter_m))
    else:
        assert_within("x.grad (experts)", values(xt.grad), ref.dx_experts, tol(ref.dx_experts_m))
        assert_within("weights.grad", values(rt.grad), ref.dw, tol(ref.dw_m))
    got = grads_of(moe)
    for name in ("w1", "w2", "w3"):
        assert_within(f"{name}.grad", got[name], ref.dweights[name], tol(ref.dweights_m[name]))


# ---------------------------------------------------------------- values and gradients

CONFIGS = {
    "mixtral": dict(k=2, normalize=True, block_routing=False),
    "qwen": dict(k=2, normalize=False, block_routing=True),
    "top1": dict(k=1, normalize=True, block_routing=False),
    "all": dict(k=E, normalize=True, block_routing=False),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("row_major", [True, False], ids=["row_major", "column_major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_output_and_every_gradient_match_the_float64_reference(dtype, row_major, config):
    c = CONFIGS[config]
    k = c["k"]
    routing_dtype = dtype if c["block_routing"] else DType.Float32
    seed = BASE_SEED + 7 * DTYPES.index(dtype) + list(CONFIGS).index(config)
    x, router, w1, w2, w3, g = problem(seed, dtype, k)
    ref = Reference(x, router, w1, w2, w3, g, k, c["normalize"])
    check_margin(ref, dtype)
    moe = build(w1, w2, w3, dtype, row_major=row_major, top_k=k, normalize=c["normalize"],
                routing_dtype=dtype if c["block_routing"] else None)
    out, xt, rt = run(moe, x, router, g, dtype)
    assert out.dtype() is dtype and out.shape == sw.Shape(T, H)
    check_all(moe, out, xt, rt, ref, dtype, routing_dtype, k)
    # The expert part alone, given the reference's routing (weights rounded to the routing dtype): no logit error
    # reaches it, so its bound is the rounding steps' alone (16-bit: tight enough that dropping a factor shows).
    given = as_dtype(ref.weights, routing_dtype)
    ref = Reference(x, router, w1, w2, w3, g, k, c["normalize"], weights=given)
    moe = build(w1, w2, w3, dtype, row_major=row_major, top_k=k, normalize=c["normalize"],
                routing_dtype=dtype if c["block_routing"] else None)
    xt, wt = dense(x, dtype), dense(given, routing_dtype)
    out = moe.experts(xt, wt, friendly.tensor(ref.indices.astype(np.int32), dtype=DType.Int32))
    out.backward(friendly.tensor(g.astype(np.float32)))
    check_all(moe, out, xt, wt, ref, dtype, routing_dtype, k, routed=False)
    # Experts never routed keep implicit-zero gradient tiles.
    unused = sorted(set(range(E)) - set(ref.indices.reshape(-1).tolist()))
    for e in unused:
        assert moe.w1.grad.carrier.tile_state((0, 0, e)).location == "implicit"


def test_routing_matches_the_reference():
    dtype = DType.Float32
    x, router, w1, w2, w3, g = problem(BASE_SEED + 100, dtype, 2)
    ref = Reference(x, router, w1, w2, w3, g, 2, True)
    moe = build(w1, w2, w3, dtype, top_k=2)
    logits, weights, indices = moe.route(dense(x, dtype), dense(router, dtype))
    assert logits.dtype() is DType.Float32 and weights.dtype() is DType.Float32 and indices.dtype() is DType.Int32
    assert np.asarray(indices).tolist() == ref.indices.tolist()
    # Float32 logits: gamma_H |x||R|; the weights: 4 (2 e_L + (E + 2) u) relative (see `tolerance`).
    assert_within("logits", values(logits), ref.logits, (H + 1) * U32 * ref.logits_mag)
    e_l = (H + 1) * U32 * ref.logits_mag.max()
    assert_within("weights", values(weights), ref.weights, 4 * (2 * e_l + (E + 2) * U32) * ref.weights)
    # experts() given that routing is forward().
    with sw.no_grad():
        a = values(moe.experts(dense(x, dtype), weights, indices))
        b = values(moe(dense(x, dtype), dense(router, dtype)))
    np.testing.assert_array_equal(a, b)


def test_a_safetensors_checkpoint_of_row_major_experts(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    for dtype, tdtype in ((DType.Float32, torch.float32), (DType.BFloat16, torch.bfloat16)):
        x, router, w1, w2, w3, g = problem(BASE_SEED + 200 + (dtype is DType.BFloat16), dtype, 2)
        ref = Reference(x, router, w1, w2, w3, g, 2, True)
        check_margin(ref, dtype)
        tensors = {}
        for e in range(E):
            for name, stack in (("w1", w1), ("w2", w2), ("w3", w3)):
                tensors[f"experts.{e}.{name}.weight"] = torch.tensor(stack[e]).to(tdtype)
        path = tmp_path / f"experts-{dtype.name}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        ckpt = sw.safetensors.open(path)
        full = [ckpt.tiled([f"experts.{e}.{n}.weight" for e in range(E)]) for n in ("w1", "w2", "w3")]
        moe = sw.moe.SparseMoE(*full, top_k=2)
        out, xt, rt = run(moe, x, router, g, dtype)
        check_all(moe, out, xt, rt, ref, dtype, DType.Float32, 2)


# ---------------------------------------------------------------- memory: a budget smaller than the routed experts


@pytest.mark.parametrize("experts_held", [1.5, 3.5], ids=["depth0", "depth1"])
@pytest.mark.parametrize("dtype", [DType.Float32, DType.BFloat16], ids=lambda d: d.name)
def test_a_budget_smaller_than_the_routed_experts(dtype, experts_held):
    x, router, w1, w2, w3, g = problem(BASE_SEED + 300, dtype, 2)
    ref = Reference(x, router, w1, w2, w3, g, 2, True)
    check_margin(ref, dtype)
    free = build(w1, w2, w3, dtype, top_k=2)
    out_free, x_free, r_free = run(free, x, router, g, dtype)
    weight_bytes = 3 * I * H * np.dtype(NP[dtype]).itemsize  # one expert's three tiles
    grad_bytes = 3 * I * H * 4  # their Float32 gradient tiles
    max_bytes = int(experts_held * (weight_bytes + grad_bytes))
    routed = len(set(ref.indices.reshape(-1).tolist()))
    assert max_bytes < routed * (weight_bytes + grad_bytes)
    budget = ResidencyBudget(max_bytes)
    moe = build(w1, w2, w3, dtype, top_k=2, budget=budget)
    assert moe.prefetch_depth(True) == (1 if experts_held > 3 else 0)
    for step in range(2):  # the second backward adds into gradient tiles that were evicted
        budget.reset_peak()
        out, xt, rt = run(moe, x, router, g, dtype)
        stats = budget.stats()
        # Admission evicts before a tile becomes resident, in the calling thread (forward, backward and the
        # projections in flight beside the current expert all admit from it): the bound holds without slack.
        assert stats["peak_bytes"] <= max_bytes, stats
        assert stats["evictions"] > 0
        np.testing.assert_array_equal(values(out), values(out_free))
        np.testing.assert_array_equal(values(xt.grad), values(x_free.grad))
        np.testing.assert_array_equal(values(rt.grad), values(r_free.grad))
    got, want = grads_of(moe), grads_of(free)
    for name in ("w1", "w2", "w3"):
        # Two steps of the same gradient: 2 G, summed in Float32 (one rounding) then rounded once to the dtype.
        bound = (UNIT[dtype] + U32) * 2 * np.abs(want[name]) + 1e-30
        assert_within(name, got[name], 2 * want[name], bound)
    assert moe.stats()["expert_visits"] == 4 * routed


@pytest.mark.parametrize("dtype", [DType.Float32, DType.BFloat16], ids=lambda d: d.name)
def test_later_backwards_add_into_the_held_gradient(dtype):
    """A second backward adds each dW into the resident .grad tile in place; a .grad the caller holds is left as
    it was (the sum is a fresh gradient then)."""
    x, router, w1, w2, w3, g = problem(BASE_SEED + 350, dtype, 2)
    moe = build(w1, w2, w3, dtype, top_k=2)
    run(moe, x, router, g, dtype)
    one = grads_of(moe)
    run(moe, x, router, g, dtype)
    two = grads_of(moe)
    held = moe.w1.grad
    version = held.carrier.version
    run(moe, x, router, g, dtype)
    three = grads_of(moe)
    assert held.carrier.version == version and moe.w1.grad is not held
    np.testing.assert_array_equal(values(held).transpose(2, 0, 1), two["w1"])
    u = UNIT[dtype] + U32  # each step: a Float32 sum rounded once to the .grad's dtype
    for name in ("w1", "w2", "w3"):
        assert_within(f"2 {name}", two[name], 2 * one[name], u * 2 * np.abs(one[name]) + 1e-30)
        assert_within(f"3 {name}", three[name], 3 * one[name], u * (2 + 3) * np.abs(one[name]) + 1e-30)


# ---------------------------------------------------------------- prefetch and statistics


def test_prefetch_makes_the_next_call_hit_and_stats_count():
    moe, x, xt, rt, (_, _, indices) = routed_block(BASE_SEED + 400)
    routed = sorted(set(np.asarray(indices).reshape(-1).tolist()))
    handle = moe.prefetch(indices)
    assert handle is not None
    handle.wait()
    assert moe.prefetch(indices) is None  # every tile is resident already
    stats = moe.stats()
    assert stats["tiles_promoted"] == 3 * len(routed)
    assert stats["bytes_promoted"] == 3 * len(routed) * I * H * 4
    with sw.no_grad():
        moe(xt, rt)
    stats = moe.stats()
    assert stats["calls"] == 1 and stats["expert_visits"] == len(routed) and stats["hits"] == len(routed)
    assert stats["tiles_promoted"] == 3 * len(routed) and stats["wait_seconds"] >= 0
    moe.reset_stats()
    assert moe.stats() == dict(calls=0, expert_visits=0, hits=0, tiles_promoted=0, bytes_promoted=0,
                               wait_seconds=0.0)


def test_no_grad_records_nothing_and_properties():
    dtype = DType.BFloat16
    x, router, w1, w2, w3, g = problem(BASE_SEED + 500, dtype, 2)
    moe = build(w1, w2, w3, dtype, top_k=2, normalize=False, routing_dtype=dtype)
    with sw.no_grad():
        out = moe.forward(dense(x, dtype), dense(router, dtype))
    assert out.autograd_ctx is None
    assert (moe.top_k, moe.normalize, moe.num_experts, moe.hidden_size, moe.intermediate_size) == (2, False, E, H, I)
    assert moe.dtype is DType.BFloat16 and moe.routing_dtype is DType.BFloat16 and moe.budget is None
    assert moe.w1.shape == sw.Shape(I, H, E) and moe.w2.shape == sw.Shape(H, I, E)
    assert "SparseMoE(experts=6" in repr(moe)


# ---------------------------------------------------------------- errors: type, message, nothing changed


def error_cases():
    rng = np.random.default_rng(BASE_SEED + 600)
    f32 = DType.Float32
    w1 = rng.standard_normal((E, I, H))
    w2 = rng.standard_normal((E, H, I))
    good = lambda: (tiled(w1, f32), tiled(w2, f32), tiled(w1, f32))  # noqa: E731
    cases = []

    def add(name, make, exc, fragment):
        cases.append(pytest.param(make, exc, fragment, id=name))

    add("w1 not a tensor", lambda: (("w1",) + good()[1:], {}), TypeError, "w1 must be a Tensor")
    add("dense weight", lambda: ((dense(np.zeros((I, H)), f32),) + good()[1:], {}), TypeError,
        "must be a tensor over a TiledEvictable")
    add("dtypes differ", lambda: ((tiled(w1, DType.BFloat16),) + good()[1:], {}), TypeError, "share one dtype")
    add("w2 shape", lambda: ((good()[0], tiled(w1, f32), good()[2]), {}), ValueError, "w2 must have shape")
    add("w3 shape", lambda: ((good()[0], good()[1], tiled(rng.standard_normal((E, I, H + 1)), f32)), {}), ValueError,
        "w3 must have shape")
    add("top_k zero", lambda: (good(), dict(top_k=0)), ValueError, "top_k must be in [1, 6]")
    add("top_k too large", lambda: (good(), dict(top_k=E + 1)), ValueError, "top_k must be in [1, 6]")
    add("top_k float", lambda: (good(), dict(top_k=2.0)), TypeError, "top_k must be an int")
    add("normalize int", lambda: (good(), dict(normalize=1)), TypeError, "normalize must be a bool")
    add("routing dtype", lambda: (good(), dict(routing_dtype=DType.BFloat16)), TypeError,
        "routing_dtype must be Float32 or the block's dtype")
    add("routing not dtype", lambda: (good(), dict(routing_dtype="float32")), TypeError, "routing_dtype must be a DType")
    add("budget type", lambda: (good(), dict(budget=100)), TypeError, "budget must be a ResidencyBudget")
    return cases


@pytest.mark.parametrize("make, exc, fragment", error_cases())
def test_constructor_errors(make, exc, fragment):
    args, kwargs = make()
    budgets = [getattr(a, "carrier", None) for a in args]
    with pytest.raises(exc, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        sw.moe.SparseMoE(*args, **kwargs)
    for c in budgets:  # nothing joined a budget
        if isinstance(c, TiledEvictable):
            assert c.residency_budget is None


def test_grid_and_budget_errors_change_nothing():
    rng = np.random.default_rng(BASE_SEED + 700)
    f32 = DType.Float32
    w1, w2 = rng.standard_normal((E, I, H)), rng.standard_normal((E, H, I))
    # Two experts per tile: not one tile per expert.
    data = w1.reshape(-1).astype(np.float32)
    tier = sw.move(friendly.tensor(data), sw.FileBacked(dtype=f32))
    c = TiledEvictable(sw.CPU(0, dtype=f32), tier.carrier, (1, 1, E // 2), (I, H, 2))
    bad = sw.Tensor(c, 0, sw.Layout(sw.Shape(I, H, E), sw.Stride(H, 1, I * H)))
    with pytest.raises(ValueError, match="one tile per expert"):
        sw.moe.SparseMoE(bad, tiled(w2, f32), tiled(w1, f32))
    # A carrier under another budget: nothing joins the new one.
    other, mine = ResidencyBudget(1 << 30), ResidencyBudget(1 << 30)
    a, b, cc = tiled(w1, f32), tiled(w2, f32), tiled(w1, f32)
    cc.carrier.set_residency_budget(other)
    with pytest.raises(ValueError, match="already draws from another ResidencyBudget"):
        sw.moe.SparseMoE(a, b, cc, budget=mine)
    assert a.carrier.residency_budget is None and b.carrier.residency_budget is None
    assert mine.stats()["members"] == 0
    # The same carrier twice.
    with pytest.raises(ValueError, match="distinct TiledEvictables"):
        sw.moe.SparseMoE(a, b, a)


def test_call_errors_change_nothing():
    dtype = DType.Float32
    moe, x, xt, rt, (_, weights, indices) = routed_block(BASE_SEED + 800)
    router = np.asarray(rt).astype(np.float64)
    cases = [
        (lambda: moe(xt, "r"), TypeError, "router_weight must be a Tensor"),
        (lambda: moe(dense(x, DType.BFloat16), rt), TypeError, "x must be Float32"),
        (lambda: moe(dense(x[:, :-1], dtype), rt), ValueError, "x must have shape"),
        (lambda: moe(xt, dense(router[:-1], dtype)), ValueError, "router_weight must have shape"),
        (lambda: moe(tiled(x[None], dtype).carrier and sw.Tensor(tiled(x[None], dtype).carrier, 0,
                                                                 sw.Layout(sw.Shape(T, H, 1), sw.Stride(H, 1, T * H))),
                     rt), TypeError, "must be a CPU tensor"),
        (lambda: moe.experts(xt, dense(np.zeros((T, 2)), DType.BFloat16), indices), TypeError, "weights must be Float32"),
        (lambda: moe.experts(xt, weights, weights), TypeError, "indices must be Int32"),
        (lambda: moe.experts(xt, weights, friendly.tensor(np.full((T, 2), E, np.int32), dtype=DType.Int32)),
         IndexError, "outside \\[0, 6\\)"),
        (lambda: moe.experts(xt, dense(np.zeros((T, 3)), dtype), indices), ValueError, "weights must have shape"),
        (lambda: moe.prefetch(friendly.tensor(np.array([-1], np.int32), dtype=DType.Int32)), IndexError,
         "expert -1"),
        (lambda: moe.prefetch(weights), TypeError, "indices must be Int32"),
    ]
    for call, exc, fragment in cases:
        with pytest.raises(exc, match=fragment):
            call()
    assert moe.stats()["calls"] == 0 and moe.stats()["tiles_promoted"] == 0
    assert xt.grad is None and moe.w1.grad is None


# ---------------------------------------------------------------- the package


def test_the_module_is_part_of_the_package():
    import strideweave.moe

    assert sw.moe is strideweave.moe and sw.moe.SparseMoE is sw._core.SparseMoE
    gc.collect()
