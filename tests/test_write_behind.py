"""Write-behind evictions under a ResidencyBudget (Note [Write-behind evictions] in cpp/src/tiled/write_behind.cpp).

Dirty tiles the budget evicts ahead of need are written on the I/O threads, at most ``write_behind_bytes`` at once,
and count as resident until written. These tests hold every pwrite at the engine's test-only gate
(``_core._io_hold("pwrite")``): a SparseMoE forward and backward still completes, since the computing thread never
waits for a write it did not ask for; once the gate opens the tiles reach their files. A failed write is raised by
the next request on its carrier, with nothing lost. Nothing sleeps to order events (``waiting.held`` waits for the
gate; ``waiting.eventually`` bounds the wait for the queue to drain).
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import ResidencyBudget, TiledEvictable
from waiting import eventually, held

pytestmark = pytest.mark.usefixtures("grad_mode_on")
core = sw._core
SEED = 20261205
T, H, I, E = 24, 16, 32, 8


@pytest.fixture(autouse=True)
def open_gate():
    yield
    core._io_unhold()
    core._io_clear()


def tiled(stack, *, budget=None):
    """A full (rows, cols, E) Float32 tensor over a TiledEvictable whose tile e is stack[e] (PyTorch's row-major)."""
    e, r, c = stack.shape
    tier = sw.move(friendly.tensor(stack.reshape(-1).astype(np.float32)), sw.FileBacked())
    carrier = TiledEvictable(sw.CPU(0), tier.carrier, (1, 1, e), (r, c, 1), residency_budget=budget)
    return sw.Tensor(carrier, 0, sw.Layout(sw.Shape(r, c, e), sw.Stride(c, 1, r * c)))


def problem():
    rng = np.random.default_rng(SEED)
    print(f"seed {SEED}")
    w1 = rng.standard_normal((E, I, H), dtype=np.float32) / np.float32(np.sqrt(H))
    w3 = rng.standard_normal((E, I, H), dtype=np.float32) / np.float32(np.sqrt(H))
    w2 = rng.standard_normal((E, H, I), dtype=np.float32) / np.float32(np.sqrt(I))
    router = rng.standard_normal((E, H), dtype=np.float32)
    x = rng.standard_normal((T, H), dtype=np.float32)
    g = rng.standard_normal((T, H), dtype=np.float32)
    return w1, w2, w3, router, x, g


def forward_backward(moe, x, router, g):
    xt, rt = friendly.tensor(x), friendly.tensor(router)
    out = moe(xt, rt)
    out.backward(friendly.tensor(g))
    return np.asarray(out).copy(), np.asarray(xt.grad).copy()


def grads(moe):
    """Each weight's tiled .grad read slot by slot (a secondary tile is read from its file; nothing moves)."""
    return {name: np.asarray(getattr(moe, name).grad).copy() for name in ("w1", "w2", "w3")}


EXPERT_BYTES = 3 * I * H * 4  # one expert's three Float32 weight tiles, and as much for their gradient tiles


def test_a_backward_completes_while_the_write_behind_writes_are_held():
    """Weights and gradients of every expert fit the budget, and half of it is kept free by write-behind: the
    backward's gradient tiles are handed to the I/O threads, whose writes wait at the gate. The forward and backward
    complete anyway, with no wait on evictions and the budget never exceeded; after the gate opens every tile
    handed over is evicted, and the gradients read back from their files bit for bit equal to those of the same
    block without a budget (the arithmetic is the same: residency never changes a value)."""
    w1, w2, w3, router, x, g = problem()
    free = sw.moe.SparseMoE(tiled(w1), tiled(w2), tiled(w3), top_k=2)
    out_free, xgrad_free = forward_backward(free, x, router, g)
    want = grads(free)

    max_bytes = E * 2 * EXPERT_BYTES
    budget = ResidencyBudget(max_bytes)
    budget.write_behind_bytes = max_bytes // 2
    moe = sw.moe.SparseMoE(tiled(w1, budget=budget), tiled(w2, budget=budget), tiled(w3, budget=budget), top_k=2)
    core._io_hold("pwrite")
    out, xgrad = forward_backward(moe, x, router, g)
    held("pwrite")  # a write-behind is at the gate (it started after the backward needed nothing from it)
    stats = budget.stats()
    print(stats)
    assert stats["eviction_waits"] == 0 and stats["eviction_wait_ns"] == 0, stats
    assert stats["write_behind_waits"] == 0 and stats["write_behind_wait_ns"] == 0, stats
    assert stats["write_behind_tiles"] > 0 and stats["write_behind_evictions"] == 0, stats
    assert stats["peak_bytes"] <= max_bytes, stats
    queued = stats["write_behind_tiles"]

    core._io_unhold()
    eventually(lambda: budget.stats()["write_behind_tiles"] == 0, "the write-behind queue drains")
    stats = budget.stats()
    assert stats["write_behind_evictions"] == queued and stats["write_behind_failures"] == 0, stats
    assert stats["peak_bytes"] <= max_bytes, stats
    evicted = sum(len(list(getattr(moe, name).grad.carrier.secondary_tiles)) for name in ("w1", "w2", "w3"))
    assert evicted == queued  # the tiles handed over are in their files now
    np.testing.assert_array_equal(out, out_free)
    np.testing.assert_array_equal(xgrad, xgrad_free)
    got = grads(moe)
    for name in ("w1", "w2", "w3"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_failed_write_behind_is_raised_by_the_next_request_and_loses_nothing():
    """The first write-behind write fails with ENOSPC once the gate opens: its tile stays resident and dirty (the
    budget counts the failure), the next request on that carrier raises RuntimeError naming the write-behind and
    its cause and changes nothing, and a retry goes on; a flush then puts every value in the file."""
    w1, w2, w3, router, x, g = problem()
    max_bytes = E * 2 * EXPERT_BYTES
    budget = ResidencyBudget(max_bytes)
    budget.write_behind_bytes = max_bytes // 2
    moe = sw.moe.SparseMoE(tiled(w1, budget=budget), tiled(w2, budget=budget), tiled(w3, budget=budget), top_k=2)
    core._io_hold("pwrite")
    forward_backward(moe, x, router, g)
    held("pwrite")
    core._io_inject("pwrite", errno.ENOSPC, 1)
    core._io_unhold()
    eventually(lambda: budget.stats()["write_behind_tiles"] == 0, "the write-behind queue drains")
    stats = budget.stats()
    assert stats["write_behind_failures"] == 1, stats
    failed = [name for name in ("w1", "w2", "w3")
              if len(list(getattr(moe, name).grad.carrier.dirty_tiles)) > 0]
    carriers = {name: getattr(moe, name).grad.carrier for name in ("w1", "w2", "w3")}
    before = {name: (c.stats(), list(c.primary_tiles), list(c.dirty_tiles)) for name, c in carriers.items()}
    values_before = grads(moe)
    reported = []
    for name, c in carriers.items():
        try:
            c.flush()
        except RuntimeError as e:
            reported.append(name)
            assert "a write-behind eviction of tile" in str(e) and "No space left on device" in str(e), str(e)
            assert "resident and dirty (nothing is lost)" in str(e) and "this request changed nothing" in str(e)
            assert (c.stats(), list(c.primary_tiles), list(c.dirty_tiles)) == before[name]
            c.flush()  # reported once: the retry writes every dirty tile
    assert len(reported) == 1 and reported[0] in failed, (reported, failed)
    for name, c in carriers.items():
        assert len(list(c.dirty_tiles)) == 0
    after = grads(moe)
    for name in ("w1", "w2", "w3"):
        np.testing.assert_array_equal(after[name], values_before[name], err_msg=name)


def test_the_queue_bound_is_validated_and_zero_turns_write_behind_off():
    """write_behind_bytes defaults to max_bytes // 8, is clamped to max_bytes, refuses a negative bound with
    ValueError (leaving the bound as it was), and 0 turns write-behind off: under a budget of two experts' weights
    and gradients, the same forward and backward then evicts inline, in the computing thread (counted as waits),
    and hands nothing to the I/O threads."""
    max_bytes = 2 * 2 * EXPERT_BYTES
    budget = ResidencyBudget(max_bytes)
    assert budget.write_behind_bytes == max_bytes // 8
    assert budget.stats()["write_behind_limit"] == max_bytes // 8
    budget.write_behind_bytes = 10 * max_bytes
    assert budget.write_behind_bytes == max_bytes
    with pytest.raises(ValueError, match="write_behind_bytes must be >= 0"):
        budget.write_behind_bytes = -1
    assert budget.write_behind_bytes == max_bytes
    budget.write_behind_bytes = 0
    w1, w2, w3, router, x, g = problem()
    moe = sw.moe.SparseMoE(tiled(w1, budget=budget), tiled(w2, budget=budget), tiled(w3, budget=budget), top_k=2)
    forward_backward(moe, x, router, g)
    stats = budget.stats()
    assert stats["evictions"] > 0 and stats["eviction_waits"] > 0 and stats["eviction_wait_ns"] > 0, stats
    assert stats["write_behind_evictions"] == 0 and stats["write_behind_tiles"] == 0, stats
    assert stats["write_behind_waits"] == 0, stats
    assert stats["peak_bytes"] <= max_bytes, stats
