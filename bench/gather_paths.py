"""gather_paths: a two-expert projection of resident tiles copied by the caller (Note [Gathering in the caller])
against the same projection copied on the selection threads, for row-major and column-major experts.

A measurement, not a benchmark with a target (bench/run_all.py skips it). Both sides are the same call,
``carrier.project(full, TileSelection([[0], [5, 2]])).wait()`` over E = 8 resident experts of (512, 256)
Float32 (the tiles of bench/rowmajor.py); the reference side first sets ``_core._set_caller_gather_bytes(0)``,
which sends every gather to the selection threads (the path every projection took before), ours restores the
default (4 MiB). Timed interleaved by harness.compare; ratio = caller / selection threads.

Usage: python bench/gather_paths.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import strideweave as sw  # noqa: E402
from strideweave import _core  # noqa: E402

OUT, IN, EXPERTS = 512, 256, 8
PAIR = [5, 2]


def main(argv=None) -> None:
    args = harness.parse_args("gather_paths", argv, __doc__)
    reps = args.reps or (10 if args.quick else 40)
    experts = np.random.default_rng(0).standard_normal((EXPERTS, OUT, IN), dtype=np.float32)
    default = _core._set_caller_gather_bytes(0)
    _core._set_caller_gather_bytes(default)
    cases = []
    with tempfile.TemporaryDirectory(prefix="sw-bench-gather-paths-") as tmp:
        for name, row_major in (("row-major experts, flat (out, 2 in)", True), ("column-major experts", False)):
            path = os.path.join(tmp, "row.f32" if row_major else "col.f32")
            (experts if row_major else experts.transpose(0, 2, 1)).copy().tofile(path)
            carrier = sw.TiledEvictable(sw.CPU(0), sw.FileBacked(path), (1, EXPERTS), (OUT, IN))
            layout = (sw.Layout(sw.Shape(OUT, [IN, EXPERTS]), sw.Stride(IN, [1, OUT * IN])) if row_major
                      else sw.column_major(OUT, [IN, EXPERTS]))
            full = sw.Tensor(carrier, 0, layout)
            carrier.promote(sw.TileSelection([[0], list(range(EXPERTS))]).tile_set)
            pair = sw.TileSelection([[0], PAIR])
            want = np.concatenate([experts[e] for e in PAIR], axis=1)

            def project(limit, carrier=carrier, full=full, pair=pair):
                _core._set_caller_gather_bytes(limit)
                with sw.no_grad():
                    return carrier.project(full, pair).wait()

            for limit in (default, 0):  # same values on both paths, checked once before timing
                assert np.array_equal(np.asarray(project(limit)), want), "projection differs"
            try:
                case = harness.compare(name, lambda: project(default), lambda: project(0), reps=reps, warmup=3,
                                       min_sample_s=0.05, bytes=2 * OUT * IN * 4)
            finally:
                _core._set_caller_gather_bytes(default)
            harness.log(args, case.summary())
            cases.append(case)
            carrier.release()
    harness.emit(harness.record("gather_paths", cases, target=1.0, better="lower", quick=args.quick,
                                note="ratio = copied by the caller / on the selection threads (a measurement)"))


if __name__ == "__main__":
    main()
