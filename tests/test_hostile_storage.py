"""File-backed storage under hostile but realistic use, through the public API.

* A secondary file truncated while in use: promotion, projection, slot reads
  and moves fail with RuntimeError naming the file, the offset and the bytes
  expected and got, and change nothing; a dirty eviction refuses rather than
  re-extend the file with a hole (Note [A short read is an error] in
  cpp/src/io.cpp).
* A named file removed, renamed or replaced (``os.replace``) while in use:
  writes into it (an eviction, a slot write, a move) fail with RuntimeError
  naming the path; nothing is marked clean, tiles stay dirty and resident
  (Note [Files changed under a carrier] in cpp/src/carriers/storage.cpp).
* Anonymous files never have a name in the temporary directory, so a process
  that ends by SIGKILL, ``os._exit``, abort or with an uncollected cycle leaves
  nothing behind (Note [Anonymous files leave no name]).
* Paths with an embedded NUL are a ValueError; ``FileBacked(path,
  mutable=False)`` never creates a missing file; an allocation that cannot be
  had is a MemoryError saying what and how much.

Error tests check the exception type, a message fragment and that nothing
changed (values, dirty marks, residency, stats, version, the file itself).

Run: ``.venv/bin/python -m pytest -q tests/test_hostile_storage.py``.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import strideweave as sw
from strideweave import Tensor
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection, TileSet
from open_files import open_files

core = sw._core
TILES, TILE = 4, 256  # 1 KiB tiles
N = TILES * TILE
ALL = TileSet([(t,) for t in range(TILES)])


pytestmark = pytest.mark.usefixtures("clear_io_faults")


class Scene:
    """A TiledEvictable whose secondary tier is a named file holding 0.5, 1.5, ... (every tile secondary)."""

    def __init__(self, tmp_path):
        self.path = str(tmp_path / "weights.f32")
        self.values = np.arange(N, dtype=np.float32) + 0.5
        self.values.tofile(self.path)
        self.c = TiledEvictable(sw.CPU(0), sw.FileBacked(self.path), (TILES,), (TILE,))
        self.full = Tensor(self.c, 0, sw.column_major(N))

    def snapshot(self):
        """Tile states, residency counters and version: every fact a failed request must leave as it was."""
        c = self.c
        return {"states": [c.tile_state((t,)) for t in range(TILES)], "stats": c.stats(), "version": c.version,
                "dirty": c.dirty_tiles, "primary": c.primary_tiles, "owned": c.is_owned()}

    def resident_values(self):
        return [self.c[s] for s in range(N) if self.c.tile_state((s // TILE,)).location == "primary"]


# ================================================================ U2: a truncated secondary file


def test_promotion_of_a_truncated_secondary_fails_and_changes_nothing(tmp_path):
    sc = Scene(tmp_path)
    os.truncate(sc.path, (2 * TILE + TILE // 2) * 4)  # half of tile 2 and all of tile 3 are gone
    before = sc.snapshot()
    with pytest.raises(RuntimeError, match=r"weights\.f32 at offset \d+ expected 1024 bytes but got (512|0)"):
        sc.c.promote(TileSet([(1,), (2,), (3,)]))
    assert sc.snapshot() == before  # no zeros published, nothing marked clean
    with pytest.raises(RuntimeError, match="truncated"):
        sc.c.promote_async(TileSet([(3,)])).wait()
    assert sc.snapshot() == before
    with pytest.raises(RuntimeError, match="expected 4 bytes but got 0"):
        sc.c.secondary[3 * TILE]  # the tier's own slot read
    sc.c.promote(TileSet([(0,), (1,)]))  # what the file still holds reads as before
    assert sc.c[TILE + 7] == sc.values[TILE + 7]


def test_projection_of_a_truncated_secondary_fails_and_changes_nothing(tmp_path):
    sc = Scene(tmp_path)
    sc.c.promote(TileSet([(0,)]))
    sc.c[3] = -1.0  # a dirty resident tile, kept as it is
    os.truncate(sc.path, 2 * TILE * 4)
    before, resident = sc.snapshot(), sc.resident_values()
    with pytest.raises(RuntimeError, match="expected 1024 bytes but got 0"):
        sc.c.project(sc.full, TileSelection([[0, 3]])).wait()
    assert sc.snapshot() == before and sc.resident_values() == resident
    out = sc.c.project(sc.full, TileSelection([[0, 1]])).wait()  # tiles the file holds project as before
    assert [out[i] for i in range(2 * TILE)] == [-1.0 if i == 3 else float(sc.values[i]) for i in range(2 * TILE)]


def test_a_dirty_eviction_into_a_truncated_file_refuses_instead_of_writing_a_hole(tmp_path):
    sc = Scene(tmp_path)
    sc.c.promote(TileSet([(3,)]))
    sc.c[3 * TILE + 1] = 99.5
    os.truncate(sc.path, TILE * 4)  # only tile 0 is left
    before = sc.snapshot()
    with pytest.raises(RuntimeError, match=r"weights\.f32 was truncated while in use: it has 1024 bytes but must hold 4096"):
        sc.c.evict(TileSet([(3,)]))
    assert sc.snapshot() == before
    assert sc.c.dirty_tiles == TileSet([(3,)]) and sc.c[3 * TILE + 1] == 99.5  # the only copy kept
    assert os.path.getsize(sc.path) == TILE * 4  # not re-extended with a hole


def test_slot_reads_and_moves_of_a_truncated_file_fail(tmp_path):
    path = tmp_path / "slots.f32"
    np.arange(64, dtype=np.float32).tofile(path)
    fb = sw.FileBacked(path)
    os.truncate(path, 40 * 4)
    with pytest.raises(RuntimeError, match=r"slots\.f32 at offset 200 expected 4 bytes but got 0"):
        fb[50]
    assert fb[39] == 39.0
    t = Tensor(fb, 0, sw.column_major(64))
    with pytest.raises(RuntimeError, match="expected 256 bytes but got 160"):
        sw.move(t, sw.CPU(0))
    assert not fb.is_released() and fb[0] == 0.0  # the source was not consumed


# ================================================================ U4: a removed, renamed or replaced file


def _remove(path):
    os.remove(path)


def _rename(path):
    os.rename(path, path + ".moved")


def _replace(path):
    np.full(N, 7.0, dtype=np.float32).tofile(path + ".new")
    os.replace(path + ".new", path)


CHANGES = {"removed": (_remove, "was deleted while in use"),
           "renamed": (_rename, "is no longer there"),
           "replaced": (_replace, "was replaced by another file")}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("how", ["evict", "evict_async"])
def test_an_eviction_into_a_changed_file_fails_and_keeps_the_tiles_dirty_and_resident(tmp_path, change, how):
    sc = Scene(tmp_path)
    sc.c.promote(TileSet([(0,), (2,)]))
    sc.c[5] = -5.0
    sc.c[2 * TILE + 5] = -6.0
    act, fragment = CHANGES[change]
    act(sc.path)
    before, resident = sc.snapshot(), sc.resident_values()
    with pytest.raises(RuntimeError, match=fragment) as info:
        if how == "evict":
            sc.c.evict(ALL)
        else:
            sc.c.evict_async(ALL).wait()
    assert sc.path in str(info.value)
    assert sc.snapshot() == before and sc.resident_values() == resident
    assert sc.c.dirty_tiles == TileSet([(0,), (2,)])
    if change == "replaced":
        assert np.array_equal(np.fromfile(sc.path, dtype=np.float32), np.full(N, 7.0, dtype=np.float32))
    else:
        assert not os.path.exists(sc.path)  # nothing re-created the name


def test_the_same_eviction_succeeds_once_the_file_is_back(tmp_path):
    sc = Scene(tmp_path)
    sc.c.promote(TileSet([(1,)]))
    sc.c[TILE] = 123.0
    os.rename(sc.path, sc.path + ".moved")
    with pytest.raises(RuntimeError, match="removed or renamed"):
        sc.c.evict(ALL)
    os.rename(sc.path + ".moved", sc.path)
    sc.c.evict(ALL)
    assert sc.c.primary_tiles == TileSet([]) and np.fromfile(sc.path, dtype=np.float32)[TILE] == 123.0


def test_slot_writes_and_moves_into_a_removed_file_fail(tmp_path):
    path = str(tmp_path / "slots.f32")
    np.arange(8, dtype=np.float32).tofile(path)
    fb = sw.FileBacked(path)
    os.remove(path)
    version = fb.version
    with pytest.raises(RuntimeError, match="was deleted while in use") as info:
        fb[0] = 5.0
    assert path in str(info.value) and fb[0] == 0.0 and fb.version == version
    src = sw.friendly.tensor(np.ones(8, dtype=np.float32))
    with pytest.raises(RuntimeError, match="was deleted while in use"):
        sw.move(src, fb)
    assert not src.carrier.is_released() and fb[1] == 1.0


def test_anonymous_secondaries_are_not_checked_against_a_name(tmp_path):
    staged = sw.friendly.tensor(np.arange(N, dtype=np.float32))
    c = TiledEvictable(sw.CPU(0), sw.move(staged, sw.FileBacked()).carrier, (TILES,), (TILE,))
    c.promote(ALL)
    c[9] = -9.0
    c.evict(ALL)  # an anonymous file has no name (its link count is 0 by design): evictions just work
    assert c[9] == -9.0 and c[10] == 10.0


# ================================================================ U7: anonymous files leave nothing behind


ENDINGS = {
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "os._exit": "os._exit(3)",
    "abort": "resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); os.abort()",
    "uncollected cycle": "gc.disable(); cycle = [c, full]; cycle.append(cycle); del c, full, cycle; sys.exit(0)",
}

CHILD = """
    import gc, os, resource, signal, sys
    import numpy as np
    import strideweave as sw
    from strideweave import Tensor
    from strideweave.carriers.tiled_evictable import TiledEvictable, TileSet
    if {fallback}:
        import errno
        sw._core._io_inject("open", errno.EOPNOTSUPP, count=-1)  # as a file system without O_TMPFILE
    # Tensor-sized anonymous files of every origin: FileBacked(), a move into one, an anonymous secondary
    # grown by an eviction, and allocate_like.
    anon = sw.FileBacked().allocate_like(1 << 16)
    moved = sw.move(sw.friendly.tensor(np.arange(1 << 16, dtype=np.float32)), sw.FileBacked())
    c = TiledEvictable(sw.CPU(1 << 16), sw.FileBacked(), (4,), (1 << 14,))
    full = Tensor(c, 0, sw.column_major(1 << 16))
    c[5] = 5.0
    c.evict(TileSet([(0,), (1,), (2,), (3,)]))
    like = c.allocate_like(c.size())
    print("while running:", sorted(os.listdir(os.environ["TMPDIR"])), flush=True)
    {ending}
"""


@pytest.mark.parametrize("fallback", [False, True], ids=["O_TMPFILE", "create+unlink"])
@pytest.mark.parametrize("ending", ENDINGS)
def test_a_process_that_ends_abruptly_leaves_no_anonymous_file(tmp_path, ending, fallback):
    private = tmp_path / "tmp"
    private.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD).format(fallback=fallback, ending=ENDINGS[ending]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(private)))
    assert "while running: []" in proc.stdout, (proc.stdout, proc.stderr[-2000:])  # never visible at all
    if ending == "uncollected cycle":
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0  # it really ended abruptly
    assert os.listdir(private) == []


def test_an_anonymous_filename_says_what_the_kernel_calls_the_open_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    fb = sw.FileBacked()
    assert fb.is_anonymous()
    assert fb.filename.startswith(str(tmp_path) + "/") and fb.filename.endswith(" (deleted)")
    assert not os.path.exists(fb.filename) and os.listdir(tmp_path) == []
    assert fb.filename in open_files()
    fb.release()
    assert fb.filename not in open_files()


# ================================================================ U12a: paths and allocations


def test_an_immutable_file_backed_never_creates_a_missing_file(tmp_path):
    missing = tmp_path / "missing.f32"
    with pytest.raises(RuntimeError, match=r"missing\.f32 failed: No such file or directory \(ENOENT\)"):
        sw.FileBacked(missing, mutable=False)
    assert not missing.exists()
    sw.FileBacked(missing).release()  # a mutable one still creates it
    assert missing.exists()


@pytest.mark.parametrize("make", [
    lambda p: sw.FileBacked(p),
    lambda p: sw.FileBacked(p, mutable=False),
    lambda p: sw.BlockDevice(p),
], ids=["FileBacked", "FileBacked immutable", "BlockDevice"])
def test_a_path_with_an_embedded_nul_is_a_value_error(tmp_path, make):
    prefix = tmp_path / "data.bin"
    with open(prefix, "wb") as f:
        f.truncate(1 << 16)  # what the part before the NUL names: must stay untouched
    missing = tmp_path / "never"
    for bad in (str(prefix) + "\0.tail", str(missing) + "\0x"):
        with pytest.raises(ValueError, match="embedded NUL byte"):
            make(bad)
    assert not missing.exists() and os.path.getsize(prefix) == 1 << 16


class AddressSpaceLimit:
    """Limits the address space to what the process maps now plus `headroom` bytes (restored on exit): an
    allocation larger than the headroom fails whatever the machine's overcommit policy."""

    def __init__(self, headroom):
        self.headroom = headroom

    def __enter__(self):
        self.old = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft = mapped + self.headroom
        if self.old[1] != resource.RLIM_INFINITY:
            soft = min(soft, self.old[1])
        resource.setrlimit(resource.RLIMIT_AS, (soft, self.old[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_AS, self.old)


def test_an_allocation_that_cannot_be_had_is_a_memory_error_saying_what_and_how_much():
    with AddressSpaceLimit(1 << 30):
        with pytest.raises(MemoryError, match=r"allocating 4398046511104 bytes for a CPU carrier failed"):
            sw.CPU(2**40)
        empty = sw.CPU(0)
        with pytest.raises(MemoryError, match=r"allocating 4398046511104 bytes for a CPU carrier"):
            empty.allocate_like(2**40)
        with pytest.raises(MemoryError, match=r"allocating \d+ bytes for a Generic carrier"):
            sw.Generic([]).allocate_like(2**40)
    assert empty.size() == 0 and not empty.is_released()


def test_a_failed_anonymous_open_names_the_directory_and_the_errno(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    core._io_inject("open", errno.EMFILE, count=1)
    with pytest.raises(RuntimeError, match=r"open of an anonymous FileBacked file in .* failed: .*\(EMFILE\)"):
        sw.FileBacked()
    core._io_clear()
    assert os.listdir(tmp_path) == []
