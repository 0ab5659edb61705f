"""op_overhead: sw.add on two 1,024-element CPU tensors against torch.add (CPU); target ratio <= 1.0.

Two cases, grad mode on and off. Grad on: StrideWeave's Float32 tensors are
differentiable, so every add records an autograd node; PyTorch's tensors have
requires_grad=True, so torch.add records one too. Grad off: sw.no_grad and
torch.no_grad around the same calls with the same tensors. The work is tiny,
so this measures per-call overhead: argument handling, validation, result
allocation, dispatch and node creation. Calls go through functools.partial on
both sides so the loop costs the same for each.

Usage: python bench/op_overhead.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import strideweave as sw  # noqa: E402
import torch  # noqa: E402
from strideweave import friendly  # noqa: E402

TARGET = 1.0
N = 1024


def main(argv=None) -> None:
    args = harness.parse_args("op_overhead", argv, __doc__)
    reps = args.reps or (30 if args.quick else 100)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(N, dtype=np.float32)
    b = rng.standard_normal(N, dtype=np.float32)
    x, y = friendly.tensor(a), friendly.tensor(b)
    tx = torch.from_numpy(a.copy()).requires_grad_(True)
    ty = torch.from_numpy(b.copy()).requires_grad_(True)
    if not np.array_equal(np.asarray(sw.add(x, y)), (tx + ty).detach().numpy()):
        raise SystemExit("add: StrideWeave and PyTorch disagree")
    ours = functools.partial(sw.add, x, y)
    reference = functools.partial(torch.add, tx, ty)
    nbytes = 3 * N * 4
    cases = []
    for grad in (True, False):
        sw.set_grad_enabled(grad)
        torch.set_grad_enabled(grad)
        try:
            assert (ours().autograd_ctx is not None) == grad
            assert (reference().grad_fn is not None) == grad
            case = harness.compare(f"add 2x{N} grad={'on' if grad else 'off'}", ours, reference,
                                   reps=reps, warmup=1000, min_sample_s=0.02, bytes=nbytes,
                                   budget_s=20.0 if args.quick else None)
        finally:
            sw.set_grad_enabled(True)
            torch.set_grad_enabled(True)
        harness.log(args, case.summary(), f"| {case.reps} pairs x {case.inner} calls")
        cases.append(case)
    harness.emit(harness.record("op_overhead", cases, target=TARGET, better="lower", quick=args.quick,
                                note=f"torch {torch.__version__}, {torch.get_num_threads()} threads"))


if __name__ == "__main__":
    main()
