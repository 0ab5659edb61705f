"""moe_naive: the examples/moe_offload.py workload against PyTorch loading each batch's experts synchronously.

Target: StrideWeave >= 2x faster (ratio = PyTorch naive wall / StrideWeave wall,
higher is better).

StrideWeave: the example's ``run_strideweave`` at the example's defaults, as in
bench/moe_layer.py: 64 experts of 1024 x 1024 Float32 per matrix in two raw
files opened in place as the FileBacked secondary tier, ``LRUPolicy(16)`` per
matrix, top-2 Zipf-skewed routing, 256 tokens a batch, forward + backward,
the next batch's experts prefetched while the current one computes.

Reference: the example's PyTorch worker, mode "naive": every batch reads each
of its experts from the checkpoint with one ``np.fromfile`` (made contiguous
for PyTorch), synchronously, no cache and no overlap, then the same math; the
gradients accumulate per expert in RAM.

The checkpoint is written once (the example's ``write_checkpoint``) and both
sides read it from the page cache. Each run is a fresh process (bench/_moe.py),
run A B A B: StrideWeave, PyTorch naive, StrideWeave, ... Per pair: ratio =
reference wall / ours wall; the record reports the median and min/max, plus
each side's tokens/s and peak RSS for context.

--quick runs 10 batches x 3 pairs, or 2 pairs when those took over 25 s (the
naive reference takes about a second a batch on a loaded 2-core machine); the
full run 120 batches x 4 pairs.

Usage: python bench/moe_naive.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _moe  # noqa: E402
import harness  # noqa: E402

TARGET = 2.0  # speed-up, higher is better
MiB = 1 << 20


def main(argv=None) -> None:
    args = harness.parse_args("moe_naive", argv, __doc__)
    pairs = args.reps or (3 if args.quick else 4)
    budget_s = 25.0 if args.quick else None  # no third pair once two took this long
    cfg = _moe.config(batches=10 if args.quick else 120)

    def describe(a, b):
        return (f"StrideWeave {a['wall']:.2f} s ({a['tokens_per_s']:.0f} tokens/s, prefetch wait "
                f"{a['prefetch_wait']:.2f} s); PyTorch naive {b['wall']:.2f} s ({b['tokens_per_s']:.0f} tokens/s, "
                f"synchronous reads {b['io']:.2f} s) -> speed-up {b['wall'] / a['wall']:.3f}")

    ours, ref, nbytes = _moe.interleaved_pairs(args, "moe_naive", cfg, pairs, budget_s, "naive", describe)

    ratios = [b["wall"] / a["wall"] for a, b in zip(ours, ref)]
    case = _moe.pairs_case(cfg, ours, ref, ratios, nbytes)
    io_s = statistics.median(b["io"] for b in ref)
    harness.log(args, case.summary(), f"| speed-up (higher is better); the reference's synchronous reads "
                f"{io_s:.2f} s of its {case.reference_s:.2f} s")
    rec = harness.record(
        "moe_naive", [case], target=TARGET, better="higher", quick=args.quick,
        note=(f"ratio = PyTorch naive wall / StrideWeave wall (speed-up); the reference's synchronous reads "
              f"{io_s:.2f} s of {case.reference_s:.2f} s"),
    )
    rec.update({
        "ratio_label": "PyTorch naive wall / StrideWeave wall (speed-up)",
        "ours_tokens_per_s": round(statistics.median(a["tokens_per_s"] for a in ours), 1),
        "reference_tokens_per_s": round(statistics.median(b["tokens_per_s"] for b in ref), 1),
        "reference_io_s": round(io_s, 3),
        "ours_peak_rss": int(statistics.median(a["peak_rss"] for a in ours)),
        "reference_peak_rss": int(statistics.median(b["peak_rss"] for b in ref)),
        "batches": cfg.batches,
        "pairs": len(ratios),
    })
    harness.emit(rec)


if __name__ == "__main__":
    main()
