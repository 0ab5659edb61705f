"""interleave: sw.matmul and NumPy's ``a @ b.T`` called alternately in one process (a measurement, no target).

Users mix NumPy and StrideWeave calls. Two thread pools then share the cores:
NumPy's bundled OpenBLAS (its workers spin after each call before they sleep)
and StrideWeave's compute pool (Note [Compute pool] in
cpp/src/ops/compute_pool.cpp). This measures what each side's calls cost

* alone: that side's calls back to back, after a settle pause;
* interleaved: ours, NumPy's, ours, NumPy's, ... with no pause, each call
  timed on its own;

for (64 x 4096) by (1024 x 4096)^T, the shape of bench/matmul.py's first case
(grad mode off). It reports the median per-call time of each side in both
settings and the slowdown interleaving causes (interleaved / alone), with the
CPU it ran on. bench/run_all.py does not run it (no target); its figures are in
docs/performance.md.

Usage: python bench/interleave.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import numpy as np

import strideweave as sw
from strideweave import friendly


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - a missing lscpu only loses the label
        return platform.processor() or "unknown"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=60, help="calls of each side per round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of alone/interleaved (default %(default)s)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 4096), dtype=np.float32)
    b = rng.standard_normal((1024, 4096), dtype=np.float32)
    ta, tb = friendly.tensor(a), friendly.tensor(b)

    def ours():
        return sw.matmul(ta, tb)

    def numpy_side():
        return a @ b.T

    times = {k: [] for k in ("ours alone", "numpy alone", "ours interleaved", "numpy interleaved")}
    with sw.no_grad():
        assert np.allclose(np.asarray(ours()), numpy_side(), rtol=1e-4, atol=1e-3 * 64)
        for _ in range(args.rounds):
            for name, fn in (("ours alone", ours), ("numpy alone", numpy_side)):
                time.sleep(0.3)  # the other side's workers go idle
                times[name] += [timed(fn) for _ in range(args.calls)]
            time.sleep(0.3)
            for _ in range(args.calls):
                times["ours interleaved"].append(timed(ours))
                times["numpy interleaved"].append(timed(numpy_side))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "bench": "interleave", "cpu": cpu_name(),
        "ours_alone_us": med["ours alone"] * 1e6, "numpy_alone_us": med["numpy alone"] * 1e6,
        "ours_interleaved_us": med["ours interleaved"] * 1e6, "numpy_interleaved_us": med["numpy interleaved"] * 1e6,
        "ours_slowdown": med["ours interleaved"] / med["ours alone"],
        "numpy_slowdown": med["numpy interleaved"] / med["numpy alone"],
        "ours_vs_numpy_interleaved": med["ours interleaved"] / med["numpy interleaved"],
    }
    print(f"CPU: {result['cpu']}; (64 x 4096) @ (1024 x 4096)^T, median per call over {args.rounds} x {args.calls}")
    print(f"{'':<10} {'alone':>10} {'interleaved':>12} {'slowdown':>9}")
    for side in ("ours", "numpy"):
        print(f"{side:<10} {result[side + '_alone_us']:>8.0f} us {result[side + '_interleaved_us']:>9.0f} us "
              f"{result[side + '_slowdown']:>8.2f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
