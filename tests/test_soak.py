"""The soak's machinery (tools/soak.py, ``make soak``; docs/reliability.md, "Soak"): the least-squares slope, the
verdict on synthetic series, the sampler on real child processes (a steady one passes, one that leaks memory, one
that leaks file descriptors and one that leaks threads are flagged), and a short soak of the main job whose check
passes. The 10-minute soak itself is ``make soak``.

Run: ``.venv/bin/python -m pytest -q tests/test_soak.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import soak  # noqa: E402

MiB = 1 << 20


def series(n, rss, fds, threads, t0=1000.0, dt=1.0):
    """Synthetic samples: rss(i), fds(i), threads(i) for i in range(n), one every dt seconds from unix t0."""
    s = {"unix": [t0 + i * dt for i in range(n)], "t": [i * dt for i in range(n)]}
    s["rss"] = [int(rss(i)) for i in range(n)]
    s["fds"] = [fds(i) for i in range(n)]
    s["threads"] = [threads(i) for i in range(n)]
    return s


def verdict(s, warmup=0.2, slope=2.0, margin=16.0):
    return soak.analyze(s, (s["unix"][0], s["unix"][-1]), warmup, slope, margin)


def test_slope_is_the_least_squares_slope():
    assert soak.slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    assert soak.slope([0, 1, 2, 3], [4, 4, 4, 4]) == 0.0
    assert soak.slope([0, 1, 2, 3], [0, 1, 0, 1]) == pytest.approx(0.2)  # not first-to-last (1/3)
    assert soak.slope([1], [3]) == 0.0 and soak.slope([2, 2], [1, 5]) == 0.0


def test_verdict_passes_a_flat_run_with_warmup_growth_and_noise():
    # Grows during warm-up (the first 20%: 120 of 600 samples), then flat with a few MiB of noise.
    s = series(600, lambda i: 200 * MiB + min(i, 100) * MiB + (i * 7919 % 5) * MiB,
               lambda i: 10 + (i < 50), lambda i: 5 + (i % 30 == 0) * (i < 100))
    v = verdict(s)
    assert v["ok"], v["failures"]
    assert abs(v["series"]["rss"]["slope_per_min"]) < 0.5
    assert v["samples_in_window"] == 600 and v["samples_after_warmup"] == 480


def test_verdict_flags_each_kind_of_growth():
    flat = lambda i: 100 * MiB  # noqa: E731
    # RSS: a 256 KiB tile per 1-second step = 15 MiB/min.
    v = verdict(series(600, lambda i: 100 * MiB + i * 256 * 1024, lambda i: 8, lambda i: 4))
    assert not v["ok"] and v["series"]["rss"]["slope_per_min"] == pytest.approx(15.0)
    assert any("rss grows 15.000 MiB/min" in f for f in v["failures"]), v["failures"]
    # RSS: a jump in the last minute (slope small over the whole window, margin exceeded).
    v = verdict(series(600, lambda i: 100 * MiB + (40 * MiB if i > 590 else 0), lambda i: 8, lambda i: 4))
    assert [f for f in v["failures"] if "last minute" in f], v["failures"]
    # A file descriptor every 100 s after warm-up; one thread more after warm-up.
    v = verdict(series(600, flat, lambda i: 8 + max(0, i - 120) // 100, lambda i: 4))
    assert v["failures"] == ["fds grow after warm-up: 12 (warm-up max 8; slope 0.621/min)"] or \
        [f for f in v["failures"] if f.startswith("fds grow after warm-up: 12 (warm-up max 8")], v["failures"]
    v = verdict(series(600, flat, lambda i: 8, lambda i: 4 + (i > 400)))
    assert [f for f in v["failures"] if f.startswith("threads grow after warm-up: 5 (warm-up max 4")], v["failures"]
    # Too short a window to judge: a failure, not a pass.
    v = verdict(series(1, flat, lambda i: 8, lambda i: 4))
    assert not v["ok"] and "too few samples" in v["failures"][0]


FAKE_JOB = textwrap.dedent(
    """
    import os, sys, threading, time
    kind, seconds = sys.argv[1], float(sys.argv[2])
    held, stop = [], threading.Event()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if kind == "rss":
            held.append(bytearray(b"x" * (4 << 20)))   # 4 MiB per tick, touched
        elif kind == "fds":
            held.append(open(os.devnull))
        elif kind == "threads":
            t = threading.Thread(target=stop.wait)
            t.start()
            held.append(t)
        time.sleep(0.1)  # the job's pace (one "step" per tick), not an ordering of events
    stop.set()
    """
)


def run_soak(tmp_path, *args, timeout=300):
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--out", str(out), "--no-plot",
                           *args], capture_output=True, text=True, timeout=timeout)
    with open(out / "verdict.json") as f:
        v = json.load(f)
    with open(out / "samples.json") as f:
        s = json.load(f)
    return proc, v, s


@pytest.mark.parametrize("kind", ["steady", "rss", "fds", "threads"])
def test_sampler_passes_a_steady_job_and_flags_a_leaking_one(tmp_path, kind):
    job = tmp_path / "job.py"
    job.write_text(FAKE_JOB)
    proc, v, s = run_soak(tmp_path, "--seconds", "4", "--interval", "0.1", "--rss-slope", "60", "--job",
                          f"{sys.executable} {job} {kind} 4")
    print(proc.stdout, proc.stderr)
    assert len(s["t"]) >= 20 and s["t"] == sorted(s["t"])  # sampled about every 0.1 s for 4 s
    assert min(s["rss"]) > MiB and min(s["fds"]) >= 3 and min(s["threads"]) >= 1
    if kind == "steady":
        assert proc.returncode == 0 and v["ok"], v["failures"]
        assert "soak: PASS" in proc.stdout
        return
    assert proc.returncode == 1 and not v["ok"]
    assert "soak: FAIL" in proc.stdout
    flagged = {f.split()[0] for f in v["failures"]}
    assert kind in flagged, v["failures"]  # (open files and threads cost memory too: rss may be flagged with them)
    if kind == "rss":
        assert flagged == {"rss"}, v["failures"]
    assert v["series"][kind]["slope_per_min"] > 0


def test_soak_of_a_failing_job_fails(tmp_path):
    proc, v, _ = run_soak(tmp_path, "--seconds", "1", "--interval", "0.1", "--job",
                          f"{sys.executable} -c 'import sys; sys.exit(3)'")  # exits at once: no timing
    assert proc.returncode == 1 and not v["job_ok"] and v["exit_status"] == 3
    assert any("the job failed (exit status 3" in f for f in v["failures"]), v["failures"]


def test_soak_arguments_are_checked(tmp_path):
    for args, message in ((["--seconds", "0"], "--seconds and --interval must be > 0"),
                          (["--warmup-fraction", "1"], "--warmup-fraction must be in [0, 1)")):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--out",
                               str(tmp_path / "x"), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr
        assert not (tmp_path / "x").exists()  # nothing started, nothing written


def test_short_soak_of_the_main_job(tmp_path):
    """The main job (small sizes) for a few seconds under the sampler: the window is its training loop (from its
    summary), its sampled check passes, and the verdict has every series. Growth is not judged on so short a
    window (the real bound is ``make soak``'s)."""
    proc, v, s = run_soak(tmp_path, "--seconds", "6", "--interval", "0.25", "--rss-slope", "1e9", "--rss-margin",
                          "1e9", "--", "--layers", "2", "--experts", "4", "--hidden", "64", "--intermediate", "128",
                          "--vocab", "128", "--tokens", "64", "--check-every", "4", timeout=600)
    log = (tmp_path / "soak" / "job.log").read_text()
    assert v["job_ok"], log[-3000:]
    j = v["job"]
    assert j["check_ok"] and j["reload_ok"] and j["steps"] >= 2
    assert j["checked_steps"][-1] == j["steps"] - 1  # the last step (decided by time) was checked
    assert j["train_seconds"] >= 6 and j["tile_bytes"] == 64 * 128 * 2
    lo, hi = v["window_unix"]
    assert s["unix"][0] < lo < hi < s["unix"][-1]  # sampled before and after the training loop
    assert v["samples_after_warmup"] >= 10 and set(v["series"]) == {"rss", "fds", "threads"}
    assert f"{j['steps']} x 64" in log  # the example's summary counts the steps done


def test_the_examples_seconds_flag_is_checked(capsys, tmp_path):
    import examples  # tests/examples.py

    ex = examples.load_example("finetune_moe")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="--seconds must be >= 0"):
            ex.Config(seconds=bad).validate()
    with pytest.raises(SystemExit) as e:
        ex.parse_args(["--seconds", "-5", "--dir", str(tmp_path / "never")])
    assert e.value.code == 2 and "--seconds must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()  # nothing ran
    assert ex.parse_args(["--seconds", "2.5"]).seconds == 2.5 and ex.parse_args([]).seconds == 0
