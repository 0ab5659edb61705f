"""Shared helpers for StrideWeave benchmarks (see shared design: benchmarks.md).

Every figure is a ratio measured in one run: StrideWeave ("ours") and its
reference do the same work, interleaved A B A B ... after a warm-up, and the
benchmark reports the median of the per-pair ratios ours/reference plus their
min and max. Absolute times are for context only.

A benchmark script uses this module like so::

    args = harness.parse_args("matmul")           # --quick, --reps, --json-only
    case = harness.compare("grad=off", ours, ref, reps=..., inner=...)
    harness.emit(harness.record("matmul", [case, ...], target=1.10, better="lower"))

`emit` prints the record as the last line of output: one JSON object with the
keys of benchmarks.md (bench, ratio, ratio_min, ratio_max, target, better,
ours_s, reference_s, bytes, detail) plus `cases` (one object per case with the
same numbers), `meets_target` (whether "ratio" meets the target, compared in
the direction of `better`) and `quick` (whether --quick was given). With
several cases, "ratio" is the worst case's median (highest for better=lower,
lowest for better=higher), and ratio_min/ratio_max/ours_s/reference_s/bytes
are that case's.

Benchmarks whose ratio is not a pair of calls timed by `compare` (overlap: a
wall against the larger of two separately measured walls; moe_layer and
moe_naive: runs in fresh processes, ratio = throughput or speed-up) build
their `Case` objects themselves, and may add keys to the record before
`emit`: "ratio_label" (what the ratio divides, for charts) and, for
moe_layer, a second target on memory ("memory_ratio", "memory_target", ...).

The harness never touches OPENBLAS_* (or any other) environment variables.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Case", "parse_args", "time_call", "calibrate_inner", "compare", "record", "log", "emit", "fmt_s"]


@dataclass
class Case:
    """The measurement of one case: per-pair ratios and per-call times."""

    name: str
    ratio: float  # median of per-pair ratios ours/reference
    ratio_min: float
    ratio_max: float
    ours_s: float  # median seconds per call (context only)
    reference_s: float
    reps: int
    inner: int  # calls per timed sample
    bytes: int = 0
    ratios: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> str:
        return (
            f"{self.name}: {self.ratio:.3f} [{self.ratio_min:.3f}, {self.ratio_max:.3f}] "
            f"ours {fmt_s(self.ours_s)} ref {fmt_s(self.reference_s)}"
        )


def fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.3f} us"
    return f"{seconds * 1e9:.1f} ns"


def parse_args(bench: str, argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The common flags: --quick (under a minute), --reps N (override), --quiet (only the JSON line)."""
    p = argparse.ArgumentParser(prog=f"bench/{bench}.py", description=description)
    p.add_argument("--quick", action="store_true", help="fewer repetitions: the whole benchmark in under a minute")
    p.add_argument("--reps", type=int, default=None, help="timed pairs per case (overrides the mode's default)")
    p.add_argument("--quiet", action="store_true", help="print only the final JSON line")
    args = p.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def time_call(fn: Callable[[], object], inner: int) -> float:
    """Seconds for `inner` back-to-back calls of fn (garbage collector paused, as timeit does)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        t1 = time.perf_counter_ns()
    finally:
        if gc_was_enabled:
            gc.enable()
    return (t1 - t0) * 1e-9


def calibrate_inner(fn: Callable[[], object], min_sample_s: float, max_inner: int = 1 << 20) -> int:
    """Calls per timed sample so that one sample lasts at least min_sample_s (timer resolution, noise)."""
    inner = 1
    while inner < max_inner:
        t = time_call(fn, inner)
        if t >= min_sample_s:
            break
        inner = min(max_inner, inner * 2 if t <= 0 else max(inner * 2, math.ceil(inner * min_sample_s / t)))
    return inner


def compare(
    name: str,
    ours: Callable[[], object],
    reference: Callable[[], object],
    *,
    reps: int,
    warmup: int = 3,
    inner: int | None = None,
    min_sample_s: float = 0.02,
    bytes: int = 0,
    budget_s: float | None = None,
    min_reps: int = 5,
    prepare_ours: Callable[[], object] | None = None,
    settle_s: float = 0.0,
) -> Case:
    """Interleaved timing A B A B ...: `warmup` untimed pairs, then `reps` timed pairs.

    Each timed sample runs `inner` calls (calibrated on the reference to last
    at least min_sample_s when not given); the per-pair ratio is
    ours_sample / reference_sample. With `budget_s`, timing stops early once
    the timed pairs have taken that long and at least `min_reps` pairs exist
    (keeps --quick under a minute when a side turns slow); Case.reps tells
    how many pairs were timed.

    With `prepare_ours`, every call of `ours` is preceded by an untimed call
    of prepare_ours (state that each call must start from, e.g. evicted
    tiles); samples are then single calls, so `inner` must be 1 or None.

    With `settle_s`, the process sleeps that long (untimed) before every timed
    sample of either side, so helper threads the previous sample left busy
    (a BLAS's workers spin for a while after each call) are idle again when
    the next sample starts: both sides start from the same quiet machine.
    """
    if prepare_ours is not None:
        if inner not in (None, 1):
            raise ValueError("prepare_ours needs single-call samples (inner=1)")
        inner = 1
    prepare = prepare_ours or (lambda: None)
    for _ in range(warmup):
        prepare()
        ours()
        reference()
    if inner is None:
        inner = calibrate_inner(reference, min_sample_s)
    # One untimed pair at the sample size too, so caches and pools are warm for it.
    prepare()
    time_call(ours, inner)
    time_call(reference, inner)
    ours_t, ref_t, ratios = [], [], []
    started = time.perf_counter()
    for _ in range(reps):
        prepare()
        if settle_s:
            time.sleep(settle_s)
        a = time_call(ours, inner)
        if settle_s:
            time.sleep(settle_s)
        b = time_call(reference, inner)
        ours_t.append(a / inner)
        ref_t.append(b / inner)
        ratios.append(a / b)
        if budget_s is not None and len(ratios) >= min_reps and time.perf_counter() - started > budget_s:
            break
    return Case(
        name=name,
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        ours_s=statistics.median(ours_t),
        reference_s=statistics.median(ref_t),
        reps=len(ratios),
        inner=inner,
        bytes=bytes,
        ratios=ratios,
    )


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _meets(ratio: float, target: float, better: str) -> bool:
    return ratio <= target if better == "lower" else ratio >= target


def record(bench: str, cases: list[Case], *, target: float, better: str, quick: bool, note: str = "",
           case_targets: dict[str, float] | None = None, untargeted: set[str] | None = None) -> dict:
    """The JSON record of benchmarks.md for a list of cases (worst case leads).

    `case_targets` gives some cases a target of their own (by case name; the others have `target`): the worst
    case is then the one furthest from its own target (ratio / target), and the record's target is its target.
    `untargeted` names cases reported for context only: they have no target ("target": null, "meets_target":
    null in their case object) and never lead the record.
    """
    if better not in ("lower", "higher"):
        raise ValueError("better must be 'lower' or 'higher'")
    if not cases:
        raise ValueError("record needs at least one case")
    targets = case_targets or {}
    context = untargeted or set()
    unknown = context - {c.name for c in cases}
    if unknown:
        raise ValueError(f"untargeted names no case: {sorted(unknown)}")
    targeted = [c for c in cases if c.name not in context]
    if not targeted:
        raise ValueError("record needs at least one targeted case")

    def target_of(c: Case) -> float:
        return targets.get(c.name, target)

    def score(c: Case) -> float:
        return c.ratio / target_of(c)

    worst = max(targeted, key=score) if better == "lower" else min(targeted, key=score)
    target = target_of(worst)
    detail = "; ".join(c.summary() + (" (untargeted)" if c.name in context else "") for c in cases)
    if len(cases) > 1:
        detail = f"worst: {worst.name}; " + detail
    if note:
        detail += f"; {note}"
    return {
        "bench": bench,
        "ratio": _round(worst.ratio),
        "ratio_min": _round(worst.ratio_min),
        "ratio_max": _round(worst.ratio_max),
        "target": target,
        "better": better,
        "ours_s": _round(worst.ours_s),
        "reference_s": _round(worst.reference_s),
        "bytes": int(worst.bytes),
        "detail": detail,
        "meets_target": _meets(worst.ratio, target, better),
        "quick": quick,
        "python": platform.python_version(),
        "cases": [
            {
                "name": c.name,
                "ratio": _round(c.ratio),
                "ratio_min": _round(c.ratio_min),
                "ratio_max": _round(c.ratio_max),
                "ours_s": _round(c.ours_s),
                "reference_s": _round(c.reference_s),
                "bytes": int(c.bytes),
                "reps": c.reps,
                "inner": c.inner,
                "target": None if c.name in context else target_of(c),
                "meets_target": None if c.name in context else _meets(c.ratio, target_of(c), better),
            }
            for c in cases
        ],
    }


def log(args: argparse.Namespace, *parts: object) -> None:
    """Context lines on stdout, before the JSON line, unless --quiet."""
    if not getattr(args, "quiet", False):
        print(*parts, flush=True)


def emit(rec: dict) -> None:
    """Prints the record as the last line of output (one JSON object)."""
    sys.stdout.flush()
    print(json.dumps(rec), flush=True)

