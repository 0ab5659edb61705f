"""Hostile input: property tests over the public entry points (issue 8, item 4).

Every test feeds random and malformed values to one entry point and checks
the one contract of the substrate: a call either works and matches a small
Python model, or raises one of the documented exception types
(``TypeError``, ``ValueError``, ``RuntimeError``, ``IndexError``,
``NotImplementedError``, ``OverflowError``) and changes nothing (values,
versions, residency, ownership, release state). Any other exception type fails
the test; a crash kills the run; a hang is caught by a watchdog
(``faulthandler.dump_traceback_later``) and by deadlines on every ``wait()``.

Where an input breaks several rules at once, the model expects one of the
exception types those rules name (the spec fixes the order only for some
entry points; those orders are tested elsewhere). Policies are the one place
where a user exception may surface unchanged: "An exception raised by the
callback SHALL propagate".

Hypothesis runs derandomized (``derandomize=True``, no example database), so
every run feeds the same examples; ``SW_FUZZ_EXAMPLES`` scales every test's
``max_examples`` (e.g. ``SW_FUZZ_EXAMPLES=10`` for a ten times longer run).
The number of calls per entry point and their outcomes are printed at the end
of the module (``examples run per entry point``) and written to
``build/fuzz-counts.json`` when that directory exists.

Run one entry point: ``.venv/bin/python -m pytest -q tests/test_fuzz.py -k project``.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import gc
import itertools
import json
import math
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strideweave as sw
from strideweave import DType, Layout, Shape, Stride, Tensor
from strideweave.carriers.tiled_evictable import ResidencyPlan, TiledEvictable, TileSelection, TileSet

F32, I32, BOOL, F64 = DType.Float32, DType.Int32, DType.Bool, DType.Float64
DOCUMENTED = (TypeError, ValueError, RuntimeError, IndexError, NotImplementedError, OverflowError)
SCALE = float(os.environ.get("SW_FUZZ_EXAMPLES", "1"))
DEADLINE_S = 20.0  # a wait() that takes longer is a hang


def fuzz(n):
    """Hypothesis settings of one fuzz test: derandomized, `n` examples (scaled by SW_FUZZ_EXAMPLES)."""
    return settings(
        max_examples=max(1, int(n * SCALE)),
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


# ---------------------------------------------------------------- bookkeeping

CALLS: collections.Counter = collections.Counter()
OUTCOMES: dict = collections.defaultdict(collections.Counter)


class Undocumented(AssertionError):
    pass


def attempt(entry, fn, *, extra=()):
    """Calls fn(); returns (result, None) or (None, exception) for a documented exception type.

    Any other exception (``extra`` adds user exception types a policy may raise) fails the test.
    """
    CALLS[entry] += 1
    try:
        result = fn()
    except DOCUMENTED + tuple(extra) as e:
        OUTCOMES[entry][type(e).__name__] += 1
        return None, e
    except BaseException as e:  # noqa: BLE001 - the point of the test
        if type(e).__module__.startswith("hypothesis"):
            raise  # Hypothesis' own control flow
        OUTCOMES[entry][type(e).__name__] += 1
        raise Undocumented(f"{entry}: undocumented exception {type(e).__name__}: {e}") from e
    OUTCOMES[entry]["ok"] += 1
    return result, None


def expect(entry, fn, faults, check=None, *, extra=()):
    """The model says `faults` (a set of exception types, empty when the call is valid).

    Valid: the call must succeed and `check(result)` holds. Invalid: the call must raise one of `faults`.
    Returns the exception (or None).
    """
    result, error = attempt(entry, fn, extra=extra)
    if faults:
        assert error is not None, f"{entry}: expected one of {sorted(f.__name__ for f in faults)}, got success {result!r}"
        assert isinstance(error, tuple(faults)), (
            f"{entry}: expected one of {sorted(f.__name__ for f in faults)}, got {type(error).__name__}: {error}")
        return error
    assert error is None, f"{entry}: valid call raised {type(error).__name__}: {error}"
    if check is not None:
        check(result)
    return None


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    # Watchdog: a hang anywhere in this module dumps every thread's stack and ends the run (the module
    # takes about 25 s; the bound is generous for slow or sanitized runs and scales with SW_FUZZ_EXAMPLES).
    faulthandler.dump_traceback_later(max(600, 60 * SCALE * 10), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    lines = ["", "test_fuzz: examples run per entry point (calls; outcomes)"]
    for entry in sorted(CALLS):
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(OUTCOMES[entry].items()))
        lines.append(f"  {entry:32s} {CALLS[entry]:6d}   {outcomes}")
    lines.append(f"  {'total':32s} {sum(CALLS.values()):6d}")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print("\n".join(lines))
    else:
        print("\n".join(lines))
    build = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")
    if os.path.isdir(build):
        with open(os.path.join(build, "fuzz-counts.json"), "w") as f:
            json.dump({k: {"calls": CALLS[k], **OUTCOMES[k]} for k in sorted(CALLS)}, f, indent=1)


@pytest.fixture(autouse=True)
def _clean_state():
    sw._core._io_clear()
    sw.set_grad_enabled(True)
    yield
    sw._core._io_clear()
    sw.set_grad_enabled(True)


def finish(handle, timeout=DEADLINE_S):
    """handle.wait() with a deadline: a handle that never completes fails the test instead of hanging it."""
    end = time.monotonic() + timeout
    while not handle.done:
        if time.monotonic() > end:
            raise AssertionError(f"{handle!r} did not complete within {timeout} s")
        time.sleep(0.0005)
    return handle.wait()


# ---------------------------------------------------------------- models


def f32(x):
    """x rounded to binary32 (overflow to +-inf), as Float32 storage does."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _assert_same(a, b):
    assert same(a, b), (a, b)


def value_kind(v):
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    if isinstance(v, (float, np.floating)):
        return "float"
    return None


def stored(dtype, v):
    """(what a slot of `dtype` stores for `v`, None) or (None, the exception type the write must raise)."""
    kind = value_kind(v)
    if kind is None:
        return None, TypeError
    if dtype is BOOL:
        return (bool(v), None) if kind == "bool" else (None, TypeError)
    if kind == "bool":
        return None, TypeError
    if dtype is I32:
        if kind == "float":
            return None, TypeError
        return (int(v), None) if -(2**31) <= int(v) < 2**31 else (None, OverflowError)
    try:
        return f32(float(v)), None
    except OverflowError:  # an int beyond float range
        return (math.inf if v > 0 else -math.inf), None


def tree_size(t):
    return t if isinstance(t, int) else math.prod(tree_size(c) for c in t)


def tree_leaves(t):
    if isinstance(t, int):
        return [t]
    return [x for c in t for x in tree_leaves(c)]


def decode_model(t, i):
    """Colexicographic decode of ordinal i over the tree t (first mode fastest at every level)."""
    if isinstance(t, int):
        return i
    out = []
    for c in t:
        n = tree_size(c)
        out.append(decode_model(c, i % n))
        i //= n
    return tuple(out)


def index_model(shape_t, stride_t, coord):
    if isinstance(shape_t, int):
        return coord * stride_t
    return sum(index_model(s, d, c) for s, d, c in zip(shape_t, stride_t, coord))


def as_tree(x):
    """Python tree of a nested list/tuple of ints (np ints become ints)."""
    if isinstance(x, (list, tuple)):
        return tuple(as_tree(c) for c in x)
    return int(x)


def colex(extents):
    """All coordinates of `extents`, first axis fastest."""
    return [tuple(reversed(c)) for c in itertools.product(*[range(e) for e in reversed(extents)])]


def dense_offset(coord, extents):
    off, run = 0, 1
    for c, e in zip(coord, extents):
        off += c * run
        run *= e
    return off


# ---------------------------------------------------------------- strategies

GARBAGE = st.sampled_from([None, "3", b"3", 2.0, float("nan"), 1.5, True, False, object(), [], {}, -1, 2**70, -(2**70)])
SMALL_BAD_INT = st.sampled_from([0, -1, -5, 2**62 + 1, 2**63, 2**70, -(2**70)])


def shape_leaf():
    return st.one_of(
        st.integers(1, 4),
        st.integers(1, 4),
        st.integers(1, 4).map(np.int64),
        SMALL_BAD_INT,
        st.sampled_from([True, 2.0, "2", None, b"2", float("inf")]),
    )


shape_trees = st.recursive(shape_leaf(), lambda ch: st.lists(ch, max_size=3), max_leaves=8)


def shape_fault(t, depth=0):
    """The exception types a Shape mode tree must raise (empty set when valid)."""
    if isinstance(t, (bool, np.bool_)) or isinstance(t, (float, str, bytes, type(None))):
        return {TypeError}
    if isinstance(t, (int, np.integer)):
        return {ValueError} if not (1 <= int(t) <= 2**62) else set()
    faults = set()
    for c in t:
        faults |= shape_fault(c, depth + 1)
    return faults


@st.composite
def valid_shape_trees(draw, max_size=48):
    """A valid nested mode list (top-level list) with a small total size."""
    while True:
        t = draw(st.recursive(st.integers(1, 4), lambda ch: st.lists(ch, min_size=1, max_size=3), max_leaves=6))
        if isinstance(t, int):
            t = [t]
        if tree_size(as_tree(t)) <= max_size:
            return t


def congruent_stride(draw, t, hostile):
    if isinstance(t, int):
        if hostile and draw(st.integers(0, 9)) == 9:
            return draw(st.sampled_from([-1, 2**62 + 1, 2**63, True, 1.5, None, "1"]))
        return draw(st.integers(0, 6))
    out = [congruent_stride(draw, c, hostile) for c in t]
    if hostile and draw(st.integers(0, 11)) == 11:
        choice = draw(st.integers(0, 2))
        if choice == 0:
            out.append(1)  # one mode too many
        elif choice == 1 and out:
            out.pop()
        else:
            return 1 if out else [1]  # a leaf where the shape has a tuple (or vice versa)
    return out


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
                # extent-1 leaves read coordinate 0 with the original stride (stride 0 after broadcast)
                def clamp(s_t, c):
                    return 0 if isinstance(s_t, int) and s_t == 1 else (c if isinstance(s_t, int) else tuple(clamp(x, y) for x, y in zip(s_t, c)))
                assert r(j) == index_model(tree, st_tree, clamp(tree, src))

        expect("Layout.broadcast_to", lambda: layout.broadcast_to(target), bfault(tree, t_tree), bcheck)


# ================================================================ carriers, tensors


def make_carrier(kind, n, dtype):
    if kind == "cpu":
        return sw.CPU(n, dtype=dtype)
    if kind == "generic":
        return sw.Generic([{F32: 0.0, I32: 0, BOOL: False}[dtype]] * n, dtype=dtype)
    if kind == "file":
        return sw.FileBacked(dtype=dtype).allocate_like(n) if n else sw.FileBacked(dtype=dtype)
    raise AssertionError(kind)


CARRIER_KINDS = ["cpu", "generic", "file"]
ZERO = {F32: 0.0, I32: 0, BOOL: False}

slot_values = st.one_of(
    st.floats(-100, 100), st.integers(-100, 100), st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(-(2**33), 2**33),
    st.sampled_from([2**31 - 1, -(2**31), 2**31, 2**70, -(2**1100), 10**400, True, False]),
    st.sampled_from([np.float32(1.5), np.int64(7), np.bool_(True), np.float64(-2.25), np.int32(-3)]),
    st.sampled_from([None, "1", b"1", [1.0], 1j, object()]),
)
slot_indices = st.one_of(st.integers(0, 7), st.integers(0, 7), st.integers(-3, 12),
                         st.sampled_from([2**63, 2**70, -(2**70), np.int64(1)]), GARBAGE)


GOOD_VALUES = {F32: st.one_of(st.floats(width=32), st.integers(-(2**40), 2**40)),
               I32: st.integers(-(2**31), 2**31 - 1), BOOL: st.booleans()}


def index_fault(i, n):
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
        return TypeError
    return None if 0 <= int(i) < n else IndexError


@fuzz(120)
@given(data=st.data(), kind=st.sampled_from(CARRIER_KINDS), dtype=st.sampled_from([F32, I32, BOOL]),
       n=st.integers(1, 8))
def test_fuzz_carrier_slot_reads_and_writes(data, kind, dtype, n):
    if kind == "file" and dtype is BOOL:
        expect("carrier constructor", lambda: make_carrier(kind, n, dtype), {TypeError})
        return
    c = make_carrier(kind, n, dtype)
    model = [ZERO[dtype]] * n
    version = c.version
    immutable = data.draw(st.integers(0, 4), label="read-only copy") == 4
    if immutable:
        c = c.new_like(model, mutable=False)
        version = c.version
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        i = data.draw(st.one_of(st.integers(0, n - 1), slot_indices), label="index")
        if data.draw(st.booleans(), label="write"):
            v = data.draw(st.one_of(GOOD_VALUES[dtype], slot_values), label="value")
            value, vfault = stored(dtype, v)
            faults = {f for f in (index_fault(i, n), vfault) if f}
            if immutable:
                faults.add(RuntimeError)
            err = expect("carrier[i] = v", lambda: c.__setitem__(i, v), faults)
            if err is None:
                model[int(i)] = value
                version += 1
        else:
            f = index_fault(i, n)
            expect("carrier[i]", lambda: c[i], {f} if f else set(),
                   lambda r, i=i: _assert_same(r, model[int(i)]))
        assert c.version == version
        assert all(same(c[k], model[k]) for k in range(n))
        assert type(c[0]) is {F32: float, I32: int, BOOL: bool}[dtype]
    c.release()
    expect("carrier[i]", lambda: c[0], {RuntimeError})
    expect("carrier[i] = v", lambda: c.__setitem__(0, ZERO[dtype]), {RuntimeError})


def random_layout(draw, max_size=24):
    modes = draw(valid_shape_trees(max_size=max_size))
    strides = congruent_stride(draw, list(modes), False)
    return Layout(Shape(modes), Stride(strides)), as_tree(modes), as_tree(strides)


@fuzz(150)
@given(data=st.data())
def test_fuzz_tensor_constructor(data):
    kind = data.draw(st.sampled_from(CARRIER_KINDS + ["released", "garbage"]), label="carrier")
    n = data.draw(st.integers(1, 60), label="size")
    if kind == "garbage":
        carrier = data.draw(GARBAGE, label="garbage carrier")
    else:
        carrier = make_carrier("cpu" if kind == "released" else kind, n, F32)
        for k in range(n):
            carrier[k] = float(k)
        if kind == "released":
            carrier.release()
    offset = data.draw(st.one_of(st.integers(0, 6), st.integers(0, 6), st.integers(-3, 50), GARBAGE,
                                 st.sampled_from([2**62, 2**63 - 1, 2**63, -(2**63), np.int64(2)])), label="offset")
    if data.draw(st.integers(0, 8), label="garbage layout") == 8:
        layout, tree, strides = data.draw(st.sampled_from([None, (2, 3), Shape(2), "L"])), None, None
    elif data.draw(st.booleans(), label="dense"):
        m = data.draw(st.integers(1, n), label="dense size")
        layout, tree, strides = sw.column_major(m), (m,), (1,)
    else:
        layout, tree, strides = random_layout(data.draw)
    faults = set()
    if not isinstance(carrier, sw.Carrier):
        faults.add(TypeError)
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, (int, np.integer)):
        faults.add(TypeError)
    if not isinstance(layout, Layout):
        faults.add(TypeError)
    if not faults:
        if int(offset) < 0 or int(offset) + layout.cosize > carrier.size():
            faults.add(ValueError)
        if kind == "released":
            faults.add(RuntimeError)  # a released carrier has size 0 (ValueError) or refuses (RuntimeError)
            faults.add(ValueError)
    before = [carrier[k] for k in range(n)] if isinstance(carrier, sw.Carrier) and kind != "released" else None

    def check(t):
        assert t.carrier is carrier and t.offset == int(offset) and t.layout == layout and t.size() == layout.size
        for i in range(layout.size):
            slot = int(offset) + index_model(tree, strides, decode_model(tree, i))
            assert t[i] == carrier[slot] == float(slot)
        # One write through the view lands on the modelled slot and bumps the version once.
        v = carrier.version
        slot = int(offset) + index_model(tree, strides, decode_model(tree, layout.size - 1))
        t[layout.size - 1] = -1.0
        assert carrier[slot] == -1.0 and carrier.version == v + 1
        carrier[slot] = float(slot)

    if kind == "released" and not faults - {RuntimeError, ValueError}:
        # Released: the call may only fail; it must not produce a usable view.
        t, err = attempt("Tensor", lambda: Tensor(carrier, offset, layout))
        if err is None:
            expect("Tensor[i]", lambda: t[0], {RuntimeError})
        return
    expect("Tensor", lambda: Tensor(carrier, offset, layout), faults, check)
    if before is not None:
        assert [carrier[k] for k in range(n)] == before


# ---------------------------------------------------------------- friendly.tensor

scalar_like = st.one_of(st.floats(width=32, allow_nan=False), st.integers(-1000, 1000), st.booleans(),
                        st.sampled_from([2**31, 2**70, None, "x", 1j, float("nan"), float("inf")]))


@st.composite
def nested_data(draw):
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(scalar_like)
    if kind == 1:  # ragged
        return [draw(st.lists(scalar_like, max_size=3)) for _ in range(draw(st.integers(1, 3)))]
    shape = tuple(draw(st.lists(st.integers(0 if kind == 2 else 1, 3), min_size=1, max_size=3)))
    elem = draw(st.sampled_from(["float", "int", "bool", "mixed"]))
    size = math.prod(shape)
    if elem == "float":
        flat = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=size, max_size=size))
    elif elem == "int":
        flat = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=size, max_size=size))
    elif elem == "bool":
        flat = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    else:
        flat = draw(st.lists(scalar_like, min_size=size, max_size=size))
    arr = np.array(flat, dtype=object).reshape(shape) if size else np.zeros(shape)
    if kind == 4 and elem != "mixed":
        return np.asarray(arr.tolist())  # a NumPy array of the natural dtype
    return arr.tolist()


@fuzz(200)
@given(data=nested_data(), dtype=st.sampled_from([F32, I32, BOOL, F64, "Float32", None]),
       carrier=st.sampled_from([sw.CPU, sw.Generic, sw.FileBacked, "CPU", None, sw.Evictable]))
def test_fuzz_friendly_tensor(data, dtype, carrier):
    kwargs = {"dtype": dtype, "carrier": carrier}

    def check(t):
        arr = np.asarray(data)
        assert t.layout.shape.extents == arr.shape or (arr.shape == () and t.layout.shape.extents == ())
        assert t.dtype() is dtype and isinstance(t.carrier, carrier)
        for idx in itertools.product(*[range(e) for e in arr.shape]):
            want, fault = stored(dtype, arr[idx].item() if hasattr(arr[idx], "item") else arr[idx])
            assert fault is None, (arr[idx], fault)
            got = t[idx] if idx else t[0]
            assert same(got, want), (idx, got, want)

    _, err = attempt("friendly.tensor", lambda: sw.friendly.tensor(data, **kwargs))
    # A success is checked against the model; a failure only has to be documented (attempt checked it).
    if err is None and isinstance(dtype, DType) and dtype is not F64 and carrier in (sw.CPU, sw.Generic, sw.FileBacked):
        check(sw.friendly.tensor(data, **kwargs))
    # Inputs the model knows to be valid must succeed.
    arr = np.asarray(data) if not isinstance(data, list) or _rectangular(data) else None
    if (arr is not None and arr.dtype.kind == "f" and arr.size and dtype is F32 and carrier in (sw.CPU, sw.Generic, sw.FileBacked)):
        assert err is None, err


def _rectangular(data):
    try:
        a = np.asarray(data)
    except ValueError:
        return False
    return a.dtype.kind != "O"


# ================================================================ move_async


def tensor_on(kind, values, dtype, layout=None, offset=0):
    n = len(values)
    c = make_carrier(kind, n, dtype)
    for i, v in enumerate(values):
        c[i] = v
    if layout is None:
        layout = sw.column_major(n - offset)
    return Tensor(c, offset, layout)


def logical(t):
    return [t[i] for i in range(t.size())]


def facts(c):
    d = {"released": c.is_released()}
    if not d["released"]:
        d.update(version=c.version, size=c.size(), owned=c.is_owned())
        if c.size() <= 256 and not isinstance(c, TiledEvictable):
            d["values"] = [c[i] for i in range(c.size())]
    return d


@fuzz(150)
@given(data=st.data())
def test_fuzz_move_async(data):
    dtype = data.draw(st.sampled_from([F32, I32]), label="dtype")
    src_kind = data.draw(st.sampled_from(CARRIER_KINDS), label="source")
    n = data.draw(st.integers(1, 12), label="n")
    values = [float(i) + 0.5 if dtype is F32 else i * 3 for i in range(n)]
    offset = data.draw(st.integers(0, n - 1), label="offset")
    layout = sw.column_major(n - offset)
    if data.draw(st.booleans(), label="strided"):
        layout, _, _ = random_layout(data.draw, max_size=12)
        if layout.cosize + offset > n:
            offset = 0
            if layout.cosize > n:
                layout = sw.column_major(n)
    src = tensor_on(src_kind, values, dtype, layout, offset)
    src_state = data.draw(st.sampled_from(["live", "live", "released", "owned", "not a tensor"]), label="source state")
    keep = []
    if src_state == "released":
        src.carrier.release()
    elif src_state == "owned":  # claimed by a live TiledEvictable (as its secondary tier)
        keep.append(TiledEvictable(sw.CPU(0, dtype=dtype), src.carrier, (n,), (1,)))
    dest_kind = data.draw(st.sampled_from(["cpu0", "cpu_exact", "cpu_big", "cpu_small", "generic0", "file0", "file_exact",
                                            "same", "released", "immutable", "other dtype", "owned", "garbage"]),
                          label="destination")
    need = layout.cosize
    if dest_kind == "same":
        dest = src.carrier
    elif dest_kind == "garbage":
        dest = data.draw(GARBAGE)
    elif dest_kind == "other dtype":
        dest = sw.CPU(0, dtype=I32 if dtype is F32 else F32)
    else:
        size = {"cpu0": 0, "cpu_exact": need, "cpu_big": need + 3, "cpu_small": max(1, need - 1), "generic0": 0,
                "file0": 0, "file_exact": need, "released": 0, "immutable": 0, "owned": 0}[dest_kind]
        dk = {"generic0": "generic", "file0": "file", "file_exact": "file"}.get(dest_kind, "cpu")
        dest = make_carrier(dk, size, dtype)
        if dest_kind == "released":
            dest.release()
        elif dest_kind == "immutable":
            dest = sw.CPU(need, dtype=dtype, mutable=False)
        elif dest_kind == "owned":
            keep.append(TiledEvictable(dest, sw.CPU(0, dtype=dtype), (1,), (1,)))
        elif dest_kind == "cpu_small" and need == 1:
            dest_kind = "cpu_exact"
    subject = src if src_state != "not a tensor" else data.draw(GARBAGE)
    faults = set()
    if src_state == "not a tensor":
        faults.add(TypeError)
    if src_state in ("released", "owned"):
        faults.add(RuntimeError)
    faults |= {"same": {ValueError}, "garbage": {TypeError}, "released": {RuntimeError}, "immutable": {RuntimeError},
               "other dtype": {TypeError}, "owned": {RuntimeError}, "cpu_small": {ValueError}}.get(dest_kind, set())
    before_src = facts(src.carrier)
    before_dst = facts(dest) if isinstance(dest, sw.Carrier) else None
    want = logical(src) if src_state == "live" else None

    handle, err = attempt("move_async", lambda: sw.move_async(subject, dest))
    if err is None:
        result, err = attempt("AwaitMove.wait", lambda: finish(handle))
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (faults, err)
        assert facts(src.carrier) == before_src
        if before_dst is not None:
            assert facts(dest) == before_dst
        return
    assert err is None, err
    assert result.carrier is dest and result.layout == src.layout and result.offset == 0
    assert logical(result) == want
    assert src.carrier.is_released()  # a move consumes its source
    assert handle.wait() is result  # the same object every time


# ================================================================ the six operations


@st.composite
def op_operand(draw, extents, dtype_choices=(F32, F32, I32, BOOL)):
    """(operand, numpy model or None) of a random operand kind with logical shape `extents`."""
    kind = draw(st.sampled_from(["cpu", "cpu", "cpu", "cpu", "cpu", "strided", "strided", "generic", "file", "tiled",
                                 "tiled", "number", "garbage", "handle", "released"]))
    dtype = draw(st.sampled_from(dtype_choices))
    if kind == "file" and dtype is BOOL:
        dtype = F32  # FileBacked stores Float32 and Int32 only
    size = math.prod(extents)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if dtype is F32:
        vals = rng.integers(-8, 8, size=extents).astype(np.float32) / 2
    elif dtype is I32:
        vals = rng.integers(-50, 50, size=extents).astype(np.int32)
    else:
        vals = rng.integers(0, 2, size=extents).astype(bool)
    if kind == "number":
        v = draw(st.sampled_from([2, -3, 0.5, 2**40, float("inf")]))
        return v, v
    if kind == "garbage":
        return draw(st.sampled_from([None, "t", [1.0, 2.0], True, np.ones(extents, np.float32)])), None
    carrier_cls = {"cpu": sw.CPU, "strided": sw.CPU, "released": sw.CPU, "generic": sw.Generic, "file": sw.FileBacked,
                   "handle": sw.CPU, "tiled": sw.CPU}[kind]
    t = sw.friendly.tensor(vals, dtype=dtype, carrier=carrier_cls) if kind != "tiled" or dtype is not BOOL else None
    if kind == "strided":
        # the same logical values through a padded, offset, reversed-order-of-storage layout
        pad = 3
        c = sw.CPU(pad + 2 * size, dtype=dtype)
        strides, run = [], 2
        for e in extents:
            strides.append(run)
            run *= e
        lay = Layout(Shape(*extents), Stride(*strides))
        t = Tensor(c, pad, lay)
        for coord in colex(extents):
            t[coord] = vals[coord].item()
    elif kind == "released":
        t.carrier.release()
        return t, "released"
    elif kind == "handle":
        h = sw.move_async(t, sw.CPU(0, dtype=dtype))
        finish(h)
        return h, None
    elif kind == "tiled":
        if dtype is BOOL:
            dtype = F32
            vals = vals.astype(np.float32)
        flat = sw.friendly.tensor(vals.reshape(-1, order="F").copy(), dtype=dtype)
        secondary = sw.move(flat, sw.FileBacked(dtype=dtype)).carrier
        grid = tuple(draw(st.sampled_from([d for d in (1, e) if e % d == 0])) for e in extents)
        tile = tuple(e // g for e, g in zip(extents, grid))
        c = TiledEvictable(sw.CPU(0, dtype=dtype), secondary, grid, tile)
        t = Tensor(c, 0, sw.column_major(*extents))
    return t, vals


def result_dtype(op, a, b, f64=False):
    """Model of the result dtype of an operation over tensor operand dtypes / weak scalars."""
    dts = []
    for x in (a, b):
        if isinstance(x, Tensor):
            dts.append(x.dtype())
        elif isinstance(x, (int, float)):
            dts.append("int" if isinstance(x, int) else "float")
    tensors = [d for d in dts if isinstance(d, DType)]
    if op in ("relu", "reduce_sum") and not f64:
        return tensors[0]
    if f64:
        return F32
    if all(d is I32 or d == "int" for d in dts):
        return I32
    return F32


def np_of(t):
    out = np.empty(t.layout.shape.extents, dtype={F32: np.float64, I32: np.int64, BOOL: bool}[t.dtype()])
    for coord in colex(t.layout.shape.extents):
        out[coord] = t[coord] if coord else t[0]
    return out


@pytest.mark.parametrize("op", ["add", "mul", "elementwise_mul", "relu", "reduce_sum", "matmul"])
@fuzz(50)
@given(data=st.data())
def test_fuzz_operations(op, data):
    rank = 2 if op == "matmul" else data.draw(st.integers(1, 3), label="rank")
    ext_a = tuple(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank), label="a extents"))
    if op == "matmul":
        ext_b = (data.draw(st.integers(1, 3), label="n"), data.draw(st.sampled_from([ext_a[1], ext_a[1], 1, 3]), label="k"))
    else:
        ext_b = tuple(data.draw(st.sampled_from([e, e, 1, 2]), label="b extent") for e in ext_a)
        if data.draw(st.integers(0, 9), label="rank mismatch") == 9:
            ext_b = ext_b + (1,)
    a, va = data.draw(op_operand(ext_a), label="a")
    b, vb = data.draw(op_operand(ext_b), label="b")
    desc = None
    if op == "reduce_sum":
        if data.draw(st.integers(0, 3), label="hostile description") != 3:
            names = data.draw(st.permutations(["a", "b", "c", "x1", "y_"]), label="names")[: len(ext_a)]
            kept = data.draw(st.permutations(names), label="kept")[: data.draw(st.integers(0, len(names)), label="k")]
            spacing = data.draw(st.sampled_from([" -> ", "->", "  ->   "]), label="spacing")
            desc = data.draw(st.sampled_from([" ".join(names) + spacing + " ".join(kept), None]), label="description")
        else:
            names = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d", "x1"]), max_size=4), label="names")
            kept = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d", "x1", "z"]), max_size=3), label="kept")
            desc = data.draw(st.sampled_from([" ".join(names) + " -> " + " ".join(kept), "", "->",
                                              " ".join(names) + " " + " ".join(kept), 3, b"a -> a",
                                              " ".join(names) + "->" + " ".join(kept) + " -> a"]), label="description")
    acc = data.draw(st.sampled_from([None, None, F64, F32, "Float64"]), label="accumulator")
    call = {
        "add": lambda: sw.add(a, b),
        "mul": lambda: sw.mul(a, b),
        "elementwise_mul": lambda: sw.elementwise_mul(a, b),
        "relu": lambda: sw.relu(a),
        "reduce_sum": lambda: sw.reduce_sum(a, desc, accumulator_dtype=acc),
        "matmul": lambda: sw.matmul(a, b, accumulator_dtype=acc),
    }[op]
    operands = [a] if op in ("relu", "reduce_sum") else [a, b]
    models = [va] if op in ("relu", "reduce_sum") else [va, vb]

    # ---- the model's verdict
    faults = set()
    scalars_ok = op == "mul"
    for x, m in zip(operands, models):
        if isinstance(x, Tensor):
            if isinstance(m, str):  # released
                faults.add(RuntimeError)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            if not scalars_ok:
                faults.add(TypeError)
        else:
            faults.add(TypeError)
    tensors = [x for x in operands if isinstance(x, Tensor)]
    if not tensors and not faults:
        faults.add(TypeError)  # mul(number, number)
    if len({type(t.carrier) for t in tensors}) > 1:
        faults.add(TypeError)
    for t in tensors:
        if not t.carrier.is_released() and type(t.carrier) is sw.FileBacked:
            faults.add(NotImplementedError)
        if isinstance(t.carrier, TiledEvictable) and len(tensors) == 2 and tensors[0].carrier is not tensors[1].carrier:
            pass  # two tiled carriers of one class are allowed
    if op in ("reduce_sum", "matmul") and acc is not None and acc is not F64:
        faults.add(TypeError if not isinstance(acc, DType) else ValueError)
    live = not faults
    shape_a = ext_a
    if op in ("add", "mul", "elementwise_mul") and len(tensors) == 2:
        if len(ext_a) != len(ext_b) or any(x != y and 1 not in (x, y) for x, y in zip(ext_a, ext_b)):
            faults.add(ValueError)
    if op == "matmul" and len(tensors) == 2 and ext_a[1] != ext_b[1]:
        faults.add(ValueError)
    kept_axes = None
    if op == "reduce_sum":
        if desc is None:
            kept_axes = [0]
        elif not isinstance(desc, str):
            faults.add(TypeError)
        else:
            parts = desc.split("->")
            if len(parts) != 2:
                faults.add(ValueError)
            else:
                left, right = parts[0].split(), parts[1].split()
                if (len(left) != len(shape_a) or len(set(left)) != len(left) or len(set(right)) != len(right)
                        or any(r not in left for r in right)):
                    faults.add(ValueError)
                else:
                    kept_axes = [left.index(r) for r in right]
    if op in ("add", "mul") and live and not faults:
        rd = result_dtype(op, a, b)
        if rd is I32:
            # weak ints beyond Int32 and Int32 overflow raise OverflowError
            if any(isinstance(x, int) and not -(2**31) <= x < 2**31 for x in (a, b)):
                faults.add(OverflowError)
    before = [facts(t.carrier) for t in tensors if isinstance(t, Tensor)]

    def check(r):
        assert isinstance(r, Tensor) and isinstance(r.carrier, type(tensors[0].carrier) if not isinstance(
            tensors[0].carrier, TiledEvictable) else sw.CPU)
        rd = result_dtype(op, a, b, acc is F64 and op in ("reduce_sum", "matmul"))
        assert r.dtype() is rd, (r.dtype(), rd)
        x = [np.asarray(m, dtype=np.float64) if not isinstance(m, (int, float)) else m for m in models]
        if op == "add":
            want = x[0] + x[1]
        elif op in ("mul", "elementwise_mul"):
            want = x[0] * x[1]
        elif op == "relu":
            want = np.maximum(x[0], 0)
        elif op == "reduce_sum":
            drop = tuple(i for i in range(len(shape_a)) if i not in kept_axes)
            summed = x[0].sum(axis=drop)  # the kept axes, in their original order
            order = sorted(kept_axes)
            want = np.transpose(summed, [order.index(k) for k in kept_axes]) if kept_axes else summed
        else:
            want = x[0] @ x[1].T
        got = np_of(r).astype(np.float64)
        if rd is BOOL:
            want = want.astype(bool).astype(np.float64)
        elif rd is F32:
            with np.errstate(all="ignore"):
                want = want.astype(np.float32).astype(np.float64)
        assert got.shape == np.shape(want), (got.shape, np.shape(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert r.offset == 0 and r.layout == sw.column_major(*r.layout.shape.extents)

    expect(f"op.{op}", call, faults, check)
    # Operations never change their operands.
    assert [facts(t.carrier) for t in tensors if isinstance(t, Tensor)] == before


# ================================================================ TileSelection, TileSet, ResidencyPlan

coordinate_entry = st.one_of(st.integers(0, 5), st.integers(0, 5), st.integers(-2, 5),
                             st.sampled_from([True, 1.0, "1", None, 2**70, np.int64(2), [1]]))


def iterable_of(elements, max_size=4):
    """Lists, tuples, generators, sets, ranges and strings of `elements`."""
    return st.one_of(
        st.lists(elements, max_size=max_size),
        st.lists(elements, max_size=max_size).map(tuple),
        st.lists(elements, max_size=max_size).map(lambda x: (v for v in x)),
        st.sampled_from(["01", b"\x00\x01", 3, None, 1.5, range(0, 3), range(2, 0, -1)]),
    )


def int_like(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@fuzz(300)
@given(per_axis=st.one_of(
    st.lists(st.lists(st.integers(0, 6), unique=True, min_size=1, max_size=4), min_size=1, max_size=3),
    iterable_of(iterable_of(coordinate_entry))))
def test_fuzz_tile_selection(per_axis):
    # materialise generators once so the model and the call see the same values
    if hasattr(per_axis, "__next__"):
        per_axis = [list(a) if hasattr(a, "__next__") else a for a in per_axis]
        per_axis = iter(per_axis)
        materialised = list(per_axis)
        per_axis = iter(materialised)
    else:
        if isinstance(per_axis, (list, tuple)):
            per_axis = type(per_axis)(list(a) if hasattr(a, "__next__") else a for a in per_axis)
        materialised = per_axis
    faults = set()
    axes = None
    if isinstance(materialised, (str, bytes)) or not hasattr(materialised, "__iter__"):
        faults.add(TypeError)
    else:
        axes = []
        for axis in materialised:
            if isinstance(axis, (str, bytes)) or not hasattr(axis, "__iter__"):
                faults.add(TypeError)
                continue
            axis = list(axis)
            if any(not int_like(v) for v in axis):
                faults.add(TypeError)
            axes.append(axis)
        if TypeError not in faults:
            if not axes or any(not a for a in axes):
                faults.add(ValueError)
            for a in axes:
                if len(set(int(v) for v in a)) != len(a) or any(int(v) < 0 for v in a):
                    faults.add(ValueError)

    def check(sel):
        want = tuple(tuple(int(v) for v in a) for a in axes)
        assert sel.per_axis == want and sel.rank == len(want)
        assert sel.compact_grid_shape == tuple(len(a) for a in want)
        coords = [tuple(want[i][c[i]] for i in range(len(want))) for c in colex(sel.compact_grid_shape)]
        assert sel.coordinates == tuple(coords)
        assert sel.tile_set == TileSet(coords) and len(sel.tile_set) == len(coords)
        assert sel == TileSelection(want) and hash(sel) == hash(TileSelection(want))
        with pytest.raises(dataclasses.FrozenInstanceError):
            sel.per_axis = ()

    expect("TileSelection", lambda: TileSelection(per_axis), faults, check)


@fuzz(300)
@given(coordinates=st.one_of(
    st.integers(1, 3).flatmap(lambda r: st.lists(st.tuples(*[st.integers(0, 4)] * r), unique=True, max_size=6)),
    iterable_of(iterable_of(coordinate_entry, max_size=3), max_size=5)))
def test_fuzz_tile_set(coordinates):
    if isinstance(coordinates, (list, tuple)):
        coordinates = type(coordinates)(list(a) if hasattr(a, "__next__") else a for a in coordinates)
    elif hasattr(coordinates, "__next__"):
        coordinates = iter([list(a) if hasattr(a, "__next__") else a for a in coordinates])
        coordinates = list(coordinates)
    faults = set()
    coords = []
    if isinstance(coordinates, (str, bytes)) or not hasattr(coordinates, "__iter__"):
        faults.add(TypeError)
    else:
        for entry in coordinates:
            if isinstance(entry, (str, bytes)) or not hasattr(entry, "__iter__"):
                faults.add(TypeError)
                continue
            entry = list(entry)
            if any(not int_like(v) for v in entry):
                faults.add(TypeError)
                continue
            coords.append(tuple(int(v) for v in entry))
        if TypeError not in faults:
            if len({len(c) for c in coords}) > 1 or any(v < 0 for c in coords for v in c) or len(set(coords)) != len(coords):
                faults.add(ValueError)

    def check(ts):
        want = tuple(sorted(coords, key=lambda c: tuple(reversed(c))))
        assert ts.coordinates == want and len(ts) == len(want) and list(ts) == list(want)
        assert all(c in ts for c in want)
        assert ts == TileSet(want) and hash(ts) == hash(TileSet(list(reversed(want))))

    expect("TileSet", lambda: TileSet(coordinates), faults, check)


tile_sets_or_garbage = st.one_of(
    st.none(),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), unique=True, max_size=4).map(TileSet),
    st.sampled_from([[(0, 0)], (), "TileSet", 3, TileSelection([[0], [1]])]),
)


@fuzz(300)
@given(promote=tile_sets_or_garbage, retain=tile_sets_or_garbage, evict=tile_sets_or_garbage,
       positional=st.booleans())
def test_fuzz_residency_plan(promote, retain, evict, positional):
    faults = set()
    fields = {"promote": promote, "retain": retain, "evict": evict}
    for v in fields.values():
        if v is not None and not isinstance(v, TileSet):
            faults.add(TypeError)
    seen = [c for v in fields.values() if isinstance(v, TileSet) for c in v.coordinates]
    if len(seen) != len(set(seen)):
        faults.add(ValueError)  # fields are checked in order: an early overlap may be reported first

    def check(plan):
        for name, v in fields.items():
            assert getattr(plan, name) == (v if v is not None else TileSet())
        assert plan == ResidencyPlan(**fields) and hash(plan) == hash(ResidencyPlan(**fields))

    expect("ResidencyPlan",
           (lambda: ResidencyPlan(promote, retain, evict)) if positional else (lambda: ResidencyPlan(**fields)),
           faults, check)


# ================================================================ TiledEvictable construction


SANE_TIERS = ["cpu0", "cpu_full", "file0", "file_full", "generic0", "generic_full"]
HOSTILE_TIERS = ["cpu_partial", "released", "owned", "evictable", "tiled", "garbage", "immutable_full", "other_dtype"]


def tier(draw, label, n, dtype, hostile):
    kind = draw(st.sampled_from(SANE_TIERS + HOSTILE_TIERS if hostile else SANE_TIERS), label=label)
    keep = []
    if dtype is I32:
        vals = [i * 3 + (1 if label == "primary" else 100) for i in range(n)]
    else:
        vals = [float(i) * 1.5 + (0.25 if label == "primary" else 100.0) for i in range(n)]
    if kind in ("cpu0", "file0", "generic0"):
        c = make_carrier(kind[:-1] if kind != "cpu0" else "cpu", 0, dtype) if kind != "generic0" else sw.Generic([], dtype=dtype)
        return kind, c, None, keep
    if kind.endswith("_full") or kind == "cpu_partial":
        size = n if kind != "cpu_partial" else draw(st.sampled_from([1, n + 1, max(1, n - 1)]))
        if kind == "cpu_partial" and size == n:
            size = n + 1
        k = {"cpu_full": "cpu", "file_full": "file", "generic_full": "generic", "cpu_partial": "cpu",
             "immutable_full": "cpu"}[kind]
        c = make_carrier(k, size, dtype)
        for i in range(size):
            c[i] = vals[i] if i < n else ZERO[dtype]
        if kind == "immutable_full":
            c = c.new_like([c[i] for i in range(size)], mutable=False)
        return kind, c, vals[:size], keep
    if kind == "released":
        c = sw.CPU(0, dtype=dtype)
        c.release()
        return kind, c, None, keep
    if kind == "owned":  # claimed by another live TiledEvictable
        c = sw.CPU(0, dtype=dtype)
        keep.append(TiledEvictable(c, sw.CPU(0, dtype=dtype), (1,), (1,)))
        return kind, c, None, keep
    if kind == "evictable":
        return kind, sw.Evictable(sw.CPU(1, dtype=dtype), sw.FileBacked(dtype=dtype)), None, keep
    if kind == "tiled":
        return kind, TiledEvictable(sw.CPU(0, dtype=dtype), sw.CPU(0, dtype=dtype), (1,), (1,)), None, keep
    if kind == "other_dtype":
        return kind, sw.CPU(0, dtype=I32 if dtype is F32 else F32), None, keep
    return kind, draw(GARBAGE), None, keep


BAD_EXTENTS = [True, 1.5, None, "2", np.int64(2)]
# Tile extents may be huge (a tile of 2**32 slots with empty tiers allocates nothing when its footprint is
# few runs). Grid extents are either small or beyond the tile table limits (2**40 tiles: ValueError before
# anything is allocated; 2**62 and up: ValueError for the extent).
tile_entries = st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(-1, 0),
                         st.sampled_from([2**31, 2**32, 2**62, 2**63] + BAD_EXTENTS))
grid_entries = st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(-1, 0),
                         st.sampled_from([2**40, 2**62, 2**63] + BAD_EXTENTS))


class _GoodPolicy:
    def plan(self, required, purpose):
        return ResidencyPlan()


MAX_TILES, MAX_RUNS = 2**24, 2**26  # TiledEvictable tile table limits (Note [Tile table limits])


def tile_table_too_big(grid, tile):
    """Whether a valid geometry exceeds the tile table limits: more than 2**24 tiles, or more than 2**26
    footprint runs in all (each tile has tile_size / run_length runs; the run is the footprint's first
    coalesced leaf when its stride is 1: the leading tile axes whose grid axes before them are all 1)."""
    if math.prod(grid) > MAX_TILES:
        return True
    logical = [g * t for g, t in zip(grid, tile)]
    stride, ext, strides = 1, [], []
    for t, extent in zip(tile, logical):
        if t != 1:
            if ext and stride == ext[-1] * strides[-1]:
                ext[-1] *= t
            else:
                ext.append(t)
                strides.append(stride)
        stride *= extent
    run = ext[0] if ext and strides[0] == 1 else 1
    return math.prod(logical) // run > MAX_RUNS


class _NotAPolicy:
    plan = 3


@fuzz(250)
@given(data=st.data())
def test_fuzz_tiled_evictable_construction(data):
    # One part of the call is hostile (or none, or all): the others are sane, so that every rule is reached.
    hostile = data.draw(st.sampled_from(["none", "none", "grid", "tile", "rank", "shapes", "primary", "secondary",
                                         "same", "policy", "everything"]), label="hostile part")
    bad = lambda part: hostile in (part, "everything")  # noqa: E731
    rank = data.draw(st.integers(0, 3) if bad("rank") else st.integers(1, 3), label="rank")
    grid = data.draw(st.lists(grid_entries if bad("grid") else st.integers(1, 3), min_size=rank, max_size=rank),
                     label="grid")
    tile = data.draw(st.lists(tile_entries if bad("tile") else st.integers(1, 3), min_size=rank, max_size=rank),
                     label="tile")
    if bad("rank") and data.draw(st.booleans(), label="rank mismatch"):
        tile = tile + [1]
    if bad("shapes"):
        grid = data.draw(st.sampled_from([3, "12", None, 2.5, Shape(2), (2,)]), label="grid garbage")
    dtype = data.draw(st.sampled_from([F32, F32, I32]), label="dtype")
    shape_ok = isinstance(grid, (list, tuple, Shape)) and isinstance(tile, list)
    gl = list(grid.extents) if isinstance(grid, Shape) else grid
    ints = shape_ok and all(int_like(v) for v in list(gl) + list(tile))
    n = math.prod(int(v) for v in list(gl) + tile) if ints and all(1 <= int(v) <= 2**62 for v in list(gl) + tile) else 0
    nn = n if 0 < n <= 64 else 4
    pk, primary, pvals, keep1 = tier(data.draw, "primary", nn, dtype, bad("primary"))
    sk, secondary, svals, keep2 = tier(data.draw, "secondary", nn, dtype, bad("secondary"))
    if bad("same"):
        sk, secondary, svals = pk, primary, pvals
    policy = data.draw(st.sampled_from([None, _GoodPolicy(), _NotAPolicy(), "policy", 3] if bad("policy")
                                       else [None, _GoodPolicy()]), label="policy")

    faults = set()
    carriers = [primary, secondary]
    if not all(isinstance(c, sw.Carrier) for c in carriers):
        faults.add(TypeError)
    else:
        if any(k in ("evictable", "tiled") for k in (pk, sk)):
            faults.add(TypeError)
        if primary is secondary:
            faults.add(ValueError)
        if any(k in ("released", "owned") for k in (pk, sk)):
            faults.add(RuntimeError)
        if primary.dtype() is not secondary.dtype():
            faults.add(TypeError)
    if not shape_ok:
        faults.add(TypeError)
    else:
        if not ints:
            faults.add(TypeError)
            if any(int_like(v) and not -(2**63) <= int(v) < 2**63 for v in list(gl) + list(tile)):
                faults.add(ValueError)  # an entry beyond int64 before the non-int one is reported first
        else:
            vals = [int(v) for v in list(gl) + tile]
            if len(gl) == 0 or len(gl) != len(tile):
                faults.add(ValueError)
            elif any(v < 1 for v in vals) or any(v > 2**62 for v in vals) or math.prod(vals) > 2**62:
                faults.add(ValueError)
            elif tile_table_too_big([int(v) for v in gl], [int(v) for v in tile]):
                faults.add(ValueError)  # the tile table limits
    if policy is not None and not isinstance(policy, _GoodPolicy):
        faults.add(TypeError)
    if not faults:
        for k, c in ((pk, primary), (sk, secondary)):
            if c.size() not in (0, n):
                faults.add(ValueError)
    before = [facts(c) for c in carriers if isinstance(c, sw.Carrier)]
    te_, err = attempt("TiledEvictable", lambda: TiledEvictable(primary, secondary, grid, tile, residency_policy=policy))
    if faults or err is not None:
        if not faults and isinstance(err, ValueError) and "cannot grow" in str(err):
            return  # an empty tier that cannot hold evicted tiles: documented ValueError
        assert faults, f"valid construction raised {type(err).__name__}: {err}"
        assert isinstance(err, tuple(faults)), (faults, err)
        assert [facts(c) for c in carriers if isinstance(c, sw.Carrier)] == before  # nothing claimed
        return
    c = te_
    g = tuple(int(v) for v in gl)
    t = tuple(int(v) for v in tile)
    assert c.grid_shape == g and c.tile_shape == t and c.logical_shape == tuple(a * b for a, b in zip(g, t))
    assert c.size() == n and c.dtype() is dtype and c.residency_policy is policy
    assert primary.is_owned() and secondary.is_owned()
    if n <= 64:
        if primary.size() == n:
            where, vals = "primary", pvals
        elif secondary.size() == n:
            where, vals = "secondary", svals
        else:
            where, vals = "invalid", None
        for tc in colex(g):
            assert c.tile_state(tc).location == where
        if vals is not None:
            assert [c[s] for s in range(n)] == vals
        else:
            expect("TiledEvictable[i]", lambda: c[0], {RuntimeError})
    c.release()
    assert c.is_released() and primary.is_released() and secondary.is_released()


# ================================================================ TiledEvictable scenes


class Scene:
    """A TiledEvictable with known values and mixed residency, plus the model of its logical values."""

    def __init__(self, draw, policy=None, allow_invalid=True):
        self.rank = draw(st.integers(1, 3), label="rank")
        self.grid = tuple(draw(st.lists(st.integers(1, 3), min_size=self.rank, max_size=self.rank), label="grid"))
        self.tile = tuple(draw(st.lists(st.integers(1, 3), min_size=self.rank, max_size=self.rank), label="tile"))
        self.logical = tuple(g * t for g, t in zip(self.grid, self.tile))
        self.n = math.prod(self.logical)
        self.tiles = colex(self.grid)
        secondary_kind = draw(st.sampled_from(["file", "cpu"]), label="secondary")
        start = draw(st.sampled_from(["secondary", "secondary", "implicit", "partial"] if allow_invalid
                                     else ["secondary", "secondary", "implicit"]), label="start")
        vals = [float((7 * s) % 23) - 5.0 for s in range(self.n)]
        sec = (sw.FileBacked().allocate_like(self.n) if secondary_kind == "file" else sw.CPU(self.n))
        for s, v in enumerate(vals):
            sec[s] = v
        base = TiledEvictable(sw.CPU(0), sec, self.grid, self.tile, residency_policy=policy)
        self.vals = list(vals)
        if start == "implicit":
            self.carrier = base.allocate_like(self.n)
            self.vals = [0.0] * self.n
            base.release()
        elif start == "partial":
            # a scatter result: the selected tiles valid and dirty, the others invalid
            sel = TileSelection([sorted(draw(st.sets(st.integers(0, g - 1), min_size=1), label="axis")) for g in self.grid])
            compact_ext = tuple(len(a) * t for a, t in zip(sel.per_axis, self.tile))
            compact = sw.friendly.tensor(np.arange(math.prod(compact_ext), dtype=np.float32).reshape(compact_ext, order="F"))
            full = Tensor(base, 0, sw.column_major(*self.logical))
            with sw.no_grad():
                out = finish(base.scatter(compact, full, sel))
            self.carrier = out.carrier
            self.vals = [None] * self.n
            for coord in colex(compact_ext):
                src = tuple(sel.per_axis[i][coord[i] // self.tile[i]] * self.tile[i] + coord[i] % self.tile[i]
                            for i in range(self.rank))
                self.vals[dense_offset(src, self.logical)] = float(np.asarray(compact)[coord])
            base.release()
        else:
            self.carrier = base
        c = self.carrier
        # mixed residency: promote some tiles, dirty some by a slot write
        valid = [t for t in self.tiles if c.tile_state(t).valid]
        promote = draw(st.lists(st.sampled_from(valid), unique=True), label="promote") if valid else []
        c.promote(TileSet(promote))
        for t in draw(st.lists(st.sampled_from(valid), unique=True, max_size=3), label="dirty") if valid else []:
            slot = self.slots(t)[0]
            self.vals[slot] = float(self.vals[slot] + 1.0)
            c[slot] = self.vals[slot]
        self.full = Tensor(c, 0, sw.column_major(*self.logical))

    def slots(self, t):
        return [dense_offset(x, self.logical) for x in colex(self.logical)
                if tuple(xi // ti for xi, ti in zip(x, self.tile)) == tuple(t)]

    def valid(self, t):
        return self.vals[self.slots(t)[0]] is not None

    def snapshot(self):
        """Everything a refused request must leave unchanged, read without moving anything."""
        c = self.carrier
        d = facts(c)
        if c.is_released():
            return d
        states = {t: c.tile_state(t) for t in self.tiles}
        values = {}
        for t, s in states.items():
            for slot in self.slots(t):
                if s.location in ("primary", "implicit"):
                    values[slot] = c[slot]
                elif s.location == "secondary":
                    values[slot] = c.secondary[slot]
        d.update(states=states, values=values, stats=c.stats(), primary=facts(c.primary),
                 secondary={k: v for k, v in facts(c.secondary).items() if k != "values"})
        return d

    def region(self, per_axis):
        """The model of project(full, TileSelection(per_axis)): (compact extents, {compact coord: value})."""
        ext = tuple(len(a) * t for a, t in zip(per_axis, self.tile))
        out = {}
        for coord in colex(ext):
            src = tuple(per_axis[i][coord[i] // self.tile[i]] * self.tile[i] + coord[i] % self.tile[i]
                        for i in range(self.rank))
            out[coord] = self.vals[dense_offset(src, self.logical)]
        return ext, out

    def check_values(self):
        c = self.carrier
        for t in self.tiles:
            s = c.tile_state(t)
            assert s.valid == self.valid(t), (t, s)
            if s.valid:
                for slot in self.slots(t):
                    assert c[slot] == self.vals[slot], (slot, c[slot], self.vals[slot])


@st.composite
def selections(draw, scene):
    """A TileSelection (in range or not), or something else; with the faults the model expects."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "out of range", "rank", "tile set", "garbage", "huge"]))
    if kind in ("valid", "out of range", "huge"):
        axes = [draw(st.permutations(range(g)).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: list(p[:k]))))
                for g in scene.grid]
        if kind == "out of range":
            i = draw(st.integers(0, scene.rank - 1))
            axes[i] = axes[i] + [scene.grid[i] + draw(st.integers(0, 2))]
        if kind == "huge":
            axes[0] = axes[0] + [draw(st.sampled_from([2**62, 2**63, 2**70]))]
        return TileSelection(axes), (set() if kind == "valid" else {ValueError}), axes
    if kind == "rank":
        axes = [[0]] * draw(st.sampled_from([r for r in (1, 2, 3, 4) if r != scene.rank]))
        return TileSelection(axes), {ValueError}, None
    if kind == "tile set":
        return TileSet([tuple([0] * scene.rank)]), {TypeError}, None
    return draw(st.sampled_from([None, [[0]], "sel", 0, (0,)])), {TypeError}, None


def invalid_selected(scene, axes):
    return any(not scene.valid(tuple(axes[i][c[i]] for i in range(scene.rank)))
               for c in colex(tuple(len(a) for a in axes)))


def _other_full(scene):
    other = TiledEvictable(sw.CPU(0), sw.CPU(scene.n), scene.grid, scene.tile)
    return Tensor(other, 0, sw.column_major(*scene.logical))


@st.composite
def full_tensors(draw, scene):
    """The tensor argument of project/scatter: the full tensor or a hostile substitute, and its faults."""
    kind = draw(st.sampled_from(["full", "full", "full", "other carrier", "partial", "offset", "cpu", "handle", "none",
                                 "transposed"]))
    c = scene.carrier
    if kind == "full":
        return scene.full, set()
    if kind == "other carrier":
        return _other_full(scene), {TypeError}
    if kind == "partial":
        if scene.n == 1:
            return scene.full, set()
        return Tensor(c, 0, sw.column_major(scene.n - 1)), {ValueError}
    if kind == "offset":
        if scene.n == 1:
            return scene.full, set()
        return Tensor(c, 1, sw.column_major(scene.n - 1)), {ValueError}
    if kind == "transposed":
        if scene.rank < 2 or scene.logical[0] == scene.logical[1] or (scene.grid[0] == 1 and scene.grid[1] == 1):
            return scene.full, set()
        ext = (scene.logical[1], scene.logical[0]) + scene.logical[2:]
        return Tensor(c, 0, sw.column_major(*ext)), {ValueError}
    if kind == "cpu":
        return sw.friendly.zeros(*scene.logical), {TypeError}
    if kind == "handle":
        h = sw.move_async(sw.friendly.zeros(2), sw.CPU(0))
        finish(h)
        return h, {TypeError}
    return None, {TypeError}


@fuzz(150)
@given(data=st.data())
def test_fuzz_tiled_project(data):
    scene = Scene(data.draw)
    sel, faults, axes = data.draw(selections(scene), label="selection")
    tensor, tfaults = data.draw(full_tensors(scene), label="tensor")
    faults = faults | tfaults
    ext = tuple(len(a) * t for a, t in zip(axes, scene.tile)) if axes and not faults else None
    need = math.prod(ext) if ext else 4
    dkind = data.draw(st.sampled_from(["none", "none", "cpu0", "exact", "bigger", "smaller", "immutable", "released",
                                       "generic", "file", "int32", "tiled", "primary tier", "garbage"]), label="dest")
    dest = {
        "none": lambda: None, "cpu0": lambda: sw.CPU(0), "exact": lambda: sw.CPU(need), "bigger": lambda: sw.CPU(need + 5),
        "smaller": lambda: sw.CPU(need - 1) if need > 1 else sw.CPU(0),
        "immutable": lambda: sw.CPU(need, mutable=False), "released": lambda: _released(sw.CPU(need)),
        "generic": lambda: sw.Generic([], dtype=F32), "file": lambda: sw.FileBacked(), "int32": lambda: sw.CPU(0, dtype=I32),
        "tiled": lambda: scene.carrier, "primary tier": lambda: scene.carrier.primary, "garbage": lambda: "CPU",
    }[dkind]()
    faults |= {"smaller": {ValueError} if need > 1 else set(), "immutable": {RuntimeError}, "released": {RuntimeError},
               "generic": {TypeError}, "file": {TypeError}, "int32": {TypeError}, "tiled": {TypeError},
               "primary tier": {RuntimeError, TypeError}, "garbage": {TypeError}}.get(dkind, set())
    if not faults and invalid_selected(scene, axes):
        faults = {RuntimeError}
    before = scene.snapshot()
    dest_before = facts(dest) if isinstance(dest, sw.Carrier) and dest is not scene.carrier else None
    grad = data.draw(st.booleans(), label="grad")
    with _grad(grad):
        handle, err = attempt("TiledEvictable.project", lambda: scene.carrier.project(tensor, sel, dest))
        result = None
        if err is None:
            result, err = attempt("AwaitProjection.wait", lambda: finish(handle))
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (faults, err)
        if not (faults == {RuntimeError} and handle is not None):
            assert scene.snapshot() == before  # refused before work: nothing changed
        else:
            # failed after start (an invalid tile): values, validity, version and ownership unchanged
            after = scene.snapshot()
            assert after["values"] == before["values"] and after["version"] == before["version"]
        if dest_before is not None:
            assert facts(dest) == dest_before
    else:
        assert err is None, err
        got_ext, want = scene.region(axes)
        assert result.layout == sw.column_major(*got_ext) and result.offset == 0 and isinstance(result.carrier, sw.CPU)
        if dest is not None:
            assert result.carrier is dest
        for coord, v in want.items():
            assert result[coord] == v, (coord, result[coord], v)
        assert (result.autograd_ctx is not None) == grad
        assert handle.wait() is result
        assert scene.carrier.version == before["version"]
    # The source's logical values never change, and the carrier stays usable and releasable.
    scene.check_values()
    scene.carrier.release()


class _grad:
    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.prev = sw.is_grad_enabled()
        sw.set_grad_enabled(self.on)

    def __exit__(self, *exc):
        sw.set_grad_enabled(self.prev)


def _released(c):
    c.release()
    return c


@fuzz(120)
@given(data=st.data())
def test_fuzz_tiled_scatter(data):
    scene = Scene(data.draw)
    sel, faults, axes = data.draw(selections(scene), label="selection")
    template, tfaults = data.draw(full_tensors(scene), label="template")
    faults = faults | tfaults
    ext = tuple(len(a) * t for a, t in zip(axes, scene.tile)) if axes else (2,)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    cvals = rng.integers(-9, 9, size=ext).astype(np.float32)
    ckind = data.draw(st.sampled_from(["cpu", "cpu", "cpu", "shape", "int32", "generic", "tiled", "released", "garbage",
                                       "strided"]), label="compact")
    if ckind in ("cpu", "strided"):
        compact = sw.friendly.tensor(cvals)
        if ckind == "strided":
            c = sw.CPU(2 * cvals.size + 1)
            strides, run = [], 2
            for e in ext:
                strides.append(run)
                run *= e
            compact = Tensor(c, 1, Layout(Shape(*ext), Stride(*strides)))
            for coord in colex(ext):
                compact[coord] = float(cvals[coord])
    elif ckind == "shape":
        compact = sw.friendly.tensor(np.zeros(ext + (2,), np.float32))
        faults |= {ValueError}
    elif ckind == "int32":
        compact = sw.friendly.tensor(cvals.astype(np.int32), dtype=I32)
        faults |= {TypeError}
    elif ckind == "generic":
        compact = sw.friendly.tensor(cvals, carrier=sw.Generic)
        faults |= {TypeError}
    elif ckind == "tiled":
        compact = scene.full
        faults |= {TypeError, ValueError}
    elif ckind == "released":
        compact = sw.friendly.tensor(cvals)
        compact.carrier.release()
        faults |= {RuntimeError}
    else:
        compact = data.draw(GARBAGE, label="garbage compact")
        faults |= {TypeError}
    reduction = data.draw(st.sampled_from(["replace", "replace", "add", "add", "sum", "", None, 3, "REPLACE"]),
                          label="reduction")
    if reduction not in ("replace", "add"):
        faults |= {ValueError, TypeError}
    if not faults and reduction == "add" and invalid_selected(scene, axes):
        faults = {RuntimeError}
    before = scene.snapshot()
    compact_before = facts(compact.carrier) if isinstance(compact, Tensor) and compact is not scene.full else None
    kwargs = {} if reduction == "replace" and data.draw(st.booleans(), label="default") else {"reduction": reduction}
    handle, err = attempt("TiledEvictable.scatter", lambda: scene.carrier.scatter(compact, template, sel, **kwargs))
    result = None
    if err is None:
        result, err = attempt("AwaitMove.wait", lambda: finish(handle))
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (faults, err)
        if handle is None:
            assert scene.snapshot() == before
        else:
            after = scene.snapshot()
            assert after["values"] == before["values"] and after["version"] == before["version"]
    else:
        assert err is None, err
        r = result.carrier
        assert isinstance(r, TiledEvictable) and r is not scene.carrier
        assert r.grid_shape == scene.grid and r.tile_shape == scene.tile and result.layout == scene.full.layout
        assert r.valid_tiles == sel.tile_set and r.dirty_tiles == sel.tile_set
        _, old = scene.region(axes)
        proj = finish(r.project(result, sel))
        for coord in colex(ext):
            want = float(cvals[coord]) + (old[coord] if reduction == "add" else 0.0)
            assert proj[coord] == np.float32(want), (coord, proj[coord], want)
        for t in colex(scene.grid):
            if t not in sel.tile_set:
                expect("TiledEvictable[i]", lambda t=t: result.carrier[scene.slots(t)[0]], {RuntimeError})
        r.release()
        assert scene.carrier.version == before["version"]  # scatter does not mutate the template's carrier
    if compact_before is not None:
        assert facts(compact.carrier) == compact_before
    scene.check_values()
    scene.carrier.release()


def _assert_none(r):
    assert r is None, r


@st.composite
def residency_args(draw, scene):
    kind = draw(st.sampled_from(["set", "set", "set", "selection", "out of range", "rank", "empty", "huge", "garbage"]))
    if kind == "set":
        tiles = draw(st.lists(st.sampled_from(scene.tiles), unique=True))
        return TileSet(tiles), set(), tiles
    if kind == "selection":
        sel, faults, axes = draw(selections(scene))
        if isinstance(sel, TileSet):  # a TileSet is what residency requests take
            return sel, set(), list(sel.coordinates)
        if isinstance(sel, TileSelection) and not faults:
            return sel, set(), list(sel.coordinates)
        return sel, faults, None
    if kind == "out of range":
        t = list(draw(st.sampled_from(scene.tiles)))
        i = draw(st.integers(0, scene.rank - 1))
        t[i] = scene.grid[i] + draw(st.integers(0, 3))
        return TileSet(draw(st.lists(st.sampled_from(scene.tiles), unique=True)) + [tuple(t)]) if False else TileSet([tuple(t)]), {ValueError}, None
    if kind == "rank":
        return TileSet([tuple([0] * (scene.rank + 1))]), {ValueError}, None
    if kind == "empty":
        return TileSet(), set(), []
    if kind == "huge":
        return TileSet([tuple([2**63] + [0] * (scene.rank - 1))]), {ValueError}, None
    return draw(st.sampled_from([None, [(0,)], "tiles", (0,), 0, scene.full])), {TypeError}, None


@fuzz(150)
@given(data=st.data())
def test_fuzz_tiled_promote_evict(data):
    scene = Scene(data.draw)
    c = scene.carrier
    for _ in range(data.draw(st.integers(1, 6), label="requests")):
        arg, faults, tiles = data.draw(residency_args(scene), label="tiles")
        op = data.draw(st.sampled_from(["promote_async", "evict_async", "promote", "evict"]), label="op")
        if not faults and op.startswith("promote") and any(not scene.valid(t) for t in tiles):
            faults = {RuntimeError}
        before = scene.snapshot()
        prev = {t: c.tile_state(t) for t in scene.tiles}
        entry = f"TiledEvictable.{op.replace('_async', '')}_async"

        def call():
            if op.endswith("_async"):
                h = getattr(c, op)(arg)
                return finish(h)
            return getattr(c, op)(arg)

        err = expect(entry, call, faults, _assert_none)
        if err is not None:
            assert scene.snapshot() == before, (op, arg, err)
            continue
        for t in scene.tiles:
            s = c.tile_state(t)
            if t in tiles:
                if op.startswith("promote"):
                    assert s.location == "primary" and s.valid
                elif prev[t].location == "primary":
                    assert s.location == "secondary" and not s.dirty
                else:
                    assert s == prev[t]
            else:
                assert s == prev[t]
        assert c.version == before["version"]  # residency never changes the version
        scene.check_values()
    c.release()
    expect("TiledEvictable.promote_async", lambda: c.promote_async(TileSet()), {RuntimeError})


# ================================================================ residency policies


class PolicyError(Exception):
    """A user exception a policy raises: it must propagate unchanged."""


class HostilePolicy:
    """A policy whose plan() misbehaves in one of several ways (chosen per example)."""

    def __init__(self, kind, grid, draw):
        self.kind, self.grid, self.calls = kind, grid, 0
        self.carrier = None
        rank = len(grid)
        inside = colex(grid)
        if kind == "out of range":
            t = [0] * rank
            t[draw(st.integers(0, rank - 1))] = grid[0] + 5
            field = draw(st.sampled_from(["promote", "retain", "evict"]))
            self.plan_value = ResidencyPlan(**{field: TileSet([tuple(t)])})
        elif kind == "wrong rank":
            field = draw(st.sampled_from(["promote", "retain", "evict"]))
            self.plan_value = ResidencyPlan(**{field: TileSet([tuple([0] * (rank + 1))])})
        elif kind == "huge":
            self.plan_value = ResidencyPlan(evict=TileSet([tuple([2**64] + [0] * (rank - 1))]))
        elif kind == "valid":
            chosen = draw(st.lists(st.sampled_from(inside), unique=True, max_size=4))
            k = draw(st.integers(0, len(chosen)))
            self.plan_value = ResidencyPlan(promote=TileSet(chosen[:k]), evict=TileSet(chosen[k:]))
        else:
            self.plan_value = {
                "none": None, "int": 3, "tile set": TileSet(), "dict": {"promote": TileSet()},
                "duck": type("Duck", (), {"promote": TileSet(), "retain": TileSet(), "evict": TileSet()})(),
                "plan class": ResidencyPlan,
            }.get(kind)

    def plan(self, required, purpose):
        self.calls += 1
        assert purpose in ("projection", "scatter", "operation", "backward")
        assert isinstance(required, TileSet)
        if self.kind == "raise":
            raise PolicyError("policy refuses")
        if self.kind == "raise value":
            raise ValueError("policy refuses with ValueError")
        if self.kind == "re-entrant evict" and self.carrier is not None:
            # evicts every tile from inside the callback: the request must still see valid values
            self.carrier.evict(TileSet(colex(self.grid)))
            return ResidencyPlan()
        if self.kind == "re-entrant release" and self.carrier is not None:
            self.carrier.release()
            return ResidencyPlan()
        return self.plan_value


POLICY_FAULTS = {
    "raise": {PolicyError}, "raise value": {ValueError}, "none": {TypeError}, "int": {TypeError},
    "tile set": {TypeError}, "dict": {TypeError}, "duck": {TypeError}, "plan class": {TypeError},
    "out of range": {ValueError}, "wrong rank": {ValueError}, "huge": {ValueError}, "valid": set(),
    "re-entrant evict": set(), "re-entrant release": None,  # None: any documented outcome, then invariants
}


@pytest.mark.parametrize("kind", sorted(POLICY_FAULTS))
@fuzz(12)
@given(data=st.data())
def test_fuzz_residency_policies(kind, data):
    purpose = data.draw(st.sampled_from(["projection", "scatter", "operation", "backward"]), label="purpose")
    holder = {}

    def make_policy():
        return holder.setdefault("p", HostilePolicy(kind, scene_grid[0], data.draw))

    # The scene's geometry is drawn first, so that the policy knows the grid.
    scene_grid = [None]

    class Deferred:
        def plan(self, required, purpose):
            return holder["p"].plan(required, purpose)

    scene = Scene(data.draw, policy=Deferred(), allow_invalid=False)
    scene_grid[0] = scene.grid
    policy = make_policy()
    policy.carrier = scene.carrier if kind.startswith("re-entrant") else None
    c = scene.carrier
    all_sel = TileSelection([list(range(g)) for g in scene.grid])
    axes = [data.draw(st.lists(st.integers(0, g - 1), unique=True, min_size=1), label="axis") for g in scene.grid]
    sel = TileSelection(axes)
    faults = POLICY_FAULTS[kind]
    before = scene.snapshot()
    calls_before = policy.calls

    def run():
        if purpose == "projection":
            return finish(c.project(scene.full, sel))
        if purpose == "scatter":
            ext = tuple(len(a) * t for a, t in zip(axes, scene.tile))
            return finish(c.scatter(sw.friendly.zeros(*ext), scene.full, sel, reduction="add"))
        if purpose == "operation":
            return sw.relu(scene.full)
        # backward: the forward relu runs with a well-behaved plan; relu's backward reads the saved full
        # tensor again, which is a "backward" request that meets the hostile policy.
        policy_kind, policy.kind = policy.kind, "valid-shadow"
        saved_plan, policy.plan_value = policy.plan_value, ResidencyPlan()
        try:
            y = sw.relu(scene.full)
        finally:
            policy.kind, policy.plan_value = policy_kind, saved_plan
        holder["forward"] = scene.snapshot()
        loss = sw.reduce_sum(y, " ".join("abcd"[: scene.rank]) + " -> ")
        loss.backward()
        return scene.full

    before = scene.snapshot()
    result, err = attempt(f"policy.{purpose}", run, extra=(PolicyError,))
    CALLS[f"policy kind: {kind}"] += 1
    OUTCOMES[f"policy kind: {kind}"]["ok" if err is None else type(err).__name__] += 1
    assert policy.calls > calls_before, "the policy was not consulted"
    if faults is None:  # re-entrant release: anything documented; afterwards the carrier is released or usable
        if not c.is_released():
            scene.check_values()
            c.release()
        return
    if faults:
        assert err is not None and isinstance(err, tuple(faults)), (kind, purpose, err)
        # failed before any provider work: nothing changed (since the forward pass, for backward)
        assert scene.snapshot() == holder.get("forward", before), (kind, purpose)
        if purpose == "backward":
            assert scene.full.grad is None  # no partial gradient was published
    else:
        assert err is None, (kind, purpose, err)
        if purpose == "projection":
            _, want = scene.region(axes)
            for coord, v in want.items():
                assert result[coord] == v
        elif purpose == "operation":
            for coord in colex(scene.logical):
                assert result[coord] == max(scene.vals[dense_offset(coord, scene.logical)], 0.0)
        elif purpose == "backward":
            g = scene.full.grad
            assert g is not None and isinstance(g.carrier, TiledEvictable)
            for coord in colex(scene.logical):
                assert g[coord] == (1.0 if scene.vals[dense_offset(coord, scene.logical)] > 0 else 0.0)
    # Whatever happened, no pin or pending mark is left behind: every tile can be evicted and the carrier released.
    scene.check_values()
    c.evict(TileSet(scene.tiles))
    assert not c.primary_tiles
    c.release()
    assert c.is_released()


# ================================================================ regression cases found by this file


def test_regression_tensor_offset_near_int64_max():
    for off in (2**63 - 1, 2**63 - 2, 2**62):
        with pytest.raises(ValueError, match="exceeds"):
            Tensor(sw.CPU(4), off, sw.column_major(2))


@pytest.mark.parametrize("grid,tile", [((2**32, 2**32), (1, 1)), ((2**62,), (2,)), ((1, 1), (2**32, 2**32)),
                                       ((2**31, 2**31, 2), (1, 1, 1))])
def test_regression_tiled_extent_overflow(grid, tile):
    p, s = sw.CPU(0), sw.CPU(0)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        TiledEvictable(p, s, grid, tile)
    assert not p.is_owned() and not s.is_owned()


@pytest.mark.parametrize("grid,tile,fragment", [
    ((10**7, 10**7), (1, 1), "has 100000000000000 tiles; at most 2**24 (16777216) tiles are supported"),
    ((2**40,), (1,), "has 1099511627776 tiles; at most 2**24"),
    ((2**24 + 1,), (1,), "has 16777217 tiles; at most 2**24"),
    ((4096, 4097), (1, 1), "has 16781312 tiles"),
    ((2, 1), (1, 2**40), "need 2199023255552 contiguous runs; at most 2**26 (67108864) are supported"),
    ((2, 1), (3, 2**25 + 1), "need 67108866 contiguous runs"),
])
def test_regression_tile_table_limits(grid, tile, fragment):
    """A geometry within the 2**62 extent whose tile table would be too big: ValueError up front, no giant
    allocation (Note [Tile table limits]), and nothing claimed or changed: the tiers build a sane carrier."""
    import resource

    p, s = sw.CPU(0), sw.FileBacked()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError) as info:
        TiledEvictable(p, s, grid, tile)
    assert fragment in str(info.value) and "TiledEvictable" in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: nothing was built
    assert not p.is_owned() and not s.is_owned() and p.size() == 0 and s.size() == 0
    assert not p.is_released() and not s.is_released() and p.is_mutable() and s.is_mutable()
    c = TiledEvictable(p, s, (2,), (2,))
    assert c.size() == 4 and p.is_owned() and s.is_owned()
    c.release()


@pytest.mark.parametrize("grid,tile", [((1, 4), (2**30, 2**27)), ((1, 1, 3), (2**20, 2**20, 2**10)), ((4,), (2**40,))])
def test_tile_table_limits_count_coalesced_runs(grid, tile):
    """Huge tiles with few runs are fine: a footprint's axes coalesce into one run while the grid axes
    before them are 1 (4 tiles of 2**57 slots are 4 runs, not 2**29)."""
    assert not tile_table_too_big(grid, tile)
    c = TiledEvictable(sw.CPU(0), sw.FileBacked(), grid, tile)
    assert c.grid_shape == grid and c.tile_shape == tile and c.size() == math.prod(grid) * math.prod(tile)
    assert c.tile_state(tuple(g - 1 for g in grid)).location == "invalid"
    c.release()


@pytest.mark.parametrize("grid", [(10**30,), (2**63,), (1, 2**64)])
def test_regression_grid_extent_beyond_int64(grid):
    p, s = sw.CPU(0), sw.FileBacked()
    with pytest.raises(ValueError, match="grid_shape .* is out of range"):
        TiledEvictable(p, s, grid, (1,) * len(grid))
    assert not p.is_owned() and not s.is_owned()


def test_regression_tile_coordinates_beyond_int64():
    c = TiledEvictable(sw.CPU(0), sw.CPU(8), (4,), (2,))
    full = Tensor(c, 0, sw.column_major(8))
    for bad in (2**63, 2**70):
        with pytest.raises(ValueError, match="out of range"):
            c.promote(TileSet([(bad,)]))
        with pytest.raises(ValueError, match="out of range"):
            c.project(full, TileSelection([[bad]]))
    assert c.tile_state((0,)).location == "secondary"
    c.release()


def test_regression_deeply_nested_coordinate():
    key = [1]
    for _ in range(100_000):
        key = [key]
    t = sw.friendly.tensor([1.0, 2.0])
    for call in (lambda: Shape(2, 3).encode(key), lambda: sw.column_major(2, 3).index(key), lambda: t[key],
                 lambda: t.__setitem__(key, 1.0)):
        with pytest.raises(ValueError, match="deeper than 64"):
            call()
    gc.collect()
