"""Carriers: flat, fixed-size arrays of physical slots of one storage dtype.

Shipped classes are final; new kinds subclass :class:`Carrier` and register a
definition with :func:`strideweave.carriers.extension.register_carrier_definition`.
"""

from .._core import (
    CPU,
    BlockDevice,
    BlockDeviceCarrier,
    Carrier,
    DependentCarrier,
    DType,
    Evictable,
    FileBacked,
    Generic,
    TiledEvictable,
)

__all__ = [
    "Carrier",
    "DependentCarrier",
    "Generic",
    "CPU",
    "FileBacked",
    "BlockDevice",
    "BlockDeviceCarrier",
    "Evictable",
    "TiledEvictable",
    "DType",
]

from . import tiled_evictable  # noqa: E402  (installs TiledEvictable's definition)
from . import move  # noqa: E402,F401  (strideweave.carriers.move)
