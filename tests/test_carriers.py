"""Conformance suite for carriers (docs/guide.md, "Carriers"), run by every carrier kind.

One parameterised suite (practices: "One conformance suite per interface"):
every kind of the registry (``KINDS`` in carrier_kinds.py: Generic, CPU,
FileBacked anonymous and named, BlockDeviceCarrier, Evictable, the
user-defined ``ListCarrier`` and TiledEvictable) runs every ``test_*`` below
that takes the ``kind`` fixture, and, where the test also takes ``dtype``,
once per storage dtype the kind supports. A test that checks a property some
kind declares inapplicable says so with ``@needs(...)``; that kind runs it as
a skip giving the reason declared in the registry.

Every error test checks the exception type, a message fragment, and that
nothing changed (values, version, release and ownership state).
After the kind-wide suite come the kind-specific contracts: FileBacked files,
BlockDevice extents, Evictable residency and ownership, the user kind's
provider calls.
"""

from __future__ import annotations

import gc
import math
import os
import struct

import pytest

import strideweave as sw
from forked import check_in_forked_child
from open_files import open_files
from waiting import eventually
from strideweave import DType, Layout, Shape, Stride, Tensor
from strideweave.carriers.extension import register_carrier_definition
from strideweave.carriers.tiled_evictable import TiledEvictable

from carrier_kinds import (
    BOOL,
    F32,
    F64,
    I32,
    KINDS,
    LEDGER,
    LIST_DEFINITION,
    N,
    PY_TYPE,
    ROUTE_CALLS,
    SAMPLES,
    STORAGE_DTYPES,
    VIOLATIONS,
    ZERO,
    ListCarrier,
    TiledEvictableKind,
    _record,
    applies,
    binary32,
    exclusion,
    fill,
    finding,
    needs,
    only,
)
from devices import block_device


def bits(value, dtype):
    """A comparable, bit-exact form of an element value that also pins its Python type."""
    assert type(value) is PY_TYPE[dtype], f"{dtype.name} element read back as {type(value).__name__}"
    if dtype is F32:
        return struct.pack("<f", value).hex()
    return value


def bits_of(values, dtype):
    return [bits(v, dtype) for v in values]


def read_all(c):
    return [c[i] for i in range(c.size())]


def state(c):
    """Everything a failed call must leave alone: values, version, released and owned state."""
    values = bits_of(read_all(c), c.dtype()) if not c.is_released() else None
    return (values, c.version, c.is_released(), c.is_owned())


def dense(n: int) -> Layout:
    return Layout(Shape(n), Stride(1))


@pytest.fixture(autouse=True)
def _provider_contract_holds():
    """After every test: no provider callback saw a contract breach; no storage was released twice."""
    seen = len(LEDGER)
    yield
    assert VIOLATIONS == []
    assert all(s.releases <= 1 for s in LEDGER[seen:])


def pytest_generate_tests(metafunc):
    if "kind_cls" not in metafunc.fixturenames:
        return
    kinds = [k for k in KINDS if getattr(metafunc.function, "kind_filter", lambda k: True)(k)]

    def case(*values, kind, id):
        why, known = exclusion(kind, metafunc.function), finding(kind, metafunc.function)
        marks = [pytest.mark.skip(reason=why)] if why else []
        if known:
            marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=known))
        return pytest.param(*values, id=id, marks=marks)

    if "dtype" in metafunc.fixturenames:
        cases = [case(k, d, kind=k, id=f"{k.name}-{d.name}") for k in kinds for d in k.dtypes]
        metafunc.parametrize(("kind_cls", "dtype"), cases)
    else:
        metafunc.parametrize("kind_cls", [case(k, kind=k, id=k.name) for k in kinds])


@pytest.fixture
def kind(kind_cls, tmp_path):
    return kind_cls(tmp_path)


def first_supported(kind, *preferred):
    return next(d for d in preferred if d in kind.dtypes)


# ============================================================ size, dtype, slots


def test_size_dtype_and_exact_class(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    assert type(c) is kind.cls
    assert isinstance(c, sw.Carrier)
    assert c.size() == N
    assert c.dtype() is dtype
    assert not c.is_released() and not c.is_owned() and c.is_mutable()


def test_slots_read_back_bit_exact(kind, dtype):
    c = kind.make([ZERO[dtype]] * N, dtype)
    assert bits_of(read_all(c), dtype) == bits_of([ZERO[dtype]] * N, dtype)
    for i, v in enumerate(SAMPLES[dtype]):
        c[i] = v
    assert bits_of(read_all(c), dtype) == bits_of(SAMPLES[dtype], dtype)
    c[3] = SAMPLES[dtype][0]  # overwrite one slot; neighbours keep their values
    expected = list(SAMPLES[dtype])
    expected[3] = SAMPLES[dtype][0]
    assert bits_of(read_all(c), dtype) == bits_of(expected, dtype)


@pytest.mark.parametrize("index", [1.0, "0", None, True, (0,), [0]], ids=repr)
def test_slot_index_must_be_an_int(kind, index):
    dtype = first_supported(kind, F32)
    c = kind.make(SAMPLES[dtype], dtype)
    before = state(c)
    with pytest.raises(TypeError, match="index must be an int"):
        c[index]
    with pytest.raises(TypeError, match="index must be an int"):
        c[index] = SAMPLES[dtype][0]
    assert state(c) == before


@pytest.mark.parametrize("index", [N, N + 100, -1, -N, 2**70, -(2**70)])
def test_slot_index_out_of_range(kind, index):
    dtype = first_supported(kind, F32)
    c = kind.make(SAMPLES[dtype], dtype)
    before = state(c)
    with pytest.raises(IndexError, match="out of range"):
        c[index]
    with pytest.raises(IndexError, match="out of range"):
        c[index] = SAMPLES[dtype][0]
    assert state(c) == before


def test_numpy_integer_index_is_accepted(kind):
    np = pytest.importorskip("numpy")
    dtype = first_supported(kind, I32)
    c = kind.make(SAMPLES[dtype], dtype)
    assert c[np.int64(2)] == SAMPLES[dtype][2]
    c[np.int32(3)] = SAMPLES[dtype][0]
    assert c[3] == SAMPLES[dtype][0]


# ============================================================ value conversion per dtype


@only(lambda k: F32 in k.dtypes)
def test_float32_slots_round_to_binary32(kind):
    c = kind.make([0.0] * 4, F32)
    c[0] = 0.1
    c[1] = 7  # an int is a valid Float32 element
    c[2] = 2**80 + 1  # beyond int64: rounds like any other int
    c[3] = 1e300  # beyond binary32: rounds to inf
    assert bits_of(read_all(c), F32) == bits_of([binary32(0.1), 7.0, binary32(float(2**80)), math.inf], F32)
    assert c[0] != 0.1


@pytest.mark.parametrize(
    "value, error, fragment",
    [
        (2**31, OverflowError, "out of range"),
        (-(2**31) - 1, OverflowError, "out of range"),
        (2**100, OverflowError, "out of range"),
        (1.0, TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
        ("1", TypeError, "must be float, int or bool"),
        (None, TypeError, "must be float, int or bool"),
    ],
    ids=repr,
)
@only(lambda k: I32 in k.dtypes)
def test_int32_slots_refuse(kind, value, error, fragment):
    c = kind.make(SAMPLES[I32], I32)
    before = state(c)
    with pytest.raises(error, match=fragment):
        c[0] = value
    assert state(c) == before


@pytest.mark.parametrize(
    "value, fragment",
    [(1, "must be a bool"), (0, "must be a bool"), (1.0, "must be a bool"), ("True", "must be float, int or bool")],
    ids=repr,
)
@only(lambda k: BOOL in k.dtypes)
def test_bool_slots_accept_only_bool(kind, value, fragment):
    c = kind.make(SAMPLES[BOOL], BOOL)
    before = state(c)
    with pytest.raises(TypeError, match=fragment):
        c[1] = value
    assert state(c) == before
    c[1] = True
    assert c[1] is True


@pytest.mark.parametrize(
    "value, fragment", [(True, "must be a float or an int"), ("0.5", "must be float, int or bool"), (None, "must be")], ids=repr
)
@only(lambda k: F32 in k.dtypes)
def test_float32_slots_refuse_non_numbers(kind, value, fragment):
    c = kind.make(SAMPLES[F32], F32)
    before = state(c)
    with pytest.raises(TypeError, match=fragment):
        c[0] = value
    assert state(c) == before


# ============================================================ version


def test_version_grows_by_one_per_successful_write(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    v0 = c.version
    assert type(v0) is int and v0 >= 0
    read_all(c)
    assert c.version == v0  # reads never count
    for k, v in enumerate(SAMPLES[dtype], start=1):
        c[k - 1] = v
        assert c.version == v0 + k
    t = Tensor(c, 0, dense(N))
    t[2] = SAMPLES[dtype][5]  # a tensor write is a write into its carrier
    assert c.version == t.version == v0 + N + 1


def test_version_unchanged_by_failed_writes(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    before = state(c)
    bad = "not a number"
    with pytest.raises(TypeError, match="element values"):
        c[0] = bad
    with pytest.raises(IndexError, match="out of range"):
        c[N] = SAMPLES[dtype][0]
    with pytest.raises(TypeError, match="index must be an int"):
        c["0"] = SAMPLES[dtype][0]
    with pytest.raises(ValueError, match="out of range"):
        Tensor(c, 0, dense(N))[N] = SAMPLES[dtype][0]
    assert state(c) == before


def test_version_unchanged_by_release(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    c[0] = SAMPLES[dtype][1]
    v = c.version
    c.release()
    assert c.version == v
    c.release()
    assert c.version == v


# ============================================================ mutability


def test_immutable_carrier_refuses_writes(kind, dtype):
    c = kind.make_immutable(N, dtype)
    assert type(c) is kind.cls
    assert c.is_mutable() is False
    assert c.is_owned() is False
    before = state(c)
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        c[0] = SAMPLES[dtype][0]
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        Tensor(c, 0, dense(N))[0] = SAMPLES[dtype][0]
    assert state(c) == before
    source = fill(sw.CPU(N, dtype=dtype), SAMPLES[dtype])
    source_before = state(source)
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        sw.move(Tensor(source, 0, dense(N)), c)
    assert state(c) == before
    assert state(source) == source_before
    c.release()  # immutability is about writes, not about the storage's lifetime
    assert c.is_released()


# ============================================================ ownership (a composite owns its tiers)


def test_evictable_tier_is_owned_and_refuses_writes_release_and_moves(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    if kind.dependent:
        before = state(c)
        with pytest.raises(TypeError, match="must not be dependent"):
            sw.Evictable(c, sw.CPU(0, dtype=dtype))
        assert state(c) == before
        return
    secondary = sw.CPU(0, dtype=dtype)
    ev = sw.Evictable(c, secondary)
    assert c.is_owned() and secondary.is_owned()
    assert c.is_mutable() is False
    assert ev.is_owned() is False and ev.is_mutable()
    before = state(c)
    assert bits_of(read_all(c), dtype) == bits_of(SAMPLES[dtype], dtype)  # others may read it
    assert Tensor(c, 0, dense(N))[1] == c[1]
    with pytest.raises(RuntimeError, match="owned"):
        c[0] = SAMPLES[dtype][1]
    with pytest.raises(RuntimeError, match="owned"):
        Tensor(c, 0, dense(N))[0] = SAMPLES[dtype][1]
    with pytest.raises(RuntimeError, match="owned"):
        c.release()
    with pytest.raises(RuntimeError, match="owned"):
        sw.move(Tensor(c, 0, dense(N)), sw.CPU(0, dtype=dtype))
    other = fill(sw.CPU(N, dtype=dtype), SAMPLES[dtype])
    other_before = state(other)
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        sw.move(Tensor(other, 0, dense(N)), c)
    with pytest.raises(RuntimeError, match="owned"):
        sw.Evictable(c, sw.CPU(0, dtype=dtype))  # one owner at a time
    assert state(c) == before
    assert state(other) == other_before
    ev.release()  # the composite releases its tiers with itself
    assert c.is_released() and secondary.is_released()


@only(lambda k: not k.dependent)  # a dependent carrier cannot be a tier
def test_evict_and_promote_through_tiers_of_this_kind(kind, dtype):
    """Both tiers of one Evictable are of this kind: residency copies go through the kind's bulk I/O."""
    primary = kind.make(SAMPLES[dtype], dtype)
    secondary = kind.empty(dtype)
    ev = sw.Evictable(primary, secondary)
    v = ev.version
    for _ in range(2):
        ev.evict()
        assert ev.is_evicted()
        with pytest.raises(RuntimeError, match="evicted"):
            ev[0]
        ev.promote()
        assert not ev.is_evicted()
        assert bits_of(read_all(ev), dtype) == bits_of(SAMPLES[dtype], dtype)
    assert ev.version == v  # residency movement is not a write
    assert type(ev.primary) is kind.cls and type(ev.secondary) is kind.cls
    ev[0] = SAMPLES[dtype][1]
    assert ev.version == v + 1
    ev.evict()
    ev.promote()
    assert bits(ev[0], dtype) == bits(SAMPLES[dtype][1], dtype)
    tiers = (ev.primary, ev.secondary)
    ev.release()
    assert all(t.is_released() for t in tiers)
    assert primary.is_released() and secondary.is_released()


# ============================================================ release


def test_release_is_idempotent_and_returns_none(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    assert c.is_released() is False
    assert c.release() is None
    assert c.is_released() is True
    assert c.release() is None
    assert c.is_released() is True


@needs("released_size_is_zero")
def test_released_carrier_has_size_zero(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    c.release()
    assert c.size() == 0
    c.release()
    assert c.size() == 0


def test_released_carrier_refuses_reads_writes_and_moves(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    t = Tensor(c, 0, dense(N))
    c.release()
    v = c.version
    with pytest.raises(RuntimeError, match="released"):
        c[0]
    with pytest.raises(RuntimeError, match="released"):
        c[0] = SAMPLES[dtype][0]
    with pytest.raises(RuntimeError, match="released"):
        t[0]
    with pytest.raises(RuntimeError, match="released"):
        t[0] = SAMPLES[dtype][0]
    destination = sw.CPU(0, dtype=dtype)
    with pytest.raises(RuntimeError, match="released"):
        sw.move(t, destination)
    with pytest.raises(RuntimeError, match="released"):
        sw.move_async(t, destination)
    assert destination.size() == 0 and destination.version == 0 and not destination.is_owned()
    source = fill(sw.CPU(N, dtype=dtype), SAMPLES[dtype])
    source_before = state(source)
    with pytest.raises(RuntimeError, match="released"):
        sw.move(Tensor(source, 0, dense(N)), c)
    assert state(source) == source_before
    assert c.version == v and c.is_released()


def test_released_carrier_keeps_dtype_supports_and_new_like(kind, dtype):
    c = kind.make(SAMPLES[dtype], dtype)
    c.release()
    assert c.dtype() is dtype
    for d in STORAGE_DTYPES:
        assert c.supports_storage_dtype(d) is (d in kind.dtypes)
    fresh = c.new_like(SAMPLES[dtype])
    assert type(fresh) is kind.cls
    assert not fresh.is_released()
    assert bits_of(read_all(fresh), dtype) == bits_of(SAMPLES[dtype], dtype)


# ============================================================ supports_storage_dtype


def test_supports_storage_dtype_is_an_identity_test(kind):
    c = kind.make(SAMPLES[F32][:2] if F32 in kind.dtypes else SAMPLES[kind.dtypes[0]][:2], kind.dtypes[0])
    footprint = kind.footprint()
    for d in STORAGE_DTYPES:
        assert c.supports_storage_dtype(d) is (d in kind.dtypes)
        assert c.supports_storage_dtype(dtype=d) is (d in kind.dtypes)
    assert c.supports_storage_dtype(F64) is False  # accumulator only: no carrier stores it
    assert kind.footprint() == footprint  # allocates nothing


@pytest.mark.parametrize("bad", ["Float32", None, 1, DType, float], ids=repr)
def test_supports_storage_dtype_refuses_non_dtypes(kind, bad):
    c = kind.make(SAMPLES[kind.dtypes[0]][:2], kind.dtypes[0])
    before = state(c)
    with pytest.raises(TypeError, match="dtype must be a DType"):
        c.supports_storage_dtype(bad)
    assert state(c) == before


# ============================================================ new_like / allocate_like


@needs("like_of_any_size")
def test_new_like_makes_a_fresh_carrier_of_the_same_kind(kind, dtype):
    c = kind.make(SAMPLES[dtype][:3], dtype)
    before = state(c)
    fresh = c.new_like(SAMPLES[dtype])
    assert type(fresh) is kind.cls and fresh is not c
    assert fresh.dtype() is dtype
    assert fresh.size() == N
    assert fresh.is_mutable() and not fresh.is_owned() and not fresh.is_released()
    assert bits_of(read_all(fresh), dtype) == bits_of(SAMPLES[dtype], dtype)
    fresh[0] = SAMPLES[dtype][1]  # independent storage
    assert state(c) == before


@needs("like_of_any_size")
def test_new_like_honours_mutable_false(kind, dtype):
    c = kind.make(SAMPLES[dtype][:2], dtype)
    frozen = c.new_like(SAMPLES[dtype], mutable=False)
    assert type(frozen) is kind.cls
    assert frozen.is_mutable() is False
    assert bits_of(read_all(frozen), dtype) == bits_of(SAMPLES[dtype], dtype)
    before = state(frozen)
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        frozen[0] = SAMPLES[dtype][1]
    assert state(frozen) == before


@needs("like_of_any_size")
def test_new_like_honours_dtype(kind, dtype):
    c = kind.make(SAMPLES[dtype][:2], dtype)
    for other in kind.dtypes:
        fresh = c.new_like(SAMPLES[other], dtype=other)
        assert type(fresh) is kind.cls and fresh.dtype() is other
        assert bits_of(read_all(fresh), other) == bits_of(SAMPLES[other], other)
    if F32 in kind.dtypes:
        assert c.new_like([0.1, 3], dtype=F32)[0] == binary32(0.1)  # values are converted for the new dtype
        assert type(c.new_like([3], dtype=F32)[0]) is float
    if kind.allocatable:
        assert c.new_like([], dtype=dtype).size() == 0


@pytest.mark.parametrize(
    "args, kwargs, error, fragment",
    [
        ((5,), {}, TypeError, "iterable"),
        (("abc",), {}, TypeError, "iterable"),
        ((["x"],), {}, TypeError, "element values"),
        (([1.0],), {"dtype": "Float32"}, TypeError, "dtype must be a DType"),
        (([1.0],), {"dtype": F64}, TypeError, "Float64"),
        (([2**31],), {"dtype": I32}, OverflowError, "out of range"),
        (([1.5],), {"dtype": I32}, TypeError, "must be an int"),
        (([1],), {"dtype": BOOL}, TypeError, "must be a bool"),
    ],
    ids=["int", "str", "element", "dtype-str", "Float64", "overflow", "float-into-Int32", "int-into-Bool"],
)
@needs("like_of_any_size")
def test_new_like_refuses_before_allocating(kind, args, kwargs, error, fragment):
    """Values are checked against the requested dtype before any carrier is made."""
    c = kind.make(SAMPLES[kind.dtypes[0]][:2], kind.dtypes[0])
    before, footprint = state(c), kind.footprint()
    with pytest.raises(error, match=fragment):
        c.new_like(*args, **kwargs)
    assert state(c) == before
    assert kind.footprint() == footprint


@only(lambda k: set(k.dtypes) != set(STORAGE_DTYPES))
@needs("like_of_any_size")
def test_new_like_refuses_a_dtype_the_kind_does_not_store(kind):
    unsupported = [d for d in STORAGE_DTYPES if d not in kind.dtypes]
    c = kind.make(SAMPLES[kind.dtypes[0]][:2], kind.dtypes[0])
    before = state(c)
    for d in unsupported:
        with pytest.raises(TypeError, match=f"{d.name}"):
            c.new_like(SAMPLES[d], dtype=d)
        with pytest.raises(TypeError, match=f"does not store {d.name}"):
            c.allocate_like(2, dtype=d)
    assert state(c) == before


@needs("like_of_any_size")
def test_allocate_like_is_zero_filled_of_the_same_kind(kind, dtype):
    c = kind.make(SAMPLES[dtype][:2], dtype)
    before = state(c)
    fresh = c.allocate_like(N)
    assert type(fresh) is kind.cls
    assert fresh.size() == N and fresh.dtype() is dtype
    assert fresh.is_mutable() and not fresh.is_owned()
    assert bits_of(read_all(fresh), dtype) == bits_of([ZERO[dtype]] * N, dtype)
    fresh[1] = SAMPLES[dtype][0]
    assert state(c) == before


@needs("like_of_any_size")
def test_allocate_like_honours_mutable_dtype_and_empty(kind, dtype):
    c = kind.make(SAMPLES[dtype][:2], dtype)
    frozen = c.allocate_like(3, mutable=False)
    assert type(frozen) is kind.cls and frozen.is_mutable() is False
    before = state(frozen)
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        frozen[0] = SAMPLES[dtype][0]
    assert state(frozen) == before
    for other in kind.dtypes:
        fresh = c.allocate_like(3, dtype=other)
        assert type(fresh) is kind.cls and fresh.dtype() is other
        assert bits_of(read_all(fresh), other) == bits_of([ZERO[other]] * 3, other)
    unfilled = c.allocate_like(5, empty=True)  # contents unspecified, but a full, usable carrier
    assert type(unfilled) is kind.cls and unfilled.size() == 5 and unfilled.dtype() is dtype
    unfilled[4] = SAMPLES[dtype][2]
    assert bits(unfilled[4], dtype) == bits(SAMPLES[dtype][2], dtype)
    if kind.allocatable:
        assert c.allocate_like(0).size() == 0


@pytest.mark.parametrize(
    "size, kwargs, error, fragment",
    [
        (-1, {}, ValueError, ">= 0"),
        (2.0, {}, TypeError, "must be an int"),
        (True, {}, TypeError, "must be an int"),
        ("3", {}, TypeError, "must be an int"),
        (3, {"dtype": "Int32"}, TypeError, "dtype must be a DType"),
        (3, {"dtype": F64}, TypeError, "does not store Float64"),
    ],
    ids=["negative", "float", "bool", "str", "dtype-str", "Float64"],
)
def test_allocate_like_refuses_before_allocating(kind, size, kwargs, error, fragment):
    c = kind.make(SAMPLES[kind.dtypes[0]][:2], kind.dtypes[0])
    before, footprint = state(c), kind.footprint()
    with pytest.raises(error, match=fragment):
        c.allocate_like(size, **kwargs)
    assert state(c) == before
    assert kind.footprint() == footprint


# ============================================================ moves both ways with CPU


def wait_move(tensor, destination):
    handle = sw.move_async(tensor, destination)
    assert isinstance(handle, sw.AwaitMove) and isinstance(handle, sw.AwaitResult)
    result = handle.wait()
    assert handle.done is True
    assert handle.wait() is result  # the same object on every wait
    return result


MOVERS = [pytest.param(sw.move, id="move"), pytest.param(wait_move, id="move_async")]


def check_moved(result, destination, layout, expected, dtype):
    assert isinstance(result, Tensor)
    assert result.carrier is destination
    assert result.offset == 0
    assert result.layout == layout
    assert result.dtype() is dtype
    assert bits_of([result[i] for i in range(layout.size)], dtype) == bits_of(expected, dtype)
    assert not destination.is_owned() and destination.is_mutable()


@pytest.mark.parametrize("mover", MOVERS)
@needs("moves_with_cpu")
def test_move_from_kind_to_cpu(kind, dtype, mover):
    source = kind.make(SAMPLES[dtype], dtype)
    for destination in (sw.CPU(0, dtype=dtype), sw.CPU(N, dtype=dtype)):  # allocatable, then large enough
        if destination.size():
            source = kind.make(SAMPLES[dtype], dtype)
        v = destination.version
        result = mover(Tensor(source, 0, dense(N)), destination)
        check_moved(result, destination, dense(N), SAMPLES[dtype], dtype)
        assert destination.size() == N
        assert destination.version == v + 1  # one write; growing it is allocation, not a write
        assert source.is_released()  # a move consumes its source


@pytest.mark.parametrize("mover", MOVERS)
@needs("moves_with_cpu")
def test_move_from_cpu_to_kind(kind, dtype, mover):
    destinations = [kind.make([ZERO[dtype]] * N, dtype)]
    if kind.allocatable:
        destinations.insert(0, kind.empty(dtype))
        assert destinations[0].size() == 0
    for destination in destinations:
        source = fill(sw.CPU(N, dtype=dtype), SAMPLES[dtype])
        v = destination.version
        result = mover(Tensor(source, 0, dense(N)), destination)
        check_moved(result, destination, dense(N), SAMPLES[dtype], dtype)
        assert type(destination) is kind.cls and destination.size() == N
        assert destination.version == v + 1
        assert source.is_released()


@pytest.mark.parametrize("direction", ["kind-to-cpu", "cpu-to-kind"])
@needs("moves_with_cpu")
def test_move_of_an_offset_strided_view(kind, dtype, direction):
    """The result is Tensor(destination, 0, layout): slot layout(i) of the destination holds source ordinal i."""
    layout = Layout(Shape(2, 2), Stride(3, 1))  # offsets 0, 3, 1, 4: cosize 5
    values = SAMPLES[dtype]
    offset = 2
    expected = [values[offset + layout(i)] for i in range(4)]
    if direction == "kind-to-cpu":
        source, destination = kind.make(values, dtype), sw.CPU(0, dtype=dtype)
    else:
        source = fill(sw.CPU(N, dtype=dtype), values)
        destination = kind.empty(dtype) if kind.allocatable else kind.make([ZERO[dtype]] * 5, dtype)
    result = sw.move(Tensor(source, offset, layout), destination)
    check_moved(result, destination, layout, expected, dtype)
    assert destination.size() >= layout.cosize
    for i in range(4):
        assert bits(destination[layout(i)], dtype) == bits(expected[i], dtype)
    assert source.is_released()


def test_moves_refused_before_work_leave_both_sides_alone(kind, dtype):
    source = kind.make(SAMPLES[dtype], dtype)
    t = Tensor(source, 0, dense(N))
    other = first_supported(kind, *(d for d in STORAGE_DTYPES if d is not dtype))
    cases = [
        (source, ValueError, "own carrier"),
        ("not a carrier", TypeError, "Carrier instance"),
        (sw.CPU(0, dtype=other), TypeError, "dtype mismatch"),
        (sw.CPU(N - 1, dtype=dtype), ValueError, "not allocatable"),
    ]
    for destination, error, fragment in cases:
        before = state(source)
        dest_before = state(destination) if isinstance(destination, sw.Carrier) and destination is not source else None
        with pytest.raises(error, match=fragment):
            sw.move_async(t, destination)
        assert state(source) == before
        if dest_before is not None:
            assert state(destination) == dest_before
    with pytest.raises(TypeError, match="tensor must be a Tensor"):
        sw.move(source, sw.CPU(0, dtype=dtype))
    if applies(kind, "moves_with_cpu"):
        assert sw.move(t, sw.CPU(0, dtype=dtype)).carrier.size() == N  # still movable afterwards


# ============================================================ shipped classes are final


@pytest.mark.parametrize("cls", [sw.Generic, sw.CPU, sw.FileBacked, sw.Evictable, sw.BlockDeviceCarrier])
def test_shipped_carrier_classes_are_final(cls):
    with pytest.raises(TypeError, match="subclass"):
        type("Derived", (cls,), {})


def test_kind_is_final_or_registered(kind):
    if kind.shipped:
        with pytest.raises(TypeError, match="subclass"):
            type("Derived", (kind.cls,), {})
    else:
        assert issubclass(kind.cls, sw.Carrier) and kind.cls.__bases__ == (sw.Carrier,)
        with pytest.raises(ValueError, match="already registered"):
            register_carrier_definition(kind.cls, LIST_DEFINITION)


# ============================================================ kind-specific: Generic and CPU


def test_generic_dtype_is_keyword_only_and_empty_generic_is_allocatable():
    with pytest.raises(TypeError, match="incompatible function arguments"):
        sw.Generic([1], I32)
    g = sw.Generic([], dtype=I32)
    assert g.size() == 0 and g.dtype() is I32
    source = fill(sw.CPU(3, dtype=I32), [4, 5, 6])
    sw.move(Tensor(source, 0, dense(3)), g)
    assert read_all(g) == [4, 5, 6]
    assert sw.Generic([1.5, 2]).dtype() is F32 and read_all(sw.Generic([1.5, 2])) == [1.5, 2.0]


def test_generic_refuses_bad_values_and_dtypes():
    with pytest.raises(OverflowError, match="out of range"):
        sw.Generic([1, 2**31], dtype=I32)
    with pytest.raises(TypeError, match="must be a bool"):
        sw.Generic([True, 0], dtype=BOOL)
    with pytest.raises(TypeError, match="not a storage dtype"):
        sw.Generic([1.0], dtype=F64)
    with pytest.raises(TypeError, match="iterable"):
        sw.Generic(3)


def test_cpu_construction():
    assert read_all(sw.CPU(3)) == [0.0, 0.0, 0.0]
    assert read_all(sw.CPU(2, dtype=BOOL)) == [False, False]
    assert sw.CPU(4, empty=True).size() == 4
    with pytest.raises(ValueError, match=">= 0"):
        sw.CPU(-1)
    with pytest.raises(TypeError, match="must be an int"):
        sw.CPU(2.0)
    with pytest.raises(TypeError, match="not a storage dtype"):
        sw.CPU(2, dtype=F64)


# ============================================================ kind-specific: FileBacked


def test_anonymous_file_has_no_name_and_is_closed_on_release():
    """An anonymous file is never in the directory; its filename is what the kernel calls the open file."""
    c = fill(sw.FileBacked().allocate_like(4), [1.0, 2.0, 3.0, 4.0])
    assert c.is_anonymous()
    path = c.filename
    assert path.endswith(" (deleted)") and not os.path.exists(path)
    assert path in open_files()
    assert read_all(c) == [1.0, 2.0, 3.0, 4.0]
    c.release()
    assert path not in open_files()


def test_anonymous_file_is_closed_when_the_carrier_is_dropped():
    c = sw.FileBacked().allocate_like(4)
    path = c.filename
    assert path in open_files() and not os.path.exists(path)
    del c
    gc.collect()
    assert path not in open_files()


def test_named_file_persists_and_reopening_sees_the_values(tmp_path):
    path = tmp_path / "slots.bin"
    c = sw.FileBacked(path, dtype=I32)
    assert not c.is_anonymous() and c.filename == str(path)
    assert c.size() == 0  # a new file starts empty (allocatable)
    source = fill(sw.CPU(N, dtype=I32), SAMPLES[I32])
    sw.move(Tensor(source, 0, dense(N)), c)  # grows when allocated
    assert c.size() == N and os.path.getsize(path) == N * 4
    c[0] = 42
    c.release()
    assert os.path.exists(path) and os.path.getsize(path) == N * 4
    again = sw.FileBacked(str(path), dtype=I32)  # str and os.PathLike both name the file
    assert again.size() == N
    assert read_all(again) == [42] + SAMPLES[I32][1:]
    again.release()
    frozen = sw.FileBacked(path, dtype=I32, mutable=False)
    assert read_all(frozen) == [42] + SAMPLES[I32][1:]
    before = state(frozen)
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        frozen[0] = 1
    assert state(frozen) == before
    frozen.release()
    assert os.path.getsize(path) == N * 4


def test_file_backed_refuses_bool(tmp_path):
    path = tmp_path / "bool.bin"
    with pytest.raises(TypeError, match="Float32 and Int32"):
        sw.FileBacked(dtype=BOOL)
    with pytest.raises(TypeError, match="Float32 and Int32"):
        sw.FileBacked(path, dtype=BOOL)
    assert not path.exists()
    c = sw.FileBacked(dtype=F32)
    assert c.supports_storage_dtype(BOOL) is False
    with pytest.raises(TypeError, match="does not store Bool"):
        c.allocate_like(2, dtype=BOOL)


def test_file_backed_refuses_bad_filenames():
    with pytest.raises(TypeError, match="filename must be"):
        sw.FileBacked(3)
    with pytest.raises(ValueError, match="must not be empty"):
        sw.FileBacked("")


# ============================================================ kind-specific: BlockDevice


@pytest.fixture
def arena(tmp_path):
    return block_device(tmp_path / "device.img", 8 << 20)


def test_block_device_carrier_is_not_constructible_directly():
    with pytest.raises(TypeError, match="not constructible directly"):
        sw.BlockDeviceCarrier()


def test_block_device_extents_are_returned_exactly_once(arena):
    capacity = arena.capacity
    assert capacity == 8 << 20 and arena.free_bytes == capacity
    a = arena.allocate(10)
    b = arena.allocate(2000, dtype=I32)  # 8000 bytes: two 4096-byte blocks
    assert arena.free_bytes == capacity - 4096 - 8192
    fill(a, [float(i) for i in range(10)])
    fill(b, list(range(2000)))
    assert read_all(a) == [float(i) for i in range(10)]  # extents do not overlap
    assert b[1999] == 1999 and b[0] == 0
    a.release()
    a.release()
    assert arena.free_bytes == capacity - 8192
    del b  # dropping an unreleased carrier returns its extent too
    gc.collect()
    assert arena.free_bytes == capacity


def test_block_device_refusals_leave_the_arena_alone(arena):
    free = arena.free_bytes
    with pytest.raises(TypeError, match="Float32 and Int32"):
        arena.allocate(4, dtype=BOOL)
    with pytest.raises(ValueError, match="no free extent"):
        arena.allocate((8 << 20) // 4 + 1)
    with pytest.raises(ValueError, match=">= 0"):
        arena.allocate(-1)
    with pytest.raises(TypeError, match="must be an int"):
        arena.allocate(1.5)
    assert arena.free_bytes == free


def test_block_device_allocate_honours_mutable_and_empty(arena):
    frozen = arena.allocate(4, mutable=False)
    assert frozen.is_mutable() is False and read_all(frozen) == [0.0] * 4
    assert arena.allocate(4, empty=True).size() == 4
    assert arena.allocate(3, dtype=I32).dtype() is I32


# ============================================================ kind-specific: Evictable


def make_evictable(values, dtype=F32):
    return fill(sw.Evictable(sw.CPU(len(values), dtype=dtype), sw.FileBacked(dtype=dtype)), values)


def test_evictable_residency():
    ev = make_evictable(SAMPLES[F32])
    assert not ev.is_evicted() and ev.size() == N
    v = ev.version
    assert ev.evict() is None and ev.is_evicted()
    ev.evict()  # idempotent
    assert ev.is_evicted() and ev.size() == N
    assert ev.version == v
    assert ev.secondary.size() == N
    assert ev.promote() is None and not ev.is_evicted()
    ev.promote()
    assert not ev.is_evicted()
    assert bits_of(read_all(ev), F32) == bits_of(SAMPLES[F32], F32)
    assert ev.version == v


def test_evicted_carrier_refuses_reads_and_writes():
    ev = make_evictable(SAMPLES[F32])
    ev.evict()
    v = ev.version
    t = Tensor(ev, 0, dense(N))
    with pytest.raises(RuntimeError, match="evicted"):
        ev[0]
    with pytest.raises(RuntimeError, match="evicted"):
        ev[0] = 1.0
    with pytest.raises(RuntimeError, match="evicted"):
        t[1]
    with pytest.raises(RuntimeError, match="evicted"):
        t[1] = 1.0
    assert ev.version == v and ev.is_evicted()
    ev.promote()
    assert bits_of(read_all(ev), F32) == bits_of(SAMPLES[F32], F32)


def test_moving_from_an_evicted_carrier_fails_and_leaves_it_usable():
    ev = make_evictable(SAMPLES[F32])
    ev.evict()
    destination = sw.CPU(0)
    handle = sw.move_async(Tensor(ev, 0, dense(N)), destination)
    with pytest.raises(RuntimeError, match="evicted") as first:
        handle.wait()
    with pytest.raises(RuntimeError) as second:
        handle.wait()
    assert second.value is first.value  # the same exception object every time
    assert not ev.is_released() and not ev.is_owned() and ev.is_evicted()
    assert ev.primary.is_owned() and ev.secondary.is_owned()
    assert not destination.is_owned() and destination.version == 0
    ev.promote()
    assert bits_of(read_all(ev), F32) == bits_of(SAMPLES[F32], F32)
    sw.move(Tensor(ev, 0, dense(N)), destination)
    assert bits_of(read_all(destination), F32) == bits_of(SAMPLES[F32], F32)
    assert ev.is_released()


def test_evictable_starts_evicted_when_only_the_secondary_holds_values():
    secondary = sw.FileBacked(dtype=I32).allocate_like(3)
    fill(secondary, [7, 8, 9])
    ev = sw.Evictable(sw.CPU(0, dtype=I32), secondary)
    assert ev.is_evicted() and ev.size() == 3 and ev.dtype() is I32
    with pytest.raises(RuntimeError, match="evicted"):
        ev[0]
    ev.promote()
    assert read_all(ev) == [7, 8, 9]


def test_evictable_release_releases_its_tiers_and_ends_residency_calls():
    ev = make_evictable([1.0, 2.0])
    ev.evict()
    primary, secondary = ev.primary, ev.secondary
    ev.release()
    assert ev.is_released() and primary.is_released() and secondary.is_released()
    with pytest.raises(RuntimeError, match="released"):
        ev.promote()
    with pytest.raises(RuntimeError, match="released"):
        ev.evict()
    assert ev.dtype() is F32 and ev.supports_storage_dtype(I32)
    assert type(ev.new_like([3.0])) is sw.Evictable


def tier_states(*carriers):
    return [(c.is_owned(), c.is_released(), c.version, c.size()) for c in carriers]


@pytest.mark.parametrize(
    "build, error, fragment",
    [
        (lambda p, s: (p, p), ValueError, "distinct"),
        (lambda p, s: (p, sw.FileBacked(dtype=I32)), TypeError, "share one dtype"),
        (lambda p, s: (p, fill(sw.CPU(3), [0.0] * 3)), ValueError, "0 or 4 slots"),
        (lambda p, s: (sw.CPU(0), sw.CPU(0)), ValueError, "non-empty"),
        (lambda p, s: (p, "tier"), TypeError, "Carrier instances"),
        (lambda p, s: (make_evictable([1.0] * 4), s), TypeError, "must not be dependent"),
    ],
    ids=["same-carrier", "dtype", "size", "both-empty", "not-a-carrier", "dependent"],
)
def test_evictable_construction_refusals_leave_tiers_unowned(build, error, fragment):
    p, s = fill(sw.CPU(4), [1.0, 2.0, 3.0, 4.0]), sw.FileBacked()
    primary, secondary = build(p, s)
    carriers = [c for c in (primary, secondary, p, s) if isinstance(c, sw.Carrier)]
    before = tier_states(*carriers)
    with pytest.raises(error, match=fragment):
        sw.Evictable(primary, secondary)
    assert tier_states(*carriers) == before
    assert read_all(p) == [1.0, 2.0, 3.0, 4.0]
    assert not p.is_owned()


def test_evictable_refuses_released_or_owned_tiers():
    p = fill(sw.CPU(2), [1.0, 2.0])
    released = sw.CPU(2)
    released.release()
    with pytest.raises(RuntimeError, match="released"):
        sw.Evictable(p, released)
    assert not p.is_owned()
    first = sw.Evictable(p, sw.CPU(0))
    with pytest.raises(RuntimeError, match="owned"):
        sw.Evictable(sw.CPU(2), p)
    assert p.is_owned() and not first.is_released()
    first.release()
    assert p.is_released()


# ============================================================ kind-specific: TiledEvictable


def test_tiled_evictable_like_carriers_take_its_extent_only(tmp_path):
    """What the suite's any-size new_like/allocate_like tests leave out for TiledEvictable (its like_of_any_size
    exclusion in carrier_kinds.py), checked at the sizes it takes: 0 or the full extent."""
    c = TiledEvictableKind(tmp_path).make(SAMPLES[F32], F32)
    before = state(c)
    for dtype in (F32, I32):
        fresh = c.new_like(SAMPLES[dtype], mutable=False, dtype=dtype)
        assert type(fresh) is TiledEvictable and fresh.dtype() is dtype and fresh.is_mutable() is False
        assert fresh.grid_shape == c.grid_shape and fresh.tile_shape == c.tile_shape
        assert bits_of(read_all(fresh), dtype) == bits_of(SAMPLES[dtype], dtype)
        zeros = c.allocate_like(N, dtype=dtype)
        assert type(zeros) is TiledEvictable and zeros.is_mutable()
        assert bits_of(read_all(zeros), dtype) == bits_of([ZERO[dtype]] * N, dtype)
        assert c.allocate_like(0, dtype=dtype, empty=True).size() == N  # 0: the full extent, its tiles invalid
    for size in (1, N - 1, N + 1):
        with pytest.raises(ValueError, match=f"0 or the full extent {N}, got {size}"):
            c.allocate_like(size)
        with pytest.raises(ValueError, match=f"0 or the full extent {N}, got {size}"):
            c.new_like(SAMPLES[F32][:1] * size)
    with pytest.raises(TypeError, match="Bool"):
        c.allocate_like(N, dtype=BOOL)
    with pytest.raises(TypeError, match="Bool"):
        c.new_like(SAMPLES[BOOL], dtype=BOOL)
    assert state(c) == before


# ============================================================ kind-specific: the user-defined carrier


def test_user_carrier_provider_release_is_called_at_most_once():
    c = ListCarrier(3, dtype=F32)
    record = _record(c)
    assert (record.allocations, record.releases) == (1, 0)
    c.release()
    c.release()
    c.release()
    assert (record.allocations, record.releases) == (1, 1)


def test_user_carrier_read_fault_propagates_and_leaves_it_usable():
    c = fill(ListCarrier(4, dtype=F32), [1.0, 2.0, 3.0, 4.0])
    record = _record(c)
    before = (list(record.values), c.version)
    record.fail_read = True
    with pytest.raises(OSError, match="injected read fault"):
        c[0]
    with pytest.raises(OSError, match="injected read fault"):
        Tensor(c, 0, dense(4))[1]
    destination = sw.CPU(0)
    with pytest.raises(OSError, match="injected read fault"):
        sw.move(Tensor(c, 0, dense(4)), destination)  # the request fails; every participant stays usable
    assert (list(record.values), c.version) == before
    assert not c.is_released() and not c.is_owned() and c.is_mutable() and record.releases == 0
    assert not destination.is_owned() and destination.is_mutable()
    record.fail_read = False
    assert read_all(c) == [1.0, 2.0, 3.0, 4.0]
    result = sw.move(Tensor(c, 0, dense(4)), destination)
    assert [result[i] for i in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert c.is_released() and record.releases == 1


def test_user_carrier_write_fault_propagates_and_leaves_it_usable():
    c = fill(ListCarrier(2, dtype=I32), [5, 6])
    record = _record(c)
    v = c.version
    record.fail_write = True
    with pytest.raises(OSError, match="injected write fault"):
        c[0] = 9
    with pytest.raises(OSError, match="injected write fault"):
        Tensor(c, 0, dense(2))[1] = 9
    source = fill(sw.CPU(2, dtype=I32), [1, 2])
    with pytest.raises(OSError, match="injected write fault"):
        sw.move(Tensor(source, 0, dense(2)), c)
    assert c.version == v and record.values == [5, 6]
    assert not source.is_released() and not source.is_owned() and read_all(source) == [1, 2]
    assert not c.is_owned() and c.is_mutable()
    record.fail_write = False
    c[0] = 9
    assert c.version == v + 1 and read_all(c) == [9, 6]


def test_user_carrier_registered_route_moves_between_its_own_kind():
    source = fill(ListCarrier(5, dtype=F32), [1.0, 2.0, 3.0, 4.0, 5.0])
    destination = ListCarrier(0, dtype=F32)
    calls = dict(ROUTE_CALLS)
    result = sw.move(Tensor(source, 1, Layout(Shape(2), Stride(2))), destination)
    assert ROUTE_CALLS == {"prepare": calls["prepare"] + 1, "submit": calls["submit"] + 1}
    assert result.carrier is destination and [result[0], result[1]] == [2.0, 4.0]
    assert source.is_released() and _record(source).releases == 1
    assert destination.size() == 3 and _record(destination).allocations == 2  # constructed empty, then grown


def test_user_carrier_storage_is_released_exactly_once_across_a_lifetime():
    """Constructions and releases counted through construction, new_like, allocate_like, moves and an Evictable."""
    start = len(LEDGER)
    a = fill(ListCarrier(4, dtype=F32), [1.0, 2.0, 3.0, 4.0])
    b = a.new_like([5.0, 6.0])
    c = a.allocate_like(4, empty=True)
    moved = sw.move(Tensor(a, 0, dense(4)), ListCarrier(0, dtype=F32))  # route; releases a
    to_cpu = sw.move(moved, sw.CPU(0))  # fallback; releases moved.carrier
    back = sw.move(to_cpu, ListCarrier(0, dtype=F32))  # fallback; releases the CPU carrier
    ev = sw.Evictable(back.carrier, c)
    ev.evict()  # the primary is released and replaced by an empty one of its kind
    ev.promote()  # and again
    assert bits_of(read_all(ev), F32) == bits_of([1.0, 2.0, 3.0, 4.0], F32)
    ev.release()
    b.release()
    b.release()
    created = LEDGER[start:]
    assert len(created) >= 7  # a, b, c, two destinations, and evict/promote's replacements
    assert [s.releases for s in created] == [1] * len(created)


def test_user_carrier_construction_contract():
    with pytest.raises(TypeError, match="incompatible function arguments"):
        ListCarrier(2, F32)  # dtype is keyword-only
    start = len(LEDGER)
    with pytest.raises(TypeError, match="must be an int"):
        ListCarrier(2.0, dtype=F32)
    with pytest.raises(ValueError, match=">= 0"):
        ListCarrier(-1, dtype=F32)
    with pytest.raises(TypeError, match="storage dtype"):
        ListCarrier(2, dtype=F64)
    with pytest.raises(TypeError, match="dtype must be a DType"):
        ListCarrier(2, dtype="Float32")
    assert len(LEDGER) == start  # refused before the provider allocated anything
    unregistered = type("Unregistered", (sw.Carrier,), {})
    with pytest.raises(TypeError, match="has no carrier definition"):
        unregistered(2, dtype=F32)


# ---------------------------------------------------------------- the mapping cache (Note [Mapping cache])


def default_mapping_cache_limit() -> int:
    """1 GiB, or a sixteenth of the machine's memory where that is less."""
    sixteenth = os.sysconf("SC_PHYS_PAGES") // 16 * os.sysconf("SC_PAGESIZE")
    return min(1 << 30, sixteenth)


@pytest.fixture
def long_decay():
    """An hour's decay while the test runs: the trimming thread unmaps nothing while it counts bytes."""
    previous = sw.set_mapping_cache_decay(3600)
    try:
        yield
    finally:
        sw.set_mapping_cache_decay(previous)


def test_mapping_cache_limit_round_trips_and_bounds_what_is_kept(long_decay):
    previous = sw.set_mapping_cache_limit(8 << 20)
    try:
        assert previous == default_mapping_cache_limit()
        big = [sw.CPU(1 << 20) for _ in range(4)]  # 4 MiB each: mapped buffers
        del big  # freed: the cache keeps what fits in 8 MiB
        assert sw.mapping_cache_bytes() == 8 << 20
        assert sw.set_mapping_cache_limit(0) == 8 << 20  # 0 turns it off and unmaps what it held
        assert sw.mapping_cache_bytes() == 0
        small = sw.CPU(1 << 20)
        del small
        assert sw.mapping_cache_bytes() == 0
    finally:
        sw.set_mapping_cache_limit(previous)
    assert sw.set_mapping_cache_limit(previous) == previous


def test_mapping_cache_gives_freed_memory_back_after_the_decay():
    previous_limit = sw.set_mapping_cache_limit(0)  # empty, then room for the test's buffers
    sw.set_mapping_cache_limit(64 << 20)
    previous = sw.set_mapping_cache_decay(3600)
    try:
        assert previous == 2.0  # the default
        big = sw.CPU(1 << 20)  # 4 MiB: a mapped buffer
        del big
        assert sw.mapping_cache_bytes() == 4 << 20  # kept: freed less than an hour ago
        assert sw.set_mapping_cache_decay(0.02) == 3600.0
        # The trimming thread unmaps it about 20 ms after it was freed; a slow machine gets a minute.
        eventually(lambda: sw.mapping_cache_bytes() == 0, "the trimming thread unmapped the freed buffer", 60)
    finally:
        sw.set_mapping_cache_decay(previous)
        sw.set_mapping_cache_limit(previous_limit)


def test_mapping_cache_default_limit_is_a_sixteenth_of_a_memory_cgroup_limit():
    """A process in a memory cgroup limited to 512 MiB starts with a cache limit of a sixteenth of that (32 MiB),
    not of the machine's memory (it used to keep up to 1 GiB there, double the whole allowance's sixteenth at a
    1 GiB limit). Needs a writable memory cgroup (root, or a delegated subtree); skipped otherwise."""
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        from bigger_than_ram import Cgroup

        cg = Cgroup(512 << 20)
    except (SystemExit, OSError) as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    finally:
        sys.path.pop(0)
    try:
        code = "import strideweave as sw; print(sw.set_mapping_cache_limit(0))"
        inside = subprocess.run([sys.executable, "-c", code], preexec_fn=cg.enter, capture_output=True, text=True,
                                check=True)
        outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    finally:
        cg.close()
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert int(inside.stdout) == min(1 << 30, machine // 16, (512 << 20) // 16)
    assert int(outside.stdout) >= int(inside.stdout)


def test_mapping_cache_in_a_forked_child_gives_memory_back_and_reuses_it(long_decay):
    """The trimming thread does not survive fork(): the child starts its own, and the cache's lock is usable."""
    previous_limit = sw.set_mapping_cache_limit(0)
    sw.set_mapping_cache_limit(64 << 20)
    try:
        big = sw.CPU(1 << 20)
        del big
        assert sw.mapping_cache_bytes() == 4 << 20

        def child() -> bool:
            ok = sw.mapping_cache_bytes() == 4 << 20  # inherited
            again = sw.CPU(1 << 20)  # the inherited mapping is reused
            ok &= sw.mapping_cache_bytes() == 0
            del again
            sw.set_mapping_cache_decay(0.02)
            eventually(lambda: sw.mapping_cache_bytes() == 0, "the child's trimming thread unmapped the buffer")
            return ok

        # A notify just before fork() leaves the parent's trimmer, woken but not yet running, counted as a waiter
        # in the child's copy of the condition variable: the child's own notify and wait must not wait for it.
        sw.set_mapping_cache_decay(3600)
        check_in_forked_child(child, "the mapping cache", timeout_s=20)
        assert sw.mapping_cache_bytes() == 4 << 20  # the parent's cache is its own
    finally:
        sw.set_mapping_cache_limit(previous_limit)


@pytest.mark.parametrize("bad, exc, fragment", [
    (0, ValueError, "must be > 0"),
    (-1.5, ValueError, "must be > 0"),
    (float("nan"), ValueError, "must be > 0"),
    (400 * 24 * 3600, ValueError, "at most one year"),
    (1 << 2000, ValueError, "out of range"),
    (True, TypeError, "number of seconds"),
    ("2", TypeError, "number of seconds"),
])
def test_mapping_cache_decay_rejects_bad_values_and_keeps_the_decay(bad, exc, fragment):
    before = sw.set_mapping_cache_decay(5)
    try:
        with pytest.raises(exc, match=fragment):
            sw.set_mapping_cache_decay(bad)
        assert sw.set_mapping_cache_decay(5) == 5.0  # unchanged by the failed call
    finally:
        sw.set_mapping_cache_decay(before)


@pytest.mark.parametrize("bad, exc, fragment", [
    (-1, ValueError, "must be >= 0"),
    (1 << 70, ValueError, "out of range"),
    (1.5, TypeError, "takes an int"),
    (True, TypeError, "takes an int"),
    ("64", TypeError, "takes an int"),
])
def test_mapping_cache_limit_rejects_bad_values_and_keeps_the_limit(bad, exc, fragment):
    before = sw.set_mapping_cache_limit(32 << 20)
    try:
        with pytest.raises(exc, match=fragment):
            sw.set_mapping_cache_limit(bad)
        assert sw.set_mapping_cache_limit(32 << 20) == 32 << 20  # unchanged by the failed call
    finally:
        sw.set_mapping_cache_limit(before)
