"""checkpoint: bf16 experts of a safetensors checkpoint, opened where they lie.

The cases, each a ratio ours / reference measured in interleaved pairs (bench/harness.py):

* ``promote vs safe_open``: ``carrier.promote`` of 16 bf16 experts (1024 x 1024, 2 MiB each) of a
  safetensors file in the page cache, through ``sw.safetensors.open(path).tiled(names)``, against
  ``safetensors.safe_open(path, "pt")`` and ``get_tensor(name)`` of the same 16 tensors, each touched once
  per 4 KiB page (safe_open maps the file: a tensor's bytes are read when its pages are first touched).
  Target <= 1.0.
* ``promote vs preadv``: the same promotion against one ``os.preadv`` of the same 16 byte ranges into 16
  touched buffers (the floor of any reader). Target <= 1.25.
* ``open 20000 tensors``: ``sw.safetensors.open(path)`` of a file of 20,000 small bf16 tensors named as a
  model's (a header of about 2.1 MB), with its keys listed, against ``safetensors.safe_open(path, "pt")`` and
  ``keys()``: the cost of reading and validating a large header (Note [A header is parsed in linear time and
  bounded depth] in cpp/src/checkpoint/safetensors.cpp). Target <= 2.0.
* ``bf16 matmul``: ``sw.matmul`` of a (64 x 4096) bf16 activation by a (4096 x 4096) bf16 row-major
  PyTorch-style weight read as its transpose, against ``x @ w.T`` of PyTorch's bf16 CPU matmul with the
  same threads (``sw.matmul(x, w)`` contracts mode 1 of both operands: ``x @ w.T``). Each timed sample (eight
  calls) starts after a 0.1 s settle pause, both sides alike, as in bench/matmul.py: PyTorch's OpenMP threads
  spin for milliseconds after its calls and would otherwise slow whichever side comes next. Target <= 1.0.

* Quantized experts (one tile each, 2048 x 7168: a DeepSeek-V3 expert's gate_proj, 28 MiB in BFloat16),
  promoted into BFloat16 from the page cache, the same values stored three ways: BFloat16; FP8 e4m3 with one
  Float32 scale per 128 x 128 block (``weight_scale_inv``); MXFP4 (``_blocks`` and ``_scales``, one e8m0 scale per
  32 values), both written with ``sw.safetensors.quantize``. Bytes read per promotion (``ckpt.bytes_read``, checked
  once: the quantized bytes and their scales; targets 0.5x for FP8 and about 0.27x for MXFP4 of BFloat16's) go in
  the log and the record's note. Timed, each ratio ours / reference:
  ``fp8 promote vs bf16 read`` and ``mxfp4 promote vs bf16 read``: the quantized tile's promotion (a read of its
  bytes and scales and a dequantization into the tile) against the BFloat16 tile's promotion by a read into a
  buffer of its own (``set_promotion_path("read")``), the same 28 MiB written. Target <= 1.0.
  ``fp8 promote vs bf16 mapped`` and ``mxfp4 promote vs bf16 mapped`` (untargeted): against the default BFloat16
  promotion, which maps the page cache's pages and copies nothing (Note [Promotion by mapping] in
  cpp/src/carriers/checkpoint.cpp); no promotion that writes the tile can match it.
  ``fp8 promote vs transformers`` and ``mxfp4 promote vs transformers`` (untargeted): against transformers' own
  dequantizers of the same tensors from the same files (``safe_open`` + ``get_tensor``):
  ``Fp8Dequantize._dequantize_one(..., output_dtype=torch.bfloat16)`` and ``convert_moe_packed_tensors`` (whose
  result is GPT-OSS's transposed layout, made contiguous). The promoted tiles are checked once, bit for bit,
  against these.

The record's ratio is the worst case against its own target: each case's ratio is divided by its
target, so "meets target" means every case does.

Every StrideWeave promotion starts from evicted tiles (clean: eviction drops the buffers without
writing), evicted outside the timed region. Values are checked once against the safetensors package's
own load before timing.

Usage: python bench/checkpoint.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import strideweave as sw  # noqa: E402

EXPERTS, OUT, IN = 16, 1024, 1024
TOKENS, HIDDEN = 64, 4096
MANY = 20_000  # tensors of the open case
QROWS, QCOLS = 2048, 7168  # one quantized expert: DeepSeek-V3's moe_intermediate_size x hidden_size
TARGETS = {"promote vs safe_open": 1.0, "promote vs preadv": 1.25, "open 20000 tensors": 2.0, "bf16 matmul": 1.0,
           "fp8 promote vs bf16 read": 1.0, "mxfp4 promote vs bf16 read": 1.0}
UNTARGETED = {"fp8 promote vs bf16 mapped", "mxfp4 promote vs bf16 mapped", "fp8 promote vs transformers",
              "mxfp4 promote vs transformers"}


def data_ranges(path: str, names: list[str]) -> list[tuple[int, int]]:
    """(absolute offset, bytes) of each tensor, from the file's header (for the preadv reference only)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return [(8 + n + header[k]["data_offsets"][0], header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
            for k in names]


def quantized_cases(tmpdir: str, gen, reps: int, budget: float | None) -> tuple[list, str]:
    """The quantized-expert cases (module docstring) and the note on bytes read."""
    import ml_dtypes
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = (torch.randn(QROWS, QCOLS, generator=gen) * 0.02).bfloat16()
    q8, s8 = sw.safetensors.quantize(w.view(torch.int16).numpy().view(ml_dtypes.bfloat16), "fp8")
    q4, s4 = sw.safetensors.quantize(w.view(torch.int16).numpy().view(ml_dtypes.bfloat16), "mxfp4")
    name = "model.layers.3.mlp.experts.0.gate_proj.weight"
    paths = {k: os.path.join(tmpdir, f"{k}.safetensors") for k in ("bf16", "fp8", "mxfp4")}
    save_file({name: w}, paths["bf16"])
    save_file({name: torch.from_numpy(q8).view(torch.float8_e4m3fn),
               name.removesuffix(".weight") + ".weight_scale_inv": torch.from_numpy(s8)}, paths["fp8"])
    save_file({name + "_blocks": torch.from_numpy(q4), name + "_scales": torch.from_numpy(s4)}, paths["mxfp4"])
    try:
        for p in paths.values():  # the page cache holds every file for both sides
            with open(p, "rb") as fh:
                while fh.read(8 << 20):
                    pass
        ckpts = {k: sw.safetensors.open(p) for k, p in paths.items()}
        tiled = {k: c.tiled([name], dtype=sw.DType.BFloat16) for k, c in ckpts.items()}
        one = sw.TileSelection(((0,), (0,), (0,)))

        def bits(k):
            return np.asarray(tiled[k].carrier.project(tiled[k], one).wait())[:, :, 0].view(np.uint16)

        # transformers' dequantizers of the same tensors, read from the same files as they load them.
        def fp8_transformers():
            with safe_open(paths["fp8"], "pt") as f:
                return Fp8Dequantize(None)._dequantize_one(
                    f.get_tensor(name), f.get_tensor(name.removesuffix(".weight") + ".weight_scale_inv"),
                    output_dtype=torch.bfloat16)

        def mxfp4_transformers():
            with safe_open(paths["mxfp4"], "pt") as f:
                return convert_moe_packed_tensors(f.get_tensor(name + "_blocks")[None],
                                                  f.get_tensor(name + "_scales")[None], dtype=torch.bfloat16)

        # Same values, checked once before timing (no NaN here: torch's vectorised cast and ours agree on every
        # other value).
        if not np.array_equal(bits("bf16"), w.view(torch.int16).numpy().view(np.uint16)):
            raise SystemExit("checkpoint: the bf16 expert differs from what was saved")
        if not np.array_equal(bits("fp8"), fp8_transformers().view(torch.int16).numpy().view(np.uint16)):
            raise SystemExit("checkpoint: the fp8 expert differs from transformers' Fp8Dequantize")
        if not np.array_equal(bits("mxfp4"), mxfp4_transformers()[0].T.contiguous().view(torch.int16).numpy().view(np.uint16)):
            raise SystemExit("checkpoint: the mxfp4 expert differs from transformers' convert_moe_packed_tensors")

        # Bytes read per promotion: exactly the tile's stored bytes and its scales.
        read = {}
        for k in tiled:
            tiled[k].carrier.evict(one)
            before = ckpts[k].bytes_read
            tiled[k].carrier.promote(one)
            read[k] = ckpts[k].bytes_read - before
        want = {"bf16": w.numel() * 2, "fp8": q8.nbytes + s8.nbytes, "mxfp4": q4.nbytes + s4.nbytes}
        if read != want:
            raise SystemExit(f"checkpoint: bytes read per promotion {read}, expected {want}")
        note = (f"bytes read per {QROWS}x{QCOLS} expert promotion: bf16 {read['bf16']}, fp8 {read['fp8']} "
                f"({read['fp8'] / read['bf16']:.3f}x), mxfp4 {read['mxfp4']} ({read['mxfp4'] / read['bf16']:.3f}x)")

        def promote(k):
            return lambda: tiled[k].carrier.promote(one)

        def evict_both(k):
            def evict():
                tiled[k].carrier.evict(one)
                tiled["bf16"].carrier.evict(one)
            return evict

        cases = []
        for k in ("fp8", "mxfp4"):
            for path in ("read", "map"):
                previous = sw.safetensors.set_promotion_path(path if path == "read" else "auto")
                try:
                    cases.append(harness.compare(f"{k} promote vs bf16 {'read' if path == 'read' else 'mapped'}",
                                                 promote(k), promote("bf16"), reps=reps, warmup=5, inner=1,
                                                 bytes=read[k], budget_s=budget, prepare_ours=evict_both(k)))
                finally:
                    sw.safetensors.set_promotion_path(previous)
            # transformers' side takes 0.1-0.3 s a call here: a quarter of the pairs.
            cases.append(harness.compare(f"{k} promote vs transformers", promote(k),
                                         fp8_transformers if k == "fp8" else mxfp4_transformers,
                                         reps=max(reps // 4, 10), warmup=2, inner=1, bytes=read[k],
                                         budget_s=budget, prepare_ours=evict_both(k)))
        for t in tiled.values():
            t.carrier.release()
        return cases, note
    finally:
        for p in paths.values():
            try:
                os.unlink(p)
            except OSError:
                pass


def main(argv=None) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    args = harness.parse_args("checkpoint", argv, __doc__)
    reps = args.reps or (40 if args.quick else 200)
    budget = 20.0 if args.quick else None
    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(EXPERTS)]
    weights = {k: torch.randn(OUT, IN, generator=gen).bfloat16() for k in names}
    nbytes = EXPERTS * OUT * IN * 2
    tmpdir = tempfile.mkdtemp(prefix="sw-bench-checkpoint-")
    path = os.path.join(tmpdir, "model.safetensors")
    save_file(weights, path)
    many_path = os.path.join(tmpdir, "many.safetensors")
    many = {f"model.layers.{i // 64}.mlp.experts.{i % 64}.w{i % 3 + 1}.weight": torch.full((4, 8), float(i)).bfloat16()
            for i in range(MANY)}
    save_file(many, many_path)
    del many
    cases = []
    try:
        with open(path, "rb") as fh:  # the page cache holds the file for both sides
            while fh.read(8 << 20):
                pass
        ckpt = sw.safetensors.open(path)
        full = ckpt.tiled(names)
        carrier = full.carrier
        everything = sw.TileSelection(((0,), (0,), tuple(range(EXPERTS))))

        # Same bytes, checked once before timing: every expert against the safetensors package's own load.
        got = np.asarray(carrier.project(full, everything).wait())
        for e, k in enumerate(names):
            if not np.array_equal(got[:, :, e].view(np.uint16), weights[k].view(torch.int16).numpy().view(np.uint16)):
                raise SystemExit(f"checkpoint: expert {e} differs from safetensors' load")
        del got
        carrier.evict(everything)

        def ours():
            carrier.promote(everything)

        def evict():
            carrier.evict(everything)

        # safe_open maps the file and get_tensor returns tensors over the mapping: nothing is read until a page
        # is touched, and a mapping kept across calls stays populated. So the reference opens the file, gets the 16
        # tensors and touches one element per 4 KiB page of each (what it takes before the values can be used),
        # every call: the same work as a promotion, which leaves the bytes in memory of its own.
        def safe_open_ref():
            with safe_open(path, "pt") as f:
                for k in names:
                    f.get_tensor(k).view(-1)[::2048].view(torch.int16).sum()

        cases.append(harness.compare("promote vs safe_open", ours, safe_open_ref, reps=reps, warmup=5, inner=1,
                                     bytes=nbytes, budget_s=budget, prepare_ours=evict))

        ranges = data_ranges(path, names)
        buffers = [np.ones(size, dtype=np.uint8) for _, size in ranges]  # touched
        fd = os.open(path, os.O_RDONLY)

        def preadv_ref():
            for (offset, size), buf in zip(ranges, buffers):
                if os.preadv(fd, [buf], offset) != size:
                    raise SystemExit("checkpoint: short read")

        cases.append(harness.compare("promote vs preadv", ours, preadv_ref, reps=reps, warmup=5, inner=1,
                                     bytes=nbytes, budget_s=budget, prepare_ours=evict))
        os.close(fd)
        carrier.release()
        del full, ckpt

        # Opening a large header: both sides read and validate it and list its names.
        with safe_open(many_path, "pt") as f:
            want = sorted(f.keys())
            want_shape = list(f.get_slice(want[-1]).get_shape())
        many_ckpt = sw.safetensors.open(many_path)
        if many_ckpt.keys() != want or list(many_ckpt.shape(want[-1])) != want_shape:
            raise SystemExit("checkpoint: the 20000-tensor file opens with other names or shapes than safe_open's")
        del many_ckpt

        def open_many():
            sw.safetensors.open(many_path).keys()

        def safe_open_many():
            with safe_open(many_path, "pt") as f:
                f.keys()

        cases.append(harness.compare("open 20000 tensors", open_many, safe_open_many, reps=max(reps // 4, 10),
                                     warmup=3, inner=1, bytes=os.path.getsize(many_path), budget_s=budget))
        quantized, quantized_note = quantized_cases(tmpdir, gen, reps, budget)
        cases += quantized
    finally:
        for p in (path, many_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        os.rmdir(tmpdir)

    # bf16 matmul: sw.matmul contracts mode 1 of both operands (x W^T, as torch.nn.functional.linear): the
    # row-major (out, in) weight is read where it lies.
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    w = torch.randn(HIDDEN, HIDDEN, generator=gen).bfloat16()
    xs = sw.from_dlpack(x)
    ws = sw.from_dlpack(w)
    with sw.no_grad():
        ours_y = np.asarray(sw.matmul(xs, ws)).astype(np.float64)
        ref_y = (x @ w.T).float().numpy().astype(np.float64)
        # Both round a Float32 sum of exact bf16 products once to bf16: within 2 bf16 ulps of each other.
        bound = 2 * 2.0 ** -8 * np.abs(x.float().numpy().astype(np.float64)) @ np.abs(w.float().numpy().T.astype(np.float64))
        if np.any(np.abs(ours_y - ref_y) > bound):
            raise SystemExit("checkpoint: bf16 matmul differs from PyTorch's beyond two bf16 ulps")
        # PyTorch's OpenMP threads keep spinning after a call returns and take a core from whatever runs next:
        # measured here, the first two of eight sw.matmul calls right after PyTorch's took 6.3 and 4.7 ms against
        # 2.6-2.7 ms for the rest (docs/performance.md, "bf16 matmul after PyTorch"). As in
        # bench/matmul.py, every timed sample therefore starts after an untimed settle pause, both sides alike,
        # so each side's time is its own; eight calls a sample amortise each side's own wake-up.
        cases.append(harness.compare("bf16 matmul", lambda: sw.matmul(xs, ws), lambda: x @ w.T, reps=reps,
                                     warmup=3, inner=8, bytes=HIDDEN * HIDDEN * 2, budget_s=budget,
                                     settle_s=0.1))

    for c in cases:
        harness.log(args, c.summary())
    harness.emit(harness.record("checkpoint", cases, target=1.0, better="lower", quick=args.quick,
                                case_targets=TARGETS, untargeted=UNTARGETED,
                                note=f"{EXPERTS} bf16 experts ({OUT}x{IN}) in page cache; {quantized_note}; "
                                     f"quantized kernels {'AVX-512' if sw._core._quant_uses_avx512() else 'portable'}; "
                                     f"torch threads {torch.get_num_threads()}"))


if __name__ == "__main__":
    main()
