"""Tiled gradients of 16-bit parameters (Note [Tiled gradients of 16-bit parameters] in
cpp/src/tiled/gradient_dtypes.cpp).

A BFloat16 or Float16 TiledEvictable leaf (a file of experts, or a safetensors checkpoint) is projected a few tiles
at a time, multiplied and backpropagated many times. Its .grad is a TiledEvictable of the parameter's dtype; the
contributions of one backward add in Float32 and are rounded to 16 bits once per backward, tile by tile (the .grad
carrier is the same one, advanced once per step: never a dense full-size sum).

Error bound, per slot, against a Float64 reference R_k (the exact sum of the exact products of the stored 16-bit
inputs and the Float32 seeds): backward j contributes c_j = sum over its tokens (and its projections) of g x, computed
in Float32 with |c^_j - c_j| <= gamma_n S_j (S_j: the same sum of |g||x|, n: its number of products,
gamma_n = n u / (1 - n u), u = 2^-24); the held gradient G_j = round16(fl32(G_{j-1} + c^_j)) satisfies
|G_j - (G_{j-1} + c^_j)| <= (u16 + u) |G_{j-1} + c^_j|, u16 = 2^-8 (BFloat16) or 2^-11 (Float16). So
E_j = |G_j - R_j| <= E_{j-1} + gamma_n S_j + (u16 + u)(|R_j| + E_{j-1} + gamma_n S_j), accumulated below.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261218

OUT, IN, E, TOKENS = 4, 3, 6, 5
U = 2.0**-24
DTYPES = [
    pytest.param(sw.DType.BFloat16, ml_dtypes.bfloat16, 2.0**-8, id="bf16"),
    pytest.param(sw.DType.Float16, np.float16, 2.0**-11, id="fp16"),
]
# Steps: the experts each backward projects (a list of lists: one projection per inner list, all in one backward).
STEPS = [[[1]], [[4]], [[1, 2]], [[4]], [[1], [1, 4]], [[2]], [[1]], [[4], [2]]]


def gamma(n):
    return n * U / (1 - n * U)


def expert_weight(experts16, dtype, row_major):
    """A TiledEvictable over a FileBacked tier of `experts16` (E, OUT, IN) in the parameter's dtype."""
    flat = experts16 if row_major else experts16.transpose(0, 2, 1)
    data = np.ascontiguousarray(flat).reshape(-1)
    tier = sw.move(friendly.tensor(data), sw.FileBacked(dtype=dtype))
    c = TiledEvictable(sw.CPU(0, dtype=dtype), tier.carrier, (1, E), (OUT, IN))
    stride = sw.Stride(IN, [1, OUT * IN]) if row_major else sw.Stride(1, [OUT, OUT * IN])
    return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), stride))


def grad_values(full):
    # Slot reads in this thread (a projection's job could still hold the gradient carrier when the next backward
    # asks whether only the leaf holds it, making that sum a fresh one).
    return np.asarray(full.grad).astype(np.float64)


def run_steps(c, full, np16, rng, u16):
    """Runs STEPS; returns (reference, bound) as Float64 (OUT, IN * E) arrays, checking after every step."""
    ref = np.zeros((OUT, IN * E))
    err = np.zeros((OUT, IN * E))
    versions = []
    for step in STEPS:
        contrib = np.zeros((OUT, IN * E))
        mags = np.zeros((OUT, IN * E))
        count = np.zeros((OUT, IN * E))
        ys = []
        for chosen in step:
            w = c.project(full, TileSelection([[0], chosen])).wait()
            x = rng.standard_normal((TOKENS, IN * len(chosen))).astype(np16)
            g = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
            y = sw.matmul(friendly.tensor(x), w)
            ys.append(sw.elementwise_mul(y, friendly.tensor(g)))
            x64, g64 = x.astype(np.float64), g.astype(np.float64)
            for k, e in enumerate(chosen):
                cols = np.s_[:, IN * e:IN * (e + 1)]
                xs = x64[:, IN * k:IN * (k + 1)]
                contrib[cols] += g64.T @ xs
                mags[cols] += np.abs(g64).T @ np.abs(xs)
                count[cols] += TOKENS
        loss = sw.reduce_sum(ys[0], "t o ->")
        for more in ys[1:]:
            loss = sw.add(loss, sw.reduce_sum(more, "t o ->"))
        loss.backward()
        ref += contrib
        f32 = gamma(np.maximum(count, 1)) * mags
        err = err + f32 + (u16 + U) * (np.abs(ref) + err + f32)
        got = grad_values(full)
        assert np.all(np.abs(got - ref) <= err), np.max(np.abs(got - ref) - err)
        versions.append(full.grad.carrier.version)
    return ref, err, versions


@pytest.mark.parametrize("row_major", [False, True], ids=["col", "row"])
@pytest.mark.parametrize("dtype, np16, u16", DTYPES)
def test_a_16_bit_tiled_leaf_accumulates_tile_by_tile_in_its_dtype(rng, dtype, np16, u16, row_major):
    experts = rng.standard_normal((E, OUT, IN)).astype(np16)
    c, full = expert_weight(experts, dtype, row_major)
    ref, err, versions = run_steps(c, full, np16, rng, u16)
    g = full.grad
    assert g.dtype() is dtype and isinstance(g.carrier, TiledEvictable) and g.carrier.dtype() is dtype
    assert g.layout == full.layout
    # The same carrier, advanced once per projection's gradient: each went into it tile by tile, in place.
    assert versions == np.cumsum([len(step) for step in STEPS]).tolist()
    # Untouched experts stay implicit zeros; the touched ones are resident and dirty.
    locations = [g.carrier.tile_state((0, e)).location for e in range(E)]
    assert locations == ["implicit", "primary", "primary", "implicit", "primary", "implicit"]
    # The values are 16-bit values: what the tiles hold converts to the dtype exactly.
    got = grad_values(full)
    assert np.array_equal(got, got.astype(np16).astype(np.float64))


@pytest.mark.parametrize("dtype, np16, u16", DTYPES)
def test_an_evicted_16_bit_gradient_tile_is_read_back_and_added(rng, dtype, np16, u16):
    experts = rng.standard_normal((E, OUT, IN)).astype(np16)
    c, full = expert_weight(experts, dtype, False)
    w = c.project(full, TileSelection([[0], [3]])).wait()
    x1 = rng.standard_normal((TOKENS, IN)).astype(np16)
    g1 = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
    sw.matmul(friendly.tensor(x1), w).backward(friendly.tensor(g1))
    gc = full.grad.carrier
    gc.evict(TileSelection([[0], [3]]).tile_set)
    assert gc.stats()["bytes_evicted"] == OUT * IN * 2  # one dirty 16-bit tile written to the gradient's tier
    w = c.project(full, TileSelection([[0], [3]])).wait()
    x2 = rng.standard_normal((TOKENS, IN)).astype(np16)
    g2 = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
    sw.matmul(friendly.tensor(x2), w).backward(friendly.tensor(g2))
    assert full.grad.carrier is gc or full.grad.carrier.version >= 1
    got = grad_values(full)[:, 3 * IN:4 * IN]
    x1, x2, g1, g2 = (a.astype(np.float64) for a in (x1, x2, g1, g2))
    c1, c2 = g1.T @ x1, g2.T @ x2
    s1, s2 = np.abs(g1).T @ np.abs(x1), np.abs(g2).T @ np.abs(x2)
    e1 = gamma(TOKENS) * s1 + (u16 + U) * (np.abs(c1) + gamma(TOKENS) * s1)
    e2 = e1 + gamma(TOKENS) * s2 + (u16 + U) * (np.abs(c1 + c2) + e1 + gamma(TOKENS) * s2)
    assert np.all(np.abs(got - (c1 + c2)) <= e2)
    assert full.grad.dtype() is dtype


def test_a_bf16_checkpoint_leaf_trains_through_projections(tmp_path, rng):
    torch = pytest.importorskip("torch")
    import safetensors.torch

    names = [f"experts.{e}.w1.weight" for e in range(E)]
    experts = rng.standard_normal((E, OUT, IN)).astype(ml_dtypes.bfloat16)
    tensors = {n: torch.from_numpy(experts[e].view(np.uint16).astype(np.int16)).view(torch.bfloat16).clone()
               for e, n in enumerate(names)}
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    with open(path, "rb") as f:
        before = f.read()
    ckpt = sw.safetensors.open(str(path))
    full = ckpt.tiled(names)  # (OUT, IN, E): row-major (out, in) tiles, one per expert
    c = full.carrier
    ref = np.zeros((E, OUT, IN))
    err = np.zeros((E, OUT, IN))
    for e in [0, 5, 0, 0, 5, 2]:
        w = c.project(full, TileSelection([[0], [0], [e]])).wait()  # (OUT, IN, 1), row-major within the tile
        # loss = sum(w * m): the gradient is m itself (exact in Float32), one contribution per backward.
        m = rng.standard_normal((OUT, IN, 1)).astype(np.float32)
        sw.reduce_sum(sw.elementwise_mul(w, friendly.tensor(m)), "o i e ->").backward()
        ref[e] += m[:, :, 0]
        err[e] = err[e] + (2.0**-8 + U) * (np.abs(ref[e]) + err[e])
    assert full.grad.dtype() is sw.DType.BFloat16 and isinstance(full.grad.carrier, TiledEvictable)
    got = np.asarray(full.grad).astype(np.float64)  # (OUT, IN, E)
    assert np.all(np.abs(got - ref.transpose(1, 2, 0)) <= err.transpose(1, 2, 0))
    assert [full.grad.carrier.tile_state((0, 0, e)).location for e in range(E)] == [
        "primary", "implicit", "primary", "implicit", "implicit", "primary"]
    with open(path, "rb") as f:
        assert f.read() == before  # the checkpoint is never written
