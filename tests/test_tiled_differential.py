"""Randomised differential tests for TiledEvictable projection, scatter and their autograd.

Every case draws, from its own seeded ``numpy.random.default_rng``:

* a tile geometry of rank 1 to 3 (``grid_shape`` and ``tile_shape`` per axis,
  at most ``MAX_SLOTS`` Float32 slots);
* a footprint-valid full-Tensor Layout that permutes elements inside tiles
  (mission, "Tensor Layout compatibility preserves exact carrier tile
  footprints": any injective within-tile ordering whose image is exactly the
  carrier tile footprint is compatible). The carrier's canonical slot of a
  logical coordinate ``x`` is ``sum(x[k] * S[k])`` with ``S`` the dense
  first-mode-fastest strides of ``logical_shape`` (docs/guide.md, "TiledEvictable"). The
  generator splits each tile's canonical slot set into maximal contiguous runs,
  refines the runs into prime "digits" in a random order, hands the digits to
  the logical axes (a prime of one axis may land on another axis: a within-tile
  transpose) in a random order, optionally re-merges contiguous neighbours and
  nests them, and appends the tile-index digit of each axis at its canonical
  stride. The generator checks its own output (a bijection onto the slots, and
  every logical tile reaching exactly its own carrier tile footprint);
* a TileSelection (random non-empty subset per axis, random order; the
  mission forbids duplicates within an axis, which is asserted, and repeated
  tiles are exercised through several overlapping selections instead);
* a residency mix: tiles promoted, dirtied by a public write and evicted
  through the blocking, asynchronous and facet forms of the residency API,
  starting from either a full secondary or a full primary tier.

The oracle is plain NumPy indexed by logical coordinate, plus the same
compact computation run on dense ``friendly.tensor`` leaves.

Tests:

* test_projection_matches_numpy_gather: three projections per case (default,
  allocatable and sized destinations) equal the NumPy gather, also tile by tile
  in ``selection.coordinates`` order; dense Layout, dtype, handle identity;
  source Layout, version, values and unselected tile states unchanged.
* test_scatter_then_project_returns_compact: replace scatter then project
  reproduces compact exactly (also after evicting written tiles, and for a
  reordered sub-selection); add scatter equals template + compact in NumPy;
  add and replace onto a scatter result; the written values sit at the slots
  the template's permuted Layout assigns; result tile states and version;
  inputs unchanged.
* test_projection_gradient_matches_dense: ``full.grad`` after a compact
  computation (mul/sum, relu, matmul on either side, two overlapping paths,
  two accumulating backwards, a projection path plus a direct operation) equals
  the dense run's leaf gradients scatter-added in NumPy, read both slot by slot
  (physically permuted like the primal) and by projection; untouched tiles are
  implicit zero. Source and gradient tiles are evicted before each backward.
* test_scatter_gradients_match_dense: the scatter node's gradients to compact
  and template, for replace and add, under a consuming projection, an explicit
  tiled seed, and a compact that is itself derived from a projection of the
  template's tensor.
* test_generator_covers_permuted_geometries: the generator is not vacuous.

Seeds: each test is parametrised over ``N_SEEDS`` seeds; the seed and the
drawn case are printed (shown by pytest on failure). ``SW_TEST_SEED=<int>``
runs only that seed, ``SW_TEST_SEEDS=<n>`` changes the count.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly
from strideweave.carriers.tiled_evictable import (
    TiledEvictable,
    TiledResidencyFacet,
    TileSelection,
    TileSet,
)
from models import column_major_strides

F32 = DType.Float32
MAX_SLOTS = 1500
TILE_EXTENTS = (1, 2, 3, 4, 6, 8, 9, 12)
BASE_SEED = 7_301_000
N_SEEDS = int(os.environ.get("SW_TEST_SEEDS", "60"))
if os.environ.get("SW_TEST_SEED"):
    SEEDS = [int(os.environ["SW_TEST_SEED"])]
else:
    SEEDS = list(range(BASE_SEED, BASE_SEED + N_SEEDS))

# Float32 tolerances for computations that sum (compact VJPs compared with the dense run,
# scatter-add). Pure data movement (projection, replace scatter, explicit seeds) is exact.
RTOL, ATOL = 1e-5, 1e-6


pytestmark = pytest.mark.usefixtures("grad_mode_on")


def case_rng(seed: int, salt: int) -> np.random.Generator:
    print(f"seed={seed} (rerun with SW_TEST_SEED={seed})")
    return np.random.default_rng([seed, salt])


# ================================================================ geometry and layout generation


def prime_factors(n: int) -> list:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def random_geometry(rng, rank=None):
    while True:
        r = int(rng.integers(1, 4)) if rank is None else rank
        grid = tuple(int(rng.integers(1, 5)) for _ in range(r))
        tile = tuple(int(rng.choice(TILE_EXTENTS)) for _ in range(r))
        tiles = int(np.prod(grid))
        if tiles >= 2 and tiles * int(np.prod(tile)) <= MAX_SLOTS and any(t > 1 for t in tile):
            return grid, tile


class TiledLayout:
    """A footprint-valid Layout over (grid, tile) and its slot map computed independently in NumPy."""

    def __init__(self, rng, grid, tile, permute=True):
        self.grid, self.tile = tuple(grid), tuple(tile)
        rank = len(grid)
        self.logical_shape = tuple(g * t for g, t in zip(grid, tile))
        S = column_major_strides(self.logical_shape)
        self.canonical_strides = S
        # Maximal contiguous runs of one tile's canonical slot set.
        runs = []
        for k in range(rank):
            if tile[k] == 1:
                continue
            if runs and runs[-1][0] * runs[-1][1] == S[k]:
                runs[-1][0] *= tile[k]
            else:
                runs.append([tile[k], S[k]])
        # Prime digits of each run, in random order (or canonical order when not permuting).
        physical = {}
        for n, s in runs:
            primes = prime_factors(n)
            if permute:
                rng.shuffle(primes)
            stride = s
            for p in primes:
                physical.setdefault(p, []).append(stride)
                stride *= p
        if permute:
            for p in physical:
                rng.shuffle(physical[p])
        else:
            for p in physical:
                physical[p].reverse()  # pop() then yields them in canonical order
        shape_modes, stride_modes, self.digits = [], [], []
        for k in range(rank):
            within = [(p, physical[p].pop()) for p in prime_factors(tile[k])]
            if permute:
                within = [within[i] for i in rng.permutation(len(within))]
            merged = []
            for e, s in within:
                if merged and merged[-1][0] * merged[-1][1] == s and (not permute or rng.random() < 0.5):
                    merged[-1] = (merged[-1][0] * e, merged[-1][1])
                else:
                    merged.append((e, s))
            tile_digits = []
            if grid[k] > 1:
                base = S[k] * tile[k]
                g = grid[k]
                if permute and g == 4 and rng.random() < 0.3:
                    tile_digits = [(2, base), (2, 2 * base)]
                else:
                    tile_digits = [(g, base)]
            flat = merged + tile_digits
            self.digits.append(flat)
            if not flat:
                shape_modes.append(1)
                stride_modes.append(S[k])
            elif len(flat) == 1:
                shape_modes.append(flat[0][0])
                stride_modes.append(flat[0][1])
            elif len(merged) >= 2 and tile_digits and permute and rng.random() < 0.5:
                shape_modes.append([[e for e, _ in merged]] + [e for e, _ in tile_digits])
                stride_modes.append([[s for _, s in merged]] + [s for _, s in tile_digits])
            else:
                shape_modes.append([e for e, _ in flat])
                stride_modes.append([s for _, s in flat])
        self.layout = Layout(Shape(shape_modes), Stride(stride_modes))  # one iterable: the mode list
        # offsets[x] = the slot the Layout assigns to logical coordinate x (top-level ordinals).
        per_axis = []
        for k in range(rank):
            x = np.arange(self.logical_shape[k])
            off = np.zeros_like(x)
            rest = x.copy()
            for e, s in self.digits[k]:
                off += (rest % e) * s
                rest //= e
            per_axis.append(off)
        self.offsets = sum(np.ix_(*per_axis)) if rank > 1 else per_axis[0]
        self.canonical = sum(np.ix_(*[np.arange(n) * s for n, s in zip(self.logical_shape, S)])) if rank > 1 \
            else np.arange(self.logical_shape[0])
        self.permuted = not np.array_equal(self.offsets, self.canonical)
        self._self_check()

    def _self_check(self):
        total = int(np.prod(self.logical_shape))
        assert sorted(self.offsets.ravel().tolist()) == list(range(total))
        # Each logical tile reaches exactly its own carrier tile footprint.
        idx = np.indices(self.logical_shape)
        for k, (t, s, n) in enumerate(zip(self.tile, self.canonical_strides, self.logical_shape)):
            physical_tile = ((self.offsets // s) % n) // t
            assert np.array_equal(physical_tile, idx[k] // t)

    def describe(self):
        return f"grid={self.grid} tile={self.tile} layout={self.layout} permuted={self.permuted}"


class Full:
    """A full Tensor over a fresh TiledEvictable, with its logical values kept in NumPy."""

    def __init__(self, rng, geo: TiledLayout, values=None, seeded="random"):
        self.geo = geo
        self.values = (rng.standard_normal(geo.logical_shape).astype(np.float32) if values is None
                       else np.array(values, dtype=np.float32, copy=True))
        slots = np.empty(self.values.size, np.float32)
        slots[geo.offsets] = self.values
        if seeded == "random":
            seeded = "primary" if rng.random() < 0.3 else "secondary"
        self.seeded = seeded
        if seeded == "primary":
            primary = friendly.tensor(slots).carrier
            assert type(primary) is sw.CPU and primary.size() == slots.size
            self.carrier = TiledEvictable(primary, sw.FileBacked(), geo.grid, geo.tile)
        else:
            secondary = sw.move(friendly.tensor(slots), sw.FileBacked()).carrier
            self.carrier = TiledEvictable(sw.CPU(0), secondary, geo.grid, geo.tile)
        self.full = Tensor(self.carrier, 0, geo.layout)
        c = self.carrier
        assert c.grid_shape == geo.grid and c.tile_shape == geo.tile and c.logical_shape == geo.logical_shape
        want = "primary" if seeded == "primary" else "secondary"
        assert all(c.tile_state(t).location == want and c.tile_state(t).valid for t in self.tiles())

    def tiles(self):
        return all_tiles(self.geo.grid)


def all_tiles(grid):
    """Every tile coordinate, first axis fastest."""
    return [tuple(reversed(t)) for t in itertools.product(*(range(g) for g in reversed(grid)))]


# ================================================================ selections and oracles


def random_selection(rng, grid) -> TileSelection:
    per_axis = []
    for g in grid:
        n = int(rng.integers(1, g + 1))
        per_axis.append([int(v) for v in rng.permutation(g)[:n]])
    return TileSelection(per_axis)


def overlapping_selection(rng, grid, sel: TileSelection) -> TileSelection:
    """A second selection sharing at least one tile with sel."""
    per_axis = []
    for g, axis in zip(grid, sel.per_axis):
        keep = int(rng.choice(axis))
        others = [v for v in range(g) if v != keep and rng.random() < 0.5]
        axis2 = [keep] + others
        per_axis.append([axis2[i] for i in rng.permutation(len(axis2))])
    return TileSelection(per_axis)


def sub_selection(rng, sel: TileSelection) -> TileSelection:
    """A non-empty sub-product of sel's tiles in a new random order."""
    per_axis = []
    for axis in sel.per_axis:
        n = int(rng.integers(1, len(axis) + 1))
        per_axis.append([axis[i] for i in rng.permutation(len(axis))[:n]])
    return TileSelection(per_axis)


def region_index(tile, per_axis):
    return np.ix_(*[np.concatenate([np.arange(s * t, (s + 1) * t) for s in axis]) for axis, t in zip(per_axis, tile)])


def gather(values, tile, sel: TileSelection) -> np.ndarray:
    """NumPy projection oracle: the selected logical tile blocks, compact first-mode-fastest."""
    return values[region_index(tile, sel.per_axis)]


def scatter_add(shape, tile, sel: TileSelection, compact) -> np.ndarray:
    out = np.zeros(shape, np.float32)
    np.add.at(out, region_index(tile, sel.per_axis), compact)  # index sets are duplicate-free anyway
    return out


def tile_block(tile, coord):
    return tuple(slice(c * t, (c + 1) * t) for c, t in zip(coord, tile))


def logical_values(t: Tensor) -> np.ndarray:
    """The logical values of a full tiled tensor, read by projecting every tile (no graph)."""
    c = t.carrier
    with sw.no_grad():
        compact = c.project(t, TileSelection([range(g) for g in c.grid_shape])).wait()
    return np.array(np.asarray(compact), copy=True)


def slot_values(carrier, n) -> np.ndarray:
    return np.array([carrier[i] for i in range(n)], dtype=np.float32)


def cpu(values) -> Tensor:
    return friendly.tensor(np.ascontiguousarray(values, dtype=np.float32))


def states(carrier, tiles):
    return {t: carrier.tile_state(t) for t in tiles}


# ================================================================ residency


def _residency_call(rng, carrier, kind, tiles: TileSet):
    form = int(rng.integers(3))
    if form == 0:
        getattr(carrier, kind)(tiles)
    elif form == 1:
        handle = getattr(carrier, kind + "_async")(tiles)
        assert handle.wait() is None
    else:
        facet = carrier.facet(TiledResidencyFacet)
        assert getattr(facet, kind)(tiles) is None


def random_residency(rng, w: Full):
    """Promote, dirty (by public writes) and evict random tile subsets; returns the dirty set."""
    c = w.carrier
    tiles = w.tiles()
    promote = [t for t in tiles if rng.random() < 0.5]
    if promote:
        _residency_call(rng, c, "promote", TileSet(promote))
    primary = {t for t in tiles if c.tile_state(t).location == "primary"}
    assert set(promote) <= primary
    dirty = set()
    version = c.version
    for t in sorted(primary):
        if rng.random() < 0.5:
            x = tuple(ci * ti + int(rng.integers(ti)) for ci, ti in zip(t, w.geo.tile))
            v = float(np.float32(rng.standard_normal()))
            w.full[x] = v
            w.values[x] = v
            dirty.add(t)
    assert c.version == version + len(dirty)
    evict = [t for t in tiles if rng.random() < 0.35]
    if evict:
        _residency_call(rng, c, "evict", TileSet(evict))
    for t in tiles:
        st = c.tile_state(t)
        assert st.valid, (t, st)
        if t in evict:
            assert st.location == "secondary" and not st.dirty, (t, st)
        elif t in primary:
            assert st.location == "primary", (t, st)
            if t in dirty:
                assert st.dirty, (t, st)
        else:
            assert st.location == ("secondary" if w.seeded == "secondary" else "primary"), (t, st)
    print(f"residency: seeded={w.seeded} promoted={promote} dirtied={sorted(dirty)} evicted={evict}")
    return dirty - set(evict)


def make_case(rng, rank=None):
    grid, tile = random_geometry(rng, rank)
    geo = TiledLayout(rng, grid, tile, permute=rng.random() < 0.9)
    print(geo.describe())
    w = Full(rng, geo)
    # The engine's Layout agrees with the independently computed slot map.
    for _ in range(5):
        x = tuple(int(rng.integers(n)) for n in geo.logical_shape)
        assert w.full.layout.index(x) == int(geo.offsets[x])
    return geo, w


def assert_tiled_gradient(g: Tensor, w: Full):
    c = w.carrier
    assert g is not None and isinstance(g.carrier, TiledEvictable) and g.carrier is not c
    assert g.layout == w.full.layout and g.offset == w.full.offset and g.dtype() is F32
    gc = g.carrier
    assert gc.grid_shape == c.grid_shape and gc.tile_shape == c.tile_shape and gc.logical_shape == c.logical_shape
    assert type(gc.primary) is type(c.primary) and type(gc.secondary) is type(c.secondary)


# ================================================================ (1) projection vs NumPy gather


def test_generator_covers_permuted_geometries():
    """The layout generator is not vacuous: most drawn layouts permute tiles, every rank occurs."""
    rng = np.random.default_rng(BASE_SEED)
    ranks, permuted, cross_axis = set(), 0, 0
    n = 300
    for _ in range(n):
        grid, tile = random_geometry(rng)
        geo = TiledLayout(rng, grid, tile)
        ranks.add(len(grid))
        permuted += geo.permuted
        # a within-tile digit whose physical stride belongs to another axis' canonical range
        cross_axis += any(s < geo.canonical_strides[k] for k, d in enumerate(geo.digits) for _, s in d)
    assert ranks == {1, 2, 3}
    assert permuted >= n // 2 and cross_axis >= n // 10, (permuted, cross_axis)


@pytest.mark.parametrize("seed", SEEDS)
def test_projection_matches_numpy_gather(seed):
    rng = case_rng(seed, 1)
    geo, w = make_case(rng)
    c = w.carrier
    dirty = random_residency(rng, w)
    tiles = w.tiles()
    version = c.version
    layout = w.full.layout

    # Duplicates within an axis are not a TileSelection (mission: "an axis contains a duplicate").
    axis = int(rng.integers(len(geo.grid)))
    dup = [[0] for _ in geo.grid]
    dup[axis] = [0, 0]
    with pytest.raises(ValueError):
        TileSelection(dup)

    for _ in range(3):
        sel = random_selection(rng, geo.grid)
        before = states(c, tiles)
        choice = int(rng.integers(3))
        expected = gather(w.values, geo.tile, sel)
        dest = [None, sw.CPU(0), sw.CPU(expected.size + int(rng.integers(0, 5)))][choice]
        handle = c.project(w.full, sel) if dest is None else c.project(w.full, sel, dest)
        compact = handle.wait()
        print(f"selection={sel.per_axis} destination={'default' if dest is None else dest.size()}")
        assert handle.wait() is compact
        assert isinstance(compact, Tensor) and type(compact.carrier) is sw.CPU
        if dest is not None:
            assert compact.carrier is dest and compact.offset == 0
        assert compact.dtype() is F32
        assert compact.layout == friendly.column_major(*expected.shape)
        got = np.asarray(compact)
        np.testing.assert_array_equal(got, expected)
        # Tile by tile in selection.coordinates order (compact tile k decodes first-mode-fastest).
        cgrid = sel.compact_grid_shape
        for k, source in enumerate(sel.coordinates):
            ccoord = tuple((k // int(np.prod(cgrid[:i]))) % cgrid[i] for i in range(len(cgrid)))
            np.testing.assert_array_equal(got[tile_block(geo.tile, ccoord)], w.values[tile_block(geo.tile, source)])
        # The source is unchanged; only selected tiles' residency may differ.
        assert w.full.layout == layout and w.full.carrier is c and c.version == version
        after = states(c, tiles)
        for t in tiles:
            assert after[t].valid
            if t not in sel.coordinates:
                assert after[t] == before[t], (t, before[t], after[t])
            elif t in dirty:
                assert after[t].location == "primary" and after[t].dirty
        assert not c.is_owned()
    # Every logical value, whatever its residency, is still what it was.
    np.testing.assert_array_equal(logical_values(w.full), w.values)
    assert c.version == version


# ================================================================ (2) scatter then project


@pytest.mark.parametrize("seed", SEEDS)
def test_scatter_then_project_returns_compact(seed):
    rng = case_rng(seed, 2)
    geo, w = make_case(rng)
    c = w.carrier
    random_residency(rng, w)
    tiles = w.tiles()
    sel = random_selection(rng, geo.grid)
    compact_np = rng.standard_normal(gather(w.values, geo.tile, sel).shape).astype(np.float32)
    compact = cpu(compact_np)
    before, version = states(c, tiles), c.version
    print(f"selection={sel.per_axis}")
    selected = set(sel.coordinates)
    total = int(np.prod(geo.logical_shape))

    def check_result(result, expected_full):
        rc = result.carrier
        assert isinstance(rc, TiledEvictable) and rc is not c
        assert result.layout == w.full.layout and result.offset == w.full.offset and result.dtype() is F32
        assert rc.grid_shape == geo.grid and rc.tile_shape == geo.tile and rc.logical_shape == geo.logical_shape
        assert type(rc.primary) is type(c.primary) and type(rc.secondary) is type(c.secondary)
        assert rc.version == 1
        for t in tiles:
            st = rc.tile_state(t)
            if t in selected:
                assert (st.location, st.valid, st.dirty) == ("primary", True, True), (t, st)
            else:
                assert (st.location, st.valid) == ("invalid", False), (t, st)
        # Physically, each selected value sits at the slot the template Layout assigns to it.
        sel_mask = np.zeros(geo.logical_shape, bool)
        sel_mask[region_index(geo.tile, sel.per_axis)] = True
        slots = geo.offsets[sel_mask]
        got = np.array([rc[int(s)] for s in slots], np.float32)
        return got, expected_full[sel_mask]

    # replace: projecting the result with the same selection reproduces compact exactly.
    result = c.scatter(compact, w.full, sel).wait()
    assert result.autograd_ctx is not None and result.autograd_ctx.name == "scatter"
    expected_full = np.full(geo.logical_shape, np.nan, np.float32)
    expected_full[region_index(geo.tile, sel.per_axis)] = compact_np
    got, want = check_result(result, expected_full)
    np.testing.assert_array_equal(got, want)
    # Evicting some of the written (dirty) tiles preserves them on the secondary tier.
    evict = [t for t in sel.coordinates if rng.random() < 0.5]
    if evict:
        _residency_call(rng, result.carrier, "evict", TileSet(evict))
        for t in evict:
            st = result.carrier.tile_state(t)
            assert (st.location, st.valid, st.dirty) == ("secondary", True, False), (t, st)
    print(f"result tiles evicted={evict}")
    np.testing.assert_array_equal(np.asarray(result.carrier.project(result, sel).wait()), compact_np)
    sub = sub_selection(rng, sel)
    np.testing.assert_array_equal(np.asarray(result.carrier.project(result, sub).wait()),
                                  gather(expected_full, geo.tile, sub))

    # add: the selected template values plus compact (central Float32 addition).
    added = c.scatter(compact, w.full, sel, reduction="add").wait()
    expected_add = np.full(geo.logical_shape, np.nan, np.float32)
    expected_add[region_index(geo.tile, sel.per_axis)] = gather(w.values, geo.tile, sel) + compact_np
    got, want = check_result(added, expected_add)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(added.carrier.project(added, sel).wait()),
                               gather(w.values, geo.tile, sel) + compact_np, rtol=1e-6, atol=1e-7)

    # add onto a partial result (its unselected tiles invalid): compact + compact2 at the selection.
    compact2_np = rng.standard_normal(compact_np.shape).astype(np.float32)
    chained = result.carrier.scatter(cpu(compact2_np), result, sel, reduction="add").wait()
    assert chained.carrier is not result.carrier
    np.testing.assert_allclose(np.asarray(chained.carrier.project(chained, sel).wait()), compact_np + compact2_np,
                               rtol=1e-6, atol=1e-7)
    # replace onto a tiled template with the same selection reproduces the new compact.
    again = added.carrier.scatter(cpu(compact2_np), added, sel).wait()
    np.testing.assert_array_equal(np.asarray(again.carrier.project(again, sel).wait()), compact2_np)

    # Neither input was mutated or released.
    np.testing.assert_array_equal(np.asarray(compact), compact_np)
    assert not compact.carrier.is_released() and not compact.carrier.is_owned()
    # The template's values, version and unselected tiles are unchanged; "add" read the selected
    # template tiles, which (as for a projection) may have become primary-resident.
    assert c.version == version and not c.is_owned()
    after = states(c, tiles)
    for t in tiles:
        if t in selected:
            assert after[t].valid and (after[t].dirty or not before[t].dirty), (t, before[t], after[t])
        else:
            assert after[t] == before[t], (t, before[t], after[t])
    np.testing.assert_array_equal(logical_values(w.full), w.values)
    assert total == w.full.size()


# ================================================================ (3) projection gradients vs dense


PROJECTION_COMPUTATIONS = ["mulsum", "relu_keep", "matmul_lhs", "matmul_rhs", "two_paths", "accumulate",
                           "with_direct"]


def names(rank):
    return " ".join("abcd"[:rank])


def mulsum(p, r):
    """reduce_sum(elementwise_mul(p, r)) over every mode: a scalar."""
    rank = len(p.layout.shape)
    return sw.reduce_sum(sw.elementwise_mul(p, r), f"{names(rank)} ->")


def relu_keep(p, r):
    """reduce_sum(relu(mul(mul(p, r), 1.5))) keeping the first mode."""
    rank = len(p.layout.shape)
    return sw.reduce_sum(sw.relu(sw.mul(sw.mul(p, r), 1.5)), f"{names(rank)} -> a")


@pytest.mark.parametrize("seed", SEEDS)
def test_projection_gradient_matches_dense(seed):
    rng = case_rng(seed, 3)
    kind = PROJECTION_COMPUTATIONS[seed % len(PROJECTION_COMPUTATIONS)]
    geo, w = make_case(rng, rank=2 if kind.startswith("matmul") else None)
    c = w.carrier
    random_residency(rng, w)
    sel = random_selection(rng, geo.grid)
    sel2 = overlapping_selection(rng, geo.grid, sel)
    print(f"computation={kind} selection={sel.per_axis} second={sel2.per_axis}")
    L, T = geo.logical_shape, geo.tile

    def run(source_for, direct_source, before_backward):
        """Builds the loss from compact tensors given by source_for(selection) and backpropagates it;
        before_backward() runs before every backward call."""
        p = source_for(sel)
        shape = p.layout.shape.extents
        if kind == "mulsum":
            out = mulsum(p, cpu(consts["r"](shape)))
            before_backward()
            out.backward()
        elif kind == "relu_keep":
            out = relu_keep(p, cpu(consts["r"](shape)))
            before_backward()
            out.backward(gradient=cpu(consts["cot"]((shape[0],))))
        elif kind == "matmul_lhs":
            x = cpu(consts["r"]((int(consts["n"]), shape[1])))
            out = sw.matmul(p, x)  # (m, n)
            before_backward()
            out.backward(gradient=cpu(consts["cot"](out.layout.shape.extents)))
        elif kind == "matmul_rhs":
            x = cpu(consts["r"]((int(consts["n"]), shape[1])))
            out = sw.matmul(x, p)  # (n, m)
            before_backward()
            out.backward(gradient=cpu(consts["cot"](out.layout.shape.extents)))
        elif kind == "two_paths":
            q = source_for(sel2)
            loss = sw.add(mulsum(p, cpu(consts["r"](shape))),
                          sw.reduce_sum(relu_keep(q, cpu(consts["r2"](q.layout.shape.extents))), "a ->"))
            before_backward()
            loss.backward()
        elif kind == "accumulate":
            out = mulsum(p, cpu(consts["r"](shape)))
            before_backward()
            out.backward()
            q = source_for(sel2)
            out = relu_keep(q, cpu(consts["r2"](q.layout.shape.extents)))
            before_backward()
            out.backward(gradient=cpu(consts["cot"]((q.layout.shape.extents[0],))))
        else:  # with_direct: a projection path plus a direct operation on the full tensor
            direct = sw.reduce_sum(sw.mul(direct_source, 0.5), f"{names(len(L))} ->")
            out = sw.add(mulsum(p, cpu(consts["r"](shape))), direct)
            before_backward()
            out.backward()

    # Constants are drawn once and replayed identically for the tiled and the dense run.
    cache = {}

    def const(name):
        def draw(shape):
            key = (name, tuple(shape))
            if key not in cache:
                cache[key] = rng.standard_normal(shape).astype(np.float32)
            return cache[key]
        return draw

    consts = {"r": const("r"), "r2": const("r2"), "cot": const("cot"), "n": int(rng.integers(1, 5))}

    # Tiled run.
    projections = []

    def tiled_source(s):
        p = c.project(w.full, s).wait()
        assert p.autograd_ctx is not None and p.autograd_ctx.name == "project"
        assert len(p.autograd_ctx.inputs()) == 1 and p.autograd_ctx.inputs()[0] is w.full
        np.testing.assert_array_equal(np.asarray(p), gather(w.values, T, s))
        projections.append(s)
        return p

    def perturb_residency():
        # Residency transitions between forward and backward change no gradient: evict random source
        # tiles and, once a gradient exists, random tiles of the tiled .grad (it is promoted back).
        evict = [t for t in w.tiles() if rng.random() < 0.4]
        if evict:
            _residency_call(rng, c, "evict", TileSet(evict))
        if w.full.grad is not None:
            gc = w.full.grad.carrier
            g_evict = [t for t in w.tiles() if gc.tile_state(t).location == "primary" and rng.random() < 0.5]
            if g_evict:
                _residency_call(rng, gc, "evict", TileSet(g_evict))
                assert all(gc.tile_state(t).location == "secondary" for t in g_evict)
        print(f"before backward: evicted source {evict}")

    run(tiled_source, w.full, perturb_residency)

    # Dense run: the same computation on dense leaves holding the gathered values.
    leaves = []

    def dense_source(s):
        leaf = cpu(gather(w.values, T, s))
        leaves.append((s, leaf))
        return leaf

    dense_full = cpu(w.values)
    run(dense_source, dense_full, lambda: None)
    expected = np.zeros(L, np.float32)
    for s, leaf in leaves:
        expected += scatter_add(L, T, s, np.asarray(leaf.grad))
    touched = set(itertools.chain.from_iterable(s.coordinates for s in projections))
    if kind == "with_direct":
        expected += np.asarray(dense_full.grad)
        touched = set(w.tiles())

    g = w.full.grad
    assert_tiled_gradient(g, w)
    gc = g.carrier
    for t in w.tiles():
        st = gc.tile_state(t)
        assert st.valid, (t, st)
        if t not in touched:
            assert st.location == "implicit", (t, st)
        else:
            assert st.location != "invalid", (t, st)
    # Physical slots: the gradient is laid out by the primal's (permuted) Layout.
    phys = np.zeros(int(np.prod(L)), np.float32)
    phys[geo.offsets] = expected
    np.testing.assert_allclose(slot_values(gc, phys.size), phys, rtol=RTOL, atol=ATOL)
    # Logical values through a projection of every tile of the gradient.
    got = logical_values(g)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    for t in w.tiles():
        if t not in touched:
            assert not np.any(got[tile_block(T, t)]), t
    # The primal is untouched.
    np.testing.assert_array_equal(logical_values(w.full), w.values)


# ================================================================ (3) scatter gradients vs dense


SCATTER_CASES = [(red, use) for red in ("replace", "add") for use in ("consume", "seed", "through_projection")]


@pytest.mark.parametrize("seed", SEEDS)
def test_scatter_gradients_match_dense(seed):
    rng = case_rng(seed, 4)
    reduction, use = SCATTER_CASES[seed % len(SCATTER_CASES)]
    geo, w = make_case(rng)
    c = w.carrier
    random_residency(rng, w)
    L, T = geo.logical_shape, geo.tile
    sel = random_selection(rng, geo.grid)
    cshape = gather(w.values, T, sel).shape
    if use == "through_projection":
        # compact = mul(project(full, sel_c), 2.0): the full tensor is reached through both scatter inputs.
        sel_c = TileSelection([[int(v) for v in rng.permutation(g)[:len(a)]] for g, a in zip(geo.grid, sel.per_axis)])
        compact = sw.mul(c.project(w.full, sel_c).wait(), 2.0)
        compact_np = 2.0 * gather(w.values, T, sel_c)
        compact.retain_grad()
    else:
        compact_np = rng.standard_normal(cshape).astype(np.float32)
        compact = cpu(compact_np)
    print(f"reduction={reduction} use={use} selection={sel.per_axis}")
    result = c.scatter(compact, w.full, sel, reduction=reduction).wait()
    node = result.autograd_ctx
    assert node is not None and node.name == "scatter" and node.dispatch_carrier_class is TiledEvictable
    assert any(x is compact for x in node.inputs())
    selected_values = compact_np + (gather(w.values, T, sel) if reduction == "add" else 0.0)

    if use == "seed":
        seed_values = rng.standard_normal(L).astype(np.float32)
        seed_t = Full(rng, geo, values=seed_values)
        result.backward(gradient=seed_t.full)
        cot_full = seed_values.copy()
        exact = True
        np.testing.assert_array_equal(logical_values(seed_t.full), seed_values)
    else:
        sub = sub_selection(rng, sel)
        read = result.carrier.project(result, sub).wait()
        full_expected = np.zeros(L, np.float32)
        full_expected[region_index(T, sel.per_axis)] = selected_values
        np.testing.assert_allclose(np.asarray(read), gather(full_expected, T, sub), rtol=1e-6, atol=1e-7)
        r = rng.standard_normal(read.layout.shape.extents).astype(np.float32)
        cot = rng.standard_normal((read.layout.shape.extents[0],)).astype(np.float32)
        dense_read = cpu(np.asarray(read))
        relu_keep(read, cpu(r)).backward(gradient=cpu(cot))
        relu_keep(dense_read, cpu(r)).backward(gradient=cpu(cot))
        cot_full = scatter_add(L, T, sub, np.asarray(dense_read.grad))
        exact = False
        print(f"sub-selection={sub.per_axis}")
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=RTOL, atol=ATOL)

    # Compact input: the full cotangent projected through the saved selection.
    want_compact = gather(cot_full, T, sel)
    assert type(compact.grad.carrier) is sw.CPU
    np.testing.assert_allclose(np.asarray(compact.grad), want_compact, **tol)

    # Template: replace retained no template value (selected overwritten, unselected invalid);
    # add passes the selected cotangent through, zero elsewhere.
    want_template = np.zeros(L, np.float32)
    if reduction == "add":
        want_template[region_index(T, sel.per_axis)] = gather(cot_full, T, sel)
    if use == "through_projection":
        want_template += scatter_add(L, T, sel_c, 2.0 * want_compact)
    g = w.full.grad
    if reduction == "replace" and use != "through_projection" and g is None:
        return
    assert_tiled_gradient(g, w)
    gc = g.carrier
    reached = set(sel.coordinates) if reduction == "add" else set()
    if use == "through_projection":
        reached |= set(sel_c.coordinates)
    for t in w.tiles():
        st = gc.tile_state(t)
        assert st.valid, (t, st)
        if t not in reached:
            assert st.location == "implicit", (t, st)
    phys = np.zeros(int(np.prod(L)), np.float32)
    phys[geo.offsets] = want_template
    np.testing.assert_allclose(slot_values(gc, phys.size), phys, **tol)
    np.testing.assert_allclose(logical_values(g), want_template, **tol)
