"""The stubs check of `make typecheck` (run with the project's virtual environment, after `make install`).

1. The installed package ships its typing: strideweave/py.typed and strideweave/_core.pyi (nanobind's stubgen, at
   build time), and the stub types real arguments (no `: object` where the bindings know better).
2. mypy (pinned in requirements-dev.txt), strict, passes tests/typing/user_script.py, which then runs.
3. mypy reports every line of tests/typing/wrong_calls.py marked `# expect: TEXT`, with TEXT in the message: the
   check can fail.
The checker runs from this folder, so it sees the installed package, never the source tree.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CACHE = os.path.join(ROOT, "build", "mypy-cache")


def fail(message: str) -> None:
    print(f"typecheck: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--show-error-codes",
                           "--cache-dir", CACHE, *args], cwd=HERE, env=env, capture_output=True, text=True)


def main() -> None:
    spec = importlib.util.find_spec("strideweave")
    if spec is None or spec.origin is None:
        fail("strideweave is not installed (make install)")
    package = os.path.dirname(spec.origin)
    if os.path.commonpath([package, ROOT]) == ROOT and "site-packages" not in package:
        fail(f"strideweave resolves to the source tree ({package}), not the installed package")
    for name in ("py.typed", "_core.pyi"):
        if not os.path.isfile(os.path.join(package, name)):
            fail(f"the installed package has no {name} ({package})")
    with open(os.path.join(package, "_core.pyi"), encoding="utf-8") as f:
        stub = f.read()
    for needle in ("class Tensor", "class TiledEvictable", "def matmul(", "def __init__(self, carrier: Carrier"):
        if needle not in stub:
            fail(f"_core.pyi has no {needle!r}")

    # 2. A typed user script passes, strictly, and runs.
    done = mypy("--strict", "user_script.py")
    if done.returncode != 0:
        fail("mypy --strict refuses user_script.py:\n" + done.stdout + done.stderr)
    ran = subprocess.run([sys.executable, "user_script.py"], cwd=HERE, capture_output=True, text=True)
    if ran.returncode != 0:
        fail("user_script.py failed when run:\n" + ran.stdout + ran.stderr)
    print(ran.stdout.strip(), flush=True)

    # 3. Wrong calls are reported, each on its line with its message.
    expected: dict[int, str] = {}
    with open(os.path.join(HERE, "wrong_calls.py"), encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            m = re.search(r"  # expect: (.+)$", line)
            if m:
                expected[number] = m.group(1).strip()
    done = mypy("wrong_calls.py")
    if done.returncode == 0:
        fail("mypy accepted wrong_calls.py: the stubs let wrong calls through")
    reported: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        m = re.match(r"wrong_calls\.py:(\d+): error: (.*)$", line)
        if m:
            reported.setdefault(int(m.group(1)), []).append(m.group(2))
    missed = [f"line {n}: {text!r}" for n, text in sorted(expected.items())
              if not any(text in message for message in reported.get(n, []))]
    if missed:
        fail("mypy did not report, in wrong_calls.py, " + "; ".join(missed) + "\nmypy said:\n" + done.stdout)
    unexpected = sorted(set(reported) - set(expected))
    if unexpected:
        fail(f"mypy reported unmarked lines {unexpected} of wrong_calls.py:\n" + done.stdout)
    print(f"typecheck: user_script.py passes mypy --strict and runs; {len(expected)} wrong calls reported")


if __name__ == "__main__":
    main()
