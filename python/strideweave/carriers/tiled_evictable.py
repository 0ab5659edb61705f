"""TiledEvictable: one flat logical extent whose tiles are independently resident.

The engine (tile table, residency state machine, transfers) is C++; this
module holds the immutable request values (TileSelection, TileSet,
ResidencyPlan), the ResidencyPolicy protocol and the residency facet. The
values check, order and expand their tiles in C++ (one call each: Note
[Canonical tile order] in cpp/include/strideweave/tiled/tile_set.hpp).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Optional, Protocol, runtime_checkable

from .. import _core
from .._core import AwaitProjection, AwaitResidency, ResidencyBudget, TiledEvictable  # noqa: F401 (sw.ResidencyBudget)
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


@dataclasses.dataclass(frozen=True)
class TileSet:
    """An immutable finite set of full-rank tile coordinates, first axis fastest."""

    coordinates: tuple = ()

    def __post_init__(self) -> None:
        # Checked (one rank, non-negative, distinct) and sorted into canonical order by the core.
        object.__setattr__(self, "coordinates", _core._tile_set_coordinates(self.coordinates))

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

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self.coordinates)

    def __contains__(self, coord: Any) -> bool:
        return tuple(coord) in self.coordinates


@dataclasses.dataclass(frozen=True)
class TileSelection:
    """An ordered Cartesian product of tile coordinates, one non-empty axis list per grid axis."""

    per_axis: tuple

    def __post_init__(self) -> None:
        # Checked by the core: at least one axis, each non-empty, distinct and non-negative.
        object.__setattr__(self, "per_axis", _core._selection_axes(self.per_axis))

    @property
    def rank(self) -> int:
        return len(self.per_axis)

    @property
    def compact_grid_shape(self) -> tuple:
        return tuple(len(a) for a in self.per_axis)

    @property
    def coordinates(self) -> tuple:
        """Source tile coordinates in compact first-mode-fastest order."""
        return _core._selection_coordinates(self.per_axis)

    @property
    def tile_set(self) -> TileSet:
        """The selected tiles as a TileSet (canonical order), enumerated by the core in one call."""
        return _core._selection_tile_set(self.per_axis)


@dataclasses.dataclass(frozen=True)
class ResidencyPlan:
    """One immutable control-plane decision: tiles to promote, retain and evict."""

    promote: Optional[TileSet] = None
    retain: Optional[TileSet] = None
    evict: Optional[TileSet] = None

    def __post_init__(self) -> None:
        seen: dict = {}
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

    def __init__(self, carrier: Optional[TiledEvictable] = None) -> None:
        self._carrier = carrier

    def _bind(self, carrier: TiledEvictable) -> "TiledResidencyFacet":
        return TiledResidencyFacet(carrier)

    def promote_async(self, tiles: TileSet | TileSelection) -> AwaitResidency:
        return self._carrier.promote_async(tiles)

    def evict_async(self, tiles: TileSet | TileSelection) -> AwaitResidency:
        return self._carrier.evict_async(tiles)

    def promote(self, tiles: TileSet | TileSelection) -> None:
        return self._carrier.promote(tiles)

    def evict(self, tiles: TileSet | TileSelection) -> None:
        return self._carrier.evict(tiles)

    def flush_async(self) -> AwaitResidency:
        return self._carrier.flush_async()

    def flush(self) -> None:
        return self._carrier.flush()


def _unsupported(*_args: Any) -> None:
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

