"""Grad mode: per thread, default on."""

from __future__ import annotations

import contextlib
from typing import Any

from ._core import is_grad_enabled, set_grad_enabled

__all__ = ["no_grad", "is_grad_enabled", "set_grad_enabled"]


class no_grad(contextlib.ContextDecorator):
    """Context manager (and decorator) that disables graph recording in this thread."""

    def __enter__(self) -> "no_grad":
        self._previous = is_grad_enabled()
        set_grad_enabled(False)
        return self

    def __exit__(self, *exc: Any) -> bool:
        set_grad_enabled(self._previous)
        return False
