"""Which dtype should the held gradient of a BFloat16 tiled weight have? (docs/guide.md, "Tiled gradients of 16-bit
parameters"; not part of ``make bench``.)

StrideWeave keeps the .grad of a 16-bit TiledEvictable in the weight's dtype. A SparseMoE call's dW is a BFloat16
product (Float32 sums over its tokens, rounded once), added into the .grad in Float32 and rounded once: what torch's
AccumulateGrad does. A Float32 .grad that the caller set before backward (zeros) is kept Float32 and accumulates
the same BFloat16 dWs without rounding. This script runs the
same K backwards of a BFloat16 ``SparseMoE`` (given routing: ``moe.experts``) three ways and compares the gradients
with the exact Float64 gradient of the same stored inputs:

* ``sw bf16 .grad``: the default;
* ``sw f32 .grad``: a Float32 zero .grad set before the first backward;
* ``torch bf16``: PyTorch on the same block, one BFloat16 ``nn.Parameter`` per expert weight (torch's AccumulateGrad
  adds a BFloat16 dW into a BFloat16 .grad: two roundings per backward);
* ``floor``: the Float64 gradient rounded once to BFloat16 (what any BFloat16 gradient must lose).

Reported: ||G - R||_F / ||R||_F over all three weights, after K = 1, 4 and 16 backwards, and, under a budget of
the experts' weight bytes, the budget's evictions and the backward time of the 16 accumulated backwards.

    .venv/bin/python bench/grad_dtype.py [--experts 8 --hidden 256 --inter 512 --tokens 256]
"""

from __future__ import annotations

import argparse
import platform
import time

import ml_dtypes
import numpy as np
import torch

import strideweave as sw
from strideweave import DType, friendly
from strideweave.carriers.tiled_evictable import ResidencyBudget, TiledEvictable


def tiled(stack, budget):
    """(rows, cols, E) over a TiledEvictable of BFloat16 row-major (out, in) tiles, tile e = stack[e]."""
    e, r, c = stack.shape
    tier = sw.move(friendly.tensor(stack.reshape(-1).astype(ml_dtypes.bfloat16)), sw.FileBacked(dtype=DType.BFloat16))
    carrier = TiledEvictable(sw.CPU(0, dtype=DType.BFloat16), tier.carrier, (1, 1, e), (r, c, 1),
                             residency_budget=budget)
    return sw.Tensor(carrier, 0, sw.Layout(sw.Shape(r, c, e), sw.Stride(c, 1, r * c)))


def float32_zero_grad(full, budget):
    """A Float32 .grad of zeros with the weight's tiles and layout (its own scratch file, the same budget)."""
    tier = sw.move(friendly.tensor(np.zeros(full.size(), np.float32)), sw.FileBacked())
    c = TiledEvictable(sw.CPU(0), tier.carrier, full.carrier.grid_shape, full.carrier.tile_shape,
                       residency_budget=budget)
    return sw.Tensor(c, 0, full.layout)


def problem(seed, E, H, I, T, K):
    rng = np.random.default_rng(seed)
    bf = lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    w1, w3 = bf(rng.standard_normal((E, I, H)) / np.sqrt(H)), bf(rng.standard_normal((E, I, H)) / np.sqrt(H))
    w2 = bf(rng.standard_normal((E, H, I)) / np.sqrt(I))
    steps = []
    for _ in range(K):
        x = bf(rng.standard_normal((T, H)))
        idx = np.stack([rng.choice(E, 2, replace=False) for _ in range(T)]).astype(np.int32)
        w = rng.uniform(0.2, 0.8, (T, 2)).astype(np.float32)
        w[:, 1] = 1 - w[:, 0]
        g = rng.standard_normal((T, H)).astype(np.float32)
        steps.append((x, idx, w, g))
    return (w1, w2, w3), steps


def torch_grads(weights, steps, dtype, K):
    """Per-expert nn.Parameters of `dtype`; the block computed in `dtype`; .grad accumulated by torch over K steps."""
    params = [[torch.nn.Parameter(torch.from_numpy(w[e]).to(dtype)) for e in range(w.shape[0])] for w in weights]
    for x, idx, wts, g in steps[:K]:
        xt = torch.from_numpy(x).to(dtype)
        out = torch.zeros(x.shape, dtype=dtype)
        for e in range(weights[0].shape[0]):
            tok, slot = np.nonzero(idx == e)
            if tok.size == 0:
                continue
            xe = xt[tok]
            h = torch.nn.functional.silu(xe @ params[0][e].T) * (xe @ params[2][e].T)
            y = h @ params[1][e].T
            out = out.index_add(0, torch.from_numpy(tok), y * torch.from_numpy(wts[tok, slot]).to(dtype)[:, None])
        out.backward(torch.from_numpy(g).to(dtype))
    return [np.stack([p.grad.double().numpy() for p in ps]) for ps in params]


def sw_grads(weights, steps, K, float32_grad, budget=None):
    moe = sw.moe.SparseMoE(*(tiled(w, budget) for w in weights), top_k=2, budget=budget)
    if float32_grad:
        for name in ("w1", "w2", "w3"):
            getattr(moe, name).grad = float32_zero_grad(getattr(moe, name), budget)
    seconds = 0.0
    for x, idx, wts, g in steps[:K]:
        xt = friendly.tensor(x.astype(ml_dtypes.bfloat16))
        out = moe.experts(xt, friendly.tensor(wts), friendly.tensor(idx, dtype=DType.Int32))
        start = time.perf_counter()
        out.backward(friendly.tensor(g))
        seconds += time.perf_counter() - start
    grads = [np.asarray(getattr(moe, n).grad).astype(np.float64).transpose(2, 0, 1) for n in ("w1", "w2", "w3")]
    assert all(getattr(moe, n).grad.dtype() is (DType.Float32 if float32_grad else DType.BFloat16)
               for n in ("w1", "w2", "w3"))
    return grads, seconds


def rel(got, want):
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(got, want))
    return np.sqrt(num / sum(float(np.sum(b**2)) for b in want))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=20261230)
    a = p.parse_args()
    E, H, I, T = a.experts, a.hidden, a.inter, a.tokens
    sw.set_grad_enabled(True)
    print(f"seed {a.seed}; E {E} H {H} I {I} T {T} top-2; {platform.processor() or platform.machine()}")
    weights, steps = problem(a.seed, E, H, I, T, 16)
    print("| backwards | sw bf16 .grad | sw f32 .grad | torch bf16 | floor (R rounded to bf16) |")
    print("|---|---|---|---|---|")
    for K in (1, 4, 16):
        ref = torch_grads(weights, steps, torch.float64, K)
        floor = [x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in ref]
        row = [rel(sw_grads(weights, steps, K, False)[0], ref), rel(sw_grads(weights, steps, K, True)[0], ref),
               rel(torch_grads(weights, steps, torch.bfloat16, K), ref), rel(floor, ref)]
        print(f"| {K} | " + " | ".join(f"{v:.2e}" for v in row) + " |")
    weight_bytes = 3 * E * I * H * 2
    print(f"\nbudget {weight_bytes} bytes (the experts' BFloat16 weights), 16 accumulated backwards:")
    for f32 in (False, True):
        budget = ResidencyBudget(weight_bytes)
        _, seconds = sw_grads(weights, steps, 16, f32, budget)
        s = budget.stats()
        print(f"  {'f32' if f32 else 'bf16'} .grad: gradient bytes {weight_bytes * (2 if f32 else 1)}, "
              f"evictions {s['evictions']}, backward {seconds:.3f} s")


if __name__ == "__main__":
    main()
