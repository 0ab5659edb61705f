"""Lifetimes: dropped handles with work in flight, collected tensors, interpreter exit (docs/reliability.md, "Lifetimes").

The guide promises that handles never cancel: "dropping a handle neither
blocks nor stops the work, and the handle itself can be garbage collected while
work runs". These tests drop every Python reference to a request (its handle,
its tensors, often its carrier) while the request is held in flight, collect
garbage, let the work finish, and then prove by counting that nothing crashed,
nothing was lost and every piece of storage was freed exactly once.

Counting, three independent ways (practices: "Lifetimes proven by counting"):

* ``BlockDevice`` arena bytes. The primary tier of every TiledEvictable here is
  an empty ``BlockDeviceCarrier`` of an 8 MiB arena, so every per-tile primary
  buffer, every staged promotion buffer and every compact projection result is
  an extent of the arena. ``arena.free_bytes == arena.capacity`` proves that all
  of them were returned; an extent returned twice would push ``free_bytes``
  above ``capacity`` (and is asserted never to happen at any point).
* ``LedgerCarrier``, a user-defined kind whose provider records every
  allocation and release (one record per carrier, like ``ListCarrier`` in
  test_carriers.py) and whose route ``LedgerCarrier -> LedgerCarrier`` stays
  pending until the test opens a gate.
* Anonymous ``FileBacked`` files, which are open exactly while their carrier
  lives (they never have a name in the directory: ``is_open`` finds them among
  the process's descriptors by the name the kernel gives them, their
  ``filename``).

Nothing sleeps to pace the engine: requests are held in flight with the
test-only I/O gate (``_io_hold(op)`` blocks every call of ``op`` until
``_io_unhold()``; ``_io_held_waiting(op)`` says a call is blocked) or with the
ledger route's gate. ``eventually`` polls a condition with a deadline only to
observe work whose handle the test has deliberately dropped.

Interpreter exit runs real subprocesses: each starts requests that are still
pending when the script ends, and must exit with status 0, with no fatal error
on stderr, within a timeout (the extension drains its pools for at most 10 s
per pool at exit: Note [Drain at exit]).

Run: ``.venv/bin/python -m pytest -q tests/test_lifetimes.py``.
"""

from __future__ import annotations

import errno
import gc
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

import strideweave as sw
from strideweave import DType, Tensor
from strideweave.carriers.extension import (
    CarrierDefinition,
    PreparedTransfer,
    TransferProvider,
    TransferRoute,
    register_carrier_definition,
)
from strideweave.carriers.tiled_evictable import ResidencyPlan, TiledEvictable, TileSelection, TileSet
from ledger import Ledger, record_of
from open_files import is_open
from waiting import eventually, held
from devices import block_device

F32 = DType.Float32
core = sw._core
TILE = 1024  # slots per tile: 4096 bytes, exactly one arena block
DEADLINE_S = 15.0


pytestmark = pytest.mark.usefixtures("clear_io_faults")


def try_release(c):
    try:
        c.release()
        return True
    except RuntimeError as e:
        assert "wait" in str(e), e  # only "incomplete work; wait for it" may refuse a release
        return False


# ---------------------------------------------------------------- the arena


class Arena:
    """An 8 MiB BlockDevice arena whose byte count must never exceed its capacity."""

    def __init__(self, path):
        self.device = block_device(path, 8 << 20)
        self.capacity = self.device.capacity

    @property
    def in_use(self):
        free = self.device.free_bytes
        assert free <= self.capacity, f"an extent was returned twice: free {free} > capacity {self.capacity}"
        return self.capacity - free

    def tier(self):
        return self.device.allocate(0)


@pytest.fixture
def arena(tmp_path):
    a = Arena(tmp_path / "device.img")
    yield a
    gc.collect()
    eventually(lambda: a.in_use == 0, "every arena extent returned when the test ends")


def tiled(arena, tiles=4, values=None, policy=None):
    """A TiledEvictable over (tiles,) tiles of TILE slots: arena primary, anonymous FileBacked secondary."""
    n = tiles * TILE
    values = [float(i % 251) for i in range(n)] if values is None else values
    staged = sw.friendly.tensor(values)
    secondary = sw.move(staged, sw.FileBacked()).carrier
    c = TiledEvictable(arena.tier(), secondary, (tiles,), (TILE,), residency_policy=policy)
    return c, Tensor(c, 0, sw.column_major(n)), values


# ---------------------------------------------------------------- LedgerCarrier


LEDGER = Ledger()  # every LedgerCarrier ever constructed (its Record), in order, and the breaches its provider saw
VIOLATIONS = LEDGER.violations
GATE = threading.Event()  # the LedgerCarrier route's transfers finish only while this is set
SUBMITTED = []
_record = record_of


class LedgerCarrier(sw.Carrier):
    """A user-defined carrier kind whose provider counts every allocation and release."""


class _GatedCopy:
    """The completion object of one route transfer: copies, then finishes once GATE is set."""

    def __init__(self, request):
        self.request = request
        SUBMITTED.append(self)

    @property
    def done(self):
        return GATE.is_set()

    def wait(self):
        if not GATE.wait(DEADLINE_S * 2):
            raise RuntimeError("the test never opened the gate")
        src, dst = self.request.tensor, self.request.destination
        layout = self.request.layout
        for i in range(layout.size):
            off = layout(i)
            _record(dst).values[off] = _record(src.carrier).values[src.offset + off]


def _prepare(request):
    return PreparedTransfer(lambda: _GatedCopy(request))


register_carrier_definition(
    LedgerCarrier,
    CarrierDefinition(
        LEDGER.storage(lambda c, d: d is F32, elementwise_fallback=True),
        transfers=(TransferRoute(LedgerCarrier, LedgerCarrier, "gated", TransferProvider(_prepare)),),
    ),
)


@pytest.fixture
def ledger():
    start = len(LEDGER)
    GATE.clear()
    yield lambda: LEDGER[start:]
    GATE.set()  # never leave a move thread blocked behind a failed test
    assert VIOLATIONS == []
    assert all(r.releases <= 1 for r in LEDGER[start:])


def ledger_tensor(values):
    c = LedgerCarrier(len(values), dtype=F32)
    for i, v in enumerate(values):
        c[i] = v
    return Tensor(c, 0, sw.column_major(len(values)))


# ================================================================ dropped handles with work in flight


def test_dropped_projection_handle_and_tensors_work_completes(arena):
    c, full, values = tiled(arena)
    core._io_hold("pread")
    h = c.project(full, TileSelection([[3, 1]]))
    held("pread", 2)  # both tile transfers staged (the I/O pool has at least 4 threads)
    assert not h.done
    in_flight = arena.in_use  # two staged tiles and the two-tile compact destination
    assert in_flight == 4 * 4096
    del h, full
    gc.collect()
    assert not try_release(c)  # the dropped projection still runs
    core._io_unhold()
    eventually(lambda: try_release(c), "release after the dropped projection finished")
    assert c.is_released()
    eventually(lambda: arena.in_use == 0, "the projection's staged tiles and result returned")


def test_dropped_projection_handle_tensor_and_carrier(arena):
    """Nothing but the engine holds the carrier: it lives until the work ends, then everything is freed once."""
    c, full, _ = tiled(arena)
    path = c.secondary.filename
    c.promote(TileSet([(0,)]))
    full[5] = -1.0  # a dirty resident tile
    assert arena.in_use == 4096
    core._io_hold("pread")
    h = c.project(full, TileSelection([[0, 2]]))
    held("pread")
    del h, full, c
    gc.collect()
    assert is_open(path)  # the carrier (and its secondary file) is still alive
    core._io_unhold()
    eventually(lambda: arena.in_use == 0, "every tile buffer and the compact result returned")
    eventually(lambda: not is_open(path), "the anonymous secondary file closed")


def test_dropped_residency_handles_promotion_and_dirty_eviction_complete(arena):
    c, full, values = tiled(arena)
    core._io_hold("pread")
    h = c.promote_async(TileSet([(1,), (2,)]))
    held("pread")
    del h
    gc.collect()
    core._io_unhold()
    eventually(lambda: c.tile_state((1,)).location == "primary" and c.tile_state((2,)).location == "primary",
               "the dropped promotion committed")
    assert arena.in_use == 2 * 4096
    full[TILE + 7] = 1234.0  # dirty tile 1
    values[TILE + 7] = 1234.0
    core._io_hold("pwrite")
    h = c.evict_async(TileSet([(1,), (2,)]))
    held("pwrite")
    del h
    gc.collect()
    core._io_unhold()
    eventually(lambda: not c.primary_tiles, "the dropped eviction committed")
    eventually(lambda: arena.in_use == 0, "evicted tile buffers returned")
    assert c.secondary[TILE + 7] == 1234.0  # the dirty value reached the secondary tier
    assert [c[i] for i in range(0, 4 * TILE, 97)] == values[0 : 4 * TILE : 97]
    c.release()


def test_dropped_handle_of_a_failing_request_frees_its_staging(arena):
    """The second transfer of a held promotion fails with EIO; nobody waits. Nothing is committed or leaked."""
    c, full, values = tiled(arena)
    core._io_hold("pread")
    core._io_inject("pread", errno.EIO, count=1, after=1)
    h = c.promote_async(TileSet([(0,), (1,), (3,)]))
    held("pread")
    del h
    gc.collect()
    core._io_unhold()
    eventually(lambda: not _incomplete(c), "the failed request ended")
    assert not c.primary_tiles and arena.in_use == 0  # all-or-nothing: no staged tile survives
    core._io_clear()
    c.promote(TileSet([(0,), (1,), (3,)]))  # the carrier is usable again
    assert [c[i] for i in range(0, 4 * TILE, 89)] == values[0 : 4 * TILE : 89]
    c.release()


def _incomplete(c):
    """True while a residency request or tiled work is in flight (probed through a conflicting request)."""
    try:
        c.evict(TileSet([(t,) for t in range(c.grid_shape[0])]))
    except RuntimeError as e:
        assert "wait" in str(e), e
        return True
    return False


def test_dropped_scatter_handle_with_held_template_reads(arena):
    c, full, values = tiled(arena)
    compact = Tensor(arena.device.allocate(2 * TILE), 0, sw.column_major(2 * TILE))  # the compute tier's class
    for i in range(0, 2 * TILE, 50):
        compact[i] = 1.0
    core._io_hold("pread")
    h = c.scatter(compact, full, TileSelection([[2, 0]]), reduction="add")
    held("pread")
    del h, compact, full
    gc.collect()
    core._io_unhold()
    eventually(lambda: try_release(c), "release after the dropped scatter")
    eventually(lambda: arena.in_use == 0, "the scatter's buffers and its unobserved result freed")


def test_dropped_move_handle_and_source_tensor(arena):
    """A move of an arena extent into a FileBacked carrier: the source is consumed exactly once."""
    n = 3000
    src = arena.device.allocate(n)
    for i in range(0, n, 7):
        src[i] = float(i)
    t = Tensor(src, 0, sw.column_major(n))
    dest = sw.FileBacked()
    core._io_hold("pwrite")
    h = sw.move_async(t, dest)
    held("pwrite")
    assert dest.is_owned() and src.is_owned()
    del h, t, src
    gc.collect()
    core._io_unhold()
    eventually(lambda: not dest.is_owned(), "the dropped move finished")
    assert dest.size() == n and dest[7 * 100] == 700.0
    eventually(lambda: arena.in_use == 0, "the consumed source's extent returned once")


def test_dropped_move_handle_of_a_user_kind_releases_the_source_once(ledger):
    t = ledger_tensor([1.0, 2.0, 3.0, 4.0])
    dest = LedgerCarrier(0, dtype=F32)
    h = sw.move_async(t, dest)
    assert not h.done
    src_record = _record(t.carrier)
    del h, t
    gc.collect()
    assert src_record.releases == 0  # the pending move keeps its source alive and unreleased
    GATE.set()
    eventually(lambda: src_record.releases == 1, "the move consumed its source")
    assert _record(dest).values == [1.0, 2.0, 3.0, 4.0] and not dest.is_owned()
    records = ledger()
    assert [r.releases for r in records] == [1, 0]  # source released once; the destination lives on
    dest.release()
    assert [r.releases for r in records] == [1, 1]


def test_collected_tensors_whose_carrier_is_pending(ledger):
    """Many views of one source are collected while its move is pending; storage is released once."""
    src = LedgerCarrier(6, dtype=F32)
    for i in range(6):
        src[i] = float(i)
    views = [Tensor(src, k, sw.column_major(6 - k)) for k in range(6)]
    h = sw.move_async(views[0], LedgerCarrier(0, dtype=F32))
    record = _record(src)
    del views, src
    gc.collect()
    assert record.releases == 0
    GATE.set()
    result = h.wait()
    assert [result[i] for i in range(6)] == [float(i) for i in range(6)]
    assert record.releases == 1
    del h, result
    gc.collect()
    assert all(r.releases <= 1 for r in ledger())


def test_moves_between_user_kinds_count_allocations_and_releases(ledger):
    """Eight moves in flight at once (more than the move pool's threads), every handle dropped."""
    dests = []
    for k in range(8):
        t = ledger_tensor([float(k)] * 3)
        d = LedgerCarrier(0, dtype=F32)
        sw.move_async(t, d)  # the handle is dropped at once
        dests.append(d)
    gc.collect()
    assert all(d.is_owned() for d in dests)  # every move is in flight (submitted or queued behind the pool)
    GATE.set()
    eventually(lambda: all(not d.is_owned() for d in dests), "every move finished")
    records = ledger()
    sources = records[0::2]
    assert [r.releases for r in sources] == [1] * 8
    assert [_record(d).values for d in dests] == [[float(k)] * 3 for k in range(8)]
    for d in dests:
        d.release()
    assert [r.releases for r in records] == [1] * 16
    assert all(r.allocations >= 1 for r in records)


def test_policy_objects_are_dropped_with_their_carrier(arena):
    """A residency policy held only by a carrier with work in flight is kept alive, then collected."""
    collected = threading.Event()

    class Policy:
        def plan(self, required, purpose):
            return ResidencyPlan()

        def __del__(self):
            collected.set()

    c, full, _ = tiled(arena, policy=Policy())
    core._io_hold("pread")
    h = c.project(full, TileSelection([[1]]))
    held("pread")
    del c, full, h
    gc.collect()
    assert not collected.is_set()
    core._io_unhold()
    eventually(lambda: arena.in_use == 0, "all buffers returned")

    def gone():
        gc.collect()
        return collected.is_set()

    eventually(gone, "the policy object was collected")


def test_tiled_storage_counts_match_stats_through_a_lifetime(arena):
    """The arena's byte count follows stats()["primary_bytes"] through promote, project, evict and release.

    (The arena primary executes no operations, so direct operations are counted in test_stress.py.)
    """
    c, full, values = tiled(arena, tiles=6)
    assert arena.in_use == 0 and c.stats()["primary_bytes"] == 0
    c.promote(TileSet([(0,), (4,)]))
    assert arena.in_use == c.stats()["primary_bytes"] == 2 * 4096
    compact = c.project(full, TileSelection([[4, 5]])).wait()  # tile 5 is promoted as part of the projection
    assert c.stats()["primary_bytes"] == 3 * 4096
    assert arena.in_use == 3 * 4096 + 2 * 4096  # plus the compact result
    del compact
    gc.collect()
    assert arena.in_use == 3 * 4096
    c.evict(TileSet([(0,), (4,), (5,)]))
    assert arena.in_use == c.stats()["primary_bytes"] == 0
    c.promote(TileSet([(t,) for t in range(6)]))
    full[3 * TILE] = -3.0  # one dirty tile: release discards it with the rest
    assert arena.in_use == c.stats()["primary_bytes"] == 6 * 4096
    c.release()
    assert arena.in_use == 0 and c.stats()["primary_bytes"] == 0


# ================================================================ interpreter exit with pending requests

EXIT_PRELUDE = textwrap.dedent(
    """
    import atexit, sys, threading, time
    import strideweave as sw
    from strideweave import Tensor
    from strideweave.carriers.tiled_evictable import ResidencyPlan, TiledEvictable, TileSelection, TileSet
    core = sw._core

    def held(op, n=1):
        end = time.monotonic() + 10
        while core._io_held_waiting(op) < n:
            assert time.monotonic() < end, "never held"
            time.sleep(0.001)

    class Policy:
        def plan(self, required, purpose):
            return ResidencyPlan()

    def tiled(secondary=None, policy=None):
        staged = sw.friendly.tensor([float(i % 13) for i in range(4 * 256)])
        sec = sw.move(staged, secondary if secondary is not None else sw.FileBacked()).carrier
        c = TiledEvictable(sw.CPU(0), sec, (4,), (256,), residency_policy=policy)
        return c, Tensor(c, 0, sw.column_major(4 * 256))
    """
)

EXIT_SCENARIOS = {
    # held forever: the exit drain gives up after its bound and the process still exits cleanly
    "projection held forever": """
        c, full = tiled(policy=Policy())
        core._io_hold("pread")
        h = c.project(full, TileSelection([[1, 3]]))
        held("pread")
    """,
    # the held I/O is released while the interpreter is exiting (an atexit handler registered after
    # strideweave's runs first): the drain waits for the work, which touches the Python policy
    "projection finishing during exit": """
        c, full = tiled(policy=Policy())
        core._io_hold("pread")
        h = c.project(full, TileSelection([[0, 2]]))
        held("pread")
        atexit.register(lambda: threading.Timer(0.2, core._io_unhold).start())
    """,
    "dropped handles and tensors, residency requests in flight": """
        c, full = tiled()
        c.promote(TileSet([(0,)]))
        full[3] = 99.0
        core._io_hold("pwrite")
        c.evict_async(TileSet([(0,)]))
        core._io_hold("pread")
        c.promote_async(TileSet([(2,), (3,)]))
        held("pwrite"); held("pread")
        del c, full
        import gc; gc.collect()
        atexit.register(lambda: threading.Timer(0.2, core._io_unhold).start())
    """,
    "a user-kind transfer nobody completes": """
        sys.path.insert(0, TESTS)
        import pending_carrier as pc
        t = pc.pending_tensor([1.0, 2.0, 3.0])
        h = sw.move_async(t, pc.destination())
        assert not h.done
    """,
    "move to a file held forever, handle dropped": """
        t = sw.friendly.tensor([1.0] * 1000)
        core._io_hold("pwrite")
        sw.move_async(t, sw.FileBacked())
        held("pwrite")
        del t
    """,
    # Regression: a daemon thread blocked in wait() took the GIL back after finalization began, CPython
    # ended it with pthread_exit, and the unwinding aborted the process (rc 134, "terminate called").
    "a daemon thread waiting on a handle that never completes": """
        c, full = tiled()
        core._io_hold("pread")
        h = c.project(full, TileSelection([[1]]))
        held("pread")
        threading.Thread(target=h.wait, daemon=True).start()
        m = sw.move_async(sw.friendly.tensor([1.0, 2.0]), sw.FileBacked())
        threading.Thread(target=lambda: [m.wait(), h.wait()], daemon=True).start()
    """,
    "daemon threads waiting on handles that complete during exit": """
        c, full = tiled(policy=Policy())
        core._io_hold("pread")
        hs = [c.project(full, TileSelection([[k]])) for k in range(4)]
        held("pread")
        for h in hs:
            threading.Thread(target=h.wait, daemon=True).start()
        atexit.register(lambda: threading.Timer(0.1, core._io_unhold).start())
    """,
    "gradient backward after a pending promotion": """
        c, full = tiled(policy=Policy())
        y = sw.relu(full)
        loss = sw.reduce_sum(y, "a -> ")
        c.evict(TileSet([(0,), (1,), (2,), (3,)]))
        core._io_hold("pread")
        c.promote_async(TileSet([(0,)]))
        held("pread")
        t = threading.Thread(target=lambda: None)
        t.start(); t.join()
        atexit.register(lambda: threading.Timer(0.1, core._io_unhold).start())
    """,
}

FATAL = ("Fatal Python error", "terminate called", "Segmentation fault", "Aborted", "core dumped",
         "AddressSanitizer", "double free", "std::terminate")


def _run_exit_scenario(name, tmp_path):
    script = tmp_path / f"exit_{abs(hash(name))}.py"
    script.write_text(EXIT_PRELUDE + f"TESTS = {os.path.dirname(os.path.abspath(__file__))!r}\n"
                      + textwrap.dedent(EXIT_SCENARIOS[name]) + "\nprint('script ended', flush=True)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONFAULTHANDLER="1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    return proc, time.monotonic() - start


def test_interpreter_exit_with_pending_requests(tmp_path):
    """Every scenario's process exits with status 0, prints no fatal error and removes its anonymous files."""
    dirs = {name: tmp_path / f"s{i}" for i, name in enumerate(EXIT_SCENARIOS)}
    for d in dirs.values():
        d.mkdir()
    with ThreadPoolExecutor(len(EXIT_SCENARIOS)) as pool:  # run concurrently: several wait out the drain bound
        results = dict(zip(EXIT_SCENARIOS, pool.map(lambda n: _run_exit_scenario(n, dirs[n]), EXIT_SCENARIOS)))
    failures = []
    for name, (proc, elapsed) in results.items():
        print(f"{name}: rc={proc.returncode} in {elapsed:.1f} s")
        if proc.returncode != 0 or "script ended" not in proc.stdout or any(f in proc.stderr for f in FATAL):
            failures.append(f"{name}: rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}")
        elif elapsed > 60:
            failures.append(f"{name}: exit took {elapsed:.1f} s")
    assert not failures, "\n\n".join(failures)
    # Work that finished during exit released the storage nobody referenced: no anonymous file is left.
    # (Scenarios that keep carriers in module globals are not checked: those may live until the process ends.)
    for name in ("dropped handles and tensors, residency requests in flight",):
        leftovers = [p for p in os.listdir(dirs[name]) if p.startswith("strideweave-")]
        assert leftovers == [], (name, leftovers)


def test_exit_finishes_an_eviction_of_the_only_copy(tmp_path):
    """A dirty tile evicted asynchronously just before exit reaches the named secondary file."""
    path = tmp_path / "weights.bin"
    script = tmp_path / "evict_at_exit.py"
    script.write_text(EXIT_PRELUDE + textwrap.dedent(f"""
        c, full = tiled(secondary=sw.FileBacked({str(path)!r}))
        c.promote(TileSet([(1,), (2,)]))
        full[256 + 5] = 4242.0
        full[512 + 9] = -7.5
        core._io_hold("pwrite")
        c.evict_async(TileSet([(1,), (2,)]))   # handle dropped at once
        held("pwrite")
        atexit.register(lambda: threading.Timer(0.2, core._io_unhold).start())
        print('script ended', flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0 and "script ended" in proc.stdout, proc.stderr[-3000:]
    assert not any(f in proc.stderr for f in FATAL), proc.stderr[-3000:]
    data = path.read_bytes()
    assert len(data) == 4 * 256 * 4
    value = lambda slot: struct.unpack_from("<f", data, 4 * slot)[0]  # noqa: E731
    assert value(256 + 5) == 4242.0 and value(512 + 9) == -7.5  # nothing lost
    assert value(7) == float(7 % 13)


POLICY_CYCLE = textwrap.dedent(
    """
    import gc, os, sys, tempfile, weakref
    import numpy as np
    import strideweave as sw
    from strideweave import Tensor
    from strideweave.carriers.tiled_evictable import ResidencyPlan, TiledEvictable

    class Policy:
        carrier = None
        def plan(self, required, purpose):
            return ResidencyPlan()

    def open_files():
        fds = "/proc/self/fd"
        return {os.path.realpath(os.path.join(fds, f)) for f in os.listdir(fds)}

    path = os.path.realpath(os.path.join(tempfile.mkdtemp(), "tier.f32"))
    np.ones(8, np.float32).tofile(path)
    policy = Policy()
    # The secondary tier is the file opened in place (no move, whose finishing thread could still hold a
    # result for a moment): it is open exactly while the carrier lives.
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(path, mutable=False), (2,), (4,), residency_policy=policy)
    assert path in open_files()
    policy.carrier = c          # the policy refers back to its carrier: a cycle through C++
    ref = weakref.ref(policy)
    del c, policy
    gc.collect()
    print("leaked" if ref() is not None or path in open_files() else "freed", flush=True)
    """
)


def test_policy_reference_cycle_is_collected(tmp_path):
    """Regression (docs/reliability.md, "Bugs these tests found"): the carrier -> policy edge through C++ is reported to the garbage collector
    (Note [Policy reference cycles] in python/bindings/tiled.cpp), so the cycle and its file are freed."""
    script = tmp_path / "cycle.py"
    script.write_text(POLICY_CYCLE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "freed"


class CyclePolicy:
    """A policy that refers back to its carrier (set after construction) and counts its plans."""

    def __init__(self):
        self.carrier = None
        self.calls = 0

    def plan(self, required, purpose):
        self.calls += 1
        return ResidencyPlan()


def blocking_policy(result):
    """A CyclePolicy class whose plan() signals `entered`, blocks until `go` is set (failing after DEADLINE_S)
    and then returns result(required). Returns (the class, entered, go)."""
    entered, go = threading.Event(), threading.Event()

    class BlockingPolicy(CyclePolicy):
        def plan(self, required, purpose):
            self.calls += 1
            entered.set()
            if not go.wait(DEADLINE_S):
                raise RuntimeError("the test never released the plan")
            return result(required)

    return BlockingPolicy, entered, go


def collected(ref, path=None):
    """Collects garbage; true once `ref` is dead (and `path`, an anonymous file's filename, closed)."""
    gc.collect()
    return ref() is None and (path is None or not is_open(path))


def policy_cycle_is_collected(arena, link, edge, what):
    """A carrier with two resident tiles whose policy refers back to it (`link(policy, carrier, full)`); the edge
    through C++ (`edge(policy, carrier, full)`: (object, referent)) is reported; dropped, the cycle is collected:
    its resident tiles return to the arena and its file is removed."""
    policy = CyclePolicy()
    c, full, values = tiled(arena, policy=policy)
    link(policy, c, full)
    c.promote(TileSet([(1,), (3,)]))
    assert [c[i] for i in range(TILE, 2 * TILE, 61)] == values[TILE : 2 * TILE : 61]
    assert arena.in_use == 2 * 4096
    path, ref = c.secondary.filename, weakref.ref(policy)
    owner, referent = edge(policy, c, full)
    assert referent in gc.get_referents(owner)  # the edge through C++ is reported
    del c, full, policy, owner, referent
    eventually(lambda: collected(ref, path), what)
    assert arena.in_use == 0


def test_policy_cycle_frees_tiles_and_file(arena):
    """In process, counted: the cycle's resident tiles return to the arena and its file is removed."""
    policy_cycle_is_collected(arena, lambda policy, c, full: setattr(policy, "carrier", c),
                              lambda policy, c, full: (c, policy), "the cycle collected")


def test_policy_shared_through_allocate_like_keeps_the_cycle_until_the_sharers_are_gone(tmp_path):
    """allocate_like hands the carrier's policy to the carrier it makes. While that one lives it keeps
    the policy, which keeps the first carrier: nothing may be collected, and the policy stays intact."""
    policy = CyclePolicy()
    staged = sw.friendly.tensor([float(i) for i in range(8)])
    c = TiledEvictable(sw.CPU(0), sw.move(staged, sw.FileBacked()).carrier, (2,), (4,), residency_policy=policy)
    policy.carrier = c
    path, ref = c.secondary.filename, weakref.ref(policy)
    g = c.allocate_like(c.size())  # implicit-zero tiles, the same policy
    assert g.residency_policy is policy
    assert policy not in gc.get_referents(c) and policy not in gc.get_referents(g)  # shared: not reported
    del c, policy, staged
    for _ in range(3):
        gc.collect()
    assert ref() is not None and is_open(path)
    full = Tensor(g, 0, sw.column_major(8))
    compact = g.project(full, TileSelection([[1]])).wait()  # the policy is asked, and is whole
    assert [compact[i] for i in range(4)] == [0.0] * 4
    assert ref().calls == 1 and ref().carrier.size() == 8 and ref().carrier[5] == 5.0
    del full, compact, g
    eventually(lambda: collected(ref, path), "the cycle collected once the sharer is gone")


def test_policy_cycle_through_a_carrier_made_in_cpp():
    """A carrier made by allocate_like, held only by its Python wrapper, owns its policy once the
    carrier it came from is gone: its cycle is collected. A C++ owner (a tensor) holds the edge back."""
    policy = CyclePolicy()
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), (2,), (4,), residency_policy=policy)
    g = c.allocate_like(c.size())
    assert policy not in gc.get_referents(g)  # c shares the policy
    del c
    assert policy in gc.get_referents(g)
    policy.carrier = g
    full = Tensor(g, 0, sw.column_major(8))  # a C++ owner of g's carrier: the wrapper is no longer its owner
    assert policy not in gc.get_referents(g)
    del full
    assert policy in gc.get_referents(g)
    ref = weakref.ref(policy)
    del g, policy
    eventually(lambda: collected(ref), "the cycle collected")


def test_policy_holding_a_tensor_of_its_carrier_is_collected(arena):
    """Regression (docs/reliability.md, "Lifetimes"): a policy that holds a Tensor of its own carrier makes the
    cycle carrier -> policy -> tensor -> carrier, whose last edge passes through C++; the tensor reports it
    (Note [Tensor reference cycles] in python/bindings/tensor.cpp), so the cycle, its tiles and its file are freed."""
    # full is Tensor(c, 0, ...): the policy refers back to its carrier through a tensor.
    policy_cycle_is_collected(arena, lambda policy, c, full: setattr(policy, "full", full),
                              lambda policy, c, full: (full, c), "the cycle through a tensor collected")


def test_policy_holding_a_view_of_its_carrier_is_collected():
    """The same with tensors made in C++ (a view's wrapper owns its TensorImpl) and with a carrier made in C++
    (allocate_like: the tensor is then the carrier's only owner and reports the carrier's policy)."""
    policy = CyclePolicy()
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), (2,), (4,), residency_policy=policy)
    path = c.secondary.filename
    with sw.no_grad():  # (with grad the view's autograd node would hold the first tensor: two owners of c)
        policy.view = Tensor(c, 0, sw.column_major(8)).narrow(0, 0, 8)  # made in C++, of c (its only view: itself)
    ref = weakref.ref(policy)
    assert c in gc.get_referents(policy.view)
    del c, policy
    eventually(lambda: collected(ref, path), "the cycle through a view collected")

    policy = CyclePolicy()
    first = TiledEvictable(sw.CPU(0), sw.FileBacked(), (2,), (4,), residency_policy=policy)
    g = first.allocate_like(first.size())
    del first  # g alone holds the policy now
    policy.full = Tensor(g, 0, sw.column_major(8))
    assert policy not in gc.get_referents(policy.full)  # g's wrapper shares g's carrier: not reported
    path, ref = g.secondary.filename, weakref.ref(policy)
    del g  # the tensor is the carrier's only owner
    assert policy in gc.get_referents(ref().full)
    del policy
    eventually(lambda: collected(ref, path), "the cycle through a carrier made in C++ collected")


def test_tensor_cycle_is_kept_while_the_carrier_is_used_elsewhere():
    """Never a wrong collection: while another tensor of the carrier lives outside the cycle, the carrier is
    reachable and nothing is collected or cleared (the policy keeps planning); once it goes, the cycle is."""
    policy = CyclePolicy()
    staged = sw.friendly.tensor([float(i) for i in range(8)])
    c = TiledEvictable(sw.CPU(0), sw.move(staged, sw.FileBacked()).carrier, (2,), (4,), residency_policy=policy)
    policy.full = Tensor(c, 0, sw.column_major(8))
    outside = Tensor(c, 0, sw.column_major(8))
    assert c not in gc.get_referents(policy.full) and c not in gc.get_referents(outside)  # shared: not reported
    path, ref = c.secondary.filename, weakref.ref(policy)
    del c, policy, staged
    for _ in range(3):
        gc.collect()
    assert ref() is not None and is_open(path)
    compact = outside.carrier.project(outside, TileSelection([[1]])).wait()  # the policy is asked, and is whole
    assert [compact[i] for i in range(4)] == [4.0, 5.0, 6.0, 7.0]
    assert ref().calls == 1 and ref().full.carrier[5] == 5.0
    del outside, compact
    eventually(lambda: collected(ref, path), "the cycle collected once the other tensor is gone")


def test_policy_plans_run_while_garbage_is_collected(arena):
    """Deterministic (events, no sleeps). Carrier B's policy blocks inside plan() on a second thread while
    the main thread collects garbage repeatedly: carrier A's dropped cycle is collected (its policy
    cleared and its tiles and file freed) during B's plan, B's own cycle is kept alive by the running
    request, and its plan also collects garbage itself. Nothing crashes; every result is right."""
    def collect_then_promote(required):
        gc.collect()  # a collection inside the plan of a carrier whose cycle is otherwise garbage
        return ResidencyPlan(promote=required)

    BlockingPolicy, entered, go = blocking_policy(collect_then_promote)

    pa = CyclePolicy()
    a, _, _ = tiled(arena, policy=pa)
    pa.carrier = a
    a.promote(TileSet([(0,)]))
    a_path, a_ref = a.secondary.filename, weakref.ref(pa)
    pb = BlockingPolicy()
    b, b_full, b_values = tiled(arena, policy=pb)
    pb.carrier = b
    b_path, b_ref = b.secondary.filename, weakref.ref(pb)
    box, out = [b, b_full], {}

    def project():
        carrier, full = box
        box.clear()
        compact = carrier.project(full, TileSelection([[2]])).wait()
        out["values"] = [compact[i] for i in range(TILE)]

    worker = threading.Thread(target=project)
    worker.start()
    assert entered.wait(DEADLINE_S)
    del a, pa, b, b_full, pb  # only the running request still reaches B
    for _ in range(3):
        gc.collect()
    assert a_ref() is None  # A's cycle went while B's plan was running; its file goes with its secondary tier
    eventually(lambda: not is_open(a_path), "A's file closed")
    assert b_ref() is not None and is_open(b_path)
    go.set()
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    assert out["values"] == b_values[2 * TILE : 3 * TILE]
    eventually(lambda: collected(b_ref, b_path), "B's cycle collected once its request ended")
    assert arena.in_use == 0


def test_failed_handle_cycle_is_collected(arena):
    """A handle caches the exception its wait() raised; the exception's traceback holds the frame that
    holds the handle. That cycle passes through C++ (Note [Handle reference cycles] in completion.cpp)
    and is collected with everything the frame held."""

    class Marker:
        pass

    c, _, _ = tiled(arena)

    def fail():
        marker = Marker()
        core._io_inject("pread", errno.EIO)
        h = c.promote_async(TileSet([(1,)]))
        try:
            h.wait()
        except RuntimeError as e:
            assert "EIO" in str(e) or "Input/output" in str(e), e
        assert h.done
        return weakref.ref(marker)

    ref = fail()
    core._io_clear()
    eventually(lambda: collected(ref), "the handle, its exception and the frame collected")
    c.release()


def test_cleared_policy_mid_plan_behaves_like_no_policy(arena):
    """What the collector does to a carrier of a cycle (tp_clear: drop the policy) may meet a plan in
    flight. Deterministic: the plan blocks on a second thread while the main thread clears the carrier.
    The running plan finishes with its own reference (its plan applies), later requests plan like a
    carrier without a policy, and nothing crashes."""
    BlockingPolicy, entered, go = blocking_policy(lambda required: ResidencyPlan(promote=TileSet([(0,)])))

    policy = BlockingPolicy()
    c, full, values = tiled(arena, policy=policy)
    policy.carrier = c
    out = {}

    def project():
        compact = c.project(full, TileSelection([[2]])).wait()
        out["values"] = [compact[i] for i in range(TILE)]

    worker = threading.Thread(target=project)
    worker.start()
    assert entered.wait(DEADLINE_S)
    core._gc_clear(c)
    assert c.residency_policy is None
    assert policy not in gc.get_referents(c)
    go.set()
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    assert out["values"] == values[2 * TILE : 3 * TILE]
    assert c.tile_state((0,)).location == "primary"  # the in-flight plan's promotion ran
    compact = c.project(full, TileSelection([[3]])).wait()  # no policy now: not asked
    assert [compact[i] for i in range(0, TILE, 37)] == values[3 * TILE : 4 * TILE : 37]
    assert policy.calls == 1 and policy.carrier is c
    del compact
    c.release()


def test_clear_leaves_a_shared_policy_alone():
    """A policy shared through allocate_like is not the carrier's to drop: tp_clear keeps it."""
    policy = CyclePolicy()
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), (2,), (4,), residency_policy=policy)
    g = c.allocate_like(c.size())
    core._gc_clear(c)
    core._gc_clear(g)
    assert c.residency_policy is policy and g.residency_policy is policy
    g.project(Tensor(g, 0, sw.column_major(8)), TileSelection([[0]])).wait()
    assert policy.calls == 1
    with pytest.raises(TypeError, match="TiledEvictable or an AwaitResult"):
        core._gc_clear(policy)


def test_cleared_handle_waits_again(arena):
    """wait() raises the same exception every time; a handle whose caches the collector dropped
    recomputes its outcome from the completion."""
    c, full, values = tiled(arena)
    core._io_inject("pread", errno.EIO)
    h = c.promote_async(TileSet([(1,)]))
    errors = []
    for _ in range(2):
        with pytest.raises(RuntimeError, match="EIO|Input/output") as info:
            h.wait()
        errors.append(info.value)
    assert errors[0] is errors[1]
    core._gc_clear(h)
    with pytest.raises(RuntimeError, match="EIO|Input/output") as info:
        h.wait()
    assert info.value is not errors[0] and str(info.value) == str(errors[0])
    core._io_clear()
    p = c.project(full, TileSelection([[1]]))
    first = p.wait()
    assert p.wait() is first
    core._gc_clear(p)
    again = p.wait()  # the completion's tensor, so the same object while it lives
    assert again is first and [again[i] for i in range(0, TILE, 41)] == values[TILE : 2 * TILE : 41]
    assert p.wait() is again
    del first, again, p
    c.release()
