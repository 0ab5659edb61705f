"""Built-in residency policies (strideweave.policies): plain ResidencyPolicy implementations."""

import numpy as np
import pytest

import strideweave as sw
from strideweave.carriers.tiled_evictable import ResidencyPlan, ResidencyPolicy, TileSet
from strideweave.policies import LRUPolicy, PinnedPolicy


def test_builtin_policies_satisfy_the_protocol():
    assert isinstance(LRUPolicy(2), ResidencyPolicy)
    assert isinstance(PinnedPolicy([(0,)]), ResidencyPolicy)


@pytest.mark.parametrize("bad, exc, match", [(0, ValueError, ">= 1"), (True, TypeError, "int"), (1.5, TypeError, "int")])
def test_lru_capacity_is_checked(bad, exc, match):
    with pytest.raises(exc, match=match):
        LRUPolicy(bad)


def test_lru_plan_evicts_least_recently_required_beyond_capacity():
    p = LRUPolicy(2)
    assert p.plan(TileSet([(0,)]), "projection").evict == TileSet()
    assert p.plan(TileSet([(1,)]), "projection").evict == TileSet()
    plan = p.plan(TileSet([(2,)]), "projection")
    assert isinstance(plan, ResidencyPlan)
    assert plan.evict == TileSet([(0,)])
    assert plan.retain == TileSet([(2,)])
    # (1,) is now least recent; requiring it again refreshes it, so (2,) goes next.
    p.plan(TileSet([(1,)]), "operation")
    assert p.plan(TileSet([(3,)]), "projection").evict == TileSet([(2,)])


def test_lru_never_evicts_what_the_request_requires():
    p = LRUPolicy(1)
    plan = p.plan(TileSet([(0,), (1,), (2,)]), "operation")
    assert plan.evict == TileSet()
    assert set(plan.retain.coordinates) == {(0,), (1,), (2,)}


def test_pinned_policy_promotes_its_tiles_and_never_evicts():
    p = PinnedPolicy(TileSet([(0,), (3,)]))
    plan = p.plan(TileSet([(3,), (5,)]), "projection")
    assert plan.promote == TileSet([(0,)])
    assert plan.retain == TileSet([(3,)])
    assert plan.evict == TileSet()


def _expert_carrier(experts, policy):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 3 * experts)).astype(np.float32)  # (out, in * expert), expert-last
    on_file = sw.move(sw.friendly.tensor(w), sw.FileBacked())
    te = sw.TiledEvictable(sw.CPU(0), on_file.carrier, (1, experts), (4, 3), residency_policy=policy)
    full = sw.Tensor(te, 0, sw.Layout(sw.Shape(4, [3, experts]), sw.Stride(1, [4, 12])))
    return w, te, full


def test_lru_policy_bounds_residency_across_projections():
    w, te, full = _expert_carrier(8, LRUPolicy(3))
    order = [0, 5, 2, 5, 7, 1, 0, 6]
    for e in order:
        with sw.no_grad():
            compact = te.project(full, sw.TileSelection([[0], [e]])).wait()
        np.testing.assert_array_equal(np.asarray(compact), w[:, 3 * e:3 * e + 3])
        assert len(te.primary_tiles.coordinates) <= 3
    # The three most recently required experts are the resident ones.
    assert set(te.primary_tiles.coordinates) == {(0, 1), (0, 0), (0, 6)}


def test_pinned_policy_keeps_its_tiles_resident():
    w, te, full = _expert_carrier(6, PinnedPolicy([(0, 4)]))
    with sw.no_grad():
        te.project(full, sw.TileSelection([[0], [1]])).wait()
    assert {(0, 4), (0, 1)} <= set(te.primary_tiles.coordinates)
    te.evict(sw.TileSet([(0, 1)]))
    with sw.no_grad():
        te.project(full, sw.TileSelection([[0], [2]])).wait()
    assert (0, 4) in te.primary_tiles.coordinates
