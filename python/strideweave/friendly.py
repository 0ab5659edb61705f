"""Convenience constructors: dense tensors from nested lists or arrays, zeros, dense layouts."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from . import _core
from ._core import CPU, DType, FileBacked, Generic, Shape, Tensor, column_major, row_major

__all__ = ["tensor", "zeros", "column_major", "row_major"]

_NUMPY = {
    "Float32": np.dtype(np.float32),
    "Int32": np.dtype(np.int32),
    "Bool": np.dtype(np.bool_),
    "BFloat16": np.dtype(ml_dtypes.bfloat16),
    "Float16": np.dtype(np.float16),
}
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _checked_array(data: Any, dtype: DType) -> np.ndarray:
    """``data`` as an array of ``dtype``'s storage elements.

    The values are converted by the core's rules (``DType.convert``: Int32's range, Float32's rounding, to +-inf
    past its range), over the whole array in one call, exactly as slot writes convert them.
    """
    if not isinstance(dtype, DType):
        raise TypeError("dtype must be a DType")
    if dtype.name not in _NUMPY:
        raise TypeError(f"{dtype.name} is not a storage dtype")
    arr = np.asarray(data)
    if arr.dtype == _NUMPY[dtype.name]:
        return arr  # already this dtype's elements: every value stays as it is (no widening, no rounding)
    if arr.dtype == _BF16:
        # bfloat16 arrays (kind "V" in NumPy) hold floats; widened exactly to read them as any other float array.
        arr = arr.astype(np.float64)
    if arr.dtype.kind == "O":
        # NumPy keeps Python ints beyond 64 bits as objects; they are still ints (docs/guide.md, "DTypes").
        values = _core._storage_values(arr.reshape(-1).tolist(), dtype)
        if values is not None:
            return values.reshape(arr.shape)
    kind = arr.dtype.kind
    if dtype is DType.Bool and kind != "b":
        raise TypeError(f"a Bool tensor accepts only bool values, got {arr.dtype}")
    if dtype is DType.Int32 and kind not in "iu":
        raise TypeError(f"an Int32 tensor accepts only int values, got {arr.dtype}")
    if dtype in (DType.Float32, DType.BFloat16, DType.Float16) and kind not in "fiu":
        raise TypeError(f"a {dtype.name} tensor accepts float or int values, got {arr.dtype}")
    if dtype is DType.Bool:
        return arr.astype(np.bool_, copy=False)
    if not arr.dtype.isnative or (kind == "f" and arr.dtype.itemsize not in (4, 8)):
        # The core reads native integers, float32 and float64; other floats widen exactly (float16, read by
        # the rules of the requested dtype, never kept as Float32 silently) or as a slot write reads them (long
        # double, through a double).
        arr = arr.astype(np.float64 if kind == "f" else arr.dtype.newbyteorder("="))
    return _core._storage_array(np.ascontiguousarray(arr).reshape(-1), dtype).reshape(arr.shape)


def _allocate(carrier: type, size: int, dtype: DType) -> _core.Carrier:
    if carrier is CPU:
        return CPU(size, dtype=dtype, empty=True)
    if carrier is Generic:
        return Generic([False] * size if dtype is DType.Bool else [0] * size, dtype=dtype)
    if carrier is FileBacked:
        return FileBacked(dtype=dtype).allocate_like(size, empty=True)
    if isinstance(carrier, type) and issubclass(carrier, _core.Carrier):
        return carrier(size, dtype=dtype)
    raise TypeError(f"carrier must be a Carrier class, got {carrier!r}")


def tensor(data: Any, *, dtype: DType | None = None, carrier: type = CPU) -> Tensor:
    """A dense tensor (first mode fastest) holding ``data`` (nested lists or an array).

    Without ``dtype``, a float16 array makes a Float16 tensor and an ``ml_dtypes.bfloat16`` array a BFloat16
    one (their values kept exactly); anything else Float32. With ``dtype``, values convert by its rules
    (``DType.convert``: BFloat16 and Float16 round to nearest even).
    """
    if dtype is None:
        kind = getattr(data, "dtype", None)
        dtype = DType.Float16 if kind == np.float16 else DType.BFloat16 if kind == _BF16 else DType.Float32
    arr = _checked_array(data, dtype)
    shape = Shape(*arr.shape)
    flat = np.ascontiguousarray(arr.reshape(-1, order="F"))
    c = _allocate(carrier, max(1, flat.size), dtype)
    if flat.size:
        # 16-bit floats travel as their bits (the core takes the bytes; NumPy's buffer of bfloat16 is not standard)
        _core._fill_from_array(c, flat.view(np.uint16) if dtype.bits == 16 else flat)
    return Tensor(c, 0, column_major(shape))


def zeros(*extents: Any, dtype: DType = DType.Float32, carrier: type = CPU) -> Tensor:
    """A zero-filled dense tensor of the given extents."""
    shape = Shape(*extents)
    if carrier is CPU:
        c = CPU(shape.size, dtype=dtype)
    else:
        c = _allocate(carrier, shape.size, dtype)
    return Tensor(c, 0, column_major(shape))
