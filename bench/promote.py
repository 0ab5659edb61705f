"""promote: TiledEvictable.promote of 32 tiles of 1 MiB from a FileBacked tier; target ratio <= 1.25.

StrideWeave: a TiledEvictable with a CPU(0) primary and a FileBacked secondary
(a raw file of Float32 values written with NumPy ``tofile``), grid (1, 32),
tile (512, 512): 32 tiles of 262,144 Float32 values (1 MiB) each, every tile
one contiguous MiB of the file. One timed call is
``carrier.promote(TileSet(all 32 tiles))``: the engine allocates a primary
buffer per tile and reads the tile's bytes into it on its I/O pool.

Reference: ``os.preadv`` of the same 32 MiB from the same file into 32
preallocated 1 MiB buffers (NumPy arrays, touched before timing), one preadv
call (the kernel's IOV_MAX is far above 32).

The file is read once before timing, so both sides read from the page cache.
Every StrideWeave repetition starts from evicted tiles: between calls (outside
the timed region) the 32 tiles are evicted again; they are clean, so eviction
writes nothing and only drops the primary buffers. Each sample is one call
(inner = 1), so the timed region never includes an eviction. This measures the
steady state of evict/promote churn: the dropped buffers' memory is recycled
by the next promotion (Note [Mapping cache] in cpp/src/carriers/native.cpp);
the first promotion of a process pays fresh page faults instead.

Usage: python bench/promote.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import strideweave as sw  # noqa: E402

TARGET = 1.25
TILES = 32
TILE = (512, 512)  # 262,144 Float32 values: 1 MiB
TILE_ELEMS = TILE[0] * TILE[1]


def main(argv=None) -> None:
    args = harness.parse_args("promote", argv, __doc__)
    reps = args.reps or (60 if args.quick else 300)
    total = TILES * TILE_ELEMS
    nbytes = total * 4
    rng = np.random.default_rng(0)
    values = rng.standard_normal(total, dtype=np.float32)

    tmpdir = tempfile.mkdtemp(prefix="sw-bench-promote-")
    path = os.path.join(tmpdir, "tiles.f32")
    values.tofile(path)
    try:
        # Warm the page cache: read the whole file once.
        with open(path, "rb") as fh:
            while fh.read(8 << 20):
                pass

        carrier = sw.TiledEvictable(sw.CPU(0), sw.FileBacked(path), (1, TILES), TILE)
        everything = sw.TileSet(coordinates=[(0, j) for j in range(TILES)])
        assert len(carrier.secondary_tiles) == TILES

        fd = os.open(path, os.O_RDONLY)
        buffers = [np.ones(TILE_ELEMS, dtype=np.float32) for _ in range(TILES)]  # touched
        views = [memoryview(b).cast("B") for b in buffers]

        def ours():
            carrier.promote(everything)

        def reference():
            n = os.preadv(fd, views, 0)
            assert n == nbytes

        def evict():
            carrier.evict(everything)

        # Same bytes, checked once before timing: the full tensor's values (column-major over (512, 512*32),
        # i.e. the file's order) against the reference's buffers.
        reference()
        assert np.array_equal(np.concatenate(buffers), values)
        ours()
        full = sw.Tensor(carrier, 0, sw.column_major(TILE[0], TILE[1] * TILES))
        got = np.asarray(carrier.project(full, sw.TileSelection([[0], list(range(TILES))])).wait())
        if not np.array_equal(got.reshape(-1, order="F"), values):
            raise SystemExit("promote: StrideWeave's promoted tiles differ from the file's bytes")
        del full, got
        stats = carrier.stats()
        assert stats["primary_tiles"] == TILES
        evict()
        assert len(carrier.secondary_tiles) == TILES and carrier.stats()["primary_tiles"] == 0
        before = carrier.stats()

        # Interleaved pairs, one call per sample; each StrideWeave call starts from evicted tiles
        # (cheap: clean tiles are dropped without writing), evicted outside the timed region.
        warmup = 5
        case = harness.compare(f"{TILES} x 1 MiB FileBacked->CPU", ours, reference, reps=reps, warmup=warmup,
                               inner=1, bytes=nbytes, budget_s=20.0 if args.quick else None, prepare_ours=evict)
        calls = warmup + 1 + case.reps  # warm-up, the untimed pair at sample size, timed pairs
        after = carrier.stats()
        promoted = after["bytes_promoted"] - before["bytes_promoted"]
        expect = calls * nbytes
        assert promoted == expect, f"every timed call must promote all {TILES} tiles ({promoted} != {expect})"
        assert after["writes_skipped"] - before["writes_skipped"] == (calls - 1) * TILES, \
            "evictions must drop clean tiles without writing"
        os.close(fd)
        carrier.release()
    finally:
        try:
            os.unlink(path)
            os.rmdir(tmpdir)
        except OSError:
            pass

    harness.log(args, case.summary(), f"| ours {nbytes / case.ours_s / 1e9:.2f} GB/s,"
                f" ref {nbytes / case.reference_s / 1e9:.2f} GB/s, {case.reps} pairs")
    harness.emit(harness.record("promote", [case], target=TARGET, better="lower", quick=args.quick,
                                note="reference: one os.preadv into 32 touched 1 MiB buffers"))


if __name__ == "__main__":
    main()
