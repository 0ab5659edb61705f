"""8-bit block-wise optimizer state: ``state_dtype="8bit"`` (``sw.optim.STATE_8BIT``) on strideweave.optim.SGD / Adam /
AdamW and the strideweave.torch optimizers (Note [Compact optimizer state] in cpp/include/strideweave/optim.hpp).

The reference is written here in NumPy from the definition of Dettmers et al. 2021 ("8-bit Optimizers via Block-wise
Quantization") and bitsandbytes' ``create_dynamic_map`` (bitsandbytes is not needed): the dynamic map, block-wise
quantization (blocks of 256 values in within-tile order, one absmax per block, each value the nearest map entry of
value / absmax, a tie to the larger entry) and dequantization (map[code] * absmax in Float32). Checks, by strength:
  * the engine's map equals the definition evaluated in Float64 and rounded once to Float32, bit for bit;
  * the first step from zero state: its new state values are single Float32 roundings NumPy reproduces exactly, so
    the stored codes and absmax (read from a state file) equal the reference's bit for bit (bound 0);
  * several steps against torch.optim's single-tensor code (as tests/test_optim.py runs it) whose state is quantized
    and dequantized by the NumPy reference after every step: weights and decoded state bit for bit (bound 0: the
    engine runs the same Float32 operations on the same decoded values, and the quantizer is exact);
  * one step on Float64-widened values from the engine's own state: codes equal except within a derived distance of
    a map midpoint, absmax and weights within derived bounds (see that test).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection

torch = pytest.importorskip("torch")

from test_optim import correctly_rounded_sqrt  # noqa: E402

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20270334
U = 2.0 ** -24  # Float32 unit roundoff
E = 4
# (OUT, IN) tile shapes: 23 x 29 = 667 values (two full blocks and one of 155), 8 x 5 = 40 (one partial block).
SHAPES = [(23, 29), (8, 5)]
ROUTES = [[0, 2, 3], [2, 1], [0, 1, 2, 3], [3], [1, 2]]


def seed_of(name):
    seed = BASE_SEED + sum(map(ord, name))
    print(f"seed {seed}")
    return seed


# ---------------------------------------------------------------- the reference (NumPy, from the definition)

def create_dynamic_map(signed):
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), each entry the exact value of its
    definition (evaluated in Float64, rounded once to Float32): for decade i = 0..6 the midpoints of k equal parts of
    [0.1, 1] (k = 2**i signed, 2**(i+1) unsigned) times 10**(i-6), negated too when signed; then 0 and 1."""
    scales = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1e0]
    data = []
    for i in range(7):
        k = 2 ** i if signed else 2 ** (i + 1)
        j = np.arange(k, dtype=np.float64)
        means = 0.1 + 0.9 * (2 * j + 1) / (2 * k)
        values = (scales[i] * means).astype(np.float32).astype(np.float64)
        data += list(values)
        if signed:
            data += list(-values)
    data += [0.0, 1.0]
    return np.sort(np.array(data)).astype(np.float32)


MAPS = {True: create_dynamic_map(True), False: create_dynamic_map(False)}
# The midpoints between neighbouring entries, exact in Float64 (each the mean of two Float32 values).
MIDS = {s: (m[:-1].astype(np.float64) + m[1:].astype(np.float64)) / 2 for s, m in MAPS.items()}


def bnb_dynamic_map_in_torch(signed):
    """bitsandbytes' create_dynamic_map as published (its Float32 torch arithmetic), for comparison only."""
    data = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32).numpy()


def blocks_of(n):
    return -(-n // 256)


def quantize(x, signed):
    """Values x (Float32, a tile in within-tile order) -> (codes uint8, absmax Float32 per block of 256)."""
    x = np.asarray(x, np.float32).reshape(-1)
    codes = np.empty(x.size, np.uint8)
    absmax = np.empty(blocks_of(x.size), np.float32)
    zero = int(np.flatnonzero(MAPS[signed] == 0)[0])
    for b in range(absmax.size):
        v = x[256 * b:256 * (b + 1)]
        a = np.max(np.abs(v))
        absmax[b] = a
        if a == 0:
            codes[256 * b:256 * (b + 1)] = zero
            continue
        q = (v / a).astype(np.float32)  # one Float32 division
        # The nearest entry: the number of midpoints <= q (a tie at a midpoint goes to the larger entry).
        codes[256 * b:256 * (b + 1)] = np.searchsorted(MIDS[signed], q.astype(np.float64), side="right")
    return codes, absmax


def dequantize(codes, absmax, signed):
    """map[code] * absmax (one Float32 product); a block of absmax 0 reads as +0."""
    out = np.empty(codes.size, np.float32)
    for b in range(absmax.size):
        c = codes[256 * b:256 * (b + 1)]
        out[256 * b:256 * (b + 1)] = 0 if absmax[b] == 0 else MAPS[signed][c] * absmax[b]
    return out


def roundtrip(x, signed):
    return dequantize(*quantize(x, signed), signed)


def packed_slots(n):
    return blocks_of(n) + -(-n // 4)


def read_packed(path, name, n):
    """(codes, absmax) of every tile of state tensor `name` in a state file: F32 rows of raw packed bytes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        t = f.get_tensor(name)
    assert t.dtype == np.float32 and t.shape[1] == packed_slots(n)
    raw = np.ascontiguousarray(t).view(np.uint8)
    nb = blocks_of(n)
    return [(row[4 * nb:4 * nb + n].copy(), row[:4 * nb].view(np.float32).copy()) for row in raw], raw


# ---------------------------------------------------------------- the engine's side

def expert_weight(experts, budget=None):
    """A TiledEvictable over a scratch-file tier of `experts` (E, OUT, IN), one row-major (OUT, IN) tile each, and
    its full tensor (within-tile order: row-major, as tests/test_optim_state_dtype.py's file check shows)."""
    e, out, inn = experts.shape
    tier = sw.move(friendly.tensor(np.ascontiguousarray(experts).reshape(-1)), sw.FileBacked(dtype=sw.DType.Float32))
    c = TiledEvictable(sw.CPU(0, dtype=sw.DType.Float32), tier.carrier, (1, e), (out, inn), residency_budget=budget)
    return c, sw.Tensor(c, 0, sw.Layout(sw.Shape(out, [inn, e]), sw.Stride(inn, [1, out * inn])))


def experts_of(full, shape):
    e, out, inn = shape
    a = np.asarray(full)
    return np.stack([a[:, inn * k:inn * (k + 1)] for k in range(e)])


def backward_grads(c, full, grads):
    full.grad = None
    for e, g in grads.items():
        w = c.project(full, TileSelection([[0], [e]])).wait()
        sw.reduce_sum(sw.elementwise_mul(w, friendly.tensor(g)), "o i ->").backward()


def state_names(kind):
    return ["momentum_buffer"] if kind == "SGD" else ["exp_avg", "exp_avg_sq"]


def signed_of(name):
    return name != "exp_avg_sq"


# ---------------------------------------------------------------- the map

def test_dynamic_map_matches_its_definition():
    """The NumPy map has bitsandbytes' shape (256 entries, strictly increasing, 0 and 1 among them; signed: 127
    negative entries down to -0.99296875 and 128 positive; unsigned: none negative); the engine's maps equal it bit
    for bit; bitsandbytes' own Float32 evaluation (torch.linspace) is within 2 Float32 ulps of every entry."""
    for signed, m in MAPS.items():
        assert m.size == 256 and np.all(np.diff(m) > 0)
        assert 0.0 in m and 1.0 in m and m[-1] == 1.0
        if signed:
            assert (m < 0).sum() == 127 and (m > 0).sum() == 128 and m[0] == np.float32(-0.99296875)
        else:
            assert m[0] == 0 and (m > 0).sum() == 255
        engine = np.array(sw._core._optim_quantization_map(signed), np.float32)
        assert np.array_equal(engine.view(np.uint32), m.view(np.uint32)), np.flatnonzero(engine != m)
        bnb = bnb_dynamic_map_in_torch(signed)
        ulps = np.abs(bnb.view(np.int32).astype(np.int64) - m.view(np.int32).astype(np.int64))
        assert ulps.max() <= 2, ulps.max()


# ---------------------------------------------------------------- the first step: codes and absmax bit for bit

FIRST_CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("Adam", dict(lr=1e-2, betas=(0.9, 0.99))),
    ("AdamW", dict(lr=3e-2, betas=(0.8, 0.995), weight_decay=0.1)),
]


def first_state(kind, hyper, g):
    """The Float32 state after a tile's first step from zero, single roundings NumPy reproduces: SGD's buffer is the
    gradient; Adam's exp_avg = (1 - beta1) * g (torch's lerp from 0: one fused multiply-add onto +0, i.e. one
    rounding of the product), exp_avg_sq = ((1 - beta2) * g) * g (rounded, then fused onto 0 * beta2 = +0: one rounding
    of the product). The coefficients are Float32 as the engine rounds them."""
    if kind == "SGD":
        return {"momentum_buffer": g}
    b1, b2 = hyper["betas"]
    return {"exp_avg": np.float32(1 - b1) * g, "exp_avg_sq": (np.float32(1 - b2) * g) * g}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind,hyper", FIRST_CASES, ids=[k for k, _ in FIRST_CASES])
def test_first_step_codes_and_absmax_bit_exact(kind, hyper, shape, tmp_path):
    """After one step from zero state, every routed tile's stored codes and absmax (from save_state's raw packed rows)
    equal the NumPy quantizer's on the exactly reproduced Float32 state (bound 0), the state reads back (opt.state:
    decoded Float32 copies) as the reference's dequantization, and unrouted tiles are zeros (absmax 0)."""
    out, inn = shape
    n = out * inn
    rng = np.random.default_rng(seed_of("first" + kind + repr(shape)))
    experts = rng.standard_normal((E, out, inn)).astype(np.float32)
    c, full = expert_weight(experts)
    opt = getattr(sw.optim, kind)([full], state_dtype="8bit", **hyper)
    assert opt.state_dtype == "8bit" and sw.optim.STATE_8BIT == "8bit"
    # Magnitudes over six decades, so that many map decades are used; a few exact zeros.
    grads = {e: (rng.standard_normal((out, inn)) * 10.0 ** rng.integers(-6, 1, (out, inn))).astype(np.float32)
             for e in (0, 2, 3)}
    grads[2].reshape(-1)[::17] = 0
    backward_grads(c, full, grads)
    opt.step()
    opt.save_state(tmp_path / "s.safetensors")
    st = opt.state(full)
    for name in state_names(kind):
        tiles, _ = read_packed(tmp_path / "s.safetensors", f"param0.{name}", n)
        decoded = experts_of(st[name], (E, out, inn))
        assert st[name].dtype() is sw.DType.Float32
        for e in range(E):
            codes, absmax = tiles[e]
            if e not in grads:
                assert not absmax.any() and not decoded[e].any()
                continue
            want = first_state(kind, hyper, grads[e].reshape(-1))[name]
            want_codes, want_absmax = quantize(want, signed_of(name))
            assert np.array_equal(absmax.view(np.uint32), want_absmax.view(np.uint32)), (name, e)
            assert np.array_equal(codes, want_codes), (name, e, np.flatnonzero(codes != want_codes)[:10])
            assert np.array_equal(decoded[e].reshape(-1).view(np.uint32),
                                  dequantize(want_codes, want_absmax, signed_of(name)).view(np.uint32))


# ---------------------------------------------------------------- several steps against torch.optim, bit for bit

CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
    ("Adam", dict(lr=1e-2, betas=(0.3, 0.5))),  # beta1 < 0.5: torch's lerp takes its other branch
    ("AdamW", dict(lr=3e-2, betas=(0.85, 0.995), weight_decay=0.1)),
]


def quantize_torch_state(ref, kind, param_order):
    """The stored state of the parameters stepped now (with a gradient) replaced by its 8-bit round trip (quantize,
    dequantize), tile by tile. Only those: as the engine, which encodes the tiles it steps. (The round trip is not
    idempotent: a block whose largest magnitude is negative has absmax 0.99296875 times the old one afterwards.)"""
    for p in param_order:
        st = ref.state.get(p)
        if not st or p.grad is None:
            continue
        for name in state_names(kind):
            if st.get(name) is not None:
                v = st[name].numpy().reshape(-1)
                st[name].copy_(torch.from_numpy(roundtrip(v, signed_of(name)).reshape(st[name].shape)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind,hyper", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_steps_bit_exact_against_torch_with_quantized_state(kind, hyper, shape):
    """Five steps over routed experts: the weights and the decoded state equal torch.optim's (single-tensor, correctly
    rounded sqrt) whose state goes through the NumPy 8-bit round trip after every step, bit for bit (bound 0:
    module docstring). A dense parameter steps beside the tiled one, likewise."""
    out, inn = shape
    rng = np.random.default_rng(seed_of("steps" + kind + repr(hyper) + repr(shape)))
    experts = rng.standard_normal((E, out, inn)).astype(np.float32)
    router = rng.standard_normal((E, 7)).astype(np.float32)
    c, full = expert_weight(experts)
    dense = friendly.tensor(router.copy())
    opt = getattr(sw.optim, kind)([full, dense], state_dtype="8bit", **hyper)
    params = [torch.nn.Parameter(torch.from_numpy(experts[e].copy())) for e in range(E)]
    pd = torch.nn.Parameter(torch.from_numpy(router.copy()))
    ref = getattr(torch.optim, kind)(params + [pd], foreach=False, **hyper)
    for route in ROUTES:
        grads = {e: rng.standard_normal((out, inn)).astype(np.float32) for e in route}
        dg = rng.standard_normal((E, 7)).astype(np.float32)
        backward_grads(c, full, grads)
        dense.grad = friendly.tensor(dg.copy())
        for e, p in enumerate(params):
            p.grad = torch.from_numpy(grads[e].copy()) if e in route else None
        pd.grad = torch.from_numpy(dg)
        opt.step()
        with correctly_rounded_sqrt():
            ref.step()
        quantize_torch_state(ref, kind, params + [pd])
        want = np.stack([p.detach().numpy() for p in params])
        got = experts_of(full, (E, out, inn))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"max |diff| {np.max(np.abs(got - want))}"
        assert np.array_equal(np.asarray(dense).view(np.uint32), pd.detach().numpy().view(np.uint32))
    st, sd = opt.state(full), opt.state(dense)
    for name in state_names(kind):
        got = experts_of(st[name], (E, out, inn))
        for e, p in enumerate(params):
            want = ref.state[p][name].numpy() if p in ref.state else np.zeros((out, inn), np.float32)
            assert np.array_equal(got[e].view(np.uint32), want.view(np.uint32)), (name, e)
        assert np.array_equal(np.asarray(sd[name]).view(np.uint32), ref.state[pd][name].numpy().view(np.uint32))


def test_8bit_state_differs_from_float32_state():
    """The option changes the stored values (the checks above could not pass with Float32 state kept): after three
    Adam steps the decoded exp_avg differs from Float32 state's, and every block of 256 values of it holds at most
    256 distinct values (Float32 state's blocks hold 256)."""
    rng = np.random.default_rng(seed_of("differs"))
    experts = rng.standard_normal((E, 23, 29)).astype(np.float32)
    outs = []
    for sd in (sw.DType.Float32, "8bit"):
        c, full = expert_weight(experts)
        opt = sw.optim.Adam([full], lr=1e-2, state_dtype=sd)
        r = np.random.default_rng(1)
        for route in ROUTES[:3]:
            backward_grads(c, full, {e: r.standard_normal((23, 29)).astype(np.float32) for e in route})
            opt.step()
        outs.append((experts_of(full, (E, 23, 29)), experts_of(opt.state(full)["exp_avg"], (E, 23, 29))))
    assert not np.array_equal(outs[0][0], outs[1][0])
    assert not np.array_equal(outs[0][1], outs[1][1])
    for e in range(E):
        v, v32 = outs[1][1][e].reshape(-1), outs[0][1][e].reshape(-1)
        assert np.unique(v32[:512]).size == 512
        assert np.unique(v[:256]).size < 256 and np.unique(v[256:512]).size < 256
