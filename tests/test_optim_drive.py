"""Driving strideweave.optim from outside: hyperparameters changed between steps, the gradients' total norm and
their scaling (clipping), and the optimizer state saved to and restored from a safetensors file.

The comparisons with torch.optim follow tests/test_optim.py (their helpers are imported from there): one nn.Parameter per
expert on the torch side (grad None for an expert no backward touched), fed the values of the StrideWeave .grad, so
both sides step from bit-identical inputs; torch's Tensor.sqrt replaced by the correctly rounded one. With those
inputs the update is torch's operations in torch's order with torch's fusions: bound 0 (bit for bit), whatever the
hyperparameters of each step, since they enter the arithmetic as the same Python floats rounded the same way.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly

torch = pytest.importorskip("torch")

# The experts, their routes and the helpers of tests/test_optim.py (the same geometry and arithmetic checks).
from test_optim import E, IN, OUT, ROUTES, backward_grads, expert_weight, experts_of, routed, step_both  # noqa: E402

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20270117


def seed_of(name):
    seed = BASE_SEED + sum(map(ord, name))
    print(f"seed {seed}")
    return seed


def make_pair(kind, hyper, experts, dtype=sw.DType.Float32, budget=None):
    """(sw carrier, full tensor, sw optimizer, torch parameters, torch optimizer) over the same initial experts."""
    c, full = expert_weight(experts, dtype, budget)
    opt = getattr(sw.optim, kind)([full], **hyper)
    params = [torch.nn.Parameter(torch.from_numpy(experts[e].astype(np.float32))) for e in range(E)]
    ref = getattr(torch.optim, kind)(params, foreach=False, **hyper)
    return c, full, opt, params, ref


def assert_same_weights(full, params, what):
    got = experts_of(full)
    want = np.stack([p.detach().numpy() for p in params])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"{what}: max |diff| {np.max(np.abs(got - want))}"  # bound 0 (module docstring)


# ---------------------------------------------------------------- 1. hyperparameters between steps

# What torch's schedulers change: OneCycleLR changes lr every step and, with cycle_momentum, SGD's momentum or
# Adam's beta1 too (nesterov stays off: it needs dampening 0, which this SGD case has not).
SCHEDULE_CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("Adam", dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)),
    ("AdamW", dict(lr=3e-2, betas=(0.85, 0.995), weight_decay=0.1)),
]


@pytest.mark.parametrize("kind,hyper", SCHEDULE_CASES, ids=["SGD", "SGD-nesterov", "Adam", "AdamW"])
def test_scheduled_hyperparameters_bit_exact_against_torch(kind, hyper):
    """torch.optim.lr_scheduler.OneCycleLR drives torch's optimizer; its param group's values are copied onto the
    sw optimizer before each step (as a torch-side wrapper does). Bound 0 (module docstring)."""
    rng = np.random.default_rng(seed_of("sched" + kind + repr(hyper)))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full, opt, params, ref = make_pair(kind, hyper, experts)
    sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=hyper["lr"] * 4, total_steps=len(ROUTES) + 1,
                                                base_momentum=0.5, max_momentum=0.95)
    seen = set()
    for route in ROUTES:
        group = ref.param_groups[0]
        opt.lr = group["lr"]
        if kind == "SGD":
            opt.momentum = group["momentum"]
            assert opt.momentum == group["momentum"]
        else:
            opt.betas = group["betas"]
            assert opt.betas == tuple(group["betas"])
        assert opt.lr == group["lr"]
        seen.add(opt.lr)
        backward_grads(c, full, {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in route})
        step_both(full, route, opt, params, ref)
        assert_same_weights(full, params, f"{kind} at lr {opt.lr}")
        sched.step()
    assert len(seen) == len(ROUTES)  # the learning rate really changed at every step


@pytest.mark.parametrize("kind,hyper,changes", [
    # Momentum switched on with dampening at a step where most tiles have stepped before: their buffers start from
    # the gradient (undampened), not from a zero buffer; then off (buffers kept, unused), on again, nesterov.
    ("SGD", dict(lr=0.05), [dict(weight_decay=0.03, dampening=0.4), dict(momentum=0.9), dict(momentum=0.0),
                            dict(momentum=0.7), dict(dampening=0.0, nesterov=True)]),
    ("Adam", dict(lr=1e-2), [dict(eps=1e-3), dict(weight_decay=0.2), dict(betas=(0.3, 0.5)), dict(lr=0.05),
                             dict(betas=(0.95, 0.9999), eps=0.0)]),
    ("AdamW", dict(lr=1e-2), [dict(weight_decay=0.0), dict(weight_decay=0.3), dict(eps=1e-2),
                              dict(betas=(0.5, 0.7)), dict(lr=0.0)]),
], ids=["SGD", "Adam", "AdamW"])
def test_every_hyperparameter_changed_between_steps_bit_exact(kind, hyper, changes):
    """Each hyperparameter changed in turn (SGD's momentum switched on mid-run: each tile's buffer starts from its
    gradient on its first step with momentum, as torch's None buffer does; switched off, kept, and on again). torch's
    param group gets the same values. Bound 0."""
    rng = np.random.default_rng(seed_of("each" + kind))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full, opt, params, ref = make_pair(kind, hyper, experts)
    for route, change in zip(ROUTES, [{}] + changes):
        for name, value in change.items():
            setattr(opt, name, value)
            ref.param_groups[0][name] = value
            assert getattr(opt, name) == value
        backward_grads(c, full, {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in route})
        step_both(full, route, opt, params, ref)
        assert_same_weights(full, params, f"{kind} after {change}")
    if kind == "SGD":  # the buffers kept across the momentum-0 step are torch's
        got = experts_of(opt.state(full)["momentum_buffer"])
        for e, p in enumerate(params):
            if ref.state[p].get("momentum_buffer") is not None:
                assert np.array_equal(got[e], ref.state[p]["momentum_buffer"].numpy())


def test_dense_parameter_lr_changed_between_steps():
    """A dense parameter (one tile) follows a changed lr and a momentum switched on at its second step (with
    dampening: its buffer starts from the gradient, undampened, as torch's). Bound 0."""
    rng = np.random.default_rng(seed_of("dense-lr"))
    w0 = rng.standard_normal((4, 6)).astype(np.float32)
    w = friendly.tensor(w0.copy())
    opt = sw.optim.SGD([w], lr=0.1)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    ref = torch.optim.SGD([p], lr=0.1, foreach=False)
    for k, (lr, momentum) in enumerate([(0.1, 0.0), (0.02, 0.9), (0.3, 0.9), (0.05, 0.5)]):
        opt.lr, opt.momentum, opt.dampening = lr, momentum, 0.3
        ref.param_groups[0].update(lr=lr, momentum=momentum, dampening=0.3)
        g = rng.standard_normal((4, 6)).astype(np.float32)
        w.grad = friendly.tensor(g)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        ref.step()
        assert np.array_equal(np.asarray(w).view(np.uint32), p.detach().numpy().view(np.uint32)), k


ABSENT = {"SGD": ["betas", "eps"], "Adam": ["momentum", "dampening", "nesterov"],
          "AdamW": ["momentum", "dampening", "nesterov"]}


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_hyperparameter_the_algorithm_lacks_is_an_attribute_error(kind):
    c, full = expert_weight(np.zeros((E, OUT, IN), np.float32))
    opt = getattr(sw.optim, kind)([full], lr=0.1)
    for name in ABSENT[kind]:
        with pytest.raises(AttributeError):
            getattr(opt, name)
        with pytest.raises(AttributeError, match=f"no hyperparameter '{name}'"):
            setattr(opt, name, 0.5)
        assert name not in vars(opt)
    assert opt.lr == 0.1


SETTER_ERRORS = [
    ("SGD", dict(lr=0.1), "lr", -1.0, ValueError, "invalid learning rate lr -1"),
    ("SGD", dict(lr=0.1), "lr", float("nan"), ValueError, "invalid learning rate lr"),
    ("SGD", dict(lr=0.1), "lr", "0.1", TypeError, "lr must be a float"),
    ("SGD", dict(lr=0.1), "weight_decay", -0.1, ValueError, "invalid weight_decay"),
    ("SGD", dict(lr=0.1), "momentum", -0.5, ValueError, "invalid momentum"),
    ("SGD", dict(lr=0.1), "dampening", float("inf"), ValueError, "invalid dampening"),
    ("SGD", dict(lr=0.1), "nesterov", True, ValueError, "nesterov momentum requires momentum > 0"),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True), "momentum", 0.0, ValueError, "nesterov momentum requires"),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True), "dampening", 0.1, ValueError, "nesterov momentum requires"),
    ("Adam", dict(lr=0.1), "betas", (1.0, 0.9), ValueError, "invalid beta at index 0"),
    ("Adam", dict(lr=0.1), "betas", (0.9, -0.1), ValueError, "invalid beta at index 1"),
    ("AdamW", dict(lr=0.1), "betas", (0.9,), ValueError, "betas must be a pair"),
    ("AdamW", dict(lr=0.1), "eps", -1e-8, ValueError, "invalid eps"),
    ("AdamW", dict(lr=0.1), "weight_decay", float("nan"), ValueError, "invalid weight_decay"),
]


@pytest.mark.parametrize("kind,hyper,name,value,exc,fragment", SETTER_ERRORS,
                         ids=[f"{k}-{n}-{v}" for k, _, n, v, _, _ in SETTER_ERRORS])
def test_setter_errors_change_nothing(kind, hyper, name, value, exc, fragment):
    rng = np.random.default_rng(seed_of("err" + kind + name))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full, opt, params, ref = make_pair(kind, hyper, experts)
    before = {n: getattr(opt, n) for n in ["lr", "weight_decay"] + (
        ["momentum", "dampening", "nesterov"] if kind == "SGD" else ["betas", "eps"])}
    with pytest.raises(exc, match=fragment):
        setattr(opt, name, value)
    assert {n: getattr(opt, n) for n in before} == before
    # The next step is still torch's with the constructor's values.
    backward_grads(c, full, {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in ROUTES[0]})
    step_both(full, ROUTES[0], opt, params, ref)
    assert_same_weights(full, params, "after a refused setter")


# ---------------------------------------------------------------- 2. the gradients' norm and their scaling

# Error bounds for grad_norm (n values in all, k tensors on the torch side, u32 = 2^-24, u64 = 2^-53, u16 = 2^-8 for
# BFloat16's 8-bit significand):
#  * against the Float64 reference (numpy over the same values in Float64): both sides sum the same n terms in
#    Float64; |x|^2 of a 24-bit significand is exact in Float64, |x| and |x|^p within one rounding (pow: within
#    1 ulp, 2 u64); each sum of n non-negative terms is within (n - 1) u64 relatively, whatever the order; the root
#    (^(1/p)) divides a relative error by p and adds 2 u64. Relative bound: 2 (n + 4) u64 max(1, 1/p). Exact for inf.
#  * against torch.nn.utils.get_total_norm, which computes in the gradients' dtype (Float32 accumulation per tensor,
#    then the norm of the k norms): each term within 2 u32 (pow in Float32), each sum within (n - 1) u32, each root
#    within 2 u32 (plus the same division by p): relative (n + k + 8) 2 u32 max(1, 1/p); for BFloat16 gradients
#    torch also rounds each tensor's norm and the total to BFloat16: 2 u16 more. Exact for inf.
U32, U64, U16 = 2.0 ** -24, 2.0 ** -53, 2.0 ** -8


def grads_setup(dtype, np_dtype, rng, budget_tiles):
    """A tiled parameter of E experts under a budget of `budget_tiles` Float32 tiles (weights and gradients both
    draw from it), gradients for experts 0, 1, 3 and 4 (2 and 5 stay implicit zeros), a dense parameter with a
    gradient and one without. Returns (budget, params, tiled full, expected gradient arrays per parameter)."""
    budget = sw.ResidencyBudget(budget_tiles * OUT * IN * 4)
    experts = rng.standard_normal((E, OUT, IN)).astype(np_dtype)
    c, full = expert_weight(experts, dtype, budget)
    routes = [0, 1, 3, 4]
    # Values representable in the gradient's dtype, so the .grad holds them exactly; spread over a few binades.
    grads = {e: (rng.standard_normal((OUT, IN)) * 2.0 ** rng.integers(-3, 4)).astype(np_dtype).astype(np.float32)
             for e in routes}
    backward_grads(c, full, grads)
    assert routed(full) == routes
    dense = friendly.tensor(rng.standard_normal((3, 7)).astype(np.float32))
    dense_grad = (rng.standard_normal((3, 7)) * 0.25).astype(np.float32)
    dense.grad = friendly.tensor(dense_grad.copy())
    no_grad = friendly.tensor(np.ones((2, 2), np.float32))
    expected = [grads[e] for e in routes] + [dense_grad]
    return budget, [full, dense, no_grad], full, expected


NORMS = [2.0, 1.0, 3.0, 0.5, float("inf")]


@pytest.mark.parametrize("norm_type", NORMS, ids=[str(p) for p in NORMS])
@pytest.mark.parametrize("dtype,np_dtype,torch_dtype", [
    (sw.DType.Float32, np.float32, torch.float32), (sw.DType.BFloat16, ml_dtypes.bfloat16, torch.bfloat16)],
    ids=["f32", "bf16"])
def test_grad_norm_against_float64_and_torch(norm_type, dtype, np_dtype, torch_dtype):
    rng = np.random.default_rng(seed_of(f"norm{norm_type}{dtype}"))
    budget, params, full, expected = grads_setup(dtype, np_dtype, rng, budget_tiles=3)
    gc = full.grad.carrier
    assert full.grad.dtype() is dtype
    states = [gc.tile_state((0, e)).location for e in range(E)]
    assert states[2] == states[5] == "implicit"
    assert "secondary" in states  # the budget evicted gradient tiles: the norm reads them back
    promotions = gc.stats()["promotions"]
    budget.reset_peak()
    got = sw.optim.grad_norm(params, norm_type)
    assert isinstance(got, float)
    assert budget.stats()["peak_bytes"] <= budget.max_bytes
    assert gc.stats()["promotions"] > promotions
    assert [gc.tile_state((0, e)).location for e in (2, 5)] == ["implicit", "implicit"]
    values = np.concatenate([g.reshape(-1) for g in expected]).astype(np.float64)
    n, k = values.size, len(expected)
    if math.isinf(norm_type):
        want = float(np.max(np.abs(values)))
        assert got == want
    else:
        want = float(np.sum(np.abs(values) ** norm_type) ** (1.0 / norm_type))
        assert abs(got - want) <= 2 * (n + 4) * U64 * max(1.0, 1.0 / norm_type) * want
    ref = torch.nn.utils.get_total_norm([torch.from_numpy(g).to(torch_dtype) for g in expected], norm_type)
    bound = 2 * (n + k + 8) * U32 * max(1.0, 1.0 / norm_type) + (2 * U16 if torch_dtype == torch.bfloat16 else 0)
    if math.isinf(norm_type):
        assert got == float(ref)
    else:
        assert abs(got - float(ref)) <= bound * want, (got, float(ref))


def test_grad_norm_without_gradients_is_zero_and_nan_propagates():
    a, b = friendly.tensor(np.ones((2, 3), np.float32)), friendly.tensor(np.ones(4, np.float32))
    assert sw.optim.grad_norm([a, b]) == 0.0
    assert float(torch.nn.utils.get_total_norm([])) == 0.0  # torch's too
    g = np.ones((2, 3), np.float32)
    g[1, 2] = np.nan
    a.grad = friendly.tensor(g)
    for p in (2.0, 1.0, float("inf")):
        assert math.isnan(sw.optim.grad_norm(a, p))
        assert math.isnan(float(torch.nn.utils.get_total_norm([torch.from_numpy(g)], p)))


@pytest.mark.parametrize("dtype,np_dtype,torch_dtype", [
    (sw.DType.Float32, np.float32, torch.float32), (sw.DType.BFloat16, ml_dtypes.bfloat16, torch.bfloat16)],
    ids=["f32", "bf16"])
def test_scale_grads_equals_torch_mul_and_keeps_implicit_tiles(dtype, np_dtype, torch_dtype):
    """Each present tile times the factor, as torch's g.mul_(factor) (Float32 product, rounded once more to
    BFloat16): bound 0. Evicted tiles are read back under the budget; implicit tiles stay implicit."""
    rng = np.random.default_rng(seed_of(f"scale{dtype}"))
    budget, params, full, expected = grads_setup(dtype, np_dtype, rng, budget_tiles=3)
    gc = full.grad.carrier
    factor = 0.3712
    budget.reset_peak()
    sw.optim.scale_grads(params, factor)
    assert budget.stats()["peak_bytes"] <= budget.max_bytes
    assert [gc.tile_state((0, e)).location for e in (2, 5)] == ["implicit", "implicit"]
    got = experts_of(full.grad)
    for e, g in zip([0, 1, 3, 4], expected):
        want = torch.from_numpy(g).to(torch_dtype).mul_(factor)
        assert np.array_equal(got[e].astype(np.float32), want.float().numpy()), e
    for e in (2, 5):
        assert not np.any(got[e].astype(np.float32))
    dense_want = torch.from_numpy(expected[-1]).mul_(factor).numpy()
    assert np.array_equal(np.asarray(params[1].grad).view(np.uint32), dense_want.view(np.uint32))
    assert params[2].grad is None


def test_clipping_with_grad_norm_and_scale_grads_matches_torch_clip():
    """clip_grad_norm_'s recipe over sw gradients equals torch's clip_grad_norm_ over the same Float32 values: the
    norm within the bound above (our Float64 sum against torch's Float32), so the coefficient max_norm / (norm +
    1e-6) too, relatively; the clipped gradients within that relative bound plus one rounding (u32)."""
    rng = np.random.default_rng(seed_of("clip"))
    budget, params, full, expected = grads_setup(sw.DType.Float32, np.float32, rng, budget_tiles=3)
    torch_grads = [torch.nn.Parameter(torch.zeros(g.shape)) for g in expected]
    for p, g in zip(torch_grads, expected):
        p.grad = torch.from_numpy(g.copy())
    max_norm = 0.5
    total = sw.optim.grad_norm(params)
    coef = min(1.0, max_norm / (total + 1e-6))
    assert coef < 1.0  # the gradients really are clipped
    sw.optim.scale_grads(params, coef)
    ref_total = float(torch.nn.utils.clip_grad_norm_(torch_grads, max_norm, foreach=False))
    n, k = sum(g.size for g in expected), len(expected)
    rel = 2 * (n + k + 8) * U32
    assert abs(total - ref_total) <= rel * total
    got = experts_of(full.grad)
    for e, p in zip([0, 1, 3, 4], torch_grads):
        want = p.grad.numpy()
        assert np.all(np.abs(got[e] - want) <= (2 * rel + 2 * U32) * np.abs(want))


GRAD_ERRORS = [
    ("grad_norm", dict(norm_type=0.0), ValueError, "norm_type must be > 0"),
    ("grad_norm", dict(norm_type=-2.0), ValueError, "norm_type must be > 0"),
    ("grad_norm", dict(norm_type=float("nan")), ValueError, "norm_type must be > 0"),
    ("grad_norm", dict(norm_type="2"), TypeError, "norm_type must be a float"),
    ("grad_norm", dict(extra=3), TypeError, r"params\[3\] must be a Tensor, got int"),
    ("grad_norm", dict(bare=5), TypeError, "params must be a Tensor or an iterable"),
    ("scale_grads", dict(factor="0.5"), TypeError, "factor must be a float"),
    ("scale_grads", dict(extra=None), TypeError, r"params\[3\] must be a Tensor, got NoneType"),
    ("scale_grads", dict(extra="dense-view"), ValueError, "is scaled in place in CPU memory, compact"),
]


@pytest.mark.parametrize("fn,args,exc,fragment", GRAD_ERRORS, ids=[f"{f}-{a}" for f, a, _, _ in GRAD_ERRORS])
def test_grad_errors_change_nothing(fn, args, exc, fragment):
    rng = np.random.default_rng(seed_of("graderr" + fn))
    budget, params, full, expected = grads_setup(sw.DType.Float32, np.float32, rng, budget_tiles=3)
    gc = full.grad.carrier
    before_states = [gc.tile_state((0, e)) for e in range(E)]
    before_stats = gc.stats()
    before = experts_of(full.grad).copy()
    if args.get("extra") == "dense-view":  # a dense parameter whose gradient is a strided (non-compact) view
        base = friendly.tensor(np.arange(12, dtype=np.float32))
        p = friendly.tensor(np.zeros(3, np.float32))
        p.grad = sw.Tensor(base.carrier, 0, sw.Layout(sw.Shape(3), sw.Stride(4)))
        params = params + [p]
    elif "extra" in args:
        params = params + [args["extra"]]
    target = args.get("bare", params)
    with pytest.raises(exc, match=fragment):
        if fn == "grad_norm":
            sw.optim.grad_norm(target, args.get("norm_type", 2.0))
        else:
            sw.optim.scale_grads(target, args.get("factor", 0.5))
    assert [gc.tile_state((0, e)) for e in range(E)] == before_states
    assert gc.stats()["promotions"] == before_stats["promotions"]
    assert np.array_equal(experts_of(full.grad), before)
    assert np.array_equal(np.asarray(params[1].grad), expected[-1])


# ---------------------------------------------------------------- 3. state saved and restored

FIRST, THEN = [[0, 2], [2, 5], [0, 5, 2]], [[1, 2, 3], [0, 4, 5]]  # experts 1, 3 and 4 first step after the resume
RESUME_CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)),
    ("AdamW", dict(lr=3e-2, weight_decay=0.1)),
]


def tile_bytes():
    return OUT * IN * 4


def model(kind, hyper, experts, dense0, budget_tiles, **override):
    """A tiled expert weight under its own budget and a dense parameter, and an optimizer over both."""
    budget = sw.ResidencyBudget(budget_tiles * tile_bytes())
    c, full = expert_weight(experts, budget=budget)
    dense = friendly.tensor(dense0.copy())
    opt = getattr(sw.optim, kind)([full, dense], **{**hyper, **override})
    return budget, c, full, dense, opt


def step_with(c, full, dense, opt, route, grads, dense_grad):
    backward_grads(c, full, {e: grads[e] for e in route})
    dense.grad = friendly.tensor(dense_grad.copy())
    opt.step()


@pytest.mark.parametrize("kind,hyper", RESUME_CASES, ids=[k for k, _ in RESUME_CASES])
def test_resume_from_saved_state_is_bit_identical(kind, hyper, tmp_path):
    """A runs 3 steps (lr changed between them) and saves; B, built with other hyperparameters over a copy of A's
    weights, loads the file; both run 2 more steps with the same gradients: B's weights, state and counts equal A's
    bit for bit (the same arithmetic from the same values)."""
    rng = np.random.default_rng(seed_of("resume" + kind))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    dense0 = rng.standard_normal((3, 4)).astype(np.float32)
    grads = [{e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in range(E)} for _ in range(5)]
    dense_grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(5)]
    budget_a, ca, full_a, dense_a, a = model(kind, hyper, experts, dense0, budget_tiles=6)
    for k, route in enumerate(FIRST):
        a.lr = hyper["lr"] * (1 + k) / 3
        step_with(ca, full_a, dense_a, a, route, grads[k], dense_grads[k])
    path = tmp_path / "state.safetensors"
    a.save_state(path)

    other = dict(lr=0.5, weight_decay=0.0) if kind == "SGD" else dict(lr=0.5, betas=(0.5, 0.6), eps=0.1)
    budget_b, cb, full_b, dense_b, b = model(kind, hyper, experts_of(full_a), np.asarray(dense_a), 6, **other)
    b.load_state(path)
    assert b.lr == a.lr and b.weight_decay == a.weight_decay
    if kind == "SGD":
        assert (b.momentum, b.dampening, b.nesterov) == (a.momentum, a.dampening, a.nesterov)
    else:
        assert (b.betas, b.eps) == (a.betas, a.eps)
    names = ["momentum_buffer"] if kind == "SGD" else ["exp_avg", "exp_avg_sq"]
    for name in names:  # never-stepped tiles stay implicit zeros in B
        locations = [b.state(full_b)[name].carrier.tile_state((0, e)).location for e in range(E)]
        assert [loc == "implicit" for loc in locations] == [e in (1, 3, 4) for e in range(E)]
    for k, route in enumerate(THEN, start=len(FIRST)):
        for c, full, dense, opt in ((ca, full_a, dense_a, a), (cb, full_b, dense_b, b)):
            step_with(c, full, dense, opt, route, grads[k], dense_grads[k])
        assert np.array_equal(experts_of(full_b).view(np.uint32), experts_of(full_a).view(np.uint32)), k
        assert np.array_equal(np.asarray(dense_b).view(np.uint32), np.asarray(dense_a).view(np.uint32)), k
    for (pa, pb) in ((full_a, full_b), (dense_a, dense_b)):
        sa, sb = a.state(pa), b.state(pb)
        assert sa["step"] == sb["step"]
        for name in names:
            assert np.array_equal(np.asarray(sa[name]).view(np.uint32), np.asarray(sb[name]).view(np.uint32))
    assert a.state(full_a)["step"] == [3, 1, 4, 1, 1, 3]


def test_state_file_contents(tmp_path):
    """The file: one Float32 (tiles, tile size) tensor per state and parameter, row t tile t in within-tile order
    (here: the expert's row-major values), and JSON metadata with the counts and hyperparameters."""
    from safetensors import safe_open

    rng = np.random.default_rng(seed_of("contents"))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    budget, c, full, dense, opt = model("Adam", dict(lr=1e-2, betas=(0.8, 0.99)), experts,
                                        rng.standard_normal((3, 4)).astype(np.float32), budget_tiles=6)
    grads = {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in range(E)}
    step_with(c, full, dense, opt, [1, 4], grads, rng.standard_normal((3, 4)).astype(np.float32))
    opt.save_state(str(tmp_path / "s.safetensors"))
    with safe_open(str(tmp_path / "s.safetensors"), framework="np") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["param0.exp_avg", "param0.exp_avg_sq", "param1.exp_avg", "param1.exp_avg_sq"]
        m = f.get_tensor("param0.exp_avg")
        assert m.dtype == np.float32 and m.shape == (E, OUT * IN)
        want = experts_of(opt.state(full)["exp_avg"])
        assert np.array_equal(m, want.reshape(E, OUT * IN))
        assert not np.any(m[[0, 2, 3, 5]])
        assert f.get_tensor("param1.exp_avg_sq").shape == (1, 12)
    assert json.loads(meta["algorithm"]) == "Adam"
    assert json.loads(meta["hyperparameters"])["beta1"] == 0.8
    p0 = json.loads(meta["param0"])
    assert p0["step"] == [0, 1, 0, 0, 1, 0] and p0["state_tiles"] == [0, 1, 0, 0, 1, 0]
    assert p0["grid"] == [1, E] and p0["tile"] == [OUT, IN]


def test_load_stays_within_the_budget_when_the_state_is_larger(tmp_path):
    """Adam's state over E experts is 2 E tiles; the budget holds 4 (one step's weight, gradient and two moments).
    Loading it streams tile by tile: the budget's peak never exceeds max_bytes, tiles are evicted to their scratch
    files to make room, and every value arrives."""
    rng = np.random.default_rng(seed_of("budget-load"))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    hyper = dict(lr=1e-2)
    _, ca, full_a, dense_a, a = model("Adam", hyper, experts, np.zeros((2, 2), np.float32), budget_tiles=4)
    grads = {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in range(E)}
    step_with(ca, full_a, dense_a, a, list(range(E)), grads, np.ones((2, 2), np.float32))
    a.save_state(tmp_path / "s.safetensors")

    budget, cb, full_b, dense_b, b = model("Adam", hyper, experts, np.zeros((2, 2), np.float32), budget_tiles=4)
    state_bytes = 2 * E * tile_bytes()
    assert state_bytes >= 3 * budget.max_bytes
    evictions = budget.stats()["evictions"]
    budget.reset_peak()
    b.load_state(tmp_path / "s.safetensors")
    stats = budget.stats()
    assert stats["peak_bytes"] <= budget.max_bytes
    assert stats["evictions"] - evictions >= 2 * E - 4  # the state did not all stay resident
    for name in ("exp_avg", "exp_avg_sq"):
        got, want = b.state(full_b)[name], a.state(full_a)[name]
        assert np.array_equal(experts_of(got), experts_of(want))
        assert sum(got.carrier.tile_state((0, e)).location == "secondary" for e in range(E)) >= 1


def load_error_cases(tmp_path, rng):
    """(name, make optimizer B's parameters and optimizer, the file to load, exception, fragment)."""
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    _, c, full, dense, adam = model("Adam", dict(lr=1e-2), experts, np.zeros((2, 2), np.float32), 6)
    step_with(c, full, dense, adam, [0, 1], {0: experts[0], 1: experts[1]}, np.ones((2, 2), np.float32))
    adam_file = tmp_path / "adam.safetensors"
    adam.save_state(adam_file)
    plain = tmp_path / "plain.safetensors"
    sw.safetensors.save(plain, {"x": friendly.tensor(np.ones(3, np.float32))})
    return adam_file, plain


LOAD_ERRORS = [
    ("other-algorithm", "AdamW", "adam", 'holds the state of "Adam", not of AdamW'),
    ("other-count", "Adam-one-param", "adam", "holds the state of 2 parameters; this Adam has 1"),
    ("other-shape", "Adam-small-dense", "adam", "parameter 1 has shape"),
    ("not-a-state-file", "Adam", "plain", "is not an optimizer state file"),
]


@pytest.mark.parametrize("case,target,source,fragment", LOAD_ERRORS, ids=[c for c, _, _, _ in LOAD_ERRORS])
def test_load_errors_change_nothing(case, target, source, fragment, tmp_path):
    rng = np.random.default_rng(seed_of("loaderr" + case))
    adam_file, plain = load_error_cases(tmp_path, rng)
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    kind = target.split("-")[0]
    dense0 = np.zeros((2, 3) if target == "Adam-small-dense" else (2, 2), np.float32)
    _, c, full, dense, opt = model(kind, dict(lr=0.02), experts, dense0, 6)
    step_with(c, full, dense, opt, [3], {3: experts[3]}, np.ones(dense0.shape, np.float32))
    if target == "Adam-one-param":
        opt = sw.optim.Adam([full], lr=0.02)
    before = (opt.lr, opt.state(full)["step"], experts_of(opt.state(full)["exp_avg"]).copy(),
              [opt.state(full)["exp_avg"].carrier.tile_state((0, e)).location for e in range(E)])
    with pytest.raises(ValueError, match=fragment):
        opt.load_state(adam_file if source == "adam" else plain)
    after = (opt.lr, opt.state(full)["step"], experts_of(opt.state(full)["exp_avg"]),
             [opt.state(full)["exp_avg"].carrier.tile_state((0, e)).location for e in range(E)])
    assert before[0] == after[0] and before[1] == after[1] and before[3] == after[3]
    assert np.array_equal(before[2], after[2])
