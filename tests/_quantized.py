"""A NumPy reference for the element formats of quantized checkpoints, and writers of small quantized files.

Written from the formats' definitions (Note [Quantized element formats] in
cpp/include/strideweave/checkpoint/quantized.hpp; the OCP 8-bit floating point and microscaling specifications),
not from the engine's kernels:

* decoders: e4m3fn, e2m1 and e8m0 codes to Float64 by sign / exponent / mantissa arithmetic (every value of the
  three formats is exact in Float64);
* dequantizers: block-scaled FP8 and MXFP4, the product of two exact values formed in Float64 (exact: at most
  4 + 24 significant bits) and rounded once to Float32 by NumPy's Float64 -> Float32 conversion (IEEE round to
  nearest even, subnormals included), then, for BFloat16 output, rounded to nearest even by bit arithmetic with
  every NaN mapped to 0x7FC0;
* quantizers: the header's definitions (DeepSeek-V3's block FP8, OCP MXFP4), the rounding to the nearest code
  done against each format's table of values (ties to the even code, i.e. the even mantissa);
* a writer of safetensors files by hand (any element type string, any shape, so that hostile files can be
  written too), and the checkpoint forms the engine must read: per-expert FP8 with DeepSeek-V3's names, fused FP8
  (E, R, C) with (E, ceil(R/br), ceil(C/bc)) scales, GPT-OSS's MXFP4 ``X_blocks`` / ``X_scales``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence

import numpy as np

# ---------------------------------------------------------------- decoders (exact, Float64)


def e4m3_to_f64(codes) -> np.ndarray:
    """e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent field 0 is subnormal (m * 2^-9);
    0x7F and 0xFF (exponent 15, mantissa 7) are NaN; no infinities."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c >> 7 == 1, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    man = (c & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * np.exp2((exp - 7).astype(np.float64)))
    out = sign * mag
    return np.where((exp == 0xF) & (c & 0x7 == 0x7), np.nan, out)


def e2m1_to_f64(nibbles) -> np.ndarray:
    """e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent field 0 is subnormal (m * 0.5)."""
    n = np.asarray(nibbles).astype(np.int64) & 0xF
    sign = np.where(n >> 3 == 1, -1.0, 1.0)
    exp = (n >> 1) & 0x3
    man = (n & 0x1).astype(np.float64)
    mag = np.where(exp == 0, man * 0.5, (1.0 + man / 2.0) * np.exp2((exp - 1).astype(np.float64)))
    return sign * mag


def e8m0_to_f64(codes) -> np.ndarray:
    """e8m0: 2^(b - 127); b = 255 is NaN."""
    b = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    return np.where(b == 255, np.nan, np.exp2((b - 127).astype(np.float64)))


def bf16_bits_to_f64(bits) -> np.ndarray:
    """The exact value of BFloat16 bits (the high half of a Float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f32_to_bf16_bits(values) -> np.ndarray:
    """Float32 -> BFloat16 bits, round to nearest even (ties to an even last kept bit); every NaN -> 0x7FC0.

    The 16 dropped bits decide: above half the last kept bit rounds up, below rounds down, exactly half rounds to
    the even neighbour; a carry out of the mantissa raises the exponent (up to infinity), which is what rounding
    to nearest does at a binade's end. Subnormals round the same way (their exponent field is 0)."""
    f = np.asarray(values, dtype=np.float32)
    u = np.ascontiguousarray(f).reshape(f.shape).view(np.uint32).astype(np.uint64)
    keep = u >> 16
    dropped = u & 0xFFFF
    up = (dropped > 0x8000) | ((dropped == 0x8000) & ((keep & 1) == 1))
    out = (keep + up.astype(np.uint64)).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), out)


# ---------------------------------------------------------------- dequantizers


def scale_values(scales, scale_dtype: str) -> np.ndarray:
    """Stored scale bytes (as the file holds them) -> their exact values in Float64.

    scale_dtype: "F32" (float32 array), "BF16" (uint16 bits), "F8_E8M0" or "U8" (uint8 e8m0 codes)."""
    if scale_dtype == "F32":
        return np.asarray(scales, dtype=np.float32).astype(np.float64)
    if scale_dtype == "BF16":
        return bf16_bits_to_f64(scales)
    if scale_dtype in ("F8_E8M0", "U8"):
        return e8m0_to_f64(scales)
    raise ValueError(scale_dtype)


def expand_blocks(scales: np.ndarray, rows: int, cols: int, block) -> np.ndarray:
    """(..., ceil(R/br), ceil(C/bc)) -> (..., R, C): element (i, j) takes scale (i // br, j // bc)."""
    br, bc = block
    return np.repeat(np.repeat(scales, br, axis=-2), bc, axis=-1)[..., :rows, :cols]


def fp8_dequantize_f32(q, scales_f64, block=(128, 128)) -> np.ndarray:
    """value(i, j) = e4m3(q[i, j]) * scale(i // br, j // bc): the exact product (Float64) rounded once to Float32.

    q: uint8 (..., R, C); scales_f64: exact scale values (..., ceil(R/br), ceil(C/bc))."""
    q = np.asarray(q, dtype=np.uint8)
    rows, cols = q.shape[-2:]
    s = expand_blocks(np.asarray(scales_f64, dtype=np.float64), rows, cols, block)
    with np.errstate(all="ignore"):
        return (e4m3_to_f64(q) * s).astype(np.float32)


def mxfp4_dequantize_f32(blocks, scales) -> np.ndarray:
    """blocks uint8 (..., G, 16), scales uint8 e8m0 (..., G) -> Float32 (..., 32 G).

    Value 2j of a group is the low nibble of its byte j, value 2j + 1 the high nibble; each times 2^(b - 127),
    the exact product rounded once to Float32 (the largest codes overflow to infinity; 255 is NaN)."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == 16
    nib = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    nib[..., 0::2] = blocks & 0xF
    nib[..., 1::2] = blocks >> 4
    with np.errstate(all="ignore"):
        v = (e2m1_to_f64(nib) * e8m0_to_f64(scales)[..., None]).astype(np.float32)
    return v.reshape(blocks.shape[:-2] + (32 * blocks.shape[-2],))


# ---------------------------------------------------------------- quantizers (the header's definitions)

E4M3_TABLE = e4m3_to_f64(np.arange(0x7F, dtype=np.uint8))  # the 127 non-negative finite values, code = index
E2M1_TABLE = e2m1_to_f64(np.arange(8))  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def _nearest_code(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The index of the table value nearest each magnitude (>= 0, finite or +inf); ties go to the even index (the
    even mantissa); beyond the last value, the last (saturation)."""
    top = len(table) - 1
    hi = np.clip(np.searchsorted(table, mag, side="left"), 1, top)
    lo = hi - 1
    dlo = mag - table[lo]
    dhi = table[hi] - mag
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    return np.where(mag >= table[top], top, code)


def float_to_e4m3(values) -> np.ndarray:
    """The e4m3 byte nearest each Float32 value: round to nearest even, saturating at +-448; NaN -> 0x7F.
    The sign is kept (a negative value that rounds to zero is 0x80, -0)."""
    v = np.asarray(values, dtype=np.float32).astype(np.float64)
    nan = np.isnan(v)
    mag = np.where(nan, 0.0, np.abs(v))
    code = _nearest_code(mag, E4M3_TABLE).astype(np.uint8)
    code = code | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))
    return np.where(nan, np.uint8(0x7F), code).astype(np.uint8)


def quantize_fp8(x, block=(128, 128)):
    """DeepSeek-V3's block quantizer: per block, amax = max |x| over its finite values; scale = amax / 448 in
    Float32 (1 where amax is 0); q = e4m3(x / scale), the quotient a Float32 division. x: (R, C) Float32 values
    (a BFloat16 input is given as its exact Float32 values). Returns (uint8 (R, C), float32 (sr, sc))."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    br, bc = block
    sr, sc = -(-rows // br), -(-cols // bc)
    scales = np.empty((sr, sc), dtype=np.float32)
    q = np.empty((rows, cols), dtype=np.uint8)
    for bi in range(sr):
        for bj in range(sc):
            blk = x[bi * br:(bi + 1) * br, bj * bc:(bj + 1) * bc]
            finite = blk[np.isfinite(blk)]
            amax = np.float32(np.max(np.abs(finite))) if finite.size else np.float32(0)
            s = np.float32(1) if amax == 0 else np.float32(amax / np.float32(448))
            scales[bi, bj] = s
            with np.errstate(all="ignore"):
                q[bi * br:(bi + 1) * br, bj * bc:(bj + 1) * bc] = float_to_e4m3(blk / s)
    return q, scales


def float_to_e2m1(values) -> np.ndarray:
    """The e2m1 nibble nearest each (non-NaN) value: ties to the even mantissa, saturating at +-6, sign kept."""
    v = np.asarray(values, dtype=np.float64)
    assert not np.isnan(v).any()
    code = _nearest_code(np.abs(v), E2M1_TABLE)
    return (code | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def quantize_mxfp4(x):
    """OCP MXFP4: per group of 32 along the last axis, amax = max |x| over its finite values; e = floor(log2 amax)
    - 2 clamped to [-127, 127] (amax 0: -127); scale byte e + 127; each x / 2^e (exact in Float64) rounded to the
    nearest e2m1 value. x: (..., C) with C % 32 == 0 and no NaN. Returns (uint8 (..., C/32, 16), uint8 (..., C/32))."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    assert x.shape[-1] % 32 == 0 and not np.isnan(x).any()
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    mag = np.where(np.isfinite(g), np.abs(g), 0.0)
    amax = mag.max(axis=-1)
    _, k = np.frexp(amax)  # amax = m * 2^k, m in [0.5, 1): floor(log2 amax) = k - 1
    e = np.where(amax == 0, -127, np.clip(k - 1 - 2, -127, 127)).astype(np.int64)
    codes = float_to_e2m1(g / np.exp2(e.astype(np.float64))[..., None])
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


# ---------------------------------------------------------------- writing safetensors files by hand


def write_safetensors(path, entries: Mapping[str, tuple], metadata: Mapping[str, str] | None = None) -> None:
    """entries: name -> (dtype string as the format spells it, array whose raw bytes are the data[, shape]).

    The shape is the array's unless given (hostile files may lie); tensors are laid out in the given order."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name, entry in entries.items():
        dtype, array = entry[0], np.ascontiguousarray(entry[1])
        shape = list(entry[2]) if len(entry) > 2 else list(array.shape)
        data = array.tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for data in blobs:
            fh.write(data)


def encode_scales(values, scale_dtype: str) -> np.ndarray:
    """Scale values -> the array of the bytes a file stores for them (F32 float32, BF16 uint16 bits rounded to
    nearest even, F8_E8M0 / U8: the codes themselves, passed as integers)."""
    if scale_dtype == "F32":
        return np.asarray(values, dtype=np.float32)
    if scale_dtype == "BF16":
        return f32_to_bf16_bits(np.asarray(values, dtype=np.float32))
    if scale_dtype in ("F8_E8M0", "U8"):
        return np.asarray(values, dtype=np.uint8)
    raise ValueError(scale_dtype)


def expert_name(e: int, proj: str = "gate_proj", layer: int = 0) -> str:
    """DeepSeek-V3's per-expert FP8 weight name."""
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"


def fp8_per_expert_entries(q: Sequence[np.ndarray], scales: Sequence[np.ndarray], scale_dtype: str = "F32",
                           proj: str = "gate_proj", layer: int = 0) -> dict:
    """Per-expert FP8 as DeepSeek-V3 ships it: `<prefix>.weight` (F8_E4M3 (R, C)) and `<prefix>.weight_scale_inv`
    (ceil(R/128), ceil(C/128)). scales: the stored scale arrays (see encode_scales)."""
    out = {}
    for e, (qe, se) in enumerate(zip(q, scales)):
        name = expert_name(e, proj, layer)
        out[name] = ("F8_E4M3", np.asarray(qe, dtype=np.uint8))
        out[name + "_scale_inv"] = (scale_dtype, se)
    return out


def fp8_fused_entries(name: str, q: np.ndarray, scales: np.ndarray, scale_dtype: str = "F32") -> dict:
    """Fused FP8 experts: `name` F8_E4M3 (E, R, C) and `name_scale_inv` (E, ceil(R/br), ceil(C/bc))."""
    return {name: ("F8_E4M3", np.asarray(q, dtype=np.uint8)), name + "_scale_inv": (scale_dtype, scales)}


def mxfp4_entries(base: str, blocks: np.ndarray, scales: np.ndarray, scale_dtype: str = "U8") -> dict:
    """GPT-OSS's MXFP4 experts: `base_blocks` U8 (E, R, G, 16) and `base_scales` (E, R, G) (U8 or F8_E8M0)."""
    return {base + "_blocks": ("U8", np.asarray(blocks, dtype=np.uint8)),
            base + "_scales": (scale_dtype, np.asarray(scales, dtype=np.uint8))}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "json", "struct", "np")]
