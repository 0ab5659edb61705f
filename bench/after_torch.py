"""after_torch: what PyTorch's spinning OpenMP threads cost the sw.matmul calls that follow PyTorch's.

A measurement, not a benchmark with a target (bench/run_all.py skips it). The bf16 product of
bench/checkpoint.py, (64 x 4096)(4096 x 4096)^T, timed call by call:

* each side alone: the median over 10 samples of 8 back-to-back calls (ms a call);
* eight sw.matmul calls right after two of PyTorch's ``x @ w.T``, each call timed, and eight of PyTorch's right
  after two sw.matmul calls.

Usage: python bench/after_torch.py
"""

from __future__ import annotations

import statistics
import time

import torch

import strideweave as sw


def per_call_ms(f, calls: int = 8) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e3


def each_call_ms(f, calls: int = 8) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).bfloat16()
    w = torch.randn(4096, 4096, generator=gen).bfloat16()
    xs, ws = sw.from_dlpack(x), sw.from_dlpack(w)

    def ours():
        return sw.matmul(xs, ws)

    def ref():
        return x @ w.T

    with sw.no_grad():
        for _ in range(3):
            ours()
            ref()
        print(f"torch threads {torch.get_num_threads()}")
        print(f"alone: sw.matmul {statistics.median(per_call_ms(ours) for _ in range(10)):.2f} ms a call, "
              f"PyTorch {statistics.median(per_call_ms(ref) for _ in range(10)):.2f} ms a call")
        for _ in range(3):
            ref()
            ref()
            after_torch = each_call_ms(ours)
            ours()
            ours()
            after_ours = each_call_ms(ref)
            print("sw.matmul right after PyTorch:", " ".join(f"{t:.2f}" for t in after_torch), "ms")
            print("PyTorch right after sw.matmul:", " ".join(f"{t:.2f}" for t in after_ours), "ms")


if __name__ == "__main__":
    main()
