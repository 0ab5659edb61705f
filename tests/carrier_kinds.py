"""The registry of carrier kinds that the carrier conformance suite (test_carriers.py) runs.

Every kind in ``KINDS`` runs every suite test that takes the ``kind`` fixture,
and, where the test also takes ``dtype``, once per storage dtype the kind
supports. A new carrier kind gets coverage by adding one line to ``KINDS`` (a
small ``Kind`` subclass saying how to build one).

Kinds: Generic, CPU, FileBacked (anonymous and a named file), a
BlockDeviceCarrier on an 8 MiB preallocated file, Evictable (CPU primary,
FileBacked secondary), ``ListCarrier``, a user-defined kind registered below
whose storage is a Python list and whose provider counts every allocation and
release (practices: "Lifetimes proven by counting"), and TiledEvictable (CPU
primary, FileBacked secondary).

A conformance property that does not apply to a kind is declared in the
kind's ``excludes`` (property -> why, from docs/guide.md); a suite test that
checks such a property says so with ``@needs(property)``, and runs as a skip
that gives the kind's reason, never silently left out. A property that does
apply but that the engine breaks for a kind is a finding in the kind's
``findings``: such a test runs for it as a strict expected failure (it fails
the run once the engine is fixed, so the finding is removed then).
``PROPERTIES`` names every property a kind may exclude.
"""

from __future__ import annotations

import math

import strideweave as sw
from strideweave import DType
from strideweave.carriers.extension import (
    CarrierDefinition,
    PreparedTransfer,
    TransferProvider,
    TransferRoute,
    register_carrier_definition,
)
from strideweave.carriers.tiled_evictable import TiledEvictable

from ledger import PY_TYPE, ZERO, Ledger, record_of
from models import binary32
from devices import block_device, sized_file

F32, I32, BOOL, F64 = DType.Float32, DType.Int32, DType.Bool, DType.Float64
STORAGE_DTYPES = (F32, I32, BOOL)


# Values every kind must store bit-exactly (all exactly representable).
SAMPLES = {
    F32: [0.5, -0.0, binary32(1e-45), 3.4028234663852886e38, math.inf, -math.inf, math.nan, -2.75],
    I32: [0, -1, 2**31 - 1, -(2**31), 7, 123456789, -5, 1],
    BOOL: [True, False, False, True, True, False, True, False],
}
N = 8


def fill(c, values):
    for i, v in enumerate(values):
        c[i] = v
    return c


# ============================================================ the user-defined kind


LEDGER = Ledger()  # every ListCarrier ever constructed (its Record), in order, and the breaches its provider saw
VIOLATIONS = LEDGER.violations
ROUTE_CALLS = {"prepare": 0, "submit": 0}
_record = record_of


class ListCarrier(sw.Carrier):
    """A user-defined carrier kind: slots in a Python list."""


def _list_prepare(request):
    """ListCarrier -> ListCarrier: copies list to list (fallback covers CPU in both directions)."""
    ROUTE_CALLS["prepare"] += 1
    src, dst = _record(request.tensor.carrier), _record(request.destination)
    layout, offset = request.layout, request.tensor.offset

    def submit():
        ROUTE_CALLS["submit"] += 1
        for i in range(layout.size):
            dst.values[layout(i)] = src.values[offset + layout(i)]

    return PreparedTransfer(submit)


LIST_DEFINITION = CarrierDefinition(
    LEDGER.storage(lambda c, d: d in STORAGE_DTYPES, elementwise_fallback=True),
    transfers=(TransferRoute(ListCarrier, ListCarrier, "list-copy", TransferProvider(_list_prepare)),),
)
register_carrier_definition(ListCarrier, LIST_DEFINITION)


# ============================================================ the kinds


# Conformance properties a kind may declare inapplicable (Kind.excludes), and what each one is.
PROPERTIES = {
    "like_of_any_size": "new_like and allocate_like make a carrier of any size, whatever the size of the carrier "
                        "they are called on",
    "moves_with_cpu": "sw.move and move_async carry its tensors to and from CPU carriers (a route or the "
                      "element-wise fallback)",
    "released_size_is_zero": "a released carrier's size() is 0",
}


class Kind:
    """How to build carriers of one kind. Subclass, then add one line to KINDS."""

    name: str
    cls: type
    dtypes: tuple = STORAGE_DTYPES
    shipped = True
    dependent = False
    allocatable = True  # an empty carrier of this kind can grow (a move destination)
    excludes: dict[str, str] = {}  # a property of PROPERTIES -> why it does not apply to this kind
    # A property of PROPERTIES that applies but that the engine breaks for this kind today -> what is wrong (a
    # finding): the tests that need it run as strict expected failures, so they fail once the engine is fixed.
    findings: dict[str, str] = {}

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.count = 0

    def fresh_path(self, suffix=".bin"):
        self.count += 1
        return self.tmp_path / f"{self.name}-{self.count}{suffix}"

    def make(self, values, dtype):
        """A live, mutable, unowned carrier of this kind holding exactly `values`."""
        raise NotImplementedError

    def make_immutable(self, n, dtype):
        """A carrier of this kind created with mutable=False (any contents), through the kind's own constructor."""
        raise NotImplementedError

    def empty(self, dtype):
        """An allocatable (size 0) carrier of this kind."""
        raise NotImplementedError

    def footprint(self):
        """A number that changes when this kind allocates storage (None when not observable)."""
        return None


class GenericKind(Kind):
    name, cls = "Generic", sw.Generic

    def make(self, values, dtype):
        return sw.Generic(values, dtype=dtype)

    def make_immutable(self, n, dtype):
        return sw.Generic(SAMPLES[dtype][:n], dtype=dtype, mutable=False)

    def empty(self, dtype):
        return sw.Generic([], dtype=dtype)


class CPUKind(Kind):
    name, cls = "CPU", sw.CPU

    def make(self, values, dtype):
        return fill(sw.CPU(len(values), dtype=dtype), values)

    def make_immutable(self, n, dtype):
        return sw.CPU(n, dtype=dtype, mutable=False)

    def empty(self, dtype):
        return sw.CPU(0, dtype=dtype)


class AnonymousFileKind(Kind):
    name, cls, dtypes = "FileBacked-anonymous", sw.FileBacked, (F32, I32)

    def make(self, values, dtype):
        prototype = sw.FileBacked(dtype=dtype)
        c = prototype.allocate_like(len(values))
        prototype.release()
        return fill(c, values)

    def make_immutable(self, n, dtype):
        prototype = sw.FileBacked(dtype=dtype)
        c = prototype.allocate_like(n, mutable=False)
        prototype.release()
        return c

    def empty(self, dtype):
        return sw.FileBacked(dtype=dtype)


class NamedFileKind(Kind):
    name, cls, dtypes = "FileBacked-named", sw.FileBacked, (F32, I32)

    def sized_file(self, n, dtype):
        return sized_file(self.fresh_path(), n * dtype.bits // 8)

    def make(self, values, dtype):
        c = sw.FileBacked(self.sized_file(len(values), dtype), dtype=dtype)
        assert c.size() == len(values)  # starts at the file's size
        return fill(c, values)

    def make_immutable(self, n, dtype):
        return sw.FileBacked(self.sized_file(n, dtype), dtype=dtype, mutable=False)

    def empty(self, dtype):
        return sw.FileBacked(self.fresh_path(), dtype=dtype)


class BlockDeviceKind(Kind):
    name, cls, dtypes = "BlockDeviceCarrier", sw.BlockDeviceCarrier, (F32, I32)
    ARENA_BYTES = 8 << 20

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.arena = block_device(tmp_path / "arena.img", self.ARENA_BYTES)

    def make(self, values, dtype):
        return fill(self.arena.allocate(len(values), dtype=dtype), values)

    def make_immutable(self, n, dtype):
        return self.arena.allocate(n, dtype=dtype, mutable=False)

    def empty(self, dtype):
        return self.arena.allocate(0, dtype=dtype)

    def footprint(self):
        return self.arena.free_bytes


class EvictableKind(Kind):
    name, cls, dtypes = "Evictable", sw.Evictable, (F32, I32)  # CPU and FileBacked share Float32/Int32
    dependent = True
    allocatable = False  # its extent is fixed by its tiers

    def make(self, values, dtype):
        return fill(sw.Evictable(sw.CPU(len(values), dtype=dtype), sw.FileBacked(dtype=dtype)), values)

    def make_immutable(self, n, dtype):
        prototype = sw.Evictable(sw.CPU(n, dtype=dtype), sw.FileBacked(dtype=dtype))
        c = prototype.allocate_like(n, mutable=False)
        prototype.release()
        return c

    def empty(self, dtype):
        return None


class ListKind(Kind):
    name, cls, shipped = "ListCarrier", ListCarrier, False

    def make(self, values, dtype):
        return fill(ListCarrier(len(values), dtype=dtype), values)

    def make_immutable(self, n, dtype):
        return ListCarrier(n, dtype=dtype, mutable=False)

    def empty(self, dtype):
        return ListCarrier(0, dtype=dtype)

    def footprint(self):
        return len(LEDGER)


def tile_geometry_of(n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, tile) of two axes with exactly `n` slots: n's prime factors, smallest first, dealt in turn to
    tile[0], grid[0], tile[1], grid[1], so a tile's footprint is several runs (8: tile (2, 2), grid (2, 1))."""
    dealt, p, turn = [1, 1, 1, 1], 2, 0
    while n > 1:
        if p * p > n:
            p = n
        while n % p == 0:
            dealt[turn % 4] *= p
            turn += 1
            n //= p
        p += 1
    return (dealt[1], dealt[3]), (dealt[0], dealt[2])


class TiledEvictableKind(Kind):
    name, cls, dtypes = "TiledEvictable", TiledEvictable, (F32, I32)  # CPU and FileBacked share Float32/Int32
    dependent = True
    allocatable = False  # its extent is its tile geometry
    excludes = {
        "like_of_any_size": "a TiledEvictable's extent is its tile geometry: new_like and allocate_like take 0 or "
                            "the full extent and refuse other sizes with ValueError (docs/guide.md, "
                            '"TiledEvictable")',
        "moves_with_cpu": "a TiledEvictable has no move route and refuses the element-wise fallback "
                          "(allows_elementwise_fallback() is false): its values come and go by project and "
                          'scatter, tile by tile (docs/guide.md, "TiledEvictable")',
    }

    @staticmethod
    def build(n, dtype):
        """Zeros in an anonymous FileBacked secondary, an empty CPU primary: every tile starts valid in the
        secondary tier, and slot access promotes the tiles it touches."""
        secondary = sw.FileBacked(dtype=dtype)
        zeros = secondary.allocate_like(n)
        secondary.release()
        grid, tile = tile_geometry_of(n)
        return TiledEvictable(sw.CPU(0, dtype=dtype), zeros, grid, tile)

    def make(self, values, dtype):
        return fill(self.build(len(values), dtype), values)

    def make_immutable(self, n, dtype):
        prototype = self.build(n, dtype)
        c = prototype.allocate_like(n, mutable=False)
        prototype.release()
        return c

    def empty(self, dtype):
        return None


KINDS = [
    GenericKind,
    CPUKind,
    AnonymousFileKind,
    NamedFileKind,
    BlockDeviceKind,
    EvictableKind,
    ListKind,
    TiledEvictableKind,
]


def only(predicate):
    """Runs a suite test only for the kinds `predicate` accepts (instead of skipping the others)."""

    def mark(test):
        test.kind_filter = predicate
        return test

    return mark


def needs(*properties):
    """Marks a suite test as checking `properties` (of PROPERTIES): a kind that excludes one skips it, saying why."""
    unknown = set(properties) - set(PROPERTIES)
    assert not unknown, f"not a conformance property: {sorted(unknown)}"

    def mark(test):
        test.kind_needs = properties
        return test

    return mark


def applies(kind, prop) -> bool:
    """Whether `prop` (of PROPERTIES) applies to `kind`; a test leaves out the part that checks it when not."""
    assert prop in PROPERTIES, f"not a conformance property: {prop}"
    return prop not in kind.excludes


def finding(kind, test) -> str | None:
    """The known finding on a property `test` needs (the engine breaks it for `kind`), or None."""
    for p in getattr(test, "kind_needs", ()):
        if p in kind.findings:
            return f"{kind.name}: finding on {p}: {kind.findings[p]}"
    return None


def exclusion(kind, test) -> str | None:
    """Why `kind` does not run `test` (a property the test needs that the kind excludes), or None."""
    for p in getattr(test, "kind_needs", ()):
        if p in kind.excludes:
            return f"{kind.name}: {p} does not apply: {kind.excludes[p]}"
    return None
