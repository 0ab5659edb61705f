"""StrideWeave: tensors whose storage is tiled and tiered.

A C++20 engine (``strideweave._core``) with a thin Python face. Layouts map
logical coordinates to physical slots; carriers hold the slots.
"""

from . import friendly, layout
from ._core import DType, Layout, Shape, Stride
from .friendly import column_major, row_major

__all__ = [
    "DType",
    "Layout",
    "Shape",
    "Stride",
    "column_major",
    "friendly",
    "layout",
    "row_major",
]
