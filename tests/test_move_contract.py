"""The movement and extension contract (docs/guide.md, "Movement", "Adding a carrier kind"): routes by exact class,
resolved late; both carriers owned before the provider prepares; prepared
transfers kept until the move is terminal; completions that return values;
``physical_span``; the "no route" message; ``strideweave.carriers.move``.

Every user kind here is a list of slots made by :func:`list_kind`, with routes
whose submit copies the slots itself (synchronously, or through a completion
the test settles), so nothing sleeps: a test decides when a transfer ends.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref

import pytest

import strideweave as sw
from strideweave.carriers.extension import (
    CarrierDefinition,
    PreparedTransfer,
    StorageProvider,
    TransferProvider,
    TransferRoute,
    register_carrier_definition,
)

F32, I32 = sw.DType.Float32, sw.DType.Int32
DEADLINE_S = 60.0  # a bound for waits that only a bug could reach
_ids = itertools.count()


def _storage() -> StorageProvider:
    def allocate(c, n):
        c._slots = [0.0 if c.dtype() is F32 else 0] * n

    def release(c):
        c._slots = None

    return StorageProvider(
        lambda c, d: d is F32 or d is I32,
        lambda c: 0 if c.__dict__.get("_slots") is None else len(c._slots),
        allocate,
        release,
        lambda c, i: c._slots[i],
        lambda c, i, v: c._slots.__setitem__(i, v),
    )


def copy_slots(request) -> None:
    """Copies the request's logical elements through the destination's public slot writes (a provider may write
    its in-flight destination while the engine calls it)."""
    src = request.tensor
    for i in range(request.layout.size):
        off = request.layout(i)
        request.destination[off] = src.carrier._slots[src.offset + off]


def sync_provider(before=None) -> TransferProvider:
    """A route whose prepare calls ``before(request)`` (when given) and whose submit copies at once."""

    def prepare(request):
        if before is not None:
            before(request)

        def submit():
            copy_slots(request)
            return None

        return PreparedTransfer(submit)

    return TransferProvider(prepare)


def list_kind(base=sw.Carrier, routes_to=(), provider=sync_provider):
    """A fresh carrier class registered with list storage and a route to each class of ``routes_to``."""
    cls = type(f"ListKind{next(_ids)}", (base,), {})
    routes = tuple(TransferRoute(cls, dst if dst != "self" else cls, f"r{i}", provider())
                   for i, dst in enumerate(routes_to))
    register_carrier_definition(cls, CarrierDefinition(_storage(), transfers=routes))
    return cls


def tensor_on(cls, values, dtype=F32):
    c = cls(len(values), dtype=dtype)
    c._slots[:] = values
    return sw.Tensor(c, 0, sw.column_major(len(values)))


def state(c):
    released = c.is_released()
    return {"released": released, "owned": c.is_owned(), "version": c.version,
            "slots": None if released else [c[i] for i in range(c.size())]}


# ================================================================ routes by exact class, resolved late


def test_a_route_may_name_a_class_registered_later_and_two_kinds_route_both_ways():
    later = type(f"Later{next(_ids)}", (sw.Carrier,), {})
    first = list_kind(routes_to=(later,))  # `later` has no definition yet: accepted
    register_carrier_definition(later, CarrierDefinition(_storage(), transfers=(
        TransferRoute(later, first, "back", sync_provider()),)))
    t = tensor_on(first, [1.0, 2.0, 3.0])
    there = sw.move(t, later(0, dtype=F32))  # Float32 in grad mode: the reverse route is required, and exists
    assert type(there.carrier) is later and there.carrier._slots == [1.0, 2.0, 3.0] and t.carrier.is_released()
    back = sw.move(there, first(0, dtype=F32))
    assert type(back.carrier) is first and back.carrier._slots == [1.0, 2.0, 3.0]


def test_a_subclass_of_a_registered_class_is_a_kind_of_its_own_and_inherits_no_route():
    base = list_kind(routes_to=(sw.CPU,))
    sub = type(f"Sub{next(_ids)}", (base,), {})
    with pytest.raises(TypeError, match="no carrier definition"):
        sub(2, dtype=F32)  # not a kind until it is registered
    register_carrier_definition(sub, CarrierDefinition(_storage()))  # no routes of its own
    # Int32: not differentiable, so no reverse route is needed.
    assert sw.move(tensor_on(base, [5], I32), sw.CPU(0, dtype=I32)).carrier[0] == 5  # the parent's route works
    t = tensor_on(sub, [1, 2], I32)
    dest = sw.CPU(0, dtype=I32)
    before, d_before = state(t.carrier), state(dest)
    with pytest.raises(NotImplementedError, match=f"{sub.__name__}, CPU"):
        sw.move_async(t, dest)  # the parent's route is not inherited
    assert state(t.carrier) == before and state(dest) == d_before
    # A subclass with a route of its own uses it.
    sub2 = list_kind(base=base, routes_to=(sw.CPU,))
    assert sw.move(tensor_on(sub2, [7, 8], I32), sw.CPU(0, dtype=I32)).carrier[1] == 8


def test_a_subclass_of_a_shipped_base_is_still_refused():
    dep = type(f"Dep{next(_ids)}", (sw.DependentCarrier,), {})
    with pytest.raises(TypeError, match="shipped class .*DependentCarrier"):
        register_carrier_definition(dep, CarrierDefinition(_storage()))
    assert sw._core._definition_of(dep) is None


def test_no_route_names_both_classes_source_first():
    src = list_kind()  # no routes, no element-wise fallback
    t = tensor_on(src, [1.0])
    for dest in (sw.CPU(0), sw.FileBacked()):
        d_before = state(dest)
        with pytest.raises(NotImplementedError, match=f"{src.__name__}, {type(dest).__name__}"):
            sw.move_async(t, dest)
        assert state(dest) == d_before
    with pytest.raises(NotImplementedError, match=f"CPU, {src.__name__}"):
        sw.move_async(sw.friendly.tensor([1.0]), src(0, dtype=F32))


# ================================================================ both carriers are owned before the provider prepares


def test_both_carriers_are_owned_while_prepare_runs_and_the_provider_may_write_its_destination():
    entered, go = threading.Event(), threading.Event()
    seen = {}

    def slow_prepare(request):
        seen["owned"] = (request.tensor.carrier.is_owned(), request.destination.is_owned())
        request.destination[0] = 42.0  # the provider's own write to the in-flight destination is allowed
        entered.set()
        assert go.wait(DEADLINE_S)

    dst_cls = list_kind()
    src_cls = list_kind(routes_to=(dst_cls,), provider=lambda: sync_provider(slow_prepare))
    t = tensor_on(src_cls, [1.0, 2.0])
    with sw.no_grad():  # no reverse route needed for this test
        dest = dst_cls(2, dtype=F32)
        handles = []

        def move():
            with sw.no_grad():  # grad mode is per thread
                handles.append(sw.move_async(t, dest))

        mover = threading.Thread(target=move)
        mover.start()
        try:
            assert entered.wait(DEADLINE_S)
            # While prepare runs, public writes and release of either carrier refuse.
            for carrier in (t.carrier, dest):
                assert carrier.is_owned() and not carrier.is_mutable()
                with pytest.raises(RuntimeError, match="owned by a move"):
                    carrier[1] = 9.0
                with pytest.raises(RuntimeError, match="owned by a move"):
                    carrier.release()
                with pytest.raises(RuntimeError, match="owned by a move"):
                    sw.Tensor(carrier, 0, sw.column_major(2))[0] = 9.0
        finally:
            go.set()
            mover.join(DEADLINE_S)
        r = handles[0].wait()
    assert seen["owned"] == (True, True)
    assert r.carrier is dest and dest._slots == [1.0, 2.0] and t.carrier.is_released() and not dest.is_owned()


def test_a_failing_prepare_leaves_both_carriers_as_they_were():
    def provider():
        def prepare(request):
            raise KeyError("no such device")

        return TransferProvider(prepare)

    dst_cls = list_kind()
    src_cls = list_kind(routes_to=(dst_cls,), provider=provider)
    t = tensor_on(src_cls, [1.0, 2.0])
    dest = dst_cls(2, dtype=F32)
    before, d_before = state(t.carrier), state(dest)
    with sw.no_grad(), pytest.raises(KeyError, match="no such device"):
        sw.move_async(t, dest)
    assert state(t.carrier) == before and state(dest) == d_before
    dest[0] = 3.0  # both usable
    t.carrier.release()


# ================================================================ completions: lifetime and return value


class Completion:
    """A transfer completion the test settles: wait() (run by the engine) blocks until settle(), then copies the
    slots and returns `result`."""

    def __init__(self, request, result=None):
        self.request, self.result = request, result
        self._event = threading.Event()

    @property
    def done(self):
        return self._event.is_set()

    def settle(self):
        self._event.set()

    def wait(self):
        assert self._event.wait(DEADLINE_S)
        copy_slots(self.request)
        return self.result


def pending_provider(completions, result=None):
    def make():
        def prepare(request):
            def submit():
                c = Completion(request, result)
                completions.append(c)
                return c

            return PreparedTransfer(submit)

        return TransferProvider(prepare)

    return make


def test_the_prepared_transfer_and_its_submit_closure_live_until_the_move_is_terminal():
    completions = []
    dst_cls = list_kind()
    src_cls = list_kind(routes_to=(dst_cls,), provider=pending_provider(completions))
    refs = {}

    def start():  # the tensor and the destination are dropped on return
        t = tensor_on(src_cls, [1.0, 2.0, 3.0])
        dest = dst_cls(0, dtype=F32)
        return sw.move_async(t, dest)

    # Wrap the registered provider's prepare so the test can see the PreparedTransfer and its submit.
    route_provider = sw._core._definition_of(src_cls).transfers[0].provider
    original = route_provider.prepare

    def watching(request):
        prepared = original(request)
        refs["prepared"] = weakref.ref(prepared)
        refs["submit"] = weakref.ref(prepared.submit)
        return prepared

    object.__setattr__(route_provider, "prepare", watching)
    with sw.no_grad():
        h = start()
    gc.collect()
    # The caller holds nothing but the handle; the transfer is in flight.
    assert not h.done
    assert refs["prepared"]() is not None and refs["submit"]() is not None
    (completion,) = completions
    completions.clear()
    completion.settle()
    r = h.wait()
    assert r.carrier._slots == [1.0, 2.0, 3.0]
    del r, h, completion
    gc.collect()
    assert refs["prepared"]() is None and refs["submit"]() is None  # let go by the time the move is terminal


@pytest.mark.parametrize("returned", [True, 0, "done", [None]])
def test_a_completion_whose_wait_returns_a_value_fails_the_move_with_type_error(returned):
    completions = []
    dst_cls = list_kind()
    src_cls = list_kind(routes_to=(dst_cls,), provider=pending_provider(completions, result=returned))
    t = tensor_on(src_cls, [1.0, 2.0])
    dest = dst_cls(2, dtype=F32)
    before, d_before = state(t.carrier), state(dest)
    with sw.no_grad():
        h = sw.move_async(t, dest)
    (completion,) = completions
    completion.settle()  # copies, then wait() returns a value: a contract error
    with pytest.raises(TypeError, match="must return None"):
        h.wait()
    assert state(t.carrier) == before  # ownership restored, the source live and unchanged
    d_after = state(dest)
    # Not published: the move's own version step never came; the provider's two slot writes count as writes.
    assert not d_after["owned"] and d_after["version"] == d_before["version"] + 2
    dest[0] = 5.0  # usable
    assert not t.carrier.is_owned() and t.carrier.is_mutable()


def test_physical_span_is_the_number_of_slots_the_transfer_covers():
    seen = []

    dst_cls = list_kind()
    src_cls = list_kind(routes_to=(dst_cls,), provider=lambda: sync_provider(lambda r: seen.append(r.physical_span)))
    c = src_cls(20, dtype=F32)
    c._slots[:] = [float(i) for i in range(20)]
    t = sw.Tensor(c, 3, sw.Layout(sw.Shape(2, 3), sw.Stride(1, 5)))  # cosize 12 from offset 3
    with sw.no_grad():
        r = sw.move(t, dst_cls(0, dtype=F32))
    assert seen == [t.layout.cosize] and type(seen[0]) is int and t.layout.cosize == 12
    assert [r[(i, j)] for i in range(2) for j in range(3)] == [3.0 + i + 5 * j for i in range(2) for j in range(3)]


# ================================================================ strideweave.carriers.move


def test_the_move_module_exports_the_handles_and_move_async():
    import strideweave.carriers.move as move_module

    assert move_module.__all__ == ["AwaitResult", "AwaitMove", "move_async"]
    assert move_module.AwaitResult is sw.AwaitResult and move_module.AwaitMove is sw.AwaitMove
    assert move_module.move_async is sw.move_async


def test_handles_support_weak_references():
    h = sw.move_async(sw.friendly.tensor([1.0, 2.0]), sw.CPU(0))
    ref = weakref.ref(h)
    assert ref() is h
    r = h.wait()
    assert r[1] == 2.0
    del h
    gc.collect()
    assert ref() is None
    t = sw.friendly.tensor([1.0])
    assert weakref.ref(sw.move_async(t, sw.CPU(0)))  # every handle class (AwaitMove here) inherits it


def test_residency_and_projection_handles_support_weak_references_and_stay_collectable():
    primary = sw.CPU(8)  # a full primary seeds every tile (resident)
    for i in range(8):
        primary[i] = float(i)
    carrier = sw.TiledEvictable(primary, sw.FileBacked(), (1, 2), (2, 2))
    full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(2, [2, 2]), sw.Stride(1, [2, 4])))
    residency = carrier.evict_async(sw.TileSet([(0, 0)]))
    assert residency.wait() is None
    projection = carrier.project(full, sw.TileSelection([[0], [0]]), None)
    refs = [weakref.ref(residency), weakref.ref(projection)]
    assert [projection.wait()[i] for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    del residency, projection
    gc.collect()
    assert [r() for r in refs] == [None, None]
    carrier.release()


# ================================================================ user carrier kinds as tiers


class CountedTier(sw.Carrier):
    """A user storage kind that counts its provider calls (reads, writes, allocations, releases)."""


COUNTS = {"read": 0, "write": 0, "allocate": 0, "release": 0}


def _counted(name, fn):
    def call(*args):
        COUNTS[name] += 1
        return fn(*args)

    return call


register_carrier_definition(CountedTier, CarrierDefinition(StorageProvider(
    lambda c, d: d is F32,
    lambda c: 0 if c.__dict__.get("_slots") is None else len(c._slots),
    _counted("allocate", lambda c, n: setattr(c, "_slots", [0.0] * n)),
    _counted("release", lambda c: setattr(c, "_slots", None)),
    _counted("read", lambda c, i: c._slots[i]),
    _counted("write", lambda c, i, v: c._slots.__setitem__(i, v)),
)))


def test_a_user_carrier_kind_is_a_secondary_tier_through_promote_evict_project_scatter_and_release():
    for k in COUNTS:
        COUNTS[k] = 0
    secondary = CountedTier(8, dtype=F32)  # holds the full extent: every tile starts in the secondary
    secondary._slots[:] = [float(i) for i in range(8)]
    carrier = sw.TiledEvictable(sw.CPU(0), secondary, (1, 2), (2, 2))
    full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(2, [2, 2]), sw.Stride(1, [2, 4])))
    assert carrier.tile_state((0, 1)).location == "secondary" and secondary.is_owned()
    both = sw.TileSet([(0, 0), (0, 1)])
    carrier.promote(both)
    assert COUNTS["read"] == 8 and carrier.tile_state((0, 0)).location == "primary"
    w1 = carrier.project(full, sw.TileSelection([[0], [1]])).wait()
    assert [w1[i] for i in range(4)] == [4.0, 5.0, 6.0, 7.0]
    # A scatter makes a fresh carrier on tiers of the same kinds; its selected tile is dirty, and evicting it
    # writes through the user kind's provider.
    out = carrier.scatter(sw.friendly.tensor([[10.0, 30.0], [20.0, 40.0]]), full, sw.TileSelection([[0], [0]])).wait()
    writes = COUNTS["write"]
    out.carrier.evict(sw.TileSet([(0, 0)]))
    assert COUNTS["write"] == writes + 4 and out.carrier.tile_state((0, 0)).location == "secondary"
    assert [out[(i, (j, 0))] for j in range(2) for i in range(2)] == [10.0, 20.0, 30.0, 40.0]
    # Dirty tiles of the first carrier go back to its user-kind secondary on eviction.
    full[(0, (0, 1))] = -1.0  # tile (0, 1), slot 4
    carrier.evict(both)
    assert secondary._slots[4] == -1.0 and carrier.tile_state((0, 1)).location == "secondary"
    released = COUNTS["release"]
    carrier.release()
    assert secondary.is_released() and COUNTS["release"] == released + 1


def test_a_user_carrier_kind_is_a_primary_tier():
    primary = CountedTier(0, dtype=F32)
    secondary = sw.CPU(8)
    for i in range(8):
        secondary[i] = float(i)
    carrier = sw.TiledEvictable(primary, secondary, (1, 2), (2, 2))
    full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(2, [2, 2]), sw.Stride(1, [2, 4])))
    carrier.promote(sw.TileSet([(0, 1)]))
    assert carrier.tile_state((0, 1)).location == "primary"
    w1 = carrier.project(full, sw.TileSelection([[0], [1]])).wait()
    assert type(w1.carrier) is CountedTier and [w1[i] for i in range(4)] == [4.0, 5.0, 6.0, 7.0]
    full[(1, (1, 1))] = 70.0  # slot 7, in the resident tile
    carrier.evict(sw.TileSet([(0, 1)]))
    assert secondary[7] == 70.0
    carrier.release()
    assert primary.is_released() and secondary.is_released()


def test_reading_a_slot_never_changes_residency():
    for k in COUNTS:
        COUNTS[k] = 0
    secondary = CountedTier(8, dtype=F32)
    secondary._slots[:] = [float(i) for i in range(8)]
    carrier = sw.TiledEvictable(sw.CPU(0), secondary, (1, 2), (2, 2))
    full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(2, [2, 2]), sw.Stride(1, [2, 4])))
    stats = carrier.stats()
    assert [carrier[i] for i in range(8)] == [float(i) for i in range(8)]
    assert full[(1, (1, 1))] == 7.0
    assert COUNTS["read"] == 9  # one provider read a slot read, through the secondary
    assert [carrier.tile_state((0, j)).location for j in range(2)] == ["secondary", "secondary"]
    assert carrier.stats() == stats and carrier.primary_tiles == sw.TileSet()
    full[(1, (1, 1))] = 70.0  # a write promotes first
    assert carrier.tile_state((0, 1)).location == "primary" and carrier.tile_state((0, 0)).location == "secondary"
    carrier.release()
