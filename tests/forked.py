"""Runs a check in a child made by ``fork()`` (where the engine's threads do not exist) and fails the test if it fails or hangs.

A child that hangs is described before it is killed: its Python stack (``faulthandler``, written by the child
itself to its stderr, which pytest shows with the failure) and, where ``gdb`` is installed, every thread's
native stack, so a hang seen once on a CI machine can be diagnosed from its log.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import threading
from typing import Callable

import pytest


def child_watchdog(timeout_s: float) -> None:
    """In a forked child: dumps every Python thread's stack to stderr shortly before the parent gives up."""
    faulthandler.dump_traceback_later(max(timeout_s - 5.0, timeout_s * 0.8), exit=False, file=sys.__stderr__)


def describe_hung_child(pid: int) -> str:
    """What a hung child is doing: each thread's kernel wait channel, and its native stacks when gdb is here."""
    lines = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                lines.append(f"thread {tid}: waits in {f.read().strip() or '(running)'}")
    except OSError as e:
        lines.append(f"(no /proc view of {pid}: {e})")
    gdb = shutil.which("gdb")
    if gdb:
        try:
            out = subprocess.run([gdb, "-batch", "-nx", "-p", str(pid), "-ex", "thread apply all bt 30"],
                                 capture_output=True, text=True, timeout=60)
            lines.append(out.stdout[-20000:])
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"(gdb failed: {e})")
    return "\n".join(lines)


def check_in_forked_child(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Forks; the child runs ``check()`` and exits 0 only if it returned True (an exception or a hang fails).

    ``what`` names what the child exercises, for the failure message when it hangs past ``timeout_s``.
    """
    pid = os.fork()
    if pid == 0:  # child: never returns into the test runner
        try:
            child_watchdog(timeout_s)
            ok = bool(check())
        except BaseException:  # noqa: BLE001 - any failure is a non-zero status
            ok = False
        os._exit(0 if ok else 1)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(os.waitpid(pid, 0)[1]), daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if not waited:
        described = describe_hung_child(pid)
        os.kill(pid, 9)
        pytest.fail(f"the forked child hung in {what}:\n{described}")
    assert os.WIFEXITED(waited[0]) and os.WEXITSTATUS(waited[0]) == 0, f"the forked child failed in {what}"
