"""Hostile input: property tests over the public entry points (docs/reliability.md, "Hostile input"); what the test_fuzz_*.py
modules share (one module per area: layout, carriers, ops, tiles, tiled, regressions).

Every test feeds random and malformed values to one entry point and checks
the one contract of every entry point (docs/guide.md): a call either works and matches a small
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
The number of calls per entry point and their outcomes are counted here, printed at the end of
the session (``examples run per entry point``, the ``fuzz_report`` fixture of conftest.py) and written to
``build/fuzz-counts.json`` when that directory exists.

Run one entry point: ``.venv/bin/python -m pytest -q tests/test_fuzz_*.py -k project``.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import strideweave as sw
from strideweave import DType
from strideweave.carriers.tiled_evictable import TiledEvictable
from models import binary32 as f32  # x rounded to binary32 (overflow to +-inf), as Float32 storage does
from models import decode_model, tree_leaves, tree_size

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


def finish(handle, timeout=DEADLINE_S):
    """handle.wait() with a deadline: a handle that never completes fails the test instead of hanging it."""
    end = time.monotonic() + timeout
    while not handle.done:
        if time.monotonic() > end:
            raise AssertionError(f"{handle!r} did not complete within {timeout} s")
        time.sleep(0.0005)
    return handle.wait()


# ---------------------------------------------------------------- models


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


# ---------------------------------------------------------------- carriers (carrier, operation and tiled tests)


def make_carrier(kind, n, dtype):
    if kind == "cpu":
        return sw.CPU(n, dtype=dtype)
    if kind == "generic":
        return sw.Generic([{F32: 0.0, I32: 0, BOOL: False}[dtype]] * n, dtype=dtype)
    if kind == "file":
        return sw.FileBacked(dtype=dtype).allocate_like(n) if n else sw.FileBacked(dtype=dtype)
    raise AssertionError(kind)


ZERO = {F32: 0.0, I32: 0, BOOL: False}


def logical(t):
    return [t[i] for i in range(t.size())]


def facts(c):
    d = {"released": c.is_released()}
    if not d["released"]:
        d.update(version=c.version, size=c.size(), owned=c.is_owned())
        if c.size() <= 256 and not isinstance(c, TiledEvictable):
            d["values"] = [c[i] for i in range(c.size())]
    return d


# ---------------------------------------------------------------- tile coordinates (tile and tiled tests)

coordinate_entry = st.one_of(st.integers(0, 5), st.integers(0, 5), st.integers(-2, 5),
                             st.sampled_from([True, 1.0, "1", None, 2**70, np.int64(2), [1]]))


def int_like(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


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
