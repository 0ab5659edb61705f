"""Extension API: add carrier kinds without touching the library.

Every value type here is a frozen dataclass; a field of the wrong type raises
``TypeError`` at construction. The behaviour lives in the C++ core: a
registered definition becomes a carrier kind whose storage calls the
provider's callables (with the GIL held and autograd disabled, possibly from
library threads) and whose moves use the registered routes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from .. import _core
from .._core import Carrier, DType, Layout

__all__ = [
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


def _require_callable(owner: str, name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{owner}.{name} must be callable, got {type(value).__name__}")


def _require_carrier_class(owner: str, name: str, value: Any) -> None:
    if not (isinstance(value, type) and issubclass(value, Carrier)):
        raise TypeError(f"{owner}.{name} must be a Carrier subclass, got {value!r}")


@dataclasses.dataclass(frozen=True)
class StorageProvider:
    """Storage callables of a carrier kind; each takes the carrier first."""

    supports_dtype: Callable[[Any, DType], bool]
    physical_size: Callable[[Any], int]
    allocate: Callable[[Any, int], None]
    release: Callable[[Any], None]
    read: Callable[[Any, int], Any]
    write: Callable[[Any, int, Any], None]
    elementwise_fallback: bool = False

    def __post_init__(self) -> None:
        for name in ("supports_dtype", "physical_size", "allocate", "release", "read", "write"):
            _require_callable("StorageProvider", name, getattr(self, name))
        if not isinstance(self.elementwise_fallback, bool):
            raise TypeError("StorageProvider.elementwise_fallback must be a bool")


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A route's answer when it cannot perform a particular request."""

    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str):
            raise TypeError(f"Unsupported.reason must be a str, got {type(self.reason).__name__}")
        if not self.reason:
            raise ValueError("Unsupported.reason must be a non-empty string")


@dataclasses.dataclass(frozen=True)
class PreparedTransfer:
    """``submit()`` is called exactly once; it returns None (done) or an object with ``done`` and ``wait()``."""

    submit: Callable[[], Any]

    def __post_init__(self) -> None:
        _require_callable("PreparedTransfer", "submit", self.submit)


@dataclasses.dataclass(frozen=True)
class TransferRequest:
    """What a route is asked to move."""

    tensor: Any
    destination: Any
    source_class: type
    destination_class: type
    dtype: DType
    layout: Layout
    physical_span: int  # physical slots the transfer covers: the layout's cosize, from tensor.offset

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, _core.Tensor):
            raise TypeError("TransferRequest.tensor must be a Tensor")
        if not isinstance(self.destination, Carrier):
            raise TypeError("TransferRequest.destination must be a Carrier")
        _require_carrier_class("TransferRequest", "source_class", self.source_class)
        _require_carrier_class("TransferRequest", "destination_class", self.destination_class)
        if not isinstance(self.dtype, DType):
            raise TypeError("TransferRequest.dtype must be a DType")
        if not isinstance(self.layout, Layout):
            raise TypeError("TransferRequest.layout must be a Layout")
        if not isinstance(self.physical_span, int) or isinstance(self.physical_span, bool):
            raise TypeError("TransferRequest.physical_span must be an int (the number of physical slots)")
        if self.physical_span < 0:
            raise ValueError(f"TransferRequest.physical_span must be >= 0, got {self.physical_span}")


@dataclasses.dataclass(frozen=True)
class TransferProvider:
    """``prepare(request) -> PreparedTransfer | Unsupported``."""

    prepare: Callable[[TransferRequest], Any]

    def __post_init__(self) -> None:
        _require_callable("TransferProvider", "prepare", self.prepare)


@dataclasses.dataclass(frozen=True)
class TransferRoute:
    """A route from ``source_class`` (the registering class) to ``destination_class``."""

    source_class: type
    destination_class: type
    route_id: str
    provider: TransferProvider

    def __post_init__(self) -> None:
        _require_carrier_class("TransferRoute", "source_class", self.source_class)
        _require_carrier_class("TransferRoute", "destination_class", self.destination_class)
        if not isinstance(self.route_id, str):
            raise TypeError("TransferRoute.route_id must be a str")
        if not isinstance(self.provider, TransferProvider):
            raise TypeError("TransferRoute.provider must be a TransferProvider")


class CarrierFacet:
    """Marker base class for capability objects a carrier definition attaches."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class CarrierDefinition:
    """How a carrier kind stores slots, which routes it offers and which facets it has."""

    storage: StorageProvider
    transfers: tuple = ()
    composite: Optional[Any] = None
    facets: tuple = ()

    def __post_init__(self) -> None:
        if not isinstance(self.storage, StorageProvider):
            raise TypeError("CarrierDefinition.storage must be a StorageProvider")
        try:
            transfers = tuple(self.transfers)
            facets = tuple(self.facets)
        except TypeError:
            raise TypeError("CarrierDefinition.transfers and facets must be iterables") from None
        object.__setattr__(self, "transfers", transfers)
        object.__setattr__(self, "facets", facets)
        pairs = set()
        for route in transfers:
            if not isinstance(route, TransferRoute):
                raise TypeError(f"CarrierDefinition.transfers entries must be TransferRoute, got {type(route).__name__}")
            pair = (route.source_class, route.destination_class)
            if pair in pairs:
                raise ValueError(
                    f"duplicate route pair {route.source_class.__name__} -> {route.destination_class.__name__}"
                )
            pairs.add(pair)
        kinds = set()
        for facet in facets:
            if not isinstance(facet, CarrierFacet):
                raise TypeError(f"CarrierDefinition.facets entries must be CarrierFacet, got {type(facet).__name__}")
            if type(facet) in kinds:
                raise ValueError(f"duplicate facet type {type(facet).__name__}")
            kinds.add(type(facet))


def register_carrier_definition(cls: type, definition: CarrierDefinition) -> None:
    """Makes ``cls`` (a subclass of Carrier) a working carrier kind.

    Registered once, before its first construction ("already registered"
    otherwise); shipped classes are refused with TypeError. A subclass of a
    registered class may be registered with its own definition: kinds and
    routes are exact per class, never inherited. A route may name a
    destination class that is registered later; it takes effect once that
    class is registered (a move to it cannot be requested before).
    """
    if not isinstance(definition, CarrierDefinition):
        raise TypeError("register_carrier_definition: definition must be a CarrierDefinition")
    _core._register_definition(cls, definition)
