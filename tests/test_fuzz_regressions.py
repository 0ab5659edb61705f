"""Regression cases the fuzz tests found (fuzzing.py), kept as plain tests."""

from __future__ import annotations

import gc
import math

import pytest

import strideweave as sw
from strideweave import Shape, Tensor
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection, TileSet

from fuzzing import tile_table_too_big

pytestmark = pytest.mark.usefixtures("fuzz_report", "fuzz_watchdog", "clear_io_faults", "grad_mode_on")


# ================================================================ regression cases found by the fuzz tests


def test_regression_tensor_offset_near_int64_max():
    for off in (2**63 - 1, 2**63 - 2, 2**62):
        with pytest.raises(ValueError, match="exceeds"):
            Tensor(sw.CPU(4), off, sw.column_major(2))


@pytest.mark.parametrize("grid,tile", [((2**32, 2**32), (1, 1)), ((2**62,), (2,)), ((1, 1), (2**32, 2**32)),
                                       ((2**31, 2**31, 2), (1, 1, 1))])


def test_regression_tiled_extent_overflow(grid, tile):
    p, s = sw.CPU(0), sw.CPU(0)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        TiledEvictable(p, s, grid, tile)
    assert not p.is_owned() and not s.is_owned()


@pytest.mark.parametrize("grid,tile,fragment", [
    ((10**7, 10**7), (1, 1), "has 100000000000000 tiles; at most 2**24 (16777216) tiles are supported"),
    ((2**40,), (1,), "has 1099511627776 tiles; at most 2**24"),
    ((2**24 + 1,), (1,), "has 16777217 tiles; at most 2**24"),
    ((4096, 4097), (1, 1), "has 16781312 tiles"),
    ((2, 1), (1, 2**40), "need 2199023255552 contiguous runs; at most 2**26 (67108864) are supported"),
    ((2, 1), (3, 2**25 + 1), "need 67108866 contiguous runs"),
])
def test_regression_tile_table_limits(grid, tile, fragment):
    """A geometry within the 2**62 extent whose tile table would be too big: ValueError up front, no giant
    allocation (Note [Tile table limits]), and nothing claimed or changed: the tiers build a sane carrier."""
    import resource

    p, s = sw.CPU(0), sw.FileBacked()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError) as info:
        TiledEvictable(p, s, grid, tile)
    assert fragment in str(info.value) and "TiledEvictable" in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: nothing was built
    assert not p.is_owned() and not s.is_owned() and p.size() == 0 and s.size() == 0
    assert not p.is_released() and not s.is_released() and p.is_mutable() and s.is_mutable()
    c = TiledEvictable(p, s, (2,), (2,))
    assert c.size() == 4 and p.is_owned() and s.is_owned()
    c.release()


@pytest.mark.parametrize("grid,tile", [((1, 4), (2**30, 2**27)), ((1, 1, 3), (2**20, 2**20, 2**10)), ((4,), (2**40,))])
def test_tile_table_limits_count_coalesced_runs(grid, tile):
    """Huge tiles with few runs are fine: a footprint's axes coalesce into one run while the grid axes
    before them are 1 (4 tiles of 2**57 slots are 4 runs, not 2**29)."""
    assert not tile_table_too_big(grid, tile)
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), grid, tile)
    assert c.grid_shape == grid and c.tile_shape == tile and c.size() == math.prod(grid) * math.prod(tile)
    assert c.tile_state(tuple(g - 1 for g in grid)).location == "invalid"
    c.release()


@pytest.mark.parametrize("grid", [(10**30,), (2**63,), (1, 2**64)])
def test_regression_grid_extent_beyond_int64(grid):
    p, s = sw.CPU(0), sw.FileBacked()
    with pytest.raises(ValueError, match="grid_shape .* is out of range"):
        TiledEvictable(p, s, grid, (1,) * len(grid))
    assert not p.is_owned() and not s.is_owned()


def test_regression_tile_coordinates_beyond_int64():
    c = TiledEvictable(sw.CPU(0), sw.CPU(8), (4,), (2,))
    full = Tensor(c, 0, sw.column_major(8))
    for bad in (2**63, 2**70):
        with pytest.raises(ValueError, match="out of range"):
            c.promote(TileSet([(bad,)]))
        with pytest.raises(ValueError, match="out of range"):
            c.project(full, TileSelection([[bad]]))
    assert c.tile_state((0,)).location == "secondary"
    c.release()


def test_regression_deeply_nested_coordinate():
    key = [1]
    for _ in range(100_000):
        key = [key]
    t = sw.friendly.tensor([1.0, 2.0])
    for call in (lambda: Shape(2, 3).encode(key), lambda: sw.column_major(2, 3).index(key), lambda: t[key],
                 lambda: t.__setitem__(key, 1.0)):
        with pytest.raises(ValueError, match="deeper than 64"):
            call()
    gc.collect()


# ================================================================ regression cases found by `make fuzz` (fuzz/)


def _sized_kind(answer):
    """A fresh user kind whose provider's physical_size answers `answer` once a test sets it."""
    from strideweave.carriers.extension import CarrierDefinition, StorageProvider, register_carrier_definition

    cls = type(f"Sized{id(answer)}", (sw.Carrier,), {})
    register_carrier_definition(cls, CarrierDefinition(StorageProvider(
        supports_dtype=lambda c, d: True,
        physical_size=lambda c: c.__dict__.get("answer", len(c.__dict__.get("slots", ()))),
        allocate=lambda c, n: setattr(c, "slots", [0.0] * n),
        release=lambda c: setattr(c, "slots", []),
        read=lambda c, i: c.slots[i],
        write=lambda c, i, v: c.slots.__setitem__(i, v))))
    return cls


@pytest.mark.parametrize("answer", [-1, -(2**62)])
def test_regression_negative_physical_size(answer):
    """extension_fuzz: a provider's physical_size answering -1 made the carrier's size() -1 (and Tensor(...)
    then failed inside sw.column_major); it is a ValueError naming the callback, and nothing changes."""
    c = _sized_kind(answer)(3, dtype=sw.DType.Float32)
    c[1] = 2.0
    c.answer = answer
    with pytest.raises(ValueError, match=f"StorageProvider.physical_size must return a size >= 0, got {answer}"):
        c.size()
    with pytest.raises(ValueError, match="physical_size"):
        Tensor(c, 0, sw.column_major(1))
    del c.answer
    assert c.size() == 3 and c.slots == [0.0, 2.0, 0.0] and c.version == 1 and not c.is_owned()


@pytest.mark.parametrize("header", [b'{"a": 1E400}', b'{"__metadata__": {"k": -11.1111111111E11111111}}',
                                    b'{"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}'])
def test_regression_header_number_beyond_double(tmp_path, header):
    """safetensors_fuzz: a number beyond double in a header escaped as nlohmann::json's out_of_range, which
    Python saw as RuntimeError('[json.exception.out_of_range.406] ...'); it is the ValueError of any malformed
    header, naming the file, and the file is left as it was."""
    import struct

    path = tmp_path / "bad.safetensors"
    data = struct.pack("<Q", len(header)) + header + bytes(4)
    path.write_bytes(data)
    with pytest.raises(ValueError, match="bad.safetensors: the header is not well-formed JSON"):
        sw.safetensors.open(path)
    assert path.read_bytes() == data
