"""Compatible shapes (Note [Compatible shapes] in cpp/include/strideweave/layout.hpp): a flat mode of extent n and
a nested mode of size n name the same coordinates (the nested mode's in colexicographic order, first leaf fastest),
so elementwise operations and backward's gradient take one where the other is expected; a mode of extent 1
broadcasts to any mode. The result of an operation takes the nested profile; each operand's gradient comes back
in the operand's own profile. Checked against NumPy on the values in ordinal order (Float32 elementwise results
are exact: one rounding of the same operation), sums against a Float64 reference within their error bound.
"""

from __future__ import annotations

import numpy as np
import pytest

import strideweave as sw
from strideweave import Shape, friendly

U = 2.0**-24  # Float32 unit roundoff
NESTED = (2, [3, 4])

OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "elementwise_mul": np.multiply, "div": np.divide}


def ordinal(t) -> np.ndarray:
    """A tensor's values in ordinal (first-mode-fastest) order."""
    return np.asarray(t).ravel(order="F")


def values(seed: int, shape) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(1, 9, size=shape) * 0.25).astype(np.float32)  # exact in Float32, no zeros


def nested(a: np.ndarray):
    """A (2, 12) array as a (2, (3, 4)) tensor: a view of a flat leaf (sw.reshape of a dense operand)."""
    leaf = friendly.tensor(a)
    return leaf, sw.reshape(leaf, NESTED)


def on(kind, a: np.ndarray, *modes):
    """`a`'s values in ordinal (column-major) order on a fresh carrier of `kind`, laid out column-major over
    `modes` (a nested mode as a list)."""
    if kind is sw.CPU:
        carrier = friendly.tensor(a.ravel(order="F")).carrier
    else:
        carrier = sw.Generic(a.ravel(order="F").tolist(), dtype=sw.DType.Float32)
    return sw.Tensor(carrier, 0, sw.column_major(*modes))


@pytest.mark.parametrize("kind", [sw.CPU, sw.Generic], ids=["CPU", "Generic"])
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("other", [(2, 12), (2, 1), (1, 12), (1, 1)], ids=["2x12", "2x1", "1x12", "1x1"])
def test_a_flat_mode_meets_a_nested_one_of_its_size_or_extent_1(op, other, kind):
    A, B = values(1, (2, 12)), values(2, other)
    a = on(kind, A, 2, [3, 4])
    b = on(kind, B, *other)
    want = OPS[op](A, B)  # NumPy broadcasts (2, 1), (1, 12), (1, 1) the same way
    for r, expect in ((getattr(sw, op)(a, b), want), (getattr(sw, op)(b, a), OPS[op](B, A))):
        assert r.shape == Shape(2, [3, 4])
        assert np.array_equal(ordinal(r), expect.ravel(order="F")), op


def test_nested_modes_of_other_sizes_or_ranks_still_refuse():
    _, a = nested(values(1, (2, 12)))
    for bad in ((2, 10), (2, 3)):
        b = friendly.tensor(values(2, bad))
        with pytest.raises(ValueError, match="do not broadcast"):
            sw.add(a, b)
    other = sw.reshape(friendly.tensor(values(3, (2, 12))), (2, [12]))  # a nested mode of rank 1
    with pytest.raises(ValueError, match="do not broadcast"):
        sw.add(a, other)
    assert np.array_equal(ordinal(a), values(1, (2, 12)).ravel(order="F"))  # the operand is unchanged


def test_each_operand_gets_its_gradient_in_its_own_profile():
    """y = a * b + c with a nested (2, (3, 4)), b flat (2, 12), c (2, 1); the seed flat (2, 12)."""
    A, B, C, G = values(1, (2, 12)), values(2, (2, 12)), values(3, (2, 1)), values(4, (2, 12))
    a_leaf, a = nested(A)
    b, c = friendly.tensor(B), friendly.tensor(C)
    y = sw.add(sw.elementwise_mul(a, b), c)
    assert y.shape == Shape(2, [3, 4])
    y.backward(friendly.tensor(G))  # a flat seed for a nested output: read through a refined view
    assert a_leaf.grad.shape == Shape(2, 12) and b.grad.shape == Shape(2, 12) and c.grad.shape == Shape(2, 1)
    # g * b and g * a: one Float32 rounding of an exact product of quarter-integers: exact
    assert np.array_equal(np.asarray(a_leaf.grad), G * B)
    assert np.array_equal(np.asarray(b.grad), G * A)
    # c's gradient sums 12 seeds per row: within n u / (1 - n u) of the sum of magnitudes (exact here, but the
    # bound is what the check derives from)
    ref = G.astype(np.float64).sum(axis=1, keepdims=True)
    bound = 12 * U / (1 - 12 * U) * np.abs(G).astype(np.float64).sum(axis=1, keepdims=True)
    assert np.all(np.abs(np.asarray(c.grad) - ref) <= bound)


def test_a_nested_seed_for_a_flat_output_is_read_in_its_order():
    B, G = values(2, (2, 12)), values(4, (2, 12))
    b = friendly.tensor(B)
    y = sw.mul(b, 3.0)
    _, seed = nested(G)
    y.backward(seed)
    assert b.grad.shape == Shape(2, 12)
    assert np.array_equal(np.asarray(b.grad), G * np.float32(3.0))


def test_a_seed_of_another_size_is_refused_and_nothing_accumulates():
    _, a = nested(values(1, (2, 12)))
    b = friendly.tensor(values(2, (2, 12)))
    y = sw.add(a, b)
    for bad in (values(5, (2, 10)), values(5, (24,)), values(5, (2, 1))):
        with pytest.raises(ValueError, match="does not match the output's"):
            y.backward(friendly.tensor(bad))
    assert b.grad is None


def test_a_tile_major_projection_combines_with_flat_tensors(tmp_path):
    """The guide's case (docs/guide.md, "Tile-major projections"): two row-major experts projected tile-major,
    (out, (in, 2)), added to a flat (out, 2 in) tensor and differentiated with a flat seed: the tiled gradient
    holds the seed's columns of each expert, times the scale, in the expert's own row-major order."""
    from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection

    out, inn, experts = 4, 3, 3
    W = values(6, (experts, out, inn))
    W.tofile(tmp_path / "experts.f32")
    carrier = TiledEvictable(sw.CPU(0), sw.FileBacked(str(tmp_path / "experts.f32")), (1, experts), (out, inn))
    full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(out, [inn, experts]), sw.Stride(inn, [1, out * inn])))
    pair = carrier.project(full, TileSelection([[0], [2, 0]]), tile_major=True).wait()
    assert pair.shape == Shape(out, [inn, 2])
    bias = values(7, (out, 2 * inn))
    both = np.concatenate([W[2], W[0]], axis=1)
    y = sw.add(sw.mul(pair, 2.0), friendly.tensor(bias))
    assert y.shape == Shape(out, [inn, 2])
    assert np.array_equal(ordinal(y), (both * np.float32(2.0) + bias).ravel(order="F"))
    G = values(8, (out, 2 * inn))
    y.backward(friendly.tensor(G))
    grad = np.asarray(full.grad)  # (out, experts * in): expert e's columns e * in .. (e + 1) * in
    assert np.array_equal(grad[:, 2 * inn:3 * inn], G[:, :inn] * np.float32(2.0))
    assert np.array_equal(grad[:, 0:inn], G[:, inn:] * np.float32(2.0))
    assert not np.any(grad[:, inn:2 * inn])
    carrier.release()
