"""examples/moe_offload.py at toy sizes: the correctness check passes and the summary is sane."""

from __future__ import annotations

import os

import numpy as np
import pytest

import examples  # tests/examples.py


def load_example():
    return examples.load_example("moe_offload")


TINY = ["--experts", "8", "--d-model", "32", "--d-hidden", "32", "--budget", "3", "--batches", "4",
        "--tokens", "16", "--no-progress"]


@pytest.mark.parametrize("policy", ["lru", "pinned", "none"])
def test_tiny_run_checks_and_summarises(tmp_path, capsys, policy):
    moe = load_example()
    s = moe.main(TINY + ["--policy", policy, "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "PASS" in out and "tokens/s" in out and "expert hit rate" in out
    c = s["check"]
    assert c["ok"]
    assert max(c["worst_y"], c["worst_w1"], c["worst_w2"]) <= 1.0
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


# ---------------------------------------------------------------- the correctness check itself


def checked_run(moe, monkeypatch, argv, wrap_backward=None):
    """Runs the example with `argv`; returns the correctness check's result (recorded even when it fails, in which
    case main raises AssertionError). `wrap_backward(batch_index, e, G)` may replace the cotangent one expert's
    backward receives in one batch."""
    seen = {}
    real_check = moe.check

    def recording_check(*args, **kwargs):
        seen["check"] = real_check(*args, **kwargs)
        return seen["check"]

    monkeypatch.setattr(moe, "check", recording_check)
    if wrap_backward is not None:
        real = moe.expert_forward_backward
        batches = []

        def patched(batch, e, w1, w2, G, y, before_backward=None):
            if not batches or batches[-1] is not batch:
                batches.append(batch)
            real(batch, e, w1, w2, wrap_backward(len(batches) - 1, e, G), y, before_backward)

        monkeypatch.setattr(moe, "expert_forward_backward", patched)
    try:
        moe.main(argv)
    except AssertionError:
        assert "check" in seen and not seen["check"]["ok"]
    return seen["check"]


@pytest.mark.parametrize("fault,factor", [("lost", 0.0), ("added twice", 2.0)])
def test_the_check_fails_when_one_batch_contribution_of_one_expert_is_lost_or_doubled(tmp_path, monkeypatch,
                                                                                       fault, factor):
    moe = load_example()
    cfg = moe.parse_args(TINY)
    hot = int(np.argmax(moe.popularity(cfg)))  # routed to in every batch: one lost batch of several
    hits = []

    def wrap(b, e, G):
        if (b, e) == (2, hot):
            hits.append(b)
            return G * np.float32(factor)
        return G

    c = checked_run(moe, monkeypatch, TINY + ["--dir", str(tmp_path)], wrap)
    assert hits == [2], "the faulty backward ran once"
    assert not c["ok"]
    assert c["worst_y"] <= 1.0  # the forward is untouched
    assert c["worst_w1"] > 1.0 and c["worst_w2"] > 1.0, c  # both gradients miss (or double) one batch's share
    # The same run with every contribution intact passes.
    c = checked_run(load_example(), monkeypatch, TINY + ["--dir", str(tmp_path)])
    assert c["ok"], c


def test_the_check_accepts_either_mask_at_relus_kink(tmp_path, monkeypatch):
    """W1's rows are made orthogonal to tokens routed to them in the first batch, so those pre-activations are 0
    up to Float32 rounding: StrideWeave's sign and the Float64 reference's are each a coin toss. The check counts
    them as at the kink and passes; the rest of the check is as strict as ever."""
    moe = load_example()
    argv = ["--experts", "6", "--d-model", "64", "--d-hidden", "32", "--budget", "3", "--batches", "3",
            "--tokens", "32", "--no-progress", "--dir", str(tmp_path)]
    cfg = moe.parse_args(argv)
    rows, cols = moe.matrix_shape(cfg, "w1")
    first = moe.make_batch(cfg, 0, np.log(moe.popularity(cfg)))
    real_write = moe.write_checkpoint
    modified = []

    def write_with_kinks(cfg_, directory):
        paths = real_write(cfg_, directory)
        with open(paths["w1"], "r+b") as f:
            for e in first.used:
                tokens, _ = first.tokens_of(e)
                w = moe.read_expert(paths["w1"], e, rows, cols).astype(np.float64)
                for j in range(rows):
                    x = first.x[tokens[j % tokens.size]].astype(np.float64)
                    w[j] -= (w[j] @ x) / (x @ x) * x  # x . w[j] = 0 exactly, before rounding w to Float32
                    modified.append((e, j))
                f.seek(e * rows * cols * 4)
                f.write(np.ascontiguousarray(w.astype(np.float32).T).tobytes())  # column-major, as written
        return paths

    monkeypatch.setattr(moe, "write_checkpoint", write_with_kinks)
    c = checked_run(moe, monkeypatch, argv)
    assert len(modified) == len(first.used) * rows
    # Rounding each w[j] to Float32 moves x . w[j] by at most u * sum |x| |w|, inside the pre-activation's bound.
    assert c["kink_elements"] >= len(modified), c
    assert c["ok"], c
