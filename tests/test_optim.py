"""strideweave.optim against torch.optim (torch 2.13, single-tensor code path) on the same inputs.

The torch side keeps one nn.Parameter per expert (grad None for an expert no backward touched), which is exactly
what sw.optim does per tile. The gradients fed to torch are the values of the StrideWeave .grad after its backward,
so both sides step from bit-identical inputs.

Error bounds:
 * SGD: bound 0 (bit-exact). The update is torch's operations in torch's order, with fused multiply-adds where
   torch's CPU kernels fuse (add with alpha).
 * Adam/AdamW against torch.optim with its square root replaced by the correctly rounded one: bound 0. Every other
   operation is torch's, in its order, fused where torch fuses (lerp, addcmul). Torch's own Tensor.sqrt calls MKL's
   vectorised sqrt for 16 elements or more, which is not correctly rounded (measured: within 0.75 ulp of the exact
   root, so within 1 ulp of ours); test_adam_against_unpatched_torch_within_a_derived_bound covers that case.
 * BFloat16 weights with Float32 moments: the reference runs torch on Float32 copies of the BFloat16 weights, with
   torch's own Float32 state kept across steps, and rounds the weight to BFloat16 (nearest even) after each step,
   as sw does (widen, update in Float32, round once): the same Float32 arithmetic then the same rounding, bound 0.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261220

# 8 x 5 = 40 slots per tile: two 16-lane vectors and an 8-element tail, so both kernel paths run.
OUT, IN, E = 8, 5, 6
# The experts routed at each step (the others get no gradient: their tiles stay implicit zeros).
ROUTES = [[0, 2, 3], [2, 5], [0, 1, 2, 3, 4, 5], [4], [1, 2], [3, 5, 0]]


def seed_of(name):
    seed = BASE_SEED + sum(map(ord, name))
    print(f"seed {seed}")
    return seed


def expert_weight(experts, dtype=sw.DType.Float32, budget=None):
    """A TiledEvictable over a scratch-file tier of `experts` (E, OUT, IN), row-major tiles, and its full tensor."""
    data = np.ascontiguousarray(experts).reshape(-1)
    tier = sw.move(friendly.tensor(data), sw.FileBacked(dtype=dtype))
    c = TiledEvictable(sw.CPU(0, dtype=dtype), tier.carrier, (1, E), (OUT, IN), residency_budget=budget)
    return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), sw.Stride(IN, [1, OUT * IN])))


def experts_of(full):
    """The (E, OUT, IN) values of a full tensor (or its gradient), in its dtype."""
    a = np.asarray(full)
    return np.stack([a[:, IN * e:IN * (e + 1)] for e in range(E)])


def backward_grads(c, full, grads):
    """Drops full.grad and runs one backward per routed expert e: sum(w_e * grads[e]), whose gradient is grads[e]."""
    full.grad = None
    for e, g in grads.items():
        w = c.project(full, TileSelection([[0], [e]])).wait()
        sw.reduce_sum(sw.elementwise_mul(w, friendly.tensor(g)), "o i ->").backward()


def routed(full):
    g = full.grad
    return [e for e in range(E) if g.carrier.tile_state((0, e)).location != "implicit"]


def exact_sqrt(self):
    """The correctly rounded square root of a Float32 tensor (through Float64: one rounding of an exact value)."""
    return torch.sqrt(self.double()).to(self.dtype)


@contextlib.contextmanager
def correctly_rounded_sqrt():
    original = torch.Tensor.sqrt
    torch.Tensor.sqrt = exact_sqrt
    try:
        yield
    finally:
        torch.Tensor.sqrt = original


def step_both(full, route, opt, params, ref):
    """One step of both sides, torch's gradients the values of full.grad (None for an implicit tile)."""
    assert routed(full) == sorted(route)
    g = experts_of(full.grad)
    for e, p in enumerate(params):
        p.grad = torch.from_numpy(g[e].copy()) if e in route else None
    opt.step()
    with correctly_rounded_sqrt():
        ref.step()


def make_pair(kind, hyper, experts, dtype):
    """(sw carrier, full tensor, sw optimizer, torch parameters, torch optimizer) over the same initial experts."""
    c, full = expert_weight(experts, dtype)
    opt = getattr(sw.optim, kind)([full], **hyper)
    params = [torch.nn.Parameter(torch.from_numpy(experts[e].astype(np.float32))) for e in range(E)]
    ref = getattr(torch.optim, kind)(params, foreach=False, **hyper)
    return c, full, opt, params, ref


CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
    ("Adam", dict(lr=1e-2, betas=(0.3, 0.5))),  # beta1 < 0.5: torch's lerp takes its other branch
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=3e-2, betas=(0.85, 0.995), weight_decay=0.1)),
]


@pytest.mark.parametrize("kind,hyper", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_float32_bit_exact_against_torch(kind, hyper):
    rng = np.random.default_rng(seed_of(kind + repr(hyper)))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full, opt, params, ref = make_pair(kind, hyper, experts, sw.DType.Float32)
    steps = np.zeros(E, np.int64)
    for route in ROUTES:
        backward_grads(c, full, {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in route})
        step_both(full, route, opt, params, ref)
        steps[route] += 1
        got = experts_of(full)
        want = np.stack([p.detach().numpy() for p in params])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{kind} {hyper}: max |diff| " \
            f"{np.max(np.abs(got - want))}"  # bound 0: same operations, same order, same fusions
    state = opt.state(full)
    assert state["step"] == list(steps)
    s = opt.stats()
    assert s["steps"] == len(ROUTES)
    assert s["tiles_stepped"] == sum(len(r) for r in ROUTES)
    assert s["tiles_skipped"] == len(ROUTES) * E - s["tiles_stepped"]
    if kind == "SGD" and not hyper.get("momentum"):
        assert "momentum_buffer" in state and state["momentum_buffer"] is None
    else:
        names = ["momentum_buffer"] if kind == "SGD" else ["exp_avg", "exp_avg_sq"]
        for name in names:
            got = experts_of(state[name])
            for e, p in enumerate(params):
                want = ref.state[p][name].numpy() if p in ref.state else np.zeros((OUT, IN), np.float32)
                assert np.array_equal(got[e], want), name


@pytest.mark.parametrize("kind,hyper", [CASES[2], CASES[5], CASES[8]], ids=["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("dtype,np16", [(sw.DType.BFloat16, ml_dtypes.bfloat16), (sw.DType.Float16, np.float16)],
                         ids=["bf16", "fp16"])
def test_16bit_weights_with_float32_state_against_torch(kind, hyper, dtype, np16):
    """Reference: torch on Float32 copies of the 16-bit weights, its Float32 state kept, the weight rounded to 16 bits
    (nearest even) after each step. Bound 0 (see the module docstring)."""
    rng = np.random.default_rng(seed_of("16" + kind + repr(dtype)))
    experts = rng.standard_normal((E, OUT, IN)).astype(np16)
    c, full, opt, params, ref = make_pair(kind, hyper, experts, dtype)
    weights16 = experts.copy()
    for route in ROUTES:
        grads = {e: rng.standard_normal((OUT, IN)).astype(np16).astype(np.float32) for e in route}
        backward_grads(c, full, grads)
        assert full.grad.dtype() is dtype
        g = experts_of(full.grad).astype(np.float32)
        for e in route:
            assert np.array_equal(g[e], grads[e])  # representable: the 16-bit .grad holds it exactly
        for e, p in enumerate(params):
            with torch.no_grad():
                p.copy_(torch.from_numpy(weights16[e].astype(np.float32)))
            p.grad = torch.from_numpy(g[e].copy()) if e in route else None
        opt.step()
        with correctly_rounded_sqrt():
            ref.step()
        weights16 = np.stack([p.detach().numpy().astype(np16) for p in params])
        got = experts_of(full)
        assert got.dtype == np16
        assert np.array_equal(got.view(np.uint16), weights16.view(np.uint16))  # bound 0
    state = opt.state(full)
    for name in (["momentum_buffer"] if kind == "SGD" else ["exp_avg", "exp_avg_sq"]):
        assert state[name].dtype() is sw.DType.Float32  # Float32 state for 16-bit weights
        got = experts_of(state[name])
        for e, p in enumerate(params):
            if p in ref.state:
                assert np.array_equal(got[e], ref.state[p][name].numpy())


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adam_against_unpatched_torch_within_a_derived_bound(kind):
    """torch's own sqrt (MKL's, within 1 ulp). Bound, per weight: with s' = s (1 + d), |d| <= 2^-23, the update
    D = (c m) / (s / b + eps) of the two runs differs by at most 4 ulp of |D| (the relative change of s, and one
    differently rounded division, addition and division: 4 * 2^-23 |D|); the new weights fl(w + D) then differ by at
    most the old difference, that, and one rounding each (2^-24 |w_new| per run). The moments do not depend on the
    weights (no coupled weight decay), so they stay identical. Summed over the steps, with |D| and |w| taken from the
    torch run (a factor 2 covers the few ulps by which those differ from ours)."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.99)) if kind == "Adam" else dict(lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(seed_of("unpatched" + kind))
    out, inp = 16, 40  # 640 slots: MKL's vectorised path in torch
    experts = rng.standard_normal((E, out, inp)).astype(np.float32)
    data = np.ascontiguousarray(experts).reshape(-1)
    c = TiledEvictable(sw.CPU(0), sw.move(friendly.tensor(data), sw.FileBacked()).carrier, (1, E), (out, inp))
    full = sw.Tensor(c, 0, sw.Layout(sw.Shape(out, [inp, E]), sw.Stride(inp, [1, out * inp])))
    opt = getattr(sw.optim, kind)([full], **hyper)
    params = [torch.nn.Parameter(torch.from_numpy(experts[e].copy())) for e in range(E)]
    ref = getattr(torch.optim, kind)(params, foreach=False, **hyper)
    bound = np.zeros((E, out, inp))
    for route in ROUTES:
        full.grad = None
        for e in route:
            w = c.project(full, TileSelection([[0], [e]])).wait()
            g = rng.standard_normal((out, inp)).astype(np.float32)
            sw.reduce_sum(sw.elementwise_mul(w, friendly.tensor(g)), "o i ->").backward()
            params[e].grad = torch.from_numpy(g)
        for e in range(E):
            if e not in route:
                params[e].grad = None
        before = np.stack([p.detach().numpy().astype(np.float64) for p in params])
        opt.step()
        ref.step()
        after = np.stack([p.detach().numpy().astype(np.float64) for p in params])
        bound += 2 * (4 * 2.0**-23 * np.abs(after - before) + 2 * 2.0**-24 * np.abs(after))
        a = np.asarray(full).astype(np.float64)
        got = np.stack([a[:, inp * e:inp * (e + 1)] for e in range(E)])
        assert np.all(np.abs(got - after) <= bound)


def test_real_backward_swiglu_experts_against_torch():
    """Gradients from real backward passes (projection, matmul, silu, elementwise products) into the tiled .grad;
    torch steps with the same gradient values. AdamW, bound 0 (correctly rounded sqrt on both sides)."""
    rng = np.random.default_rng(seed_of("swiglu"))
    experts = (rng.standard_normal((E, OUT, IN)) * 0.5).astype(np.float32)
    c, full, opt, params, ref = make_pair("AdamW", dict(lr=1e-2, weight_decay=0.05), experts, sw.DType.Float32)
    tokens = 7
    for route in ROUTES:
        full.grad = None
        for e in route:
            w = c.project(full, TileSelection([[0], [e]])).wait()      # (OUT, IN)
            x = friendly.tensor(rng.standard_normal((tokens, IN)).astype(np.float32))
            h = sw.matmul(x, w)                                        # (tokens, OUT)
            up = friendly.tensor(rng.standard_normal((tokens, OUT)).astype(np.float32))
            sw.reduce_sum(sw.elementwise_mul(sw.silu(h), up), "t o ->").backward()
        step_both(full, route, opt, params, ref)
        want = np.stack([p.detach().numpy() for p in params])
        assert np.array_equal(experts_of(full), want)


def test_dense_parameter_is_one_tile():
    """A dense CPU tensor (a router weight) beside a tiled one: the same update over the whole tensor."""
    rng = np.random.default_rng(seed_of("dense"))
    router = rng.standard_normal((E, IN)).astype(np.float32)
    r = friendly.tensor(router.copy())
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full = expert_weight(experts)
    opt = sw.optim.Adam([r, full], lr=1e-2)
    p = torch.nn.Parameter(torch.from_numpy(router.copy()))
    ref = torch.optim.Adam([p], lr=1e-2, foreach=False)
    for step in range(3):
        g = rng.standard_normal((E, IN)).astype(np.float32)
        r.grad = friendly.tensor(g)
        p.grad = torch.from_numpy(g)
        opt.step()
        with correctly_rounded_sqrt():
            ref.step()
        assert np.array_equal(np.asarray(r), p.detach().numpy())
    assert opt.state(r)["step"] == [3]
    assert opt.state(full)["step"] == [0] * E  # no gradient: never stepped
    assert np.array_equal(experts_of(full), experts)


@pytest.mark.parametrize("prefetch", [False, True])
def test_budget_smaller_than_everything_gives_identical_values(prefetch):
    """Weights, gradients and both moments of all experts take 4 E tiles; the budget holds 6. The steps complete,
    every value equals the unbounded run's bit for bit, the peak stays under the bound, and moment tiles are
    evicted to their scratch file and read back. With prefetch, the next expert's tiles promote during an update."""
    rng = np.random.default_rng(seed_of("budget"))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    tile = OUT * IN * 4
    budget = sw.ResidencyBudget(6 * tile)
    runs = []
    for b in (None, budget):
        c, full = expert_weight(experts, budget=b)
        opt = sw.optim.Adam([full], lr=1e-2, weight_decay=0.01)
        assert opt.prefetch is False
        opt.prefetch = prefetch
        state = opt.state(full)
        if b is not None:
            assert state["exp_avg"].carrier.residency_budget is b
            assert state["exp_avg_sq"].carrier.residency_budget is b
        assert all(state["exp_avg"].carrier.tile_state((0, e)).location == "implicit" for e in range(E))
        step_rng = np.random.default_rng(1)
        for route in ROUTES:
            backward_grads(c, full, {e: step_rng.standard_normal((OUT, IN)).astype(np.float32) for e in route})
            opt.step()
        runs.append((experts_of(full), experts_of(state["exp_avg"]), experts_of(state["exp_avg_sq"]), opt.stats()))
    for k in range(3):
        assert np.array_equal(runs[0][k], runs[1][k])
    s = budget.stats()
    assert s["peak_bytes"] <= s["max_bytes"] == 6 * tile
    assert s["evictions"] > 0
    stats = runs[1][3]
    assert stats["state"]["bytes_evicted"] > 0 and stats["state"]["bytes_promoted"] > 0  # written out, read back
    assert stats["weights"]["bytes_promoted"] > 0
    assert (stats["prefetches"] > 0) == prefetch


def test_zero_grad_drops_gradients_and_untouched_tiles_stay_implicit():
    rng = np.random.default_rng(seed_of("zero_grad"))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full = expert_weight(experts)
    opt = sw.optim.SGD([full], lr=0.1, momentum=0.9)
    backward_grads(c, full, {1: np.ones((OUT, IN), np.float32)})
    opt.step()
    buf = opt.state(full)["momentum_buffer"].carrier
    assert [buf.tile_state((0, e)).location for e in range(E)] == ["implicit"] + ["primary"] + ["implicit"] * 4
    opt.zero_grad()
    assert full.grad is None
    before = experts_of(full)
    opt.step()  # no gradient: every tile skipped, nothing changes
    assert np.array_equal(experts_of(full), before)
    assert opt.stats()["tiles_skipped"] == E - 1 + E
    assert opt.state(full)["step"] == [0, 1, 0, 0, 0, 0]


# ---------------------------------------------------------------- errors: type, message, nothing changed

def fresh():
    experts = np.arange(E * OUT * IN, dtype=np.float32).reshape(E, OUT, IN) / 100
    c, full = expert_weight(experts)
    return c, full, experts


@pytest.mark.parametrize("make,exc,fragment", [
    (lambda p: sw.optim.SGD(p, lr=-0.1), ValueError, "invalid learning rate lr -0.1"),
    (lambda p: sw.optim.Adam(p, lr=-1.0), ValueError, "invalid learning rate lr"),
    (lambda p: sw.optim.Adam(p, betas=(1.0, 0.9)), ValueError, "beta at index 0"),
    (lambda p: sw.optim.Adam(p, betas=(0.9, -0.1)), ValueError, "beta at index 1"),
    (lambda p: sw.optim.AdamW(p, betas=(0.9,)), ValueError, "betas must be a pair"),
    (lambda p: sw.optim.AdamW(p, eps=-1e-8), ValueError, "invalid eps"),
    (lambda p: sw.optim.AdamW(p, weight_decay=-1.0), ValueError, "invalid weight_decay"),
    (lambda p: sw.optim.SGD(p, lr=0.1, momentum=-0.5), ValueError, "invalid momentum"),
    (lambda p: sw.optim.SGD(p, lr=0.1, nesterov=True), ValueError, "nesterov momentum requires"),
    (lambda p: sw.optim.SGD(p, lr="0.1"), TypeError, "lr must be a float"),
    (lambda p: sw.optim.SGD(p + p, lr=0.1), ValueError, "listed twice"),
    (lambda p: sw.optim.SGD([], lr=0.1), ValueError, "empty parameter list"),
    (lambda p: sw.optim.SGD(p[0], lr=0.1), TypeError, "params must be an iterable of Tensors"),
    (lambda p: sw.optim.SGD([p[0], 3], lr=0.1), TypeError, "parameter 1 must be a Tensor"),
    (lambda p: sw.optim.SGD([p[0], sw.mul(friendly.tensor(np.ones(3, np.float32)), 2.0)], lr=0.1), ValueError,
     "parameter 1 is not a leaf"),
    (lambda p: sw.optim.SGD([sw.Tensor(sw.CPU(4, dtype=sw.DType.Int32), 0, sw.Layout(sw.Shape(4), sw.Stride(1)))],
                            lr=0.1), TypeError, "has dtype Int32"),
    (lambda p: sw.optim.SGD([sw.Tensor(p[0].carrier, 0, sw.Layout(sw.Shape(OUT, [IN, 1]), sw.Stride(IN, [1, 1])))],
                            lr=0.1), ValueError, "must view the whole extent"),
])
def test_construction_errors_change_nothing(make, exc, fragment):
    c, full, experts = fresh()
    with pytest.raises(exc, match=fragment):
        make([full])
    assert np.array_equal(experts_of(full), experts)
    assert full.grad is None
    assert c.stats()["primary_tiles"] == 0  # nothing promoted


def test_bad_gradient_changes_nothing():
    """The second parameter's gradient has the right shape but another layout: step() refuses before the first
    parameter (whose gradient is fine) moves."""
    c1, full1, experts = fresh()
    c2, full2, _ = fresh()
    opt = sw.optim.Adam([full1, full2], lr=0.1)
    backward_grads(c1, full1, {0: np.ones((OUT, IN), np.float32)})
    column_major = sw.Layout(sw.Shape(OUT, [IN, E]), sw.Stride(1, [OUT, OUT * IN]))  # full2's tiles are row-major
    full2.grad = sw.Tensor(sw.move(friendly.tensor(np.ones(OUT * IN * E, np.float32)), sw.CPU(0)).carrier, 0,
                           column_major)
    with pytest.raises(ValueError, match="must have its parameter's layout"):
        opt.step()
    assert np.array_equal(experts_of(full1), experts) and np.array_equal(experts_of(full2), experts)
    assert opt.state(full1)["step"] == [0] * E and opt.stats()["steps"] == 0
    # The same layout over a dense carrier: still not a tiled gradient.
    full2.grad = sw.Tensor(sw.move(friendly.tensor(np.ones(OUT * IN * E, np.float32)), sw.CPU(0)).carrier, 0,
                           full2.layout)
    with pytest.raises(ValueError, match="must be a tiled gradient of that geometry"):
        opt.step()
    assert np.array_equal(experts_of(full1), experts)
    full2.grad = None
    opt.step()  # now it steps
    assert opt.state(full1)["step"] == [1, 0, 0, 0, 0, 0]


def test_budget_too_small_for_one_tile_and_its_state():
    c, full, experts = fresh()
    tile = OUT * IN * 4
    c.set_residency_budget(sw.ResidencyBudget(3 * tile))  # weight, gradient and two moments need 4
    opt = sw.optim.Adam([full], lr=0.1)
    backward_grads(c, full, {2: np.ones((OUT, IN), np.float32)})
    with pytest.raises(ValueError, match="more than its ResidencyBudget's max_bytes"):
        opt.step()
    assert np.array_equal(experts_of(full), experts)
    assert opt.state(full)["step"] == [0] * E


def test_state_of_a_tensor_that_is_not_a_parameter():
    c, full, _ = fresh()
    opt = sw.optim.SGD([full], lr=0.1)
    with pytest.raises(ValueError, match="not one of this optimizer's parameters"):
        opt.state(friendly.tensor(np.ones(3, np.float32)))
    assert opt.params[0] is full


def test_more_parameter_errors_change_nothing(tmp_path):
    c, full, experts = fresh()
    path = tmp_path / "w.f32"
    np.ones(8, np.float32).tofile(path)
    read_only = sw.Tensor(sw.FileBacked(str(path), mutable=False), 0, sw.Layout(sw.Shape(8), sw.Stride(1)))
    with pytest.raises(ValueError, match="parameter 0 is read-only"):
        sw.optim.SGD([read_only], lr=0.1)
    on_file = sw.Tensor(sw.move(friendly.tensor(np.ones(8, np.float32)), sw.FileBacked()).carrier, 0,
                        sw.Layout(sw.Shape(8), sw.Stride(1)))
    with pytest.raises(ValueError, match="a parameter is a TiledEvictable or a dense CPU tensor"):
        sw.optim.SGD([on_file], lr=0.1)
    strided = sw.Tensor(sw.CPU(10), 0, sw.Layout(sw.Shape(5), sw.Stride(2)))
    with pytest.raises(ValueError, match="is not compact"):
        sw.optim.Adam([strided])
    again = sw.Tensor(c, 0, full.layout)  # another tensor over the same carrier
    with pytest.raises(ValueError, match="parameters 0 and 1 view one carrier"):
        sw.optim.Adam([full, again])
    with pytest.raises(ValueError, match="invalid dampening"):
        sw.optim.SGD([full], lr=0.1, dampening=float("nan"))
    with pytest.raises(ValueError, match="algorithm must be 'SGD', 'Adam' or 'AdamW'"):
        sw._core.Optimizer("Lion", [full], 0.1, 0.0, 0.0, False, 0.9, 0.999, 1e-8, 0.0)
    assert np.array_equal(experts_of(full), experts) and c.stats()["primary_tiles"] == 0
    assert np.array_equal(np.fromfile(path, np.float32), np.ones(8, np.float32))


def test_more_gradient_errors_change_nothing():
    c, full, experts = fresh()
    opt = sw.optim.SGD([full], lr=0.1)
    full.grad = sw.Tensor(sw.CPU(OUT * IN * E, dtype=sw.DType.Int32), 0, full.layout)
    with pytest.raises(TypeError, match="the gradient of parameter 0 has dtype Int32"):
        opt.step()
    full.grad = full  # the parameter's own carrier
    with pytest.raises(ValueError, match="the parameter's own carrier"):
        opt.step()
    backward_grads(c, full, {0: np.ones((OUT, IN), np.float32)})
    g = full.grad
    g.carrier.release()
    with pytest.raises(ValueError, match="over a released carrier"):
        opt.step()
    assert np.array_equal(experts_of(full), experts) and opt.stats()["steps"] == 0
    router = friendly.tensor(np.ones(4, np.float32))
    opt2 = sw.optim.SGD([router], lr=0.1)
    router.grad = sw.Tensor(sw.move(friendly.tensor(np.ones(4, np.float32)), sw.FileBacked()).carrier, 0,
                            router.layout)
    with pytest.raises(ValueError, match="it must be dense CPU memory"):
        opt2.step()
    assert np.array_equal(np.asarray(router), np.ones(4, np.float32))


def test_bf16_checkpoint_experts_against_torch(tmp_path):
    """The experts of a BFloat16 safetensors checkpoint, opened where they lie (ckpt.tiled: (out, in, E), row-major
    tiles): AdamW steps them in memory and leaves the file alone. Reference and bound (0) as for 16-bit weights."""
    from safetensors.torch import save_file
    rng = np.random.default_rng(seed_of("checkpoint"))
    experts = rng.standard_normal((E, OUT, IN)).astype(ml_dtypes.bfloat16)
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(E)]
    path = tmp_path / "model.safetensors"
    save_file({n: torch.from_numpy(experts[e].astype(np.float32)).to(torch.bfloat16) for e, n in enumerate(names)},
              str(path))
    before = path.read_bytes()
    full = sw.safetensors.open(path).tiled(names)
    assert full.layout.shape == sw.Shape(OUT, IN, E) and full.dtype() is sw.DType.BFloat16
    hyper = dict(lr=1e-2, weight_decay=0.1)
    opt = sw.optim.AdamW([full], **hyper)
    params = [torch.nn.Parameter(torch.zeros(OUT, IN)) for _ in range(E)]
    ref = torch.optim.AdamW(params, foreach=False, **hyper)
    weights16 = experts.copy()
    for route in ([0, 2], [2, 3], [5]):
        full.grad = None
        grads = {}
        for e in route:
            w = full.carrier.project(full, TileSelection(((0,), (0,), (e,)))).wait()   # (OUT, IN, 1)
            grads[e] = rng.standard_normal((OUT, IN)).astype(ml_dtypes.bfloat16).astype(np.float32)
            sw.reduce_sum(sw.elementwise_mul(w, friendly.tensor(grads[e].reshape(OUT, IN, 1))), "o i e ->").backward()
        for e, p in enumerate(params):
            with torch.no_grad():
                p.copy_(torch.from_numpy(weights16[e].astype(np.float32)))
            p.grad = torch.from_numpy(grads[e]) if e in route else None
        opt.step()
        with correctly_rounded_sqrt():
            ref.step()
        weights16 = np.stack([p.detach().numpy().astype(ml_dtypes.bfloat16) for p in params])
        got = np.moveaxis(np.asarray(full), -1, 0)
        assert np.array_equal(got.view(np.uint16), weights16.view(np.uint16))  # bound 0
    assert opt.state(full)["step"] == [1, 0, 2, 1, 0, 1]
    assert path.read_bytes() == before
