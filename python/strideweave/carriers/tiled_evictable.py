"""TiledEvictable: one flat logical extent whose tiles are independently resident.

The engine (tile table, residency state machine, transfers) is C++; this
module holds the immutable request values (TileSelection, TileSet,
ResidencyPlan), the ResidencyPolicy protocol and the residency facet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from .. import _core
from .._core import AwaitProjection, AwaitResidency, TiledEvictable
from .extension import CarrierDefinition, CarrierFacet, StorageProvider

__all__ = [
    "AwaitProjection",
    "AwaitResidency",
    "ResidencyPlan",
    "ResidencyPolicy",
    "TileSelection",
    "TileSet",
    "TiledEvictable",
    "TiledResidencyFacet",
]


def _iterable(value, what: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a finite iterable, got {type(value).__name__}")
    return tuple(value)


def _coordinate(value, where: str, rule: str) -> int:
    """One tile coordinate or coordinate component as an int; `where` and `rule` make the message."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{where}: {rule} must be integers, got {type(value).__name__}")
    return int(value.__index__())


@dataclasses.dataclass(frozen=True)
class TileSet:
    """An immutable finite set of full-rank tile coordinates, first axis fastest."""

    coordinates: tuple = ()

    def __post_init__(self) -> None:
        coords = []
        for i, entry in enumerate(_iterable(self.coordinates, "TileSet coordinates")):
            coord = tuple(_coordinate(c, f"TileSet coordinates[{i}][{j}]", "components")
                          for j, c in enumerate(_iterable(entry, f"TileSet coordinates[{i}]")))
            coords.append(coord)
        ranks = {len(c) for c in coords}
        if len(ranks) > 1:
            raise ValueError(f"TileSet coordinates must all have the same rank, got ranks {sorted(ranks)}")
        for c in coords:
            if any(v < 0 for v in c):
                raise ValueError(f"TileSet coordinate {c} has a negative component: components must be non-negative")
        if len(set(coords)) != len(coords):
            raise ValueError("TileSet coordinates contain a duplicate")
        coords.sort(key=lambda c: tuple(reversed(c)))
        object.__setattr__(self, "coordinates", tuple(coords))

    @classmethod
    def _from_canonical(cls, coordinates: tuple) -> "TileSet":
        """The TileSet of coordinates the core produced: tuples of ints, one rank, distinct, already sorted.

        Skips the per-coordinate checks of the constructor (the residency properties build one of these on every
        call, and a Mixture-of-Experts step asks for them per expert).
        """
        obj = object.__new__(cls)
        object.__setattr__(obj, "coordinates", coordinates)
        return obj

    def __len__(self) -> int:
        return len(self.coordinates)

    def __iter__(self):
        return iter(self.coordinates)

    def __contains__(self, coord) -> bool:
        return tuple(coord) in self.coordinates


@dataclasses.dataclass(frozen=True)
class TileSelection:
    """An ordered Cartesian product of tile coordinates, one non-empty axis list per grid axis."""

    per_axis: tuple

    def __post_init__(self) -> None:
        axes = []
        for i, axis in enumerate(_iterable(self.per_axis, "TileSelection per_axis")):
            values = tuple(_coordinate(v, f"TileSelection per_axis[{i}][{j}]", "tile coordinates")
                           for j, v in enumerate(_iterable(axis, f"TileSelection per_axis[{i}]")))
            axes.append(values)
        if not axes:
            raise ValueError("TileSelection needs at least one axis")
        for i, values in enumerate(axes):
            if not values:
                raise ValueError(f"TileSelection axis {i} is empty")
            if len(set(values)) != len(values):
                raise ValueError(f"TileSelection axis {i} contains a duplicate: {values}")
            if any(v < 0 for v in values):
                raise ValueError(f"TileSelection axis {i} contains a negative coordinate: {values} "
                                 "(coordinates must be non-negative)")
        object.__setattr__(self, "per_axis", tuple(axes))

    @property
    def rank(self) -> int:
        return len(self.per_axis)

    @property
    def compact_grid_shape(self) -> tuple:
        return tuple(len(a) for a in self.per_axis)

    @property
    def coordinates(self) -> tuple:
        """Source tile coordinates in compact first-mode-fastest order."""
        shape = self.compact_grid_shape
        total = 1
        for n in shape:
            total *= n
        coords = []
        for ordinal in range(total):
            c = []
            for i, n in enumerate(shape):
                c.append(self.per_axis[i][ordinal % n])
                ordinal //= n
            coords.append(tuple(c))
        return tuple(coords)

    @property
    def tile_set(self) -> TileSet:
        return TileSet(coordinates=self.coordinates)


@dataclasses.dataclass(frozen=True)
class ResidencyPlan:
    """One immutable control-plane decision: tiles to promote, retain and evict."""

    promote: TileSet = None
    retain: TileSet = None
    evict: TileSet = None

    def __post_init__(self) -> None:
        seen = {}
        for name in ("promote", "retain", "evict"):
            value = getattr(self, name)
            if value is None:
                value = TileSet()
                object.__setattr__(self, name, value)
            if not isinstance(value, TileSet):
                raise TypeError(f"ResidencyPlan.{name} must be a TileSet or None, got {type(value).__name__}")
            for c in value.coordinates:
                if c in seen:
                    raise ValueError(f"ResidencyPlan fields must be disjoint: tile {c} occurs in both {seen[c]} and {name}")
                seen[c] = name


@runtime_checkable
class ResidencyPolicy(Protocol):
    """Optimises residency; never defines correctness."""

    def plan(self, required: TileSet, purpose: str) -> ResidencyPlan:  # pragma: no cover - protocol
        ...


@dataclasses.dataclass(frozen=True)
class TileState:
    """Residency metadata of one tile."""

    location: str
    valid: bool
    dirty: bool


class TiledResidencyFacet(CarrierFacet):
    """The residency surface of a TiledEvictable: ``carrier.facet(TiledResidencyFacet)``."""

    __slots__ = ("_carrier",)

    def __init__(self, carrier=None):
        self._carrier = carrier

    def _bind(self, carrier) -> "TiledResidencyFacet":
        return TiledResidencyFacet(carrier)

    def promote_async(self, tiles) -> AwaitResidency:
        return self._carrier.promote_async(tiles)

    def evict_async(self, tiles) -> AwaitResidency:
        return self._carrier.evict_async(tiles)

    def promote(self, tiles) -> None:
        return self._carrier.promote_async(tiles).wait()

    def evict(self, tiles) -> None:
        return self._carrier.evict_async(tiles).wait()

    def flush_async(self) -> AwaitResidency:
        return self._carrier.flush_async()

    def flush(self) -> None:
        return self._carrier.flush_async().wait()


def _promote(self, tiles) -> None:
    """Exactly ``promote_async(tiles).wait()``."""
    return self.promote_async(tiles).wait()


def _evict(self, tiles) -> None:
    """Exactly ``evict_async(tiles).wait()``."""
    return self.evict_async(tiles).wait()


def _flush(self) -> None:
    """Exactly ``flush_async().wait()``: every dirty tile is in the secondary tier, durably, and clean (still resident)."""
    return self.flush_async().wait()


TiledEvictable.promote = _promote
TiledEvictable.evict = _evict
TiledEvictable.flush = _flush


def _unsupported(*_args):
    raise NotImplementedError("TiledEvictable storage is managed by the engine")


_DEFINITION = CarrierDefinition(
    StorageProvider(
        supports_dtype=lambda c, d: c.supports_storage_dtype(d),
        physical_size=lambda c: c.size(),
        allocate=_unsupported,
        release=lambda c: c.release(),
        read=lambda c, i: c[i],
        write=lambda c, i, v: c.__setitem__(i, v),
    ),
    facets=(TiledResidencyFacet(),),
)
_core._install_shipped_definition(TiledEvictable, _DEFINITION)

