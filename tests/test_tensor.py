"""Contract tests for Tensor, NumPy interop and friendly constructors (docs/guide.md, "Carriers").

A tensor is a view: `t[key]` is `carrier[offset + layout.index(key)]` for an
int ordinal or a coordinate, writes go to that slot and count on the carrier's
version. Dense CPU tensors export to NumPy without copy; everything else
exports a correct copy. `friendly.tensor` builds dense (first-mode-fastest)
tensors from nested lists or NumPy arrays under the dtype rules of §3.

Every error test checks the exception type, a message fragment and that
nothing changed. The few tests that guard against interpreter crashes run
their scenario in a subprocess, so a regression fails one test instead of
killing the run.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly
from models import binary32
from devices import sized_file

F32, I32, BOOL, F64 = DType.Float32, DType.Int32, DType.Bool, DType.Float64


def dense(n: int) -> Layout:
    return Layout(Shape(n), Stride(1))


def read_all(c):
    return [c[i] for i in range(c.size())]


def counting(n, dtype=F32, factory=None):
    """A carrier whose slot i holds a value derived from i (distinct per slot)."""
    c = (factory or (lambda n, d: sw.CPU(n, dtype=d)))(n, dtype)
    for i in range(n):
        c[i] = {F32: i + 0.25, I32: 1000 + i, BOOL: i % 3 == 0}[dtype]
    return c


CARRIERS = {
    "CPU": lambda n, d: sw.CPU(n, dtype=d),
    "Generic": lambda n, d: sw.Generic([False] * n if d is BOOL else [0] * n, dtype=d),
    "FileBacked": lambda n, d: sw.FileBacked(dtype=d).allocate_like(n),
}

# (layout, offset) pairs over a 64-slot carrier: dense, offset, strided, hierarchical, broadcast, rank 0.
VIEWS = [
    (Layout(Shape(2, 3), Stride(1, 2)), 0),
    (Layout(Shape(2, 3), Stride(1, 2)), 5),
    (Layout(Shape(3, 4), Stride(4, 1)), 1),
    (Layout(Shape(5, [2, 4]), Stride(1, [5, 10])), 3),
    (Layout(Shape(2, [2, 2]), Stride(1, [4, 2])), 7),
    (Layout(Shape([2, 2], 3), Stride([1, 2], 4)), 0),
    (Layout(Shape(3, 4), Stride(0, 1)), 2),
    (Layout(Shape(4), Stride(3)), 10),
    (Layout(Shape(), Stride()), 63),
]
VIEW_IDS = [f"{layout!r}+{offset}" for layout, offset in VIEWS]


# ============================================================ construction


def test_construction_keeps_carrier_offset_and_layout():
    c = counting(12)
    layout = Layout(Shape(2, 3), Stride(1, 2))
    t = Tensor(c, 2, layout)
    assert t.carrier is c
    assert t.offset == 2 and type(t.offset) is int
    assert t.layout == layout
    assert t.size() == 6
    assert t.dtype() is F32
    assert Tensor(c, np.int64(6), layout).offset == 6  # any __index__ int
    assert layout.cosize == 6
    assert Tensor(c, 12 - layout.cosize, layout).offset == 6  # exactly fits


@pytest.mark.parametrize("offset", [1.0, "1", None, True, [1], np.float64(1.0)], ids=repr)
def test_non_int_offset_is_a_type_error(offset):
    c = counting(12)
    version = c.version
    with pytest.raises(TypeError, match="offset must be an int"):
        Tensor(c, offset, dense(4))
    assert c.version == version and read_all(c) == read_all(counting(12))


@pytest.mark.parametrize(
    "offset, layout, fragment",
    [
        (-1, dense(4), ">= 0"),
        (9, dense(4), "exceeds"),
        (0, dense(13), "exceeds"),
        (1, Layout(Shape(2, 3), Stride(1, 6)), "exceeds"),  # cosize 12
        (12, Layout(Shape(), Stride()), "exceeds"),  # rank 0 has cosize 1
    ],
    ids=["negative", "offset-past-end", "layout-too-large", "strided-too-large", "rank0-past-end"],
)
def test_view_outside_the_carrier_is_a_value_error(offset, layout, fragment):
    c = counting(12)
    version = c.version
    with pytest.raises(ValueError, match=fragment):
        Tensor(c, offset, layout)
    assert c.version == version and read_all(c) == read_all(counting(12))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("carrier", 0, dense(2)), "Carrier instance"),
        ((None, 0, dense(2)), "Carrier instance"),
        ((sw.CPU(2), 0, Shape(2)), "must be a Layout"),
        ((sw.CPU(2), 0, None), "must be a Layout"),
    ],
    ids=["str-carrier", "None-carrier", "Shape-layout", "None-layout"],
)
def test_wrong_argument_types_are_type_errors(args, fragment):
    with pytest.raises(TypeError, match=fragment):
        Tensor(*args)


# ============================================================ element access


@pytest.mark.parametrize("make", CARRIERS.values(), ids=CARRIERS.keys())
@pytest.mark.parametrize("layout, offset", VIEWS, ids=VIEW_IDS)
def test_reads_by_ordinal_and_coordinate_are_carrier_slots(make, layout, offset):
    c = counting(64, F32, make)
    t = Tensor(c, offset, layout)
    assert t.size() == layout.size
    for i in range(layout.size):
        slot = offset + layout(i)
        assert t[i] == c[slot]
        coord = layout.shape.decode(i)
        assert t[coord] == c[slot]
        assert t[coord] == c[offset + layout.index(coord)]


WRITABLE = [(name, d) for name in CARRIERS for d in (F32, I32, BOOL) if not (name == "FileBacked" and d is BOOL)]


@pytest.mark.parametrize("name, dtype", WRITABLE, ids=[f"{n}-{d.name}" for n, d in WRITABLE])
def test_writes_land_in_the_carrier_slot_and_count_once(name, dtype):
    make = CARRIERS[name]
    layout, offset = Layout(Shape(3, [2, 2]), Stride(1, [3, 12])), 4
    c = counting(40, dtype, make)
    t = Tensor(c, offset, layout)
    values = {F32: lambda i: -1.5 * i, I32: lambda i: -7 * i, BOOL: lambda i: i % 2 == 1}[dtype]
    v0 = c.version
    for i in range(layout.size):
        key = i if i % 2 else layout.shape.decode(i)  # ordinals and coordinates alike
        t[key] = values(i)
        assert c.version == t.version == v0 + i + 1
    for i in range(layout.size):
        assert c[offset + layout(i)] == values(i)
    touched = {offset + layout(i) for i in range(layout.size)}
    untouched = counting(40, dtype, make)
    assert all(c[s] == untouched[s] for s in range(40) if s not in touched)


def test_writes_convert_values_by_dtype():
    f = Tensor(sw.CPU(2), 0, dense(2))
    f[0] = 0.1
    f[1] = 3
    assert f[0] == binary32(0.1) and f[1] == 3.0 and type(f[1]) is float
    i = Tensor(sw.CPU(1, dtype=I32), 0, dense(1))
    for bad, error, fragment in [(2**31, OverflowError, "out of range"), (1.0, TypeError, "must be an int")]:
        with pytest.raises(error, match=fragment):
            i[0] = bad
    b = Tensor(sw.CPU(1, dtype=BOOL), 0, dense(1))
    with pytest.raises(TypeError, match="must be a bool"):
        b[0] = 1
    assert (i[0], i.version, b[0], b.version) == (0, 0, False, 0)


@pytest.mark.parametrize(
    "key, error, fragment",
    [
        (6, ValueError, "out of range"),
        (-1, ValueError, "out of range"),
        ((2, 0), ValueError, "out of range"),
        ((0, 3), ValueError, "out of range"),
        ((0, 0, 0), ValueError, "rank|hierarchy|mismatch|modes"),
        (1.5, TypeError, "coordinates must be ints"),
        (True, TypeError, "bool"),
        ("0", TypeError, "coordinates must be ints"),
        (None, TypeError, "coordinates must be ints"),
    ],
    ids=repr,
)
def test_bad_keys_refused_and_nothing_changes(key, error, fragment):
    c = counting(12)
    t = Tensor(c, 1, Layout(Shape(2, 3), Stride(1, 2)))
    before = (read_all(c), c.version)
    with pytest.raises(error, match=fragment):
        t[key]
    with pytest.raises(error, match=fragment):
        t[key] = 1.0
    assert (read_all(c), c.version) == before


def test_version_is_the_carriers():
    c = counting(8)
    a, b = Tensor(c, 0, dense(4)), Tensor(c, 4, dense(4))
    v = c.version
    assert a.version == b.version == v
    a[0] = 9.0
    assert a.version == b.version == c.version == v + 1
    c[7] = 1.0
    assert a.version == b.version == v + 2
    assert b[3] == 1.0


def test_mutability_follows_the_carrier():
    frozen = sw.CPU(4, mutable=False)
    t = Tensor(frozen, 0, dense(4))
    assert t.is_mutable() is False
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        t[0] = 1.0
    assert frozen.version == 0 and t[0] == 0.0
    tier = counting(4)
    view = Tensor(tier, 0, dense(4))
    assert view.is_mutable() is True
    ev = sw.Evictable(tier, sw.CPU(0))  # the tier is now owned
    assert view.is_mutable() is False
    with pytest.raises(RuntimeError, match="owned"):
        view[0] = 1.0
    assert view[0] == 0.25 and tier.version == 4
    assert Tensor(ev, 0, dense(4)).is_mutable() is True


def test_released_carrier_fails_reads_and_writes():
    c = counting(4)
    t = Tensor(c, 0, dense(4))
    c.release()
    with pytest.raises(RuntimeError, match="released"):
        t[0]
    with pytest.raises(RuntimeError, match="released"):
        t[0] = 1.0
    assert t.dtype() is F32 and t.size() == 4 and t.carrier is c  # the view itself stays intact


# ============================================================ differentiability and grad


def test_only_float32_is_differentiable():
    assert Tensor(sw.CPU(1), 0, dense(1)).is_differentiable() is True
    assert Tensor(sw.CPU(1, dtype=I32), 0, dense(1)).is_differentiable() is False
    assert Tensor(sw.CPU(1, dtype=BOOL), 0, dense(1)).is_differentiable() is False
    assert Tensor(sw.Generic([1.0]), 0, dense(1)).is_differentiable() is True
    assert not hasattr(Tensor(sw.CPU(1), 0, dense(1)), "requires_grad")


def test_grad_defaults_to_none_and_is_settable():
    t = Tensor(sw.CPU(6), 0, friendly.column_major(2, 3))
    assert t.grad is None
    g = friendly.zeros(2, 3)
    t.grad = g
    assert t.grad is g
    t.grad = None
    assert t.grad is None


def test_grad_setter_refusals_change_nothing():
    t = Tensor(sw.CPU(6), 0, friendly.column_major(2, 3))
    g = friendly.zeros(2, 3)
    t.grad = g
    with pytest.raises(ValueError, match="does not match"):
        t.grad = friendly.zeros(3, 2)
    with pytest.raises(TypeError, match="must be a Tensor or None"):
        t.grad = 0.0
    assert t.grad is g


@pytest.mark.parametrize("dtype", [I32, BOOL], ids=lambda d: d.name)
def test_grad_on_a_non_differentiable_tensor_is_a_runtime_error(dtype):
    t = Tensor(sw.CPU(2, dtype=dtype), 0, dense(2))
    with pytest.raises(RuntimeError, match="not differentiable"):
        t.grad
    with pytest.raises(RuntimeError, match="not differentiable"):
        t.grad = None
    with pytest.raises(RuntimeError, match="not differentiable"):
        t.grad = friendly.zeros(2)


# ============================================================ identity


def test_carrier_property_is_the_same_object_every_time():
    c = sw.CPU(4)
    t = Tensor(c, 0, dense(4))
    assert t.carrier is c and t.carrier is t.carrier
    made = friendly.tensor([[1.0, 2.0]])
    assert made.carrier is made.carrier
    assert Tensor(made.carrier, 0, made.layout).carrier is made.carrier


def test_moved_tensor_is_the_same_object_on_every_wait():
    source = counting(6)
    destination = sw.Generic([], dtype=F32)
    handle = sw.move_async(Tensor(source, 0, dense(6)), destination)
    result = handle.wait()
    assert handle.wait() is result and handle.wait() is result
    assert result.carrier is destination and result.carrier is result.carrier
    assert [result[i] for i in range(6)] == [i + 0.25 for i in range(6)]


# ============================================================ NumPy interop


NP_DTYPE = {F32: np.float32, I32: np.int32, BOOL: np.bool_}


def assert_matches(array, t):
    extents = t.layout.shape.extents
    assert array.shape == tuple(extents)
    for index in np.ndindex(*extents):
        assert array[index] == t[tuple(index)]


@pytest.mark.parametrize("dtype", [F32, I32, BOOL], ids=lambda d: d.name)
def test_dense_cpu_tensor_exports_without_copy(dtype):
    c = counting(6, dtype)
    t = Tensor(c, 0, friendly.column_major(2, 3))
    a = np.asarray(t)
    assert a.dtype == NP_DTYPE[dtype] and a.shape == (2, 3)
    assert_matches(a, t)
    assert np.shares_memory(a, np.asarray(t))
    new = {F32: 42.5, I32: -42, BOOL: not bool(a[1, 2])}[dtype]
    a[1, 2] = new
    assert t[(1, 2)] == new and c[5] == new  # writing through the view is visible to the tensor
    c[0] = {F32: -1.0, I32: 77, BOOL: True}[dtype]
    assert a[0, 0] == c[0]  # and the other way round


@pytest.mark.parametrize(
    "layout, offset",
    [
        (Layout(Shape(2, 3), Stride(1, 2)), 5),
        (Layout(Shape(3, 4), Stride(4, 1)), 1),
        (Layout(Shape(4), Stride(3)), 10),
        (Layout(Shape(3, 4), Stride(0, 1)), 2),
        (Layout(Shape([2, 2], 3), Stride([1, 2], 4)), 0),
    ],
    ids=["offset", "row-major", "strided", "broadcast", "coalescing-mode"],
)
def test_offset_and_strided_cpu_tensors_are_views(layout, offset):
    c = counting(64)
    t = Tensor(c, offset, layout)
    a = np.asarray(t)
    assert_matches(a, t)
    whole = np.asarray(Tensor(c, 0, dense(64)))
    assert np.shares_memory(a, whole)
    slot = offset + layout(layout.size - 1)
    c[slot] = -3.0
    assert a[np.unravel_index(layout.size - 1, a.shape, order="F")] == -3.0


def test_non_coalescing_layout_exports_a_correct_copy():
    c = counting(64)
    t = Tensor(c, 7, Layout(Shape(2, [2, 2]), Stride(1, [4, 2])))
    a = np.asarray(t)
    assert_matches(a, t)
    c[7] = 100.0
    assert a[0, 0] == 7.25  # a snapshot


@pytest.mark.parametrize("name", ["Generic", "FileBacked", "Evictable", "BlockDeviceCarrier"])
@pytest.mark.parametrize("dtype", [F32, I32], ids=lambda d: d.name)
def test_non_cpu_tensors_export_a_correct_copy(name, dtype, tmp_path):
    if name == "Evictable":
        c = sw.Evictable(counting(40, dtype), sw.FileBacked(dtype=dtype))
    elif name == "BlockDeviceCarrier":
        path = sized_file(tmp_path / "arena.img", 1 << 20)
        c = counting(40, dtype, lambda n, d: sw.BlockDevice(path).allocate(n, dtype=d))
    else:
        c = counting(40, dtype, CARRIERS[name])
    for layout, offset in [(friendly.column_major(3, 4), 0), (Layout(Shape(3, [2, 2]), Stride(1, [3, 12])), 4)]:
        t = Tensor(c, offset, layout)
        a = np.asarray(t)
        assert a.dtype == NP_DTYPE[dtype]
        assert_matches(a, t)
        first = a.flat[0]
        t[0] = {F32: -9.0, I32: -9}[dtype]
        assert a.flat[0] == first  # a copy, not a view


def test_immutable_cpu_tensor_exports_a_read_only_view():
    c = sw.CPU(4, mutable=False)
    a = np.asarray(Tensor(c, 0, dense(4)))
    assert a.flags.writeable is False
    with pytest.raises(ValueError, match="read-only"):
        a[0] = 1.0
    assert c[0] == 0.0 and c.version == 0


def test_export_of_a_released_or_evicted_carrier_fails():
    c = sw.CPU(4)
    t = Tensor(c, 0, dense(4))
    c.release()
    with pytest.raises(RuntimeError, match="released"):
        np.asarray(t)
    ev = sw.Evictable(counting(4), sw.FileBacked())
    ev.evict()
    with pytest.raises(RuntimeError, match="evicted"):
        np.asarray(Tensor(ev, 0, dense(4)))
    assert ev.is_evicted() and not ev.is_released()


def test_dlpack_and_dtype_requests():
    c = counting(6)
    t = Tensor(c, 0, friendly.column_major(2, 3))
    d = np.from_dlpack(t)
    assert np.shares_memory(d, np.asarray(t))
    assert_matches(d, t)
    wide = np.asarray(t, dtype=np.float64)
    assert wide.dtype == np.float64 and not np.shares_memory(wide, d)
    assert_matches(wide, t)


def run_python(code: str, timeout=60):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_views_outlive_release_moves_and_evictions():
    """A view must stay readable whatever happens to the carrier (1 MiB buffers are unmapped when freed)."""
    result = run_python(
        """
        import numpy as np, strideweave as sw
        from strideweave import Layout, Shape, Stride, Tensor
        n = 1 << 18
        dense = Layout(Shape(n), Stride(1))
        def filled():
            c = sw.CPU(n)
            np.asarray(Tensor(c, 0, dense))[:] = 2.5
            return c
        c = filled(); a = np.asarray(Tensor(c, 0, dense)); c.release()
        print("release", float(a.sum()))
        c = filled(); t = Tensor(c, 0, dense); a = np.asarray(t); sw.move(t, sw.CPU(0))
        print("move", float(a.sum()))
        ev = sw.Evictable(filled(), sw.FileBacked()); a = np.asarray(Tensor(ev, 0, dense)); ev.evict()
        print("evict", float(a.sum()))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["release", "655360.0", "move", "655360.0", "evict", "655360.0"]


def test_interpreter_exit_with_a_dropped_move_in_flight(tmp_path):
    """Dropping a handle neither blocks nor stops the work, and exiting right after does not crash."""
    path = tmp_path / "out.bin"
    result = run_python(
        f"""
        import numpy as np, strideweave as sw
        from strideweave import Layout, Shape, Stride, Tensor, DType
        n = 1 << 22
        c = sw.CPU(n, dtype=DType.Int32)
        np.asarray(Tensor(c, 0, Layout(Shape(n), Stride(1))))[:] = np.arange(n, dtype=np.int32)
        sw.move_async(Tensor(c, 0, Layout(Shape(n), Stride(1))), sw.FileBacked({str(path)!r}, dtype=DType.Int32))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    moved = sw.FileBacked(path, dtype=I32)
    n = 1 << 22
    assert moved.size() == n
    a = np.asarray(Tensor(moved, 0, dense(n)))
    assert np.array_equal(a, np.arange(n, dtype=np.int32))


# ============================================================ friendly.tensor and friendly.zeros


def test_tensor_from_nested_lists_is_dense_first_mode_fastest():
    data = [[1.5, 2.0, -3.0], [4.0, 5.25, 6.0]]
    t = friendly.tensor(data)
    assert isinstance(t, Tensor) and type(t.carrier) is sw.CPU
    assert t.dtype() is F32 and t.offset == 0
    assert t.layout == friendly.column_major(2, 3) == Layout(Shape(2, 3), Stride(1, 2))
    for i in range(2):
        for j in range(3):
            assert t[(i, j)] == data[i][j]
    assert [t[k] for k in range(6)] == [1.5, 4.0, 2.0, 5.25, -3.0, 6.0]


def test_tensor_from_three_dimensional_lists_and_a_scalar():
    data = [[[i * 100 + j * 10 + k for k in range(4)] for j in range(3)] for i in range(2)]
    t = friendly.tensor(data, dtype=I32)
    assert t.layout == friendly.column_major(2, 3, 4)
    assert all(t[(i, j, k)] == data[i][j][k] for i in range(2) for j in range(3) for k in range(4))
    s = friendly.tensor(2.5)
    assert s.layout == Layout(Shape(), Stride()) and s[()] == 2.5 and s.size() == 1


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) / 7),
        np.arange(48, dtype=np.int64).reshape(6, 8)[::2, 1::3],
        np.arange(24, dtype=np.int32).reshape(2, 3, 4).transpose(2, 0, 1),
    ],
    ids=["c-order", "fortran-order", "strided-slice", "transposed"],
)
def test_tensor_from_numpy_arrays(array):
    t = friendly.tensor(array)
    assert t.layout == friendly.column_major(*array.shape)
    for index in np.ndindex(*array.shape):
        assert t[index] == binary32(float(array[index]))


@pytest.mark.parametrize(
    "data, dtype, expected",
    [
        (np.array([[True, False], [False, True]]), BOOL, [[True, False], [False, True]]),
        ([[True, False]], BOOL, [[True, False]]),
        (np.array([[2**31 - 1, -(2**31)]], dtype=np.int64), I32, [[2**31 - 1, -(2**31)]]),
        ([[1, 2], [3, 4]], I32, [[1, 2], [3, 4]]),
        ([[1, 2]], F32, [[1.0, 2.0]]),
        ([[0.1, 2**80]], F32, [[binary32(0.1), binary32(float(2**80))]]),
        ([[-(2**2000), 2**70, 3]], F32, [[-math.inf, binary32(float(2**70)), 3.0]]),
    ],
    ids=["numpy-bool", "list-bool", "int32-limits", "list-int", "ints-into-float", "rounding", "beyond-float64"],
)
def test_tensor_dtype_accepts(data, dtype, expected):
    t = friendly.tensor(data, dtype=dtype)
    assert t.dtype() is dtype
    for i, row in enumerate(expected):
        for j, value in enumerate(row):
            assert t[(i, j)] == value and type(t[(i, j)]) is type(value)


@pytest.mark.parametrize(
    "data, dtype, error, fragment",
    [
        ([[1, 0]], BOOL, TypeError, "only bool"),
        (np.array([1.0, 0.0]), BOOL, TypeError, "only bool"),
        ([1.5, 2.0], I32, TypeError, "only int"),
        ([True], I32, TypeError, "only int"),
        ([2**31], I32, OverflowError, "out of range"),
        ([-(2**31) - 1], I32, OverflowError, "out of range"),
        ([[1, 2**70]], I32, OverflowError, "out of range"),
        (np.array([2**40]), I32, OverflowError, "out of range"),
        ([True, False], F32, TypeError, "float or int"),
        (["a"], F32, TypeError, "float or int"),
        ([1.0], F64, TypeError, "not a storage dtype"),
        ([1.0], "Float32", TypeError, "dtype must be a DType"),
    ],
    ids=[
        "int-into-bool",
        "float-array-into-bool",
        "float-into-int",
        "bool-into-int",
        "int32-max+1",
        "int32-min-1",
        "beyond-int64",
        "int64-array",
        "bool-into-float",
        "str",
        "Float64",
        "dtype-str",
    ],
)
def test_tensor_dtype_refusals(data, dtype, error, fragment):
    with pytest.raises(error, match=fragment):
        friendly.tensor(data, dtype=dtype)


@pytest.mark.parametrize("carrier", [sw.Generic, sw.FileBacked], ids=lambda c: c.__name__)
def test_tensor_on_another_carrier_class(carrier):
    data = [[1, 2, 3], [4, 5, 6]]
    t = friendly.tensor(data, dtype=I32, carrier=carrier)
    assert type(t.carrier) is carrier and t.dtype() is I32
    assert t.layout == friendly.column_major(2, 3)
    assert all(t[(i, j)] == data[i][j] for i in range(2) for j in range(3))


def test_tensor_refuses_a_carrier_that_is_not_a_class():
    with pytest.raises(TypeError, match="Carrier class"):
        friendly.tensor([1.0], carrier=sw.CPU(1))


@pytest.mark.parametrize("dtype", [F32, I32, BOOL], ids=lambda d: d.name)
def test_zeros(dtype):
    z = friendly.zeros(2, 3, dtype=dtype)
    assert type(z.carrier) is sw.CPU and z.dtype() is dtype and z.offset == 0
    assert z.layout == friendly.column_major(2, 3)
    zero = {F32: 0.0, I32: 0, BOOL: False}[dtype]
    assert all(z[k] == zero and type(z[k]) is type(zero) for k in range(6))
    g = friendly.zeros(4, dtype=dtype, carrier=sw.Generic)
    assert type(g.carrier) is sw.Generic and [g[k] for k in range(4)] == [zero] * 4
    assert friendly.zeros(2, [3, 4]).layout == friendly.column_major(2, [3, 4])


def test_zeros_refusals():
    with pytest.raises(ValueError, match=">= 1"):
        friendly.zeros(2, 0)
    with pytest.raises(TypeError, match="bool"):
        friendly.zeros(True)
    with pytest.raises(TypeError, match="not a storage dtype"):
        friendly.zeros(2, dtype=F64)
