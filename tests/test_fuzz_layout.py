"""Fuzz tests of Shape, Stride and Layout: constructors, encode/decode, index and broadcast_to (fuzzing.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strideweave import Layout, Shape, Stride

from fuzzing import (
    GARBAGE,
    as_tree,
    attempt,
    congruent_stride,
    decode_model,
    expect,
    fuzz,
    index_model,
    shape_fault,
    shape_trees,
    tree_leaves,
    tree_size,
    valid_shape_trees,
)

pytestmark = pytest.mark.usefixtures("fuzz_report", "fuzz_watchdog", "clear_io_faults", "grad_mode_on")


# ================================================================ Shape, Stride, Layout


@fuzz(300)
@given(modes=st.lists(shape_trees, max_size=4), splat=st.booleans())
def test_fuzz_shape_constructor(modes, splat):
    faults = set()
    for m in modes:
        faults |= shape_fault(m)
    good = not faults
    leaves = [int(x) for x in tree_leaves(as_tree(modes))] if good else []
    if good and math.prod(leaves) > 2**62:
        faults = {ValueError}

    # "a single iterable argument is the mode list": Shape(*[[2, 3]]) is Shape(2, 3)
    effective = modes[0] if splat and len(modes) == 1 and isinstance(modes[0], list) else modes

    def check(s):
        tree = as_tree(effective)
        assert len(s) == len(tree)
        assert s.size == tree_size(tree)
        assert s.extents == tuple(tree_size(c) for c in tree)
        for k in range(len(s)):
            assert s[k].size == tree_size(tree[k])
        again = Shape(*modes) if splat else Shape(modes)
        assert again == s == Shape(s) and hash(again) == hash(s)
        if s.size <= 64:
            for i in range(s.size):
                assert s.decode(i) == decode_model(tree, i)

    expect("Shape", (lambda: Shape(*modes)) if splat else (lambda: Shape(modes)), faults, check)


def coordinate_for(draw, t, i):
    """A coordinate denoting ordinal i over t: nested, or with random subtrees collapsed to their ordinal."""
    if isinstance(t, int):
        return i
    if draw(st.integers(0, 3)) == 3:
        return i
    out, rest = [], i
    for c in t:
        n = tree_size(c)
        out.append(coordinate_for(draw, c, rest % n))
        rest //= n
    return tuple(out)


def coordinate_fault(t, key, top=True):
    """Exception types encode(key) over tree t must raise, or empty."""
    if isinstance(key, dict):
        key = tuple(key)  # any non-text iterable is a coordinate
    if isinstance(key, (bool, np.bool_)):
        return {TypeError}
    if isinstance(key, (int, np.integer)):
        return set() if 0 <= int(key) < tree_size(t) else {ValueError}
    if not isinstance(key, (tuple, list)):
        return {TypeError}
    faults = set()
    for k in key:
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer, tuple, list)):
            faults.add(TypeError)
    if isinstance(t, int):
        if top and len(key) == 1 and not faults:  # rank-1 shapes accept (i,)
            return coordinate_fault(t, key[0], False)
        return faults | {ValueError}
    if len(key) != len(t):
        return faults | {ValueError}
    for c, k in zip(t, key):
        faults |= coordinate_fault(c, k, False)
    return faults


def encode_model(t, key):
    if isinstance(key, (int, np.integer)):
        return int(key)
    if isinstance(t, int):
        return int(key[0])
    out, run = 0, 1
    for c, k in zip(t, key):
        out += encode_model(c, k) * run
        run *= tree_size(c)
    return out


def mutate_coordinate(draw, key):
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(GARBAGE)
    if kind == 1:
        return draw(st.integers(-3, 200))
    if not isinstance(key, tuple) or not key:
        return (key, 0)
    key = list(key)
    pos = draw(st.integers(0, len(key) - 1))
    if kind == 2:
        key[pos] = draw(st.one_of(GARBAGE, st.integers(-2, 9)))
    elif kind == 3:
        key.append(0)
    elif kind == 4:
        key.pop()
    else:
        key[pos] = (key[pos], 0)
    return tuple(key)


@fuzz(250)
@given(data=st.data())
def test_fuzz_shape_encode_decode(data):
    modes = data.draw(valid_shape_trees(), label="modes")
    s = Shape(modes)
    tree = as_tree(modes)
    n = s.size
    for _ in range(data.draw(st.integers(1, 6), label="calls")):
        i = data.draw(st.one_of(st.integers(0, n - 1), st.integers(-3, n + 3), GARBAGE, st.integers(0, n - 1).map(np.int64)),
                      label="ordinal")
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            faults = {TypeError}
        else:
            faults = set() if 0 <= int(i) < n else {ValueError}
        def dcheck(r, i=i):
            assert r == decode_model(tree, int(i))

        expect("Shape.decode", lambda: s.decode(i), faults, dcheck)
        if not faults:
            c = s.decode(i)
            assert s.encode(c) == int(i)
        j = data.draw(st.integers(0, n - 1), label="ordinal")
        key = coordinate_for(data.draw, tree, j)
        if data.draw(st.booleans(), label="mutate"):
            key = mutate_coordinate(data.draw, key)
        faults = coordinate_fault(tree, key)

        def check(r, key=key):
            assert r == encode_model(tree, key)

        expect("Shape.encode", lambda: s.encode(key), faults, check)


@fuzz(250)
@given(data=st.data())
def test_fuzz_layout_constructor_and_index(data):
    modes = data.draw(valid_shape_trees(), label="modes")
    tree = as_tree(modes)
    hostile = data.draw(st.booleans(), label="hostile")
    strides = congruent_stride(data.draw, list(modes), hostile)
    shape = Shape(modes)

    def stride_fault(shape_t, d):
        if isinstance(d, (bool, np.bool_)) or isinstance(d, (float, str, type(None))):
            return {TypeError}
        if isinstance(shape_t, int):
            if isinstance(d, (list, tuple)):
                return {ValueError} | set().union(*[stride_fault(0, x) for x in d]) if d else {ValueError}
            return {ValueError} if not (0 <= d <= 2**62) else set()
        if not isinstance(d, (list, tuple)):
            return {ValueError} | stride_fault(0, d)
        f = set() if len(d) == len(shape_t) else {ValueError}
        for k, x in enumerate(d):
            f |= stride_fault(shape_t[k] if k < len(shape_t) else 0, x)
        return f

    faults = stride_fault(tree, strides) if isinstance(strides, list) else {TypeError}  # a bare int is no Stride
    if not faults:
        st_tree = as_tree(strides)
        cosize = 1 + sum((e - 1) * d for e, d in zip(tree_leaves(tree), tree_leaves(st_tree)))
        if cosize > 2**62:
            faults = {ValueError}
    layout, error = attempt("Layout", lambda: Layout(shape, Stride(strides)) if isinstance(strides, list) else Layout(shape, strides))
    if faults:
        assert isinstance(error, tuple(faults)), (faults, error, layout)
        return
    assert error is None, error
    assert layout.size == shape.size and layout.cosize == cosize
    offsets = [index_model(tree, st_tree, decode_model(tree, i)) for i in range(shape.size)]
    assert layout.is_injective == (len(set(offsets)) == len(offsets))
    assert layout == Layout(shape, Stride(strides)) and hash(layout) == hash(Layout(shape, Stride(strides)))
    for _ in range(data.draw(st.integers(1, 6), label="calls")):
        i = data.draw(st.one_of(st.integers(-2, shape.size + 2), GARBAGE), label="key")
        if data.draw(st.booleans(), label="as coordinate") and isinstance(i, int) and 0 <= i < shape.size:
            i = coordinate_for(data.draw, tree, i)
            if data.draw(st.booleans(), label="mutate"):
                i = mutate_coordinate(data.draw, i)
        faults = coordinate_fault(tree, i)

        def check(r, i=i):
            assert r == offsets[encode_model(tree, i)]

        as_call = data.draw(st.booleans(), label="call")
        expect("Layout.index", lambda: layout(i) if as_call else layout.index(i), faults, check)
    target_modes = data.draw(st.one_of(st.just(None), valid_shape_trees()), label="broadcast target")
    if target_modes is not None:
        target = Shape(target_modes)
        t_tree = as_tree(target_modes)

        def bfault(a, b):
            # Note [Compatible shapes]: a leaf meets a nested mode of its size (refined) or any (extent 1); a
            # nested mode never meets a leaf.
            if isinstance(a, int) and not isinstance(b, int):
                return set() if a == 1 or a == tree_size(b) else {ValueError}
            if isinstance(a, int) != isinstance(b, int):
                return {ValueError}
            if isinstance(a, int):
                return set() if a == b or a == 1 else {ValueError}
            if len(a) != len(b):
                return {ValueError}
            return set().union(set(), *[bfault(x, y) for x, y in zip(a, b)])

        def bcheck(r):
            assert r.shape == target
            for j in range(target.size):
                src = decode_model(t_tree, j)

                # extent-1 leaves read coordinate 0 with the original stride (stride 0 after broadcast); a leaf
                # refined into a nested mode reads the nested coordinate's colexicographic ordinal
                def clamp(s_t, t_t, c):
                    if isinstance(s_t, int):
                        return 0 if s_t == 1 else encode_model(t_t, c)
                    return tuple(clamp(x, y, z) for x, y, z in zip(s_t, t_t, c))

                assert r(j) == index_model(tree, st_tree, clamp(tree, t_tree, src))

        expect("Layout.broadcast_to", lambda: layout.broadcast_to(target), bfault(tree, t_tree), bcheck)
