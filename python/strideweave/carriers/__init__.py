"""Carriers: flat, fixed-size arrays of physical slots of one storage dtype."""

from .._core import DType

__all__ = ["DType"]
