"""finetune: the examples/finetune_moe.py workload, StrideWeave offloaded against PyTorch with everything in RAM.

Targets: throughput ratio >= 0.8 (StrideWeave tokens/s / PyTorch tokens/s) at <= 0.3 x PyTorch's peak resident
memory.

Workload (the example's defaults unless --quick): a Mixtral-format BFloat16 checkpoint written once with the
safetensors package (4 MoE layers of 8 SwiGLU experts, H 256, I 512: 24 MiB of experts), fine-tuned for a number
of steps of 512 tokens on the example's synthetic next-token objective (fixed random successor rule over a
512-token vocabulary, frozen embedding, unembedding and routers, top-2 routing, cross-entropy), AdamW on every
expert (lr 1e-3, weight decay 0.01).

StrideWeave: the example's ``train``: the checkpoint opened where it lies (``ckpt.tiled``), one ``SparseMoE`` per
layer, ``sw.optim.AdamW`` with Float32 moments, everything under one ``ResidencyBudget`` of a fifth of experts +
gradients + moments (the rest lives in the checkpoint's overlay and scratch files), the next step's experts
prefetched.

Reference: the example's PyTorch worker: every tensor loaded into RAM (not timed), the same model and objective in
bf16, Float32 master weights (one ``nn.Parameter`` per expert matrix) and moments, ``torch.optim.AdamW`` with its
defaults (the foreach implementation), PyTorch's default threads.

Each run is a fresh process (its peak RSS is its own), A B A B. Per pair: throughput ratio = ours tokens/s /
reference tokens/s ("ratio", higher is better) and memory ratio = ours peak RSS / reference peak RSS
("memory_ratio", lower is better); the record reports the median and range of each and whether each target is
met. --quick: 2 pairs of 12 steps (about half a minute); the full run: 3 pairs of the example's 24 steps.

Usage: python bench/finetune.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _moe  # noqa: E402
import harness  # noqa: E402

TARGET = 0.8  # throughput ratio, higher is better
MEMORY_TARGET = 0.3  # peak-RSS ratio, lower is better
MiB = 1 << 20
EXAMPLE = os.path.join(ROOT, "examples", "finetune_moe.py")


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_moe", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _strideweave_worker(job: dict) -> dict:
    ex = load_example()
    cfg = ex.Config(**job["cfg"])
    r = ex.train(cfg, job["folder"])
    out = {"wall": r["wall"], "tokens_per_s": r["tokens_per_s"], "peak_rss": r["peak_rss"],
           "wait_seconds": r["wait_seconds"], "hit_rate": r["hits"] / max(1, r["expert_visits"]),
           "moments_read": r["moments_read"], "weights_read": r["weights_read"]}
    r["model"].release()
    return out


def main(argv=None) -> None:
    args = harness.parse_args("finetune", argv, __doc__)
    ex = load_example()
    pairs = args.reps or (2 if args.quick else 3)
    cfg = ex.Config(steps=12 if args.quick else ex.Config().steps, check=False, progress=False)
    payload = None
    ours, ref = [], []
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as directory:
        folder = os.path.join(directory, "mixtral")
        ex.write_checkpoint(cfg, folder)
        payload = json.dumps({"cfg": dataclasses.asdict(cfg), "folder": folder})
        for k in range(pairs):
            a = _moe._run([sys.executable, os.path.abspath(__file__), "--_worker", payload], "StrideWeave")
            b = _moe._run([sys.executable, EXAMPLE, "--_torch-worker", payload], "PyTorch")
            ours.append(a)
            ref.append(b)
            harness.log(args, f"pair {k + 1}/{pairs}: StrideWeave {a['tokens_per_s']:.0f} tokens/s, peak RSS "
                        f"{a['peak_rss'] / MiB:.0f} MiB (I/O wait {a['wait_seconds']:.2f} s, hit rate "
                        f"{a['hit_rate']:.1%}); PyTorch in RAM {b['tokens_per_s']:.0f} tokens/s, peak RSS "
                        f"{b['peak_rss'] / MiB:.0f} MiB")
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, ref)]
    state = sum(cfg.state_bytes().values())
    case = harness.Case(
        name=f"{cfg.steps} steps, {cfg.layers} layers x {cfg.experts} experts, budget 1/{cfg.budget_ratio:g}",
        ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
        ours_s=statistics.median(a["wall"] for a in ours), reference_s=statistics.median(b["wall"] for b in ref),
        reps=len(ratios), inner=1, bytes=state, ratios=ratios,
    )
    rec = _moe.record_with_memory(args, "finetune", case, ours, ref, TARGET, MEMORY_TARGET, "everything in RAM")
    rec.update({
        "state_bytes": state,
        "steps": cfg.steps,
        "pairs": len(ratios),
    })
    harness.emit(rec)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
        print(json.dumps(_strideweave_worker(json.loads(sys.argv[2]))))
    else:
        main()
