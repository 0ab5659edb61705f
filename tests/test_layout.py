"""Contract tests for Shape, Stride, Layout and the dense layouts (docs/guide.md, "Layouts").

Every rule, worked example and error case of the layout contract (plus the
module-level identities that concern these names) has a test here. Property tests compare the engine with naive Python references over
random nested shapes; they are derandomized so every run sees the same cases.
"""

import copy
import itertools
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strideweave as sw
import strideweave.friendly
import strideweave.layout
from strideweave import Layout, Shape, Stride
from models import decode_model, tree_leaves, tree_size

EXAMPLE = Layout(Shape([2, [3, 4]]), Stride([1, [10, 100]]))


# --------------------------------------------------------------------------
# Naive references. A "tree" is an int leaf or a list of trees; a shape's
# top level is always a list of modes.


# ref_size, ref_decode (colex: first mode fastest at every level) and ref_leaves are the shared models.
ref_size, ref_decode, ref_leaves = tree_size, decode_model, tree_leaves


def ref_index(shape_tree, stride_tree, ordinal):
    coord_leaves = ref_leaves(ref_decode(shape_tree, ordinal))
    return sum(c * s for c, s in zip(coord_leaves, ref_leaves(stride_tree)))


def ref_depth(tree):
    if isinstance(tree, int):
        return 0
    if not tree:
        return 0
    return 1 + max(ref_depth(child) for child in tree)


def ref_to_tuple(tree):
    return tree if isinstance(tree, int) else tuple(ref_to_tuple(c) for c in tree)


def ref_dense(tree, running, reverse):
    """Dense strides: running product of extents (last mode first if reverse)."""
    if isinstance(tree, int):
        return running, running * tree
    out = [None] * len(tree)
    order = range(len(tree) - 1, -1, -1) if reverse else range(len(tree))
    for k in order:
        out[k], running = ref_dense(tree[k], running, reverse)
    return out, running


def collapse(shape_tree, coord, rng):
    """Replace random subtrees of a nested coordinate with their ordinal."""
    if isinstance(shape_tree, int):
        return coord
    if rng.random() < 0.3:
        ordinal, scale = 0, 1
        for child, c in zip(shape_tree, coord):
            ordinal += ref_encode(child, c) * scale
            scale *= ref_size(child)
        return ordinal
    return tuple(collapse(child, c, rng) for child, c in zip(shape_tree, coord))


def ref_encode(tree, coord):
    if isinstance(coord, int):
        return coord
    ordinal, scale = 0, 1
    for child, c in zip(tree, coord):
        ordinal += ref_encode(child, c) * scale
        scale *= ref_size(child)
    return ordinal


# --------------------------------------------------------------------------
# Strategies: random nested mode lists (nested modes are non-empty), sizes
# kept small so brute force over every ordinal stays cheap.

MAX_SIZE = 360

mode_trees = st.recursive(
    st.integers(1, 4),
    lambda children: st.lists(children, min_size=1, max_size=3),
    max_leaves=7,
)
shape_trees = st.lists(mode_trees, min_size=0, max_size=4).filter(lambda t: ref_size(t) <= MAX_SIZE)


def congruent(tree, leaf_strategy):
    if isinstance(tree, int):
        return leaf_strategy
    return st.tuples(*[congruent(child, leaf_strategy) for child in tree]).map(list)


@st.composite
def layout_trees(draw, max_stride=12):
    shape_tree = draw(shape_trees)
    stride_tree = draw(congruent(shape_tree, st.integers(0, max_stride)))
    return shape_tree, stride_tree


PROPERTY = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ============================================================== module map


def test_module_map_names_are_the_same_objects():
    assert strideweave.layout.Shape is sw.Shape
    assert strideweave.layout.Stride is sw.Stride
    assert strideweave.layout.Layout is sw.Layout
    assert strideweave.friendly.column_major is sw.column_major
    assert strideweave.friendly.row_major is sw.row_major
    for name in ("Shape", "Stride", "Layout"):
        assert name in strideweave.layout.__all__
    for name in ("column_major", "row_major"):
        assert name in strideweave.friendly.__all__
    for name in ("Shape", "Stride", "Layout", "column_major", "row_major"):
        assert name in sw.__all__
        assert hasattr(sw, name)


# ============================================================== Shape


def test_shape_single_iterable_argument_is_the_mode_list():
    assert Shape(2, [3, 4]) == Shape([2, [3, 4]])
    assert Shape(2, [3, 4]) == Shape((2, (3, 4)))
    assert Shape(2, 3) == Shape([2, 3]) == Shape(iter([2, 3])) == Shape(x for x in (2, 3))
    assert Shape([4]) == Shape(4)
    assert Shape([]) == Shape()
    # A nested iterable of one mode is a nested mode, not the mode list.
    assert Shape([[2, 3]]) != Shape(2, 3)
    assert len(Shape([[2, 3]])) == 1


def test_shape_object_used_as_a_mode_means_its_tree():
    assert Shape(2, Shape(3, 4)) == Shape(2, [3, 4])
    assert Shape(Shape(2, [3, 4])) == Shape(2, [3, 4])
    assert Shape([Shape(3, 4)]) == Shape([[3, 4]])
    assert Shape(Shape()) == Shape()


def test_shape_accepts_numpy_integers_and_arrays():
    assert Shape(np.int64(3), np.int32(4)) == Shape(3, 4)
    assert Shape(np.array([2, 3])) == Shape(2, 3)
    assert Shape(2, np.array([3, 4])) == Shape(2, [3, 4])


def test_shape_one_mode():
    s = Shape(4)
    assert len(s) == 1
    assert s.rank == 1
    assert s.size == 4
    assert s.extents == (4,)
    assert s.depth == 1
    assert s.decode(2) == (2,)
    assert s.encode((3,)) == 3
    assert s.encode(3) == 3


def test_shape_rank_zero():
    s = Shape()
    assert len(s) == 0
    assert s.rank == 0
    assert s.size == 1
    assert s.extents == ()
    assert s.depth == 0
    assert list(s) == []
    assert s.decode(0) == ()
    assert s.encode(()) == 0
    assert s.encode([]) == 0


def test_shape_properties_of_a_nested_shape():
    s = Shape(2, [3, 4])
    assert len(s) == 2
    assert s.rank == len(s)
    assert s.size == 24
    assert s.extents == (2, 12)
    assert isinstance(s.extents, tuple)
    assert s.depth == 2
    assert Shape(5, [20, 4]).extents == (5, 80)
    assert Shape(5, [20, 4]).size == 400


@pytest.mark.parametrize(
    "modes, depth",
    [((), 0), ((4,), 1), ((2, 3), 1), ((2, [3, 4]), 2), (([[2]],), 2), (([[[2]]],), 3), (([[2]], 1), 3), ((1, [2, [3, [4]]]), 4)],
)
def test_shape_depth(modes, depth):
    assert Shape(*modes).depth == depth


def test_shape_indexing_gives_sub_shapes():
    s = Shape(2, [3, 4], [[5, 6], 7])
    assert s[0] == Shape(2)  # a leaf mode e gives Shape(e)
    assert s[1] == Shape(3, 4)  # a nested mode gives Shape(*children)
    assert s[2] == Shape([5, 6], 7)
    assert s[2][0] == Shape(5, 6)
    assert s[-1] == s[2]
    assert s[-3] == s[0]
    assert s[np.int64(1)] == s[1]
    assert all(isinstance(sub, Shape) for sub in (s[0], s[1], s[2]))
    assert s[0].size == 2 and s[1].size == 12 and s[2].size == 210


def test_shape_iteration_yields_sub_shapes():
    s = Shape(2, [3, 4])
    assert list(s) == [Shape(2), Shape(3, 4)]
    assert list(s) == [s[k] for k in range(len(s))]
    assert [sub.size for sub in s] == list(s.extents)


@pytest.mark.parametrize("k", [2, 3, -3, 100, 2**70, -(2**70)])
def test_shape_index_out_of_range_raises_index_error(k):
    with pytest.raises(IndexError, match="out of range"):
        Shape(2, [3, 4])[k]


def test_shape_index_on_rank_zero_raises_index_error():
    with pytest.raises(IndexError, match="out of range"):
        Shape()[0]


@pytest.mark.parametrize("k", [True, False, 1.0, "1", None, slice(0, 1), (0,), [0]])
def test_shape_index_non_int_raises_type_error(k):
    with pytest.raises(TypeError, match="indices must be ints"):
        Shape(2, [3, 4])[k]


def test_shape_equality_compares_trees():
    assert Shape(2, [3, 4]) == Shape(2, [3, 4])
    assert not (Shape(2, [3, 4]) != Shape(2, [3, 4]))
    assert Shape(2, [3, 4]) != Shape(2, 3, 4)  # same leaves, different tree
    assert Shape(2, [3, 4]) != Shape([2, 3], 4)
    assert Shape(4) != Shape([[4]])
    assert Shape(2, 3) != Shape(3, 2)
    assert Shape(6) != Shape(2, 3)  # same size
    assert Shape(2, [3, 4]) != (2, (3, 4))
    assert Shape(2, [3, 4]) != [2, [3, 4]]
    assert Shape(2, [3, 4]) != Stride(2, [3, 4])
    assert Shape() == Shape()


def test_shape_is_hashable_and_hash_agrees_with_equality():
    a, b = Shape(2, [3, 4]), Shape([2, (3, 4)])
    assert hash(a) == hash(b)
    assert len({a, b, Shape(2, 3, 4), Shape()}) == 3
    assert {a: "x"}[b] == "x"
    assert hash(Shape()) == hash(Shape([]))


def test_shape_is_immutable():
    modes = [2, [3, 4]]
    s = Shape(modes)
    modes[1].append(5)
    modes.append(7)
    assert s == Shape(2, [3, 4])  # no aliasing of the input
    with pytest.raises(AttributeError):
        s.size = 5
    with pytest.raises(AttributeError):
        s.extents = (1,)
    with pytest.raises(AttributeError):
        s.depth = 0
    with pytest.raises(AttributeError):
        s.anything = 1
    with pytest.raises(TypeError):
        s[0] = Shape(3)
    assert s == Shape(2, [3, 4])


def test_shape_repr():
    assert repr(Shape(2, [3, 4])) == "Shape((2,(3,4)))"
    assert repr(Shape(3, 4)) == "Shape((3,4))"
    assert repr(Shape()) == "Shape(())"


def test_shape_copy_and_pickle_round_trip():
    for s in (Shape(), Shape(4), Shape(2, [3, 4]), Shape([[2]], 1)):
        assert pickle.loads(pickle.dumps(s)) == s
        assert copy.copy(s) == s
        assert copy.deepcopy(s) == s


@pytest.mark.parametrize(
    "modes",
    [(True,), (False,), (2, True), (2, [3, True]), ([True, 2],), (np.bool_(True),)],
    ids=["True", "False", "second", "nested", "nested-list", "numpy-bool"],
)
def test_shape_bool_extent_raises_type_error(modes):
    with pytest.raises(TypeError, match="bool"):
        Shape(*modes)


@pytest.mark.parametrize(
    "modes, fragment",
    [
        ((2.0,), "float"),
        ((2, [3.5]),"float"),
        (("ab",), "str"),
        ((2, "3"), "str"),
        ((b"ab",), "bytes"),
        ((None,), "NoneType"),
        ((2, [3, None]), "NoneType"),
        ((1 + 2j,), "complex"),
        ((object(),), "object"),
        ((np.float64(2.0),), "float"),
    ],
)
def test_shape_non_integer_extent_raises_type_error(modes, fragment):
    with pytest.raises(TypeError, match=fragment):
        Shape(*modes)
    with pytest.raises(TypeError, match="ints or nested iterables"):
        Shape(*modes)


@pytest.mark.parametrize("modes", [(0,), (-1,), (2, 0), (2, [3, 0]), ([[0]],), (-(2**70),), (3, [4, -5])])
def test_shape_extent_below_one_raises_value_error(modes):
    with pytest.raises(ValueError):
        Shape(*modes)


def test_shape_extent_below_one_message():
    with pytest.raises(ValueError, match=">= 1"):
        Shape(2, [3, 0])
    with pytest.raises(ValueError, match="got -1"):
        Shape(-1)


# ---------------------------------------------------------- decode / encode


def test_decode_order_is_first_mode_fastest():
    s = Shape(3, 4)
    assert [s.decode(i) for i in range(5)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    assert s.decode(11) == (2, 3)


def test_decode_nested_worked_example():
    assert Shape(5, [20, 4]).decode(214) == (4, (2, 2))
    assert Shape(2, [3, 4]).decode(23) == (1, (2, 3))


def test_decode_returns_nested_python_tuples_of_ints():
    c = Shape(5, [20, 4]).decode(214)
    assert type(c) is tuple and type(c[1]) is tuple
    assert all(type(x) is int for x in (c[0], c[1][0], c[1][1]))


def test_decode_accepts_numpy_integers():
    assert Shape(5, [20, 4]).decode(np.int64(214)) == (4, (2, 2))
    assert Shape(5, [20, 4]).decode(np.uint16(214)) == (4, (2, 2))


def test_encode_worked_example_mixes_nested_coordinates_and_ordinals():
    s = Shape(5, [20, 4])
    assert s.encode((4, (2, 2))) == 214
    assert s.encode((4, 42)) == 214
    assert s.encode(214) == 214
    assert s.encode([4, [2, 2]]) == 214


def test_encode_ordinal_for_any_subtree():
    s = Shape([2, 3], [4, [5, 6]])
    coord = ((1, 2), (3, (4, 5)))
    ordinal = s.encode(coord)
    assert s.decode(ordinal) == coord
    inner = 4 + 5 * 5  # (4, 5) over (5, 6)
    second = 3 + 4 * inner  # (3, (4, 5)) over (4, (5, 6))
    first = 1 + 2 * 2  # (1, 2) over (2, 3)
    assert ordinal == first + 6 * second
    assert s.encode(((1, 2), (3, inner))) == ordinal
    assert s.encode(((1, 2), second)) == ordinal
    assert s.encode((first, (3, (4, 5)))) == ordinal
    assert s.encode((first, second)) == ordinal
    assert s.encode(ordinal) == ordinal


def test_encode_accepts_numpy_integers_and_arrays():
    s = Shape(5, [20, 4])
    assert s.encode((np.int32(4), np.int64(42))) == 214
    assert s.encode((4, np.array([2, 2]))) == 214
    assert s.encode(np.int64(214)) == 214


def test_encode_does_not_modify_the_coordinate():
    coord = [4, [2, 2]]
    assert Shape(5, [20, 4]).encode(coord) == 214
    assert coord == [4, [2, 2]]


@pytest.mark.parametrize("ordinal", [True, False, 1.0, 2.5, "3", None, (0, 0), [1], np.float64(1.0)])
def test_decode_wrong_type_raises_type_error(ordinal):
    with pytest.raises(TypeError, match="must be an int"):
        Shape(3, 4).decode(ordinal)


@pytest.mark.parametrize("ordinal", [-1, 12, 13, 2**62, 2**70, -(2**70)])
def test_decode_out_of_range_raises_value_error(ordinal):
    with pytest.raises(ValueError, match="out of range"):
        Shape(3, 4).decode(ordinal)


def test_decode_rank_zero_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        Shape().decode(1)
    with pytest.raises(ValueError, match="out of range"):
        Shape().decode(-1)


@pytest.mark.parametrize(
    "coord, fragment",
    [
        (True, "bool"),
        ((True, 2), "bool"),
        ((4, (2, False)), "bool"),
        (1.0, "float"),
        ((4.0, 42), "float"),
        ((4, (2, 2.0)), "float"),
        ("ab", "str"),
        ((4, "42"), "str"),
        (None, "NoneType"),
        ((4, None), "NoneType"),
        ((4, object()), "object"),
    ],
)
def test_encode_wrong_type_raises_type_error(coord, fragment):
    with pytest.raises(TypeError, match=fragment):
        Shape(5, [20, 4]).encode(coord)


@pytest.mark.parametrize(
    "coord",
    [(5, 42), (-1, 42), (4, 80), (4, -1), (4, (20, 2)), (4, (2, 4)), (4, (-1, 0)), 400, -1, 2**70, (2**70, 0)],
)
def test_encode_out_of_range_raises_value_error(coord):
    with pytest.raises(ValueError, match="out of range"):
        Shape(5, [20, 4]).encode(coord)


@pytest.mark.parametrize(
    "coord",
    [
        (4,),  # too few modes
        (4, 42, 0),  # too many modes
        (4, (2, 2, 0)),  # too many sub-modes
        (4, (2,)),  # too few sub-modes
        ((4,), 42),  # nested where a leaf is expected
        (4, (2, (1,))),  # nested below a leaf
        ((4, 0), (2, 2)),  # nested where a leaf is expected
        (),  # empty coordinate for a rank-2 shape
    ],
)
def test_encode_mismatched_hierarchy_raises_value_error(coord):
    with pytest.raises(ValueError, match="modes|hierarchy"):
        Shape(5, [20, 4]).encode(coord)


def test_encode_rank_zero_errors():
    with pytest.raises(ValueError, match="out of range"):
        Shape().encode(1)
    with pytest.raises(ValueError, match="modes|hierarchy"):
        Shape().encode((0,))
    with pytest.raises(TypeError, match="bool"):
        Shape().encode(False)


# ============================================================== Stride


def test_stride_has_the_same_tree_form():
    s = Stride(1, [10, 100])
    assert s == Stride([1, [10, 100]]) == Stride((1, (10, 100)))
    assert Stride(1, Stride(10, 100)) == s
    assert len(s) == 2
    assert s.rank == 2
    assert s[0] == Stride(1)
    assert s[1] == Stride(10, 100)
    assert s[-1] == s[1]
    assert list(s) == [Stride(1), Stride(10, 100)]
    assert repr(s) == "Stride((1,(10,100)))"
    assert repr(Stride()) == "Stride(())"
    assert len(Stride()) == 0
    assert Stride(np.array([1, 2])) == Stride(1, 2)


def test_stride_zero_is_allowed():
    assert Stride(0) != Stride(1)
    assert len(Stride(0, [0, 0])) == 2


def test_stride_equality_and_hash():
    assert Stride(1, [10, 100]) != Stride(1, 10, 100)
    assert Stride(1, 2) != Shape(1, 2)
    assert Stride(1, 2) != (1, 2)
    assert hash(Stride(1, [10, 100])) == hash(Stride([1, (10, 100)]))
    assert len({Stride(1, 2), Stride([1, 2]), Stride(2, 1)}) == 2


def test_stride_is_immutable_and_picklable():
    modes = [1, [10, 100]]
    s = Stride(modes)
    modes[1][0] = 99
    assert s == Stride(1, [10, 100])
    with pytest.raises(AttributeError):
        s.rank = 3
    with pytest.raises(TypeError):
        s[0] = Stride(3)
    assert pickle.loads(pickle.dumps(s)) == s


@pytest.mark.parametrize("modes", [(-1,), (1, [10, -100]), (-(2**70),)])
def test_stride_negative_raises_value_error(modes):
    with pytest.raises(ValueError):
        Stride(*modes)
    if modes != (-(2**70),):
        with pytest.raises(ValueError, match=">= 0"):
            Stride(*modes)


@pytest.mark.parametrize("modes, fragment", [((True,), "bool"), ((1, [False]), "bool"), ((1.5,), "float"), (("1",), "str"), ((None,), "NoneType")])
def test_stride_wrong_type_raises_type_error(modes, fragment):
    with pytest.raises(TypeError, match=fragment):
        Stride(*modes)


@pytest.mark.parametrize("k, exc", [(2, IndexError), (-3, IndexError), ("0", TypeError), (True, TypeError), (0.0, TypeError)])
def test_stride_index_errors(k, exc):
    with pytest.raises(exc, match="out of range" if exc is IndexError else "indices must be ints"):
        Stride(1, [10, 100])[k]


# ============================================================== Layout


def test_layout_worked_example():
    assert EXAMPLE([1, [2, 3]]) == 321
    assert EXAMPLE.index([1, [2, 3]]) == 321
    assert EXAMPLE((1, (2, 3))) == 321


def test_layout_index_int_key_is_a_decoded_logical_ordinal():
    ordinal = EXAMPLE.shape.encode((1, (2, 3)))
    assert ordinal == 23
    assert EXAMPLE(23) == 321
    assert EXAMPLE.index(23) == 321
    assert EXAMPLE((1, 11)) == 321  # an ordinal for the (3, 4) subtree
    assert EXAMPLE(np.int64(23)) == 321
    assert EXAMPLE(np.array([1, 11])) == 321
    for i in range(EXAMPLE.size):
        assert EXAMPLE(i) == EXAMPLE(EXAMPLE.shape.decode(i)) == EXAMPLE.index(i)


def test_layout_accepts_shape_and_stride_objects_or_plain_iterables():
    a = Layout(Shape(2, [3, 4]), Stride(1, [10, 100]))
    assert Layout([2, [3, 4]], [1, [10, 100]]) == a
    assert Layout((2, (3, 4)), (1, (10, 100))) == a
    assert Layout(Shape(2, [3, 4]), [1, [10, 100]]) == a
    assert Layout([2, [3, 4]], Stride(1, [10, 100])) == a
    assert Layout(shape=[2, [3, 4]], stride=[1, [10, 100]]) == a
    assert Layout([4], [2]) == Layout(Shape(4), Stride(2))


def test_layout_properties():
    assert EXAMPLE.shape == Shape(2, [3, 4])
    assert isinstance(EXAMPLE.shape, Shape)
    assert EXAMPLE.stride == Stride(1, [10, 100])
    assert isinstance(EXAMPLE.stride, Stride)
    assert EXAMPLE.size == EXAMPLE.shape.size == 24
    assert EXAMPLE.rank == len(EXAMPLE) == 2
    assert EXAMPLE.cosize == 1 * 1 + 2 * 10 + 3 * 100 + 1 == 322
    assert EXAMPLE.is_injective is True


def test_layout_repr():
    assert repr(EXAMPLE) == "Layout((2,(3,4)):(1,(10,100)))"
    assert repr(Layout([], [])) == "Layout(():())"
    assert repr(Layout([3, 4], [1, 3])) == "Layout((3,4):(1,3))"


def test_layout_sub_layouts():
    assert EXAMPLE[0] == Layout(Shape(2), Stride(1))
    assert EXAMPLE[1] == Layout(Shape(3, 4), Stride(10, 100))
    assert EXAMPLE[-1] == EXAMPLE[1]
    assert EXAMPLE[-2] == EXAMPLE[0]
    assert EXAMPLE[1][1] == Layout(Shape(4), Stride(100))
    assert list(EXAMPLE) == [EXAMPLE[0], EXAMPLE[1]]
    assert all(isinstance(sub, Layout) for sub in EXAMPLE)
    assert EXAMPLE[1]((2, 3)) == 320
    assert EXAMPLE[1](11) == 320
    assert EXAMPLE[1].cosize == 321
    assert list(Layout([], [])) == []


@pytest.mark.parametrize("k, exc, fragment", [
    (2, IndexError, "out of range"),
    (-3, IndexError, "out of range"),
    (2**70, IndexError, "out of range"),
    ("0", TypeError, "indices must be ints"),
    (True, TypeError, "indices must be ints"),
    (1.0, TypeError, "indices must be ints"),
    (None, TypeError, "indices must be ints"),
    (slice(None), TypeError, "indices must be ints"),
])
def test_layout_index_errors(k, exc, fragment):
    with pytest.raises(exc, match=fragment):
        EXAMPLE[k]


def test_layout_rank_zero():
    r = Layout([], [])
    assert r == Layout(Shape(), Stride())
    assert r.size == 1
    assert r.rank == len(r) == 0
    assert r.cosize == 1
    assert r.is_injective is True
    assert r(()) == 0
    assert r(0) == 0
    assert r.index(()) == 0
    with pytest.raises(ValueError, match="out of range"):
        r(1)
    with pytest.raises(ValueError, match="modes|hierarchy"):
        r((0,))
    with pytest.raises(IndexError, match="out of range"):
        r[0]


def test_layout_equality_compares_both_trees():
    assert Layout([2, 3], [1, 2]) == Layout(Shape(2, 3), Stride(1, 2))
    assert Layout([2, 3], [1, 2]) != Layout([2, 3], [1, 3])
    assert Layout([2, 3], [1, 2]) != Layout([3, 2], [1, 2])
    assert Layout([6], [1]) != Layout([[2, 3]], [[1, 2]])  # same map, different trees
    assert Layout([2, 3], [1, 2]) != "Layout((2,3):(1,2))"
    assert Layout([2, 3], [1, 2]) != (Shape(2, 3), Stride(1, 2))
    assert not (Layout([2, 3], [1, 2]) != Layout([2, 3], [1, 2]))


def test_layout_is_hashable_and_hash_agrees_with_equality():
    a = Layout([2, [3, 4]], [1, [10, 100]])
    assert hash(a) == hash(EXAMPLE)
    assert {a: 1}[EXAMPLE] == 1
    assert len({a, EXAMPLE, Layout([2, [3, 4]], [1, [10, 101]]), Layout([], [])}) == 3


def test_layout_is_immutable():
    shape_modes, stride_modes = [2, [3, 4]], [1, [10, 100]]
    layout = Layout(shape_modes, stride_modes)
    shape_modes[0] = 9
    stride_modes[1][1] = 7
    assert layout == EXAMPLE
    for attr in ("shape", "stride", "size", "rank", "cosize", "is_injective"):
        with pytest.raises(AttributeError):
            setattr(layout, attr, 1)
    with pytest.raises(TypeError):
        layout[0] = layout[1]
    assert layout == EXAMPLE


def test_layout_copy_and_pickle_round_trip():
    for layout in (EXAMPLE, Layout([], []), Layout([4], [0])):
        assert pickle.loads(pickle.dumps(layout)) == layout
        assert copy.deepcopy(layout) == layout


@pytest.mark.parametrize(
    "shape, stride",
    [
        ([2, [3, 4]], [1, 10, 100]),
        ([2, 3], [1]),
        ([2], [1, 2]),
        ([2, [3, 4]], [1, [10]]),
        ([2, [3, 4]], [[1], [10, 100]]),
        ([2, [3, 4]], [1, [10, [100]]]),
        ([], [1]),
        ([2], []),
    ],
)
def test_layout_non_congruent_raises_value_error(shape, stride):
    shape_before, stride_before = copy.deepcopy(shape), copy.deepcopy(stride)
    with pytest.raises(ValueError, match="not congruent"):
        Layout(shape, stride)
    with pytest.raises(ValueError, match="not congruent"):
        Layout(Shape(shape), Stride(stride))
    assert shape == shape_before and stride == stride_before


@pytest.mark.parametrize(
    "shape, stride, fragment",
    [
        (2, [1], "expected a Shape"),
        (None, [1], "expected a Shape"),
        (2.0, [1], "expected a Shape"),
        ("ab", [1], "expected a Shape"),
        (True, [1], "expected a Shape"),
        ([2], 1, "expected a Stride"),
        ([2], None, "expected a Stride"),
        ([2], "a", "expected a Stride"),
        (Shape(2), False, "expected a Stride"),
    ],
)
def test_layout_non_iterable_raises_type_error(shape, stride, fragment):
    with pytest.raises(TypeError, match=fragment):
        Layout(shape, stride)


def test_layout_invalid_entries_raise_shape_and_stride_errors():
    with pytest.raises(ValueError, match=">= 1"):
        Layout([2, 0], [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        Layout([2, 3], [1, -2])
    with pytest.raises(TypeError, match="bool"):
        Layout([2, True], [1, 2])
    with pytest.raises(TypeError, match="float"):
        Layout([2, 3], [1, 2.0])


def test_layout_missing_argument_raises_type_error():
    with pytest.raises(TypeError):
        Layout(Shape(2))
    with pytest.raises(TypeError):
        Layout()


@pytest.mark.parametrize(
    "key, fragment",
    [
        (True, "bool"),
        ((1, (2, True)), "bool"),
        (1.0, "float"),
        ((1, (2.0, 3)), "float"),
        ("1", "str"),
        (None, "NoneType"),
        ((1, None), "NoneType"),
    ],
)
def test_layout_key_wrong_type_raises_type_error(key, fragment):
    with pytest.raises(TypeError, match=fragment):
        EXAMPLE(key)
    with pytest.raises(TypeError, match=fragment):
        EXAMPLE.index(key)


@pytest.mark.parametrize("key", [24, -1, 2**70, (2, (0, 0)), (1, 12), (1, (3, 0)), (0, (0, 4)), (-1, 0)])
def test_layout_key_out_of_range_raises_value_error(key):
    with pytest.raises(ValueError, match="out of range"):
        EXAMPLE(key)
    with pytest.raises(ValueError, match="out of range"):
        EXAMPLE.index(key)


@pytest.mark.parametrize("key", [(1,), (1, (2, 3), 0), (1, (2,)), (1, (2, 3, 0)), ((1,), (2, 3)), (1, ((2,), 3)), ()])
def test_layout_key_mismatched_hierarchy_raises_value_error(key):
    with pytest.raises(ValueError, match="modes|hierarchy"):
        EXAMPLE(key)
    with pytest.raises(ValueError, match="modes|hierarchy"):
        EXAMPLE.index(key)


def test_layout_index_does_not_modify_the_key():
    key = [1, [2, 3]]
    assert EXAMPLE(key) == 321
    assert key == [1, [2, 3]]


# ---------------------------------------------------------- cosize / injective


@pytest.mark.parametrize(
    "shape, stride, cosize",
    [
        ([], [], 1),  # rank 0
        ([1], [5], 1),
        ([4], [0], 1),  # broadcast
        ([2, 3], [0, 0], 1),
        ([4], [2], 7),
        ([3, 1], [2, 9], 5),  # extent-1 leaves contribute nothing
        ([2, 3], [1, 2], 6),
        ([2, [3, 4]], [1, [10, 100]], 322),
    ],
)
def test_cosize_is_one_past_the_largest_offset(shape, stride, cosize):
    layout = Layout(shape, stride)
    assert layout.cosize == cosize
    assert layout.cosize == 1 + max(layout(i) for i in range(layout.size))


@pytest.mark.parametrize(
    "shape, stride, injective",
    [
        ([], [], True),
        ([1, 1], [0, 0], True),  # extent-1 leaves with stride 0 are fine
        ([4], [2], True),
        ([4], [0], False),
        ([2, 3], [3, 1], True),
        ([2, 3], [2, 1], False),
        ([2, 3], [3, 2], True),  # injective though strides overlap in span
        ([2, 2], [1, 1], False),
        ([2, [3, 4]], [1, [10, 100]], True),
        ([2, [3, 4]], [1, [2, 5]], False),
        ([3, 3], [2, 3], True),
        ([3, 3], [3, 2], True),
        ([4, 3], [3, 2], True),  # overlapping spans, still injective
        ([4, 3], [2, 3], False),  # (3, 0) and (0, 2) collide
    ],
)
def test_is_injective(shape, stride, injective):
    layout = Layout(shape, stride)
    assert layout.is_injective is injective
    offsets = [layout(i) for i in range(layout.size)]
    assert (len(set(offsets)) == len(offsets)) is injective


# ---------------------------------------------------------- broadcast_to


def test_broadcast_to_sets_extent_one_leaves_with_stride_zero():
    layout = Layout([1, [3, 1]], [5, [1, 7]])
    out = layout.broadcast_to(Shape(4, [3, 6]))
    assert out == Layout(Shape(4, [3, 6]), Stride(0, [1, 0]))
    assert layout.broadcast_to([4, [3, 6]]) == out
    assert out(((3, (2, 5)))) == 2
    assert layout == Layout([1, [3, 1]], [5, [1, 7]])  # the input is unchanged


def test_broadcast_to_keeps_matching_extents_and_strides():
    assert EXAMPLE.broadcast_to(EXAMPLE.shape) == EXAMPLE
    assert Layout([1, 3], [5, 1]).broadcast_to([1, 3]) == Layout([1, 3], [5, 1])
    assert Layout([1, 3], [5, 1]).broadcast_to([2, 3]) == Layout([2, 3], [0, 1])
    assert Layout([], []).broadcast_to(Shape()) == Layout([], [])
    assert Layout([[1, 1]], [[3, 4]]).broadcast_to([[2, 1]]) == Layout([[2, 1]], [[0, 4]])


def _assert_broadcast_rejected(layout, target, fragment):
    before = repr(layout)
    with pytest.raises(ValueError, match=fragment):
        layout.broadcast_to(target)
    assert repr(layout) == before


@pytest.mark.parametrize(
    "target",
    [
        [4, 3, 2],  # inserts a mode
        [1, 3, 1],  # inserts an extent-1 mode
        [3],  # removes a mode
        [],  # removes every mode
        [4, [2, 2]],  # refines a leaf into a nested mode of another size
    ],
)
def test_broadcast_to_never_inserts_removes_or_reshapes_modes(target):
    _assert_broadcast_rejected(Layout([1, 3], [5, 1]), target, "broadcast")


def test_broadcast_to_never_merges_a_nested_mode_into_a_leaf():
    """Note [Compatible shapes]: a nested mode's strides need not coalesce, so no view merges it."""
    _assert_broadcast_rejected(Layout([2, [3, 1]], [1, [2, 0]]), [2, 3], "hierarchies differ")
    _assert_broadcast_rejected(Layout([4, [3, 2]], [6, [1, 3]]), [4, 6], "hierarchies differ")


@pytest.mark.parametrize(
    ("target", "strides"),
    [
        ([4, [3]], [0, [1]]),  # a leaf of extent 3 refined into (3,)
        ([[4], 3], [[0], 1]),  # an extent-1 leaf broadcast to a nested mode
        ([[1, 4], 3], [[0, 0], 1]),
        ([[2, 2], [3, 1]], [[0, 0], [1, 3]]),
    ],
)
def test_broadcast_to_refines_a_leaf_into_a_nested_mode(target, strides):
    """Note [Compatible shapes]: a leaf of extent n meets a nested mode of size n (refined: the nested
    coordinates in colexicographic order are the leaf's) or of any size (extent 1: broadcast)."""
    layout = Layout([1, 3], [5, 1])
    got = layout.broadcast_to(target)
    assert got == Layout(target, strides)
    # every target's first mode has size 4 (broadcast: coordinate 0), its second size 3 (the leaf's coordinate)
    assert [got(j) for j in range(12)] == [layout((0, j // 4)) for j in range(12)]
    rowmajor = Layout([4, 6], [6, 1])
    refined = rowmajor.broadcast_to([4, [3, 2]])
    assert refined == Layout([4, [3, 2]], [6, [1, 3]])
    assert [refined(j) for j in range(24)] == [rowmajor(j) for j in range(24)]


def test_broadcast_to_never_reorders_modes():
    _assert_broadcast_rejected(Layout([2, [3, 1]], [1, [2, 0]]), [[3, 1], 2], "broadcast")
    _assert_broadcast_rejected(Layout([2, 1], [1, 2]), [1, 2], "broadcast")
    _assert_broadcast_rejected(Layout([2, [3, 4]], [1, [2, 6]]), [2, [4, 3]], "broadcast")


def test_broadcast_to_rejects_changing_extents_other_than_one():
    _assert_broadcast_rejected(Layout([1, 3], [5, 1]), [4, 4], "broadcast")
    _assert_broadcast_rejected(Layout([2, 3], [1, 2]), [1, 3], "broadcast")  # never shrinks
    _assert_broadcast_rejected(Layout([2, 3], [1, 2]), [4, 3], "broadcast")
    _assert_broadcast_rejected(Layout([2, [3, 1]], [1, [2, 6]]), [2, [6, 1]], "broadcast")


def test_broadcast_to_target_errors():
    layout = Layout([1, 3], [5, 1])
    with pytest.raises(TypeError, match="expected a Shape"):
        layout.broadcast_to(5)
    with pytest.raises(TypeError, match="expected a Shape"):
        layout.broadcast_to(None)
    with pytest.raises(TypeError, match="bool"):
        layout.broadcast_to([True, 3])
    with pytest.raises(ValueError, match=">= 1"):
        layout.broadcast_to([0, 3])
    assert layout == Layout([1, 3], [5, 1])


# ============================================================== dense layouts


def test_column_major_worked_example():
    assert sw.column_major(2, 3) == Layout(Shape([2, 3]), Stride([1, 2]))
    assert strideweave.friendly.column_major(2, 3) == Layout(Shape([2, 3]), Stride([1, 2]))


def test_row_major_worked_example():
    layout = sw.row_major(2, 3, 4)
    assert layout.stride == Stride(12, 4, 1)
    assert layout == Layout(Shape(2, 3, 4), Stride(12, 4, 1))


def test_dense_layouts_accept_the_shape_argument_forms():
    assert sw.column_major([2, 3]) == sw.column_major(2, 3) == sw.column_major(Shape(2, 3))
    assert sw.row_major([2, 3, 4]) == sw.row_major(2, 3, 4) == sw.row_major(Shape(2, 3, 4))
    assert sw.column_major(np.array([2, 3])) == sw.column_major(2, 3)


def test_dense_layouts_nest_at_every_depth():
    assert sw.column_major(2, [3, 4]) == Layout(Shape(2, [3, 4]), Stride(1, [2, 6]))
    assert sw.column_major([2, 3], 4) == Layout(Shape([2, 3], 4), Stride([1, 2], 6))
    assert sw.row_major(2, [3, 4]) == Layout(Shape(2, [3, 4]), Stride(12, [4, 1]))
    assert sw.column_major(5) == Layout([5], [1])
    assert sw.row_major(5) == Layout([5], [1])


def test_dense_layouts_rank_zero():
    assert sw.column_major() == Layout([], [])
    assert sw.row_major() == Layout([], [])
    assert sw.column_major().cosize == 1


def test_column_major_maps_each_ordinal_to_itself():
    layout = sw.column_major(2, [3, 4], 5)
    assert [layout(i) for i in range(layout.size)] == list(range(layout.size))
    assert layout.cosize == layout.size
    assert layout.is_injective


def test_row_major_maps_onto_a_dense_range():
    layout = sw.row_major(2, [3, 4])
    assert sorted(layout(i) for i in range(layout.size)) == list(range(layout.size))
    assert layout((0, (0, 1))) == 1
    assert layout((1, (0, 0))) == 12


@pytest.mark.parametrize("make", [sw.column_major, sw.row_major])
def test_dense_layout_errors(make):
    with pytest.raises(ValueError, match=">= 1"):
        make(2, 0)
    with pytest.raises(TypeError, match="bool"):
        make(True)
    with pytest.raises(TypeError, match="float"):
        make(2.0, 3)
    with pytest.raises(TypeError, match="NoneType"):
        make(None)


# ============================================================== properties


@PROPERTY
@given(shape_trees, st.randoms(use_true_random=False))
def test_property_decode_encode_round_trip(tree, rng):
    s = Shape(tree)
    assert s.size == ref_size(tree)
    assert len(s) == len(tree)
    assert s.extents == tuple(ref_size(m) for m in tree)
    assert s.depth == ref_depth(tree)
    if len(tree) != 1 or isinstance(tree[0], int):  # else Shape(*tree) is Shape(m): m is the mode list
        assert Shape(*tree) == s
    assert Shape(ref_to_tuple(tree)) == s
    assert hash(Shape(ref_to_tuple(tree))) == hash(s)
    assert list(s) == [Shape(m) for m in tree]  # leaf e: Shape(e); nested m: m is the mode list
    for i in range(s.size):
        coord = s.decode(i)
        assert coord == ref_decode(tree, i)
        assert s.encode(coord) == i
        mixed = collapse(tree, coord, rng)
        assert s.encode(mixed) == i, mixed
    with pytest.raises(ValueError):
        s.decode(s.size)


@PROPERTY
@given(layout_trees())
def test_property_layout_index_matches_reference(trees):
    shape_tree, stride_tree = trees
    layout = Layout(shape_tree, stride_tree)
    assert layout.size == ref_size(shape_tree)
    offsets = []
    for i in range(layout.size):
        expected = ref_index(shape_tree, stride_tree, i)
        assert layout(i) == expected
        assert layout.index(layout.shape.decode(i)) == expected
        offsets.append(expected)
    assert layout.cosize == max(offsets) + 1
    assert layout.is_injective is (len(set(offsets)) == len(offsets))
    for k, sub in enumerate(layout):
        assert sub == layout[k]
        assert sub.shape == layout.shape[k]
        assert sub.stride == layout.stride[k]


@PROPERTY
@given(layout_trees(max_stride=4))
def test_property_is_injective_matches_brute_force_with_small_strides(trees):
    # Small strides make collisions (and overlapping-but-injective spans) common.
    layout = Layout(*trees)
    offsets = {layout(i) for i in range(layout.size)}
    assert layout.is_injective is (len(offsets) == layout.size)
    assert layout.cosize == max(offsets) + 1


@PROPERTY
@given(shape_trees)
def test_property_dense_layouts_match_reference(tree):
    s = Shape(tree)
    col, row = sw.column_major(s), sw.row_major(s)
    assert col == Layout(s, Stride(ref_dense(tree, 1, reverse=False)[0]))
    assert row == Layout(s, Stride(ref_dense(tree, 1, reverse=True)[0]))
    assert sw.column_major(tree) == col
    assert sw.row_major(tree) == row
    assert [col(i) for i in range(s.size)] == list(range(s.size))
    assert sorted(row(i) for i in range(s.size)) == list(range(s.size))
    assert col.cosize == row.cosize == s.size
    assert col.is_injective and row.is_injective


def _widen(tree, rng):
    """Target tree: each extent-1 leaf becomes a random extent (sometimes kept)."""
    if isinstance(tree, int):
        return rng.choice([1, 2, 3]) if tree == 1 else tree
    return [_widen(child, rng) for child in tree]


def _broadcast_strides(shape_tree, stride_tree, target_tree):
    if isinstance(shape_tree, int):
        return 0 if target_tree != shape_tree else stride_tree
    return [_broadcast_strides(*children) for children in zip(shape_tree, stride_tree, target_tree)]


@PROPERTY
@given(layout_trees(), st.randoms(use_true_random=False))
def test_property_broadcast_to(trees, rng):
    shape_tree, stride_tree = trees
    layout = Layout(shape_tree, stride_tree)
    target = _widen(shape_tree, rng)
    out = layout.broadcast_to(Shape(target))
    expected_strides = _broadcast_strides(shape_tree, stride_tree, target)
    assert out == Layout(Shape(target), Stride(expected_strides))
    assert out.shape == Shape(target)
    assert out.stride == Stride(expected_strides)
    # Every broadcast coordinate reads the source at the same coordinate with the widened leaves at 0.
    for i in range(0, out.size, max(1, out.size // 64)):
        assert out(i) == ref_index(target, expected_strides, i)
        source_leaves = [
            c if e == t else 0
            for c, e, t in zip(ref_leaves(ref_decode(target, i)), ref_leaves(shape_tree), ref_leaves(target))
        ]
        assert out(i) == sum(c * s for c, s in zip(source_leaves, ref_leaves(stride_tree)))
    assert layout == Layout(shape_tree, stride_tree)
