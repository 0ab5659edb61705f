"""Shared by bench/moe_layer.py and bench/moe_naive.py: the examples/moe_offload.py workload, side by side.

Not a benchmark itself (run_all skips names starting with "_"). The workload
is the example's own code, imported, not copied: its ``Config`` (defaults: 64
experts of 1024 x 1024 Float32 per matrix, budget 16, top-2, Zipf 3.0, 256
tokens a batch, forward + backward), ``write_checkpoint``, ``run_strideweave``
and ``torch_worker``. Every run is a fresh process, so its peak resident
memory (``ru_maxrss``) is its own:

* StrideWeave: this file as a script, ``python bench/_moe.py JOB``, which runs
  ``run_strideweave`` on the checkpoint the benchmark wrote (the example's
  ``main`` would write a checkpoint of its own every run; the correctness
  check is ``main``'s and is skipped here: tests/test_moe_example.py covers it)
  and prints one JSON line. It never imports torch.
* PyTorch: the example's own worker entry point, ``python
  examples/moe_offload.py --_torch-worker JOB`` (what ``--compare`` runs),
  mode "ram" (every expert read into RAM first, not timed) or "naive" (each
  batch reads its experts from the file synchronously).

Both sides time the same loop of ``cfg.batches`` batches (batch generation
included on both sides); tokens/s = batches * tokens / wall.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "moe_offload.py")


def load_example():
    """examples/moe_offload.py as the module `moe_offload` (imports strideweave, never torch)."""
    examples = os.path.dirname(EXAMPLE)
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import moe_offload

    return moe_offload


def config(batches: int):
    """The example's workload at its defaults (benchmarks.md), `batches` long, quiet and unchecked."""
    moe = load_example()
    return moe.Config(batches=batches, check=False, progress=False)


def write_checkpoint(cfg, directory: str) -> dict:
    """The example's checkpoint (one raw file per matrix), written once per benchmark run."""
    return load_example().write_checkpoint(cfg, directory)


def _job(cfg, paths: dict, mode: str) -> str:
    return json.dumps({"mode": mode, "cfg": dataclasses.asdict(cfg), "paths": paths})


def _run(cmd: list, what: str) -> dict:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the {what} run failed (exit status {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise SystemExit(f"the {what} run printed nothing:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def run_strideweave(cfg, paths: dict) -> dict:
    """One StrideWeave run in a fresh process: {"wall", "tokens_per_s", "peak_rss", ...}."""
    return _run([sys.executable, os.path.abspath(__file__), _job(cfg, paths, "strideweave")], "StrideWeave")


def run_torch(cfg, paths: dict, mode: str) -> dict:
    """One PyTorch run ("ram" or "naive") in a fresh process, through the example's own worker entry point."""
    return _run([sys.executable, EXAMPLE, "--_torch-worker", _job(cfg, paths, mode)], f"PyTorch {mode}")


def interleaved_pairs(args, bench: str, cfg, pairs: int, budget_s, mode: str, describe) -> tuple:
    """Writes the checkpoint once, then runs StrideWeave and PyTorch (`mode`: "ram" or "naive") alternately,
    each in a fresh process, `pairs` times (with `budget_s`, no third pair once two took that long: --quick stays
    under a minute). Logs `describe(ours, ref)` after each pair. Returns (ours, ref, checkpoint bytes)."""
    import harness  # bench/ is on sys.path when a benchmark imports this module

    ours, ref = [], []
    with tempfile.TemporaryDirectory(prefix=f"sw-bench-{bench.replace('_', '-')}-") as directory:
        t0 = time.perf_counter()
        paths = write_checkpoint(cfg, directory)
        nbytes = sum(os.path.getsize(p) for p in paths.values())
        harness.log(args, f"checkpoint: {nbytes / (1 << 20):.0f} MiB written once in {time.perf_counter() - t0:.1f} s; "
                          f"{cfg.batches} batches x {cfg.tokens} tokens, {pairs} pairs")
        started = time.perf_counter()
        for i in range(pairs):
            if budget_s is not None and i >= 2 and time.perf_counter() - started > budget_s:
                break
            a = run_strideweave(cfg, paths)
            b = run_torch(cfg, paths, mode)
            ours.append(a)
            ref.append(b)
            harness.log(args, f"pair {i + 1}: {describe(a, b)}")
    return ours, ref, nbytes


def pairs_case(cfg, ours: list, ref: list, ratios: list, nbytes: int):
    """The harness Case of `interleaved_pairs`' runs: the median of the per-pair `ratios` and their range, the
    median wall times of each side."""
    import harness  # bench/ is on sys.path when a benchmark imports this module

    return harness.Case(
        name=f"{cfg.batches} batches, budget {cfg.budget} of {cfg.experts}",
        ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
        ours_s=statistics.median(a["wall"] for a in ours), reference_s=statistics.median(b["wall"] for b in ref),
        reps=len(ratios), inner=1, bytes=nbytes, ratios=ratios,
    )


def _strideweave_worker(job: dict) -> dict:
    import numpy as np

    moe = load_example()
    cfg = moe.Config(**job["cfg"])
    paths = job["paths"]
    p = moe.popularity(cfg)
    log_p = np.log(p)
    G = moe.cotangent(cfg)
    r = moe.run_strideweave(cfg, paths, lambda b: moe.make_batch(cfg, b, log_p), G, p)
    out = {
        "mode": "strideweave", "wall": r["wall"], "tokens_per_s": cfg.batches * cfg.tokens / r["wall"],
        "peak_rss": r["peak_rss"], "prefetch_wait": r["prefetch_wait"], "project": r["project"],
        "compute": r["compute"], "hit_rate": r["hits"] / r["requests"] if r["requests"] else 0.0,
        "bytes_promoted": r["bytes_promoted"], "peak_resident_experts": r["peak_resident_experts"],
    }
    moe.release_run(r)  # before exiting, as the example's main does
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/_moe.py JOB_JSON (started by bench/moe_layer.py, bench/moe_naive.py)")
    print(json.dumps(_strideweave_worker(json.loads(sys.argv[1]))), flush=True)


def record_with_memory(args, bench: str, case, ours: list, ref: list, target: float, memory_target: float,
                       reference: str) -> dict:
    """The harness record of a benchmark with a second target on peak memory (moe_layer, finetune): the throughput
    ratio of `case` (higher is better), and the per-pair memory ratios ours / reference peak RSS (lower is better)
    with their target and the median figures of each side. Logs the summary line."""
    import harness  # bench/ is on sys.path when a benchmark imports this module

    mem = [a["peak_rss"] / b["peak_rss"] for a, b in zip(ours, ref)]
    memory_ratio = statistics.median(mem)
    ours_rss = statistics.median(a["peak_rss"] for a in ours)
    ref_rss = statistics.median(b["peak_rss"] for b in ref)
    harness.log(args, case.summary(), f"| throughput (higher is better); peak RSS ours {ours_rss / (1 << 20):.0f} "
                f"MiB, ref {ref_rss / (1 << 20):.0f} MiB: memory ratio {memory_ratio:.3f} [{min(mem):.3f}, "
                f"{max(mem):.3f}]")
    rec = harness.record(
        bench, [case], target=target, better="higher", quick=args.quick,
        note=(f"ratio = StrideWeave tokens/s / PyTorch ({reference}) tokens/s; memory ratio (peak RSS, lower is "
              f"better) {memory_ratio:.3f} [{min(mem):.3f}, {max(mem):.3f}], target {memory_target:g}"),
    )
    memory_ok = memory_ratio <= memory_target
    rec.update({
        "ratio_label": "StrideWeave tokens/s / PyTorch (in RAM) tokens/s",
        "memory_ratio": round(memory_ratio, 4),
        "memory_ratio_min": round(min(mem), 4),
        "memory_ratio_max": round(max(mem), 4),
        "memory_target": memory_target,
        "memory_better": "lower",
        "memory_meets_target": memory_ok,
        "targets_met": rec["meets_target"] and memory_ok,
        "ours_tokens_per_s": round(statistics.median(a["tokens_per_s"] for a in ours), 1),
        "reference_tokens_per_s": round(statistics.median(b["tokens_per_s"] for b in ref), 1),
        "ours_peak_rss": int(ours_rss),
        "reference_peak_rss": int(ref_rss),
    })
    return rec
