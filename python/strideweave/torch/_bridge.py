"""The DLPack bridge to PyTorch (docs/guide.md, "PyTorch").

``to_torch(t)`` and ``from_torch(x)`` share memory through DLPack both ways, never copying: the result's data
pointer is the argument's, and a write on either side is seen on the other. Float32, BFloat16, Float16, Int32 and
Bool travel (``torch.float32``, ``torch.bfloat16``, ``torch.float16``, ``torch.int32``, ``torch.bool``); shapes,
strides and offsets are kept (a transposed tensor stays transposed). What cannot be shared without a copy is
refused with the reason and changes nothing.

Only data crosses: ``from_torch`` refuses a tensor that requires grad (``x.detach()`` is the same memory without
its history), and ``to_torch`` gives a tensor that takes no part in StrideWeave's autograd.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._core import Tensor, from_dlpack

if TYPE_CHECKING:  # the annotations only; nothing imports torch before a function runs
    import torch as _torch_module

__all__ = ["from_torch", "to_torch"]

# The dtypes that travel, by the names of both sides (torch's attribute name, StrideWeave's DType name).
_DTYPES = (("float32", "Float32"), ("bfloat16", "BFloat16"), ("float16", "Float16"), ("int32", "Int32"),
           ("bool", "Bool"))


def _torch() -> Any:
    """The torch module, imported on first use; without PyTorch, an ImportError that says what to install."""
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise ImportError("strideweave.torch needs PyTorch (pip install torch); the rest of strideweave does "
                          "not") from e


def to_torch(t: Tensor) -> "_torch_module.Tensor":
    """A ``torch.Tensor`` over ``t``'s memory, no copy: same data pointer, shape and strides.

    ``t`` must be a tensor over a ``CPU`` carrier whose layout a stride list describes (one leaf per mode, or
    modes whose leaves coalesce). The export holds the memory: the torch tensor stays valid after the carrier is
    released. Memory shared copy-on-write (a projection of a resident tile) is made private to the carrier first,
    so torch's writes reach that tensor alone.

    TypeError when ``t`` is not a strideweave Tensor; BufferError when its memory cannot be shared without a copy
    (another carrier kind, a layout without strides, an immutable tensor, which torch would be free to write).
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"to_torch: expected a strideweave Tensor, got {type(t).__name__}")
    torch = _torch()
    if not t.is_mutable():
        raise BufferError(f"to_torch: the {t.dtype().name} tensor of layout {t.layout} is immutable and PyTorch has no "
                          "read-only tensors, so its writes would change memory that must not change; "
                          "torch.from_dlpack(t.__dlpack__(max_version=(1, 0), copy=True)) gives torch a copy")
    try:
        return torch.from_dlpack(t)
    except BufferError as e:
        raise BufferError(f"to_torch: {e}") from e


def from_torch(x: "_torch_module.Tensor") -> Tensor:
    """A StrideWeave ``Tensor`` over ``x``'s memory, no copy: same data pointer, shape and strides.

    The tensor lives on a ``CPU`` carrier that borrows the memory and keeps ``x``'s storage alive. ``x`` must be
    a dense (strided) CPU tensor of a dtype that travels, with no zero extent, and must not require grad. Once
    PyTorch moves or frees the storage's memory (a ``resize_`` past its size), every use of the tensor raises
    RuntimeError; ``x.set_`` leaves it over the imported bytes (docs/guide.md, "PyTorch").

    TypeError when ``x`` is not a ``torch.Tensor`` or its dtype has no StrideWeave counterpart; ValueError when it
    requires grad; BufferError when its memory cannot be shared (another device, a sparse layout, an empty shape).
    """
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"from_torch: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in {getattr(torch, name) for name, _ in _DTYPES}:
        raise TypeError(f"from_torch: {x.dtype} has no StrideWeave dtype (shared: "
                        f"{', '.join('torch.' + name for name, _ in _DTYPES)}; "
                        "x.to(torch.float32) converts into a new tensor)")
    if x.device.type != "cpu":
        raise BufferError(f"from_torch: the tensor is on device {x.device}; StrideWeave shares CPU memory only "
                          "(x.cpu() copies it)")
    if x.layout != torch.strided:
        raise BufferError(f"from_torch: a {x.layout} tensor has no strides to share (x.to_dense() copies it)")
    if x.requires_grad:
        raise ValueError(f"from_torch: the tensor of shape {tuple(x.shape)} requires grad, and its autograd history "
                         "would not cross; x.detach() is the same memory without it")
    return from_dlpack(x)




def _sw() -> Any:
    """The strideweave package."""
    return importlib.import_module("strideweave")


def _torch_dtype(dtype: Any) -> Any:
    """torch's dtype for a StrideWeave DType that travels."""
    torch = _torch()
    for torch_name, sw_name in _DTYPES:
        if dtype.name == sw_name:
            return getattr(torch, torch_name)
    raise TypeError(f"{dtype.name} has no torch dtype")


def _sw_dtype(dtype: Any) -> Any:
    """StrideWeave's DType for a torch dtype that travels; None when it has none."""
    torch = _torch()
    sw = _sw()
    for torch_name, sw_name in _DTYPES:
        if dtype == getattr(torch, torch_name):
            return getattr(sw.DType, sw_name)
    return None


def _leaf_grads(leaves: tuple, inputs: tuple, needed: tuple) -> list:
    """torch gradients of a StrideWeave graph's leaves after its backward, for a torch.autograd.Function's
    backward: per leaf, ``to_torch(leaf.grad)`` (no copy) in its torch input's dtype (converted explicitly: torch
    requires it), zeros when StrideWeave left none, None when torch needs none. `inputs`: (shape, dtype) each."""
    torch = _torch()
    grads = []
    for leaf, (shape, dtype), need in zip(leaves, inputs, needed):
        g = leaf.grad if need else None
        if g is None:
            grads.append(torch.zeros(shape, dtype=dtype) if need else None)
        else:
            g = to_torch(g)
            grads.append(g if g.dtype == dtype else g.to(dtype))
    return grads
