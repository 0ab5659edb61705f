"""Hierarchical shapes, strides and layouts (first-mode-fastest at every level)."""

from ._core import Layout, Shape, Stride

__all__ = ["Layout", "Shape", "Stride"]
