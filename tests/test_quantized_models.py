"""Quantized checkpoints through ``strideweave.torch.from_pretrained`` (docs/guide.md, "Quantized checkpoints (FP8,
MXFP4)"): a tiny DeepSeek-V3 written as its releases are (every Linear but the LM head FP8 e4m3 with a Float32
``weight_scale_inv`` per 128 x 128 block, ``quantization_config`` {"quant_method": "fp8", ...}) and a tiny GPT-OSS
(experts only, MXFP4 ``*_blocks``/``*_scales`` of the untransposed (E, 2I, H) / (E, H, I) matrices,
{"quant_method": "mxfp4", ...}), both quantized by tests/_quantized.py (NumPy, from the formats' definitions).
transformers 5 dequantizes both at load on a CPU; StrideWeave binds the experts to the quantized tensors where they
lie and dequantizes each tile on promotion.

* ``test_opening_reads_no_expert``: transformers never materializes an expert tensor (values, scales, blocks) of
  the checkpoint (its safetensors reads are counted), the bindings are over the quantized tensors, and the engine's
  reads of the experts are the quantized bytes.
* ``test_float32_logits_match_transformers``: opened in Float32, both dequantize the same bytes to the same values
  (transformers' FP8 dequantizer and the engine's form the same Float32 product, MXFP4's is exact), so only the
  compute differs: the Float32 parity bound of tests/test_hf_families.py (1e-5 of the largest logit).
* ``test_bfloat16_experts_match_transformers``: opened in BFloat16 (transformers' own choice on a CPU), the MoE
  layer's experts on the inputs its block gives them against a Float64 computation from the same dequantized bf16
  weights, within the bound derived in tests/test_hf_families.py (``float64_and_bound``), for transformers' module
  and ours.
* ``test_train_save_reload``: three AdamW steps (loss finite, the experts changed, their tiles BFloat16, the
  checkpoint's files unchanged byte for byte); ``save_pretrained`` in BFloat16 (no quantization_config;
  transformers reloads exactly our weights, its experts module within the derived bound on the same inputs as
  ours, and ``from_pretrained`` of the folder gives our logits bit for bit) and with ``quantize=True`` (the
  source format and quantization_config; transformers' dequantized reload within the derived re-quantization
  bound of our weights, every FP8 linear included; ``from_pretrained`` of the folder against transformers' reload:
  the experts' bound in BFloat16, logits within the parity bound in Float32).
* ``test_fp8_dequantized_where_transformers_would_keep_it``: where transformers would keep the FP8 checkpoint
  quantized (on an accelerator; simulated), from_pretrained still binds the experts unread.
* ``test_partly_bound_requantized``: ``layers=`` leaves GPT-OSS's layer 0 to transformers (in RAM, the module's
  transposed form); ``quantize=True`` writes it as the checkpoint stored it, within the re-quantization bound.
* ``test_mutable_refused``, ``test_quantize_refused_for_a_plain_model``: the refusals (type, message, nothing
  written).

Seeds: the models are drawn from ``BASE_SEED + crc32(family)``, the token ids from that + 1; printed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib

import numpy as np
import pytest
import torch
import transformers

import _quantized as qz
import hf_families as zoo
import strideweave as sw
import test_hf_families as hf

BASE_SEED = 3500
FAMILIES = ["deepseek_v3", "gpt_oss"]
E, K = zoo.E, zoo.K  # test_hf_families' Float64 reference reads zoo.E experts
TOKENS = (2, 8)

CONFIGS = {
    # hidden 256 = two 128-blocks; moe_intermediate_size 96, not a multiple of 128 (a partial block); attention
    # projections 128 wide so that transformers' FP8 dequantizer (block = shape / scale grid) reads 128 x 128 blocks.
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=zoo.VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=112, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, head_dim=16, n_routed_experts=E, num_experts_per_tok=K,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False)),
    "gpt_oss": ("GptOssConfig", dict(
        vocab_size=zoo.VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, num_local_experts=E, num_experts_per_tok=K, num_hidden_layers=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=64,
        initializer_range=0.1, tie_word_embeddings=False)),
}
QUANTIZATION = {
    "deepseek_v3": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]},
    "gpt_oss": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
MOE_LAYERS = {"deepseek_v3": (1,), "gpt_oss": (0, 1)}


def seed_of(family: str) -> int:
    return BASE_SEED + zlib.crc32(family.encode())


def swt():
    import strideweave.torch as module
    return module


def _fp8_quantized_name(name: str) -> bool:
    """DeepSeek-V3's FP8 release quantizes every Linear of the decoder (attention, dense MLP, shared and routed
    experts); embeddings, norms, the router and the LM head stay BFloat16."""
    return name.startswith("model.layers.") and (name.endswith("proj.weight") or name.endswith("_mqa.weight"))


def write_quantized(family: str, folder: str, seed: int) -> None:
    """The seeded BFloat16 model saved by transformers, then its tensors rewritten in the family's quantized form
    (one model.safetensors) and config.json given the release's quantization_config."""
    cls, kw = CONFIGS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**kw)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # zero-initialised tensors drawn too (biases, DeepSeek's correction bias, GPT-OSS's sinks)
        for name, p in model.named_parameters():
            if any(f in name for f in ("bias", "sinks")):
                p.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(folder)
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, f)))
            os.remove(os.path.join(folder, f))
        elif f.endswith(".index.json"):
            os.remove(os.path.join(folder, f))
    entries = {}
    for name, t in tensors.items():
        values = t.float().numpy()
        if family == "deepseek_v3" and _fp8_quantized_name(name):
            q, s = qz.quantize_fp8(values)
            entries[name] = ("F8_E4M3", q)
            entries[name[:-len("weight")] + "weight_scale_inv"] = ("F32", s)
        elif family == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = qz.quantize_mxfp4(np.ascontiguousarray(values.transpose(0, 2, 1)))  # (E, out, in)
            entries.update(qz.mxfp4_entries(name, blocks, scales))
        elif t.dtype == torch.bfloat16:
            entries[name] = ("BF16", t.view(torch.int16).numpy().view(np.uint16))
        else:
            entries[name] = ({torch.float32: "F32"}[t.dtype], values)
    qz.write_safetensors(os.path.join(folder, "model.safetensors"), entries, {"format": "pt"})
    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = QUANTIZATION[family]
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = os.path.join(root, family)
            write_quantized(family, cache[family], seed_of(family))
        return cache[family]

    return get


def ids_for(family: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed_of(family) + 1)
    return torch.randint(0, zoo.VOCAB, TOKENS, generator=g)


def load_reference(folder: str, dtype=None):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **({"dtype": dtype} if dtype else {})).eval()


def experts_path(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def stored_bytes(folder: str) -> dict:
    """{tensor name: its bytes in the file} from the safetensors headers (data_offsets)."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            out.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                        if k != "__metadata__"})
    return out


def is_routed_expert_tensor(name: str) -> bool:
    """A tensor of the routed experts' weights: FP8 values and scales, MXFP4 blocks and scales (not biases)."""
    return ".mlp.experts." in name and not name.endswith("_bias")


def file_hashes(folder: str) -> dict:
    out = {}
    for f in sorted(os.listdir(folder)):
        with open(os.path.join(folder, f), "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


class _ReadCounter:
    """Records every tensor transformers materializes from a safetensors file (``get_slice(name)[...]`` or
    ``get_tensor(name)``), by wrapping the ``safe_open`` transformers' loader calls."""

    def __init__(self, monkeypatch):
        import transformers.modeling_utils as mu
        self.read: list = []
        original = mu.safe_open
        counter = self

        class Slice:
            def __init__(self, name, inner):
                self._name, self._inner = name, inner

            def __getitem__(self, index):
                counter.read.append(self._name)
                return self._inner[index]

            def __getattr__(self, attr):
                return getattr(self._inner, attr)

        class File:
            def __init__(self, inner):
                self._inner = inner

            def get_slice(self, name):
                return Slice(name, self._inner.get_slice(name))

            def get_tensor(self, name):
                counter.read.append(name)
                return self._inner.get_tensor(name)

            def __getattr__(self, attr):
                return getattr(self._inner, attr)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._inner.__exit__(*exc)

        monkeypatch.setattr(mu, "safe_open", lambda *a, **k: File(original(*a, **k)))


def expert_bytes_bf16(family: str) -> int:
    """One expert's weights in BFloat16 (three (I, H) matrices, or GPT-OSS's (2I, H) and (H, I))."""
    kw = CONFIGS[family][1]
    inter = kw.get("moe_intermediate_size", kw["intermediate_size"])
    return 3 * inter * kw["hidden_size"] * 2


def assert_close(actual, expected, what: str, rel: float = 1e-5):
    hf.assert_close(actual, expected, what, rel)


# ------------------------------------------------------------------------------------------------------- opening


@pytest.mark.parametrize("family", FAMILIES)
def test_opening_reads_no_expert(family, folders, monkeypatch):
    folder = folders(family)
    print(f"family={family} seed={seed_of(family)}")
    counter = _ReadCounter(monkeypatch)
    load_reference(folder)  # transformers alone reads (and dequantizes) every expert tensor: the counter sees them
    assert sum(map(is_routed_expert_tensor, counter.read)) == sum(map(is_routed_expert_tensor, stored_bytes(folder)))
    counter.read.clear()
    model = swt().from_pretrained(folder, budget=E * expert_bytes_bf16(family) * len(MOE_LAYERS[family]))
    # transformers read the other tensors through the wrapped safe_open (the counter sees its reads) ...
    assert "model.embed_tokens.weight" in counter.read and "lm_head.weight" in counter.read
    if family == "deepseek_v3":  # ... the non-expert FP8 linears and their scales, dequantized by transformers
        assert "model.layers.0.mlp.gate_proj.weight_scale_inv" in counter.read
        assert model.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
    # ... and no tensor of the routed experts (values, scales, blocks; biases are ordinary parameters).
    experts_read = [n for n in counter.read if is_routed_expert_tensor(n)]
    assert experts_read == [], f"transformers read expert tensors: {experts_read[:5]}"
    assert getattr(model.config, "quantization_config", None) is None  # dequantized, as transformers leaves it
    assert model.__dict__["_strideweave_quantization"] == QUANTIZATION[family]

    bindings = swt().offloaded_experts(model)
    assert list(bindings) == [experts_path(i) for i in MOE_LAYERS[family]]
    fmt = "fp8" if family == "deepseek_v3" else "mxfp4"
    ckpt = next(iter(bindings.values())).checkpoint
    sizes = {name: n for name, n in stored_bytes(folder).items() if is_routed_expert_tensor(name)}
    scale_bytes = sum(n for name, n in sizes.items() if name.endswith(("_scale_inv", "_scales")))
    value_bytes = sum(sizes.values()) - scale_bytes
    # Opening read the experts' scales once (each tier checks its scales when it is made), nothing else of theirs.
    assert ckpt.bytes_read == scale_bytes > 0
    for b in bindings.values():
        assert b.quantized and all(q.format == fmt for q in b.quantized.values())
        assert all(t.dtype() == sw.DType.BFloat16 for t in b.tiled.values())
    assert not any(is_routed_expert_tensor(n) for n, _ in model.named_parameters())
    # Every expert's tiles read once (gather): exactly the quantized values and their scales, just over 1/2 (FP8, a
    # Float32 scale per 128 x 128 block) or 17/64 (MXFP4: 16 bytes and a scale byte per 32 values) of BFloat16.
    before = ckpt.bytes_read
    for b in bindings.values():
        for p in b.parameter_names:
            b.gather(p)
    read = ckpt.bytes_read - before
    bf16 = len(bindings) * E * expert_bytes_bf16(family)
    assert read == value_bytes + scale_bytes, (read, value_bytes, scale_bytes)
    assert read <= (0.51 if family == "deepseek_v3" else 17 / 64) * bf16, (read, bf16)


# ------------------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(family, folders):
    folder = folders(family)
    ids = ids_for(family)
    print(f"family={family} seed={seed_of(family)} ids seed={seed_of(family) + 1}")
    reference = load_reference(folder, torch.float32)
    model = swt().from_pretrained(folder, budget=4 * expert_bytes_bf16(family) * 2, torch_dtype=torch.float32)
    assert all(t.dtype() == sw.DType.Float32 for b in swt().offloaded_experts(model).values()
               for t in b.tiled.values())
    layer = MOE_LAYERS[family][-1]
    ref_experts = dict(reference.named_modules())[experts_path(layer)]
    binding = swt().offloaded_experts(model)[experts_path(layer)]
    for p in binding.parameter_names:  # the same dequantized values, in the module's own form
        assert torch.equal(binding.gather(p), getattr(ref_experts, p)), p
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=ids)
        out = model(input_ids=ids, labels=ids)
    # Float32 parity (tests/test_hf_families.py): the same weights, only the order of the Float32 sums differs.
    assert_close(out.logits, expected.logits, f"{family} logits")
    assert abs(float(out.loss) - float(expected.loss)) <= 1e-5 * abs(float(expected.loss))


def check_experts_bound(family: str, reference, model, ids) -> None:
    """The last MoE layer's experts of `model` and of transformers' BFloat16 `reference` (the same BFloat16 expert
    weights), on the inputs the reference's block gives them, each within tests/test_hf_families.py's derived bound
    of the Float64 computation from those weights."""
    path = experts_path(MOE_LAYERS[family][-1])
    args = hf.captured_inputs(reference, path, ids)
    assert args[0].dtype == torch.bfloat16
    ref_module = dict(reference.named_modules())[path]
    off_module = dict(model.named_modules())[path]
    exact, bound, margin = hf.float64_and_bound(zoo.ZOO[family], ref_module, args)
    if family == "gpt_oss":
        assert margin > 1.0, f"a gate or up value within {margin} of the clamp"
    with torch.no_grad():
        ref_out = hf.call_module(zoo.ZOO[family], ref_module, args)
        off_out = hf.call_module(zoo.ZOO[family], off_module, args)
    assert off_out.dtype == ref_out.dtype == torch.bfloat16
    assert float(bound.max()) <= 0.15 * float(exact.abs().max()), "the bound would not catch an error"
    for what, out in (("transformers", ref_out), ("strideweave", off_out)):
        err = (out.double() - exact).abs()
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (
            f"{family} {what}: |bf16 - Float64| {float(err.flatten()[worst]):.3e} > bound "
            f"{float(bound.flatten()[worst]):.3e} at element {worst}")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_experts_match_transformers(family, folders):
    folder = folders(family)
    ids = ids_for(family)
    print(f"family={family} seed={seed_of(family)} ids seed={seed_of(family) + 1}")
    reference = load_reference(folder)  # transformers' choice on a CPU: dequantized to BFloat16
    assert reference.dtype == torch.bfloat16
    model = swt().from_pretrained(folder, budget=4 * expert_bytes_bf16(family))  # 4 of 8 experts: evictions
    check_experts_bound(family, reference, model, ids)


# ------------------------------------------------------------------------------------------------------- training


def requantization_bound(family: str, w: torch.Tensor, reloaded_scales: torch.Tensor) -> torch.Tensor:
    """A bound on |dequantize(quantize(w)) - w| per element, w the BFloat16 values written.

    FP8 (e4m3, 3 mantissa bits; s the block's scale, amax / 448 rounded to Float32): y = fl32(w / s) is within
    2^-24 |w / s|; e4m3 rounding to nearest moves y by at most 2^-4 |y| where y is normal (|y| >= 2^-6: half the
    spacing 2^(e-3) of its binade) and by 2^-10 where subnormal (half of 2^-9); |y| <= 448 up to the division's
    rounding, so saturation adds nothing beyond that. transformers forms fl32(q s) (2^-24 relative) and rounds it
    to BFloat16 (2^-8 relative, |q s| <= 1.07 |w| + 2^-10 s). In all, |deq - w| <= (2^-4 + 1.07 2^-8 + 2^-22) |w|
    + (1 + 2^-8) 2^-10 s.
    MXFP4 (e2m1, 1 mantissa bit; scale 2^e with e = floor(log2 amax) - 2, so |w / 2^e| < 8): rounding to the
    nearest of +-{0, .5, 1, 1.5, 2, 3, 4, 6} moves v = w / 2^e by at most 1/4 |v| for |v| >= 1, by 1/4 below
    (spacing 1/2), and saturation at 6 by |v| - 6 <= |v| / 4 (|v| < 8); the products are exact (a power of two),
    so |deq - w| <= |w| / 4 + 2^e / 4."""
    w = w.double().abs()
    s = reloaded_scales.double()
    if family == "deepseek_v3":
        return (2.0 ** -4 + 1.07 * 2.0 ** -8 + 2.0 ** -22) * w + (1 + 2.0 ** -8) * 2.0 ** -10 * s
    return w / 4 + s / 4


def expanded_scales(family: str, stored, name: str, shape: tuple) -> torch.Tensor:
    """The scale of each element of the dequantized tensor `name` (its module form for GPT-OSS), from the file."""
    if family == "deepseek_v3":
        s = stored[name[:-len("weight")] + "weight_scale_inv"].double().numpy()
        return torch.from_numpy(qz.expand_blocks(s, shape[-2], shape[-1], (128, 128)))
    codes = stored[name + "_scales"].numpy()  # (E, out, G)
    per_value = np.repeat(qz.e8m0_to_f64(codes), 32, axis=-1)  # (E, out, in)
    return torch.from_numpy(np.ascontiguousarray(per_value.transpose(0, 2, 1)))  # the module's (E, in, out)


def stored_tensors(folder: str) -> dict:
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def check_float32_reload(family: str, saved: str, ids) -> None:
    """transformers' Float32 reload of the quantized folder `saved` and ``from_pretrained`` of it in Float32 agree
    within the parity bound (the same dequantized values, only the order of the sums differs)."""
    reference = load_reference(saved, torch.float32)
    again = swt().from_pretrained(saved, budget=E * expert_bytes_bf16(family) * 2, torch_dtype=torch.float32)
    assert all(b.quantized for b in swt().offloaded_experts(again).values())
    with torch.no_grad():
        assert_close(again(input_ids=ids).logits, reference(input_ids=ids).logits, f"{family} reloaded logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_train_save_reload(family, folders, tmp_path):
    folder = folders(family)
    ids = ids_for(family)
    print(f"family={family} seed={seed_of(family)} ids seed={seed_of(family) + 1}")
    hashes = file_hashes(folder)
    model = swt().from_pretrained(folder, budget=4 * expert_bytes_bf16(family)).train()
    bindings = swt().offloaded_experts(model)
    before = {(path, p): b.gather(p) for path, b in bindings.items() for p in b.parameter_names}
    opt = swt().AdamW(model, lr=1e-2)
    for step in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        assert math.isfinite(float(loss.detach())), f"step {step}: loss {float(loss.detach())}"
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    after = {key: bindings[key[0]].gather(key[1]) for key in before}
    for key, value in after.items():
        assert value.dtype == torch.bfloat16
        # AdamW's first steps move every routed expert by about lr: far beyond a BFloat16 rounding
        assert not torch.equal(value, before[key]), f"{key}: the experts did not change"
    assert all(t.dtype() == sw.DType.BFloat16 for b in bindings.values() for t in b.tiled.values())
    assert file_hashes(folder) == hashes, "the quantized checkpoint was written"

    # BFloat16: a plain checkpoint transformers reloads as our weights exactly.
    plain = str(tmp_path / "bf16")
    swt().save_pretrained(model, plain)
    with open(os.path.join(plain, "config.json")) as fh:
        assert "quantization_config" not in json.load(fh)
    stored = stored_tensors(plain)
    assert {str(t.dtype) for t in stored.values()} <= {"torch.bfloat16", "torch.float32"}
    reloaded = load_reference(plain)
    assert reloaded.dtype == torch.bfloat16
    state = dict(reloaded.named_parameters())
    for (path, p), value in after.items():
        assert torch.equal(state[f"{path}.{p}"], value), f"{path}.{p}"
    ours = dict(model.named_parameters())
    for name, p in ours.items():
        assert torch.equal(state[name], p.detach()), name
    check_experts_bound(family, reloaded, model, ids)  # transformers' reload computes what we do, within the bound
    again = swt().from_pretrained(plain, budget=4 * expert_bytes_bf16(family))
    assert not any(b.quantized for b in swt().offloaded_experts(again).values())
    with torch.no_grad():  # reopened: the same weights, the same computation
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
    del again

    # quantize=True: the source format; transformers' dequantized reload within the re-quantization bound.
    requantized = str(tmp_path / "quantized")
    swt().save_pretrained(model, requantized, quantize=True)
    with open(os.path.join(requantized, "config.json")) as fh:
        assert json.load(fh)["quantization_config"] == QUANTIZATION[family]
    stored = stored_tensors(requantized)
    reloaded = load_reference(requantized)
    assert reloaded.dtype == torch.bfloat16
    state = dict(reloaded.named_parameters())
    checked = 0
    for (path, p), value in after.items():
        if family == "deepseek_v3":  # per expert: (E, 2I, H) = [gate; up], (E, H, I)
            projs = ("gate_proj", "up_proj") if p == "gate_up_proj" else ("down_proj",)
            names = [[f"{path}.{e}.{proj}.weight" for proj in projs] for e in range(E)]
            assert all(stored[n].dtype == torch.float8_e4m3fn for row in names for n in row)
            scales = torch.stack([torch.cat([expanded_scales(family, stored, n, tuple(stored[n].shape))
                                             for n in row]) for row in names])
        else:
            assert stored[f"{path}.{p}_blocks"].dtype == torch.uint8 and f"{path}.{p}" not in stored
            scales = expanded_scales(family, stored, f"{path}.{p}", tuple(value.shape))
        err = (state[f"{path}.{p}"].detach().double() - value.double()).abs()
        bound = requantization_bound(family, value, scales)
        assert bool((err <= bound).all()), f"{path}.{p}: re-quantization error {float((err - bound).max()):.3e} over"
        assert float(err.max()) > 0  # it went through the quantizer
        print(f"{path}.{p}: max re-quantization error / bound {float((err / bound).max()):.3f}")
        checked += 1
    if family == "deepseek_v3":  # the non-expert linears transformers dequantized are re-quantized too
        for name, p in ours.items():
            if _fp8_quantized_name(name):
                assert stored[name].dtype == torch.float8_e4m3fn, name
                scales = expanded_scales(family, stored, name, tuple(p.shape))
                err = (state[name].detach().double() - p.detach().double()).abs()
                assert bool((err <= requantization_bound(family, p.detach(), scales)).all()), name
                checked += 1
    assert checked >= len(after)
    again = swt().from_pretrained(requantized, budget=4 * expert_bytes_bf16(family))
    check_experts_bound(family, reloaded, again, ids)
    check_float32_reload(family, requantized, ids)


# ------------------------------------------------------------------------------------------------------- refusals


def test_fp8_dequantized_where_transformers_would_keep_it(folders, monkeypatch):
    """On an accelerator, transformers keeps an FP8 checkpoint quantized: its FP8 experts modules (which hold the
    experts' weights) replace the model's. from_pretrained asks for dequantization, so the experts stay unread and
    bound. (Simulated: the quantizer's environment check, which on a CPU turns dequantization on, does nothing.)"""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    folder = folders("deepseek_v3")
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    kept = load_reference(folder)
    assert "FP8" in type(kept.model.layers[1].mlp.experts).__name__  # the simulation is in effect
    del kept
    counter = _ReadCounter(monkeypatch)
    model = swt().from_pretrained(folder, budget=E * expert_bytes_bf16("deepseek_v3"))
    assert not [n for n in counter.read if is_routed_expert_tensor(n)]
    assert list(swt().offloaded_experts(model)) == [experts_path(1)]
    assert model.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16  # transformers dequantized the rest


def test_mutable_refused(folders):
    folder = folders("deepseek_v3")
    hashes = file_hashes(folder)
    with pytest.raises(ValueError, match=r"from_pretrained: .*experts\.0\.gate_proj\.weight.*quantized.*mutable=True"):
        swt().from_pretrained(folder, budget=E * expert_bytes_bf16("deepseek_v3"), mutable=True)
    assert file_hashes(folder) == hashes


def test_quantize_refused_for_a_plain_model(folders, tmp_path):
    folder = folders("gpt_oss")
    plain = str(tmp_path / "plain")
    swt().save_pretrained(swt().from_pretrained(folder, budget=E * expert_bytes_bf16("gpt_oss") * 2), plain)
    model = swt().from_pretrained(plain, budget=E * expert_bytes_bf16("gpt_oss") * 2)
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="quantize=True re-quantizes a model opened by strideweave.torch"
                                         ".from_pretrained from a quantized checkpoint"):
        swt().save_pretrained(model, target, quantize=True)
    with pytest.raises(TypeError, match="quantize must be a bool, got str"):
        swt().save_pretrained(model, target, quantize="mxfp4")
    assert sorted(os.listdir(tmp_path)) == ["plain"]  # nothing written, no temporary folder left


def test_partly_bound_requantized(folders, tmp_path):
    """layers=[1]: layer 0's experts are transformers' (dequantized in RAM, the module's (E, H, 2I) form), layer 1's
    tiles; quantize=True writes both as the checkpoint stored them (MXFP4 of (E, 2I, H)), and transformers' reload
    of each is within the re-quantization bound (test_train_save_reload's derivation) of the model's values."""
    folder = folders("gpt_oss")
    model = swt().from_pretrained(folder, budget=E * expert_bytes_bf16("gpt_oss"), layers=[1])
    assert list(swt().offloaded_experts(model)) == [experts_path(1)]
    in_ram = dict(model.named_parameters())
    binding = swt().offloaded_experts(model)[experts_path(1)]
    values = {f"{experts_path(0)}.{p}": in_ram[f"{experts_path(0)}.{p}"].detach() for p in binding.parameter_names}
    values |= {f"{experts_path(1)}.{p}": binding.gather(p) for p in binding.parameter_names}
    out = str(tmp_path / "quantized")
    swt().save_pretrained(model, out, quantize=True)
    stored = stored_tensors(out)
    state = dict(load_reference(out).named_parameters())
    for name, value in values.items():
        assert name not in stored and stored[name + "_blocks"].dtype == torch.uint8, name
        err = (state[name].detach().double() - value.double()).abs()
        bound = requantization_bound("gpt_oss", value, expanded_scales("gpt_oss", stored, name, tuple(value.shape)))
        assert bool((err <= bound).all()), name
