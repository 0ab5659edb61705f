"""soak: runs the main job for a set time and checks that its memory, open files and threads do not grow.

``make soak`` runs ``python tools/soak.py`` (``SOAK_SECONDS=600`` by default). The job is
``examples/finetune_moe.py --seconds S`` (experts, gradients and AdamW moments offloaded under one
``sw.ResidencyBudget``, trained for S seconds; the example's sampled check ``--check-sample`` runs at the end), in
a child process; this process samples the child every ``--interval`` seconds (1 by default) from ``/proc/<pid>``:
its resident memory (``VmRSS`` of ``status``), its open file descriptors (the entries of ``fd/``) and its threads
(``Threads`` of ``status``). Nothing runs inside the job for the sampling.

Note [The soak's bound]
-----------------------
The window is the job's training loop: from the ``train_start_unix`` to the ``train_end_unix`` of the job's
summary JSON (``--summary-json`` of the example), or the job's whole life for a job that writes none (``--job``).
Its first ``--warmup-fraction`` (20%) is warm-up: the budget fills, the arenas and the page cache reach their
working sizes and the I/O threads start. After warm-up, for each series, a least-squares line is fitted to the
samples, and:

* RSS: the slope is below ``--rss-slope`` MiB per minute (2 by default) and the maximum of the last minute is at
  most the warm-up's maximum plus ``--rss-margin`` MiB (16 by default);
* open file descriptors and threads: the maximum after warm-up is at most the maximum during warm-up.

The bound is set against the leak that matters here, one tile buffer per step: the main job's smallest tile is an
expert matrix of I x H BFloat16 values (256 KiB at the defaults), so at S steps per minute such a leak grows RSS by
S / 4 MiB per minute, and the verdict prints that figure beside the bound (the run's own steps per minute). At the
75 steps per minute of the recorded run on a loaded 2-core machine (docs/reliability.md, "Soak") that is 18.8
MiB/min, 9 times the slope bound, and 150 MiB over the 8 minutes after warm-up, 9 times the margin; a leak of one
tile every 5 steps still exceeds the slope bound. What the job keeps by design stays far below it: its per-step
record for the summary and the plot (about 0.8 KiB per step, 0.06 MiB/min).

Writes ``samples.json`` (time, RSS, fds, threads per sample), ``verdict.json``, ``job.log`` (the job's output)
and ``soak.png`` (the three series against time, warm-up shaded, the fitted lines; ``--no-plot`` skips it, and
matplotlib is needed only for it) under ``--out`` (``build/soak``). The exit status is 0 when the job passed its
check and nothing grew, 1 otherwise.

Usage: python tools/soak.py [--seconds S] [--interval S] [--out DIR] [--warmup-fraction F] [--rss-slope MiB]
       [--rss-margin MiB] [--job "COMMAND"] [--no-plot] [-- EXAMPLE FLAGS]
(flags after ``--`` are passed to the example, after the soak's own: ``-- --tokens 256``.)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "finetune_moe.py")
SERIES = ("rss", "fds", "threads")


# ---------------------------------------------------------------- sampling


def sample(pid: int) -> dict | None:
    """RSS (bytes), open fds and threads of process `pid` now; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "VmRSS" not in fields:  # a zombie: its memory is gone
        return None
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "fds": fds, "threads": int(fields["Threads"])}


def run_and_sample(cmd: list, interval: float, log_path: str) -> tuple[int, dict]:
    """Runs `cmd`, sampling it every `interval` seconds until it exits. Returns (exit status, samples)."""
    samples = {"unix": [], "t": [], **{k: [] for k in SERIES}}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        tick = 0
        while True:  # the first sample one interval after the start (not of the process before its exec)
            tick += 1
            try:
                proc.wait(timeout=max(0.0, start + tick * interval - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                pass
            s = sample(proc.pid)
            if s is not None and proc.poll() is None:
                samples["unix"].append(time.time())
                samples["t"].append(time.monotonic() - start)
                for k in SERIES:
                    samples[k].append(s[k])
    return proc.returncode, samples


# ---------------------------------------------------------------- the verdict


def slope(t: list, y: list) -> float:
    """The least-squares slope of y against t (units of y per unit of t); 0 with fewer than two distinct t."""
    n = len(t)
    if n < 2:
        return 0.0
    mt, my = sum(t) / n, sum(y) / n
    stt = sum((a - mt) ** 2 for a in t)
    if stt == 0:
        return 0.0
    return sum((a - mt) * (b - my) for a, b in zip(t, y)) / stt


def analyze(samples: dict, window: tuple, warmup_fraction: float, rss_slope_mib_min: float,
            rss_margin_mib: float) -> dict:
    """The verdict over the samples in `window` (unix start, end): see the module docstring."""
    lo, hi = window
    idx = [i for i, u in enumerate(samples["unix"]) if lo <= u <= hi]
    warm_end = lo + warmup_fraction * (hi - lo)
    warm = [i for i in idx if samples["unix"][i] < warm_end]
    after = [i for i in idx if samples["unix"][i] >= warm_end]
    out = {"window_unix": [lo, hi], "warmup_end_unix": warm_end, "warmup_fraction": warmup_fraction,
           "samples_in_window": len(idx), "samples_after_warmup": len(after), "series": {}, "failures": []}
    if len(warm) < 1 or len(after) < 2:
        out["failures"].append(f"too few samples: {len(warm)} in warm-up, {len(after)} after it (window "
                               f"{hi - lo:.1f} s)")
        out["ok"] = False
        return out
    last_minute = [i for i in after if samples["unix"][i] >= max(warm_end, hi - 60.0)]
    for k in SERIES:
        t = [samples["unix"][i] / 60.0 for i in after]  # minutes
        y = [samples[k][i] / (MiB if k == "rss" else 1) for i in after]
        s = {"slope_per_min": slope(t, y), "warmup_max": max(samples[k][i] for i in warm),
             "after_warmup_max": max(samples[k][i] for i in after),
             "last_minute_max": max(samples[k][i] for i in last_minute),
             "first": samples[k][idx[0]], "last": samples[k][idx[-1]]}
        if k == "rss":
            s["unit"] = "bytes (slope: MiB/min)"
            s["bound"] = {"slope_mib_per_min": rss_slope_mib_min, "last_minute_margin_mib": rss_margin_mib}
            if not s["slope_per_min"] < rss_slope_mib_min:
                out["failures"].append(f"rss grows {s['slope_per_min']:.3f} MiB/min after warm-up "
                                       f"(bound {rss_slope_mib_min:g})")
            if s["last_minute_max"] > s["warmup_max"] + rss_margin_mib * MiB:
                out["failures"].append(f"rss of the last minute peaks at {s['last_minute_max'] / MiB:.1f} MiB, "
                                       f"above the warm-up's {s['warmup_max'] / MiB:.1f} MiB + {rss_margin_mib:g}")
        else:
            s["unit"] = "count (slope: per min)"
            s["bound"] = {"after_warmup_max_at_most": s["warmup_max"]}
            if s["after_warmup_max"] > s["warmup_max"]:
                out["failures"].append(f"{k} grow after warm-up: {s['after_warmup_max']} (warm-up max "
                                       f"{s['warmup_max']}; slope {s['slope_per_min']:.3f}/min)")
        out["series"][k] = s
    out["ok"] = not out["failures"]
    return out


# ---------------------------------------------------------------- the plot


def plot(samples: dict, verdict: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples["unix"][0] if samples["unix"] else 0.0
    t = [(u - t0) / 60 for u in samples["unix"]]
    lo, hi = ((u - t0) / 60 for u in verdict["window_unix"])
    warm_end = (verdict["warmup_end_unix"] - t0) / 60
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    for ax, k, label in zip(axes, SERIES, ("RSS (MiB)", "open file descriptors", "threads")):
        y = [v / MiB for v in samples[k]] if k == "rss" else samples[k]
        ax.plot(t, y, linewidth=1, label=label)
        ax.axvspan(lo, warm_end, color="0.85", label="warm-up")
        ax.axvline(hi, color="0.5", linestyle=":", linewidth=1, label="training ends")
        s = verdict.get("series", {}).get(k)
        if s is not None:
            pts = [(tt, yy) for tt, yy, u in zip(t, y, samples["unix"]) if verdict["warmup_end_unix"] <= u <= verdict["window_unix"][1]]
            if pts:
                mt = sum(p[0] for p in pts) / len(pts)
                my = sum(p[1] for p in pts) / len(pts)
                xs = [pts[0][0], pts[-1][0]]
                unit = "MiB/min" if k == "rss" else "/min"
                ax.plot(xs, [my + s["slope_per_min"] * (x - mt) for x in xs], color="C3", linewidth=1.5,
                        label=f"fit: {s['slope_per_min']:+.3f} {unit}")
        ax.set_ylabel(label)
        ax.legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("minutes since the job started")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 600)),
                   help="the job's training time (default: $SOAK_SECONDS or 600)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default %(default)s)")
    p.add_argument("--out", default=os.path.join("build", "soak"), help="output folder (default %(default)s)")
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="the first part of the window left out of the growth checks (default %(default)s)")
    p.add_argument("--rss-slope", type=float, default=2.0, help="RSS slope bound, MiB/min (default %(default)s)")
    p.add_argument("--rss-margin", type=float, default=16.0,
                   help="the last minute's RSS may exceed the warm-up's maximum by this many MiB "
                        "(default %(default)s)")
    p.add_argument("--job", default=None,
                   help="another command to soak instead of the example (whole life as the window; no check)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG (no matplotlib needed)")
    a = p.parse_args(argv)
    if not a.seconds > 0 or not a.interval > 0:
        p.error("--seconds and --interval must be > 0")
    if not 0 <= a.warmup_fraction < 1:
        p.error("--warmup-fraction must be in [0, 1)")
    a.extra = extra
    return a


def job_command(a) -> tuple[list, str | None]:
    """The command and the summary JSON it writes (None for --job)."""
    if a.job is not None:
        return shlex.split(a.job) + a.extra, None
    summary = os.path.join(a.out, "job-summary.json")
    # The sampled check (bounded memory; the full replay would hold every step's state in memory), every 50th
    # step and the last.
    cmd = [sys.executable, EXAMPLE, "--seconds", str(a.seconds), "--check-sample", "2", "--check-every", "50",
           "--no-progress", "--summary-json", summary] + a.extra
    return cmd, summary


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    cmd, summary_path = job_command(a)
    if summary_path is not None and os.path.exists(summary_path):
        os.remove(summary_path)
    print(f"soak: {shlex.join(cmd)}\n  sampling RSS, fds and threads every {a.interval:g} s -> {a.out}", flush=True)
    t_start = time.time()
    status, samples = run_and_sample(cmd, a.interval, os.path.join(a.out, "job.log"))
    t_end = time.time()
    summary = None
    if summary_path is not None and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    if summary is not None and "train_start_unix" in summary:
        window = (summary["train_start_unix"], summary["train_end_unix"])
    else:
        window = (t_start, t_end)
    verdict = analyze(samples, window, a.warmup_fraction, a.rss_slope, a.rss_margin)
    verdict["command"] = cmd
    verdict["exit_status"] = status
    verdict["interval_s"] = a.interval
    verdict["samples"] = len(samples["t"])
    job_ok = status == 0
    if summary_path is not None:
        check = (summary or {}).get("check") or {}
        job_ok = job_ok and bool(summary and summary.get("ok")) and bool(check.get("ok"))
        if summary is not None:
            minutes = (window[1] - window[0]) / 60
            steps = summary.get("steps", 0)
            verdict["job"] = {"steps": steps, "tokens_per_s": summary.get("tokens_per_s"),
                              "train_seconds": window[1] - window[0], "check_ok": bool(check.get("ok")),
                              "checked_steps": check.get("checked_steps"), "sample": check.get("sample"),
                              "reload_ok": summary.get("reload_ok")}
            tile = _tile_bytes(cmd)
            if tile and minutes > 0:
                verdict["job"]["tile_bytes"] = tile
                verdict["job"]["one_tile_per_step_mib_per_min"] = steps / minutes * tile / MiB
    if not job_ok:
        verdict["failures"].append(f"the job failed (exit status {status}; its check: see job.log)")
    verdict["job_ok"] = job_ok
    verdict["ok"] = job_ok and not verdict["failures"]
    with open(os.path.join(a.out, "samples.json"), "w") as f:
        json.dump(samples, f)
    with open(os.path.join(a.out, "verdict.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    report(verdict)
    if a.plot and samples["t"]:
        path = os.path.join(a.out, "soak.png")
        title = f"soak: {os.path.basename(cmd[1]) if a.job is None else a.job}, {a.seconds:g} s, " + \
                ("PASS" if verdict["ok"] else "FAIL")
        plot(samples, verdict, path, title)
        print(f"  plot: {path}")
    return 0 if verdict["ok"] else 1


def _tile_bytes(cmd: list) -> int:
    """The example's expert tile (I x H values of its dtype) for the flags in `cmd`."""
    flags = {"--hidden": 256, "--intermediate": 512, "--dtype": "bfloat16"}
    for i, c in enumerate(cmd[:-1]):
        if c in flags:
            flags[c] = cmd[i + 1]
    return int(flags["--hidden"]) * int(flags["--intermediate"]) * (2 if flags["--dtype"] == "bfloat16" else 4)


def report(v: dict) -> None:
    for k, s in v.get("series", {}).items():
        scale, unit = (MiB, "MiB") if k == "rss" else (1, "")
        print(f"  {k:<8} warm-up max {s['warmup_max'] / scale:9.1f}{unit}  after {s['after_warmup_max'] / scale:9.1f}"
              f"{unit}  slope {s['slope_per_min']:+.4f}{unit}/min")
    j = v.get("job")
    if j:
        print(f"  job: {j['steps']} steps in {j['train_seconds']:.0f} s, {j['tokens_per_s']:.0f} tokens/s, check "
              f"{'PASS' if j['check_ok'] else 'FAIL'}" + (f"; a leak of one {j['tile_bytes'] // 1024} KiB tile per "
              f"step would grow RSS {j['one_tile_per_step_mib_per_min']:.1f} MiB/min" if "tile_bytes" in j else ""))
    for f in v["failures"]:
        print(f"  FAIL: {f}")
    print(f"soak: {'PASS' if v['ok'] else 'FAIL'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
