"""Tiny Hugging Face MoE models for tests: built from a config with seeded random weights (nothing is downloaded),
saved with ``save_pretrained`` (safetensors) in Float32 and BFloat16, and their sparse-MoE blocks' reference
forward and backward.

* ``FAMILIES``: the MoE families of the pinned transformers this module knows (Mixtral, Qwen2-MoE, Qwen3-MoE), each
  a ``Family`` with its config and model classes, the attribute path of a layer's sparse-MoE block, and the names
  its checkpoint gives the router and each expert's gate, up and down projections.
* ``tiny_config(family, **overrides)``, ``build_model(family, seed, dtype)``: the model, in eval mode.
* ``save_model(model, directory, dtype)``: ``save_pretrained`` into ``directory``; ``load_model`` reads it back.
* ``saved_models(family, directory, seed)``: the same model saved in Float32 and in BFloat16 (two folders).
* ``moe_block(model, layer)``: the layer's sparse-MoE block module.
* ``expert_names(family, layer, num_experts)``: the checkpoint's tensor names of one layer's experts.
* ``hidden_states(config, tokens, seed, dtype)``: inputs of a block; ``block_reference(block, x, cotangent)`` runs
  the block forward and backward and returns the output, the input gradient and every parameter's gradient, with
  the router's logits, top-k indices and weights.
* ``routing_margin(router_logits, k)``: how far each token's routing is from a tie (tests that compare routing
  across implementations need it away from zero).

The facts below were read from the pinned transformers (5.24.0) and are checked by tests/test_torch_bridge.py.

Blocks (``model.model.layers[i].mlp`` in all three families; replace a block by assigning that attribute):
  transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock        (.gate: MixtralTopKRouter, .experts)
  transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock   (.gate, .experts, .shared_expert,
                                                                              .shared_expert_gate)
  transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock   (.gate, .experts)
  ``forward(hidden_states)`` takes (batch, seq, hidden) and returns ONE tensor of the same shape (no router
  logits: those are recorded by a forward hook on the router class, ``_can_record_outputs["router_logits"]``, so
  a replacement that still calls the original ``.gate`` module keeps ``output_router_logits`` working).
Router (``.gate``, weight (E, H), no bias): logits = x W^T in the model dtype; probabilities = softmax in Float32
  (Mixtral: ``softmax(logits.float())``; Qwen: ``softmax(logits, dtype=torch.float)``); ``torch.topk`` of the
  probabilities; Mixtral always renormalises the k values to sum 1 (in Float32) and keeps them Float32; Qwen
  renormalises only when ``config.norm_topk_prob`` (Qwen2-MoE default False, Qwen3-MoE default False in this
  version: real Qwen3 checkpoints set True) and casts them to the model dtype.
Experts (``.experts``, one module, ``config._experts_implementation``: default "grouped_mm" on CPU; "eager" is the
  per-expert loop): ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) Parameters, PyTorch (out, in) per
  expert. ``gate_up_proj[e][:I]`` is the gate (Mixtral w1), ``[I:]`` the up projection (w3);
  out_e = down_e(silu(gate_e x) * up_e x); the block output is sum over the token's k experts of
  weight * out_e (a bf16 Mixtral multiplies by the Float32 weight, then rounds to bf16 before the sum).
Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (a dense SwiGLU MLP, nn.Linear
  gate_proj/up_proj/down_proj, and a Linear(H, 1)).
Checkpoint (``save_pretrained``, safetensors, one file at these sizes): the fused parameters are converted back to
  per-expert tensors. Mixtral: ``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`` (I, H) gate,
  ``.w3.weight`` (I, H) up, ``.w2.weight`` (H, I) down, router ``model.layers.{i}.block_sparse_moe.gate.weight``.
  Qwen2/3-MoE: ``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``, router
  ``model.layers.{i}.mlp.gate.weight``; Qwen2-MoE also ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
  ``mlp.shared_expert_gate.weight`` (1, H). Tensors lie in name order, so one expert's three matrices are adjacent
  and a projection's experts are not. ``from_pretrained`` fuses them again (w1 then w3 along dim 1).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import transformers
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # save_pretrained / from_pretrained bars would fill the test output

__all__ = ["FAMILIES", "Family", "BlockReference", "tiny_config", "build_model", "save_model", "load_model",
           "saved_models", "moe_block", "expert_names", "hidden_states", "block_reference", "routing_margin"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One MoE family of transformers, as these tests use it."""

    name: str
    config_class: str  # names in the transformers namespace
    model_class: str
    block_class: str  # the sparse-MoE block's qualified class name
    block_path: str  # attribute path of layer {layer}'s block from the CausalLM model
    router_name: str  # checkpoint names, with {layer} (and {expert})
    gate_name: str
    up_name: str
    down_name: str
    config: dict  # the tiny config
    shared_expert: bool = False

    @property
    def available(self) -> bool:
        return hasattr(transformers, self.config_class) and hasattr(transformers, self.model_class)


_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, num_experts_per_tok=2,
               # Larger than the default 0.02, so that router logits spread (softmax far from uniform, routing far
               # from ties) and expert outputs are not tiny next to rounding.
               initializer_range=0.1, tie_word_embeddings=False)


def _qwen(name: str, prefix: str, shared_expert: bool = False, **config) -> Family:
    """A Qwen MoE family: the checkpoint names of Qwen2-MoE and Qwen3-MoE are the same."""
    return Family(
        name=name, config_class=f"{prefix}Config", model_class=f"{prefix}ForCausalLM",
        block_class=f"transformers.models.{name}.modeling_{name}.{prefix}SparseMoeBlock",
        block_path="model.layers.{layer}.mlp",
        router_name="model.layers.{layer}.mlp.gate.weight",
        gate_name="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up_name="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down_name="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        config=dict(_COMMON, intermediate_size=128, moe_intermediate_size=96, num_experts=8, **config),
        shared_expert=shared_expert)


FAMILIES = {
    "mixtral": Family(
        name="mixtral", config_class="MixtralConfig", model_class="MixtralForCausalLM",
        block_class="transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        block_path="model.layers.{layer}.mlp",
        router_name="model.layers.{layer}.block_sparse_moe.gate.weight",
        gate_name="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        up_name="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        down_name="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
        config=dict(_COMMON, intermediate_size=96, num_local_experts=8)),
    "qwen2_moe": _qwen("qwen2_moe", "Qwen2Moe", shared_expert=True, shared_expert_intermediate_size=128,
                       norm_topk_prob=False),  # Qwen1.5-MoE's setting
    "qwen3_moe": _qwen("qwen3_moe", "Qwen3Moe", head_dim=16, norm_topk_prob=True),  # Qwen3-MoE checkpoints'
}


def family_of(family: str | Family) -> Family:
    return FAMILIES[family] if isinstance(family, str) else family


def tiny_config(family: str | Family, **overrides):
    """The family's tiny config (hidden 64, 8 experts, top-2, 2 layers, vocab 128), with `overrides`."""
    f = family_of(family)
    return getattr(transformers, f.config_class)(**dict(f.config, **overrides))


def build_model(family: str | Family, seed: int = 0, dtype: torch.dtype = torch.float32,
                experts_implementation: str | None = None, **overrides):
    """A tiny model with random weights drawn from `seed` (the global torch generator is left as it was), in eval
    mode, its parameters in `dtype`. `experts_implementation` ("eager", "grouped_mm", "batched_mm") picks how the
    experts module computes; None keeps transformers' default."""
    f = family_of(family)
    config = tiny_config(f, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, f.model_class)(config)
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    return model.to(dtype).eval()


def save_model(model, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> str:
    """``save_pretrained`` of `model` (a copy converted to `dtype` when given) into `directory`; returns the path of
    its safetensors file."""
    if dtype is not None and dtype != model.dtype:
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(os.fspath(directory))
    return os.path.join(os.fspath(directory), "model.safetensors")


def load_model(family: str | Family, directory: str | os.PathLike, experts_implementation: str | None = None):
    """The saved model read back with ``from_pretrained`` (in the dtype it was saved in), in eval mode."""
    f = family_of(family)
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    return getattr(transformers, f.model_class).from_pretrained(os.fspath(directory), dtype="auto", **kwargs).eval()


def saved_models(family: str | Family, directory: str | os.PathLike, seed: int = 0) -> dict:
    """The seeded tiny model saved twice under `directory`: {"float32": folder, "bfloat16": folder}."""
    model = build_model(family, seed)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        folder = os.path.join(os.fspath(directory), f"{family_of(family).name}-{str(dtype).removeprefix('torch.')}")
        save_model(model, folder, dtype)
        out[str(dtype).removeprefix("torch.")] = folder
    return out


def moe_block(model, layer: int = 0):
    """Layer `layer`'s sparse-MoE block (``model.model.layers[layer].mlp``)."""
    family = next((f for f in FAMILIES.values() if type(model).__name__ == f.model_class), None)
    if family is None:
        raise TypeError(f"moe_block: {type(model).__name__} is none of {[f.model_class for f in FAMILIES.values()]}")
    module = model
    for part in family.block_path.format(layer=layer).split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def expert_names(family: str | Family, layer: int, num_experts: int) -> dict:
    """{"gate": [...], "up": [...], "down": [...], "router": name}: the checkpoint's names of layer `layer`."""
    f = family_of(family)
    out = {k: [getattr(f, f"{k}_name").format(layer=layer, expert=e) for e in range(num_experts)]
           for k in ("gate", "up", "down")}
    out["router"] = f.router_name.format(layer=layer)
    return out


def hidden_states(config, tokens: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(tokens, hidden) standard normal inputs of a block, drawn from `seed` by a generator of their own."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, config.hidden_size, generator=g).to(dtype)


@dataclasses.dataclass
class BlockReference:
    """A block's forward and backward, as transformers computes them."""

    output: torch.Tensor  # (tokens, hidden), the block's dtype
    grad_hidden: torch.Tensor  # (tokens, hidden)
    grads: dict  # parameter name (within the block, e.g. "experts.gate_up_proj") -> gradient (None: untouched)
    router_logits: torch.Tensor  # (tokens, E), the block's dtype
    topk_index: torch.Tensor  # (tokens, k) int64
    topk_weights: torch.Tensor  # (tokens, k): Float32 for Mixtral, the block's dtype for Qwen

    def expert_grads(self, intermediate: int) -> dict:
        """{"gate", "up", "down"}: (E, I, H), (E, I, H), (E, H, I) gradients, gate and up split from gate_up_proj."""
        gu = self.grads["experts.gate_up_proj"]
        return {"gate": gu[:, :intermediate], "up": gu[:, intermediate:], "down": self.grads["experts.down_proj"]}


def block_reference(block, x: torch.Tensor, cotangent: torch.Tensor | None = None) -> BlockReference:
    """Runs `block` on `x` (tokens, hidden) as one sequence and backpropagates `cotangent` (default: ones) through
    it; the block's parameter gradients are reset first and returned (detached clones)."""
    x = x.detach().clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits, weights, index = block.gate(x.detach())
    y = block(x.unsqueeze(0)).squeeze(0)
    y.backward(torch.ones_like(y) if cotangent is None else cotangent.to(y.dtype))
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    return BlockReference(output=y.detach(), grad_hidden=x.grad.detach(), grads=grads, router_logits=logits,
                          topk_index=index, topk_weights=weights)


def routing_margin(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, the Float32 softmax probability of its k-th choice minus that of its (k+1)-th: how far top-k is
    from a tie (0 when two experts tie for the last place)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top = torch.topk(probs, k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def routing_logit_margin(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, its k-th largest router logit minus its (k+1)-th, in Float64. Softmax is increasing, so top-k of
    the probabilities is top-k of the logits: two computations of the logits that differ by at most delta per entry
    choose the same k experts when this margin exceeds 2 delta (plus the softmax's own rounding)."""
    top = torch.topk(router_logits.double(), k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]
