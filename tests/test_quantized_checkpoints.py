"""Quantized checkpoints (FP8 block-scaled, MXFP4) at the format level, through the public API.

* Exactness over every code point: all 256 e4m3 bytes under Float32 / BFloat16 / e8m0 scales (normal, tiny,
  subnormal, huge, zero, negative; e8m0 codes 0, 1, 127, 254 and more), all 16 e2m1 nibbles under every e8m0
  code 0..254 (255, NaN, through sw.safetensors.dequantize), on tiles whose sizes are no multiple of the block
  (FP8 130 x 200 with 128 x 128 blocks; MXFP4 13 rows). Tiers (read whole, slot by slot, projected) and
  sw.safetensors.dequantize are compared bit for bit with the NumPy reference of tests/_quantized.py (written
  from the formats' definitions) and with transformers' own dequantizers. No tolerance: dequantizing is one
  exact product rounded once to Float32 (then once to BFloat16), so every implementation of the definition gives
  the same bits.
  SW_NO_AVX512=1 runs the same checks on the portable kernels in a child process.
* ckpt.dtype() of each form; bytes read per promotion (the quantized bytes and their scales); tiles promoted in
  chunks that begin inside a block; slot reads across rows and blocks; writes to the overlay in the compute dtype
  with the file unchanged.
* sw.safetensors.quantize / dequantize / save(quantize=): equal to the reference quantizers, round trips within
  the formats' bounds, files the `safetensors` package loads.
* Hostile files: ValueError naming the tensor and the file, nothing opened.
* A tile promoted in several chunks reads each of its scales once; a saved FP8 block the shape rule would not
  infer is recorded in the file's metadata and read back.

Run: ``.venv/bin/python -m pytest -q tests/test_quantized_checkpoints.py``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

import _quantized as ref
import strideweave as sw
from open_files import open_files

BASE_SEED = 3500

BF16 = sw.DType.BFloat16
F32 = sw.DType.Float32
OUT_DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(F32, id="f32")]

# ---------------------------------------------------------------- geometry and code points

R, C = 130, 200  # an FP8 tile: 2 x 2 blocks of 128 x 128, three of them partial
SR, SC = ref.ceil_div(R, 128), ref.ceil_div(C, 128)
E_FP8 = 8  # 32 blocks: 16 in the positions (0, 0) and (1, 0) that hold all 256 codes, one scale each
FUSED = "model.layers.0.mlp.experts.down_proj"

MX_R, MX_G = 13, 3  # an MXFP4 tile (13, 96): rows a multiple of nothing
E_MX = 7  # 273 groups >= 256 e8m0 codes
MX = "model.layers.0.mlp.experts.gate_up_proj"

F32_SCALES = np.array([1.0, 0.0123, -1.5, 0.0, 2.0**-130, 2.0**-149, 1e-30, 2.0**100, 3.0e38, 448.0, 1 / 448,
                       7.5e-5, 2.0**-126, 65504.0, 1.7, 2.0**127], dtype=np.float32)  # normal, subnormal, huge
E8M0_SCALES = np.array([0, 1, 127, 254, 2, 126, 128, 253, 100, 150, 10, 240, 64, 190, 30, 220], dtype=np.uint8)


def fp8_codes() -> np.ndarray:
    """(E, R, C) bytes: every 128-column stretch of rows 2k, 2k+1 holds all 256 codes (blocks (0, 0) and (1, 0)
    of each tile hold them all; the others hold many)."""
    e, i, j = np.ogrid[:E_FP8, :R, :C]
    return ((j + 128 * (i % 2) + 5 * (i // 2) + 17 * e) % 256).astype(np.uint8)


def scale_grid(values: np.ndarray) -> np.ndarray:
    """(E, 2, 2) stored scales: blocks (0, 0), (1, 0) of tile e take values[2e], values[2e + 1] (all 16 values
    meet every code); blocks (0, 1), (1, 1) reuse others."""
    n = len(values)
    out = np.empty((E_FP8, SR, SC), dtype=values.dtype)
    for e in range(E_FP8):
        out[e, 0, 0], out[e, 1, 0] = values[2 * e % n], values[(2 * e + 1) % n]
        out[e, 0, 1], out[e, 1, 1] = values[(2 * e + 5) % n], values[(2 * e + 11) % n]
    return out


def stored_scales(scale_dtype: str) -> np.ndarray:
    if scale_dtype == "F32":
        return scale_grid(F32_SCALES)
    if scale_dtype == "BF16":
        return scale_grid(ref.f32_to_bf16_bits(F32_SCALES))
    return scale_grid(E8M0_SCALES)


def mx_blocks() -> np.ndarray:
    """(E, R, G, 16): byte j of group k holds nibbles (j + k) % 16 (low) and (15 - j + 3k) % 16 (high): every
    group holds all 16 nibbles in both halves."""
    k = np.arange(E_MX * MX_R * MX_G).reshape(E_MX, MX_R, MX_G, 1)
    j = np.arange(16)
    return (((j + k) % 16) | (((15 - j + 3 * k) % 16) << 4)).astype(np.uint8)


def mx_scales(modulus: int) -> np.ndarray:
    """(E, R, G) e8m0 codes 0..modulus-1 in turn (255: every code the tier accepts; 256: with NaN's 255)."""
    return (np.arange(E_MX * MX_R * MX_G) % modulus).reshape(E_MX, MX_R, MX_G).astype(np.uint8)


# ---------------------------------------------------------------- comparisons


def sha256(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def want(f32: np.ndarray, dtype) -> np.ndarray:
    """The reference result's bits for an output dtype (BFloat16: rounded to nearest even, NaN 0x7FC0)."""
    return ref.f32_to_bf16_bits(f32) if dtype == BF16 else np.ascontiguousarray(f32, dtype=np.float32)


def got_bits(array: np.ndarray, dtype) -> np.ndarray:
    a = np.ascontiguousarray(array)
    if dtype == BF16:
        assert a.dtype == ml_dtypes.bfloat16, a.dtype
        return a.view(np.uint16)
    assert a.dtype == np.float32, a.dtype
    return a


def assert_bits(got: np.ndarray, expected: np.ndarray, dtype) -> None:
    """BFloat16: bit for bit, NaN included (the kernels make every NaN 0x7FC0). Float32: NaN at the same places
    (which quiet NaN a product gives is the hardware's), every other value bit for bit (the sign of a zero too)."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if dtype == BF16:
        bad = np.nonzero(got != expected)
        assert bad[0].size == 0, f"{bad[0].size} values differ, first at {tuple(b[0] for b in bad)}: " \
                                 f"{got[tuple(b[0] for b in bad)]:#06x} != {expected[tuple(b[0] for b in bad)]:#06x}"
        return
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    g, w = got.view(np.uint32)[~nan], expected.view(np.uint32)[~nan]
    bad = np.nonzero(g != w)[0]
    assert bad.size == 0, f"{bad.size} values differ, first {g[bad[0]].view(np.float32)!r} != {w[bad[0]].view(np.float32)!r}"


def assert_bf16_nan_as_nan(got: np.ndarray, torch_bits: np.ndarray) -> None:
    """Against torch's BFloat16: its vectorised float -> bfloat16 turns NaN into 0xFFFF and its scalar path into
    0x7FC0, so NaN positions are compared as NaN and every other value bit for bit."""
    g_nan = ref.bf16_bits_to_f64(got)
    t_nan = ref.bf16_bits_to_f64(torch_bits)
    np.testing.assert_array_equal(np.isnan(g_nan), np.isnan(t_nan))
    keep = ~np.isnan(t_nan)
    np.testing.assert_array_equal(got[keep], torch_bits[keep])


def assert_names(message: str, tensor: str, path) -> None:
    assert tensor in message, message
    assert str(path) in message or os.path.realpath(path) in message, message


def tiles_of(full, dtype) -> np.ndarray:
    """The tiled tensor read whole, as (tiles, *tile shape) bits."""
    return np.moveaxis(got_bits(np.asarray(full), dtype), -1, 0)


def project(full, experts, dtype) -> np.ndarray:
    sel = sw.TileSelection(((0,), (0,), tuple(experts)))  # every tiled tensor here is (rows, cols, tiles)
    return np.moveaxis(got_bits(np.asarray(full.carrier.project(full, sel).wait()), dtype), -1, 0)


# ---------------------------------------------------------------- transformers' dequantizers


TORCH_SCALE = {"F32": (np.float32, torch.float32), "BF16": (np.int16, torch.bfloat16),
               "F8_E8M0": (np.uint8, torch.float8_e8m0fnu)}


def transformers_fp8_f32(q: np.ndarray, stored: np.ndarray, scale_dtype: str, block) -> torch.Tensor:
    """transformers' FP8 dequantization of one (R, C) matrix in Float32 (the product before any cast), with the
    scales as torch loads them from the file (float32, bfloat16 or float8_e8m0fnu): Fp8Dequantize._dequantize_one
    where the block divides the shape, _dequantize_fp8_weight otherwise."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    tq = torch.from_numpy(np.ascontiguousarray(q)).view(torch.float8_e4m3fn)
    np_type, torch_type = TORCH_SCALE[scale_dtype]
    ts = torch.from_numpy(np.ascontiguousarray(stored).view(np_type)).view(torch_type)
    rows, cols = q.shape
    if rows % block[0] == 0 and cols % block[1] == 0:
        return Fp8Dequantize(None)._dequantize_one(tq, ts, output_dtype=torch.float32)
    return _dequantize_fp8_weight(tq, ts, list(block), torch.float32)


def transformers_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """transformers.integrations.mxfp4.convert_moe_packed_tensors of (E, R, G, 16) + (E, R, G): it returns
    (E, 32 G, R) (GPT-OSS's transposed experts); transposed back to (E, R, 32 G), as bits."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy()),
                                     dtype=torch.bfloat16 if dtype == BF16 else torch.float32)
    out = out.transpose(1, 2).contiguous()
    return out.view(torch.int16).numpy().view(np.uint16) if dtype == BF16 else out.numpy()


# ---------------------------------------------------------------- the checkpoints of the exactness tests


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per-expert and fused FP8 checkpoints for each scale element type, and MXFP4 ones (U8, F8_E8M0 scales)."""
    folder = tmp_path_factory.mktemp("quantized")
    q = fp8_codes()
    out = {}
    for sd in ("F32", "BF16", "F8_E8M0"):
        s = stored_scales(sd)
        path = folder / f"fp8_{sd}.safetensors"
        entries = ref.fp8_per_expert_entries(list(q), list(s), sd)
        entries.update(ref.fp8_fused_entries(FUSED, q, s, sd))
        ref.write_safetensors(path, entries, {"format": "pt"})
        out[sd] = path
    for sd in ("U8", "F8_E8M0"):
        path = folder / f"mxfp4_{sd}.safetensors"
        ref.write_safetensors(path, ref.mxfp4_entries(MX, mx_blocks(), mx_scales(255), sd))
        out["mx_" + sd] = path
    return out


def fp8_reference(scale_dtype: str) -> np.ndarray:
    """(E, R, C) Float32 reference values of the FP8 experts of `files` with `scale_dtype` scales."""
    s = ref.scale_values(stored_scales(scale_dtype), scale_dtype)
    return ref.fp8_dequantize_f32(fp8_codes(), s)


def test_the_codes_meet_every_scale():
    """Every scale value of each list multiplies all 256 e4m3 codes somewhere (so the exactness tests below are
    over every code point), and the MXFP4 tiles hold every nibble under every e8m0 code."""
    q = fp8_codes()
    for values in (F32_SCALES, E8M0_SCALES):
        grid = ref.expand_blocks(scale_grid(np.arange(len(values))), R, C, (128, 128))
        for k in range(len(values)):
            assert np.unique(q[grid == k]).size == 256, k
    nib = np.concatenate([mx_blocks() & 0xF, mx_blocks() >> 4], axis=-1)
    codes = mx_scales(256)
    for code in range(256):
        assert np.unique(nib[codes == code]).size == 16, code


def test_the_reference_decoders_agree_with_ml_dtypes_on_every_code():
    """The reference's own check: its decoders and roundings against ml_dtypes' (independent) conversions."""
    c = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(ref.e4m3_to_f64(c), c.view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    np.testing.assert_array_equal(ref.e8m0_to_f64(c), c.view(ml_dtypes.float8_e8m0fnu).astype(np.float64))
    n = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(ref.e2m1_to_f64(n), n.view(ml_dtypes.float4_e2m1fn).astype(np.float64))
    assert np.signbit(ref.e2m1_to_f64(8)) and np.signbit(ref.e4m3_to_f64(0x80))
    rng = np.random.default_rng(BASE_SEED)
    print(f"seed={BASE_SEED}")
    u = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    u = u[~np.isnan(u)]
    np.testing.assert_array_equal(ref.f32_to_bf16_bits(u), u.astype(ml_dtypes.bfloat16).view(np.uint16))
    x = (rng.standard_normal(50_000) * 300).astype(np.float32)
    np.testing.assert_array_equal(ref.float_to_e4m3(x), np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    x = (rng.standard_normal(50_000) * 3).astype(np.float32)
    np.testing.assert_array_equal(ref.float_to_e2m1(x), np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F8_E8M0"])
def test_the_reference_fp8_dequantizer_is_transformers(scale_dtype):
    """The reference against transformers on the same bytes: Float32 bit for bit (NaN as NaN), and its BFloat16
    cast (NaN as NaN); both the non-dividing 130 x 200 and a dividing 256 x 384 shape."""
    expected = fp8_reference(scale_dtype)
    stored = stored_scales(scale_dtype)
    for e in range(E_FP8):
        t = transformers_fp8_f32(fp8_codes()[e], stored[e], scale_dtype, (128, 128))
        assert_bits(t.numpy(), expected[e], F32)
        assert_bf16_nan_as_nan(ref.f32_to_bf16_bits(expected[e]), t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    big = np.tile(fp8_codes()[0], (2, 2))[:256, :384]
    s2 = F32_SCALES[:6].reshape(2, 3)
    assert_bits(transformers_fp8_f32(big, s2, "F32", (128, 128)).numpy(), ref.fp8_dequantize_f32(big, s2.astype(np.float64)), F32)


# ---------------------------------------------------------------- exactness through the tiers


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("form", ["per_expert", "fused"])
@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F8_E8M0"])
def test_fp8_tier_is_bit_identical_over_every_code_and_scale(files, scale_dtype, form, dtype):
    path = files[scale_dtype]
    ckpt = sw.safetensors.open(path)
    names = [ref.expert_name(e) for e in range(E_FP8)]
    full = ckpt.tiled(names if form == "per_expert" else FUSED, dtype=dtype)
    assert full.layout.shape == sw.Shape(R, C, E_FP8)
    expected = want(fp8_reference(scale_dtype), dtype)
    picked = [5, 0, 7]
    assert_bits(project(full, picked, dtype), expected[picked], dtype)  # promoted by the projection
    assert_bits(tiles_of(full, dtype), expected, dtype)  # read whole: the rest read through the tier
    full.carrier.promote(sw.TileSelection(((0,), (0,), tuple(range(E_FP8)))))
    assert_bits(tiles_of(full, dtype), expected, dtype)  # every tile promoted
    # and transformers' own dequantization of the same bytes (NaN compared as NaN for BFloat16, see above)
    stored = stored_scales(scale_dtype)
    for e in picked:
        t = transformers_fp8_f32(fp8_codes()[e], stored[e], scale_dtype, (128, 128))
        if dtype == F32:
            assert_bits(tiles_of(full, dtype)[e], t.numpy(), F32)
        else:
            assert_bf16_nan_as_nan(tiles_of(full, dtype)[e], t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    full.carrier.release()


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("name", [MX, MX + "_blocks"], ids=["logical", "blocks"])
@pytest.mark.parametrize("scale_dtype", ["U8", "F8_E8M0"])
def test_mxfp4_tier_is_bit_identical_over_every_nibble_and_scale_code(files, scale_dtype, name, dtype):
    ckpt = sw.safetensors.open(files["mx_" + scale_dtype])
    full = ckpt.tiled(name, dtype=dtype)
    assert full.layout.shape == sw.Shape(MX_R, 32 * MX_G, E_MX)
    expected = want(ref.mxfp4_dequantize_f32(mx_blocks(), mx_scales(255)), dtype)
    picked = [6, 1]
    assert_bits(project(full, picked, dtype), expected[picked], dtype)
    assert_bits(tiles_of(full, dtype), expected, dtype)
    full.carrier.promote(sw.TileSelection(((0,), (0,), tuple(range(E_MX)))))
    assert_bits(tiles_of(full, dtype), expected, dtype)
    t = transformers_mxfp4(mx_blocks(), mx_scales(255), dtype)  # codes 0..254: transformers agrees bit for bit
    assert_bits(tiles_of(full, dtype), t, dtype)
    full.carrier.release()


# ---------------------------------------------------------------- exactness through sw.safetensors.dequantize


def scale_array(scale_dtype: str, stored: np.ndarray) -> np.ndarray:
    """What sw.safetensors.dequantize takes for each stored scale form."""
    if scale_dtype == "F32":
        return stored.astype(np.float32)
    if scale_dtype == "BF16":
        return stored.view(ml_dtypes.bfloat16)
    return stored.astype(np.uint8)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F8_E8M0"])
def test_fp8_dequantize_is_bit_identical_to_the_reference_and_transformers(scale_dtype, dtype):
    q = fp8_codes()
    stored = stored_scales(scale_dtype)
    expected = fp8_reference(scale_dtype)
    for e in range(E_FP8):
        out = sw.safetensors.dequantize(q[e], scale_array(scale_dtype, stored[e]), "fp8", dtype=dtype)
        assert out.shape == (R, C)
        assert_bits(got_bits(out, dtype), want(expected[e], dtype), dtype)
        t = transformers_fp8_f32(q[e], stored[e], scale_dtype, (128, 128))
        if dtype == F32:
            assert_bits(out, t.numpy(), F32)
        else:
            assert_bf16_nan_as_nan(got_bits(out, dtype), t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    # ml_dtypes' float8_e4m3fn values are taken as their bytes
    out = sw.safetensors.dequantize(q[1].view(ml_dtypes.float8_e4m3fn), scale_array(scale_dtype, stored[1]), "fp8", dtype=dtype)
    assert_bits(got_bits(out, dtype), want(expected[1], dtype), dtype)
    # a block that divides the shape: transformers' _dequantize_one
    big = np.tile(q[0], (2, 2))[:256, :384]
    s2 = F32_SCALES[3:9].reshape(2, 3)
    out = sw.safetensors.dequantize(big, s2, "fp8", dtype=dtype, block=(128, 128))
    t = transformers_fp8_f32(big, s2, "F32", (128, 128))
    assert_bits(got_bits(out, dtype), want(t.numpy(), dtype), dtype)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_mxfp4_dequantize_over_every_scale_code_and_255_is_nan(dtype):
    blocks, scales = mx_blocks(), mx_scales(256)
    out = sw.safetensors.dequantize(blocks, scales, "mxfp4", dtype=dtype)
    assert out.shape == (E_MX, MX_R, 32 * MX_G)
    bits = got_bits(out, dtype)
    expected = want(ref.mxfp4_dequantize_f32(blocks, scales), dtype)
    assert_bits(bits, expected, dtype)
    nan_groups = np.repeat(scales == 255, 32, axis=-1)
    assert nan_groups.sum() >= 32
    as_f64 = ref.bf16_bits_to_f64(bits) if dtype == BF16 else bits.astype(np.float64)
    assert np.isnan(as_f64[nan_groups]).all() and not np.isnan(as_f64[~nan_groups]).any()
    # transformers on the codes it handles (0..254; its ldexp turns 255 into infinities, not NaN)
    ok = mx_scales(255)
    assert_bits(got_bits(sw.safetensors.dequantize(blocks, ok, "mxfp4", dtype=dtype), dtype),
                transformers_mxfp4(blocks, ok, dtype), dtype)


def test_the_portable_kernels_give_the_same_bits():
    """The exactness tests above again in a process where SW_NO_AVX512=1 forces the portable kernels (this process
    runs the AVX-512 ones where the CPU has them): the same bits, every code point, tiers and functions."""
    print(f"this process: AVX-512 kernels {sw._core._quant_uses_avx512()}")
    env = dict(os.environ, SW_NO_AVX512="1")
    # The child processes run the portable kernels: checked first, in a process of their environment.
    probe = subprocess.run([sys.executable, "-c", "import strideweave as sw; print(sw._core._quant_uses_avx512())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "False", probe.stdout + probe.stderr
    select = "bit_identical or mxfp4_dequantize_over"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", select],
                         env=env, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(__file__))
    print(run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0
    assert " passed" in run.stdout and "skipped" not in run.stdout and "deselected" in run.stdout


# ---------------------------------------------------------------- ckpt.dtype


def test_dtype_reports_each_quantized_form_and_plain_tensors_are_unchanged(tmp_path):
    path = tmp_path / "m.safetensors"
    q = fp8_codes()
    entries = ref.fp8_per_expert_entries([q[0], q[1]], [stored_scales("F32")[0], stored_scales("F32")[1]], "F32")
    entries.update(ref.fp8_fused_entries(FUSED, q[:3], stored_scales("BF16")[:3], "BF16"))
    entries["model.layers.0.mlp.experts.up_proj"] = ("F8_E4M3", q[:2])
    entries["model.layers.0.mlp.experts.up_proj_scale"] = ("F8_E8M0", stored_scales("F8_E8M0")[:2])
    entries.update(ref.mxfp4_entries(MX, mx_blocks(), mx_scales(255), "U8"))
    entries.update(ref.mxfp4_entries("model.layers.0.mlp.experts.down_proj_mx", mx_blocks()[:2], mx_scales(255)[:2], "F8_E8M0"))
    entries["model.norm.weight"] = ("F32", np.ones(7, np.float32))
    entries["model.embed.weight"] = ("BF16", np.ones((3, 4), np.uint16))
    ref.write_safetensors(path, entries)
    ckpt = sw.safetensors.open(path)
    Q = sw.safetensors.Quantized

    w0 = ref.expert_name(0)
    d = ckpt.dtype(w0)
    assert isinstance(d, Q)
    assert (d.format, d.element, d.block, d.scale, d.scale_dtype, d.shape) == \
        ("fp8", "F8_E4M3", (128, 128), w0 + "_scale_inv", "F32", (R, C))
    assert str(d) == f"F8_E4M3 with F32 scales per 128x128 block ({w0}_scale_inv)"
    assert d == ckpt.dtype(w0) and d != ckpt.dtype(ref.expert_name(1))

    d = ckpt.dtype(FUSED)
    assert (d.format, d.element, d.block, d.scale, d.scale_dtype, d.shape) == \
        ("fp8", "F8_E4M3", (128, 128), FUSED + "_scale_inv", "BF16", (3, R, C))
    assert str(d) == f"F8_E4M3 with BF16 scales per 128x128 block ({FUSED}_scale_inv)"

    d = ckpt.dtype("model.layers.0.mlp.experts.up_proj")  # "_scale" when there is no "_scale_inv"
    assert (d.format, d.scale, d.scale_dtype, d.shape) == \
        ("fp8", "model.layers.0.mlp.experts.up_proj_scale", "F8_E8M0", (2, R, C))

    for name in (MX, MX + "_blocks"):
        d = ckpt.dtype(name)
        assert (d.format, d.element, d.block, d.scale, d.scale_dtype, d.shape) == \
            ("mxfp4", "E2M1", (1, 32), MX + "_scales", "U8", (E_MX, MX_R, 32 * MX_G))
        assert "E2M1" in str(d) and "U8" in str(d) and MX + "_scales" in str(d)
    assert ckpt.dtype(MX) == ckpt.dtype(MX + "_blocks")
    d = ckpt.dtype("model.layers.0.mlp.experts.down_proj_mx")
    assert (d.format, d.scale_dtype, d.shape) == ("mxfp4", "F8_E8M0", (2, MX_R, 32 * MX_G))
    assert MX not in ckpt.keys() and MX + "_blocks" in ckpt.keys()  # the logical name is no key

    assert ckpt.dtype("model.norm.weight") is sw.DType.Float32
    assert ckpt.dtype("model.embed.weight") is sw.DType.BFloat16
    assert ckpt.shape(w0) == (R, C)  # the stored shape, as before


def test_the_block_follows_the_scale_shape_and_scales_and_block_can_be_named(tmp_path):
    """A scale grid that is not (ceil(R/128), ceil(C/128)) but divides the shape gives block (R/sr, C/sc)
    (transformers' rule); scales= and block= name what the naming rule would not find."""
    rng = np.random.default_rng(BASE_SEED + 1)
    print(f"seed={BASE_SEED + 1}")
    q = rng.integers(0, 256, (96, 64), dtype=np.uint8)
    s = rng.uniform(0.5, 2.0, (3, 2)).astype(np.float32)
    q2 = fp8_codes()[2]
    s2 = rng.uniform(0.01, 3.0, (ref.ceil_div(R, 64), ref.ceil_div(C, 64))).astype(np.float32)
    path = tmp_path / "m.safetensors"
    ref.write_safetensors(path, {"a.weight": ("F8_E4M3", q), "a.weight_scale_inv": ("F32", s),
                                 "b.weight": ("F8_E4M3", q2), "b.my_scales": ("F32", s2)})
    ckpt = sw.safetensors.open(path)
    assert ckpt.dtype("a.weight").block == (32, 32)
    full = ckpt.tiled(["a.weight"], dtype=F32)
    assert_bits(tiles_of(full, F32)[0], ref.fp8_dequantize_f32(q, s.astype(np.float64), (32, 32)), F32)
    full = ckpt.tiled(["b.weight"], dtype=BF16, scales=["b.my_scales"], block=(64, 64))
    assert_bits(tiles_of(full, BF16)[0], want(ref.fp8_dequantize_f32(q2, s2.astype(np.float64), (64, 64)), BF16), BF16)


# ---------------------------------------------------------------- bytes read per promotion


@pytest.mark.parametrize("form", ["fp8_per_expert", "fp8_fused", "mxfp4"])
def test_promoting_one_tile_reads_its_quantized_bytes_and_scales(tmp_path, form):
    rng = np.random.default_rng(BASE_SEED + 2)
    print(f"seed={BASE_SEED + 2}")
    path = tmp_path / "m.safetensors"
    E = 3
    if form.startswith("fp8"):
        rows, cols = 256, 384
        q = rng.integers(0, 0x7F, (E, rows, cols), dtype=np.uint8)  # finite codes
        s = rng.uniform(0.5, 2.0, (E, 2, 3)).astype(np.float32)
        entries = ref.fp8_per_expert_entries(list(q), list(s)) if form == "fp8_per_expert" else ref.fp8_fused_entries(FUSED, q, s)
        name = [ref.expert_name(e) for e in range(E)] if form == "fp8_per_expert" else FUSED
        tile = rows * cols + 4 * 2 * 3  # the e4m3 bytes and the tile's 2 x 3 Float32 scales
        expected = ref.fp8_dequantize_f32(q, s.astype(np.float64))
    else:
        rows, groups = 64, 8
        cols = 32 * groups
        blocks = rng.integers(0, 256, (E, rows, groups, 16), dtype=np.uint8)
        scales = rng.integers(100, 150, (E, rows, groups), dtype=np.uint8)
        entries, name = ref.mxfp4_entries(MX, blocks, scales), MX
        tile = rows * groups * 16 + rows * groups  # the nibbles and one e8m0 byte per 32 values
        expected = ref.mxfp4_dequantize_f32(blocks, scales)
    ref.write_safetensors(path, entries)
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(name, dtype=BF16)
    before = ckpt.bytes_read
    full.carrier.promote(sw.TileSelection(((0,), (0,), (1,))))
    assert ckpt.bytes_read - before == tile
    bf16_tile = 2 * rows * cols
    ratio = tile / bf16_tile
    print(f"{form}: {tile} bytes read per promotion, {ratio:.4f}x the BFloat16 tile's {bf16_tile}")
    assert ratio == pytest.approx(0.5, abs=1e-3) if form.startswith("fp8") else ratio == pytest.approx(17 / 64)
    before = ckpt.bytes_read
    assert_bits(project(full, [1], BF16)[0], want(expected[1], BF16), BF16)
    assert ckpt.bytes_read == before  # resident: nothing read again
    full.carrier.promote(sw.TileSelection(((0,), (0,), (0, 2))))
    assert ckpt.bytes_read - before == 2 * tile
    full.carrier.release()


def big_fp8(tmp_path):
    """A fused FP8 checkpoint of two (1100, 2000) experts (2.2 MB each): a promotion reads it in chunks of about
    1 MiB of whole rows (Note [A quantized checkpoint tier] in cpp/include/strideweave/carriers/checkpoint.hpp),
    524 rows here, so chunks begin inside the 128-row blocks 4 and 8; random bytes (NaN codes included)."""
    seed = BASE_SEED + 6
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    q = rng.integers(0, 256, (2, 1100, 2000), dtype=np.uint8)
    s = rng.uniform(1e-3, 10.0, (2, 9, 16)).astype(np.float32)
    path = tmp_path / "big.safetensors"
    ref.write_safetensors(path, ref.fp8_fused_entries(FUSED, q, s))
    return path, q, s


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_a_tile_promoted_in_chunks_that_begin_inside_blocks_is_bit_identical(tmp_path, dtype):
    path, q, s = big_fp8(tmp_path)
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(FUSED, dtype=dtype)
    full.carrier.promote(sw.TileSelection(((0,), (0,), (1,))))
    assert_bits(project(full, [1], dtype)[0], want(ref.fp8_dequantize_f32(q[1], s[1].astype(np.float64)), dtype), dtype)
    full.carrier.release()


def test_a_tile_promoted_in_chunks_reads_each_of_its_scales_once(tmp_path):
    """A 1100 x 2000 FP8 tile is promoted in chunks of about 1 MiB; chunks are whole block rows, so each scale is
    read once: the bytes read are exactly the tile's values and scales."""
    path, q, s = big_fp8(tmp_path)
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(FUSED, dtype=BF16)
    before = ckpt.bytes_read
    full.carrier.promote(sw.TileSelection(((0,), (0,), (1,))))
    assert ckpt.bytes_read - before == q[1].nbytes + s[1].nbytes  # the contract: exactly the tile's bytes and scales
    full.carrier.release()


# ---------------------------------------------------------------- partial reads and writes


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_slot_reads_across_rows_and_block_boundaries_read_through_the_tier(files, dtype):
    """Reading slots of a tile in the checkpoint tier (rows 125..129 x columns 124..131: the last rows, across the
    128-row and 128-column block edges) gives the reference values and leaves the tile where it was."""
    ckpt = sw.safetensors.open(files["F32"])
    full = ckpt.tiled(FUSED, dtype=dtype)
    expected = fp8_reference("F32")
    e = 3
    got = np.array([[full[(i, j, e)] for j in range(124, 132)] for i in range(125, 130)], dtype=np.float64)
    w = expected[e, 125:130, 124:132]
    if dtype == BF16:
        w = ref.bf16_bits_to_f64(ref.f32_to_bf16_bits(w))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(w))
    keep = ~np.isnan(w)
    np.testing.assert_array_equal(got[keep], w[keep])
    np.testing.assert_array_equal(np.signbit(got[keep]), np.signbit(w[keep]))
    assert full.carrier.tile_state((0, 0, e)).location == "secondary"
    mx = sw.safetensors.open(files["mx_U8"]).tiled(MX, dtype=dtype)
    mexp = ref.mxfp4_dequantize_f32(mx_blocks(), mx_scales(255))
    got = np.array([[mx[(i, j, 4)] for j in range(28, 70)] for i in range(10, 13)], dtype=np.float64)
    w = mexp[4, 10:13, 28:70].astype(np.float64)  # exact in BFloat16 unless infinite
    np.testing.assert_array_equal(got, w)
    assert mx.carrier.tile_state((0, 0, 4)).location == "secondary"


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_writes_go_to_the_overlay_in_the_compute_dtype_and_the_file_never_changes(files, dtype):
    path = files["F32"]
    before = sha256(path)
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(FUSED, dtype=dtype)
    carrier = full.carrier
    tile_bytes = R * C * (2 if dtype == BF16 else 4)
    carrier.set_residency_budget(sw.ResidencyBudget(tile_bytes))  # one tile resident at a time
    # A value BFloat16 cannot hold stays whole in a Float32 overlay; in BFloat16 it is stored rounded.
    fine = 1.0 + 2.0**-20
    written = {(129, 199): -3.0, (0, 0): 2.5, (127, 128): fine}
    for (i, j), v in written.items():
        full[(i, j, 2)] = v
    assert carrier.tile_state((0, 0, 2)).dirty
    carrier.promote(sw.TileSelection(((0,), (0,), (5,))))  # evicts the dirty tile under the budget
    state = carrier.tile_state((0, 0, 2))
    assert state.location == "secondary" and not state.dirty
    assert carrier.secondary.overlaid_ranges == 1
    assert sha256(path) == before

    f32 = fp8_reference("F32")[2].copy()
    for (i, j), v in written.items():
        f32[i, j] = v
    expected = want(f32, dtype)
    if dtype == F32:
        assert f32[127, 128] == np.float32(fine)
    assert_bits(project(full, [2], dtype)[0], expected, dtype)  # promoted again: from the overlay
    assert_bits(tiles_of(full, dtype)[2], expected, dtype)
    assert_bits(tiles_of(full, dtype)[5], want(fp8_reference("F32")[5], dtype), dtype)  # the others: the file's
    assert sha256(path) == before
    again = sw.safetensors.open(path).tiled(FUSED, dtype=dtype)  # a fresh reader: the file's values
    assert_bits(tiles_of(again, dtype)[2], want(fp8_reference("F32")[2], dtype), dtype)
    carrier.release()


# ---------------------------------------------------------------- wrong requests


def test_mutable_quantized_tiers_are_refused_and_nothing_is_written(files):
    path = files["F32"]
    before = sha256(path)
    ckpt = sw.safetensors.open(path)
    for name in (FUSED, [ref.expert_name(0), ref.expert_name(1)]):
        with pytest.raises(ValueError) as info:
            ckpt.tiled(name, dtype=BF16, mutable=True)
        print(info.value)
        assert "mutable" in str(info.value)
    assert sha256(path) == before
    assert_bits(tiles_of(ckpt.tiled(FUSED, dtype=BF16), BF16), want(fp8_reference("F32"), BF16), BF16)


def test_quantized_tiles_need_a_dtype_and_plain_ones_take_only_their_own(files, tmp_path):
    fp8 = sw.safetensors.open(files["F32"])
    for name, fragment in ((FUSED, ("fp8", "f8_e4m3")), ([ref.expert_name(0)], ("fp8", "f8_e4m3"))):
        with pytest.raises(TypeError) as info:
            fp8.tiled(name)
        print(info.value)
        msg = str(info.value).lower()
        assert "dtype" in msg and any(f in msg for f in fragment)
    mx = sw.safetensors.open(files["mx_U8"])
    with pytest.raises(TypeError) as info:
        mx.tiled(MX)
    print(info.value)
    assert "dtype" in str(info.value) and "mxfp4" in str(info.value).lower()

    path = tmp_path / "plain.safetensors"
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ref.write_safetensors(path, {"plain.experts": ("F32", a)})
    plain = sw.safetensors.open(path)
    with pytest.raises(TypeError) as info:
        plain.tiled("plain.experts", dtype=BF16)  # nothing converts implicitly
    print(info.value)
    assert "plain.experts" in str(info.value) and "dtype" in str(info.value).lower()
    full = plain.tiled("plain.experts", dtype=F32)  # its own dtype: as before
    np.testing.assert_array_equal(np.moveaxis(np.asarray(full), -1, 0), a)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(plain.tiled("plain.experts")), -1, 0), a)


# ---------------------------------------------------------------- quantize / dequantize / save(quantize=)


def special_values(rng, shape) -> np.ndarray:
    """Normal values of several magnitudes per block, with zeros, a whole-zero block, +-inf and extreme values."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    x[:64, :64] = 0.0  # a block of zeros: scale 1
    x[5, 70] = np.inf
    x[6, 71] = -np.inf
    x[129, 199] = 3.0e38
    x[100, 3] = -0.0
    x[101, 4] = 1e-40  # a Float32 subnormal
    # Rows 64, 65 x columns 128..159 lie in one block for both block shapes tested, with amax 448 (scale 1): the
    # e4m3 ties there (normal, subnormal, beyond 448) round to the even code.
    x[:128, 128:200] = np.clip(x[:128, 128:200], -400, 400)
    ties = [448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 464.0, -464.0, 232.0, 0.0146484375]
    x[64, 128:128 + len(ties)] = ties
    x[65, 128:160] = np.linspace(-448, 448, 32)
    return x


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
@pytest.mark.parametrize("in_dtype", ["f32", "bf16"])
def test_quantize_fp8_is_the_reference_and_round_trips_within_the_format_bound(block, in_dtype):
    seed = BASE_SEED + 3
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    x = special_values(rng, (R, C))
    x[7, 150] = np.nan
    if in_dtype == "bf16":
        x = ref.bf16_bits_to_f64(ref.f32_to_bf16_bits(x)).astype(np.float32)
        arg = x.astype(ml_dtypes.bfloat16)
    else:
        arg = x
    q, s = sw.safetensors.quantize(arg, "fp8", block=block)
    wq, ws = ref.quantize_fp8(x, block)
    assert q.dtype == np.uint8 and q.shape == (R, C)
    assert s.dtype == np.float32 and s.shape == (ref.ceil_div(R, block[0]), ref.ceil_div(C, block[1]))
    assert_bits(s, ws, F32)
    np.testing.assert_array_equal(q, wq)
    assert q[7, 150] == 0x7F and q[5, 70] == 0x7E and q[6, 71] == 0xFE  # NaN -> 0x7F, +-inf saturate at +-448
    back = sw.safetensors.dequantize(q, s, "fp8", dtype=F32, block=block).astype(np.float64)
    # Bound: x / s is rounded to Float32 (relative 2^-24), then to e4m3: 3 mantissa bits, half a unit in the last
    # place is 2^-4 relative for normals, 2^-10 absolute in the subnormal range (spacing 2^-9); |x / s| <= 448
    # (amax / s = 448 up to the Float32 rounding of s), so nothing saturates. Times s, rounded to Float32
    # (2^-24): |back - x| <= (2^-4 + 2^-22) |x| + 2^-10 s (1 + 2^-22).
    sx = ref.expand_blocks(s.astype(np.float64), R, C, block)
    finite = np.isfinite(x)
    err = np.abs(back[finite] - x[finite].astype(np.float64))
    bound = (2.0**-4 + 2.0**-22) * np.abs(x[finite].astype(np.float64)) + 2.0**-10 * sx[finite] * (1 + 2.0**-22)
    assert (err <= bound).all(), np.max(err - bound)


def test_quantize_mxfp4_is_the_reference_and_round_trips_within_the_format_bound():
    seed = BASE_SEED + 4
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    x = (rng.standard_normal((5, 7, 128)) * np.exp2(rng.integers(-30, 30, (5, 7, 4)).repeat(32, axis=-1))).astype(np.float32)
    x[0, 0, :32] = 0.0
    x[0, 1, 5] = np.inf
    x[0, 2, 64:96] = 1e-44
    x[1, 1, 40] = -3.0e38
    # a group with amax 6 (scale 2^0): every e2m1 tie, and values beyond 6 would saturate (none: amax sets e)
    x[3, 3, 32:64] = np.resize([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                                -5.0, 0.1], 32)
    # a group with amax 7.5 (scale 2^0 again): 7.5 and 6.5 saturate to 6
    x[3, 4, 0:32] = np.resize([7.5, 6.5, -7.0, 0.75, 5.0, 2.5], 32)
    blocks, scales = sw.safetensors.quantize(x, "mxfp4")
    wb, ws = ref.quantize_mxfp4(x)
    assert blocks.dtype == np.uint8 and blocks.shape == (5, 7, 4, 16)
    assert scales.dtype == np.uint8 and scales.shape == (5, 7, 4)
    np.testing.assert_array_equal(scales, ws)
    np.testing.assert_array_equal(blocks, wb)
    assert scales[0, 0, 0] == 0  # amax 0: e = -127
    back = sw.safetensors.dequantize(blocks, scales, "mxfp4", dtype=F32).astype(np.float64)
    # Bound: with 2^e the group's scale (2^e <= amax / 4), each |x| / 2^e rounds to e2m1 with an error of at most
    # a quarter of 2^e below 1 (spacing 0.5) and a quarter of |x| above (a 1-bit mantissa: spacing half the binade,
    # and saturation from (6, 8) 2^e to 6 2^e loses less than |x| / 4): |back - x| <= 2^-2 max(|x|, 2^e), exact in
    # Float32.
    finite = np.isfinite(x)
    s = np.repeat(ref.e8m0_to_f64(scales), 32, axis=-1)
    xf = x.astype(np.float64)
    err = np.abs(back - xf)[finite]
    assert (err <= 0.25 * np.maximum(np.abs(xf), s)[finite]).all()
    x[2, 3, 17] = np.nan
    with pytest.raises(ValueError) as info:
        sw.safetensors.quantize(x, "mxfp4")
    print(info.value)
    assert "NaN" in str(info.value)


def test_save_with_quantize_writes_what_quantize_gives(tmp_path):
    seed = BASE_SEED + 5
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    w0 = ref.expert_name(0)
    a = special_values(rng, (R, C))
    b = (rng.standard_normal((3, 128, 96))).astype(np.float32)  # 64 x 32 blocks: a (2, 3) grid, which the
    # reader's rule (a grid that divides the shape) turns back into 64 x 32
    m = (rng.standard_normal((2, 5, 64)) * 10).astype(np.float32)
    h = ref.bf16_bits_to_f64(ref.f32_to_bf16_bits(rng.standard_normal((40, 130)).astype(np.float32)))
    norm = np.arange(7, dtype=np.float32)
    path = tmp_path / "q.safetensors"
    sw.safetensors.save(path, {w0: sw.friendly.tensor(a), FUSED: sw.friendly.tensor(b), MX: sw.friendly.tensor(m),
                               "h.weight": sw.friendly.tensor(h.astype(ml_dtypes.bfloat16), dtype=BF16),
                               "model.norm.weight": sw.friendly.tensor(norm)},
                        {"format": "pt"},
                        quantize={w0: "fp8", FUSED: ("fp8", (64, 32)), MX: "mxfp4", "h.weight": "fp8"})
    loaded = safetensors.torch.load_file(str(path))
    assert sorted(loaded) == sorted([w0, w0 + "_scale_inv", FUSED, FUSED + "_scale_inv", MX + "_blocks",
                                     MX + "_scales", "h.weight", "h.weight_scale_inv", "model.norm.weight"])
    dtypes = {k: (v.dtype, tuple(v.shape)) for k, v in loaded.items()}
    assert dtypes[w0] == (torch.float8_e4m3fn, (R, C)) and dtypes[w0 + "_scale_inv"] == (torch.float32, (SR, SC))
    assert dtypes[FUSED] == (torch.float8_e4m3fn, (3, 128, 96)) and dtypes[FUSED + "_scale_inv"] == (torch.float32, (3, 2, 3))
    assert dtypes[MX + "_blocks"] == (torch.uint8, (2, 5, 2, 16)) and dtypes[MX + "_scales"] == (torch.uint8, (2, 5, 2))
    assert dtypes["h.weight"] == (torch.float8_e4m3fn, (40, 130)) and dtypes["h.weight_scale_inv"] == (torch.float32, (1, 2))
    assert dtypes["model.norm.weight"] == (torch.float32, (7,))

    def raw(k):
        t = loaded[k]
        return t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.numpy()

    for name, values, block in ((w0, a, (128, 128)), ("h.weight", h.astype(np.float32), (128, 128))):
        q, s = ref.quantize_fp8(values, block)
        np.testing.assert_array_equal(raw(name), q)
        assert_bits(raw(name + "_scale_inv"), s, F32)
        q2, s2 = sw.safetensors.quantize(values, "fp8", block=block)
        np.testing.assert_array_equal(raw(name), q2)
    for e in range(3):
        q, s = ref.quantize_fp8(b[e], (64, 32))
        np.testing.assert_array_equal(raw(FUSED)[e], q)
        assert_bits(raw(FUSED + "_scale_inv")[e], s, F32)
    wb, ws = ref.quantize_mxfp4(m)
    np.testing.assert_array_equal(raw(MX + "_blocks"), wb)
    np.testing.assert_array_equal(raw(MX + "_scales"), ws)
    np.testing.assert_array_equal(raw("model.norm.weight"), norm)

    ckpt = sw.safetensors.open(path)
    assert ckpt.metadata == {"format": "pt"}
    assert (ckpt.dtype(w0).format, ckpt.dtype(FUSED).block, ckpt.dtype(MX).format) == ("fp8", (64, 32), "mxfp4")
    assert ckpt.dtype("model.norm.weight") is F32
    full = ckpt.tiled([w0], dtype=F32)
    q, s = ref.quantize_fp8(a)
    assert_bits(tiles_of(full, F32)[0], ref.fp8_dequantize_f32(q, s.astype(np.float64)), F32)
    full = ckpt.tiled(FUSED, dtype=F32)
    qs = [ref.quantize_fp8(b[e], (64, 32)) for e in range(3)]
    expected = np.stack([ref.fp8_dequantize_f32(q, s.astype(np.float64), (64, 32)) for q, s in qs])
    assert_bits(tiles_of(full, F32), expected, F32)
    full = ckpt.tiled(MX, dtype=BF16)
    assert_bits(tiles_of(full, BF16), want(ref.mxfp4_dequantize_f32(wb, ws), BF16), BF16)


def test_the_checkpoint_block_from_a_quantization_config_is_taken_where_the_scales_fit(tmp_path):
    """A file that records no block, written (96, 256) in 64 x 64 blocks: its (2, 4) scale grid reads as 48 x 64
    blocks by the shape rule (a grid dividing the shape), and as 64 x 64 once the checkpoint's block is given
    (sw.safetensors.open(fp8_block=), what from_pretrained passes from quantization_config.weight_block_size),
    bit for bit against the reference; a tensor whose scales do not fit the given block keeps the shape rule."""
    seed = BASE_SEED + 8
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    b = rng.standard_normal((3, 96, 256)).astype(np.float32)
    c = rng.standard_normal((3, 256, 256)).astype(np.float32)
    qs = [ref.quantize_fp8(b[e], (64, 64)) for e in range(3)]
    qc = [ref.quantize_fp8(c[e], (128, 128)) for e in range(3)]
    other = "model.layers.0.mlp.experts.gate_up_proj"
    path = tmp_path / "q.safetensors"
    ref.write_safetensors(path, {**ref.fp8_fused_entries(FUSED, np.stack([q for q, _ in qs]),
                                                         np.stack([s for _, s in qs])),
                                 **ref.fp8_fused_entries(other, np.stack([q for q, _ in qc]),
                                                         np.stack([s for _, s in qc]))})
    assert sw.safetensors.open(path).dtype(FUSED).block == (48, 64)  # the shape rule alone misreads it
    ckpt = sw.safetensors.open(path, fp8_block=(64, 64))
    assert ckpt.dtype(FUSED).block == (64, 64)
    assert ckpt.dtype(other).block == (128, 128)  # (2, 2) scales do not fit 64 x 64 blocks of (256, 256)
    expected = np.stack([ref.fp8_dequantize_f32(q, s.astype(np.float64), (64, 64)) for q, s in qs])
    assert_bits(tiles_of(ckpt.tiled(FUSED, dtype=F32), F32), expected, F32)
    with pytest.raises(TypeError, match="fp8_block must be"):
        sw.safetensors.open(path, fp8_block=64)
    with pytest.raises(ValueError, match="at least 1 x 1"):
        sw.safetensors.open(path, fp8_block=(0, 64))


def test_save_with_a_block_the_reader_cannot_infer_reads_back_its_values(tmp_path):
    """A (2, 2) grid of 64 x 32 blocks over (96, 64) would read back as 48 x 32 blocks by the shape rule (a grid
    dividing the shape): save records the block in the metadata, and the reader takes it from there."""
    seed = BASE_SEED + 7
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    b = rng.standard_normal((3, 96, 64)).astype(np.float32)
    path = tmp_path / "q.safetensors"
    sw.safetensors.save(path, {FUSED: sw.friendly.tensor(b)}, quantize={FUSED: ("fp8", (64, 32))})
    qs = [ref.quantize_fp8(b[e], (64, 32)) for e in range(3)]
    expected = np.stack([ref.fp8_dequantize_f32(q, s.astype(np.float64), (64, 32)) for q, s in qs])
    ckpt = sw.safetensors.open(path)
    assert ckpt.metadata == {"fp8_block_size:" + FUSED + "_scale_inv": "[64, 32]"}
    assert ckpt.dtype(FUSED).block == (64, 32)
    full = ckpt.tiled(FUSED, dtype=F32)
    assert_bits(tiles_of(full, F32), expected, F32)


# ---------------------------------------------------------------- hostile files

GOOD = ref.expert_name(0)
BAD = ref.expert_name(1)
BAD_FUSED = "model.layers.1.mlp.experts.down_proj"
BAD_MX = "model.layers.1.mlp.experts.gate_up_proj"


def hostile_entries(case: str):
    """(entries of a bad tensor, its logical name, whether ckpt.dtype() sees it (False: only tiled() reads the
    scales))."""
    q = fp8_codes()[1]
    f32 = stored_scales("F32")[1]
    blocks, scales = mx_blocks()[:2], mx_scales(255)[:2]
    nan_f32 = f32.copy()
    cases = {
        "fp8_scale_missing": ({BAD: ("F8_E4M3", q)}, BAD, True),
        "fp8_scale_wrong_shape": ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("F32", np.ones((3, 2), np.float32))}, BAD, True),
        "fp8_scale_wrong_rank": ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("F32", f32[None])}, BAD, True),
        "fp8_fused_scale_wrong_leading_extent": (ref.fp8_fused_entries(BAD_FUSED, fp8_codes()[:3], stored_scales("F32")[:2]), BAD_FUSED, True),
        "fp8_scale_F16": ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("F16", np.ones((SR, SC), np.float16))}, BAD, True),
        "fp8_scale_U8": ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("U8", np.full((SR, SC), 127, np.uint8))}, BAD, True),
        "mxfp4_scales_missing": ({BAD_MX + "_blocks": ("U8", blocks)}, BAD_MX, True),
        "mxfp4_scales_fewer_groups": (ref.mxfp4_entries(BAD_MX, blocks, scales[..., :-1]), BAD_MX, True),
        "mxfp4_scales_more_rows": (ref.mxfp4_entries(BAD_MX, blocks, np.concatenate([scales, scales[:, :1]], 1)), BAD_MX, True),
        "mxfp4_blocks_last_extent_15": (ref.mxfp4_entries(BAD_MX, blocks[..., :15], scales), BAD_MX, True),
        "mxfp4_scale_F32": ({BAD_MX + "_blocks": ("U8", blocks), BAD_MX + "_scales": ("F32", scales.astype(np.float32))}, BAD_MX, True),
    }
    for label, value in (("nan", np.nan), ("inf", np.inf), ("neg_inf", -np.inf)):
        s = nan_f32.copy()
        s[1, 1] = value
        cases[f"fp8_scale_F32_{label}"] = ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("F32", s)}, BAD, False)
        s = ref.f32_to_bf16_bits(nan_f32)
        s[0, 1] = ref.f32_to_bf16_bits(np.float32(value))
        cases[f"fp8_scale_BF16_{label}"] = ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("BF16", s)}, BAD, False)
    e = np.full((SR, SC), 127, np.uint8)
    e[1, 0] = 255
    cases["fp8_scale_e8m0_255"] = ({BAD: ("F8_E4M3", q), BAD + "_scale_inv": ("F8_E8M0", e)}, BAD, False)
    for sd in ("U8", "F8_E8M0"):
        s = scales.copy()
        s[1, 12, 2] = 255
        cases[f"mxfp4_scale_{sd}_255"] = (ref.mxfp4_entries(BAD_MX, blocks, s, sd), BAD_MX, False)
    return cases[case]


HOSTILE = ["fp8_scale_missing", "fp8_scale_wrong_shape", "fp8_scale_wrong_rank", "fp8_fused_scale_wrong_leading_extent",
           "fp8_scale_F16", "fp8_scale_U8", "mxfp4_scales_missing", "mxfp4_scales_fewer_groups",
           "mxfp4_scales_more_rows", "mxfp4_blocks_last_extent_15", "mxfp4_scale_F32",
           "fp8_scale_F32_nan", "fp8_scale_F32_inf", "fp8_scale_F32_neg_inf", "fp8_scale_BF16_nan",
           "fp8_scale_BF16_inf", "fp8_scale_BF16_neg_inf", "fp8_scale_e8m0_255", "mxfp4_scale_U8_255",
           "mxfp4_scale_F8_E8M0_255"]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_quantized_tensors_are_refused_naming_tensor_and_file_and_nothing_opens(tmp_path, case):
    bad_entries, bad, structural = hostile_entries(case)
    path = tmp_path / "hostile.safetensors"
    q = fp8_codes()[0]
    entries = ref.fp8_per_expert_entries([q], [stored_scales("F32")[0]])  # a valid expert 0 ...
    entries.update(ref.mxfp4_entries(MX, mx_blocks()[:2], mx_scales(255)[:2]))  # ... and a valid MXFP4 layer
    entries["model.norm.weight"] = ("F32", np.arange(5, dtype=np.float32))
    entries.update(bad_entries)
    ref.write_safetensors(path, entries)
    before = sha256(path)
    ckpt = sw.safetensors.open(path)
    keys = ckpt.keys()
    np.testing.assert_array_equal(np.asarray(ckpt.tensor("model.norm.weight")), np.arange(5))
    fds = open_files()  # the checkpoint's own reader (opened at its first read) included

    if structural:  # names, shapes and element types: ckpt.dtype() sees them
        with pytest.raises(ValueError) as info:
            ckpt.dtype(bad)
        print(info.value)
        assert_names(str(info.value), bad, path)
    else:  # the scales' values: read when tiled() makes the tier
        assert isinstance(ckpt.dtype(bad), sw.safetensors.Quantized)
    calls = [lambda: ckpt.tiled(bad if bad != BAD else [bad], dtype=BF16)]
    if bad == BAD:
        calls.append(lambda: ckpt.tiled([GOOD, BAD], dtype=F32))
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        print(info.value)
        assert_names(str(info.value), bad, path)
    assert ckpt.keys() == keys
    assert open_files() == fds  # no tier, no overlay left open
    assert sha256(path) == before
    # the same checkpoint still makes valid tiers
    full = ckpt.tiled([GOOD], dtype=BF16)
    assert_bits(tiles_of(full, BF16)[0], want(fp8_reference("F32")[0], BF16), BF16)
    full = ckpt.tiled(MX, dtype=F32)
    assert_bits(tiles_of(full, F32), ref.mxfp4_dequantize_f32(mx_blocks()[:2], mx_scales(255)[:2]), F32)
