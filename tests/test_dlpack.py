"""DLPack both ways (docs/guide.md, "Carriers", "DLPack"): ``Tensor.__dlpack__`` exports a CPU carrier's memory
and ``sw.from_dlpack`` imports NumPy's or PyTorch's, without copying either way (the same data address, writes
seen on both sides), with the producer's shape and strides; exports outlive the carrier's release and imports
outlive the producer's last reference; what cannot be shared without a copy raises BufferError and changes
nothing.

Values are compared exactly (every conversion here is a reinterpretation of the same bytes).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import weakref

import numpy as np
import pytest
import torch

import strideweave as sw
from strideweave import Layout, Shape, Stride, Tensor, friendly

F32, I32, BOOL = sw.DType.Float32, sw.DType.Int32, sw.DType.Bool
HAS_HALF = hasattr(sw.DType, "BFloat16")  # BFloat16 and Float16 arrive together (docs/guide.md, "DTypes")

# (StrideWeave dtype, NumPy dtype, torch dtype, values) for the dtypes of every build.
DTYPES = [
    (F32, np.float32, torch.float32, [0.5, -1.25, 3.0, 1e-3, 7.0, -0.0]),
    (I32, np.int32, torch.int32, [1, -2, 2**31 - 1, -(2**31), 0, 42]),
    (BOOL, np.bool_, torch.bool, [True, False, False, True, True, False]),
]
DTYPE_IDS = ["Float32", "Int32", "Bool"]


def address(t: Tensor) -> int:
    """The address of a CPU tensor's first element (the zero-copy NumPy view of it)."""
    return np.asarray(t).ctypes.data


def cpu_tensor(values, dtype, layout=None, offset=0) -> Tensor:
    """A CPU tensor over a carrier holding `values` in slot order."""
    c = sw.CPU(len(values), dtype=dtype)
    for i, v in enumerate(values):
        c[i] = v
    return Tensor(c, offset, layout or friendly.column_major(len(values)))


# ============================================================ a capsule built by hand (the C ABI of DLPack 1.0)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]

VERSIONED = b"dltensor_versioned"  # module constants: a capsule keeps a pointer to its name


class Crafted:
    """A versioned DLPack capsule over `array`'s memory with the given fields, without a deleter (the array and
    the structs live as long as this object)."""

    def __init__(self, array, *, device=(1, 0), dtype=(2, 32, 1), version=(1, 0), strides=None, name=VERSIONED):
        self.array = array
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self.strides = None if strides is None else (ctypes.c_int64 * array.ndim)(*strides)
        self.managed = DLManagedTensorVersioned()
        self.managed.version = DLPackVersion(*version)
        self.managed.dl_tensor = DLTensor(array.ctypes.data, DLDevice(*device), array.ndim, DLDataType(*dtype),
                                          self.shape, self.strides, 0)
        self.name = name
        self.capsule = _capsule_new(ctypes.addressof(self.managed), name, None)

    def unconsumed(self) -> bool:
        return _capsule_is_valid(self.capsule, self.name) == 1


# ============================================================ NumPy


@pytest.mark.parametrize("dtype, np_dtype, torch_dtype, values", DTYPES, ids=DTYPE_IDS)
def test_numpy_round_trip_shares_memory_both_ways(dtype, np_dtype, torch_dtype, values):
    a = np.array(values, dtype=np_dtype).reshape(2, 3)
    t = sw.from_dlpack(a)
    assert t.dtype() is dtype and t.is_mutable()
    assert t.shape.extents == (2, 3) and t.layout == Layout(Shape(2, 3), Stride(3, 1))
    assert address(t) == a.ctypes.data  # no copy
    np.testing.assert_array_equal(np.asarray(t), a)
    b = np.from_dlpack(t)
    assert b.ctypes.data == a.ctypes.data and b.strides == a.strides and b.dtype == a.dtype
    t[(0, 1)] = values[3]  # StrideWeave writes, NumPy sees
    assert a[0, 1] == values[3] and b[0, 1] == values[3]
    a[1, 2] = values[0]  # NumPy writes, StrideWeave sees
    assert t[(1, 2)] == values[0]


def test_numpy_export_of_a_strided_view_with_an_offset():
    c = cpu_tensor([float(i) for i in range(24)], F32).carrier
    t = Tensor(c, 5, Layout(Shape(3, 4), Stride(1, 4)))  # (i, j) at slot 5 + i + 4 j
    base = address(Tensor(c, 0, friendly.column_major(24)))
    d = np.from_dlpack(t)
    assert d.ctypes.data == base + 5 * 4 and d.strides == (4, 16)
    np.testing.assert_array_equal(d, 5 + np.arange(3)[:, None] + 4 * np.arange(4)[None, :])
    d[2, 1] = -1.0
    assert c[5 + 2 + 4] == -1.0


def test_import_keeps_strides_broadcasts_and_rank_zero():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    view = a[:, ::2, 1:]  # strided and offset
    t = sw.from_dlpack(view)
    assert t.layout == Layout(Shape(2, 2, 3), Stride(12, 8, 1)) and address(t) == view.ctypes.data
    np.testing.assert_array_equal(np.asarray(t), view)
    b = sw.from_dlpack(np.broadcast_to(np.float32(2.5), (3, 2)))  # stride 0, read-only
    assert b.layout.stride == Stride(0, 0) and not b.is_mutable()
    np.testing.assert_array_equal(np.asarray(b), np.full((3, 2), 2.5, np.float32))
    s = sw.from_dlpack(np.array(7, dtype=np.int32))
    assert s.layout == Layout(Shape(), Stride()) and s[()] == 7


def test_a_read_only_producer_gives_an_immutable_tensor():
    a = np.arange(4, dtype=np.int32)
    a.flags.writeable = False
    t = sw.from_dlpack(a)
    assert not t.is_mutable() and not t.carrier.is_mutable()
    with pytest.raises(RuntimeError, match="immutable"):
        t[(1,)] = 5
    np.testing.assert_array_equal(a, [0, 1, 2, 3])
    again = np.from_dlpack(t)  # exported read-only in turn
    assert not again.flags.writeable and again.ctypes.data == a.ctypes.data


def test_an_immutable_tensor_exports_read_only_and_only_as_a_versioned_capsule():
    c = sw.CPU(4, mutable=False)
    t = Tensor(c, 0, friendly.column_major(4))
    d = np.from_dlpack(t)  # NumPy asks for a versioned capsule
    assert not d.flags.writeable and d.ctypes.data == address(t)
    with pytest.raises(BufferError, match="legacy DLPack capsule, which cannot mark it read-only"):
        t.__dlpack__()
    assert t.__dlpack__(max_version=(1, 0)) is not None
    assert t.__dlpack__(copy=True) is not None  # a copy is the consumer's to write


# ============================================================ PyTorch


@pytest.mark.parametrize("dtype, np_dtype, torch_dtype, values", DTYPES, ids=DTYPE_IDS)
def test_torch_round_trip_shares_memory_both_ways(dtype, np_dtype, torch_dtype, values):
    x = torch.tensor(values, dtype=torch_dtype).reshape(2, 3)
    t = sw.from_dlpack(x)
    assert t.dtype() is dtype and address(t) == x.data_ptr()
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr() and y.stride() == x.stride() and y.dtype == torch_dtype
    assert torch.equal(y, x)
    t[(1, 0)] = values[5]
    assert x[1, 0].item() == values[5]
    x[0, 2] = values[1]
    assert t[(0, 2)] == values[1] and y[0, 2].item() == values[1]


def test_torch_export_of_a_strided_tensor_and_a_transposed_import():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).T  # (4, 3), strides (1, 4)
    t = sw.from_dlpack(x)
    assert t.layout == Layout(Shape(4, 3), Stride(1, 4)) and address(t) == x.data_ptr()
    assert np.asarray(t).tolist() == x.tolist()
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr() and y.stride() == (1, 4) and torch.equal(x, y)
    c = cpu_tensor([float(i) for i in range(6)], F32, friendly.row_major(2, 3)).carrier
    z = torch.from_dlpack(Tensor(c, 0, friendly.row_major(2, 3)))
    assert z.stride() == (3, 1) and z.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    z[1, 1] = 9.0
    assert c[4] == 9.0


def test_strideweave_ops_run_on_an_import():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # PyTorch's (out, in) weight, row-major
    out = sw.matmul(sw.from_dlpack(x), sw.from_dlpack(w))  # (m, k) against (n, k)
    np.testing.assert_array_equal(np.asarray(out), (x @ w.T).numpy())  # small integers: exact in float32


# ============================================================ lifetime


def test_an_import_keeps_the_producer_alive_until_its_last_holder_lets_go():
    a = np.arange(8, dtype=np.float32)
    alive = weakref.ref(a)
    t = sw.from_dlpack(a)
    del a
    gc.collect()
    assert alive() is not None and np.asarray(t).tolist() == list(range(8))
    exported = np.from_dlpack(t)  # an export of the import holds the producer too
    t.carrier.release()
    del t
    gc.collect()
    assert alive() is not None and exported.tolist() == list(range(8))
    del exported
    gc.collect()
    assert alive() is None  # the producer's deleter ran: nothing leaks


def test_an_unconsumed_capsule_lets_go_of_the_memory():
    a = np.arange(4, dtype=np.float32)
    alive = weakref.ref(a)
    t = sw.from_dlpack(a)
    del a
    capsule = t.__dlpack__(max_version=(1, 0))
    del t
    gc.collect()
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None


def test_dropping_the_torch_producer_leaves_the_import_valid():
    n = 1 << 18  # 1 MiB: the allocator would hand freed memory to the next tensor of that size
    x = torch.arange(n, dtype=torch.float32)
    t = sw.from_dlpack(x)
    del x
    gc.collect()
    other = torch.full((n,), -1.0)
    assert np.array_equal(np.asarray(t), np.arange(n, dtype=np.float32))
    assert other[0].item() == -1.0


def test_an_export_outlives_release_of_the_carrier():
    n = 1 << 18  # 1 MiB: a freed buffer would go to the mapping cache and back to the next CPU(n)
    c = sw.CPU(n)
    t = Tensor(c, 0, friendly.column_major(n))
    np.from_dlpack(t)[:] = np.arange(n, dtype=np.float32)
    x = torch.from_dlpack(t)
    d = np.from_dlpack(t)
    c.release()
    with pytest.raises(RuntimeError, match="released"):
        t.__dlpack__()
    other = sw.CPU(n)
    np.from_dlpack(Tensor(other, 0, friendly.column_major(n)))[:] = -1.0
    expected = np.arange(n, dtype=np.float32)
    assert np.array_equal(x.numpy(), expected) and np.array_equal(d, expected)
    assert x.data_ptr() != address(Tensor(other, 0, friendly.column_major(n)))


# ============================================================ export: what cannot be shared without a copy


def non_native_tensors():
    values = [float(i) for i in range(8)]
    file_backed = sw.FileBacked().allocate_like(8)
    for i, v in enumerate(values):
        file_backed[i] = v
    primary = sw.CPU(8)
    for i, v in enumerate(values):
        primary[i] = v
    tiled = sw.TiledEvictable(primary, sw.FileBacked(), (1, 2), (2, 2))
    layout = friendly.column_major(2, 4)
    return {
        "FileBacked": Tensor(file_backed, 0, layout),
        "Generic": Tensor(sw.Generic(values), 0, layout),
        "TiledEvictable": Tensor(tiled, 0, layout),
    }


@pytest.mark.parametrize("kind", ["FileBacked", "Generic", "TiledEvictable"])
def test_a_carrier_without_host_memory_exports_only_a_copy(kind):
    t = non_native_tensors()[kind]
    before = np.asarray(t).copy()
    version = t.carrier.version
    for call in (lambda: t.__dlpack__(), lambda: t.__dlpack__(max_version=(1, 0), copy=False),
                 lambda: np.from_dlpack(t), lambda: torch.from_dlpack(t)):
        with pytest.raises(BufferError, match=f"cannot export {kind} tensor of layout .* without a copy: its carrier "
                                              "keeps no host memory to share .pass copy=True"):
            call()
    assert t.carrier.version == version and np.array_equal(np.asarray(t), before)  # nothing changed
    copied = np.from_dlpack(t, copy=True)
    assert np.array_equal(copied, before)
    copied[0, 0] = -5.0  # the copy is the consumer's own
    assert t[(0, 0)] == before[0, 0] and t.carrier.version == version
    y = torch.from_dlpack(t.__dlpack__(max_version=(1, 0), copy=True))
    assert y.tolist() == before.tolist()


def test_copy_true_copies_a_cpu_tensor_too():
    t = cpu_tensor([1.0, 2.0, 3.0, 4.0], F32, Layout(Shape(2, 2), Stride(2, 1)))
    c = np.from_dlpack(t, copy=True)
    assert c.ctypes.data != address(t) and c.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    c[0, 0] = 9.0
    assert t[(0, 0)] == 1.0


def test_a_layout_without_strides_exports_only_a_copy():
    c = cpu_tensor([float(i) for i in range(16)], F32).carrier
    t = Tensor(c, 0, Layout(Shape(2, [2, 2]), Stride(1, [2, 8])))  # mode 1's leaves do not coalesce
    with pytest.raises(BufferError, match=r"layout .* has a mode whose leaves no single stride describes"):
        np.from_dlpack(t)
    copied = np.from_dlpack(t, copy=True)
    assert copied.shape == (2, 4)
    assert [copied[i, j] for i in range(2) for j in range(4)] == [t[(i, j)] for i in range(2) for j in range(4)]
    assert c.version == 16  # one write per slot by cpu_tensor, none since


def test_export_argument_errors():
    t = cpu_tensor([1.0, 2.0], F32)
    version = t.carrier.version
    with pytest.raises(ValueError, match="stream must be None for CPU memory, got 1"):
        t.__dlpack__(stream=1)
    with pytest.raises(BufferError, match=r"cannot export to CUDA device 0 \(DLPack device type 2\)"):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match=r"cannot export to CPU device 3"):
        t.__dlpack__(dl_device=(1, 3))
    with pytest.raises(TypeError, match=r"max_version must be None or a \(major, minor\) tuple of ints, got '1.0'"):
        t.__dlpack__(max_version="1.0")
    with pytest.raises(TypeError, match=r"dl_device must be None or a \(device_type, device_id\) tuple"):
        t.__dlpack__(dl_device="cpu")
    with pytest.raises(TypeError, match="copy must be None, True or False, got 'yes'"):
        t.__dlpack__(copy="yes")
    assert t.carrier.version == version and [t[(i,)] for i in range(2)] == [1.0, 2.0]
    assert t.__dlpack_device__() == (1, 0)
    again = sw.from_dlpack(t.__dlpack__(dl_device=(1, 0), max_version=(1, 0)))
    assert address(again) == address(t) and [again[(i,)] for i in range(2)] == [1.0, 2.0]


# ============================================================ import: what StrideWeave cannot take without a copy


def test_import_refusals_name_the_dtype_and_leave_the_producer_alone():
    for producer, fragment in [
        (np.arange(4, dtype=np.float64), "dtype float64 has no StrideWeave dtype"),
        (np.arange(4, dtype=np.uint8), "dtype uint8 has no StrideWeave dtype"),
        (torch.arange(4, dtype=torch.int64), "dtype int64 has no StrideWeave dtype"),
        (np.zeros(2, dtype=np.complex64), "dtype complex64 has no StrideWeave dtype"),
        (np.arange(8, dtype=np.float32)[::-2], "mode 0 has the negative stride -2 .a reversed view.; StrideWeave "
                                              "strides are >= 0"),
        (np.zeros((0, 3), dtype=np.float32), "mode 0 has extent 0; StrideWeave shapes have extents >= 1"),
        (np.frombuffer(bytearray(20), dtype=np.float32, offset=1, count=4),
         "the data address is not aligned to the 4-byte elements of Float32"),
    ]:
        before = np.array(producer, copy=True) if isinstance(producer, np.ndarray) else producer.clone()
        refs = sys.getrefcount(producer)
        with pytest.raises(BufferError, match=fragment):
            sw.from_dlpack(producer)
        gc.collect()
        assert sys.getrefcount(producer) == refs  # the refused capsule gave its reference back
        assert (np.array_equal(producer, before) if isinstance(producer, np.ndarray) else torch.equal(producer, before))
    with pytest.raises(BufferError, match="imports float32, int32, bool"):
        sw.from_dlpack(np.arange(2, dtype=np.float64))


def test_strides_that_are_not_whole_elements_are_refused_by_the_producer():
    packed = np.zeros(4, dtype=[("a", "i1"), ("b", "<f4")])["b"]  # 5-byte strides
    with pytest.raises(BufferError, match="multiple of itemsize"):
        sw.from_dlpack(packed)


def test_a_producer_on_another_device_is_refused_before_it_exports():
    class OnCuda:
        exported = False

        def __dlpack_device__(self):
            return (2, 1)

        def __dlpack__(self, **kwargs):
            OnCuda.exported = True
            raise AssertionError("never asked")

    with pytest.raises(BufferError, match=r"the .*OnCuda lives on CUDA device 1 \(DLPack device type 2\); "
                                          "StrideWeave imports CPU memory only"):
        sw.from_dlpack(OnCuda())
    assert not OnCuda.exported


def test_capsule_refusals_leave_the_capsule_unconsumed():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    for kwargs, fragment in [
        ({"device": (2, 0)}, r"the tensor lives on CUDA device 0 \(DLPack device type 2\)"),
        ({"device": (99, 0)}, r"unknown device 0 \(DLPack device type 99\)"),
        ({"dtype": (2, 32, 4)}, "dtype float32x4 has no StrideWeave dtype"),
        ({"dtype": (4, 16, 1)} if not HAS_HALF else {"dtype": (4, 8, 1)}, "has no StrideWeave dtype"),
        ({"version": (2, 0)}, r"DLPack version 2.0 is not one StrideWeave reads \(1.x\)"),
        ({"strides": (1, -2)}, "mode 1 has the negative stride -2"),
    ]:
        crafted = Crafted(a, **kwargs)
        with pytest.raises(BufferError, match=fragment):
            sw.from_dlpack(crafted.capsule)
        assert crafted.unconsumed()
    good = Crafted(a, strides=(1, 2))  # a column-major reading of the same memory
    t = sw.from_dlpack(good.capsule)
    assert not good.unconsumed() and t.layout == Layout(Shape(2, 3), Stride(1, 2)) and address(t) == a.ctypes.data
    with pytest.raises(BufferError, match="this DLPack capsule was already consumed"):
        sw.from_dlpack(good.capsule)
    del t  # the consumer lets go first: DLPack's structs must outlive it, and good's die with good
    other = Crafted(a, name=b"not_a_tensor")
    with pytest.raises(TypeError, match="a capsule named 'not_a_tensor' is not a DLPack capsule"):
        sw.from_dlpack(other.capsule)
    with pytest.raises(TypeError, match="expected an object with __dlpack__ .* or a DLPack capsule, got list"):
        sw.from_dlpack([1.0, 2.0])


def test_a_legacy_producer_is_asked_again_without_max_version():
    a = np.arange(3, dtype=np.int32)

    class Legacy:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None):  # no max_version: TypeError when it is passed
            return a.__dlpack__()

    t = sw.from_dlpack(Legacy())
    assert t.is_mutable() and address(t) == a.ctypes.data and [t[(i,)] for i in range(3)] == [0, 1, 2]


# ============================================================ BFloat16 and Float16 (when the build has them)

half = pytest.mark.skipif(not HAS_HALF, reason="this build has no BFloat16/Float16 dtypes")


@half
@pytest.mark.parametrize("torch_dtype, name", [(torch.bfloat16, "BFloat16"), (torch.float16, "Float16")])
def test_half_round_trips_with_torch(torch_dtype, name):
    x = torch.tensor([[0.5, -1.0, 2.0], [3.0, -0.25, 8.0]], dtype=torch_dtype)
    t = sw.from_dlpack(x)
    assert t.dtype() is getattr(sw.DType, name)
    y = torch.from_dlpack(t)
    assert y.dtype == torch_dtype and y.data_ptr() == x.data_ptr() and torch.equal(x, y)
    t[(0, 1)] = 2.5  # exact in both formats
    assert x[0, 1].item() == 2.5
    x[1, 2] = -3.0
    assert t[(1, 2)] == -3.0
    xt = x.T
    assert sw.from_dlpack(xt).layout == Layout(Shape(3, 2), Stride(1, 3))


@half
def test_float16_round_trips_with_numpy():
    a = np.array([0.5, -1.0, 65504.0, 6e-8], dtype=np.float16)
    t = sw.from_dlpack(a)
    assert t.dtype() is sw.DType.Float16
    b = np.from_dlpack(t)
    assert b.dtype == np.float16 and b.ctypes.data == a.ctypes.data and np.array_equal(a, b)


def test_asarray_copy_false_gives_a_view_or_refuses():
    """NumPy's protocol: copy=False is a view of the CPU memory, or ValueError where only a copy could be made
    (no host memory of its own, or a nested mode no stride describes); nothing changes either way."""
    a = np.arange(6, dtype=np.float32)
    t = sw.from_dlpack(a)
    view = np.asarray(t, copy=False)
    assert np.shares_memory(view, a)
    on_file = friendly.tensor([[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]], carrier=sw.FileBacked)  # slots 0..5 in order
    nested = sw.Tensor(t.carrier, 0, sw.Layout(sw.Shape(1, [2, 3]), sw.Stride(0, [3, 1])))  # no single stride
    for tensor, kind in ((on_file, "FileBacked"), (nested, "CPU")):
        before = tensor.carrier.version
        with pytest.raises(ValueError, match=f"copy=False.*over {kind}.*not a NumPy view"):
            np.asarray(tensor, copy=False)
        assert tensor.carrier.version == before
        assert np.array_equal(np.asarray(tensor).ravel(order="F"), [0, 3, 1, 4, 2, 5] if kind == "CPU" else range(6))
