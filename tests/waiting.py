"""Waiting for an observable state, bounded: what tests use instead of sleeping to order events.

A test that must act while engine work is blocked (at an I/O gate, say) waits
until that state is observable, polling a predicate; it fails, never hangs,
when the state does not come within the deadline.
"""

from __future__ import annotations

import time
from typing import Callable

import strideweave as sw

DEADLINE_S = 30.0  # only a bug makes a wait reach it


def eventually(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    """Polls `predicate` until it is true; fails with `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.001)


def held(op: str, n: int = 1, timeout: float = DEADLINE_S) -> None:
    """Waits until `n` calls of the I/O operation `op` are blocked at the held gate (``_core._io_hold``): the gate
    signals each call that starts waiting (``_core._io_wait_held``), so nothing polls."""
    if not sw._core._io_wait_held(op, n, timeout):
        raise AssertionError(f"not within {timeout} s: {n} {op} call(s) held at the I/O gate")
