"""Fixtures shared by the test modules (pytest finds this file by name)."""

from __future__ import annotations

import pytest

import strideweave as sw


@pytest.fixture
def clear_io_faults():
    """No injected I/O fault and no held I/O gate before or after the test (whatever it left behind)."""
    sw._core._io_clear()
    yield
    sw._core._io_clear()
