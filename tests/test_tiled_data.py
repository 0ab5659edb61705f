"""TiledEvictable data paths: projection, scatter and direct operations.

The TiledEvictable requirements (docs/guide.md, "TiledEvictable") covered here, one test per
scenario, named after it:

* "Project eagerly returns a completion handle for a compact Tensor"
* "Projection is an autograd-visible gather"
* "A direct tiled operand means the full logical Tensor"
* "Gather preserves public TileSelection ordering"
* "Scatter is the asynchronous projection counterpart"
* "Scatter participates in autograd"
* "Accept a within-tile permutation" (projection, scatter, direct execution
  and backward under a permuted within-tile Layout)

plus regression tests for engine fixes made while writing these (tiled
gradient summation keeps gradients tiled, implicit and in the primal's Layout;
two consumers of one scatter result; an explicit tiled seed; the template
gradient of replace/add scatter; the residency policy's purpose), and
every validation error of ``project`` and ``scatter`` (each checks the
exception type, a message fragment and that nothing changed: tile states,
values, versions, ownership, release state), and the direct-operation surface
(exactly add, elementwise_mul, mul in all three operand orders, relu,
reduce_sum and matmul; everything else NotImplementedError).

Fixtures: a weight Tensor (out, in, expert) with one expert per tile (grid
(1, 1, E), tile (out, in, 1)), a FileBacked secondary (a CPU tensor moved into
``sw.FileBacked()``; its carrier is the secondary) and a ``CPU(0)`` primary, so
every tile starts secondary-valid; also an (expert, out, in) layout (grid
(E, 1, 1): every tile footprint is a strided, non-contiguous slot set) and a
rank-2 grid. NumPy arrays are indexed by logical coordinates; the oracle is
plain NumPy on the same values.

Nothing sleeps. The pending window of "Overlap projection with computation"
is not held open here (the tiers are shipped carriers, whose I/O calls back
into nothing the test controls; the held I/O gates of tests/test_faults.py do
that), so that test asserts the handle semantics without relying on timing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly
from strideweave.carriers import tiled_evictable as te
from strideweave.carriers.tiled_evictable import AwaitProjection, TileSelection, TiledEvictable
from models import column_major_strides

F32 = DType.Float32
BASE_SEED = 20250301


# `rng` (conftest.py) seeds from BASE_SEED and the test id; every test starts and ends with grad mode on.
pytestmark = pytest.mark.usefixtures("grad_mode_on")


# ---------------------------------------------------------------- builders


class Tiled:
    """A full Tensor over a fresh TiledEvictable with known logical values.

    ``values`` is indexed by logical coordinate. ``strides`` is the Tensor's
    (flat) Layout stride; the default is dense column-major, which is the
    carrier's canonical slot order. The secondary is a FileBacked carrier
    filled by moving a CPU tensor into ``sw.FileBacked()``; the primary is
    ``CPU(0)``. Every tile therefore starts secondary-valid and clean.
    """

    def __init__(self, values: np.ndarray, grid, tile, strides=None):
        values = np.asarray(values, dtype=np.float32)
        self.values = values
        self.grid = tuple(grid)
        self.tile = tuple(tile)
        assert values.shape == tuple(g * t for g, t in zip(self.grid, self.tile))
        self.strides = tuple(strides) if strides is not None else column_major_strides(values.shape)
        idx = np.indices(values.shape)
        offsets = sum(idx[i] * self.strides[i] for i in range(values.ndim)).ravel()
        slots = np.empty(values.size, dtype=np.float32)
        slots[offsets] = values.ravel()
        assert sorted(offsets.tolist()) == list(range(values.size))
        staged = friendly.tensor(slots)
        secondary = sw.move(staged, sw.FileBacked()).carrier
        assert isinstance(secondary, sw.FileBacked)
        self.carrier = TiledEvictable(sw.CPU(0), secondary, self.grid, self.tile)
        self.layout = Layout(Shape(*values.shape), Stride(*self.strides))
        self.full = Tensor(self.carrier, 0, self.layout)

    def coords(self):
        return all_tiles(self.carrier)


def all_tiles(carrier):
    return list(itertools.product(*(range(g) for g in carrier.grid_shape)))


def expert_weight(rng, out=3, inp=4, experts=6) -> Tiled:
    """(out, in, expert), one expert per tile."""
    v = rng.standard_normal((out, inp, experts)).astype(np.float32)
    return Tiled(v, (1, 1, experts), (out, inp, 1))


def expert_first_weight(rng, out=3, inp=4, experts=6) -> Tiled:
    """(expert, out, in), one expert per tile: strided tile footprints."""
    v = rng.standard_normal((experts, out, inp)).astype(np.float32)
    return Tiled(v, (experts, 1, 1), (1, out, inp))


def grid2_weight(rng, grid=(3, 2), tile=(2, 4)) -> Tiled:
    v = rng.standard_normal((grid[0] * tile[0], grid[1] * tile[1])).astype(np.float32)
    return Tiled(v, grid, tile)


GEOMETRIES = {
    "out_in_expert": expert_weight,
    "expert_out_in": expert_first_weight,
    "grid2": grid2_weight,
}


def region(values: np.ndarray, tile, per_axis) -> np.ndarray:
    """The compact NumPy oracle of a projection: selected tile blocks in selection order."""
    index = [
        np.concatenate([np.arange(s * t, (s + 1) * t) for s in axis]) for axis, t in zip(per_axis, tile)
    ]
    return values[np.ix_(*index)]


def region_index(tile, per_axis):
    return np.ix_(*[np.concatenate([np.arange(s * t, (s + 1) * t) for s in axis]) for axis, t in zip(per_axis, tile)])


def np_of(t: Tensor) -> np.ndarray:
    """Logical values of a tensor. Tiled tensors are read through a full projection (no grad)."""
    if isinstance(t.carrier, TiledEvictable):
        c = t.carrier
        sel = TileSelection([range(g) for g in c.grid_shape])
        with sw.no_grad():
            compact = c.project(t, sel).wait()
        return np.array(np.asarray(compact), copy=True)
    return np.array(np.asarray(t), copy=True)


def cpu_tensor(values) -> Tensor:
    return friendly.tensor(np.asarray(values, dtype=np.float32))


def tile_states(carrier):
    return {t: carrier.tile_state(t) for t in all_tiles(carrier)}


def carrier_facts(c):
    facts = {"released": c.is_released(), "owned": c.is_owned(), "version": c.version, "size": c.size()}
    if not c.is_released():
        facts["mutable"] = c.is_mutable()
    return facts


def tiled_snapshot(c):
    snap = carrier_facts(c)
    if not c.is_released():
        snap["tiles"] = tile_states(c)
        snap["stats"] = c.stats()
        snap["primary"] = carrier_facts(c.primary)
        snap["secondary"] = carrier_facts(c.secondary)
    return snap


def tensor_facts(t: Tensor):
    return {
        "carrier": t.carrier,
        "offset": t.offset,
        "layout": t.layout,
        "version": t.version,
        "ctx": t.autograd_ctx,
        "grad": t.grad if t.is_differentiable() else None,
    }


def mixed_residency(w: Tiled, primary_clean=(), primary_dirty=()):
    """Promote some tiles, and dirty others by a slot write (values stay known)."""
    c = w.carrier
    if primary_clean or primary_dirty:
        c.promote(te.TileSet(list(primary_clean) + list(primary_dirty)))
    for t in primary_dirty:
        coord = tuple(ti * extent for ti, extent in zip(t, w.tile))  # first element of the tile
        value = float(np.float32(w.values[coord] + 1.0))
        w.full[coord] = value
        w.values[coord] = value
    for t in primary_clean:
        assert c.tile_state(t).location == "primary" and not c.tile_state(t).dirty
    for t in primary_dirty:
        assert c.tile_state(t).dirty


# ================================================================ Project eagerly returns a completion handle


def test_overlap_projection_with_computation(rng):
    # Selected tiles are evicted (secondary-valid in a FileBacked file). Tiles are
    # large enough (256 KiB each) that their promotion is real file I/O, but the
    # test does not depend on whether it is still pending when project returns.
    out, inp, experts = 256, 256, 6
    w = Tiled(rng.standard_normal((out, inp, experts)).astype(np.float32), (1, 1, experts), (out, inp, 1))
    c = w.carrier
    sel = TileSelection([[0], [0], [4, 1, 3]])
    assert all(c.tile_state(t).location == "secondary" for t in sel.coordinates)
    promotions = c.stats()["promotions"]

    handle = c.project(w.full, sel)
    assert type(handle) is AwaitProjection and isinstance(handle, sw.AwaitResult)
    assert isinstance(handle.done, bool)
    assert not isinstance(handle, Tensor) and not hasattr(handle, "autograd_ctx")
    # Unrelated computation while the projection may still be in flight.
    a = cpu_tensor(rng.standard_normal((32, 64)))
    b = cpu_tensor(rng.standard_normal((16, 64)))
    unrelated = sw.matmul(a, b)
    np.testing.assert_allclose(np.asarray(unrelated), np.asarray(a) @ np.asarray(b).T, rtol=1e-4, atol=1e-4)

    compact = handle.wait()
    assert handle.done
    assert isinstance(compact, Tensor) and type(compact.carrier) is sw.CPU
    assert compact.layout == friendly.column_major(out, inp, 3)
    assert compact.dtype() is F32
    np.testing.assert_array_equal(np.asarray(compact), region(w.values, w.tile, sel.per_axis))
    # project itself started the promotion of the missing tiles (part of its request).
    assert c.stats()["promotions"] >= promotions + 3
    for t in sel.coordinates:
        assert c.tile_state(t).valid and c.tile_state(t).location == "primary"
    for t in set(w.coords()) - set(sel.coordinates):
        assert c.tile_state(t).location == "secondary"
    # The projection's work is terminal once wait() returned: the carrier can be released.
    assert not c.is_owned()
    c.release()
    assert c.is_released()
    np.testing.assert_array_equal(np.asarray(compact), region(w.values, w.tile, sel.per_axis))


def test_observe_a_completed_projection_repeatedly(rng):
    w = expert_weight(rng)
    sel = TileSelection([[0], [0], [5, 2]])
    handle = w.carrier.project(w.full, sel)
    first = handle.wait()
    assert handle.done
    for _ in range(3):
        assert handle.wait() is first
        assert handle.done
    np.testing.assert_array_equal(np.asarray(first), region(w.values, w.tile, sel.per_axis))
    # A caller-supplied destination: wait() returns a Tensor over that destination.
    dest = sw.CPU(0)
    h2 = w.carrier.project(w.full, sel, dest)
    got = h2.wait()
    assert got.carrier is dest and got.offset == 0 and h2.wait() is got
    assert got.layout == friendly.column_major(*region(w.values, w.tile, sel.per_axis).shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(first))


def test_keep_the_full_tensor_unchanged(rng):
    w = expert_weight(rng, experts=8)
    c = w.carrier
    mixed_residency(w, primary_clean=[(0, 0, 1)], primary_dirty=[(0, 0, 6)])
    before = tensor_facts(w.full)
    version = c.version
    per_axis = [[0], [0], [6, 1, 3]]
    # Mutating the caller's Python inputs after return changes nothing observed.
    axes = [list(a) for a in per_axis]
    sel = TileSelection(axes)
    handle = c.project(w.full, sel)
    axes[2][0] = 0
    axes[2].append(7)
    compact = handle.wait()
    assert sel.per_axis == ((0,), (0,), (6, 1, 3))
    np.testing.assert_array_equal(np.asarray(compact), region(w.values, w.tile, per_axis))

    after = tensor_facts(w.full)
    assert after["carrier"] is c
    assert after == before
    assert c.version == version
    assert w.full.layout == w.layout and c.logical_shape == w.values.shape
    assert c.grid_shape == w.grid and c.tile_shape == w.tile
    # Only residency metadata may differ: every tile is still valid, the dirty
    # tile stays dirty, unselected secondary tiles were not touched.
    assert all(c.tile_state(t).valid for t in w.coords())
    assert c.tile_state((0, 0, 6)).dirty
    for t in [(0, 0, 0), (0, 0, 2), (0, 0, 4), (0, 0, 5), (0, 0, 7)]:
        assert c.tile_state(t).location == "secondary"
    # No carrier-wide selection state: another projection of other tiles is independent.
    other = TileSelection([[0], [0], [0, 7]])
    np.testing.assert_array_equal(np.asarray(c.project(w.full, other).wait()), region(w.values, w.tile, other.per_axis))
    np.testing.assert_array_equal(np_of(w.full), w.values)
    assert not c.is_owned() and not compact.carrier.is_owned()


def test_one_tile_projection_is_a_snapshot_isolated_from_writes_on_either_side(rng):
    """Projecting one resident expert without a destination shares the tile's memory copy-on-write
    (Note [Shared snapshots]): neither a later write to the tile nor one to the projection reaches the other."""
    w = expert_weight(rng)
    c = w.carrier
    c.promote(te.TileSet([(0, 0, 2)]))
    sel = TileSelection([[0], [0], [2]])
    expected = w.values[:, :, 2:3].copy()

    def slot(o, i, e):  # canonical column-major slot of logical (o, i, e) over (3, 4, 6)
        return o + 3 * i + 12 * e

    def compact_values(t):  # read through the carrier, without exporting it
        return np.array([t.carrier[k] for k in range(t.size())], np.float32).reshape(expected.shape, order="F")

    p = c.project(w.full, sel).wait()
    np.testing.assert_array_equal(compact_values(p), expected)
    version = c.version
    c[slot(1, 2, 2)] = 123.0  # the tile is written
    assert c.version == version + 1
    np.testing.assert_array_equal(compact_values(p), expected)  # the projection kept its values
    assert c[slot(1, 2, 2)] == 123.0

    q = c.project(w.full, sel).wait()
    arr = np.asarray(q)  # a writable view: the projection's memory becomes its own first
    assert arr.flags.writeable
    arr[0, 0, 0] = -9.0
    assert q.carrier[0] == -9.0
    assert c[slot(0, 0, 2)] == expected[0, 0, 0]  # the tile did not see the write
    q.carrier[1] = -8.0
    assert c[slot(1, 0, 2)] == expected[1, 0, 0]

    # Evicting the (dirty) tile writes it back; the projections live on with their own values.
    c.evict(te.TileSet([(0, 0, 2)]))
    assert c.tile_state((0, 0, 2)).location == "secondary"
    np.testing.assert_array_equal(compact_values(p), expected)
    assert arr[0, 0, 0] == -9.0
    assert c[slot(1, 2, 2)] == 123.0


# ================================================================ Projection is an autograd-visible gather


def test_backpropagate_through_project_then_operation(rng):
    w = expert_weight(rng)
    c = w.carrier
    mixed_residency(w, primary_clean=[(0, 0, 3)])
    sel = TileSelection([[0], [0], [3, 0, 4]])
    compact = c.project(w.full, sel).wait()
    node = compact.autograd_ctx
    assert node is not None and node.name == "project"
    assert node.dispatch_carrier_class is TiledEvictable
    assert len(node.inputs()) == 1 and node.inputs()[0] is w.full

    scale = rng.standard_normal(compact.layout.shape.extents).astype(np.float32)
    y = sw.mul(compact, cpu_tensor(scale))  # normal compute-carrier node after the gather node
    assert y.autograd_ctx.name == "mul" and y.autograd_ctx.dispatch_carrier_class is sw.CPU
    assert y.autograd_ctx.inputs()[0] is compact
    loss = sw.reduce_sum(sw.relu(y), "a b c -> a")
    cot = rng.standard_normal(loss.layout.shape.extents).astype(np.float32)
    loss.backward(gradient=cot_tensor(cot))

    y_np = region(w.values, w.tile, sel.per_axis) * scale
    d_compact = (y_np > 0) * cot[:, None, None] * scale
    expected = np.zeros_like(w.values)
    expected[region_index(w.tile, sel.per_axis)] += d_compact

    g = w.full.grad
    assert g is not None and isinstance(g.carrier, TiledEvictable) and g.carrier is not c
    assert g.layout == w.full.layout and g.dtype() is F32
    gc = g.carrier
    assert gc.grid_shape == c.grid_shape and gc.tile_shape == c.tile_shape and gc.logical_shape == c.logical_shape
    assert type(gc.primary) is type(c.primary) and type(gc.secondary) is type(c.secondary)
    for t in set(w.coords()) - set(sel.coordinates):
        st = gc.tile_state(t)
        assert st.valid and st.location == "implicit"
    np.testing.assert_allclose(np_of(g), expected, rtol=1e-5, atol=1e-6)
    # The projection's VJP reads no values of the full tensor, so a write to it in between changes nothing
    # (Note [A projection saves no values]): see test_projection_backward_ignores_writes_to_the_full_tensor.


def cot_tensor(values) -> Tensor:
    return cpu_tensor(values)


@pytest.mark.parametrize("tiles", [[4], [4, 2]], ids=["one-tile", "two-tiles"])
def test_projection_backward_ignores_writes_to_the_full_tensor(rng, tiles):
    """A projection's backward needs the full tensor's geometry, not its values: writing a slot of the full carrier
    (in a projected tile and in another) between forward and backward leaves backward working, with exact
    gradients. An operation whose VJP reads its saved inputs (elementwise_mul of the full tiled tensor with
    itself) still refuses with "modified in-place", changing nothing."""
    w = expert_weight(rng, experts=6)
    c = w.carrier
    sel = TileSelection([[0], [0], tiles])
    p = c.project(w.full, sel).wait()
    weights = rng.standard_normal(p.layout.shape.extents).astype(np.float32)
    loss = sw.reduce_sum(sw.elementwise_mul(p, cpu_tensor(weights)), "a b c ->")
    v0 = w.full.version
    w.full[(0, 0, tiles[0])] = 5.0  # a projected tile
    w.carrier[c.size() - 1] = -3.0  # tile (0, 0, 5): not projected
    assert w.full.version == v0 + 2
    loss.backward()
    expected = np.zeros_like(w.values)
    expected[region_index(w.tile, sel.per_axis)] = weights  # d(sum(p * W))/dp = W, exactly
    np.testing.assert_array_equal(np_of(w.full.grad), expected)

    # elementwise_mul saves its operands (its VJP reads each): a write in between is refused.
    w2 = expert_weight(rng, experts=3)
    y = sw.reduce_sum(sw.elementwise_mul(w2.full, w2.full), "a b c ->")
    v1 = w2.full.version
    w2.carrier[0] = 7.0
    before = tiled_snapshot(w2.carrier)
    with pytest.raises(RuntimeError, match=rf"modified in-place.*version {v1}.*version {v1 + 1}"):
        y.backward()
    assert w2.full.grad is None
    assert tiled_snapshot(w2.carrier) == before


def test_accumulate_overlapping_projections(rng):
    w = expert_weight(rng, experts=7)
    c = w.carrier
    sel1 = TileSelection([[0], [0], [1, 4, 2]])
    sel2 = TileSelection([[0], [0], [4, 5, 1]])
    p1 = c.project(w.full, sel1).wait()
    p2 = c.project(w.full, sel2).wait()
    w1 = rng.standard_normal(p1.layout.shape.extents).astype(np.float32)
    w2 = rng.standard_normal(p2.layout.shape.extents).astype(np.float32)
    loss = sw.add(
        sw.reduce_sum(sw.elementwise_mul(p1, cpu_tensor(w1)), "a b c -> a"),
        sw.reduce_sum(sw.elementwise_mul(p2, cpu_tensor(w2)), "a b c -> a"),
    )
    loss.backward(gradient=cpu_tensor(np.ones(w.tile[0], np.float32)))
    expected = np.zeros_like(w.values)
    expected[region_index(w.tile, sel1.per_axis)] += w1
    expected[region_index(w.tile, sel2.per_axis)] += w2
    g = w.full.grad
    assert isinstance(g.carrier, TiledEvictable) and g.carrier is not c
    untouched = {(0, 0, 0), (0, 0, 3), (0, 0, 6)}
    for t in untouched:
        st = g.carrier.tile_state(t)
        assert st.location == "implicit" and st.valid
    np.testing.assert_allclose(np_of(g), expected, rtol=1e-5, atol=1e-6)
    # Overlap tiles (1 and 4) hold the sum of both contributions.
    np.testing.assert_allclose(np_of(g)[:, :, 4], w1[:, :, 1] + w2[:, :, 0], rtol=1e-5, atol=1e-6)


def test_tiled_leaf_gradient_accumulates_across_backwards(rng):
    # .grad of a tiled leaf accumulates: the sum stays a tiled gradient with the
    # primal's Layout, and tiles untouched by every contribution stay implicit.
    values = rng.standard_normal((3, 4, 5)).astype(np.float32)
    w = Tiled(values, (1, 1, 5), (3, 4, 1), strides=(4, 1, 12))  # within-tile permuted Layout
    c = w.carrier
    expected = np.zeros_like(values)
    for per_axis in ([[0], [0], [1, 3]], [[0], [0], [3, 0]]):
        sel = TileSelection(per_axis)
        p = c.project(w.full, sel).wait()
        weights = rng.standard_normal((3, 4, 2)).astype(np.float32)
        sw.reduce_sum(sw.elementwise_mul(p, cpu_tensor(weights)), "a b c -> a").backward(
            gradient=cpu_tensor(np.ones(3, np.float32))
        )
        expected[region_index(w.tile, per_axis)] += weights
    g = w.full.grad
    assert isinstance(g.carrier, TiledEvictable) and g.layout == w.full.layout and g.offset == w.full.offset
    assert {t for t in w.coords() if g.carrier.tile_state(t).location == "implicit"} == {(0, 0, 2), (0, 0, 4)}
    np.testing.assert_allclose(np_of(g), expected, rtol=1e-5, atol=1e-6)
    # A direct operation's gradient accumulates into the same tiled .grad.
    sw.reduce_sum(w.full, "o i e -> e").backward(gradient=cpu_tensor(np.ones(5, np.float32)))
    np.testing.assert_allclose(np_of(w.full.grad), expected + 1.0, rtol=1e-5, atol=1e-6)
    assert w.full.grad.layout == w.full.layout
    # An explicit tiled seed on the tiled leaf itself.
    w.full.grad = None
    seed_values = rng.standard_normal(values.shape).astype(np.float32)
    seed = Tiled(seed_values, w.grid, w.tile)
    w.full.backward(gradient=seed.full)
    assert isinstance(w.full.grad.carrier, TiledEvictable) and w.full.grad.carrier is not seed.carrier
    np.testing.assert_array_equal(np_of(w.full.grad), seed_values)
    np.testing.assert_array_equal(np_of(seed.full), seed_values)


def test_policy_sees_the_request_purpose(rng):
    class Recorder:
        def __init__(self):
            self.log = []

        def plan(self, required, purpose):
            self.log.append(purpose)
            return te.ResidencyPlan()

    policy = Recorder()
    values = rng.standard_normal((3, 4, 4)).astype(np.float32)
    staged = friendly.tensor(values.reshape(-1, order="F"))
    c = TiledEvictable(sw.CPU(0), sw.move(staged, sw.FileBacked()).carrier, (1, 1, 4), (3, 4, 1),
                       residency_policy=policy)
    full = Tensor(c, 0, friendly.column_major(3, 4, 4))
    out = sw.reduce_sum(full, "o i e -> e")
    assert policy.log == ["operation"]
    policy.log.clear()
    out.backward(gradient=cpu_tensor(np.ones(4, np.float32)))
    assert policy.log and set(policy.log) == {"backward"}
    policy.log.clear()
    p = c.project(full, TileSelection([[0], [0], [2]])).wait()
    assert policy.log == ["projection"]
    policy.log.clear()
    sw.reduce_sum(p, "a b c -> a").backward(gradient=cpu_tensor(np.ones(3, np.float32)))
    assert set(policy.log) <= {"backward"}  # accumulating into the existing tiled .grad is backward work
    policy.log.clear()
    c.scatter(p, full, TileSelection([[0], [0], [2]]), reduction="add").wait()
    assert policy.log == ["scatter"]


# ================================================================ A direct tiled operand means the full logical Tensor


def test_execute_on_a_partially_resident_full_tensor(rng):
    w = expert_weight(rng, experts=6)
    c = w.carrier
    # Resident set is not a Cartesian product: (0,0,0) clean, (0,0,2) dirty, rest secondary.
    mixed_residency(w, primary_clean=[(0, 0, 0)], primary_dirty=[(0, 0, 2)])
    states = tile_states(c)
    out = sw.reduce_sum(w.full, "o i e -> e")
    assert type(out.carrier) is sw.CPU and not isinstance(out.carrier, TiledEvictable)
    np.testing.assert_allclose(np.asarray(out), w.values.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
    node = out.autograd_ctx
    assert node.name == "reduce_sum" and node.dispatch_carrier_class is TiledEvictable
    assert len(node.inputs()) == 1 and node.inputs()[0] is w.full and w.full.autograd_ctx is None
    # Same result as with every tile resident.
    r = sw.relu(w.full)
    c.promote(te.TileSet(w.coords()))
    np.testing.assert_array_equal(np.asarray(sw.relu(w.full)), np.asarray(r))
    np.testing.assert_array_equal(np.asarray(r), np.maximum(w.values, 0))
    assert all(c.tile_state(t).valid for t in w.coords())
    assert c.tile_state((0, 0, 2)).dirty and states[(0, 0, 2)].dirty


def test_reject_a_pending_projection_operand(rng):
    w = expert_weight(rng)
    c = w.carrier
    sel = TileSelection([[0], [0], [1, 3, 5]])
    handle = c.project(w.full, sel)
    other = cpu_tensor(np.ones((3, 4, 3), np.float32))
    calls = [
        lambda: sw.add(handle, other),
        lambda: sw.add(other, handle),
        lambda: sw.elementwise_mul(handle, other),
        lambda: sw.mul(handle, other),
        lambda: sw.mul(handle, 2.0),
        lambda: sw.mul(2.0, handle),
        lambda: sw.relu(handle),
        lambda: sw.reduce_sum(handle),
        lambda: sw.matmul(handle, other),
        lambda: sw.add(handle, w.full),
        lambda: c.project(handle, sel),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="Tensor"):
            call()
    # The handle is unaffected and still completes with the selected values.
    np.testing.assert_array_equal(np.asarray(handle.wait()), region(w.values, w.tile, sel.per_axis))


def test_execute_on_an_explicitly_projected_tensor(rng):
    w = expert_weight(rng, experts=8)
    sel = TileSelection([[0], [0], [6, 1, 4]])
    compact = w.carrier.project(w.full, sel).wait()
    assert type(compact.carrier) is sw.CPU and compact.layout.shape.extents == (3, 4, 3)
    gate = rng.standard_normal((3, 4, 3)).astype(np.float32)
    y = sw.reduce_sum(sw.mul(compact, cpu_tensor(gate)), "o i e -> e")
    assert type(y.carrier) is sw.CPU and y.layout.shape.extents == (3,)
    dense = region(w.values, w.tile, sel.per_axis)
    np.testing.assert_allclose(np.asarray(y), (dense * gate).sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
    assert y.autograd_ctx.dispatch_carrier_class is sw.CPU
    mul_node = y.autograd_ctx.inputs()[0].autograd_ctx
    assert mul_node.name == "mul" and mul_node.dispatch_carrier_class is sw.CPU
    assert mul_node.inputs()[0].autograd_ctx.name == "project"
    # The compact tensor keeps the compute carrier's full legacy surface.
    np.testing.assert_allclose(np.asarray(sw.exp(sw.neg(compact))), np.exp(-dense), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sw.sub(compact, compact)), np.zeros_like(dense))


# ================================================================ Gather preserves public TileSelection ordering


def test_gather_a_permuted_selection(rng):
    w = expert_weight(rng, out=2, inp=3, experts=20)
    sel = TileSelection([[0], [0], [7, 2, 19]])
    compact = w.carrier.project(w.full, sel).wait()
    assert compact.layout == friendly.column_major(2, 3, 3)  # dense: no global affine permutation
    got = np.asarray(compact)
    for k, e in enumerate([7, 2, 19]):
        np.testing.assert_array_equal(got[:, :, k], w.values[:, :, e])
    # Same selection on the (expert, out, in) layout, where tiles are strided.
    v = expert_first_weight(rng, out=2, inp=3, experts=20)
    got = np.asarray(v.carrier.project(v.full, TileSelection([[7, 2, 19], [0], [0]])).wait())
    for k, e in enumerate([7, 2, 19]):
        np.testing.assert_array_equal(got[k], v.values[e])


def test_gather_a_multi_axis_selection(rng):
    w = grid2_weight(rng, grid=(8, 10), tile=(2, 3))
    sel = TileSelection([[7, 2], [4, 9]])
    assert sel.coordinates == ((7, 4), (2, 4), (7, 9), (2, 9))
    compact = w.carrier.project(w.full, sel).wait()
    assert compact.layout == friendly.column_major(4, 6)
    got = np.asarray(compact)
    th, tw = w.tile
    for k, (a, b) in enumerate(sel.coordinates):
        ca, cb = k % 2, k // 2  # compact tile coordinate, first axis fastest
        np.testing.assert_array_equal(
            got[ca * th:(ca + 1) * th, cb * tw:(cb + 1) * tw], w.values[a * th:(a + 1) * th, b * tw:(b + 1) * tw]
        )
    np.testing.assert_array_equal(got, region(w.values, w.tile, sel.per_axis))


# ================================================================ Scatter is the asynchronous projection counterpart


def test_scatter_a_compact_result(rng):
    w = expert_weight(rng, experts=6)
    c = w.carrier
    mixed_residency(w, primary_dirty=[(0, 0, 5)])
    sel = TileSelection([[0], [0], [4, 0, 2]])
    compact_np = rng.standard_normal((3, 4, 3)).astype(np.float32)
    compact = cpu_tensor(compact_np)
    src_before, tmpl_before = tensor_facts(compact), tensor_facts(w.full)
    tiles_before = tile_states(c)

    handle = c.scatter(compact, w.full, sel)
    assert type(handle) is sw.AwaitMove and isinstance(handle, sw.AwaitResult)
    result = handle.wait()
    assert handle.wait() is result
    rc = result.carrier
    assert isinstance(rc, TiledEvictable) and rc is not c
    assert result.layout == w.full.layout and result.offset == w.full.offset and result.dtype() is F32
    assert rc.grid_shape == c.grid_shape and rc.tile_shape == c.tile_shape and rc.logical_shape == c.logical_shape
    assert type(rc.primary) is sw.CPU and type(rc.secondary) is sw.FileBacked
    for t in w.coords():
        st = rc.tile_state(t)
        if t in sel.coordinates:
            assert (st.location, st.valid, st.dirty) == ("primary", True, True)
        else:
            assert not st.valid and st.location == "invalid"
    assert rc.version == 1  # the selected set committed once
    # Neither input was released or mutated.
    assert tensor_facts(compact) == src_before and tensor_facts(w.full) == tmpl_before
    assert tile_states(c) == tiles_before
    assert not compact.carrier.is_owned() and not compact.carrier.is_released() and not c.is_owned()
    np.testing.assert_array_equal(np.asarray(compact), compact_np)
    np.testing.assert_array_equal(np_of(w.full), w.values)
    for k, e in enumerate([4, 0, 2]):
        for o, i in itertools.product(range(3), range(4)):
            assert result[(o, i, e)] == compact_np[o, i, k]
    with pytest.raises(RuntimeError, match="invalid"):
        result[(0, 0, 1)]

    # reduction="add" combines with the template's selected values.
    added = c.scatter(compact, w.full, sel, reduction="add").wait()
    np.testing.assert_allclose(
        np.asarray(added.carrier.project(added, sel).wait()),
        region(w.values, w.tile, sel.per_axis) + compact_np,
        rtol=1e-6,
    )
    assert added.carrier.tile_state((0, 0, 1)).location == "invalid"
    assert added.carrier.version == 1


def small_tiled(dtype, values, grid, tile):
    """A 1-D TiledEvictable of `dtype` over CPU tiers (FileBacked stores no Bool), every tile secondary-valid."""
    n = len(values)
    sec = sw.CPU(n, dtype=dtype)
    for s, v in enumerate(values):
        sec[s] = v
    c = TiledEvictable(sw.CPU(0, dtype=dtype), sec, grid, tile)
    return c, Tensor(c, 0, Layout(Shape(n), Stride(1)))


@pytest.mark.parametrize("dtype", ["Bool", "Int32"])
def test_scatter_add_follows_the_central_add_dtype_rule(dtype, rng):
    """reduction="add" is add's sum: Int32 + Int32 stays Int32 (exact values); Bool + Bool is Float32 for add, which
    a Bool carrier cannot hold, so the scatter refuses with TypeError before any work and changes nothing."""
    dt = getattr(DType, dtype)
    if dt is DType.Bool:
        values = [bool(x) for x in rng.integers(0, 2, 6)]
        compact_np = np.array([True, False, True, True])
        as_np = np.bool_
    else:
        values = [int(x) for x in rng.integers(-50, 50, 6)]
        compact_np = rng.integers(-50, 50, 4).astype(np.int32)
        as_np = np.int32
    c, full = small_tiled(dt, values, (3,), (2,))
    compact = friendly.tensor(compact_np, dtype=dt)
    sel = TileSelection([[2, 0]])
    selected = np.array(values, dtype=as_np)[[4, 5, 0, 1]]
    # The central operation's rule, on the same values.
    central = sw.add(compact, compact)
    if dt is DType.Bool:
        assert central.dtype() is F32  # add never returns Bool: True + True is 2.0
        np.testing.assert_array_equal(np.asarray(central), 2 * compact_np.astype(np.float32))
        w = Tiled.__new__(Tiled)  # assert_rejected's view of the carrier: its full tensor and its values
        w.carrier, w.full, w.values = c, full, np.array(values, dtype=np.float32)
        before_compact = (np.array(np.asarray(compact), copy=True), compact.version)
        err = assert_rejected(lambda: c.scatter(compact, full, sel, reduction="add"), TypeError,
                              "reduction 'add' of Bool values gives Float32", w, extra=[compact])
        assert "replace" in str(err)
        np.testing.assert_array_equal(np.asarray(compact), before_compact[0])
        assert compact.version == before_compact[1]
        # replace keeps the dtype, and works with exact values.
        replaced = c.scatter(compact, full, sel).wait()
        assert replaced.dtype() is DType.Bool
        assert [replaced[i] for i in (4, 5, 0, 1)] == compact_np.tolist()
        return
    assert central.dtype() is DType.Int32
    added = c.scatter(compact, full, sel, reduction="add").wait()
    assert added.dtype() is DType.Int32 and added.carrier.dtype() is DType.Int32
    model = (selected.astype(np.int64) + compact_np.astype(np.int64)).tolist()
    got = [added[i] for i in (4, 5, 0, 1)]
    assert got == model and all(type(x) is int for x in got)
    assert added.carrier.tile_state((1,)).location == "invalid"


def test_project_after_replace_scatter(rng):
    for make in (expert_weight, expert_first_weight):
        w = make(rng)
        c = w.carrier
        per_axis = [[0], [0], [5, 1]] if make is expert_weight else [[5, 1], [0], [0]]
        sel = TileSelection(per_axis)
        compact_np = rng.standard_normal(region(w.values, w.tile, per_axis).shape).astype(np.float32)
        result = c.scatter(cpu_tensor(compact_np), w.full, sel).wait()
        back = result.carrier.project(result, sel).wait()
        np.testing.assert_array_equal(np.asarray(back), compact_np)
    w = grid2_weight(rng)
    sel = TileSelection([[2, 0], [1]])
    compact_np = rng.standard_normal((4, 4)).astype(np.float32)
    result = w.carrier.scatter(cpu_tensor(compact_np), w.full, sel).wait()
    np.testing.assert_array_equal(np.asarray(result.carrier.project(result, sel).wait()), compact_np)


def test_reject_a_compact_shape_mismatch(rng):
    w = expert_weight(rng)
    c = w.carrier
    mixed_residency(w, primary_clean=[(0, 0, 1)], primary_dirty=[(0, 0, 3)])
    sel = TileSelection([[0], [0], [1, 3]])
    for shape in [(3, 4, 3), (4, 3, 2), (3, 4), (12, 2), (3, 4, 2, 1)]:
        compact = cpu_tensor(np.ones(shape, np.float32))
        assert_rejected(
            lambda: c.scatter(compact, w.full, sel), ValueError, "shape", w, extra=[compact]
        )


# ================================================================ Scatter participates in autograd


def test_differentiate_replace_scatter(rng):
    w = expert_weight(rng, experts=5)
    c = w.carrier
    sel = TileSelection([[0], [0], [3, 1]])
    compact_np = rng.standard_normal((3, 4, 2)).astype(np.float32)
    compact = cpu_tensor(compact_np)
    result = c.scatter(compact, w.full, sel).wait()
    node = result.autograd_ctx
    assert node.name == "scatter" and node.dispatch_carrier_class is TiledEvictable
    assert any(x is compact for x in node.inputs())
    # The loss consumes the written tiles (read back through the same selection).
    read = result.carrier.project(result, sel).wait()
    weights = rng.standard_normal((3, 4, 2)).astype(np.float32)
    loss = sw.reduce_sum(sw.elementwise_mul(read, cpu_tensor(weights)), "a b c -> a")
    cot = rng.standard_normal(3).astype(np.float32)
    loss.backward(gradient=cpu_tensor(cot))
    assert type(compact.grad.carrier) is sw.CPU
    np.testing.assert_allclose(np.asarray(compact.grad), cot[:, None, None] * weights, rtol=1e-5, atol=1e-6)
    # Replace: the overwritten template tiles receive no gradient.
    if w.full.grad is not None:
        assert isinstance(w.full.grad.carrier, TiledEvictable)
        np.testing.assert_array_equal(np_of(w.full.grad), np.zeros_like(w.values))

    # An explicit full cotangent: compact receives it at the saved selection; the
    # template none, since the result retained no template value (its unselected
    # tiles are invalid, its selected ones overwritten).
    compact.grad = None
    w.full.grad = None
    result = c.scatter(compact, w.full, sel).wait()
    seed_values = rng.standard_normal(w.values.shape).astype(np.float32) + 5.0
    seed = Tiled(seed_values, w.grid, w.tile)
    result.backward(gradient=seed.full)
    np.testing.assert_array_equal(np.asarray(compact.grad), region(seed_values, w.tile, sel.per_axis))
    if w.full.grad is not None:
        np.testing.assert_array_equal(np_of(w.full.grad), np.zeros_like(w.values))


def test_scatter_result_consumed_twice(rng):
    # Two consumers of one scatter result: their full tiled cotangents are summed
    # (as a tiled gradient) before the scatter node's backward.
    w = expert_weight(rng, experts=5)
    c = w.carrier
    sel = TileSelection([[0], [0], [1, 2, 4]])
    compact_np = rng.standard_normal((3, 4, 3)).astype(np.float32)
    compact = cpu_tensor(compact_np)
    result = c.scatter(compact, w.full, sel).wait()
    rc = result.carrier
    a = rc.project(result, TileSelection([[0], [0], [2, 1]])).wait()
    b = rc.project(result, TileSelection([[0], [0], [4, 2]])).wait()
    wa = rng.standard_normal((3, 4, 2)).astype(np.float32)
    wb = rng.standard_normal((3, 4, 2)).astype(np.float32)
    loss = sw.add(
        sw.reduce_sum(sw.elementwise_mul(a, cpu_tensor(wa)), "a b c -> a"),
        sw.reduce_sum(sw.elementwise_mul(b, cpu_tensor(wb)), "a b c -> a"),
    )
    loss.backward(gradient=cpu_tensor(np.ones(3, np.float32)))
    expected = np.zeros((3, 4, 3), np.float32)  # compact order: tiles 1, 2, 4
    expected[:, :, 1] += wa[:, :, 0]
    expected[:, :, 0] += wa[:, :, 1]
    expected[:, :, 2] += wb[:, :, 0]
    expected[:, :, 1] += wb[:, :, 1]
    np.testing.assert_allclose(np.asarray(compact.grad), expected, rtol=1e-5, atol=1e-6)


def test_add_scatter_gradients_reach_both_inputs(rng):
    w = expert_weight(rng, experts=5)
    c = w.carrier
    sel = TileSelection([[0], [0], [4, 0]])
    compact_np = rng.standard_normal((3, 4, 2)).astype(np.float32)
    compact = cpu_tensor(compact_np)
    result = c.scatter(compact, w.full, sel, reduction="add").wait()
    read = result.carrier.project(result, sel).wait()
    np.testing.assert_allclose(np.asarray(read), region(w.values, w.tile, sel.per_axis) + compact_np, rtol=1e-6)
    weights = rng.standard_normal((3, 4, 2)).astype(np.float32)
    loss = sw.reduce_sum(sw.elementwise_mul(read, cpu_tensor(weights)), "a b c -> a")
    loss.backward(gradient=cpu_tensor(np.ones(3, np.float32)))
    np.testing.assert_allclose(np.asarray(compact.grad), weights, rtol=1e-6)
    g = w.full.grad
    assert isinstance(g.carrier, TiledEvictable) and g.carrier is not c and g.layout == w.full.layout
    expected = np.zeros_like(w.values)
    expected[region_index(w.tile, sel.per_axis)] = weights
    np.testing.assert_allclose(np_of(g), expected, rtol=1e-6)
    for t in set(w.coords()) - set(sel.coordinates):
        assert g.carrier.tile_state(t).location == "implicit"

    # An explicit full cotangent reaches both inputs only at the selected tiles:
    # the result holds no template value elsewhere.
    compact.grad = None
    w.full.grad = None
    result = c.scatter(compact, w.full, sel, reduction="add").wait()
    seed_values = rng.standard_normal(w.values.shape).astype(np.float32) + 5.0
    seed = Tiled(seed_values, w.grid, w.tile)
    result.backward(gradient=seed.full)
    np.testing.assert_array_equal(np.asarray(compact.grad), region(seed_values, w.tile, sel.per_axis))
    expected = np.zeros_like(w.values)
    expected[region_index(w.tile, sel.per_axis)] = region(seed_values, w.tile, sel.per_axis)
    np.testing.assert_array_equal(np_of(w.full.grad), expected)
    np.testing.assert_array_equal(np_of(seed.full), seed_values)


@pytest.mark.parametrize("reduction", ["replace", "add"])
def test_scatter_saves_compact_and_refuses_backward_after_it_was_written(rng, reduction):
    w = expert_weight(rng, experts=5)
    c = w.carrier
    sel = TileSelection([[0], [0], [1, 3]])
    compact = cpu_tensor(rng.standard_normal((3, 4, 2)).astype(np.float32))
    result = c.scatter(compact, w.full, sel, reduction=reduction).wait()
    v0 = compact.version
    compact[(0, 0, 0)] = 1.0  # written in place after the scatter saved it
    with pytest.raises(RuntimeError, match="modified in-place") as info:
        result.backward(gradient=Tiled(np.ones_like(w.values), w.grid, w.tile).full)
    assert f"version {v0}" in str(info.value) and f"version {v0 + 1}" in str(info.value)
    assert compact.grad is None and w.full.grad is None  # nothing accumulated
    # Without the write, the same backward runs.
    compact2 = cpu_tensor(rng.standard_normal((3, 4, 2)).astype(np.float32))
    result2 = c.scatter(compact2, w.full, sel, reduction=reduction).wait()
    result2.backward(gradient=Tiled(np.ones_like(w.values), w.grid, w.tile).full)
    np.testing.assert_array_equal(np.asarray(compact2.grad), np.ones((3, 4, 2), np.float32))


# ================================================================ Accept a within-tile permutation


def test_accept_a_within_tile_permutation(rng):
    out, inp, experts = 3, 4, 5
    values = rng.standard_normal((out, inp, experts)).astype(np.float32)
    # Row-major within each expert tile: the same slots as the carrier tile, permuted.
    w = Tiled(values, (1, 1, experts), (out, inp, 1), strides=(inp, 1, out * inp))
    c = w.carrier
    mixed_residency(w, primary_clean=[(0, 0, 2)])
    assert w.full.layout.stride != friendly.column_major(out, inp, experts).stride
    # Logical values are defined by the Layout: slot offset + layout(x).
    for x in [(1, 2, 0), (2, 3, 4), (0, 1, 3)]:
        assert w.full[x] == pytest.approx(float(values[x]))

    sel = TileSelection([[0], [0], [4, 2]])
    compact = c.project(w.full, sel).wait()
    np.testing.assert_array_equal(np.asarray(compact), values[:, :, [4, 2]])

    # Scatter writes the compact values at the logical coordinates of the template Layout.
    new = rng.standard_normal((out, inp, 2)).astype(np.float32)
    result = c.scatter(cpu_tensor(new), w.full, sel).wait()
    assert result.layout == w.full.layout
    for k, e in enumerate([4, 2]):
        for o, i in itertools.product(range(out), range(inp)):
            slot = o * inp + i + out * inp * e
            assert result.carrier[slot] == new[o, i, k]
    np.testing.assert_array_equal(np.asarray(result.carrier.project(result, sel).wait()), new)

    # Direct execution on the full permuted Tensor.
    np.testing.assert_array_equal(np.asarray(sw.relu(w.full)), np.maximum(values, 0))
    s = sw.reduce_sum(w.full, "o i e -> i")
    np.testing.assert_allclose(np.asarray(s), values.sum(axis=(0, 2)), rtol=1e-5, atol=1e-5)

    # Backward of the direct operation and of a projection keep the logical association.
    cot = rng.standard_normal(inp).astype(np.float32)
    s.backward(gradient=cpu_tensor(cot))
    g = w.full.grad
    assert g.layout == w.full.layout and isinstance(g.carrier, TiledEvictable)
    np.testing.assert_allclose(np_of(g), np.broadcast_to(cot[None, :, None], values.shape), rtol=1e-6)
    w.full.grad = None
    p = c.project(w.full, sel).wait()
    weights = rng.standard_normal((out, inp, 2)).astype(np.float32)
    sw.reduce_sum(sw.elementwise_mul(p, cpu_tensor(weights)), "a b c -> a").backward(
        gradient=cpu_tensor(np.ones(out, np.float32))
    )
    expected = np.zeros_like(values)
    expected[:, :, [4, 2]] = weights
    np.testing.assert_allclose(np_of(w.full.grad), expected, rtol=1e-6)
    # The permuted gradient is physically permuted like its primal.
    gc = w.full.grad.carrier
    assert gc[0 * inp + 1 + out * inp * 4] == pytest.approx(float(weights[0, 1, 0]))


# ================================================================ validation: nothing changes on failure


def assert_rejected(call, exc, fragment, w: Tiled, *, extra=(), carriers=()):
    """`call` raises `exc` mentioning `fragment`; w's carrier, `extra` tensors and `carriers` are unchanged."""
    c = w.carrier
    before = tiled_snapshot(c)
    full_before = tensor_facts(w.full)
    extra_before = [(tensor_facts(t), carrier_facts(t.carrier)) for t in extra]
    carriers_before = [carrier_facts(x) for x in carriers]
    with pytest.raises(exc) as info:
        call()
    assert fragment.lower() in str(info.value).lower(), str(info.value)
    assert tiled_snapshot(c) == before
    assert tensor_facts(w.full) == full_before
    assert [(tensor_facts(t), carrier_facts(t.carrier)) for t in extra] == extra_before
    assert [carrier_facts(x) for x in carriers] == carriers_before
    if not c.is_released():
        np.testing.assert_array_equal(np_of(w.full), w.values)
    return info.value


@pytest.fixture
def scene(rng):
    """An (out, in, expert) weight with clean-primary, dirty-primary and secondary tiles."""
    w = expert_weight(rng, experts=6)
    mixed_residency(w, primary_clean=[(0, 0, 1)], primary_dirty=[(0, 0, 3)])
    return w


SEL = TileSelection([[0], [0], [3, 1, 5]])  # dirty, clean and secondary tiles


class TestProjectValidation:
    def test_tensor_not_a_tensor(self, scene):
        c = scene.carrier
        for bad in [None, 3, np.zeros((3, 4, 6), np.float32), [1.0], scene.values]:
            assert_rejected(lambda: c.project(bad, SEL), TypeError, "Tensor", scene)

    def test_tensor_of_another_carrier(self, scene, rng):
        c = scene.carrier
        cpu = cpu_tensor(scene.values)
        other = expert_weight(rng, experts=6)
        for t in [cpu, other.full]:
            assert_rejected(lambda: c.project(t, SEL), TypeError, "TiledEvictable", scene, extra=[t])
        assert tile_states(other.carrier) == {t: other.carrier.tile_state(t) for t in other.coords()}
        assert all(s.location == "secondary" for s in tile_states(other.carrier).values())

    def test_selection_not_a_tile_selection(self, scene):
        c = scene.carrier
        for bad in [None, [[0], [0], [1]], ((0,), (0,), (1,)), SEL.tile_set, "0"]:
            assert_rejected(lambda: c.project(scene.full, bad), TypeError, "TileSelection", scene)

    def test_released_carrier(self, rng):
        w = expert_weight(rng)
        w.carrier.release()
        assert_rejected(lambda: w.carrier.project(w.full, SEL), RuntimeError, "released", w)

    @pytest.mark.parametrize("kind", ["spanning", "aliasing", "remapped", "partial"])
    def test_footprint_incompatible_tensor(self, scene, kind):
        c = scene.carrier
        out, inp, experts = scene.values.shape
        n = out * inp
        if kind == "spanning":  # experts fastest: one logical tile reaches every carrier tile
            t = Tensor(c, 0, Layout(Shape(out, inp, experts), Stride(experts, experts * out, 1)))
        elif kind == "aliasing":  # repeats slots and omits others within each tile
            t = Tensor(c, 0, Layout(Shape(out, inp, experts), Stride(1, 0, n)))
        elif kind == "remapped":  # logical tile e reaches exactly carrier tile 3*(e%2) + e//2
            t = Tensor(c, 0, Layout(Shape(out, inp, [2, experts // 2]), Stride(1, out, [3 * n, n])))
        else:  # only part of the logical extent
            t = Tensor(c, 0, Layout(Shape(out, inp, experts - 1), Stride(1, out, n)))
        assert_rejected(lambda: c.project(t, TileSelection([[0], [0], [1]])), ValueError, "footprint", scene, extra=[t])

    @pytest.mark.parametrize(
        "per_axis,fragment",
        [
            ([[0], [3]], "rank"),
            ([[0], [0], [1], [0]], "rank"),
            ([[0], [0], [6]], "range"),
            ([[0], [1], [2]], "range"),
            ([[1], [0], [0, 2]], "range"),
        ],
    )
    def test_selection_rank_or_range(self, scene, per_axis, fragment):
        c = scene.carrier
        assert_rejected(lambda: c.project(scene.full, TileSelection(per_axis)), ValueError, fragment, scene)

    def test_destination_not_an_ordinary_compute_carrier(self, scene, rng):
        c = scene.carrier
        other = expert_weight(rng)
        evictable = sw.Evictable(sw.CPU(64), sw.FileBacked())
        generic = sw.Generic([0.0] * 64)
        filebacked = sw.FileBacked()
        cases = [
            (other.carrier, "dependent"),
            (c, "dependent"),
            (evictable, "dependent"),
            (generic, "CPU"),
            (filebacked, "CPU"),
            (3, "Carrier"),
            (cpu_tensor(np.zeros(36, np.float32)), "Carrier"),
        ]
        for dest, fragment in cases:
            carriers = [dest] if isinstance(dest, sw.Carrier) and dest is not c else []
            assert_rejected(lambda: c.project(scene.full, SEL, dest), TypeError, fragment, scene, carriers=carriers)

    def test_destination_released_or_immutable(self, scene, rng):
        c = scene.carrier
        released = sw.CPU(64)
        released.release()
        immutable = sw.CPU(64, mutable=False)
        owner = sw.Evictable(sw.CPU(64), sw.FileBacked())  # owns its tiers
        owned = owner.primary
        assert owned.is_owned()
        assert_rejected(lambda: c.project(scene.full, SEL, released), RuntimeError, "released", scene,
                        carriers=[released])
        assert_rejected(lambda: c.project(scene.full, SEL, immutable), RuntimeError, "mutable", scene,
                        carriers=[immutable])
        if type(owned) is sw.CPU:
            assert_rejected(lambda: c.project(scene.full, SEL, owned), RuntimeError, "mutable", scene,
                            carriers=[owned])

    def test_destination_dtype(self, scene):
        c = scene.carrier
        dest = sw.CPU(64, dtype=DType.Int32)
        assert_rejected(lambda: c.project(scene.full, SEL, dest), TypeError, "dtype", scene, carriers=[dest])

    def test_destination_insufficient(self, scene):
        c = scene.carrier
        dest = sw.CPU(35)  # the projection needs 3 * 4 * 3 = 36 slots
        assert_rejected(lambda: c.project(scene.full, SEL, dest), ValueError, "slots", scene, carriers=[dest])
        # Large enough or allocatable destinations are accepted.
        for ok in [sw.CPU(36), sw.CPU(50), sw.CPU(0)]:
            got = c.project(scene.full, SEL, ok).wait()
            assert got.carrier is ok and ok.size() >= 36 and not ok.is_owned()
            np.testing.assert_array_equal(np.asarray(got), region(scene.values, scene.tile, SEL.per_axis))


class TestScatterValidation:
    def compact(self, w):
        return cpu_tensor(np.ones((3, 4, 3), np.float32))

    def test_compact_or_template_not_a_tensor(self, scene):
        c = scene.carrier
        good = self.compact(scene)
        for bad in [None, 1.0, np.ones((3, 4, 3), np.float32)]:
            assert_rejected(lambda: c.scatter(bad, scene.full, SEL), TypeError, "Tensor", scene, extra=[good])
            assert_rejected(lambda: c.scatter(good, bad, SEL), TypeError, "Tensor", scene, extra=[good])

    def test_compact_on_a_dependent_or_other_class_carrier(self, scene, rng):
        c = scene.carrier
        other = expert_weight(rng, out=3, inp=4, experts=3)
        ev = sw.Evictable(sw.CPU(36), sw.FileBacked())
        ev_t = Tensor(ev, 0, friendly.column_major(3, 4, 3))
        gen = friendly.tensor(np.ones((3, 4, 3), np.float32), carrier=sw.Generic)
        for compact, fragment in [(other.full, "ordinary"), (ev_t, "ordinary"), (gen, "CPU"),
                                  (scene.full, "ordinary")]:
            assert_rejected(lambda: c.scatter(compact, scene.full, SEL), TypeError, fragment, scene, extra=[compact])

    def test_template_of_another_carrier(self, scene, rng):
        c = scene.carrier
        good = self.compact(scene)
        other = expert_weight(rng)
        for templ in [other.full, cpu_tensor(scene.values)]:
            assert_rejected(lambda: c.scatter(good, templ, SEL), TypeError, "template", scene, extra=[good, templ])

    def test_selection_not_a_tile_selection(self, scene):
        c = scene.carrier
        good = self.compact(scene)
        for bad in [None, [[0], [0], [3, 1, 5]], SEL.tile_set]:
            assert_rejected(lambda: c.scatter(good, scene.full, bad), TypeError, "TileSelection", scene, extra=[good])

    def test_released_carrier_or_compact(self, rng):
        w = expert_weight(rng)
        good = cpu_tensor(np.ones((3, 4, 3), np.float32))
        dead = cpu_tensor(np.ones((3, 4, 3), np.float32))
        dead.carrier.release()
        assert_rejected(lambda: w.carrier.scatter(dead, w.full, SEL), RuntimeError, "released", w, extra=[dead])
        w.carrier.release()
        assert_rejected(lambda: w.carrier.scatter(good, w.full, SEL), RuntimeError, "released", w, extra=[good])

    def test_compact_dtype(self, scene):
        c = scene.carrier
        ints = friendly.tensor(np.ones((3, 4, 3), np.int32), dtype=DType.Int32)
        assert_rejected(lambda: c.scatter(ints, scene.full, SEL), TypeError, "dtype", scene, extra=[ints])

    @pytest.mark.parametrize(
        "per_axis,fragment", [([[0], [3]], "rank"), ([[0], [0], [6, 1, 2]], "range"), ([[1], [0], [0, 1, 2]], "range")]
    )
    def test_selection_rank_or_range(self, scene, per_axis, fragment):
        c = scene.carrier
        good = cpu_tensor(np.ones((3, 4, 3), np.float32))
        assert_rejected(lambda: c.scatter(good, scene.full, TileSelection(per_axis)), ValueError, fragment, scene,
                        extra=[good])

    def test_template_tile_geometry_mismatch(self, scene):
        c = scene.carrier
        out, inp, experts = scene.values.shape
        templ = Tensor(c, 0, Layout(Shape(out, inp, experts), Stride(experts, experts * out, 1)))
        good = cpu_tensor(np.ones((3, 4, 3), np.float32))
        assert_rejected(lambda: c.scatter(good, templ, SEL), ValueError, "footprint", scene, extra=[good, templ])

    def test_reduction(self, scene):
        c = scene.carrier
        good = cpu_tensor(np.ones((3, 4, 3), np.float32))
        for bad in ["sum", "Replace", "", "mean", None, 1]:
            assert_rejected(lambda: c.scatter(good, scene.full, SEL, reduction=bad), ValueError, "reduction", scene,
                            extra=[good])


# ================================================================ direct operations: exactly six names


def make_pair(geometry, rng):
    a = GEOMETRIES[geometry](rng)
    b = Tiled(rng.standard_normal(a.values.shape).astype(np.float32), a.grid, a.tile)
    mixed_residency(a, primary_clean=[a.coords()[1]], primary_dirty=[a.coords()[-1]])
    mixed_residency(b, primary_dirty=[b.coords()[0]])
    return a, b


def sum_description(rank, keep):
    names = "abcd"[:rank]
    return f"{' '.join(names)} -> {' '.join(names[k] for k in keep)}"


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize(
    "op", ["add", "elementwise_mul", "mul", "mul_scalar_right", "mul_scalar_left", "relu", "reduce_sum",
           "reduce_sum_default"]
)
def test_direct_operation_matches_dense(geometry, op, rng):
    a, b = make_pair(geometry, rng)
    A, B = a.values, b.values
    rank = A.ndim
    s = 1.75
    keep = (rank - 1,)
    if op == "add":
        run, name, ref, grads = (lambda: sw.add(a.full, b.full)), "add", A + B, (lambda C: (C, C))
    elif op == "elementwise_mul":
        run, name, ref, grads = (lambda: sw.elementwise_mul(a.full, b.full)), "elementwise_mul", A * B, (
            lambda C: (C * B, C * A))
    elif op == "mul":
        run, name, ref, grads = (lambda: sw.mul(a.full, b.full)), "mul", A * B, (lambda C: (C * B, C * A))
    elif op == "mul_scalar_right":
        run, name, ref, grads = (lambda: sw.mul(a.full, s)), "mul", A * np.float32(s), (lambda C: (C * s,))
    elif op == "mul_scalar_left":
        run, name, ref, grads = (lambda: sw.mul(s, a.full)), "mul", np.float32(s) * A, (lambda C: (C * s,))
    elif op == "relu":
        run, name, ref, grads = (lambda: sw.relu(a.full)), "relu", np.maximum(A, 0), (lambda C: (C * (A > 0),))
    elif op == "reduce_sum":
        summed = tuple(k for k in range(rank) if k not in keep)
        run, name = (lambda: sw.reduce_sum(a.full, sum_description(rank, keep))), "reduce_sum"
        ref = A.sum(axis=summed)
        grads = lambda C: (np.broadcast_to(np.expand_dims(C, summed), A.shape),)
    else:  # reduce_sum without a description keeps the first mode
        summed = tuple(range(1, rank))
        run, name = (lambda: sw.reduce_sum(a.full)), "reduce_sum"
        ref = A.sum(axis=summed)
        grads = lambda C: (np.broadcast_to(np.expand_dims(C, summed), A.shape),)
    inputs = [a] if op in ("mul_scalar_right", "mul_scalar_left", "relu", "reduce_sum", "reduce_sum_default") else [a, b]
    check_direct(run, name, ref, grads, inputs, rng)


def check_direct(run, name, ref, grads, inputs, rng):
    states = [tile_states(w.carrier) for w in inputs]
    versions = [w.carrier.version for w in inputs]
    out = run()
    assert type(out.carrier) is sw.CPU  # ordinary dense compute-carrier result, not re-wrapped
    assert out.layout == friendly.column_major(*ref.shape) if ref.ndim else True
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    node = out.autograd_ctx
    assert node is not None and node.name == name and node.dispatch_carrier_class is TiledEvictable
    # Exactly one outer node: its inputs are the raw tiled leaves themselves.
    assert [x is w.full for x, w in zip(node.inputs(), inputs)] == [True] * len(inputs)
    assert len(node.inputs()) == len(inputs)
    for w, v, st in zip(inputs, versions, states):
        assert w.full.autograd_ctx is None and w.carrier.version == v
        assert all(w.carrier.tile_state(t).valid for t in w.coords())
        assert {t for t, s in st.items() if s.dirty} <= {t for t in w.coords() if w.carrier.tile_state(t).dirty}
    C = rng.standard_normal(ref.shape).astype(np.float32)
    out.backward(gradient=cpu_tensor(C))
    expected = grads(C)
    for w, e in zip(inputs, expected):
        g = w.full.grad
        assert g is not None and isinstance(g.carrier, TiledEvictable) and g.carrier is not w.carrier
        assert g.layout == w.full.layout and g.carrier.grid_shape == w.carrier.grid_shape
        assert g.carrier.tile_shape == w.carrier.tile_shape
        np.testing.assert_allclose(np_of(g), e, rtol=1e-5, atol=1e-5)


def test_direct_matmul_matches_dense(rng):
    lhs = grid2_weight(rng, grid=(3, 2), tile=(2, 4))  # (6, 8)
    rhs = Tiled(rng.standard_normal((5, 8)).astype(np.float32), (1, 2), (5, 4))  # (5, 8)
    mixed_residency(lhs, primary_clean=[(1, 0)], primary_dirty=[(2, 1)])
    A, B = lhs.values, rhs.values
    check_direct(lambda: sw.matmul(lhs.full, rhs.full), "matmul", A @ B.T, lambda C: (C @ B, C.T @ A), [lhs, rhs],
                 rng)


def test_direct_operation_on_mismatched_carriers_rejected(rng):
    w = expert_weight(rng)
    dense = cpu_tensor(w.values)
    before = tile_states(w.carrier)
    with pytest.raises(TypeError, match="carriers must match"):
        sw.add(w.full, dense)
    assert tile_states(w.carrier) == before


@pytest.mark.parametrize("name", ["sub", "div", "neg", "exp"])
def test_direct_operation_other_names_unsupported(name, rng):
    w = expert_weight(rng)
    v = Tiled(rng.standard_normal(w.values.shape).astype(np.float32) + 3.0, w.grid, w.tile)
    before = tiled_snapshot(w.carrier), tiled_snapshot(v.carrier)
    fn = getattr(sw, name)
    with pytest.raises(NotImplementedError):
        fn(w.full, v.full) if name in ("sub", "div") else fn(w.full)
    with pytest.raises(NotImplementedError):
        w.carrier.dispatch_op(name)
    assert (tiled_snapshot(w.carrier), tiled_snapshot(v.carrier)) == before
    assert not w.carrier.is_owned() and not v.carrier.is_owned()
    # The ordinary compact tensor returned by a projection still accepts it.
    p = w.carrier.project(w.full, TileSelection([[0], [0], [0, 1]])).wait()
    q = v.carrier.project(v.full, TileSelection([[0], [0], [0, 1]])).wait()
    r = fn(p, q) if name in ("sub", "div") else fn(p)
    assert type(r.carrier) is sw.CPU


# ---------------------------------------------------------------- held I/O: pending projections and races


def test_overlap_projection_with_computation_while_promotion_is_held(rng, held_io):
    out, inp, experts = 8, 4, 6
    w = Tiled(rng.standard_normal((out, inp, experts)).astype(np.float32), (1, 1, experts), (out, inp, 1))
    c = w.carrier
    sel = TileSelection([[0], [0], [4, 1, 3]])
    held_io._io_hold("pread")
    handle = c.project(w.full, sel)
    # project returned while the missing tiles' transfer is still pending.
    assert handle.done is False
    unrelated = sw.matmul(cpu_tensor(np.ones((3, 5))), cpu_tensor(np.ones((2, 5))))
    np.testing.assert_array_equal(np.asarray(unrelated), np.full((3, 2), 5.0, np.float32))
    assert handle.done is False
    held_io._io_unhold()
    compact = handle.wait()
    assert handle.done and compact is handle.wait()
    np.testing.assert_array_equal(np.asarray(compact), region(w.values, w.tile, sel.per_axis))


@pytest.mark.parametrize("work", ["project", "scatter_add", "operation"])
def test_tiled_work_racing_a_pending_evict_raises_wait(rng, held_io, work):
    out, inp, experts = 4, 3, 5
    w = Tiled(rng.standard_normal((out, inp, experts)).astype(np.float32), (1, 1, experts), (out, inp, 1))
    c = w.carrier
    c.promote(te.TileSet([(0, 0, 1), (0, 0, 2)]))
    w.full[(0, 0, 1)] = 5.0  # dirty: its eviction must write
    held_io._io_hold("pwrite")
    pending = c.evict_async(te.TileSet([(0, 0, 1)]))
    assert pending.done is False
    before = {t: c.tile_state(t) for t in [(0, 0, e) for e in range(experts)]}
    version = c.version
    sel = TileSelection([[0], [0], [1, 2]])
    with pytest.raises(RuntimeError, match="wait"):
        if work == "project":
            c.project(w.full, sel)
        elif work == "scatter_add":
            compact = cpu_tensor(np.ones((out, inp, 2)))
            c.scatter(compact, w.full, sel, "add")
        else:
            sw.relu(w.full)
    assert pending.done is False  # it neither waited for nor joined the eviction
    assert {t: c.tile_state(t) for t in before} == before and c.version == version
    held_io._io_unhold()
    pending.wait()
    assert c.tile_state((0, 0, 1)).location == "secondary"
    # Once the eviction is terminal the same work succeeds.
    got = c.project(w.full, sel).wait()
    expected = region(w.values, w.tile, sel.per_axis).copy()
    expected[0, 0, 0] = 5.0
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_evict_racing_a_pending_projection_raises_wait(rng, held_io):
    out, inp, experts = 4, 3, 5
    w = Tiled(rng.standard_normal((out, inp, experts)).astype(np.float32), (1, 1, experts), (out, inp, 1))
    c = w.carrier
    held_io._io_hold("pread")
    handle = c.project(w.full, TileSelection([[0], [0], [2, 3]]))
    assert handle.done is False
    with pytest.raises(RuntimeError, match="wait"):
        c.evict_async(te.TileSet([(0, 0, 3)]))
    assert handle.done is False
    held_io._io_unhold()
    handle.wait()
    c.evict(te.TileSet([(0, 0, 3)]))
    assert c.tile_state((0, 0, 3)).location == "secondary"
