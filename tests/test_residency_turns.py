"""Blocking residency requests and optimizer steps wait in turn instead of refusing (Note [Taking turns] in
cpp/src/tiled/residency.cpp; docs/reliability.md, "Hostile use" U24).

A loop of blocking ``evict`` / ``flush`` / ``promote`` calls on the tiles an optimizer steps used to refuse ("wait")
whenever the step held a tile, and the step refused whenever the loop's request was in flight: in 60 iterations of
each, no step got through. Now the blocking forms and the step wait for the other side's request or hold to end,
first come first served among those that wait, with a bound (``sw.set_turn_wait_limit``); the asynchronous forms
still refuse at once, as the specification requires of them.

Nothing sleeps to order events: requests are held in flight with the test-only I/O gate (``_io_hold(op)`` blocks
every call of ``op`` until ``_io_unhold()``; ``_io_held_waiting(op)`` counts the blocked calls).

Run: ``.venv/bin/python -m pytest -q tests/test_residency_turns.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from waiting import held
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection, TileSet

pytestmark = pytest.mark.usefixtures("grad_mode_on", "clear_io_faults")
BASE_SEED = 20261205

OUT, IN, E = 8, 5, 4
ALL = TileSet([(0, e) for e in range(E)])


def expert_weight(experts):
    """A TiledEvictable over a scratch-file tier of `experts` (E, OUT, IN), one tile per expert, and its full tensor."""
    data = np.ascontiguousarray(experts, dtype=np.float32).reshape(-1)
    tier = sw.move(friendly.tensor(data), sw.FileBacked(dtype=sw.DType.Float32))
    c = TiledEvictable(sw.CPU(0, dtype=sw.DType.Float32), tier.carrier, (1, E), (OUT, IN))
    return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), sw.Stride(IN, [1, OUT * IN])))


def give_gradient(c, full, grads):
    """full.grad with tile e equal to grads[e] for every expert (one backward of sum(w * g) per expert)."""
    full.grad = None
    for e in range(E):
        w = c.project(full, TileSelection([[0], [e]])).wait()
        sw.reduce_sum(sw.elementwise_mul(w, friendly.tensor(grads[e])), "o i ->").backward()




def started_waiting(call):
    """Runs `call` in a thread and checks that it is still running (waiting, not refused) 0.2 s later: the thread
    and its result dict ({"ok": True} or {"error": e} once it ends)."""
    result = {}

    def run():
        try:
            call()
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 (reported by the caller)
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(0.2)
    assert t.is_alive(), result
    return t, result


@pytest.fixture
def wait_limit():
    """Restores the process-wide wait limit after the test."""
    before = sw.turn_wait_limit()
    yield
    sw.set_turn_wait_limit(before)


def snapshot(c):
    return ([c.tile_state((0, e)) for e in range(E)], c.stats(), c.version)


def test_residency_loop_and_optimizer_steps_both_complete(rng):
    """U24: a thread loops evict / flush / promote of every tile of the weight and of its gradient while the main
    thread steps 60 times: every iteration of both completes, and the weights are those of 60 plain steps."""
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    grads = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full = expert_weight(experts)
    give_gradient(c, full, grads)
    opt = sw.optim.SGD([full], lr=0.01)
    gcar = full.grad.carrier
    iterations = 60
    done = {"loop": 0, "steps": 0}
    errors = []
    start = threading.Barrier(2)

    def residency_loop():
        start.wait()
        try:
            for _ in range(iterations):
                for carrier in (c, gcar):
                    carrier.evict(ALL)
                    carrier.flush()
                    carrier.promote(ALL)
                done["loop"] += 1
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=residency_loop)
    t.start()
    start.wait()
    try:
        for _ in range(iterations):
            opt.step()
            done["steps"] += 1
    finally:
        t.join(120)
    assert not t.is_alive()
    assert not errors, errors
    assert done == {"loop": iterations, "steps": iterations}
    # The same steps without the other loop, on a second carrier: bit-identical weights.
    c2, full2 = expert_weight(experts)
    give_gradient(c2, full2, grads)
    opt2 = sw.optim.SGD([full2], lr=0.01)
    for _ in range(iterations):
        opt2.step()
    np.testing.assert_array_equal(np.asarray(full), np.asarray(full2))
    assert not np.array_equal(np.asarray(full), np.asarray(experts.transpose(1, 0, 2).reshape(OUT, E * IN)))
    assert opt.stats()["tiles_stepped"] == iterations * E


@pytest.mark.parametrize("blocking", ["promote", "evict", "flush"])
def test_blocking_form_waits_for_a_request_in_flight(held_io, blocking):
    """A blocking request on a tile under another caller's incomplete request waits for it (no "wait" refusal) and
    then runs; the asynchronous form still refuses at once."""
    c, full = expert_weight(np.arange(E * OUT * IN, dtype=np.float32).reshape(E, OUT, IN))
    full[0] = 7.0  # tile 0 resident and dirty: its eviction or flush writes
    held_io._io_hold("pwrite")
    if blocking == "evict":
        other = c.flush_async()
        target = TileSet([(0, 0)])
    else:
        other = c.evict_async(TileSet([(0, 0)]))
        target = None if blocking == "flush" else TileSet([(0, 0)])
    held("pwrite")
    with pytest.raises(RuntimeError, match="wait"):
        (c.flush_async() if target is None else getattr(c, blocking + "_async")(target))
    call = getattr(c, blocking)
    t, result = started_waiting(lambda: call() if target is None else call(target))
    held_io._io_unhold()
    other.wait()
    t.join(30)
    assert result == {"ok": True}
    state = c.tile_state((0, 0))
    assert state.location == {"promote": "primary", "evict": "secondary", "flush": "secondary"}[blocking]
    assert not state.dirty
    assert np.asarray(full)[0, 0] == 7.0


def test_wait_is_bounded_and_changes_nothing(held_io, wait_limit):
    """Past the wait limit a blocking request raises RuntimeError naming what holds the tile; nothing changed."""
    c, full = expert_weight(np.ones((E, OUT, IN), dtype=np.float32))
    full[0] = 3.0
    held_io._io_hold("pwrite")
    other = c.evict_async(TileSet([(0, 0)]))
    held("pwrite")
    before = snapshot(c)
    sw.set_turn_wait_limit(0.05)
    for call in (lambda: c.promote(TileSet([(0, 0)])), lambda: c.evict(TileSet([(0, 0)])), c.flush):
        with pytest.raises(RuntimeError, match=r"waited 0\.05 s for tile \(0, 0\).*incomplete residency request"):
            call()
        assert snapshot(c) == before
    held_io._io_unhold()
    other.wait()
    assert c.tile_state((0, 0)).location == "secondary"
    assert np.asarray(full)[0, 0] == 3.0


def test_step_waits_for_a_request_in_flight(held_io):
    """An optimizer step meets a tile under an eviction in flight: it waits for it and steps (it used to refuse)."""
    experts = np.ones((E, OUT, IN), dtype=np.float32)
    c, full = expert_weight(experts)
    give_gradient(c, full, np.full((E, OUT, IN), 2.0, dtype=np.float32))
    opt = sw.optim.SGD([full], lr=0.5)
    full[0] = 5.0  # tile 0 dirty: its eviction writes
    held_io._io_hold("pwrite")
    other = c.evict_async(TileSet([(0, 0)]))
    held("pwrite")
    t, result = started_waiting(opt.step)
    held_io._io_unhold()
    other.wait()
    t.join(30)
    assert result == {"ok": True}
    a = np.asarray(full)
    assert a[0, 0] == np.float32(5.0) - np.float32(0.5) * np.float32(2.0)
    assert a[0, IN] == 0.0  # 1 - 0.5 * 2


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_wait_limit_must_be_positive_and_finite(wait_limit, bad):
    before = sw.turn_wait_limit()
    with pytest.raises(ValueError, match="positive, finite"):
        sw.set_turn_wait_limit(bad)
    assert sw.turn_wait_limit() == before
