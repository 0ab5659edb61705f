"""``save_pretrained``: the whole model written back as a Hugging Face checkpoint (docs/guide.md, "Opening a Hugging
Face MoE bigger than RAM").

Note [Saving a model whose experts are tiles]
A model whose experts are bound to a checkpoint's tiles has no expert parameters, so transformers' own
``save_pretrained`` cannot write it (it is refused, ``_guards``). ``save_pretrained`` here writes what transformers
would write for the untouched model, from two sources:

* the non-expert weights: the model's state dict (read inside ``_guards.saving_state``, which lets it through),
  tied weights removed and names converted back to the checkpoint's by transformers' own functions
  (``remove_tied_weights_from_state_dict``, ``revert_weight_conversion``: Mixtral's ``.mlp.`` back to
  ``.block_sparse_moe.``, Phi-MoE's router, any family's renames), exactly as ``PreTrainedModel.save_pretrained``
  does. The tensors cross to StrideWeave without a copy (``from_torch``); an experts module left in RAM (``layers=``)
  is converted back by transformers like any other weight.
* the experts: each binding's tiled tensors, under the checkpoint's own names and layout (``checkpoint_names``):
  one ``(rows, cols)`` matrix per expert and projection, one ``(E, rows, cols)`` tensor for fused forms, DBRX's
  ``(E * rows, cols)``. Each is a tensor over the tiles' carrier in the file's row-major order (a tile's bytes are
  contiguous slots of the carrier), so ``strideweave.safetensors.save`` (C++) reads it in bounded chunks, tile range
  by tile range: a resident tile from memory (its fine-tuned values), any other from its tier (the checkpoint, or
  the overlay holding its evicted writes) without promoting it. No expert is ever gathered whole.

Memory: the non-expert tensors are the model's own (no copy; only a conversion that builds new tensors, rare for
non-expert weights, allocates), and the experts cost the writer's chunk buffer (8 MiB), well inside the residency
budget, which saving leaves untouched.

Note [Quantized checkpoints when saving]
A model opened from an FP8 or MXFP4 checkpoint computes in its dtype (BFloat16): transformers dequantized its
non-expert weights at load, and the experts' tiles are dequantized on promotion, their updates kept in the overlay
in that dtype. By default it is saved so: every tensor in the model's dtype, the experts under their logical names
in the module's own form (MXFP4's ``gate_up_proj`` as the module's (E, H, 2I), a transposed view of the tiles), and
config.json without ``quantization_config``: a plain checkpoint. ``quantize=True`` writes the checkpoint's format
back: each tensor the source checkpoint stores quantized (experts and, for FP8, the non-expert linears) is passed
to ``strideweave.safetensors.save(quantize=)``, which quantizes it matrix by matrix in C++ as it reads it (FP8: e4m3
values and Float32 ``weight_scale_inv`` recomputed per block of the source's block size; MXFP4: ``X_blocks`` and
``X_scales`` of the stored (out, in) form), and config.json carries the checkpoint's ``quantization_config``. The
index's ``weight_map`` and ``total_size`` name and count the tensors as written.

Layout of the folder (what transformers writes, always the sharded form): ``config.json`` (with ``dtype`` and
``architectures`` set as transformers sets them, the model's config itself unchanged), ``generation_config.json``
when the model can generate, ``model-0000i-of-0000n.safetensors`` (metadata ``{"format": "pt"}``) and
``model.safetensors.index.json`` (``metadata``: ``total_size`` in bytes and ``total_parameters``; ``weight_map``),
also for a single shard, and never a ``model.safetensors`` (transformers would prefer it to the index). Tensors are
ordered by transformers' natural key of their names (a layer's weights together) and packed greedily into shards of
at most ``max_shard_size`` bytes (huggingface_hub's rule; a tensor larger than that gets a shard of its own).

Atomicity (Note [Replacing a folder whole] in cpp/src/checkpoint/save.cpp): everything is written into a new
folder ``.<name>.tmp-<pid>-<n>`` beside the target (same file system), every file synced, and the folder is then
moved to the target in one rename: a new target by a rename that never replaces, an existing target folder by
``renameat2(RENAME_EXCHANGE)``, after which the old folder (now under the temporary's name) is removed. The target
is therefore at every moment the old folder or the new one. An error removes the temporary folder (and the parent
folders this call created) and leaves the target as it was; a process killed part-way leaves its temporary folder,
which the next save to the same target removes (its process is gone). Saving into the folder the model was opened
from works: the open checkpoint keeps reading its files, which stay alive (open or mapped) after the old folder is
removed.

Note [Saving across ranks]
A model opened with a process group of N > 1 ranks (Note [Experts across ranks] in ``_distributed``) is saved by
every rank calling ``save_pretrained(model, folder)`` (collective) into ONE checkpoint, laid out as above, with no
tensor ever gathered or sent over the network: each rank plans the tensors it holds (``collect(rank=)``): rank 0 the
non-expert tensors (replicated: every rank holds the same) and its own experts, rank r > 0 its own experts (the
share ``experts_range``), each read from its tiles as in one process, and packs them into shards by the same greedy
rule. The ranks then agree by ``torch.distributed.all_gather_object`` (which is also the barrier) in three phases:
  1. each rank's shard count (the files are numbered rank after rank, ``model-0000i-of-0000n`` with n the total),
     and the temporary folder rank 0 made beside the target (the folder must be on a file system every rank sees);
     a checkpoint storing all of a layer's experts in one tensor per projection (fused forms such as GPT-OSS's
     (E, H, 2I), DBRX's split (E * rows, cols)) has tensors no rank holds whole: these "joint" tensors get shards
     of their own, numbered after the ranks' (the same plan on every rank: every rank binds the whole tensors), and
     rank 0 creates each joint shard's file, its header and its full size (a sparse file), before phase 2;
  2. each rank writes its shards into that folder, and its slice of each joint tensor (its experts' rows,
     contiguous in the tensor's expert-major row-major order): streamed from its tiles by the shard writer into a
     file of its own beside them, whose data bytes it copies into place in the joint shard (``pwrite`` at the
     slice's offset; each rank writes disjoint bytes) and syncs; each rank sends {stored tensor name: (file,
     bytes)};
  3. rank 0 checks that no tensor was written twice, writes config.json, generation_config.json and the one index
     (``weight_map`` the union of the ranks' lists, ``total_size`` their sum, ``total_parameters`` the model's count
     as in one process) and installs the folder by the same rename as in one process.
Every phase ends with each rank's error (or None) exchanged: when any rank failed, rank 0 removes the temporary
folder (and the parents it made), the rank that failed raises its own error and every other rank RuntimeError
naming the failed ranks and their errors, so nothing appears under the target name and every rank raises.
``quantize=True`` works per rank as in one process (each tensor quantized by its writer) for checkpoints storing
one matrix per expert; for joint tensors it is refused (TypeError on every rank, before anything is written: a
quantized tensor's blocks and scales are not laid out as one slice per rank).
"""

from __future__ import annotations

import copy
import errno
import itertools
import json
import os
import shutil
from typing import Any

from ._bridge import _sw, _torch, from_torch

WEIGHTS_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_COUNTER = itertools.count(1)


def shard_size(max_shard_size: Any, what: str = "save_pretrained") -> int:
    """`max_shard_size` in bytes: an int, or a string as transformers takes it ("5GB" = 5 * 10**9, "500MiB" =
    500 * 2**20; huggingface_hub's parser). TypeError for another type, ValueError for a string that is no size or
    a size <= 0."""
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        raise TypeError(f"{what}: max_shard_size must be a byte count (int) or a size string such as \"5GB\", got "
                        f"{type(max_shard_size).__name__}")
    if isinstance(max_shard_size, str):
        from huggingface_hub.serialization._base import parse_size_to_int
        try:
            size = parse_size_to_int(max_shard_size)
        except ValueError as e:
            raise ValueError(f"{what}: max_shard_size {max_shard_size!r} is not a size ({e})") from None
    else:
        size = max_shard_size
    if size <= 0:
        raise ValueError(f"{what}: max_shard_size must be > 0 bytes, got {max_shard_size!r}")
    return int(size)


def _write_shard(path: str, tensors: dict, metadata: dict, quantize: Any = None) -> None:
    """Writes one shard (strideweave.safetensors.save: C++, tiled tensors read tile range by tile range; the
    tensors named in `quantize` quantized matrix by matrix as they are read)."""
    if quantize:
        _sw().safetensors.save(path, tensors, metadata, quantize=quantize)
    else:
        _sw().safetensors.save(path, tensors, metadata)


def _strides(layout: Any) -> list:
    """The stride of each top-level mode of a flat layout (its value at the unit coordinates)."""
    rank = layout.rank
    origin = layout([0] * rank)
    return [layout([1 if j == k else 0 for j in range(rank)]) - origin for k in range(rank)]


def in_one_tensor(binding: Any) -> bool:
    """Whether the checkpoint stores all of a binding's experts of a projection in one tensor (fused forms, DBRX's
    split form) rather than one matrix per expert."""
    return binding.fused or (len(next(iter(binding.checkpoint_names.values()))) == 1 and binding.spec.experts > 1)


def expert_tensors(binding: Any, *, requantize: bool = False, experts: Any = None, joint: Any = None) -> dict:
    """{checkpoint name: StrideWeave tensor} of one binding's experts, in the checkpoint's own shape and row-major
    order, each a view of the tiles' carrier (no value read, nothing copied). Quantized experts (Note [Quantized
    checkpoints when saving]) are given under their logical names in the module's own form, or, `requantize`, in the
    form the checkpoint quantized them. `experts` (a contiguous range; default all): only those experts' matrices;
    a tensor holding every expert (fused forms, DBRX's split form) is then given as the slice of those experts (its
    rows, expert-major), and `joint` (a dict) receives {name: (the whole tensor's shape, the slice's first element
    in the whole tensor's row-major order)} for each such tensor."""
    sw = _sw()
    share = experts
    out = {}
    for role, names in binding.checkpoint_names.items():
        t = binding.tiled[role]
        if t.layout.rank != 3:
            raise TypeError(f"{binding.name}: the {role} tiles have layout {t.layout}; (rows, cols, experts) expected")
        rows, cols, experts = (int(x) for x in t.shape.extents)
        s_rows, s_cols, s_tile = _strides(t.layout)
        lo, n = (share.start, len(share)) if share is not None else (0, experts)
        if n == 0 and in_one_tensor(binding):
            if joint is not None:
                shape = [experts * rows, cols] if not binding.fused else \
                    [experts, cols, rows] if binding.tiles_transposed != binding.spec.transposed and not requantize \
                    else [experts, rows, cols]
                joint[names[0]] = (shape, 0, t.dtype())
            continue
        if binding.fused and not requantize and binding.tiles_transposed != binding.spec.transposed:
            # (E, cols, rows): the module's form of (out, in) tiles, a transposed view (the writer reads any layout)
            layout = sw.Layout(sw.Shape(n, cols, rows), sw.Stride(s_tile, s_cols, s_rows))
            out[names[0]] = sw.Tensor(t.carrier, t.offset + lo * s_tile, layout)
            whole = [experts, cols, rows]
        elif binding.fused:  # (E, rows, cols)
            layout = sw.Layout(sw.Shape(n, rows, cols), sw.Stride(s_tile, s_rows, s_cols))
            out[names[0]] = sw.Tensor(t.carrier, t.offset + lo * s_tile, layout)
            whole = [experts, rows, cols]
        elif len(names) == 1 and experts > 1:  # DBRX's split form: (E * rows, cols), expert e the rows [e*rows, ..)
            layout = sw.Layout(sw.Shape([rows, n], cols), sw.Stride([s_rows, s_tile], s_cols))
            out[names[0]] = sw.Tensor(t.carrier, t.offset + lo * s_tile, layout)
            whole = [experts * rows, cols]
        else:  # one (rows, cols) matrix per expert
            if len(names) != experts:
                raise ValueError(f"{binding.name}: {len(names)} checkpoint names for {experts} {role} tiles")
            layout = sw.Layout(sw.Shape(rows, cols), sw.Stride(s_rows, s_cols))
            for e, name in enumerate(names):
                if share is None or e in share:
                    out[name] = sw.Tensor(t.carrier, t.offset + e * s_tile, layout)
            continue
        if joint is not None:
            joint[names[0]] = (whole, lo * rows * cols, t.dtype())
    return out


def _nbytes(t: Any) -> int:
    n = 1
    for d in t.shape.extents:
        n *= int(d)
    return n * (t.dtype().bits // 8)


def non_expert_tensors(model: Any) -> dict:
    """{checkpoint name: torch tensor} of the model's weights other than its bound experts, as transformers'
    ``save_pretrained`` names and keeps them (tied weights removed, conversions reverted)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from ._guards import saving_state
    with saving_state():
        state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    return revert_weight_conversion(model, state)


def _natural_key(name: str) -> Any:
    from transformers.core_model_loading import dot_natural_key
    return dot_natural_key(name)


def _scale_name(name: str) -> str:
    """Where sw.safetensors.save writes an FP8 tensor's scales (the reader's naming rule, first candidate)."""
    return name[:-len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _stored(name: str, t: Any, spec: Any) -> list:
    """[(name in the file, bytes)] of tensor `name` written as `spec` (None: as it is; "mxfp4"; ("fp8", block))."""
    if spec is None:
        return [(name, _nbytes(t))]
    extents = [int(x) for x in t.shape.extents]
    n = _prod(extents)
    if spec == "mxfp4":
        return [(name + "_blocks", n // 2), (name + "_scales", n // 32)]
    (br, bc) = spec[1]
    lead = _prod(extents[:-2])
    scales = lead * -(-extents[-2] // br) * -(-extents[-1] // bc)
    return [(name, n), (_scale_name(name), 4 * scales)]


def _format_of(q: Any) -> Any:
    """The sw.safetensors.save quantize= entry re-creating the checkpoint's format `q` (a Quantized)."""
    return "mxfp4" if q.format == "mxfp4" else ("fp8", tuple(int(b) for b in q.block))


def plan(model: Any, max_shard_size: int, what: str, quantize: bool = False) -> tuple:
    """(shards: [[(name, StrideWeave tensor)]], total bytes, total parameters, {name: quantize= entry}); checks
    everything, writes nothing. `quantize`: every tensor the source checkpoint stores quantized is written in its
    format (Note [Quantized checkpoints when saving])."""
    tensors, params, formats, _ = collect(model, what, quantize)
    shards, total = pack(tensors, formats, max_shard_size)
    return shards, total, params, formats


def collect(model: Any, what: str, quantize: bool = False, *, rank: Any = None) -> tuple:
    """({name: StrideWeave tensor}, total parameters, {name: quantize= entry}, joint) of what `model` saves; with
    `rank` (a model sharded over ranks, Note [Saving across ranks]), what that rank writes: the non-expert tensors
    on rank 0 only, and the rank's own experts (``experts_range``); a tensor holding every expert of a layer is then
    in `joint` ({name: (whole shape, the rank's slice's first element, dtype, the slice or None)}) rather than in
    the tensors."""
    from ._experts import _quantized
    from ._offload import offloaded_experts
    bindings = offloaded_experts(model)
    if not bindings:
        raise TypeError(f"{what}: {type(model).__name__} has no experts bound to checkpoint tiles; open it with "
                        "strideweave.torch.from_pretrained or bind them with strideweave.torch.offload_experts "
                        "(a model in RAM saves with its own save_pretrained)")
    torch = _torch()
    formats: dict = {}
    if quantize:
        if model.__dict__.get("_strideweave_quantization") is None:
            raise ValueError(f"{what}: quantize=True re-quantizes a model opened by strideweave.torch.from_pretrained "
                             f"from a quantized checkpoint (FP8 or MXFP4); {type(model).__name__} was not")
        source = next(iter(bindings.values())).checkpoint
    tensors: dict = {}
    joint: dict = {}
    # transformers' count for the untouched model: its parameters (tied ones once) plus the bound experts'
    params = model.num_parameters() if hasattr(model, "num_parameters") else 0
    for name, value in (non_expert_tensors(model) if not rank else {}).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: the state dict entry {name!r} is a {type(value).__name__}, not a tensor")
        try:
            tensors[name] = from_torch(value.detach())
        except (TypeError, ValueError, BufferError) as e:
            raise TypeError(f"{what}: {name!r} ({value.dtype}, shape {tuple(value.shape)}) cannot be written: "
                            f"{e}") from None
        if quantize and (q := _quantized(source, name)) is not None:
            flipped = tuple(value.shape[:-2]) + (value.shape[-1], value.shape[-2]) if value.dim() >= 2 else None
            if q.format == "mxfp4" and tuple(q.shape) == flipped and flipped != tuple(value.shape):
                # experts left in RAM (layers=) in a transposed module's form: MXFP4 stores them (out, in)
                tensors[name] = from_torch(value.detach().transpose(-1, -2).contiguous())
            elif tuple(q.shape) != tuple(value.shape):
                raise ValueError(f"{what}: quantize=True: {name!r} is {tuple(value.shape)} in the model, the "
                                 f"checkpoint quantized it as {tuple(q.shape)} ({q})")
            formats[name] = _format_of(q)
    for b in bindings.values():
        if rank is not None and in_one_tensor(b) and quantize:
            raise TypeError(f"{what}: {b.name}: quantize=True across ranks re-quantizes checkpoints storing one "
                            "matrix per expert; this one stores all its experts in one tensor per projection "
                            f"({', '.join(ns[0] for ns in b.checkpoint_names.values())}) (nothing was written)")
        share = b.experts_range if rank is not None else None
        info: dict = {}
        for name, t in expert_tensors(b, requantize=quantize, experts=share,
                                      joint=info if rank is not None else None).items():
            if name in info:
                joint[name] = info.pop(name) + (t,)
                continue
            if name in tensors:
                raise ValueError(f"{what}: {name!r} is both a weight of the model and an expert tensor of {b.name}")
            tensors[name] = t
            if quantize and name in b.quantized:
                formats[name] = _format_of(b.quantized[name])
        joint.update({name: v + (None,) for name, v in info.items()})  # an empty share: nothing of it here
        params += sum(_prod(shape) for shape in b.spec.shapes.values())
    return tensors, params, formats, joint


def pack(tensors: dict, formats: dict, max_shard_size: int) -> tuple:
    """(shards: [[(name, tensor)]], total bytes): huggingface_hub's greedy rule in transformers' order."""
    shards: list = []
    current: list = []
    size = total = 0
    for name in sorted(tensors, key=_natural_key):  # huggingface_hub's greedy rule, in transformers' order
        t = tensors[name]
        n = sum(size_of for _, size_of in _stored(name, t, formats.get(name)))
        total += n
        if n > max_shard_size:
            shards.append([(name, t)])
            continue
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        shards.append(current)
    return shards, total


def _prod(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_config(model: Any, tmp: str, formats: dict) -> list:
    """config.json (and generation_config.json, remote code) into `tmp`; the names of the files to sync."""
    config = copy.deepcopy(model.config)  # transformers sets these on the model's config; we leave it unchanged
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    if formats:
        config.quantization_config = copy.deepcopy(model.__dict__["_strideweave_quantization"])
    elif hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are written in the model's dtype
    if getattr(model, "is_remote_code", lambda: False)():
        from transformers.dynamic_module_utils import custom_object_save
        custom_object_save(model, tmp, config=config)
    config.save_pretrained(tmp)
    written = ["config.json"]
    if getattr(model, "can_generate", lambda: False)() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
        written.append("generation_config.json")
    return written


def _write_shards(tmp: str, shards: list, formats: dict, first: int, count: int) -> dict:
    """Writes `shards` as files ``first + 1``, ... of `count` into `tmp`; {stored tensor name: (file, bytes)}."""
    written = {}
    for i, shard in enumerate(shards):
        filename = WEIGHTS_PATTERN.format(index=first + i + 1, count=count)
        quantize = {name: formats[name] for name, _ in shard if name in formats}
        _write_shard(os.path.join(tmp, filename), dict(shard), {"format": "pt"}, *([quantize] if quantize else []))
        written.update({stored: (filename, n) for name, t in shard for stored, n in _stored(name, t, formats.get(name))})
    return written


def _write_index(tmp: str, weight_map: dict, total: int, params: int, synced: list) -> None:
    index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
    with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for name in synced:
        path = os.path.join(tmp, name)
        if os.path.isfile(path):
            _fsync(path)


def _write_into(model: Any, tmp: str, shards: list, total: int, params: int, formats: dict) -> None:
    """Writes the whole checkpoint into the (new, empty) folder `tmp` (`formats`: the tensors written quantized)."""
    written = _write_config(model, tmp, formats)
    stored = _write_shards(tmp, shards, formats, 0, len(shards))
    _write_index(tmp, {name: f for name, (f, _) in stored.items()}, total, params, written)


class _Folder:
    """The target folder of a save and its temporary folder beside it (Note [Saving a model whose experts are
    tiles], atomicity): `open()` makes the missing parents and the temporary folder, `install()` moves it into
    place, `discard()` removes what this save made."""

    def __init__(self, folder: Any, what: str) -> None:
        self.target = os.path.realpath(os.fspath(folder))
        if os.path.lexists(self.target) and not os.path.isdir(self.target):
            raise NotADirectoryError(errno.ENOTDIR, f"{what}: exists and is not a folder (nothing was written)",
                                     self.target)
        self.parent, self.name = os.path.split(self.target)
        self.created: list = []  # parent folders made by this save, removed again on error
        self.tmp: Any = None
        self.what = what

    def open(self) -> str:
        probe = self.parent
        while probe and not os.path.isdir(probe):
            if os.path.lexists(probe):
                raise NotADirectoryError(errno.ENOTDIR, f"{self.what}: not a folder (nothing was written)", probe)
            self.created.append(probe)
            probe = os.path.dirname(probe)
        for path in reversed(self.created):
            os.mkdir(path)
        _sw()._core._remove_stale_folders(self.target)
        while self.tmp is None:
            candidate = os.path.join(self.parent, f".{self.name}.tmp-{os.getpid()}-{next(_COUNTER)}")
            try:
                os.mkdir(candidate)
                self.tmp = candidate
            except FileExistsError:
                continue
        return self.tmp

    def install(self) -> None:
        _sw()._core._install_folder(self.tmp, self.target)
        self.tmp = None
        self.created = []

    def discard(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        for path in self.created:  # innermost first
            try:
                os.rmdir(path)
            except OSError:
                break
        self.created = []


def save_pretrained(model: Any, folder: Any, *, max_shard_size: Any = "5GB", quantize: bool = False) -> None:
    """Writes `model` (its experts bound by ``from_pretrained`` or ``offload_experts``) as a complete Hugging Face
    checkpoint in `folder`: config, every non-expert weight under the names transformers' ``save_pretrained`` would
    write, every expert streamed from its tiles (their current, fine-tuned values) in the checkpoint's own names and
    layout, sharded by ``max_shard_size`` (bytes, or a string such as ``"5GB"``) with
    ``model.safetensors.index.json``. transformers' ``from_pretrained`` loads it with nothing missing.

    A model opened from a quantized checkpoint (FP8, MXFP4) is written in its dtype (BFloat16 experts, no
    ``quantization_config``), or with ``quantize=True`` in the checkpoint's format: every tensor the checkpoint
    stored quantized re-quantized from its current values (FP8 scales recomputed per block, MXFP4 blocks and
    scales), the checkpoint's ``quantization_config`` in config.json (Note [Quantized checkpoints when saving]).

    The folder is written beside `folder` and moved into place at the end in one rename; an existing `folder` is
    replaced whole (Note [Saving a model whose experts are tiles]). Memory: the non-expert weights are written from
    the model's own tensors, the experts through an 8 MiB buffer; nothing is gathered.

    A model opened with a process group of several ranks is saved by every rank calling this (collective): each
    rank writes its own experts' shards, rank 0 the other tensors, the config and the one index, into one folder
    that appears whole at the end; an error on any rank raises on every rank and writes nothing (Note [Saving
    across ranks]). `folder` must then be on a file system every rank sees.

    Errors leave `folder` as it was and nothing beside it: TypeError for a model without bound experts (pointing to
    ``offload_experts``/``from_pretrained``), a `folder` that is not a path or a ``max_shard_size`` that is neither
    an int nor a size string; ValueError for a ``max_shard_size`` <= 0 or not a size; an OSError
    (``NotADirectoryError``, ``PermissionError``, ...) for a `folder` that cannot be written.
    """
    what = "save_pretrained"
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: expected a transformers model (a torch.nn.Module), got {type(model).__name__}")
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"{what}: folder must be a path, got {type(folder).__name__}")
    if not isinstance(quantize, bool):
        raise TypeError(f"{what}: quantize must be a bool, got {type(quantize).__name__}")
    from ._distributed import group_of, world_size_of
    group = group_of(model)
    limit = shard_size(max_shard_size, what)
    if world_size_of(group) > 1:
        _save_across_ranks(model, folder, limit, quantize, group, what)
        return
    target = _Folder(folder, what)
    shards, total, params, formats = plan(model, limit, what, quantize)
    try:
        tmp = target.open()
        _write_into(model, tmp, shards, total, params, formats)
        target.install()
    except BaseException:
        target.discard()
        raise


def _describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _agree(group: Any, error: Any, value: Any = None) -> list:
    """Every rank's (error description or None, `value`) (``all_gather_object``: collective, and a barrier)."""
    dist = _torch().distributed
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (None if error is None else _describe_error(error), value), group=group)
    return out


def _check_agreed(agreed: list, error: Any, folder: Any, what: str) -> None:
    """Raises on every rank when any rank failed: this rank's own error where it failed, else RuntimeError naming
    the failed ranks and their errors; the temporary folder is then already removed (by rank 0)."""
    failed = [(r, message) for r, (message, _) in enumerate(agreed) if message is not None]
    if not failed:
        return
    if folder is not None:
        folder.discard()
    if error is not None:
        raise error
    raise RuntimeError(f"{what}: " + "; ".join(f"rank {r} failed ({message})" for r, message in failed)
                       + " (nothing was written)")


_SAFETENSORS_DTYPES = {"Float32": "F32", "BFloat16": "BF16", "Float16": "F16", "Float64": "F64"}


def _joint_shards(joint: dict, limit: int) -> list:
    """The shards of the tensors every rank writes a slice of: [[(name, whole shape, dtype name, bytes)]], packed by
    the greedy rule in transformers' order (the same on every rank: every rank binds the whole tensors)."""
    entries = []
    for name in sorted(joint, key=_natural_key):
        shape, _, dtype, _ = joint[name]
        kind = str(dtype).split(".")[-1]
        if kind not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: cannot write a {kind} tensor in parts")
        entries.append((name, shape, _SAFETENSORS_DTYPES[kind], _prod(shape) * (dtype.bits // 8)))
    shards: list = []
    current: list = []
    size = 0
    for e in entries:
        if current and size + e[3] > limit:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e[3]
    if current:
        shards.append(current)
    return shards


def _joint_header(shard: list) -> tuple:
    """(header bytes with its length prefix, {name: first byte of its data in the file}) of a joint shard."""
    header: dict = {"__metadata__": {"format": "pt"}}
    begins = {}
    offset = 0
    for name, shape, dtype, nbytes in shard:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        begins[name] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = len(text).to_bytes(8, "little") + text
    return prefix, {name: len(prefix) + b for name, b in begins.items()}, len(prefix) + offset


def _write_slices(tmp: str, joint: dict, joint_shards: list, first: int, count: int) -> None:
    """Writes this rank's slice of every joint tensor into its shard (created by rank 0): each slice is streamed
    from the tiles into a file of its own (the shard writer), whose data bytes are then copied into place."""
    import tempfile
    for j, shard in enumerate(joint_shards):
        path = os.path.join(tmp, WEIGHTS_PATTERN.format(index=first + j + 1, count=count))
        _, begins, _ = _joint_header(shard)
        mine = [(name, begins[name]) for name, *_ in shard if joint[name][3] is not None]
        if not mine:
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for name, begin in mine:
                _, first_element, dtype, t = joint[name]
                handle, part = tempfile.mkstemp(prefix=".strideweave-slice-", suffix=".safetensors", dir=tmp)
                os.close(handle)
                try:
                    _write_shard(part, {name: t}, {})
                    with open(part, "rb") as f:
                        n = int.from_bytes(f.read(8), "little")
                        lo, hi = json.loads(f.read(n))[name]["data_offsets"]
                        f.seek(8 + n + lo)
                        at = begin + first_element * (dtype.bits // 8)
                        left = hi - lo
                        while left:
                            chunk = f.read(min(left, 8 << 20))
                            if not chunk:
                                raise OSError(f"{part}: cut short")
                            os.pwrite(fd, chunk, at)
                            at += len(chunk)
                            left -= len(chunk)
                finally:
                    os.remove(part)
            os.fsync(fd)
        finally:
            os.close(fd)


def _save_across_ranks(model: Any, folder: Any, limit: int, quantize: bool, group: Any, what: str) -> None:
    """save_pretrained of a model sharded over the ranks of `group` (Note [Saving across ranks]); collective."""
    dist = _torch().distributed
    rank = dist.get_rank(group)
    target = None
    error: Any = None
    shards: list = []
    formats: dict = {}
    joint: dict = {}
    joint_shards: list = []
    params = 0
    try:  # 1. each rank plans its own tensors; rank 0 makes the temporary folder
        tensors, params, formats, joint = collect(model, what, quantize, rank=rank)
        shards, _ = pack(tensors, formats, limit)
        joint_shards = _joint_shards(joint, limit)
        if rank == 0:
            target = _Folder(folder, what)
            target.open()
    except Exception as e:  # noqa: BLE001 (propagated to every rank below)
        error = e
    agreed = _agree(group, error, (len(shards), target.tmp if target is not None else None))
    _check_agreed(agreed, error, target, what)
    counts = [n for _, (n, _) in agreed]
    tmp = agreed[0][1][1]
    own = sum(counts)
    count = own + len(joint_shards)
    if joint_shards:  # rank 0 lays out the shards of the tensors every rank writes a slice of
        try:
            if rank == 0:
                for j, shard in enumerate(joint_shards):
                    prefix, _, size = _joint_header(shard)
                    with open(os.path.join(tmp, WEIGHTS_PATTERN.format(index=own + j + 1, count=count)), "wb") as f:
                        f.write(prefix)
                        f.truncate(size)
        except Exception as e:  # noqa: BLE001
            error = e
        _check_agreed(_agree(group, error), error, target, what)
    stored: dict = {}
    try:  # 2. each rank writes its shards and its slices into the one temporary folder
        stored = _write_shards(tmp, shards, formats, sum(counts[:rank]), count)
        _write_slices(tmp, joint, joint_shards, own, count)
    except Exception as e:  # noqa: BLE001
        error = e
    agreed = _agree(group, error, stored)
    _check_agreed(agreed, error, target, what)
    try:  # 3. rank 0 writes the config and the index, and installs the folder
        if rank == 0:
            written = [w for _, w in agreed]
            written.append({name: (WEIGHTS_PATTERN.format(index=own + j + 1, count=count), nbytes)
                            for j, shard in enumerate(joint_shards) for name, _, _, nbytes in shard})
            weight_map: dict = {}
            total = 0
            for part in written:
                for name, (filename, n) in part.items():
                    if name in weight_map:
                        raise ValueError(f"{what}: {name!r} was written by two ranks (the ranks disagree on the "
                                         "experts' shares)")
                    weight_map[name] = filename
                    total += n
            synced = _write_config(model, tmp, formats) + sorted(set(written[-1][n][0] for n in written[-1]))
            _write_index(tmp, weight_map, total, params, synced)
            target.install()
    except Exception as e:  # noqa: BLE001
        error = e
    _check_agreed(_agree(group, error), error, target, what)
