"""sw.safetensors: checkpoints written by the `safetensors` package itself, read where they lie.

Every value StrideWeave reads is compared with the package's own load. Reading moves bytes and does no
arithmetic, so the comparisons are exact (a bf16/f16 value widened to Float64 is exact too). Files are written
with safetensors.numpy (Float32) or safetensors.torch (bf16, f16); both naming schemes of Hugging Face MoE
checkpoints (per-expert w1/w2/w3 tensors, fused 3-D gate_up_proj/down_proj), one file and a sharded folder.

bf16/f16: the DTypes BFloat16/Float16 land separately (docs/guide.md, "DTypes"); their cases run only when
``sw.DType`` has them (``hasattr(sw.DType, "BFloat16")``) and are skipped until then. Float32 always runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

import strideweave as sw
from open_files import open_files

BASE_SEED = 1800

E, I, H = 4, 6, 5  # experts, intermediate size, hidden size: small, and no two extents equal

DTYPES = [
    pytest.param("float32", id="f32"),
    pytest.param(
        "bfloat16",
        id="bf16",
        marks=pytest.mark.skipif(not hasattr(sw.DType, "BFloat16"), reason="sw.DType.BFloat16 not there yet"),
    ),
    pytest.param(
        "float16",
        id="f16",
        marks=pytest.mark.skipif(not hasattr(sw.DType, "Float16"), reason="sw.DType.Float16 not there yet"),
    ),
]
SW_DTYPE = {"float32": "Float32", "bfloat16": "BFloat16", "float16": "Float16"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------- writing checkpoints with the package


def _values(rng, shape, dtype):
    """Random values of `shape`, exactly representable in `dtype` (as a torch tensor of that dtype)."""
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(getattr(torch, dtype))


def write_file(path, tensors: dict, dtype: str, metadata=None):
    """Writes `tensors` (name -> torch tensor) with the package: safetensors.numpy for f32, .torch otherwise."""
    if dtype == "float32":
        safetensors.numpy.save_file({k: v.numpy() for k, v in tensors.items()}, str(path), metadata=metadata)
    else:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def reference(path) -> dict:
    """The package's own load of every tensor of the file, widened exactly to Float64."""
    return {k: v.to(torch.float64).numpy() for k, v in safetensors.torch.load_file(str(path)).items()}


def per_expert_names(layer=0):
    return {w: [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(E)] for w in ("w1", "w2", "w3")}


def per_expert_tensors(rng, dtype, layer=0):
    """Mixtral's naming: w1, w3 (I, H) and w2 (H, I) per expert, PyTorch's (out, in); plus the router."""
    names = per_expert_names(layer)
    out = {f"model.layers.{layer}.block_sparse_moe.gate.weight": _values(rng, (E, H), dtype)}
    for e in range(E):
        out[names["w1"][e]] = _values(rng, (I, H), dtype)
        out[names["w2"][e]] = _values(rng, (H, I), dtype)
        out[names["w3"][e]] = _values(rng, (I, H), dtype)
    return out


FUSED_GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
FUSED_DOWN = "model.layers.0.mlp.experts.down_proj"


def fused_tensors(rng, dtype):
    return {FUSED_GATE_UP: _values(rng, (E, 2 * I, H), dtype), FUSED_DOWN: _values(rng, (E, H, I), dtype)}


def write_sharded(folder, tensors: dict, dtype: str, shards=2):
    """A sharded checkpoint as transformers writes one: model-0000k-of-0000n.safetensors and the index."""
    folder.mkdir(exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]  # one expert's tensors spread over both files
        write_file(folder / file, {n: tensors[n] for n in part}, dtype)
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return folder


def numpy_dtype(dtype: str):
    """NumPy's type for `dtype` (bf16 through ml_dtypes, as StrideWeave exports it); the values converted are exact."""
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {"float32": np.float32, "float16": np.float16}[dtype]


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def values(t) -> np.ndarray:
    """A StrideWeave tensor's values by coordinate, widened exactly to Float64."""
    return np.asarray(t).astype(np.float64)


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["one_file", "sharded_folder", "file_list"])
def test_every_tensor_matches_the_packages_load(tmp_path, rng, dtype, layout):
    tensors = per_expert_tensors(rng, dtype)
    tensors.update(fused_tensors(rng, dtype))
    if layout == "one_file":
        write_file(tmp_path / "model.safetensors", tensors, dtype, metadata={"format": "pt"})
        ckpt = sw.safetensors.open(tmp_path / "model.safetensors")
        ref = reference(tmp_path / "model.safetensors")
        assert ckpt.metadata == {"format": "pt"}
    else:
        folder = write_sharded(tmp_path / "ckpt", tensors, dtype)
        files = sorted(folder.glob("*.safetensors"))
        ckpt = sw.safetensors.open(folder if layout == "sharded_folder" else [str(f) for f in files])
        ref = {}
        for f in files:
            ref.update(reference(f))
    assert ckpt.keys() == sorted(tensors)
    assert len(ckpt) == len(tensors) and FUSED_DOWN in ckpt and "missing" not in ckpt
    assert ckpt.bytes_read == 0  # opening reads headers only (Note [A header is checked before any read])
    for name in ckpt.keys():
        assert ckpt.dtype(name) is getattr(sw.DType, SW_DTYPE[dtype])
        assert ckpt.shape(name) == tuple(tensors[name].shape)
        t = ckpt.tensor(name)
        assert t.layout == sw.row_major(*ckpt.shape(name))  # its own shape, row-major strides
        assert isinstance(t.carrier, sw.safetensors.CheckpointCarrier) and t.carrier.range_count == 1
        np.testing.assert_array_equal(values(t), ref[name])
    total = sum(ITEMSIZE[dtype] * int(np.prod(v.shape)) for v in tensors.values())
    assert ckpt.bytes_read == total  # each tensor's bytes once


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_per_expert_tensors_and_fused_tensors_give_the_same_full_tensor(tmp_path, rng, dtype):
    per_expert = per_expert_tensors(rng, dtype)
    names = per_expert_names()
    # The fused checkpoint holds the same experts: gate_up_proj[e] = cat(w1, w3), down_proj[e] = w2.
    fused = {
        FUSED_GATE_UP: torch.stack([torch.cat([per_expert[names["w1"][e]], per_expert[names["w3"][e]]]) for e in range(E)]),
        FUSED_DOWN: torch.stack([per_expert[names["w2"][e]] for e in range(E)]),
    }
    write_file(tmp_path / "experts.safetensors", per_expert, dtype)
    write_file(tmp_path / "fused.safetensors", fused, dtype)
    a = sw.safetensors.open(tmp_path / "experts.safetensors")
    b = sw.safetensors.open(tmp_path / "fused.safetensors")
    ref = reference(tmp_path / "experts.safetensors")

    w2 = a.tiled(names["w2"])
    down = b.tiled(FUSED_DOWN)
    assert w2.layout.shape == down.layout.shape == sw.Shape(H, I, E)
    assert w2.layout == down.layout  # (*shape, E): row-major strides within a tile, the tile size across
    assert w2.carrier.grid_shape == (1, 1, E) and w2.carrier.tile_shape == (H, I, 1)
    expected = np.stack([ref[n] for n in names["w2"]], axis=-1)
    np.testing.assert_array_equal(values(w2), expected)
    np.testing.assert_array_equal(values(down), expected)

    gate_up = b.tiled(FUSED_GATE_UP)
    assert gate_up.layout.shape == sw.Shape(2 * I, H, E) and gate_up.carrier.secondary.range_count == E
    np.testing.assert_array_equal(
        values(gate_up), np.stack([np.concatenate([ref[names["w1"][e]], ref[names["w3"][e]]]) for e in range(E)], axis=-1)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_promoting_and_projecting_a_few_experts_reads_only_their_bytes(tmp_path, rng, dtype, fused):
    tensors = fused_tensors(rng, dtype) if fused else per_expert_tensors(rng, dtype)
    folder = write_sharded(tmp_path / "ckpt", tensors, dtype)
    ckpt = sw.safetensors.open(folder)
    names = per_expert_names()["w1"]
    full = ckpt.tiled(FUSED_DOWN) if fused else ckpt.tiled(names)
    ref = reference(folder / "model-00001-of-00002.safetensors") | reference(folder / "model-00002-of-00002.safetensors")
    expert = (lambda e: ref[FUSED_DOWN][e]) if fused else (lambda e: ref[names[e]])
    shape = ckpt.shape(FUSED_DOWN)[1:] if fused else ckpt.shape(names[0])
    tile_bytes = ITEMSIZE[dtype] * int(np.prod(shape))
    r = len(shape)
    carrier = full.carrier
    assert isinstance(carrier, sw.TiledEvictable) and ckpt.bytes_read == 0

    carrier.promote(sw.TileSelection(((0,),) * r + ((1, 3),)))
    assert ckpt.bytes_read == 2 * tile_bytes  # one read per promoted tile, nothing else
    assert carrier.primary_tiles == sw.TileSet(((0,) * r + (1,), (0,) * r + (3,)))

    compact = carrier.project(full, sw.TileSelection(((0,),) * r + ((3, 1),))).wait()
    assert ckpt.bytes_read == 2 * tile_bytes  # both were resident
    assert compact.layout.shape == sw.Shape(*shape, 2)
    np.testing.assert_array_equal(values(compact), np.stack([expert(3), expert(1)], axis=-1))

    one = carrier.project(full, sw.TileSelection(((0,),) * r + ((2,),))).wait()
    assert ckpt.bytes_read == 3 * tile_bytes
    np.testing.assert_array_equal(values(one)[..., 0], expert(2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_a_fresh_tensor_and_leaves_the_file_alone(tmp_path, rng, dtype):
    tensors = per_expert_tensors(rng, dtype)
    path = tmp_path / "model.safetensors"
    write_file(path, tensors, dtype)
    before = sha256(path)
    ckpt = sw.safetensors.open(path)
    names = per_expert_names()["w2"]
    full = ckpt.tiled(names)
    new = _values(rng, (H, I, 2), dtype).to(torch.float64).numpy()
    compact = sw.friendly.tensor(new.astype(numpy_dtype(dtype)), dtype=getattr(sw.DType, SW_DTYPE[dtype]))
    sel = sw.TileSelection(((0,), (0,), (2, 0)))
    ref = reference(path)
    source = np.stack([ref[n] for n in names], axis=-1)
    out = full.carrier.scatter(compact, full, sel).wait()  # a fresh carrier: its other tiles are invalid
    np.testing.assert_array_equal(values(out.carrier.project(out, sel).wait()), new)
    added = full.carrier.scatter(compact, full, sel, reduction="add").wait()
    # The Float32 sum, rounded once to the dtype: exact agreement for f32 (numpy rounds the same sum once). A
    # bf16/f16 result is that sum rounded to the dtype, within one unit in its last place (relative 2**-7 bf16,
    # 2**-10 f16; absolute 2**-24 in f16's subnormal range).
    want = (new.astype(np.float32) + source[..., [2, 0]].astype(np.float32)).astype(np.float64)
    rtol, atol = {"float32": (0.0, 0.0), "bfloat16": (2.0**-7, 0.0), "float16": (2.0**-10, 2.0**-24)}[dtype]
    np.testing.assert_allclose(values(added.carrier.project(added, sel).wait()), want, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(values(full), source)  # the template is unchanged
    assert sha256(path) == before


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mutable", [False, True], ids=["overlay", "in_place"])
def test_evicting_dirty_tiles(tmp_path, rng, dtype, mutable):
    """mutable=False: the evicted dirty tile goes to the scratch overlay, the file is unchanged (same hash) and the
    tile reads back its new values; mutable=True writes the tile where it lies in the file."""
    tensors = per_expert_tensors(rng, dtype)
    path = tmp_path / "model.safetensors"
    write_file(path, tensors, dtype)
    before = sha256(path)
    names = per_expert_names()["w1"]
    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(names, mutable=mutable)
    carrier, tier = full.carrier, full.carrier.secondary
    assert tier.writes == ("in_place" if mutable else "overlay")
    sel = sw.TileSelection(((0,), (0,), (1,)))
    carrier.promote(sel)
    full[(2, 3, 1)] = 0.5
    full[(0, 0, 1)] = -2.0
    assert carrier.tile_state((0, 0, 1)).dirty
    carrier.evict(sel)
    state = carrier.tile_state((0, 0, 1))
    assert state.location == "secondary" and not state.dirty

    original = {k: v.to(torch.float64).numpy() for k, v in tensors.items()}
    written = np.stack([original[n] for n in names], axis=-1)
    written[2, 3, 1], written[0, 0, 1] = 0.5, -2.0
    np.testing.assert_array_equal(values(full), written)  # the tile reads back its new values either way
    now = reference(path)  # the file's values, as the package loads them
    if mutable:
        assert sha256(path) != before and tier.overlaid_ranges == 0
        np.testing.assert_array_equal(now[names[1]], written[..., 1])
        carrier.flush()
    else:
        assert sha256(path) == before and tier.overlaid_ranges == 1
        np.testing.assert_array_equal(now[names[1]], original[names[1]])
    for n in names[:1] + names[2:]:
        np.testing.assert_array_equal(now[n], original[n])
    # A fresh reader sees the file: the new values only where they were written in place.
    again = sw.safetensors.open(path).tensor(names[1])
    assert (values(again)[2, 3] == 0.5) == mutable
    carrier.release()


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_tiles_are_mapped_copy_on_write_and_the_file_never_changes(tmp_path, rng, dtype):
    """Tiles of 1 MiB and more of a read-only checkpoint are promoted by mapping the file's pages copy-on-write
    (Note [Promotion by mapping]): the values are the package's, a write changes the tile and never the file, the
    dirty tile goes to the overlay and reads back its new values, and eviction gives the mapping back."""
    rows = 512
    cols = (1 << 20) // (rows * ITEMSIZE[dtype])  # 1 MiB per expert
    names = [f"experts.{e}.weight" for e in range(3)]
    tensors = {n: _values(rng, (rows, cols), dtype) for n in names}
    path = tmp_path / "model.safetensors"
    write_file(path, tensors, dtype)
    before = sha256(path)
    full = sw.safetensors.open(path).tiled(names)
    carrier = full.carrier
    resolved = os.path.realpath(path)

    def mapped() -> bool:
        with open("/proc/self/maps") as fh:
            return any(line.rstrip("\n").endswith(resolved) for line in fh)

    original = np.stack([tensors[n].to(torch.float64).numpy() for n in names], axis=-1)
    sel = sw.TileSelection(((0,), (0,), (0, 2)))
    carrier.promote(sel)
    assert mapped()
    np.testing.assert_array_equal(values(full), original)
    full[(7, 9, 2)] = 0.25
    carrier.evict(sel)
    assert not mapped()
    assert sha256(path) == before and carrier.secondary.overlaid_ranges == 1
    original[7, 9, 2] = 0.25
    np.testing.assert_array_equal(values(full), original)
    carrier.release()


# ---------------------------------------------------------------- saving


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_then_reopen_with_strideweave_and_the_package(tmp_path, rng, dtype):
    tensors = per_expert_tensors(rng, dtype)
    src = tmp_path / "model.safetensors"
    write_file(src, tensors, dtype)
    ckpt = sw.safetensors.open(src)
    names = per_expert_names()["w3"]
    full = ckpt.tiled(names)
    full.carrier.promote(sw.TileSelection(((0,), (0,), (2,))))  # one tile resident, the others read where they lie
    dense = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = tmp_path / "out.safetensors"
    sw.safetensors.save(
        out,
        {"single": ckpt.tensor(names[0]), "experts": full, "dense": sw.friendly.tensor(dense)},
        metadata={"format": "pt", "note": "saved by StrideWeave"},
    )
    ref = reference(src)
    stacked = np.stack([ref[n] for n in names], axis=-1)
    with safetensors.safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "saved by StrideWeave"}
        assert sorted(f.keys()) == ["dense", "experts", "single"]
        np.testing.assert_array_equal(f.get_tensor("single").to(torch.float64).numpy(), ref[names[0]])
        np.testing.assert_array_equal(f.get_tensor("experts").to(torch.float64).numpy(), stacked)
        np.testing.assert_array_equal(f.get_tensor("dense").numpy(), dense)
    back = sw.safetensors.open(out)
    assert back.shape("experts") == (I, H, E) and back.metadata["note"] == "saved by StrideWeave"
    np.testing.assert_array_equal(values(back.tensor("experts")), stacked)
    split = back.tiled("experts")  # the slabs of its first axis: shape (H, E, I), slab i = stacked[i]
    assert split.layout.shape == sw.Shape(H, E, I)
    np.testing.assert_array_equal(values(split), np.moveaxis(stacked, 0, -1))
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "out.safetensors"]  # no temporary file left


# ---------------------------------------------------------------- hostile headers


def _header_file(path, header, data: bytes, length=None):
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HOSTILE = {
    "truncated": (lambda p: p.write_bytes(b"\x05\x00\x00"), "fewer than the 8-byte header length"),
    "oversized_length": (lambda p: _header_file(p, {"a": F32_2}, bytes(8), length=1 << 40), "exceeds the limit"),
    "length_past_the_end": (lambda p: _header_file(p, {"a": F32_2}, bytes(8), length=4096), "runs past the end of the file"),
    "overlapping_ranges": (
        lambda p: _header_file(p, {"a": F32_2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
        "overlap",
    ),
    "unknown_dtype": (lambda p: _header_file(p, {"a": {**F32_2, "dtype": "X9"}}, bytes(8)), "unknown dtype 'X9'"),
    "shape_size_mismatch": (lambda p: _header_file(p, {"a": {**F32_2, "shape": [3]}}, bytes(8)), "needs 12 bytes"),
    "range_past_the_end": (
        lambda p: _header_file(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
        "run past the end of the data area",
    ),
    "not_json": (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{nope"), "not well-formed JSON"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_raise_value_error_and_leave_nothing_open(tmp_path, case):
    make, fragment = HOSTILE[case]
    good = tmp_path / "good.safetensors"
    safetensors.numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(good))
    bad = tmp_path / "bad.safetensors"
    make(bad)
    before = sha256(bad)
    for paths in (bad, [good, bad]):
        with pytest.raises(ValueError, match=fragment) as info:
            sw.safetensors.open(paths)
        assert str(bad) in str(info.value)  # names the file
        assert str(bad) not in open_files() and str(good) not in open_files()
    assert sha256(bad) == before
    if case in ("unknown_dtype", "shape_size_mismatch", "range_past_the_end"):
        assert "'a'" in str(info.value)  # and the tensor


def test_a_sharded_index_naming_a_missing_tensor_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    write_sharded(folder, {"a": torch.ones(2), "b": torch.zeros(3)}, "float32")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'c'"):
        sw.safetensors.open(folder)
    assert not any(str(folder) in f for f in open_files())


# ---------------------------------------------------------------- the Python face's own errors


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.safetensors"
    safetensors.torch.save_file(
        {
            "a": torch.ones(2, 3),
            "b": torch.ones(2, 3),
            "c": torch.ones(3, 2),
            "scalar": torch.tensor(1.0),
            "empty": torch.ones(0, 4),
            "ints64": torch.ones(2, dtype=torch.int64),
        },
        str(path),
    )
    return path


ERRORS = {
    "unknown_name": (lambda c: c.tensor("nope"), ValueError, "holds no tensor named 'nope'"),
    "name_not_str": (lambda c: c.tensor(3), TypeError, "must be a str"),
    "dtype_without_dtype": (lambda c: c.dtype("ints64"), TypeError, "I64 elements"),
    "tensor_with_empty_mode": (lambda c: c.tensor("empty"), ValueError, "extent 0"),
    "tiled_no_names": (lambda c: c.tiled([]), ValueError, "at least one tensor name"),
    "tiled_not_names": (lambda c: c.tiled(3), TypeError, "a tensor name or a sequence"),
    "tiled_name_not_str": (lambda c: c.tiled(["a", 1]), TypeError, "each tensor name must be a str"),
    "tiled_shapes_differ": (lambda c: c.tiled(["a", "c"]), ValueError, "share dtype and shape"),
    "tiled_repeated_name": (lambda c: c.tiled(["a", "a"]), ValueError, "named twice"),
    "tiled_split_rank_0": (lambda c: c.tiled("scalar"), ValueError, "rank 0"),
    "tiled_split_empty": (lambda c: c.tiled("empty"), ValueError, "extent 0"),
    "tiled_primary_not_carrier": (lambda c: c.tiled(["a", "b"], primary=3), TypeError, "primary must be a Carrier"),
    "tiled_bad_policy": (lambda c: c.tiled(["a", "b"], residency_policy=3), TypeError, "ResidencyPolicy"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_checkpoint_errors(small, case):
    call, kind, fragment = ERRORS[case]
    before = sha256(small)
    ckpt = sw.safetensors.open(small)
    with pytest.raises(kind, match=fragment):
        call(ckpt)
    assert ckpt.bytes_read == 0 and sha256(small) == before  # nothing read, nothing written
    assert ckpt.keys() == ["a", "b", "c", "empty", "ints64", "scalar"]
    np.testing.assert_array_equal(values(ckpt.tensor("a")), np.ones((2, 3)))  # still usable


def test_constructors_are_refused():
    with pytest.raises(TypeError, match="use sw.safetensors.open"):
        sw.safetensors.Checkpoint()
    with pytest.raises(TypeError, match="use sw.safetensors.open"):
        sw.safetensors.CheckpointCarrier()
    with pytest.raises(TypeError):
        sw.safetensors.open([3])


SAVE_ERRORS = {
    "not_a_dict": (lambda t: [t], None, TypeError, "a dict of name -> Tensor"),
    "value_not_tensor": (lambda t: {"a": 3}, None, TypeError, "tensor 'a' is a int, not a Tensor"),
    "name_not_str": (lambda t: {1: t}, None, TypeError, "a tensor name must be a str"),
    "empty_name": (lambda t: {"": t}, None, ValueError, "must not be empty"),
    "metadata_not_dict": (lambda t: {"a": t}, ["x"], TypeError, "metadata must be a dict"),
    "metadata_value_not_str": (lambda t: {"a": t}, {"k": 1}, TypeError, "a metadata value must be a str"),
}


@pytest.mark.parametrize("case", sorted(SAVE_ERRORS))
def test_save_errors_leave_no_file(tmp_path, case):
    tensors, metadata, kind, fragment = SAVE_ERRORS[case]
    out = tmp_path / "out.safetensors"
    with pytest.raises(kind, match=fragment):
        sw.safetensors.save(out, tensors(sw.friendly.tensor([1.0, 2.0])), metadata=metadata)
    assert os.listdir(tmp_path) == []


def test_a_2_gib_bf16_checkpoint_reads_only_the_projected_experts(tmp_path):
    """Opening a 2 GiB bf16 checkpoint and projecting a few experts touches only those experts' bytes.

    The file is sparse (a header, then a 2 GiB data area that is a hole: it reads as zeros and takes no disk), so
    the test costs what it reads: 3 experts of 32 MiB. The counts come from the engine's own stats
    (``ckpt.bytes_read``, the primary tier's tiles) and from the kernel's count of bytes this process read.
    """
    experts, out, inp = 64, 4096, 4096  # 64 x 32 MiB bf16 = 2 GiB
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(experts)]
    size = out * inp * 2
    header = {n: {"dtype": "BF16", "shape": [out, inp], "data_offsets": [e * size, (e + 1) * size]}
              for e, n in enumerate(names)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        fh.truncate(8 + len(text) + experts * size)
    assert os.path.getsize(path) >= 2 << 30

    ckpt = sw.safetensors.open(path)
    full = ckpt.tiled(names)
    assert full.layout.shape == sw.Shape(out, inp, experts) and ckpt.bytes_read == 0
    picked = (5, 17, 63)
    compact = full.carrier.project(full, sw.TileSelection(((0,), (0,), picked))).wait()
    assert np.asarray(compact).shape == (out, inp, len(picked))
    assert ckpt.bytes_read == len(picked) * size  # exactly the three experts' bytes
    assert full.carrier.stats()["primary_tiles"] == len(picked)
    assert not np.asarray(compact).view(np.uint16).any()  # the hole reads as zeros
    full.carrier.release()
