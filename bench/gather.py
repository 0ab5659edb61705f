"""gather: project 8 resident 1 MiB expert tiles into a compact tensor; target ratio <= 1.25.

StrideWeave: a TiledEvictable with a CPU(0) primary and a FileBacked secondary
(a raw file of Float32 values written with NumPy ``tofile``) holding E = 16
experts of (out, in) = (512, 512) Float32 values, 1 MiB each, in the
expert-last layout: the full tensor is (out, in * E) column-major, i.e.
``column_major(out, [in, E])`` with grid (1, E) and tile (out, in), so each
expert is one contiguous MiB. The 8 selected experts (not adjacent, not in
order) are promoted once before timing and stay resident. One timed call is
``carrier.project(full, TileSelection([[0], experts])).wait()``: allocate the
compact (512, 4096) destination, copy the 8 tiles into it, publish the tensor.

Reference: one memcpy of the same 8 MiB, NumPy ``np.copyto`` from a contiguous
array into a preallocated (already touched) array.

Two cases: grad mode on (the full tensor is Float32, hence differentiable, so
each projection records an autograd node) and off (sw.no_grad). Each call's
result is dropped before the next call, as a loop would, so the destination's
memory is recycled (Note [Mapping cache] in cpp/src/carriers/native.cpp).

Usage: python bench/gather.py [--quick] [--reps N] [--quiet]
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
OUT, IN, EXPERTS = 512, 512, 16
SELECTED = [11, 2, 7, 14, 0, 5, 9, 12]  # 8 experts, in routing order


def main(argv=None) -> None:
    args = harness.parse_args("gather", argv, __doc__)
    reps = args.reps or (30 if args.quick else 100)
    rng = np.random.default_rng(0)
    tile_elems = OUT * IN
    experts = rng.standard_normal((EXPERTS, tile_elems), dtype=np.float32)  # expert e: column-major (out, in)
    nbytes = len(SELECTED) * tile_elems * 4

    tmpdir = tempfile.mkdtemp(prefix="sw-bench-gather-")
    path = os.path.join(tmpdir, "experts.f32")
    experts.tofile(path)
    try:
        carrier = sw.TiledEvictable(sw.CPU(0), sw.FileBacked(path), (1, EXPERTS), (OUT, IN))
        full = sw.Tensor(carrier, 0, sw.column_major(OUT, [IN, EXPERTS]))
        selection = sw.TileSelection([[0], SELECTED])
        carrier.promote(selection.tile_set)  # resident before timing
        assert len(carrier.primary_tiles) == len(SELECTED)

        source = np.ascontiguousarray(experts[SELECTED])  # the same 8 MiB, contiguous
        dest = np.ones_like(source)  # preallocated and touched

        def reference():
            np.copyto(dest, source)

        def ours():
            return carrier.project(full, selection).wait()

        # Same values, checked once before timing: the compact (out, 8 * in) tensor is column-major,
        # so its Fortran-order flattening is the 8 experts one after another.
        reference()
        got = np.asarray(ours())
        assert got.shape == (OUT, IN * len(SELECTED)), got.shape
        if not np.array_equal(got.reshape(-1, order="F"), dest.reshape(-1)):
            raise SystemExit("gather: StrideWeave's projection differs from the selected experts")
        del got
        stats0 = carrier.stats()

        cases = []
        for grad in (True, False):
            sw.set_grad_enabled(grad)
            try:
                r = ours()
                assert (r.autograd_ctx is not None) == grad, "grad on must record a node, grad off none"
                del r
                case = harness.compare(f"8 x 1 MiB grad={'on' if grad else 'off'}", ours, reference,
                                       reps=reps, warmup=5, min_sample_s=0.02, bytes=nbytes,
                                       budget_s=12.0 if args.quick else None)
            finally:
                sw.set_grad_enabled(True)
            harness.log(args, case.summary(), f"| ours {nbytes / case.ours_s / 1e9:.2f} GB/s,"
                        f" ref {nbytes / case.reference_s / 1e9:.2f} GB/s, {case.reps} pairs x {case.inner} calls")
            cases.append(case)
        stats1 = carrier.stats()
        assert stats1["promotions"] == stats0["promotions"], "the timed projections must not promote anything"
        del full
        carrier.release()
    finally:
        try:
            os.unlink(path)
            os.rmdir(tmpdir)
        except OSError:
            pass
    harness.emit(harness.record("gather", cases, target=TARGET, better="lower", quick=args.quick,
                                note="reference: one np.copyto of 8 MiB into a touched array"))


if __name__ == "__main__":
    main()
