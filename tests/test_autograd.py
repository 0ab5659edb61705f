"""Autograd: every VJP against double-precision central differences, and the graph contract.

Substrate §5 (grad, backward, retain_grad), §8 (operations) and §9 (autograd);
design/practices.md, "Oracles and gradient checks" and "Version counters with
useful errors".

Gradient checks: each operation has a NumPy float64 re-implementation of its
forward. The loss is a random scalar projection of the output,
L = sum(C * f(inputs)); its central finite differences (float64, on the
Float32-rounded inputs) are compared with the analytic gradient that
`out.backward(gradient=C)` leaves in each leaf's `.grad`. Inputs are dense or
strided-with-offset views (over a carrier filled with junk), on CPU and on
Generic, and include broadcast (extent-1) leaves, which must receive summed
gradients.

Arrays on the NumPy side are indexed by the *leaves* of the (possibly nested)
shape, first leaf fastest, so the ordinal `i` of a tensor is
`array.reshape(-1, order="F")[i]`.

Seeds: each test draws from `numpy.random.default_rng(seed)`, with `seed`
derived from BASE_SEED and the test id and printed (pytest shows it on
failure).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor, friendly
from models import leaves

F32 = DType.Float32
BASE_SEED = 20240611
CARRIERS = [sw.CPU, sw.Generic]


# `rng` (conftest.py) seeds from BASE_SEED and the test id; every test starts and ends with grad mode on.
pytestmark = pytest.mark.usefixtures("grad_mode_on")


# ---------------------------------------------------------------- shape specs and tensors


def tree_like(spec, values):
    """`values` (an iterator over leaves) arranged in the tree form of `spec`."""
    return [tree_like(m, values) if isinstance(m, (tuple, list)) else next(values) for m in spec]


def shape_of(spec) -> Shape:
    return Shape(tree_like(spec, iter(leaves(spec))))


def f32(a) -> np.ndarray:
    """Float32-rounded values, as float64."""
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def junk_carrier(kind, size: int, rng):
    values = rng.uniform(-1e3, 1e3, size)
    return friendly.tensor(values, carrier=kind).carrier


def make(a, spec, *, kind=sw.CPU, strided=False, rng=None) -> Tensor:
    """A Float32 tensor of shape `spec` holding `a` (indexed by leaves), dense or strided with an offset."""
    lv = leaves(spec)
    a = np.asarray(a, dtype=np.float64).reshape(lv)
    if not strided:
        return _dense(a, spec, kind)
    # Strided: leaf strides row-major over the leaves with gaps, an offset, junk around the values.
    strides, run = [0] * len(lv), 1
    for j in reversed(range(len(lv))):
        strides[j] = run * 2
        run *= lv[j] * 2 + 1
    offset = 3
    cosize = offset + sum((e - 1) * s for e, s in zip(lv, strides)) + 1
    c = junk_carrier(kind, cosize + 2, rng or np.random.default_rng(0))
    t = Tensor(c, offset, Layout(shape_of(spec), Stride(tree_like(spec, iter(strides)))))
    for i, v in enumerate(a.reshape(-1, order="F")):
        t[i] = float(v)
    return t


def _dense(a, spec, kind) -> Tensor:
    flat = a.reshape(-1, order="F")
    c = friendly.tensor(flat if flat.size else [0.0], carrier=kind).carrier
    return Tensor(c, 0, friendly.column_major(shape_of(spec)))


def vals(t) -> np.ndarray:
    """A tensor's values as float64, indexed by the leaves of its shape."""
    flat = np.array([t[i] for i in range(t.size())], dtype=np.float64)
    return flat.reshape(shape_leaves(t.shape), order="F")


def shape_spec(shape: Shape):
    """The spec (nested tuples of ints) of an sw.Shape."""
    subs = [shape[k] for k in range(len(shape))]
    return tuple(sub.size if len(sub) == 1 and sub[0] == sub else shape_spec(sub) for sub in subs)


def shape_leaves(shape: Shape) -> list[int]:
    """Leaf extents of an sw.Shape (a leaf mode is its own only sub-mode)."""
    out = []
    for k in range(len(shape)):
        sub = shape[k]
        if len(sub) == 1 and sub[0] == sub:
            out.append(sub.size)
        else:
            out.extend(shape_leaves(sub))
    return out


def like(t, a) -> Tensor:
    """A dense tensor of `t`'s shape and carrier kind holding `a` (indexed by leaves)."""
    flat = f32(a).reshape(-1, order="F")
    c = friendly.tensor(flat if flat.size else [0.0], carrier=type(t.carrier)).carrier
    return Tensor(c, 0, friendly.column_major(t.shape))


# ---------------------------------------------------------------- the gradient check


def central_differences(fn_np, arrays, cot, k, h=1e-6):
    """d/d arrays[k] of sum(cot * fn_np(*arrays)), by central differences in float64."""
    base = [np.array(a, dtype=np.float64) for a in arrays]
    grad = np.zeros_like(base[k])
    for idx in np.ndindex(base[k].shape):
        x0 = base[k][idx]
        step = h * max(1.0, abs(x0))
        base[k][idx] = x0 + step
        plus = float(np.sum(cot * fn_np(*base)))
        base[k][idx] = x0 - step
        minus = float(np.sum(cot * fn_np(*base)))
        base[k][idx] = x0
        grad[idx] = (plus - minus) / (2 * step)
    return grad


def assert_close(actual, expected, what, rtol=2e-4):
    scale = max(1.0, float(np.max(np.abs(expected))) if np.size(expected) else 1.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


def gradcheck(fn_sw, fn_np, arrays, specs, *, kind, strided, rng, node_name=None):
    """Runs fn_sw on tensors built from `arrays`, checks the forward, then every leaf's gradient."""
    arrays = [f32(a).reshape(leaves(s)) for a, s in zip(arrays, specs)]
    tensors = [make(a, s, kind=kind, strided=strided, rng=rng) for a, s in zip(arrays, specs)]
    out = fn_sw(*tensors)
    ref = fn_np(*arrays)
    assert out.dtype() is F32
    assert out.size() == ref.size
    assert_close(vals(out).reshape(-1, order="F"), np.asarray(ref).reshape(-1, order="F"), "forward")
    if node_name is not None:
        assert out.autograd_ctx is not None and out.autograd_ctx.name == node_name
    cot = f32(rng.standard_normal(vals(out).shape))
    versions = [t.version for t in tensors]
    # With strided inputs the cotangent is a strided, offset view too.
    seed = make(cot, shape_spec(out.shape), kind=kind, strided=True, rng=rng) if strided else like(out, cot)
    out.backward(gradient=seed)
    assert [t.version for t in tensors] == versions, "backward changed an input's version"
    for k, (t, s) in enumerate(zip(tensors, specs)):
        g = t.grad
        assert g is not None, f"input {k} received no gradient"
        assert g.shape == shape_of(s), f"input {k}: gradient shape {g.shape} != {shape_of(s)}"
        assert type(g.carrier) is kind, f"input {k}: gradient on {type(g.carrier).__name__}, leaf on {kind.__name__}"
        assert g.dtype() is F32
        numeric = central_differences(fn_np, arrays, np.asarray(cot).reshape(np.shape(ref)), k)
        assert_close(vals(g), numeric, f"gradient of input {k}")
    return tensors, out


# NumPy float64 forwards (on leaf-indexed arrays).


def np_reduce_sum(spec, description):
    """NumPy reduce_sum over leaf-indexed arrays of shape `spec` (docs/guide.md, "Operations and autograd")."""
    groups, j = [], 0
    for m in spec:
        n = len(leaves([m]))
        groups.append(list(range(j, j + n)))
        j += n
    if description is None:
        kept = [0] if spec else []
    else:
        left, right = description.split("->")
        names = left.split()
        kept = [names.index(w) for w in right.split()]
    summed = tuple(ax for g, grp in enumerate(groups) if g not in kept for ax in grp)
    keep_axes = [ax for g in kept for ax in groups[g]]

    def fn(a):
        r = np.sum(a, axis=summed, keepdims=True)
        r = np.transpose(r, keep_axes + list(summed))
        return r.reshape([a.shape[ax] for ax in keep_axes])

    return fn


def np_matmul(lspec, rspec):
    m, k = (math.prod(leaves([x])) for x in lspec)
    n = math.prod(leaves([rspec[0]]))
    out_leaves = leaves([lspec[0]]) + leaves([rspec[0]])

    def fn(a, b):
        A = a.reshape(m, k, order="F")
        B = b.reshape(n, k, order="F")
        return (A @ B.T).reshape(out_leaves, order="F")

    return fn


def away_from_zero(rng, n, lo=0.1, hi=2.0):
    return rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)


# ---------------------------------------------------------------- VJPs


BINARY = {
    "add": (sw.add, np.add),
    "add_operator": (lambda a, b: a + b, np.add),
    "elementwise_mul": (sw.elementwise_mul, np.multiply),
    "mul": (sw.mul, np.multiply),
    "mul_operator": (lambda a, b: a * b, np.multiply),
    "sub": (sw.sub, np.subtract),
    "sub_operator": (lambda a, b: a - b, np.subtract),
    "div": (sw.div, np.divide),
    "div_operator": (lambda a, b: a / b, np.divide),
}
NODE = {k: k.replace("_operator", "") for k in BINARY}

# (lhs spec, rhs spec): same shape, broadcast both ways, nested with broadcast leaves, rank 3.
BINARY_SHAPES = [
    ((3, 4), (3, 4)),
    ((3, 1), (1, 4)),
    ((3, 4), (1, 4)),
    ((2, (3, 1)), (1, (3, 4))),
    ((2, 3, 2), (2, 1, 2)),
]


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_vjp_matches_central_differences(name, shapes, strided, kind, rng):
    fn_sw, fn_np = BINARY[name]
    a = rng.standard_normal(math.prod(leaves(shapes[0])))
    if name.startswith("div"):
        b = away_from_zero(rng, math.prod(leaves(shapes[1])), 0.5, 2.0)
    else:
        b = rng.standard_normal(math.prod(leaves(shapes[1])))
    gradcheck(fn_sw, fn_np, [a, b], list(shapes), kind=kind, strided=strided, rng=rng, node_name=NODE[name])


SCALAR_CASES = {
    "mul(t, 2.5)": (lambda t: sw.mul(t, 2.5), lambda a: a * 2.5),
    "mul(-1.75, t)": (lambda t: sw.mul(-1.75, t), lambda a: -1.75 * a),
    "mul(t, 3)": (lambda t: sw.mul(t, 3), lambda a: a * 3),
    "t * 0.5": (lambda t: t * 0.5, lambda a: a * 0.5),
    "-3 * t": (lambda t: -3 * t, lambda a: -3 * a),
}


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("case", list(SCALAR_CASES))
def test_mul_with_a_weak_scalar_matches_central_differences(case, strided, kind, rng):
    fn_sw, fn_np = SCALAR_CASES[case]
    spec = (3, (2, 2))
    (t,), out = gradcheck(fn_sw, fn_np, [rng.standard_normal(12)], [spec], kind=kind, strided=strided, rng=rng,
                          node_name="mul")
    # The weak scalar is no input: the node has exactly one tensor operand.
    assert len(out.autograd_ctx.inputs()) == 1 and out.autograd_ctx.inputs()[0] is t


UNARY = {
    "neg": (sw.neg, np.negative, lambda rng, n: rng.standard_normal(n)),
    "neg_operator": (lambda t: -t, np.negative, lambda rng, n: rng.standard_normal(n)),
    "exp": (sw.exp, np.exp, lambda rng, n: rng.uniform(-2.0, 1.5, n)),
    "relu": (sw.relu, lambda a: np.maximum(a, 0.0), lambda rng, n: away_from_zero(rng, n)),
}


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("spec", [(5,), (3, 4), (2, (3, 2))], ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_vjp_matches_central_differences(name, spec, strided, kind, rng):
    fn_sw, fn_np, draw = UNARY[name]
    x = draw(rng, math.prod(leaves(spec)))
    gradcheck(fn_sw, fn_np, [x], [spec], kind=kind, strided=strided, rng=rng, node_name=name.replace("_operator", ""))


REDUCTIONS = [
    ((3, 4), None),
    ((3, 4), "a b -> a"),
    ((3, 4), "a b -> b"),
    ((3, 4), "a b -> b a"),
    ((3, 4), "a b ->"),
    ((2, 3, 4), None),
    ((2, 3, 4), "a b c -> c a"),
    ((2, 3, 4), "i j k -> j"),
    ((2, (3, 2)), None),
    ((2, (3, 2)), "a b -> b"),
    ((2, (3, 2)), "a b -> b a"),
    (((2, 2), 3, (1, 2)), "a b c -> c a"),
    (((2, 2), 3, (1, 2)), "a b c ->"),
]


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("spec,description", REDUCTIONS, ids=str)
def test_reduce_sum_vjp_matches_central_differences(spec, description, strided, kind, rng):
    fn = (lambda t: sw.reduce_sum(t)) if description is None else (lambda t: sw.reduce_sum(t, description))
    x = rng.standard_normal(math.prod(leaves(spec)))
    gradcheck(fn, np_reduce_sum(spec, description), [x], [spec], kind=kind, strided=strided, rng=rng,
              node_name="reduce_sum")


def test_reduce_sum_with_a_float64_accumulator_has_the_same_vjp(rng):
    spec = (3, 4)
    x = rng.standard_normal(12)
    gradcheck(lambda t: sw.reduce_sum(t, "a b -> b", accumulator_dtype=DType.Float64), np_reduce_sum(spec, "a b -> b"),
              [x], [spec], kind=sw.CPU, strided=True, rng=rng, node_name="reduce_sum")


MATMULS = [
    ((3, 4), (5, 4)),
    ((1, 4), (5, 4)),
    ((3, 1), (2, 1)),
    ((4, 3), (1, 3)),
    (((2, 2), 3), (5, 3)),
    ((3, (2, 2)), (2, (2, 2))),
]


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("specs", MATMULS, ids=str)
@pytest.mark.parametrize("form", ["matmul", "operator", "f64"])
def test_matmul_vjp_matches_central_differences(form, specs, strided, kind, rng):
    fn = {
        "matmul": sw.matmul,
        "operator": lambda a, b: a @ b,
        "f64": lambda a, b: sw.matmul(a, b, accumulator_dtype=DType.Float64),
    }[form]
    arrays = [rng.standard_normal(math.prod(leaves(s))) for s in specs]
    gradcheck(fn, np_matmul(*specs), arrays, list(specs), kind=kind, strided=strided, rng=rng, node_name="matmul")


def test_dispatch_op_forward_records_the_same_vjp(rng):
    a, b = rng.standard_normal(6), rng.standard_normal(6)
    gradcheck(lambda x, y: x.carrier.dispatch_op("elementwise_mul").forward(x, y), np.multiply, [a, b],
              [(2, 3), (2, 3)], kind=sw.CPU, strided=False, rng=rng, node_name="elementwise_mul")


# Composite graphs: shared inputs, diamonds, chains, broadcasting inside the graph.

def sw_diamond(x):
    e = sw.exp(x)
    return sw.add(sw.mul(e, 2.0), sw.relu(sw.sub(e, x)))  # exp(x) - x >= 1: away from relu's kink


def np_diamond(x):
    return 2 * np.exp(x) + np.maximum(np.exp(x) - x, 0)


def sw_softmax(x, w):
    e = sw.exp(sw.matmul(x, w))
    ones = friendly.tensor([[1.0] * 5], carrier=type(e.carrier))
    return sw.div(e, sw.matmul(e, ones))  # row sums as a (3, 1) matmul, broadcast over each row by div


def np_softmax(x, w):
    e = np.exp(x @ w.T)
    return e / e.sum(axis=1, keepdims=True)


def sw_mlp(x, w1, b1, w2):
    return sw.reduce_sum(sw.matmul(sw.relu(sw.add(sw.matmul(x, w1), b1)), w2), "a b ->")


def np_mlp(x, w1, b1, w2):
    return np.sum(np.maximum(x @ w1.T + b1, 0) @ w2.T)


# Central differences step each input by about 1e-6 and the Float32 forward rounds pre-activations by about 1e-7
# of their size: a pre-activation closer than this to relu's kink could take the other branch on one side (its
# derivative is not defined there). Data drawn that close is redrawn; 1e-3 leaves a margin of 1000.
KINK_MARGIN = 1e-3


def mlp_away_from_kink(x, w1, b1, w2):
    return np.abs(x @ w1.T + b1).min() > KINK_MARGIN


COMPOSITES = {
    "x*x": (lambda x: sw.elementwise_mul(x, x), lambda x: x * x, [(3, 4)]),
    "x+x": (lambda x: sw.add(x, x), lambda x: x + x, [(3, 4)]),
    "exp(x)*exp(x) (non-leaf twice)": (
        lambda x: (lambda e: sw.elementwise_mul(e, e))(sw.exp(x)),
        lambda x: np.exp(x) ** 2,
        [(3, 2)],
    ),
    "diamond": (sw_diamond, np_diamond, [(4, 3)]),
    "softmax": (sw_softmax, np_softmax, [(3, 4), (5, 4)]),
    "mlp": (sw_mlp, np_mlp, [(4, 3), (5, 3), (1, 5), (2, 5)], mlp_away_from_kink),
    "broadcast leaf used twice": (
        lambda x, b: sw.elementwise_mul(sw.add(x, b), sw.neg(b)),
        lambda x, b: (x + b) * -b,
        [(3, 4), (3, 1)],
    ),
}


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(COMPOSITES))
def test_composite_graphs_match_central_differences(name, kind, rng):
    fn_sw, fn_np, specs, *valid = COMPOSITES[name]

    def draw():
        return [rng.standard_normal(math.prod(leaves(s))) * 0.7 for s in specs]

    arrays = draw()
    while valid and not valid[0](*[f32(a).reshape(leaves(s)) for a, s in zip(arrays, specs)]):
        arrays = draw()
    gradcheck(fn_sw, fn_np, arrays, specs, kind=kind, strided=True, rng=rng)


# ---------------------------------------------------------------- node recording


def t2(values, kind=sw.CPU, dtype=F32):
    return friendly.tensor(values, dtype=dtype, carrier=kind)


def test_nodes_are_recorded_for_differentiable_results_in_grad_mode():
    x, w = t2([[1.0, 2.0], [3.0, 4.0]]), t2([[0.5, -1.0], [2.0, 1.0]])
    i = t2([[1, 2], [3, 4]], dtype=DType.Int32)
    b = t2([[True, False], [False, True]], dtype=DType.Bool)
    for y in (sw.add(x, w), sw.mul(x, 2), sw.relu(x), sw.reduce_sum(x), sw.matmul(x, w), sw.exp(x)):
        assert y.autograd_ctx is not None
    # Leaves have no node.
    assert x.autograd_ctx is None
    # A Float32 result of a differentiable and a non-differentiable operand records a node over both.
    y = sw.add(x, i)
    assert y.dtype() is F32 and y.autograd_ctx is not None
    assert y.autograd_ctx.inputs()[1] is i
    # Int32 results have no node; Float32 results without a differentiable input have none either.
    assert sw.add(i, i).dtype() is DType.Int32 and sw.add(i, i).autograd_ctx is None
    assert sw.mul(i, 3).autograd_ctx is None
    assert sw.reduce_sum(i).autograd_ctx is None
    assert sw.relu(b).autograd_ctx is None
    fi = sw.mul(i, 2.5)
    assert fi.dtype() is F32 and fi.autograd_ctx is None
    assert sw.reduce_sum(i, accumulator_dtype=DType.Float64).autograd_ctx is None
    assert sw.elementwise_mul(i, b).autograd_ctx is None
    # fi is differentiable but has no node: it is a leaf of later graphs, and its Int32 source gets nothing.
    s = sw.reduce_sum(fi, "a b ->")
    assert s.autograd_ctx.inputs()[0] is fi
    s.backward()
    np.testing.assert_array_equal(vals(fi.grad), 1.0)
    with pytest.raises(RuntimeError, match="not differentiable"):
        i.grad


def test_no_grad_and_set_grad_enabled_stop_recording():
    x = t2([1.0, 2.0, 3.0])
    with sw.no_grad():
        assert sw.is_grad_enabled() is False
        y = sw.exp(x)
        assert y.autograd_ctx is None
        with sw.no_grad():
            pass
        assert sw.is_grad_enabled() is False
    assert sw.is_grad_enabled() is True
    assert sw.exp(x).autograd_ctx is not None

    @sw.no_grad()
    def f(t):
        return sw.relu(t)

    assert f(x).autograd_ctx is None and sw.is_grad_enabled() is True
    sw.set_grad_enabled(False)
    assert sw.is_grad_enabled() is False
    assert sw.mul(x, x).autograd_ctx is None
    assert sw.move(t2([1.0, 2.0]), sw.Generic([0.0, 0.0])).autograd_ctx is None
    sw.set_grad_enabled(True)
    assert sw.mul(x, x).autograd_ctx is not None
    with pytest.raises(TypeError, match="bool"):
        sw.set_grad_enabled(1)
    assert sw.is_grad_enabled() is True
    # An exception inside no_grad restores the mode.
    with pytest.raises(KeyError):
        with sw.no_grad():
            raise KeyError("x")
    assert sw.is_grad_enabled() is True


def test_grad_mode_is_per_thread():
    x = t2([1.0, 2.0])
    seen = {}
    main_off = threading.Event()

    def worker():
        main_off.wait()
        seen["enabled"] = sw.is_grad_enabled()
        seen["node"] = sw.exp(x).autograd_ctx
        sw.set_grad_enabled(False)  # affects this thread only
        seen["after"] = sw.is_grad_enabled()
        seen["node_off"] = sw.exp(x).autograd_ctx

    th = threading.Thread(target=worker)
    th.start()
    sw.set_grad_enabled(False)
    main_off.set()
    th.join()
    assert sw.is_grad_enabled() is False
    assert sw.exp(x).autograd_ctx is None
    assert seen["enabled"] is True and seen["node"] is not None and seen["node"].name == "exp"
    assert seen["after"] is False and seen["node_off"] is None
    sw.set_grad_enabled(True)
    assert sw.exp(x).autograd_ctx is not None
    # A fresh thread starts with grad mode on, whatever other threads did.
    fresh = {}
    th = threading.Thread(target=lambda: fresh.setdefault("enabled", sw.is_grad_enabled()))
    th.start()
    th.join()
    assert fresh["enabled"] is True


@pytest.mark.parametrize("kind", CARRIERS, ids=lambda c: c.__name__)
def test_node_inputs_name_and_dispatch_class(kind):
    a = t2([[1.0, -2.0], [3.0, 4.0]], kind)
    b = t2([[0.5, 1.0], [-1.0, 2.0]], kind)
    i = t2([[1, 2], [3, 4]], kind, DType.Int32)
    cases = [
        (sw.add(a, b), "add", (a, b)),
        (sw.add(b, a), "add", (b, a)),
        (sw.elementwise_mul(a, b), "elementwise_mul", (a, b)),
        (sw.mul(a, b), "mul", (a, b)),
        (sw.mul(a, 2.0), "mul", (a,)),
        (sw.mul(3, b), "mul", (b,)),
        (sw.sub(b, a), "sub", (b, a)),
        (sw.div(a, b), "div", (a, b)),
        (sw.neg(a), "neg", (a,)),
        (sw.exp(a), "exp", (a,)),
        (sw.relu(a), "relu", (a,)),
        (sw.reduce_sum(a, "a b -> b"), "reduce_sum", (a,)),
        (sw.matmul(a, b), "matmul", (a, b)),
        (sw.add(i, a), "add", (i, a)),
        (sw.add(a, a), "add", (a, a)),
        (a @ b, "matmul", (a, b)),
        (a.carrier.dispatch_op("add").forward(a, b), "add", (a, b)),
    ]
    for y, name, inputs in cases:
        ctx = y.autograd_ctx
        assert ctx.name == name and ctx._operation_name == name
        got = ctx.inputs()
        assert isinstance(got, tuple) and len(got) == len(inputs)
        assert all(g is w for g, w in zip(got, inputs)), name
        assert ctx.dispatch_carrier_class is kind and ctx._dispatch_carrier_class is kind
        assert y.autograd_ctx is ctx  # the same node object every time


# ---------------------------------------------------------------- backward semantics


def grads_of(*ts):
    return [None if t.grad is None else vals(t.grad).copy() for t in ts]


def assert_grads_unchanged(ts, before):
    after = grads_of(*ts)
    for t, b, a in zip(ts, before, after):
        if b is None:
            assert a is None
        else:
            np.testing.assert_array_equal(a, b)


def test_shared_input_and_diamond_sum_contributions():
    x = t2([1.0, -2.0, 0.5])
    y = sw.elementwise_mul(x, x)  # dy/dx = 2x
    y.backward(t2([1.0, 1.0, 1.0]))
    np.testing.assert_allclose(vals(x.grad), [2.0, -4.0, 1.0])
    x.grad = None
    e = sw.exp(x)
    d = sw.add(sw.mul(e, 3.0), sw.neg(e))  # 2 exp(x) through two paths from e
    d.backward(t2([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(vals(x.grad), 2 * np.exp(f32([1.0, -2.0, 0.5])) * [1, 2, 3], rtol=1e-6)


def test_two_backward_calls_with_retain_graph_accumulate():
    x, w = t2([[1.0, 2.0], [3.0, -1.0]]), t2([[0.5, -1.0], [2.0, 1.5]])
    loss = sw.reduce_sum(sw.elementwise_mul(sw.matmul(x, w), x), "a b ->")
    loss.backward(retain_graph=True)
    gx, gw = vals(x.grad).copy(), vals(w.grad).copy()
    loss.backward(retain_graph=True)
    np.testing.assert_allclose(vals(x.grad), 2 * gx, rtol=1e-6)
    np.testing.assert_allclose(vals(w.grad), 2 * gw, rtol=1e-6)
    x.grad = None
    loss.backward()  # the last one frees the graph
    np.testing.assert_allclose(vals(x.grad), gx, rtol=1e-6)
    np.testing.assert_allclose(vals(w.grad), 3 * gw, rtol=1e-6)
    before = grads_of(x, w)
    with pytest.raises(RuntimeError, match=r"retain_graph=True"):
        loss.backward()
    assert_grads_unchanged([x, w], before)


def test_second_backward_without_retain_graph_raises():
    x = t2([1.0, 2.0, 3.0])
    y = sw.exp(x)
    z = sw.mul(y, 2.0)
    z.backward(t2([1.0, 1.0, 1.0]))
    before = grads_of(x)
    with pytest.raises(RuntimeError, match=r"retain_graph=True"):
        z.backward(t2([1.0, 1.0, 1.0]))
    assert_grads_unchanged([x], before)
    # A new node on top of a freed one: backward reaches the freed graph and refuses as well.
    u = sw.neg(y)
    with pytest.raises(RuntimeError, match=r"retain_graph=True"):
        u.backward(t2([1.0, 1.0, 1.0]))
    assert_grads_unchanged([x], before)
    # Graphs that do not reach the freed nodes still work.
    sw.neg(x).backward(t2([1.0, 1.0, 1.0]))
    np.testing.assert_allclose(vals(x.grad), before[0] - 1.0, rtol=1e-6)


def test_leaf_grad_accumulates_across_graphs_until_reset():
    x = t2([1.0, 2.0])
    for k in range(1, 4):
        sw.reduce_sum(sw.mul(x, 2.0), "a ->").backward()
        np.testing.assert_allclose(vals(x.grad), [2.0 * k, 2.0 * k])
    x.grad = None
    assert x.grad is None
    sw.reduce_sum(sw.mul(x, 5.0), "a ->").backward()
    np.testing.assert_allclose(vals(x.grad), [5.0, 5.0])
    # A user-set grad is accumulated into as well.
    x.grad = t2([100.0, 200.0])
    sw.reduce_sum(x, "a ->").backward()
    np.testing.assert_allclose(vals(x.grad), [101.0, 201.0])
    # backward on a leaf accumulates the gradient itself.
    x.backward(t2([1.0, 1.0]))
    np.testing.assert_allclose(vals(x.grad), [102.0, 202.0])


def test_gradients_are_fresh_tensors_not_aliases():
    """Leaf gradients are allocated with new_like: never the caller's seed nor shared between leaves."""
    x, w = t2([1.0, 2.0]), t2([3.0, 4.0])
    seed = t2([1.0, 1.0])
    y = sw.add(x, w)
    y.retain_grad()
    y.backward(seed)
    assert x.grad is not seed and w.grad is not seed and y.grad is not seed
    assert x.grad.carrier is not w.grad.carrier and x.grad.carrier is not seed.carrier
    seed[0] = 50.0
    x.grad[1] = 7.0
    np.testing.assert_array_equal(vals(x.grad), [1.0, 7.0])
    np.testing.assert_array_equal(vals(w.grad), [1.0, 1.0])
    np.testing.assert_array_equal(vals(y.grad), [1.0, 1.0])
    # Leaf backward: the seed is copied too.
    v, s = t2([1.0, 2.0]), t2([0.5, 0.25])
    v.backward(s)
    assert v.grad is not s and v.grad.carrier is not s.carrier
    s[0] = 9.0
    np.testing.assert_array_equal(vals(v.grad), [0.5, 0.25])


def test_retain_grad_keeps_non_leaf_gradients():
    x = t2([[1.0, -2.0], [0.5, 3.0]])
    a = sw.mul(x, 2.0)
    b = sw.relu(a)
    c = sw.elementwise_mul(b, b)
    loss = sw.reduce_sum(c, "i j ->")
    b.retain_grad()
    loss.retain_grad()
    loss.backward()
    assert a.grad is None and c.grad is None  # non-leaves without retain_grad()
    bv = np.maximum(2 * f32([[1.0, -2.0], [0.5, 3.0]]), 0)
    np.testing.assert_allclose(vals(b.grad), 2 * bv)
    np.testing.assert_allclose(vals(loss.grad), 1.0)
    np.testing.assert_allclose(vals(x.grad), 2 * 2 * bv * (bv > 0) * 1.0)
    # retain_grad on a tensor used twice sums both contributions.
    x.grad = None
    e = sw.exp(x)
    e.retain_grad()
    sw.add(e, sw.mul(e, 3.0)).backward(t2([[1.0, 1.0], [1.0, 1.0]]))
    np.testing.assert_allclose(vals(e.grad), 4.0)
    assert type(e.grad.carrier) is sw.CPU


def test_backward_without_gradient_only_for_single_element_outputs():
    x = t2([[1.0, 2.0], [3.0, 4.0]])
    s = sw.reduce_sum(x, "a b ->")
    assert s.size() == 1
    s.backward()
    np.testing.assert_array_equal(vals(x.grad), 1.0)
    one = sw.reduce_sum(t2([[2.0]]), None)  # shape (1), single element
    one.backward()
    y = sw.exp(x)
    before = grads_of(x)
    with pytest.raises(ValueError, match="single-element"):
        y.backward()
    with pytest.raises(ValueError, match="single-element"):
        sw.reduce_sum(x).backward()  # shape (2): still two elements
    assert_grads_unchanged([x], before)
    # The graph survives the refused call.
    y.backward(t2([[1.0, 1.0], [1.0, 1.0]]))
    np.testing.assert_allclose(vals(x.grad), 1.0 + np.exp(f32([[1.0, 2.0], [3.0, 4.0]])), rtol=1e-6)


def test_gradient_must_have_the_outputs_shape():
    x = t2([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    y = sw.relu(x)
    x.grad = t2([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    before = grads_of(x)
    for bad in (t2([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]), t2([1.0] * 6), t2([[1.0, 1.0, 1.0]])):
        with pytest.raises(ValueError, match="shape"):
            y.backward(bad)
    with pytest.raises(TypeError, match="must be a Tensor"):
        y.backward([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert_grads_unchanged([x], before)
    y.backward(t2([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    np.testing.assert_allclose(vals(x.grad), 2.0)


def test_gradient_must_be_a_live_float32_tensor():
    """A wrong seed is refused before any leaf accumulates (add would pass it straight to `a`)."""
    a, x = t2([1.0, 2.0]), t2([0.5, -0.5])
    y = sw.add(a, sw.exp(x))
    a.grad = t2([10.0, 20.0])
    before = grads_of(a, x)
    with pytest.raises(TypeError, match="Float32"):
        y.backward(t2([1, 2], dtype=DType.Int32))
    with pytest.raises(TypeError, match="Float32"):
        y.backward(t2([True, False], dtype=DType.Bool))
    released = t2([1.0, 1.0])
    released.carrier.release()
    with pytest.raises(RuntimeError, match="released"):
        y.backward(released)
    with pytest.raises(TypeError, match="Float32"):
        a.backward(t2([1, 2], dtype=DType.Int32))  # a leaf root too
    assert_grads_unchanged([a, x], before)
    y.backward(t2([1.0, 1.0]))
    np.testing.assert_allclose(vals(a.grad), [11.0, 21.0])
    np.testing.assert_allclose(vals(x.grad), np.exp(f32([0.5, -0.5])), rtol=1e-6)


def test_a_gradient_on_another_carrier_kind_is_copied_and_left_as_it_was():
    """Note [A gradient on another carrier kind]: the cotangent's values are used, on the output's kind."""
    a, x = t2([1.0, 2.0]), t2([0.5, -0.5])
    y = sw.add(a, sw.exp(x))
    seed = t2([3.0, -2.0], kind=sw.Generic)
    v0 = seed.version
    y.backward(seed, retain_graph=True)
    np.testing.assert_array_equal(vals(a.grad), f32([3.0, -2.0]))
    np.testing.assert_allclose(vals(x.grad), f32([3.0, -2.0]) * np.exp(f32([0.5, -0.5])), rtol=1e-6)
    assert vals(seed).tolist() == [3.0, -2.0] and seed.version == v0 and not seed.carrier.is_released()
    # A strided cotangent on another kind: its logical values, not its slots in order.
    g = sw.Generic([7.0, 0.0, 5.0, 0.0])
    y.backward(sw.Tensor(g, 0, sw.Layout(sw.Shape(2), sw.Stride(2))))
    np.testing.assert_array_equal(vals(a.grad), f32([10.0, 3.0]))


def test_a_cpu_gradient_seeds_the_output_of_a_tiled_computation():
    primary = sw.CPU(8)
    for i in range(8):
        primary[i] = float(i + 1)
    te = sw.TiledEvictable(primary, sw.FileBacked(), (1, 2), (2, 2))
    full = sw.Tensor(te, 0, sw.Layout(sw.Shape(2, [2, 2]), sw.Stride(1, [2, 4])))
    y = sw.mul(full, full)
    seed = sw.Tensor(sw.Generic([1.0, -1.0, 2.0, -2.0, 0.5, 0.25, 4.0, 8.0]), 0, y.layout)
    y.backward(seed)
    # d(x*x)/dx = 2x, times the seed, element by element (exact in Float32).
    expected = [2.0 * (i + 1) * s for i, s in enumerate([1.0, -1.0, 2.0, -2.0, 0.5, 0.25, 4.0, 8.0])]
    assert [full.grad[i] for i in range(8)] == expected


@pytest.mark.parametrize("dtype,values", [(DType.Int32, [1, 2]), (DType.Bool, [True, False])], ids=["Int32", "Bool"])
def test_non_differentiable_tensors_refuse_grad_apis(dtype, values):
    t = t2(values, dtype=dtype)
    f = t2([1.0, 2.0])
    r = sw.add(t, t) if dtype is DType.Int32 else sw.relu(t)
    for u in (t, r):
        with pytest.raises(RuntimeError, match="not differentiable"):
            u.backward()
        with pytest.raises(RuntimeError, match="not differentiable"):
            u.backward(t2(values, dtype=dtype))
        with pytest.raises(RuntimeError, match="not differentiable"):
            u.grad
        with pytest.raises(RuntimeError, match="not differentiable"):
            u.grad = None
        with pytest.raises(RuntimeError, match="not differentiable"):
            u.retain_grad()
    assert f.grad is None
    # A mixed operation sends the gradient to the Float32 operand only.
    sw.reduce_sum(sw.elementwise_mul(f, t), "a ->").backward()
    np.testing.assert_array_equal(vals(f.grad), np.array(values, dtype=np.float64))
    with pytest.raises(RuntimeError, match="not differentiable"):
        t.grad


# ---------------------------------------------------------------- saved-version validation


SAVING_OPS = {
    "elementwise_mul": (lambda a, b: sw.elementwise_mul(a, b), 0),
    "mul": (lambda a, b: sw.mul(a, 2.0), 0),
    "div": (lambda a, b: sw.div(a, b), 1),
    "relu": (lambda a, b: sw.relu(a), 0),
    "exp": (lambda a, b: sw.exp(a), 0),
    "matmul": (lambda a, b: sw.matmul(a, b), 1),
}


@pytest.mark.parametrize("how", ["tensor", "carrier", "other view"])
@pytest.mark.parametrize("name", list(SAVING_OPS))
def test_in_place_write_to_a_saved_input_fails_backward(name, how):
    fn, victim = SAVING_OPS[name]
    a = t2([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    b = t2([[0.5, 1.5, 2.5], [1.0, 2.0, 3.0]])
    y = fn(a, b)
    y.retain_grad()
    a.grad = t2([[9.0] * 3] * 2)
    before = grads_of(a, b)
    t = (a, b)[victim]
    v0 = t.version
    if how == "tensor":
        t[0] = 42.0
    elif how == "carrier":
        t.carrier[3] = 42.0
    else:  # a different view of the same carrier
        Tensor(t.carrier, 1, Layout(Shape(2), Stride(1)))[1] = 42.0
    v1 = t.version
    assert v1 == v0 + 1
    with pytest.raises(RuntimeError) as err:
        y.backward(like(y, np.ones(vals(y).shape)))
    msg = str(err.value)
    assert "modified in-place" in msg
    assert name in msg
    assert "(2,3)" in msg  # the saved tensor's shape
    assert f"version {v0}" in msg and f"version {v1}" in msg
    assert_grads_unchanged([a, b], before)
    assert y.grad is None
    # Nothing was freed: the error repeats.
    with pytest.raises(RuntimeError, match="modified in-place"):
        y.backward(like(y, np.ones(vals(y).shape)))


def test_in_place_error_deep_in_the_graph_changes_nothing():
    x, w = t2([[1.0, 2.0], [3.0, 4.0]]), t2([[0.5, -1.0], [2.0, 1.0]])
    h = sw.exp(x)  # saves x
    loss = sw.reduce_sum(sw.matmul(h, w), "a b ->")  # saves h, w
    x.grad = t2([[1.0, 1.0], [1.0, 1.0]])
    before = grads_of(x, w)
    x[(1, 1)] = 0.0
    with pytest.raises(RuntimeError, match=r"modified in-place.*exp.*\(2,2\).*version 0.*version 1"):
        loss.backward()
    assert_grads_unchanged([x, w], before)


def test_writes_to_inputs_that_are_not_saved_are_allowed():
    """add, sub, neg and reduce_sum save nothing: their VJPs need no values."""
    a, b = t2([1.0, 2.0]), t2([3.0, 4.0])
    y = sw.reduce_sum(sw.neg(sw.sub(sw.add(a, b), b)), "i ->")
    a[0] = 10.0
    b.carrier[1] = 10.0
    y.backward()
    np.testing.assert_allclose(vals(a.grad), [-1.0, -1.0])
    np.testing.assert_allclose(vals(b.grad), [0.0, 0.0])


def test_unreachable_branch_is_not_executed():
    x, v = t2([1.0, 2.0, 3.0]), t2([4.0, 5.0, 6.0])
    y = sw.add(x, x)
    z = sw.elementwise_mul(x, v)  # shares x, saves x and v; not reachable from y
    z.retain_grad()
    v[0] = -1.0  # z's node is stale: running or checking it would raise
    y.backward(t2([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(vals(x.grad), [2.0, 4.0, 6.0])
    assert v.grad is None and z.grad is None
    # z's own backward still detects the stale save.
    with pytest.raises(RuntimeError, match="modified in-place"):
        z.backward(t2([1.0, 1.0, 1.0]))
    np.testing.assert_allclose(vals(x.grad), [2.0, 4.0, 6.0])
    assert v.grad is None


# ---------------------------------------------------------------- the move node


def test_move_records_a_node_and_moves_the_gradient_back(rng):
    a = f32(rng.standard_normal((3, 2)))
    x = friendly.tensor(a)  # CPU leaf
    y = sw.move(x, sw.Generic([0.0] * 6))
    ctx = y.autograd_ctx
    assert ctx is not None and ctx.name == "move" and ctx._operation_name == "move"
    assert len(ctx.inputs()) == 1 and ctx.inputs()[0] is x
    assert type(y.carrier) is sw.Generic
    # Compute on Generic; the gradient comes back to the CPU leaf.
    loss = sw.reduce_sum(sw.elementwise_mul(sw.exp(y), y), "a b ->")
    y.retain_grad()
    loss.backward()
    assert type(x.grad.carrier) is sw.CPU
    assert x.grad.shape == x.shape
    expected = np.exp(a) * (1 + a)
    np.testing.assert_allclose(vals(x.grad), expected, rtol=1e-5)
    assert type(y.grad.carrier) is sw.Generic
    np.testing.assert_allclose(vals(y.grad), expected, rtol=1e-5)


def test_move_chain_and_mixed_graph(rng):
    a = f32(rng.standard_normal((2, 3)))
    x = friendly.tensor(a, carrier=sw.Generic)
    w = friendly.tensor(f32(rng.standard_normal((2, 3))))
    y = sw.move(x, sw.CPU(6))  # Generic -> CPU
    z = sw.move(sw.mul(y, 2.0), sw.Generic([0.0] * 6))  # CPU -> Generic, on a non-leaf
    out = sw.elementwise_mul(sw.move(z, sw.CPU(6)), w)
    cot = f32(rng.standard_normal((2, 3)))
    out.backward(friendly.tensor(cot))
    assert type(x.grad.carrier) is sw.Generic
    np.testing.assert_allclose(vals(x.grad), 2 * cot * vals(w), rtol=1e-6)
    np.testing.assert_allclose(vals(w.grad), 2 * a * cot, rtol=1e-6)


def test_move_without_a_node():
    i = friendly.tensor([1, 2], dtype=DType.Int32)
    assert sw.move(i, sw.Generic([0, 0], dtype=DType.Int32)).autograd_ctx is None
    with sw.no_grad():
        assert sw.move(friendly.tensor([1.0, 2.0]), sw.Generic([0.0, 0.0])).autograd_ctx is None


# ---------------------------------------------------------------- a dependent carrier


def evictable(a):
    flat = f32(a).reshape(-1, order="F")
    carrier = sw.Evictable(friendly.tensor(flat).carrier, sw.Generic([0.0] * flat.size))
    return Tensor(carrier, 0, friendly.column_major(*np.shape(a)))


def test_evictable_graph_matches_central_differences(rng):
    a, b = f32(rng.standard_normal((3, 4))), f32(rng.standard_normal((2, 4)))
    while np.abs(np.exp(a) @ b.T).min() <= KINK_MARGIN:  # relu's kink (see KINK_MARGIN)
        a, b = f32(rng.standard_normal((3, 4))), f32(rng.standard_normal((2, 4)))
    x, w = evictable(a), evictable(b)
    out = sw.relu(sw.matmul(sw.exp(x), w))
    fn = lambda a, b: np.maximum(np.exp(a) @ b.T, 0)  # noqa: E731
    ref = fn(a, b)
    cot = f32(rng.standard_normal(ref.shape))
    gc = evictable(cot)
    out.backward(gc)
    for k, t in enumerate((x, w)):
        assert type(t.grad.carrier) is sw.Evictable
        assert_close(vals(t.grad), central_differences(fn, [a, b], cot, k), f"gradient of input {k}")
