"""Views with autograd: sw.narrow, sw.chunk, sw.permute, sw.reshape (docs/guide.md, "Views").

Values are compared exactly with NumPy's views of the same data (a view reads the base's own slots; reshape
follows the colex order, NumPy's order="F"); storage is shown shared by writing through the base; the one copying
reshape is checked to copy; gradients are exact (views are linear and the test values are eighths, exact in every
float dtype) and checked against a finite difference as well; every error names its problem and changes nothing.
Every carrier kind of tests/carrier_kinds.py runs the value tests, in every dtype it stores.
"""

from __future__ import annotations

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType

from carrier_kinds import KINDS

pytestmark = pytest.mark.usefixtures("grad_mode_on")

F32, BF16, F16, I32, BOOL = DType.Float32, DType.BFloat16, DType.Float16, DType.Int32, DType.Bool
ALL_DTYPES = (F32, BF16, F16, I32, BOOL)
SHAPE = (4, 6, 2)


def sample(dtype, n):
    """Small integers (exact in every dtype), i % 2 for Bool, in ordinal order."""
    i = np.arange(n)
    if dtype is BOOL:
        return [bool(v) for v in i % 2]
    if dtype is I32:
        return [int(v) for v in i - 7]
    return [float(v) for v in i - 7]


def base_on(kind, dtype, shape=SHAPE):
    """A column-major tensor of `shape` on `kind`, or None when the kind does not store `dtype`."""
    n = int(np.prod(shape))
    try:
        c = kind.make(sample(dtype, n), dtype)
    except TypeError:
        return None
    return sw.Tensor(c, 0, sw.column_major(sw.Shape(*shape)))


def array(t):
    return np.array(np.asarray(t))


def kind_ids():
    return [k.name for k in KINDS]


@pytest.fixture(params=KINDS, ids=kind_ids())
def kind(request, tmp_path):
    return request.param(tmp_path)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_views_match_numpy_and_share_storage(kind, dtype):
    x = base_on(kind, dtype)
    if x is None:
        pytest.skip(f"{kind.name} does not store {dtype.name}")
    a = array(x)
    if kind.name == "TiledEvictable":
        version = x.version
        for call in (lambda: sw.narrow(x, 1, 2, 3), lambda: sw.permute(x, [2, 0, 1]), lambda: sw.reshape(x, [8, 6]),
                     lambda: sw.chunk(x, 2, 1)):
            with pytest.raises(TypeError, match="a TiledEvictable tensor has no views but itself"):
                call()
        assert x.version == version and x.layout == sw.column_major(sw.Shape(*SHAPE)) and x.autograd_ctx is None
        same = sw.narrow(x, 1, 0, 6)  # the identity is a view
        assert same.carrier is x.carrier and same.layout == x.layout
        return
    n = sw.narrow(x, 1, 2, 3)
    assert n.carrier is x.carrier
    np.testing.assert_array_equal(array(n), a[:, 2:5, :])
    parts = sw.chunk(x, 4, 1)  # ceil(6 / 4) = 2 a piece: three pieces, not four (torch.chunk's rule)
    assert len(parts) == 3 and all(p.carrier is x.carrier for p in parts)
    for i, p in enumerate(parts):
        np.testing.assert_array_equal(array(p), a[:, 2 * i:2 * i + 2, :])
    p = sw.permute(x, [2, 0, 1])
    assert p.carrier is x.carrier
    np.testing.assert_array_equal(array(p), a.transpose(2, 0, 1))
    for shape in ([8, 6], [48], [2, 2, 12], [-1, 3], sw.Shape([2, 2], [6, 2])):
        assert sw.reshape_is_view(x, shape)
        r = sw.reshape(x, shape)
        assert r.carrier is x.carrier
        flat = shape if not isinstance(shape, sw.Shape) else [4, 12]
        np.testing.assert_array_equal(array(r).reshape(-1, order="F"), a.reshape(flat, order="F").reshape(-1, order="F"))
    np.testing.assert_array_equal(array(sw.reshape(x, [8, 6])), a.reshape((8, 6), order="F"))
    # A write through the base is seen by every view.
    value = True if dtype is BOOL else 42
    x[(1, 3, 0)] = value
    assert n[(1, 1, 0)] == value and parts[1][(1, 1, 0)] == value and p[(0, 1, 3)] == value
    assert sw.reshape(x, [48])[1 + 3 * 4] == value
    assert n.version == x.version


def test_views_share_the_data_pointer():
    base = np.arange(48, dtype=np.float32).reshape(SHAPE)  # row-major, as PyTorch holds it
    x = sw.from_dlpack(base)
    for v in (sw.narrow(x, 1, 2, 3), sw.permute(x, [2, 0, 1]), sw.reshape(x, [2, 2, 6, 2]), *sw.chunk(x, 2, 0)):
        assert np.shares_memory(np.asarray(v), base)
    np.testing.assert_array_equal(np.asarray(sw.narrow(x, 1, 2, 3)), base[:, 2:5, :])
    # A row-major base is a view in colex order only where the colex progressions allow it.
    assert not sw.reshape_is_view(x, [48])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_reshape_copies_exactly_when_the_layout_cannot_express_it(dtype):
    x = base_on(KINDS[1](None), dtype)  # CPU
    t = sw.permute(sw.narrow(x, 2, 1, 1), [1, 0, 2])  # (6, 4, 1), transposed
    assert not sw.reshape_is_view(t, [24])
    flat = sw.reshape(t, [-1])
    assert flat.carrier is not x.carrier and type(flat.carrier) is type(x.carrier)
    assert flat.dtype() is dtype and flat.layout == sw.column_major(sw.Shape(24))
    np.testing.assert_array_equal(array(flat), array(t).reshape(-1, order="F"))
    before = array(flat)
    x[(0, 0, 1)] = True if dtype is BOOL else -3  # was False, 17: the base changes, the copy does not
    np.testing.assert_array_equal(array(flat), before)
    assert not np.array_equal(array(t).reshape(-1, order="F"), before)
    # What can be expressed stays a view: (6, 4, 1) splits its leading progression.
    assert sw.reshape_is_view(t, [3, 2, 4]) and sw.reshape(t, [3, 2, 4]).carrier is x.carrier


# ---------------------------------------------------------------- autograd


def executing(kind):
    """Whether the kind executes operations (the gradient tests compute a loss on it)."""
    probe = kind.make([0.0], F32)
    return bool(probe.operation_capabilities("elementwise_mul"))


def weights(kind, shape, rng):
    """Eighths in [-8, 8] of `shape` on `kind` and as an array: exact in every float dtype."""
    w = rng.integers(-64, 65, size=shape) / 8.0
    t = sw.Tensor(kind.make([float(v) for v in w.reshape(-1, order="F")], F32), 0, sw.column_major(sw.Shape(*shape)))
    return t, w


def weighted_sum(y, w):
    letters = " ".join("abcdefgh"[: len(np.asarray(w).shape)])
    return sw.reduce_sum(sw.elementwise_mul(y, w), f"{letters} ->")


def pull(kind, x, *pairs):
    """x's gradient as an array, with d loss / d y = w for each (y, w): through sum(w * y) where the kind executes
    operations; else y.backward(w) for each (the views' VJPs need no operation of the kind), summed here because a
    storage-only kind cannot add two gradients."""
    if executing(kind):
        loss = weighted_sum(*pairs[0])
        for y, w in pairs[1:]:
            loss = sw.add(loss, weighted_sum(y, w))
        loss.backward()
        return array(x.grad).astype(np.float64)
    total = 0
    for y, w in pairs:
        x.grad = None
        y.backward(w)
        total = total + array(x.grad).astype(np.float64)
    return total


@pytest.mark.parametrize("dtype", (F32, BF16), ids=lambda d: d.name)
def test_gradients_are_exact_on_every_kind(kind, dtype):
    if kind.name == "TiledEvictable":
        pytest.skip("a TiledEvictable has no views but itself (test_gate_up_of_a_tiled_expert_stack_projects_then_splits)")
    seed = 1919
    print("seed", seed)
    rng = np.random.default_rng(seed)

    def fresh():
        x = base_on(kind, dtype)
        if x is None:
            pytest.skip(f"{kind.name} does not store {dtype.name}")
        return x

    x = fresh()
    y = sw.narrow(x, 1, 2, 3)
    assert y.autograd_ctx.name == "narrow" and y.autograd_ctx.inputs()[0] is x
    wt, w = weights(kind, (4, 3, 2), rng)
    expect = np.zeros(SHAPE)
    expect[:, 2:5, :] = w
    np.testing.assert_array_equal(pull(kind, x, (y, wt)), expect)

    x = fresh()
    parts = sw.chunk(x, 3, 0)  # ceil(4 / 3) = 2: two pieces of two
    assert len(parts) == 2 and parts[0].autograd_ctx.name == "chunk"
    (w0t, w0), (w1t, w1) = weights(kind, (2, 6, 2), rng), weights(kind, (2, 6, 2), rng)
    np.testing.assert_array_equal(pull(kind, x, (parts[0], w0t), (parts[1], w1t)), np.concatenate([w0, w1], axis=0))

    x = fresh()
    wt, w = weights(kind, (2, 4, 6), rng)
    np.testing.assert_array_equal(pull(kind, x, (sw.permute(x, [2, 0, 1]), wt)), w.transpose(1, 2, 0))

    for copying in (False, True):
        x = fresh()
        src = sw.permute(x, [1, 0, 2]) if copying else x
        y = sw.reshape(src, [12, -1])
        assert (y.carrier is x.carrier) is not copying and y.autograd_ctx.name == "reshape"
        wt, w = weights(kind, (12, 4), rng)
        g_src = w.reshape((6, 4, 2) if copying else SHAPE, order="F")
        np.testing.assert_array_equal(pull(kind, x, (y, wt)), g_src.transpose(1, 0, 2) if copying else g_src)

    # Composition: narrow of permute of reshape.
    x = fresh()
    y = sw.narrow(sw.permute(sw.reshape(x, [8, 6]), [1, 0]), 1, 3, 4)
    wt, w = weights(kind, (6, 4), rng)
    g = np.zeros((6, 8))
    g[:, 3:7] = w
    np.testing.assert_array_equal(pull(kind, x, (y, wt)), g.T.reshape(SHAPE, order="F"))
    assert x.grad.dtype() is dtype


def test_gradient_matches_a_finite_difference():
    """Views are linear, so a central difference of a Float32 loss over eighths is exact: f(x + h e) - f(x - h e)
    is 2 h w_i computed from sums of eighths with h = 1/8, all exactly representable (|f| < 2**24 / 8)."""
    rng = np.random.default_rng(7)
    print("seed", 7)
    xa = rng.integers(-64, 65, size=SHAPE) / 8.0
    wa = rng.integers(-64, 65, size=(6, 4)) / 8.0
    w = sw.friendly.tensor(wa)

    def loss(arr):
        x = sw.friendly.tensor(arr)
        return x, weighted_sum(sw.narrow(sw.permute(sw.reshape(x, [8, 6]), [1, 0]), 1, 3, 4), w)

    x, out = loss(xa)
    out.backward()
    g = array(x.grad)
    h = 1.0 / 8
    with sw.no_grad():
        for idx in [(0, 0, 0), (3, 5, 1), (2, 1, 0), (1, 4, 1)]:
            e = np.zeros(SHAPE)
            e[idx] = h
            fd = (float(np.asarray(loss(xa + e)[1])) - float(np.asarray(loss(xa - e)[1]))) / (2 * h)
            assert g[idx] == fd


# ---------------------------------------------------------------- the fused gate_up projection


def test_gate_up_of_a_transformers_expert_stack_splits_without_a_copy():
    E, I, H = 3, 4, 5
    gate_up = np.arange(E * 2 * I * H, dtype=np.float32).reshape(E, 2 * I, H)  # transformers' (E, 2I, H)
    t = sw.from_dlpack(gate_up)
    gate, up = sw.chunk(t, 2, 1)
    assert np.shares_memory(np.asarray(gate), gate_up) and np.shares_memory(np.asarray(up), gate_up)
    np.testing.assert_array_equal(np.asarray(gate), gate_up[:, :I, :])
    np.testing.assert_array_equal(np.asarray(up), gate_up[:, I:, :])
    np.testing.assert_array_equal(np.asarray(sw.narrow(t, 1, I, I)), gate_up[:, I:, :])


def test_gate_up_of_a_tiled_expert_stack_projects_then_splits(tmp_path):
    """On a TiledEvictable (2I, H, E) with one tile per expert, a view is refused; the expert's projection is a
    dense tensor, and its halves are views of it with autograd back into the expert's tile."""
    E, I, H = 3, 4, 5
    values = np.arange(2 * I * H * E, dtype=np.float32) / 8
    primary = sw.friendly.tensor(values).carrier
    carrier = sw.TiledEvictable(primary, sw.FileBacked(), (1, 1, E), (2 * I, H, 1))
    full = sw.Tensor(carrier, 0, sw.column_major(sw.Shape(2 * I, H, E)))
    with pytest.raises(TypeError, match="narrow: a TiledEvictable tensor has no views but itself.*project the tiles"):
        sw.narrow(full, 0, 0, I)
    expert = carrier.project(full, sw.TileSelection([[0], [0], [1]])).wait()  # (2I, H, 1)
    gate, up = sw.chunk(expert, 2, 0)
    assert gate.carrier is expert.carrier and up.carrier is expert.carrier
    dense = values.reshape((2 * I, H, E), order="F")
    np.testing.assert_array_equal(np.asarray(gate)[:, :, 0], dense[:I, :, 1])
    np.testing.assert_array_equal(np.asarray(up)[:, :, 0], dense[I:, :, 1])
    sw.add(sw.reduce_sum(gate, "a b c ->"), sw.reduce_sum(sw.mul(up, 2.0), "a b c ->")).backward()
    g = full.grad
    assert g.carrier.tile_state((0, 0, 0)).location == "implicit"  # untouched experts: zero tiles
    expect = np.zeros((2 * I, H, E), np.float32)
    expect[:I, :, 1], expect[I:, :, 1] = 1.0, 2.0
    np.testing.assert_array_equal(np.asarray(g.carrier.project(g, sw.TileSelection([[0], [0], [0, 1, 2]])).wait()), expect)


# ---------------------------------------------------------------- Tensor methods


def test_tensor_methods_are_the_functions():
    x = sw.friendly.tensor(np.arange(24, dtype=np.float32).reshape(4, 6))
    a = array(x)
    np.testing.assert_array_equal(array(x.narrow(1, 1, 2)), a[:, 1:3])
    np.testing.assert_array_equal(array(x.permute([1, 0])), a.T)
    np.testing.assert_array_equal(array(x.reshape([2, 12])), a.reshape((2, 12), order="F"))
    assert [array(p).shape for p in x.chunk(4, 0)] == [(1, 6)] * 4
    # extent < n: `extent` pieces of one ordinal
    assert len(x.chunk(10, 0)) == 4


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, exc, fragment",
    [
        (lambda x: sw.narrow(x, 2, 0, 1), IndexError, r"narrow: mode 2 is out of range for a tensor of 2 modes \(shape \(4,6\)\)"),
        (lambda x: sw.narrow(x, -1, 0, 1), IndexError, "mode -1 is out of range"),
        (lambda x: sw.narrow(x, 1, 4, 3), IndexError, r"narrow: ordinals \[4, 7\) are out of range for mode 1 of extent 6"),
        (lambda x: sw.narrow(x, 1, -1, 2), IndexError, r"ordinals \[-1, 1\) are out of range"),
        (lambda x: sw.narrow(x, 1, 0, 0), ValueError, "narrow: length must be >= 1, got 0"),
        (lambda x: sw.narrow(x, 1.0, 0, 1), TypeError, "narrow: mode must be an int, got float"),
        (lambda x: sw.narrow([1], 0, 0, 1), TypeError, "narrow: t must be a Tensor, got list"),
        (lambda x: sw.chunk(x, 2, 3), IndexError, "chunk: mode 3 is out of range"),
        (lambda x: sw.chunk(x, 0, 1), ValueError, "chunk: the number of chunks must be >= 1, got 0"),
        (lambda x: sw.permute(x, [0, 0]), ValueError, r"permute: order \(0, 0\) is not a permutation of the 2 modes"),
        (lambda x: sw.permute(x, [1]), ValueError, r"order \(1\) is not a permutation"),
        (lambda x: sw.permute(x, [0, 2]), ValueError, r"order \(0, 2\) is not a permutation"),
        (lambda x: sw.permute(x, 1), TypeError, "permute: order must be a sequence of ints, got int"),
        (lambda x: sw.reshape(x, [5, 5]), ValueError, r"reshape: shape \(5,5\) has 25 elements but the tensor \(shape \(4,6\)\) has 24"),
        (lambda x: sw.reshape(x, [-1, -1]), ValueError, "has more than one -1"),
        (lambda x: sw.reshape(x, [5, -1]), ValueError, r"the other extents' product 5 does not divide it"),
        (lambda x: sw.reshape(x, [0, 24]), ValueError, r"reshape: extents must be >= 1 \(or one -1\), got \(0, 24\)"),
        (lambda x: sw.reshape(x, [-2, -12]), ValueError, "extents must be >= 1"),
        (lambda x: sw.reshape(x, "ab"), TypeError, "reshape: shape must be a Shape or a sequence of ints, got str"),
    ],
)
def test_errors_name_the_problem_and_change_nothing(call, exc, fragment):
    x = sw.friendly.tensor(np.arange(24, dtype=np.float32).reshape(4, 6))
    before = (x.layout, x.offset, x.version, array(x))
    with pytest.raises(exc, match=fragment):
        call(x)
    assert (x.layout, x.offset, x.version) == before[:3] and x.autograd_ctx is None and x.grad is None
    np.testing.assert_array_equal(array(x), before[3])


def test_a_nested_mode_range_without_a_layout_is_refused():
    c = sw.CPU(24)
    w = sw.Tensor(c, 0, sw.Layout(sw.Shape(2, [3, 4]), sw.Stride(3, [1, 6])))  # (out, (in, E)), row-major tiles
    assert sw.narrow(w, 1, 3, 6).layout == sw.Layout(sw.Shape(2, [3, 2]), sw.Stride(3, [1, 6]))  # experts 1, 2
    with pytest.raises(ValueError, match=r"narrow: ordinals \[2, 5\) of nested mode 1 \(3,4\).*not one layout"):
        sw.narrow(w, 1, 2, 3)


def test_views_of_a_released_carrier_raise():
    x = sw.friendly.tensor(np.ones((2, 2), np.float32))
    x.carrier.release()
    with pytest.raises(RuntimeError, match="released"):
        sw.narrow(x, 0, 0, 1)
