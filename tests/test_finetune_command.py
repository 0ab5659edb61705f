"""``python -m strideweave.finetune`` (strideweave/finetune): sizes, the data file, tokenization and packing, the
refusals of bad input (one line on stderr, exit status 2, no output folder left), a run's outputs (loss.csv,
loss.png, progress, checkpoints, the final Hugging Face checkpoint), and an interrupted-and-resumed run
bit-identical to an uninterrupted one.

The model: tests/hf_families.py's tiny Qwen3-MoE (seed 0, vocabulary 300) with a byte-level BPE tokenizer trained
here on a text that ships with Debian (/usr/share/common-licenses; a fixed fallback text where it is missing), so
nothing is downloaded. The command runs in this process (``strideweave.finetune.main``), except for one run as
``python -m`` in a child process.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strideweave.finetune as ft  # noqa: E402
import strideweave.torch as swt  # noqa: E402

import hf_families as zoo  # noqa: E402  (tests/hf_families.py)

VOCAB = 300
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
FALLBACK = ("Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
            "associated documentation files, to deal in the Software without restriction.\n\n") * 40


def corpus() -> str:
    path = "/usr/share/common-licenses/Apache-2.0"
    return open(path).read() if os.path.isfile(path) else FALLBACK


def make_tokenizer(text: str, chat: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    if chat:
        t.chat_template = CHAT_TEMPLATE
    return t


def paragraphs(n: int) -> list:
    parts = [p.strip() for p in corpus().split("\n\n") if p.strip()]
    return (parts * (n // len(parts) + 1))[:n]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"model": Qwen3-MoE + tokenizer with a chat template, "plain": the same without one, "llama": a dense
    Llama + tokenizer, "data": a JSON-lines file of 60 paragraphs}."""
    root = tmp_path_factory.mktemp("finetune")
    text = corpus()
    model = zoo.build("qwen3_moe", 0, vocab_size=VOCAB)
    out = {}
    for name, chat in (("model", True), ("plain", False)):
        folder = str(root / name)
        model.save_pretrained(folder)
        make_tokenizer(text, chat).save_pretrained(folder)
        out[name] = folder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1))
    out["llama"] = str(root / "llama")
    llama.save_pretrained(out["llama"])
    make_tokenizer(text, False).save_pretrained(out["llama"])
    out["data"] = str(root / "data.jsonl")
    with open(out["data"], "w") as f:
        for p in paragraphs(60):
            f.write(json.dumps({"text": p}) + "\n")
    return out


def run(capsys, *argv) -> tuple:
    """(exit status, stdout, stderr) of the command run in this process."""
    code = ft.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(capsys, out_dir, fragment, *argv):
    """Exit status 2, one line on stderr naming `fragment`, no traceback, and no output folder."""
    code, _, err = run(capsys, *argv, "--output", out_dir)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("python -m strideweave.finetune: error: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert not os.path.exists(out_dir), f"{out_dir} was left behind"
    return lines[0]


# ------------------------------------------------------------------------------------------------- sizes and data


@pytest.mark.parametrize("text,size", [("1234", 1234), ("64MB", 64 * 10**6), ("64mib", 64 * 2**20),
                                       ("1.5GB", 1_500_000_000), ("2 KiB", 2048), ("3k", 3000), ("7B", 7)])
def test_parse_size(text, size):
    assert ft.parse_size(text) == size


@pytest.mark.parametrize("text,fragment", [("", "is not a size"), ("12XB", "is not a size"),
                                           ("-5MB", "is not a size"), ("MB", "is not a size"),
                                           ("0", "below 1 byte"), ("0.1B", "below 1 byte")])
def test_parse_size_refuses(text, fragment):
    with pytest.raises(ft.CommandError, match=fragment):
        ft.parse_size(text)


@pytest.mark.parametrize("lines,fragment", [
    (['{"text": "a"}', '{"text": "b"', '{"text": "c"}'], "data.jsonl:2: not a JSON object"),
    (['{"text": "a"}', '', '[1, 2]'], "data.jsonl:3: a JSON list"),
    (['{"text": 5}'], "data.jsonl:1: \"text\" is a int"),
    (['{"text": "a"}', '{"prompt": "a"}'], "data.jsonl:2: an object needs exactly one of"),
    (['{"text": "a", "messages": []}'], "data.jsonl:1: an object needs exactly one of"),
    (['{"messages": [{"role": "user"}]}'], "data.jsonl:1: \"messages\" must be"),
    ([], "has no records"),
    (['', '   ', ''], "has no records"),
])
def test_malformed_data_is_refused_naming_the_line(folders, tmp_path, capsys, lines, fragment):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines))
    assert_refused(capsys, tmp_path / "out", fragment, folders["model"], "--data", data, "--budget", "1MiB")


def test_data_not_utf8_names_the_line(folders, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    assert_refused(capsys, tmp_path / "out", "data.jsonl:2: not UTF-8", folders["model"], "--data", data,
                   "--budget", "1MiB")


def test_missing_data_file(folders, tmp_path, capsys):
    assert_refused(capsys, tmp_path / "out", "does not exist", folders["model"], "--data", tmp_path / "none.jsonl",
                   "--budget", "1MiB")


def test_messages_without_chat_template_names_the_line(folders, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert_refused(capsys, tmp_path / "out", "data.jsonl:2: a \"messages\" record, but", folders["plain"],
                   "--data", data, "--budget", "1MiB")


def test_tokenize_text_and_messages(folders):
    """A text record is the tokenizer's encoding + EOS; a messages record the chat template's text encoded
    without special tokens + EOS (the template adds its own)."""
    tok = transformers.AutoTokenizer.from_pretrained(folders["model"])
    msgs = [{"role": "user", "content": "Licensed under the Apache License"}, {"role": "assistant", "content": "ok"}]
    seqs = ft.tokenize([(1, {"text": "Grant of Copyright License"}), (2, {"messages": msgs})], tok, "d.jsonl")
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert seqs[0] == tok("Grant of Copyright License")["input_ids"] + [eos]
    chat = "<|im_start|>user\nLicensed under the Apache License<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    assert seqs[1] == tok(chat, add_special_tokens=False)["input_ids"] + [eos]
    assert seqs[1][0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_packing_concatenates_in_seeded_order_into_full_rows():
    """Rows are the concatenation of the sequences in the epoch's seeded permutation, cut every seq_len tokens
    (tail dropped); a step is grad_accum micro-batches of rows_per_batch consecutive rows; epochs reshuffle; the
    same seed gives the same rows, another seed other rows."""
    rng = np.random.default_rng(7)
    print("seed 7")
    seqs = [list(rng.integers(1, 100, size=int(rng.integers(1, 30)))) + [0] for _ in range(40)]
    p = ft.Packing(seqs, seq_len=8, rows_per_batch=2, grad_accum=3, seed=5)
    total = sum(len(s) for s in seqs)
    assert p.total_tokens == total and p.rows_per_epoch == total // 8 and p.steps_per_epoch == total // 8 // 6
    for epoch in (0, 1):
        order = np.random.default_rng([5, epoch]).permutation(40)
        stream = [t for i in order for t in seqs[i]]
        for s in range(p.steps_per_epoch):
            micro = p.step(epoch * p.steps_per_epoch + s)
            assert len(micro) == 3
            for j, rows in enumerate(micro):
                first = (s * 6 + j * 2) * 8
                assert rows.dtype == np.int64 and rows.shape == (2, 8)
                assert rows.reshape(-1).tolist() == stream[first:first + 16]
    assert not np.array_equal(p.rows(0), p.rows(1))
    again = ft.Packing(seqs, 8, 2, 3, seed=5)
    assert np.array_equal(again.rows(1), p.rows(1))
    assert not np.array_equal(ft.Packing(seqs, 8, 2, 3, seed=6).rows(0), p.rows(0))


# ------------------------------------------------------------------------------------------------------ refusals


def test_missing_model_folder(folders, tmp_path, capsys):
    assert_refused(capsys, tmp_path / "out", "model folder", tmp_path / "nowhere", "--data", folders["data"],
                   "--budget", "1MiB")


def test_model_without_moe_layer(folders, tmp_path, capsys):
    line = assert_refused(capsys, tmp_path / "out", "LlamaForCausalLM has no experts module", folders["llama"],
                          "--data", folders["data"], "--budget", "1MiB")
    assert "llama" in line


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_budget_below_what_training_needs(folders, tmp_path, capsys, dtype):
    """The optimizer step of one (64, 64) tile holds the tile, its gradient (the weights' dtype) and two Float32
    moments: 64 * 64 * (2 * 4 + 8) bytes in Float32, 64 * 64 * (2 * 2 + 8) in BFloat16, more than one expert's
    three tiles (3 * 64 * 64 * 4 or * 2). One byte less is refused before anything is written; exactly that
    trains (two steps and the final save)."""
    model = folders["model"]
    if dtype == "bfloat16":
        model = str(tmp_path / "bf16")
        transformers.AutoModelForCausalLM.from_pretrained(folders["model"], dtype=torch.bfloat16).save_pretrained(model)
        transformers.AutoTokenizer.from_pretrained(folders["model"]).save_pretrained(model)
    need = 64 * 64 * (2 * (4 if dtype == "float32" else 2) + 8)
    line = assert_refused(capsys, tmp_path / "out", f"({need} bytes)", model, "--data", folders["data"],
                          "--budget", str(need - 1), "--batch-tokens", "64")
    assert "cannot hold what training needs resident at once" in line
    code, _, err = run(capsys, model, "--data", folders["data"], "--output", tmp_path / "out", "--budget", str(need),
                       "--batch-tokens", "64", "--max-steps", "2", "--lr", "1e-3", "--no-progress")
    assert code == 0, err
    assert ("of 64.0 KiB" if dtype == "float32" else "of 48.0 KiB") in err, err


@pytest.mark.parametrize("budget", ["lots", "0", "-1MB"])
def test_budget_that_is_no_size(folders, tmp_path, capsys, budget):
    assert_refused(capsys, tmp_path / "out", "--budget", folders["model"], "--data", folders["data"],
                   f"--budget={budget}")


def test_data_too_short_for_one_step(folders, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "Apache"}\n')
    assert_refused(capsys, tmp_path / "out", "fewer than one optimizer step takes (4096", folders["model"],
                   "--data", data, "--budget", "1MiB")


def test_output_not_empty_or_parent_missing(folders, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--budget", "1MiB", "--output", out)
    assert code == 2 and "is not empty" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert_refused(capsys, tmp_path / "no" / "out", "does not exist", folders["model"], "--data", folders["data"],
                   "--budget", "1MiB")


def test_bad_option_is_one_line(folders, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ft.main([folders["model"], "--data", folders["data"], "--budget", "1MiB", "--output", str(tmp_path / "o"),
                 "--lr", "fast"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "--lr" in err
    assert_refused(capsys, tmp_path / "out", "--grad-accum must be > 0", folders["model"], "--data",
                   folders["data"], "--budget", "1MiB", "--grad-accum", "0")


TRAIN = ["--budget", "256KiB", "--batch-tokens", "64", "--seq-len", "32", "--grad-accum", "2", "--max-steps", "4",
         "--lr", "1e-3", "--warmup", "1", "--max-grad-norm", "0.5", "--weight-decay", "0.1", "--seed", "3"]


def test_full_disk_leaves_no_output_folder(folders, tmp_path, capsys, monkeypatch):
    """A full disk at the first checkpoint (save_pretrained raising ENOSPC): one line naming the error, and the
    output folder, which held no complete checkpoint, is removed."""
    def full(model, folder, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    monkeypatch.setattr(swt, "save_pretrained", full)
    out = tmp_path / "out"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", out, *TRAIN,
                       "--save-every", "2", "--no-progress")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "No space left on device" in lines[0] and "was removed" in lines[0]
    assert not out.exists()


def test_full_disk_after_a_checkpoint_keeps_it(folders, tmp_path, capsys, monkeypatch):
    """ENOSPC at the final save: the complete checkpoint-2 is kept (the error says how to resume); no temporary
    folder is left."""
    real = swt.save_pretrained
    calls = []

    def full_at_end(model, folder, **kw):
        calls.append(folder)
        if os.path.basename(str(folder)).startswith(".model.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        return real(model, folder, **kw)
    monkeypatch.setattr(swt, "save_pretrained", full_at_end)
    out = tmp_path / "out"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", out, *TRAIN,
                       "--save-every", "2", "--no-progress")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "No space left on device" in lines[0], err
    assert "rerun with --resume to continue from step 4" in lines[0]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "loss.csv", "loss.png"]


# ------------------------------------------------------------------------------------------------------ a run


def safetensors_of(folder) -> dict:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def test_run_writes_loss_plot_checkpoints_and_model(folders, tmp_path, capsys):
    """Four steps: loss.csv (step, loss, lr, tokens) with the warm-up/linear schedule's rates, a PNG, the
    progress bar's fields on stderr, checkpoint-2 and -4, and the final model, which transformers opens, with
    every expert and every other weight trained (changed)."""
    out = tmp_path / "out"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", out, *TRAIN,
                       "--save-every", "2")
    assert code == 0, err
    for fragment in ("tok/s", "loss ", "resident ", "of 256.0 KiB", "4/4"):
        assert fragment in err, fragment
    rows = (out / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,tokens" and len(rows) == 5
    parsed = [r.split(",") for r in rows[1:]]
    assert [int(r[0]) for r in parsed] == [1, 2, 3, 4]
    assert [int(r[3]) for r in parsed] == [128, 256, 384, 512]
    # warm-up 1 step then linear decay to 0 over 4: lr(step s, 0-based) = 1e-3 * min(s / 1, (4 - s) / 3)
    assert [float(r[2]) for r in parsed] == pytest.approx([0.0, 1e-3, 1e-3 * 2 / 3, 1e-3 / 3], rel=1e-12)
    assert all(np.isfinite(float(r[1])) for r in parsed)
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    original = transformers.AutoModelForCausalLM.from_pretrained(folders["model"])
    assert transformers.AutoTokenizer.from_pretrained(str(out))("Apache")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(folders["model"])("Apache")["input_ids"]
    before, after = original.state_dict(), reloaded.state_dict()
    assert sorted(before) == sorted(after)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert unchanged == [], unchanged  # step 1 has lr 0, steps 2-4 move every parameter


def test_resume_is_bit_identical(folders, tmp_path, capsys, monkeypatch):
    """A run interrupted right after checkpoint-2 (of 4) and resumed with --resume (under a larger budget) gives
    the uninterrupted run's loss.csv byte for byte, the same checkpoint-4 (weights and optimizer state, tiled
    moments included) and the same final weights, bit for bit."""
    whole = tmp_path / "whole"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", whole, *TRAIN,
                       "--save-every", "2", "--no-progress")
    assert code == 0, err

    from strideweave.finetune import _run
    real = _run._Run._save_checkpoint

    def interrupt_after_2(self, *a, **kw):
        real(self, *a, **kw)
        if self.step == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(_run._Run, "_save_checkpoint", interrupt_after_2)
    part = tmp_path / "part"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", part, *TRAIN,
                       "--save-every", "2", "--no-progress")
    assert code == 130 and "interrupted at step 2" in err, err
    assert sorted(os.listdir(part)) == ["checkpoint-2", "loss.csv"]
    monkeypatch.setattr(_run._Run, "_save_checkpoint", real)
    # Resumed under another budget: eviction moves bytes and does no arithmetic, so the result is the same.
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", part, *TRAIN,
                       "--save-every", "2", "--no-progress", "--resume", "--budget", "1MiB")
    assert code == 0, err

    assert (part / "loss.csv").read_bytes() == (whole / "loss.csv").read_bytes()
    for sub in ("checkpoint-4", "checkpoint-4/optimizer", "."):
        a, b = safetensors_of(whole / sub), safetensors_of(part / sub)
        assert sorted(a) == sorted(b) and a, sub
        for name in a:
            assert torch.equal(a[name], b[name]), f"{sub}: {name}"
    sa = torch.load(whole / "checkpoint-4" / "optimizer" / "optimizer.pt", weights_only=True)
    sb = torch.load(part / "checkpoint-4" / "optimizer" / "optimizer.pt", weights_only=True)
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for key, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][key]), (k, key)


def test_resume_refuses_other_options(folders, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", out, *TRAIN,
                       "--save-every", "2", "--no-progress")
    assert code == 0, err
    listing = sorted(os.listdir(out))
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", out,
                       *[x if x != "1e-3" else "2e-3" for x in TRAIN], "--resume")
    assert code == 2 and "lr 0.001 -> 0.002" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(out)) == listing
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", tmp_path / "fresh", *TRAIN,
                       "--resume")
    assert code == 2 and "holds no complete checkpoint" in err, err
    assert not (tmp_path / "fresh").exists()
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", tmp_path / "other", *TRAIN,
                       "--resume", out / "checkpoint-2")
    assert code == 2 and "is not a checkpoint of --output" in err, err
    assert not (tmp_path / "other").exists()


def test_dtype_other_than_the_experts_is_refused(folders, tmp_path, capsys):
    assert_refused(capsys, tmp_path / "out", "is Float32, the model's", folders["model"], "--data", folders["data"],
                   "--budget", "1MiB", "--dtype", "bfloat16")


def test_python_dash_m(folders, tmp_path):
    """The module runs as ``python -m strideweave.finetune``: --help, and a bad data file's one line."""
    r = subprocess.run([sys.executable, "-m", "strideweave.finetune", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--budget" in r.stdout and "--resume" in r.stdout
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\nnot json\n')
    r = subprocess.run([sys.executable, "-m", "strideweave.finetune", folders["model"], "--data", str(data),
                        "--output", str(tmp_path / "o"), "--budget", "1MiB"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "d.jsonl:2:" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_import_strideweave_does_not_import_torch():
    code = "import sys, strideweave, strideweave.finetune; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr


# ------------------------------------------------------------------------------------------------- make demo


def test_demo_passes_and_fails_when_the_command_is_wrong(tmp_path):
    """examples/finetune_command_demo.py (what make demo runs), 4 steps: PASS against the replay in RAM; FAIL
    (exit status 1) when the command's expert optimizer uses a learning rate 0.1% too large (a sitecustomize on
    the child's PYTHONPATH scales it), so the check resolves errors of that size."""
    demo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "finetune_command_demo.py")
    argv = [sys.executable, demo, "--steps", "4", "--warmup", "1"]
    r = subprocess.run(argv + ["--dir", str(tmp_path / "ok")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), r.stdout + r.stderr
    assert "x the budget" in r.stdout and "8.0 x" in r.stdout
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import strideweave.optim as o\n"
        "_step = o.AdamW.step\n"
        "def step(self):\n"
        "    self.lr = self.lr * 1.001\n"
        "    _step(self)\n"
        "o.AdamW.step = step\n")
    env = dict(os.environ, PYTHONPATH=str(shim))
    r = subprocess.run(argv + ["--dir", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1 and "FAIL" in r.stdout and "experts" in r.stdout, r.stdout + r.stderr


def test_step_in_backward_gives_the_same_model(folders, tmp_path, capsys):
    """--step-in-backward (with 2 micro-batches per step: the first accumulates, the second's backward steps the
    experts) writes the model of the run that steps after backward, bit for bit, and the same loss.csv."""
    argv = [folders["model"], "--data", folders["data"], *TRAIN, "--grad-accum", "2", "--max-grad-norm", "0",
            "--save-every", "0", "--no-progress"]
    code, _, err = run(capsys, *argv, "--output", tmp_path / "after")
    assert code == 0, err
    code, _, err = run(capsys, *argv, "--output", tmp_path / "inside", "--step-in-backward")
    assert code == 0, err
    assert (tmp_path / "after" / "loss.csv").read_bytes() == (tmp_path / "inside" / "loss.csv").read_bytes()
    a, b = safetensors_of(tmp_path / "after"), safetensors_of(tmp_path / "inside")
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bound 0: the same updates (docs/guide.md, "Stepping in backward")


def test_step_in_backward_with_clipping_is_refused(folders, tmp_path, capsys):
    assert_refused(capsys, str(tmp_path / "o"), "--step-in-backward steps each expert before the other gradients",
                   folders["model"], "--data", folders["data"], *TRAIN, "--step-in-backward", "--max-grad-norm", "1")


@pytest.mark.parametrize("state,stored", [("bfloat16", "BFloat16"), ("8bit", "Int8Blockwise")])
def test_state_dtype_reaches_the_experts_optimizer(folders, tmp_path, capsys, state, stored):
    """--state-dtype: the experts' moments in the checkpoint's optimizer state are stored as asked (the state
    files' metadata), and the run trains."""
    import json

    from safetensors import safe_open
    out = tmp_path / "out"
    code, _, err = run(capsys, folders["model"], "--data", folders["data"], "--output", out, *TRAIN,
                       "--save-every", "2", "--no-progress", "--state-dtype", state)
    assert code == 0, err
    files = sorted((out / "checkpoint-2" / "optimizer").glob("tiled_state.*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), "pt") as fh:
            meta = fh.metadata()
        assert json.loads(meta["state_dtype"]) == stored, meta["state_dtype"]
