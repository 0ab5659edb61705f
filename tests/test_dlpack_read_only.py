"""_core._dlpack_read_only: the read-only export strideweave.torch's per-expert arithmetic reads projected tiles
through (Note [Experts on transformers' interface]): it shares the memory as it is, even a one-tile projection's
memory shared copy-on-write with the resident tile, which a writable export (to_torch) first copies."""

from __future__ import annotations

import numpy as np
import pytest

import strideweave as sw
from strideweave import _core

torch = pytest.importorskip("torch")


def _projection(tmp_path):
    E, R, C = 3, 4, 5
    data = np.arange(E * R * C, dtype=np.float32).reshape(E, R, C)
    path = str(tmp_path / "experts.safetensors")
    sw.safetensors.save(path, {f"e{e}": sw.friendly.tensor(data[e]) for e in range(E)})
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled([f"e{e}" for e in range(E)])
    return data, full, full.carrier.project(full, sw.TileSelection([[0], [0], [1]])).wait()


def test_a_read_only_export_shares_the_projection_without_a_copy(tmp_path):
    data, full, compact = _projection(tmp_path)
    shared = torch.from_dlpack(_core._dlpack_read_only(compact))
    again = torch.from_dlpack(_core._dlpack_read_only(compact))
    assert shared.data_ptr() == again.data_ptr()  # the same memory each time: nothing was copied
    assert torch.equal(shared[..., 0], torch.from_numpy(data[1]))
    # A writable export makes the memory private first: another address (the copy the read-only export avoids).
    writable = torch.from_dlpack(compact)
    assert writable.data_ptr() != shared.data_ptr()
    assert torch.equal(writable, shared)


def test_the_capsule_says_read_only_and_a_non_tensor_is_refused(tmp_path):
    _, _, compact = _projection(tmp_path)
    capsule = _core._dlpack_read_only(compact)
    assert "dltensor_versioned" in repr(capsule)  # only a versioned capsule can carry the read-only flag
    with pytest.raises(TypeError, match="_dlpack_read_only: expected a Tensor, got ndarray"):
        _core._dlpack_read_only(np.zeros(3, np.float32))
