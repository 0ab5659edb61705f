"""Long-running readers that run without the GIL claim what they read, so another thread's ``release()`` is refused
("... (wait for it)") instead of freeing memory or closing a file under them (docs/reliability.md, "Hostile use"
U16): ``FileBacked.flush()`` held at its fsync with the test-only I/O gate, and an optimizer's step of a dense
parameter whose carrier was released before it began. (``sw.safetensors.save`` is covered in
tests/test_hostile_checkpoints.py.)

Run: ``.venv/bin/python -m pytest -q tests/test_release_during_readers.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from waiting import held

pytestmark = pytest.mark.usefixtures("clear_io_faults")




@pytest.mark.parametrize("crash_safe", [False, True])
def test_release_during_a_file_flush_waits_for_it(tmp_path, held_io, crash_safe):
    path = tmp_path / "tier.bin"
    f = sw.FileBacked(str(path), dtype=sw.DType.Float32, crash_safe=crash_safe)
    t = sw.move(friendly.tensor(np.arange(1024, dtype=np.float32)), f)
    held_io._io_hold("fsync")
    errors = []

    def flush():
        try:
            t.carrier.flush()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=flush)
    th.start()
    held("fsync")
    with pytest.raises(RuntimeError, match=r"owned by FileBacked.flush.*wait for it"):
        t.carrier.release()
    assert not t.carrier.is_released()
    held_io._io_unhold()
    th.join(30)
    assert not th.is_alive() and not errors, errors
    np.testing.assert_array_equal(np.fromfile(path, dtype=np.float32)[:1024], np.arange(1024, dtype=np.float32))
    t.carrier.release()  # the flush ended: now it releases
    assert t.carrier.is_released()


def test_step_of_a_dense_parameter_over_a_released_carrier_names_it():
    w = friendly.tensor(np.ones((4, 3), np.float32))
    w.grad = friendly.tensor(np.full((4, 3), 2.0, np.float32))
    opt = sw.optim.SGD([w], lr=0.5)
    g_before = np.asarray(w.grad).copy()
    w.carrier.release()
    with pytest.raises(RuntimeError, match="released.*SGD.step"):
        opt.step()
    assert opt.stats()["tiles_stepped"] == 0
    np.testing.assert_array_equal(np.asarray(w.grad), g_before)
