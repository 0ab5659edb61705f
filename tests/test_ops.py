"""Contract tests for the central operations, dispatch_op and
operation_capabilities (docs/guide.md, "Operations and autograd").

The heart of the file checks every fast CPU kernel against the Generic
reference: the same operation on the same slot values, placed by the same
layout at the same offset, once on a CPU carrier and once on a Generic carrier.
Both results are also checked against an independent NumPy oracle (computed in
float64 / int64 and rounded once, as the contract's "compute, then store in the
result dtype" implies). Inputs cover dense, strided (non-unit strides,
permuted modes), offset, broadcast (stride-0 leaves and extent-1 leaves),
hierarchical and rank-0 layouts, for every dtype pair of Float32/Int32/Bool.
Comparisons are bit-exact where the math is exact (integers; add, sub, mul,
div, neg, relu on Float32) and within a tight tolerance otherwise (exp,
reduce_sum and matmul on floats).

Random values come from NumPy generators seeded with SEED plus a CRC of the
test's parameters, so every test is reproducible on its own; SEED is printed
at session start and appears in every value-mismatch message.

Every error test checks the exception type, a message fragment and that the
operands did not change (slot values, versions, autograd state).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib

import numpy as np
import pytest

import strideweave as sw
from forked import check_in_forked_child
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly
from models import binary32, leaves
from devices import block_device


F32, I32, BOOL, F64 = DType.Float32, DType.Int32, DType.Bool, DType.Float64
DTYPES = (F32, I32, BOOL)
HALF_DTYPES = (DType.BFloat16, DType.Float16)  # their operations: tests/test_dtype16.py
DTYPE_PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
PAIR_IDS = [f"{a.name}-{b.name}" for a, b in DTYPE_PAIRS]
NP_DTYPE = {F32: np.float32, I32: np.int32, BOOL: np.bool_}
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)

SEED = 20240611
OPS = ("add", "elementwise_mul", "mul", "relu", "reduce_sum", "matmul", "sub", "div", "neg", "exp",
       "silu", "sigmoid")  # activations: tests/test_ops_activations.py
WEAK_SCALAR_OPS = ("add", "elementwise_mul", "mul", "sub", "div")  # every element-wise binary operation


@pytest.fixture(scope="session", autouse=True)
def _announce_seed():
    print(f"\ntest_ops: SEED={SEED}")


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


# ============================================================ nested shapes as Python lists


def rebuild(modes, flat):
    """The tree of `modes` with its leaves replaced, in order, by `flat`."""
    it = iter(flat)

    def go(ms):
        return [go(m) if isinstance(m, (list, tuple)) else next(it) for m in ms]

    return go(modes)


def dense_stride(modes) -> list:
    """Running product of the leaf extents, first mode fastest, at every depth."""
    run, flat = 1, []
    for e in leaves(modes):
        flat.append(run)
        run *= e
    return rebuild(modes, flat)


def layout_of(shape, stride) -> Layout:
    return Layout(Shape(list(shape)), Stride(list(stride)))


def dense_layout(shape) -> Layout:
    return layout_of(shape, dense_stride(shape))


def cosize(shape, stride) -> int:
    return 1 + sum((e - 1) * s for e, s in zip(leaves(shape), leaves(stride)))


# ============================================================ placing values on carriers


def random_slots(n: int, dtype: DType, rng: np.random.Generator) -> np.ndarray:
    if dtype is F32:
        values = (rng.standard_normal(n) * 3).astype(np.float32)
        values[rng.random(n) < 0.1] = 0.0  # some exact zeros (sign of zero, division by zero)
        return values
    if dtype is I32:
        return rng.integers(-9, 10, n).astype(np.int32)
    return rng.random(n) < 0.5


class Placed:
    """Slot values plus a view (shape, stride, offset): the same data on any carrier class."""

    def __init__(self, shape, stride, offset, dtype, rng, slots=None):
        self.shape, self.stride, self.offset, self.dtype = list(shape), list(stride), offset, dtype
        n = offset + cosize(shape, stride) + 2  # spare slots after the view
        self.slots = random_slots(n, dtype, rng) if slots is None else np.asarray(slots, dtype=NP_DTYPE[dtype])
        assert len(self.slots) >= offset + cosize(shape, stride)

    @property
    def layout(self) -> Layout:
        return layout_of(self.shape, self.stride)

    def carrier(self, cls):
        if cls is sw.CPU:
            c = friendly.tensor(self.slots, dtype=self.dtype).carrier
        elif cls is sw.Generic:
            c = sw.Generic(self.slots.tolist(), dtype=self.dtype)
        elif cls is sw.Evictable:
            c = sw.Evictable(self.carrier(sw.CPU), sw.Generic([], dtype=self.dtype))
        else:
            raise AssertionError(cls)
        assert c.size() == len(self.slots)
        return c

    def on(self, cls) -> Tensor:
        return Tensor(self.carrier(cls), self.offset, self.layout)

    def logical(self) -> np.ndarray:
        """Logical values as an array over the leaf extents (axis 0 = first leaf)."""
        ext, st = leaves(self.shape), leaves(self.stride)
        index = np.full(ext, self.offset, dtype=np.int64) if ext else np.int64(self.offset)
        for j, (e, s) in enumerate(zip(ext, st)):
            shape = [1] * len(ext)
            shape[j] = e
            index = index + (np.arange(e, dtype=np.int64) * s).reshape(shape)
        return self.slots[index]


def place(shape, stride=None, offset=0, dtype=F32, rng=None, slots=None) -> Placed:
    return Placed(shape, dense_stride(shape) if stride is None else stride, offset, dtype,
                  rng or rng_for("place", repr(shape)), slots)


def flat(t: Tensor) -> np.ndarray:
    """A tensor's logical values in ordinal (first-mode-fastest) order."""
    return np.asarray(t).ravel(order="F")


def f_order(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).ravel(order="F")


# ============================================================ comparisons


def _mismatch(a, b, bad, key):
    where = np.flatnonzero(bad)[:5]
    return f"SEED={SEED} key={key!r}: {bad.sum()} mismatches at {where.tolist()}: {a[where].tolist()} vs {b[where].tolist()}"


def assert_exact(a: np.ndarray, b: np.ndarray, key=None):
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype == np.float32:
        both_nan = np.isnan(a) & np.isnan(b)
        bad = (a.view(np.uint32) != b.view(np.uint32)) & ~both_nan  # bit-exact, sign of zero included
    else:
        bad = a != b
    assert not bad.any(), _mismatch(a, b, bad, key)


def assert_close(a: np.ndarray, b: np.ndarray, scale, key=None, rtol=2e-6):
    """|a - b| <= rtol * scale elementwise (scale: the magnitude the rounding errors are relative to)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    both_nan = np.isnan(a64) & np.isnan(b64)
    bad = ~(np.abs(a64 - b64) <= rtol * np.maximum(np.asarray(scale, dtype=np.float64), 1e-30)) & ~both_nan
    bad &= ~(a64 == b64)  # equal infinities
    assert not bad.any(), _mismatch(a, b, bad, key)


def check_result(r: Tensor, cls, shape, dtype):
    """A fresh dense carrier of class `cls` at offset 0 with the dense layout over `shape`."""
    assert type(r) is Tensor
    assert type(r.carrier) is cls
    assert r.offset == 0
    assert r.layout == dense_layout(shape)
    assert r.dtype() is dtype
    assert r.carrier.dtype() is dtype
    assert r.carrier.size() == r.size() == math.prod(leaves(shape))


def to_result_dtype(values: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is F32:
        return values.astype(np.float64).astype(np.float32)
    if dtype is I32:
        assert np.all((values >= INT32_MIN) & (values <= INT32_MAX))
        return values.astype(np.int32)
    return values.astype(np.bool_)


def as_compute(values: np.ndarray, result_dtype: DType) -> np.ndarray:
    return values.astype(np.int64 if result_dtype is I32 else np.float64)


def versions(*ts):
    return [t.version for t in ts]


# ============================================================ dtype plan (what the tests expect)


def binary_dtype(op, da, db):
    if op == "div":
        return F32
    return I32 if (da is I32 and db is I32) else F32


def weak_dtype(tensor_dtype, scalar):
    return I32 if (tensor_dtype is I32 and isinstance(scalar, int)) else F32


UNARY_DTYPE = {
    "relu": lambda d: d,
    "neg": lambda d: I32 if d is I32 else F32,  # Bool cannot be negated: Float32 like any other non-Int32 mix
    "exp": lambda d: F32,
}


# ============================================================ view cases

# Elementwise binary cases: (id, A view, B view, result shape). A view is (shape, stride, offset).
S2 = [3, 4]
SN = [2, [3, 2]]
BINARY_CASES = [
    ("dense", (S2, None, 0), (S2, None, 0), S2),
    ("strided-permuted", (S2, [2, 7], 0), (S2, [4, 1], 0), S2),
    ("offset", (S2, None, 5), (S2, [5, 1], 3), S2),
    ("zero-stride", (S2, [0, 1], 2), (S2, [1, 0], 1), S2),
    ("bcast-b-extent1", (S2, None, 1), ([1, 4], [9, 2], 2), S2),
    ("bcast-a-extent1", ([3, 1], [2, 5], 4), (S2, [4, 1], 0), S2),
    ("bcast-both", ([3, 1], None, 0), ([1, 4], [1, 3], 1), S2),
    ("nested-dense", (SN, None, 0), (SN, None, 0), SN),
    ("nested-strided", (SN, [6, [1, 3]], 3), (SN, [1, [4, 2]], 2), SN),
    ("nested-bcast", (SN, [1, [2, 6]], 1), ([1, [3, 1]], [5, [1, 7]], 0), SN),
    ("nested-bcast-a", ([2, [1, 2]], [1, [0, 2]], 2), (SN, None, 0), SN),
    ("rank0", ([], [], 3), ([], [], 1), []),
]
BINARY_IDS = [c[0] for c in BINARY_CASES]

# Unary cases (also the tensor side of mul with a weak scalar): (id, view).
UNARY_CASES = [
    ("dense", (S2, None, 0)),
    ("strided-permuted", (S2, [5, 1], 0)),
    ("offset", (S2, None, 7)),
    ("zero-stride", (S2, [0, 2], 1)),
    ("extent1", ([3, 1], [1, 4], 2)),
    ("nested", (SN, [6, [1, 3]], 3)),
    ("nested-extent1", ([2, [1, 3]], [3, [5, 1]], 1)),
    ("rank0", ([], [], 2)),
]
UNARY_IDS = [c[0] for c in UNARY_CASES]


def placed(view, dtype, rng) -> Placed:
    shape, stride, offset = view
    return place(shape, stride, offset, dtype, rng)


def broadcast_leaves(a: np.ndarray, b: np.ndarray):
    return np.broadcast_arrays(a, b)


# ============================================================ elementwise: CPU against Generic


def binary_oracle(op, xa, xb, rd):
    a, b = as_compute(xa, rd), as_compute(xb, rd)
    with np.errstate(all="ignore"):
        r = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "elementwise_mul": np.multiply,
             "div": np.true_divide}[op](a, b)
    return to_result_dtype(np.asarray(r), rd)


@pytest.mark.parametrize("case", BINARY_CASES, ids=BINARY_IDS)
@pytest.mark.parametrize(("da", "db"), DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("op", ["add", "elementwise_mul", "mul", "sub", "div"])
def test_binary_cpu_matches_generic(op, da, db, case):
    name, va, vb, rshape = case
    rng = rng_for(op, da.name, db.name, name)
    pa, pb = placed(va, da, rng), placed(vb, db, rng)
    rd = binary_dtype(op, da, db)
    fn = getattr(sw, op)
    a_cpu, b_cpu, a_gen, b_gen = pa.on(sw.CPU), pb.on(sw.CPU), pa.on(sw.Generic), pb.on(sw.Generic)
    before = versions(a_cpu, b_cpu, a_gen, b_gen)
    fast, ref = fn(a_cpu, b_cpu), fn(a_gen, b_gen)
    check_result(fast, sw.CPU, rshape, rd)
    check_result(ref, sw.Generic, rshape, rd)
    key = (op, da.name, db.name, name)
    assert_exact(flat(fast), flat(ref), key)
    assert_exact(flat(ref), f_order(binary_oracle(op, *broadcast_leaves(pa.logical(), pb.logical()), rd)), key)
    assert versions(a_cpu, b_cpu, a_gen, b_gen) == before
    assert flat(a_cpu).tolist() == flat(a_gen).tolist()  # inputs untouched


WEAK_SCALARS = [3, -2, 0, 0.5, -1.3, 1e10]
WEAK_IDS = ["int3", "int-2", "int0", "float0.5", "float-1.3", "float1e10"]


@pytest.mark.parametrize("case", UNARY_CASES, ids=UNARY_IDS)
@pytest.mark.parametrize("scalar", WEAK_SCALARS, ids=WEAK_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("side", ["tensor*weak", "weak*tensor"])
def test_mul_weak_scalar_cpu_matches_generic(side, dtype, scalar, case):
    name, view = case
    rng = rng_for("mul-weak", side, dtype.name, scalar, name)
    p = placed(view, dtype, rng)
    rd = weak_dtype(dtype, scalar)

    def run(t):
        return sw.mul(t, scalar) if side == "tensor*weak" else sw.mul(scalar, t)

    fast, ref = run(p.on(sw.CPU)), run(p.on(sw.Generic))
    check_result(fast, sw.CPU, view[0], rd)
    check_result(ref, sw.Generic, view[0], rd)
    key = (side, dtype.name, scalar, name)
    assert_exact(flat(fast), flat(ref), key)
    # The weak scalar takes the result dtype first (a weak float is a Float32 value).
    s = scalar if rd is I32 else binary32(float(scalar))
    expected = as_compute(p.logical(), rd) * s
    assert_exact(flat(ref), f_order(to_result_dtype(np.asarray(expected), rd)), key)


def unary_oracle(op, x, rd):
    v = x.astype(np.int64 if rd is I32 else np.float64)
    if op == "relu":
        if x.dtype == np.bool_:
            return x.copy()
        v = np.where(v > 0, v, np.zeros_like(v))  # -0.0 and NaN become +0
    elif op == "neg":
        v = -v
    else:
        v = np.exp(v)
    return to_result_dtype(v, rd)


@pytest.mark.parametrize("case", UNARY_CASES, ids=UNARY_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("op", ["relu", "neg", "exp"])
def test_unary_cpu_matches_generic(op, dtype, case):
    name, view = case
    rng = rng_for(op, dtype.name, name)
    p = placed(view, dtype, rng)
    rd = UNARY_DTYPE[op](dtype)
    fn = getattr(sw, op)
    fast, ref = fn(p.on(sw.CPU)), fn(p.on(sw.Generic))
    check_result(fast, sw.CPU, view[0], rd)
    check_result(ref, sw.Generic, view[0], rd)
    key = (op, dtype.name, name)
    expected = f_order(unary_oracle(op, p.logical(), rd))
    if op == "exp":
        assert_close(flat(fast), flat(ref), flat(ref), key)
        assert_close(flat(ref), expected, expected, key)
    else:
        assert_exact(flat(fast), flat(ref), key)
        assert_exact(flat(ref), expected, key)


def test_neg_produces_negative_zero_and_relu_positive_zero():
    """Exact sign-of-zero behaviour on Float32 (the math is exact there)."""
    for cls in (sw.CPU, sw.Generic):
        p = place([4], slots=[0.0, -0.0, 1.5, -2.5])
        n, r = sw.neg(p.on(cls)), sw.relu(p.on(cls))
        assert [math.copysign(1, v) for v in flat(n)] == [-1, 1, -1, 1]
        assert flat(n).tolist() == [0.0, 0.0, -1.5, 2.5]
        assert [math.copysign(1, v) for v in flat(r)[:2]] == [1, 1]
        assert flat(r).tolist() == [0.0, 0.0, 1.5, 0.0]


@pytest.mark.parametrize(("op", "da", "db"), [
    ("add", F32, F32), ("mul", F32, I32), ("sub", I32, I32), ("div", F32, F32), ("elementwise_mul", BOOL, F32),
])
def test_large_threaded_elementwise_matches_generic(op, da, db):
    """Enough elements (> 2 * 65536) for the fast kernels to split work across threads, strided + broadcast."""
    rng = rng_for("large", op, da.name, db.name)
    pa = place([300, 520], [2, 601], 3, da, rng)        # non-unit strides, offset
    pb = place([300, 1], [1, 7], 5, db, rng)            # extent-1 leaf: broadcast along mode 1
    rd = binary_dtype(op, da, db)
    fn = getattr(sw, op)
    fast, ref = fn(pa.on(sw.CPU), pb.on(sw.CPU)), fn(pa.on(sw.Generic), pb.on(sw.Generic))
    check_result(fast, sw.CPU, [300, 520], rd)
    assert_exact(flat(fast), flat(ref), (op, "large"))
    assert_exact(flat(ref), f_order(binary_oracle(op, *broadcast_leaves(pa.logical(), pb.logical()), rd)))
    w_fast, w_ref = sw.mul(pa.on(sw.CPU), -0.75), sw.mul(-0.75, pa.on(sw.Generic))  # weak scalar, threaded
    assert_exact(flat(w_fast), flat(w_ref), (op, "large-weak"))
    u = sw.exp(pa.on(sw.CPU)) if da is F32 else sw.neg(pa.on(sw.CPU))
    v = sw.exp(pa.on(sw.Generic)) if da is F32 else sw.neg(pa.on(sw.Generic))
    assert_close(flat(u), flat(v), np.abs(flat(v)))


# ============================================================ reduce_sum: CPU against Generic

# (id, shape, description, kept top-level modes in result order)
REDUCE_CASES = [
    ("default-rank2", [3, 4], None, [0]),
    ("a b -> a", [3, 4], "a b -> a", [0]),
    ("a b -> b", [3, 4], "a b -> b", [1]),
    ("a b -> b a", [3, 4], "a b -> b a", [1, 0]),
    ("a b -> (nothing)", [3, 4], "a b -> ", []),
    ("a b c -> c a", [2, 3, 4], "a b c -> c a", [2, 0]),
    ("default-rank3", [2, 3, 4], None, [0]),
    ("-> (rank0)", [], "-> ", []),
    ("default-rank0", [], None, []),
    ("default-rank1", [5], None, [0]),
    ("nested x y -> y", [2, [3, 2]], "x y -> y", [1]),
    ("nested x y -> x", [[2, 2], 3], "x y -> x", [0]),
    ("nested p q r -> r p", [[2, 1], 3, [2, 2]], "p q r -> r p", [2, 0]),
    ("spaces", [3, 4], "  a   b->b ", [1]),
    ("long names", [3, 4], "rows cols -> cols", [1]),
]
REDUCE_IDS = [c[0] for c in REDUCE_CASES]


def reduce_views(shape, rng):
    """dense, strided (permuted, non-unit), offset, stride-0 leaf, extent-1 leaf variants of `shape`."""
    ext = leaves(shape)
    if not ext:
        return [("rank0", [], [], 3)]
    out = [("dense", shape, dense_stride(shape), 0), ("offset", shape, dense_stride(shape), 5)]
    # Permuted: leaf strides assigned last-leaf-fastest, spaced by 2.
    run, rev = 2, [0] * len(ext)
    for j in reversed(range(len(ext))):
        rev[j] = run
        run *= ext[j] + 1
    out.append(("strided-permuted", shape, rebuild(shape, rev), 1))
    zero = list(leaves(dense_stride(shape)))
    zero[0] = 0
    out.append(("zero-stride", shape, rebuild(shape, zero), 2))
    ones = [1 if j == len(ext) - 1 else e for j, e in enumerate(ext)]
    s1 = rebuild(shape, ones)
    out.append(("extent1", s1, dense_stride(s1), 4))
    return out


def reduce_oracle(x: np.ndarray, shape, kept, rd):
    """Sum over the leaves of the modes not kept; result leaves ordered by `kept`."""
    axes_of, j = [], 0
    for m in shape:
        n = len(leaves([m]))
        axes_of.append(list(range(j, j + n)))
        j += n
    summed = tuple(a for k, axes in enumerate(axes_of) if k not in kept for a in axes)
    keep_order = [a for k in kept for a in axes_of[k]]
    v = x.astype(np.int64 if (rd is I32 or x.dtype == np.bool_) else np.float64)
    s = np.sum(v, axis=summed) if summed else v
    remaining = [a for a in range(len(leaves(shape))) if a not in summed]
    s = np.transpose(s, [remaining.index(a) for a in keep_order]) if keep_order else s
    return to_result_dtype(np.asarray(s), rd)


@pytest.mark.parametrize("acc", [None, F64], ids=["acc-default", "acc-Float64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("case", REDUCE_CASES, ids=REDUCE_IDS)
def test_reduce_sum_cpu_matches_generic(case, dtype, acc):
    name, shape, desc, kept = case
    rng = rng_for("reduce", name, dtype.name, acc is None)
    rd = F32 if acc is F64 else dtype  # keeps the input dtype; a Float64 accumulator returns Float32
    for vname, vshape, vstride, offset in reduce_views(shape, rng):
        p = place(vshape, vstride, offset, dtype, rng)
        kwargs = {} if acc is None else {"accumulator_dtype": acc}
        args = () if desc is None else (desc,)
        fast, ref = sw.reduce_sum(p.on(sw.CPU), *args, **kwargs), sw.reduce_sum(p.on(sw.Generic), *args, **kwargs)
        rshape = [vshape[k] for k in kept]
        check_result(fast, sw.CPU, rshape, rd)
        check_result(ref, sw.Generic, rshape, rd)
        expected = f_order(reduce_oracle(p.logical(), vshape, kept, rd))
        key = (name, dtype.name, acc, vname)
        if dtype is F32:
            # Rounding errors are relative to the sum of magnitudes; bound it by the whole input's.
            scale = np.full(expected.shape, max(1.0, float(np.sum(np.abs(p.logical().astype(np.float64))))))
            assert_close(flat(fast), flat(ref), scale, key)
            assert_close(flat(ref), expected, scale, key)
        else:  # integer or Bool sums are exact (also when returned as Float32)
            assert_exact(flat(fast), flat(ref), key)
            assert_exact(flat(ref), expected, key)


def test_reduce_sum_bool_keeps_bool_as_any():
    """Bool keeps its dtype: a slot is True when any summed element is True."""
    for cls in (sw.CPU, sw.Generic):
        p = place([2, 3], slots=[False, False, True, False, False, False], dtype=BOOL)
        r = sw.reduce_sum(p.on(cls), "a b -> b")
        assert r.dtype() is BOOL
        assert flat(r).tolist() == [False, True, False]
        r64 = sw.reduce_sum(p.on(cls), "a b -> b", accumulator_dtype=F64)
        assert r64.dtype() is F32 and flat(r64).tolist() == [0.0, 1.0, 0.0]


def test_reduce_sum_float64_accumulator_is_more_exact():
    """1 + 2^-24 * many: a Float64 accumulator keeps what one Float32 rounding per step would lose."""
    n = 4096
    slots = [1.0] + [2.0**-24] * (n - 1)
    exact = binary32(1.0 + (n - 1) * 2.0**-24)
    for cls in (sw.CPU, sw.Generic):
        t = place([n], slots=slots).on(cls)
        r = sw.reduce_sum(t, "a -> ", accumulator_dtype=F64)
        assert r.dtype() is F32 and r.layout == dense_layout([]) and r[()] == exact


def test_large_reduce_sum_matches_generic():
    rng = rng_for("large-reduce")
    p = place([256, 600], [601, 1], 9, F32, rng)  # permuted modes, offset
    for desc in ("a b -> a", "a b -> b", "a b -> "):
        fast, ref = sw.reduce_sum(p.on(sw.CPU), desc), sw.reduce_sum(p.on(sw.Generic), desc)
        assert_close(flat(fast), flat(ref), np.full(flat(ref).shape, 600.0 * 256 * 12), desc)


# ============================================================ matmul: CPU against Generic

M, K, N = 3, 4, 5
# (id, lhs view (shape, stride, offset), rhs view)
MATMUL_CASES = [
    ("dense", ([M, K], None, 0), ([N, K], None, 0)),
    ("row-major-both", ([M, K], [K, 1], 0), ([N, K], [K, 1], 0)),
    ("row-major-lhs", ([M, K], [K, 1], 2), ([N, K], None, 1)),
    ("row-major-rhs", ([M, K], None, 0), ([N, K], [K, 1], 3)),
    ("padded-ld", ([M, K], [1, M + 2], 1), ([N, K], [K + 3, 1], 2)),
    ("strided", ([M, K], [2, 2 * M + 1], 0), ([N, K], [3, 1 + 3 * N], 1)),
    ("offset", ([M, K], None, 7), ([N, K], None, 11)),
    ("zero-stride", ([M, K], [0, 1], 1), ([N, K], [1, 0], 0)),
    ("extent1-m", ([1, K], [5, 1], 1), ([N, K], None, 0)),
    ("extent1-n", ([M, K], None, 0), ([1, K], [1, 1], 2)),
    ("extent1-k", ([M, 1], [1, 9], 0), ([N, 1], [2, 1], 1)),
    ("nested-mergeable", ([[3, 2], K], None, 0), ([N, [2, 2]], None, 1)),
    ("nested-permuted", ([[3, 2], [2, 2]], [[2, 1], [6, 12]], 0), ([N, [2, 2]], [4, [1, 2]], 3)),
    ("vector-rhs", ([M, K], None, 0), ([1, K], None, 0)),
]
MATMUL_IDS = [c[0] for c in MATMUL_CASES]


def matrix(p: Placed) -> np.ndarray:
    """The (rows, cols) matrix of a two-mode tensor: ordinal = row + rows * col."""
    x = f_order(p.logical())
    rows = math.prod(leaves([p.shape[0]]))
    return x.reshape((rows, -1), order="F")


@pytest.mark.parametrize("acc", [None, F64], ids=["acc-default", "acc-Float64"])
@pytest.mark.parametrize(("da", "db"), DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("case", MATMUL_CASES, ids=MATMUL_IDS)
def test_matmul_cpu_matches_generic(case, da, db, acc):
    name, vl, vr = case
    rng = rng_for("matmul", name, da.name, db.name, acc is None)
    pl, pr = placed(vl, da, rng), placed(vr, db, rng)
    rd = I32 if (da is I32 and db is I32 and acc is None) else F32
    kwargs = {} if acc is None else {"accumulator_dtype": acc}
    fast = sw.matmul(pl.on(sw.CPU), pr.on(sw.CPU), **kwargs)
    ref = sw.matmul(pl.on(sw.Generic), pr.on(sw.Generic), **kwargs)
    rshape = [vl[0][0], vr[0][0]]
    check_result(fast, sw.CPU, rshape, rd)
    check_result(ref, sw.Generic, rshape, rd)
    a, b = matrix(pl).astype(np.float64), matrix(pr).astype(np.float64)
    expected = a @ b.T  # result[i, j] = sum_k lhs[i, k] * rhs[j, k]
    scale = f_order(np.abs(a) @ np.abs(b).T)
    key = (name, da.name, db.name, acc)
    if da is not F32 and db is not F32:  # integer-valued products and sums: exact in every path
        assert_exact(flat(fast), flat(ref), key)
        assert_exact(flat(ref), f_order(to_result_dtype(expected.astype(np.int64), rd)), key)
    else:
        assert_close(flat(fast), flat(ref), scale, key)
        assert_close(flat(ref), f_order(to_result_dtype(expected, rd)), scale, key)


@pytest.mark.parametrize(("da", "db", "acc"), [(F32, F32, None), (F32, F32, F64), (I32, F32, None), (I32, I32, None)])
def test_large_matmul_matches_generic(da, db, acc):
    rng = rng_for("large-matmul", da.name, db.name, acc is None)
    pl = place([64, 96], [96, 1], 3, da, rng)         # row-major lhs (transposed BLAS view)
    pr = place([80, 96], None, 1, db, rng)            # column-major rhs
    kwargs = {} if acc is None else {"accumulator_dtype": acc}
    fast = sw.matmul(pl.on(sw.CPU), pr.on(sw.CPU), **kwargs)
    ref = sw.matmul(pl.on(sw.Generic), pr.on(sw.Generic), **kwargs)
    a, b = matrix(pl).astype(np.float64), matrix(pr).astype(np.float64)
    scale = f_order(np.abs(a) @ np.abs(b).T)
    if da is I32 and db is I32:
        assert fast.dtype() is I32
        assert_exact(flat(fast), flat(ref))
    else:
        assert_close(flat(fast), flat(ref), scale)
    assert_close(flat(ref), f_order(a @ b.T), scale)


# Shapes the CPU backend computes with its direct skinny kernels (few rows, or a short inner dimension;
# see Note [Skinny products] in cpp/src/ops/skinny_gemm.hpp), in each operand order in memory, against the
# Generic reference. These are the Mixture-of-Experts step's products: tokens x expert, and expert gradients.
SKINNY_CASES = [
    ("few-rows/rhs-along-j", ([20, 300], None, 0), ([260, 300], None, 1)),
    ("few-rows/rhs-along-p", ([32, 300], None, 2), ([260, 300], [300, 1], 0)),
    ("few-rows/row-major-lhs", ([5, 257], [257, 1], 0), ([256, 257], None, 0)),
    ("few-rows/padded", ([16, 256], [1, 18], 1), ([270, 256], [258, 1], 3)),
    ("short-inner/outer", ([300, 32], [32, 1], 0), ([257, 32], [32, 1], 0)),
    ("short-inner/col-major", ([256, 17], None, 0), ([260, 17], None, 2)),
]


@pytest.mark.parametrize("case", SKINNY_CASES, ids=[c[0] for c in SKINNY_CASES])
def test_skinny_matmul_matches_generic(case):
    name, vl, vr = case
    rng = rng_for("skinny-matmul", name)
    pl, pr = placed(vl, F32, rng), placed(vr, F32, rng)
    fast = sw.matmul(pl.on(sw.CPU), pr.on(sw.CPU))
    ref = sw.matmul(pl.on(sw.Generic), pr.on(sw.Generic))
    a, b = matrix(pl).astype(np.float64), matrix(pr).astype(np.float64)
    scale = f_order(np.abs(a) @ np.abs(b).T)
    check_result(fast, sw.CPU, [vl[0][0], vr[0][0]], F32)
    assert_close(flat(fast), flat(ref), scale, name)
    assert_close(flat(fast), f_order(a @ b.T), scale, name)


def test_matmul_shape_is_lhs_mode0_by_rhs_mode0():
    """(tokens, in) @ (out, in) -> (tokens, out), nested modes kept as they are."""
    for cls in (sw.CPU, sw.Generic):
        x = place([[2, 3], 4]).on(cls)
        w = place([[5, 1], 4]).on(cls)
        r = sw.matmul(x, w)
        assert r.layout == dense_layout([[2, 3], [5, 1]])
        # result[i, j] spot check against the definition.
        i, j = 4, 3
        expected = sum(x[(i, k)] * w[(j, k)] for k in range(4))
        assert abs(r[(i, j)] - expected) <= 1e-5 * sum(abs(x[(i, k)] * w[(j, k)]) for k in range(4))


# ============================================================ dtype plans


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
def test_int32_with_int32_stays_int32(cls):
    a = place([3], slots=[1, -2, 2_000_000_000], dtype=I32).on(cls)
    b = place([3], slots=[5, 7, 147_483_647], dtype=I32).on(cls)
    for op, expected in [("add", [6, 5, 2_147_483_647]), ("sub", [-4, -9, 1_852_516_353]),
                         ("elementwise_mul", None), ("mul", None)]:
        if expected is None:
            small = place([3], slots=[3, -4, 5], dtype=I32).on(cls)
            r = getattr(sw, op)(small, small)
            expected = [9, 16, 25]
        else:
            r = getattr(sw, op)(a, b)
        assert r.dtype() is I32 and type(r.carrier) is cls
        assert flat(r).tolist() == expected
    assert sw.neg(a).dtype() is I32 and flat(sw.neg(a)).tolist() == [-1, 2, -2_000_000_000]
    d = sw.div(place([2], slots=[7, -7], dtype=I32).on(cls), place([2], slots=[2, 2], dtype=I32).on(cls))
    assert d.dtype() is F32 and flat(d).tolist() == [3.5, -3.5]  # true division
    assert sw.exp(place([1], slots=[0], dtype=I32).on(cls)).dtype() is F32


OVERFLOWS = [
    ("add", lambda t, u: sw.add(t, u), [INT32_MAX, 0], [1, 0]),
    ("add-negative", lambda t, u: sw.add(t, u), [INT32_MIN, 0], [-1, 0]),
    ("sub", lambda t, u: sw.sub(t, u), [0, INT32_MIN], [0, 1]),
    ("elementwise_mul", lambda t, u: sw.elementwise_mul(t, u), [1, 65536], [1, 32768]),
    ("mul", lambda t, u: sw.mul(t, u), [1, 65536], [1, -32769]),
    ("mul-weak-int", lambda t, u: sw.mul(t, 2), [1, 2**30], [0, 0]),
    ("weak-int-mul", lambda t, u: sw.mul(-3, t), [1, 2**30], [0, 0]),
    ("neg", lambda t, u: sw.neg(t), [5, INT32_MIN], [0, 0]),
    ("reduce_sum", lambda t, u: sw.reduce_sum(Tensor(t.carrier, 0, Layout(Shape(1, 2), Stride(1, 1)))),
     [INT32_MAX, 1], [0, 0]),
    ("reduce_sum-desc", lambda t, u: sw.reduce_sum(t, "a -> "), [INT32_MIN, -1], [0, 0]),
    ("matmul", lambda t, u: sw.matmul(Tensor(t.carrier, 0, Layout(Shape(1, 2), Stride(1, 1))),
                                      Tensor(u.carrier, 0, Layout(Shape(1, 2), Stride(1, 1)))),
     [INT32_MAX, 1], [1, 1]),
]


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize("case", OVERFLOWS, ids=[c[0] for c in OVERFLOWS])
def test_int32_overflow_raises(case, cls):
    _, call, x, y = case
    t, u = place([2], slots=x, dtype=I32).on(cls), place([2], slots=y, dtype=I32).on(cls)
    snap = Snapshot(t, u)
    with pytest.raises(OverflowError, match="Int32 result overflows"):
        call(t, u)
    snap.check()


def test_int32_overflow_in_the_threaded_path():
    slots = np.zeros(200_000, dtype=np.int32)
    slots[-1] = INT32_MAX
    t = place([200_000], slots=slots, dtype=I32).on(sw.CPU)
    one = place([1], slots=[1], dtype=I32).on(sw.CPU)
    snap = Snapshot(t, one)
    with pytest.raises(OverflowError, match="Int32 result overflows"):
        sw.add(t, one)
    snap.check()


def test_int32_tensor_with_weak_int_out_of_int32_range_overflows():
    t = place([2], slots=[1, 2], dtype=I32).on(sw.CPU)
    snap = Snapshot(t)
    with pytest.raises(OverflowError):
        sw.mul(t, 2**40)
    snap.check()


@pytest.mark.parametrize(("da", "db"), DTYPE_PAIRS, ids=PAIR_IDS)
def test_binary_dtype_plan(da, db):
    a, b = place([2], dtype=da).on(sw.CPU), place([2], dtype=db).on(sw.CPU)
    for op in ("add", "elementwise_mul", "mul", "sub", "div"):
        assert getattr(sw, op)(a, b).dtype() is binary_dtype(op, da, db), op
    assert sw.matmul(Tensor(a.carrier, 0, Layout(Shape(1, 2), Stride(1, 1))),
                     Tensor(b.carrier, 0, Layout(Shape(1, 2), Stride(1, 1)))).dtype() is binary_dtype("mul", da, db)


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_weak_scalar_dtype_plan(dtype):
    t = place([2], dtype=dtype).on(sw.CPU)
    for scalar in (2, -7, 0, 2**31 - 1):
        if dtype is I32 and scalar == 2**31 - 1:
            continue
        assert sw.mul(t, scalar).dtype() is (I32 if dtype is I32 else F32)
        assert sw.mul(scalar, t).dtype() is (I32 if dtype is I32 else F32)
    for scalar in (2.0, 0.5, -1e-3):
        assert sw.mul(t, scalar).dtype() is F32
        assert sw.mul(scalar, t).dtype() is F32


def test_weak_float_with_int32_computes_in_float32():
    t = place([3], slots=[1, 3, -4], dtype=I32).on(sw.CPU)
    assert flat(sw.mul(t, 0.5)).tolist() == [0.5, 1.5, -2.0]
    assert flat(sw.mul(2.0, t)).tolist() == [2.0, 6.0, -8.0]  # 2.0 is a float: Float32 even though integral


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_relu_and_reduce_sum_keep_the_dtype(dtype):
    for cls in (sw.CPU, sw.Generic):
        t = place([2, 3], dtype=dtype).on(cls)
        assert sw.relu(t).dtype() is dtype
        assert sw.reduce_sum(t).dtype() is dtype
        assert sw.reduce_sum(t, "a b -> b").dtype() is dtype
        assert sw.reduce_sum(t, accumulator_dtype=None).dtype() is dtype
        assert sw.reduce_sum(t, accumulator_dtype=F64).dtype() is F32


@pytest.mark.parametrize("fn", ["reduce_sum", "matmul"])
@pytest.mark.parametrize(("bad", "error"), [
    (F32, ValueError), (I32, ValueError), (BOOL, ValueError),
    ("Float64", TypeError), (np.float64, TypeError), (64, TypeError), (True, TypeError), (float, TypeError),
], ids=["Float32", "Int32", "Bool", "str", "np.float64", "int", "bool", "float-type"])
def test_accumulator_dtype_only_none_or_float64(fn, bad, error):
    a = place([2, 2], dtype=I32).on(sw.CPU)
    b = place([2, 2], dtype=F32).on(sw.CPU)
    snap = Snapshot(a, b)
    with pytest.raises(error, match="accumulator_dtype must be None or DType.Float64"):
        if fn == "reduce_sum":
            sw.reduce_sum(a, accumulator_dtype=bad)
        else:
            sw.matmul(a, b, accumulator_dtype=bad)
    snap.check()
    # None and DType.Float64 are accepted.
    call = (lambda acc: sw.reduce_sum(a, accumulator_dtype=acc)) if fn == "reduce_sum" else \
        (lambda acc: sw.matmul(a, a, accumulator_dtype=acc))
    assert call(None).dtype() is I32
    assert call(F64).dtype() is F32


@pytest.mark.parametrize("op", ["add", "elementwise_mul", "mul", "sub", "div", "relu", "neg", "exp"])
def test_operations_without_an_accumulator_refuse_the_keyword(op):
    t = place([2], dtype=F32).on(sw.CPU)
    args = (t,) if op in ("relu", "neg", "exp") else (t, t)
    with pytest.raises(TypeError):
        getattr(sw, op)(*args, accumulator_dtype=F64)


# ============================================================ broadcasting and results


BROADCAST_OK = [
    ([3, 1], [1, 4], [3, 4]),
    ([1, 4], [3, 1], [3, 4]),
    ([3, 4], [1, 1], [3, 4]),
    ([1, 1], [3, 4], [3, 4]),
    ([2, [1, 4]], [1, [3, 1]], [2, [3, 4]]),
    ([[2, 1], 1], [[1, 3], 5], [[2, 3], 5]),
    ([1], [7], [7]),
]


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize(("sa", "sb", "sr"), BROADCAST_OK, ids=[f"{a}+{b}" for a, b, _ in BROADCAST_OK])
def test_broadcast_extent1_leaves(cls, sa, sb, sr):
    rng = rng_for("bcast", repr(sa), repr(sb))
    pa, pb = place(sa, None, 1, F32, rng), place(sb, None, 2, I32, rng)
    a, b = pa.on(cls), pb.on(cls)
    xa, xb = broadcast_leaves(pa.logical(), pb.logical())
    for op in ("add", "elementwise_mul", "mul", "sub", "div"):
        r = getattr(sw, op)(a, b)
        check_result(r, cls, sr, F32)
        assert_exact(flat(r), f_order(binary_oracle(op, xa, xb, F32)), (op, sa, sb))
        r2 = getattr(sw, op)(b, a)  # order does not change the result shape
        check_result(r2, cls, sr, F32)


BROADCAST_BAD = [
    ([3, 4], [4, 3]),          # leaf extents differ, neither is 1
    ([3, 4], [3, 2]),
    ([3, 4], [3]),             # rank
    ([12], [3, 4]),
    ([3, 4], [3, 4, 1]),
    ([2, [3, 4]], [2, 10]),    # a leaf meets a nested mode of another size (tests/test_compatible_shapes.py)
    ([2, 10], [2, [3, 4]]),
    ([2, [3, 4]], [2, [3, 4, 1]]),
    ([2, [3, 4]], [2, [3, 2]]),
    ([], [1]),
]


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize(("sa", "sb"), BROADCAST_BAD, ids=[f"{a}+{b}" for a, b in BROADCAST_BAD])
@pytest.mark.parametrize("op", ["add", "elementwise_mul", "mul", "sub", "div"])
def test_broadcast_mismatch_raises_before_work(op, sa, sb, cls):
    a, b = place(sa, dtype=F32).on(cls), place(sb, dtype=I32).on(cls)
    snap = Snapshot(a, b)
    with pytest.raises(ValueError, match="broadcast"):
        getattr(sw, op)(a, b)
    with pytest.raises(ValueError, match="broadcast"):
        getattr(sw, op)(b, a)
    snap.check()


def test_broadcast_mismatch_is_detected_before_allocating():
    """A 2^40 x 3 stride-0 view: allocating its result (4 TiB) would fail differently, or not at all."""
    huge = Tensor(sw.CPU(1), 0, Layout(Shape(2**40, 3), Stride(0, 0)))
    small = place([1, 4]).on(sw.CPU)
    snap = Snapshot(huge, small)
    for op in ("add", "elementwise_mul", "mul", "sub", "div"):
        with pytest.raises(ValueError, match="do not broadcast"):
            getattr(sw, op)(huge, small)
    with pytest.raises(ValueError, match="contracted"):
        sw.matmul(huge, Tensor(sw.CPU(1), 0, Layout(Shape(2**40, 4), Stride(0, 0))))
    with pytest.raises(ValueError, match="reduce_sum description"):
        sw.reduce_sum(huge, "a b c -> a")
    snap.check()


def test_results_are_fresh_carriers_never_aliases():
    for cls in (sw.CPU, sw.Generic):
        p = place([2, 3], None, 2, F32)
        a = p.on(cls)
        results = [sw.add(a, a), sw.add(a, a), sw.mul(a, 1), sw.mul(1.0, a), sw.relu(a), sw.neg(a),
                   sw.reduce_sum(a, "a b -> a b"), sw.sub(a, a), sw.div(a, a), sw.exp(a),
                   sw.elementwise_mul(a, a), sw.matmul(a, a)]
        carriers = [r.carrier for r in results] + [a.carrier]
        assert len({id(c) for c in carriers}) == len(carriers)
        for r in results:
            assert type(r.carrier) is cls and r.offset == 0 and r.carrier.is_mutable() and not r.carrier.is_owned()
        # An identity reduction ("a b -> a b") of an offset view is a dense copy.
        ident = results[6]
        check_result(ident, cls, [2, 3], F32)
        assert flat(ident).tolist() == flat(a).tolist()
        before = flat(a).tolist()
        ident[0] = 123.0  # writing a result leaves the operand alone
        assert flat(a).tolist() == before


def test_immutable_operands_compute_into_mutable_results():
    for cls in (sw.CPU, sw.Generic):
        c = sw.CPU(4, mutable=False) if cls is sw.CPU else sw.Generic([1.0, -2.0, 3.0, 0.5], mutable=False)
        t = Tensor(c, 0, Layout(Shape(2, 2), Stride(1, 2)))
        snap = Snapshot(t)
        for r in (sw.add(t, t), sw.mul(t, 2), sw.relu(t), sw.reduce_sum(t), sw.matmul(t, t), sw.exp(t)):
            assert type(r.carrier) is cls and r.carrier.is_mutable()
        snap.check()


def test_result_class_is_the_first_tensor_operands_class():
    for cls in (sw.CPU, sw.Generic, sw.Evictable):
        t = place([2, 2], dtype=F32).on(cls)
        for r in (sw.mul(3, t), sw.mul(t, 3), sw.add(t, t), sw.matmul(t, t), sw.reduce_sum(t)):
            assert type(r.carrier) is cls


# ============================================================ errors (before work)


class Snapshot:
    """Slot values, versions and autograd state of the operands' carriers; check() asserts no change."""

    def __init__(self, *tensors):
        self.tensors = tensors
        self.state = [self._state(t) for t in tensors]

    @staticmethod
    def _state(t):
        c = t.carrier
        slots = None if c.is_released() else [c[i] for i in range(min(c.size(), 4096))]
        grad = t.grad if t.is_differentiable() else "n/a"
        return (c.version, t.version, c.is_released(), c.is_owned(), slots, t.autograd_ctx, grad, t.offset, t.layout)

    def check(self):
        assert [self._state(t) for t in self.tensors] == self.state


NOT_TENSORS = [1, 2.5, True, None, "x", [1.0, 2.0], np.float32(1.0), np.ones(2, dtype=np.float32)]
NOT_TENSOR_IDS = ["int", "float", "bool", "None", "str", "list", "np.float32", "ndarray"]


# Python numbers (int, float) are weak scalars for add and elementwise_mul too: tests/test_ops_activations.py.
@pytest.mark.parametrize("other", NOT_TENSORS[2:], ids=NOT_TENSOR_IDS[2:])
@pytest.mark.parametrize("op", ["add", "elementwise_mul"])
def test_add_and_elementwise_mul_take_two_tensors(op, other):
    t = place([2]).on(sw.CPU)
    snap = Snapshot(t)
    for args in ((t, other), (other, t)):
        with pytest.raises(TypeError, match="Tensor"):
            getattr(sw, op)(*args)
    snap.check()


@pytest.mark.parametrize("other", [True, False, None, "2", [2], np.ones(2)], ids=["True", "False", "None", "str",
                                                                                   "list", "ndarray"])
def test_mul_takes_only_python_numbers_as_weak_scalars(other):
    t = place([2]).on(sw.CPU)
    snap = Snapshot(t)
    for args in ((t, other), (other, t)):
        with pytest.raises(TypeError):
            sw.mul(*args)
    snap.check()


def test_mul_needs_a_tensor_operand():
    with pytest.raises(TypeError, match="Tensor"):
        sw.mul(2, 3.0)


@pytest.mark.parametrize("other", [1, 2.5, None], ids=["int", "float", "None"])
def test_other_operations_refuse_non_tensors(other):
    t = place([2, 2]).on(sw.CPU)
    snap = Snapshot(t)
    calls = [lambda: sw.relu(other), lambda: sw.neg(other), lambda: sw.exp(other), lambda: sw.reduce_sum(other),
             lambda: sw.matmul(t, other), lambda: sw.matmul(other, t), lambda: sw.silu(other), lambda: sw.sigmoid(other)]
    if other is None:  # sub and div take numbers (weak scalars) like add and mul, never None
        calls += [lambda: sw.sub(t, other), lambda: sw.sub(other, t), lambda: sw.div(t, other), lambda: sw.div(other, t)]
    for call in calls:
        with pytest.raises(TypeError, match="Tensor"):
            call()
    snap.check()


def _mixed_pairs():
    return [("CPU", "Generic"), ("Generic", "CPU"), ("CPU", "Evictable"), ("Evictable", "Generic")]


@pytest.mark.parametrize(("ca", "cb"), _mixed_pairs(), ids=[f"{a}-{b}" for a, b in _mixed_pairs()])
@pytest.mark.parametrize("op", ["add", "elementwise_mul", "mul", "sub", "div", "matmul"])
def test_mixed_carrier_classes_raise(op, ca, cb):
    a = place([2, 2], dtype=F32).on(getattr(sw, ca))
    b = place([2, 2], dtype=F32).on(getattr(sw, cb))
    snap = Snapshot(a, b)
    with pytest.raises(TypeError, match="Tensor backing carriers must match"):
        getattr(sw, op)(a, b)
    snap.check()


@pytest.fixture
def arena(tmp_path):
    return block_device(tmp_path / "arena.img", 1 << 20)


def _storage_tensor(kind, arena, dtype=F32):
    c = sw.FileBacked(dtype=dtype).allocate_like(4) if kind == "FileBacked" else arena.allocate(4, dtype=dtype)
    for i in range(4):
        c[i] = (1.5 if dtype is F32 else 1) * (i + 1)
    return Tensor(c, 0, Layout(Shape(2, 2), Stride(1, 2)))


@pytest.mark.parametrize("dtype", [F32, I32], ids=["Float32", "Int32"])
@pytest.mark.parametrize("kind", ["FileBacked", "BlockDeviceCarrier"])
def test_storage_only_carriers_execute_no_operations(kind, dtype, arena):
    t = _storage_tensor(kind, arena, dtype)
    u = _storage_tensor(kind, arena, dtype)
    snap = Snapshot(t, u)
    calls = {"add": lambda: sw.add(t, u), "elementwise_mul": lambda: sw.elementwise_mul(t, u),
             "mul": lambda: sw.mul(t, u), "mul-weak": lambda: sw.mul(t, 2), "weak-mul": lambda: sw.mul(2.0, t),
             "relu": lambda: sw.relu(t), "reduce_sum": lambda: sw.reduce_sum(t, "a b -> b"),
             "matmul": lambda: sw.matmul(t, u), "sub": lambda: sw.sub(t, u), "div": lambda: sw.div(t, u),
             "neg": lambda: sw.neg(t), "exp": lambda: sw.exp(t), "operator+": lambda: t + u,
             "operator@": lambda: t @ u}
    for name, call in calls.items():
        with pytest.raises(NotImplementedError):
            call()
    for name in OPS:
        with pytest.raises(NotImplementedError):
            t.carrier.dispatch_op(name)
    assert t.carrier.operation_capabilities() == ()
    # A storage-only tensor with a CPU one: the class check comes first.
    c = place([2, 2]).on(sw.CPU) if dtype is F32 else place([2, 2], dtype=I32).on(sw.CPU)
    with pytest.raises(TypeError, match="Tensor backing carriers must match"):
        sw.add(c, t)
    snap.check()


def test_pending_await_move_is_not_an_operand():
    src = place([2, 2]).on(sw.CPU)
    other = place([2, 2]).on(sw.CPU)
    handle = sw.move_async(src, sw.CPU(0))  # kept un-waited until every attempt below is done
    snap = Snapshot(other)
    calls = [lambda: sw.add(handle, other), lambda: sw.add(other, handle), lambda: sw.elementwise_mul(handle, other),
             lambda: sw.mul(handle, 2), lambda: sw.mul(2.0, handle), lambda: sw.mul(other, handle),
             lambda: sw.relu(handle), lambda: sw.neg(handle), lambda: sw.exp(handle), lambda: sw.reduce_sum(handle),
             lambda: sw.matmul(other, handle), lambda: sw.matmul(handle, other), lambda: sw.sub(handle, other),
             lambda: sw.div(other, handle), lambda: other + handle, lambda: other @ handle,
             lambda: other.carrier.dispatch_op("add").forward(other, handle)]
    for call in calls:
        with pytest.raises(TypeError, match="Tensor"):
            call()
    snap.check()
    moved = handle.wait()
    assert isinstance(moved, Tensor) and flat(sw.add(moved, other)).tolist() == flat(sw.add(other, moved)).tolist()
    with pytest.raises(TypeError, match="Tensor"):  # a terminal handle is not a Tensor either
        sw.add(handle, other)


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic, sw.Evictable], ids=["CPU", "Generic", "Evictable"])
def test_released_carrier_raises_runtime_error(cls):
    live = place([2, 2]).on(cls)
    dead = place([2, 2]).on(cls)
    dead.carrier.release()
    snap = Snapshot(live, dead)
    calls = [lambda: sw.add(live, dead), lambda: sw.add(dead, live), lambda: sw.elementwise_mul(live, dead),
             lambda: sw.mul(dead, 2), lambda: sw.mul(0.5, dead), lambda: sw.mul(live, dead), lambda: sw.relu(dead),
             lambda: sw.reduce_sum(dead), lambda: sw.matmul(live, dead), lambda: sw.matmul(dead, live),
             lambda: sw.sub(dead, live), lambda: sw.div(live, dead), lambda: sw.neg(dead), lambda: sw.exp(dead),
             lambda: live.carrier.dispatch_op("add").forward(live, dead)]
    for call in calls:
        with pytest.raises(RuntimeError, match="released"):
            call()
    snap.check()


MATMUL_BAD = [
    ("rank1-lhs", [4], [3, 4], "two top-level modes"),
    ("rank1-rhs", [3, 4], [4], "two top-level modes"),
    ("rank3", [3, 4, 1], [2, 4], "two top-level modes"),
    ("rank0", [], [], "two top-level modes"),
    ("one-nested-mode", [[3, 4]], [[3, 4]], "two top-level modes"),
    ("contracted", [3, 4], [5, 3], "contracted"),
    ("contracted-not-broadcast", [3, 1], [5, 4], "contracted"),
    ("contracted-nested", [3, [2, 2]], [5, [2, 3]], "contracted"),
]


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize("case", MATMUL_BAD, ids=[c[0] for c in MATMUL_BAD])
def test_matmul_shape_errors(case, cls):
    _, sl, sr, fragment = case
    a, b = place(sl).on(cls), place(sr).on(cls)
    snap = Snapshot(a, b)
    with pytest.raises(ValueError, match=fragment):
        sw.matmul(a, b)
    with pytest.raises(ValueError, match=fragment):
        sw.matmul(a, b, accumulator_dtype=F64)
    snap.check()


REDUCE_BAD = [
    ("no-arrow", "a b"),
    ("empty", ""),
    ("two-arrows", "a b -> a -> b"),
    ("too-few-names", "a -> a"),
    ("too-many-names", "a b c -> a"),
    ("repeated-name", "a a -> a"),
    ("unknown-kept", "a b -> c"),
    ("kept-twice", "a b -> a a"),
    ("nothing-left", "-> "),
]


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize("case", REDUCE_BAD, ids=[c[0] for c in REDUCE_BAD])
def test_reduce_sum_bad_descriptions(case, cls):
    t = place([3, 4]).on(cls)
    snap = Snapshot(t)
    with pytest.raises(ValueError, match="reduce_sum description"):
        sw.reduce_sum(t, case[1])
    with pytest.raises(ValueError, match="reduce_sum description"):
        t.carrier.dispatch_op("reduce_sum").forward(t, description=case[1])
    snap.check()


@pytest.mark.parametrize("desc", [5, b"a b -> a", ["a", "b"], 1.0, F32], ids=["int", "bytes", "list", "float",
                                                                               "dtype"])
def test_reduce_sum_description_must_be_a_str(desc):
    t = place([3, 4]).on(sw.CPU)
    snap = Snapshot(t)
    with pytest.raises(TypeError, match="description must be a str"):
        sw.reduce_sum(t, desc)
    snap.check()


def test_reduce_sum_description_rank0_input():
    t = place([], [], 1).on(sw.CPU)
    with pytest.raises(ValueError, match="reduce_sum description"):
        sw.reduce_sum(t, "a -> a")
    assert sw.reduce_sum(t, "->")[()] == t[()]


# ============================================================ dispatch_op and operation_capabilities


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic, sw.Evictable], ids=["CPU", "Generic", "Evictable"])
@pytest.mark.parametrize("name", OPS)
def test_dispatch_op_objects(cls, name):
    carrier = place([2, 2]).carrier(cls)
    op1, op2 = carrier.dispatch_op(name), carrier.dispatch_op(name)
    assert op1 is not op2
    for op in (op1, op2):
        assert op.name == op._operation_name == name
        assert op.dispatch_carrier_class is cls
        assert op._dispatch_carrier_class is cls


@pytest.mark.parametrize("cls", [sw.CPU, sw.Generic, sw.Evictable], ids=["CPU", "Generic", "Evictable"])
def test_dispatch_op_forward_equals_the_function(cls):
    rng = rng_for("forward", cls.__name__)
    pa, pb = place([3, 3], None, 1, F32, rng), place([3, 3], [3, 1], 2, F32, rng)
    pi = place([3, 3], None, 0, I32, rng)
    a, b, i = pa.on(cls), pb.on(cls), pi.on(cls)
    carrier = a.carrier
    calls = [
        ("add", (a, b), {}), ("elementwise_mul", (a, b), {}), ("mul", (a, b), {}), ("mul", (a, 2), {}),
        ("mul", (-1.5, b), {}), ("mul", (i, 3), {}), ("relu", (a,), {}), ("neg", (i,), {}), ("exp", (a,), {}),
        ("sub", (a, b), {}), ("div", (a, i), {}), ("matmul", (a, b), {}), ("matmul", (i, i), {}),
        ("matmul", (a, i), {"accumulator_dtype": F64}),
        ("reduce_sum", (a,), {}), ("reduce_sum", (a, "a b -> b"), {}), ("reduce_sum", (a,), {"description": "x y -> "}),
        ("reduce_sum", (i, "a b -> b a"), {"accumulator_dtype": F64}), ("reduce_sum", (i,), {"accumulator_dtype": F64}),
    ]
    for name, args, kwargs in calls:
        expected = getattr(sw, name)(*args, **kwargs)
        got = carrier.dispatch_op(name).forward(*args, **kwargs)
        assert type(got.carrier) is cls, name
        assert got.layout == expected.layout and got.offset == expected.offset == 0, name
        assert got.dtype() is expected.dtype(), name
        assert_exact(flat(got), flat(expected), (name, args))
        if expected.autograd_ctx is None:
            assert got.autograd_ctx is None
        else:
            assert got.autograd_ctx.name == expected.autograd_ctx.name == name
            assert got.autograd_ctx.dispatch_carrier_class is cls


def test_dispatch_op_forward_checks_operands_like_the_function():
    a = place([2, 2]).on(sw.CPU)
    g = place([2, 2]).on(sw.Generic)
    cpu_add = a.carrier.dispatch_op("add")
    snap = Snapshot(a, g)
    with pytest.raises(TypeError, match="Tensor backing carriers must match"):
        cpu_add.forward(g, g)  # operands of another class than the dispatching carrier
    with pytest.raises(TypeError, match="Tensor backing carriers must match"):
        cpu_add.forward(a, g)
    with pytest.raises(TypeError):  # a number is a weak scalar, as sw.add(a, 2) takes it; a str is not
        cpu_add.forward(a, "2")
    with pytest.raises(TypeError):
        cpu_add.forward(a)
    with pytest.raises(TypeError):
        cpu_add.forward(a, a, a)
    with pytest.raises(ValueError, match="broadcast"):
        cpu_add.forward(a, place([3]).on(sw.CPU))
    with pytest.raises(ValueError, match="accumulator_dtype"):
        a.carrier.dispatch_op("matmul").forward(a, a, accumulator_dtype=F32)
    # Keywords the function does not take are refused, as the function refuses them.
    with pytest.raises(TypeError):
        cpu_add.forward(a, a, accumulator_dtype=None)
    with pytest.raises(TypeError):
        a.carrier.dispatch_op("reduce_sum").forward(a, foo=1)
    with pytest.raises(TypeError):
        a.carrier.dispatch_op("reduce_sum").forward(a, "a b -> a", description="a b -> b")
    with pytest.raises(TypeError, match="description must be a str"):
        a.carrier.dispatch_op("reduce_sum").forward(a, 3)
    snap.check()


@pytest.mark.parametrize("name", ["conv", "", "ADD", "add ", "tiled_add", "transpose"])
def test_dispatch_op_unknown_names(name):
    for carrier in (sw.CPU(2), sw.Generic([1.0]), sw.FileBacked()):
        with pytest.raises(NotImplementedError):
            carrier.dispatch_op(name)


def test_dispatch_op_name_must_be_a_str():
    with pytest.raises(TypeError):
        sw.CPU(2).dispatch_op(5)


@pytest.mark.parametrize("name", ["add", "matmul", "conv", 5])
def test_dispatch_op_after_release_raises_runtime_error_whatever_the_name(name):
    primary = sw.CPU(8)
    tiled = sw.TiledEvictable(primary, sw.FileBacked(), (1, 2), (2, 2))
    for carrier in (sw.CPU(2), sw.Generic([1.0]), sw.FileBacked(), tiled):
        carrier.release()
        with pytest.raises(RuntimeError, match="released"):
            carrier.dispatch_op(name)
        assert carrier.is_released()


def test_dispatch_op_on_file_backed_raises():
    for dtype in (F32, I32):
        fb = sw.FileBacked(dtype=dtype)
        for name in OPS:
            with pytest.raises(NotImplementedError):
                fb.dispatch_op(name)


STORAGE = {"CPU": lambda: sw.CPU(4), "Generic": lambda: sw.Generic([0.0]),
           "Evictable": lambda: sw.Evictable(sw.CPU(4), sw.Generic([]))}


@pytest.mark.parametrize("kind", list(STORAGE))
def test_operation_capabilities_entries(kind):
    carrier = STORAGE[kind]()
    caps = carrier.operation_capabilities()
    assert isinstance(caps, tuple) and caps
    assert {e.operation for e in caps} == set(OPS)
    for e in caps:
        assert dataclasses.is_dataclass(e)
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.operation = "x"
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.operands = ()
        assert isinstance(e.operands, tuple)
        arity = 1 if e.operation in ("relu", "neg", "exp", "reduce_sum", "silu", "sigmoid") else 2
        assert len(e.operands) == arity
        roles = [o.role.value for o in e.operands]
        assert set(roles) <= {"tensor", "weak_scalar"}
        assert "tensor" in roles
        if "weak_scalar" in roles:
            assert e.operation in WEAK_SCALAR_OPS
        for o in e.operands:
            with pytest.raises(dataclasses.FrozenInstanceError):
                o.dtype = F64
            assert o.dtype in DTYPES + HALF_DTYPES
            if o.role.value == "tensor":
                assert carrier.supports_storage_dtype(o.dtype)
    assert hash(caps) == hash(carrier.operation_capabilities())  # frozen all the way down
    assert caps == carrier.operation_capabilities()
    # mul accepts weak scalars on either side.
    mul_roles = {tuple(o.role.value for o in e.operands) for e in caps if e.operation == "mul"}
    assert mul_roles == {("tensor", "tensor"), ("tensor", "weak_scalar"), ("weak_scalar", "tensor")}


@pytest.mark.parametrize("name", OPS)
def test_operation_capabilities_filter_by_name(name):
    carrier = sw.CPU(4)
    every = carrier.operation_capabilities()
    only = carrier.operation_capabilities(name)
    assert only == tuple(e for e in every if e.operation == name)
    assert carrier.operation_capabilities(name=name) == only
    assert only and all(e.operation == name for e in only)


def test_operation_capabilities_unknown_name_is_empty():
    assert sw.CPU(4).operation_capabilities("conv") == ()
    assert sw.FileBacked().operation_capabilities() == ()


def test_every_advertised_signature_executes():
    """Each CPU capability entry runs, with the dtype plan of §8."""
    values = {F32: [0.5, -1.0, 2.0, 3.0], I32: [1, -2, 3, 4], BOOL: [True, False, True, True],
              DType.BFloat16: [0.5, -1.0, 2.0, 3.0], DType.Float16: [0.5, -1.0, 2.0, 3.0]}
    for e in sw.CPU(4).operation_capabilities():
        operands = []
        for o in e.operands:
            if o.role.value == "tensor":
                operands.append(Tensor(friendly.tensor(values[o.dtype], dtype=o.dtype).carrier, 0,
                                       Layout(Shape(2, 2), Stride(1, 2))))
            else:
                operands.append(3 if o.dtype is I32 else 0.25)
        r = getattr(sw, e.operation)(*operands)
        assert type(r.carrier) is sw.CPU
        dts = [o.dtype for o in e.operands]
        tensor_dts = [o.dtype for o in e.operands if o.role.value == "tensor"]
        halves = {d for d in tensor_dts if d in HALF_DTYPES}
        # the float dtype (docs/guide.md, "DTypes"): a 16-bit dtype when it is the only float dtype among the
        # tensor operands (Int32, Bool and weak scalars do not promote it), else Float32
        float_dtype = halves.pop() if len(halves) == 1 and F32 not in tensor_dts else F32
        if e.operation in ("relu", "reduce_sum"):
            assert r.dtype() is dts[0]
        elif e.operation in ("div", "exp", "silu", "sigmoid"):
            assert r.dtype() is float_dtype
        elif e.operation == "neg":
            assert r.dtype() is (UNARY_DTYPE["neg"](dts[0]) if dts[0] not in HALF_DTYPES else dts[0])
        else:
            assert r.dtype() is (I32 if all(d is I32 for d in dts) else float_dtype), e


# ============================================================ Tensor operators


def test_operators_call_the_same_path():
    rng = rng_for("operators")
    for cls in (sw.CPU, sw.Generic, sw.Evictable):
        a = place([3, 4], None, 1, F32, rng).on(cls)
        b = place([3, 4], [4, 1], 0, F32, rng).on(cls)
        w = place([5, 4], None, 2, F32, rng).on(cls)
        cases = [
            (lambda: a + b, lambda: sw.add(a, b), "add", (a, b)),
            (lambda: a * b, lambda: sw.mul(a, b), "mul", (a, b)),
            (lambda: a * 2.5, lambda: sw.mul(a, 2.5), "mul", (a,)),
            (lambda: 3 * a, lambda: sw.mul(3, a), "mul", (a,)),
            (lambda: a @ w, lambda: sw.matmul(a, w), "matmul", (a, w)),
            (lambda: a - b, lambda: sw.sub(a, b), "sub", (a, b)),
            (lambda: a / b, lambda: sw.div(a, b), "div", (a, b)),
            (lambda: -a, lambda: sw.neg(a), "neg", (a,)),
        ]
        for operator, function, name, inputs in cases:
            r, s = operator(), function()
            assert type(r.carrier) is cls and r.layout == s.layout and r.dtype() is s.dtype()
            assert_exact(flat(r), flat(s), name)
            node = r.autograd_ctx
            assert node is not None and node.name == s.autograd_ctx.name == name
            assert node._operation_name == name and node.dispatch_carrier_class is cls
            ins = node.inputs()
            assert len(ins) == len(inputs) and all(x is y for x, y in zip(ins, inputs))


def test_operators_on_int32_and_their_errors():
    i = place([2, 2], dtype=I32).on(sw.CPU)
    j = place([2, 2], [2, 1], 1, I32).on(sw.CPU)
    assert flat(i + j).tolist() == flat(sw.add(i, j)).tolist() and (i + j).dtype() is I32
    assert flat(i * 3).tolist() == flat(sw.mul(i, 3)).tolist() and (i * 3).dtype() is I32
    assert flat(i @ j).tolist() == flat(sw.matmul(i, j)).tolist() and (i @ j).autograd_ctx is None
    assert flat(-i).tolist() == flat(sw.neg(i)).tolist()
    g = place([2, 2]).on(sw.Generic)
    snap = Snapshot(i, g)
    with pytest.raises(TypeError):  # a number is a weak scalar (i + 1 is Int32); anything else is refused
        i + None
    with pytest.raises(TypeError):
        "1" + i
    with pytest.raises(TypeError, match="Tensor backing carriers must match"):
        i + g
    with pytest.raises(TypeError, match="Tensor backing carriers must match"):
        g @ i
    with pytest.raises(ValueError, match="broadcast"):
        i * place([3]).on(sw.CPU)
    snap.check()


# ============================================================ Evictable


def _evictable(p: Placed, primary_cls=sw.CPU, secondary=None):
    primary = p.carrier(primary_cls)
    return Tensor(sw.Evictable(primary, secondary or sw.Generic([], dtype=p.dtype)), p.offset, p.layout)


@pytest.mark.parametrize("primary_cls", [sw.CPU, sw.Generic], ids=["CPU-primary", "Generic-primary"])
def test_evictable_computes_on_its_primary_tier(primary_cls):
    rng = rng_for("evictable", primary_cls.__name__)
    pa, pb = place([3, 4], None, 1, F32, rng), place([3, 1], [1, 3], 2, F32, rng)
    pi = place([3, 4], [4, 1], 0, I32, rng)
    pw = place([2, 4], None, 0, F32, rng)
    a, b, i, w = (_evictable(p, primary_cls) for p in (pa, pb, pi, pw))
    ra, rb, ri, rw = (p.on(primary_cls) for p in (pa, pb, pi, pw))
    calls = [
        lambda x, y, z, v: sw.add(x, y), lambda x, y, z, v: sw.elementwise_mul(x, z),
        lambda x, y, z, v: sw.mul(x, y), lambda x, y, z, v: sw.mul(z, 3), lambda x, y, z, v: sw.mul(0.5, x),
        lambda x, y, z, v: sw.relu(x), lambda x, y, z, v: sw.reduce_sum(x, "a b -> b"),
        lambda x, y, z, v: sw.reduce_sum(z, accumulator_dtype=F64), lambda x, y, z, v: sw.matmul(x, v),
        lambda x, y, z, v: sw.matmul(z, z), lambda x, y, z, v: sw.sub(x, y), lambda x, y, z, v: sw.div(z, x),
        lambda x, y, z, v: sw.neg(z), lambda x, y, z, v: sw.exp(x),
    ]
    for k, call in enumerate(calls):
        r, expected = call(a, b, i, w), call(ra, rb, ri, rw)
        assert type(r.carrier) is sw.Evictable, k
        assert type(r.carrier.primary) is primary_cls, k
        assert not r.carrier.is_evicted()
        assert r.offset == 0 and r.layout == expected.layout and r.dtype() is expected.dtype()
        assert_exact(flat(r), flat(expected), k)
        if r.autograd_ctx is not None:
            assert r.autograd_ctx.dispatch_carrier_class is sw.Evictable
    # Results are themselves Evictable: they can be evicted and promoted.
    r = sw.add(a, b)
    values = flat(r).tolist()
    r.carrier.evict()
    r.carrier.promote()
    assert flat(r).tolist() == values


def test_evicted_operand_raises_runtime_error():
    rng = rng_for("evicted")
    pa, pb = place([2, 2], None, 0, F32, rng), place([2, 2], None, 1, F32, rng)
    a, b = _evictable(pa), _evictable(pb)
    a_values = flat(a).tolist()
    a.carrier.evict()
    snap = Snapshot(b)
    version = a.carrier.version
    calls = [lambda: sw.add(a, b), lambda: sw.add(b, a), lambda: sw.mul(a, 2), lambda: sw.mul(2, a),
             lambda: sw.relu(a), lambda: sw.reduce_sum(a), lambda: sw.matmul(b, a), lambda: sw.neg(a),
             lambda: sw.exp(a), lambda: sw.sub(a, b), lambda: sw.div(b, a), lambda: sw.elementwise_mul(a, b),
             lambda: a.carrier.dispatch_op("add").forward(a, b)]
    for call in calls:
        with pytest.raises(RuntimeError, match="evicted"):
            call()
    snap.check()
    assert a.carrier.is_evicted() and a.carrier.version == version and a.autograd_ctx is None
    a.carrier.promote()
    assert flat(a).tolist() == a_values
    assert flat(sw.add(a, b)).tolist() == flat(sw.add(pa.on(sw.CPU), pb.on(sw.CPU))).tolist()


def test_evictable_with_a_storage_only_primary_executes_nothing():
    p = place([2, 2], dtype=F32)
    primary = sw.FileBacked(dtype=F32).allocate_like(len(p.slots))
    for k, v in enumerate(p.slots.tolist()):
        primary[k] = v
    t = Tensor(sw.Evictable(primary, sw.CPU(0)), p.offset, p.layout)
    snap = Snapshot(t)
    with pytest.raises(NotImplementedError):
        sw.add(t, t)
    with pytest.raises(NotImplementedError):
        sw.relu(t)
    with pytest.raises(NotImplementedError):
        sw.mul(2, t)
    # It advertises and dispatches nothing either (§4: unsupported names raise NotImplementedError).
    assert t.carrier.operation_capabilities() == ()
    for name in OPS:
        with pytest.raises(NotImplementedError):
            t.carrier.dispatch_op(name)
    snap.check()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_large_kernels_work_in_a_forked_child():
    """The compute pool's workers do not exist in a child after fork(): its kernels run on the calling thread."""
    n = 1 << 20  # large enough to be split over the compute threads
    a = np.arange(n, dtype=np.float32)
    ta, tb = friendly.tensor(a), friendly.tensor(a)
    assert np.array_equal(np.asarray(sw.add(ta, tb)), a + a)  # the pool has run in the parent
    w = np.ones((16, 512), np.float32)

    def child() -> bool:
        ok = np.array_equal(np.asarray(sw.add(ta, tb)), a + a)
        return ok and np.allclose(np.asarray(sw.matmul(friendly.tensor(w), friendly.tensor(np.ones((300, 512), np.float32)))),
                                  512.0)

    check_in_forked_child(child, "a kernel")
