"""A zoo of tiny Hugging Face MoE models, one per family the bridge supports (``strideweave.torch``): built from
a config with seeded random weights (nothing is downloaded), saved with ``save_pretrained`` in Float32 and
BFloat16.

* ``ZOO``: family name -> ``Family`` (config and model classes, the tiny config, where the experts modules are).
* ``build(family, seed)``: the model in Float32, eval mode (the global torch generator is left as it was).
* ``saved(family, directory, seed)``: {"float32": folder, "bfloat16": folder}, each written by ``save_pretrained``.
* ``experts_modules(model)``: {module path: module} of every experts module (the one transformers dispatches
  through ``ALL_EXPERTS_FUNCTIONS``, or Llama4's and DBRX's experts module).
* ``moe_layers(model)`` / ``dense_layers(model)``: the decoder layer indices with and without experts.
* ``call_experts(family, module, hidden, index, weights)``: calls one experts module the way its block does.

Every config is tiny: hidden 64, 4 attention heads, 2 key/value heads, vocab 128, 8 experts, top-2, expert
intermediate 32..96, 2 or 3 layers, ``tie_word_embeddings=False``, ``initializer_range=0.1`` (router logits spread
far from ties; expert outputs not tiny next to rounding). Parameters and persistent buffers that transformers
initialises to zero and that change what the model computes (expert and router biases, the score-correction
biases of DeepSeek-V3, GLM4-MoE, dots1 and ERNIE) are redrawn from the same seed, so a bridge that drops them
fails the parity tests.

Families (transformers 5.24.0; checked by ``tests/test_hf_families.py::test_zoo_facts`` against the built models
and the safetensors keys ``save_pretrained`` wrote). "Experts" is the experts module's class and its
``use_experts_implementation`` flags (defaults: is_concatenated=True, is_transposed=False, has_bias=False,
has_gate=True); its parameters (relative to the module) are ``gate_up_proj`` (E, 2I, H) [gate; up] and
``down_proj`` (E, H, I) unless stated. "Disk" is what ``save_pretrained`` writes for layer {i}, expert {e}.

=========  ==================================  ===========================================================
family     experts module (path)               disk (save_pretrained)
=========  ==================================  ===========================================================
mixtral    MixtralExperts, defaults            per expert: ...block_sparse_moe.experts.{e}.w1/w3/w2.weight
           (model.layers.{i}.mlp.experts)      (w1 gate (I,H), w3 up (I,H), w2 down (H,I))
qwen2_moe  Qwen2MoeExperts, defaults           per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           (model.layers.{i}.mlp.experts)      (+ shared_expert.*, shared_expert_gate)
qwen3_moe  Qwen3MoeExperts, defaults           per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
qwen3_next Qwen3NextExperts, defaults          per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           hybrid: layer 0 dense (mlp_only_layers), linear attention on layers 0 and 2
olmoe      OlmoeExperts, defaults              per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
deepseek_v2 DeepseekV2Experts, defaults        per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           first_k_dense_replace=1 (layer 0 dense), group-limited greedy routing, a shared expert
deepseek_v3 DeepseekV3Experts, defaults        per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           first_k_dense_replace=1, sigmoid scores + e_score_correction_bias, groups, routed_scaling_factor
glm4_moe   Glm4MoeExperts, defaults            per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           first_k_dense_replace=1
gpt_oss    GptOssExperts, is_concatenated=     fused 3-D, as the module holds them: mlp.experts.gate_up_proj (E, H, 2I)
           False, is_transposed=True,          transposed, gate/up interleaved (even columns gate, odd up),
           has_bias=True                       mlp.experts.gate_up_proj_bias (E, 2I), mlp.experts.down_proj
           (model.layers.{i}.mlp.experts)      (E, I, H), mlp.experts.down_proj_bias (E, H); clamped SwiGLU
granitemoe GraniteMoeExperts, defaults         fused 3-D: block_sparse_moe.input_linear.weight (E, 2I, H),
           (model.layers.{i}.block_sparse_moe  block_sparse_moe.output_linear.weight (E, H, I)
           .experts)
phimoe     PhimoeExperts, defaults             per expert: block_sparse_moe.experts.{e}.w1/w3/w2.weight
ernie4_5_moe Ernie4_5_MoeExperts, defaults     per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           layer 0 dense (moe_layer_start_index=1), a shared expert
hunyuan_v1_moe HunYuanMoEV1Experts, defaults   per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           (+ shared_mlp), router mlp.gate.wg.weight (Float32)
dots1      Dots1Experts, defaults              per expert: mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
           first_k_dense_replace=1
minimax    MiniMaxExperts, defaults            per expert: block_sparse_moe.experts.{e}.w1/w3/w2.weight
           hybrid in attention only (layer 0 linear "lightning" attention, layer 1 full): every MiniMax layer
           has experts, MiniMax has no dense-MLP layer
jamba      JambaExperts, defaults              per expert: feed_forward.experts.{e}.gate_proj/up_proj/down_proj
           (model.layers.{i}.feed_forward      .weight; hybrid: layer 0 attention + dense MLP, layer 1 Mamba +
           .experts)                           experts
llama4     Llama4TextExperts, NOT on the       fused 3-D: feed_forward.experts.gate_up_proj (E, H, 2I)
           interface (forward(hidden) over     transposed, [gate | up] concatenated, feed_forward.experts
           (E*T, H) pre-scaled inputs)         .down_proj (E, I, H); layer 0 dense (interleave_moe_layer_step=2)
           (model.layers.{i}.feed_forward.experts)
dbrx       DbrxExperts, NOT on the interface   fused 2-D: transformer.blocks.{i}.ffn.experts.mlp.w1 / v1 / w2, each
           (transformer.blocks.{i}.ffn         (E*I, H): w1 gate, v1 up, w2 down stored (I, H) per expert (the
           .experts; params mlp.w1/v1/w2)      forward multiplies by w2, not its transpose)
=========  ==================================  ===========================================================

The exact table rows (module class, flags, and the key suffixes of one MoE layer on disk) are data below
(``Family.experts_class``, ``Family.flags``, ``Family.disk``) and are asserted against the pinned transformers.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import transformers
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()

__all__ = ["ZOO", "Family", "build", "saved", "experts_modules", "moe_layers", "dense_layers", "call_experts",
           "layer_of", "family_of_model"]

H, HEADS, KV, VOCAB, E, K = 64, 4, 2, 128, 8, 2

_BASE = dict(vocab_size=VOCAB, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
             max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False)

_MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            head_dim=8, num_key_value_heads=HEADS)  # DeepSeek's multi-head latent attention (no grouped k/v heads), tiny


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    model_class: str
    config: dict
    experts_class: str  # class name of the experts module
    flags: dict | None  # use_experts_implementation flags (None: not on the interface)
    experts_path: str  # attribute path of layer {layer}'s experts module
    params: tuple  # the experts module's own parameter names (relative to it)
    disk: tuple  # on-disk key suffixes of one MoE layer's experts ({e}: the expert), below the layer prefix
    moe: tuple  # the decoder layers with experts
    dense: tuple = ()  # the decoder layers without (hybrids)
    randomize: tuple = ()  # name fragments of zero-initialised tensors to redraw
    signature: str = "routed"  # how the experts module is called: "routed" (x, index, weights) or "llama4"

    @property
    def layer_prefix(self) -> str:
        return "transformer.blocks.{layer}." if self.name == "dbrx" else "model.layers.{layer}."

    def disk_keys(self, layer: int, num_experts: int = E) -> list:
        """The checkpoint names of layer `layer`'s experts, as save_pretrained writes them."""
        out = []
        for suffix in self.disk:
            names = [suffix.format(e=e) for e in range(num_experts)] if "{e}" in suffix else [suffix]
            out += [self.layer_prefix.format(layer=layer) + n for n in names]
        return out


def _per_expert(prefix, gate="gate_proj", up="up_proj", down="down_proj"):
    return tuple(f"{prefix}.experts.{{e}}.{p}.weight" for p in (gate, up, down))


_GU = ("gate_up_proj", "down_proj")
_DEFAULT = {}

ZOO = {f.name: f for f in [
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=64, num_local_experts=E, num_experts_per_tok=K),
           "MixtralExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU,
           _per_expert("block_sparse_moe", "w1", "w3", "w2"), moe=(0, 1)),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=48, num_experts=E,
                num_experts_per_tok=K, shared_expert_intermediate_size=64, norm_topk_prob=False),
           "Qwen2MoeExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"), moe=(0, 1)),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                num_experts=E, num_experts_per_tok=K, norm_topk_prob=True),
           "Qwen3MoeExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"), moe=(0, 1)),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
           dict(_BASE, num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
                mlp_only_layers=[0], layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4),
           "Qwen3NextExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"),
           moe=(1, 2), dense=(0,)),
    Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=64, num_experts=E, num_experts_per_tok=K,
                pad_token_id=1, eos_token_id=2),
           "OlmoeExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"), moe=(0, 1)),
    Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
           dict(_BASE | _MLA, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=1,
                topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
           "DeepseekV2Experts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"),
           moe=(1,), dense=(0,)),
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(_BASE | _MLA, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=1,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
           "DeepseekV3Experts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"),
           moe=(1,), dense=(0,), randomize=("e_score_correction_bias",)),
    Family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True),
           "Glm4MoeExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"),
           moe=(1,), dense=(0,), randomize=("e_score_correction_bias",)),
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=32, num_local_experts=E,
                num_experts_per_tok=K, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
           "GptOssExperts", dict(is_concatenated=False, is_transposed=True, has_bias=True),
           "model.layers.{layer}.mlp.experts", ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
           tuple(f"mlp.experts.{p}" for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
           moe=(0, 1), randomize=("experts.gate_up_proj_bias", "experts.down_proj_bias", "router.bias",
                                  "self_attn.sinks")),
    Family("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=32, num_local_experts=E, num_experts_per_tok=K,
                embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.25),
           "GraniteMoeExperts", _DEFAULT, "model.layers.{layer}.block_sparse_moe.experts", _GU,
           ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"), moe=(0, 1)),
    Family("phimoe", "PhimoeConfig", "PhimoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=64, num_local_experts=E, num_experts_per_tok=K),
           "PhimoeExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU,
           _per_expert("block_sparse_moe", "w1", "w3", "w2"), moe=(0, 1)),
    Family("jamba", "JambaConfig", "JambaForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=64, num_experts=E, num_experts_per_tok=K,
                attn_layer_period=2, attn_layer_offset=0, expert_layer_period=2, expert_layer_offset=1,
                mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False,
                pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "JambaExperts", _DEFAULT, "model.layers.{layer}.feed_forward.experts", _GU,
           _per_expert("feed_forward"), moe=(1,), dense=(0,)),
    Family("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
           dict(_BASE, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32, moe_num_experts=E,
                moe_k=K, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=1,
                pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "Ernie4_5_MoeExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"),
           moe=(1,), dense=(0,), randomize=("e_score_correction_bias",)),
    Family("hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=32, num_experts=E, moe_topk=K,
                pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "HunYuanMoEV1Experts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"), moe=(0, 1)),
    Family("dots1", "Dots1Config", "Dots1ForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, sliding_window=None,
                max_window_layers=2, layer_types=["full_attention", "full_attention"]),
           "Dots1Experts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU, _per_expert("mlp"),
           moe=(1,), dense=(0,), randomize=("e_score_correction_bias",)),
    Family("minimax", "MiniMaxConfig", "MiniMaxForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=64, num_local_experts=E,
                num_experts_per_tok=K, layer_types=["linear_attention", "full_attention"], block_size=4),
           "MiniMaxExperts", _DEFAULT, "model.layers.{layer}.mlp.experts", _GU,
           _per_expert("block_sparse_moe", "w1", "w3", "w2"), moe=(0, 1)),
    Family("llama4", "Llama4TextConfig", "Llama4ForCausalLM",
           dict(_BASE, num_hidden_layers=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
                num_local_experts=E, num_experts_per_tok=K, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                attention_chunk_size=16, layer_types=["chunked_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
           "Llama4TextExperts", None, "model.layers.{layer}.feed_forward.experts", _GU,
           ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
           moe=(1,), dense=(0,), signature="llama4"),
    Family("dbrx", "DbrxConfig", "DbrxForCausalLM",
           dict(d_model=H, n_heads=HEADS, n_layers=2, max_seq_len=64, vocab_size=VOCAB, initializer_range=0.1,
                tie_word_embeddings=False, attn_config={"kv_n_heads": KV, "clip_qkv": 8.0, "rope_theta": 10000.0},
                ffn_config={"hidden_size": H, "ffn_hidden_size": 32, "moe_num_experts": E, "moe_top_k": K,
                            "moe_jitter_eps": None, "moe_normalize_expert_weights": 1.0}),
           "DbrxExperts", None, "transformer.blocks.{layer}.ffn.experts", ("mlp.w1", "mlp.v1", "mlp.w2"),
           ("ffn.experts.mlp.w1", "ffn.experts.mlp.v1", "ffn.experts.mlp.w2"), moe=(0, 1)),
]}


def family_of_model(model) -> Family:
    name = type(model).__name__
    for f in ZOO.values():
        if f.model_class == name:
            return f
    raise KeyError(name)


def tiny_config(family: str | Family, **overrides):
    f = ZOO[family] if isinstance(family, str) else family
    return getattr(transformers, f.config_class)(**copy.deepcopy(dict(f.config, **overrides)))


def build(family: str | Family, seed: int = 0, **overrides):
    """The family's tiny model, Float32, eval mode, weights drawn from `seed` (the global generator is restored);
    the zero-initialised tensors named in ``Family.randomize`` are redrawn (normal, std 0.1) from the same seed."""
    f = ZOO[family] if isinstance(family, str) else family
    config = tiny_config(f, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, f.model_class)(config)
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if any(frag in name for frag in f.randomize):
                    t.copy_(0.1 * torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    return model.float().eval()


def saved(family: str | Family, directory: str | os.PathLike, seed: int = 0) -> dict:
    """The seeded model written by ``save_pretrained`` twice under `directory`: {"float32": ..., "bfloat16": ...}."""
    f = ZOO[family] if isinstance(family, str) else family
    model = build(f, seed)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype).removeprefix("torch.")
        folder = os.path.join(os.fspath(directory), f"{f.name}-{key}")
        (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)).save_pretrained(folder)
        out[key] = folder
    return out


def _get(module, path: str):
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def experts_modules(model, family: Family | None = None) -> dict:
    """{path: experts module} for every MoE layer of `model`, in layer order."""
    f = family or family_of_model(model)
    return {f.experts_path.format(layer=i): _get(model, f.experts_path.format(layer=i)) for i in f.moe}


def layer_of(path: str) -> int:
    return int(next(p for p in path.split(".") if p.isdigit()))


def _layers(model):
    base = getattr(model, "model", None) or model.transformer
    return base.layers if hasattr(base, "layers") else base.blocks


def moe_layers(model, family: Family | None = None) -> list:
    """The decoder layers that hold an experts module of the family's class (found by walking the model)."""
    f = family or family_of_model(model)
    out = []
    for i, layer in enumerate(_layers(model)):
        if any(type(m).__name__ == f.experts_class for m in layer.modules()):
            out.append(i)
    return out


def dense_layers(model, family: Family | None = None) -> list:
    moe = set(moe_layers(model, family))
    return [i for i in range(len(_layers(model))) if i not in moe]


def call_experts(family: Family, module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
    """The experts module's output for (T, H) hidden states routed to `index` (T, k) with `weights` (T, k), called
    as the family's block calls it; returns (T, H). Llama4's experts module takes the (E*T, H) inputs already
    scaled by each expert's score (0 for the experts a token did not pick) and returns (E*T, H), summed here."""
    if family.signature == "llama4":
        T = hidden.shape[0]
        scores = torch.zeros(T, module.num_experts, dtype=weights.dtype).scatter(1, index, weights)
        routed = hidden.repeat(module.num_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
        return module(routed).reshape(module.num_experts, T, -1).sum(0)
    out = module(hidden, index, weights)
    return out.reshape(hidden.shape[0], -1)
