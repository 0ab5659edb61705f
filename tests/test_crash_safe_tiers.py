"""Crash-safe tiers (Note [A crash-safe tier] in cpp/src/carriers/journal.cpp): the switch, its journal, its faults.

* ``FileBacked(path, crash_safe=True)`` and ``ckpt.tiled(names, mutable=True, crash_safe=True)`` write every unit
  (an evicted tile: all its runs) to ``<file>.swjournal`` and fsync it before writing in place; ``flush()`` empties
  the journal; a clean close removes it. The journal's writes are counted apart (``journal_stats()``), so the
  engine's one write per dirty tile is still one ``pwrite`` per run in place.
* A failed journal write or fsync fails the eviction before anything reaches the file: the tiles stay resident
  and dirty (the promise of tests/test_faults.py and tests/test_durability.py, in crash-safe mode too).
* What a crash left is replayed by the next writable open; a read-only open refuses it (RuntimeError naming the
  file), leaving it untouched.

Killed processes at random moments: tests/test_crash.py. Torn writes made deterministically: cpp/tests/journal_test.cpp.

Run: ``.venv/bin/python -m pytest -q tests/test_crash_safe_tiers.py``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import strideweave as sw
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSet

core = sw._core
TILES, TILE = 6, 2048  # 8 KiB tiles: two pages each
ALL = TileSet([(t,) for t in range(TILES)])

pytestmark = pytest.mark.usefixtures("clear_io_faults")


class Scene:
    """TILES tiles over a named file seeded 0.5, 1.5, ...; `dirty` tiles promoted and given a new first slot."""

    def __init__(self, tmp_path, crash_safe=True, dirty=range(TILES)):
        self.path = str(tmp_path / "tier.f32")
        self.values = np.arange(TILES * TILE, dtype=np.float32) + 0.5
        self.values.tofile(self.path)
        self.file = sw.FileBacked(self.path, crash_safe=crash_safe)
        self.c = TiledEvictable(sw.CPU(0), self.file, (TILES,), (TILE,))
        self.c.promote(TileSet([(t,) for t in dirty]))
        for t in dirty:
            self.c[t * TILE] = -1.0 - t
            self.values[t * TILE] = -1.0 - t

    def on_file(self):
        return np.fromfile(self.path, dtype=np.float32)

    @property
    def journal(self):
        return self.path + ".swjournal"


def test_crash_safe_eviction_journals_each_tile_once_and_flush_empties_the_journal(tmp_path):
    sc = Scene(tmp_path)
    assert sc.file.crash_safe and os.path.exists(sc.journal)
    pwrites = core._io_calls("pwrite")
    sc.c.evict(ALL)
    assert np.array_equal(sc.on_file(), sc.values)
    st = sc.file.journal_stats()
    assert st["records"] == TILES and st["syncs"] == TILES  # one record, one fsync per dirty tile
    assert st["bytes"] >= TILES * TILE * 4
    # Each tile: its record (header, then its one run) and its one write in place.
    assert core._io_calls("pwrite") - pwrites == 3 * TILES
    assert sc.c.stats()["evictions"] == TILES and sc.c.stats()["bytes_evicted"] == TILES * TILE * 4
    assert os.path.getsize(sc.journal) > TILES * TILE * 4
    sc.file.flush()
    assert sc.file.journal_stats()["resets"] == 1 and os.path.getsize(sc.journal) == 32
    sc.c.release()
    sc.file.release()
    assert not os.path.exists(sc.journal)  # a clean close leaves no journal


def test_a_plain_tier_writes_no_journal(tmp_path):
    sc = Scene(tmp_path, crash_safe=False)
    pwrites = core._io_calls("pwrite")
    sc.c.evict(ALL)
    assert core._io_calls("pwrite") - pwrites == TILES  # one write per dirty tile, as ever
    assert not sc.file.crash_safe and sc.file.journal_stats()["records"] == 0
    assert not os.path.exists(sc.journal)


@pytest.mark.parametrize("op, err, after, name", [
    ("pwrite", errno.ENOSPC, 0, "ENOSPC"),  # the record's header
    ("pwrite", errno.EIO, 1, "EIO"),        # the record's data
    ("fsync", errno.EIO, 0, "EIO"),         # the record's fsync
])
def test_a_failed_journal_write_keeps_every_dirty_tile_resident_and_dirty(tmp_path, op, err, after, name):
    sc = Scene(tmp_path)
    on_file = sc.on_file()
    core._io_inject(op, err, count=-1, after=after)
    with pytest.raises(RuntimeError, match=name) as info:
        sc.c.evict(ALL)
    assert sc.journal in str(info.value), str(info.value)
    core._io_clear()
    assert sc.c.dirty_tiles == ALL and sc.c.primary_tiles == ALL
    assert sc.c.stats()["evictions"] == 0
    assert np.array_equal(sc.on_file(), on_file)  # nothing reached the file in place
    assert sc.file.journal_stats()["records"] == 0
    sc.c.evict(ALL)  # the values were kept
    assert np.array_equal(sc.on_file(), sc.values)


def test_a_failed_flush_leaves_the_journal_and_the_tiles_dirty(tmp_path):
    sc = Scene(tmp_path)
    core._io_inject("fsync", errno.EIO, count=1, after=TILES)  # the records' fsyncs pass; the file's fails
    with pytest.raises(RuntimeError, match="EIO"):
        sc.c.flush()
    core._io_clear()
    assert sc.c.dirty_tiles == ALL
    assert sc.file.journal_stats()["resets"] == 0  # the records stay: the file was not synced
    sc.c.flush()
    assert not sc.c.dirty_tiles and sc.file.journal_stats()["resets"] == 1


def test_crash_safe_needs_a_named_writable_file(tmp_path):
    with pytest.raises(ValueError, match="needs a filename"):
        sw.FileBacked(crash_safe=True)
    path = str(tmp_path / "ro.f32")
    np.zeros(4, np.float32).tofile(path)
    with pytest.raises(ValueError, match="read-only file is never written"):
        sw.FileBacked(path, mutable=False, crash_safe=True)
    assert not os.path.exists(path + ".swjournal")


def test_one_crash_safe_writer_per_file(tmp_path):
    sc = Scene(tmp_path, dirty=())
    with pytest.raises(RuntimeError, match="in use by another crash-safe tier"):
        sw.FileBacked(sc.path, crash_safe=True)
    with pytest.raises(RuntimeError, match="in use by another crash-safe tier"):
        sw.FileBacked(sc.path)  # a plain writer would find the live journal too
    assert sc.file.crash_safe


LEAVE_JOURNAL = textwrap.dedent("""
    import os, sys
    import numpy as np
    import strideweave as sw
    from strideweave.carriers.tiled_evictable import TiledEvictable, TileSet
    f = sw.FileBacked(sys.argv[1], crash_safe=True)
    c = TiledEvictable(sw.CPU(0), f, ({tiles},), ({tile},))
    every = TileSet([(t,) for t in range({tiles})])
    c.promote(every)
    for t in range({tiles}):
        c[t * {tile} + 1] = 7.0
    c.evict(every)
    os._exit(0)  # as a killed process: nothing closes the journal
""").format(tiles=TILES, tile=TILE)


def test_what_a_crash_left_is_refused_read_only_and_replayed_by_a_writable_open(tmp_path):
    path = str(tmp_path / "left.f32")
    values = np.arange(TILES * TILE, dtype=np.float32)
    values.tofile(path)
    subprocess.run([sys.executable, "-c", LEAVE_JOURNAL, path], check=True)
    journal = path + ".swjournal"
    assert os.path.getsize(journal) > 32
    values[1::TILE] = 7.0
    # Tear the file as a kill would have: half of tile 2's first page written back to its old values.
    torn = values.copy()
    torn[2 * TILE:2 * TILE + 512] = -5.0
    torn.tofile(path)
    with pytest.raises(RuntimeError, match="open the file writable once") as info:
        sw.FileBacked(path, mutable=False)
    assert path in str(info.value) and journal in str(info.value)
    assert np.array_equal(np.fromfile(path, np.float32), torn)  # the refusal changed nothing
    f = sw.FileBacked(path)  # plain and writable: replays, then removes the journal
    assert not os.path.exists(journal)
    f.release()
    assert np.array_equal(np.fromfile(path, np.float32), values)
    sw.FileBacked(path, mutable=False).release()


def test_a_checkpoint_tier_in_place_can_be_crash_safe(tmp_path):
    path = str(tmp_path / "ck.safetensors")
    w = np.arange(3 * 1024, dtype=np.float32).reshape(3, 1024)
    sw.safetensors.save(path, {f"w.{i}": sw.friendly.tensor(w[i]) for i in range(3)})
    ck = sw.safetensors.open(path)
    names = [f"w.{i}" for i in range(3)]
    with pytest.raises(ValueError, match="needs mutable=True"):
        ck.tiled(names, crash_safe=True)
    assert not os.path.exists(path + ".swjournal")
    t = ck.tiled(names, mutable=True, crash_safe=True)
    c = t.carrier
    assert c.secondary.crash_safe and c.secondary.writes == "in_place"
    assert os.path.exists(path + ".swjournal")
    assert c.grid_shape == (1, 3)
    every = TileSet([(0, i) for i in range(3)])
    c.promote(every)
    for i in range(3):
        c[i * 1024 + 5] = -1.0
    c.evict(every)
    c.flush()
    assert os.path.getsize(path + ".swjournal") == 32
    c.release()
    del t, c, ck
    import gc
    gc.collect()
    assert not os.path.exists(path + ".swjournal")
    w[:, 5] = -1.0
    back = sw.safetensors.open(path)
    for i in range(3):
        assert np.array_equal(np.asarray(back.tensor(f"w.{i}")), w[i])


def test_a_forked_child_neither_writes_nor_removes_its_parents_journal(tmp_path):
    sc = Scene(tmp_path)
    sc.c.evict(ALL)  # records in the journal, not yet flushed
    size = os.path.getsize(sc.journal)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                sc.file.flush()
            except RuntimeError as e:
                code = 0 if "a forked child cannot write or flush" in str(e) and sc.journal in str(e) else 2
            sc.c.release()
            sc.file.release()  # closing the tier in the child leaves the parent's journal alone
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.getsize(sc.journal) == size  # not emptied, not removed
    sc.file.flush()  # the parent's own flush still works
    assert os.path.getsize(sc.journal) == 32
