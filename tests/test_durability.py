"""Durability of a TiledEvictable's values: what reaches the secondary tier's file, and what is never lost silently.

* A residency policy's eviction that fails (a full disk) fails the handle of the work that planned it, with its
  cause; the tiles stay resident and dirty and ``stats()`` counts no eviction for them (Note [A failed deferred
  eviction reaches the work] in cpp/src/tiled/work.cpp).
* ``flush()`` / ``flush_async()`` write every dirty tile to the secondary tier, fsync it and mark the tiles clean
  while they stay resident; all-or-nothing under injected write and fsync faults (Note [Flushing tiles]).
  ``FileBacked.flush()`` fsyncs a plain file.
* Releasing, collecting or leaving alive at exit a carrier whose secondary is a file the user named, with dirty
  tiles, emits a ResourceWarning with their count (Note [Dirty tiles are never discarded silently]).
* A read-only secondary tier refuses an eviction or flush that would write, before writing (Note [A read-only
  secondary tier]).

Faults come from the engine's test-only gates: ``_core._io_inject(op, errno, count, after)`` and
``_core._io_hold(op)``; ``_core._io_calls(op)`` counts the system calls made. Nothing sleeps to order events.

Run: ``.venv/bin/python -m pytest -q tests/test_durability.py``.
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import strideweave as sw
from waiting import held
from strideweave import Tensor
from strideweave.carriers.tiled_evictable import (ResidencyPlan, TiledEvictable, TiledResidencyFacet, TileSelection,
                                                  TileSet)
from strideweave.policies import LRUPolicy

core = sw._core
TILES, TILE = 10, 4
N = TILES * TILE
ALL = TileSet([(t,) for t in range(TILES)])


pytestmark = pytest.mark.usefixtures("clear_io_faults")


class Scene:
    """TILES tiles of TILE slots over a secondary file (named `path`, or anonymous), seeded 0.5, 1.5, ...

    ``dirty`` tiles are promoted and get a new value in their second slot; ``resident`` ones are promoted clean.
    """

    def __init__(self, tmp_path, *, name="tier.f32", named=True, mutable=True, policy=None, dirty=(), resident=()):
        self.values = np.arange(N, dtype=np.float32) + 0.5
        self.path = str(tmp_path / name) if named else None
        if named:
            self.values.tofile(self.path)
            secondary = sw.FileBacked(self.path, mutable=mutable)
        else:
            secondary = sw.move(sw.friendly.tensor(self.values.copy()), sw.FileBacked()).carrier
        self.c = TiledEvictable(sw.CPU(0), secondary, (TILES,), (TILE,), residency_policy=policy)
        self.full = Tensor(self.c, 0, sw.column_major(N))
        if dirty or resident:
            self.c.promote(TileSet([(t,) for t in sorted(set(dirty) | set(resident))]))
        for t in dirty:
            self.write(t * TILE + 1, -100.0 - t)

    def write(self, slot, value):
        self.c[slot] = value
        self.values[slot] = value

    def file(self):
        return np.fromfile(self.path, dtype=np.float32)

    def facts(self):
        """What can be read while a request is pending (no values)."""
        c = self.c
        return {"states": {t: c.tile_state((t,)) for t in range(TILES)}, "version": c.version, "stats": c.stats()}

    def snapshot(self):
        """Every observable fact, read without moving a tile (no fault armed)."""
        c = self.c
        states = {t: c.tile_state((t,)) for t in range(TILES)}
        values = [c[s] if states[s // TILE].location == "primary" else c.secondary[s] for s in range(N)]
        return {"states": states, "values": values, "version": c.version, "stats": c.stats(),
                "owned": (c.is_owned(), c.primary.is_owned(), c.secondary.is_owned()), "released": c.is_released()}


def tiles(*ts):
    return TileSet([(t,) for t in ts])


# ---------------------------------------------------------------- a policy's failed eviction (U3)


def test_lru_evictions_on_a_full_disk_fail_the_projection_that_planned_them(tmp_path):
    """LRUPolicy(2) over ten dirty tiles projected one after another on a full disk: from the third projection on,
    the eviction the policy plans after each fails with ENOSPC. Each such projection raises with the cause; the
    tiles stay resident and dirty; stats() counts no eviction; nothing else changes."""
    sc = Scene(tmp_path, policy=LRUPolicy(2), dirty=range(TILES))
    on_file = sc.file()
    core._io_inject("pwrite", errno.ENOSPC, count=-1)
    for t in range(TILES):
        before = sc.snapshot()
        handle = sc.c.project(sc.full, TileSelection([[t]]))
        if t < 2:  # within the budget: nothing to evict
            assert np.array_equal(np.asarray(handle.wait()), sc.values[t * TILE:(t + 1) * TILE])
            continue
        with pytest.raises(RuntimeError) as info:
            handle.wait()
        message = str(info.value)
        assert "ENOSPC" in message and "pwrite" in message and sc.path in message, message
        assert f"eviction of tile ({t - 2},)" in message and "projection" in message, message
        assert "stay resident" in message or "stays resident" in message, message
        assert sc.snapshot() == before  # the planned tile is still primary and dirty; stats, values, version as before
    assert sc.c.dirty_tiles == ALL and sc.c.primary_tiles == ALL
    stats = sc.c.stats()
    assert stats["evictions"] == 0 and stats["bytes_evicted"] == 0 and stats["primary_tiles"] == TILES
    assert np.array_equal(sc.file(), on_file)  # nothing reached the file
    core._io_clear()
    sc.c.evict(ALL)  # the values were kept: they all reach the file once the disk has room
    assert np.array_equal(sc.file(), sc.values)
    assert sc.c.stats()["evictions"] == TILES


class EvictAfter:
    """A policy that plans the eviction of fixed tiles after every request."""

    def __init__(self, *evict):
        self.evict = tiles(*evict)

    def plan(self, required, purpose):
        return ResidencyPlan(evict=self.evict)


def _project(sc):
    return np.asarray(sc.c.project(sc.full, TileSelection([[0, 1]])).wait())


def _scatter_add(sc):
    compact = sw.friendly.tensor(np.ones(2 * TILE, dtype=np.float32))
    return sc.c.scatter(compact, sc.full, TileSelection([[0, 1]]), reduction="add").wait()


def _operation(sc):
    return sw.reduce_sum(sc.full, "a -> ")[0]


def _backward(sc):
    sc.loss.backward()  # the product's backward reads the saved full tensor again ("backward")
    return sc.full.grad


@pytest.mark.parametrize("work", [_project, _scatter_add, _operation, _backward],
                         ids=["projection", "scatter-add", "operation", "backward"])
@pytest.mark.parametrize("fault", [("pwrite", errno.ENOSPC, "ENOSPC"), ("pwrite", errno.EIO, "EIO")],
                         ids=["ENOSPC", "EIO"])
def test_a_failed_deferred_eviction_fails_every_kind_of_work(tmp_path, work, fault):
    """Every request kind that asks the policy reports its failed eviction with the cause and publishes nothing."""
    op, err, name = fault
    sc = Scene(tmp_path, policy=EvictAfter(5, 6), dirty=range(TILES))
    if work is _backward:
        policy = sc.c.residency_policy
        policy.evict = TileSet()  # the forward evicts nothing; the eviction planned after backward's read fails
        sc.loss = sw.reduce_sum(sw.elementwise_mul(sc.full, sc.full), "a -> ")
        policy.evict = tiles(5, 6)
    before = sc.snapshot()
    core._io_inject(op, err, count=-1)
    with pytest.raises(RuntimeError, match=name) as info:
        work(sc)
    assert "tiles (5,), (6,)" in str(info.value) and "residency policy" in str(info.value), info.value
    core._io_clear()
    assert sc.snapshot() == before
    assert sc.full.grad is None
    assert sc.c.dirty_tiles == ALL


def test_a_deferred_eviction_of_a_tile_under_another_request_is_left_out_not_failed(tmp_path):
    """Conflicts are not failures: a planned tile that another request is transitioning is left to that request."""
    sc = Scene(tmp_path, policy=EvictAfter(5), dirty=range(TILES))
    core._io_hold("pwrite")
    pending = sc.c.evict_async(tiles(5))  # tile 5 is under this request while the projection ends
    held("pwrite")
    assert np.array_equal(_project(sc), sc.values[:2 * TILE])
    core._io_unhold()
    pending.wait()
    assert sc.c.tile_state((5,)).location == "secondary"
    assert sc.c.stats()["evictions"] == 1


# ---------------------------------------------------------------- flush (U5)


def test_flush_writes_every_dirty_tile_durably_and_keeps_it_resident(tmp_path):
    sc = Scene(tmp_path, dirty=(1, 4, 7), resident=(2,))
    version = sc.c.version
    fsyncs, pwrites = core._io_calls("fsync"), core._io_calls("pwrite")
    assert sc.c.flush() is None
    assert np.array_equal(sc.file(), sc.values)  # the file itself holds every value
    assert len(sc.c.dirty_tiles) == 0
    assert sc.c.primary_tiles == tiles(1, 2, 4, 7)  # still resident
    stats = sc.c.stats()
    assert stats["flushes"] == 3 and stats["bytes_flushed"] == 3 * TILE * 4
    assert stats["evictions"] == 0 and stats["primary_tiles"] == 4
    assert core._io_calls("pwrite") - pwrites == 3  # one write per dirty tile, none for the clean one
    assert core._io_calls("fsync") - fsyncs == 1
    assert sc.c.version == version  # residency and durability never change the version
    assert sc.snapshot()["values"] == list(sc.values)  # read without promoting the other tiles
    # Clean resident tiles now evict without writing.
    pwrites = core._io_calls("pwrite")
    sc.c.evict(ALL)
    assert core._io_calls("pwrite") == pwrites and sc.c.stats()["writes_skipped"] == 4


def test_flush_async_returns_a_residency_handle_and_a_flush_with_nothing_dirty_still_syncs(tmp_path):
    sc = Scene(tmp_path, dirty=(3,))
    handle = sc.c.flush_async()
    assert isinstance(handle, sw.AwaitResidency)
    assert handle.wait() is None and len(sc.c.dirty_tiles) == 0
    assert np.array_equal(sc.file(), sc.values)
    sc.write(3 * TILE, 42.0)
    sc.c.evict(tiles(3))  # written by the eviction, not synced
    fsyncs = core._io_calls("fsync")
    sc.c.flush()  # nothing dirty: syncs what the eviction wrote
    assert core._io_calls("fsync") - fsyncs == 1
    assert np.array_equal(sc.file(), sc.values) and sc.c.stats()["flushes"] == 1
    # The facet has both forms.
    facet = sc.c.facet(TiledResidencyFacet)
    sc.write(0, 7.0)
    assert facet.flush_async().wait() is None and facet.flush() is None
    assert np.array_equal(sc.file(), sc.values)


def test_flush_is_refused_while_a_tile_is_in_flight_and_a_flush_in_flight_refuses_others(tmp_path):
    sc = Scene(tmp_path, dirty=(0, 1, 2))
    core._io_hold("pwrite")
    eviction = sc.c.evict_async(tiles(0))
    held("pwrite")
    before = sc.facts()
    with pytest.raises(RuntimeError, match="wait for it before flushing"):
        sc.c.flush_async()
    assert sc.facts() == before and sc.c.dirty_tiles == tiles(0, 1, 2)
    core._io_unhold()
    eviction.wait()
    # A flush in flight: its tiles are pending, so requests and writes on them refuse with "wait".
    core._io_hold("fsync")
    flush = sc.c.flush_async()
    held("fsync")
    for refused in (lambda: sc.c.__setitem__(TILE + 1, 3.0), lambda: sc.c.evict_async(tiles(1)),
                    lambda: sc.c.flush_async(), lambda: sc.c.project(sc.full, TileSelection([[2]]))):
        with pytest.raises(RuntimeError, match="wait"):
            refused()
    with pytest.raises(RuntimeError, match="wait"):
        sc.c.release()
    core._io_unhold()
    assert flush.wait() is None
    assert len(sc.c.dirty_tiles) == 0 and np.array_equal(sc.file(), sc.values)


FLUSH_FAULTS = {
    "EIO first pwrite": ("pwrite", errno.EIO, 1, 0, "EIO"),
    "ENOSPC first pwrite": ("pwrite", errno.ENOSPC, 1, 0, "ENOSPC"),
    "ENOSPC third pwrite": ("pwrite", errno.ENOSPC, 1, 2, "ENOSPC"),
    "EIO fsync": ("fsync", errno.EIO, 1, 0, "EIO"),
    "ENOSPC fsync": ("fsync", errno.ENOSPC, 1, 0, "ENOSPC"),
}


@pytest.mark.parametrize("fault", list(FLUSH_FAULTS))
def test_a_failed_flush_leaves_every_tile_dirty_and_resident_and_a_retry_succeeds(tmp_path, fault):
    op, err, count, after, name = FLUSH_FAULTS[fault]
    sc = Scene(tmp_path, dirty=(0, 3, 5, 9), resident=(4,))
    before = sc.snapshot()
    core._io_inject(op, err, count=count, after=after)
    with pytest.raises(RuntimeError, match=name) as info:
        sc.c.flush()
    assert op in str(info.value) and sc.path in str(info.value), info.value
    core._io_clear()
    assert sc.snapshot() == before  # every tile dirty and resident, stats (no flush counted), values, version
    assert sc.c.dirty_tiles == tiles(0, 3, 5, 9)
    sc.c.flush()  # every dirty tile is written again, then synced
    assert np.array_equal(sc.file(), sc.values) and len(sc.c.dirty_tiles) == 0
    assert sc.c.stats()["flushes"] == 4


def test_file_backed_flush_fsyncs_its_file(tmp_path):
    path = str(tmp_path / "plain.f32")
    np.zeros(4, np.float32).tofile(path)
    f = sw.FileBacked(path)
    f[2] = 5.0
    fsyncs = core._io_calls("fsync")
    assert f.flush() is None
    assert core._io_calls("fsync") - fsyncs == 1
    assert np.fromfile(path, np.float32).tolist() == [0.0, 0.0, 5.0, 0.0]
    core._io_inject("fsync", errno.EIO)
    with pytest.raises(RuntimeError, match="fsync of .*plain.f32.*EIO"):
        f.flush()
    assert f[2] == 5.0 and f.version == 1
    core._io_clear()
    f.flush()
    f.release()
    with pytest.raises(RuntimeError, match="released"):
        f.flush()


# ---------------------------------------------------------------- dirty tiles discarded (U6)


def no_resource_warnings(action):
    gc.collect()  # what earlier tests left in cycles is not this action's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_release_with_dirty_tiles_of_a_named_file_warns_with_their_count(tmp_path):
    sc = Scene(tmp_path, dirty=(1, 2, 8), resident=(4,))
    with pytest.warns(ResourceWarning, match=r"discards 3 dirty tiles on release\(\)") as record:
        sc.c.release()
    assert sc.path in str(record[0].message) and "flush()" in str(record[0].message)
    assert sc.c.is_released()
    no_resource_warnings(sc.c.release)  # idempotent, and reported once


def test_release_warning_becomes_an_error_under_an_error_filter(tmp_path):
    sc = Scene(tmp_path, dirty=(0,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with pytest.raises(ResourceWarning, match="discards 1 dirty tile on"):
            sc.c.release()
    assert sc.c.is_released()


def test_collecting_a_carrier_with_dirty_tiles_of_a_named_file_warns(tmp_path):
    sc = Scene(tmp_path, dirty=(5, 6))
    path = sc.path
    with pytest.warns(ResourceWarning, match="discards 2 dirty tiles as it is destroyed") as record:
        sc.c = sc.full = None
        gc.collect()
    assert path in str(record[0].message)


def test_clean_flushed_or_anonymous_carriers_do_not_warn(tmp_path):
    clean = Scene(tmp_path, name="clean.f32", resident=(0, 1))
    no_resource_warnings(clean.c.release)
    flushed = Scene(tmp_path, name="flushed.f32", dirty=(2, 3))
    flushed.c.flush()
    no_resource_warnings(flushed.c.release)
    anonymous = Scene(tmp_path, named=False, dirty=(2, 3))
    no_resource_warnings(anonymous.c.release)
    for scene in (Scene(tmp_path, name="collected.f32", dirty=(4,)), Scene(tmp_path, named=False, dirty=(4,))):
        if scene.path:
            scene.c.flush()

        def drop(scene=scene):
            scene.c = scene.full = None
        no_resource_warnings(drop)


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import strideweave as sw
    from strideweave.carriers.tiled_evictable import TiledEvictable, TileSet

    path, flush = sys.argv[1], sys.argv[2] == "flush"
    np.arange(12, dtype=np.float32).tofile(path)
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(path), (3,), (4,))
    c.promote(TileSet([(0,), (1,), (2,)]))
    c[1] = -1.0
    c[9] = -9.0   # two dirty tiles
    if flush:
        c.flush()
    print("script ended", flush=True)
    """
)


@pytest.mark.parametrize("flush", [False, True], ids=["dirty", "flushed"])
def test_a_carrier_alive_at_interpreter_exit_with_dirty_tiles_warns(tmp_path, flush):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    path = tmp_path / "tier.f32"
    proc = subprocess.run([sys.executable, "-W", "error::ResourceWarning", str(script), str(path),
                           "flush" if flush else "keep"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "script ended" in proc.stdout, proc.stderr
    if flush:
        assert "ResourceWarning" not in proc.stderr, proc.stderr
        assert np.fromfile(path, np.float32)[[1, 9]].tolist() == [-1.0, -9.0]
    else:
        assert "ResourceWarning" in proc.stderr and "discards 2 dirty tiles at interpreter exit" in proc.stderr, \
            proc.stderr
        assert str(path) in proc.stderr
        assert proc.stderr.count("dirty tiles") == 1, proc.stderr  # not again when finalization destroys it


# ---------------------------------------------------------------- a read-only secondary tier (U12c)


def test_a_read_only_secondary_refuses_to_evict_or_flush_dirty_tiles_before_writing(tmp_path):
    sc = Scene(tmp_path, mutable=False, dirty=(1, 3), resident=(2,))
    on_file = sc.file()
    before = sc.snapshot()
    pwrites = core._io_calls("pwrite")
    for request, fragment in ((lambda: sc.c.evict(tiles(1, 2)), "cannot evict dirty tile (1,)"),
                              (lambda: sc.c.evict_async(ALL), "cannot evict dirty tiles (1,), (3,)"),
                              (sc.c.flush, "cannot flush dirty tiles (1,), (3,)"),
                              (sc.c.flush_async, "cannot flush dirty tiles")):
        with pytest.raises(RuntimeError, match=r"read-only \(created with mutable=False\)") as info:
            request()
        assert fragment in str(info.value) and sc.path in str(info.value), info.value
        assert sc.snapshot() == before  # still primary and dirty; stats, values, version as before
    assert core._io_calls("pwrite") == pwrites  # refused before writing anything
    assert np.array_equal(sc.file(), on_file)
    # Clean tiles still evict (no write needed), and a flush with nothing dirty has nothing to do.
    sc.c.evict(tiles(2))
    assert sc.c.tile_state((2,)).location == "secondary"
    assert sc.c.stats()["writes_skipped"] == 1
    assert core._io_calls("pwrite") == pwrites and np.array_equal(sc.file(), on_file)


def test_a_policy_eviction_of_a_dirty_tile_into_a_read_only_tier_fails_the_work(tmp_path):
    sc = Scene(tmp_path, mutable=False, policy=EvictAfter(3), dirty=(3,), resident=(0, 1))
    before = sc.snapshot()
    with pytest.raises(RuntimeError, match="read-only") as info:
        _project(sc)
    assert "residency policy" in str(info.value) and "tile (3,)" in str(info.value), info.value
    assert sc.snapshot() == before
