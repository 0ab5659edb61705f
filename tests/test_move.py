"""Substrate §6: completion handles (AwaitResult / AwaitMove) and movement.

Pending states are driven by the test carrier in ``pending_carrier.py``
(transfers stay queued until the test completes or fails them), I/O failures by
the engine's test-only fault hooks (``_core._io_inject``). Nothing sleeps.
"""

from __future__ import annotations

import _thread
import errno
import gc
import inspect
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import pending_carrier as pc
import strideweave as sw
from pending_carrier import DEADLINE_S, PendingCarrier, SealedCarrier
from strideweave.carriers.extension import (
    CarrierDefinition,
    PreparedTransfer,
    StorageProvider,
    TransferProvider,
    TransferRoute,
    Unsupported,
    register_carrier_definition,
)
from devices import block_device, sized_file

F32 = sw.DType.Float32
I32 = sw.DType.Int32

FLOATS = [1.5, -2.0, 3.25, 0.0, 7.0, -0.5, 100.0, 2.75, -8.0, 0.125, 9.5, -3.0]
INTS = [3, -7, 11, 0, 42, -100000, 2**31 - 1, -(2**31), 5, 6, 7, 8]


# ---------------------------------------------------------------- helpers


def slots(c):
    return [c[i] for i in range(c.size())]


def values(t):
    return [t[i] for i in range(t.size())]


def state(c):
    """Everything a check 'before work' must leave alone."""
    released = c.is_released()
    return {
        "released": released,
        "owned": c.is_owned(),
        "mutable": c.is_mutable(),
        "version": c.version,
        "size": None if released else c.size(),
        "slots": None if released else slots(c),
    }


def cpu_tensor(vals, dtype=F32):
    return sw.friendly.tensor(vals, dtype=dtype)


def strided_layout():
    # 2 x (2 x 2) elements, scattered over 12 slots: not contiguous, cosize 12.
    return sw.Layout(sw.Shape([2, [2, 2]]), sw.Stride([6, [1, 3]]))


@pytest.fixture(autouse=True)
def _no_pending_transfers_left():
    """A test must settle every transfer it starts; leftovers are failed so no library thread stays blocked."""
    yield
    left = pc.settle_all(RuntimeError("failed by the test teardown"))
    assert left == 0, f"the test left {left} transfer(s) pending"


@pytest.fixture
def io_faults():
    """The engine's fault hooks; every fault is cleared when the test ends, pass or fail."""
    yield sw._core._io_inject
    sw._core._io_clear()


@pytest.fixture
def arena(tmp_path):
    """A BlockDevice over a preallocated 32 MiB file."""
    return block_device(str(tmp_path / "arena.bin"), 32 << 20)


# ---------------------------------------------------------------- carrier factories (one per kind)


def make_carrier(kind, vals, dtype, arena=None, size=None):
    """A carrier of `kind` holding `vals` in its first slots (size `size`, default len(vals))."""
    n = len(vals) if size is None else size
    if kind == "pending":
        c = PendingCarrier(n, dtype=dtype)
        for i, v in enumerate(vals):
            c._slots[i] = v
        return c
    if kind == "generic":
        zero = 0 if dtype is I32 else 0.0
        return sw.Generic(list(vals) + [zero] * (n - len(vals)), dtype=dtype)
    if kind == "cpu":
        c = sw.CPU(n, dtype=dtype)
    elif kind == "file":
        c = sw.FileBacked(dtype=dtype).allocate_like(n)
    elif kind == "block":
        c = arena.allocate(n, dtype=dtype)
    else:
        raise AssertionError(kind)
    for i, v in enumerate(vals):
        c[i] = v
    return c


def empty_destination(kind, dtype, arena=None):
    if kind == "pending":
        return pc.destination(dtype=dtype)
    if kind == "generic":
        return sw.Generic([], dtype=dtype)
    if kind == "cpu":
        return sw.CPU(0, dtype=dtype)
    if kind == "file":
        return sw.FileBacked(dtype=dtype)
    if kind == "block":
        return arena.allocate(0, dtype=dtype)
    raise AssertionError(kind)


def run_move(tensor, dest):
    """move_async + (when the pending route queued a transfer) complete it + wait."""
    h = sw.move_async(tensor, dest)
    for t in pc.pending_transfers():
        t.complete()
    return pc.wait_handle(h)


# ================================================================ §6 checks, each before work


class TestChecksBeforeWork:
    @pytest.mark.parametrize(
        "bad", [None, 1.5, [1.0, 2.0], "tensor", sw.CPU(2), sw.column_major(2)],
        ids=["None", "float", "list", "str", "carrier", "layout"],
    )
    def test_not_a_tensor(self, bad):
        dest = sw.CPU(0)
        before = state(dest)
        for call in (sw.move_async, sw.move):
            with pytest.raises(TypeError, match="tensor must be a Tensor"):
                call(bad, dest)
        assert state(dest) == before

    def test_source_released(self):
        t = cpu_tensor(FLOATS[:4])
        t.carrier.release()
        dest = sw.CPU(0)
        before, src_before = state(dest), state(t.carrier)
        for call in (sw.move_async, sw.move):
            with pytest.raises(RuntimeError, match="released"):
                call(t, dest)
        assert state(dest) == before and state(t.carrier) == src_before

    def test_source_owned_by_a_composite(self):
        primary = make_carrier("cpu", FLOATS[:4], F32)
        ev = sw.Evictable(primary, sw.FileBacked())
        t = sw.Tensor(primary, 0, sw.column_major(4))
        dest = sw.CPU(0)
        before, src_before = state(dest), state(primary)
        assert src_before["owned"]
        with pytest.raises(RuntimeError, match="owned"):
            sw.move_async(t, dest)
        assert state(dest) == before and state(primary) == src_before
        assert not ev.is_released()

    def test_source_owned_by_a_pending_move(self):
        t = pc.pending_tensor(FLOATS[:4])
        first = sw.move_async(t, pc.destination())
        dest = sw.CPU(0)
        before = state(dest)
        with pytest.raises(RuntimeError, match="owned"):
            sw.move_async(t, dest)
        assert state(dest) == before
        pc.take().complete()
        pc.wait_handle(first)

    @pytest.mark.parametrize("bad", [None, sw.CPU, "cpu", 3, object()], ids=["None", "class", "str", "int", "object"])
    def test_destination_not_a_carrier(self, bad):
        t = cpu_tensor(FLOATS[:4])
        before = state(t.carrier)
        for call in (sw.move_async, sw.move):
            with pytest.raises(TypeError, match="Carrier instance"):
                call(t, bad)
        assert state(t.carrier) == before

    def test_destination_is_a_tensor(self):
        t, other = cpu_tensor(FLOATS[:4]), cpu_tensor(FLOATS[4:8])
        before, other_before = state(t.carrier), state(other.carrier)
        with pytest.raises(TypeError, match="Carrier instance"):
            sw.move_async(t, other)
        assert state(t.carrier) == before and state(other.carrier) == other_before

    @pytest.mark.parametrize("kind", ["cpu", "generic", "file", "pending"])
    def test_own_carrier(self, kind):
        c = make_carrier(kind, FLOATS[:4], F32)
        t = sw.Tensor(c, 0, sw.column_major(4))
        before = state(c)
        with pytest.raises(ValueError, match="own carrier"):
            sw.move_async(t, c)
        assert state(c) == before

    def test_own_carrier_through_another_view(self):
        c = make_carrier("cpu", FLOATS[:8], F32)
        t = sw.Tensor(c, 4, sw.column_major(4))
        before = state(c)
        with pytest.raises(ValueError, match="own carrier"):
            sw.move(t, c)
        assert state(c) == before

    def test_destination_released(self):
        t = cpu_tensor(FLOATS[:4])
        dest = sw.CPU(0)
        dest.release()
        before, src_before = state(dest), state(t.carrier)
        with pytest.raises(RuntimeError, match="released"):
            sw.move_async(t, dest)
        assert state(dest) == before and state(t.carrier) == src_before

    @pytest.mark.parametrize("kind", ["cpu", "generic", "file", "pending"])
    def test_destination_created_immutable(self, kind):
        t = cpu_tensor(FLOATS[:4])
        if kind == "pending":
            dest = pc.destination(mutable=False)
        elif kind == "generic":
            dest = sw.Generic([], mutable=False)
        elif kind == "file":
            dest = sw.FileBacked(mutable=False)
        else:
            dest = sw.CPU(0, mutable=False)
        before, src_before = state(dest), state(t.carrier)
        with pytest.raises(RuntimeError, match="not publicly mutable"):
            sw.move_async(t, dest)
        assert state(dest) == before and state(t.carrier) == src_before

    def test_destination_owned_by_a_composite(self):
        primary = sw.CPU(4)
        ev = sw.Evictable(primary, sw.FileBacked())
        t = cpu_tensor(FLOATS[:4])
        before, src_before = state(primary), state(t.carrier)
        assert before["owned"]
        with pytest.raises(RuntimeError, match="not publicly mutable"):
            sw.move_async(t, primary)
        assert state(primary) == before and state(t.carrier) == src_before
        assert not ev.is_released()

    def test_destination_owned_by_a_pending_move(self):
        src = pc.pending_tensor(FLOATS[:4])
        busy = pc.destination()
        h = sw.move_async(src, busy)
        t = cpu_tensor(FLOATS[4:8])
        before = state(t.carrier)
        with pytest.raises(RuntimeError, match="not publicly mutable"):
            sw.move_async(t, busy)
        assert state(t.carrier) == before
        pc.take().complete()
        pc.wait_handle(h)

    @pytest.mark.parametrize(
        "src_dtype, dest",
        [
            (F32, lambda: sw.CPU(0, dtype=I32)),
            (I32, lambda: sw.CPU(0, dtype=F32)),
            (F32, lambda: sw.FileBacked(dtype=I32)),
            (sw.DType.Bool, lambda: sw.Generic([], dtype=F32)),
            (F32, lambda: pc.destination(dtype=I32)),
        ],
    )
    def test_dtype_mismatch(self, src_dtype, dest):
        vals = [True, False, True, True] if src_dtype is sw.DType.Bool else (INTS[:4] if src_dtype is I32 else FLOATS[:4])
        t = cpu_tensor(vals, dtype=src_dtype)
        d = dest()
        before, src_before = state(d), state(t.carrier)
        with pytest.raises(TypeError, match="dtype"):
            sw.move_async(t, d)
        assert state(d) == before and state(t.carrier) == src_before

    @pytest.mark.parametrize(
        "dest",
        [
            lambda: make_carrier("cpu", [9.0, 8.0, 7.0], F32),
            lambda: make_carrier("generic", [9.0], F32),
            lambda: make_carrier("file", [9.0, 8.0], F32),
            lambda: make_carrier("pending", [9.0, 8.0, 7.0], F32),
        ],
    )
    def test_destination_too_small_and_not_allocatable(self, dest):
        t = cpu_tensor(FLOATS[:4])
        d = dest()
        before, src_before = state(d), state(t.carrier)
        with pytest.raises(ValueError, match="not allocatable"):
            sw.move_async(t, d)
        assert state(d) == before and state(t.carrier) == src_before

    def test_extent_is_the_layout_cosize_not_the_element_count(self):
        # 2 elements at slots 0 and 3: cosize 4.
        c = make_carrier("cpu", [1.0, 2.0, 3.0, 4.0], F32)
        t = sw.Tensor(c, 0, sw.Layout(sw.Shape(2), sw.Stride(3)))
        small = make_carrier("cpu", [0.0, 0.0, 0.0], F32)
        before, src_before = state(small), state(c)
        with pytest.raises(ValueError, match="not allocatable"):
            sw.move(t, small)
        assert state(small) == before and state(c) == src_before
        r = sw.move(t, sw.CPU(4))
        assert values(r) == [1.0, 4.0]

    @pytest.mark.parametrize(
        "src, dest",
        [
            (lambda: pc.sealed_tensor(FLOATS[:4]), lambda: sw.CPU(0)),
            (lambda: cpu_tensor(FLOATS[:4]), lambda: SealedCarrier(0, dtype=F32)),
            (lambda: pc.sealed_tensor(FLOATS[:4]), lambda: pc.destination()),
            (lambda: pc.pending_tensor(FLOATS[:4]), lambda: SealedCarrier(0, dtype=F32)),
            (lambda: pc.sealed_tensor(FLOATS[:4]), lambda: SealedCarrier(0, dtype=F32)),
            (lambda: pc.pending_tensor(FLOATS[:4]), lambda: sw.Evictable(sw.CPU(4), sw.FileBacked())),
            (lambda: sw.Tensor(sw.Evictable(make_carrier("cpu", FLOATS[:4], F32), sw.FileBacked()), 0, sw.column_major(4)),
             lambda: pc.destination()),
        ],
        ids=["sealed-cpu", "cpu-sealed", "sealed-pending", "pending-sealed", "sealed-sealed", "pending-evictable",
             "evictable-pending"],
    )
    def test_no_route(self, src, dest):
        t, d = src(), dest()
        before, src_before = state(d), state(t.carrier)
        with pytest.raises(NotImplementedError, match="no route"):
            sw.move_async(t, d)
        assert state(d) == before and state(t.carrier) == src_before


# ---------------------------------------------------------------- order: the earlier rule wins


def _released(t):
    t.carrier.release()
    return t


def _order_cases():
    small_int = lambda: make_carrier("cpu", [1, 2], I32)  # noqa: E731
    return [
        # (id, build() -> (tensor, destination), exception, fragment)
        ("tensor-before-destination", lambda: ("nope", "nope"), TypeError, "tensor must be a Tensor"),
        ("tensor-before-released-destination", lambda: (None, _dead(sw.CPU(0))), TypeError, "tensor must be a Tensor"),
        ("source-before-destination-type", lambda: (_released(cpu_tensor(FLOATS[:4])), "nope"), RuntimeError, "released"),
        ("source-before-own-carrier", lambda: _own(_released(cpu_tensor(FLOATS[:4]))), RuntimeError, "released"),
        ("source-before-dtype", lambda: (_released(cpu_tensor(FLOATS[:4])), sw.CPU(0, dtype=I32)), RuntimeError, "released"),
        ("source-before-route", lambda: (_released(pc.sealed_tensor(FLOATS[:4])), sw.CPU(0)), RuntimeError, "released"),
        ("destination-type-before-route", lambda: (pc.sealed_tensor(FLOATS[:4]), None), TypeError, "Carrier instance"),
        ("own-carrier-before-immutable", lambda: _own(sw.Tensor(sw.CPU(4, mutable=False), 0, sw.column_major(4))), ValueError, "own carrier"),
        ("own-carrier-before-route", lambda: _own(pc.sealed_tensor(FLOATS[:4])), ValueError, "own carrier"),
        ("released-destination-before-dtype", lambda: (cpu_tensor(FLOATS[:4]), _dead(sw.CPU(0, dtype=I32))), RuntimeError, "released"),
        ("immutable-destination-before-dtype", lambda: (cpu_tensor(FLOATS[:4]), sw.CPU(0, dtype=I32, mutable=False)), RuntimeError, "not publicly mutable"),
        ("immutable-destination-before-size", lambda: (cpu_tensor(FLOATS[:4]), sw.CPU(2, mutable=False)), RuntimeError, "not publicly mutable"),
        ("immutable-destination-before-route", lambda: (pc.sealed_tensor(FLOATS[:4]), sw.CPU(0, mutable=False)), RuntimeError, "not publicly mutable"),
        ("dtype-before-size", lambda: (cpu_tensor(FLOATS[:4]), small_int()), TypeError, "dtype"),
        ("dtype-before-route", lambda: (pc.sealed_tensor(FLOATS[:4]), sw.CPU(0, dtype=I32)), TypeError, "dtype"),
        ("size-before-route", lambda: (pc.sealed_tensor(FLOATS[:4]), make_carrier("cpu", [0.0], F32)), ValueError, "not allocatable"),
        ("size-before-route-evictable", lambda: (pc.pending_tensor(FLOATS[:4]), sw.Evictable(sw.CPU(2), sw.FileBacked())), ValueError, "not allocatable"),
    ]


def _dead(c):
    c.release()
    return c


def _own(t):
    return t, t.carrier


@pytest.mark.parametrize("build, exc, fragment", [c[1:] for c in _order_cases()], ids=[c[0] for c in _order_cases()])
def test_check_order_earlier_rule_wins(build, exc, fragment):
    t, d = build()
    watched = [c for c in (getattr(t, "carrier", None), d) if isinstance(c, sw.Carrier)]
    before = [state(c) for c in watched]
    with pytest.raises(exc, match=fragment):
        sw.move_async(t, d)
    assert [state(c) for c in watched] == before


# ================================================================ success semantics

KINDS = ["cpu", "generic", "file", "block"]


@pytest.mark.parametrize("dst_kind", KINDS + ["pending"])
@pytest.mark.parametrize("src_kind", KINDS + ["pending"])
@pytest.mark.parametrize("shape", ["dense", "strided"])
def test_move_between_kinds(src_kind, dst_kind, shape, arena):
    if shape == "dense":
        layout, offset, size = sw.column_major(4, 2), 0, 8
    else:
        layout, offset = strided_layout(), 3
        size = offset + layout.cosize + 2
    vals = [float(i * 7 % 11) - 4.5 for i in range(size)]
    src = make_carrier(src_kind, vals, F32, arena)
    t = sw.Tensor(src, offset, layout)
    expected = values(t)
    dest = empty_destination(dst_kind, F32, arena)
    v0 = dest.version
    r = run_move(t, dest)
    assert isinstance(r, sw.Tensor)
    assert r.carrier is dest and r.offset == 0 and r.layout == layout
    assert values(r) == expected
    for i in range(layout.size):  # physically placed by the layout from slot 0
        assert dest[layout(i)] == vals[offset + layout(i)]
    assert dest.size() >= layout.cosize
    assert dest.version > v0
    assert src.is_released() and not src.is_owned()
    assert not dest.is_owned() and dest.is_mutable() and not dest.is_released()
    with pytest.raises(RuntimeError, match="released"):
        src[0]


@pytest.mark.parametrize("dst_kind", KINDS + ["pending"])
def test_move_int32_into_a_presized_destination(dst_kind, arena):
    t = cpu_tensor(INTS[:6], dtype=I32)
    dest = make_carrier(dst_kind, [0] * 10, I32, arena)
    v0 = dest.version
    r = run_move(t, dest)
    assert r.carrier is dest and r.offset == 0 and r.layout == t.layout
    assert values(r) == INTS[:6] and r.dtype() is I32
    assert dest.size() == 10 and dest.version > v0
    assert t.carrier.is_released()


def test_move_into_and_out_of_a_resident_evictable():
    ev = sw.Evictable(sw.CPU(6), sw.FileBacked())  # not allocatable: it must be large enough
    t = cpu_tensor(FLOATS[:6])
    v0 = ev.version
    r = sw.move(t, ev)
    assert r.carrier is ev and values(r) == FLOATS[:6] and ev.version > v0 and t.carrier.is_released()
    back = sw.move(r, sw.CPU(0))
    assert values(back) == FLOATS[:6] and ev.is_released()


def test_move_from_an_evicted_evictable_fails_and_leaves_it_intact():
    ev = sw.Evictable(make_carrier("cpu", FLOATS[:4], F32), sw.FileBacked())
    t = sw.Tensor(ev, 0, sw.column_major(4))
    ev.evict()
    dest = sw.CPU(0)
    v0 = ev.version
    with pytest.raises(RuntimeError, match="evicted"):
        sw.move(t, dest)
    assert ev.is_evicted() and not ev.is_owned() and not ev.is_released() and ev.version == v0
    assert not dest.is_owned()
    ev.promote()
    assert values(sw.move(t, dest)) == FLOATS[:4] and ev.is_released()


def test_move_into_an_evicted_evictable_fails_and_leaves_the_source_intact():
    ev = sw.Evictable(sw.CPU(4), sw.FileBacked())
    ev.evict()
    t = cpu_tensor(FLOATS[:4])
    before = state(t.carrier)
    with pytest.raises(RuntimeError, match="evicted"):
        sw.move(t, ev)
    assert state(t.carrier) == before and not ev.is_owned() and ev.is_evicted()
    ev.promote()
    assert values(sw.move(t, ev)) == FLOATS[:4]


def test_result_is_published_before_the_source_is_released():
    """Success publishes Tensor(destination, 0, layout), then releases the source:
    at the moment the source is released the move is not yet terminal, so the
    destination is still owned and the handle not done."""
    t = pc.pending_tensor(FLOATS[:4])
    dest = pc.destination()
    h = sw.move_async(t, dest)
    seen = {}

    def probe(c):
        seen["dest_owned"] = dest.is_owned()
        seen["done"] = h.done
        seen["dest_values"] = list(dest._slots)

    t.carrier.on_release = probe
    pc.take().complete()
    pc.wait_handle(h)
    assert seen == {"dest_owned": True, "done": False, "dest_values": FLOATS[:4]}
    assert not dest.is_owned() and t.carrier.release_calls == 1


def test_pending_route_request_and_single_submit():
    c = make_carrier("pending", FLOATS[:10], F32)
    t = sw.Tensor(c, 1, sw.Layout(sw.Shape(2, 2), sw.Stride(1, 4)))
    dest = pc.destination()
    h = sw.move_async(t, dest)
    (transfer,) = pc.pending_transfers()
    req = transfer.request
    assert req.tensor is t and req.destination is dest
    assert req.source_class is PendingCarrier and req.destination_class is PendingCarrier
    assert req.dtype is F32 and req.layout == t.layout
    assert req.physical_span == t.layout.cosize and type(req.physical_span) is int  # slots covered, from t.offset
    assert dest.size() >= t.layout.cosize  # the destination was allocated for the route
    transfer.complete()
    r = pc.wait_handle(h)
    assert values(r) == [FLOATS[1], FLOATS[2], FLOATS[5], FLOATS[6]]
    assert c.prepare_calls == 1 and c.submit_calls == 1 and transfer.wait_calls >= 1


# ================================================================ AwaitResult / AwaitMove


class TestHandles:
    @pytest.mark.parametrize("args", [(), (1,), (None, None)])
    def test_only_the_framework_creates_handles(self, args):
        with pytest.raises(TypeError, match="created by the framework"):
            sw.AwaitResult(*args)
        with pytest.raises(TypeError, match="created by the framework"):
            sw.AwaitMove(*args)

    def test_handle_types(self):
        t = cpu_tensor(FLOATS[:2])
        h = sw.move_async(t, sw.CPU(0))
        assert type(h) is sw.AwaitMove and isinstance(h, sw.AwaitResult)
        assert issubclass(sw.AwaitMove, sw.AwaitResult)
        h.wait()

    def test_no_await(self):
        h = sw.move_async(cpu_tensor(FLOATS[:2]), sw.CPU(0))
        h.wait()
        for obj in (h, sw.AwaitResult, sw.AwaitMove):
            assert not hasattr(obj, "__await__")
        assert not inspect.isawaitable(h)

    def test_a_handle_is_not_a_tensor(self):
        t = pc.pending_tensor(FLOATS[:4])
        dest = pc.destination()
        h = sw.move_async(t, dest)
        assert not isinstance(h, sw.Tensor)
        other = cpu_tensor(FLOATS[:4])
        other_before = state(other.carrier)
        with pytest.raises(TypeError, match="tensor must be a Tensor"):
            sw.move_async(h, sw.CPU(0))
        with pytest.raises(TypeError, match="tensor must be a Tensor"):
            sw.move(h, sw.CPU(0))
        with pytest.raises(TypeError, match="Carrier instance"):
            sw.move_async(other, h)
        with pytest.raises(TypeError, match="Carrier"):
            sw.Tensor(h, 0, sw.column_major(4))
        assert state(other.carrier) == other_before
        pc.take().complete()
        r = pc.wait_handle(h)
        assert not isinstance(h, sw.Tensor) and isinstance(r, sw.Tensor)

    def test_done_while_pending_and_after(self):
        t = pc.pending_tensor(FLOATS[:4])
        h = sw.move_async(t, pc.destination())
        transfer = pc.take()
        assert h.done is False and transfer.done is False
        assert "pending" in repr(h)
        assert h.done is False  # still: nothing completes it but the test
        transfer.complete()
        pc.wait_handle(h)
        assert h.done is True and "done" in repr(h)

    def test_wait_returns_the_same_object_every_time(self):
        t = pc.pending_tensor(FLOATS[:4])
        h = sw.move_async(t, pc.destination())
        n = 6
        barrier = threading.Barrier(n + 1)
        got = [None] * n

        def waiter(k):
            barrier.wait()
            got[k] = h.wait()

        threads = [threading.Thread(target=waiter, args=(k,), daemon=True) for k in range(n)]
        for th in threads:
            th.start()
        barrier.wait()
        pc.take().complete()
        for th in threads:
            th.join(DEADLINE_S)
            assert not th.is_alive()
        first = got[0]
        assert isinstance(first, sw.Tensor)
        assert all(r is first for r in got)
        assert all(h.wait() is first for _ in range(5))
        assert sw.move(cpu_tensor([1.0]), sw.CPU(0)) is not first

    def test_failed_wait_raises_the_same_exception_every_time(self):
        t = pc.pending_tensor(FLOATS[:4])
        src_before = state(t.carrier)
        h = sw.move_async(t, pc.destination())
        err = RuntimeError("the device went away")
        n = 6
        barrier = threading.Barrier(n + 1)
        caught = [None] * n

        def waiter(k):
            barrier.wait()
            try:
                h.wait()
            except BaseException as e:  # noqa: BLE001
                caught[k] = e

        threads = [threading.Thread(target=waiter, args=(k,), daemon=True) for k in range(n)]
        for th in threads:
            th.start()
        barrier.wait()
        pc.take().fail(err)
        for th in threads:
            th.join(DEADLINE_S)
            assert not th.is_alive()
        assert all(e is err for e in caught)
        for _ in range(3):
            with pytest.raises(RuntimeError) as info:
                h.wait()
            assert info.value is err
        assert h.done
        assert state(t.carrier) == src_before

    def test_both_carriers_are_owned_while_pending(self):
        t = pc.pending_tensor(FLOATS[:4])
        src = t.carrier
        dest = pc.destination()
        h = sw.move_async(t, dest)
        for c in (src, dest):
            assert c.is_owned() and not c.is_mutable()
            with pytest.raises(RuntimeError, match="owned"):
                c[0] = 1.0
            with pytest.raises(RuntimeError, match="owned"):
                c.release()
            with pytest.raises(RuntimeError, match="owned"):
                sw.Tensor(c, 0, sw.column_major(1))[0] = 1.0
            assert not c.is_released()
        # Others may read.
        assert src[1] == FLOATS[1] and t[2] == FLOATS[2]
        # Moves from either and into either are refused.
        view = sw.Tensor(dest, 0, sw.column_major(2))
        with pytest.raises(RuntimeError, match="owned"):
            sw.move_async(t, sw.CPU(0))
        with pytest.raises(RuntimeError, match="owned"):
            sw.move_async(view, sw.CPU(0))
        for c in (src, dest):
            with pytest.raises(RuntimeError, match="not publicly mutable"):
                sw.move_async(cpu_tensor(FLOATS[:4]), c)
        pc.take().complete()
        r = pc.wait_handle(h)
        assert not src.is_owned() and not dest.is_owned()
        assert src.is_released() and dest.is_mutable()
        v = dest.version
        r[0] = 5.0  # the destination is publicly writable again
        assert dest.version == v + 1 and r[0] == 5.0

    def test_failure_restores_ownership_and_leaves_the_source_unchanged(self):
        t = pc.pending_tensor(FLOATS[:6])
        src = t.carrier
        dest = pc.destination()
        src_before = state(src)
        h = sw.move_async(t, dest)
        err = OSError(errno.EIO, "simulated")
        pc.take().fail(err)
        with pytest.raises(OSError) as info:
            pc.wait_handle(h)
        assert info.value is err
        assert state(src) == src_before
        assert not dest.is_owned() and not dest.is_released()
        assert src.release_calls == 0
        # The identical move succeeds afterwards.
        h2 = sw.move_async(t, dest)
        pc.take().complete()
        r = pc.wait_handle(h2)
        assert values(r) == FLOATS[:6] and src.is_released()

    def test_dropping_a_pending_handle_neither_blocks_nor_cancels(self):
        t = pc.pending_tensor(FLOATS[:5])
        src, dest = t.carrier, pc.destination()
        h = sw.move_async(t, dest)
        transfer = pc.take()
        assert sys.getrefcount(h) <= 2  # nothing else holds the Python handle: it is collectable
        box = [h]
        del h
        dropped = threading.Event()

        def drop():
            box.clear()
            gc.collect()
            dropped.set()

        threading.Thread(target=drop, daemon=True).start()
        assert dropped.wait(DEADLINE_S), "dropping a pending handle blocked"
        # Not cancelled: still queued, both carriers still owned.
        assert not transfer.done and transfer in pc.pending_transfers()
        assert src.is_owned() and dest.is_owned() and not src.is_released()
        transfer.complete()
        assert src.released.wait(DEADLINE_S), "the move did not finish after its handle was dropped"
        assert src.is_released() and src.release_calls == 1
        assert dest._slots[:5] == FLOATS[:5]

    def test_wait_releases_the_interpreter_lock_and_is_interruptible(self):
        t = pc.pending_tensor(FLOATS[:3])
        h = sw.move_async(t, pc.destination())
        transfer = pc.take()
        entering, finished = threading.Event(), threading.Event()
        seen = []  # what the other threads saw, for the failure message

        def interrupter():
            # Runs only if wait() lets other Python threads run.
            if entering.wait(DEADLINE_S):
                frame = sys._current_frames().get(threading.main_thread().ident)
                where = inspect.getframeinfo(frame) if frame else None
                seen.append(f"interrupt_main at {time.monotonic() - start:.3f} s, the main thread in "
                            f"{where.function if where else '?'} (line {where.lineno if where else '?'}), "
                            f"handle done: {h.done}")
                _thread.interrupt_main()

        def safety_net():
            # A wait that ignores the interrupt would otherwise never return.
            if not finished.wait(DEADLINE_S):
                seen.append(f"the safety net completed the transfer at {time.monotonic() - start:.3f} s")
                transfer.complete()

        # Python's own SIGINT handler, whatever the process inherited: a process started with SIGINT ignored (a
        # command run in the background by a shell without job control) gets no handler at startup, and
        # interrupt_main() then does nothing.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=interrupter, daemon=True).start()
        threading.Thread(target=safety_net, daemon=True).start()
        start = time.monotonic()
        interrupted = False
        try:
            entering.set()
            h.wait()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signal.signal(signal.SIGINT, previous)
        returned = time.monotonic() - start
        finished.set()
        assert interrupted, f"wait() returned after {returned:.3f} s without KeyboardInterrupt; {seen}"
        # Interrupting the wait does not cancel the move.
        assert not transfer.done and not h.done and t.carrier.is_owned()
        transfer.complete()
        assert values(pc.wait_handle(h)) == FLOATS[:3]


# ================================================================ provider exceptions


class TestProviderExceptions:
    def _usable(self, src, dest, src_before):
        assert state(src) == src_before
        assert not dest.is_owned() and not dest.is_released() and dest.is_mutable()

    def test_prepare_raising_fails_only_that_request(self):
        t = pc.pending_tensor(FLOATS[:4])
        src, dest = t.carrier, pc.destination()
        src_before, dest_before = state(src), state(dest)
        err = LookupError("prepare exploded")
        src.prepare_error = err
        with pytest.raises(LookupError) as info:
            sw.move(t, dest)
        assert info.value is err
        self._usable(src, dest, src_before)
        assert state(dest) == dest_before and src.submit_calls == 0
        src.prepare_error = None
        r = run_move(t, dest)
        assert values(r) == FLOATS[:4]

    def test_submit_raising_fails_only_that_request(self):
        t = pc.pending_tensor(FLOATS[:4])
        src, dest = t.carrier, pc.destination()
        src_before = state(src)
        err = ArithmeticError("submit exploded")
        src.submit_error = err
        with pytest.raises(ArithmeticError) as info:
            sw.move(t, dest)
        assert info.value is err
        assert src.submit_calls == 1 and not pc.pending_transfers()
        self._usable(src, dest, src_before)
        src.submit_error = None
        r = run_move(t, dest)
        assert values(r) == FLOATS[:4] and src.is_released()

    @pytest.mark.parametrize("dst_kind", ["cpu", "generic", "file"])
    def test_read_raising_during_elementwise_fallback(self, dst_kind):
        t = pc.pending_tensor(FLOATS[:4])
        src = t.carrier
        dest = empty_destination(dst_kind, F32)
        src_before = state(src)
        err = KeyError("read exploded")
        src.read_error = err
        with pytest.raises(KeyError) as info:
            sw.move(t, dest)
        assert info.value is err
        src.read_error = None
        self._usable(src, dest, src_before)
        r = sw.move(t, dest)  # the identical move, into the same destination
        assert values(r) == FLOATS[:4] and src.is_released()

    def test_unsupported_falls_back_to_elementwise(self):
        t = pc.pending_tensor(FLOATS[:4])
        t.carrier.unsupported = "not today"
        dest = pc.destination()
        r = sw.move(t, dest)  # no transfer is queued: the element-wise fallback ran
        assert values(r) == FLOATS[:4] and not pc.pending_transfers()
        assert t.carrier.prepare_calls == 1 and t.carrier.submit_calls == 0


# ================================================================ element-wise fallback


@pytest.mark.parametrize("other", ["cpu", "generic", "file"])
@pytest.mark.parametrize("dtype", [F32, I32])
def test_elementwise_fallback_round_trip(other, dtype):
    vals = FLOATS if dtype is F32 else INTS
    c = make_carrier("cpu", vals, dtype)
    t = sw.Tensor(c, 1, sw.Layout(sw.Shape(2, 3), sw.Stride(1, 3)))
    expected = values(t)
    there = sw.move(t, pc.destination(dtype=dtype))
    assert isinstance(there.carrier, PendingCarrier) and there.layout == t.layout
    assert values(there) == expected and c.is_released()
    back = sw.move(there, empty_destination(other, dtype))
    assert values(back) == expected and there.carrier.is_released()
    assert there.carrier.release_calls == 1


def test_no_fallback_and_no_route():
    t = pc.sealed_tensor(FLOATS[:3])
    before = state(t.carrier)
    for dest in (sw.CPU(0), sw.Generic([]), sw.FileBacked(), pc.destination()):
        d_before = state(dest)
        with pytest.raises(NotImplementedError, match="no route from SealedCarrier"):
            sw.move(t, dest)
        assert state(dest) == d_before
    assert state(t.carrier) == before


# ---------------------------------------------------------------- a one-way route (no reverse route)


class OneWayCarrier(sw.Carrier):
    """Has a route to PendingCarrier (synchronous submit) and nothing else: no fallback, no reverse route."""


def _ow_allocate(c, n):
    c._slots = [0.0 if c.dtype() is F32 else 0] * n
    c.__dict__.setdefault("unsupported", None)


def _ow_release(c):
    c._slots = None


def _ow_prepare(request):
    src = request.tensor
    if src.carrier.unsupported:
        return Unsupported(src.carrier.unsupported)

    def submit():
        for i in range(request.layout.size):
            off = request.layout(i)
            request.destination._slots[off] = src.carrier._slots[src.offset + off]
        return None  # done synchronously

    return PreparedTransfer(submit)


register_carrier_definition(
    OneWayCarrier,
    CarrierDefinition(
        StorageProvider(
            lambda c, d: d is F32 or d is I32,
            lambda c: 0 if c._slots is None else len(c._slots),
            _ow_allocate,
            _ow_release,
            lambda c, i: c._slots[i],
            lambda c, i, v: c._slots.__setitem__(i, v),
        ),
        transfers=(TransferRoute(OneWayCarrier, PendingCarrier, "one-way", TransferProvider(_ow_prepare)),),
    ),
)


def _one_way(vals, dtype):
    c = OneWayCarrier(len(vals), dtype=dtype)
    c._slots[:] = vals
    return sw.Tensor(c, 0, sw.column_major(len(vals)))


def test_registered_route_with_synchronous_submit():
    t = _one_way(INTS[:4], I32)  # Int32 is not differentiable: no reverse route is needed
    dest = pc.destination(dtype=I32)
    r = sw.move(t, dest)
    assert r.carrier is dest and values(r) == INTS[:4] and t.carrier.is_released()


def test_missing_reverse_route_fails_before_work_in_grad_mode():
    t = _one_way(FLOATS[:4], F32)  # differentiable, grad mode on by default
    dest = pc.destination()
    before, d_before = state(t.carrier), state(dest)
    with pytest.raises(NotImplementedError, match="reverse route"):
        sw.move_async(t, dest)
    assert state(t.carrier) == before and state(dest) == d_before


def test_unsupported_without_fallback_is_no_route():
    t = _one_way(INTS[:4], I32)
    t.carrier.unsupported = "only on Tuesdays"
    dest = pc.destination(dtype=I32)
    before, d_before = state(t.carrier), state(dest)
    with pytest.raises(NotImplementedError, match="only on Tuesdays"):
        sw.move_async(t, dest)
    assert state(t.carrier) == before and state(dest) == d_before
    with pytest.raises(NotImplementedError, match="no route from OneWayCarrier to CPU"):
        sw.move_async(_one_way(INTS[:2], I32), sw.CPU(0, dtype=I32))


# ================================================================ fault injection at system-call sites

ERRNOS = [pytest.param(errno.EIO, "EIO", id="EIO"), pytest.param(errno.ENOSPC, "ENOSPC", id="ENOSPC")]


def _dense_source(kind, n, arena):
    """A dense Float32 tensor of n elements on `kind` (file/block sources are filled by a clean move)."""
    data = (np.arange(n, dtype=np.float32) * 0.5 - 3.0).astype(np.float32)
    t = sw.friendly.tensor(data)
    if kind != "cpu":
        t = sw.move(t, empty_destination(kind, F32, arena))
    return t, data


def _source_intact(t, data, v0):
    c = t.carrier
    assert not c.is_released() and not c.is_owned() and c.is_mutable()
    assert c.version == v0
    assert np.array_equal(np.asarray(t), data)


@pytest.mark.parametrize("err, name", ERRNOS)
@pytest.mark.parametrize(
    "src_kind, dst_kind, op",
    [
        ("cpu", "file", "pwrite"),
        ("file", "cpu", "pread"),
        ("cpu", "block", "pwrite"),
        ("block", "cpu", "pread"),
        ("file", "block", "pread"),
        ("file", "block", "pwrite"),
    ],
)
def test_io_fault_during_move(src_kind, dst_kind, op, err, name, io_faults, arena):
    t, data = _dense_source(src_kind, 1000, arena)
    v0 = t.carrier.version
    dest = empty_destination(dst_kind, F32, arena)
    io_faults(op, err)
    h = sw.move_async(t, dest)
    with pytest.raises(RuntimeError, match=rf"{op} of .*\({name}\)"):
        pc.wait_handle(h)
    with pytest.raises(RuntimeError, match=name):
        h.wait()
    sw._core._io_clear()
    _source_intact(t, data, v0)
    assert not dest.is_owned() and not dest.is_released()
    r = sw.move(t, dest)  # the identical move succeeds once the fault is gone
    assert r.carrier is dest and np.array_equal(np.asarray(r), data)
    assert t.carrier.is_released()


@pytest.mark.parametrize("err, name", ERRNOS)
@pytest.mark.parametrize("src_kind, dst_kind, op", [("cpu", "block", "pwrite"), ("block", "cpu", "pread")])
def test_io_fault_in_the_middle_of_a_large_move(src_kind, dst_kind, op, err, name, io_faults, arena):
    # 6 MiB plus a partial block: the block device moves it in several calls; the second one fails.
    n = (6 << 20) // 4 + 3
    t, data = _dense_source(src_kind, n, arena)
    v0 = t.carrier.version
    dest = empty_destination(dst_kind, F32, arena)
    io_faults(op, err, count=1, after=1)
    with pytest.raises(RuntimeError, match=name):
        sw.move(t, dest)
    sw._core._io_clear()
    _source_intact(t, data, v0)
    r = sw.move(t, dest)
    assert np.array_equal(np.asarray(r), data)


def test_io_fault_on_a_strided_file_source(io_faults):
    c = sw.FileBacked().allocate_like(20)
    for i in range(20):
        c[i] = float(i)
    t = sw.Tensor(c, 2, strided_layout())
    expected, v0 = values(t), c.version
    dest = sw.CPU(0)
    io_faults("pread", errno.EIO, count=1, after=2)  # the third contiguous run fails
    with pytest.raises(RuntimeError, match="EIO"):
        sw.move(t, dest)
    sw._core._io_clear()
    assert values(t) == expected and c.version == v0 and not c.is_owned()
    assert values(sw.move(t, dest)) == expected


@pytest.mark.parametrize("err, name", ERRNOS)
def test_open_fault_creating_a_file_destination(err, name, io_faults, tmp_path):
    t, data = _dense_source("cpu", 100, None)
    v0 = t.carrier.version
    io_faults("open", err, count=2)
    with pytest.raises(RuntimeError, match=rf"open of .*\({name}\)"):
        sw.FileBacked()
    with pytest.raises(RuntimeError, match=name):
        sw.FileBacked(tmp_path / "named.bin")
    sw._core._io_clear()
    _source_intact(t, data, v0)
    assert np.array_equal(np.asarray(sw.move(t, sw.FileBacked(tmp_path / "named.bin"))), data)


@pytest.mark.parametrize("err, name", ERRNOS)
def test_open_fault_creating_a_block_device(err, name, io_faults, tmp_path):
    path = sized_file(tmp_path / "dev.bin", 1 << 20)
    t, data = _dense_source("cpu", 100, None)
    v0 = t.carrier.version
    io_faults("open", err)  # one failure: it must surface, not be mistaken for "no O_DIRECT here"
    with pytest.raises(RuntimeError, match=rf"open of .*\({name}\)"):
        sw.BlockDevice(str(path))
    sw._core._io_clear()
    _source_intact(t, data, v0)
    dev = sw.BlockDevice(str(path))
    assert np.array_equal(np.asarray(sw.move(t, dev.allocate(0))), data)


def test_fault_hooks_validate_their_operation(io_faults):
    with pytest.raises(ValueError, match="unknown I/O operation"):
        io_faults("write", errno.EIO)


# ================================================================ bandwidth


def _raw_round_trip(buf):
    """Raw os.pwrite then os.preadv of `buf` through a fresh file in the default temp dir
    (like an anonymous FileBacked: created, written, read, removed); returns both times."""
    fd, path = tempfile.mkstemp(prefix="sw-raw-")
    try:
        t0 = time.perf_counter()
        off = 0
        while off < len(buf):
            off += os.pwrite(fd, buf[off:], off)
        write_s = time.perf_counter() - t0
        out = np.empty(len(buf) // 4, dtype=np.float32)
        view = memoryview(out).cast("B")
        t0 = time.perf_counter()
        off = 0
        while off < len(buf):
            off += os.preadv(fd, [view[off:]], off)
        read_s = time.perf_counter() - t0
        return write_s, read_s, out
    finally:
        os.close(fd)
        os.unlink(path)


def _ours_round_trip(data):
    t = sw.friendly.tensor(data)
    dest = sw.FileBacked()
    assert dest.is_anonymous()
    t0 = time.perf_counter()
    on_file = sw.move(t, dest)
    t1 = time.perf_counter()
    back = sw.move(on_file, sw.CPU(0))
    t2 = time.perf_counter()
    assert on_file.carrier is dest and t.carrier.is_released() and dest.is_released()
    return t1 - t0, t2 - t1, np.asarray(back)


def test_bandwidth_cpu_file_round_trip(capsys):
    n = (256 << 20) // 4  # 256 MiB of Float32
    # Random bit patterns (NaN payloads included): the round trip must be bit-exact.
    data = np.random.default_rng(1234).integers(0, 2**32, n, dtype=np.uint32).view(np.float32)
    bits = data.view(np.uint32)
    nbytes = data.nbytes
    raw_buf = memoryview(data).cast("B")
    ours_w, ours_r, raw_w, raw_r = [], [], [], []
    # Interleaved (alternating which side goes first), so both see the same page-cache and
    # machine-load conditions; the best of each is compared. Two repetitions (about 2 s on a
    # quiet machine); more, up to six, only while a figure is below the bar: on a shared machine
    # a neighbour's burst of CPU or I/O load can slow any single repetition of either side.
    for rep in range(6):
        if rep >= 2 and max(ours_w) >= 0.5 * max(raw_w) and max(ours_r) >= 0.5 * max(raw_r):
            break
        for side in ("ours", "raw") if rep % 2 == 0 else ("raw", "ours"):
            if side == "ours":
                ws, rs, back = _ours_round_trip(data)
                ours_w.append(nbytes / ws / 1e9)
                ours_r.append(nbytes / rs / 1e9)
            else:
                ws, rs, back = _raw_round_trip(raw_buf)
                raw_w.append(nbytes / ws / 1e9)
                raw_r.append(nbytes / rs / 1e9)
            assert np.array_equal(back.view(np.uint32), bits), f"{side}: the round trip is not bit-exact"
            del back
    w, r, rw, rr = max(ours_w), max(ours_r), max(raw_w), max(raw_r)
    with capsys.disabled():
        print(
            f"\n[bandwidth 256 MiB, best of {len(ours_w)}] CPU->FileBacked {w:.2f} GB/s (raw pwrite {rw:.2f}); "
            f"FileBacked->CPU {r:.2f} GB/s (raw preadv {rr:.2f})"
        )
    assert w >= 0.5 * rw, f"CPU->FileBacked {w:.2f} GB/s < half of raw pwrite {rw:.2f} GB/s"
    assert r >= 0.5 * rr, f"FileBacked->CPU {r:.2f} GB/s < half of raw preadv {rr:.2f} GB/s"
