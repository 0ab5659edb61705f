"""Daemon threads doing engine work while the main thread forks children, then the interpreter exits with the
threads still running (docs/reliability.md, promises 4 and 7; docs/guide.md, "Threads, fork() and exit").

Each pattern runs in a subprocess with a timeout, so a child or a parent that hangs fails the test instead of
the suite. The parent waits (bounded) for each child, kills one that hangs and says so on stdout; the test then
checks that every child finished with status 0, that the parent exited with status 0 and that no fatal error
("terminate called", "Fatal Python error") reached stderr.

* Engine only: one daemon thread is inside a SparseMoE forward (held at the test-only I/O gate while it promotes
  an expert: the block's call lock is held), another runs a plain StrideWeave loop, when the main thread forks.
  Each child computes on its own tensors and its own block with exact values, and the block the parent's thread
  was using raises RuntimeError "created before fork" there (Note [Locks held for a whole call], fork.hpp)
  instead of blocking for ever on a lock no thread of the child will release. Then the gate opens and the
  interpreter exits while both threads run forward and backward.
* PyTorch: two daemon threads run forward and backward of tiny offloaded transformers models (tests/hf_models.py)
  while the main thread forks children that run forward and backward of a third, with the supported setting of
  docs/guide.md: a child calls ``torch.set_num_threads(1)`` before any torch operation (as PyTorch's own
  DataLoader workers do: libgomp's thread pool is not usable after fork), and threads running torch's backward are
  stopped and joined at exit (torch's autograd engine takes the GIL back inside C++ destructors, which aborts the
  process when CPython ends a daemon thread during finalization). A StrideWeave-only daemon thread is left running.

Run: ``.venv/bin/python -m pytest -q tests/test_exit_fork_threads.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

TESTS = os.path.dirname(os.path.abspath(__file__))
FATAL = ("terminate called", "Fatal Python error", "Segmentation fault", "Aborted", "core dumped", "std::terminate")

# Shared by both scripts: forks `n` children running `work()` (exit 0 when it returns True), waits for each at most
# `CHILD_S` seconds in all (a hung child is killed and reported), prints one line per child.
FORK_HELPERS = """
import os, sys, time, threading, traceback

CHILD_S = 30.0

def say(line):
    # One write of the whole line: with PYTHONUNBUFFERED set, print() writes its text and its newline separately,
    # and a child's line on the shared pipe can land between the two.
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()

def fork_children(n, work):
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                ok = bool(work())
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(0 if ok else 1)
        pids.append(pid)
    deadline = time.monotonic() + CHILD_S
    for pid in pids:
        # A thread blocks in waitpid; the bound is its join's timeout (nothing polls).
        status = {}
        waiter = threading.Thread(target=lambda: status.setdefault("s", os.waitpid(pid, 0)[1]), daemon=True)
        waiter.start()
        waiter.join(max(0.0, deadline - time.monotonic()))
        if "s" in status:
            say(f"child status {os.waitstatus_to_exitcode(status['s'])}")
        else:
            say("child HUNG")
            os.kill(pid, 9)
            waiter.join()
"""

ENGINE_SCRIPT = """
import numpy as np
import strideweave as sw
from strideweave import friendly
from strideweave.carriers import TiledEvictable
sys.path.insert(0, TESTS)
from waiting import held

core = sw._core
E, H, I = 4, 8, 16
rng = np.random.default_rng(0)

def tiled(stack):
    e, r, c = stack.shape
    tier = sw.move(friendly.tensor(stack.reshape(-1).astype(np.float32)), sw.FileBacked())
    carrier = TiledEvictable(sw.CPU(0), tier.carrier, (1, 1, e), (r, c, 1))  # every expert on the file
    return sw.Tensor(carrier, 0, sw.Layout(sw.Shape(r, c, e), sw.Stride(c, 1, r * c)))

def block(seed):
    g = np.random.default_rng(seed)
    return sw.moe.SparseMoE(*[tiled(g.standard_normal(s).astype(np.float32))
                              for s in ((E, I, H), (E, H, I), (E, I, H))], top_k=2)

x = friendly.tensor(rng.standard_normal((6, H)).astype(np.float32))
router = friendly.tensor(rng.standard_normal((E, H)).astype(np.float32))
cotangent = friendly.tensor(rng.standard_normal((6, H)).astype(np.float32))
want = np.asarray(block(2)(x, router))  # the result a child's own block must give

moe = block(1)
ran = threading.Event()

def moe_loop():
    while True:
        out = moe(x, router)
        out.backward(cotangent)
        ran.set()

values = np.arange(-512, 512, dtype=np.float32)
def plain_loop():  # no tiles, no I/O: kernels only
    t = friendly.tensor(values)
    while True:
        assert np.array_equal(np.asarray(sw.relu(t)), np.maximum(values, 0))

core._io_hold("pread")
threading.Thread(target=moe_loop, daemon=True).start()
held("pread")  # the forward is promoting an expert: its call lock is held
threading.Thread(target=plain_loop, daemon=True).start()

def child():
    core._io_clear()  # the gate's hold is the parent's
    assert np.array_equal(np.asarray(sw.relu(friendly.tensor(values))), np.maximum(values, 0))
    assert np.array_equal(np.asarray(block(2)(x, router)), want)  # its own block, its own I/O threads
    try:
        moe(x, router)
    except RuntimeError as e:
        assert "created before fork" in str(e) and "SparseMoE" in str(e), e
        say("child: the parent's block raised")
        return True
    say("child: the parent's block did not raise")
    return False

fork_children(3, child)
core._io_unhold()
ran.wait(30)
assert ran.is_set()
say("script ended")
"""

TORCH_SCRIPT = """
import tempfile
import torch
sys.path.insert(0, TESTS)
import hf_models
import strideweave as sw
from strideweave import friendly
from strideweave.torch import offload_experts, offloaded_experts
import numpy as np

folder = os.path.join(tempfile.mkdtemp(), "mixtral")
hf_models.save_model(hf_models.build_model("mixtral", seed=0), folder)

def offloaded():
    model = hf_models.load_model("mixtral", folder, experts_implementation="eager")
    bindings = offload_experts(model, folder, budget=1 << 30)
    assert len(bindings) == 2 and all(b.native for b in bindings)  # the C++ SparseMoE computes the experts
    return model.train()

models = [offloaded() for _ in range(3)]  # one per thread, and one for the children
ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    models[2](input_ids=ids)  # the children's model makes its SparseMoEs in the parent, before the fork
assert all(b._moes for b in offloaded_experts(models[2]).values())
stop = threading.Event()
steps = [0, 0]

def torch_loop(k):
    while not stop.is_set():
        models[k](input_ids=ids, labels=ids).loss.backward()
        steps[k] += 1

values = np.arange(-512, 512, dtype=np.float32)
def plain_loop():
    t = friendly.tensor(values)
    while True:
        assert np.array_equal(np.asarray(sw.relu(t)), np.maximum(values, 0))

threads = [threading.Thread(target=torch_loop, args=(k,), daemon=True) for k in range(2)]
for t in threads:
    t.start()
threading.Thread(target=plain_loop, daemon=True).start()

def stop_torch_threads():  # the supported pattern: torch's backward never runs during finalization
    stop.set()
    for t in threads:
        t.join()
import atexit
atexit.register(stop_torch_threads)

def child():
    torch.set_num_threads(1)  # before any torch operation in the child (libgomp's pool is the parent's)
    out = models[2](input_ids=ids, labels=ids)
    out.loss.backward()
    return bool(torch.isfinite(out.loss)) and np.array_equal(np.asarray(sw.relu(friendly.tensor(values))),
                                                             np.maximum(values, 0))

fork_children(3, child)
say("script ended")
"""


def run_script(tmp_path, body: str, timeout: float) -> subprocess.CompletedProcess:
    script = tmp_path / "pattern.py"
    script.write_text(f"TESTS = {TESTS!r}\n" + textwrap.dedent(FORK_HELPERS) + textwrap.dedent(body))
    env = dict(os.environ)
    if env.get("SW_SANITIZED") == "1":
        # Under `make sanitize` the process ends with daemon threads inside NumPy and CPython calls, which CPython
        # never unwinds: their frames' buffers (NumPy's iterators, the threads' start state) are still allocated at
        # exit, by construction of the pattern. LeakSanitizer would report those and fail the exit status this
        # test checks; AddressSanitizer's memory-error checks stay on.
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "").replace("detect_leaks=1", "detect_leaks=0")
    try:
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                              cwd=str(tmp_path), env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not finish in {timeout} s (stdout: {e.stdout!r}, stderr: {e.stderr!r})")


def check(result: subprocess.CompletedProcess, children: int) -> None:
    where = f"\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    assert lines.count("child status 0") == children, f"every child finishes with status 0{where}"
    assert "child HUNG" not in lines, where
    assert result.returncode == 0, f"exit status {result.returncode}{where}"
    assert not any(f in result.stderr for f in FATAL), where
    assert lines[-1] == "script ended", where


def test_engine_daemon_threads_forked_children_and_exit(tmp_path):
    """A child forked while a daemon thread is inside a SparseMoE call does its own engine work, and the block
    whose call was in flight raises RuntimeError "created before fork" there (it blocked for ever before); the
    parent then exits with both daemon threads running engine work: status 0, no fatal error."""
    result = run_script(tmp_path, ENGINE_SCRIPT, timeout=120)
    check(result, children=3)
    assert result.stdout.splitlines().count("child: the parent's block raised") == 3, result.stdout


def test_torch_daemon_threads_forked_children_and_exit(tmp_path):
    """Two daemon threads run forward and backward of offloaded transformers models while the main thread forks
    children that run their own forward and backward, with the setting docs/guide.md gives for PyTorch: every
    child finishes and the parent exits with status 0."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    result = run_script(tmp_path, TORCH_SCRIPT, timeout=240)
    check(result, children=3)
