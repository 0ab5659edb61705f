"""overlap: prefetch batch k+1's cold experts from a file while computing batch k; target ratio <= 1.15.

StrideWeave: a TiledEvictable with a CPU(0) primary and a FileBacked secondary
(a raw file of Float32 values written with NumPy ``tofile``) holding E = 128
experts of (out, in) = (1024, 1024) Float32 values, 4 MiB each, in the
expert-last layout of examples/moe_offload.py (grid (1, E), tile (out, in):
each expert is one contiguous 4 MiB range of the file). A loop of B = 16
batches of 8 distinct experts each (batch k uses experts 8k .. 8k+7, so every
expert is read once per repetition and every read is cold); one repetition of
the overlapped loop is::

    carrier.promote_async(batch 0).wait()
    for k in range(B):
        ahead = carrier.promote_async(batch k + 1)        # cold reads on the I/O pool
        for e in batch k:                                 # meanwhile, on this thread:
            w = carrier.project(full, [[0], [e]], dest).wait()   # gather the resident expert
            sw.matmul(x, w)                               # (64, 1024) x (1024, 1024)^T
        ahead.wait()

(64 tokens an expert: 256 tokens routed top-2 over 8 experts.) The two
references run the same requests on their own, in the same process:

* I/O alone: ``carrier.promote_async(batch k).wait()`` for k = 0 .. B-1;
* compute alone: every tile resident beforehand (promoted untimed), then the
  same projections and matmuls, batch after batch.

Ratio of one repetition = overlapped wall / max(I/O alone, compute alone), all
three measured back to back (overlapped, I/O, compute, repeated) after one
untimed warm-up round; the benchmark reports the median of these per-repetition
ratios and their min and max. 1.0 means the shorter of the two is completely
hidden behind the longer. Even a perfect pipeline cannot reach 1.0: batch 0's
reads come before any compute and batch B-1's compute after the last read, so
the ideal is (B + 1) / B = 1.06 when both sides are equally long and closer to
1.0 the more unequal they are (printed as "pipeline floor").

Cold reads: before every repetition that reads (overlapped and I/O alone) all
tiles are evicted (clean: dropped without writing) and the file's pages are
dropped from the page cache with ``os.posix_fadvise(fd, 0, 0,
POSIX_FADV_DONTNEED)`` (the file was fsynced after writing, so its pages are
clean and droppable). Each sample also records the process's CPU time (user +
system, all threads): buffered cold reads cost kernel CPU (page cache fill and
copy), which the compute has to share the cores with. Grad mode is off (forward matmuls only); each timed
sample starts after an untimed settle pause so BLAS workers left spinning by
the previous sample are idle (see bench/matmul.py).

Usage: python bench/overlap.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import strideweave as sw  # noqa: E402
from strideweave import friendly  # noqa: E402

TARGET = 1.15
OUT, IN = 1024, 1024  # one expert: 4 MiB of Float32
BATCHES, PER_BATCH = 16, 8
EXPERTS = BATCHES * PER_BATCH
TOKENS = 64  # tokens an expert (256 tokens, top-2, over 8 experts)
SETTLE_S = 0.2


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> None:
    args = harness.parse_args("overlap", argv, __doc__)
    reps = args.reps or (9 if args.quick else 25)
    budget_s = 30.0 if args.quick else None  # timed repetitions stop early past this (at least 3): --quick < 1 min
    tile_elems = OUT * IN
    tile_bytes = tile_elems * 4
    nbytes = EXPERTS * tile_bytes
    batches = [list(range(k * PER_BATCH, (k + 1) * PER_BATCH)) for k in range(BATCHES)]
    rng = np.random.default_rng(0)

    tmpdir = tempfile.mkdtemp(prefix="sw-bench-overlap-")
    path = os.path.join(tmpdir, "experts.f32")
    with open(path, "wb") as f:  # expert by expert: never more than one expert in memory
        for _ in range(EXPERTS):
            (rng.standard_normal(tile_elems, dtype=np.float32) / np.float32(32.0)).tofile(f)
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED can drop them
    fd = os.open(path, os.O_RDONLY)
    sw.set_grad_enabled(False)
    try:
        carrier = sw.TiledEvictable(sw.CPU(0), sw.FileBacked(path, mutable=False), (1, EXPERTS), (OUT, IN))
        full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(OUT, [IN, EXPERTS]), sw.Stride(1, [OUT, OUT * IN])))
        everything = sw.TileSet([(0, e) for e in range(EXPERTS)])
        tiles = [sw.TileSet([(0, e) for e in b]) for b in batches]
        selections = [sw.TileSelection([[0], [e]]) for e in range(EXPERTS)]
        dest = None  # no destination, as the example does: one-tile projections share the tile
        x_np = rng.standard_normal((TOKENS, IN), dtype=np.float32)
        x = friendly.tensor(x_np)

        def compute_batch(k: int) -> None:
            for e in batches[k]:
                w = carrier.project(full, selections[e], dest).wait()
                sw.matmul(x, w)

        def overlapped() -> None:
            carrier.promote_async(tiles[0]).wait()
            for k in range(BATCHES):
                ahead = carrier.promote_async(tiles[k + 1]) if k + 1 < BATCHES else None
                compute_batch(k)
                if ahead is not None:
                    ahead.wait()

        def io_alone() -> None:
            for k in range(BATCHES):
                carrier.promote_async(tiles[k]).wait()

        def compute_alone() -> None:
            for k in range(BATCHES):
                compute_batch(k)

        def cold() -> None:  # untimed: nothing resident, nothing of the file in the page cache
            carrier.evict(everything)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def resident() -> None:  # untimed: every tile resident (read from the page cache)
            carrier.promote(everything)

        def timed(prepare, fn) -> tuple[float, float]:
            """(wall seconds, CPU seconds of this process, user + system, all threads) of one call."""
            prepare()
            time.sleep(SETTLE_S)
            cpu0 = cpu_s()
            wall = harness.time_call(fn, 1)
            return wall, cpu_s() - cpu0

        # Same values, checked once before timing: one projected expert against the file, one product against NumPy.
        cold()
        resident()
        e = 37
        got = np.asarray(carrier.project(full, selections[e], dest).wait())
        expert = np.fromfile(path, dtype=np.float32, count=tile_elems, offset=e * tile_bytes).reshape(IN, OUT).T
        if not np.array_equal(got, expert):
            raise SystemExit("overlap: a projected expert differs from the file's bytes")
        y = np.asarray(sw.matmul(x, carrier.project(full, selections[e], dest).wait()))
        if not np.allclose(y, x_np @ expert.T, rtol=1e-4, atol=1e-3 * np.sqrt(IN)):
            raise SystemExit("overlap: StrideWeave's matmul disagrees with NumPy")
        del got, y

        # Warm-up round (untimed), then interleaved timed repetitions: overlapped, I/O alone, compute alone.
        timed(cold, overlapped)
        timed(cold, io_alone)
        timed(resident, compute_alone)
        before = carrier.stats()
        wall_t, io_t, comp_t, ratios, floors = [], [], [], [], []
        cpu = {"overlapped": [], "io": [], "compute": []}
        started = time.perf_counter()
        for r in range(reps):
            w, cw = timed(cold, overlapped)
            io, cio = timed(cold, io_alone)
            c, cc = timed(resident, compute_alone)
            wall_t.append(w)
            io_t.append(io)
            comp_t.append(c)
            for key, v in (("overlapped", cw), ("io", cio), ("compute", cc)):
                cpu[key].append(v)
            ratios.append(w / max(io, c))
            floors.append((max(io, c) + min(io, c) / BATCHES) / max(io, c))
            harness.log(args, f"rep {r + 1}: overlapped {harness.fmt_s(w)}, I/O alone {harness.fmt_s(io)} "
                              f"({nbytes / io / 1e9:.2f} GB/s cold), compute alone {harness.fmt_s(c)} "
                              f"-> ratio {ratios[-1]:.3f} | CPU s (user+sys) {cw:.2f}, {cio:.2f}, {cc:.2f}")
            if budget_s is not None and len(ratios) >= 3 and time.perf_counter() - started > budget_s:
                break
        after = carrier.stats()
        # Every overlapped and I/O-alone repetition read every tile: nothing was served from a resident tile.
        promoted = after["bytes_promoted"] - before["bytes_promoted"]
        expect = 2 * len(ratios) * nbytes  # overlapped + I/O alone (the compute side finds every tile resident)
        assert promoted == expect, f"each repetition must read every tile ({promoted} != {expect})"
        carrier.evict(everything)
        del full, dest
        carrier.release()
    finally:
        sw.set_grad_enabled(True)
        os.close(fd)
        try:
            os.unlink(path)
            os.rmdir(tmpdir)
        except OSError:
            pass

    io_s, comp_s = statistics.median(io_t), statistics.median(comp_t)
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    case = harness.Case(
        name=f"{BATCHES} batches x {PER_BATCH} cold 4 MiB experts",
        ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
        ours_s=statistics.median(wall_t), reference_s=statistics.median([max(a, b) for a, b in zip(io_t, comp_t)]),
        reps=len(ratios), inner=1, bytes=nbytes, ratios=ratios,
    )
    flops = 2 * TOKENS * OUT * IN * EXPERTS
    harness.log(args, case.summary(), f"| I/O alone {harness.fmt_s(io_s)} ({nbytes / io_s / 1e9:.2f} GB/s), "
                f"compute alone {harness.fmt_s(comp_s)} ({flops / comp_s / 1e9:.1f} GFLOP/s incl. gathers), "
                f"pipeline floor {statistics.median(floors):.3f}, {case.reps} repetitions; CPU s (user+sys) "
                f"overlapped {cpu_med['overlapped']:.2f}, I/O alone {cpu_med['io']:.2f}, "
                f"compute alone {cpu_med['compute']:.2f}")
    rec = harness.record(
        "overlap", [case], target=TARGET, better="lower", quick=args.quick,
        note=(f"ratio = overlapped wall / max(I/O alone, compute alone); I/O alone {harness.fmt_s(io_s)} "
              f"({nbytes / io_s / 1e9:.2f} GB/s cold), compute alone {harness.fmt_s(comp_s)}; "
              f"pipeline floor {statistics.median(floors):.3f}; CPU s (user+sys) overlapped "
              f"{cpu_med['overlapped']:.2f}, I/O alone {cpu_med['io']:.2f}, compute alone {cpu_med['compute']:.2f}"),
    )
    rec["io_s"] = float(f"{io_s:.4g}")
    rec["compute_s"] = float(f"{comp_s:.4g}")
    rec["pipeline_floor"] = float(f"{statistics.median(floors):.4g}")
    rec["cpu_s"] = {k: float(f"{v:.4g}") for k, v in cpu_med.items()}
    rec["ratio_label"] = "overlapped wall / max(I/O alone, compute alone)"
    harness.emit(rec)


if __name__ == "__main__":
    main()
