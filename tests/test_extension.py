"""Substrate §7: the extension API (strideweave.carriers.extension).

Registration is permanent for a class, so every test that registers makes its
own fresh ``Carrier`` subclass (``fresh_class``).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools

import pytest

import strideweave as sw
from strideweave.carriers import extension as ext
from strideweave.carriers.extension import (
    CarrierDefinition,
    CarrierFacet,
    PreparedTransfer,
    StorageProvider,
    TransferProvider,
    TransferRequest,
    TransferRoute,
    Unsupported,
    register_carrier_definition,
)

F32, I32 = sw.DType.Float32, sw.DType.Int32

EXTENSION_NAMES = [
    "CarrierDefinition",
    "StorageProvider",
    "TransferProvider",
    "TransferRoute",
    "TransferRequest",
    "PreparedTransfer",
    "Unsupported",
    "CarrierFacet",
    "register_carrier_definition",
]

SHIPPED = [sw.Carrier, sw.DependentCarrier, sw.Generic, sw.CPU, sw.FileBacked, sw.BlockDeviceCarrier, sw.Evictable]

_ids = itertools.count()


def fresh_class(base=sw.Carrier):
    return type(f"UserCarrier{next(_ids)}", (base,), {})


class Recorder:
    """A list-backed StorageProvider that records every call (and the carrier it was given)."""

    def __init__(self, dtypes=(F32, I32)):
        self.dtypes = dtypes
        self.calls = []
        self.write_error = None
        self.allocate_error = None

    def provider(self, **overrides):
        fields = dict(
            supports_dtype=self.supports_dtype,
            physical_size=self.physical_size,
            allocate=self.allocate,
            release=self.release,
            read=self.read,
            write=self.write,
        )
        fields.update(overrides)
        return StorageProvider(**fields)

    def supports_dtype(self, c, dtype):
        return dtype in self.dtypes

    def physical_size(self, c):
        s = c.__dict__.get("_slots")
        return 0 if s is None else len(s)

    def allocate(self, c, n):
        self.calls.append(("allocate", c, n))
        if self.allocate_error is not None:
            raise self.allocate_error
        c._slots = [0.0 if c.dtype() is F32 else 0] * n

    def release(self, c):
        self.calls.append(("release", c))
        c._slots = None

    def read(self, c, i):
        self.calls.append(("read", c, i))
        return c._slots[i]

    def write(self, c, i, v):
        self.calls.append(("write", c, i, v))
        if self.write_error is not None:
            raise self.write_error
        c._slots[i] = v

    def count(self, name):
        return sum(1 for call in self.calls if call[0] == name)


def registered(rec=None, **definition):
    cls = fresh_class()
    rec = rec or Recorder()
    register_carrier_definition(cls, CarrierDefinition(rec.provider(), **definition))
    return cls, rec


def _noop(*args):
    return None


def _provider():
    return TransferProvider(lambda request: Unsupported("never"))


# ================================================================ module map


@pytest.mark.parametrize("name", EXTENSION_NAMES)
def test_extension_names_are_the_top_level_objects(name):
    assert getattr(ext, name) is getattr(sw, name)
    assert name in sw.__all__


def test_extension_module():
    assert set(ext.__all__) == set(EXTENSION_NAMES) and len(ext.__all__) == len(EXTENSION_NAMES)
    assert sw.extension is ext and sw.carriers.extension is ext


# ================================================================ value types


class _Facet(CarrierFacet):
    pass


def _values():
    src_cls = fresh_class()
    t = sw.friendly.tensor([1.0, 2.0])
    route = TransferRoute(src_cls, sw.CPU, "r", _provider())
    return {
        "StorageProvider": Recorder().provider(),
        "TransferRequest": TransferRequest(t, sw.CPU(0), sw.CPU, sw.Generic, F32, t.layout, 2),
        "TransferProvider": _provider(),
        "PreparedTransfer": PreparedTransfer(_noop),
        "TransferRoute": route,
        "Unsupported": Unsupported("because"),
        "CarrierDefinition": CarrierDefinition(Recorder().provider(), transfers=(route,), facets=(_Facet(),)),
    }


@pytest.mark.parametrize("kind", sorted(_values()))
def test_value_types_are_frozen(kind):
    value = _values()[kind]
    assert dataclasses.is_dataclass(value)
    for field in dataclasses.fields(value):
        before = getattr(value, field.name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field.name, before)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(value, field.name)
        assert getattr(value, field.name) is before
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.extra = 1
    assert not hasattr(value, "extra")


def test_value_types_compare_by_value():
    assert Unsupported("x") == Unsupported("x") and hash(Unsupported("x")) == hash(Unsupported("x"))
    assert Unsupported("x") != Unsupported("y")
    p = _provider()
    assert TransferRoute(sw.CPU, sw.Generic, "a", p) == TransferRoute(sw.CPU, sw.Generic, "a", p)


def test_storage_provider_defaults():
    sp = Recorder().provider()
    assert sp.elementwise_fallback is False
    assert StorageProvider(*[_noop] * 6, elementwise_fallback=True).elementwise_fallback is True


def test_carrier_definition_defaults_and_tuples():
    sp = Recorder().provider()
    d = CarrierDefinition(sp)
    assert d.storage is sp and d.transfers == () and d.composite is None and d.facets == ()
    cls = fresh_class()
    route = TransferRoute(cls, sw.CPU, "r", _provider())
    facet = _Facet()
    d = CarrierDefinition(sp, transfers=[route], facets=[facet])  # stored as tuples: frozen all the way down
    assert d.transfers == (route,) and type(d.transfers) is tuple
    assert d.facets == (facet,) and type(d.facets) is tuple


def _wrong_types():
    t = sw.friendly.tensor([1.0, 2.0])
    good_req = dict(
        tensor=t, destination=sw.CPU(0), source_class=sw.CPU, destination_class=sw.Generic,
        dtype=F32, layout=t.layout, physical_span=2,
    )
    sp = Recorder().provider()
    cases = []
    for name in ("supports_dtype", "physical_size", "allocate", "release", "read", "write"):
        cases.append((f"StorageProvider.{name}", lambda name=name: Recorder().provider(**{name: 3}), name))
    cases += [
        ("StorageProvider.elementwise_fallback=1", lambda: StorageProvider(*[_noop] * 6, elementwise_fallback=1), "elementwise_fallback"),
        ("StorageProvider.elementwise_fallback=None", lambda: StorageProvider(*[_noop] * 6, elementwise_fallback=None), "elementwise_fallback"),
        ("Unsupported.reason", lambda: Unsupported(42), "reason"),
        ("Unsupported.reason-bytes", lambda: Unsupported(b"no"), "reason"),
        ("TransferProvider.prepare", lambda: TransferProvider("prepare"), "prepare"),
        ("PreparedTransfer.submit", lambda: PreparedTransfer(None), "submit"),
        ("TransferRoute.source_class-instance", lambda: TransferRoute(sw.CPU(1), sw.CPU, "r", _provider()), "source_class"),
        ("TransferRoute.source_class-int", lambda: TransferRoute(int, sw.CPU, "r", _provider()), "source_class"),
        ("TransferRoute.destination_class", lambda: TransferRoute(sw.CPU, "CPU", "r", _provider()), "destination_class"),
        ("TransferRoute.route_id", lambda: TransferRoute(sw.CPU, sw.CPU, 7, _provider()), "route_id"),
        ("TransferRoute.provider", lambda: TransferRoute(sw.CPU, sw.CPU, "r", _noop), "provider"),
        ("CarrierDefinition.storage", lambda: CarrierDefinition(_noop), "storage"),
        ("CarrierDefinition.transfers-entry", lambda: CarrierDefinition(sp, transfers=(_provider(),)), "transfers"),
        ("CarrierDefinition.transfers-not-iterable", lambda: CarrierDefinition(sp, transfers=5), "transfers"),
        ("CarrierDefinition.facets-entry", lambda: CarrierDefinition(sp, facets=(object(),)), "facets"),
        ("CarrierDefinition.facets-class", lambda: CarrierDefinition(sp, facets=(_Facet,)), "facets"),
    ]
    wrong = {
        "tensor": [1.0, 2.0],
        "destination": sw.CPU,
        "source_class": "CPU",
        "destination_class": sw.CPU(0),
        "dtype": "Float32",
        "layout": (2,),
        "physical_span": (0, 2),  # an int: the number of physical slots, not a (begin, end) pair
    }
    for field, bad in wrong.items():
        cases.append((f"TransferRequest.{field}", lambda field=field, bad=bad: TransferRequest(**{**good_req, field: bad}), field))
    cases.append(("TransferRequest.physical_span-bool", lambda: TransferRequest(**{**good_req, "physical_span": True}),
                  "physical_span"))
    return cases


@pytest.mark.parametrize("build, fragment", [c[1:] for c in _wrong_types()], ids=[c[0] for c in _wrong_types()])
def test_wrong_field_types_raise_type_error(build, fragment):
    with pytest.raises(TypeError, match=fragment):
        build()


def test_unsupported_reason_must_be_non_empty():
    with pytest.raises(ValueError, match="non-empty"):
        Unsupported("")
    assert Unsupported(" ").reason == " "


def test_duplicate_route_pairs():
    cls = fresh_class()
    a = TransferRoute(cls, sw.CPU, "a", _provider())
    b = TransferRoute(cls, sw.CPU, "b", _provider())  # same pair, another id
    sp = Recorder().provider()
    for transfers in ((a, b), (a, a)):
        with pytest.raises(ValueError, match="duplicate route pair"):
            CarrierDefinition(sp, transfers=transfers)
    d = CarrierDefinition(sp, transfers=(a, TransferRoute(cls, sw.Generic, "c", _provider())))
    assert len(d.transfers) == 2


def test_duplicate_facet_types():
    class Other(_Facet):
        pass

    sp = Recorder().provider()
    one = _Facet()
    for facets in ((one, _Facet()), (one, one)):
        with pytest.raises(ValueError, match="duplicate facet type"):
            CarrierDefinition(sp, facets=facets)
    assert len(CarrierDefinition(sp, facets=(one, Other())).facets) == 2  # a subclass is another type


# ================================================================ register_carrier_definition


def _unregistered(cls):
    """The class is still definition-free: construction fails with TypeError."""
    assert sw._core._definition_of(cls) is None
    with pytest.raises(TypeError, match="no carrier definition"):
        cls(2, dtype=F32)
    return True


@pytest.mark.parametrize("cls", SHIPPED, ids=lambda c: c.__name__)
def test_shipped_classes_are_refused(cls):
    with pytest.raises(TypeError):
        register_carrier_definition(cls, CarrierDefinition(Recorder().provider()))
    assert sw._core._definition_of(cls) is None
    c = sw.CPU(2)  # the shipped kinds keep working
    c[1] = 3.0
    assert c[1] == 3.0 and c.facet(_Facet) is None


@pytest.mark.parametrize(
    "cls", [int, object, type("Plain", (), {}), "CPU", None], ids=["int", "object", "plain-class", "str", "None"]
)
def test_non_carrier_classes_are_refused(cls):
    with pytest.raises(TypeError, match="subclass of Carrier"):
        register_carrier_definition(cls, CarrierDefinition(Recorder().provider()))


def test_a_carrier_instance_is_refused():
    with pytest.raises(TypeError):
        register_carrier_definition(sw.CPU(1), CarrierDefinition(Recorder().provider()))


def test_subclasses_of_registered_classes_register_their_own_definition():
    base, base_rec = registered()
    sub = fresh_class(base)
    assert _unregistered(sub)  # a subclass is not a kind until it is registered
    sub_rec = Recorder()
    register_carrier_definition(sub, CarrierDefinition(sub_rec.provider()))
    c = sub(3, dtype=F32)
    assert sub_rec.count("allocate") == 1 and base_rec.count("allocate") == 0  # its own storage provider
    dep = fresh_class(sw.DependentCarrier)
    with pytest.raises(TypeError, match="shipped class"):
        register_carrier_definition(dep, CarrierDefinition(Recorder().provider()))
    assert sw._core._definition_of(dep) is None
    assert c.size() == 3


@pytest.mark.parametrize("shipped", [sw.CPU, sw.Generic, sw.FileBacked, sw.BlockDeviceCarrier, sw.Evictable])
def test_shipped_classes_are_final(shipped):
    with pytest.raises(TypeError):
        type("Sub", (shipped,), {})


def test_definition_must_be_a_carrier_definition():
    cls = fresh_class()
    rec = Recorder()
    for bad in (None, rec.provider(), {"storage": rec.provider()}):
        with pytest.raises(TypeError, match="CarrierDefinition"):
            register_carrier_definition(cls, bad)
    assert _unregistered(cls)
    register_carrier_definition(cls, CarrierDefinition(rec.provider()))
    assert cls(2, dtype=F32).size() == 2


def test_registering_twice():
    cls = fresh_class()
    first = CarrierDefinition(Recorder().provider())
    register_carrier_definition(cls, first)
    c = cls(1, dtype=F32)
    for again in (first, CarrierDefinition(Recorder().provider())):
        with pytest.raises(ValueError, match="already registered"):
            register_carrier_definition(cls, again)
    assert sw._core._definition_of(cls) is first
    c[0] = 2.5
    assert c[0] == 2.5


def test_unregistered_subclass_fails_construction():
    cls = fresh_class()
    with pytest.raises(TypeError, match="no carrier definition"):
        cls(3, dtype=F32)
    with pytest.raises(TypeError):
        cls(0, dtype=F32)
    # A failed construction is not a construction: registering afterwards works.
    rec = Recorder()
    register_carrier_definition(cls, CarrierDefinition(rec.provider()))
    assert cls(3, dtype=F32).size() == 3 and rec.count("allocate") == 1


def test_route_source_must_be_the_registering_class():
    cls, other = fresh_class(), fresh_class()
    bad = CarrierDefinition(Recorder().provider(), transfers=(TransferRoute(other, sw.CPU, "r", _provider()),))
    with pytest.raises(ValueError, match="source_class"):
        register_carrier_definition(cls, bad)
    assert _unregistered(cls) and _unregistered(other)
    good = CarrierDefinition(Recorder().provider(), transfers=(TransferRoute(cls, sw.CPU, "r", _provider()),))
    register_carrier_definition(cls, good)  # nothing of the failed attempt was left behind
    assert sw._core._definition_of(cls) is good


def test_route_destination_may_be_registered_later():
    cls, later = fresh_class(), fresh_class()
    d = CarrierDefinition(Recorder().provider(), transfers=(TransferRoute(cls, later, "r", _provider()),))
    register_carrier_definition(cls, d)  # accepted: resolved once `later` is registered
    assert sw._core._definition_of(cls) is d and _unregistered(later)
    register_carrier_definition(later, CarrierDefinition(Recorder().provider()))
    assert later(1, dtype=F32).size() == 1


# ================================================================ construction and storage callables


def test_construction_signature():
    cls, rec = registered()
    c = cls(3, dtype=F32)
    assert type(c) is cls and isinstance(c, sw.Carrier)
    assert c.size() == 3 and c.dtype() is F32 and c.is_mutable() and c.version == 0
    assert not c.is_owned() and not c.is_released()
    assert rec.calls == [("allocate", c, 3)]  # the carrier itself comes first
    frozen = cls(2, dtype=I32, mutable=False)
    assert not frozen.is_mutable() and frozen.dtype() is I32
    with pytest.raises(RuntimeError, match="not publicly mutable"):
        frozen[0] = 1
    assert frozen.version == 0 and frozen[0] == 0
    assert cls(0, dtype=F32).size() == 0


@pytest.mark.parametrize(
    "args, kwargs, exc, fragment",
    [
        ((3,), {}, TypeError, "dtype"),  # dtype is required
        ((3, F32), {}, TypeError, "dtype"),  # ... and keyword-only
        ((3,), {"dtype": "Float32"}, TypeError, "dtype must be a DType"),
        ((3.0,), {"dtype": F32}, TypeError, "int"),
        ((True,), {"dtype": F32}, TypeError, "int"),
        (("3",), {"dtype": F32}, TypeError, "int"),
        ((-1,), {"dtype": F32}, ValueError, ">= 0"),
        ((3,), {"dtype": sw.DType.Bool}, TypeError, "Bool"),  # the provider does not store it
        ((3,), {"dtype": sw.DType.Float64}, TypeError, "Float64"),  # not a storage dtype
        ((3,), {"dtype": F32, "slots": 3}, TypeError, "slots"),
    ],
)
def test_construction_errors(args, kwargs, exc, fragment):
    cls, rec = registered()
    with pytest.raises(exc, match=fragment):
        cls(*args, **kwargs)
    assert rec.count("allocate") == 0


def test_storage_callables_take_the_carrier_first():
    cls, rec = registered()
    c = cls(2, dtype=F32)
    c[1] = 4.5
    assert c[1] == 4.5 and c.version == 1
    assert ("write", c, 1, 4.5) in rec.calls and ("read", c, 1) in rec.calls


def test_release_is_called_at_most_once():
    cls, rec = registered()
    c = cls(2, dtype=F32)
    assert c.release() is None
    assert c.release() is None
    del c
    gc.collect()
    assert rec.count("release") == 1


def test_new_like_and_allocate_like_construct_through_the_class():
    cls, rec = registered()
    c = cls(1, dtype=F32)
    a = c.allocate_like(4, dtype=I32)
    assert type(a) is cls and a.size() == 4 and a.dtype() is I32 and a.is_mutable()
    n = c.new_like([1.5, 2.5], mutable=False)
    assert type(n) is cls and [n[0], n[1]] == [1.5, 2.5] and not n.is_mutable()


def test_a_storage_exception_fails_only_that_call():
    rec = Recorder()
    cls, _ = registered(rec)
    c = cls(2, dtype=F32)
    err = LookupError("disk on fire")
    rec.write_error = err
    with pytest.raises(LookupError) as info:
        c[0] = 1.0
    assert info.value is err
    assert c.version == 0 and not c.is_owned() and not c.is_released()
    rec.write_error = None
    c[0] = 1.0
    assert c[0] == 1.0 and c.version == 1


def test_an_allocate_exception_fails_the_construction():
    rec = Recorder()
    cls, _ = registered(rec)
    err = MemoryError("no room")
    rec.allocate_error = err
    with pytest.raises(MemoryError) as info:
        cls(2, dtype=F32)
    assert info.value is err
    rec.allocate_error = None
    assert cls(2, dtype=F32).size() == 2


# ================================================================ facets


class Alpha(CarrierFacet):
    def __init__(self, tag):
        self.tag = tag


class Beta(CarrierFacet):
    pass


class Gamma(CarrierFacet):
    pass


def test_facets():
    alpha, beta = Alpha("a"), Beta()
    cls, _ = registered(facets=(alpha, beta))
    c = cls(1, dtype=F32)
    assert c.facet(Alpha) is alpha and c.facet(Beta) is beta
    assert c.require_facet(Alpha) is alpha and c.require_facet(Beta) is beta
    assert c.facet(Gamma) is None
    with pytest.raises(NotImplementedError, match="no facet"):
        c.require_facet(Gamma)
    with pytest.raises(TypeError):
        c.facet("Alpha")
    c.release()
    assert c.facet(Alpha) is alpha  # a facet belongs to the kind, not to the storage


@pytest.mark.parametrize("make", [lambda: sw.CPU(1), lambda: sw.Generic([1.0]), lambda: sw.FileBacked()])
def test_shipped_carriers_have_no_user_facets(make):
    c = make()
    assert c.facet(Alpha) is None
    with pytest.raises(NotImplementedError, match="no facet"):
        c.require_facet(Alpha)


def test_carrier_facet_is_a_marker_base():
    assert isinstance(Alpha("x"), CarrierFacet)
    assert CarrierFacet.__slots__ == ()
