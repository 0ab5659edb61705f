"""Fuzz tests of TiledEvictable: construction, project, scatter, promote/evict and residency policies (fuzzing.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import strideweave as sw
from strideweave import Layout, Shape, Stride, Tensor
from strideweave.carriers.tiled_evictable import ResidencyPlan, TiledEvictable, TileSelection, TileSet

from fuzzing import (
    CALLS,
    F32,
    GARBAGE,
    I32,
    OUTCOMES,
    ZERO,
    attempt,
    colex,
    dense_offset,
    expect,
    facts,
    finish,
    fuzz,
    int_like,
    make_carrier,
    tile_table_too_big,
)

pytestmark = pytest.mark.usefixtures("fuzz_report", "fuzz_watchdog", "clear_io_faults", "grad_mode_on")


# ================================================================ TiledEvictable construction


SANE_TIERS = ["cpu0", "cpu_full", "file0", "file_full", "generic0", "generic_full"]
HOSTILE_TIERS = ["cpu_partial", "released", "owned", "evictable", "tiled", "garbage", "immutable_full", "other_dtype"]


def tier(draw, label, n, dtype, hostile):
    kind = draw(st.sampled_from(SANE_TIERS + HOSTILE_TIERS if hostile else SANE_TIERS), label=label)
    keep = []
    if dtype is I32:
        vals = [i * 3 + (1 if label == "primary" else 100) for i in range(n)]
    else:
        vals = [float(i) * 1.5 + (0.25 if label == "primary" else 100.0) for i in range(n)]
    if kind in ("cpu0", "file0", "generic0"):
        c = make_carrier(kind[:-1] if kind != "cpu0" else "cpu", 0, dtype) if kind != "generic0" else sw.Generic([], dtype=dtype)
        return kind, c, None, keep
    if kind.endswith("_full") or kind == "cpu_partial":
        size = n if kind != "cpu_partial" else draw(st.sampled_from([1, n + 1, max(1, n - 1)]))
        if kind == "cpu_partial" and size == n:
            size = n + 1
        k = {"cpu_full": "cpu", "file_full": "file", "generic_full": "generic", "cpu_partial": "cpu",
             "immutable_full": "cpu"}[kind]
        c = make_carrier(k, size, dtype)
        for i in range(size):
            c[i] = vals[i] if i < n else ZERO[dtype]
        if kind == "immutable_full":
            c = c.new_like([c[i] for i in range(size)], mutable=False)
        return kind, c, vals[:size], keep
    if kind == "released":
        c = sw.CPU(0, dtype=dtype)
        c.release()
        return kind, c, None, keep
    if kind == "owned":  # claimed by another live TiledEvictable
        c = sw.CPU(0, dtype=dtype)
        keep.append(TiledEvictable(c, sw.CPU(0, dtype=dtype), (1,), (1,)))
        return kind, c, None, keep
    if kind == "evictable":
        return kind, sw.Evictable(sw.CPU(1, dtype=dtype), sw.FileBacked(dtype=dtype)), None, keep
    if kind == "tiled":
        return kind, TiledEvictable(sw.CPU(0, dtype=dtype), sw.CPU(0, dtype=dtype), (1,), (1,)), None, keep
    if kind == "other_dtype":
        return kind, sw.CPU(0, dtype=I32 if dtype is F32 else F32), None, keep
    return kind, draw(GARBAGE), None, keep


BAD_EXTENTS = [True, 1.5, None, "2", np.int64(2)]
# Tile extents may be huge (a tile of 2**32 slots with empty tiers allocates nothing when its footprint is
# few runs). Grid extents are either small or beyond the tile table limits (2**40 tiles: ValueError before
# anything is allocated; 2**62 and up: ValueError for the extent).
tile_entries = st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(-1, 0),
                         st.sampled_from([2**31, 2**32, 2**62, 2**63] + BAD_EXTENTS))


grid_entries = st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(-1, 0),
                         st.sampled_from([2**40, 2**62, 2**63] + BAD_EXTENTS))


class _GoodPolicy:
    def plan(self, required, purpose):
        return ResidencyPlan()


class _NotAPolicy:
    plan = 3


@fuzz(250)
@given(data=st.data())
def test_fuzz_tiled_evictable_construction(data):
    # One part of the call is hostile (or none, or all): the others are sane, so that every rule is reached.
    hostile = data.draw(st.sampled_from(["none", "none", "grid", "tile", "rank", "shapes", "primary", "secondary",
                                         "same", "policy", "everything"]), label="hostile part")
    bad = lambda part: hostile in (part, "everything")  # noqa: E731
    rank = data.draw(st.integers(0, 3) if bad("rank") else st.integers(1, 3), label="rank")
    grid = data.draw(st.lists(grid_entries if bad("grid") else st.integers(1, 3), min_size=rank, max_size=rank),
                     label="grid")
    tile = data.draw(st.lists(tile_entries if bad("tile") else st.integers(1, 3), min_size=rank, max_size=rank),
                     label="tile")
    if bad("rank") and data.draw(st.booleans(), label="rank mismatch"):
        tile = tile + [1]
    if bad("shapes"):
        grid = data.draw(st.sampled_from([3, "12", None, 2.5, Shape(2), (2,)]), label="grid garbage")
    dtype = data.draw(st.sampled_from([F32, F32, I32]), label="dtype")
    shape_ok = isinstance(grid, (list, tuple, Shape)) and isinstance(tile, list)
    gl = list(grid.extents) if isinstance(grid, Shape) else grid
    ints = shape_ok and all(int_like(v) for v in list(gl) + list(tile))
    n = math.prod(int(v) for v in list(gl) + tile) if ints and all(1 <= int(v) <= 2**62 for v in list(gl) + tile) else 0
    nn = n if 0 < n <= 64 else 4
    pk, primary, pvals, keep1 = tier(data.draw, "primary", nn, dtype, bad("primary"))
    sk, secondary, svals, keep2 = tier(data.draw, "secondary", nn, dtype, bad("secondary"))
    if bad("same"):
        sk, secondary, svals = pk, primary, pvals
    policy = data.draw(st.sampled_from([None, _GoodPolicy(), _NotAPolicy(), "policy", 3] if bad("policy")
                                       else [None, _GoodPolicy()]), label="policy")

    faults = set()
    carriers = [primary, secondary]
    if not all(isinstance(c, sw.Carrier) for c in carriers):
        faults.add(TypeError)
    else:
        if any(k in ("evictable", "tiled") for k in (pk, sk)):
            faults.add(TypeError)
        if primary is secondary:
            faults.add(ValueError)
        if any(k in ("released", "owned") for k in (pk, sk)):
            faults.add(RuntimeError)
        if primary.dtype() is not secondary.dtype():
            faults.add(TypeError)
    if not shape_ok:
        faults.add(TypeError)
    else:
        if not ints:
            faults.add(TypeError)
            if any(int_like(v) and not -(2**63) <= int(v) < 2**63 for v in list(gl) + list(tile)):
                faults.add(ValueError)  # an entry beyond int64 before the non-int one is reported first
        else:
            vals = [int(v) for v in list(gl) + tile]
            if len(gl) == 0 or len(gl) != len(tile):
                faults.add(ValueError)
            elif any(v < 1 for v in vals) or any(v > 2**62 for v in vals) or math.prod(vals) > 2**62:
                faults.add(ValueError)
            elif tile_table_too_big([int(v) for v in gl], [int(v) for v in tile]):
                faults.add(ValueError)  # the tile table limits
    if policy is not None and not isinstance(policy, _GoodPolicy):
        faults.add(TypeError)
    if not faults:
        for k, c in ((pk, primary), (sk, secondary)):
            if c.size() not in (0, n):
                faults.add(ValueError)
    before = [facts(c) for c in carriers if isinstance(c, sw.Carrier)]
    te_, err = attempt("TiledEvictable", lambda: TiledEvictable(primary, secondary, grid, tile, residency_policy=policy))
    if faults or err is not None:
        if not faults and isinstance(err, ValueError) and "cannot grow" in str(err):
            return  # an empty tier that cannot hold evicted tiles: documented ValueError
        assert faults, f"valid construction raised {type(err).__name__}: {err}"
        assert isinstance(err, tuple(faults)), (faults, err)
        assert [facts(c) for c in carriers if isinstance(c, sw.Carrier)] == before  # nothing claimed
        return
    c = te_
    g = tuple(int(v) for v in gl)
    t = tuple(int(v) for v in tile)
    assert c.grid_shape == g and c.tile_shape == t and c.logical_shape == tuple(a * b for a, b in zip(g, t))
    assert c.size() == n and c.dtype() is dtype and c.residency_policy is policy
    assert primary.is_owned() and secondary.is_owned()
    if n <= 64:
        if primary.size() == n:
            where, vals = "primary", pvals
        elif secondary.size() == n:
            where, vals = "secondary", svals
        else:
            where, vals = "invalid", None
        for tc in colex(g):
            assert c.tile_state(tc).location == where
        if vals is not None:
            assert [c[s] for s in range(n)] == vals
        else:
            expect("TiledEvictable[i]", lambda: c[0], {RuntimeError})
    c.release()
    assert c.is_released() and primary.is_released() and secondary.is_released()


# ================================================================ TiledEvictable scenes


class Scene:
    """A TiledEvictable with known values and mixed residency, plus the model of its logical values."""

    def __init__(self, draw, policy=None, allow_invalid=True):
        self.rank = draw(st.integers(1, 3), label="rank")
        self.grid = tuple(draw(st.lists(st.integers(1, 3), min_size=self.rank, max_size=self.rank), label="grid"))
        self.tile = tuple(draw(st.lists(st.integers(1, 3), min_size=self.rank, max_size=self.rank), label="tile"))
        self.logical = tuple(g * t for g, t in zip(self.grid, self.tile))
        self.n = math.prod(self.logical)
        self.tiles = colex(self.grid)
        secondary_kind = draw(st.sampled_from(["file", "cpu"]), label="secondary")
        start = draw(st.sampled_from(["secondary", "secondary", "implicit", "partial"] if allow_invalid
                                     else ["secondary", "secondary", "implicit"]), label="start")
        vals = [float((7 * s) % 23) - 5.0 for s in range(self.n)]
        sec = (sw.FileBacked().allocate_like(self.n) if secondary_kind == "file" else sw.CPU(self.n))
        for s, v in enumerate(vals):
            sec[s] = v
        base = TiledEvictable(sw.CPU(0), sec, self.grid, self.tile, residency_policy=policy)
        self.vals = list(vals)
        if start == "implicit":
            self.carrier = base.allocate_like(self.n)
            self.vals = [0.0] * self.n
            base.release()
        elif start == "partial":
            # a scatter result: the selected tiles valid and dirty, the others invalid
            sel = TileSelection([sorted(draw(st.sets(st.integers(0, g - 1), min_size=1), label="axis")) for g in self.grid])
            compact_ext = tuple(len(a) * t for a, t in zip(sel.per_axis, self.tile))
            compact = sw.friendly.tensor(np.arange(math.prod(compact_ext), dtype=np.float32).reshape(compact_ext, order="F"))
            full = Tensor(base, 0, sw.column_major(*self.logical))
            with sw.no_grad():
                out = finish(base.scatter(compact, full, sel))
            self.carrier = out.carrier
            self.vals = [None] * self.n
            for coord in colex(compact_ext):
                src = tuple(sel.per_axis[i][coord[i] // self.tile[i]] * self.tile[i] + coord[i] % self.tile[i]
                            for i in range(self.rank))
                self.vals[dense_offset(src, self.logical)] = float(np.asarray(compact)[coord])
            base.release()
        else:
            self.carrier = base
        c = self.carrier
        # mixed residency: promote some tiles, dirty some by a slot write
        valid = [t for t in self.tiles if c.tile_state(t).valid]
        promote = draw(st.lists(st.sampled_from(valid), unique=True), label="promote") if valid else []
        c.promote(TileSet(promote))
        for t in draw(st.lists(st.sampled_from(valid), unique=True, max_size=3), label="dirty") if valid else []:
            slot = self.slots(t)[0]
            self.vals[slot] = float(self.vals[slot] + 1.0)
            c[slot] = self.vals[slot]
        self.full = Tensor(c, 0, sw.column_major(*self.logical))

    def slots(self, t):
        return [dense_offset(x, self.logical) for x in colex(self.logical)
                if tuple(xi // ti for xi, ti in zip(x, self.tile)) == tuple(t)]

    def valid(self, t):
        return self.vals[self.slots(t)[0]] is not None

    def snapshot(self):
        """Everything a refused request must leave unchanged, read without moving anything."""
        c = self.carrier
        d = facts(c)
        if c.is_released():
            return d
        states = {t: c.tile_state(t) for t in self.tiles}
        values = {}
        for t, s in states.items():
            for slot in self.slots(t):
                if s.location in ("primary", "implicit"):
                    values[slot] = c[slot]
                elif s.location == "secondary":
                    values[slot] = c.secondary[slot]
        d.update(states=states, values=values, stats=c.stats(), primary=facts(c.primary),
                 secondary={k: v for k, v in facts(c.secondary).items() if k != "values"})
        return d

    def region(self, per_axis):
        """The model of project(full, TileSelection(per_axis)): (compact extents, {compact coord: value})."""
        ext = tuple(len(a) * t for a, t in zip(per_axis, self.tile))
        out = {}
        for coord in colex(ext):
            src = tuple(per_axis[i][coord[i] // self.tile[i]] * self.tile[i] + coord[i] % self.tile[i]
                        for i in range(self.rank))
            out[coord] = self.vals[dense_offset(src, self.logical)]
        return ext, out

    def check_values(self):
        c = self.carrier
        for t in self.tiles:
            s = c.tile_state(t)
            assert s.valid == self.valid(t), (t, s)
            if s.valid:
                for slot in self.slots(t):
                    assert c[slot] == self.vals[slot], (slot, c[slot], self.vals[slot])


@st.composite
def selections(draw, scene):
    """A TileSelection (in range or not), or something else; with the faults the model expects."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "out of range", "rank", "tile set", "garbage", "huge"]))
    if kind in ("valid", "out of range", "huge"):
        axes = [draw(st.permutations(range(g)).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: list(p[:k]))))
                for g in scene.grid]
        if kind == "out of range":
            i = draw(st.integers(0, scene.rank - 1))
            axes[i] = axes[i] + [scene.grid[i] + draw(st.integers(0, 2))]
        if kind == "huge":
            axes[0] = axes[0] + [draw(st.sampled_from([2**62, 2**63, 2**70]))]
        return TileSelection(axes), (set() if kind == "valid" else {ValueError}), axes
    if kind == "rank":
        axes = [[0]] * draw(st.sampled_from([r for r in (1, 2, 3, 4) if r != scene.rank]))
        return TileSelection(axes), {ValueError}, None
    if kind == "tile set":
        return TileSet([tuple([0] * scene.rank)]), {TypeError}, None
    return draw(st.sampled_from([None, [[0]], "sel", 0, (0,)])), {TypeError}, None


def invalid_selected(scene, axes):
    return any(not scene.valid(tuple(axes[i][c[i]] for i in range(scene.rank)))
               for c in colex(tuple(len(a) for a in axes)))


def _other_full(scene):
    other = TiledEvictable(sw.CPU(0), sw.CPU(scene.n), scene.grid, scene.tile)
    return Tensor(other, 0, sw.column_major(*scene.logical))


@st.composite
def full_tensors(draw, scene):
    """The tensor argument of project/scatter: the full tensor or a hostile substitute, and its faults."""
    kind = draw(st.sampled_from(["full", "full", "full", "other carrier", "partial", "offset", "cpu", "handle", "none",
                                 "transposed"]))
    c = scene.carrier
    if kind == "full":
        return scene.full, set()
    if kind == "other carrier":
        return _other_full(scene), {TypeError}
    if kind == "partial":
        if scene.n == 1:
            return scene.full, set()
        return Tensor(c, 0, sw.column_major(scene.n - 1)), {ValueError}
    if kind == "offset":
        if scene.n == 1:
            return scene.full, set()
        return Tensor(c, 1, sw.column_major(scene.n - 1)), {ValueError}
    if kind == "transposed":
        if scene.rank < 2 or scene.logical[0] == scene.logical[1] or (scene.grid[0] == 1 and scene.grid[1] == 1):
            return scene.full, set()
        ext = (scene.logical[1], scene.logical[0]) + scene.logical[2:]
        return Tensor(c, 0, sw.column_major(*ext)), {ValueError}
    if kind == "cpu":
        return sw.friendly.zeros(*scene.logical), {TypeError}
    if kind == "handle":
        h = sw.move_async(sw.friendly.zeros(2), sw.CPU(0))
        finish(h)
        return h, {TypeError}
    return None, {TypeError}


@fuzz(150)
@given(data=st.data())
def test_fuzz_tiled_project(data):
    scene = Scene(data.draw)
    sel, faults, axes = data.draw(selections(scene), label="selection")
    tensor, tfaults = data.draw(full_tensors(scene), label="tensor")
    faults = faults | tfaults
    ext = tuple(len(a) * t for a, t in zip(axes, scene.tile)) if axes and not faults else None
    need = math.prod(ext) if ext else 4
    dkind = data.draw(st.sampled_from(["none", "none", "cpu0", "exact", "bigger", "smaller", "immutable", "released",
                                       "generic", "file", "int32", "tiled", "primary tier", "garbage"]), label="dest")
    dest = {
        "none": lambda: None, "cpu0": lambda: sw.CPU(0), "exact": lambda: sw.CPU(need), "bigger": lambda: sw.CPU(need + 5),
        "smaller": lambda: sw.CPU(need - 1) if need > 1 else sw.CPU(0),
        "immutable": lambda: sw.CPU(need, mutable=False), "released": lambda: _released(sw.CPU(need)),
        "generic": lambda: sw.Generic([], dtype=F32), "file": lambda: sw.FileBacked(), "int32": lambda: sw.CPU(0, dtype=I32),
        "tiled": lambda: scene.carrier, "primary tier": lambda: scene.carrier.primary, "garbage": lambda: "CPU",
    }[dkind]()
    faults |= {"smaller": {ValueError} if need > 1 else set(), "immutable": {RuntimeError}, "released": {RuntimeError},
               "generic": {TypeError}, "file": {TypeError}, "int32": {TypeError}, "tiled": {TypeError},
               "primary tier": {RuntimeError, TypeError}, "garbage": {TypeError}}.get(dkind, set())
    if not faults and invalid_selected(scene, axes):
        faults = {RuntimeError}
    before = scene.snapshot()
    dest_before = facts(dest) if isinstance(dest, sw.Carrier) and dest is not scene.carrier else None
    grad = data.draw(st.booleans(), label="grad")
    with _grad(grad):
        handle, err = attempt("TiledEvictable.project", lambda: scene.carrier.project(tensor, sel, dest))
        result = None
        if err is None:
            result, err = attempt("AwaitProjection.wait", lambda: finish(handle))
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (faults, err)
        if not (faults == {RuntimeError} and handle is not None):
            assert scene.snapshot() == before  # refused before work: nothing changed
        else:
            # failed after start (an invalid tile): values, validity, version and ownership unchanged
            after = scene.snapshot()
            assert after["values"] == before["values"] and after["version"] == before["version"]
        if dest_before is not None:
            assert facts(dest) == dest_before
    else:
        assert err is None, err
        got_ext, want = scene.region(axes)
        assert result.layout == sw.column_major(*got_ext) and result.offset == 0 and isinstance(result.carrier, sw.CPU)
        if dest is not None:
            assert result.carrier is dest
        for coord, v in want.items():
            assert result[coord] == v, (coord, result[coord], v)
        assert (result.autograd_ctx is not None) == grad
        assert handle.wait() is result
        assert scene.carrier.version == before["version"]
    # The source's logical values never change, and the carrier stays usable and releasable.
    scene.check_values()
    scene.carrier.release()


class _grad:
    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.prev = sw.is_grad_enabled()
        sw.set_grad_enabled(self.on)

    def __exit__(self, *exc):
        sw.set_grad_enabled(self.prev)


def _released(c):
    c.release()
    return c


@fuzz(120)
@given(data=st.data())
def test_fuzz_tiled_scatter(data):
    scene = Scene(data.draw)
    sel, faults, axes = data.draw(selections(scene), label="selection")
    template, tfaults = data.draw(full_tensors(scene), label="template")
    faults = faults | tfaults
    ext = tuple(len(a) * t for a, t in zip(axes, scene.tile)) if axes else (2,)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    cvals = rng.integers(-9, 9, size=ext).astype(np.float32)
    ckind = data.draw(st.sampled_from(["cpu", "cpu", "cpu", "shape", "int32", "generic", "tiled", "released", "garbage",
                                       "strided"]), label="compact")
    if ckind in ("cpu", "strided"):
        compact = sw.friendly.tensor(cvals)
        if ckind == "strided":
            c = sw.CPU(2 * cvals.size + 1)
            strides, run = [], 2
            for e in ext:
                strides.append(run)
                run *= e
            compact = Tensor(c, 1, Layout(Shape(*ext), Stride(*strides)))
            for coord in colex(ext):
                compact[coord] = float(cvals[coord])
    elif ckind == "shape":
        compact = sw.friendly.tensor(np.zeros(ext + (2,), np.float32))
        faults |= {ValueError}
    elif ckind == "int32":
        compact = sw.friendly.tensor(cvals.astype(np.int32), dtype=I32)
        faults |= {TypeError}
    elif ckind == "generic":
        compact = sw.friendly.tensor(cvals, carrier=sw.Generic)
        faults |= {TypeError}
    elif ckind == "tiled":
        compact = scene.full
        faults |= {TypeError, ValueError}
    elif ckind == "released":
        compact = sw.friendly.tensor(cvals)
        compact.carrier.release()
        faults |= {RuntimeError}
    else:
        compact = data.draw(GARBAGE, label="garbage compact")
        faults |= {TypeError}
    reduction = data.draw(st.sampled_from(["replace", "replace", "add", "add", "sum", "", None, 3, "REPLACE"]),
                          label="reduction")
    if reduction not in ("replace", "add"):
        faults |= {ValueError, TypeError}
    if not faults and reduction == "add" and invalid_selected(scene, axes):
        faults = {RuntimeError}
    before = scene.snapshot()
    compact_before = facts(compact.carrier) if isinstance(compact, Tensor) and compact is not scene.full else None
    kwargs = {} if reduction == "replace" and data.draw(st.booleans(), label="default") else {"reduction": reduction}
    handle, err = attempt("TiledEvictable.scatter", lambda: scene.carrier.scatter(compact, template, sel, **kwargs))
    result = None
    if err is None:
        result, err = attempt("AwaitMove.wait", lambda: finish(handle))
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (faults, err)
        if handle is None:
            assert scene.snapshot() == before
        else:
            after = scene.snapshot()
            assert after["values"] == before["values"] and after["version"] == before["version"]
    else:
        assert err is None, err
        r = result.carrier
        assert isinstance(r, TiledEvictable) and r is not scene.carrier
        assert r.grid_shape == scene.grid and r.tile_shape == scene.tile and result.layout == scene.full.layout
        assert r.valid_tiles == sel.tile_set and r.dirty_tiles == sel.tile_set
        _, old = scene.region(axes)
        proj = finish(r.project(result, sel))
        for coord in colex(ext):
            want = float(cvals[coord]) + (old[coord] if reduction == "add" else 0.0)
            assert proj[coord] == np.float32(want), (coord, proj[coord], want)
        for t in colex(scene.grid):
            if t not in sel.tile_set:
                expect("TiledEvictable[i]", lambda t=t: result.carrier[scene.slots(t)[0]], {RuntimeError})
        r.release()
        assert scene.carrier.version == before["version"]  # scatter does not mutate the template's carrier
    if compact_before is not None:
        assert facts(compact.carrier) == compact_before
    scene.check_values()
    scene.carrier.release()


def _assert_none(r):
    assert r is None, r


@st.composite
def residency_args(draw, scene):
    kind = draw(st.sampled_from(["set", "set", "set", "selection", "out of range", "rank", "empty", "huge", "garbage"]))
    if kind == "set":
        tiles = draw(st.lists(st.sampled_from(scene.tiles), unique=True))
        return TileSet(tiles), set(), tiles
    if kind == "selection":
        sel, faults, axes = draw(selections(scene))
        if isinstance(sel, TileSet):  # a TileSet is what residency requests take
            return sel, set(), list(sel.coordinates)
        if isinstance(sel, TileSelection) and not faults:
            return sel, set(), list(sel.coordinates)
        return sel, faults, None
    if kind == "out of range":
        t = list(draw(st.sampled_from(scene.tiles)))
        i = draw(st.integers(0, scene.rank - 1))
        t[i] = scene.grid[i] + draw(st.integers(0, 3))
        return TileSet(draw(st.lists(st.sampled_from(scene.tiles), unique=True)) + [tuple(t)]) if False else TileSet([tuple(t)]), {ValueError}, None
    if kind == "rank":
        return TileSet([tuple([0] * (scene.rank + 1))]), {ValueError}, None
    if kind == "empty":
        return TileSet(), set(), []
    if kind == "huge":
        return TileSet([tuple([2**63] + [0] * (scene.rank - 1))]), {ValueError}, None
    return draw(st.sampled_from([None, [(0,)], "tiles", (0,), 0, scene.full])), {TypeError}, None


@fuzz(150)
@given(data=st.data())
def test_fuzz_tiled_promote_evict(data):
    scene = Scene(data.draw)
    c = scene.carrier
    for _ in range(data.draw(st.integers(1, 6), label="requests")):
        arg, faults, tiles = data.draw(residency_args(scene), label="tiles")
        op = data.draw(st.sampled_from(["promote_async", "evict_async", "promote", "evict"]), label="op")
        if not faults and op.startswith("promote") and any(not scene.valid(t) for t in tiles):
            faults = {RuntimeError}
        before = scene.snapshot()
        prev = {t: c.tile_state(t) for t in scene.tiles}
        entry = f"TiledEvictable.{op.replace('_async', '')}_async"

        def call():
            if op.endswith("_async"):
                h = getattr(c, op)(arg)
                return finish(h)
            return getattr(c, op)(arg)

        err = expect(entry, call, faults, _assert_none)
        if err is not None:
            assert scene.snapshot() == before, (op, arg, err)
            continue
        for t in scene.tiles:
            s = c.tile_state(t)
            if t in tiles:
                if op.startswith("promote"):
                    assert s.location == "primary" and s.valid
                elif prev[t].location == "primary":
                    assert s.location == "secondary" and not s.dirty
                else:
                    assert s == prev[t]
            else:
                assert s == prev[t]
        assert c.version == before["version"]  # residency never changes the version
        scene.check_values()
    c.release()
    expect("TiledEvictable.promote_async", lambda: c.promote_async(TileSet()), {RuntimeError})


# ================================================================ residency policies


class PolicyError(Exception):
    """A user exception a policy raises: it must propagate unchanged."""


class HostilePolicy:
    """A policy whose plan() misbehaves in one of several ways (chosen per example)."""

    def __init__(self, kind, grid, draw):
        self.kind, self.grid, self.calls = kind, grid, 0
        self.carrier = None
        rank = len(grid)
        inside = colex(grid)
        if kind == "out of range":
            t = [0] * rank
            t[draw(st.integers(0, rank - 1))] = grid[0] + 5
            field = draw(st.sampled_from(["promote", "retain", "evict"]))
            self.plan_value = ResidencyPlan(**{field: TileSet([tuple(t)])})
        elif kind == "wrong rank":
            field = draw(st.sampled_from(["promote", "retain", "evict"]))
            self.plan_value = ResidencyPlan(**{field: TileSet([tuple([0] * (rank + 1))])})
        elif kind == "huge":
            self.plan_value = ResidencyPlan(evict=TileSet([tuple([2**64] + [0] * (rank - 1))]))
        elif kind == "valid":
            chosen = draw(st.lists(st.sampled_from(inside), unique=True, max_size=4))
            k = draw(st.integers(0, len(chosen)))
            self.plan_value = ResidencyPlan(promote=TileSet(chosen[:k]), evict=TileSet(chosen[k:]))
        else:
            self.plan_value = {
                "none": None, "int": 3, "tile set": TileSet(), "dict": {"promote": TileSet()},
                "duck": type("Duck", (), {"promote": TileSet(), "retain": TileSet(), "evict": TileSet()})(),
                "plan class": ResidencyPlan,
            }.get(kind)

    def plan(self, required, purpose):
        self.calls += 1
        assert purpose in ("projection", "scatter", "operation", "backward")
        assert isinstance(required, TileSet)
        if self.kind == "raise":
            raise PolicyError("policy refuses")
        if self.kind == "raise value":
            raise ValueError("policy refuses with ValueError")
        if self.kind == "re-entrant evict" and self.carrier is not None:
            # evicts every tile from inside the callback: the request must still see valid values
            self.carrier.evict(TileSet(colex(self.grid)))
            return ResidencyPlan()
        if self.kind == "re-entrant release" and self.carrier is not None:
            self.carrier.release()
            return ResidencyPlan()
        return self.plan_value


POLICY_FAULTS = {
    "raise": {PolicyError}, "raise value": {ValueError}, "none": {TypeError}, "int": {TypeError},
    "tile set": {TypeError}, "dict": {TypeError}, "duck": {TypeError}, "plan class": {TypeError},
    "out of range": {ValueError}, "wrong rank": {ValueError}, "huge": {ValueError}, "valid": set(),
    "re-entrant evict": set(), "re-entrant release": None,  # None: any documented outcome, then invariants
}


@pytest.mark.parametrize("kind", sorted(POLICY_FAULTS))
@fuzz(12)
@given(data=st.data())
def test_fuzz_residency_policies(kind, data):
    purpose = data.draw(st.sampled_from(["projection", "scatter", "operation", "backward"]), label="purpose")
    holder = {}

    def make_policy():
        return holder.setdefault("p", HostilePolicy(kind, scene_grid[0], data.draw))

    # The scene's geometry is drawn first, so that the policy knows the grid.
    scene_grid = [None]

    class Deferred:
        def plan(self, required, purpose):
            return holder["p"].plan(required, purpose)

    scene = Scene(data.draw, policy=Deferred(), allow_invalid=False)
    scene_grid[0] = scene.grid
    policy = make_policy()
    policy.carrier = scene.carrier if kind.startswith("re-entrant") else None
    c = scene.carrier
    all_sel = TileSelection([list(range(g)) for g in scene.grid])
    axes = [data.draw(st.lists(st.integers(0, g - 1), unique=True, min_size=1), label="axis") for g in scene.grid]
    sel = TileSelection(axes)
    faults = POLICY_FAULTS[kind]
    before = scene.snapshot()
    calls_before = policy.calls

    def run():
        if purpose == "projection":
            return finish(c.project(scene.full, sel))
        if purpose == "scatter":
            ext = tuple(len(a) * t for a, t in zip(axes, scene.tile))
            return finish(c.scatter(sw.friendly.zeros(*ext), scene.full, sel, reduction="add"))
        if purpose == "operation":
            return sw.relu(scene.full)
        # backward: the forward relu runs with a well-behaved plan; relu's backward reads the saved full
        # tensor again, which is a "backward" request that meets the hostile policy.
        policy_kind, policy.kind = policy.kind, "valid-shadow"
        saved_plan, policy.plan_value = policy.plan_value, ResidencyPlan()
        try:
            y = sw.relu(scene.full)
        finally:
            policy.kind, policy.plan_value = policy_kind, saved_plan
        holder["forward"] = scene.snapshot()
        loss = sw.reduce_sum(y, " ".join("abcd"[: scene.rank]) + " -> ")
        loss.backward()
        return scene.full

    before = scene.snapshot()
    result, err = attempt(f"policy.{purpose}", run, extra=(PolicyError,))
    CALLS[f"policy kind: {kind}"] += 1
    OUTCOMES[f"policy kind: {kind}"]["ok" if err is None else type(err).__name__] += 1
    assert policy.calls > calls_before, "the policy was not consulted"
    if faults is None:  # re-entrant release: anything documented; afterwards the carrier is released or usable
        if not c.is_released():
            scene.check_values()
            c.release()
        return
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (kind, purpose, err)
        # failed before any provider work: nothing changed (since the forward pass, for backward)
        assert scene.snapshot() == holder.get("forward", before), (kind, purpose)
        if purpose == "backward":
            assert scene.full.grad is None  # no partial gradient was published
    else:
        assert err is None, (kind, purpose, err)
        if purpose == "projection":
            _, want = scene.region(axes)
            for coord, v in want.items():
                assert result[coord] == v
        elif purpose == "operation":
            for coord in colex(scene.logical):
                assert result[coord] == max(scene.vals[dense_offset(coord, scene.logical)], 0.0)
        elif purpose == "backward":
            g = scene.full.grad
            assert g is not None and isinstance(g.carrier, TiledEvictable)
            for coord in colex(scene.logical):
                assert g[coord] == (1.0 if scene.vals[dense_offset(coord, scene.logical)] > 0 else 0.0)
    # Whatever happened, no pin or pending mark is left behind: every tile can be evicted and the carrier released.
    scene.check_values()
    c.evict(TileSet(scene.tiles))
    assert not c.primary_tiles
    c.release()
    assert c.is_released()
