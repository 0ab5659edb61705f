"""Oversized selections are refused before they are enumerated.

A TileSelection is a Cartesian product: 10,000 coordinates on each axis name 10**8 tiles. Bound to a 2 x 2 grid,
its coordinates 2, 3, ... are out of range, and every entry point that binds a selection (or a tile set) to a grid
must say so at once, with the same exception and words as ``project``, instead of first enumerating the product
(42 s and MemoryError). Each test checks the exception, that the call returned quickly (bounded generously), and
that nothing changed.

Run: ``.venv/bin/python -m pytest -q tests/test_tile_selection_bounds.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import (
    ResidencyPlan,
    TiledEvictable,
    TiledResidencyFacet,
    TileSelection,
    TileSet,
)
from strideweave.policies import PinnedPolicy

BIG = TileSelection([range(10_000), range(10_000)])
QUICK_S = 5.0  # generous: the refusal takes well under a millisecond; enumerating takes tens of seconds


def scene():
    """A 2 x 2 grid of 2 x 2 tiles: (0, 0) resident and dirty, (1, 0) resident and clean, the rest secondary."""
    values = np.arange(16, dtype=np.float32) + 0.5
    on_file = sw.move(friendly.tensor(values), sw.FileBacked())
    c = TiledEvictable(sw.CPU(0), on_file.carrier, (2, 2), (2, 2))
    full = sw.Tensor(c, 0, sw.column_major(4, 4))
    c.promote(TileSet([(0, 0), (1, 0)]))
    c[0] = 7.0
    return c, full


def snapshot(c):
    states = {t: c.tile_state(t) for t in [(0, 0), (1, 0), (0, 1), (1, 1)]}
    return {"states": states, "stats": c.stats(), "version": c.version, "dirty": c.dirty_tiles,
            "primary": c.primary_tiles, "values": [c[s] if states[((s % 4) // 2, (s // 4) // 2)].location == "primary"
                                                     else c.secondary[s] for s in range(16)],
            "owned": c.is_owned(), "released": c.is_released()}


def project_error(c, full):
    with pytest.raises(ValueError) as e:
        c.project(full, BIG)
    return type(e.value), str(e.value)


def refused_quickly(call, exc):
    start = time.monotonic()
    with pytest.raises(exc) as e:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < QUICK_S, f"took {elapsed:.1f} s: the selection was enumerated before its ranges were checked"
    return e.value


ENTRY_POINTS = {
    "promote": lambda c, full: c.promote(BIG),
    "evict": lambda c, full: c.evict(BIG),
    "promote_async": lambda c, full: c.promote_async(BIG),
    "evict_async": lambda c, full: c.evict_async(BIG),
    "facet promote": lambda c, full: c.facet(TiledResidencyFacet).promote(BIG),
    "facet evict_async": lambda c, full: c.facet(TiledResidencyFacet).evict_async(BIG),
    "scatter": lambda c, full: c.scatter(friendly.tensor(np.ones((2, 2), np.float32)), full, BIG),
    "scatter add": lambda c, full: c.scatter(friendly.tensor(np.ones((2, 2), np.float32)), full, BIG, "add"),
    "project": lambda c, full: c.project(full, BIG),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_an_oversized_selection_is_refused_as_project_refuses_it(entry):
    c, full = scene()
    want_type, want_message = project_error(c, full)
    assert "out of range" in want_message
    before = snapshot(c)
    err = refused_quickly(lambda: ENTRY_POINTS[entry](c, full), want_type)
    assert type(err) is want_type and str(err) == want_message
    assert snapshot(c) == before


def test_an_out_of_range_tile_set_is_refused_at_its_first_bad_coordinate():
    c, full = scene()
    before = snapshot(c)
    for call in (lambda: c.promote(TileSet([(0, 0), (2, 0)])), lambda: c.evict_async(TileSet([(5, 5)]))):
        err = refused_quickly(call, ValueError)
        assert "out of range for the tile grid" in str(err)
    assert snapshot(c) == before


def test_a_pinned_policy_refuses_a_selection_larger_than_any_grid():
    err = refused_quickly(lambda: PinnedPolicy(BIG), ValueError)
    assert "out of range for every tile grid" in str(err) and "100000000 tiles" in str(err)
    # One that fits some grid is enumerated as before.
    assert PinnedPolicy(TileSelection([[0, 1], [1]])).tiles == TileSet([(0, 1), (1, 1)])


def test_a_residency_plan_takes_tile_sets_only():
    err = refused_quickly(lambda: ResidencyPlan(promote=BIG), TypeError)
    assert "must be a TileSet" in str(err)


def test_a_policy_plan_out_of_the_grid_is_refused_before_any_work():
    class Far:
        def plan(self, required, purpose):
            return ResidencyPlan(promote=TileSet([(9_999, 9_999)]))

    values = np.arange(16, dtype=np.float32)
    on_file = sw.move(friendly.tensor(values), sw.FileBacked())
    c = TiledEvictable(sw.CPU(0), on_file.carrier, (2, 2), (2, 2), residency_policy=Far())
    full = sw.Tensor(c, 0, sw.column_major(4, 4))
    before = snapshot(c)
    err = refused_quickly(lambda: c.project(full, TileSelection([[0], [1]])), ValueError)
    assert "out of range for the tile grid" in str(err)
    assert snapshot(c) == before
