"""examples/finetune_moe.py at tiny sizes: the checks pass, the summary is sane, the check
fails when one expert's gradient is wrong, and the saved checkpoint is a Mixtral-format file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import strideweave as sw

import examples  # tests/examples.py


def load_example():
    return examples.load_example("finetune_moe")


TINY = ["--layers", "2", "--experts", "4", "--hidden", "16", "--intermediate", "24", "--vocab", "32",
        "--tokens", "24", "--steps", "3", "--check-every", "1", "--no-progress"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_run_checks_saves_reloads_and_summarises(tmp_path, capsys, dtype):
    ex = load_example()
    s = ex.main(TINY + ["--dtype", dtype, "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert s["ok"] and s["reload_ok"], s["failures"]
    for fragment in ("tokens/s", "expert hit rate", "peak RSS", "waiting for I/O", "moments: read / written",
                     "gradients: read / written", "weights: read / written", "PASS"):
        assert fragment in out, fragment
    assert "FAIL" not in out
    c = s["check"]
    assert c["ok"] and c["mismatched_weights"] == 0 and c["saved_mismatches"] == 0
    assert c["checked_steps"] == [0, 1, 2]
    assert 0 < max(c["worst"].values()) <= 1.0
    assert c["counts"]["routing_mismatch"] == 0 and c["counts"]["routed_tokens"] == 3 * 2 * 24
    cfg = ex.parse_args(TINY + ["--dtype", dtype])
    total = sum(cfg.state_bytes().values())
    assert total >= 4 * cfg.budget_bytes()
    assert s["budget_peak"] <= cfg.budget_bytes()
    assert s["moments_written"] > 0 and s["moments_read"] > 0  # the moments do not fit: they go to their tier
    assert s["weights_written"] > 0  # stepped weights evicted to the checkpoint's overlay, not to the file
    assert s["checkpoint_read"] > 0 and s["tokens_per_s"] > 0 and s["peak_rss"] > 0
    assert len(s["per_step"]) == 3 and all(r["after_step"]["moments"] <= cfg.budget_bytes() for r in s["per_step"])
    # The original checkpoint is a Mixtral-format folder: shards and index, never written by the run.
    folder = tmp_path / "mixtral"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    assert "model.layers.0.block_sparse_moe.gate.weight" in index["weight_map"]


def test_the_saved_checkpoint_differs_from_the_original_only_by_training(tmp_path):
    """The saved file names every expert as the original does; the values moved (AdamW stepped them) and the
    original shards are unchanged by the run."""
    ex = load_example()
    cfg = ex.parse_args(TINY + ["--dir", str(tmp_path), "--no-check"])
    folder = tmp_path / "mixtral"
    ex.write_checkpoint(cfg, str(folder))
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    r = ex.train(cfg, str(folder))
    saved = tmp_path / "out.safetensors"
    ex.save_experts(cfg, r["model"], str(saved))
    r["model"].release()
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before
    ckpt = sw.safetensors.open(saved)
    names = [ex.expert_name(l, e, m) for l in range(2) for e in range(4) for m in ex.MATRICES]
    assert ckpt.keys() == sorted(names)
    original = sw.safetensors.open(folder)
    moved = sum(not np.array_equal(np.asarray(ckpt.tensor(n)), np.asarray(original.tensor(n))) for n in names)
    assert moved == len(names)  # every expert was routed to and stepped
    assert ckpt.shape(ex.expert_name(0, 0, "w2")) == (16, 24)


def test_the_check_fails_when_one_expert_gradient_is_wrong(tmp_path, monkeypatch):
    """One element of one routed expert's w2 gradient is zeroed after each backward of the replay: the Float64
    comparison of the expert gradients fails (Float32: the bound is about 1e-3 of the magnitude)."""
    ex = load_example()
    real = ex.Model.backward
    hits = []

    def faulty(self, fwd, tokens, targets):
        result = real(self, fwd, tokens, targets)
        if self.budget is None and fwd["routes"]:  # the replay (the offloaded run has a budget)
            e = int(fwd["routes"][0][1][0, 0])  # the first token's first expert in layer 0
            g = self.weights(0, "w2").grad
            g[(0, 0, e)] = 0.0
            hits.append(e)
        return result

    monkeypatch.setattr(ex.Model, "backward", faulty)
    s = ex.main(TINY + ["--dtype", "float32", "--dir", str(tmp_path)])
    assert hits
    assert not s["ok"] and s["failures"] == ["check"]
    assert s["check"]["worst"]["expert weight gradients"] > 1.0
    assert s["check"]["worst"]["layer output h + MoE(h)"] <= 1.0


def test_no_prefetch_and_compare(tmp_path, capsys):
    ex = load_example()
    s = ex.main(TINY + ["--dir", str(tmp_path), "--no-prefetch", "--no-check", "--compare"])
    out = capsys.readouterr().out
    assert s["ok"] and "PyTorch, everything in RAM" in out
    assert s["compare"]["tokens_per_s"] > 0 and s["compare"]["peak_rss"] > 0


def test_bad_flags_are_refused(capsys):
    ex = load_example()
    with pytest.raises(SystemExit):
        ex.parse_args(["--top-k", "4", "--experts", "4"])
    assert "--top-k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.parse_args(["--budget-ratio", "0.5"])
    assert "--budget-ratio" in capsys.readouterr().err


SAMPLED = TINY + ["--check-sample", "3"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_sampled_check_passes_within_the_budgeted_run(tmp_path, capsys, dtype):
    """--check-sample (the bigger-than-RAM mode): no replay; the sampled experts' gradients, AdamW steps and saved
    values are checked from records taken within the budgeted run itself; the summary goes to --summary-json."""
    ex = load_example()
    out_json = tmp_path / "summary.json"
    s = ex.main(SAMPLED + ["--dtype", dtype, "--dir", str(tmp_path), "--summary-json", str(out_json)])
    out = capsys.readouterr().out
    assert s["ok"] and s["reload_ok"], s["failures"]
    c = s["check"]
    assert c["ok"] and len(c["sample"]) == 3 and c["checked_steps"] == [0, 1, 2]
    assert 0 < c["worst"]["expert weight gradients"] <= 1.0
    assert c["mismatched_weights"] == 0 and c["saved_mismatches"] == 0
    layers = {layer for layer, _ in c["sample"]}
    assert c["counts"]["routed_tokens"] == 3 * len(layers) * 24 and c["counts"]["routing_mismatch"] == 0
    assert "check of 3 sampled experts" in out and "PASS" in out and "FAIL" not in out
    assert json.loads(out_json.read_text())["check"]["sample"] == c["sample"]


def faulty_train(ex, monkeypatch, fault):
    """Calls `fault(when, recorder, model, opt)` on the budgeted run's checked steps, just before the recorder
    reads them: after backward (when == "backward") and after the optimizer step (when == "step")."""
    real = ex.SampleRecorder.after_backward

    def after_backward(self, model, opt, fwd, step):
        fault("backward", self, model, opt)
        return real(self, model, opt, fwd, step)

    real_after = ex.SampleRecorder.after_step

    def after_step(self, model, opt, step):
        fault("step", self, model, opt)
        return real_after(self, model, opt, step)

    monkeypatch.setattr(ex.SampleRecorder, "after_backward", after_backward)
    monkeypatch.setattr(ex.SampleRecorder, "after_step", after_step)


def test_the_sampled_check_fails_when_a_sampled_expert_gradient_is_wrong(tmp_path, monkeypatch):
    """One element of the first sampled expert's w2 gradient is zeroed after backward (Float32): the Float64
    comparison fails, and nothing else does."""
    ex = load_example()

    def fault(when, rec, model, opt):
        layer, e = rec.sample[0]
        g = model.weights(layer, "w2").grad
        if when == "backward" and g is not None and g.carrier.tile_state((0, 0, e)).location != "implicit":
            g[(0, 0, e)] = 0.0

    faulty_train(ex, monkeypatch, fault)
    s = ex.main(SAMPLED + ["--dtype", "float32", "--dir", str(tmp_path)])
    assert not s["ok"] and s["failures"] == ["check"]
    assert s["check"]["worst"]["expert weight gradients"] > 1.0


def test_the_sampled_check_fails_when_an_optimizer_step_is_wrong(tmp_path, monkeypatch):
    """One weight of the last sampled expert's w1 is nudged by one unit in the last place after the optimizer step:
    the bit-exact AdamW comparison catches it (the gradients stay within their bound)."""
    ex = load_example()

    def fault(when, rec, model, opt):
        layer, e = rec.sample[-1]
        if when == "step":
            w = model.weights(layer, "w1")
            v = np.array([w[(0, 0, e)]], dtype=np.float32)
            w[(0, 0, e)] = float(np.nextafter(v, np.float32(np.inf))[0])

    faulty_train(ex, monkeypatch, fault)
    s = ex.main(SAMPLED + ["--dtype", "float32", "--dir", str(tmp_path)])
    assert not s["ok"] and s["failures"] == ["check"]
    assert s["check"]["mismatched_weights"] > 0
    assert s["check"]["worst"]["expert weight gradients"] <= 1.0
