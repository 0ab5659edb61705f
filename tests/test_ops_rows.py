"""The row operations from Python (docs/guide.md, "Row operations"): sw.softmax, sw.topk, sw.index_select and
sw.index_add.

Each is checked against a Float64 NumPy reference on dense (column-major and row-major), strided (a transposed
view, a sliced view with gaps and an offset) and broadcast (stride-0) layouts, in Float32, BFloat16 and Float16,
on CPU (the fast kernels) and Generic (the reference loops), then on every carrier kind of tests/carrier_kinds.py
(the kinds that execute operations give the same values; the storage-only ones refuse with NotImplementedError
and change nothing). Every VJP is checked against central finite differences (Float32; inputs with gaps for
topk, so the selection does not change under the step) and against its Float64 formula in every dtype; the
adjointness of index_select and index_add is checked exactly; every error path checks the type, a message
fragment and that nothing changed.

Error bounds (u = 2^-24; u16 = 2^-8 for BFloat16, 2^-11 for Float16; results rounded once to 16 bits add
u16 |r|, and Float16's subnormals an absolute 2^-25):
- softmax, Float32: relative 2 (u R + e_exp) + (n + 1) u with R = max |x - max| and e_exp = 2 u (the polynomial
  exp's bound, checked in ops_rows_test.cpp): the argument x - max rounded (u R), exp, a sum of n terms, one
  division; the reference loops (Generic) compute in double and round once, within the same bound.
- topk and index_select: exact (copies).
- index_add: a row receiving c source rows is a Float32 sum of c + 1 terms: gamma_c (|t| + sum |s|).
Random data comes from the `rng` fixture (seed printed).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly

from carrier_kinds import KINDS
from strideweave.carriers.tiled_evictable import TiledEvictable

BASE_SEED = 20261219
F32, I32, BF16, F16 = DType.Float32, DType.Int32, DType.BFloat16, DType.Float16
FLOATS = [F32, BF16, F16]
FLOAT_IDS = ["Float32", "BFloat16", "Float16"]
U = 2.0**-24
U16 = {F32: 0.0, BF16: 2.0**-8, F16: 2.0**-11}
NP = {F32: np.float32, BF16: np.dtype(ml_dtypes.bfloat16), F16: np.float16, I32: np.int32}
EXECUTING = {"Generic", "CPU", "Evictable", "TiledEvictable"}  # the kinds with an operation backend


def rounded(a, dtype):
    """`a` rounded to `dtype`, as float64."""
    return np.asarray(a, dtype=np.float64).astype(NP[dtype]).astype(np.float64)


def extents(t: Tensor) -> tuple:
    return tuple(t.layout.shape.extents)


def values(t: Tensor) -> np.ndarray:
    """The logical values of a two-mode (or one-mode) tensor, as float64."""
    if isinstance(t.carrier, sw.CPU):
        return np.asarray(t).astype(np.float64)
    shape = extents(t)
    out = np.empty(shape)
    for idx in np.ndindex(*shape):
        out[idx] = t[idx if len(idx) > 1 else idx[0]]
    return out


def flat_carrier(slots, dtype, factory):
    return factory(np.asarray(slots, dtype=np.float64), dtype)


def cpu_factory(slots, dtype):
    return friendly.tensor(slots.astype(NP[dtype]) if dtype is not I32 else slots.astype(np.int32), dtype=dtype).carrier


def generic_factory(slots, dtype):
    return friendly.tensor(slots.astype(NP[dtype]) if dtype is not I32 else slots.astype(np.int32), dtype=dtype,
                           carrier=sw.Generic).carrier


FACTORIES = {"CPU": cpu_factory, "Generic": generic_factory}
LAYOUTS = ["column-major", "row-major", "transposed", "sliced", "broadcast"]


def place(a: np.ndarray, dtype, how: str, factory=cpu_factory):
    """A tensor of a's shape (two modes) holding `a` (rounded to dtype) in the layout `how`, and its values."""
    a = rounded(a, dtype)
    m, n = a.shape
    if how == "column-major":
        slots, off, shape, stride = a.ravel(order="F"), 0, (m, n), (1, m)
    elif how == "row-major":
        slots, off, shape, stride = a.ravel(order="C"), 0, (m, n), (n, 1)
    elif how == "transposed":  # the transpose of a column-major (n, m) tensor
        slots, off, shape, stride = a.T.ravel(order="F"), 0, (m, n), (n, 1)
    elif how == "sliced":  # every other slot along mode 0, rows 2m + 3 apart, from offset 5
        slots = np.zeros(5 + (2 * m + 3) * n)
        for i in range(m):
            for j in range(n):
                slots[5 + 2 * i + (2 * m + 3) * j] = a[i, j]
        off, shape, stride = 5, (m, n), (2, 2 * m + 3)
    elif how == "broadcast":  # mode 0 of stride 0: every row is row 0
        a = np.repeat(a[:1], m, axis=0)
        slots, off, shape, stride = a[0], 0, (m, n), (0, 1)
    else:
        raise AssertionError(how)
    c = factory(np.asarray(slots, dtype=np.float64), dtype)
    return Tensor(c, off, Layout(Shape(*shape), Stride(*stride))), a


def indices_on(idx, factory=cpu_factory):
    return Tensor(factory(np.asarray(idx, dtype=np.float64), I32), 0, Layout(Shape(len(idx)), Stride(1)))


# ============================================================ references and bounds


def softmax64(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_bound(x, axis, dtype):
    """Per-element bound on |softmax(x) - reference| (module docstring), with 1% slack for second-order terms."""
    y = softmax64(x, axis)
    n = x.shape[axis]
    R = np.max(np.max(x, axis=axis, keepdims=True) - x, axis=axis, keepdims=True)
    rel = 1.01 * (2 * (U * R + 2 * U) + (n + 1) * U)
    b = rel * y
    u16 = U16[dtype]
    if u16:
        b = u16 * y + (1 + u16) * b + (2.0**-25 if dtype is F16 else 0.0)
    return y, b


def topk64(x, k, axis):
    """Values and indices of the reference order: NaN first, then larger, equal values by the lower index."""
    x = np.moveaxis(x, axis, -1)
    vals = np.empty(x.shape[:-1] + (k,))
    idx = np.empty(x.shape[:-1] + (k,), dtype=np.int64)
    for pos in np.ndindex(*x.shape[:-1]):
        row = x[pos]
        order = sorted(range(len(row)), key=lambda i: (0, 0.0, i) if math.isnan(row[i]) else (1, -row[i], i))[:k]
        vals[pos], idx[pos] = row[order], order
    return np.moveaxis(vals, -1, axis), np.moveaxis(idx, -1, axis)


def index_add64(t, axis, idx, src):
    """t + the source rows sent to each row, and the bound gamma_c (|t| + sum |s|) per element (c: rows sent)."""
    r, mag = t.copy(), np.abs(t)
    count = np.zeros(t.shape[axis])
    for j, d in enumerate(idx):
        sl = [slice(None)] * t.ndim
        sl[axis] = d
        ssl = [slice(None)] * t.ndim
        ssl[axis] = j
        r[tuple(sl)] += src[tuple(ssl)]
        mag[tuple(sl)] += np.abs(src[tuple(ssl)])
        count[d] += 1
    shape = [1] * t.ndim
    shape[axis] = t.shape[axis]
    c = count.reshape(shape)
    return r, c * U / (1 - c * U) * mag


def assert_within(got, want, bound, what):
    err = np.abs(got - want)
    assert np.all(err <= bound), (what, float(np.max(err - bound)))


# ============================================================ forward against Float64


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("backend", ["CPU", "Generic"])
def test_softmax_against_float64(dtype, how, backend, rng):
    for shape, scale in (((5, 7), 3.0), ((3, 37), 8.0), ((2, 1), 1.0)):
        t, a = place(rng.standard_normal(shape) * scale, dtype, how, FACTORIES[backend])
        for mode in (0, 1, -1, -2):
            y = sw.softmax(t, mode)
            assert y.dtype() is dtype and extents(y) == shape and type(y.carrier) is type(t.carrier)
            want, bound = softmax_bound(a, mode, dtype)
            assert_within(values(y), want, bound, (shape, mode))


def test_softmax_large_rows_and_results_are_row_major_like_their_operand(rng):
    # Rows long enough to split over the compute threads, both orders; a row-major operand gives a row-major result.
    a = rng.standard_normal((300, 260)) * 4
    for how in ("column-major", "row-major"):
        t, a32 = place(a, F32, how)
        for mode in (0, 1):
            want, bound = softmax_bound(a32, mode, F32)
            y = sw.softmax(t, mode)
            assert_within(values(y), want, bound, (how, mode))
            assert y.layout == (friendly.row_major(Shape(300, 260)) if how == "row-major"
                                else friendly.column_major(Shape(300, 260)))


@pytest.mark.parametrize("backend", ["CPU", "Generic"])
def test_softmax_nan_and_infinities(backend):
    a = np.array([[0.0, 1.0, np.nan, 2.0], [-np.inf, 0.0, 1.0, -np.inf], [np.inf, 0.0, 1.0, 2.0]]).T  # rows: mode 0
    t, _ = place(a, F32, "column-major", FACTORIES[backend])
    y = values(sw.softmax(t, 0))
    assert np.all(np.isnan(y[:, 0]))  # a NaN makes its row NaN
    assert y[0, 1] == 0.0 and y[3, 1] == 0.0 and abs(y[1, 1] + y[2, 1] - 1) < 1e-6  # -inf gives 0
    assert np.all(np.isnan(y[:, 2]))  # an infinite maximum: inf - inf


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("backend", ["CPU", "Generic"])
def test_topk_against_float64(dtype, how, backend, rng):
    for shape in ((6, 9), (3, 40), (1, 1)):
        a = rng.integers(-6, 7, shape) / 4.0  # many ties
        t, a = place(a, dtype, how, FACTORIES[backend])
        for mode in (0, 1, -1):
            n = shape[mode]
            for k in sorted({1, min(2, n), n, max(1, n // 2)} | ({33} if n >= 33 else set())):
                v, i = sw.topk(t, k, mode)
                assert v.dtype() is dtype and i.dtype() is I32
                assert not i.is_differentiable()
                wv, wi = topk64(a, k, mode)
                assert np.array_equal(values(v), wv), (shape, mode, k)
                assert np.array_equal(values(i), wi), (shape, mode, k)


@pytest.mark.parametrize("backend", ["CPU", "Generic"])
def test_topk_nan_is_largest_and_signed_zeros_tie(backend):
    a = np.array([[1.0, np.nan, 3.0, -0.0, 0.0, np.nan, 2.0]])
    t, _ = place(a, F32, "row-major", FACTORIES[backend])
    v, i = sw.topk(t, 7, 1)
    assert values(i).tolist() == [[1, 5, 2, 6, 0, 3, 4]]
    got = values(v)[0]
    assert np.isnan(got[:2]).all() and got[2:].tolist() == [3.0, 2.0, 1.0, 0.0, 0.0]
    assert math.copysign(1, got[5]) == -1 and math.copysign(1, got[6]) == 1  # -0.0 (index 3) before 0.0


@pytest.mark.parametrize("dtype", FLOATS + [I32], ids=FLOAT_IDS + ["Int32"])
@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("backend", ["CPU", "Generic"])
def test_index_select_is_exact(dtype, how, backend, rng):
    a = rng.integers(-50, 50, (6, 5)).astype(np.float64)
    t, a = place(a, dtype, how, FACTORIES[backend])
    for mode in (0, 1, -1):
        n = a.shape[mode]
        for idx in ([0], list(range(n))[::-1], [n - 1, 0, n - 1, 1, 1, 2, 0]):
            r = sw.index_select(t, mode, indices_on(idx, FACTORIES[backend]))
            assert r.dtype() is dtype
            assert np.array_equal(values(r), np.take(a, idx, axis=mode)), (mode, idx)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("backend", ["CPU", "Generic"])
def test_index_add_against_float64(dtype, how, backend, rng):
    a = rng.standard_normal((6, 5)) * 4
    t, a = place(a, dtype, how, FACTORIES[backend])
    before = values(t)
    for mode in (0, 1):
        n = a.shape[mode]
        idx = [n - 1, 0, n - 1, 1, n - 1, 0, 2]  # duplicates accumulate
        sshape = list(a.shape)
        sshape[mode] = len(idx)
        s, s64 = place(rng.standard_normal(sshape) * 4, dtype, "row-major", FACTORIES[backend])
        r = sw.index_add(t, mode, indices_on(idx, FACTORIES[backend]), s)
        assert r.dtype() is dtype and extents(r) == a.shape
        want, bound = index_add64(a, mode, idx, s64)
        u16 = U16[dtype]
        assert_within(values(r), want, u16 * np.abs(want) + (1 + u16) * bound + (2.0**-25 if dtype is F16 else 0), mode)
    assert np.array_equal(values(t), before)  # t is not changed


def test_index_add_rounds_a_long_16_bit_sum_once():
    # 256 ones into one BFloat16 row holding 256: each partial sum rounded to bf16 would stay at 256 (256 + 1 rounds
    # to 256 with 8 significant bits); accumulated in Float32 and rounded once, the row holds 512.
    t = friendly.tensor(np.full((2, 1), 256.0), dtype=BF16)
    s = friendly.tensor(np.ones((256, 1)), dtype=BF16)
    r = sw.index_add(t, 0, indices_on([1] * 256), s)
    assert values(r).ravel().tolist() == [256.0, 512.0]


def test_a_hierarchical_mode_that_coalesces_works_and_one_that_does_not_is_refused():
    c = friendly.tensor(np.arange(24.0)).carrier
    coalesced = Tensor(c, 0, Layout(Shape([2, 3], 4), Stride([1, 2], 6)))  # mode 0 is (2, 3):(1, 2): one stride
    flat = Tensor(c, 0, Layout(Shape(6, 4), Stride(1, 6)))
    assert np.array_equal(np.asarray(sw.softmax(coalesced, 0)).reshape(6, 4, order="F"), np.asarray(sw.softmax(flat, 0)))
    gapped = Tensor(c, 0, Layout(Shape([2, 3], 2), Stride([1, 4], 12)))
    version = c.version
    with pytest.raises(ValueError, match="hierarchical and its leaves do not coalesce"):
        sw.softmax(gapped, 0)
    assert c.version == version
    assert sw.softmax(gapped, 1).dtype() is F32  # along the other mode it works


# ============================================================ every carrier kind


def kind_indices(kind, idx):
    """A one-mode Int32 index tensor on `kind`; on TiledEvictable, one of a single axis (a tensor covers a
    TiledEvictable's full logical shape, and the registry's carriers of 4 slots have two axes)."""
    if kind.name == "TiledEvictable":
        sec = sw.FileBacked(dtype=I32).allocate_like(len(idx))
        for k, v in enumerate(idx):
            sec[k] = v
        carrier = TiledEvictable(sw.CPU(0, dtype=I32), sec, (1,), (len(idx),))
    else:
        carrier = kind.make(list(idx), I32)
    return Tensor(carrier, 0, Layout(Shape(len(idx)), Stride(1)))


@pytest.mark.parametrize("kind_cls", KINDS, ids=[k.name for k in KINDS])
def test_every_carrier_kind(kind_cls, tmp_path, rng):
    kind = kind_cls(tmp_path)
    dtypes = FLOATS if kind.name in EXECUTING else [F32]
    for dtype in dtypes:
        a = rounded(rng.integers(-40, 40, (4, 6)) / 8.0, dtype)
        slots = a.ravel(order="F")
        t = Tensor(kind.make([float(v) for v in slots], dtype), 0, Layout(Shape(4, 6), Stride(1, 4)))
        ind = kind_indices(kind, [2, 0, 2, 1])
        src_vals = rounded(rng.integers(-40, 40, (4, 6)) / 8.0, dtype)  # t's shape: one tile geometry for both
        src = Tensor(kind.make([float(v) for v in src_vals.ravel(order="F")], dtype), 0, Layout(Shape(4, 6), Stride(1, 4)))
        calls = {
            "softmax": lambda: sw.softmax(t, 1),
            "topk": lambda: sw.topk(t, 2, 1),
            "index_select": lambda: sw.index_select(t, 0, ind),
            "index_add": lambda: sw.index_add(t, 0, ind, src),
        }
        if kind.name not in EXECUTING:
            version = t.carrier.version
            for name, call in calls.items():
                with pytest.raises(NotImplementedError):
                    call()
                with pytest.raises(NotImplementedError):
                    t.carrier.dispatch_op(name)
            assert t.carrier.operation_capabilities("softmax") == ()
            assert t.carrier.version == version and [t.carrier[i] for i in range(24)] == slots.tolist()
            continue
        want, bound = softmax_bound(a, 1, dtype)
        assert_within(values(calls["softmax"]()), want, bound, (kind.name, dtype.name))
        v, i = calls["topk"]()
        wv, wi = topk64(a, 2, 1)
        assert np.array_equal(values(v), wv) and np.array_equal(values(i), wi), (kind.name, dtype.name)
        assert np.array_equal(values(calls["index_select"]()), a[[2, 0, 2, 1]])
        want = a.copy()
        want[2] += src_vals[0] + src_vals[2]
        want[0] += src_vals[1]
        want[1] += src_vals[3]
        assert np.array_equal(values(calls["index_add"]()), rounded(want, dtype))  # eighths: exact sums
        assert np.array_equal(values(t), a)  # unchanged
        # dispatch_op mirrors the module functions; operation_capabilities lists operand signatures only, and a
        # row operation also takes a mode (and k): it is not listed
        assert np.array_equal(values(t.carrier.dispatch_op("topk").forward(t, 2, 1)[1]), wi)
        assert np.array_equal(values(t.carrier.dispatch_op("softmax").forward(t, 1)), values(sw.softmax(t, 1)))
        names = {c.operation for c in t.carrier.operation_capabilities()}
        assert names and not names & {"softmax", "topk", "index_select", "index_add"}


# ============================================================ VJPs


def loss_grad(make, t, w):
    """d/dt of sum(w * make(t)) through backward(); w a float64 array of the result's shape."""
    out = make(t)
    out.backward(gradient=friendly.tensor(w.astype(np.float32)))
    return values(t.grad)


def finite_difference(make, a, w, h, dtype=F32):
    """Central differences of sum(w * make(t)) over every element of a (float64 sums of the results)."""
    g = np.zeros_like(a)
    for idx in np.ndindex(*a.shape):
        plus, minus = a.copy(), a.copy()
        plus[idx] += h
        minus[idx] -= h
        fp = np.sum(w * values(make(friendly.tensor(plus.astype(np.float32)))))
        fm = np.sum(w * values(make(friendly.tensor(minus.astype(np.float32)))))
        g[idx] = (fp - fm) / (2 * h)
    return g


@pytest.mark.parametrize("mode", [0, 1])
def test_softmax_vjp_against_finite_differences(mode, rng):
    a = rounded(rng.standard_normal((4, 5)), F32)
    w = rng.uniform(-1, 1, (4, 5))
    t = friendly.tensor(a.astype(np.float32))
    got = loss_grad(lambda x: sw.softmax(x, mode), t, w)
    h = 2.0**-7
    fd = finite_difference(lambda x: sw.softmax(x, mode), a, w, h)
    # FD error: each loss is within eps_f = sum |w| * (softmax bound) of the exact one, so rounding adds eps_f / h;
    # truncation h^2 / 6 * |f'''| with |third derivatives of softmax| <= 1 per (output, input): h^2 / 6 * sum |w|;
    # x +- h is exact (a is Float32 with |a| < 4, h = 2^-7, so the sum fits 24 bits? not always: add 2u|a| / h).
    _, b = softmax_bound(a, mode, F32)
    eps_f = np.sum(np.abs(w) * b)
    tol = eps_f / h + h**2 / 6 * np.sum(np.abs(w)) + 2 * U * 4 / h
    assert np.all(np.abs(got - fd) <= tol), float(np.max(np.abs(got - fd)))


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("how", ["column-major", "row-major", "sliced"])
def test_softmax_vjp_against_its_formula(dtype, how, rng):
    t, a = place(rng.standard_normal((5, 6)) * 2, dtype, how)
    w = rng.uniform(-1, 1, (5, 6))
    for mode in (0, 1):
        t.grad = None
        y = softmax64(a, mode)
        d = np.sum(w * y, axis=mode, keepdims=True)
        want = y * (w - d)
        got = loss_grad(lambda x: sw.softmax(x, mode), t, w)
        # y computed in Float32 within e_y (the Float32 softmax bound), g exact in Float32 (w rounded once:
        # |w| <= 1, u), dot over n terms: |error| <= 3 (e_y + (n + 2) u) y (|w| + |d| + sum |w| y) + u16 |want|.
        n = a.shape[mode]
        _, by = softmax_bound(a, mode, F32)
        ey = np.max(by / np.maximum(y, 1e-300))
        s = np.sum(np.abs(w) * y, axis=mode, keepdims=True)
        bound = 3 * (ey + (n + 2) * U) * y * (np.abs(w) + np.abs(d) + s) + U16[dtype] * np.abs(want)
        if dtype is F16:
            bound = bound + 2.0**-25
        assert_within(got, want, bound, (how, mode))


def test_topk_vjp_against_finite_differences(rng):
    # Distinct quarters (gaps of 1/4 > 2h), h = 2^-6: x +- h exact, the selection unchanged, the FD exact.
    a = rng.permutation(20).reshape(4, 5) / 4.0
    w = rng.uniform(-1, 1, (4, 2))
    t = friendly.tensor(a.astype(np.float32))
    got = loss_grad(lambda x: sw.topk(x, 2, 1)[0], t, w)
    fd = finite_difference(lambda x: sw.topk(x, 2, 1)[0], a, w, 2.0**-6)
    assert np.allclose(got, fd, rtol=0, atol=1e-6)  # float64 sums of Float32 products: |error| <= 2^-20
    _, idx = topk64(a, 2, 1)
    want = np.zeros_like(a)
    for r in range(4):
        want[r, idx[r]] = w[r].astype(np.float32)
    assert np.array_equal(got, want)  # the gradient lands exactly in the selected positions


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_topk_vjp_in_every_dtype_with_ties(dtype, rng):
    a = np.array([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 5.0]])
    t = friendly.tensor(a.astype(NP[dtype]), dtype=dtype)
    w = np.array([[0.5, -0.25], [2.0, 4.0]])
    got = loss_grad(lambda x: sw.topk(x, 2, 1)[0], t, w)
    assert got.tolist() == [[0.0, 0.5, -0.25, 0.0], [4.0, 0.0, 0.0, 2.0]]  # ties: the lower index first


@pytest.mark.parametrize("mode", [0, 1])
def test_index_select_and_index_add_vjps_against_finite_differences(mode, rng):
    a = rng.integers(-16, 16, (4, 3)) / 8.0
    idx = [2, 0, 2, 1, 2]
    sshape = [4, 3]
    sshape[mode] = len(idx)
    w = rng.integers(-8, 8, sshape) / 4.0
    ind = indices_on(idx)
    t = friendly.tensor(a.astype(np.float32))
    got = loss_grad(lambda x: sw.index_select(x, mode, ind), t, w)
    fd = finite_difference(lambda x: sw.index_select(x, mode, ind), a, w, 2.0**-4)
    assert np.array_equal(got, fd)  # linear, dyadic data: exact
    # index_add: d/dt is the identity, d/dsource index_select of the gradient
    s0 = rng.integers(-16, 16, sshape) / 8.0
    w2 = rng.integers(-8, 8, (4, 3)) / 4.0
    t2, s = friendly.tensor(a.astype(np.float32)), friendly.tensor(s0.astype(np.float32))
    out = sw.index_add(t2, mode, ind, s)
    out.backward(gradient=friendly.tensor(w2.astype(np.float32)))
    assert np.array_equal(values(t2.grad), w2)
    assert np.array_equal(values(s.grad), np.take(w2, idx, axis=mode))
    fd_s = finite_difference(lambda x: sw.index_add(friendly.tensor(a.astype(np.float32)), mode, ind, x), s0, w2, 2.0**-4)
    assert np.array_equal(values(s.grad), fd_s)
    assert not ind.is_differentiable()


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_index_vjps_in_16_bit_and_through_a_graph(dtype, rng):
    # loss = sum(index_add(x, 0, idx, softmax(index_select(x, 0, idx), 1)) * w): gradients flow through all three.
    a = rounded(rng.standard_normal((4, 3)), dtype)
    idx = [1, 3, 1]
    ind = indices_on(idx)
    w = rng.uniform(-1, 1, (4, 3))
    x = friendly.tensor(a.astype(NP[dtype]), dtype=dtype)
    sel = sw.index_select(x, 0, ind)
    out = sw.index_add(x, 0, ind, sw.softmax(sel, 1))
    out.backward(gradient=friendly.tensor(w.astype(np.float32)))
    sel64 = a[idx]
    y = softmax64(sel64, 1)
    gs = w[idx]
    gsel = y * (gs - np.sum(gs * y, axis=1, keepdims=True))
    want = w.copy()
    for j, d in enumerate(idx):
        want[d] += gsel[j]
    _, by = softmax_bound(sel64, 1, F32)
    bound = 8 * (np.max(by) + 8 * U) + U16[dtype] * np.abs(want) + (2.0**-25 if dtype is F16 else 0)
    assert_within(values(x.grad), want, bound, dtype.name)


def test_index_select_and_index_add_are_adjoint(rng):
    # <index_select(x), y> == <x, index_add(0, y)>: integer data, so both sides are exact.
    for mode, shape in ((0, (7, 5)), (1, (3, 9))):
        idx = rng.integers(0, shape[mode], 11).tolist()
        ind = indices_on(idx)
        x = rng.integers(-20, 20, shape).astype(np.float64)
        yshape = list(shape)
        yshape[mode] = len(idx)
        y = rng.integers(-20, 20, yshape).astype(np.float64)
        tx, ty = friendly.tensor(x.astype(np.float32)), friendly.tensor(y.astype(np.float32))
        lhs = np.sum(values(sw.index_select(tx, mode, ind)) * y)
        rhs = np.sum(x * values(sw.index_add(friendly.zeros(*shape), mode, ind, ty)))
        assert lhs == rhs


# ============================================================ errors


def snapshot(*ts):
    return [(t.carrier.version, values(t).tolist() if t.dtype() is not I32 else np.asarray(t).tolist()) for t in ts]


ERRORS = [
    ("softmax Int32", TypeError, "softmax: t must be a floating-point tensor", lambda t, i, s: sw.softmax(i, 0)),
    ("mode out of range", ValueError, "softmax: mode 2 is out of range for a tensor of 2 modes",
     lambda t, i, s: sw.softmax(t, 2)),
    ("negative mode out of range", ValueError, "mode -3 is out of range", lambda t, i, s: sw.topk(t, 1, -3)),
    ("mode a float", TypeError, "softmax: mode must be an int, got float", lambda t, i, s: sw.softmax(t, 1.0)),
    ("mode a bool", TypeError, "mode must be an int, got bool", lambda t, i, s: sw.softmax(t, True)),
    ("k zero", ValueError, r"topk: k=0 is out of range for mode 1 of extent 4 \(1 <= k <= 4\)",
     lambda t, i, s: sw.topk(t, 0, 1)),
    ("k too large", ValueError, "k=5 is out of range", lambda t, i, s: sw.topk(t, 5, -1)),
    ("k a float", TypeError, "topk: k must be an int", lambda t, i, s: sw.topk(t, 2.0, 1)),
    ("indices Float32", TypeError, "index_select: indices must be an Int32 tensor, got Float32",
     lambda t, i, s: sw.index_select(t, 0, t)),
    ("indices two modes", ValueError, "indices must have one mode",
     lambda t, i, s: sw.index_select(t, 0, Tensor(i.carrier, 0, Layout(Shape(1, 2), Stride(1, 1))))),
    ("index too large", IndexError, r"index_select: index 3 \(position 1 of indices\) is out of range for mode 0 of extent 3",
     lambda t, i, s: sw.index_select(t, 0, indices_on([0, 3]))),
    ("negative index", IndexError, r"index_add: index -1 \(position 0 of indices\) is out of range for mode 1 of extent 4",
     lambda t, i, s: sw.index_add(t, 1, indices_on([-1]), friendly.tensor(np.ones((3, 1), np.float32)))),
    ("index_add source dtype", TypeError, "index_add: source is BFloat16 but t is Float32",
     lambda t, i, s: sw.index_add(t, 0, indices_on([0]), friendly.tensor(np.ones((1, 4)), dtype=BF16))),
    ("index_add source shape", ValueError, "index_add: source has shape",
     lambda t, i, s: sw.index_add(t, 0, indices_on([0, 1]), s)),
    ("index_add Int32 t", TypeError, "index_add: t must be a floating-point tensor",
     lambda t, i, s: sw.index_add(i, 0, indices_on([0]), i)),
    ("operand kinds differ", TypeError, "Tensor backing carriers must match",
     lambda t, i, s: sw.index_select(t, 0, indices_on([0], generic_factory))),
    ("a number operand", TypeError, "operands must be Tensors", lambda t, i, s: sw.softmax(2.0, 0)),
    ("no modes", ValueError, "softmax: a tensor of no modes has no mode to work along",
     lambda t, i, s: sw.softmax(Tensor(t.carrier, 0, Layout(Shape(), Stride())), 0)),
    ("mode too large for an int64", ValueError, "softmax: mode is out of range", lambda t, i, s: sw.softmax(t, 2**70)),
    ("forward keywords", TypeError, r"softmax.forward\(\) takes positional arguments only",
     lambda t, i, s: t.carrier.dispatch_op("softmax").forward(t, mode=1)),
    ("forward kinds differ", TypeError, "index_select: Tensor backing carriers must match",
     lambda t, i, s: t.carrier.dispatch_op("index_select").forward(t, 0, indices_on([0], generic_factory))),
    ("forward arity", TypeError, r"topk.forward\(\) takes 3 arguments, got 2",
     lambda t, i, s: t.carrier.dispatch_op("topk").forward(t, 2)),
]


@pytest.mark.parametrize("name,exc,fragment,call", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, exc, fragment, call):
    t = friendly.tensor(np.arange(12.0).reshape(3, 4))
    i = friendly.tensor(np.arange(6, dtype=np.int32).reshape(3, 2), dtype=I32)
    s = friendly.tensor(np.ones((1, 4), np.float32))
    before = snapshot(t, i, s)
    with pytest.raises(exc, match=fragment):
        call(t, i, s)
    assert snapshot(t, i, s) == before


def test_an_out_of_range_index_writes_nothing_anywhere():
    # The range check runs before the result is allocated: nothing of t, the indices or the source changes, and
    # no node is recorded (grad mode on, a differentiable t).
    t = friendly.tensor(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    ind = indices_on([0, 1, 2, 1, 7])
    s = friendly.tensor(np.ones((5, 4), np.float32))
    before = snapshot(t, ind, s)
    with pytest.raises(IndexError, match="index 7 \\(position 4 of indices\\) is out of range for mode 0 of extent 3"):
        sw.index_add(t, 0, ind, s)
    assert snapshot(t, ind, s) == before and t.grad is None


@pytest.mark.parametrize("kind_cls", [k for k in KINDS if k.name in EXECUTING], ids=[k.name for k in KINDS if k.name in EXECUTING])
def test_vjps_on_every_executing_kind(kind_cls, tmp_path, rng):
    # The gradient of each operation's input on every kind that executes them, against its Float64 formula (the
    # softmax bound as in test_softmax_vjp_against_its_formula; the others exact: eighths).
    kind = kind_cls(tmp_path)
    a = rng.integers(-40, 40, (4, 6)) / 8.0

    def leaf():
        return Tensor(kind.make([float(v) for v in a.ravel(order="F")], F32), 0, Layout(Shape(4, 6), Stride(1, 4)))

    def grad_of(out, w):
        out.backward(gradient=friendly.tensor(w.astype(np.float32)))

    x = leaf()
    w = rng.integers(-8, 8, (4, 6)) / 4.0
    grad_of(sw.softmax(x, 1), w)
    y = softmax64(a, 1)
    d = np.sum(w * y, axis=1, keepdims=True)
    want = y * (w - d)
    _, by = softmax_bound(a, 1, F32)
    bound = 3 * (np.max(by / y) + 8 * U) * y * (np.abs(w) + np.abs(d) + np.sum(np.abs(w) * y, axis=1, keepdims=True))
    assert_within(values(x.grad), want, bound, kind.name)

    x = leaf()
    w2 = rng.integers(-8, 8, (4, 2)) / 4.0
    a_distinct = a + np.arange(24).reshape(4, 6) / 1024.0  # no ties
    x2 = Tensor(kind.make([float(v) for v in a_distinct.ravel(order="F")], F32), 0, Layout(Shape(4, 6), Stride(1, 4)))
    grad_of(sw.topk(x2, 2, 1)[0], w2)
    _, idx = topk64(a_distinct, 2, 1)
    want = np.zeros((4, 6))
    for r in range(4):
        want[r, idx[r]] = w2[r]
    assert np.array_equal(values(x2.grad), want), kind.name

    ind = kind_indices(kind, [2, 0, 2, 1])
    x = leaf()
    grad_of(sw.index_select(x, 0, ind), w)
    want = np.zeros((4, 6))
    for j, dst in enumerate([2, 0, 2, 1]):
        want[dst] += w[j]
    assert np.array_equal(values(x.grad), want), kind.name
    x, s = leaf(), leaf()
    grad_of(sw.index_add(x, 0, ind, s), w)
    assert np.array_equal(values(x.grad), w) and np.array_equal(values(s.grad), w[[2, 0, 2, 1]]), kind.name
