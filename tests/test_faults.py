"""Injected I/O faults across every tiled request kind (docs/reliability.md, "Injected faults").

A fault matrix: each request that moves tiles (promotion, eviction of dirty
tiles, projection of missing tiles, scatter-add over secondary tiles, a direct
operation, backward that needs saved tiles again, and promotion into a
FileBacked primary, whose per-tile buffers are new files) meets each fault
kind that its system calls can see:

    EIO on the first pread        EIO on the third pread (third tile transfer)
    EIO on every pread            EIO on the first pwrite
    ENOSPC on the first pwrite    ENOSPC on the third pwrite
    EMFILE on open                EIO on the second open

For every pair the test checks the promise: the request fails with
RuntimeError naming the errno; nothing is published (no result, no gradient);
every value, validity, dirtiness, version, residency counter and ownership is
exactly what it was (all-or-nothing: a full disk keeps a dirty tile dirty and
resident); the carrier stays usable; and the identical request succeeds once
the fault is gone, with the model's values. Moves and the composite carriers'
own paths are covered by tests/test_move.py (``-k io_fault``) and
tests/test_tiled_residency.py (``-k "failed or enospc"``).

Run one row: ``.venv/bin/python -m pytest -q tests/test_faults.py -k "project and third"``.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

import strideweave as sw
from strideweave import Tensor
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection, TileSet

core = sw._core
TILES, TILE = 4, 6
N = TILES * TILE
ALL = TileSet([(t,) for t in range(TILES)])
SELECT_ALL = TileSelection([list(range(TILES))])


pytestmark = pytest.mark.usefixtures("clear_io_faults")


FAULTS = {
    "EIO first pread": ("pread", errno.EIO, 1, 0, "EIO"),
    "EIO third pread": ("pread", errno.EIO, 1, 2, "EIO"),
    "EIO every pread": ("pread", errno.EIO, -1, 0, "EIO"),
    "EIO first pwrite": ("pwrite", errno.EIO, 1, 0, "EIO"),
    "ENOSPC first pwrite": ("pwrite", errno.ENOSPC, 1, 0, "ENOSPC"),
    "ENOSPC third pwrite": ("pwrite", errno.ENOSPC, 1, 2, "ENOSPC"),
    "EMFILE open": ("open", errno.EMFILE, 1, 0, "EMFILE"),
    "EIO second open": ("open", errno.EIO, 1, 1, "EIO"),
}


class Scene:
    """Four tiles of six slots; values 0.5, 1.5, ... on a FileBacked secondary; `primary` tier kind."""

    def __init__(self, primary="cpu"):
        self.values = [float(i) + 0.5 for i in range(N)]
        staged = sw.friendly.tensor(np.array(self.values, dtype=np.float32))
        secondary = sw.move(staged, sw.FileBacked()).carrier
        prim = sw.CPU(0) if primary == "cpu" else sw.FileBacked()
        self.c = TiledEvictable(prim, secondary, (TILES,), (TILE,))
        self.full = Tensor(self.c, 0, sw.column_major(N))

    def snapshot(self):
        """Every observable fact, read without moving a tile (call with no fault armed)."""
        c = self.c
        states = {t: c.tile_state((t,)) for t in range(TILES)}
        values = []
        for s in range(N):
            loc = states[s // TILE].location
            values.append(c[s] if loc == "primary" else c.secondary[s])
        return {"states": states, "values": values, "version": c.version, "stats": c.stats(),
                "owned": (c.is_owned(), c.primary.is_owned(), c.secondary.is_owned()),
                "released": c.is_released(), "grad": self.full.grad}


def _promote(sc):
    sc.c.promote_async(ALL).wait()
    return lambda: [sc.c[s] for s in range(N)] == sc.values


def _evict_dirty(sc):
    sc.c.evict_async(ALL).wait()
    return lambda: [sc.c.secondary[s] for s in range(N)] == sc.values and not sc.c.primary_tiles


def _project(sc):
    out = sc.c.project(sc.full, TileSelection([[3, 0, 2]])).wait()
    want = sc.values[3 * TILE:4 * TILE] + sc.values[0:TILE] + sc.values[2 * TILE:3 * TILE]
    return lambda: [out[i] for i in range(3 * TILE)] == want


def _scatter_add(sc):
    compact = sw.friendly.tensor(np.ones(2 * TILE, dtype=np.float32))
    out = sc.c.scatter(compact, sc.full, TileSelection([[1, 2]]), reduction="add").wait()
    proj = out.carrier.project(out, TileSelection([[1, 2]])).wait()
    return lambda: [proj[i] for i in range(2 * TILE)] == [v + 1.0 for v in sc.values[TILE:3 * TILE]]


def _operation(sc):
    y = sw.reduce_sum(sc.full, "a -> ")
    return lambda: y[0] == pytest.approx(sum(sc.values))


def _backward(sc):
    sc.loss.backward()
    return lambda: [sc.full.grad[i] for i in range(N)] == [2.0 * v for v in sc.values]


def _prepare_backward(sc):
    sc.loss = sw.reduce_sum(sw.elementwise_mul(sc.full, sc.full), "a -> ")  # backward reads the saved tiles
    sc.c.evict(ALL)


def _prepare_dirty(sc):
    sc.c.promote(ALL)
    for t in range(TILES):
        s = t * TILE + 1
        sc.values[s] = -sc.values[s]
        sc.c[s] = sc.values[s]  # every tile dirty: eviction writes each one


REQUESTS = {
    # name: (primary kind, prepare, run -> check, fault kinds that its system calls meet)
    "promote": ("cpu", None, _promote, ["EIO first pread", "EIO third pread", "EIO every pread"]),
    "promote into FileBacked tiles": ("file", None, _promote, ["EMFILE open", "EIO second open", "EIO first pread"]),
    "evict dirty": ("cpu", _prepare_dirty, _evict_dirty,
                    ["EIO first pwrite", "ENOSPC first pwrite", "ENOSPC third pwrite"]),
    "project": ("cpu", None, _project, ["EIO first pread", "EIO third pread", "EIO every pread"]),
    "scatter add": ("cpu", None, _scatter_add, ["EIO first pread", "EIO every pread"]),
    "operation": ("cpu", None, _operation, ["EIO first pread", "EIO third pread", "EIO every pread"]),
    "backward": ("cpu", _prepare_backward, _backward, ["EIO first pread", "EIO third pread"]),
}

CASES = [(r, f) for r, (_, _, _, faults) in REQUESTS.items() for f in faults]


@pytest.mark.parametrize("request_kind, fault", CASES, ids=[f"{r} / {f}" for r, f in CASES])
def test_fault_fails_the_request_changes_nothing_and_retry_succeeds(request_kind, fault):
    primary, prepare, run, _ = REQUESTS[request_kind]
    op, err, count, after, name = FAULTS[fault]
    sc = Scene(primary)
    if prepare:
        prepare(sc)
    before = sc.snapshot()
    core._io_inject(op, err, count=count, after=after)
    with pytest.raises(RuntimeError, match=name):
        run(sc)
    core._io_clear()
    assert sc.snapshot() == before  # nothing published, nothing lost, nothing half-committed
    if request_kind == "evict dirty":
        assert sc.c.dirty_tiles == ALL  # a full disk keeps every dirty tile dirty and resident
    check = run(sc)  # the identical request succeeds once the fault is gone
    assert check()
    sc.c.release()
    assert sc.c.is_released()


def test_every_fault_kind_is_exercised():
    used = {f for _, f in CASES}
    assert used == set(FAULTS), set(FAULTS) - used
