"""Fuzz tests of carriers and tensors: slot reads and writes, Tensor(...), friendly.tensor, move_async (fuzzing.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor
from strideweave.carriers.tiled_evictable import TiledEvictable

from fuzzing import (
    BOOL,
    F32,
    F64,
    GARBAGE,
    I32,
    ZERO,
    _assert_same,
    as_tree,
    attempt,
    congruent_stride,
    decode_model,
    expect,
    facts,
    finish,
    fuzz,
    index_model,
    logical,
    make_carrier,
    same,
    stored,
    valid_shape_trees,
)

pytestmark = pytest.mark.usefixtures("fuzz_report", "fuzz_watchdog", "clear_io_faults", "grad_mode_on")


CARRIER_KINDS = ["cpu", "generic", "file"]

slot_values = st.one_of(
    st.floats(-100, 100), st.integers(-100, 100), st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(-(2**33), 2**33),
    st.sampled_from([2**31 - 1, -(2**31), 2**31, 2**70, -(2**1100), 10**400, True, False]),
    st.sampled_from([np.float32(1.5), np.int64(7), np.bool_(True), np.float64(-2.25), np.int32(-3)]),
    st.sampled_from([None, "1", b"1", [1.0], 1j, object()]),
)
slot_indices = st.one_of(st.integers(0, 7), st.integers(0, 7), st.integers(-3, 12),
                         st.sampled_from([2**63, 2**70, -(2**70), np.int64(1)]), GARBAGE)


GOOD_VALUES = {F32: st.one_of(st.floats(width=32), st.integers(-(2**40), 2**40)),
               I32: st.integers(-(2**31), 2**31 - 1), BOOL: st.booleans()}


def index_fault(i, n):
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
        return TypeError
    return None if 0 <= int(i) < n else IndexError


@fuzz(120)
@given(data=st.data(), kind=st.sampled_from(CARRIER_KINDS), dtype=st.sampled_from([F32, I32, BOOL]),
       n=st.integers(1, 8))


def test_fuzz_carrier_slot_reads_and_writes(data, kind, dtype, n):
    if kind == "file" and dtype is BOOL:
        expect("carrier constructor", lambda: make_carrier(kind, n, dtype), {TypeError})
        return
    c = make_carrier(kind, n, dtype)
    model = [ZERO[dtype]] * n
    version = c.version
    immutable = data.draw(st.integers(0, 4), label="read-only copy") == 4
    if immutable:
        c = c.new_like(model, mutable=False)
        version = c.version
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        i = data.draw(st.one_of(st.integers(0, n - 1), slot_indices), label="index")
        if data.draw(st.booleans(), label="write"):
            v = data.draw(st.one_of(GOOD_VALUES[dtype], slot_values), label="value")
            value, vfault = stored(dtype, v)
            faults = {f for f in (index_fault(i, n), vfault) if f}
            if immutable:
                faults.add(RuntimeError)
            err = expect("carrier[i] = v", lambda: c.__setitem__(i, v), faults)
            if err is None:
                model[int(i)] = value
                version += 1
        else:
            f = index_fault(i, n)
            expect("carrier[i]", lambda: c[i], {f} if f else set(),
                   lambda r, i=i: _assert_same(r, model[int(i)]))
        assert c.version == version
        assert all(same(c[k], model[k]) for k in range(n))
        assert type(c[0]) is {F32: float, I32: int, BOOL: bool}[dtype]
    c.release()
    expect("carrier[i]", lambda: c[0], {RuntimeError})
    expect("carrier[i] = v", lambda: c.__setitem__(0, ZERO[dtype]), {RuntimeError})


def random_layout(draw, max_size=24):
    modes = draw(valid_shape_trees(max_size=max_size))
    strides = congruent_stride(draw, list(modes), False)
    return Layout(Shape(modes), Stride(strides)), as_tree(modes), as_tree(strides)


@fuzz(150)
@given(data=st.data())
def test_fuzz_tensor_constructor(data):
    kind = data.draw(st.sampled_from(CARRIER_KINDS + ["released", "garbage"]), label="carrier")
    n = data.draw(st.integers(1, 60), label="size")
    if kind == "garbage":
        carrier = data.draw(GARBAGE, label="garbage carrier")
    else:
        carrier = make_carrier("cpu" if kind == "released" else kind, n, F32)
        for k in range(n):
            carrier[k] = float(k)
        if kind == "released":
            carrier.release()
    offset = data.draw(st.one_of(st.integers(0, 6), st.integers(0, 6), st.integers(-3, 50), GARBAGE,
                                 st.sampled_from([2**62, 2**63 - 1, 2**63, -(2**63), np.int64(2)])), label="offset")
    if data.draw(st.integers(0, 8), label="garbage layout") == 8:
        layout, tree, strides = data.draw(st.sampled_from([None, (2, 3), Shape(2), "L"])), None, None
    elif data.draw(st.booleans(), label="dense"):
        m = data.draw(st.integers(1, n), label="dense size")
        layout, tree, strides = sw.column_major(m), (m,), (1,)
    else:
        layout, tree, strides = random_layout(data.draw)
    faults = set()
    if not isinstance(carrier, sw.Carrier):
        faults.add(TypeError)
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, (int, np.integer)):
        faults.add(TypeError)
    if not isinstance(layout, Layout):
        faults.add(TypeError)
    if not faults:
        if int(offset) < 0 or int(offset) + layout.cosize > carrier.size():
            faults.add(ValueError)
        if kind == "released":
            faults.add(RuntimeError)  # a released carrier has size 0 (ValueError) or refuses (RuntimeError)
            faults.add(ValueError)
    before = [carrier[k] for k in range(n)] if isinstance(carrier, sw.Carrier) and kind != "released" else None

    def check(t):
        assert t.carrier is carrier and t.offset == int(offset) and t.layout == layout and t.size() == layout.size
        for i in range(layout.size):
            slot = int(offset) + index_model(tree, strides, decode_model(tree, i))
            assert t[i] == carrier[slot] == float(slot)
        # One write through the view lands on the modelled slot and bumps the version once.
        v = carrier.version
        slot = int(offset) + index_model(tree, strides, decode_model(tree, layout.size - 1))
        t[layout.size - 1] = -1.0
        assert carrier[slot] == -1.0 and carrier.version == v + 1
        carrier[slot] = float(slot)

    if kind == "released" and not faults - {RuntimeError, ValueError}:
        # Released: the call may only fail; it must not produce a usable view.
        t, err = attempt("Tensor", lambda: Tensor(carrier, offset, layout))
        if err is None:
            expect("Tensor[i]", lambda: t[0], {RuntimeError})
        return
    expect("Tensor", lambda: Tensor(carrier, offset, layout), faults, check)
    if before is not None:
        assert [carrier[k] for k in range(n)] == before


# ---------------------------------------------------------------- friendly.tensor

scalar_like = st.one_of(st.floats(width=32, allow_nan=False), st.integers(-1000, 1000), st.booleans(),
                        st.sampled_from([2**31, 2**70, None, "x", 1j, float("nan"), float("inf")]))


@st.composite
def nested_data(draw):
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(scalar_like)
    if kind == 1:  # ragged
        return [draw(st.lists(scalar_like, max_size=3)) for _ in range(draw(st.integers(1, 3)))]
    shape = tuple(draw(st.lists(st.integers(0 if kind == 2 else 1, 3), min_size=1, max_size=3)))
    elem = draw(st.sampled_from(["float", "int", "bool", "mixed"]))
    size = math.prod(shape)
    if elem == "float":
        flat = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=size, max_size=size))
    elif elem == "int":
        flat = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=size, max_size=size))
    elif elem == "bool":
        flat = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    else:
        flat = draw(st.lists(scalar_like, min_size=size, max_size=size))
    arr = np.array(flat, dtype=object).reshape(shape) if size else np.zeros(shape)
    if kind == 4 and elem != "mixed":
        return np.asarray(arr.tolist())  # a NumPy array of the natural dtype
    return arr.tolist()


@fuzz(200)
@given(data=nested_data(), dtype=st.sampled_from([F32, I32, BOOL, F64, "Float32", None]),
       carrier=st.sampled_from([sw.CPU, sw.Generic, sw.FileBacked, "CPU", None, sw.Evictable]))


def test_fuzz_friendly_tensor(data, dtype, carrier):
    kwargs = {"dtype": dtype, "carrier": carrier}

    def check(t):
        arr = np.asarray(data)
        assert t.layout.shape.extents == arr.shape or (arr.shape == () and t.layout.shape.extents == ())
        assert t.dtype() is dtype and isinstance(t.carrier, carrier)
        for idx in itertools.product(*[range(e) for e in arr.shape]):
            want, fault = stored(dtype, arr[idx].item() if hasattr(arr[idx], "item") else arr[idx])
            assert fault is None, (arr[idx], fault)
            got = t[idx] if idx else t[0]
            assert same(got, want), (idx, got, want)

    _, err = attempt("friendly.tensor", lambda: sw.friendly.tensor(data, **kwargs))
    # A success is checked against the model; a failure only has to be documented (attempt checked it).
    if err is None and isinstance(dtype, DType) and dtype is not F64 and carrier in (sw.CPU, sw.Generic, sw.FileBacked):
        check(sw.friendly.tensor(data, **kwargs))
    # Inputs the model knows to be valid must succeed.
    arr = np.asarray(data) if not isinstance(data, list) or _rectangular(data) else None
    if (arr is not None and arr.dtype.kind == "f" and arr.size and dtype is F32 and carrier in (sw.CPU, sw.Generic, sw.FileBacked)):
        assert err is None, err


def _rectangular(data):
    try:
        a = np.asarray(data)
    except ValueError:
        return False
    return a.dtype.kind != "O"


# ================================================================ move_async


def tensor_on(kind, values, dtype, layout=None, offset=0):
    n = len(values)
    c = make_carrier(kind, n, dtype)
    for i, v in enumerate(values):
        c[i] = v
    if layout is None:
        layout = sw.column_major(n - offset)
    return Tensor(c, offset, layout)


@fuzz(150)
@given(data=st.data())
def test_fuzz_move_async(data):
    dtype = data.draw(st.sampled_from([F32, I32]), label="dtype")
    src_kind = data.draw(st.sampled_from(CARRIER_KINDS), label="source")
    n = data.draw(st.integers(1, 12), label="n")
    values = [float(i) + 0.5 if dtype is F32 else i * 3 for i in range(n)]
    offset = data.draw(st.integers(0, n - 1), label="offset")
    layout = sw.column_major(n - offset)
    if data.draw(st.booleans(), label="strided"):
        layout, _, _ = random_layout(data.draw, max_size=12)
        if layout.cosize + offset > n:
            offset = 0
            if layout.cosize > n:
                layout = sw.column_major(n)
    src = tensor_on(src_kind, values, dtype, layout, offset)
    src_state = data.draw(st.sampled_from(["live", "live", "released", "owned", "not a tensor"]), label="source state")
    keep = []
    if src_state == "released":
        src.carrier.release()
    elif src_state == "owned":  # claimed by a live TiledEvictable (as its secondary tier)
        keep.append(TiledEvictable(sw.CPU(0, dtype=dtype), src.carrier, (n,), (1,)))
    dest_kind = data.draw(st.sampled_from(["cpu0", "cpu_exact", "cpu_big", "cpu_small", "generic0", "file0", "file_exact",
                                            "same", "released", "immutable", "other dtype", "owned", "garbage"]),
                          label="destination")
    need = layout.cosize
    if dest_kind == "same":
        dest = src.carrier
    elif dest_kind == "garbage":
        dest = data.draw(GARBAGE)
    elif dest_kind == "other dtype":
        dest = sw.CPU(0, dtype=I32 if dtype is F32 else F32)
    else:
        size = {"cpu0": 0, "cpu_exact": need, "cpu_big": need + 3, "cpu_small": max(1, need - 1), "generic0": 0,
                "file0": 0, "file_exact": need, "released": 0, "immutable": 0, "owned": 0}[dest_kind]
        dk = {"generic0": "generic", "file0": "file", "file_exact": "file"}.get(dest_kind, "cpu")
        dest = make_carrier(dk, size, dtype)
        if dest_kind == "released":
            dest.release()
        elif dest_kind == "immutable":
            dest = sw.CPU(need, dtype=dtype, mutable=False)
        elif dest_kind == "owned":
            keep.append(TiledEvictable(dest, sw.CPU(0, dtype=dtype), (1,), (1,)))
        elif dest_kind == "cpu_small" and need == 1:
            dest_kind = "cpu_exact"
    subject = src if src_state != "not a tensor" else data.draw(GARBAGE)
    faults = set()
    if src_state == "not a tensor":
        faults.add(TypeError)
    if src_state in ("released", "owned"):
        faults.add(RuntimeError)
    faults |= {"same": {ValueError}, "garbage": {TypeError}, "released": {RuntimeError}, "immutable": {RuntimeError},
               "other dtype": {TypeError}, "owned": {RuntimeError}, "cpu_small": {ValueError}}.get(dest_kind, set())
    before_src = facts(src.carrier)
    before_dst = facts(dest) if isinstance(dest, sw.Carrier) else None
    want = logical(src) if src_state == "live" else None

    handle, err = attempt("move_async", lambda: sw.move_async(subject, dest))
    if err is None:
        result, err = attempt("AwaitMove.wait", lambda: finish(handle))
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (faults, err)
        assert facts(src.carrier) == before_src
        if before_dst is not None:
            assert facts(dest) == before_dst
        return
    assert err is None, err
    assert result.carrier is dest and result.layout == src.layout and result.offset == 0
    assert logical(result) == want
    assert src.carrier.is_released()  # a move consumes its source
    assert handle.wait() is result  # the same object every time
