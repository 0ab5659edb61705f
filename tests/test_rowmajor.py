"""Row-major tiles (PyTorch's (out, in) order within each tile) read as fast and as exactly as column-major ones
(Note [Within-tile layouts] in cpp/src/tiled/tile_copies.hpp).

The same expert matrices are written twice, each file in one order: row-major within the tile (element (o, i) of
expert e at o * IN + i + OUT * IN * e) and column-major (o + OUT * i + OUT * IN * e). Projections, a matmul on a
projected expert and the backward into the weight's tiled gradient give the same values in both forms, checked
against NumPy (exact for copies) and against a Float64 reference within the Float32 bound of a sum of n products:
|fl(sum) - sum| <= n u / (1 - n u) * sum |products|, u = 2^-24 (any order, with or without FMA).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261201  # `rng` (conftest.py) seeds from it and the test id, and prints the seed

OUT, IN, E, TOKENS = 8, 5, 4, 3
U = 2.0**-24


def bound(n, magnitudes):
    return n * U / (1 - n * U) * magnitudes


def write(tmp_path, name, experts, row_major):
    path = os.path.join(tmp_path, name)
    (experts if row_major else experts.transpose(0, 2, 1)).astype(np.float32).copy().tofile(path)
    return path


def expert_weight(tmp_path, experts, row_major, three_modes=False):
    """A TiledEvictable over a file of `experts` (E, OUT, IN) and its full tensor in the form asked for."""
    path = write(tmp_path, f"{'row' if row_major else 'col'}{'3' if three_modes else ''}.f32", experts, row_major)
    if three_modes:  # (OUT, IN, E) with one expert per tile
        c = TiledEvictable(sw.CPU(0), sw.FileBacked(path), (1, 1, E), (OUT, IN, 1))
        stride = sw.Stride(IN, 1, OUT * IN) if row_major else sw.Stride(1, OUT, OUT * IN)
        return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, IN, E), stride))
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(path), (1, E), (OUT, IN))
    stride = sw.Stride(IN, [1, OUT * IN]) if row_major else sw.Stride(1, [OUT, OUT * IN])
    return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), stride))


@pytest.fixture
def experts(rng):
    return rng.standard_normal((E, OUT, IN)).astype(np.float32)


@pytest.mark.parametrize("resident", [False, True])
def test_projections_of_row_major_tiles_hold_the_experts_in_row_major_order(tmp_path, experts, resident):
    rc, rfull = expert_weight(tmp_path, experts, True)
    cc, cfull = expert_weight(tmp_path, experts, False)
    for c in (rc, cc):
        if resident:
            c.promote(TileSelection([[0], list(range(E))]).tile_set)
    for chosen in ([2], [3, 0], [1, 2, 3, 0]):
        want = np.concatenate([experts[e] for e in chosen], axis=1)
        r = rc.project(rfull, TileSelection([[0], chosen])).wait()
        col = cc.project(cfull, TileSelection([[0], chosen])).wait()
        assert np.array_equal(np.asarray(r), want)
        assert np.array_equal(np.asarray(col), want)
        # The compact tensor keeps the tiles' order: row-major, so a matmul reads it through BLAS's flags.
        n = IN * len(chosen)
        assert r.layout == sw.Layout(sw.Shape(OUT, n), sw.Stride(n, 1))
        assert col.layout == sw.column_major(OUT, n)
        # Tile-major (Note [Tile-major projections]): row-major within each tile, tile after tile; column-major
        # tiles are whole columns already, and keep their layout.
        rt = rc.project(rfull, TileSelection([[0], chosen]), tile_major=True).wait()
        ct = cc.project(cfull, TileSelection([[0], chosen]), tile_major=True).wait()
        assert np.array_equal(np.asarray(rt), want) and np.array_equal(np.asarray(ct), want)
        if len(chosen) == 1:
            assert rt.layout == r.layout
        else:
            assert rt.layout == sw.Layout(sw.Shape(OUT, [IN, len(chosen)]), sw.Stride(IN, [1, OUT * IN]))
        assert ct.layout == col.layout


def test_the_three_mode_form_projects_row_major_experts(tmp_path, experts):
    rc, rfull = expert_weight(tmp_path, experts, True, three_modes=True)
    got = np.asarray(rc.project(rfull, TileSelection([[0], [0], [3, 1]])).wait())
    assert got.shape == (OUT, IN, 2)
    assert np.array_equal(got, np.stack([experts[3], experts[1]], axis=2))


def steps(c, full, x, g, chosen):
    """One training step per expert in `chosen`: project it, y = matmul(x, w), y.backward(g)."""
    ys = []
    for e in chosen:
        w = c.project(full, TileSelection([[0], [e]])).wait()
        y = sw.matmul(x, w)
        ys.append(np.array(np.asarray(y), copy=True))
        y.backward(g)
    return ys


def test_forward_and_backward_of_row_major_experts_match_column_major_and_float64(tmp_path, experts, rng):
    xa = rng.standard_normal((TOKENS, IN)).astype(np.float32)
    ga = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
    x, g = friendly.tensor(xa), friendly.tensor(ga)
    chosen = [1, 1, 3, 1]  # the first step adopts the gradient, the next ones add into the resident tile (sink)
    rc, rfull = expert_weight(tmp_path, experts, True)
    cc, cfull = expert_weight(tmp_path, experts, False)
    ry = steps(rc, rfull, x, g, chosen)
    cy = steps(cc, cfull, x, g, chosen)
    x64, g64 = xa.astype(np.float64), ga.astype(np.float64)
    for e, r, col in zip(chosen, ry, cy):
        w64 = experts[e].astype(np.float64)
        want = x64 @ w64.T
        b = bound(IN, np.abs(x64) @ np.abs(w64).T)
        assert np.all(np.abs(r - want) <= b) and np.all(np.abs(col - want) <= b)
        assert np.all(np.abs(r - col) <= 2 * b)
    # Expert e's gradient: count(e) times g^T x, a sum of count(e) * TOKENS products per element.
    per_step = g64.T @ x64
    mags = np.abs(g64).T @ np.abs(x64)
    rg, cg = np.asarray(rfull.grad), np.asarray(cfull.grad)
    assert rfull.grad.layout == rfull.layout and cfull.grad.layout == cfull.layout
    for e in range(E):
        k = chosen.count(e)
        cols = np.s_[:, IN * e:IN * (e + 1)]
        b = bound(k * TOKENS, k * mags)
        assert np.all(np.abs(rg[cols] - k * per_step) <= b), e
        assert np.all(np.abs(cg[cols] - k * per_step) <= b), e
        assert np.all(np.abs(rg[cols] - cg[cols]) <= 2 * b), e


def test_a_held_row_major_gradient_is_left_as_it_was(tmp_path, experts, rng):
    """Holding .grad makes the next sum a fresh tensor (no sink): the held one keeps its values, the new one adds."""
    xa = rng.standard_normal((TOKENS, IN)).astype(np.float32)
    ga = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
    rc, rfull = expert_weight(tmp_path, experts, True)
    steps(rc, rfull, friendly.tensor(xa), friendly.tensor(ga), [2])
    held = rfull.grad
    before = np.array(np.asarray(held), copy=True)
    steps(rc, rfull, friendly.tensor(xa), friendly.tensor(ga), [2])
    assert np.array_equal(np.asarray(held), before)
    one = ga.astype(np.float64).T @ xa.astype(np.float64)
    b = bound(2 * TOKENS, 2 * (np.abs(ga).T.astype(np.float64) @ np.abs(xa)))
    assert np.all(np.abs(np.asarray(rfull.grad)[:, 2 * IN:3 * IN] - 2 * one) <= b)


def test_an_elementwise_gradient_goes_back_into_row_major_tiles(tmp_path, experts, rng):
    """A column-major cotangent (an element-wise op's) is transposed into the row-major tiles, value for value."""
    rc, rfull = expert_weight(tmp_path, experts, True)
    seed = rng.standard_normal((OUT, 2 * IN)).astype(np.float32)
    compact = rc.project(rfull, TileSelection([[0], [3, 0]])).wait()
    sw.mul(compact, 2.0).backward(friendly.tensor(seed))
    got = np.asarray(rfull.grad)
    assert np.array_equal(got[:, 3 * IN:4 * IN], 2 * seed[:, :IN])
    assert np.array_equal(got[:, 0:IN], 2 * seed[:, IN:])
    assert not np.any(got[:, IN:3 * IN])


@pytest.mark.parametrize("reduction", ["replace", "add"])
def test_scatter_into_row_major_tiles(tmp_path, experts, rng, reduction):
    rc, rfull = expert_weight(tmp_path, experts, True)
    values = rng.standard_normal((OUT, 2 * IN)).astype(np.float32)
    with sw.no_grad():
        out = rc.scatter(friendly.tensor(values), rfull, TileSelection([[0], [2, 1]]), reduction=reduction).wait()
        got = np.asarray(out.carrier.project(out, TileSelection([[0], [2, 1]])).wait())
    want = values + (np.concatenate([experts[2], experts[1]], axis=1) if reduction == "add" else 0)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("grid", [(1, 3), (2, 3)])
def test_a_blocked_within_tile_order_projects_and_scatters_exactly(tmp_path, rng, grid):
    """An order that is no permutation of the modes (each mode split in two blocks; over one tile row the
    footprints are contiguous, over two they are not): the same map for every tile, copied in short runs, exact."""
    tile = (4, 6)
    rows, cols = grid[0] * 4, grid[1] * 6
    data = rng.standard_normal(rows * cols).astype(np.float32)
    path = os.path.join(tmp_path, "blocked.f32")
    data.tofile(path)
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(path), grid, tile)
    # row r = a + 2 b (+ 4 t), column q = e + 2 f (+ 6 u): slot a + 2 e + rows (b + 2 f) (+ 4 t + 6 rows u)
    row_strides = [1, rows] + ([4] if grid[0] > 1 else [])
    row_extents = [2, 2] + ([2] if grid[0] > 1 else [])
    layout = sw.Layout(sw.Shape(row_extents, [2, 3, 3]), sw.Stride(row_strides, [2, 2 * rows, 6 * rows]))
    full = sw.Tensor(c, 0, layout)
    want = data[np.array([[layout.index((r, q)) for q in range(cols)] for r in range(rows)])]
    sel = TileSelection([[grid[0] - 1], [2, 0]])
    block = np.s_[(grid[0] - 1) * 4:grid[0] * 4]
    got = np.asarray(c.project(full, sel).wait())
    assert np.array_equal(got, np.concatenate([want[block, 12:18], want[block, 0:6]], axis=1))
    values = rng.standard_normal((4, 6)).astype(np.float32)
    one = TileSelection([[0], [1]])
    with sw.no_grad():
        out = c.scatter(friendly.tensor(values), full, one, reduction="add").wait()
        back = np.asarray(out.carrier.project(out, one).wait())
    assert np.array_equal(back, want[0:4, 6:12] + values)


def test_a_projection_of_several_row_major_tiles_holds_each_tile_in_one_run(tmp_path, experts):
    """Tile-major: each selected expert's values lie together in its own (row-major) order, in selection order,
    so the gather is one copy per tile; the nested mode is no NumPy view, so np.asarray copies and copy=False
    refuses, naming the layout."""
    rc, rfull = expert_weight(tmp_path, experts, True)
    chosen = [3, 0, 2]
    r = rc.project(rfull, TileSelection([[0], chosen]), tile_major=True).wait()
    for k, e in enumerate(chosen):
        tile = sw.Tensor(r.carrier, k * OUT * IN, sw.Layout(sw.Shape(OUT, IN), sw.Stride(IN, 1)))
        assert np.array_equal(np.asarray(tile), experts[e])
    assert np.array_equal(np.asarray(r), np.concatenate([experts[e] for e in chosen], axis=1))
    before = r.carrier.version
    with pytest.raises(ValueError, match=r"copy=False.*\(8,\(5,3\)\).*not a NumPy view"):
        np.asarray(r, copy=False)
    assert r.carrier.version == before
    # A tile shared whole needs no copy, and is a view.
    one = rc.project(rfull, TileSelection([[0], [2]]), tile_major=True).wait()
    assert np.shares_memory(np.asarray(one, copy=False), np.asarray(one, copy=False))


@pytest.mark.parametrize("tokens", [4, 70])
def test_matmul_over_a_tile_major_projection_matches_float64(tmp_path, rng, tokens):
    """Products whose contraction (x2 @ w^T) or output (y @ w) runs over the nested (in, count) mode, block by
    block (Note [Products over nested modes]): within the Float32 bound of a sum of n products of the Float64
    product, whatever the order of the blocks' sums. Experts of 256 x 256: 4 tokens take the skinny kernels
    block by block (where the CPU has AVX-512), 70 one split of the product whose parts sum the blocks."""
    out, inp, e = 256, 256, 3
    big = rng.standard_normal((e, out, inp)).astype(np.float32)
    path = write(tmp_path, "big.f32", big, True)
    rc = TiledEvictable(sw.CPU(0), sw.FileBacked(path), (1, e), (out, inp))
    rfull = sw.Tensor(rc, 0, sw.Layout(sw.Shape(out, [inp, e]), sw.Stride(inp, [1, out * inp])))
    chosen = [2, 0]
    with sw.no_grad():
        w = rc.project(rfull, TileSelection([[0], chosen]), tile_major=True).wait()
    w64 = np.concatenate([big[k] for k in chosen], axis=1).astype(np.float64)  # (out, 2 in)
    xa = rng.standard_normal((tokens, 2 * inp)).astype(np.float32)
    ya = rng.standard_normal((tokens, out)).astype(np.float32)
    got = np.asarray(sw.matmul(friendly.tensor(xa), w))  # contraction over (in, 2)
    want = xa.astype(np.float64) @ w64.T
    assert np.all(np.abs(got - want) <= bound(2 * inp, np.abs(xa.astype(np.float64)) @ np.abs(w64).T))
    wt = sw.permute(w, [1, 0])  # ((in, 2), out): the nested mode is the product's output mode
    got = np.asarray(sw.matmul(friendly.tensor(ya), wt))
    want = ya.astype(np.float64) @ w64
    assert np.all(np.abs(got - want) <= bound(out, np.abs(ya.astype(np.float64)) @ np.abs(w64)))


def test_backward_through_a_tile_major_projection_matches_float64(tmp_path, experts, rng):
    """One step over two row-major experts side by side: the weight's gradient goes back into the two tiles, the
    input's gradient (g @ w, the nested mode as output) into x, each within the bound of its sum."""
    rc, rfull = expert_weight(tmp_path, experts, True)
    chosen = [2, 0]
    xa = rng.standard_normal((TOKENS, 2 * IN)).astype(np.float32)
    ga = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
    x = friendly.tensor(xa)  # every Float32 tensor is differentiable
    w = rc.project(rfull, TileSelection([[0], chosen]), tile_major=True).wait()
    sw.matmul(x, w).backward(friendly.tensor(ga))
    x64, g64 = xa.astype(np.float64), ga.astype(np.float64)
    w64 = np.concatenate([experts[e] for e in chosen], axis=1).astype(np.float64)
    got = np.asarray(rfull.grad)
    for k, e in enumerate(chosen):
        block = x64[:, k * IN:(k + 1) * IN]
        want = g64.T @ block
        b = bound(TOKENS, np.abs(g64).T @ np.abs(block))
        assert np.all(np.abs(got[:, e * IN:(e + 1) * IN] - want) <= b), e
    assert not np.any(got[:, IN:2 * IN]) and not np.any(got[:, 3 * IN:])
    assert np.all(np.abs(np.asarray(x.grad) - g64 @ w64) <= bound(OUT, np.abs(g64) @ np.abs(w64)))
    assert x.grad.layout.shape == x.layout.shape  # the input's own (flat) profile, not the nested mode's
    # A second step adds into both gradients (the input's is a flat leaf, the product's mode nested).
    w = rc.project(rfull, TileSelection([[0], chosen]), tile_major=True).wait()
    sw.matmul(x, w).backward(friendly.tensor(ga))
    assert np.all(np.abs(np.asarray(x.grad) - 2 * g64 @ w64) <= bound(2 * OUT, 2 * np.abs(g64) @ np.abs(w64)))


@pytest.mark.parametrize("reduction", ["replace", "add"])
def test_a_tile_major_compact_scatters_back_exactly(tmp_path, experts, rng, reduction):
    """A projection's own (tile-major) compact tensor scattered into the tiles it came from, run by run."""
    rc, rfull = expert_weight(tmp_path, experts, True)
    sel = TileSelection([[0], [3, 1]])
    with sw.no_grad():
        compact = rc.project(rfull, sel, tile_major=True).wait()
        out = rc.scatter(compact, rfull, sel, reduction=reduction).wait()
        got = np.asarray(out.carrier.project(out, sel).wait())
    want = np.concatenate([experts[3], experts[1]], axis=1) * (2 if reduction == "add" else 1)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_tile_major_must_be_a_bool(tmp_path, experts, bad):
    rc, rfull = expert_weight(tmp_path, experts, True)
    before = rc.stats()
    with pytest.raises(TypeError, match="tile_major"):
        rc.project(rfull, TileSelection([[0], [1, 2]]), tile_major=bad)
    assert rc.stats() == before
