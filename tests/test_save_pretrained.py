"""strideweave.torch.save_pretrained: a model opened with strideweave.torch.from_pretrained written back as a whole
Hugging Face checkpoint (docs/guide.md, "Opening a Hugging Face MoE bigger than RAM"; Note [Saving a model whose
experts are tiles] in python/strideweave/torch/_saving.py).

Tiny models built from a config with seeded random weights (nothing is downloaded), saved by transformers'
``save_pretrained``, opened by ``from_pretrained`` with their experts bound to the checkpoint's tiles, saved by
``strideweave.torch.save_pretrained`` and read back by transformers' ``AutoModelForCausalLM.from_pretrained``:

* ``test_reload_bit_identical``: Mixtral (per-expert w1/w3/w2 under ``block_sparse_moe``), Qwen3-MoE (per-expert
  gate/up/down), GPT-OSS (fused, transposed, interleaved, with biases), DBRX (2-D ``(E*I, H)`` tensors split into
  tiles), Qwen3-MoE with tied embeddings and in BFloat16: no missing or unexpected key, the same key set
  transformers' own ``save_pretrained`` writes, every weight bit-identical.
* ``test_shards``: a small ``max_shard_size`` (int and "KB" string) gives several shards, each within the limit
  unless it is one tensor, and an index whose ``weight_map`` lists exactly each shard's tensors and whose
  ``total_size`` is their bytes; one shard is still the index form.
* ``test_finetuned``: after three SGD steps (``sw.optim.SGD`` on the tiles, ``torch.optim.SGD`` on the rest, a
  budget that evicts dirty tiles) the reloaded model is the fine-tuned one, bit for bit; saving into the folder the
  model was opened from works and the model keeps working.
* ``test_partly_offloaded``: one layer bound, the other in RAM (converted back by transformers).
* ``test_save_memory``: in a fresh process, saving 100 MB of experts grows the peak RSS by at most the budget plus
  the writer's chunk and a fixed overhead (reading them into RAM, the control, grows it by their size).
* atomicity and errors: a failure on the second shard leaves the previous folder byte for byte and no temporary;
  an existing folder is replaced whole; dead writers' temporaries are removed; the model's own
  ``save_pretrained`` is refused before it writes anything; wrong arguments leave nothing behind.

Bit-identical comparisons are exact (``torch.equal``): saving and loading move bytes, no arithmetic.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strideweave as sw  # noqa: E402
import strideweave.torch as swt  # noqa: E402
from strideweave.torch import _saving  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()

_BASE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.1, tie_word_embeddings=False)
CONFIGS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_BASE, num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=32, num_local_experts=8,
                     num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM",
             dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128, initializer_range=0.1,
                  tie_word_embeddings=False, attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                  ffn_config={"hidden_size": 64, "ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                              "moe_jitter_eps": None, "moe_normalize_expert_weights": 1.0})),
}
# Zero-initialised tensors redrawn so that a save dropping or misplacing them differs from the original.
RANDOMIZE = {"gpt_oss": ("experts.gate_up_proj_bias", "experts.down_proj_bias", "router.bias", "self_attn.sinks")}
SEED = 0


def build(family: str, dtype=torch.float32, **overrides):
    config_class, model_class, config = CONFIGS[family]
    config = getattr(transformers, config_class)(**dict(config, **overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = getattr(transformers, model_class)(config)
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if any(frag in name for frag in RANDOMIZE.get(family, ())):
                    t.copy_(0.1 * torch.randn(t.shape))
    return model.to(dtype).eval()


def saved(family: str, folder, dtype=torch.float32, **overrides):
    """(the original model, its folder written by transformers' save_pretrained)."""
    model = build(family, dtype, **overrides)
    model.save_pretrained(os.fspath(folder))
    return model, os.fspath(folder)


def open_bound(folder, budget=1 << 22):
    model = swt.from_pretrained(folder, budget)
    assert swt.offloaded_experts(model), "from_pretrained bound no experts"
    return model


def reload(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(folder), output_loading_info=True,
                                                                    dtype="auto")
    assert not info["missing_keys"], f"missing keys: {sorted(info['missing_keys'])[:5]}"
    assert not info["unexpected_keys"], f"unexpected keys: {sorted(info['unexpected_keys'])[:5]}"
    assert not info["mismatched_keys"], f"mismatched keys: {info['mismatched_keys']}"
    return model.eval()


def checkpoint_keys(folder) -> dict:
    """{tensor name: shard file} of every safetensors file in `folder`."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                for k in h.keys():
                    assert k not in out, f"{k} in two files"
                    out[k] = f
    return out


def assert_same_weights(expected: dict, model, what: str) -> None:
    got = dict(model.named_parameters())
    assert set(got) == set(expected), f"{what}: parameters differ: {sorted(set(got) ^ set(expected))[:5]}"
    for n, t in expected.items():
        assert got[n].dtype == t.dtype, f"{what}: {n} is {got[n].dtype}, expected {t.dtype}"
        assert torch.equal(got[n].detach(), t.detach()), f"{what}: {n} differs"


def folder_digest(folder) -> dict:
    """{relative path: sha256} of every file under `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as h:
                out[os.path.relpath(p, folder)] = hashlib.sha256(h.read()).hexdigest()
    return out


def temporaries(parent) -> list:
    return [f for f in os.listdir(parent) if ".tmp-" in f]


# --------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("family, dtype, overrides", [
    ("mixtral", torch.float32, {}),
    ("qwen3_moe", torch.float32, {}),
    ("gpt_oss", torch.float32, {}),
    ("dbrx", torch.float32, {}),
    ("qwen3_moe", torch.float32, {"tie_word_embeddings": True}),
    ("mixtral", torch.bfloat16, {}),
], ids=["mixtral", "qwen3_moe", "gpt_oss", "dbrx", "qwen3_moe-tied", "mixtral-bf16"])
def test_reload_bit_identical(family, dtype, overrides, tmp_path):
    """The saved folder has the keys transformers' own save_pretrained writes for the untouched model (names,
    expert layout, tied weights left out), loads with no missing or unexpected key, and every weight is the
    original's, bit for bit."""
    original, src = saved(family, tmp_path / "src", dtype, **overrides)
    model = open_bound(src)
    out = tmp_path / "out"
    swt.save_pretrained(model, out)
    files = sorted(os.listdir(out))
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert "config.json" in files
    assert ("generation_config.json" in files) == ("generation_config.json" in os.listdir(src))
    assert checkpoint_keys(out).keys() == checkpoint_keys(src).keys()  # transformers' own names and set
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == [type(original).__name__] and config["dtype"] == str(dtype).split(".")[1]
    again = reload(out)
    assert_same_weights(dict(original.named_parameters()), again, family)
    if overrides.get("tie_word_embeddings"):
        assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    assert temporaries(tmp_path) == []


def test_shards(tmp_path):
    """A small max_shard_size gives several shards: each at most the limit unless it holds one tensor, the index's
    weight_map lists exactly each file's tensors, total_size is their bytes; the model reloads bit-identical. A
    size string is transformers' ("100KB" = 100 000 bytes). One shard is still the index form."""
    original, src = saved("mixtral", tmp_path / "src")
    model = open_bound(src)
    for limit, as_int in ((100_000, 100_000), ("100KB", 100_000), (10 ** 9, 10 ** 9)):
        out = tmp_path / f"out-{limit}"
        swt.save_pretrained(model, out, max_shard_size=limit)
        with open(out / "model.safetensors.index.json") as f:
            index = json.load(f)
        keys = checkpoint_keys(out)
        assert index["weight_map"] == keys
        shards = sorted(set(keys.values()))
        assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
        total = 0
        for s in shards:
            with safe_open(os.path.join(out, s), "pt") as h:
                sizes = [h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys()]
            assert sum(sizes) <= as_int or len(sizes) == 1, f"{s}: {sum(sizes)} bytes > {as_int}"
            total += sum(sizes)
        assert index["metadata"]["total_size"] == total
        assert index["metadata"]["total_parameters"] == original.num_parameters()
        n = len(shards)
        assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        if as_int == 10 ** 9:
            assert n == 1
        else:
            assert n >= 5, f"{n} shards for {total} bytes at {as_int} per shard"
        assert_same_weights(dict(original.named_parameters()), reload(out), f"max_shard_size={limit}")


@pytest.mark.parametrize("family, experts_in_budget", [("mixtral", 4), ("mixtral", 1000), ("gpt_oss", 4)],
                         ids=["mixtral-evicted", "mixtral-resident", "gpt_oss-evicted"])
def test_finetuned(family, experts_in_budget, tmp_path):
    """Three SGD steps (sw.optim.SGD over the bindings' tiles, torch.optim.SGD over the rest); the saved model
    reloads as the fine-tuned weights bit for bit (experts compared with b.gather, the rest with the parameters),
    and those differ from the original. A budget of four experts' tiles leaves the fine-tuned tiles evicted to the
    scratch overlay (the checkpoint's files unchanged), a large one leaves them resident and dirty: the save reads
    either. Saving into the folder the model was opened from replaces it and the model keeps computing from its
    open checkpoint."""
    original, src = saved(family, tmp_path / "src")
    probe = open_bound(src)
    expert_bytes = max(b.expert_bytes for b in swt.offloaded_experts(probe).values())
    del probe
    model = open_bound(src, sw.ResidencyBudget(experts_in_budget * expert_bytes))
    bindings = swt.offloaded_experts(model)
    rest = [p for p in model.parameters() if p.requires_grad]
    torch_opt = torch.optim.SGD(rest, lr=0.5)
    sw_opt = sw.optim.SGD([t for b in bindings.values() for t in b.tiled.values()], lr=0.5)
    g = torch.Generator().manual_seed(7)
    print(f"seed={SEED} ids generator seed=7")
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 12), generator=g)
        torch_opt.zero_grad(set_to_none=True)
        sw_opt.zero_grad()
        for b in bindings.values():
            b.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        torch_opt.step()
        sw_opt.step()
    tuned = {n: p.detach().clone() for n, p in model.named_parameters()}
    for path, b in bindings.items():
        for name in b.parameter_names:
            tuned[f"{path}.{name}"] = b.gather(name)
    changed = [n for n, p in original.named_parameters() if not torch.equal(p.detach(), tuned[n])]
    assert any(".experts." in n for n in changed) and any(".experts." not in n for n in changed)
    def states(b):
        return [t.carrier.tile_state((0, 0, e)) for t in b.tiled.values() for e in range(int(t.shape.extents[2]))]

    def tuned_module(path):
        return any(n.startswith(path + ".") and n in changed for n in tuned)

    if experts_in_budget == 4:  # a module fine-tuned and wholly evicted: its values are in the overlay only
        assert any(all(st.location == "secondary" for st in states(b)) and tuned_module(p)
                   for p, b in bindings.items())
    else:
        assert all(st.location == "primary" and st.dirty for b in bindings.values() for st in states(b))
    swt.save_pretrained(model, tmp_path / "out", max_shard_size=200_000)
    assert_same_weights(tuned, reload(tmp_path / "out"), f"{family} fine-tuned")

    ids = torch.randint(0, 128, (1, 8), generator=g)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    swt.save_pretrained(model, src)  # into the folder the model was opened from
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert_same_weights(tuned, reload(src), f"{family} saved over its source")
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_partly_offloaded(family, tmp_path):
    """With one layer's experts bound (layers=[1]) and the other's loaded by transformers, the experts in RAM are
    converted back by transformers' own reverse conversion and the bound ones streamed: the same keys as the
    original checkpoint, bit-identical on reload."""
    original, src = saved(family, tmp_path / "src")
    model = swt.from_pretrained(src, 1 << 22, layers=[1])
    assert len(swt.offloaded_experts(model)) == 1
    swt.save_pretrained(model, tmp_path / "out", max_shard_size="100KB")
    assert checkpoint_keys(tmp_path / "out").keys() == checkpoint_keys(src).keys()
    assert_same_weights(dict(original.named_parameters()), reload(tmp_path / "out"), f"{family} layers=[1]")


# ------------------------------------------------------------------------------------------ atomicity, errors


def test_failure_keeps_previous_folder(tmp_path, monkeypatch):
    """A failure while writing the second shard leaves the previous folder byte for byte, and no temporary."""
    _, src = saved("mixtral", tmp_path / "src")
    model = open_bound(src)
    out = tmp_path / "out"
    swt.save_pretrained(model, out, max_shard_size=100_000)
    before = folder_digest(out)
    real = _saving._write_shard
    calls = []

    def failing(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        real(path, tensors, metadata)

    monkeypatch.setattr(_saving, "_write_shard", failing)
    with pytest.raises(OSError, match="injected"):
        swt.save_pretrained(model, out, max_shard_size=50_000)
    assert len(calls) == 2
    assert folder_digest(out) == before
    assert temporaries(tmp_path) == []
    with pytest.raises(OSError, match="injected"):  # a new target: nothing at all appears
        calls.clear()
        swt.save_pretrained(model, tmp_path / "new" / "deeper", max_shard_size=50_000)
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_replaces_existing_folder_whole(tmp_path):
    """An existing folder is replaced as a whole: a stale model.safetensors or any other file of the old folder is
    gone (transformers would prefer model.safetensors to the index)."""
    original, src = saved("qwen3_moe", tmp_path / "src")
    out = tmp_path / "out"
    os.makedirs(out / "sub")
    for f in ("model.safetensors", "model-00001-of-00009.safetensors", "sub/notes.txt"):
        (out / f).write_bytes(b"old")
    swt.save_pretrained(open_bound(src), out)
    assert sorted(os.listdir(out)) == sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                                              "model-00001-of-00001.safetensors"])
    assert_same_weights(dict(original.named_parameters()), reload(out), "replaced")
    assert temporaries(tmp_path) == []


def test_dead_writers_temporaries_removed(tmp_path):
    """A temporary folder left by a process that is gone (killed mid-save) is removed by the next save to the same
    target; a live process's is left alone."""
    _, src = saved("mixtral", tmp_path / "src")
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = int(child.stdout)  # the child has exited and been reaped
    stale = tmp_path / f".out.tmp-{dead}-3"
    live = tmp_path / ".out.tmp-1-3"  # pid 1 is alive
    for d in (stale, live):
        os.makedirs(d)
        (d / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    swt.save_pretrained(open_bound(src), tmp_path / "out")
    assert not stale.exists() and live.exists()


def test_model_save_pretrained_refused(tmp_path):
    """The model's own save_pretrained (which would write the config, then no experts) raises RuntimeError naming
    strideweave.torch.save_pretrained before writing anything; its state_dict() raises too."""
    _, src = saved("mixtral", tmp_path / "src")
    model = open_bound(src)
    with pytest.raises(RuntimeError, match=r"strideweave\.torch\.save_pretrained"):
        model.save_pretrained(tmp_path / "own")
    assert not (tmp_path / "own").exists()
    with pytest.raises(RuntimeError, match=r"strideweave\.torch\.save_pretrained"):
        model.state_dict()


def test_errors_leave_nothing(tmp_path):
    """Errors come before anything is written: TypeError for a model without bound experts (naming
    offload_experts and from_pretrained), a folder that is not a path or a max_shard_size of another type;
    ValueError for max_shard_size <= 0 or a string that is no size; an OSError for a folder that cannot be made
    (below a file) or an existing file as the folder. The target and its parent are unchanged."""
    original, src = saved("mixtral", tmp_path / "src")
    model = open_bound(src)
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "keep.txt").write_text("keep")
    (tmp_path / "file").write_text("x")
    listing, digest = sorted(os.listdir(tmp_path)), folder_digest(out)
    cases = [
        (lambda: swt.save_pretrained(original, out), TypeError, "offload_experts"),
        (lambda: swt.save_pretrained(original, out), TypeError, "from_pretrained"),
        (lambda: swt.save_pretrained(model, 42), TypeError, "folder must be a path"),
        (lambda: swt.save_pretrained(model, out, max_shard_size=1.5), TypeError, "max_shard_size"),
        (lambda: swt.save_pretrained(model, out, max_shard_size=True), TypeError, "max_shard_size"),
        (lambda: swt.save_pretrained(model, out, max_shard_size=0), ValueError, "max_shard_size must be > 0"),
        (lambda: swt.save_pretrained(model, out, max_shard_size=-5), ValueError, "max_shard_size must be > 0"),
        (lambda: swt.save_pretrained(model, out, max_shard_size="lots"), ValueError, "is not a size"),
        (lambda: swt.save_pretrained(model, tmp_path / "file" / "out"), NotADirectoryError, "not a folder"),
        (lambda: swt.save_pretrained(model, tmp_path / "file"), NotADirectoryError, "not a folder"),
    ]
    for call, kind, fragment in cases:
        with pytest.raises(kind, match=fragment):
            call()
        assert sorted(os.listdir(tmp_path)) == listing
        assert folder_digest(out) == digest


_MEMORY_CHILD = r"""
import json, os, sys, tempfile
import torch, strideweave as sw, strideweave.torch as swt

def rss():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS

src, out, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = swt.from_pretrained(src, budget)
swt.save_pretrained(model, out + "-warm")  # imports and first-call allocations out of the way
growth = {}
reset_peak()
before, _ = rss()
swt.save_pretrained(model, out, max_shard_size="20MB")
growth["save"] = rss()[1] - before
from safetensors import safe_open
reset_peak()
before, _ = rss()
held = []  # the control: the saved experts read into RAM
for f in sorted(os.listdir(out)):
    if f.endswith(".safetensors"):
        with safe_open(os.path.join(out, f), "pt") as h:
            held += [h.get_tensor(k).clone() for k in h.keys() if ".experts." in k]
growth["control"] = rss()[1] - before
print(json.dumps(growth))
"""


def test_save_memory(tmp_path):
    """Saving costs the writer's chunk, not the experts: in a fresh process, a model whose experts are 100 MB
    (2 layers x 8 experts x 3 x 256 x 2048 Float32) is saved under an 8 MiB budget with its peak RSS growth
    (VmHWM reset through /proc/self/clear_refs, second save so imports are done) at most budget + the 8 MiB chunk
    + 24 MiB of fixed overhead (Python objects, the index, transformers' config writer), while reading the saved
    experts into RAM (the control, showing the measure sees them) grows it by at least their bytes."""
    assert os.path.exists("/proc/self/clear_refs"), "the peak RSS is reset through /proc/self/clear_refs (Linux)"
    original, src = saved("mixtral", tmp_path / "src", hidden_size=256, intermediate_size=2048,
                          num_attention_heads=4, num_key_value_heads=2)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in original.named_parameters() if ".experts." in n)
    assert expert_bytes == 2 * 8 * 3 * 256 * 2048 * 4
    del original
    budget = 8 << 20  # one expert is 6 MiB
    child = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, src, os.fspath(tmp_path / "out"), str(budget)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    growth = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"expert bytes {expert_bytes}, peak RSS growth {growth}")
    assert growth["control"] >= expert_bytes
    assert growth["save"] <= budget + (8 << 20) + (24 << 20), growth
