"""hf_families: a training step and an inference call of whole tiny-but-not-trivial Hugging Face MoE models, opened
with ``strideweave.torch.from_pretrained`` (experts bound to checkpoint tiles), against the same model in RAM with
transformers (its default experts implementation), side by side in one process. Not part of ``make bench``.

Each family from ``tests/hf_families.py``'s zoo at hidden 512, expert intermediate 1024, 8 experts, top-2, 2 or 3
layers, 4 x 64 tokens; the budget holds every expert (this measures the computation, not the tier: the tiles stay
resident after the first call). Median of 5 calls after one untimed call, torch with 2 threads.

    .venv/bin/python bench/hf_families.py [family ...] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import hf_families  # noqa: E402
import strideweave.torch as swt  # noqa: E402

SIZES = {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 1024}


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def median_ms(fn, calls: int = 5) -> float:
    fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("families", nargs="*", default=["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu()}, torch {torch.__version__}, transformers {transformers.__version__}, {args.dtype}")
    print(f"{'family':<12} {'path':<16} {'train torch':>12} {'train sw':>9} {'ratio':>6} {'infer torch':>12} "
          f"{'infer sw':>9} {'ratio':>6}")
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    for name in args.families:
        f = hf_families.ZOO[name]
        overrides = {k: v for k, v in SIZES.items() if k in f.config}
        model = hf_families.build(f, 0, **overrides).to(dtype)
        folder = tempfile.mkdtemp()
        model.save_pretrained(folder)
        del model
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
        ours = swt.from_pretrained(folder, 1 << 40)
        path = "SparseMoE" if all(b.native for b in swt.offloaded_experts(ours).values()) else "per-expert math"

        def train(m):
            return lambda: m(input_ids=ids, labels=ids).loss.backward()

        def infer(m):
            def run():
                with torch.no_grad():
                    m(input_ids=ids)
            return run

        t = [median_ms(train(ref)), median_ms(train(ours)), median_ms(infer(ref)), median_ms(infer(ours))]
        print(f"{name:<12} {path:<16} {t[0]:>10.1f}ms {t[1]:>7.1f}ms {t[0] / t[1]:>6.2f} {t[2]:>10.1f}ms "
              f"{t[3]:>7.1f}ms {t[2] / t[3]:>6.2f}")


if __name__ == "__main__":
    main()
