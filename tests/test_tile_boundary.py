"""One crossing per selection: TileSet and TileSelection check, order and expand their tiles in C++
(Note [Canonical tile order]), the blocking residency calls are C++ methods, and friendly.tensor converts
with the core's rules (DType.convert). Each result is compared with a plain Python statement of the rule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, TileSelection, TileSet, friendly

SEED = random.randrange(2**32)


@pytest.fixture
def rng() -> random.Random:
    print(f"seed {SEED}")
    return random.Random(SEED)


def canonical(coords) -> tuple:
    """The canonical order as Python states it: first axis fastest."""
    return tuple(sorted((tuple(c) for c in coords), key=lambda c: tuple(reversed(c))))


def compact(per_axis) -> tuple:
    """A selection's coordinates as Python states them: first axis fastest, each axis in its order."""
    shape = [len(a) for a in per_axis]
    coords = []
    for ordinal in range(math.prod(shape)):
        c, rest = [], ordinal
        for i, n in enumerate(shape):
            c.append(per_axis[i][rest % n])
            rest //= n
        coords.append(tuple(c))
    return tuple(coords)


def test_tile_set_is_canonical(rng):
    for _ in range(50):
        rank = rng.randint(1, 4)
        coords = {tuple(rng.randrange(6) for _ in range(rank)) for _ in range(rng.randint(0, 30))}
        shuffled = list(coords)
        rng.shuffle(shuffled)
        ts = TileSet(shuffled)
        assert ts.coordinates == canonical(coords), SEED
        assert all(type(v) is int for c in ts.coordinates for v in c)


def test_selection_coordinates_and_tile_set(rng):
    for _ in range(50):
        rank = rng.randint(1, 3)
        per_axis = [rng.sample(range(10), rng.randint(1, 4)) for _ in range(rank)]
        sel = TileSelection(per_axis)
        assert sel.per_axis == tuple(tuple(a) for a in per_axis)
        assert sel.coordinates == compact(per_axis), SEED
        assert sel.tile_set == TileSet(sel.coordinates), SEED
        assert sel.tile_set.coordinates == canonical(sel.coordinates), SEED


def test_components_beyond_int64_keep_their_values_and_order():
    big = [2**64, 2**63, 2**70 + 1, 5, 0]
    ts = TileSet([(v, 1) for v in big] + [(3, 2**65)])
    assert ts.coordinates == canonical([(v, 1) for v in big] + [(3, 2**65)])
    with pytest.raises(ValueError, match="duplicate"):
        TileSet([(2**64, 0), (2**64, 0)])
    with pytest.raises(ValueError, match=r"TileSet coordinate \(1180591620717411303424, -1\) has a negative"):
        TileSet([(2**70, 0), (2**70, -1)])
    with pytest.raises(ValueError, match=r"axis 0 contains a duplicate: \(18446744073709551616, 18446744073709551616\)"):
        TileSelection([[2**64, 2**64]])
    sel = TileSelection([[2**64, 1], [0]])
    assert sel.coordinates == ((2**64, 0), (1, 0))
    assert sel.tile_set.coordinates == ((1, 0), (2**64, 0))


def test_index_like_components_become_ints():
    ts = TileSet([(np.int64(3), np.uint8(1))])
    assert ts.coordinates == ((3, 1),) and all(type(v) is int for v in ts.coordinates[0])
    sel = TileSelection((np.arange(3),))
    assert sel.per_axis == ((0, 1, 2),) and type(sel.per_axis[0][0]) is int


def test_blocking_residency_calls_are_bound_in_cpp():
    for name in ("promote", "evict", "flush"):
        method = sw.TiledEvictable.__dict__[name]
        assert type(method).__name__ == "nb_method", (name, type(method))  # not a function attached from Python


def test_blocking_residency_calls_match_the_async_ones(tmp_path):
    primary = sw.CPU(8)
    carrier = sw.TiledEvictable(primary, sw.FileBacked(str(tmp_path / "t.bin")), (1, 2), (2, 2))
    carrier.evict(TileSelection([[0], [0, 1]]))
    assert carrier.primary_tiles == TileSet()
    carrier.promote(TileSet([(0, 1)]))
    assert carrier.primary_tiles == TileSet([(0, 1)])
    carrier.flush()
    assert carrier.dirty_tiles == TileSet()
    with pytest.raises(TypeError, match="promote_async: tiles must be a TileSet or a TileSelection, got list"):
        carrier.promote([(0, 0)])


def test_friendly_tensor_converts_as_dtype_convert(rng):
    values = [rng.uniform(-1e39, 1e39) for _ in range(100)] + [0.1, 2.0**80, -(2.0**70), math.inf]
    t = friendly.tensor(np.array(values))
    assert [t[i] for i in range(len(values))] == [DType.Float32.convert(v) for v in values], SEED
    ints = [rng.randrange(-(2**62), 2**62) for _ in range(50)] + [2**63 - 1]
    t = friendly.tensor(np.array(ints, dtype=np.int64))
    assert [t[i] for i in range(len(ints))] == [DType.Float32.convert(v) for v in ints], SEED
    small = [rng.randrange(-(2**31), 2**31) for _ in range(50)]
    for array in (np.array(small, dtype=np.int64), np.array(small, dtype=np.int32), np.array(small).astype(">i8")):
        t = friendly.tensor(array, dtype=DType.Int32)
        assert [t[i] for i in range(len(small))] == small, SEED
    with pytest.raises(OverflowError, match="out of range"):
        friendly.tensor(np.array([2**64 - 1], dtype=np.uint64), dtype=DType.Int32)
    t = friendly.tensor(np.array([0.5, 1.5], dtype=np.float16))
    assert [t[0], t[1]] == [0.5, 1.5]
    wide = [2**70, -(2**2000), 3]
    t = friendly.tensor(wide)
    assert [t[i] for i in range(3)] == [DType.Float32.convert(v) for v in wide]
