"""TiledEvictable: geometry, tile footprints, TileSelection/TileSet/ResidencyPlan and residency.

Covers these TiledEvictable requirements (docs/guide.md, "TiledEvictable"): "TiledEvictable owns one flat logical storage extent", "Tensor Layout
compatibility preserves exact carrier tile footprints" (through the check
exposed as ``carrier._check_footprints(tensor)``), "TileSelection is an ordered
Cartesian product", "Residency state is independent of executable selection
shape", the residency-request parts of "Residency remains valid while tiled
work needs it", "Residency requests use arbitrary immutable tile sets",
"Residency transitions have asynchronous and blocking forms", the reachable
parts of "Residency policy can optimize but cannot define correctness" and
"Tiled release ends all owned residency". Projection, scatter and direct
operations are not part of this delivery and are not exercised here.

Scenario tests are named after their scenario. Nothing sleeps: a request is
kept pending deterministically with the engine's test-only I/O gate
(``_core._io_hold(op)`` blocks every call of ``op`` until ``_io_unhold()``),
and failures are injected with ``_core._io_inject(op, errno, count, after)``.
An autouse fixture clears both when each test ends, pass or fail.

Layouts: a MoE weight is used in both placements, ``(out, in, expert)`` with
grid ``(1, 1, E)`` and tile ``(out, in, 1)`` (each expert one contiguous run of
slots), and ``(expert, out, in)`` with grid ``(E, 1, 1)`` and tile
``(1, out, in)`` (each expert a strided footprint).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strideweave as sw
from strideweave.carriers import tiled_evictable as te
from strideweave.carriers.tiled_evictable import (
    AwaitProjection,
    AwaitResidency,
    ResidencyPlan,
    ResidencyPolicy,
    TiledEvictable,
    TiledResidencyFacet,
    TileSelection,
    TileSet,
)

F32 = sw.DType.Float32
I32 = sw.DType.Int32
core = sw._core
MiB = 1 << 20


# Every injected fault and every I/O hold is cleared when a test ends, pass or fail.
pytestmark = pytest.mark.usefixtures("clear_io_faults")


# ---------------------------------------------------------------- helpers


def column_major(*extents):
    return sw.friendly.column_major(*extents)


def full_tensor(c):
    """The full logical Tensor over a TiledEvictable in its canonical placement."""
    return sw.Tensor(c, 0, column_major(*c.logical_shape))


def tiles_of(grid):
    """All tile coordinates of `grid`, first axis fastest."""
    return [tuple(reversed(t)) for t in itertools.product(*[range(g) for g in reversed(grid)])]


def tile_of_slot(c, slot):
    coord = sw.Shape(*c.logical_shape).decode(slot)
    return tuple(x // t for x, t in zip(coord, c.tile_shape))


def footprint(c, tile):
    """Slots of the canonical footprint of `tile` (slot s is decode(s) over logical_shape)."""
    return [s for s in range(c.size()) if tile_of_slot(c, s) == tuple(tile)]


def file_with(values, dtype=F32):
    f = sw.FileBacked(dtype=dtype).allocate_like(len(values))
    for i, v in enumerate(values):
        f[i] = v
    return f


def cpu_with(values, dtype=F32):
    c = sw.CPU(len(values), dtype=dtype)
    for i, v in enumerate(values):
        c[i] = v
    return c


def default_values(n):
    return [float(i + 1) for i in range(n)]


def secondary_seeded(grid, tile, values=None, secondary="file", policy=None):
    """Every tile valid on a full secondary tier, nothing on primary."""
    n = math.prod(grid) * math.prod(tile)
    values = default_values(n) if values is None else values
    sec = file_with(values) if secondary == "file" else cpu_with(values)
    return TiledEvictable(sw.CPU(0), sec, grid, tile, residency_policy=policy)


def primary_seeded(grid, tile, values=None, secondary="file"):
    """Every tile valid (and dirty) on primary, an empty secondary tier."""
    n = math.prod(grid) * math.prod(tile)
    values = default_values(n) if values is None else values
    sec = sw.FileBacked() if secondary == "file" else sw.CPU(0)
    return TiledEvictable(cpu_with(values), sec, grid, tile)


def moe(kind, experts, out=3, inp=4):
    """(grid, tile, expert -> tile coordinate, experts -> TileSelection) of a MoE weight placement."""
    if kind == "out_in_expert":
        return ((1, 1, experts), (out, inp, 1), lambda e: (0, 0, e), lambda es: TileSelection([[0], [0], list(es)]))
    assert kind == "expert_out_in"
    return ((experts, 1, 1), (1, out, inp), lambda e: (e, 0, 0), lambda es: TileSelection([list(es), [0], [0]]))


MOE_KINDS = ["out_in_expert", "expert_out_in"]


def states(c):
    return {t: c.tile_state(t) for t in tiles_of(c.grid_shape)}


def snapshot(c, secondary_values=True, skip=()):
    """Everything a failed or refused request must leave unchanged.

    Values come from the tier that holds them without moving anything: primary
    and implicit tiles are read through the carrier (no transfer), secondary
    tiles from the secondary tier directly (an owned carrier stays readable).
    With secondary_values=False nothing touches file I/O (used while I/O is held); values of the
    tiles in `skip` (tiles of a pending request, whose values are not accessible) are not read.
    """
    st_ = states(c)
    values = {}
    for s in range(c.size()):
        if tile_of_slot(c, s) in skip:
            continue
        loc = st_[tile_of_slot(c, s)].location
        if loc in ("primary", "implicit"):
            values[s] = c[s]
        elif loc == "secondary" and secondary_values:
            values[s] = c.secondary[s]
    return {
        "states": st_,
        "values": values,
        "version": c.version,
        "stats": c.stats(),
        "released": (c.is_released(), c.primary.is_released(), c.secondary.is_released()),
        "owned": (c.primary.is_owned(), c.secondary.is_owned()),
        "size": c.size(),
        "dtype": c.dtype(),
    }


# ================================================================ TiledEvictable owns one flat logical storage extent


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_promote_one_expert_tile(kind):
    grid, tile, expert, _ = moe(kind, experts=4)
    c = secondary_seeded(grid, tile)
    t = full_tensor(c)
    layout, shape, offset, version, size = t.layout, t.layout.shape, t.offset, t.version, c.size()
    before = states(c)

    assert c.promote(TileSet([expert(2)])) is None

    # Only that tile's residency changed.
    after = states(c)
    for coord, s in after.items():
        if coord == expert(2):
            assert (s.location, s.valid, s.dirty) == ("primary", True, False)
        else:
            assert s == before[coord]
    # The Tensor still denotes the full weight: same identity, carrier, shape, Layout, offset, version.
    assert t.carrier is c
    assert t.layout == layout and t.layout.shape == shape and t.offset == offset
    assert t.layout.shape.extents == c.logical_shape
    assert t.version == version == c.version
    assert c.size() == size and c.dtype() is F32
    assert t.autograd_ctx is None
    # Reading the promoted expert needs no transfer; its values are the seeded ones.
    promoted = c.stats()["promotions"]
    for s in footprint(c, expert(2)):
        assert c[s] == float(s + 1)
    assert c.stats()["promotions"] == promoted


def test_exposes_dtype_extent_grid_and_tier_kinds():
    c = TiledEvictable(sw.CPU(0, dtype=I32), sw.FileBacked(dtype=I32), (2, 3), (4, 5))
    assert c.dtype() is I32
    assert c.size() == 2 * 3 * 4 * 5
    assert c.grid_shape == (2, 3) and c.tile_shape == (4, 5) and c.logical_shape == (8, 15)
    assert all(isinstance(x, int) for x in c.grid_shape + c.tile_shape + c.logical_shape)
    assert type(c.primary) is sw.CPU and type(c.secondary) is sw.FileBacked
    assert c.primary.is_owned() and c.secondary.is_owned()
    assert isinstance(c, sw.DependentCarrier) and isinstance(c, sw.Carrier)
    # supports_storage_dtype is the intersection of both tiers'.
    assert c.supports_storage_dtype(I32) and c.supports_storage_dtype(F32)
    assert not c.supports_storage_dtype(sw.DType.Bool)  # FileBacked does not store Bool
    assert not c.supports_storage_dtype(sw.DType.Float64)
    with pytest.raises(TypeError, match="dtype must be a DType"):
        c.supports_storage_dtype("Float32")
    b = TiledEvictable(sw.CPU(0, dtype=sw.DType.Bool), sw.CPU(0, dtype=sw.DType.Bool), (2,), (2,))
    assert b.supports_storage_dtype(sw.DType.Bool)


@pytest.mark.parametrize(
    "grid,tile",
    [((3,), (4,)), ((2, 3), (2, 2)), ((1, 1, 3), (2, 3, 1)), ((3, 1, 1), (1, 2, 3)), ((2, 2, 2), (1, 2, 3))],
)
def test_tile_mapping_assigns_each_slot_one_tile_and_within_tile_coordinate(grid, tile):
    """Slot s is decode(s) over logical_shape; it lies in exactly tile coord // tile_shape."""
    base = TiledEvictable(sw.CPU(0), sw.CPU(0), grid, tile)
    logical = base.logical_shape
    assert logical == tuple(g * t for g, t in zip(grid, tile))
    seen = {}
    for s in range(base.size()):
        c = base.allocate_like(base.size())  # every tile implicit zero
        c[s] = 7.0
        coord = sw.Shape(*logical).decode(s)
        expected_tile = tuple(x // t for x, t in zip(coord, tile))
        within = tuple(x % t for x, t in zip(coord, tile))
        assert c.dirty_tiles == TileSet([expected_tile]) == c.primary_tiles
        seen.setdefault(expected_tile, set()).add(within)
        # The tile's storage is the footprint of that tile: after eviction the secondary tier (full
        # extent, slot order) holds 7 at slot s and zero on the rest of the footprint.
        c.evict(TileSet([expected_tile]))
        for q in footprint(c, expected_tile):
            assert c.secondary[q] == (7.0 if q == s else 0.0)
        c.release()
    # Each tile receives exactly prod(tile) distinct within-tile coordinates.
    assert sorted(seen) == sorted(tiles_of(grid))
    assert all(len(w) == math.prod(tile) for w in seen.values())


def test_module_map_and_top_level_names():
    assert te.__all__ == [
        "AwaitProjection",
        "AwaitResidency",
        "ResidencyPlan",
        "ResidencyPolicy",
        "TileSelection",
        "TileSet",
        "TiledEvictable",
        "TiledResidencyFacet",
    ]
    for name in te.__all__:
        assert getattr(sw, name) is getattr(te, name), name
        assert name in sw.__all__, name
    assert sw.carriers.TiledEvictable is TiledEvictable
    assert issubclass(AwaitResidency, sw.AwaitResult) and issubclass(AwaitProjection, sw.AwaitResult)
    for handle in (AwaitResidency, AwaitProjection):
        with pytest.raises(TypeError, match="created by the framework"):
            handle()
    # The residency methods are reachable through the module's TiledEvictable and its facet.
    for name in ("promote_async", "evict_async", "promote", "evict"):
        assert callable(getattr(TiledEvictable, name))
        assert callable(getattr(TiledResidencyFacet, name))


def test_only_tiled_evictable_is_installed_through_a_carrier_definition():
    definition = core._definition_of(TiledEvictable)
    from strideweave.carriers.extension import CarrierDefinition

    assert isinstance(definition, CarrierDefinition)
    assert any(isinstance(f, TiledResidencyFacet) for f in definition.facets)
    # Composition installs nothing on the carriers it composes, before or after use.
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), (2,), (2,))
    c2 = TiledEvictable(sw.Generic([], dtype=F32), sw.CPU(0), (2,), (2,))
    for cls in (sw.Generic, sw.CPU, sw.FileBacked, sw.BlockDeviceCarrier, sw.Evictable):
        assert core._definition_of(cls) is None, cls
    for carrier in (sw.CPU(1), sw.Generic([1.0]), sw.FileBacked(), sw.Evictable(sw.CPU(1), sw.FileBacked())):
        assert carrier.facet(TiledResidencyFacet) is None
    facet = c.facet(TiledResidencyFacet)
    assert isinstance(facet, TiledResidencyFacet)
    assert c.require_facet(TiledResidencyFacet) is not None
    assert c2.facet(TiledResidencyFacet) is not None
    # The composed tiers keep their own behaviour: CPU still executes, FileBacked still does not.
    assert c.primary.dispatch_op("add").name == "add"
    with pytest.raises(NotImplementedError):
        c.secondary.dispatch_op("add")


# ---------------------------------------------------------------- construction (docs/guide.md, "TiledEvictable")


def _pending_carrier(n=0):
    import pending_carrier as pc

    return pc.PendingCarrier(n, dtype=F32)


def _released(c):
    c.release()
    return c


_OWNERS = []  # keeps the owning carriers alive (an owner's claims end when it is destroyed)


def _owned_kept(c):
    """`c` (an empty carrier) claimed by a live TiledEvictable."""
    _OWNERS.append(TiledEvictable(c, sw.CPU(0, dtype=c.dtype()), (1,), (1,)))
    assert c.is_owned()
    return c


CONSTRUCTOR_ERRORS = [
    # (id, primary factory, secondary factory, grid, tile, error, message fragment)
    ("primary not a carrier", lambda: [1.0], lambda: sw.CPU(0), (2,), (2,), TypeError, "Carrier"),
    ("secondary not a carrier", lambda: sw.CPU(0), lambda: "secondary", (2,), (2,), TypeError, "Carrier"),
    ("secondary None", lambda: sw.CPU(0), lambda: None, (2,), (2,), TypeError, None),
    ("dependent primary", lambda: sw.Evictable(sw.CPU(4), sw.FileBacked()), lambda: sw.CPU(0), (2,), (2,),
     TypeError, "must not be dependent"),
    ("dependent secondary", lambda: sw.CPU(0), lambda: TiledEvictable(sw.CPU(0), sw.CPU(0), (2,), (2,)), (2,), (2,),
     TypeError, "must not be dependent"),
    ("released tier", lambda: _released(sw.CPU(0)), lambda: sw.CPU(0), (2,), (2,), RuntimeError, "released"),
    ("owned tier", lambda: sw.CPU(0), lambda: _owned_kept(sw.CPU(0)), (2,), (2,), RuntimeError, "owned"),
    ("dtype mismatch", lambda: sw.CPU(0), lambda: sw.CPU(0, dtype=I32), (2,), (2,), TypeError, "dtype"),
    ("rank mismatch", lambda: sw.CPU(0), lambda: sw.CPU(0), (2, 2), (2,), ValueError, "rank"),
    ("rank zero", lambda: sw.CPU(0), lambda: sw.CPU(0), (), (), ValueError, "rank"),
    ("zero grid extent", lambda: sw.CPU(0), lambda: sw.CPU(0), (0,), (2,), ValueError, ">= 1"),
    ("negative tile extent", lambda: sw.CPU(0), lambda: sw.CPU(0), (2,), (-1,), ValueError, ">= 1"),
    ("primary partial", lambda: sw.CPU(3), lambda: sw.CPU(0), (2,), (2,), ValueError, "0 or 4 slots"),
    ("secondary oversized", lambda: sw.CPU(0), lambda: sw.CPU(5), (2,), (2,), ValueError, "0 or 4 slots"),
    ("grid not iterable", lambda: sw.CPU(0), lambda: sw.CPU(0), 2, (2,), TypeError, "grid_shape"),
    ("grid float", lambda: sw.CPU(0), lambda: sw.CPU(0), (2.0,), (2,), TypeError, "grid_shape"),
    ("tile bool", lambda: sw.CPU(0), lambda: sw.CPU(0), (2,), (True,), TypeError, "tile_shape"),
]


@pytest.mark.parametrize("case", CONSTRUCTOR_ERRORS, ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_constructor_rejects_invalid_arguments(case):
    _, make_p, make_s, grid, tile, error, fragment = case
    p, s = make_p(), make_s()
    owned_before = [x.is_owned() for x in (p, s) if isinstance(x, sw.Carrier) and not x.is_released()]
    with pytest.raises(error, match=fragment):
        TiledEvictable(p, s, grid, tile)
    # A failed construction claims nothing.
    owned_after = [x.is_owned() for x in (p, s) if isinstance(x, sw.Carrier) and not x.is_released()]
    assert owned_after == owned_before


# §10: tiers are non-dependent, distinct, live, unowned carriers of one dtype; then the grid and
# tile shapes; then each tier holds 0 slots or the full extent. Each case breaks two rules and must
# report the earlier one.
VALIDATION_ORDER = [
    ("non-dependent before distinct", lambda: (lambda e: (e, e))(sw.Evictable(sw.CPU(4), sw.FileBacked())),
     (2,), (2,), TypeError, "must not be dependent"),
    ("non-dependent before live", lambda: (sw.Evictable(sw.CPU(4), sw.FileBacked()), _released(sw.CPU(0))), (2,),
     (2,), TypeError, "must not be dependent"),
    ("distinct before live", lambda: (lambda x: (x, x))(_released(sw.CPU(0))), (2,), (2,), ValueError, "distinct"),
    ("live before unowned", lambda: (_released(sw.CPU(0)), _owned_kept(sw.CPU(0))), (2,), (2,),
     RuntimeError, "released"),
    ("unowned before dtype", lambda: (_owned_kept(sw.CPU(0)), sw.CPU(0, dtype=I32)), (2,), (2,),
     RuntimeError, "owned"),
    ("live before dtype", lambda: (_released(sw.CPU(0)), sw.CPU(0, dtype=I32)), (2,), (2,),
     RuntimeError, "released"),
    ("dtype before shapes", lambda: (sw.CPU(0), sw.CPU(0, dtype=I32)), (2, 2), (2,), TypeError, "dtype"),
    ("shapes before sizes", lambda: (sw.CPU(3), sw.CPU(5)), (2, 2), (2,), ValueError, "rank"),
    ("extents before sizes", lambda: (sw.CPU(3), sw.CPU(0)), (0,), (2,), ValueError, ">= 1"),
]


@pytest.mark.parametrize("case", VALIDATION_ORDER, ids=[c[0] for c in VALIDATION_ORDER])
def test_constructor_validation_order(case):
    _, make, grid, tile, error, fragment = case
    p, s = make()
    with pytest.raises(error, match=fragment):
        TiledEvictable(p, s, grid, tile)


def test_constructor_rolls_back_claims_when_tile_seeding_fails():
    """Claims are taken after validation; a failure while seeding tiles (the third per-tile buffer of a
    full FileBacked primary cannot be opened) must leave both tiers unowned, unchanged and usable."""
    p = file_with([float(i) for i in range(8)])
    s = sw.FileBacked()
    version = p.version
    core._io_inject("open", errno.EIO, count=1, after=2)
    with pytest.raises(RuntimeError, match="EIO"):
        TiledEvictable(p, s, (4,), (2,))
    core._io_clear()
    assert not p.is_owned() and not s.is_owned()
    assert p.is_mutable() and s.is_mutable() and not p.is_released() and not s.is_released()
    assert [p[i] for i in range(8)] == [float(i) for i in range(8)] and p.version == version
    p[0] = 42.0  # writable again
    c = TiledEvictable(p, s, (4,), (2,))
    assert p.is_owned() and s.is_owned()
    assert [c[i] for i in range(8)] == [42.0] + [float(i) for i in range(1, 8)]


def test_constructor_seeds_tiles_from_the_tiers():
    vals = [1.0, 2.0, 3.0, 4.0]
    # A full primary seeds every tile primary-valid; its values must be preserved on eviction: dirty.
    c = TiledEvictable(cpu_with(vals), sw.FileBacked(), (2,), (2,))
    assert all((s.location, s.valid, s.dirty) == ("primary", True, True) for s in states(c).values())
    assert c.stats()["primary_tiles"] == 2 and c.stats()["primary_bytes"] == 16
    # A full secondary (and empty primary) seeds them secondary-valid and clean.
    c = TiledEvictable(sw.CPU(0), file_with(vals), (2,), (2,))
    assert all((s.location, s.valid, s.dirty) == ("secondary", True, False) for s in states(c).values())
    assert c.stats()["primary_bytes"] == 0
    # Two empty tiers: every tile invalid.
    c = TiledEvictable(sw.CPU(0), sw.CPU(0), (2,), (2,))
    assert all((s.location, s.valid, s.dirty) == ("invalid", False, False) for s in states(c).values())
    assert c.valid_tiles == TileSet() and c.primary_tiles == TileSet()
    # Both full: the primary seeds the values (dirty: the secondary's values are unrelated) and
    # eviction publishes the primary's values, not the stale secondary ones.
    c = TiledEvictable(cpu_with(vals), cpu_with([9.0, 9.0, 9.0, 9.0]), (2,), (2,))
    assert all((s.location, s.dirty) == ("primary", True) for s in states(c).values())
    c.evict(TileSet([(0,), (1,)]))
    assert [c.secondary[i] for i in range(4)] == vals
    assert c.stats()["bytes_evicted"] == 16 and c.stats()["writes_skipped"] == 0


def test_new_like_and_allocate_like_keep_geometry_tier_kinds_and_policy():
    policy = RecordingPolicy()
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), (2, 3), (2, 2), residency_policy=policy)
    n = c.size()
    z = c.allocate_like(n)
    e = c.allocate_like(n, empty=True)
    v = c.new_like([float(i) for i in range(n)])
    for x in (z, e, v):
        assert type(x) is TiledEvictable and x is not c
        assert x.grid_shape == c.grid_shape and x.tile_shape == c.tile_shape and x.size() == n
        assert type(x.primary) is sw.CPU and type(x.secondary) is sw.FileBacked
        assert x.primary is not c.primary and x.secondary is not c.secondary
        assert x.residency_policy is policy
        assert x.version == 0 and x.is_mutable()
    assert all(s.location == "implicit" and s.valid and not s.dirty for s in states(z).values())
    assert [z[i] for i in range(n)] == [0.0] * n
    assert all(s.location == "invalid" for s in states(e).values())
    assert [v[i] for i in range(n)] == [float(i) for i in range(n)]
    assert all(s.location == "primary" and s.dirty for s in states(v).values())
    # dtype and mutability are honoured; a tiled extent is all or nothing.
    assert c.allocate_like(n, dtype=I32).dtype() is I32
    frozen = c.new_like([1.0] * n, mutable=False)
    assert not frozen.is_mutable() and frozen[0] == 1.0
    with pytest.raises(RuntimeError):
        frozen[0] = 2.0
    assert not c.allocate_like(n, mutable=False).is_mutable()
    with pytest.raises(ValueError):
        c.allocate_like(n - 1)
    assert policy.calls == []


def test_tile_state_is_frozen_metadata_and_checks_coordinates():
    c = secondary_seeded((2, 3), (2, 2))
    s = c.tile_state((1, 2))
    assert (s.location, s.valid, s.dirty) == ("secondary", True, False)
    assert c.tile_state([1, 2]) == s  # any iterable coordinate
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.location = "primary"
    for bad in ((2, 0), (0, 3), (-1, 0)):
        with pytest.raises(ValueError):
            c.tile_state(bad)
    with pytest.raises(ValueError):
        c.tile_state((0,))
    with pytest.raises(TypeError):
        c.tile_state(5)
    with pytest.raises(TypeError):
        c.tile_state((0.5, 0))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_residency_never_changes_tensor_carrier_or_version(kind):
    grid, tile, expert, select = moe(kind, experts=5)
    c = secondary_seeded(grid, tile)
    t = full_tensor(c)
    layout, version = t.layout, c.version
    for request in (
        lambda: c.promote(select([0, 3])),
        lambda: c.evict(select([3])),
        lambda: c.promote_async(TileSet([expert(4)])).wait(),
        lambda: c.evict_async(select([0, 4])).wait(),
        lambda: c.facet(TiledResidencyFacet).promote(select(range(5))),
        lambda: c.facet(TiledResidencyFacet).evict(select(range(5))),
    ):
        request()
        assert t.carrier is c and t.layout == layout and t.offset == 0
        assert c.version == version == t.version
        assert c.size() == math.prod(grid) * math.prod(tile) and c.dtype() is F32
        assert t.autograd_ctx is None and t.grad is None
    # Slot writes are the ones that move the version.
    c[0] = 5.0
    assert c.version == version + 1


# ================================================================ Tensor Layout compatibility: tile footprints


WITHIN_TILE_PERMUTATIONS = [
    # (id, grid, tile, layout): every logical tile reaches exactly its carrier tile's slots, but
    # associates within-tile coordinates with them in another order.
    ("canonical", (2, 3), (2, 2), column_major(4, 6)),
    ("canonical hierarchical", (2, 3), (2, 2), sw.Layout(sw.Shape([[2, 2], [2, 3]]), sw.Stride([[1, 2], [4, 8]]))),
    ("transpose inside each 2x2 tile", (2, 3), (2, 2),
     sw.Layout(sw.Shape([[2, 2], [2, 3]]), sw.Stride([[4, 2], [1, 8]]))),
    ("1-D interleave inside tiles", (2,), (4,), sw.Layout(sw.Shape([[2, 2, 2]]), sw.Stride([[2, 1, 4]]))),
    # A row-major weight per expert, (out, in, expert) with one expert per tile.
    ("row-major experts (out,in,expert)", (1, 1, 5), (3, 4, 1), sw.Layout(sw.Shape(3, 4, 5), sw.Stride(4, 1, 12))),
    # (expert, out, in): the expert's out and in swapped within its strided footprint.
    ("swapped out/in (expert,out,in)", (5, 1, 1), (1, 3, 4), sw.Layout(sw.Shape(5, 3, 4), sw.Stride(1, 20, 5))),
]


@pytest.mark.parametrize("case", WITHIN_TILE_PERMUTATIONS, ids=[c[0] for c in WITHIN_TILE_PERMUTATIONS])
def test_accept_a_within_tile_permutation(case):
    _, grid, tile, layout = case
    c = secondary_seeded(grid, tile)
    t = sw.Tensor(c, 0, layout)
    before = snapshot(c)
    assert c._check_footprints(t) is None
    assert c._check_footprints(t) is None  # again (a cached acceptance answers the same)
    assert snapshot(c) == before
    # The Layout alone associates logical coordinates with slots: each logical element of tile T is
    # stored in carrier tile T, at the slot the Layout names.
    logical = sw.Shape(*c.logical_shape)
    for k in range(t.size()):
        coord = logical.decode(k)
        slot = layout(coord)
        assert tile_of_slot(c, slot) == tuple(x // g for x, g in zip(coord, tile))
        assert t[coord] == float(slot + 1)


SPANNING = [
    ("row-major over 2x2 tiles", (2, 3), (2, 2), 0, sw.Layout(sw.Shape(4, 6), sw.Stride(6, 1))),
    ("row-major (expert,out,in) weight", (5, 1, 1), (1, 3, 4), 0, sw.Layout(sw.Shape(5, 3, 4), sw.Stride(12, 4, 1))),
    ("column-major (out,in,expert) of the transposed weight", (1, 1, 5), (3, 4, 1), 0,
     sw.Layout(sw.Shape(3, 4, 5), sw.Stride(5, 15, 1))),
    ("1-D interleaved across tiles", (2,), (4,), 0, sw.Layout(sw.Shape([[2, 4]]), sw.Stride([[4, 1]]))),
]


@pytest.mark.parametrize("case", SPANNING, ids=[c[0] for c in SPANNING])
def test_reject_one_logical_tile_spanning_physical_tiles(case):
    _, grid, tile, offset, layout = case
    c = secondary_seeded(grid, tile)
    c.promote(TileSet([tiles_of(grid)[0]]))
    t = sw.Tensor(c, offset, layout)
    before = snapshot(c)
    with pytest.raises(ValueError, match="footprint"):
        c._check_footprints(t)
    assert snapshot(c) == before
    assert t.carrier is c and t.layout == layout and t.autograd_ctx is None


ALIASING = [
    # Repeats a slot and leaves the rest of the footprint unreached.
    ("stride-0 rows", (2, 3), (2, 2), sw.Layout(sw.Shape(4, 6), sw.Stride(0, 4))),
    ("1-D every slot twice", (2,), (4,), sw.Layout(sw.Shape([[2, 2, 2]]), sw.Stride([[0, 2, 4]]))),
    # Tile 0 complete, tile 1 reaches tile 0's slots a second time and none of its own.
    ("second tile aliases the first", (2,), (4,), sw.Layout(sw.Shape([[4, 2]]), sw.Stride([[1, 0]]))),
    # Each expert reaches only half of its footprint, twice.
    ("half an expert twice (out,in,expert)", (1, 1, 3), (2, 2, 1),
     sw.Layout(sw.Shape(2, 2, 3), sw.Stride(1, 0, 4))),
]


@pytest.mark.parametrize("case", ALIASING, ids=[c[0] for c in ALIASING])
def test_reject_aliasing_or_incomplete_tile_coverage(case):
    _, grid, tile, layout = case
    c = primary_seeded(grid, tile)
    t = sw.Tensor(c, 0, layout)
    assert not layout.is_injective
    before = snapshot(c)
    with pytest.raises(ValueError):
        c._check_footprints(t)
    assert snapshot(c) == before


REMAPPING = [
    # Logical tile (i, j) reaches exactly carrier tile (j, i)'s footprint.
    ("2x2 tiles transposed", (2, 2), (2, 2), sw.Layout(sw.Shape([[2, 2], [2, 2]]), sw.Stride([[1, 8], [4, 2]]))),
    # Logical expert tile (a, 0, c) reaches exactly carrier tile (c, 0, a).
    ("expert grid axes swapped", (2, 1, 2), (1, 3, 1), sw.Layout(sw.Shape(2, 3, 2), sw.Stride(6, 2, 1))),
]


@pytest.mark.parametrize("case", REMAPPING, ids=[c[0] for c in REMAPPING])
def test_reject_tile_coordinate_remapping(case):
    _, grid, tile, layout = case
    c = secondary_seeded(grid, tile)
    t = sw.Tensor(c, 0, layout)
    assert layout.is_injective
    # Sanity: some logical tile reaches exactly the footprint of another carrier tile.
    logical = sw.Shape(*c.logical_shape)
    reached = {}
    for k in range(t.size()):
        coord = logical.decode(k)
        reached.setdefault(tuple(x // g for x, g in zip(coord, tile)), set()).add(layout(coord))
    remapped = [lt for lt, slots in reached.items()
                if any(slots == set(footprint(c, ct)) for ct in tiles_of(grid) if ct != lt)]
    assert remapped
    before = snapshot(c)
    with pytest.raises(ValueError, match="footprint"):
        c._check_footprints(t)
    assert snapshot(c) == before


def test_footprint_check_rejects_a_partial_tensor_and_another_carrier():
    c = secondary_seeded((2, 3), (2, 2))
    before = snapshot(c)
    # Not the full logical Tensor (a compact view of the first two tile columns).
    with pytest.raises(ValueError):
        c._check_footprints(sw.Tensor(c, 0, column_major(4, 4)))
    with pytest.raises(ValueError):
        c._check_footprints(sw.Tensor(c, 0, column_major(24)))
    # A Tensor backed by another carrier, even an identical TiledEvictable.
    other = secondary_seeded((2, 3), (2, 2))
    with pytest.raises(TypeError):
        c._check_footprints(full_tensor(other))
    with pytest.raises(TypeError):
        c._check_footprints(sw.friendly.zeros(4, 6))
    with pytest.raises(TypeError):
        c._check_footprints("not a tensor")
    assert snapshot(c) == before


def test_footprint_acceptance_is_per_layout():
    """Accepting one placement must not make a different placement of the same shape acceptable."""
    c = secondary_seeded((2, 3), (2, 2))
    good = sw.Layout(sw.Shape([[2, 2], [2, 3]]), sw.Stride([[4, 2], [1, 8]]))
    bad = sw.Layout(sw.Shape(4, 6), sw.Stride(6, 1))
    for _ in range(2):
        c._check_footprints(sw.Tensor(c, 0, good))
        c._check_footprints(full_tensor(c))
        with pytest.raises(ValueError):
            c._check_footprints(sw.Tensor(c, 0, bad))
    with pytest.raises(ValueError):
        c._check_footprints(sw.Tensor(c, 0, bad))
    # Every bijective placement of a 1-D carrier of two 16-slot tiles: compatible exactly when the
    # tile-selecting leaf keeps stride 16 (24 of 120); many accepted placements in a row (more than
    # a small cache holds) never make a rejected one acceptable.
    d = secondary_seeded((2,), (16,))
    accepted = 0
    for perm in itertools.permutations([1, 2, 4, 8, 16]):
        t = sw.Tensor(d, 0, sw.Layout(sw.Shape([[2, 2, 2, 2, 2]]), sw.Stride([list(perm)])))
        if perm[4] == 16:
            d._check_footprints(t)
            accepted += 1
        else:
            with pytest.raises(ValueError):
                d._check_footprints(t)
    assert accepted == 24


# ================================================================ TileSelection is an ordered Cartesian product


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_select_three_experts_in_router_order(kind):
    grid, tile, expert, select = moe(kind, experts=20, out=2, inp=2)
    sel = select([2, 7, 19])
    axis = 2 if kind == "out_in_expert" else 0
    assert sel.per_axis[axis] == (2, 7, 19)
    assert sel.compact_grid_shape[axis] == 3
    assert sel.compact_grid_shape == tuple(3 if i == axis else 1 for i in range(3))
    assert sel.coordinates == (expert(2), expert(7), expert(19))
    # Every remaining tile axis is fully selected (extent 1 here), and the compact coordinate c maps
    # to tuple(per_axis[i][c[i]]).
    for k, c in enumerate(itertools.product(*[range(n) for n in reversed(sel.compact_grid_shape)])):
        c = tuple(reversed(c))
        assert sel.coordinates[k] == tuple(sel.per_axis[i][c[i]] for i in range(sel.rank))
    # Bound to the weight's grid: promoting it makes exactly those experts resident.
    w = secondary_seeded(grid, tile)
    w.promote(sel)
    assert w.primary_tiles == TileSet([expert(2), expert(7), expert(19)]) == sel.tile_set


def test_include_every_recombined_corner():
    sel = TileSelection([[0, 1], [0, 1]])
    assert (1, 1) in sel.coordinates
    assert set(sel.coordinates) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert len(sel.coordinates) == 4 and sel.compact_grid_shape == (2, 2)
    c = secondary_seeded((2, 2), (1, 2))
    c.promote(sel)
    assert c.primary_tiles == TileSet([(0, 0), (1, 0), (0, 1), (1, 1)])


def test_enumerate_a_multi_axis_selection_first_mode_fastest():
    sel = TileSelection([[7, 2], [4, 9]])
    assert sel.coordinates == ((7, 4), (2, 4), (7, 9), (2, 9))
    assert sel.rank == 2 and sel.compact_grid_shape == (2, 2)
    # The same ordinal authority as Shape.encode / Shape.decode.
    compact = sw.Shape(*sel.compact_grid_shape)
    for k, src in enumerate(sel.coordinates):
        c = compact.decode(k)
        assert compact.encode(c) == k
        assert src == tuple(sel.per_axis[i][c[i]] for i in range(sel.rank))


def test_selection_ordinals_agree_with_shape_decode_on_three_axes():
    sel = TileSelection([[5, 0, 3], [1], [4, 2]])
    assert sel.rank == 3 and sel.compact_grid_shape == (3, 1, 2)
    compact = sw.Shape(3, 1, 2)
    assert len(sel.coordinates) == 6
    for k, src in enumerate(sel.coordinates):
        c = compact.decode(k)
        assert src == (sel.per_axis[0][c[0]], sel.per_axis[1][c[1]], sel.per_axis[2][c[2]])
    assert sel.coordinates[:3] == ((5, 1, 4), (0, 1, 4), (3, 1, 4))


def test_selection_preserves_caller_order_and_exposes_tuples():
    sel = TileSelection((iter([3, 1, 2]) for _ in range(1)))  # generators are finite iterables too
    assert sel.per_axis == ((3, 1, 2),)
    sel = TileSelection([np.array([2, 7]), (np.int64(4),)])
    assert sel.per_axis == ((2, 7), (4,))
    assert all(type(v) is int for axis in sel.per_axis for v in axis)
    assert type(sel.per_axis) is tuple and all(type(a) is tuple for a in sel.per_axis)
    assert type(sel.rank) is int and type(sel.compact_grid_shape) is tuple
    assert type(sel.coordinates) is tuple and all(type(c) is tuple for c in sel.coordinates)
    # Mutating the caller's lists afterwards does not change the selection.
    axes = [[4, 0], [1]]
    sel = TileSelection(axes)
    axes[0].append(9)
    axes.append([0])
    assert sel.per_axis == ((4, 0), (1,)) and sel.rank == 2


@pytest.mark.parametrize(
    "per_axis",
    [5, None, 3.0, [[0], 1], [[0], None], [[0.0]], [["a"]], [[True]], [[0, 1.5]], "ab", ["ab"]],
    ids=repr,
)
def test_selection_rejects_non_iterables_and_non_integers_with_type_error(per_axis):
    with pytest.raises(TypeError):
        TileSelection(per_axis)


@pytest.mark.parametrize("per_axis", [[], (), [[]], [[0], []], [[1, 1]], [[0], [2, 0, 2]], [[-1]], [[0], [3, -2]]],
                         ids=repr)
def test_selection_rejects_empty_duplicate_or_negative_with_value_error(per_axis):
    with pytest.raises(ValueError):
        TileSelection(per_axis)


def test_selection_binding_checks_rank_and_range():
    c = secondary_seeded((4, 2), (1, 1))
    before = snapshot(c)
    for sel in (TileSelection([[0, 4], [0]]), TileSelection([[0], [2]]), TileSelection([[0]]),
                TileSelection([[0], [0], [0]])):
        for request in (c.promote_async, c.evict_async, c.promote, c.evict,
                        c.facet(TiledResidencyFacet).promote_async):
            with pytest.raises(ValueError):
                request(sel)
    assert snapshot(c) == before


def test_selection_is_frozen_hashable_equal_by_value_with_repr():
    a = TileSelection([[2, 7], [4]])
    b = TileSelection(((2, 7), (4,)))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != TileSelection([[7, 2], [4]])  # order is part of the value
    assert repr(a) == "TileSelection(per_axis=((2, 7), (4,)))"
    assert dataclasses.is_dataclass(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.per_axis = ((1,),)
    assert a.per_axis == ((2, 7), (4,))


def test_selection_exposes_no_index_map_or_sparse_constructor():
    sel = TileSelection([[2, 7], [4]])
    public = {n for n in dir(sel) if not n.startswith("_")}
    assert public == {"per_axis", "rank", "compact_grid_shape", "coordinates", "tile_set"}
    assert [f.name for f in dataclasses.fields(TileSelection)] == ["per_axis"]
    for value in (sel.per_axis, sel.coordinates, sel.compact_grid_shape, sel.rank):
        assert not isinstance(value, (sw.Layout, sw.Shape, sw.Stride))
    with pytest.raises(TypeError):
        TileSelection(coordinates=[(0, 0)])  # no sparse-coordinate constructor


# ================================================================ Residency state is independent of selection shape


def test_cache_unrelated_tiles():
    c = secondary_seeded((2, 2), (2, 3))
    cached = TileSet([(0, 0), (0, 1), (1, 0)])
    c.promote(cached)
    assert c.primary_tiles == cached
    assert c.secondary_tiles == TileSet([(1, 1)])
    assert c.valid_tiles == TileSet(tiles_of((2, 2)))
    # The resident set is not a Cartesian product: the product of its axis projections adds (1, 1).
    axes = [sorted({t[i] for t in cached}) for i in range(2)]
    assert TileSelection(axes).tile_set != cached
    # Residency stays valid: every cached tile is readable without any further transfer.
    promotions = c.stats()["promotions"]
    for t in cached:
        for s in footprint(c, t):
            assert c[s] == float(s + 1)
        assert c.tile_state(t).location == "primary"
    assert c.stats()["promotions"] == promotions
    assert c.tile_state((1, 1)).location == "secondary"


def test_invalid_tiles_are_not_readable_until_initialised():
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), (3,), (2,))
    t = full_tensor(c)
    before = snapshot(c)
    with pytest.raises(RuntimeError, match="invalid"):
        c[0]
    with pytest.raises(RuntimeError, match="invalid"):
        t[(3,)]
    with pytest.raises(RuntimeError, match="invalid"):  # one slot cannot initialise a whole tile
        c[1] = 1.0
    with pytest.raises(RuntimeError, match="invalid"):  # nothing to promote from
        c.promote(TileSet([(1,)]))
    with pytest.raises(RuntimeError, match="invalid"):
        c.promote_async(TileSet([(0,), (1,)]))
    assert snapshot(c) == before
    # Evicting a tile that holds nothing is a no-op.
    assert c.evict(TileSet([(0,)])) is None
    assert snapshot(c) == before
    # Declared implicit values and whole-extent initialisation make tiles valid.
    z = c.allocate_like(c.size())
    assert z.valid_tiles == TileSet([(0,), (1,), (2,)]) and z[5] == 0.0
    v = c.new_like([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert v[5] == 6.0 and v.valid_tiles == z.valid_tiles


def test_dirty_marks_a_primary_value_that_must_be_preserved():
    c = secondary_seeded((3,), (2,))
    c.promote(TileSet([(0,), (1,)]))
    assert c.dirty_tiles == TileSet()  # promoted from a valid secondary: nothing to preserve
    c[1] = -1.0
    assert c.dirty_tiles == TileSet([(0,)])
    s = c.tile_state((0,))
    assert (s.location, s.valid, s.dirty) == ("primary", True, True)
    # Writing a secondary tile's slot makes it resident first, then dirty.
    c[5] = -5.0
    assert c.dirty_tiles == TileSet([(0,), (2,)])
    assert c.tile_state((2,)).location == "primary"
    # Only primary tiles are ever dirty; eviction preserves the values and cleans them.
    c.evict(TileSet([(0,), (1,), (2,)]))
    assert c.dirty_tiles == TileSet() and c.primary_tiles == TileSet()
    assert [c.secondary[i] for i in range(6)] == [1.0, -1.0, 3.0, 4.0, 5.0, -5.0]
    # An implicit tile made resident by a write is dirty (the secondary holds nothing for it).
    z = c.allocate_like(6)
    z[2] = 1.0
    assert z.dirty_tiles == TileSet([(1,)])
    assert all(not s.dirty for t, s in states(z).items() if t != (1,))


# ================================================================ Residency remains valid while tiled work needs it
# (residency-request parts: failure atomicity before and after submission, conflicting transitions)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_failed_promotion_keeps_the_whole_prior_set(kind):
    """The third transfer of a multi-tile promotion fails: nothing of the set changes; a retry succeeds.

    With (out, in, expert) each expert is one contiguous run (one pread per tile), so the third
    pread is the third tile transfer; with (expert, out, in) each expert is many runs and the fault
    lands inside the first tile that reaches it. Either way the set commits all-or-nothing."""
    grid, tile, expert, select = moe(kind, experts=8)
    c = secondary_seeded(grid, tile)
    c.promote(select([6]))
    c[footprint(c, expert(6))[0]] = 100.0  # a dirty primary tile inside the request's set
    c.promote(select([7]))  # a clean primary tile inside the set
    request = select([0, 1, 2, 3, 4, 6, 7])
    before = snapshot(c)
    core._io_inject("pread", errno.EIO, count=1, after=2)
    h = c.promote_async(request)
    with pytest.raises(RuntimeError, match="EIO") as first:
        h.wait()
    with pytest.raises(RuntimeError) as second:
        h.wait()
    assert second.value is first.value and h.done
    core._io_clear()
    assert snapshot(c) == before  # residency, values, validity, dirtiness, version, stats, ownership
    assert c.primary_tiles == TileSet([expert(6), expert(7)])
    # The carrier is usable again, and the retry succeeds with the original values.
    assert c.promote(request) is None
    assert c.primary_tiles == TileSet([expert(e) for e in (0, 1, 2, 3, 4, 6, 7)])
    assert c.dirty_tiles == TileSet([expert(6)])
    assert c.version == before["version"]
    for s in range(c.size()):
        expected = 100.0 if s == footprint(c, expert(6))[0] else float(s + 1)
        assert c[s] == expected


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_failed_eviction_keeps_the_whole_prior_set(kind):
    grid, tile, expert, select = moe(kind, experts=8)
    c = secondary_seeded(grid, tile)
    c.promote(select(range(8)))
    for e in (0, 1, 2, 3, 4):  # five dirty tiles need a write each
        c[footprint(c, expert(e))[-1]] = -float(e)
    request = select([0, 1, 2, 3, 4, 5, 6])  # plus two clean tiles (no write)
    before = snapshot(c)
    core._io_inject("pwrite", errno.EIO, count=1, after=2)
    h = c.evict_async(request)
    with pytest.raises(RuntimeError, match="EIO") as first:
        h.wait()
    with pytest.raises(RuntimeError) as second:
        h.wait()
    assert second.value is first.value
    core._io_clear()
    after = snapshot(c, secondary_values=False)
    assert after["states"] == before["states"]  # all seven still primary; the five still dirty
    assert after["values"] == before["values"] and after["version"] == before["version"]
    assert after["stats"] == before["stats"]
    assert c.dirty_tiles == TileSet([expert(e) for e in range(5)])
    # Retry: every value commits to the secondary tier.
    assert c.evict(request) is None
    assert c.primary_tiles == TileSet([expert(7)]) and c.dirty_tiles == TileSet()
    for e in range(8):
        fp = footprint(c, expert(e))
        for s in fp:
            want = -float(e) if (e < 5 and s == fp[-1]) else float(s + 1)
            holder = c.secondary if e < 7 else c
            assert holder[s] == want
    assert c.version == before["version"]


def test_enospc_on_eviction_keeps_the_tile_dirty_and_resident():
    grid, tile, expert, select = moe("out_in_expert", experts=3)
    c = primary_seeded(grid, tile)  # dirty on primary, empty FileBacked secondary
    before = snapshot(c, secondary_values=False)
    core._io_inject("pwrite", errno.ENOSPC, count=1)
    with pytest.raises(RuntimeError, match="ENOSPC"):
        c.evict(select([1]))
    core._io_clear()
    assert snapshot(c, secondary_values=False) == before
    s = c.tile_state(expert(1))
    assert (s.location, s.valid, s.dirty) == ("primary", True, True)
    assert [c[i] for i in footprint(c, expert(1))] == [float(i + 1) for i in footprint(c, expert(1))]
    c.evict(select([1]))
    assert c.tile_state(expert(1)).location == "secondary"
    assert [c.secondary[i] for i in footprint(c, expert(1))] == [float(i + 1) for i in footprint(c, expert(1))]


def test_failed_slot_access_changes_nothing():
    c = secondary_seeded((4,), (3,))
    before = snapshot(c)
    core._io_inject("pread", errno.EIO, count=-1)
    with pytest.raises(RuntimeError, match="EIO"):
        c[4]  # read through the secondary
    with pytest.raises(RuntimeError, match="EIO"):
        c[4] = 1.0  # a write promotes the tile first
    core._io_clear()
    after = snapshot(c)
    assert after == before
    assert c[4] == 5.0 and c.tile_state((1,)).location == "secondary"  # a read leaves the tile where it is
    c[4] = 6.0
    assert c[4] == 6.0 and c.tile_state((1,)).location == "primary"


def test_carrier_is_usable_and_releasable_after_a_terminal_failure():
    c = secondary_seeded((4,), (2,))
    core._io_inject("pread", errno.EIO, count=-1)  # every read fails
    h = c.promote_async(TileSet([(0,), (1,), (2,)]))
    with pytest.raises(RuntimeError):
        h.wait()
    core._io_clear()
    assert c.primary.is_owned() and c.secondary.is_owned() and not c.is_released()
    c.promote(TileSet([(0,)]))
    c[0] = 9.0
    c.evict(TileSet([(0,)]))
    assert c.secondary[0] == 9.0
    assert c.release() is None and c.is_released()


# ---------------------------------------------------------------- pending requests (held I/O)


def _pending_promote(c, tiles):
    """Starts a promotion whose reads are held: it stays incomplete until _io_unhold()."""
    core._io_hold("pread")
    h = c.promote_async(tiles)
    assert not h.done
    return h


def _pending_evict(c, tiles):
    core._io_hold("pwrite")
    h = c.evict_async(tiles)
    assert not h.done
    return h


def _conflict_fixture(pending_kind):
    """A 6-tile carrier: tiles 0-1 are in a pending request; 2 is dirty primary, 3-5 secondary."""
    c = secondary_seeded((6,), (2,))
    if pending_kind == "promote":
        c.promote(TileSet([(2,)]))
        c[4] = -4.0
        h = _pending_promote(c, TileSet([(0,), (1,)]))
    else:
        c.promote(TileSet([(0,), (1,), (2,)]))
        c[0], c[2], c[4] = -0.5, -2.0, -4.0
        h = _pending_evict(c, TileSet([(0,), (1,)]))
    return c, h


CONFLICTS = {
    "promote_async": lambda c, ts: c.promote_async(ts),
    "evict_async": lambda c, ts: c.evict_async(ts),
    "promote": lambda c, ts: c.promote(ts),
    "evict": lambda c, ts: c.evict(ts),
    "facet.promote_async": lambda c, ts: c.facet(TiledResidencyFacet).promote_async(ts),
    "facet.evict": lambda c, ts: c.facet(TiledResidencyFacet).evict(ts),
}


@pytest.mark.parametrize("request_kind", list(CONFLICTS))
@pytest.mark.parametrize("pending_kind", ["promote", "evict"])
def test_overlapping_request_is_refused_while_another_is_incomplete(pending_kind, request_kind):
    """The asynchronous forms refuse at once; the blocking forms wait in turn (Note [Taking turns]) and, past the
    wait limit (here 0.05 s), refuse the same way."""
    c, h = _conflict_fixture(pending_kind)
    before = snapshot(c, secondary_values=False, skip={(0,), (1,)})
    overlapping = TileSet([(1,), (2,), (3,)])  # tile 1 pending; 2 and 3 are free
    limit = sw.turn_wait_limit()
    sw.set_turn_wait_limit(0.05)
    try:
        with pytest.raises(RuntimeError, match="waited 0.05 s for tile" if "async" not in request_kind else "wait"):
            CONFLICTS[request_kind](c, overlapping)
        with pytest.raises(RuntimeError, match="wait"):
            CONFLICTS[request_kind](c, TileSelection([[0, 3]]))
    finally:
        sw.set_turn_wait_limit(limit)
    # Refused before anything changed, without joining the pending request.
    assert not h.done
    assert snapshot(c, secondary_values=False, skip={(0,), (1,)}) == before
    core._io_unhold()
    assert h.wait() is None
    expected = "primary" if pending_kind == "promote" else "secondary"
    assert c.tile_state((0,)).location == c.tile_state((1,)).location == expected
    # Once terminal, the same request is accepted.
    result = CONFLICTS[request_kind](c, overlapping)
    if result is not None:
        assert isinstance(result, AwaitResidency) and result.wait() is None
    assert c.tile_state((3,)).location == ("primary" if "promote" in request_kind else "secondary")


def test_refuse_hidden_waiting_on_external_transition():
    """Value access (the reachable consumer in this delivery) of a tile covered by another caller's
    incomplete evict_async raises RuntimeError rather than waiting for or joining that handle."""
    c = secondary_seeded((4,), (3,))
    c.promote(TileSet([(0,), (1,), (2,), (3,)]))
    for s in range(12):
        c[s] = float(100 + s)
    t = full_tensor(c)
    h = _pending_evict(c, TileSet([(1,), (2,)]))
    version = c.version
    for access in (lambda: c[3], lambda: c[8], lambda: t[(4,)]):
        with pytest.raises(RuntimeError, match="wait"):
            access()
    for write in (lambda: c.__setitem__(3, 0.0), lambda: t.__setitem__((5,), 0.0)):
        with pytest.raises(RuntimeError, match="wait"):
            write()
    assert not h.done and c.version == version
    # Tiles outside the request stay fully usable meanwhile.
    assert c[0] == 100.0 and c[11] == 111.0
    c[0] = 1.0
    core._io_unhold()
    assert h.wait() is None
    assert c.primary_tiles == TileSet([(0,), (3,)])
    assert [c.secondary[s] for s in range(3, 9)] == [float(100 + s) for s in range(3, 9)]
    assert c[3] == 103.0 and c[0] == 1.0


def test_disjoint_request_runs_beside_an_incomplete_one():
    c = secondary_seeded((6,), (2,))
    c.promote(TileSet([(5,)]))
    c[10] = 0.0
    # At most two held reads at once: the I/O pool has at least four threads, and the eviction below
    # needs one that is free.
    h1 = _pending_promote(c, TileSet([(0,)]))
    h2 = c.promote_async(TileSet([(2,)]))  # disjoint: accepted, pending behind the same hold
    h3 = c.evict_async(TileSet([(5,)]))  # a dirty tile: its write is not held
    assert h3.wait() is None
    assert c.tile_state((5,)).location == "secondary"
    assert not h1.done and not h2.done
    core._io_unhold()
    assert h1.wait() is None and h2.wait() is None
    assert c.primary_tiles == TileSet([(0,), (2,)])
    assert [c[s] for s in range(6)] == [float(s + 1) for s in range(6)]


# ================================================================ Residency requests use arbitrary immutable tile sets


def test_represent_a_non_product_cache_set():
    ts = TileSet([(0, 0), (0, 1), (1, 0)])
    assert ts.coordinates == ((0, 0), (1, 0), (0, 1))
    assert (1, 1) not in ts.coordinates
    # Not the domain of any TileSelection...
    for axes in ([[0, 1], [0, 1]], [[0], [0, 1]], [[0, 1], [0]]):
        assert TileSelection(axes).tile_set != ts
    # ...yet a valid residency request.
    c = secondary_seeded((2, 2), (1, 1))
    assert c.promote(ts) is None
    assert c.primary_tiles == ts
    c.evict(TileSet([(0, 1)]))
    assert c.primary_tiles == TileSet([(0, 0), (1, 0)])


def test_tile_set_orders_first_axis_fastest():
    ts = TileSet([(1, 1), (2, 0), (0, 1), (0, 0), (1, 0)])
    assert ts.coordinates == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1))
    assert ts.coordinates == tuple(sorted(ts.coordinates, key=lambda c: tuple(reversed(c))))
    assert TileSet([(3,), (1,), (2,)]).coordinates == ((1,), (2,), (3,))
    ts3 = TileSet([(0, 0, 1), (1, 0, 0), (0, 1, 0)])
    assert ts3.coordinates == ((1, 0, 0), (0, 1, 0), (0, 0, 1))
    # Any finite iterables of integers, captured immutably.
    src = [[1, 0], np.array([0, 1])]
    ts = TileSet(coordinates=(c for c in src))
    src.append([5, 5])
    assert ts.coordinates == ((1, 0), (0, 1))
    assert type(ts.coordinates) is tuple and all(type(c) is tuple for c in ts.coordinates)
    assert all(type(v) is int for c in ts.coordinates for v in c)
    assert TileSet({(0,), (1,)}).coordinates == ((0,), (1,))


@pytest.mark.parametrize("coordinates", [5, None, 1.5, [5], [(0,), 1], [(0.5,)], [("a",)], [(True,)], ["ab"]],
                         ids=repr)
def test_tile_set_rejects_non_iterables_and_non_integers_with_type_error(coordinates):
    with pytest.raises(TypeError):
        TileSet(coordinates)


@pytest.mark.parametrize("coordinates", [[(0,), (0, 1)], [(0, 0), (1,)], [(-1,)], [(0, -2)], [(1, 2), (1, 2)],
                                         [(0,), [0]]], ids=repr)
def test_tile_set_rejects_mixed_ranks_negatives_and_duplicates_with_value_error(coordinates):
    with pytest.raises(ValueError):
        TileSet(coordinates)


def test_empty_tile_set_is_rank_agnostic():
    assert TileSet() == TileSet(coordinates=[]) == TileSet(())
    assert TileSet().coordinates == ()
    for grid in ((3,), (2, 2), (1, 2, 2)):
        c = secondary_seeded(grid, (1,) * len(grid))
        before = snapshot(c)
        assert c.promote(TileSet()) is None and c.evict(TileSet()) is None
        h = c.promote_async(TileSet())
        assert h.wait() is None and h.done
        assert snapshot(c) == before


def test_tile_set_binding_checks_rank_and_range():
    c = secondary_seeded((3, 2), (1, 1))
    before = snapshot(c)
    for ts in (TileSet([(3, 0)]), TileSet([(0, 2)]), TileSet([(0,)]), TileSet([(0, 0, 0)]),
               TileSet([(0, 0), (2, 1), (5, 5)])):  # one bad coordinate fails the whole set
        for request in (c.promote_async, c.evict_async, c.promote, c.evict):
            with pytest.raises(ValueError):
                request(ts)
    assert snapshot(c) == before


def test_tile_selection_tile_set_contains_its_unique_coordinates():
    sel = TileSelection([[7, 2], [4, 9]])
    ts = sel.tile_set
    assert isinstance(ts, TileSet)
    assert set(ts.coordinates) == set(sel.coordinates) and len(ts.coordinates) == 4
    assert ts == TileSet(sel.coordinates)
    assert ts.coordinates == ((2, 4), (7, 4), (2, 9), (7, 9))  # TileSet's own order, not the selection's


def test_tile_set_is_frozen_hashable_equal_by_value_with_repr():
    a = TileSet([(1, 0), (0, 1)])
    b = TileSet(coordinates=[(0, 1), (1, 0)])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != TileSet([(0, 1)])
    assert repr(a) == "TileSet(coordinates=((1, 0), (0, 1)))"
    assert repr(TileSet()) == "TileSet(coordinates=())"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.coordinates = ()
    assert a.coordinates == ((1, 0), (0, 1))


def test_residency_plan_defaults_and_fields():
    p = ResidencyPlan()
    assert p.promote == TileSet() and p.retain == TileSet() and p.evict == TileSet()
    assert all(isinstance(getattr(p, f), TileSet) for f in ("promote", "retain", "evict"))
    q = ResidencyPlan(promote=TileSet([(0,)]), retain=None, evict=TileSet([(2,), (1,)]))
    assert q.promote == TileSet([(0,)]) and q.retain == TileSet() and q.evict.coordinates == ((1,), (2,))
    assert ResidencyPlan(TileSet([(0,)])) == ResidencyPlan(promote=TileSet([(0,)]))
    assert [f.name for f in dataclasses.fields(ResidencyPlan)] == ["promote", "retain", "evict"]


@pytest.mark.parametrize("field", ["promote", "retain", "evict"])
@pytest.mark.parametrize("value", [[(0,)], ((0,),), TileSelection([[0]]), "a", 0], ids=repr)
def test_residency_plan_rejects_non_tile_sets_with_type_error(field, value):
    with pytest.raises(TypeError):
        ResidencyPlan(**{field: value})


@pytest.mark.parametrize("fields", [("promote", "retain"), ("promote", "evict"), ("retain", "evict")])
def test_residency_plan_rejects_a_tile_in_two_fields_with_value_error(fields):
    kwargs = {fields[0]: TileSet([(0, 0), (1, 0)]), fields[1]: TileSet([(1, 0)])}
    with pytest.raises(ValueError):
        ResidencyPlan(**kwargs)
    ResidencyPlan(**{fields[0]: TileSet([(0, 0)]), fields[1]: TileSet([(1, 0)])})  # disjoint is fine


def test_residency_plan_is_frozen_hashable_equal_by_value():
    a = ResidencyPlan(promote=TileSet([(0,)]), evict=TileSet([(1,)]))
    b = ResidencyPlan(TileSet([(0,)]), None, TileSet([(1,)]))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ResidencyPlan(promote=TileSet([(0,)]))
    for field in ("promote", "retain", "evict"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(a, field, TileSet())
    assert "ResidencyPlan(promote=TileSet(coordinates=((0,),))" in repr(a)


# ================================================================ Residency transitions: asynchronous and blocking


def test_prefetch_without_changing_autograd():
    grid, tile, expert, select = moe("out_in_expert", experts=6)
    c = secondary_seeded(grid, tile)
    t = full_tensor(c)
    assert t.is_differentiable() and sw.is_grad_enabled()
    # An ordinary graph built beforehand is untouched by the prefetch.
    x = sw.friendly.tensor([1.0, 2.0])
    y = sw.mul(x, 3.0)
    node = y.autograd_ctx
    layout, version = t.layout, t.version
    sel = select([1, 4])
    h = c.promote_async(sel)
    assert isinstance(h, AwaitResidency) and isinstance(h, sw.AwaitResult)
    assert not isinstance(h, sw.Tensor)
    with pytest.raises(TypeError):
        sw.add(h, x)  # a handle is never a Tensor operand
    assert h.wait() is None
    assert h.wait() is None and h.done  # repeated observations
    # Residency changed...
    assert c.primary_tiles == sel.tile_set
    # ...the full Tensor and the graph did not.
    assert t.carrier is c and t.layout == layout and t.version == version
    assert t.autograd_ctx is None and t.grad is None
    assert y.autograd_ctx is node and node.inputs()[0] is x
    y.backward(sw.friendly.tensor([1.0, 1.0]))
    assert [x.grad[i] for i in range(2)] == [3.0, 3.0]
    # No gradient was attached to the tiled Tensor by the residency request.
    assert t.grad is None


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_evict_a_selected_dirty_tile_set(kind):
    grid, tile, expert, select = moe(kind, experts=6)
    base = TiledEvictable(sw.CPU(0), sw.FileBacked(), grid, tile)
    c = base.allocate_like(base.size())  # implicit zero everywhere
    sel = select([1, 4, 5])
    for e in (1, 4, 5):
        for k, s in enumerate(footprint(c, expert(e))):
            c[s] = float(10 * e + k)
    assert c.dirty_tiles == sel.tile_set
    version = c.version
    bytes_evicted = c.stats()["bytes_evicted"]

    assert c.evict(sel) is None

    assert c.secondary_tiles == sel.tile_set and c.primary_tiles == TileSet() and c.dirty_tiles == TileSet()
    for e in (1, 4, 5):
        for k, s in enumerate(footprint(c, expert(e))):
            assert c.secondary[s] == float(10 * e + k)
    assert c.stats()["bytes_evicted"] - bytes_evicted == 3 * math.prod(tile) * 4
    assert c.stats()["primary_bytes"] == 0
    assert c.version == version
    # Untouched experts are still implicit zeros.
    assert all(c.tile_state(expert(e)).location == "implicit" for e in (0, 2, 3))
    # Promoting them back gives the same values, clean.
    c.promote(sel)
    assert c.dirty_tiles == TileSet()
    assert all(c[s] == float(10 * 4 + k) for k, s in enumerate(footprint(c, expert(4))))


def test_async_requests_return_before_terminal_completion():
    c = secondary_seeded((4,), (2,))
    h = _pending_promote(c, TileSet([(0,), (1,), (2,)]))
    assert not h.done
    # Pending: the prior residency is still what is observable.
    assert c.primary_tiles == TileSet()
    core._io_unhold()
    assert h.wait() is None and h.done
    assert c.primary_tiles == TileSet([(0,), (1,), (2,)])
    c[0] = 7.0
    c[2] = 8.0
    h = _pending_evict(c, TileSet([(0,), (1,), (2,)]))
    assert not h.done and c.dirty_tiles == TileSet([(0,), (1,)])
    core._io_unhold()
    assert h.wait() is None
    assert c.primary_tiles == TileSet() and c.secondary[0] == 7.0 and c.secondary[2] == 8.0


@pytest.mark.parametrize("via", ["carrier", "facet"])
def test_blocking_forms_return_none_and_match_async_then_wait(via):
    a = secondary_seeded((3, 2), (2, 1))
    b = secondary_seeded((3, 2), (2, 1))
    api_a = a if via == "carrier" else a.facet(TiledResidencyFacet)
    api_b = b if via == "carrier" else b.facet(TiledResidencyFacet)
    steps = [("promote", TileSet([(0, 0), (2, 1)])), ("promote", TileSelection([[1], [0, 1]])),
             ("evict", TileSet([(2, 1), (1, 1)])), ("evict", TileSelection([[0, 1, 2], [0]]))]
    for op, tiles in steps:
        assert getattr(api_a, op)(tiles) is None
        h = getattr(api_b, op + "_async")(tiles)
        assert isinstance(h, AwaitResidency)
        assert h.wait() is None
        assert states(a) == states(b)
        sa, sb = a.stats(), b.stats()
        assert sa == sb
    assert a.primary_tiles == TileSet() and a.valid_tiles == TileSet(tiles_of((3, 2)))


def test_promotion_makes_every_requested_tile_primary_valid():
    base = TiledEvictable(sw.CPU(0), sw.CPU(0), (4,), (2,))
    c = base.allocate_like(8)  # implicit
    c[0] = 1.0  # tile 0 primary dirty
    c.evict(TileSet([(0,)]))  # tile 0 secondary
    c[2] = 2.0  # tile 1 primary dirty
    # Tiles: 0 secondary, 1 primary dirty, 2 and 3 implicit.
    c.promote(TileSet([(0,), (1,), (2,), (3,)]))
    for t in tiles_of((4,)):
        s = c.tile_state(t)
        assert s.location == "primary" and s.valid
    assert [c[i] for i in range(8)] == [1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert c.dirty_tiles == TileSet([(1,), (2,), (3,)])  # materialised zeros are not on secondary yet


def test_repeating_a_satisfied_request_is_idempotent():
    c = secondary_seeded((4,), (2,))
    ts = TileSet([(1,), (3,)])
    c.promote(ts)
    once = snapshot(c)
    assert c.promote(ts) is None and c.promote_async(ts).wait() is None
    assert snapshot(c) == once
    c.evict(ts)
    once = snapshot(c)
    assert c.evict(ts) is None and c.evict_async(ts).wait() is None
    assert snapshot(c) == once


@pytest.mark.parametrize("bad", [[(0,)], ((0,),), None, 0, "tiles", ResidencyPlan(), {(0,)}], ids=repr)
@pytest.mark.parametrize("method", ["promote_async", "evict_async", "promote", "evict"])
def test_residency_requests_reject_other_inputs_with_type_error(method, bad):
    c = secondary_seeded((3,), (2,))
    c.promote(TileSet([(2,)]))
    c[5] = 0.0
    before = snapshot(c)
    for target in (c, c.facet(TiledResidencyFacet)):
        with pytest.raises(TypeError):
            getattr(target, method)(bad)
    with pytest.raises(TypeError):
        getattr(c, method)(c.tile_state((0,)))
    assert snapshot(c) == before


# ================================================================ Residency policy


class RecordingPolicy:
    def __init__(self):
        self.calls = []

    def plan(self, required, purpose):
        self.calls.append((required, purpose))
        return ResidencyPlan()


def test_residency_policy_is_a_runtime_checkable_protocol():
    assert isinstance(RecordingPolicy(), ResidencyPolicy)

    class NoPlan:
        pass

    assert not isinstance(NoPlan(), ResidencyPolicy)
    assert not isinstance(object(), ResidencyPolicy)
    assert callable(getattr(ResidencyPolicy, "plan"))


class _NotCallablePlan:
    plan = 5


@pytest.mark.parametrize("policy", [object(), 5, "plan", _NotCallablePlan()], ids=repr)
def test_non_conforming_policy_fails_construction_with_type_error(policy):
    p, s = sw.CPU(0), sw.FileBacked()
    with pytest.raises(TypeError, match="ResidencyPolicy"):
        TiledEvictable(p, s, (2,), (2,), residency_policy=policy)
    # No instance was exposed and nothing was claimed.
    assert not p.is_owned() and not s.is_owned() and p.is_mutable() and s.is_mutable()
    TiledEvictable(p, s, (2,), (2,))


def test_policy_is_keyword_only_immutable_and_defaults_to_none():
    assert TiledEvictable(sw.CPU(0), sw.CPU(0), (2,), (2,)).residency_policy is None
    assert TiledEvictable(sw.CPU(0), sw.CPU(0), (2,), (2,), residency_policy=None).residency_policy is None
    policy = RecordingPolicy()
    with pytest.raises(TypeError):
        TiledEvictable(sw.CPU(0), sw.CPU(0), (2,), (2,), policy)  # keyword only
    c = TiledEvictable(sw.CPU(0), sw.CPU(0), (2,), (2,), residency_policy=policy)
    assert c.residency_policy is policy
    with pytest.raises(AttributeError):
        c.residency_policy = RecordingPolicy()
    with pytest.raises(AttributeError):
        c.residency_policy = None
    assert c.residency_policy is policy


def test_residency_requests_and_value_access_do_not_invoke_the_policy():
    """The policy is consulted only for operation, projection, scatter and backward requests."""
    policy = RecordingPolicy()
    c = secondary_seeded((4,), (2,), policy=policy)
    c.promote(TileSet([(0,), (1,)]))
    c.promote_async(TileSelection([[2]])).wait()
    c[0] = 3.0
    _ = c[7]
    c.evict(TileSet([(0,), (3,)]))
    c.facet(TiledResidencyFacet).evict_async(TileSet([(1,)])).wait()
    c._check_footprints(full_tensor(c))
    z = c.allocate_like(8)
    z[1] = 1.0
    assert policy.calls == []


# ================================================================ Tiled release ends all owned residency


def test_release_after_completed_tiled_work():
    c = secondary_seeded((4,), (2,))
    c.promote(TileSet([(0,), (1,)]))
    c[0] = 5.0
    assert c.primary_tiles and c.secondary_tiles  # tiles in both tiers
    primary, secondary = c.primary, c.secondary
    t = full_tensor(c)
    assert not c.is_owned()

    assert c.release() is None

    assert c.is_released()
    assert primary.is_released() and secondary.is_released()  # both tiers' resources are gone
    assert c.stats()["primary_tiles"] == 0 and c.stats()["primary_bytes"] == 0
    assert c.release() is None and c.is_released()  # idempotent
    later = [
        lambda: c.promote(TileSet([(2,)])),
        lambda: c.evict(TileSet([(0,)])),
        lambda: c.promote_async(TileSet([(3,)])),
        lambda: c.evict_async(TileSet()),
        lambda: c.promote(TileSet()),
        lambda: c.facet(TiledResidencyFacet).promote(TileSelection([[0]])),
        lambda: c.facet(TiledResidencyFacet).evict_async(TileSet([(1,)])),
        lambda: c[0],
        lambda: c.__setitem__(0, 1.0),
        lambda: t[(0,)],
        lambda: c.tile_state((0,)),
        lambda: secondary[0],
    ]
    for request in later:
        with pytest.raises(RuntimeError):
            request()
    # Metadata that needs no storage keeps working (docs/guide.md, "Carriers").
    assert c.dtype() is F32 and c.supports_storage_dtype(F32)
    assert c.new_like([1.0] * 8)[7] == 1.0


@pytest.mark.parametrize("pending_kind", ["promote", "evict"])
def test_release_with_incomplete_work_fails_and_releases_nothing(pending_kind):
    c, h = _conflict_fixture(pending_kind)
    before = snapshot(c, secondary_values=False, skip={(0,), (1,)})
    with pytest.raises(RuntimeError, match="wait"):
        c.release()
    assert not c.is_released() and not c.primary.is_released() and not c.secondary.is_released()
    assert snapshot(c, secondary_values=False, skip={(0,), (1,)}) == before
    assert not h.done  # not cancelled either
    core._io_unhold()
    assert h.wait() is None
    # The request committed normally, values intact.
    if pending_kind == "promote":
        assert c.primary_tiles == TileSet([(0,), (1,), (2,)])
        assert [c[s] for s in range(4)] == [1.0, 2.0, 3.0, 4.0]
    else:
        assert c.primary_tiles == TileSet([(2,)])
        assert [c.secondary[s] for s in range(4)] == [-0.5, 2.0, -2.0, 4.0]
    assert c.release() is None and c.is_released()


# ================================================================ Storage: memory and write accounting


def test_evicted_tiles_free_primary_memory():
    c = secondary_seeded((6,), (256,))
    tb = 256 * 4
    assert c.stats()["primary_bytes"] == 0
    c.promote(TileSet([(t,) for t in range(6)]))
    assert c.stats()["primary_bytes"] == 6 * tb and c.stats()["primary_tiles"] == 6
    c.evict(TileSet([(1,), (4,)]))
    assert c.stats()["primary_bytes"] == 4 * tb and c.stats()["primary_tiles"] == 4
    c.evict(TileSelection([range(6)]))
    assert c.stats()["primary_bytes"] == 0 and c.stats()["primary_tiles"] == 0
    assert c.primary.size() == 0  # the primary tier is only the prototype of per-tile storage


def test_clean_tile_with_valid_secondary_is_evicted_without_writing():
    c = secondary_seeded((4,), (64,))
    c.promote(TileSet([(0,), (1,), (2,)]))
    s0 = c.stats()
    # Every write would fail: a clean eviction must not write at all.
    core._io_inject("pwrite", errno.EIO, count=-1)
    assert c.evict(TileSet([(0,), (2,)])) is None
    core._io_clear()
    s1 = c.stats()
    assert s1["writes_skipped"] - s0["writes_skipped"] == 2
    assert s1["bytes_evicted"] == s0["bytes_evicted"]
    assert s1["evictions"] - s0["evictions"] == 2
    assert c.secondary_tiles == TileSet([(0,), (2,), (3,)])
    assert c[0] == 1.0 and c[128] == 129.0


def test_dirty_tiles_are_written_on_eviction():
    c = secondary_seeded((4,), (64,))
    c.promote(TileSet([(0,), (1,)]))
    c[70] = -70.0
    s0 = c.stats()
    c.evict(TileSet([(0,), (1,)]))
    s1 = c.stats()
    assert s1["bytes_evicted"] - s0["bytes_evicted"] == 64 * 4  # tile 1 only
    assert s1["writes_skipped"] - s0["writes_skipped"] == 1  # tile 0
    assert c.secondary[70] == -70.0 and c.secondary[69] == 70.0
    # A residency round trip preserves the value and never touches the version.
    version = c.version
    c.promote(TileSet([(1,)]))
    assert c[70] == -70.0 and c.version == version
    assert s1["bytes_promoted"] - s0["bytes_promoted"] == 0
    assert c.stats()["bytes_promoted"] - s1["bytes_promoted"] == 64 * 4


def test_sixty_four_one_mib_tiles_with_eight_resident_stay_within_eight_mib():
    tile = 262144  # Float32: 1 MiB per tile
    n = 64
    sec = sw.FileBacked().allocate_like(n * tile)  # 64 MiB of zeros on file
    c = TiledEvictable(sw.CPU(0), sec, (n,), (tile,))
    overhead = 64 * 1024
    peak = 0
    for start in range(0, n, 8):
        window = TileSet([(t,) for t in range(start, start + 8)])
        c.promote(window)
        s = c.stats()
        peak = max(peak, s["primary_bytes"])
        assert s["primary_tiles"] == 8
        assert s["primary_bytes"] <= 8 * MiB + overhead
        c[start * tile + 5] = float(start + 1)  # one dirty tile per window
        c.evict(window)
        assert c.stats()["primary_bytes"] == 0
    assert peak == 8 * MiB
    s = c.stats()
    assert s["bytes_evicted"] == 8 * MiB and s["writes_skipped"] == 56 and s["bytes_promoted"] == 64 * MiB
    assert c.secondary[8 * tile + 5] == 9.0
    c.release()


# ================================================================ Model-based test


class _Model:
    """A plain Python model of a TiledEvictable: values, locations, dirtiness, version and counters."""

    def __init__(self, grid, tile, dtype):
        self.grid, self.tile, self.dtype = grid, tile, dtype
        self.logical = tuple(g * t for g, t in zip(grid, tile))
        self.n = math.prod(self.logical)
        self.tiles = tiles_of(grid)
        shape = sw.Shape(*self.logical)
        self.tile_of = [tuple(x // t for x, t in zip(shape.decode(s), tile)) for s in range(self.n)]
        self.slots = {t: [s for s in range(self.n) if self.tile_of[s] == t] for t in self.tiles}
        self.tile_bytes = math.prod(tile) * 4
        self.vals = [None] * self.n
        self.loc = {t: "invalid" for t in self.tiles}
        self.dirty = {t: False for t in self.tiles}
        self.version = 0
        self.evictions = self.writes_skipped = self.bytes_evicted = 0

    def promote(self, tiles):
        if any(self.loc[t] == "invalid" for t in tiles):
            return "invalid"
        for t in tiles:
            if self.loc[t] == "secondary":
                self.loc[t], self.dirty[t] = "primary", False
            elif self.loc[t] == "implicit":
                self.loc[t], self.dirty[t] = "primary", True
        return None

    def evict(self, tiles):
        for t in tiles:
            if self.loc[t] == "primary":
                self.evictions += 1
                if self.dirty[t]:
                    self.bytes_evicted += self.tile_bytes
                else:
                    self.writes_skipped += 1
                self.loc[t], self.dirty[t] = "secondary", False

    def write(self, slot, value):
        t = self.tile_of[slot]
        if self.loc[t] == "invalid":
            return "invalid"
        self.loc[t], self.dirty[t] = "primary", True
        self.vals[slot] = value
        self.version += 1
        return None

    def read(self, slot):
        t = self.tile_of[slot]
        if self.loc[t] == "invalid":
            return "invalid"
        return None  # a read never moves a tile (Note [Reading a slot never moves a tile])


def _check_against_model(c, m, t):
    for coord in m.tiles:
        s = c.tile_state(coord)
        assert (s.location, s.valid, s.dirty) == (m.loc[coord], m.loc[coord] != "invalid", m.dirty[coord]), coord
    where = lambda pred: TileSet([x for x in m.tiles if pred(x)])  # noqa: E731
    assert c.primary_tiles == where(lambda x: m.loc[x] == "primary")
    assert c.secondary_tiles == where(lambda x: m.loc[x] == "secondary")
    assert c.valid_tiles == where(lambda x: m.loc[x] != "invalid")
    assert c.dirty_tiles == where(lambda x: m.dirty[x])
    assert c.version == m.version == t.version
    stats = c.stats()
    resident = sum(1 for x in m.tiles if m.loc[x] == "primary")
    assert stats["primary_tiles"] == resident and stats["primary_bytes"] == resident * m.tile_bytes
    assert (stats["evictions"], stats["writes_skipped"], stats["bytes_evicted"]) == (
        m.evictions, m.writes_skipped, m.bytes_evicted)
    for slot in range(m.n):
        loc = m.loc[m.tile_of[slot]]
        if loc in ("primary", "implicit"):
            assert c[slot] == m.vals[slot], slot
        if loc == "secondary" or (loc == "primary" and not m.dirty[m.tile_of[slot]]):
            assert c.secondary[slot] == m.vals[slot], slot  # the secondary copy is valid
    assert t.carrier is c and t.layout == column_major(*m.logical)


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_model_based_residency(data):
    rank = data.draw(st.integers(1, 3), label="rank")
    grid = tuple(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank), label="grid"))
    tile = tuple(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank), label="tile"))
    secondary = data.draw(st.sampled_from(["file", "cpu"]), label="secondary")
    start = data.draw(st.sampled_from(["secondary", "primary", "both", "implicit", "new_like", "invalid"]),
                      label="start")
    dtype = data.draw(st.sampled_from([F32, I32]), label="dtype")
    m = _Model(grid, tile, dtype)
    conv = float if dtype is F32 else int
    seed_vals = [conv((s * 7) % 97 + 1) for s in range(m.n)]
    empty_secondary = lambda: sw.FileBacked(dtype=dtype) if secondary == "file" else sw.CPU(0, dtype=dtype)  # noqa
    full_secondary = lambda vals: file_with(vals, dtype) if secondary == "file" else cpu_with(vals, dtype)  # noqa
    if start == "secondary":
        c = TiledEvictable(sw.CPU(0, dtype=dtype), full_secondary(seed_vals), grid, tile)
        m.vals = list(seed_vals)
        m.loc = {x: "secondary" for x in m.tiles}
    elif start in ("primary", "both"):
        sec = full_secondary([conv(500)] * m.n) if start == "both" else empty_secondary()
        c = TiledEvictable(cpu_with(seed_vals, dtype), sec, grid, tile)
        m.vals = list(seed_vals)
        m.loc = {x: "primary" for x in m.tiles}
        m.dirty = {x: True for x in m.tiles}
    else:
        base = TiledEvictable(sw.CPU(0, dtype=dtype), empty_secondary(), grid, tile)
        if start == "implicit":
            c = base.allocate_like(m.n)
            m.vals = [conv(0)] * m.n
            m.loc = {x: "implicit" for x in m.tiles}
        elif start == "new_like":
            c = base.new_like(seed_vals)
            m.vals = list(seed_vals)
            m.loc = {x: "primary" for x in m.tiles}
            m.dirty = {x: True for x in m.tiles}
        else:
            c = base
    t = full_tensor(c)
    shape = sw.Shape(*m.logical)
    _check_against_model(c, m, t)

    tile_sets = st.lists(st.sampled_from(m.tiles), unique=True, max_size=len(m.tiles))
    steps = data.draw(st.integers(1, 30), label="steps")
    for _ in range(steps):
        op = data.draw(st.sampled_from(["promote", "evict", "write", "read", "twrite", "tread"]), label="op")
        if op in ("promote", "evict"):
            form = data.draw(st.sampled_from(["set", "selection"]), label="form")
            if form == "set":
                chosen = data.draw(tile_sets, label="tiles")
                request = TileSet(chosen)
            else:
                axes = [data.draw(st.lists(st.integers(0, g - 1), unique=True, min_size=1), label="axis")
                        for g in grid]
                request = TileSelection(axes)
                chosen = list(request.coordinates)
            api = data.draw(st.sampled_from(["blocking", "async", "facet"]), label="api")
            target = c.facet(TiledResidencyFacet) if api == "facet" else c
            call = (lambda: getattr(target, op + "_async")(request).wait()) if api == "async" else (
                lambda: getattr(target, op)(request))
            expected = m.promote(chosen) if op == "promote" else m.evict(chosen)
            if expected == "invalid":
                with pytest.raises(RuntimeError, match="invalid"):
                    call()
            else:
                assert call() is None
        else:
            slot = data.draw(st.integers(0, m.n - 1), label="slot")
            if op in ("write", "twrite"):
                value = conv(data.draw(st.integers(-1000, 1000), label="value"))
                do = (lambda: c.__setitem__(slot, value)) if op == "write" else (
                    lambda: t.__setitem__(shape.decode(slot), value))
                expected = m.write(slot, value)
                if expected == "invalid":
                    with pytest.raises(RuntimeError, match="invalid"):
                        do()
                else:
                    do()
            else:
                do = (lambda: c[slot]) if op == "read" else (lambda: t[shape.decode(slot)])
                expected = m.read(slot)
                if expected == "invalid":
                    with pytest.raises(RuntimeError, match="invalid"):
                        do()
                else:
                    assert do() == m.vals[slot]
        _check_against_model(c, m, t)
    c.release()
    assert c.is_released() and c.primary.is_released() and c.secondary.is_released()
