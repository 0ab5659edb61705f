"""Compact optimizer state: ``state_dtype=sw.DType.BFloat16`` on strideweave.optim.SGD / Adam / AdamW and on the
strideweave.torch optimizers (Note [Compact optimizer state] in cpp/include/strideweave/optim.hpp).

Reference: torch.optim's single-tensor code path (as tests/test_optim.py uses it, with the correctly rounded square
root) on Float32 copies of the weights, whose state is rounded to BFloat16 (nearest even: torch's
``Tensor.bfloat16()``) and widened back after every step. That is exactly the scheme under test: the update reads
the widened (exact) BFloat16 state, computes in Float32 as with Float32 state (the weight's update uses the new
Float32 state values), and only the stored state is rounded, once. Same operations, same order, same single
rounding: error bound 0 (bit-exact), for Float32 weights and for BFloat16 weights (rounded to BFloat16 after each
step on both sides, as tests/test_optim.py's 16-bit test does).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly

torch = pytest.importorskip("torch")

from test_optim import E, IN, OUT, ROUTES, backward_grads, correctly_rounded_sqrt, expert_weight, experts_of  # noqa: E402,I001

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20270134
BF16 = sw.DType.BFloat16


def seed_of(name):
    seed = BASE_SEED + sum(map(ord, name))
    print(f"seed {seed}")
    return seed


CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
    ("Adam", dict(lr=1e-2, betas=(0.3, 0.5))),  # beta1 < 0.5: torch's lerp takes its other branch
    ("AdamW", dict(lr=3e-2, betas=(0.85, 0.995), weight_decay=0.1)),
]


def state_names(kind):
    return ["momentum_buffer"] if kind == "SGD" else ["exp_avg", "exp_avg_sq"]


def round_state_to_bf16(ref, kind):
    """The reference's stored state rounded to BFloat16 (nearest even) and widened back (exact)."""
    for st in ref.state.values():
        for name in state_names(kind):
            if st.get(name) is not None:
                st[name].copy_(st[name].bfloat16().float())


@pytest.mark.parametrize("kind,hyper", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
def test_bf16_state_bit_exact_against_torch_with_rounded_state(kind, hyper, wdtype):
    """Weights and state equal the reference's bit for bit after every step (bound 0: module docstring)."""
    rng = np.random.default_rng(seed_of("bf16state" + kind + repr(hyper) + wdtype))
    dtype, npd = (sw.DType.Float32, np.float32) if wdtype == "float32" else (BF16, ml_dtypes.bfloat16)
    experts = rng.standard_normal((E, OUT, IN)).astype(npd)
    c, full = expert_weight(experts, dtype)
    opt = getattr(sw.optim, kind)([full], state_dtype=BF16, **hyper)
    assert opt.state_dtype is BF16
    params = [torch.nn.Parameter(torch.from_numpy(experts[e].astype(np.float32))) for e in range(E)]
    ref = getattr(torch.optim, kind)(params, foreach=False, **hyper)
    weights = experts.copy()
    for route in ROUTES:
        grads = {e: rng.standard_normal((OUT, IN)).astype(npd).astype(np.float32) for e in route}
        backward_grads(c, full, grads)
        g = experts_of(full.grad).astype(np.float32)
        for e, p in enumerate(params):
            with torch.no_grad():
                p.copy_(torch.from_numpy(weights[e].astype(np.float32)))
            p.grad = torch.from_numpy(g[e].copy()) if e in route else None
        opt.step()
        with correctly_rounded_sqrt():
            ref.step()
        round_state_to_bf16(ref, kind)
        weights = np.stack([p.detach().numpy().astype(npd) for p in params])
        got = experts_of(full)
        assert got.dtype == npd
        view = np.uint32 if npd == np.float32 else np.uint16
        assert np.array_equal(got.view(view), weights.view(view)), f"max |diff| {np.max(np.abs(got - weights))}"
    state = opt.state(full)
    for name in state_names(kind):
        assert state[name].dtype() is BF16
        got = experts_of(state[name])
        assert got.dtype == ml_dtypes.bfloat16
        for e, p in enumerate(params):
            want = ref.state[p][name].numpy() if p in ref.state else np.zeros((OUT, IN), np.float32)
            assert np.array_equal(got[e].astype(np.float32).view(np.uint32), want.view(np.uint32)), (name, e)


def test_bf16_state_differs_from_float32_state():
    """The option changes the stored values (the check above could not pass with Float32 state kept)."""
    rng = np.random.default_rng(seed_of("differs"))
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    outs = []
    for sd in (sw.DType.Float32, BF16):
        c, full = expert_weight(experts)
        opt = sw.optim.Adam([full], lr=1e-2, state_dtype=sd)
        r = np.random.default_rng(1)
        for route in ROUTES[:3]:
            backward_grads(c, full, {e: r.standard_normal((OUT, IN)).astype(np.float32) for e in route})
            opt.step()
        outs.append((experts_of(full), experts_of(opt.state(full)["exp_avg"]).astype(np.float32)))
    assert not np.array_equal(outs[0][0], outs[1][0])
    assert np.array_equal(outs[1][1].astype(ml_dtypes.bfloat16).astype(np.float32), outs[1][1])
    assert not np.array_equal(outs[0][1], outs[1][1])


def test_dense_parameter_with_bf16_state():
    """A dense CPU parameter: its state is one BFloat16 buffer, stepped as a tile (bound 0 against the reference)."""
    rng = np.random.default_rng(seed_of("dense"))
    router = rng.standard_normal((E, IN)).astype(np.float32)
    r = friendly.tensor(router.copy())
    opt = sw.optim.AdamW([r], lr=1e-2, state_dtype=BF16)
    p = torch.nn.Parameter(torch.from_numpy(router.copy()))
    ref = torch.optim.AdamW([p], lr=1e-2, foreach=False)
    for _ in range(3):
        g = rng.standard_normal((E, IN)).astype(np.float32)
        r.grad = friendly.tensor(g.copy())
        p.grad = torch.from_numpy(g)
        opt.step()
        with correctly_rounded_sqrt():
            ref.step()
        round_state_to_bf16(ref, "AdamW")
        assert np.array_equal(np.asarray(r).view(np.uint32), p.detach().numpy().view(np.uint32))
    st = opt.state(r)
    assert st["exp_avg"].dtype() is BF16 and st["exp_avg"].carrier.dtype() is BF16
    assert np.array_equal(np.asarray(st["exp_avg_sq"]).astype(np.float32), ref.state[p]["exp_avg_sq"].numpy())


TILE = OUT * IN  # slots per tile


def run_budgeted(state_dtype, budget_tiles, steps=3):
    """Adam over a Float32 expert weight under a budget of `budget_tiles` Float32 tiles, every expert routed."""
    rng = np.random.default_rng(seed_of("budget"))
    budget = sw.ResidencyBudget(budget_tiles * TILE * 4)
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    c, full = expert_weight(experts, budget=budget)
    opt = sw.optim.Adam([full], lr=1e-2, state_dtype=state_dtype)
    budget.reset_peak()
    for _ in range(steps):
        backward_grads(c, full, {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in range(E)})
        opt.step()
    return budget, full, opt


def test_bf16_state_tiles_are_half_the_bytes_and_the_budget_counts_them():
    """A step holds one weight tile (4 TILE bytes), its gradient (4 TILE) and two moments: Float32 moments need
    16 TILE bytes, BFloat16 ones 12 TILE. Under a budget of 3 Float32 tiles (12 TILE bytes) the Float32 state is
    refused (ValueError naming max_bytes, nothing stepped) and the BFloat16 state steps, its peak within the
    budget; every state tile written to its scratch file is 2 TILE bytes (Float32: 4 TILE)."""
    with pytest.raises(ValueError, match="max_bytes"):
        run_budgeted(sw.DType.Float32, budget_tiles=3)
    budget, full, opt = run_budgeted(BF16, budget_tiles=3)
    assert budget.stats()["peak_bytes"] <= budget.max_bytes
    s = opt.stats()["state"]
    assert s["evictions"] > 0 and s["promotions"] > 0  # 2 E moment tiles do not fit: they travel
    assert s["bytes_evicted"] == s["evictions"] * TILE * 2
    # A promotion of a never-stepped (implicit) tile makes a zero buffer and reads nothing: not every promotion
    # moves bytes, but each one that does moves one BFloat16 tile.
    assert 0 < s["bytes_promoted"] <= s["promotions"] * TILE * 2 and s["bytes_promoted"] % (TILE * 2) == 0
    for name in ("exp_avg", "exp_avg_sq"):
        carrier = opt.state(full)[name].carrier
        assert carrier.dtype() is BF16
        assert carrier.tile_shape == (OUT, IN)
    # The same run with Float32 state under a budget that fits it moves 4 TILE bytes per state tile.
    _, _, opt32 = run_budgeted(sw.DType.Float32, budget_tiles=4)
    s32 = opt32.stats()["state"]
    assert s32["evictions"] > 0 and s32["bytes_evicted"] == s32["evictions"] * TILE * 4


def make_opt(kind, state_dtype, experts, rng_seed, steps):
    c, full = expert_weight(experts)
    dense = friendly.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) / 7)
    hyper = dict(lr=0.05, momentum=0.9) if kind == "SGD" else dict(lr=1e-2)
    opt = getattr(sw.optim, kind)([full, dense], state_dtype=state_dtype, **hyper)
    rng = np.random.default_rng(rng_seed)
    for route in ROUTES[:steps]:
        backward_grads(c, full, {e: rng.standard_normal((OUT, IN)).astype(np.float32) for e in route})
        dense.grad = friendly.tensor(rng.standard_normal((3, 4)).astype(np.float32))
        opt.step()
    return c, full, dense, opt, rng


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_bf16_state_file_round_trip_resumes_bit_identical(kind, tmp_path):
    """A saves after 3 steps; the file holds BF16 (tiles, tile size) tensors and state_dtype "BFloat16"; B (a fresh
    optimizer over a copy of A's weights) loads it; both take 3 more steps: weights and state equal bit for bit."""
    from safetensors import safe_open

    seed = seed_of("roundtrip" + kind)
    rng = np.random.default_rng(seed)
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    ca, full_a, dense_a, a, rng_a = make_opt(kind, BF16, experts, seed, 3)
    path = tmp_path / "s.safetensors"
    a.save_state(path)
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
        for name in state_names(kind):
            t = f.get_tensor(f"param0.{name}")
            assert t.dtype == ml_dtypes.bfloat16 and t.shape == (E, TILE)
            assert np.array_equal(t.view(np.uint16), experts_of(a.state(full_a)[name]).reshape(E, TILE).view(np.uint16))
            assert f.get_tensor(f"param1.{name}").dtype == ml_dtypes.bfloat16
    assert json.loads(meta["state_dtype"]) == "BFloat16"

    cb, full_b = expert_weight(experts_of(full_a))
    dense_b = friendly.tensor(np.asarray(dense_a).copy())
    hyper = dict(lr=0.05, momentum=0.9) if kind == "SGD" else dict(lr=1e-2)
    b = getattr(sw.optim, kind)([full_b, dense_b], state_dtype=BF16, **hyper)
    b.load_state(path)
    for route in ROUTES[3:]:
        grads = {e: rng_a.standard_normal((OUT, IN)).astype(np.float32) for e in route}
        dg = rng_a.standard_normal((3, 4)).astype(np.float32)
        for c, full, dense, opt in ((ca, full_a, dense_a, a), (cb, full_b, dense_b, b)):
            backward_grads(c, full, grads)
            dense.grad = friendly.tensor(dg.copy())
            opt.step()
        assert np.array_equal(experts_of(full_b).view(np.uint32), experts_of(full_a).view(np.uint32))
        assert np.array_equal(np.asarray(dense_b).view(np.uint32), np.asarray(dense_a).view(np.uint32))
    for pa, pb in ((full_a, full_b), (dense_a, dense_b)):
        sa, sb = a.state(pa), b.state(pb)
        assert sa["step"] == sb["step"]
        for name in state_names(kind):
            assert sb[name].dtype() is BF16
            assert np.array_equal(np.asarray(sa[name]).view(np.uint16), np.asarray(sb[name]).view(np.uint16))


@pytest.mark.parametrize("saved,loading", [(BF16, sw.DType.Float32), (sw.DType.Float32, BF16)],
                         ids=["bf16-into-f32", "f32-into-bf16"])
def test_loading_another_state_dtype_is_refused_and_changes_nothing(saved, loading, tmp_path):
    seed = seed_of("mismatch" + saved.name)
    rng = np.random.default_rng(seed)
    experts = rng.standard_normal((E, OUT, IN)).astype(np.float32)
    _, _, _, a, _ = make_opt("Adam", saved, experts, seed, 3)
    path = tmp_path / "s.safetensors"
    a.save_state(path)
    _, full_b, dense_b, b, _ = make_opt("Adam", loading, experts, seed + 1, 2)
    before = {p: (b.state(p)["step"], {n: np.asarray(b.state(p)[n]).copy() for n in ("exp_avg", "exp_avg_sq")})
              for p in (full_b, dense_b)}
    lr = b.lr
    with pytest.raises(ValueError, match="state_dtype") as info:
        b.load_state(path)
    assert saved.name in str(info.value) and loading.name in str(info.value)
    assert b.lr == lr and b.state_dtype is loading
    for p, (steps, states) in before.items():
        assert b.state(p)["step"] == steps
        for n, v in states.items():
            assert b.state(p)[n].dtype() is loading
            assert np.array_equal(np.asarray(b.state(p)[n]), v)


@pytest.mark.parametrize("value,exc,fragment", [
    (sw.DType.Float16, ValueError, "DType.Float32 or DType.BFloat16"),
    ("bfloat16", TypeError, "state_dtype must be a DType"),
])
def test_bad_state_dtype_is_refused(value, exc, fragment):
    c, full = expert_weight(np.zeros((E, OUT, IN), np.float32))
    for kind in ("SGD", "Adam", "AdamW"):
        with pytest.raises(exc, match=fragment):
            getattr(sw.optim, kind)([full], lr=0.1, state_dtype=value)
    # Nothing was attached to the parameter: a default optimizer over it builds and has Float32 state.
    assert sw.optim.Adam([full]).state_dtype is sw.DType.Float32


def test_torch_bridge_passes_state_dtype(tmp_path):
    """strideweave.torch.AdamW(model, state_dtype=BF16) builds its tiled engines with BFloat16 state; their moments
    after a step are BFloat16; the default stays Float32."""
    import hf_families as zoo
    import strideweave.torch as swt

    seed = seed_of("bridge")
    folder = zoo.saved("mixtral", tmp_path, seed)["float32"]
    model = swt.from_pretrained(folder, 1 << 30).eval()
    ids = torch.randint(0, zoo.VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    for cls, kw in ((swt.AdamW, {}), (swt.SGD, dict(momentum=0.9))):
        opt = cls(model, lr=1e-3, state_dtype=BF16, **kw)
        default = cls(model, lr=1e-3, **kw)
        engines = [g.engine for g in opt._tiled_groups if g.engine is not None]
        assert engines and all(e.state_dtype is BF16 for e in engines)
        assert all(g.engine.state_dtype is sw.DType.Float32 for g in default._tiled_groups if g.engine is not None)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        engine = engines[0]
        st = engine.state(engine.params[0])
        name = "momentum_buffer" if cls is swt.SGD else "exp_avg"
        assert st[name].dtype() is BF16 and max(st["step"]) == 1
