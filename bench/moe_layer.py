"""moe_layer: the examples/moe_offload.py workload against PyTorch with every expert in RAM.

Targets: throughput ratio >= 0.8 (StrideWeave tokens/s / PyTorch tokens/s)
at <= 0.35 x PyTorch's peak resident memory.

StrideWeave: the example's ``run_strideweave`` at the example's defaults: two
matrices of 64 experts (1024 x 1024 Float32, 4 MiB each: 512 MiB in two raw
files), opened in place as the FileBacked secondary tier of one
TiledEvictable each, an ``LRUPolicy(16)`` residency budget per matrix, top-2
routing with Zipf-skewed experts, 256 tokens a batch, forward + backward with
gradients accumulated in full-shaped tiled gradients; the next batch's experts
are prefetched while the current one computes.

Reference: the example's PyTorch worker, mode "ram": every expert read into
RAM before timing (not counted in its wall time), then the same batches, same
math (``relu(x W1^T) W2^T`` times the gate, backward with the same cotangent,
gradients in each expert's ``.grad``).

The checkpoint is written once (bench/_moe.py: the example's
``write_checkpoint``) and both sides read it from the page cache. Each run is a
fresh process (its peak RSS is its own; the PyTorch worker is the example's
module, which imports strideweave too), run A B A B: StrideWeave, PyTorch,
StrideWeave, ... Per pair: throughput ratio = ours tokens/s / reference
tokens/s ("ratio", higher is better) and memory ratio = ours peak RSS /
reference peak RSS ("memory_ratio", lower is better); the record reports the
median and min/max of each and whether each target is met ("meets_target",
"memory_meets_target", "targets_met").

Both modes run the example's whole workload, 120 batches (a shorter run
mostly measures the first batches, which read every expert they route to
from the file, and PyTorch's peak there is lower because fewer experts have
gradients yet): --quick 2 pairs (about 50 s), the full run 5 pairs. The
benchmark runs the example unchecked, so no output is kept.

Usage: python bench/moe_layer.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _moe  # noqa: E402
import harness  # noqa: E402

TARGET = 0.8  # throughput ratio, higher is better
MEMORY_TARGET = 0.35  # peak-RSS ratio, lower is better
MiB = 1 << 20


def main(argv=None) -> None:
    args = harness.parse_args("moe_layer", argv, __doc__)
    pairs = args.reps or (2 if args.quick else 5)
    cfg = _moe.config(batches=120)

    def describe(a, b):
        return (f"StrideWeave {a['tokens_per_s']:.0f} tokens/s, peak RSS {a['peak_rss'] / MiB:.0f} MiB, up to "
                f"{a['peak_resident_experts']} experts resident a matrix (prefetch wait {a['prefetch_wait']:.2f} s, "
                f"project {a['project']:.2f} s, compute {a['compute']:.2f} s); PyTorch in RAM "
                f"{b['tokens_per_s']:.0f} tokens/s, peak RSS {b['peak_rss'] / MiB:.0f} MiB "
                f"-> throughput {a['tokens_per_s'] / b['tokens_per_s']:.3f}, memory {a['peak_rss'] / b['peak_rss']:.3f}")

    ours, ref, nbytes = _moe.interleaved_pairs(args, "moe_layer", cfg, pairs, None, "ram", describe)

    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, ref)]
    case = _moe.pairs_case(cfg, ours, ref, ratios, nbytes)
    rec = _moe.record_with_memory(args, "moe_layer", case, ours, ref, TARGET, MEMORY_TARGET, "all experts in RAM")
    rec.update({
        "batches": cfg.batches,
        "pairs": len(ratios),
    })
    harness.emit(rec)


if __name__ == "__main__":
    main()
