"""Fuzz tests of the six operations over every operand kind (fuzzing.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor
from strideweave.carriers.tiled_evictable import TiledEvictable

from fuzzing import BOOL, F32, F64, I32, colex, expect, facts, finish, fuzz

pytestmark = pytest.mark.usefixtures("fuzz_report", "fuzz_watchdog", "clear_io_faults", "grad_mode_on")


# ================================================================ the six operations


@st.composite
def op_operand(draw, extents, dtype_choices=(F32, F32, I32, BOOL)):
    """(operand, numpy model or None) of a random operand kind with logical shape `extents`."""
    kind = draw(st.sampled_from(["cpu", "cpu", "cpu", "cpu", "cpu", "strided", "strided", "generic", "file", "tiled",
                                 "tiled", "number", "garbage", "handle", "released"]))
    dtype = draw(st.sampled_from(dtype_choices))
    if kind == "file" and dtype is BOOL:
        dtype = F32  # FileBacked stores Float32 and Int32 only
    size = math.prod(extents)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if dtype is F32:
        vals = rng.integers(-8, 8, size=extents).astype(np.float32) / 2
    elif dtype is I32:
        vals = rng.integers(-50, 50, size=extents).astype(np.int32)
    else:
        vals = rng.integers(0, 2, size=extents).astype(bool)
    if kind == "number":
        v = draw(st.sampled_from([2, -3, 0.5, 2**40, float("inf")]))
        return v, v
    if kind == "garbage":
        return draw(st.sampled_from([None, "t", [1.0, 2.0], True, np.ones(extents, np.float32)])), None
    carrier_cls = {"cpu": sw.CPU, "strided": sw.CPU, "released": sw.CPU, "generic": sw.Generic, "file": sw.FileBacked,
                   "handle": sw.CPU, "tiled": sw.CPU}[kind]
    t = sw.friendly.tensor(vals, dtype=dtype, carrier=carrier_cls) if kind != "tiled" or dtype is not BOOL else None
    if kind == "strided":
        # the same logical values through a padded, offset, reversed-order-of-storage layout
        pad = 3
        c = sw.CPU(pad + 2 * size, dtype=dtype)
        strides, run = [], 2
        for e in extents:
            strides.append(run)
            run *= e
        lay = Layout(Shape(*extents), Stride(*strides))
        t = Tensor(c, pad, lay)
        for coord in colex(extents):
            t[coord] = vals[coord].item()
    elif kind == "released":
        t.carrier.release()
        return t, "released"
    elif kind == "handle":
        h = sw.move_async(t, sw.CPU(0, dtype=dtype))
        finish(h)
        return h, None
    elif kind == "tiled":
        if dtype is BOOL:
            dtype = F32
            vals = vals.astype(np.float32)
        flat = sw.friendly.tensor(vals.reshape(-1, order="F").copy(), dtype=dtype)
        secondary = sw.move(flat, sw.FileBacked(dtype=dtype)).carrier
        grid = tuple(draw(st.sampled_from([d for d in (1, e) if e % d == 0])) for e in extents)
        tile = tuple(e // g for e, g in zip(extents, grid))
        c = TiledEvictable(sw.CPU(0, dtype=dtype), secondary, grid, tile)
        t = Tensor(c, 0, sw.column_major(*extents))
    return t, vals


def result_dtype(op, a, b, f64=False):
    """Model of the result dtype of an operation over tensor operand dtypes / weak scalars."""
    dts = []
    for x in (a, b):
        if isinstance(x, Tensor):
            dts.append(x.dtype())
        elif isinstance(x, (int, float)):
            dts.append("int" if isinstance(x, int) else "float")
    tensors = [d for d in dts if isinstance(d, DType)]
    if op in ("relu", "reduce_sum") and not f64:
        return tensors[0]
    if f64:
        return F32
    if all(d is I32 or d == "int" for d in dts):
        return I32
    return F32


def np_of(t):
    out = np.empty(t.layout.shape.extents, dtype={F32: np.float64, I32: np.int64, BOOL: bool}[t.dtype()])
    for coord in colex(t.layout.shape.extents):
        out[coord] = t[coord] if coord else t[0]
    return out


@pytest.mark.parametrize("op", ["add", "mul", "elementwise_mul", "relu", "reduce_sum", "matmul"])
@fuzz(50)
@given(data=st.data())
def test_fuzz_operations(op, data):
    rank = 2 if op == "matmul" else data.draw(st.integers(1, 3), label="rank")
    ext_a = tuple(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank), label="a extents"))
    if op == "matmul":
        ext_b = (data.draw(st.integers(1, 3), label="n"), data.draw(st.sampled_from([ext_a[1], ext_a[1], 1, 3]), label="k"))
    else:
        ext_b = tuple(data.draw(st.sampled_from([e, e, 1, 2]), label="b extent") for e in ext_a)
        if data.draw(st.integers(0, 9), label="rank mismatch") == 9:
            ext_b = ext_b + (1,)
    a, va = data.draw(op_operand(ext_a), label="a")
    b, vb = data.draw(op_operand(ext_b), label="b")
    desc = None
    if op == "reduce_sum":
        if data.draw(st.integers(0, 3), label="hostile description") != 3:
            names = data.draw(st.permutations(["a", "b", "c", "x1", "y_"]), label="names")[: len(ext_a)]
            kept = data.draw(st.permutations(names), label="kept")[: data.draw(st.integers(0, len(names)), label="k")]
            spacing = data.draw(st.sampled_from([" -> ", "->", "  ->   "]), label="spacing")
            desc = data.draw(st.sampled_from([" ".join(names) + spacing + " ".join(kept), None]), label="description")
        else:
            names = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d", "x1"]), max_size=4), label="names")
            kept = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d", "x1", "z"]), max_size=3), label="kept")
            desc = data.draw(st.sampled_from([" ".join(names) + " -> " + " ".join(kept), "", "->",
                                              " ".join(names) + " " + " ".join(kept), 3, b"a -> a",
                                              " ".join(names) + "->" + " ".join(kept) + " -> a"]), label="description")
    acc = data.draw(st.sampled_from([None, None, F64, F32, "Float64"]), label="accumulator")
    call = {
        "add": lambda: sw.add(a, b),
        "mul": lambda: sw.mul(a, b),
        "elementwise_mul": lambda: sw.elementwise_mul(a, b),
        "relu": lambda: sw.relu(a),
        "reduce_sum": lambda: sw.reduce_sum(a, desc, accumulator_dtype=acc),
        "matmul": lambda: sw.matmul(a, b, accumulator_dtype=acc),
    }[op]
    operands = [a] if op in ("relu", "reduce_sum") else [a, b]
    models = [va] if op in ("relu", "reduce_sum") else [va, vb]

    # ---- the model's verdict
    faults = set()
    scalars_ok = op in ("add", "mul", "elementwise_mul")  # every element-wise binary operation takes numbers
    for x, m in zip(operands, models):
        if isinstance(x, Tensor):
            if isinstance(m, str):  # released
                faults.add(RuntimeError)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            if not scalars_ok:
                faults.add(TypeError)
        else:
            faults.add(TypeError)
    tensors = [x for x in operands if isinstance(x, Tensor)]
    if not tensors and not faults:
        faults.add(TypeError)  # mul(number, number)
    if len({type(t.carrier) for t in tensors}) > 1:
        faults.add(TypeError)
    for t in tensors:
        if not t.carrier.is_released() and type(t.carrier) is sw.FileBacked:
            faults.add(NotImplementedError)
        if isinstance(t.carrier, TiledEvictable) and len(tensors) == 2 and tensors[0].carrier is not tensors[1].carrier:
            pass  # two tiled carriers of one class are allowed
    if op in ("reduce_sum", "matmul") and acc is not None and acc is not F64:
        faults.add(TypeError if not isinstance(acc, DType) else ValueError)
    live = not faults
    shape_a = ext_a
    if op in ("add", "mul", "elementwise_mul") and len(tensors) == 2:
        if len(ext_a) != len(ext_b) or any(x != y and 1 not in (x, y) for x, y in zip(ext_a, ext_b)):
            faults.add(ValueError)
    if op == "matmul" and len(tensors) == 2 and ext_a[1] != ext_b[1]:
        faults.add(ValueError)
    kept_axes = None
    if op == "reduce_sum":
        if desc is None:
            kept_axes = [0]
        elif not isinstance(desc, str):
            faults.add(TypeError)
        else:
            parts = desc.split("->")
            if len(parts) != 2:
                faults.add(ValueError)
            else:
                left, right = parts[0].split(), parts[1].split()
                if (len(left) != len(shape_a) or len(set(left)) != len(left) or len(set(right)) != len(right)
                        or any(r not in left for r in right)):
                    faults.add(ValueError)
                else:
                    kept_axes = [left.index(r) for r in right]
    if op in ("add", "mul", "elementwise_mul") and live and not faults:
        rd = result_dtype(op, a, b)
        if rd is I32:
            # weak ints beyond Int32 and Int32 overflow raise OverflowError
            if any(isinstance(x, int) and not -(2**31) <= x < 2**31 for x in (a, b)):
                faults.add(OverflowError)
    before = [facts(t.carrier) for t in tensors if isinstance(t, Tensor)]

    def check(r):
        assert isinstance(r, Tensor) and isinstance(r.carrier, type(tensors[0].carrier) if not isinstance(
            tensors[0].carrier, TiledEvictable) else sw.CPU)
        rd = result_dtype(op, a, b, acc is F64 and op in ("reduce_sum", "matmul"))
        assert r.dtype() is rd, (r.dtype(), rd)
        x = [np.asarray(m, dtype=np.float64) if not isinstance(m, (int, float)) else m for m in models]
        if op == "add":
            want = x[0] + x[1]
        elif op in ("mul", "elementwise_mul"):
            want = x[0] * x[1]
        elif op == "relu":
            want = np.maximum(x[0], 0)
        elif op == "reduce_sum":
            drop = tuple(i for i in range(len(shape_a)) if i not in kept_axes)
            summed = x[0].sum(axis=drop)  # the kept axes, in their original order
            order = sorted(kept_axes)
            want = np.transpose(summed, [order.index(k) for k in kept_axes]) if kept_axes else summed
        else:
            want = x[0] @ x[1].T
        got = np_of(r).astype(np.float64)
        if rd is BOOL:
            want = want.astype(bool).astype(np.float64)
        elif rd is F32:
            with np.errstate(all="ignore"):
                want = want.astype(np.float32).astype(np.float64)
        assert got.shape == np.shape(want), (got.shape, np.shape(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert r.offset == 0 and r.layout == sw.column_major(*r.layout.shape.extents)

    expect(f"op.{op}", call, faults, check)
    # Operations never change their operands.
    assert [facts(t.carrier) for t in tensors if isinstance(t, Tensor)] == before
