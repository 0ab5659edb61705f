"""fork(): a child made after tile I/O works on its own, and handles it inherited in flight fail at once.

Note [Fork safety] (cpp/include/strideweave/fork.hpp): only the forking thread
exists in the child. Every engine pool starts afresh there, the locks the
engine's threads may hold are held across fork() so the child gets them
unlocked, and a handle whose work was in flight at fork() runs only in the
parent: in the child it fails at once (``done`` is True, ``wait()`` raises
``RuntimeError`` "created before fork"), and the tiles that work was
transitioning or pinning are free for the child's own requests.

Children are made with ``multiprocessing`` in fork mode (the way most users
fork) and with plain ``os.fork()`` (``tests/forked.py``); each is bounded by a
timeout, so an engine that hangs in the child fails the test instead of the
suite. Work is held in flight with the test-only I/O gate (``_io_hold``) or the
pending test carrier (``tests/pending_carrier.py``), never with sleeps.

Run: ``.venv/bin/python -m pytest -q tests/test_fork.py``.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Tensor
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection, TileSet

from forked import check_in_forked_child, child_watchdog, describe_hung_child
from pending_carrier import destination, pending_tensor, settle_all, take, wait_handle
from waiting import held

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

F32 = DType.Float32
core = sw._core
TILE = 256  # slots per tile
GRID = 4
CHILD_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def _clear_io_hooks(clear_io_faults):
    yield
    settle_all()  # pending transfers a failed test left behind end here (settling never waits on the I/O gate)


def file_backed_tiled():
    """A FileBacked-backed TiledEvictable of GRID tiles (CPU primary), its full tensor and its values."""
    values = np.arange(GRID * TILE, dtype=np.float32) * 0.5 - 100.0
    secondary = sw.move(sw.friendly.tensor(values), sw.FileBacked()).carrier
    c = TiledEvictable(sw.CPU(0), secondary, (GRID,), (TILE,))
    return c, Tensor(c, 0, sw.column_major(GRID * TILE)), values


def tile_values(values, t):
    return values[t * TILE:(t + 1) * TILE]


def run_in_mp_fork(target, timeout=CHILD_TIMEOUT_S):
    """Runs `target()` in a `multiprocessing` child made by fork; returns what it sent back (or fails when it
    hangs or dies). `target` returns a string: "ok", or what went wrong."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def main():
        try:
            child_watchdog(timeout)
            result = target()
        except BaseException as e:  # noqa: BLE001 - the parent reports it
            result = f"{type(e).__name__}: {e}"
        send.send(result)

    p = ctx.Process(target=main, daemon=True)
    p.start()
    send.close()
    try:
        if not receive.poll(timeout):
            pytest.fail(f"the forked child hung (no answer within the timeout):\n{describe_hung_child(p.pid)}")
        try:
            result = receive.recv()
        except EOFError:
            result = "the child died before answering"
    finally:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == 0, f"the forked child exited with {p.exitcode}"
    return result


def child_residency_round(c, full, values):
    """In the child: a one-tile promote, a projection and an eviction, each with exact values."""
    c.promote(TileSet([(1,)]))
    if c.tile_state((1,)).location != "primary":
        return "tile 1 not primary after promote"
    got = np.asarray(c.project(full, TileSelection([[2, 1]])).wait())
    if not np.array_equal(got, np.concatenate([tile_values(values, 2), tile_values(values, 1)])):
        return "projection values differ"
    c.evict(TileSet([(1,), (2,)]))
    if any(c.tile_state((t,)).location != "secondary" for t in (1, 2)):
        return "tiles not secondary after evict"
    h = c.promote_async(TileSet([(0,), (3,)]))
    h.wait()
    if not np.array_equal(np.asarray(c.project(full, TileSelection([[0, 1, 2, 3]])).wait()), values):
        return "full projection values differ"
    return "ok"


@pytest.mark.parametrize("how", ["multiprocessing", "os.fork"])
def test_a_child_forked_after_tile_io_promotes_projects_and_evicts(how):
    """Before: the parent's I/O threads did not exist in the child, and its pools never started new ones:
    the child's first one-tile promote never completed."""
    c, full, values = file_backed_tiled()
    c.promote(TileSet([(0,), (3,)]))  # tile I/O: the I/O pools have threads
    c.evict(TileSet([(0,), (3,)]))
    np.testing.assert_array_equal(np.asarray(c.project(full, TileSelection([[3]])).wait()), tile_values(values, 3))
    if how == "multiprocessing":
        assert run_in_mp_fork(lambda: child_residency_round(c, full, values)) == "ok"
    else:
        check_in_forked_child(lambda: child_residency_round(c, full, values) == "ok", "promote/project/evict",
                              CHILD_TIMEOUT_S)
    # The parent is unaffected.
    np.testing.assert_array_equal(np.asarray(c.project(full, TileSelection([[0, 1, 2, 3]])).wait()), values)
    c.release()


def inherited_handle_problem(handle):
    """What is wrong with a handle inherited in flight, in the child (None when it fails at once, as it should)."""
    if not handle.done:
        return "an inherited handle is not done at once"
    try:
        handle.wait()
        return "an inherited handle completed in the child"
    except RuntimeError as e:
        if "created before fork" not in str(e):
            return f"wrong message: {e}"
    return None


def residency_in_flight_child(c, full, values, h, proj):
    core._io_unhold()  # this process's copy of the gate: the child's own reads pass
    for handle in (h, proj):
        if problem := inherited_handle_problem(handle):
            return problem
    if "(done)" not in repr(h):
        return f"repr {h!r}"
    # The tiles those requests were transitioning or pinning are the child's to use.
    if c.tile_state((0,)).location != "secondary":
        return "tile 0 changed"
    c.promote(TileSet([(0,)]))
    c.evict(TileSet([(0,), (1,)]))
    got = np.asarray(c.project(full, TileSelection([[1, 0]])).wait())
    if not np.array_equal(got, np.concatenate([tile_values(values, 1), tile_values(values, 0)])):
        return "values differ"
    c.promote(TileSet([(2,)]))
    if not np.array_equal(np.asarray(c.project(full, TileSelection([[2]])).wait()), tile_values(values, 2)):
        return "tile 2 values differ"
    return "ok"


@pytest.mark.parametrize("how", ["multiprocessing", "os.fork"])
def test_residency_and_projection_handles_in_flight_at_fork_fail_in_the_child(how):
    """A promotion held at the I/O gate and a projection waiting on a promotion of another tile are in flight
    when the process forks. In the child both handles are done at once and raise RuntimeError "created before
    fork"; the tiles are free for the child's own requests, with exact values. In the parent both complete."""
    c, full, values = file_backed_tiled()
    c.promote(TileSet([(3,)]))  # tile I/O before the fork
    c.evict(TileSet([(3,)]))
    core._io_hold("pread")
    h = c.promote_async(TileSet([(0,)]))
    proj = c.project(full, TileSelection([[1]]))  # pins tile 1 and promotes it
    held("pread", 2)  # both tile reads are blocked on pool threads: the work is in flight
    assert not h.done and not proj.done
    if how == "multiprocessing":
        assert run_in_mp_fork(lambda: residency_in_flight_child(c, full, values, h, proj)) == "ok"
    else:
        check_in_forked_child(lambda: residency_in_flight_child(c, full, values, h, proj) == "ok",
                              "inherited handles", CHILD_TIMEOUT_S)
    # The parent's requests were never affected.
    assert not h.done and not proj.done
    core._io_unhold()
    assert h.wait() is None
    np.testing.assert_array_equal(np.asarray(proj.wait()), tile_values(values, 1))
    assert c.tile_state((0,)).location == "primary" and c.tile_state((1,)).location == "primary"
    np.testing.assert_array_equal(np.asarray(c.project(full, TileSelection([[0, 1, 2, 3]])).wait()), values)


def move_in_flight_child(h):
    if problem := inherited_handle_problem(h):
        return problem
    # The child's own moves run on its own move pool.
    moved = sw.move(sw.friendly.tensor(np.arange(8, dtype=np.float32)), sw.FileBacked())
    if [moved.carrier[i] for i in range(8)] != list(range(8)):
        return "the child's own move gave wrong values"
    return "ok"


@pytest.mark.parametrize("how", ["multiprocessing", "os.fork"])
def test_a_move_handle_in_flight_at_fork_fails_in_the_child_and_completes_in_the_parent(how):
    """The pending test carrier keeps a move in flight (its transfer waits for the test) across the fork."""
    src = pending_tensor([1.0, 2.0, 3.0])
    h = sw.move_async(src, destination())
    transfer = take()  # submitted: the move thread waits on it
    assert not h.done
    if how == "multiprocessing":
        assert run_in_mp_fork(lambda: move_in_flight_child(h)) == "ok"
    else:
        check_in_forked_child(lambda: move_in_flight_child(h) == "ok", "an inherited move", CHILD_TIMEOUT_S)
    assert not h.done
    transfer.complete()
    result = wait_handle(h)
    assert [result.carrier[i] for i in range(3)] == [1.0, 2.0, 3.0]
