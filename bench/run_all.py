"""Runs every benchmark in bench/ and collects their records.

Each bench/<name>.py (all but harness.py and run_all.py) runs in its own
process, with --quick unless --full is given. The last line each prints is its
JSON record (benchmarks.md); run_all writes them all to
bench/results/latest.json and draws one PNG chart per benchmark in
bench/results/<name>.png: the measured ratio of each case (median, with a
min-max error bar) against the target line, in the record's direction
("better": lower or higher); a record with a memory ratio (moe_layer) gets a
second panel for it, and counts as meeting its targets only when both are met.

Exit status: 0 when every benchmark produced a record (missing a target is a
result, not a failure), 1 when one crashed, timed out or printed no record.

With --only, the records of the other benchmarks already in latest.json (same
mode) are kept.

peers (DeepSpeed beside StrideWeave and PyTorch) runs only with --full: it needs
requirements-peers.txt and libaio-dev, which make bench installs under FULL=1.

Usage: python bench/run_all.py [--full] [--only NAME ...] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
NOT_BENCHMARKS = {"harness.py", "run_all.py", "interleave.py", "bigger_than_ram.py", "gather_paths.py", "after_torch.py",
                  "distributed.py"}  # measurements, no target
FULL_ONLY = {"peers"}  # run only with --full (DeepSpeed: requirements-peers.txt, installed by make bench FULL=1)


def discover() -> list[str]:
    return sorted(
        f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and f not in NOT_BENCHMARKS and not f.startswith("_")
    )


def last_json_line(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            return None
        return rec if isinstance(rec, dict) else None
    return None


def run_one(name: str, full: bool, timeout: float) -> dict:
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py")] + ([] if full else ["--quick"])
    print(f"== {name}: {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        sys.stdout.write(out)
        return {"bench": name, "error": f"timed out after {timeout:.0f} s"}
    wall = time.monotonic() - t0
    sys.stdout.write(proc.stdout)
    if proc.stderr.strip():
        sys.stdout.write("".join(f"  [stderr] {l}\n" for l in proc.stderr.strip().splitlines()[-20:]))
    rec = last_json_line(proc.stdout)
    if proc.returncode != 0 or rec is None:
        why = f"exit status {proc.returncode}" if proc.returncode != 0 else "no JSON record on the last line"
        return {"bench": name, "error": why}
    rec.setdefault("bench", name)
    rec["wall_s"] = round(wall, 2)
    return rec


def _meets(ratio: float, target: float, better: str) -> bool:
    return ratio <= target if better == "lower" else ratio >= target


def meets(rec: dict) -> bool | None:
    """Whether a record meets its target(s): the ratio's, and the memory ratio's where it has one (moe_layer)."""
    if "ratio" not in rec or "target" not in rec:
        return None
    ok = _meets(rec["ratio"], rec["target"], rec.get("better", "lower"))
    if "memory_ratio" in rec and "memory_target" in rec:
        ok = ok and _meets(rec["memory_ratio"], rec["memory_target"], rec.get("memory_better", "lower"))
    return ok


def chart(rec: dict, path: str) -> None:
    """One PNG per record: each case's median ratio (bar, green when it meets the target) with its min-max
    range against the target line. A record with a memory ratio (moe_layer) gets a second panel for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = rec.get("cases") or [
        {"name": rec["bench"], "ratio": rec["ratio"], "ratio_min": rec.get("ratio_min", rec["ratio"]),
         "ratio_max": rec.get("ratio_max", rec["ratio"])}
    ]
    panels = [(cases, rec["target"], rec.get("better", "lower"),
               rec.get("ratio_label", "ratio StrideWeave / reference"))]
    if "memory_ratio" in rec and "memory_target" in rec:
        memory = {"name": "peak RSS", "ratio": rec["memory_ratio"],
                  "ratio_min": rec.get("memory_ratio_min", rec["memory_ratio"]),
                  "ratio_max": rec.get("memory_ratio_max", rec["memory_ratio"])}
        panels.append(([memory], rec["memory_target"], rec.get("memory_better", "lower"),
                       "peak RSS StrideWeave / reference"))
    width = sum(max(5.0, 1.6 * len(p[0]) + 2.5) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [max(1, len(p[0])) for p in panels]})
    for ax, (cases, target, better, label) in zip(axes[0], panels):
        _chart_panel(ax, cases, target, better, label)
    mode = "quick" if rec.get("quick") else "full"
    title = f"{rec['bench']} ({mode}): ratio {rec['ratio']:.3g}, target {rec['target']:g}"
    if len(panels) > 1:
        title += f"; memory ratio {rec['memory_ratio']:.3g}, target {rec['memory_target']:g}"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _chart_panel(ax, cases: list, target: float, better: str, label: str) -> None:
    names = [c["name"] for c in cases]
    med = [c["ratio"] for c in cases]
    lo = [max(0.0, c["ratio"] - c.get("ratio_min", c["ratio"])) for c in cases]
    hi = [max(0.0, c.get("ratio_max", c["ratio"]) - c["ratio"]) for c in cases]
    # A case may have its own target, or none ("target": null: reported for context, drawn grey).
    ok = [None if "target" in c and c["target"] is None else _meets(m, c.get("target", target), better)
          for m, c in zip(med, cases)]
    xs = list(range(len(cases)))
    ax.bar(xs, med, color=["#9a9a9a" if g is None else "#4c9a5b" if g else "#c8553d" for g in ok], width=0.55,
           zorder=2)
    ax.errorbar(xs, med, yerr=[lo, hi], fmt="none", ecolor="black", capsize=6, lw=1.2, zorder=3)
    ax.axhline(target, color="#333333", ls="--", lw=1.2, zorder=1, label=f"target {target:g} ({better} is better)")
    for x, m in zip(xs, med):
        ax.annotate(f"{m:.3g}", (x, m), textcoords="offset points", xytext=(10, 3), fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=15 if len(cases) > 2 else 0, ha="right" if len(cases) > 2 else "center", fontsize=8)
    ax.set_ylabel(f"{label}\n(median, min-max)", fontsize=9)
    top = max([m + h for m, h in zip(med, hi)] + [target]) * 1.15
    ax.set_ylim(0, top)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="y", alpha=0.3, zorder=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="full runs instead of --quick")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    p.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default 600 quick, 3600 full)")
    args = p.parse_args(argv)

    names = discover()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            p.error(f"unknown benchmark(s): {', '.join(unknown)} (have: {', '.join(names)})")
        names = [n for n in names if n in args.only]
    if not args.full:
        skipped = sorted(set(names) & FULL_ONLY)
        if args.only and skipped:
            p.error(f"{', '.join(skipped)} run(s) only with --full")
        names = [n for n in names if n not in FULL_ONLY]
    timeout = args.timeout or (3600.0 if args.full else 600.0)

    records = [run_one(n, args.full, timeout) for n in names]

    os.makedirs(RESULTS, exist_ok=True)
    for rec in records:
        if "error" in rec:
            continue
        try:
            chart(rec, os.path.join(RESULTS, f"{rec['bench']}.png"))
        except Exception as e:  # a chart is context; the record stays
            rec["chart_error"] = f"{type(e).__name__}: {e}"
    mode = "full" if args.full else "quick"
    latest = os.path.join(RESULTS, "latest.json")
    merged = records
    if args.only and os.path.exists(latest):
        # A partial run replaces only its own benchmarks' records (same mode).
        try:
            with open(latest) as fh:
                old = json.load(fh)
            if old.get("mode") == mode:
                fresh = {r["bench"]: r for r in records}
                merged = [fresh.pop(r.get("bench"), r) for r in old.get("results", [])] + list(fresh.values())
        except (OSError, ValueError, KeyError, TypeError):
            merged = records
    summary = {
        "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "results": merged,
    }
    with open(latest, "w") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")

    print("\n== summary (ratio = StrideWeave / reference unless the record says otherwise, median of interleaved "
          "pairs [min, max])")
    failed = False
    for rec in records:
        if "error" in rec:
            failed = True
            print(f"  {rec['bench']:<14} ERROR: {rec['error']}")
            continue
        verdict = {True: "meets target", False: "MISSES target", None: "?"}[meets(rec)]
        print(f"  {rec['bench']:<14} {rec['ratio']:.3f} [{rec.get('ratio_min', float('nan')):.3f}, "
              f"{rec.get('ratio_max', float('nan')):.3f}]  target {rec['target']:g} ({rec.get('better')} is better): {verdict}")
        if "memory_ratio" in rec:
            print(f"  {'':<14} memory {rec['memory_ratio']:.3f} [{rec.get('memory_ratio_min', float('nan')):.3f}, "
                  f"{rec.get('memory_ratio_max', float('nan')):.3f}]  target {rec['memory_target']:g} "
                  f"({rec.get('memory_better', 'lower')} is better)")
        for c in rec.get("cases", []):
            print(f"      {c['name']:<38} {c['ratio']:.3f} [{c['ratio_min']:.3f}, {c['ratio_max']:.3f}]")
    print(f"  written: {os.path.relpath(os.path.join(RESULTS, 'latest.json'), ROOT)} and one PNG per benchmark")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
