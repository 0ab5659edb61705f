"""Safetensors checkpoints opened where they lie (docs/guide.md, "Opening a Hugging Face checkpoint").

``sw.safetensors.open(path)`` reads and validates the headers of one file, a list of files, or a folder (with
``model.safetensors.index.json`` for a sharded checkpoint) and returns a :class:`Checkpoint`; its tensors and tiled
tensors read the files' bytes where they lie, no copy. ``sw.safetensors.save`` writes a safetensors file. The
engine (header rules, the checkpoint tier, the tiled geometry, writing) is C++
(cpp/include/strideweave/checkpoint/safetensors.hpp); this module only turns paths into strings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Optional, Union

from . import _core
from ._core import Checkpoint, CheckpointCarrier, DType, Quantized, Tensor

__all__ = ["Checkpoint", "CheckpointCarrier", "Quantized", "dequantize", "open", "quantize", "save",
           "set_promotion_path"]

StrPath = Union[str, "os.PathLike[str]"]


def open(path_or_paths: Union[StrPath, Iterable[StrPath]], *,  # noqa: A001 (the contract's name)
         fp8_block: Optional[tuple] = None) -> Checkpoint:
    """Opens a safetensors checkpoint: a file, a folder, or a list of files.

    ``fp8_block``: the (rows, cols) block of its FP8 tensors' scales, as a model's ``quantization_config``
    (``weight_block_size``) states it; taken for each FP8 tensor whose scales' shape fits it, before the rule that
    infers the block from that shape (docs/guide.md, "Quantized checkpoints (FP8, MXFP4)").

    ValueError, naming the file (and the tensor), for a malformed header, index or folder; nothing stays open then.
    """
    if isinstance(path_or_paths, (str, os.PathLike)):
        paths = [os.fspath(path_or_paths)]
    else:
        paths = [os.fspath(p) for p in path_or_paths]
    if fp8_block is not None and (not isinstance(fp8_block, (tuple, list)) or len(fp8_block) != 2 or
                                  not all(isinstance(b, int) and not isinstance(b, bool) for b in fp8_block)):
        raise TypeError(f"safetensors.open: fp8_block must be (rows, cols), two ints, got {fp8_block!r}")
    ckpt = _core._safetensors_open(paths)
    if fp8_block is not None:
        ckpt._set_fp8_block(*fp8_block)
    return ckpt


def save(path: StrPath, tensors: Mapping[str, Tensor], metadata: Optional[Mapping[str, str]] = None, *,
         quantize: Optional[Mapping[str, object]] = None) -> None:
    """Writes ``tensors`` (name -> Tensor, in the dict's order) to a safetensors file at ``path``.

    Each tensor is written row-major over its top-level modes; tiled tensors are read tile range by tile range,
    never gathered whole. The file appears whole or not at all (written under a temporary name, then renamed).

    ``quantize``: name -> ``"fp8"`` (block-scaled F8_E4M3, 128 x 128 blocks, F32 scales under
    ``"<prefix>.weight_scale_inv"`` or ``name + "_scale_inv"``), ``("fp8", (rows, cols))`` (another block), or
    ``"mxfp4"`` (``name + "_blocks"`` and ``name + "_scales"``): that tensor (BFloat16 or Float32) is written
    quantized, matrix by matrix as it is read (docs/guide.md, "Quantized checkpoints").
    """
    _core._safetensors_save(os.fspath(path), tensors, metadata, quantize)


def _np():  # NumPy and ml_dtypes, imported when the array functions are used
    import ml_dtypes
    import numpy as np
    return np, ml_dtypes


_SCALE_KINDS = {"float32": "F32", "bfloat16": "BF16", "uint8": "E8M0", "float8_e8m0fnu": "E8M0"}


def dequantize(values: object, scales: object, format: str, *, dtype: DType = DType.BFloat16,
               block: tuple = (128, 128)) -> object:
    """The values of quantized bytes, by the kernels the checkpoint tiers promote with (bit for bit).

    ``format="fp8"``: ``values`` (R, C) uint8 (or ml_dtypes.float8_e4m3fn) and ``scales`` (ceil(R / br),
    ceil(C / bc)) float32, ml_dtypes.bfloat16 or uint8 (e8m0 exponents), ``block`` = (br, bc). ``format="mxfp4"``:
    ``values`` (..., G, 16) uint8 blocks and ``scales`` (..., G) uint8 e8m0 exponents (255 is NaN). Returns a
    float32 or ml_dtypes.bfloat16 array of shape (R, C) or (..., 32 G). ValueError for mismatched shapes.
    """
    np, ml = _np()
    if dtype not in (DType.BFloat16, DType.Float32):
        raise TypeError(f"dequantize: dtype must be DType.BFloat16 or DType.Float32, got {dtype!r}")
    v = np.ascontiguousarray(values)
    s = np.ascontiguousarray(scales)
    kind = _SCALE_KINDS.get(s.dtype.name)
    if v.dtype.itemsize != 1 or kind is None:
        raise TypeError(f"dequantize: values must be 1-byte elements and scales float32, bfloat16 or uint8, got "
                        f"{v.dtype} and {s.dtype}")
    if format == "fp8":
        if v.ndim != 2:
            raise ValueError(f"dequantize: fp8 values are a matrix (R, C), got shape {v.shape}")
        br, bc = block
        rows, cols = v.shape
        want = (-(-rows // br), -(-cols // bc))
        if s.shape != want:
            raise ValueError(f"dequantize: scales of shape {s.shape}; one per {br}x{bc} block of {v.shape} is {want}")
        shape = v.shape
    elif format == "mxfp4":
        if v.ndim < 2 or v.shape[-1] != 16 or s.shape != v.shape[:-1] or kind != "E8M0":
            raise ValueError(f"dequantize: mxfp4 blocks (..., G, 16) with uint8 scales (..., G); got {v.shape} "
                             f"{v.dtype} and {s.shape} {s.dtype}")
        shape = v.shape[:-2] + (v.shape[-2] * 32,)
        rows, cols, br, bc = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1], 1, 32
    else:
        raise ValueError(f"dequantize: format is \"fp8\" or \"mxfp4\", got {format!r}")
    bf16 = dtype == DType.BFloat16
    out = np.empty(shape, dtype=ml.bfloat16 if bf16 else np.float32)
    _core._quant_dequantize(format, v.view(np.uint8), s.view(np.uint8), kind, rows, cols, br, bc,
                            out.view(np.uint16 if bf16 else np.float32), bf16)
    return out


def quantize(values: object, format: str, *, block: tuple = (128, 128)) -> tuple:
    """Quantizes float32 or ml_dtypes.bfloat16 ``values`` as ``save(quantize=...)`` does (Note [Quantized element
    formats] in cpp/include/strideweave/checkpoint/quantized.hpp): ``"fp8"``: (R, C) -> (uint8 (R, C) e4m3 bytes,
    float32 scales (ceil(R / br), ceil(C / bc))); ``"mxfp4"``: (..., C), C a multiple of 32 -> (uint8 blocks
    (..., C / 32, 16), uint8 e8m0 scales (..., C / 32)); ValueError for a NaN (MXFP4 has none)."""
    np, ml = _np()
    v = np.ascontiguousarray(values)
    if v.dtype not in (np.float32, ml.bfloat16):
        raise TypeError(f"quantize: values must be float32 or bfloat16, got {v.dtype}")
    bf16 = v.dtype == ml.bfloat16
    if format == "fp8":
        if v.ndim != 2:
            raise ValueError(f"quantize: fp8 quantizes a matrix (R, C), got shape {v.shape}")
        br, bc = block
        rows, cols = v.shape
        q = np.empty(v.shape, dtype=np.uint8)
        s = np.empty((-(-rows // br), -(-cols // bc)), dtype=np.float32)
    elif format == "mxfp4":
        if v.ndim < 1 or v.shape[-1] % 32:
            raise ValueError(f"quantize: mxfp4 quantizes groups of 32 along the last axis, got shape {v.shape}")
        cols = v.shape[-1]
        rows, br, bc = v.size // max(cols, 1), 1, 32
        q = np.empty(v.shape[:-1] + (cols // 32, 16), dtype=np.uint8)
        s = np.empty(v.shape[:-1] + (cols // 32,), dtype=np.uint8)
    else:
        raise ValueError(f"quantize: format is \"fp8\" or \"mxfp4\", got {format!r}")
    if not _core._quant_quantize(format, v.view(np.uint16 if bf16 else np.float32), bf16, rows, cols, br, bc, q, s):
        raise ValueError("quantize: the values hold a NaN, which MXFP4 cannot hold (it has no NaN)")
    return q, s


def set_promotion_path(path: str) -> str:
    """How read-only checkpoint tiers promote tiles of 1 MiB and more, process-wide; returns the previous setting.

    ``"auto"`` (the default) chooses per promotion: a first promotion, or a range the page cache holds in 2 MiB
    folios, maps the file's pages; otherwise the path whose measured cost (CPU time per MiB, kept per tier) is
    lower: mapping, or reading into a buffer recycled through the mapping cache (Note [Promotion by the cheaper
    path] in cpp/src/carriers/checkpoint.cpp). ``"map"`` and ``"read"`` force one path (tests, benchmarks).
    ``CheckpointCarrier.promotion_stats()`` counts what each tier did and gives its estimates. ValueError for
    another string, TypeError for a value that is not a str.
    """
    return _core._set_promotion_path(path)


# SW_PROMOTION_PATH=auto|map|read in the environment sets the path at import (benchmarks compare the paths in
# fresh processes).
if os.environ.get("SW_PROMOTION_PATH"):
    set_promotion_path(os.environ["SW_PROMOTION_PATH"])
