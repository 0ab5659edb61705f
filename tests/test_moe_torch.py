"""strideweave.torch.MoEBlock and offload_experts (docs/guide.md, "Offloading the experts of a transformers model").

The tiny Mixtral, Qwen2-MoE and Qwen3-MoE models of tests/hf_models.py (random weights, never downloaded) are
saved with ``save_pretrained`` in Float32 and BFloat16; their sparse-MoE blocks are replaced by MoEBlocks whose
experts are the saved files' tensors, and everything is compared with transformers' own blocks and models:
outputs, the hidden states' and the router's gradients (torch side) and every expert's gradient (StrideWeave's
tiled gradients against transformers' ``gate_up_proj`` / ``down_proj`` gradients).

Bounds. Float32: 1e-5 of the largest magnitude of each quantity (the issue's bound): both sides compute the same
Float32 sums in different orders, each within gamma_n sum|terms| of the exact value (n <= 96 terms here); the
measured errors are below 1e-6 of the largest magnitude. BFloat16: BF16_ULPS and BF16_MODEL_BOUND, stated and
justified where they are defined. Routing is compared away from ties: every token's k-th and (k+1)-th router
logits must be further apart than the logits' error can move them (``assert_routing_is_stable``), or the test
fails loudly and says which tokens.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import hf_models
import strideweave as sw
from strideweave.torch import from_torch, offload_experts, to_torch

FAMILIES = [f for f in hf_models.FAMILIES if hf_models.FAMILIES[f].available]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENS = 32
U32 = 2.0 ** -24  # unit roundoff of Float32
U16 = 2.0 ** -8  # unit roundoff of BFloat16 (8 significant bits)


def MoEBlock():  # noqa: N802 (the class is defined when torch is first used)
    import strideweave.torch as swt
    return swt.MoEBlock


@pytest.fixture(autouse=True)
def _grad_mode_on():
    sw.set_grad_enabled(True)
    yield
    sw.set_grad_enabled(True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: {"float32": folder, "bfloat16": folder}}: each family's seed-0 tiny model saved twice."""
    root = tmp_path_factory.mktemp("hf")
    return {f: hf_models.saved_models(f, root / f, seed=0) for f in FAMILIES}


def load(family, saved, dtype_name="float32"):
    return hf_models.load_model(family, saved[family][dtype_name], experts_implementation="eager")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in Float64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def assert_close(got, want, bound, what):
    err = relative_error(got, want)
    assert err <= bound, f"{what}: max error {err:.3g} of the largest magnitude, bound {bound:.3g}"
    return err


def logits_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per (token, expert): how far two Float32 evaluations of x W^T (any summation order) can be apart, before
    the logits' rounding to the block's dtype: 2 gamma_H sum_h |x_h| |w_eh| (Higham, gamma_n = n u / (1 - n u))."""
    H = x.shape[-1]
    gamma = H * U32 / (1 - H * U32)
    return 2 * gamma * (x.double().abs() @ weight.double().abs().T)


def assert_routing_is_stable(logits: torch.Tensor, delta: torch.Tensor, k: int, what: str) -> None:
    """Fails loudly unless every token's top-k is unambiguous. Softmax is increasing, so top-k of the probabilities
    is top-k of the logits; two computations of the logits that differ by at most delta (per token, expert) choose
    the same experts when the k-th largest logit exceeds the (k+1)-th by more than twice the token's largest delta,
    plus what the softmax's Float32 rounding can do to the order of two probabilities (each within a relative
    2 (u R + 2u) + (n + 1) u of its value, docs/guide.md "Row operations", R <= 16, n = 8 here: 45 u, so the
    logits must be 2 * 45 u apart on top). hf_models.routing_margin, the margin in probability, is printed too."""
    assert float((logits.max(dim=-1).values - logits.min(dim=-1).values).max()) <= 16  # R <= 16
    margin = hf_models.routing_logit_margin(logits, k)
    need = 2 * delta.double().max(dim=-1).values + 90 * U32
    bad = (margin <= need).nonzero().flatten().tolist()
    assert not bad, (f"{what}: routing sits near a tie for tokens {bad[:8]} (logit margin {margin[bad[0]]:.3g} <= "
                     f"{need[bad[0]]:.3g}, probability margin {hf_models.routing_margin(logits, k)[bad[0]]:.3g}); "
                     "choose other inputs")


# ============================================================ one block against transformers' block

# BFloat16 bound, in units of the largest magnitude of each quantity. SparseMoE rounds to bf16 where transformers'
# block does in forward (the logits, x W1^T, x W3^T, silu, their product, the down product, the weighted output,
# the output after each expert; docs/guide.md "SparseMoE"), so the forward agrees to Float32 accumulation order:
# a value may land on the other side of a bf16 rounding boundary, one ulp (2 u16) of that value. The gradients
# differ where the two round at different points: torch adds a token's k = 2 expert contributions to x's gradient
# and the router path's in bf16 (2 roundings) after rounding each expert's dx (1 more), where StrideWeave sums in
# Float32 and rounds once (1); the router weight's gradient is one bf16 product of the bf16 logits' gradient on
# both sides (2 roundings that may differ: the logits' gradient, the product). At most 4 roundings, each at most one
# ulp of a partial sum no larger than the largest magnitude here: 4 ulps = 8 u16 of the largest magnitude.
# (Measured: at most 2.1 u16, the hidden states' gradient; the output and logits are bit-identical.)
BF16_ULPS = 4
BF16_BOUND = BF16_ULPS * 2 * U16


# Block inputs whose routing is away from ties in both layers, every family and dtype (assert_routing_is_stable
# checks it; with seed 10, two bf16 Mixtral logits of one token are equal).
X_SEED = 30


def sw_routing(block, x: torch.Tensor):
    """The MoEBlock's routing of x (tokens, H): (logits, weights, indices) as torch tensors."""
    with sw.no_grad():
        logits, weights, indices = block.moe.route(from_torch(x), from_torch(block.gate.weight.detach()))
    return to_torch(logits), to_torch(weights), to_torch(indices)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_an_offloaded_block_matches_transformers_block(saved, family, dtype_name):
    dtype = DTYPES[dtype_name]
    reference = load(family, saved, dtype_name)
    model = load(family, saved, dtype_name)
    config = model.config
    blocks = offload_experts(model, saved[family][dtype_name], budget=1 << 30)
    assert len(blocks) == config.num_hidden_layers
    bound = 1e-5 if dtype == torch.float32 else BF16_BOUND
    errors: dict = {}

    def record(what, err):
        errors[what] = max(errors.get(what, 0.0), err)

    for layer, block in enumerate(blocks):
        ref_block = hf_models.moe_block(reference, layer)
        I = ref_block.experts.intermediate_dim
        x = hf_models.hidden_states(config, TOKENS, seed=X_SEED + layer, dtype=dtype)
        cotangent = hf_models.hidden_states(config, TOKENS, seed=20 + layer, dtype=dtype)
        ref = hf_models.block_reference(ref_block, x, cotangent)

        # the routing first: the same experts, away from ties
        logits, weights, indices = sw_routing(block, x)
        f32_bound = logits_error_bound(x, ref_block.gate.weight.detach())
        if dtype == torch.float32:
            delta = f32_bound
        else:
            # Both round Float32 sums that are within f32_bound to bf16: the results are equal or one bf16 ulp
            # (at most 2 u16 |l|) apart. The routing then sees the logits' actual difference, checked to be that.
            delta = (logits.double() - ref.router_logits.double()).abs()
            assert bool((delta <= 2 * U16 * ref.router_logits.double().abs() + f32_bound).all())
        assert_routing_is_stable(ref.router_logits, delta, block.top_k, f"{family} {dtype_name} layer {layer}")
        # the same experts (their order within the top k may differ on a tie inside it, which changes nothing:
        # both sides add the experts' outputs in ascending expert order)
        assert torch.equal(indices.long().sort(dim=-1).values, ref.topk_index.sort(dim=-1).values)
        assert weights.dtype == ref.topk_weights.dtype
        record("router logits", assert_close(logits, ref.router_logits, bound, "router logits"))

        block.zero_expert_grads()
        xt = x.detach().clone().requires_grad_(True)
        block.gate.weight.grad = None
        y = block(xt.unsqueeze(0)).squeeze(0)
        assert y.dtype == dtype and y.shape == x.shape
        y.backward(cotangent)
        record("output", assert_close(y, ref.output, bound, f"{family} {dtype_name} layer {layer} output"))
        assert xt.grad.dtype == dtype and block.gate.weight.grad.dtype == dtype
        record("grad hidden", assert_close(xt.grad, ref.grad_hidden, bound, "hidden states' gradient"))
        record("grad router", assert_close(block.gate.weight.grad, ref.grads["gate.weight"], bound,
                                           "router weight's gradient"))
        if family == "qwen2_moe":
            for name, p in block.shared_expert.named_parameters():
                assert_close(p.grad, ref.grads[f"shared_expert.{name}"], bound, f"shared_expert.{name} gradient")
            assert_close(block.shared_expert_gate.weight.grad, ref.grads["shared_expert_gate.weight"], bound,
                         "shared_expert_gate gradient")
        want = ref.expert_grads(I)
        for part, w in (("gate", block.moe.w1), ("up", block.moe.w3), ("down", block.moe.w2)):
            got = torch.from_numpy(np.asarray(w.grad).astype(np.float64))  # (out, in, E)
            record(f"grad {part}", assert_close(got.permute(2, 0, 1), want[part], bound, f"{part} gradients"))
    print(f"{family} {dtype_name}: max error / largest magnitude {errors}")


# ============================================================ the whole model

def capture_router_inputs(model):
    """Forward hooks on every sparse-MoE block's router: [(layer, x, logits)] as the model runs."""
    seen, handles = [], []
    for layer in range(model.config.num_hidden_layers):
        gate = hf_models.moe_block(model, layer).gate

        def hook(module, args, output, layer=layer):
            seen.append((layer, args[0].detach().clone(), output[0].detach().clone()))
        handles.append(gate.register_forward_hook(hook))
    return seen, handles


# Input ids whose routing is away from ties in both layers of every family (assert_routing_is_stable checks it;
# seed 7 puts a Qwen2-MoE token 7e-7 from a tie).
IDS_SEED = 1


def input_ids(config, seed=7, shape=(2, 16)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, shape, generator=g)


def one_layer_expert_bytes(model) -> int:
    experts = hf_models.moe_block(model, 0).experts
    return sum(p.numel() * p.element_size() for p in experts.parameters())


# BFloat16, the whole model: each of the two layers' blocks adds at most BF16_ULPS to what reaches the next layer
# (the block bound above), and the torch code around them is the same on both sides: 2 * BF16_ULPS ulps of the
# largest magnitude. (Measured: at most 2.2 ulps, a gradient of layer 1's attention.)
BF16_MODEL_BOUND = 2 * BF16_BOUND


@pytest.mark.parametrize("dtype_name, prefetch", [("float32", False), ("bfloat16", False), ("float32", True)],
                         ids=["float32", "bfloat16", "float32-prefetch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_whole_model_matches_with_every_block_offloaded(saved, family, dtype_name, prefetch):
    reference = load(family, saved, dtype_name)
    model = load(family, saved, dtype_name)
    config = model.config
    half = one_layer_expert_bytes(model) // 2  # half the experts of one layer (weights; gradients share it)
    budget = sw.ResidencyBudget(half)
    blocks = offload_experts(model, saved[family][dtype_name], budget, prefetch=prefetch)
    assert [type(b).__name__ for b in blocks] == ["MoEBlock"] * config.num_hidden_layers
    assert (blocks[1].prefetch_next is blocks[0]) == prefetch and blocks[0].prefetch_next is None
    bound = 1e-5 if dtype_name == "float32" else BF16_MODEL_BOUND
    ids = input_ids(config, seed=IDS_SEED)

    seen, handles = capture_router_inputs(reference)
    want = reference(input_ids=ids, labels=ids)  # labels: the input ids, shifted inside the loss
    ours = []
    handles += [b.register_forward_pre_hook(lambda m, args: ours.append(args[0].detach().reshape(-1, m.moe.hidden_size)))
                for b in blocks]
    got = model(input_ids=ids, labels=ids)
    for h in handles:
        h.remove()
    forward_peak = budget.stats()
    # Routing away from ties in every layer. Float32: each side's logits are within 2 gamma_H sum|x||w| of the
    # exact product of its own block input, and the two inputs differ by what the layers before did (measured:
    # sum |x_ours - x_transformers| |w|). BFloat16: the logits' actual difference (as in the block test).
    for (layer, x, logits), x_ours, block in zip(seen, ours, blocks):
        w = hf_models.moe_block(reference, layer).gate.weight.detach()
        if dtype_name == "float32":
            delta = logits_error_bound(x, w) + (x_ours.double() - x.double()).abs() @ w.double().abs().T
        else:
            delta = (sw_routing(block, x_ours)[0].double() - logits.double()).abs()
        assert_routing_is_stable(logits, delta, config.num_experts_per_tok, f"{family} layer {layer}")
    assert_close(got.logits, want.logits, bound, "logits")
    # the loss (mean cross-entropy) moves by at most 2 max|logits' difference| (its gradient per token has l1 norm
    # <= 2), plus its own Float32 rounding
    loss_gap = abs(got.loss.item() - want.loss.item())
    assert loss_gap <= 2 * float((got.logits - want.logits).detach().double().abs().max()) + 1e-5 * want.loss.item()
    if dtype_name == "float32":
        assert loss_gap <= 1e-5 * abs(want.loss.item()), (got.loss, want.loss)

    budget.reset_peak()
    want.loss.backward()
    got.loss.backward()
    params = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        if ".experts." in name:
            continue
        assert name in params, name
        assert_close(params[name].grad, p.grad, bound, f"gradient of {name}")
    for layer, block in enumerate(blocks):
        ref_experts = hf_models.moe_block(reference, layer).experts
        I = ref_experts.intermediate_dim
        gate_up, down = ref_experts.gate_up_proj.grad, ref_experts.down_proj.grad
        for part, w, ref_grad in (("gate", block.moe.w1, gate_up[:, :I]), ("up", block.moe.w3, gate_up[:, I:]),
                                  ("down", block.moe.w2, down)):
            got_grad = torch.from_numpy(np.asarray(w.grad).astype(np.float64)).permute(2, 0, 1)
            assert_close(got_grad, ref_grad, bound, f"layer {layer} {part} gradients")
    # The budget held in forward and in backward (weights and gradients together), and it did bind.
    for stats in (forward_peak, budget.stats()):
        assert stats["peak_bytes"] <= stats["max_bytes"] + prefetch_allowance(blocks), stats
    assert budget.stats()["evictions"] > 0


def prefetch_allowance(blocks) -> int:
    """The bytes SparseMoE documents its prefetch may add to the budget's peak: none (docs/guide.md, "SparseMoE":
    the tiles in flight are admitted under the budget like any others, so peak_bytes stays within max_bytes)."""
    return 0


@pytest.mark.parametrize("family", FAMILIES)
def test_output_router_logits_and_the_aux_loss_still_work(saved, family):
    reference = load(family, saved)
    model = load(family, saved)
    offload_experts(model, saved[family]["float32"], 1 << 30)
    ids = input_ids(model.config, seed=8)
    want = reference(input_ids=ids, labels=ids, output_router_logits=True)
    got = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == model.config.num_hidden_layers
    for g, w in zip(got.router_logits, want.router_logits):
        assert_close(g, w, 1e-5, "recorded router logits")
    assert abs(got.aux_loss.item() - want.aux_loss.item()) <= 1e-5 * abs(want.aux_loss.item())
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    want.loss.backward()
    got.loss.backward()  # the aux loss's gradient reaches the router weight through torch
    for layer in range(model.config.num_hidden_layers):
        assert_close(hf_models.moe_block(model, layer).gate.weight.grad,
                     hf_models.moe_block(reference, layer).gate.weight.grad, 1e-5, "router gradient with aux loss")


def test_mixtral_jitter_in_training_mode_matches(saved):
    reference = load("mixtral", saved)
    model = load("mixtral", saved)
    for m in (reference, model):
        hf_models.moe_block(m, 0).jitter_noise = 0.25
    block = offload_experts(model, saved["mixtral"]["float32"], 1 << 30, layers=[0])[0]
    assert block.jitter_noise == 0.25
    ref_block = hf_models.moe_block(reference, 0)
    x = hf_models.hidden_states(model.config, TOKENS, seed=4).unsqueeze(0)
    outputs = {}
    for training in (True, False):
        ref_block.train(training)
        block.train(training)
        torch.manual_seed(123)
        want = ref_block(x.clone())  # transformers scales its input in place
        torch.manual_seed(123)
        outputs[training] = block(x.clone())
        assert_close(outputs[training], want, 1e-5, f"output (training={training})")
    assert relative_error(outputs[True], outputs[False]) > 1e-3  # the jitter did act in training mode


# ============================================================ what offload_experts does to the model

def test_offloading_frees_the_experts_and_keeps_the_rest(saved):
    model = load("qwen2_moe", saved)
    before = {name: p for name, p in model.named_parameters() if ".experts." not in name}
    old_blocks = [weakref.ref(hf_models.moe_block(model, layer)) for layer in range(2)]
    old_experts = [weakref.ref(hf_models.moe_block(model, layer).experts.gate_up_proj) for layer in range(2)]
    routers = [hf_models.moe_block(model, layer).gate for layer in range(2)]
    budget = sw.ResidencyBudget(1 << 20)
    blocks = offload_experts(model, sw.safetensors.open(saved["qwen2_moe"]["float32"]), budget)
    gc.collect()
    assert all(r() is None for r in old_blocks + old_experts)  # the in-RAM experts are gone
    after = dict(model.named_parameters())
    assert set(after) == set(before) and all(after[n] is p for n, p in before.items())  # the same Parameters
    assert [b.gate for b in blocks] == routers and all(isinstance(b, MoEBlock()) for b in blocks)
    for b in blocks:
        assert b.moe.w1.carrier.residency_budget is budget and b.moe.w2.carrier.residency_budget is budget
        assert b.moe.normalize is False and b.moe.top_k == 2  # Qwen2-MoE: no renormalisation


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_records_nothing_and_gives_the_same_output(saved, family):
    model = load(family, saved)
    block = offload_experts(model, saved[family]["float32"], 1 << 30, layers=[1])[0]
    assert type(hf_models.moe_block(model, 0)).__name__ != "MoEBlock"  # only the listed layer
    x = hf_models.hidden_states(model.config, TOKENS, seed=5).unsqueeze(0)
    with torch.no_grad():
        y0 = block(x)
    y1 = block(x.requires_grad_(True))
    assert y0.grad_fn is None and y1.grad_fn is not None
    assert torch.equal(y0, y1.detach())
    assert block.moe.w1.grad is None  # no StrideWeave backward ran


def test_gradients_accumulate_across_backwards_like_torch(saved):
    model = load("mixtral", saved)
    block = offload_experts(model, saved["mixtral"]["float32"], 1 << 30, layers=[0])[0]
    x = hf_models.hidden_states(model.config, TOKENS, seed=6).unsqueeze(0).requires_grad_(True)
    block(x).sum().backward()
    once = (x.grad.clone(), block.gate.weight.grad.clone(), np.asarray(block.moe.w2.grad).copy())
    block(x).sum().backward()
    assert torch.allclose(x.grad, 2 * once[0]) and torch.allclose(block.gate.weight.grad, 2 * once[1])
    assert np.allclose(np.asarray(block.moe.w2.grad), 2 * once[2])
    block.zero_expert_grads()
    assert block.moe.w1.grad is None and block.moe.w2.grad is None and block.moe.w3.grad is None


# ============================================================ errors change nothing

def model_state(model):
    """What an error must leave as it was: each layer's mlp object and every parameter object."""
    return [layer.mlp for layer in model.model.layers], dict(model.named_parameters())


def assert_unchanged(model, state):
    mlps, params = state
    assert [layer.mlp for layer in model.model.layers] == mlps
    now = dict(model.named_parameters())
    assert set(now) == set(params) and all(now[n] is p for n, p in params.items())


def test_offload_experts_refuses_what_it_cannot_do(saved, tmp_path):
    model = load("mixtral", saved)
    state = model_state(model)
    path = saved["mixtral"]["float32"]
    budget = sw.ResidencyBudget(1 << 20)
    cases = [
        (TypeError, "is not a transformers *ForCausalLM", lambda: offload_experts(torch.nn.Linear(2, 2), path, budget)),
        (TypeError, "checkpoint must be a path or a strideweave.safetensors Checkpoint",
         lambda: offload_experts(model, 42, budget)),
        (TypeError, "budget must be a strideweave.ResidencyBudget or a byte count",
         lambda: offload_experts(model, path, 1.5)),
        (TypeError, "budget must be", lambda: offload_experts(model, path, True)),
        (IndexError, "layer 2 is out of range (the model has 2 layers)",
         lambda: offload_experts(model, path, budget, layers=[0, 2])),
        (TypeError, "layers must be a list of layer indices", lambda: offload_experts(model, path, budget, layers="0")),
        (TypeError, "prefetch must be a bool", lambda: offload_experts(model, path, budget, prefetch=1)),
        # one expert's three Float32 (96, 64) tiles must fit at once
        (ValueError, "a budget of 73727 bytes cannot hold one expert's three weight tiles (73728 bytes)",
         lambda: offload_experts(model, path, 3 * 96 * 64 * 4 - 1)),
        (ValueError, "a budget of 0 bytes cannot hold", lambda: offload_experts(model, path, 0)),
        # a Qwen checkpoint for a Mixtral: the names are not there
        (ValueError, "the checkpoint has no tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight'",
         lambda: offload_experts(model, saved["qwen3_moe"]["float32"], budget)),
        # the same model saved in bf16: the dtypes differ
        (TypeError, "'model.layers.0.block_sparse_moe.experts.0.w1.weight' is BFloat16, the model's layer 0 gate "
                    "projection (w1) Float32", lambda: offload_experts(model, saved["mixtral"]["bfloat16"], budget)),
    ]
    other = hf_models.build_model("mixtral", seed=0, intermediate_size=64)
    hf_models.save_model(other, tmp_path / "narrow")
    cases.append((ValueError, "'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape (64, 64), the "
                              "model's layer 0 gate projection (w1) (96, 64)",
                  lambda: offload_experts(model, str(tmp_path / "narrow"), budget)))
    for kind, fragment, call in cases:
        with pytest.raises(kind) as info:
            call()
        assert fragment in str(info.value), (fragment, str(info.value))
        assert_unchanged(model, state)
        assert budget.stats()["members"] == 0 and budget.stats()["resident_bytes"] == 0


def test_offload_experts_refuses_dense_layers_other_activations_and_done_models(saved, tmp_path):
    dense = hf_models.build_model("qwen2_moe", seed=0, mlp_only_layers=[1])
    state = model_state(dense)
    with pytest.raises(ValueError, match=r"layer 1's mlp is a Qwen2MoeMLP, not a sparse-MoE block"):
        offload_experts(dense, saved["qwen2_moe"]["float32"], 1 << 20, layers=[1])
    assert_unchanged(dense, state)
    gelu = hf_models.build_model("qwen3_moe", seed=0, hidden_act="gelu")
    state = model_state(gelu)
    with pytest.raises(ValueError, match=r"activation is 'gelu'; SparseMoE computes SwiGLU"):
        offload_experts(gelu, saved["qwen3_moe"]["float32"], 1 << 20)
    assert_unchanged(gelu, state)
    model = load("qwen3_moe", saved)
    offload_experts(model, saved["qwen3_moe"]["float32"], 1 << 20)
    state = model_state(model)
    with pytest.raises(TypeError, match=r"has no sparse-MoE block of a supported family"):
        offload_experts(model, saved["qwen3_moe"]["float32"], 1 << 20)
    assert_unchanged(model, state)


def test_moe_block_refuses_wrong_inputs(saved):
    model = load("mixtral", saved)
    block = offload_experts(model, saved["mixtral"]["float32"], 1 << 30, layers=[0])[0]
    H = model.config.hidden_size
    with pytest.raises(TypeError, match=r"hidden_states are torch.float64, the block torch.float32"):
        block(torch.zeros(1, 4, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"hidden_states must be \(batch, seq, {H}\), got \(4, {H}\)"):
        block(torch.zeros(4, H))
    with pytest.raises(ValueError, match=rf"must be \(batch, seq, {H}\), got \(1, 4, 3\)"):
        block(torch.zeros(1, 4, 3))
    x = hf_models.hidden_states(model.config, 8, seed=2).unsqueeze(0).requires_grad_(True)
    y = block(x)
    y.sum().backward(retain_graph=True)
    grad = x.grad.clone()
    with pytest.raises(RuntimeError, match="a second backward through one forward of the block"):
        y.sum().backward()
    assert torch.equal(x.grad, grad)
    moe = block.moe
    Cls = MoEBlock()
    with pytest.raises(TypeError, match="moe must be a strideweave.moe.SparseMoE, got Linear"):
        Cls(torch.nn.Linear(2, 2), block.gate)
    with pytest.raises(ValueError, match=r"the router weight has shape \(4, 64\), the experts need"):
        Cls(moe, torch.zeros(4, H))
    with pytest.raises(TypeError, match=r"the router weight is torch.bfloat16, the experts torch.float32"):
        Cls(moe, torch.zeros(8, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shared_expert and shared_expert_gate come together"):
        Cls(moe, block.gate, shared_expert=torch.nn.Identity())
    with pytest.raises(ValueError, match="jitter_noise must be a number in"):
        Cls(moe, block.gate, jitter_noise=1.5)
    weight = torch.zeros(8, H)
    built = Cls(moe, weight)  # a tensor becomes the Parameter gate.weight, over the same memory
    assert isinstance(built.gate.weight, torch.nn.Parameter) and built.gate.weight.data_ptr() == weight.data_ptr()
    assert Cls(moe, block.gate.weight).gate.weight is block.gate.weight  # a Parameter is held as it is
