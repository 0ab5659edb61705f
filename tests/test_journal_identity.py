"""One crash-safe journal per file, whatever name the file is opened by; and a journal that is really one.

Note [One journal per file] in cpp/src/carriers/journal.cpp:

* The journal lies beside the file's canonical path (symlinks, ``..`` and ``.`` resolved), so a symlink (a Hugging
  Face cache snapshot points at its blob) and its target share one journal: what a killed writer left is found and
  replayed through any of those names, and a second crash-safe tier is refused. A crash-safe tier also holds a
  lock on the file itself, so a second one through a hard link is refused too (RuntimeError naming the file and
  the other opener); a hard link's journal, though, is found only through the name it was opened by.
* The journal is opened without following a symlink and must be a regular file with one name, owned by this
  process's user, and not the data file: anything else is refused (RuntimeError naming it) and left as it was.

Killed writers are simulated as in tests/test_crash_safe_tiers.py (a subprocess ends with ``os._exit``, leaving its
journal with its record).

Run: ``.venv/bin/python -m pytest -q tests/test_journal_identity.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import strideweave as sw

TILES, TILE = 6, 2048

pytestmark = pytest.mark.usefixtures("clear_io_faults")


def seed(path):
    values = np.arange(TILES * TILE, dtype=np.float32)
    values.tofile(path)
    return values


def on_file(path):
    return np.fromfile(path, dtype=np.float32)


def with_value(values, value):
    out = values.copy()
    out[1::TILE] = value
    return out


def write_and_flush(path, values):
    """A crash-safe tier over `path` writes `values` (one journaled unit), flushes and closes cleanly."""
    f = sw.FileBacked(path, crash_safe=True)
    sw._core._fill_from_array(f, values)
    f.flush()
    f.release()


# A crash-safe writer that writes its values (one journaled unit, then in place) and is killed before it closes:
# os._exit, as in tests/test_crash_safe_tiers.py, leaves the journal with its record.
LEAVE_JOURNAL = """
import os, sys
import numpy as np
import strideweave as sw
f = sw.FileBacked(sys.argv[1], crash_safe=True)
sw._core._fill_from_array(f, np.fromfile(sys.argv[2], dtype=np.float32))
os._exit(0)
"""


def killed_writer(path, values, tmp_path):
    src = tmp_path / "values.bin"
    values.tofile(src)
    subprocess.run([sys.executable, "-c", LEAVE_JOURNAL, path, str(src)], check=True)
    src.unlink()


@pytest.fixture
def names(tmp_path):
    """One file under three names: its path, a symlink in another folder, and a path with `..` and `.`."""
    data = tmp_path / "blobs"
    data.mkdir()
    (tmp_path / "snapshots").mkdir()
    real = str(data / "weights.f32")
    link = str(tmp_path / "snapshots" / "weights.f32")
    os.symlink(os.path.join("..", "blobs", "weights.f32"), link)
    dotted = str(tmp_path / "snapshots" / ".." / "blobs" / "." / "weights.f32")
    return real, link, dotted


def journals(tmp_path):
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.swjournal"))


# ------------------------------------------------------------------ item: one journal per file


@pytest.mark.parametrize("first, second", [(0, 1), (1, 0), (0, 2), (2, 1)])
def test_a_second_crash_safe_tier_through_another_name_is_refused(tmp_path, names, first, second):
    values = seed(names[0])
    f = sw.FileBacked(names[first], crash_safe=True)
    before = journals(tmp_path)
    assert before == ["blobs/weights.f32.swjournal"]  # beside the file itself, whatever name opened it
    with pytest.raises(RuntimeError, match="in use by another crash-safe tier") as info:
        sw.FileBacked(names[second], crash_safe=True)
    msg = str(info.value)
    assert names[second] in msg and names[first] in msg and "this process" in msg, msg
    with pytest.raises(RuntimeError, match="in use by another crash-safe tier"):
        sw.FileBacked(names[second])  # a plain writer finds the live journal too
    assert journals(tmp_path) == before
    assert np.array_equal(on_file(names[0]), values)
    f.release()
    assert journals(tmp_path) == []
    sw.FileBacked(names[second], crash_safe=True).release()  # free again once the first is closed


def test_a_second_crash_safe_tier_through_a_hard_link_is_refused(tmp_path):
    a, b = str(tmp_path / "a.f32"), str(tmp_path / "b.f32")
    values = seed(a)
    os.link(a, b)
    f = sw.FileBacked(a, crash_safe=True)
    with pytest.raises(RuntimeError, match="in use by another crash-safe tier") as info:
        sw.FileBacked(b, crash_safe=True)
    msg = str(info.value)
    assert b in msg and a in msg and "this process" in msg, msg
    assert journals(tmp_path) == ["a.f32.swjournal"]  # the refused opener made none
    assert np.array_equal(on_file(a), values)
    f.release()
    sw.FileBacked(b, crash_safe=True).release()


HOLD = """
import os, sys
import strideweave as sw
f = sw.FileBacked(sys.argv[1], crash_safe=True)
os.write(1, b"ready\\n")
sys.stdin.readline()
f.release()
"""


def test_another_process_holding_the_file_through_another_name_is_named(tmp_path, names):
    values = seed(names[0])
    child = subprocess.Popen([sys.executable, "-c", HOLD, names[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        with pytest.raises(RuntimeError, match="in use by another crash-safe tier") as info:
            sw.FileBacked(names[0], crash_safe=True)
        assert f"process {child.pid}" in str(info.value), str(info.value)
        assert np.array_equal(on_file(names[0]), values)
    finally:
        child.stdin.write(b"done\n")
        child.stdin.close()
        assert child.wait() == 0


@pytest.mark.parametrize("killed, writer, reopen", [(1, 0, 1), (0, 1, 0), (2, 1, 2)])
def test_a_killed_writers_journal_is_replayed_through_any_name_and_never_over_later_values(
        tmp_path, names, killed, writer, reopen):
    values = seed(names[0])
    killed_writer(names[killed], with_value(values, 7.0), tmp_path)
    # The next writer, through another name, finds the journal, replays it, then writes, flushes and closes.
    later = with_value(values, 9.0)
    write_and_flush(names[writer], later)
    assert np.array_equal(on_file(names[0]), later)
    # Reopening through the killed writer's name replays nothing over the later values.
    f = sw.FileBacked(names[reopen], crash_safe=True)
    replayed = f.journal_stats()["replayed"]
    f.release()
    assert np.array_equal(on_file(names[0]), later)
    assert replayed == 0
    assert journals(tmp_path) == []


def test_a_read_only_open_through_another_name_finds_what_a_crash_left(tmp_path, names):
    real, link, _ = names
    values = seed(real)
    killed_writer(real, with_value(values, 7.0), tmp_path)
    torn = values.copy()  # as a kill between the record and the write in place leaves it
    torn.tofile(real)
    with pytest.raises(RuntimeError, match="open the file writable once") as info:
        sw.FileBacked(link, mutable=False)
    assert link in str(info.value) and real + ".swjournal" in str(info.value), str(info.value)
    assert np.array_equal(on_file(real), torn)
    f = sw.FileBacked(link)  # a plain writable open through the symlink replays and removes it
    f.release()
    assert journals(tmp_path) == []
    assert np.array_equal(on_file(real), with_value(values, 7.0))
    sw.FileBacked(link, mutable=False).release()


# ------------------------------------------------------------------ item: a journal that is not one


def victim_file(tmp_path, data=b"precious"):
    victim = tmp_path / "elsewhere" / "victim.bin"
    victim.parent.mkdir()
    victim.write_bytes(data)
    os.utime(victim, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    return victim


def check_untouched(victim, data=b"precious"):
    st = victim.stat()
    assert victim.read_bytes() == data
    assert st.st_mtime_ns == 1_000_000_000_000_000_000


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("data", [b"", b"precious", bytes(range(256)) * 4], ids=["empty", "short", "long"])
def test_a_symlink_planted_at_the_journal_is_refused_and_its_target_untouched(tmp_path, plain, data):
    path = str(tmp_path / "tier.f32")
    values = seed(path)
    victim = victim_file(tmp_path, data)
    journal = path + ".swjournal"
    os.symlink(victim, journal)
    with pytest.raises(RuntimeError, match="symbolic link") as info:
        sw.FileBacked(path, crash_safe=not plain)
    assert journal in str(info.value) and path in str(info.value), str(info.value)
    check_untouched(victim, data)
    assert os.readlink(journal) == str(victim)
    assert np.array_equal(on_file(path), values)


def test_a_dangling_symlink_planted_at_the_journal_creates_nothing(tmp_path):
    path = str(tmp_path / "tier.f32")
    seed(path)
    target = tmp_path / "elsewhere" / "created.bin"
    target.parent.mkdir()
    os.symlink(target, path + ".swjournal")
    with pytest.raises(RuntimeError, match="symbolic link"):
        sw.FileBacked(path, crash_safe=True)
    assert not target.exists()
    assert os.readlink(path + ".swjournal") == str(target)


def test_a_hard_link_planted_at_the_journal_is_refused(tmp_path):
    path = str(tmp_path / "tier.f32")
    values = seed(path)
    victim = victim_file(tmp_path)
    os.link(victim, path + ".swjournal")
    with pytest.raises(RuntimeError, match="has 2 names") as info:
        sw.FileBacked(path, crash_safe=True)
    assert path + ".swjournal" in str(info.value), str(info.value)
    check_untouched(victim)
    assert np.array_equal(on_file(path), values)


def test_the_data_file_itself_at_the_journal_is_refused(tmp_path):
    path = str(tmp_path / "tier.f32")
    values = np.zeros(4, np.float32)  # 16 bytes: shorter than a journal's header
    values.tofile(path)
    os.link(path, path + ".swjournal")
    with pytest.raises(RuntimeError, match="is the file itself") as info:
        sw.FileBacked(path, crash_safe=True)
    assert path + ".swjournal" in str(info.value), str(info.value)
    assert np.array_equal(on_file(path), values) and os.path.getsize(path) == 16


def test_a_fifo_at_the_journal_is_refused(tmp_path):
    path = str(tmp_path / "tier.f32")
    values = seed(path)
    os.mkfifo(path + ".swjournal")
    with pytest.raises(RuntimeError, match="not a regular file") as info:
        sw.FileBacked(path, crash_safe=True)
    assert path + ".swjournal" in str(info.value), str(info.value)
    assert np.array_equal(on_file(path), values)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_journal_owned_by_another_user_is_refused(tmp_path):
    path = str(tmp_path / "tier.f32")
    values = seed(path)
    journal = tmp_path / "tier.f32.swjournal"
    journal.write_bytes(b"")
    os.chown(journal, 4321, 4321)
    with pytest.raises(RuntimeError, match="owned by user 4321") as info:
        sw.FileBacked(path, crash_safe=True)
    assert str(journal) in str(info.value), str(info.value)
    assert journal.read_bytes() == b"" and journal.stat().st_uid == 4321
    assert np.array_equal(on_file(path), values)


def test_a_checkpoint_through_a_snapshot_symlink_and_its_blob_share_one_journal(tmp_path, names):
    """The Hugging Face layout: a crash-safe checkpoint tier through the snapshot's symlink holds the blob."""
    real, link, _ = names
    w = np.arange(2 * 1024, dtype=np.float32).reshape(2, 1024)
    sw.safetensors.save(real, {f"w.{i}": sw.friendly.tensor(w[i]) for i in range(2)})
    before = open(real, "rb").read()
    ck = sw.safetensors.open(link)
    t = ck.tiled(["w.0", "w.1"], mutable=True, crash_safe=True)
    assert journals(tmp_path) == ["blobs/weights.f32.swjournal"]
    with pytest.raises(RuntimeError, match="in use by another crash-safe tier") as info:
        sw.FileBacked(real, crash_safe=True)
    assert real in str(info.value) and link in str(info.value), str(info.value)
    assert open(real, "rb").read() == before
    t.carrier.release()
