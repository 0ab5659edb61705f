"""Runs a check in a child made by ``fork()`` (where the engine's threads do not exist) and fails the test if it fails or hangs."""

from __future__ import annotations

import os
import threading
from typing import Callable

import pytest


def check_in_forked_child(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Forks; the child runs ``check()`` and exits 0 only if it returned True (an exception or a hang fails).

    ``what`` names what the child exercises, for the failure message when it hangs past ``timeout_s``.
    """
    pid = os.fork()
    if pid == 0:  # child: never returns into the test runner
        try:
            ok = bool(check())
        except BaseException:  # noqa: BLE001 - any failure is a non-zero status
            ok = False
        os._exit(0 if ok else 1)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(os.waitpid(pid, 0)[1]), daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if not waited:
        os.kill(pid, 9)
        pytest.fail(f"the forked child hung in {what}")
    assert os.WIFEXITED(waited[0]) and os.WEXITSTATUS(waited[0]) == 0, f"the forked child failed in {what}"
