"""silu, sigmoid and Python numbers on either side of every element-wise binary operation (docs/guide.md,
"Activations and scalars on either side").

Values are compared with float64 NumPy references within stated bounds (Note [Stable sigmoid] in
cpp/src/ops/activations.hpp), u = 2**-24:
  - Float32 sigmoid and silu: |err| <= 10 u |r| + (1 + |x|) 2**-149 (5 ulps; plus the subnormal quantum of
    exp(-|x|), times x for silu, where that is subnormal);
  - BFloat16 / Float16: the Float32 result rounded once, u16 |r| + (1 + u16) e32 (u16 = 2**-8 / 2**-11) plus half
    the dtype's smallest subnormal (2**-134 / 2**-25);
  - gradients c * f'(x): |c| (12 u s (1 + |x| (1 - s)) + (1 + |x|) 2**-149) for silu (s = sigmoid(x): the bound
    is relative to the size of the terms of 1 + x (1 - s), which cancel near x = -1.28), 12 u |r| + |c| (1 + |x|)
    2**-149 for sigmoid (the same subnormal term, looser than needed);
    central differences in float64 (step 1e-6 max(1, |x|)) are within 1e-8 |c| of the derivative here.
  - weak-scalar add, sub, mul, div: one correctly rounded operation on the operands as Float32 holds them: exact
    against the float64 result rounded once to Float32.
Inputs are dense, strided (offset, non-unit and permuted strides), broadcast (stride-0 and extent-1 leaves) and
nested views (tests/test_ops.py's view cases), on CPU and Generic, and every carrier kind of the registry
(tests/carrier_kinds.py). Seeds: `rng` (conftest.py) prints its seed.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly

from carrier_kinds import KINDS
from test_ops import BINARY_CASES, BINARY_IDS, UNARY_CASES, UNARY_IDS, Snapshot, check_result, f_order, flat, placed

F32, I32, BOOL, BF16, F16 = DType.Float32, DType.Int32, DType.Bool, DType.BFloat16, DType.Float16
BASE_SEED = 20261201
U = 2.0**-24
SUB = 2.0**-149
U16 = {BF16: 2.0**-8, F16: 2.0**-11}
NP16 = {BF16: ml_dtypes.bfloat16, F16: np.float16}
TINY16 = {BF16: 2.0**-134, F16: 2.0**-25}  # half the dtype's smallest subnormal: what rounding to it may lose
ACTIVATIONS = ("silu", "sigmoid")
BINARY = ("add", "sub", "mul", "elementwise_mul", "div")

pytestmark = pytest.mark.usefixtures("grad_mode_on")

EXTREMES = [-1e4, 1e4, -100.0, 100.0, 88.8, -88.8, -87.5, -103.9, -150.0, 20.0, -20.0, 17.0, 1e-40, -1e-40, 0.0,
            -0.0, -1.28, 2.0**-126, -(2.0**-126), 1e30, -1e30, 3.4e38, -3.4e38]


# ---------------------------------------------------------------- float64 references


def sigmoid64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu64(x):
    return np.asarray(x, dtype=np.float64) * sigmoid64(x)


REF = {"silu": silu64, "sigmoid": sigmoid64}


def dref(name, x):
    """f'(x) and the magnitude its rounding errors are relative to."""
    s, c = sigmoid64(x), sigmoid64(-np.asarray(x, dtype=np.float64))
    if name == "sigmoid":
        return s * c, s * c
    return s * (1 + x * c), s * (1 + np.abs(x) * c)


def bound32(r, x):
    return 10 * U * np.abs(r) + (1 + np.abs(np.asarray(x, dtype=np.float64))) * SUB


def grad_bound(scale, x, cot=1.0):
    return np.abs(cot) * (12 * U * scale + (1 + np.abs(np.asarray(x, dtype=np.float64))) * SUB)


def assert_within(got, ref, bound, what):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, what
    assert np.all(np.isfinite(got) | np.isnan(ref)), (what, got[~np.isfinite(got)][:5])
    bad = ~(np.abs(got - ref) <= bound)
    assert not bad.any(), f"{what}: at {np.flatnonzero(bad)[:5]}: got {got[bad][:5]}, expected {ref[bad][:5]}"


def values(t) -> np.ndarray:
    """A tensor's values in ordinal order as float64 (NumPy's view of a CPU or Generic tensor, else slot reads)."""
    if type(t.carrier) in (sw.CPU, sw.Generic):
        return flat(t).astype(np.float64)
    return np.array([t[i] for i in range(t.size())], dtype=np.float64)


# ---------------------------------------------------------------- forward values: views, dtypes, kinds


@pytest.mark.parametrize("case", UNARY_CASES, ids=UNARY_IDS)
@pytest.mark.parametrize("dtype", [F32, I32, BOOL], ids=["Float32", "Int32", "Bool"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_values_on_every_view_cpu_and_generic(name, dtype, case, rng):
    view_id, view = case
    p = placed(view, dtype, rng)
    if dtype is F32:  # wide values: the tails where exp(-x) overflows in a naive formula
        p.slots = (p.slots * 30).astype(np.float32)
    expected = f_order(REF[name](p.logical().astype(np.float64)))
    fast, ref = getattr(sw, name)(p.on(sw.CPU)), getattr(sw, name)(p.on(sw.Generic))
    check_result(fast, sw.CPU, view[0], F32)  # Int32 and Bool give Float32, as exp does
    check_result(ref, sw.Generic, view[0], F32)
    for got, what in ((fast, "CPU"), (ref, "Generic")):
        assert_within(values(got), expected, bound32(expected, p.logical().astype(np.float64).ravel(order="F")),
                      (name, dtype.name, view_id, what))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["BFloat16", "Float16"])
@pytest.mark.parametrize("kind", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_half_dtypes_round_once(name, kind, dtype, rng):
    x = np.concatenate([rng.uniform(-12, 12, 700), [-100, -30, -1.28, 0, 11, 60]])
    x16 = x.astype(NP16[dtype])
    dense = friendly.tensor(x16.reshape(-1, 1), carrier=kind)  # (n, 1): dense
    assert dense.dtype() is dtype
    strided = Tensor(dense.carrier, 1, Layout(Shape(3, 5), Stride(7, 1)))  # an offset, permuted view
    for t in (dense, strided):
        xs = values(t)
        r = getattr(sw, name)(t)
        assert r.dtype() is dtype and type(r.carrier) is kind
        ref = REF[name](xs)
        u16 = U16[dtype]
        bound = u16 * np.abs(ref) + (1 + u16) * bound32(ref, xs) + TINY16[dtype]
        assert_within(values(r), ref, bound, (name, dtype.name, kind.__name__))


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_extreme_inputs_are_finite_and_correct(name):
    x = np.array(EXTREMES, dtype=np.float32)
    for kind in (sw.CPU, sw.Generic):
        t = friendly.tensor(x, carrier=kind)
        r = values(getattr(sw, name)(t))
        ref = REF[name](x.astype(np.float64))
        assert np.all(np.isfinite(r)), r
        assert_within(r, ref, bound32(ref, x), (name, kind.__name__))
        # The gradient too: finite everywhere, about 0 far below zero (a naive z / (1 + exp(-z)) gives NaN there).
        t = friendly.tensor(x, carrier=kind)
        sw.reduce_sum(getattr(sw, name)(t), "a -> ").backward()
        d, scale = dref(name, x.astype(np.float64))
        g = values(t.grad)
        assert np.all(np.isfinite(g)), g
        assert_within(g, d, grad_bound(scale, x), (name, "gradient", kind.__name__))
        assert abs(g[0]) <= SUB and abs(g[2]) < 1e-40  # x = -1e4 and -100


def test_nan_and_infinities():
    nan, inf = math.nan, math.inf
    for kind in (sw.CPU, sw.Generic):
        t = friendly.tensor([nan, inf, -inf], carrier=kind)
        s, z = values(sw.sigmoid(t)), values(sw.silu(t))
        assert math.isnan(s[0]) and s[1] == 1.0 and s[2] == 0.0
        assert math.isnan(z[0]) and z[1] == inf and math.isnan(z[2])  # -inf * sigmoid(-inf) = -inf * 0


def test_large_threaded_input_matches_the_reference(rng):
    x = rng.uniform(-110, 110, 300_001).astype(np.float32)  # past the threading grain; a tail of 1
    for name in ACTIVATIONS:
        r = values(getattr(sw, name)(friendly.tensor(x)))
        ref = REF[name](x.astype(np.float64))
        assert_within(r, ref, bound32(ref, x), name)


def on_kind(kind, tmp_path, x) -> Tensor:
    """A Float32 tensor over a carrier of `kind` (carrier_kinds.py) holding the slots `x`: the whole carrier, of a
    TiledEvictable its full logical shape (the only tensor its operations take)."""
    c = kind(tmp_path).make(x, F32)
    shape = Shape(*c.logical_shape) if isinstance(c, sw.TiledEvictable) else Shape(len(x))
    return Tensor(c, 0, friendly.column_major(shape))


def sum_all(t) -> Tensor:
    names = " ".join(f"m{k}" for k in range(len(t.shape)))
    return sw.reduce_sum(t, f"{names} -> ")


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_every_carrier_kind(name, kind, tmp_path):
    """Every kind that executes operations computes silu and sigmoid (and their gradients) on its own kind; a
    storage-only kind refuses with NotImplementedError and nothing changes."""
    t = on_kind(kind, tmp_path, [-100.0, -2.5, -0.5, 0.0, 0.75, 3.0, 90.0, -1e4])
    x = values(t)  # in the tensor's ordinal order (a TiledEvictable's slots are in its own order)
    c = t.carrier
    if not c.operation_capabilities(name):
        snap = Snapshot(t)
        with pytest.raises(NotImplementedError, match="executes no operations|does not execute"):
            getattr(sw, name)(t)
        snap.check()
        return
    r = getattr(sw, name)(t)
    assert type(r.carrier) is kind.cls or kind.cls is sw.TiledEvictable  # a tiled operation returns a dense result
    ref = REF[name](x)
    assert_within(values(r), ref, bound32(ref, x), (name, kind.name))
    sum_all(r).backward()
    d, scale = dref(name, x)
    assert_within(values(t.grad), d, grad_bound(scale, x), (name, kind.name, "gradient"))
    assert values(t).tolist() == x.tolist()  # the operand is unchanged


# ---------------------------------------------------------------- VJPs against central differences


def central_differences(fn, x, cot, h=1e-6):
    step = h * np.maximum(1.0, np.abs(x))
    return cot * (fn(x + step) - fn(x - step)) / (2 * step)


@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("kind", [sw.CPU, sw.Generic, sw.Evictable], ids=["CPU", "Generic", "Evictable"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_vjp_matches_central_differences_and_the_derivative(name, kind, strided, rng):
    shape = [3, 4]
    x = rng.uniform(-8, 8, 12).astype(np.float32).astype(np.float64)
    cot = rng.standard_normal(12).astype(np.float32).astype(np.float64)
    if strided:  # a permuted view at an offset over junk
        c = friendly.tensor(rng.uniform(-50, 50, 40), carrier=sw.CPU if kind is sw.Evictable else kind).carrier
        t = Tensor(c, 2, Layout(Shape(*shape), Stride(5, 1)))
        for i, v in enumerate(x):
            t[i] = float(v)
    else:
        t = friendly.tensor(x.reshape(shape, order="F"), carrier=sw.CPU if kind is sw.Evictable else kind)
    if kind is sw.Evictable:
        t = Tensor(sw.Evictable(t.carrier, sw.Generic([], dtype=F32)), t.offset, t.layout)
    y = getattr(sw, name)(t)
    assert y.autograd_ctx.name == name and y.autograd_ctx.inputs()[0] is t
    seed = Tensor(friendly.tensor(cot, carrier=sw.Generic if kind is sw.Generic else sw.CPU).carrier, 0, y.layout)
    y.backward(gradient=seed)
    g = values(t.grad)
    assert type(t.grad.carrier) is kind
    d, scale = dref(name, x)
    bound = grad_bound(scale, x, cot)
    assert_within(g, cot * d, bound, (name, "analytic"))
    assert_within(g, central_differences(REF[name], x, cot), bound + 1e-8 * np.abs(cot), (name, "differences"))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["BFloat16", "Float16"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_vjp_of_a_16_bit_leaf(name, dtype, rng):
    """VJPs run in Float32; the leaf's gradient is rounded once to its dtype."""
    x = rng.uniform(-6, 6, 50).astype(NP16[dtype])
    t = friendly.tensor(x)
    sw.reduce_sum(getattr(sw, name)(t), "a -> ").backward()
    assert t.grad.dtype() is dtype
    d, scale = dref(name, x.astype(np.float64))
    u16 = U16[dtype]
    xs = x.astype(np.float64)
    assert_within(values(t.grad), d, u16 * np.abs(d) + (1 + u16) * grad_bound(scale, xs) + TINY16[dtype], name)


# ---------------------------------------------------------------- Python numbers on either side


def np_binary(name):
    return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "elementwise_mul": np.multiply,
            "div": np.divide}[name]


SCALARS = [2, -3, 0, 0.5, -1.3, 1e10]


@pytest.mark.parametrize("case", UNARY_CASES, ids=UNARY_IDS)
@pytest.mark.parametrize("scalar", SCALARS, ids=[repr(s) for s in SCALARS])
@pytest.mark.parametrize("side", ["tensor-scalar", "scalar-tensor"])
@pytest.mark.parametrize("name", BINARY)
def test_scalar_on_either_side_matches_numpy(name, side, scalar, case, rng):
    view_id, view = case
    for dtype in (F32, I32):
        p = placed(view, dtype, rng)
        int_result = dtype is I32 and isinstance(scalar, int) and name != "div"
        rd = I32 if int_result else F32
        s = scalar if int_result else float(np.float32(scalar))  # the scalar enters as a Float32 value
        x = p.logical().astype(np.int64 if int_result else np.float64)
        with np.errstate(all="ignore"):
            expected = np_binary(name)(x, s) if side == "tensor-scalar" else np_binary(name)(s, x)
        expected = f_order(np.asarray(expected).astype(np.int32 if int_result else np.float32))
        for cls in (sw.CPU, sw.Generic):
            t = p.on(cls)
            r = getattr(sw, name)(t, scalar) if side == "tensor-scalar" else getattr(sw, name)(scalar, t)
            check_result(r, cls, view[0], rd)
            got = flat(r)
            same = (got == expected) | (np.isnan(got) & np.isnan(expected)) if rd is F32 else got == expected
            assert same.all(), (name, side, scalar, view_id, dtype.name, cls.__name__, got, expected)


def test_operators_with_numbers_on_either_side():
    for cls in (sw.CPU, sw.Generic, sw.Evictable):
        base = friendly.tensor([1.0, -2.0, 0.5, 8.0], carrier=sw.CPU if cls is sw.Evictable else cls)
        t = base if cls is not sw.Evictable else Tensor(sw.Evictable(base.carrier, sw.Generic([])), 0, base.layout)
        x = np.array([1.0, -2.0, 0.5, 8.0])
        cases = [
            (lambda: t + 1, lambda: sw.add(t, 1), x + 1, "add"),
            (lambda: 1 + t, lambda: sw.add(1, t), 1 + x, "add"),
            (lambda: t - 2.5, lambda: sw.sub(t, 2.5), x - 2.5, "sub"),
            (lambda: 1 - t, lambda: sw.sub(1, t), 1 - x, "sub"),
            (lambda: 1 / t, lambda: sw.div(1, t), 1 / x, "div"),
            (lambda: t / 2, lambda: sw.div(t, 2), x / 2, "div"),
            (lambda: 3 * t, lambda: sw.mul(3, t), 3 * x, "mul"),
        ]
        for op, fn, want, node in cases:
            r, s = op(), fn()
            assert type(r.carrier) is cls and r.dtype() is F32
            assert values(r).tolist() == values(s).tolist() == want.astype(np.float32).tolist(), node
            assert r.autograd_ctx.name == node
            ins = r.autograd_ctx.inputs()
            assert len(ins) == 1 and ins[0] is t  # the number is no input


@pytest.mark.parametrize("name", BINARY)
def test_scalar_dtype_rules(name):
    """Weak scalars never promote: a weak int keeps Int32, a weak float with Int32 gives Float32 (the float dtype),
    a 16-bit tensor keeps its dtype; div always gives the float dtype."""
    fn = getattr(sw, name)
    for dtype in (F32, I32, BOOL, BF16, F16):
        t = friendly.tensor([True, False, True] if dtype is BOOL else [1, 2, 3], dtype=dtype)
        float_dtype = dtype if dtype in (BF16, F16) else F32
        for s in (2, 2.0, -7, 0.25):
            want = I32 if dtype is I32 and isinstance(s, int) and name != "div" else float_dtype
            assert fn(t, s).dtype() is want, (name, dtype.name, s)
            assert fn(s, t).dtype() is want, (name, dtype.name, s)


def test_weak_float_with_int32_and_int32_overflow():
    i = friendly.tensor([1, 3, -4], dtype=I32)
    assert values(sw.add(i, 0.5)).tolist() == [1.5, 3.5, -3.5] and sw.add(i, 0.5).dtype() is F32
    assert values(sw.sub(1, i)).tolist() == [0, -2, 5] and sw.sub(1, i).dtype() is I32
    assert values(1 / i).tolist() == [1.0, np.float32(1 / 3), -0.25] and (1 / i).dtype() is F32
    big = friendly.tensor([2**31 - 1], dtype=I32)
    snap = Snapshot(big)
    with pytest.raises(OverflowError, match="Int32 result overflows"):
        big + 1
    with pytest.raises(OverflowError, match="Int32 result overflows"):
        sw.sub(-2, big)
    snap.check()


@pytest.mark.parametrize("kind", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
def test_scalar_gradients(kind, rng):
    """d/dt of sum(c * op(t, s)) and sum(c * op(s, t)); the number receives no gradient."""
    x = rng.uniform(0.5, 4, 6).astype(np.float32).astype(np.float64) * rng.choice([-1, 1], 6)
    cot = rng.standard_normal(6).astype(np.float32).astype(np.float64)
    s = 1.5
    cases = {
        ("add", False): np.ones_like(x), ("add", True): np.ones_like(x),
        ("sub", False): np.ones_like(x), ("sub", True): -np.ones_like(x),
        ("mul", False): np.full_like(x, s), ("elementwise_mul", True): np.full_like(x, s),
        ("div", False): np.full_like(x, 1 / s), ("div", True): -s / (x * x),
    }
    for (name, scalar_first), d in cases.items():
        t = friendly.tensor(x, carrier=kind)
        fn = getattr(sw, name)
        y = fn(s, t) if scalar_first else fn(t, s)
        assert len(y.autograd_ctx.inputs()) == 1
        y.backward(gradient=friendly.tensor(cot, carrier=kind))
        want = cot * d
        # one Float32 rounding per operation of the VJP (at most three): 4 u |r|
        assert_within(values(t.grad), want, 4 * U * np.abs(want), (name, scalar_first))
        f64 = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "elementwise_mul": np.multiply, "div": np.divide}
        numeric = central_differences(lambda v: f64[name](s, v) if scalar_first else f64[name](v, s), x, cot)
        assert_within(values(t.grad), numeric, 4 * U * np.abs(want) + 1e-8 * np.abs(cot), (name, "differences"))


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_scalar_add_on_every_carrier_kind(kind, tmp_path):
    t = on_kind(kind, tmp_path, [1.0, -2.0, 0.5, 8.0])
    c, x = t.carrier, values(t)
    if not c.operation_capabilities("add"):
        snap = Snapshot(t)
        with pytest.raises(NotImplementedError):
            t + 1
        snap.check()
        return
    for r in (t + 1, 1 + t, sw.add(t, 1.0)):
        assert values(r).tolist() == (x + 1).tolist()
    assert any(o.role.value == "weak_scalar" for e in c.operation_capabilities("add") for o in e.operands)


NOT_NUMBERS = [None, "2", [1.0], True, np.ones(2, dtype=np.float32), np.float32(2.0)]
NOT_NUMBER_IDS = ["None", "str", "list", "bool", "ndarray", "np.float32"]


@pytest.mark.parametrize("other", NOT_NUMBERS, ids=NOT_NUMBER_IDS)
@pytest.mark.parametrize("name", BINARY)
def test_a_non_number_is_refused_and_nothing_changes(name, other):
    t = friendly.tensor([1.0, 2.0])
    snap = Snapshot(t)
    for args in ((t, other), (other, t)):
        with pytest.raises(TypeError, match=f"{name}"):
            getattr(sw, name)(*args)
    snap.check()


@pytest.mark.parametrize("other", [None, "2", [1.0], True], ids=["None", "str", "list", "bool"])
def test_operators_refuse_non_numbers(other):
    t = friendly.tensor([1.0, 2.0])
    snap = Snapshot(t)
    for call in (lambda: t + other, lambda: other + t, lambda: t - other, lambda: other - t, lambda: t / other,
                 lambda: other / t):
        with pytest.raises(TypeError):
            call()
    snap.check()


def test_error_messages_name_the_operation_and_the_type():
    t = friendly.tensor([1.0, 2.0])
    with pytest.raises(TypeError, match=r"add: operands must be Tensors or Python numbers, got str"):
        sw.add("x", t)
    with pytest.raises(TypeError, match=r"div: operands must be Tensors or Python numbers, got list"):
        sw.div(t, [1.0])
    with pytest.raises(TypeError, match=r"div\(\): incompatible function arguments"):  # None: the binding's check
        sw.div(t, None)
    with pytest.raises(TypeError, match=r"sub needs at least one Tensor operand"):
        sw.sub(1, 2.0)
    with pytest.raises(TypeError, match=r"silu: operands must be Tensors, got float"):
        sw.silu(1.0)
    with pytest.raises(TypeError, match=r"matmul: operands must be Tensors, got int"):
        sw.matmul(t, 2)


def test_capabilities_list_weak_scalars_for_every_elementwise_binary_operation():
    caps = sw.CPU(4).operation_capabilities()
    with_weak = {e.operation for e in caps if any(o.role.value == "weak_scalar" for o in e.operands)}
    assert with_weak == set(BINARY)
    assert {e.operation for e in caps} >= set(ACTIVATIONS)
    for name in ACTIVATIONS:
        assert all(len(e.operands) == 1 for e in caps if e.operation == name)
