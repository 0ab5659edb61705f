"""Fixtures shared by the test modules (pytest finds this file by name).

* ``clear_io_faults``: no injected I/O fault and no held I/O gate before or after the test.
* ``held_io``: the engine's I/O hooks (``sw._core``) for a test that holds or faults I/O; cleared after.
* ``grad_mode_on``: grad mode on in the main thread before and after the test (a module opts in with
  ``pytestmark = pytest.mark.usefixtures("grad_mode_on")``).
* ``rng``: a NumPy generator seeded from the module's ``BASE_SEED`` and the test id; the seed is printed
  (pytest shows it with a failing test's output), so a failure replays.
* ``fuzz_report`` and ``fuzz_watchdog``: the bookkeeping of the test_fuzz_*.py modules (fuzzing.py).
"""

from __future__ import annotations

import faulthandler
import json
import os
import zlib

import numpy as np
import pytest

import strideweave as sw


@pytest.fixture
def clear_io_faults():
    """No injected I/O fault and no held I/O gate before or after the test (whatever it left behind)."""
    sw._core._io_clear()
    yield
    sw._core._io_clear()


@pytest.fixture
def held_io():
    yield sw._core
    sw._core._io_clear()  # also releases holds


@pytest.fixture
def grad_mode_on():
    """The test starts and ends with grad mode on in the main thread."""
    sw.set_grad_enabled(True)
    yield
    sw.set_grad_enabled(True)


@pytest.fixture
def rng(request):
    seed = request.module.BASE_SEED + zlib.crc32(request.node.nodeid.encode())
    print(f"seed={seed} ({request.node.nodeid})")
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- the fuzz modules (fuzzing.py)


@pytest.fixture(scope="module")
def fuzz_watchdog():
    """A hang anywhere in a fuzz module dumps every thread's stack and ends the run (a module takes seconds; the
    bound is generous for slow or sanitized runs and scales with SW_FUZZ_EXAMPLES)."""
    from fuzzing import SCALE

    faulthandler.dump_traceback_later(max(600, 60 * SCALE * 10), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def fuzz_report(request):
    """At the end of the session: the examples each entry point ran and their outcomes, printed and written to
    build/fuzz-counts.json when that directory exists."""
    from fuzzing import CALLS, OUTCOMES

    yield
    lines = ["", "test_fuzz: examples run per entry point (calls; outcomes)"]
    for entry in sorted(CALLS):
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(OUTCOMES[entry].items()))
        lines.append(f"  {entry:32s} {CALLS[entry]:6d}   {outcomes}")
    lines.append(f"  {'total':32s} {sum(CALLS.values()):6d}")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print("\n".join(lines))
    else:
        print("\n".join(lines))
    build = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")
    if os.path.isdir(build):
        with open(os.path.join(build, "fuzz-counts.json"), "w") as f:
            json.dump({k: {"calls": CALLS[k], **OUTCOMES[k]} for k in sorted(CALLS)}, f, indent=1)


# ---------------------------------------------------------------- under `make sanitize` (docs/reliability.md)

# The Python suite runs under AddressSanitizer + LeakSanitizer with SW_SANITIZED=1 (Makefile: sanitize-py). The
# tests below measure what a sanitizer itself changes, and only those are skipped there (node id prefix: why);
# everything else runs sanitized.
SANITIZER_SKIPS: dict[str, str] = {
    # ASan's throwing operator new cannot throw std::bad_alloc: an allocation it cannot make is reported as
    # out-of-memory and stops the process (allocator_may_return_null covers malloc only), so the MemoryError
    # path of a failed std::vector allocation cannot be reached under it.
    "tests/test_hostile_storage.py::test_an_allocation_that_cannot_be_had_is_a_memory_error_saying_what_and_how_much":
        "operator new cannot throw std::bad_alloc under ASan (it stops the process)",
    # The resident size of a sanitized process is the sanitizer's shadow memory and quarantine, not the engine's.
    "tests/test_open_rss.py::": "the peak RSS it bounds measures the sanitizer's own memory under ASan",
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SW_SANITIZED") != "1":
        return
    for item in items:
        for prefix, why in SANITIZER_SKIPS.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f"under AddressSanitizer: {why}"))
