"""Convenience constructors."""

from ._core import column_major, row_major

__all__ = ["column_major", "row_major"]
