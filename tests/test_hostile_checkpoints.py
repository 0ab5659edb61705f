"""Safetensors checkpoints and saves under hostile but realistic use, through the public API.

* A checkpoint is the file it parsed (Note [A checkpoint is the file it parsed] in
  cpp/src/checkpoint/checkpoint.cpp): once another save replaced the file, or it changed size or was modified in
  place, ``tensor()`` and ``tiled()`` raise RuntimeError naming the file and write nothing; an in-place tier made
  earlier refuses promotion and flush once its file was replaced.
* An overlay tier's eviction after its checkpoint was truncated names the checkpoint (a tile mapped from it lost
  its bytes), not the scratch overlay, and changes nothing.
* ``sw.safetensors.save`` claims the carriers it reads: ``release()`` from another thread during a save raises
  "wait" (the save used to read freed memory), and the save completes with the values.
* A save killed with SIGKILL leaves no temporary file (Note [A save leaves no temporary] in
  cpp/src/checkpoint/save.cpp), and a save removes the temporaries of dead writers of its target.
* A tensor name or metadata string with a lone surrogate is a ValueError naming the argument (was
  ``RuntimeError: std::bad_cast``); a path decoded with surrogateescape names its file.

Saves are held in flight with the test-only I/O gate (``_io_hold("pwrite")``), never with sleeps.

Run: ``.venv/bin/python -m pytest -q tests/test_hostile_checkpoints.py``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from waiting import held

core = sw._core

pytestmark = pytest.mark.usefixtures("clear_io_faults")


def sha256(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def values(t) -> np.ndarray:
    return np.asarray(t).astype(np.float64)


A = np.arange(12, dtype=np.float32).reshape(3, 4)


def save_first(path):
    sw.safetensors.save(path, {"a": friendly.tensor(A.copy()), "b": friendly.tensor(A + 100)})


def save_second(path):
    """Another file at the same name: a new first tensor moves every offset."""
    sw.safetensors.save(path, {"0_first": friendly.tensor(np.full(7, 9.0, np.float32)),
                               "a": friendly.tensor(A * 2), "b": friendly.tensor(A * 3)})


# ---------------------------------------------------------------- a checkpoint is the file it parsed


@pytest.mark.parametrize("make", ["tiled_in_place", "tiled_overlay", "tiled_split", "tensor"])
def test_a_file_replaced_after_open_is_refused_and_nothing_is_written(tmp_path, make):
    path = tmp_path / "model.safetensors"
    save_first(path)
    ckpt = sw.safetensors.open(path)
    save_second(path)  # another save renames a new file over the name
    before = sha256(path)
    with pytest.raises(RuntimeError) as info:
        if make == "tiled_in_place":
            full = ckpt.tiled(["a", "b"], mutable=True)
            full[(0, 0, 0)] = 5.0  # before the fix: written at the old header's offsets on eviction
            full.carrier.flush()
        elif make == "tiled_overlay":
            ckpt.tiled(["a", "b"])
        elif make == "tiled_split":
            ckpt.tiled("a", mutable=True)
        else:
            ckpt.tensor("a")
    print(info.value)
    msg = str(info.value)
    assert str(path) in msg and "was replaced by another file since sw.safetensors.open read its header" in msg
    assert sha256(path) == before  # nothing written
    again = sw.safetensors.open(path)  # the new file is whole
    np.testing.assert_array_equal(values(again.tensor("a")), A * 2)


@pytest.mark.parametrize("change", ["modified", "truncated"])
def test_a_file_changed_in_place_after_open_is_refused(tmp_path, change):
    path = tmp_path / "model.safetensors"
    save_first(path)
    ckpt = sw.safetensors.open(path)
    st = os.stat(path)
    with open(path, "r+b") as fh:
        if change == "modified":  # same inode and size, other bytes (a tool rewriting in place)
            fh.seek(st.st_size - 4)
            fh.write(b"\0\0\0\0")
        else:
            fh.truncate(st.st_size - 4)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later time, whatever the clock
    before = sha256(path)
    for call in (lambda: ckpt.tensor("b"), lambda: ckpt.tiled(["a", "b"], mutable=True)):
        with pytest.raises(RuntimeError) as info:
            call()
        print(info.value)
        assert str(path) in str(info.value)
        assert ("was modified since" if change == "modified" else "changed size since") in str(info.value)
    assert sha256(path) == before


def test_own_in_place_writes_do_not_make_the_checkpoint_stale(tmp_path):
    """The modification time this checkpoint's own in-place writes change is not a change of file."""
    path = tmp_path / "model.safetensors"
    save_first(path)
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(["a", "b"], mutable=True)
    full[(1, 2, 1)] = -1.0
    full.carrier.flush()
    want = A + 100
    want[1, 2] = -1.0
    np.testing.assert_array_equal(values(ckpt.tensor("b")), want)
    np.testing.assert_array_equal(values(ckpt.tiled(["a", "b"], mutable=True))[..., 1], want)
    full.carrier.release()


def test_an_in_place_tier_refuses_promotion_and_flush_once_its_file_was_replaced(tmp_path):
    path = tmp_path / "model.safetensors"
    save_first(path)
    full = sw.safetensors.open(path).tiled(["a", "b"], mutable=True)
    carrier = full.carrier
    carrier.promote(sw.TileSet([(0, 0, 0)]))
    full[(0, 0, 0)] = 5.0
    save_second(path)
    before = sha256(path)
    with pytest.raises(RuntimeError) as info:
        carrier.promote(sw.TileSet([(0, 0, 1)]))
    print(info.value)
    assert str(path) in str(info.value) and "was replaced" in str(info.value)
    assert carrier.tile_state((0, 0, 1)).location == "secondary"
    with pytest.raises(RuntimeError) as info:
        carrier.flush()
    print(info.value)
    assert str(path) in str(info.value) and "was replaced by another file" in str(info.value)
    assert "cannot flush tiles to it" in str(info.value)  # a flush says it is a flush, not an eviction
    state = carrier.tile_state((0, 0, 0))
    assert state.location == "primary" and state.dirty  # the value is kept, not lost
    assert full[(0, 0, 0)] == 5.0
    assert sha256(path) == before
    carrier.release()


def test_an_eviction_after_the_checkpoint_was_truncated_names_the_checkpoint(tmp_path):
    """A tile of 2 MiB is promoted by mapping the file (Note [Promotion by mapping]); once the file is truncated
    below it, evicting the dirty tile is refused naming the checkpoint (it named the scratch overlay: EFAULT)."""
    path = tmp_path / "model.safetensors"
    big = np.arange(1 << 19, dtype=np.float32).reshape(512, 1024)
    sw.safetensors.save(path, {"a": friendly.tensor(big), "b": friendly.tensor(big + 1)})
    full = sw.safetensors.open(path).tiled(["a", "b"])
    carrier = full.carrier
    tile = sw.TileSet([(0, 0, 0)])
    carrier.promote(tile)
    full[(0, 0, 0)] = 5.0
    os.truncate(path, 20)
    stats = carrier.stats()
    with pytest.raises(RuntimeError) as info:
        carrier.evict(tile)
    print(info.value)
    msg = str(info.value)
    assert str(path) in msg and "was truncated while in use" in msg and "(deleted)" not in msg
    assert carrier.stats() == stats
    state = carrier.tile_state((0, 0, 0))
    assert state.location == "primary" and state.dirty
    assert carrier.secondary.overlaid_ranges == 0
    assert os.path.getsize(path) == 20


# ---------------------------------------------------------------- release during a save


@pytest.mark.parametrize("kind", ["cpu", "file_backed"])
def test_release_during_a_save_waits_for_it(tmp_path, kind):
    """The save is held at its first write (the GIL released); release() from this thread must refuse with
    "wait" (it freed the buffer the save was copying: SIGSEGV), and the save then completes with the values."""
    n = 1 << 16
    data = np.arange(n, dtype=np.float32)
    if kind == "cpu":
        t = friendly.tensor(data)
    else:
        f = tmp_path / "values.f32"
        data.tofile(f)
        t = sw.Tensor(sw.FileBacked(str(f), mutable=True), 0, sw.column_major(n))
    carrier = t.carrier
    path = tmp_path / "model.safetensors"
    errors = []

    def run():
        try:
            sw.safetensors.save(path, {"x": t})
        except Exception as e:  # noqa: BLE001 (checked below)
            errors.append(e)

    core._io_hold("pwrite")
    saver = threading.Thread(target=run)
    try:
        saver.start()
        held("pwrite")
        with pytest.raises(RuntimeError) as info:
            carrier.release()
        print(info.value)
        assert "sw.safetensors.save" in str(info.value) and "wait" in str(info.value)
        assert not carrier.is_released()
    finally:
        core._io_unhold()
        saver.join()
    assert errors == []
    np.testing.assert_array_equal(np.asarray(sw.safetensors.open(path).tensor("x")), data)
    carrier.release()  # the save is over: release is allowed
    assert carrier.is_released()


def test_saving_a_released_carrier_names_the_tensor(tmp_path):
    t = friendly.tensor(np.ones(4, np.float32))
    t.carrier.release()
    with pytest.raises(RuntimeError, match="tensor 'w' is over a released CPU carrier"):
        sw.safetensors.save(tmp_path / "m.safetensors", {"w": t})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- no temporaries left


CHILD = textwrap.dedent("""
    import sys, numpy as np, strideweave as sw
    from strideweave import friendly
    t = friendly.tensor(np.ones(1 << 18, np.float32))
    sw._core._io_hold("pwrite")
    import threading
    threading.Thread(target=sw.safetensors.save, args=(sys.argv[1], {"x": t}), daemon=True).start()
    assert sw._core._io_wait_held("pwrite", 1, 30.0), "the save did not reach the pwrite gate"
    print("held", flush=True)
    sys.stdin.read()  # until killed
""")


def test_a_save_killed_mid_write_leaves_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    save_first(path)
    before = sha256(path)
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "held"  # the save is in flight, its file begun
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL
        assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
        assert sha256(path) == before
    save_second(path)  # the next save works, and leaves only its target
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    np.testing.assert_array_equal(values(sw.safetensors.open(path).tensor("b")), A * 3)


def test_a_save_removes_the_temporaries_of_dead_writers_only(tmp_path):
    """Temporaries named the way a save without O_TMPFILE names them: a dead process's are removed by the next
    save of that target; a live process's, another target's and other files are left alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    dead, live = gone.pid, os.getppid()
    stale = tmp_path / f".model.safetensors.tmp-{dead}-0"
    stale.write_bytes(b"\0" * 4096)
    kept = [tmp_path / f".model.safetensors.tmp-{live}-3", tmp_path / f".other.safetensors.tmp-{dead}-0",
            tmp_path / f".model.safetensors.tmp-{dead}-x", tmp_path / "notes.txt"]
    for k in kept:
        k.write_bytes(b"keep")
    save_first(tmp_path / "model.safetensors")
    assert not stale.exists()
    for k in kept:
        assert k.read_bytes() == b"keep", k


# ---------------------------------------------------------------- names that UTF-8 cannot hold


@pytest.mark.parametrize("where", ["tensor name", "metadata key", "metadata value"])
def test_a_lone_surrogate_in_a_name_is_a_value_error(tmp_path, where):
    t = friendly.tensor(np.ones(3, np.float32))
    bad = "w\udcff"
    tensors, metadata = {"w": t}, {"k": "v"}
    if where == "tensor name":
        tensors = {bad: t}
    elif where == "metadata key":
        metadata = {bad: "v"}
    else:
        metadata = {"k": bad}
    with pytest.raises(ValueError) as info:
        sw.safetensors.save(tmp_path / "m.safetensors", tensors, metadata)
    print(info.value)
    assert f"a {where} must be text UTF-8 can encode" in str(info.value)
    assert "U+DCFF at index 1" in str(info.value)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="a tensor name must be text UTF-8 can encode"):
        save_first(tmp_path / "ok.safetensors")
        sw.safetensors.open(tmp_path / "ok.safetensors").tensor(bad)


def test_a_path_decoded_with_surrogateescape_names_its_file(tmp_path):
    raw = os.fsencode(str(tmp_path)) + b"/m\xff.safetensors"  # not UTF-8
    name = os.fsdecode(raw)
    save_first(name)
    assert os.path.exists(raw)
    np.testing.assert_array_equal(values(sw.safetensors.open(name).tensor("a")), A)
