"""One residency budget for weights and their gradients (Note [One residency budget] in
cpp/include/strideweave/tiled/residency_budget.hpp).

Expert weights in a file are trained a few experts per step, touching more experts than the budget holds; nothing
in the test evicts anything. The tiles resident under the budget (weight tiles, .grad tiles and the fresh gradients
of a backward) never exceed it, dirty gradient tiles go to the gradient's own tier and come back when a later
backward adds into them, untouched gradient tiles stay implicit, and the gradients match a Float64 reference within
the bound stated at `bound_step`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import ResidencyBudget, TiledEvictable, TileSelection, TileSet

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261219

OUT, IN, E, TOKENS = 6, 4, 10, 3
U = 2.0**-24
NEVER = (7, 9)  # experts no step touches


def expert_weight(experts, dtype=sw.DType.Float32, budget=None, policy=None):
    """A TiledEvictable over a FileBacked tier holding `experts` (E, OUT, IN) column-major within each tile."""
    data = np.ascontiguousarray(experts.transpose(0, 2, 1)).reshape(-1)
    tier = sw.move(friendly.tensor(data), sw.FileBacked(dtype=dtype))
    c = TiledEvictable(sw.CPU(0, dtype=dtype), tier.carrier, (1, E), (OUT, IN), residency_policy=policy,
                       residency_budget=budget)
    return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), sw.Stride(1, [OUT, OUT * IN])))


def gamma(n):
    return n * U / (1 - n * U)


def bound_step(err, ref_before, ref_after, mags, n, u16):
    """The error bound after one more backward into a held gradient, per slot.

    The step adds c = sum of n products g x (|products| summing to `mags`) to the held G in Float32, in any order
    and grouping (a matmul adding straight into the resident tile, or a fresh gradient added to it):
    |fl32 - exact| <= gamma_{n+1} (|G| + mags), |G| <= |R_before| + err. A 16-bit gradient is then rounded once:
    u16 (|R_after| + err + that Float32 error) more (u16 = 0 for Float32).
    """
    f32 = gamma(n + 1) * (np.abs(ref_before) + err + mags)
    return err + f32 + u16 * (np.abs(ref_after) + err + f32)


def schedule(rng, steps):
    touched = [e for e in range(E) if e not in NEVER]
    return [sorted(rng.choice(touched, size=int(rng.integers(1, 3)), replace=False).tolist()) for _ in range(steps)]


def grad_values(full):
    # Read slot by slot: reading never moves a tile (a projection of every tile would not fit the budget).
    return np.asarray(full.grad).astype(np.float64)


def resident_bytes(c, full):
    total = c.stats()["primary_bytes"]
    if full.grad is not None:
        total += full.grad.carrier.stats()["primary_bytes"]
    return total


def train(c, full, steps, rng, np_dtype, u16, budget=None):
    """Runs `steps` (lists of experts) as projection, matmul, backward; returns the reference and its bound."""
    ref = np.zeros((OUT, IN * E))
    err = np.zeros((OUT, IN * E))
    for chosen in steps:
        w = c.project(full, TileSelection([[0], chosen])).wait()
        x = rng.standard_normal((TOKENS, IN * len(chosen))).astype(np_dtype)
        g = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
        y = sw.matmul(friendly.tensor(x), w)
        if budget is not None:
            assert resident_bytes(c, full) <= budget.max_bytes  # after the forward
        y.backward(friendly.tensor(g))
        del w, y
        if budget is not None:
            assert resident_bytes(c, full) <= budget.max_bytes  # after the backward
        x64, g64 = x.astype(np.float64), g.astype(np.float64)
        before = ref.copy()
        mags = np.zeros_like(ref)
        for k, e in enumerate(chosen):
            cols = np.s_[:, IN * e:IN * (e + 1)]
            xs = x64[:, IN * k:IN * (k + 1)]
            ref[cols] += g64.T @ xs
            mags[cols] = np.abs(g64).T @ np.abs(xs)
        err = bound_step(err, before, ref, mags, TOKENS, u16)
    return ref, err


DTYPES = [
    pytest.param(sw.DType.Float32, np.float32, 0.0, 4, id="f32"),
    pytest.param(sw.DType.BFloat16, ml_dtypes.bfloat16, 2.0**-8, 2, id="bf16"),
]


@pytest.mark.parametrize("dtype, np_dtype, u16, itemsize", DTYPES)
def test_weights_and_gradients_stay_within_one_budget_over_many_steps(rng, dtype, np_dtype, u16, itemsize):
    tile = OUT * IN * itemsize
    # Two weight tiles and their fresh gradients (Float32: two 16-bit tiles' bytes each) must fit at once; the
    # touched experts' weights and gradients (16 tiles) do not.
    budget = ResidencyBudget(2 * tile + 2 * OUT * IN * 4 + tile)
    experts = rng.standard_normal((E, OUT, IN)).astype(np_dtype)
    c, full = expert_weight(experts, dtype, budget)
    steps = schedule(rng, 40)
    ref, err = train(c, full, steps, rng, np_dtype, u16, budget)

    stats = budget.stats()
    assert stats["peak_bytes"] <= budget.max_bytes  # every transition, forward and backward, was admitted
    assert stats["evictions"] > 0
    gc = full.grad.carrier
    assert gc.residency_budget is budget and c.residency_budget is budget
    assert full.grad.dtype() is dtype
    gstats = gc.stats()
    assert gstats["bytes_evicted"] > 0  # dirty gradient tiles were written to the gradient's tier ...
    assert gstats["promotions"] > 0  # ... and read back when a later backward added into them
    for e in NEVER:
        assert gc.tile_state((0, e)).location == "implicit"  # never materialised
    got = grad_values(full)
    assert np.all(np.abs(got - ref) <= err), np.max(np.abs(got - ref) - err)
    for e in NEVER:
        assert not np.any(got[:, IN * e:IN * (e + 1)])


def test_gradients_under_a_budget_equal_those_without_one(rng):
    # Evicting and reading back moves bytes exactly: a budgeted run gives the unbudgeted values within the bound,
    # and both the same Float64 reference.
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    steps = schedule(rng, 25)
    seed = int(rng.integers(1 << 30))
    tile = OUT * IN * 4
    budget = ResidencyBudget(4 * tile)
    c1, f1 = expert_weight(experts, budget=budget)
    c2, f2 = expert_weight(experts)
    ref1, err1 = train(c1, f1, steps, np.random.default_rng(seed), np.float32, 0.0, budget)
    ref2, err2 = train(c2, f2, steps, np.random.default_rng(seed), np.float32, 0.0)
    assert np.array_equal(ref1, ref2)
    g1, g2 = grad_values(f1), grad_values(f2)
    assert np.all(np.abs(g1 - ref1) <= err1) and np.all(np.abs(g2 - ref1) <= err1)
    assert budget.stats()["evictions"] > 0 and budget.stats()["peak_bytes"] <= budget.max_bytes


def test_two_weights_share_one_budget(rng):
    tile = OUT * IN * 4
    budget = ResidencyBudget(3 * tile)
    w1 = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    w2 = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c1, f1 = expert_weight(w1, budget=budget)
    c2, f2 = expert_weight(w2, budget=budget)
    for e in range(E):
        a = c1.project(f1, TileSelection([[0], [e]])).wait()
        b = c2.project(f2, TileSelection([[0], [e]])).wait()
        loss = sw.add(sw.reduce_sum(a, "o i ->"), sw.reduce_sum(b, "o i ->"))
        loss.backward()
        assert budget.stats()["resident_bytes"] <= 3 * tile
    assert budget.stats()["peak_bytes"] <= 3 * tile
    assert budget.stats()["members"] >= 4  # two weights and their two gradients
    for f in (f1, f2):
        np.testing.assert_array_equal(grad_values(f), np.ones((OUT, IN * E)))


class RecordingPolicy:
    def __init__(self):
        self.calls = []

    def plan(self, required, purpose):
        self.calls.append((required, purpose))
        return sw.ResidencyPlan()


def test_a_working_set_larger_than_the_budget_is_refused_and_changes_nothing(rng):
    tile = OUT * IN * 4
    budget = ResidencyBudget(2 * tile)
    policy = RecordingPolicy()
    c, full = expert_weight(rng.standard_normal((E, OUT, IN)).astype(np.float32), budget=budget, policy=policy)
    c.promote(TileSet([(0, 0)]))
    before_states = [c.tile_state((0, e)) for e in range(E)]
    before_stats, before_budget, version = c.stats(), budget.stats(), c.version
    with pytest.raises(ValueError, match=r"residency budget: this projection needs 3 tiles \(288 bytes\).*more than "
                                         r"the budget's 192 bytes.*nothing was changed"):
        c.project(full, TileSelection([[0], [1, 2, 3]]))
    assert [c.tile_state((0, e)) for e in range(E)] == before_states
    assert c.stats() == before_stats and budget.stats() == before_budget and c.version == version
    assert policy.calls == []  # refused before the policy was asked
    # A working set that fits still runs.
    c.project(full, TileSelection([[0], [1, 2]])).wait()
    assert budget.stats()["peak_bytes"] <= 2 * tile


def test_budget_arguments_are_checked(rng):
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        ResidencyBudget(0)
    with pytest.raises(TypeError, match="max_bytes must be an int"):
        ResidencyBudget(True)
    with pytest.raises(TypeError, match="max_bytes must be an int"):
        ResidencyBudget(1.5)
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    with pytest.raises(TypeError, match="residency_budget must be a ResidencyBudget or None, got str"):
        expert_weight(experts, budget="all of it")
    first, second = ResidencyBudget(1 << 20), ResidencyBudget(1 << 20)
    c, full = expert_weight(experts, budget=first)
    c.set_residency_budget(first)  # the same one again: nothing to do
    with pytest.raises(RuntimeError, match="already draws from another residency budget"):
        c.set_residency_budget(second)
    assert c.residency_budget is first and second.stats()["members"] == 0
    with pytest.raises(TypeError, match="incompatible function arguments"):
        c.set_residency_budget(None)
    assert c.residency_budget is first
    assert repr(first) == f"ResidencyBudget(max_bytes={1 << 20})"


def test_joining_a_budget_evicts_down_to_it(rng):
    tile = OUT * IN * 4
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full = expert_weight(experts)
    c.promote(TileSelection([[0], list(range(5))]).tile_set)
    budget = ResidencyBudget(2 * tile)
    c.set_residency_budget(budget)
    assert len(c.primary_tiles) == 2 and budget.stats()["resident_bytes"] == 2 * tile
    budget.reset_peak()  # the peak counted the five tiles the carrier brought along
    got = np.asarray(c.project(full, TileSelection([[0], [0, 1]])).wait())
    np.testing.assert_array_equal(got, np.concatenate([experts[0], experts[1]], axis=1))
    assert budget.stats()["peak_bytes"] <= 2 * tile


def test_room_that_running_requests_hold_is_not_taken(rng, held_io):
    # Two promotions held at the I/O gate fill the budget; a projection of a third expert cannot make room: it
    # fails with RuntimeError, its tile untouched. Once the reads land, both promotions complete within the bound.
    tile = OUT * IN * 4
    budget = ResidencyBudget(2 * tile)
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full = expert_weight(experts, budget=budget)
    held_io._io_hold("pread")
    pending = c.promote_async(TileSet([(0, 0), (0, 1)]))
    assert budget.stats()["resident_bytes"] == 2 * tile  # counted from admission
    with pytest.raises(RuntimeError, match=r"residency budget: no room for 96 more bytes \(promotion\): the budget "
                                           "of 192 bytes holds 192 bytes in tiles that running work pins"):
        c.project(full, TileSelection([[0], [2]]))
    assert c.tile_state((0, 2)).location == "secondary"
    held_io._io_unhold()
    pending.wait()
    assert c.primary_tiles == TileSet([(0, 0), (0, 1)])
    assert budget.stats()["peak_bytes"] == 2 * tile
    np.testing.assert_array_equal(np.asarray(c.project(full, TileSelection([[0], [2]])).wait()), experts[2])
    assert len(c.primary_tiles) == 2 and budget.stats()["peak_bytes"] == 2 * tile


def test_a_released_member_leaves_the_budget(rng):
    tile = OUT * IN * 4
    budget = ResidencyBudget(4 * tile)
    c, full = expert_weight(rng.standard_normal((E, OUT, IN)).astype(np.float32), budget=budget)
    w = c.project(full, TileSelection([[0], [1]])).wait()
    sw.reduce_sum(w, "o i ->").backward()
    assert budget.stats()["resident_bytes"] == 2 * tile  # the weight tile and the gradient tile
    full.grad.carrier.release()
    assert budget.stats()["resident_bytes"] == tile


def test_a_gradient_of_a_weight_in_memory_evicts_to_a_scratch_file(rng):
    tile = OUT * IN * 4
    budget = ResidencyBudget(3 * tile)
    data = rng.standard_normal(OUT * IN * E).astype(np.float32)
    c = TiledEvictable(sw.CPU(0), friendly.tensor(data).carrier, (1, E), (OUT, IN), residency_budget=budget)
    full = sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), sw.Stride(1, [OUT, OUT * IN])))
    for e in (0, 1, 2, 3, 0):
        sw.reduce_sum(c.project(full, TileSelection([[0], [e]])).wait(), "o i ->").backward()
    gc = full.grad.carrier
    assert isinstance(gc.secondary, sw.FileBacked)  # the weight's tier is memory; the gradient's is a file
    assert gc.stats()["bytes_evicted"] > 0 and budget.stats()["peak_bytes"] <= 3 * tile
    want = np.zeros((OUT, IN * E))
    want[:, :4 * IN] = 1.0
    want[:, :IN] = 2.0
    np.testing.assert_array_equal(grad_values(full), want)


def test_a_carrier_that_brings_more_than_the_budget_is_evicted_down_to_it(rng):
    # A primary holding the full extent seeds every tile (resident, dirty); joining at construction writes the
    # least recent ones to the secondary tier until the rest fit. Their values are kept.
    tile = OUT * IN * 4
    data = rng.standard_normal(OUT * IN * E).astype(np.float32)
    budget = ResidencyBudget(3 * tile)
    c = TiledEvictable(friendly.tensor(data).carrier, sw.FileBacked(), (E,), (OUT * IN,), residency_budget=budget)
    assert len(c.primary_tiles) == 3 and len(c.secondary_tiles) == E - 3
    assert c.stats()["bytes_evicted"] == (E - 3) * tile and budget.stats()["resident_bytes"] == 3 * tile
    np.testing.assert_array_equal(np.asarray(sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT * IN * E), sw.Stride(1)))), data)
