"""strideweave.torch's offload_experts and MoEBlock on Mixtral, Qwen2-MoE and Qwen3-MoE (docs/guide.md, "Opening a
Hugging Face MoE bigger than RAM" and "Blocks built by hand: MoEBlock").

The tiny Mixtral, Qwen2-MoE and Qwen3-MoE models of tests/hf_models.py (random weights, never downloaded) are
saved with ``save_pretrained`` in Float32 and BFloat16. ``offload_experts`` binds each layer's experts module to
the saved files' tensors; the blocks stay transformers' own (router, softmax and top-k, jitter, shared expert), and
the bound models are compared with the untouched ones: logits, loss, every torch gradient by name and every
expert's gradient (``binding.gather(name, grad=True)`` against transformers' ``gate_up_proj`` / ``down_proj``
gradients). ``MoEBlock``, built by hand over a ``SparseMoE`` of the same tiles, routes in StrideWeave and is
compared with transformers' block the same way.

Bounds. Float32: 1e-5 of the largest magnitude of each quantity (the issue's bound): both sides compute the same
Float32 sums in different orders, each within gamma_n sum|terms| of the exact value (n <= 96 terms here); the
measured errors are below 1e-6 of the largest magnitude. BFloat16: BF16_ULPS and BF16_MODEL_BOUND, stated and
justified where they are defined.

Routing. Bound experts modules are handed transformers' routing, so a block of the bound model routes exactly as
the untouched block when its input is the same (asserted bit for bit). Where routing is computed from inputs that
differ (a MoEBlock's StrideWeave routing; a later layer of the whole model, whose input went through the earlier
layers' experts), every token's k-th and (k+1)-th router logits must be further apart than the logits' difference
can move them (``assert_routing_is_stable``), or the test fails loudly and says which tokens.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

import hf_models
import strideweave as sw
from strideweave.torch import from_torch, offload_experts, offloaded_experts, to_torch

FAMILIES = [f for f in hf_models.FAMILIES if hf_models.FAMILIES[f].available]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENS = 32
U32 = 2.0 ** -24  # unit roundoff of Float32
U16 = 2.0 ** -8  # unit roundoff of BFloat16 (8 significant bits)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # an experts module's parameters, as transformers names them


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
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
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


def same_experts(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same experts per token (their order within the top k may differ on a tie inside it, which changes
    nothing: both sides add the experts' outputs in ascending expert order)."""
    return torch.equal(got.long().sort(dim=-1).values, want.long().sort(dim=-1).values)


# BFloat16 bound, in units of the largest magnitude of each quantity. SparseMoE rounds to bf16 where transformers'
# eager experts do in forward (x W1^T, x W3^T, silu, their product, the down product, the weighted output, the
# output after each expert; docs/guide.md "SparseMoE"; a MoEBlock's router logits too), so the forward agrees to
# Float32 accumulation order: a value may land on the other side of a bf16 rounding boundary, one ulp (2 u16) of
# that value. The gradients differ where the two round at different points: torch adds a token's k = 2 expert
# contributions to x's gradient in bf16 (2 roundings) after rounding each expert's dx (1 more), where StrideWeave
# sums in Float32 and rounds once (1); the routing weights' gradient is rounded once on each side, at different
# points, and the router weight's gradient is then one bf16 product of the bf16 logits' gradient on both sides (2
# roundings that may differ: the logits' gradient, the product). At most 4 roundings, each at most one ulp of a
# partial sum no larger than the largest magnitude here: 4 ulps = 8 u16 of the largest magnitude. (Measured: at
# most 2.1 u16, the hidden states' gradient, bound experts or MoEBlock; outputs and MoEBlock's logits bit-identical.)
BF16_ULPS = 4
BF16_BOUND = BF16_ULPS * 2 * U16

# BFloat16, the whole model: each of the two layers' blocks adds at most BF16_ULPS to what reaches the next layer
# (the block bound above), and the torch code around them is the same on both sides: 2 * BF16_ULPS ulps of the
# largest magnitude. (Measured: at most 3.6 u16, 1.8 ulps, a router weight's gradient.)
BF16_MODEL_BOUND = 2 * BF16_BOUND


# Block inputs whose routing is away from ties in both layers, every family and dtype (assert_routing_is_stable
# checks it for MoEBlock's StrideWeave routing; with seed 10, two bf16 Mixtral logits of one token are equal).
X_SEED = 30


def block_inputs(config, layer: int, dtype: torch.dtype):
    """(x, cotangent), (TOKENS, H) each, of layer `layer`'s block."""
    return (hf_models.hidden_states(config, TOKENS, seed=X_SEED + layer, dtype=dtype),
            hf_models.hidden_states(config, TOKENS, seed=20 + layer, dtype=dtype))


def bindings_by_layer(model) -> dict:
    return {b.layer: b for b in offloaded_experts(model).values()}


# ============================================================ a block whose experts are bound, against transformers'

def record_experts_calls(block, calls: list):
    """A forward pre-hook on the block's experts module: appends (top_k_index, top_k_weights) of each call."""
    return block.experts.register_forward_pre_hook(
        lambda module, args: calls.append((args[1].detach().clone(), args[2].detach().clone())))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_block_with_bound_experts_matches_transformers_block(saved, family, dtype_name):
    dtype = DTYPES[dtype_name]
    reference = load(family, saved, dtype_name)
    model = load(family, saved, dtype_name)
    config = model.config
    bindings = offload_experts(model, saved[family][dtype_name], budget=1 << 30)
    assert [b.name for b in bindings] == [f"model.layers.{i}.mlp.experts" for i in range(config.num_hidden_layers)]
    assert [b.layer for b in bindings] == list(range(config.num_hidden_layers))
    assert all(b.native for b in bindings)  # SwiGLU experts stored per expert: the C++ SparseMoE computes them
    bound = 1e-5 if dtype == torch.float32 else BF16_BOUND
    errors: dict = {}

    def record(what, err):
        errors[what] = max(errors.get(what, 0.0), err)

    for layer, binding in enumerate(bindings):
        block, ref_block = hf_models.moe_block(model, layer), hf_models.moe_block(reference, layer)
        assert block.experts.__dict__["_strideweave"] is binding
        x, cotangent = block_inputs(config, layer, dtype)
        calls: list = []
        ref_calls: list = []
        handles = [record_experts_calls(block, calls), record_experts_calls(ref_block, ref_calls)]
        binding.zero_grad()
        ours = hf_models.block_reference(block, x, cotangent)
        ref = hf_models.block_reference(ref_block, x, cotangent)
        for h in handles:
            h.remove()
        # The routing is transformers' own: the bound module was handed what transformers' experts were, bit for
        # bit, and the C++ SparseMoE computed it for that top k and routing weights' dtype.
        assert len(calls) == len(ref_calls) == 1
        assert torch.equal(calls[0][0], ref_calls[0][0]) and torch.equal(calls[0][1], ref_calls[0][1])
        assert set(binding._moes) == {(config.num_experts_per_tok, ref_calls[0][1].dtype)}

        assert ours.output.dtype == dtype and ours.grad_hidden.dtype == dtype
        record("output", assert_close(ours.output, ref.output, bound, f"{family} {dtype_name} layer {layer} output"))
        record("grad hidden", assert_close(ours.grad_hidden, ref.grad_hidden, bound, "hidden states' gradient"))
        # every torch parameter of the block (router, Qwen2-MoE's shared expert and its gate), by name
        assert set(ours.grads) == {n for n in ref.grads if not n.startswith("experts.")}
        for name, g in ours.grads.items():
            assert g is not None and g.dtype == dtype, name
            record(f"grad {name}", assert_close(g, ref.grads[name], bound, f"gradient of {name}"))
        for name in EXPERT_PARAMS:
            got = binding.gather(name, grad=True)
            assert got.dtype == dtype  # a tiled gradient is of its leaf's dtype, as torch's .grad
            record(f"grad {name}", assert_close(got, ref.grads[f"experts.{name}"], bound, f"{name} gradient"))
    print(f"{family} {dtype_name}: max error / largest magnitude {errors}")


# ============================================================ a MoEBlock built by hand, against transformers' block

def hand_block(model, family: str, layer: int, checkpoint, budget):
    """A MoEBlock for layer `layer` of `model` built by hand: a SparseMoE over the checkpoint's tiles of that
    layer's experts, with the family's routing (Mixtral renormalises its Float32 top-k weights; Qwen casts them
    to the model's dtype, renormalised when norm_topk_prob), the model's router module, Qwen2-MoE's shared
    expert and Mixtral's jitter."""
    block = hf_models.moe_block(model, layer)
    names = hf_models.expert_names(family, layer, block.gate.weight.shape[0])
    w1, w3, w2 = (checkpoint.tiled(names[r]) for r in ("gate", "up", "down"))
    if family == "mixtral":
        normalize, routing_dtype = True, None  # Float32 routing weights
    else:
        normalize, routing_dtype = bool(block.gate.norm_topk_prob), w1.dtype()
    moe = sw.moe.SparseMoE(w1, w2, w3, block.gate.top_k, normalize=normalize, routing_dtype=routing_dtype,
                           budget=budget)
    shared = family == "qwen2_moe"
    return MoEBlock()(moe, block.gate, shared_expert=block.shared_expert if shared else None,
                      shared_expert_gate=block.shared_expert_gate if shared else None,
                      jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0))


def sw_routing(block, x: torch.Tensor):
    """The MoEBlock's routing of x (tokens, H): (logits, weights, indices) as torch tensors."""
    with sw.no_grad():
        logits, weights, indices = block.moe.route(from_torch(x), from_torch(block.gate.weight.detach()))
    return to_torch(logits), to_torch(weights), to_torch(indices)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_moe_block_built_by_hand_matches_transformers_block(saved, family, dtype_name):
    dtype = DTYPES[dtype_name]
    reference = load(family, saved, dtype_name)
    model = load(family, saved, dtype_name)
    config = model.config
    checkpoint = sw.safetensors.open(saved[family][dtype_name])
    budget = sw.ResidencyBudget(1 << 30)
    bound = 1e-5 if dtype == torch.float32 else BF16_BOUND
    errors: dict = {}

    def record(what, err):
        errors[what] = max(errors.get(what, 0.0), err)

    for layer in range(config.num_hidden_layers):
        block = hand_block(model, family, layer, checkpoint, budget)
        ref_block = hf_models.moe_block(reference, layer)
        I = ref_block.experts.intermediate_dim
        x, cotangent = block_inputs(config, layer, dtype)
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
        assert same_experts(indices, ref.topk_index)
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

def capture_routers(model):
    """Forward hooks on every layer's router: [(layer, x, logits, indices)] as the model runs."""
    seen, handles = [], []
    for layer in range(model.config.num_hidden_layers):
        gate = hf_models.moe_block(model, layer).gate

        def hook(module, args, output, layer=layer):
            seen.append((layer, args[0].detach().clone(), output[0].detach().clone(), output[2].detach().clone()))
        handles.append(gate.register_forward_hook(hook))
    return seen, handles


# Input ids whose routing is away from ties in layer 1 of every family (assert_routing_is_stable checks it;
# seed 7 puts a Qwen2-MoE token 7e-7 from a tie).
IDS_SEED = 1


def input_ids(config, seed=7, shape=(2, 16)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, shape, generator=g)


def one_layer_expert_bytes(model) -> int:
    experts = hf_models.moe_block(model, 0).experts
    return sum(p.numel() * p.element_size() for p in experts.parameters())


@pytest.mark.parametrize("dtype_name, prefetch", [("float32", False), ("bfloat16", False), ("float32", True)],
                         ids=["float32", "bfloat16", "float32-prefetch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_whole_model_matches_with_every_experts_module_bound(saved, family, dtype_name, prefetch):
    reference = load(family, saved, dtype_name)
    model = load(family, saved, dtype_name)
    config = model.config
    half = one_layer_expert_bytes(model) // 2  # half the experts of one layer (weights; gradients share it)
    budget = sw.ResidencyBudget(half)
    bindings = offload_experts(model, saved[family][dtype_name], budget, prefetch=prefetch)
    assert len(bindings) == config.num_hidden_layers and all(b.native for b in bindings)
    assert (bindings[1].prefetch_next is bindings[0]) == prefetch and bindings[0].prefetch_next is None
    bound = 1e-5 if dtype_name == "float32" else BF16_MODEL_BOUND
    ids = input_ids(config, seed=IDS_SEED)

    ref_seen, handles = capture_routers(reference)
    seen, more = capture_routers(model)
    want = reference(input_ids=ids, labels=ids)  # labels: the input ids, shifted inside the loss
    got = model(input_ids=ids, labels=ids)
    for h in handles + more:
        h.remove()
    forward_peak = budget.stats()
    assert all(b._moes for b in bindings)  # the C++ SparseMoE computed every layer's experts
    # Routing. Layer 0's router sees the same input on both sides (the layers before it are the same torch code):
    # the same logits and experts, bit for bit. A later layer's input went through the earlier layers' experts,
    # computed in another order: its routing must be away from ties. Float32: each side's logits are within
    # 2 gamma_H sum|x||w| of the exact product of its own input, and the two inputs differ by what the layers
    # before did (measured: sum |x_ours - x_transformers| |w|). BFloat16: the logits' actual difference.
    assert len(seen) == len(ref_seen) == config.num_hidden_layers
    for (layer, x, logits, indices), (_, x_ref, logits_ref, indices_ref) in zip(seen, ref_seen):
        if layer == 0:
            assert torch.equal(x, x_ref) and torch.equal(logits, logits_ref) and torch.equal(indices, indices_ref)
            continue
        w = hf_models.moe_block(reference, layer).gate.weight.detach()
        if dtype_name == "float32":
            delta = logits_error_bound(x_ref, w) + (x.double() - x_ref.double()).abs() @ w.double().abs().T
        else:
            delta = (logits.double() - logits_ref.double()).abs()
        assert_routing_is_stable(logits_ref, delta, config.num_experts_per_tok, f"{family} layer {layer}")
        assert same_experts(indices, indices_ref), f"{family} layer {layer}"
    errors = {"logits": assert_close(got.logits, want.logits, bound, "logits")}
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
    # every torch parameter, by name: all of the reference's but the experts' weights
    assert set(params) == {n for n, _ in reference.named_parameters() if ".experts." not in n}
    for name, p in reference.named_parameters():
        if name in params:
            errors[name] = assert_close(params[name].grad, p.grad, bound, f"gradient of {name}")
    for binding in bindings:
        ref_experts = hf_models.moe_block(reference, binding.layer).experts
        for name in EXPERT_PARAMS:
            errors[f"{binding.name}.{name}"] = assert_close(binding.gather(name, grad=True),
                                                            getattr(ref_experts, name).grad, bound,
                                                            f"layer {binding.layer} {name} gradients")
    worst = max(errors, key=errors.get)
    print(f"{family} {dtype_name}: max error / largest magnitude {errors[worst]:.3g} ({worst})")
    # The budget held in forward and in backward (weights and gradients together), and it did bind. Prefetching
    # adds nothing to the peak: the tiles in flight are admitted under the budget like any others (docs/guide.md,
    # "SparseMoE").
    for stats in (forward_peak, budget.stats()):
        assert stats["peak_bytes"] <= stats["max_bytes"], stats
    assert budget.stats()["evictions"] > 0


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


def jittered_outputs(block, x: torch.Tensor) -> dict:
    """{training: block output} for the same input and the same draw (seed 123) of the jitter."""
    outputs = {}
    for training in (True, False):
        block.train(training)
        torch.manual_seed(123)
        outputs[training] = block(x.clone())  # transformers scales its input in place
    return outputs


def test_mixtral_jitter_in_training_mode_matches(saved):
    reference = load("mixtral", saved)
    model = load("mixtral", saved)
    for m in (reference, model):
        hf_models.moe_block(m, 0).jitter_noise = 0.25
    offload_experts(model, saved["mixtral"]["float32"], 1 << 30, layers=[0])
    x = hf_models.hidden_states(model.config, TOKENS, seed=4).unsqueeze(0)
    want = jittered_outputs(hf_models.moe_block(reference, 0), x)
    # the bound module under transformers' own block: its jitter, its routing of the jittered input
    got = jittered_outputs(hf_models.moe_block(model, 0), x)
    # a MoEBlock built by hand applies the same draw in torch and routes in StrideWeave: the jittered input's
    # routing must be away from ties
    block = hand_block(model, "mixtral", 0, sw.safetensors.open(saved["mixtral"]["float32"]),
                       sw.ResidencyBudget(1 << 30))
    assert block.jitter_noise == 0.25
    torch.manual_seed(123)
    jittered = (x * torch.empty_like(x).uniform_(0.75, 1.25)).reshape(-1, x.shape[-1])
    w = block.gate.weight.detach()
    assert_routing_is_stable(jittered @ w.T, logits_error_bound(jittered, w), block.top_k, "jittered input")
    by_hand = jittered_outputs(block, x)
    for training in (True, False):
        assert_close(got[training], want[training], 1e-5, f"bound experts' output (training={training})")
        assert_close(by_hand[training], want[training], 1e-5, f"MoEBlock's output (training={training})")
    assert relative_error(want[True], want[False]) > 1e-3  # the jitter did act in training mode


# ============================================================ what offload_experts does to the model

def test_offloading_frees_the_experts_and_keeps_the_rest(saved):
    path = saved["qwen2_moe"]["float32"]
    reference = load("qwen2_moe", saved)
    model = load("qwen2_moe", saved)
    before = {name: p for name, p in model.named_parameters() if ".experts." not in name}
    expert_weights = [weakref.ref(p) for name, p in model.named_parameters() if ".experts." in name]
    assert len(expert_weights) == 2 * len(EXPERT_PARAMS)
    blocks = [hf_models.moe_block(model, layer) for layer in range(2)]
    modules = [(b.gate, b.experts, b.shared_expert, b.shared_expert_gate) for b in blocks]
    budget = sw.ResidencyBudget(1 << 20)
    bindings = offload_experts(model, sw.safetensors.open(path), budget)
    assert all(r() is None for r in expert_weights)  # the in-RAM expert weights are gone
    after = dict(model.named_parameters())
    assert set(after) == set(before) and all(after[n] is p for n, p in before.items())  # the same Parameters
    assert offloaded_experts(model) == {b.name: b for b in bindings}
    E, H, I = 8, 64, 96
    for layer, (binding, block) in enumerate(zip(bindings, blocks)):
        # transformers' block and every module of it stay; the experts module holds no parameter
        assert hf_models.moe_block(model, layer) is block
        assert (block.gate, block.experts, block.shared_expert, block.shared_expert_gate) == modules[layer]
        assert dict(block.experts.named_parameters()) == {}
        for name, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            t = getattr(block.experts, name)
            assert not isinstance(t, torch.nn.Parameter) and t.device.type == "meta" and tuple(t.shape) == shape
        assert binding.layer == layer and binding.parameter_names == EXPERT_PARAMS
        names = hf_models.expert_names("qwen2_moe", layer, E)
        assert binding.checkpoint_names == {r: names[r] for r in ("gate", "up", "down")}
        assert {r: tuple(t.shape.extents) for r, t in binding.tiled.items()} == {
            "gate": (I, H, E), "up": (I, H, E), "down": (H, I, E)}
        ref_experts = hf_models.moe_block(reference, layer).experts
        for name in EXPERT_PARAMS:  # the tiles are the checkpoint's: what transformers loaded, bit for bit
            assert torch.equal(binding.gather(name), getattr(ref_experts, name))
    # The checkpoint's carriers, every tiled tensor's of every layer, draw from the budget from the binding on,
    # and still after a forward (SparseMoE joins the same budget).
    for when in ("bound", "after a forward"):
        for binding in bindings:
            for role, t in binding.tiled.items():
                assert t.carrier.residency_budget is budget, (when, binding.name, role)
        assert budget.stats()["members"] == 2 * 3, when
        with torch.no_grad():
            model(input_ids=input_ids(model.config))


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_records_nothing_and_gives_the_same_output(saved, family):
    model = load(family, saved)
    binding = offload_experts(model, saved[family]["float32"], 1 << 30, layers=[1])[0]
    assert binding.layer == 1 and list(offloaded_experts(model)) == ["model.layers.1.mlp.experts"]
    # only the listed layer: layer 0's experts keep their weights and transformers' implementation
    assert set(dict(hf_models.moe_block(model, 0).experts.named_parameters())) == set(EXPERT_PARAMS)
    block = hf_models.moe_block(model, 1)
    recording: list = []
    make = binding._sparse_moe

    class Recorder:  # the SparseMoE the binding uses, noting whether StrideWeave records each experts call
        def __init__(self, moe):
            self.moe = moe

        def experts(self, *args):
            recording.append(sw.is_grad_enabled())
            return self.moe.experts(*args)

    binding._sparse_moe = lambda k, dtype: Recorder(make(k, dtype))
    x = hf_models.hidden_states(model.config, TOKENS, seed=5).unsqueeze(0).requires_grad_(True)
    with torch.no_grad():
        y0 = block(x)
    y1 = block(x)
    assert recording == [False, True]
    assert y0.grad_fn is None and y1.grad_fn is not None
    assert torch.equal(y0, y1.detach())
    assert all(t.grad is None for t in binding.tiled.values())  # no StrideWeave backward ran


def test_gradients_accumulate_across_backwards_like_torch(saved):
    model = load("mixtral", saved)
    binding = offload_experts(model, saved["mixtral"]["float32"], 1 << 30, layers=[0])[0]
    block = hf_models.moe_block(model, 0)
    x = hf_models.hidden_states(model.config, TOKENS, seed=6).unsqueeze(0).requires_grad_(True)

    def grads():
        return [x.grad.clone(), block.gate.weight.grad.clone()] + [binding.gather(n, grad=True) for n in EXPERT_PARAMS]

    block(x).sum().backward()
    once = grads()
    block(x).sum().backward()
    # the second backward computes the same gradients (same inputs, same order): each sum is g + g = 2 g exactly
    for name, g, g1 in zip(("x", "router", *EXPERT_PARAMS), grads(), once):
        assert bool(g1.abs().max() > 0) and torch.equal(g, 2 * g1), name
    binding.zero_grad()
    assert all(t.grad is None for t in binding.tiled.values())
    assert all(not bool(binding.gather(n, grad=True).any()) for n in EXPERT_PARAMS)


# ============================================================ errors change nothing

def model_state(model):
    """What an error must leave as it was: each layer's mlp and experts objects, every parameter object (the
    experts' included), each experts module's config, the bindings, and the model's own methods (guards)."""
    layers = model.model.layers
    return ([layer.mlp for layer in layers], [getattr(layer.mlp, "experts", None) for layer in layers],
            [getattr(getattr(layer.mlp, "experts", None), "config", None) for layer in layers],
            dict(model.named_parameters()), dict(offloaded_experts(model)), sorted(model.__dict__))


def assert_unchanged(model, state):
    mlps, experts, configs, params, bound, attributes = state
    layers = model.model.layers
    assert [layer.mlp for layer in layers] == mlps
    assert [getattr(layer.mlp, "experts", None) for layer in layers] == experts
    assert [getattr(getattr(layer.mlp, "experts", None), "config", None) for layer in layers] == configs
    now = dict(model.named_parameters())
    assert set(now) == set(params) and all(now[n] is p for n, p in params.items())
    assert offloaded_experts(model) == bound
    assert sorted(model.__dict__) == attributes


def test_offload_experts_refuses_what_it_cannot_do(saved, tmp_path):
    model = load("mixtral", saved)
    state = model_state(model)
    path = saved["mixtral"]["float32"]
    budget = sw.ResidencyBudget(1 << 20)
    experts = "model.layers.0.mlp.experts"
    w1 = "'model.layers.0.block_sparse_moe.experts.0.w1.weight'"
    cases = [
        (TypeError, "offload_experts: expected a transformers model (a torch.nn.Module), got int",
         lambda: offload_experts(42, path, budget)),
        (TypeError, "offload_experts: Linear has no experts module StrideWeave knows",
         lambda: offload_experts(torch.nn.Linear(2, 2), path, budget)),
        (TypeError, "checkpoint must be a path or a strideweave.safetensors Checkpoint, got int",
         lambda: offload_experts(model, 42, budget)),
        (TypeError, "budget must be a strideweave.ResidencyBudget or a byte count, got float",
         lambda: offload_experts(model, path, 1.5)),
        (TypeError, "budget must be a strideweave.ResidencyBudget or a byte count, got bool",
         lambda: offload_experts(model, path, True)),
        (ValueError, "budget must be a byte count >= 1, got -1", lambda: offload_experts(model, path, -1)),
        (IndexError, "offload_experts: layer 2 is out of range (the model has 2 layers)",
         lambda: offload_experts(model, path, budget, layers=[0, 2])),
        (TypeError, "layers must be a list of layer indices", lambda: offload_experts(model, path, budget, layers="0")),
        (TypeError, "prefetch must be a bool, got int", lambda: offload_experts(model, path, budget, prefetch=1)),
        # one expert's three Float32 (96, 64) tiles must fit at once
        (ValueError, "a budget of 73727 bytes cannot hold one expert's weight tiles (73728 bytes)",
         lambda: offload_experts(model, path, 3 * 96 * 64 * 4 - 1)),
        (ValueError, "offload_experts: budget must be a byte count >= 1, got 0", lambda: offload_experts(model, path, 0)),
        # a Qwen checkpoint for a Mixtral: none of the names is there
        (ValueError, f"the checkpoint has none of the tensors of {experts} (MixtralExperts): tried {w1}",
         lambda: offload_experts(model, saved["qwen3_moe"]["float32"], budget)),
        # the same model saved in bf16: the dtypes differ
        (TypeError, f"{w1} is BFloat16, the model's {experts} gate projection Float32",
         lambda: offload_experts(model, saved["mixtral"]["bfloat16"], budget)),
    ]
    other = hf_models.build_model("mixtral", seed=0, intermediate_size=64)
    hf_models.save_model(other, tmp_path / "narrow")
    cases.append((ValueError, f"{w1} has shape (64, 64), the model's {experts} gate projection (96, 64)",
                  lambda: offload_experts(model, str(tmp_path / "narrow"), budget)))
    for kind, fragment, call in cases:
        with pytest.raises(kind) as info:
            call()
        assert fragment in str(info.value), (fragment, str(info.value))
        assert_unchanged(model, state)
        assert budget.stats()["members"] == 0 and budget.stats()["resident_bytes"] == 0
    # and the model still runs as transformers' own
    reference = load("mixtral", saved)
    ids = input_ids(model.config)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_offload_experts_refuses_dense_layers_and_done_models(saved):
    dense = hf_models.build_model("qwen2_moe", seed=0, mlp_only_layers=[1])
    state = model_state(dense)
    with pytest.raises(ValueError, match=r"offload_experts: layer 1 has no experts module \(MoE layers: \[0\]\)"):
        offload_experts(dense, saved["qwen2_moe"]["float32"], 1 << 20, layers=[1])
    assert_unchanged(dense, state)
    model = load("qwen3_moe", saved)
    offload_experts(model, saved["qwen3_moe"]["float32"], 1 << 20)
    state = model_state(model)
    with pytest.raises(ValueError, match=r"offload_experts: Qwen3MoeForCausalLM's experts are already offloaded"):
        offload_experts(model, saved["qwen3_moe"]["float32"], 1 << 20)
    assert_unchanged(model, state)


def test_other_activations_run_the_per_expert_math(saved, tmp_path):
    """Experts whose activation is not SiLU are not SwiGLU: the C++ SparseMoE does not take them, the per-expert
    math in torch over the projected tiles does (it was refused before the bridge used transformers' experts
    interface). Float32: within 1e-5 of the largest magnitude, as above."""
    gelu = hf_models.build_model("qwen3_moe", seed=0, hidden_act="gelu", experts_implementation="eager")
    folder = tmp_path / "gelu"
    hf_models.save_model(gelu, folder)
    model = hf_models.load_model("qwen3_moe", folder, experts_implementation="eager")
    bindings = offload_experts(model, str(folder), 1 << 20)
    assert not any(b.native for b in bindings)
    ids = input_ids(model.config, seed=IDS_SEED)
    want = gelu(input_ids=ids, labels=ids)
    got = model(input_ids=ids, labels=ids)
    assert_close(got.logits, want.logits, 1e-5, "logits")
    assert not any(b._moes for b in bindings)  # no SparseMoE was made
    want.loss.backward()
    got.loss.backward()
    for b in bindings:
        for name in EXPERT_PARAMS:
            assert_close(b.gather(name, grad=True), getattr(hf_models.moe_block(gelu, b.layer).experts, name).grad,
                         1e-5, f"layer {b.layer} {name} gradients")


# ============================================================ MoEBlock refuses what it cannot do

def test_moe_block_refuses_wrong_inputs(saved):
    model = load("mixtral", saved)
    block = hand_block(model, "mixtral", 0, sw.safetensors.open(saved["mixtral"]["float32"]),
                       sw.ResidencyBudget(1 << 30))
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
