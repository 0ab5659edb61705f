"""The message fragments of the tile request values and of TiledEvictable's checks, with their context.

Users and their tests match these fragments; each message keeps saying which
coordinate, axis, tile or field is wrong.
"""

from __future__ import annotations

import pytest

import strideweave as sw
from strideweave import ResidencyPlan, TileSelection, TileSet


@pytest.mark.parametrize("build, exc, fragments", [
    (lambda: TileSelection([[0, "1"]]), TypeError, ["tile coordinates must be integers", "per_axis[0][1]", "str"]),
    (lambda: TileSelection([[0], [1.0]]), TypeError, ["tile coordinates must be integers", "per_axis[1][0]"]),
    (lambda: TileSelection([[True]]), TypeError, ["tile coordinates must be integers"]),
    (lambda: TileSet([(0, 1), (0, None)]), TypeError, ["components must be integers", "coordinates[1][1]"]),
    (lambda: TileSelection([[0], 3]), TypeError, ["per_axis[1] must be a finite iterable", "int"]),
    (lambda: TileSelection(["ab"]), TypeError, ["per_axis[0] must be a finite iterable", "str"]),
    (lambda: TileSet([(0, 0), 7]), TypeError, ["coordinates[1] must be a finite iterable", "int"]),
    (lambda: TileSelection([[0], [-1]]), ValueError, ["non-negative", "axis 1"]),
    (lambda: TileSet([(0, -2)]), ValueError, ["non-negative", "(0, -2)"]),
    (lambda: TileSet([(0, 0), (0,)]), ValueError, ["same rank", "[1, 2]"]),
    (lambda: ResidencyPlan(promote=TileSet([(0, 1)]), evict=TileSet([(0, 1)])), ValueError,
     ["must be disjoint", "(0, 1)", "promote", "evict"]),
], ids=["selection-str", "selection-float", "selection-bool", "set-none", "axis-int", "axis-str", "entry-int",
        "selection-negative", "set-negative", "mixed-ranks", "plan-overlap"])
def test_request_values_say_what_is_wrong_and_where(build, exc, fragments):
    with pytest.raises(exc) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


class NotCallablePlan:
    plan = 3  # has a plan attribute, but it cannot be called


def test_a_policy_whose_plan_is_not_callable_is_refused_before_anything_is_built():
    primary = sw.CPU(0)
    with pytest.raises(TypeError, match="callable"):
        sw.TiledEvictable(primary, sw.FileBacked(), (1, 2), (2, 2), residency_policy=NotCallablePlan())
    assert not primary.is_owned() and not primary.is_released()  # nothing took the tiers


def test_a_projection_destination_without_the_capacity_is_refused_before_work():
    primary = sw.CPU(8)
    for i in range(8):
        primary[i] = float(i)
    carrier = sw.TiledEvictable(primary, sw.FileBacked(), (1, 2), (2, 2))
    full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(2, [2, 2]), sw.Stride(1, [2, 4])))
    dest = sw.CPU(3)  # the projection needs 4 slots; 3 and not allocatable
    before = (dest.version, [dest[i] for i in range(3)], carrier.stats())
    with pytest.raises(ValueError, match="capacity") as info:
        carrier.project(full, TileSelection([[0], [1]]), dest)
    assert "3 slots" in str(info.value) and "needs 4" in str(info.value)
    assert (dest.version, [dest[i] for i in range(3)], carrier.stats()) == before
    assert not dest.is_owned()
