"""sw.safetensors.save is atomic: the target holds the old file or the new one, never a mix (docs/guide.md,
"Opening a Hugging Face checkpoint", Saving).

A save writes a temporary file beside the target, fsyncs it, renames it over the target and fsyncs the folder. So:
a save over an existing file replaces it whole, tensors made over the old file keep reading the old bytes, a
save that fails part-way (here: a tensor whose tile holds no value, read after other tensors were written) leaves
the old file and no temporary one, and concurrent saves to one path (the GIL is released while a save writes) each
land whole. Values are compared exactly (bit patterns; a save moves bytes and does no arithmetic).
"""

from __future__ import annotations

import os
import threading

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

import strideweave as sw
from strideweave import friendly

BASE_SEED = 2026120
NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def seeded(name):
    seed = BASE_SEED + sum(map(ord, name))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def arrays(rng, dtype, shapes):
    return {n: rng.standard_normal(s).astype(NP[dtype]) for n, s in shapes.items()}


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def assert_file_holds(path, expected: dict):
    """The file, read by StrideWeave and by the safetensors package, holds exactly `expected` (name -> array)."""
    ckpt = sw.safetensors.open(path)
    assert ckpt.keys() == sorted(expected)
    for n, a in expected.items():
        assert np.array_equal(bits(np.asarray(ckpt.tensor(n))), bits(a)), n
    loaded = safetensors.torch.load_file(str(path))
    for n, a in expected.items():
        assert np.array_equal(bits(loaded[n].view(torch.int16 if a.itemsize == 2 else torch.int32).numpy()),
                              bits(a)), n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_save_over_an_existing_file_replaces_it_whole_and_an_open_reader_keeps_the_old(tmp_path, dtype):
    rng = seeded("replace" + dtype)
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 3, 4)}
    old, new = arrays(rng, dtype, shapes), arrays(rng, dtype, {"a": (3, 5), "d": (6, 2)})
    path = tmp_path / "model.safetensors"
    sw.safetensors.save(path, {n: friendly.tensor(a) for n, a in old.items()})
    assert_file_holds(path, old)
    reader = sw.safetensors.open(path)
    held = {n: reader.tensor(n) for n in old}  # tensors over the old file, made before the replacement
    sw.safetensors.save(path, {n: friendly.tensor(a) for n, a in new.items()})
    assert_file_holds(path, new)
    for n, a in old.items():  # the old file's bytes, whole, through the tensors made earlier
        assert np.array_equal(bits(np.asarray(held[n])), bits(a)), n
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temporary file left


def test_tiled_experts_saved_tile_by_tile_round_trip_exactly(tmp_path):
    """BFloat16 experts of a checkpoint, some tiles resident and changed, others still in the file: the saved file
    holds each expert's current values exactly, and the source file is unchanged."""
    rng = seeded("tiled")
    E, OUT, IN = 5, 4, 6
    experts = rng.standard_normal((E, OUT, IN)).astype(ml_dtypes.bfloat16)
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(E)]
    src = tmp_path / "src.safetensors"
    sw.safetensors.save(src, {n: friendly.tensor(experts[e]) for e, n in enumerate(names)})
    before = src.read_bytes()
    full = sw.safetensors.open(src).tiled(names)  # (OUT, IN, E), tile e = expert e, row-major
    full[(1, 2, 3)] = 0.5  # expert 3 promoted and changed; the others stay in the file
    experts[3, 1, 2] = 0.5
    per_expert = {n: sw.Tensor(full.carrier, e * OUT * IN, sw.Layout(sw.Shape(OUT, IN), sw.Stride(IN, 1)))
                  for e, n in enumerate(names)}
    out = tmp_path / "out.safetensors"
    sw.safetensors.save(out, per_expert)
    assert_file_holds(out, {n: experts[e] for e, n in enumerate(names)})
    assert src.read_bytes() == before
    full.carrier.release()


def test_a_save_failing_part_way_leaves_the_old_file_and_no_temporary(tmp_path):
    rng = seeded("failing")
    old = arrays(rng, "float32", {"a": (4, 4)})
    path = tmp_path / "model.safetensors"
    sw.safetensors.save(path, {"a": friendly.tensor(old["a"])})
    before = path.read_bytes()
    # A tiled tensor over an empty primary and an empty secondary: its tiles hold no value, so reading it raises,
    # after the large tensor before it was written to the temporary file.
    empty = sw.TiledEvictable(sw.CPU(0), sw.FileBacked(), (2,), (3,))
    invalid = sw.Tensor(empty, 0, sw.column_major(sw.Shape(6)))
    big = friendly.tensor(rng.standard_normal(1 << 16).astype(np.float32))
    with pytest.raises(RuntimeError) as info:
        sw.safetensors.save(path, {"big": big, "invalid": invalid})
    print(info.value)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    empty.release()


def test_concurrent_saves_to_one_path_each_land_whole(tmp_path):
    """Two threads save different contents to one path, over and over, while a third reads it: every read sees
    one of the two whole (the saves share no temporary file), and the last file is one of them."""
    rng = seeded("concurrent")
    n = 1 << 18  # 1 MiB of Float32: a save takes long enough for the two to overlap
    contents = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    tensors = [friendly.tensor(c) for c in contents]
    path = tmp_path / "model.safetensors"
    sw.safetensors.save(path, {"x": tensors[0]})
    rounds = 40
    errors, seen = [], set()
    done = threading.Event()

    def saver(k):
        try:
            for _ in range(rounds):
                sw.safetensors.save(path, {"x": tensors[k]})
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def reader():
        while not done.is_set():
            got = safetensors.torch.load_file(str(path))["x"].numpy()
            match = [k for k in range(2) if np.array_equal(got, contents[k])]
            if not match:
                errors.append(AssertionError("a read saw neither content whole"))
                return
            seen.add(match[0])

    threads = [threading.Thread(target=saver, args=(k,)) for k in range(2)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    r.join()
    assert not errors, errors
    final = safetensors.torch.load_file(str(path))["x"].numpy()
    assert any(np.array_equal(final, c) for c in contents)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
