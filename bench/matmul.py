"""matmul: sw.matmul on CPU tensors against NumPy ``a @ b.T`` (OpenBLAS); target ratio <= 1.10.

StrideWeave's matmul(lhs (m, k), rhs (n, k)) -> (m, n). Cases: (64 x 4096) by
(1024 x 4096) and (512 x 1024) by (1024 x 1024), each with grad mode on (the
Float32 operands are differentiable, so an autograd node is recorded) and off
(sw.no_grad). The reference is NumPy ``a @ b.T`` on arrays with the same
values (no autograd in either grad mode). StrideWeave's tensors are its
canonical dense layout (first mode fastest); NumPy's arrays are its canonical
C order. "ratio" is the worst case; every case is in "detail" and "cases".

Usage: python bench/matmul.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import strideweave as sw  # noqa: E402
from strideweave import friendly  # noqa: E402

TARGET = 1.10
SHAPES = [((64, 4096), (1024, 4096)), ((512, 1024), (1024, 1024))]


def main(argv=None) -> None:
    args = harness.parse_args("matmul", argv, __doc__)
    reps = args.reps or (10 if args.quick else 40)
    # Two OpenBLAS builds live in this process (NumPy's bundled one and the
    # system one StrideWeave links). After a call each build's worker threads
    # spin for a while, and on a 2-core machine the spinning pool of one side
    # takes a core from the other side's next sample. Measured alone, each
    # side runs at full speed; interleaved without a pause, whichever pool
    # spins longer makes the *other* side look up to 25% slower. So every
    # timed sample starts after an untimed settle pause (both sides alike),
    # and samples are long enough to amortise what is left of the hand-over.
    min_sample_s = 0.2 if args.quick else 0.5
    settle_s = 0.3
    budget_s = 8.0 if args.quick else None  # per case: --quick stays under a minute
    rng = np.random.default_rng(0)
    cases = []
    for (m, k), (n, k2) in SHAPES:
        assert k == k2
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((n, k), dtype=np.float32)
        ta, tb = friendly.tensor(a), friendly.tensor(b)
        nbytes = (m * k + n * k + m * n) * 4
        flops = 2 * m * n * k

        # Same math, checked once before timing.
        expect = a @ b.T
        got = np.asarray(sw.matmul(ta, tb))
        if got.shape != expect.shape or not np.allclose(got, expect, rtol=1e-4, atol=1e-3 * np.sqrt(k)):
            raise SystemExit(f"matmul ({m}x{k}) by ({n}x{k}): StrideWeave and NumPy disagree")

        def reference(a=a, b=b):
            return a @ b.T

        for grad in (True, False):
            def ours(ta=ta, tb=tb):
                return sw.matmul(ta, tb)

            sw.set_grad_enabled(grad)
            try:
                if grad:
                    assert sw.matmul(ta, tb).autograd_ctx is not None, "grad on must record a node"
                else:
                    assert sw.matmul(ta, tb).autograd_ctx is None
                case = harness.compare(
                    f"({m}x{k})@({n}x{k})^T grad={'on' if grad else 'off'}",
                    ours, reference, reps=reps, warmup=3, min_sample_s=min_sample_s, bytes=nbytes, budget_s=budget_s,
                    settle_s=settle_s,
                )
            finally:
                sw.set_grad_enabled(True)
            harness.log(args, case.summary(), f"| ours {flops / case.ours_s / 1e9:.1f} GFLOP/s,"
                        f" ref {flops / case.reference_s / 1e9:.1f} GFLOP/s, {case.reps} pairs x {case.inner} calls")
            cases.append(case)
    harness.emit(harness.record("matmul", cases, target=TARGET, better="lower", quick=args.quick))


if __name__ == "__main__":
    main()
