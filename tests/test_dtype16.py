"""BFloat16 and Float16 from Python (docs/guide.md, "DTypes").

The two singletons; `convert` rounding a float directly to nearest even (checked against an exact reference made
with ml_dtypes over every neighbour pair's midpoint and random doubles); zero-copy `np.asarray` as
`ml_dtypes.bfloat16` / `np.float16` arrays; `friendly.tensor` keeping 16-bit arrays as they are and rounding with
`dtype=`; every storage kind; the promotion table; the central operations against a float64 reference, and
autograd through a small graph. Error bounds (u16 = 2^-8 for BFloat16, 2^-11 for Float16; u = 2^-24): a Float32
operation rounded once: u16 |r| + (1 + u16) u |r|; matmul over k products: u16 |r| + (1 + u16) gamma_k sum|a b|.
Random data comes from the `rng` fixture (seed printed).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Shape, Tensor, column_major, friendly

BASE_SEED = 20261201
BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [(DType.BFloat16, BF16, 2.0**-8), (DType.Float16, np.dtype(np.float16), 2.0**-11)]
IDS = ["BFloat16", "Float16"]


def test_the_singletons():
    assert DType.BFloat16 is DType.registered()[4] and DType.Float16 is DType.registered()[5]
    assert DType.BFloat16.name == "BFloat16" and DType.Float16.name == "Float16"
    assert DType.BFloat16.bits == 16 and DType.Float16.bits == 16
    assert DType.BFloat16 is not DType.Float16 and DType.BFloat16 != DType.Float32
    assert getattr(DType, "BFloat16") is DType.BFloat16
    assert repr(DType.Float16) == "DType.Float16"


def exact_reference(np_dtype, x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float64 values, by exact distances to the two neighbours among every finite value."""
    inf_bits = 0x7F80 if np_dtype == BF16 else 0x7C00
    table = np.arange(inf_bits, dtype=np.uint16).view(np_dtype).astype(np.float64)
    a = np.abs(x)
    hi = np.minimum(np.searchsorted(table, a), len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    dl, dh = a - table[lo], table[hi] - a
    pick = np.where(table[hi] == a, hi, np.where((dh < dl) | ((dh == dl) & (lo % 2 == 1)), hi, lo))
    pick = np.where(a > table[-1], len(table) - 1, pick)
    out = table[pick]
    out = np.where(a >= table[-1] + (table[-1] - table[-2]) / 2, np.inf, out)
    return np.copysign(out, x)


@pytest.mark.parametrize("dtype,np_dtype,u16", HALVES, ids=IDS)
def test_convert_rounds_a_float_directly_to_nearest_even(dtype, np_dtype, u16, rng):
    table = np.arange(0x7F80 if np_dtype == BF16 else 0x7C00, dtype=np.uint16).view(np_dtype).astype(np.float64)
    mids = table[:-1] + np.diff(table) / 2
    xs = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), table,
                         np.ldexp(rng.uniform(1, 2, 20000), rng.integers(-140, 130, 20000))])
    xs = np.concatenate([xs, -xs])
    want = exact_reference(np_dtype, xs)
    # friendly.tensor(dtype=...) converts the array as convert does (one vectorised call)
    got = np.asarray(friendly.tensor(xs, dtype=dtype)).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    for x in xs[:: len(xs) // 400]:
        assert dtype.convert(float(x)) == exact_reference(np_dtype, np.array([x]))[0]
    # no double rounding through Float32: 1 + 2^-8 + 2^-30 is 1 + 2^-7 in bf16
    assert DType.BFloat16.convert(1 + 2.0**-8 + 2.0**-30) == 1 + 2.0**-7
    assert DType.Float16.convert(1e6) == math.inf and DType.Float16.convert(-65520.0) == -math.inf
    assert DType.BFloat16.convert(3) == 3.0 and type(DType.BFloat16.convert(3)) is float
    assert math.isnan(dtype.convert(math.nan))


@pytest.mark.parametrize("dtype", [DType.BFloat16, DType.Float16], ids=IDS)
def test_convert_refuses_what_float32_refuses(dtype):
    with pytest.raises(TypeError, match=f"{dtype.name} element must be a float or an int, got bool"):
        dtype.convert(True)
    for bad in ("1", None, [1.0]):
        with pytest.raises(TypeError, match="element values must be float, int or bool"):
            dtype.convert(bad)
    t = friendly.tensor([1.5, 2.5], dtype=dtype)
    with pytest.raises(TypeError, match=f"{dtype.name} element must be a float or an int, got bool"):
        t[0] = True
    assert [t[0], t[1]] == [1.5, 2.5] and t.version == 0  # nothing changed
    with pytest.raises(TypeError, match=f"a {dtype.name} tensor accepts float or int values"):
        friendly.tensor(np.array([True]), dtype=dtype)


@pytest.mark.parametrize("dtype,np_dtype,u16", HALVES, ids=IDS)
def test_asarray_is_a_zero_copy_view_of_its_elements(dtype, np_dtype, u16):
    t = friendly.tensor(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), dtype=dtype)
    a = np.asarray(t)
    assert a.dtype == np_dtype and a.shape == (2, 3)
    b = np.asarray(t)
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]  # the same memory both times
    a[1, 2] = 0.1  # a write through the view is visible in the tensor (rounded by NumPy's cast to the dtype)
    assert t[(1, 2)] == float(np.array(0.1).astype(np_dtype))
    t[(0, 0)] = 7.0
    assert a[0, 0] == 7.0


@pytest.mark.parametrize("dtype,np_dtype,u16", HALVES, ids=IDS)
def test_friendly_tensor_keeps_16_bit_arrays_and_rounds_with_a_dtype(dtype, np_dtype, u16):
    src = np.array([0.1, 1e-3, 300.25, -2.5]).astype(np_dtype)
    t = friendly.tensor(src)  # no dtype: the array's own, never widened to Float32
    assert t.dtype() is dtype
    np.testing.assert_array_equal(np.asarray(t), src)
    other = DType.Float16 if dtype is DType.BFloat16 else DType.BFloat16
    t2 = friendly.tensor(src, dtype=other)  # an explicit dtype converts (rounds once, from the exact values)
    assert t2.dtype() is other
    assert [t2[i] for i in range(4)] == [other.convert(float(v)) for v in src.astype(np.float64)]
    t3 = friendly.tensor(src, dtype=DType.Float32)  # exact widening only when asked for
    assert [t3[i] for i in range(4)] == [float(v) for v in src.astype(np.float64)]
    assert friendly.tensor([1.0, 2.0]).dtype() is DType.Float32


@pytest.mark.parametrize("dtype", [DType.BFloat16, DType.Float16], ids=IDS)
def test_every_storage_kind_stores_them(dtype, tmp_path):
    x = 1 + 2.0**-8 + 2.0**-30 if dtype is DType.BFloat16 else 1 + 2.0**-11 + 2.0**-40
    for carrier in (sw.CPU(3, dtype=dtype), sw.Generic([0.0, 0.0, 0.0], dtype=dtype),
                    sw.FileBacked(dtype=dtype).allocate_like(3), sw.Evictable(sw.CPU(3, dtype=dtype), sw.FileBacked(dtype=dtype))):
        assert carrier.dtype() is dtype
        carrier[1] = x  # converts per convert
        assert carrier[1] == dtype.convert(x) and carrier[0] == 0.0
        carrier[2] = -3
        assert carrier[2] == -3.0 and type(carrier[2]) is float
    # a TiledEvictable over 16-bit tiers (tiles are byte copies of the tiers' slots)
    sec = sw.FileBacked(dtype=dtype).allocate_like(6)
    for s in range(6):
        sec[s] = s + 0.1
    tiled = sw.TiledEvictable(sw.CPU(0, dtype=dtype), sec, (3,), (2,))
    t = Tensor(tiled, 0, sw.Layout(Shape(6), sw.Stride(1)))
    assert [t[i] for i in range(6)] == [dtype.convert(s + 0.1) for s in range(6)]
    t[3] = x
    assert t[3] == dtype.convert(x)
    doubled = sw.add(t, t)
    assert doubled.dtype() is dtype
    assert np.asarray(doubled).astype(np.float64).tolist() == [2 * t[i] for i in range(6)]  # exact: doubling


def test_promotion_table():
    def t(d):
        return friendly.tensor([1.0, 2.0], dtype=d) if d is not DType.Int32 else friendly.tensor([1, 2], dtype=d)

    bf, fh, f32, i32 = DType.BFloat16, DType.Float16, DType.Float32, DType.Int32
    assert sw.add(t(bf), t(bf)).dtype() is bf
    assert sw.add(t(fh), t(fh)).dtype() is fh
    assert sw.add(t(bf), t(fh)).dtype() is f32
    assert sw.sub(t(f32), t(bf)).dtype() is f32
    assert sw.elementwise_mul(t(i32), t(fh)).dtype() is fh
    assert sw.mul(t(bf), 2.0).dtype() is bf and sw.mul(3, t(fh)).dtype() is fh  # weak scalars do not promote
    assert sw.div(t(bf), t(bf)).dtype() is bf and sw.exp(t(fh)).dtype() is fh and sw.neg(t(bf)).dtype() is bf
    assert sw.reduce_sum(t(bf)).dtype() is bf
    assert sw.reduce_sum(t(bf), accumulator_dtype=DType.Float64).dtype() is f32


@pytest.mark.parametrize("dtype,np_dtype,u16", HALVES, ids=IDS)
@pytest.mark.parametrize("kind", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
def test_operations_against_float64(dtype, np_dtype, u16, kind, rng):
    u = 2.0**-24
    one = u16 + (1 + u16) * u
    a = rng.integers(-64, 65, (6, 70)) / 8.0
    b = rng.integers(-64, 65, (6, 70)) / 8.0
    b[b == 0] = 0.5
    ta, tb = friendly.tensor(a, dtype=dtype, carrier=kind), friendly.tensor(b, dtype=dtype, carrier=kind)

    def check(t, want, bound, what):
        assert t.dtype() is dtype, what
        got = np.asarray(t).astype(np.float64)
        assert np.all(np.abs(got - want) <= bound), (what, np.max(np.abs(got - want) - bound))

    for f, ref in ((sw.add, a + b), (sw.sub, a - b), (sw.elementwise_mul, a * b), (sw.div, a / b)):
        check(f(ta, tb), ref, one * np.abs(ref), f.__name__)
    check(sw.mul(ta, 0.3), a * 0.3, (one + 2 * u) * np.abs(a * 0.3), "mul by a weak float")
    check(sw.neg(ta), -a, 0, "neg")
    check(sw.relu(ta), np.maximum(a, 0), 0, "relu")
    check(sw.exp(ta), np.exp(a), (u16 + (1 + u16) * 4 * u) * np.exp(a), "exp")
    s = a.sum(axis=1)
    check(sw.reduce_sum(ta, "a b -> a"), s, u16 * np.abs(s) + 70 * 2.0**-53 * np.abs(a).sum(axis=1), "reduce_sum")
    w = rng.integers(-16, 17, (40, 70)) / 8.0  # a (out, in) weight, as PyTorch stores it: row-major
    tw = friendly.tensor(w, dtype=dtype, carrier=kind)
    k = 70
    gamma = k * u / (1 - k * u)
    ref = a @ w.T
    check(sw.matmul(ta, tw), ref, u16 * np.abs(ref) + (1 + u16) * gamma * (np.abs(a) @ np.abs(w).T), "matmul")


@pytest.mark.parametrize("dtype,np_dtype,u16", HALVES, ids=IDS)
def test_autograd_through_a_small_graph(dtype, np_dtype, u16, rng):
    # L = sum(relu(x w^T) * 0.5): gradients in Float32 (exact for these eighths), rounded once to the leaf's dtype.
    x = rng.integers(-16, 17, (3, 5)) / 8.0
    w = rng.integers(-16, 17, (4, 5)) / 8.0
    tx, tw = friendly.tensor(x, dtype=dtype), friendly.tensor(w, dtype=dtype)
    assert tx.is_differentiable()
    loss = sw.reduce_sum(sw.mul(sw.relu(sw.matmul(tx, tw)), 0.5), "a b -> ")
    assert loss.dtype() is dtype
    loss.backward()
    mask = (x @ w.T > 0).astype(np.float64)
    gx, gw = 0.5 * mask @ w, 0.5 * mask.T @ x
    for leaf, g in ((tx, gx), (tw, gw)):
        assert leaf.grad.dtype() is dtype
        got = np.asarray(leaf.grad).astype(np.float64)
        assert np.all(np.abs(got - g) <= u16 * np.abs(g))
    loss2 = sw.reduce_sum(sw.relu(tx), "a b -> ")
    with pytest.raises(TypeError, match=f"gradient must be a Float32 tensor \\(or of the output's dtype {dtype.name}\\)"):
        loss2.backward(gradient=friendly.tensor(np.zeros((), dtype=np.int32), dtype=DType.Int32))
    assert np.all(np.abs(np.asarray(tx.grad).astype(np.float64) - gx) <= u16 * np.abs(gx))  # unchanged
