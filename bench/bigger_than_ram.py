"""bigger_than_ram: the fine-tuning example under a memory limit smaller than its experts + gradients + moments.

Not a ratio benchmark and not part of ``make bench`` or CI: a documented run (docs/performance.md, "Bigger than
RAM") that shows the main job completing when the process cannot hold its state. It

1. makes a memory cgroup for the run (cgroup v2: a child of this process's cgroup with ``memory.max`` and
   ``memory.swap.max = 0``; cgroup v1: a child of its memory cgroup with ``memory.limit_in_bytes``, and
   ``memory.memsw.limit_in_bytes`` where swap accounting exists). Page cache the run touches is charged to the
   cgroup too, so the limit bounds the run's whole footprint and the kernel must write back and drop file pages
   to stay under it; going over kills the run (OOM), which this script reports as a failure;
2. runs ``examples/finetune_moe.py`` inside it (the checkpoint writer, the training, the save, the reload and the
   check are all inside), with ``--check-sample N``: instead of replaying every step all in memory, N sampled
   experts are recorded within the budgeted run on the checked steps and compared with PyTorch afterwards (their
   weight gradients in Float64 within the example's derived bound, their AdamW steps bit for bit against
   ``torch.optim.AdamW``, their saved values), one record in memory at a time;
3. refuses sizes whose experts + gradients + moments do not exceed the limit, and prints what it saw: the
   limit, the state, the process's peak RSS (after training, and at the end with the check), the cgroup's peak
   charge (RSS + page cache), throughput, bytes moved per tier, and the check.

Needs a writable cgroup (root, or a delegated cgroup v2 subtree); without one it says so. Where cgroups are not
writable, ``systemd-run --user --scope -p MemoryMax=1G -p MemorySwapMax=0 python examples/finetune_moe.py
--check-sample 4 ...`` gives the same bound.

Usage: python bench/bigger_than_ram.py [--limit-mib 1024] [--dir DIR] [-- EXAMPLE FLAGS...]
(default sizes: 4 layers x 8 experts, H 1024, I 2048, BFloat16: 2.25 GiB of experts + gradients + moments under a
1 GiB limit; 6 steps of 512 tokens, checked on steps 0 and 5, 4 sampled experts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "finetune_moe.py")
MiB = 1 << 20
DEFAULT_EXAMPLE_FLAGS = ["--layers", "4", "--experts", "8", "--hidden", "1024", "--intermediate", "2048",
                         "--steps", "6", "--check-every", "5", "--check-sample", "4", "--budget-ratio", "6",
                         "--no-progress"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


class Cgroup:
    """A memory cgroup made for one run (v2 or v1), removed by close()."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        name = f"strideweave-bigger-than-ram-{os.getpid()}"
        lines = open("/proc/self/cgroup").read().splitlines()
        v1 = [ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1].split(",").count("memory")]
        v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
        if v1 and os.path.isdir("/sys/fs/cgroup/memory"):
            self.version = 1
            self.path = os.path.join("/sys/fs/cgroup/memory", v1[0].lstrip("/"), name)
        elif v2 and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.version = 2
            self.path = os.path.join("/sys/fs/cgroup", v2[0].lstrip("/"), name)
        else:
            raise SystemExit("no memory cgroup found (neither cgroup v2 nor a v1 memory hierarchy)")
        try:
            os.mkdir(self.path)
            if self.version == 2:
                self._write("memory.max", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                    self._write("memory.swap.max", "0")
            else:
                self._write("memory.limit_in_bytes", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                    self._write("memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError as e:
            raise SystemExit(f"cannot make a memory cgroup at {self.path}: {e} (needs root or a delegated cgroup; "
                             f"see this script's docstring for systemd-run)") from e

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def enter(self) -> None:
        """Moves the calling process into the cgroup (run in the child before exec)."""
        self._write("cgroup.procs", str(os.getpid()))

    def peak_bytes(self) -> int | None:
        v = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(v) if v else None

    def limit_hits(self) -> str:
        if self.version == 2:
            events = dict(ln.split() for ln in (self._read("memory.events") or "").splitlines() if ln)
            return f"memory.events: max {events.get('max', '?')}, oom {events.get('oom', '?')}, oom_kill {events.get('oom_kill', '?')}"
        return f"memory.failcnt {(self._read('memory.failcnt') or '?').strip()}"

    def close(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-mib", type=int, default=1024, help="the cgroup's memory limit (default %(default)s)")
    p.add_argument("--dir", default=None, help="folder for the checkpoints and scratch files (default: temporary)")
    p.add_argument("example", nargs=argparse.REMAINDER, help="flags for examples/finetune_moe.py, after --")
    a = p.parse_args(argv)
    flags = [f for f in a.example if f != "--"] or DEFAULT_EXAMPLE_FLAGS
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import finetune_moe  # the example's own sizes

    cfg = finetune_moe.parse_args(flags)
    state = sum(cfg.state_bytes().values())
    limit = a.limit_mib * MiB
    if state <= limit:
        raise SystemExit(f"experts + gradients + moments ({state / MiB:.0f} MiB) must exceed the limit "
                         f"({a.limit_mib} MiB): choose larger sizes or a lower limit")
    if not cfg.check_sample:
        raise SystemExit("pass --check-sample N: the full replay holds the whole state in memory")
    cg = Cgroup(limit)
    try:
        with tempfile.TemporaryDirectory(prefix="bigger_than_ram_", dir=a.dir) as directory:
            summary_path = os.path.join(directory, "summary.json")
            cmd = [sys.executable, EXAMPLE] + flags + ["--dir", directory, "--summary-json", summary_path]
            print(f"CPU: {cpu_name()}; cgroup v{cg.version} limit {a.limit_mib} MiB (swap off) for "
                  f"{state / MiB:.0f} MiB of experts + gradients + moments ({state / limit:.2f}x the limit)")
            print("running:", " ".join(cmd[1:]), flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, preexec_fn=cg.enter, check=False)
            wall = time.perf_counter() - t0
            peak = cg.peak_bytes()
            print(f"\nexit status {proc.returncode} after {wall:.0f} s; {cg.limit_hits()}")
            if peak is not None:
                print(f"cgroup peak charge (RSS + page cache): {peak / MiB:.0f} MiB of the {a.limit_mib} MiB limit")
            if proc.returncode != 0 or not os.path.exists(summary_path):
                print("FAIL: the run did not complete" + (" (killed: over the limit)" if proc.returncode in (-9, 137)
                                                          else ""))
                return 1
            s = json.load(open(summary_path))
            ok = bool(s["ok"]) and s.get("check", {}).get("ok", False)
            print(f"process peak RSS after training {s['peak_rss'] / MiB:.0f} MiB "
                  f"({s['peak_rss'] / state:.2f}x the state, {s['peak_rss'] / limit:.2f}x the limit); "
                  f"tokens/s {s['tokens_per_s']:.0f}; peak RSS at the end (save, reload, check) "
                  f"{s['peak_rss_end'] / MiB:.0f} MiB; check {'PASS' if ok else 'FAIL'}")
            return 0 if ok else 1
    finally:
        cg.close()


if __name__ == "__main__":
    sys.exit(main())
