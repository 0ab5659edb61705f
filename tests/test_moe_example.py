"""examples/moe_offload.py at toy sizes: the correctness check passes and the summary is sane."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def load_example():
    path = os.path.join(HERE, "..", "examples", "moe_offload.py")
    spec = importlib.util.spec_from_file_location("moe_offload", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


TINY = ["--experts", "8", "--d-model", "32", "--d-hidden", "32", "--budget", "3", "--batches", "4",
        "--tokens", "16", "--no-progress"]


@pytest.mark.parametrize("policy", ["lru", "pinned", "none"])
def test_tiny_run_checks_and_summarises(tmp_path, capsys, policy):
    moe = load_example()
    s = moe.main(TINY + ["--policy", policy, "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "PASS" in out and "tokens/s" in out and "expert hit rate" in out
    assert s["check"]["ok"]
    assert s["check"]["max_abs_err_y"] <= s["check"]["tol_y"]
    assert s["check"]["max_abs_err_grad"] <= s["check"]["tol_grad"]
    assert 0.0 <= s["hit_rate"] <= 1.0
    assert s["bytes_promoted"] > 0
    assert s["bytes_evicted"] == 0  # weights are clean: evictions skip the write
    assert s["tokens_per_s"] > 0 and s["wall"] > 0 and s["peak_rss"] > 0
    assert len(s["per_batch"]) == 4
    # The checkpoint is the two raw files, written once and opened in place.
    names = sorted(os.listdir(tmp_path))
    assert names == ["moe_w1.f32", "moe_w2.f32"]
    assert all(os.path.getsize(tmp_path / n) == 8 * 32 * 32 * 4 for n in names)


def test_lru_bounds_tracked_residency_and_evicts(tmp_path):
    moe = load_example()
    s = moe.main(TINY + ["--dir", str(tmp_path), "--no-check"])
    assert s["writes_skipped"] > 0  # LRU evicted clean weight tiles
    # Budget 3, plus at most the next batch's prefetched misses and this batch's not yet projected ones.
    assert s["peak_resident_experts"] <= 8


def test_expert_last_projection_is_the_checkpoint_matrix(tmp_path):
    moe = load_example()
    cfg = moe.Config(experts=5, d_model=6, d_hidden=4, batches=1, tokens=4)
    paths = moe.write_checkpoint(cfg, str(tmp_path))
    carrier, full = moe.open_expert_weights(cfg, paths["w1"], "w1", None)
    import numpy as np
    import strideweave as sw

    for e in (3, 0):
        with sw.no_grad():
            got = np.asarray(carrier.project(full, sw.TileSelection([[0], [e]])).wait())
        np.testing.assert_array_equal(got, moe.read_expert(paths["w1"], e, 4, 6))
    carrier.release()


def test_compare_without_torch_fails_clearly(tmp_path, monkeypatch):
    moe = load_example()
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match="needs PyTorch"):
        moe.main(TINY + ["--dir", str(tmp_path), "--no-check", "--compare"])


def test_bad_flags_are_refused(capsys):
    moe = load_example()
    with pytest.raises(SystemExit):
        moe.parse_args(["--top-k", "9", "--experts", "8"])
    assert "--top-k" in capsys.readouterr().err
