"""NaN and infinities through every activation and reduction, against PyTorch (docs/reliability.md, "Hostile use").

Each operation gets NaN (quiet and signalling, either sign, with payloads), +Inf, -Inf, signed zeros and ordinary
values in Float32, BFloat16 and Float16, in tensors whose sizes reach the kernels' vector bodies, their scalar tails
(16-lane AVX-512 loops, 512-element 16-bit blocks) and the compute threads (past the 2**15 / 2**16 grains), on CPU
(the fast kernels: dense and strided runs) and Generic (the reference loops). PyTorch 2.x on the same bits is the
oracle:
  - NaN-ness per element is the same (a NaN where PyTorch gives one, and nowhere else);
  - +-Inf results are exactly PyTorch's;
  - relu and its gradient are exact (relu keeps a NaN's sign, on CPU in Float32 every bit; the one difference:
    relu(-0.0) is +0.0, the engine's rule (tests/test_ops.py), where PyTorch keeps -0.0);
  - other finite results lie within a few ulps of PyTorch's (they are checked for accuracy elsewhere:
    tests/test_ops_activations.py, tests/test_ops_rows.py).
The kernels' AVX-512 and portable paths are both run by cpp/tests/ops_nan_test.cpp (the portable path can only be
forced from C++).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly

BASE_SEED = 20260531
pytestmark = [
    pytest.mark.usefixtures("grad_mode_on"),
    # NumPy warns on every NaN it casts or subtracts: here they are the point
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

F32, BF16, F16 = DType.Float32, DType.BFloat16, DType.Float16
DTYPES = [F32, BF16, F16]
DT_IDS = ["Float32", "BFloat16", "Float16"]
NP = {F32: np.float32, BF16: ml_dtypes.bfloat16, F16: np.float16}
TORCH = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}
BITS = {F32: np.uint32, BF16: np.uint16, F16: np.uint16}
# NaNs of each dtype as bits: quiet and signalling, both signs, with payloads; then +-inf and signed zeros.
SPECIAL_BITS = {
    F32: [0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFA00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x0],
    BF16: [0x7FC0, 0xFFC0, 0x7FC1, 0xFFA1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0],
    F16: [0x7E00, 0xFE00, 0x7E01, 0xFD01, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0],
}
# Sizes: one element, a lane short of / at / past 16 lanes, past a 512-element block with a tail, and past the
# threading grains (2**15 for silu/sigmoid, 2**16 for relu) with a ragged tail.
SIZES = [1, 15, 16, 17, 47, 529, 70_001]
# Finite results other than relu's: within TOL[dtype] (|want| + the largest finite |want| of the tensor) of PyTorch's
# (a loose bound: the accuracy of each kernel is checked in its own test module; here only NaN and Inf matter).
TOL = {F32: 1e-4, BF16: 2.0**-6, F16: 2.0**-9}


def specials(dtype) -> np.ndarray:
    return np.array(SPECIAL_BITS[dtype], dtype=BITS[dtype]).view(NP[dtype])


def with_specials(n: int, dtype, rng) -> np.ndarray:
    """n ordinary values with the specials at the start, in the middle and in the last elements (the tail)."""
    x = rng.normal(0, 3, n).astype(NP[dtype])
    sp = specials(dtype)
    spots = sorted(set(range(min(n, 9))) | set(range(max(0, n - 9), n)) | set(rng.integers(0, n, min(n, 40)).tolist()))
    for j, p in enumerate(spots):
        x[p] = sp[j % len(sp)]
    return x


def torch_of(x: np.ndarray, dtype) -> torch.Tensor:
    """The same bits as a torch tensor."""
    ints = np.int32 if dtype is F32 else np.int16
    return torch.from_numpy(np.ascontiguousarray(x).view(ints).copy()).view(TORCH[dtype])


def sw_of(x: np.ndarray, kind=sw.CPU) -> Tensor:
    return friendly.tensor(x, carrier=kind)


def arr(t: Tensor) -> np.ndarray:
    """A tensor's values in ordinal order, in its dtype (CPU and Generic tensors: NumPy's view)."""
    return np.asarray(t).ravel(order="F")


def tarr(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16).ravel()
    return t.contiguous().numpy().ravel()


def assert_like_torch(got, want, dtype, what, exact=False, zero_sign=True):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    bad = gn != wn
    assert not bad.any(), f"{what}: NaN-ness differs at {np.flatnonzero(bad)[:5]}: got {got[bad][:5]}, torch {want[bad][:5]}"
    inf = np.isinf(want) | np.isinf(got)
    bad = inf & ~(got == want)
    assert not bad.any(), f"{what}: infinities differ at {np.flatnonzero(bad)[:5]}: got {got[bad][:5]}, torch {want[bad][:5]}"
    fin = ~wn & ~inf
    if exact:
        bad = fin & ~((got == want) & ((np.signbit(got) == np.signbit(want)) | (not zero_sign)))
    else:
        scale = np.max(np.abs(want[fin]), initial=0.0)
        bad = fin & ~(np.abs(got - want) <= TOL[dtype] * (np.abs(want) + scale))
    assert not bad.any(), f"{what}: values differ at {np.flatnonzero(bad)[:5]}: got {got[bad][:5]}, torch {want[bad][:5]}"


def sum_all(t: Tensor) -> Tensor:
    names = " ".join(f"m{k}" for k in range(len(t.shape)))
    return sw.reduce_sum(t, f"{names} -> ")


# ---------------------------------------------------------------- relu: exact, NaN's sign kept


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_relu_keeps_nan_as_torch(dtype, n, rng):
    x = with_specials(n, dtype, rng)
    want = tarr(torch.relu(torch_of(x, dtype)))
    for kind in (sw.CPU, sw.Generic) if n < 1000 else (sw.CPU,):
        r = sw.relu(sw_of(x, kind))
        assert r.dtype() is dtype
        got = arr(r)
        what = ("relu", dtype.name, n, kind.__name__)
        assert_like_torch(got, want, dtype, what, exact=True, zero_sign=False)
        assert not np.signbit(got.astype(np.float64)[got.astype(np.float64) == 0]).any(), what  # +0, never -0
        # a NaN keeps its sign (PyTorch's relu selects x too, though its 16-bit vector loop answers 0xFFFF for
        # every NaN: the sign is checked against the input); on CPU in Float32 every bit is PyTorch's (the Generic
        # reference computes in double, which quiets a signalling NaN)
        nan = np.isnan(x.astype(np.float64))
        assert np.array_equal(np.signbit(got.astype(np.float64))[nan], np.signbit(x.astype(np.float64))[nan]), what
        if dtype is F32 and kind is sw.CPU:
            assert np.array_equal(got.view(np.uint32)[nan], want.view(np.uint32)[nan]), what


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_relu_on_a_strided_view(dtype, rng):
    x = with_specials(101, dtype, rng)
    t = Tensor(sw_of(x).carrier, 3, Layout(Shape(49), Stride(2)))  # offset 3, every other element
    want = tarr(torch.relu(torch_of(x, dtype)[3::2][:49]))
    assert_like_torch(arr(sw.relu(t)), want, dtype, ("relu strided", dtype.name), exact=True, zero_sign=False)


@pytest.mark.parametrize("n", [17, 529, 70_001])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_relu_gradient_matches_torch(dtype, n, rng):
    """PyTorch's relu backward is threshold_backward(grad, relu(x), 0): grad where relu(x) > 0 or is NaN, so a NaN
    input passes its gradient through; 0 at +-0 and below, even where the incoming gradient is NaN or infinite."""
    x = with_specials(n, dtype, rng)
    w = rng.normal(0, 1, n).astype(np.float32)
    w[rng.integers(0, n, max(1, n // 7))] = np.nan
    w[rng.integers(0, n, max(1, n // 7))] = np.inf
    xt = torch_of(x, dtype).requires_grad_(True)
    (torch.relu(xt) * torch.from_numpy(w)).sum().backward()  # the gradient in x's dtype, rounded once
    want = tarr(xt.grad)
    for kind in (sw.CPU, sw.Generic) if n < 1000 else (sw.CPU,):
        t = sw_of(x, kind)
        sum_all(sw.elementwise_mul(sw.relu(t), sw_of(w, kind))).backward()
        assert_like_torch(arr(t.grad), want, dtype, ("relu gradient", dtype.name, n, kind.__name__), exact=True)


# ---------------------------------------------------------------- silu, sigmoid, exp, neg


UNARY = {
    "silu": (sw.silu, torch.nn.functional.silu),
    "sigmoid": (sw.sigmoid, torch.sigmoid),
    "exp": (sw.exp, torch.exp),
    "neg": (sw.neg, torch.neg),
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_matches_torch(name, dtype, n, rng):
    ours, theirs = UNARY[name]
    x = with_specials(n, dtype, rng)
    if name == "exp":
        x[np.abs(x.astype(np.float64)) > 8] = 0  # finite results in every dtype but where the specials are
        sp = specials(dtype)
        x[: min(n, len(sp))] = sp[: min(n, len(sp))]
    want = tarr(theirs(torch_of(x, dtype)))
    for kind in (sw.CPU, sw.Generic) if n < 1000 else (sw.CPU,):
        r = ours(sw_of(x, kind))
        assert r.dtype() is dtype
        assert_like_torch(arr(r), want, dtype, (name, dtype.name, n, kind.__name__))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_activation_on_a_strided_view(name, dtype, rng):
    ours, theirs = UNARY[name]
    x = with_specials(101, dtype, rng)
    t = Tensor(sw_of(x).carrier, 3, Layout(Shape(49), Stride(2)))
    want = tarr(theirs(torch_of(x, dtype)[3::2][:49]))
    assert_like_torch(arr(ours(t)), want, dtype, (name, "strided", dtype.name))


@pytest.mark.parametrize("n", [17, 529, 70_001])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_activation_gradient_matches_torch(name, dtype, n, rng):
    ours, theirs = UNARY[name]
    x = with_specials(n, dtype, rng)
    xt = torch_of(x, dtype).float().requires_grad_(True)
    theirs(xt).sum().backward()
    want = xt.grad.numpy()
    for kind in (sw.CPU, sw.Generic) if n < 1000 else (sw.CPU,):
        t = sw_of(x.astype(np.float32), kind)  # Float32: the dense backward kernel (16-bit inputs: the loops)
        sum_all(ours(t)).backward()
        assert_like_torch(arr(t.grad), want, F32, (name, "gradient", dtype.name, n, kind.__name__))
        t16 = sw_of(x, kind)
        sum_all(ours(t16)).backward()
        assert_like_torch(arr(t16.grad).astype(np.float64), want, dtype, (name, "gradient16", dtype.name, n))


# ---------------------------------------------------------------- reductions and row operations


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_reduce_sum_matches_torch(dtype, rng):
    # rows (mode 1 reduced): ordinary, one NaN, +inf, -inf, +inf and -inf (NaN), NaN and inf, a NaN at the end
    m, n = 7, 37
    x = rng.normal(0, 1, (m, n)).astype(NP[dtype])
    sp = specials(dtype)
    x[1, 5], x[2, 0], x[3, n - 1] = sp[3], sp[5], sp[6]
    x[4, 2], x[4, 30] = sp[5], sp[6]
    x[5, 3], x[5, 4] = sp[0], sp[6]
    x[6, n - 1] = sp[1]
    xt = torch_of(x.ravel(), dtype).reshape(m, n)
    for kind in (sw.CPU, sw.Generic):
        t = friendly.tensor(x, carrier=kind)
        assert_like_torch(arr(sw.reduce_sum(t, "a b -> a")), tarr(xt.sum(1)), dtype, ("sum rows", kind.__name__))
        assert_like_torch(arr(sw.reduce_sum(t, "a b -> b")), tarr(xt.sum(0)), dtype, ("sum cols", kind.__name__))
        assert_like_torch(arr(sw.reduce_sum(t, "a b -> ")), tarr(xt.sum()), dtype, ("sum all", kind.__name__))


def rows_with_specials(dtype, rng, n):
    """Rows of length n: ordinary, a NaN, +inf, -inf, every element -inf, two +inf, NaN and inf together, a NaN
    in the tail, -inf beside ordinary values."""
    sp = specials(dtype)
    nan, nnan, pinf, ninf = sp[0], sp[3], sp[5], sp[6]
    rows = []
    for r in range(9):
        row = rng.normal(0, 2, n).astype(NP[dtype])
        if r == 1:
            row[n // 2] = nan
        elif r == 2:
            row[0] = pinf
        elif r == 3:
            row[1] = ninf
        elif r == 4:
            row[:] = ninf
        elif r == 5:
            row[2], row[n - 1] = pinf, pinf
        elif r == 6:
            row[0], row[n - 2] = nnan, pinf
        elif r == 7:
            row[n - 1] = nan
        elif r == 8:
            row[::3] = ninf
        rows.append(row)
    return np.stack(rows)


@pytest.mark.parametrize("n", [5, 16, 37, 600])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_softmax_and_its_gradient_match_torch(dtype, n, rng):
    x = rows_with_specials(dtype, rng, n)
    m = x.shape[0]
    xt = torch_of(x.ravel(), dtype).reshape(m, n)
    want = tarr(torch.softmax(xt, 1))
    xg = xt.float().requires_grad_(True)
    cot = rng.normal(0, 1, (m, n)).astype(np.float32)
    (torch.softmax(xg, 1) * torch.from_numpy(cot)).sum().backward()
    want_grad = xg.grad.numpy()
    for kind in (sw.CPU, sw.Generic):
        t = friendly.tensor(x, carrier=kind)
        # ordinal order is column-major: compare in row-major order
        y = sw.softmax(t, 1)
        assert_like_torch(np.asarray(y).ravel(), want, dtype, ("softmax", dtype.name, n, kind.__name__))
        t32 = friendly.tensor(x.astype(np.float32), carrier=kind)
        sum_all(sw.elementwise_mul(sw.softmax(t32, 1), friendly.tensor(cot, carrier=kind))).backward()
        assert_like_torch(np.asarray(t32.grad).ravel(), want_grad.ravel(), F32,
                          ("softmax gradient", dtype.name, n, kind.__name__))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_topk_matches_torch(dtype, rng):
    n, k = 37, 5
    x = rows_with_specials(dtype, rng, n)
    x[0, [3, 9]] = specials(dtype)[[0, 2]]  # two NaNs in a row: the lower index first, as PyTorch
    m = x.shape[0]
    xt = torch_of(x.ravel(), dtype).reshape(m, n)
    tv, ti = torch.topk(xt, k, 1)
    for kind in (sw.CPU, sw.Generic):
        v, i = sw.topk(friendly.tensor(x, carrier=kind), k, 1)
        assert_like_torch(np.asarray(v).ravel(), tarr(tv), dtype, ("topk", dtype.name, kind.__name__), exact=True)
        # where values are distinct (no ties among the k), the indices are PyTorch's
        iv = np.asarray(i).ravel().reshape(m, k)
        tiv = ti.numpy()
        for r in range(m):
            row = x[r].astype(np.float64)
            vals = row[tiv[r]]
            if len(set(np.where(np.isnan(vals), np.inf * 2, vals).tolist())) == k and np.isnan(row).sum() <= 1:
                assert np.array_equal(iv[r], tiv[r]), (dtype.name, kind.__name__, r, iv[r], tiv[r])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_matmul_propagates_nan_and_infinities_as_torch(dtype):
    """A contraction is a reduction too: a NaN or an infinity times zero weights is NaN in every result it reaches
    (no kernel skips a zero operand), on the skinny, BLAS and 16-bit product paths."""
    for m, n, k in ((1, 3, 5), (4, 7, 33), (40, 20, 70)):
        x = np.ones((m, k), dtype=NP[dtype])
        x[0, 1], x[m - 1, k - 1] = np.nan, np.inf
        w = np.zeros((n, k), dtype=NP[dtype])
        w[n - 1, :] = 1
        want = (torch.from_numpy(x.astype(np.float32)) @ torch.from_numpy(w.astype(np.float32)).T).numpy()
        for kind in (sw.CPU, sw.Generic):
            got = np.asarray(sw.matmul(friendly.tensor(x, carrier=kind), friendly.tensor(w, carrier=kind)))
            assert_like_torch(got.ravel(), want.ravel(), dtype, ("matmul", dtype.name, (m, n, k), kind.__name__))
