"""Convenience constructors: dense tensors from nested lists or arrays, zeros, dense layouts."""

from __future__ import annotations

import math

import numpy as np

from . import _core
from ._core import CPU, DType, FileBacked, Generic, Shape, Tensor, column_major, row_major

__all__ = ["tensor", "zeros", "column_major", "row_major"]

_NUMPY = {"Float32": np.float32, "Int32": np.int32, "Bool": np.bool_}


def _wide_ints(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """NumPy keeps Python ints beyond 64 bits as objects; they are still ints (docs/guide.md, "DTypes")."""
    items = arr.reshape(-1).tolist()
    if not items or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
        return arr
    if dtype is DType.Int32:
        if any(isinstance(x, float) for x in items):
            return arr
        if any(x < -(2**31) or x > 2**31 - 1 for x in items):
            raise OverflowError("Int32 element is out of range [-2147483648, 2147483647]")
        return arr.astype(np.int64)
    if dtype is not DType.Float32:
        return arr
    # Float32 rounds them (to +-inf past its range), exactly as a slot write does.
    wide = [float(x) if isinstance(x, float) or abs(x) < 2**1024 else (math.inf if x > 0 else -math.inf) for x in items]
    return np.array(wide, dtype=np.float64).reshape(arr.shape)


def _checked_array(data, dtype: DType) -> np.ndarray:
    if not isinstance(dtype, DType):
        raise TypeError("dtype must be a DType")
    if dtype.name not in _NUMPY:
        raise TypeError(f"{dtype.name} is not a storage dtype")
    arr = np.asarray(data)
    if arr.dtype.kind == "O":
        arr = _wide_ints(arr, dtype)
    kind = arr.dtype.kind
    if dtype is DType.Bool and kind != "b":
        raise TypeError(f"a Bool tensor accepts only bool values, got {arr.dtype}")
    if dtype is DType.Int32:
        if kind not in "iu":
            raise TypeError(f"an Int32 tensor accepts only int values, got {arr.dtype}")
        if arr.size and (arr.min() < -(2**31) or arr.max() > 2**31 - 1):
            raise OverflowError("Int32 element is out of range [-2147483648, 2147483647]")
    if dtype is DType.Float32 and kind not in "fiu":
        raise TypeError(f"a Float32 tensor accepts float or int values, got {arr.dtype}")
    with np.errstate(over="ignore"):  # Float32 rounds out-of-range values to +-inf, silently as slot writes do
        return arr.astype(_NUMPY[dtype.name], copy=False)


def _allocate(carrier, size: int, dtype: DType):
    if carrier is CPU:
        return CPU(size, dtype=dtype, empty=True)
    if carrier is Generic:
        return Generic([False] * size if dtype is DType.Bool else [0] * size, dtype=dtype)
    if carrier is FileBacked:
        return FileBacked(dtype=dtype).allocate_like(size, empty=True)
    if isinstance(carrier, type) and issubclass(carrier, _core.Carrier):
        return carrier(size, dtype=dtype)
    raise TypeError(f"carrier must be a Carrier class, got {carrier!r}")


def tensor(data, *, dtype: DType = DType.Float32, carrier=CPU) -> Tensor:
    """A dense tensor (first mode fastest) holding ``data`` (nested lists or an array)."""
    arr = _checked_array(data, dtype)
    shape = Shape(*arr.shape)
    flat = np.ascontiguousarray(arr.reshape(-1, order="F"))
    c = _allocate(carrier, max(1, flat.size), dtype)
    if flat.size:
        _core._fill_from_array(c, flat)
    return Tensor(c, 0, column_major(shape))


def zeros(*extents, dtype: DType = DType.Float32, carrier=CPU) -> Tensor:
    """A zero-filled dense tensor of the given extents."""
    shape = Shape(*extents)
    if carrier is CPU:
        c = CPU(shape.size, dtype=dtype)
    else:
        c = _allocate(carrier, shape.size, dtype)
    return Tensor(c, 0, column_major(shape))
