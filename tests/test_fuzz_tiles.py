"""Fuzz tests of TileSelection, TileSet and ResidencyPlan (fuzzing.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strideweave.carriers.tiled_evictable import ResidencyPlan, TileSelection, TileSet

from fuzzing import colex, coordinate_entry, expect, fuzz, int_like

pytestmark = pytest.mark.usefixtures("fuzz_report", "fuzz_watchdog", "clear_io_faults", "grad_mode_on")


def iterable_of(elements, max_size=4):
    """Lists, tuples, generators, sets, ranges and strings of `elements`."""
    return st.one_of(
        st.lists(elements, max_size=max_size),
        st.lists(elements, max_size=max_size).map(tuple),
        st.lists(elements, max_size=max_size).map(lambda x: (v for v in x)),
        st.sampled_from(["01", b"\x00\x01", 3, None, 1.5, range(0, 3), range(2, 0, -1)]),
    )


@fuzz(300)
@given(per_axis=st.one_of(
    st.lists(st.lists(st.integers(0, 6), unique=True, min_size=1, max_size=4), min_size=1, max_size=3),
    iterable_of(iterable_of(coordinate_entry))))


def test_fuzz_tile_selection(per_axis):
    # materialise generators once so the model and the call see the same values
    if hasattr(per_axis, "__next__"):
        per_axis = [list(a) if hasattr(a, "__next__") else a for a in per_axis]
        per_axis = iter(per_axis)
        materialised = list(per_axis)
        per_axis = iter(materialised)
    else:
        if isinstance(per_axis, (list, tuple)):
            per_axis = type(per_axis)(list(a) if hasattr(a, "__next__") else a for a in per_axis)
        materialised = per_axis
    faults = set()
    axes = None
    if isinstance(materialised, (str, bytes)) or not hasattr(materialised, "__iter__"):
        faults.add(TypeError)
    else:
        axes = []
        for axis in materialised:
            if isinstance(axis, (str, bytes)) or not hasattr(axis, "__iter__"):
                faults.add(TypeError)
                continue
            axis = list(axis)
            if any(not int_like(v) for v in axis):
                faults.add(TypeError)
            axes.append(axis)
        if TypeError not in faults:
            if not axes or any(not a for a in axes):
                faults.add(ValueError)
            for a in axes:
                if len(set(int(v) for v in a)) != len(a) or any(int(v) < 0 for v in a):
                    faults.add(ValueError)

    def check(sel):
        want = tuple(tuple(int(v) for v in a) for a in axes)
        assert sel.per_axis == want and sel.rank == len(want)
        assert sel.compact_grid_shape == tuple(len(a) for a in want)
        coords = [tuple(want[i][c[i]] for i in range(len(want))) for c in colex(sel.compact_grid_shape)]
        assert sel.coordinates == tuple(coords)
        assert sel.tile_set == TileSet(coords) and len(sel.tile_set) == len(coords)
        assert sel == TileSelection(want) and hash(sel) == hash(TileSelection(want))
        with pytest.raises(dataclasses.FrozenInstanceError):
            sel.per_axis = ()

    expect("TileSelection", lambda: TileSelection(per_axis), faults, check)


@fuzz(300)
@given(coordinates=st.one_of(
    st.integers(1, 3).flatmap(lambda r: st.lists(st.tuples(*[st.integers(0, 4)] * r), unique=True, max_size=6)),
    iterable_of(iterable_of(coordinate_entry, max_size=3), max_size=5)))


def test_fuzz_tile_set(coordinates):
    if isinstance(coordinates, (list, tuple)):
        coordinates = type(coordinates)(list(a) if hasattr(a, "__next__") else a for a in coordinates)
    elif hasattr(coordinates, "__next__"):
        coordinates = iter([list(a) if hasattr(a, "__next__") else a for a in coordinates])
        coordinates = list(coordinates)
    faults = set()
    coords = []
    if isinstance(coordinates, (str, bytes)) or not hasattr(coordinates, "__iter__"):
        faults.add(TypeError)
    else:
        for entry in coordinates:
            if isinstance(entry, (str, bytes)) or not hasattr(entry, "__iter__"):
                faults.add(TypeError)
                continue
            entry = list(entry)
            if any(not int_like(v) for v in entry):
                faults.add(TypeError)
                continue
            coords.append(tuple(int(v) for v in entry))
        if TypeError not in faults:
            if len({len(c) for c in coords}) > 1 or any(v < 0 for c in coords for v in c) or len(set(coords)) != len(coords):
                faults.add(ValueError)

    def check(ts):
        want = tuple(sorted(coords, key=lambda c: tuple(reversed(c))))
        assert ts.coordinates == want and len(ts) == len(want) and list(ts) == list(want)
        assert all(c in ts for c in want)
        assert ts == TileSet(want) and hash(ts) == hash(TileSet(list(reversed(want))))

    expect("TileSet", lambda: TileSet(coordinates), faults, check)


tile_sets_or_garbage = st.one_of(
    st.none(),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), unique=True, max_size=4).map(TileSet),
    st.sampled_from([[(0, 0)], (), "TileSet", 3, TileSelection([[0], [1]])]),
)


@fuzz(300)
@given(promote=tile_sets_or_garbage, retain=tile_sets_or_garbage, evict=tile_sets_or_garbage,
       positional=st.booleans())


def test_fuzz_residency_plan(promote, retain, evict, positional):
    faults = set()
    fields = {"promote": promote, "retain": retain, "evict": evict}
    for v in fields.values():
        if v is not None and not isinstance(v, TileSet):
            faults.add(TypeError)
    seen = [c for v in fields.values() if isinstance(v, TileSet) for c in v.coordinates]
    if len(seen) != len(set(seen)):
        faults.add(ValueError)  # fields are checked in order: an early overlap may be reported first

    def check(plan):
        for name, v in fields.items():
            assert getattr(plan, name) == (v if v is not None else TileSet())
        assert plan == ResidencyPlan(**fields) and hash(plan) == hash(ResidencyPlan(**fields))

    expect("ResidencyPlan",
           (lambda: ResidencyPlan(promote, retain, evict)) if positional else (lambda: ResidencyPlan(**fields)),
           faults, check)
