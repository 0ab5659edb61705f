"""Checkpoint.tiled(name, tiles=N): one checkpoint tensor split along its first axis into N equal slabs.

DBRX stores each layer's experts as one 2-D tensor ``ffn.experts.mlp.w1`` of shape (E I, H): expert e is the rows
[e I, (e + 1) I). ``ckpt.tiled(name, tiles=E)`` is the full tensor of shape (I, H, E) over a TiledEvictable whose
tile e is exactly those rows' bytes, the same tensor as E per-expert (I, H) tensors give (docs/guide.md, "Fused
experts"). Files are written by the ``safetensors`` package (safetensors.numpy; bf16 through ml_dtypes), and every
value is compared with the NumPy slab of the array written. Reading moves bytes and does no arithmetic, so every
comparison is exact.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import strideweave as sw
from open_files import open_files

BASE_SEED = 3200

E, I, H = 4, 3, 5  # experts, intermediate size, hidden size: small, and no two extents equal
NAME = "transformer.blocks.0.ffn.experts.mlp.w1"
BEFORE = "transformer.blocks.0.norm_attn_norm.norm_1.weight"  # written first: the experts start past offset 0

DTYPES = {"f32": (np.float32, sw.DType.Float32), "bf16": (ml_dtypes.bfloat16, sw.DType.BFloat16)}


def source(rng, np_dtype):
    """The (E I, H) experts tensor, exactly representable in the dtype (cast once, compared after)."""
    return rng.standard_normal((E * I, H)).astype(np.float32).astype(np_dtype)


def write(path, tensors: dict):
    safetensors.numpy.save_file(tensors, str(path))


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def values(t) -> np.ndarray:
    """A StrideWeave tensor's values by coordinate, widened exactly to Float64."""
    return np.asarray(t).astype(np.float64)


@pytest.fixture(params=sorted(DTYPES))
def dbrx(request, tmp_path, rng):
    """(path, the source array, its dtypes): a file holding a norm, then the fused (E I, H) experts tensor."""
    np_dtype, sw_dtype = DTYPES[request.param]
    w1 = source(rng, np_dtype)
    path = tmp_path / "model.safetensors"
    write(path, {BEFORE: np.ones(H, dtype=np_dtype), NAME: w1})
    return path, w1, np_dtype, sw_dtype


def test_every_tile_is_the_numpy_slab_of_its_rows(dbrx):
    path, w1, np_dtype, sw_dtype = dbrx
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(NAME, tiles=E)
    assert full.dtype() is sw_dtype
    assert full.layout.shape == sw.Shape(I, H, E)
    assert full.layout == sw.Layout(sw.Shape(I, H, E), sw.Stride(H, 1, I * H))  # row-major in a tile, tile size across
    carrier = full.carrier
    assert isinstance(carrier, sw.TiledEvictable)
    assert carrier.grid_shape == (1, 1, E) and carrier.tile_shape == (I, H, 1)
    assert carrier.secondary.range_count == E and carrier.secondary.writes == "overlay"
    assert ckpt.bytes_read == 0  # nothing read until a tile is
    got = np.asarray(full)
    assert got.dtype == np_dtype
    for e in range(E):
        np.testing.assert_array_equal(got[..., e], w1[e * I : (e + 1) * I])
    assert ckpt.bytes_read == w1.nbytes  # each tile's bytes once


def test_it_is_the_same_tensor_as_the_per_expert_form(dbrx, tmp_path):
    path, w1, np_dtype, _ = dbrx
    names = [f"transformer.blocks.0.ffn.experts.mlp.{e}.w1" for e in range(E)]
    write(tmp_path / "per_expert.safetensors", {n: w1[e * I : (e + 1) * I].copy() for e, n in enumerate(names)})
    split = sw.safetensors.open(path).tiled(NAME, tiles=E)
    per_expert = sw.safetensors.open(tmp_path / "per_expert.safetensors").tiled(names)
    assert split.layout == per_expert.layout
    assert split.carrier.grid_shape == per_expert.carrier.grid_shape
    assert split.carrier.tile_shape == per_expert.carrier.tile_shape
    np.testing.assert_array_equal(values(split), values(per_expert))


def test_promoting_a_tile_reads_exactly_its_rows(dbrx):
    path, w1, _, _ = dbrx
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(NAME, tiles=E)
    carrier = full.carrier
    tile_bytes = I * H * w1.itemsize
    for k, e in enumerate((2, 0)):
        carrier.promote(sw.TileSelection(((0,), (0,), (e,))))
        assert ckpt.bytes_read == (k + 1) * tile_bytes  # one read of one tile's bytes, nothing else
    assert carrier.primary_tiles == sw.TileSet(((0, 0, 0), (0, 0, 2)))
    compact = carrier.project(full, sw.TileSelection(((0,), (0,), (2, 0)))).wait()
    assert ckpt.bytes_read == 2 * tile_bytes  # both resident: no read
    # The values prove which bytes were read: tile 2 holds rows [2 I, 3 I), tile 0 rows [0, I).
    np.testing.assert_array_equal(values(compact)[..., 0], w1[2 * I : 3 * I].astype(np.float64))
    np.testing.assert_array_equal(values(compact)[..., 1], w1[:I].astype(np.float64))


def test_writes_of_a_read_only_tier_go_to_the_overlay(dbrx):
    path, w1, np_dtype, _ = dbrx
    before = sha256(path)
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(NAME, tiles=E)  # mutable=False
    carrier, tier = full.carrier, full.carrier.secondary
    sel = sw.TileSelection(((0,), (0,), (1,)))
    carrier.promote(sel)
    full[(2, 4, 1)] = 0.5  # row I + 2, column 4 of the file's tensor
    assert carrier.tile_state((0, 0, 1)).dirty
    carrier.evict(sel)
    assert carrier.tile_state((0, 0, 1)).location == "secondary"
    assert tier.overlaid_ranges == 1 and sha256(path) == before  # the file is never written
    want = w1.astype(np.float64)
    want[I + 2, 4] = 0.5
    got = values(full)
    for e in range(E):
        np.testing.assert_array_equal(got[..., e], want[e * I : (e + 1) * I])  # the tile reads back its new value
    np.testing.assert_array_equal(np.asarray(sw.safetensors.open(path).tensor(NAME)), w1)  # a fresh reader: the file
    carrier.release()


def test_in_place_writes_land_on_the_tiles_rows(dbrx):
    """mutable=True writes the evicted tile where it lies: exactly its rows of the file change."""
    path, w1, np_dtype, _ = dbrx
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(NAME, tiles=E, mutable=True)
    carrier = full.carrier
    assert carrier.secondary.writes == "in_place"
    sel = sw.TileSelection(((0,), (0,), (3,)))
    carrier.promote(sel)
    full[(0, 1, 3)] = -2.0
    full[(I - 1, H - 1, 3)] = 0.25
    carrier.evict(sel)
    carrier.flush()
    carrier.release()
    want = w1.copy()
    want[3 * I, 1] = -2.0
    want[4 * I - 1, H - 1] = 0.25
    now = safetensors.numpy.load_file(str(path))
    np.testing.assert_array_equal(now[NAME], want)
    np.testing.assert_array_equal(now[BEFORE], np.ones(H, dtype=np_dtype))


def test_tiles_of_one_row_are_the_default_split(dbrx):
    """tiles=None splits into shape[0] slabs of one row each, the axis dropped; tiles=shape[0] is the same."""
    path, w1, _, _ = dbrx
    ckpt = sw.safetensors.open(path)
    default = ckpt.tiled(NAME)
    explicit = ckpt.tiled(NAME, tiles=E * I)
    one = ckpt.tiled(NAME, tiles=1)  # a single tile: the whole tensor
    assert default.layout == explicit.layout == sw.Layout(sw.Shape(H, E * I), sw.Stride(1, H))
    assert explicit.carrier.tile_shape == (H, 1) and explicit.carrier.secondary.range_count == E * I
    np.testing.assert_array_equal(values(explicit), w1.T.astype(np.float64))
    assert one.layout.shape == sw.Shape(E * I, H, 1) and one.carrier.secondary.range_count == 1
    np.testing.assert_array_equal(values(one)[..., 0], w1.astype(np.float64))


def test_a_three_dimensional_fused_tensor_splits_into_groups_of_experts(tmp_path, rng):
    """tiles counts slabs of any rank: (E, O, H) into E / 2 tiles of two experts each, shape (2, O, H, E / 2)."""
    fused = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    write(tmp_path / "fused.safetensors", {"gate_up_proj": fused})
    full = sw.safetensors.open(tmp_path / "fused.safetensors").tiled("gate_up_proj", tiles=E // 2)
    assert full.layout.shape == sw.Shape(2, 2 * I, H, E // 2)
    got = values(full)
    for t in range(E // 2):
        np.testing.assert_array_equal(got[..., t], fused[2 * t : 2 * t + 2])
    same = sw.safetensors.open(tmp_path / "fused.safetensors").tiled("gate_up_proj", tiles=E)
    assert same.layout.shape == sw.Shape(2 * I, H, E)  # slabs of one expert: as without tiles


ERRORS = {
    "zero": (dict(tiles=0), ValueError, f"tensor '{NAME}' cannot be split into 0 tiles: tiles must be >= 1"),
    "negative": (dict(tiles=-4), ValueError, "tiles must be >= 1"),
    "not_dividing": (
        dict(tiles=5),
        ValueError,
        f"tensor '{NAME}' has a first axis of extent {E * I}, which tiles=5 does not divide",
    ),
    "more_than_rows": (dict(tiles=2 * E * I), ValueError, f"extent {E * I}, which tiles={2 * E * I} does not divide"),
    "too_large": (dict(tiles=2**70), ValueError, "out of range for tensor"),
    "bool": (dict(tiles=True), TypeError, "tiles must be an int or None, got bool"),
    "float": (dict(tiles=4.0), TypeError, "tiles must be an int or None, got float"),
    "str": (dict(tiles="4"), TypeError, "tiles must be an int or None, got str"),
    "numpy_int": (dict(tiles=np.int64(4)), TypeError, "tiles must be an int or None"),
    "with_names": (dict(names=[NAME], tiles=1), TypeError, "tiles applies to one tensor name"),
    "rank_0": (dict(names="scalar", tiles=1), ValueError, "tensor 'scalar' has rank 0"),
}


@pytest.mark.parametrize("mutable", [False, True], ids=["read_only", "mutable"])
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_change_nothing(tmp_path, rng, case, mutable):
    kwargs, kind, fragment = ERRORS[case]
    kwargs = dict(kwargs)
    names = kwargs.pop("names", NAME)
    w1 = source(rng, np.float32)
    path = tmp_path / "model.safetensors"
    write(path, {NAME: w1, "scalar": np.array(7.0, dtype=np.float32)})
    before = sha256(path)
    ckpt = sw.safetensors.open(path)
    fds = open_files()
    with pytest.raises(kind, match=fragment):
        ckpt.tiled(names, mutable=mutable, **kwargs)
    assert open_files() == fds  # no file opened, read-only or writable
    assert ckpt.bytes_read == 0 and sha256(path) == before  # nothing read, nothing written
    assert ckpt.keys() == ["scalar", NAME]  # sorted
    full = ckpt.tiled(NAME, tiles=E)  # still usable
    np.testing.assert_array_equal(np.asarray(full)[..., 1], w1[I : 2 * I])
