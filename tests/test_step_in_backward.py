"""Stepping in backward (docs/guide.md, "Stepping in backward"; Note [Stepping in backward] in
cpp/include/strideweave/optim.hpp): ``step_in_backward=True`` on ``strideweave.optim`` and ``strideweave.torch``
optimizers steps each expert tile inside backward, the moment its gradient is final, and drops the gradient tile
unwritten.

The claim is bit-identity with stepping after backward: the update of a tile is the same per-tile update on the
same gradient value, so every comparison here is exact (bound 0): weights, optimizer state and per-tile step counts,
for SGD with momentum, Adam and AdamW, Float32 and BFloat16 weights, with and without a residency budget smaller
than the experts, with gradient accumulation (``no_step()``), and with a weight used by two graphs before their
backwards. Through ``strideweave.torch``: a tiny Mixtral (the C++ SparseMoE path) and a tiny GPT-OSS (the per-expert
torch path) with a warm-up schedule, against the same loop stepping after backward.

Then what it refuses (type, message, nothing changed): clipping by the total norm, a forward that would read a tile
stepped in this step before ``step()`` ran, two such optimizers over one parameter.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import strideweave as sw
from strideweave import DType, friendly
from strideweave.carriers.tiled_evictable import ResidencyBudget
from test_moe import E, H, I, as_dtype, build, dense

pytestmark = pytest.mark.usefixtures("grad_mode_on")
BASE_SEED = 20261205
KINDS = {
    "SGD": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "Adam": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05),
    "AdamW": dict(lr=1e-2, betas=(0.85, 0.995), weight_decay=0.1),
}
NAMES = ("w1", "w2", "w3")


def seed_of(name: str) -> int:
    seed = BASE_SEED + zlib.crc32(name.encode())
    print(f"seed {seed}")
    return seed


def problem(seed, dtype, k=2):
    """Experts and a router rounded to `dtype`. Both sides of every comparison route and compute alike, so ties
    in the routing need no care here: no value is compared with a reference that could route otherwise."""
    assert k == 2
    rng = np.random.default_rng(seed)
    w1 = as_dtype(rng.standard_normal((E, I, H)) / np.sqrt(H), dtype)
    w3 = as_dtype(rng.standard_normal((E, I, H)) / np.sqrt(H), dtype)
    w2 = as_dtype(rng.standard_normal((E, H, I)) / np.sqrt(I), dtype)
    router = as_dtype(rng.standard_normal((E, H)) * 2 / np.sqrt(H), dtype)
    return None, router, w1, w2, w3, None


def bits(t) -> bytes:
    return np.ascontiguousarray(np.asarray(t)).tobytes()


class Block:
    """One SparseMoE over fresh tiled copies of the problem's experts, its optimizer, and the batches."""

    def __init__(self, prob, dtype, kind, sib, budget_bytes=None, **options):
        x, router, w1, w2, w3, g = prob
        self.budget = ResidencyBudget(budget_bytes) if budget_bytes else None
        self.moe = build(w1, w2, w3, dtype, top_k=2, budget=self.budget)
        self.params = [self.moe.w1, self.moe.w2, self.moe.w3]
        self.opt = getattr(sw.optim, kind)(self.params, **KINDS[kind], step_in_backward=sib, **options)
        self.dtype, self.router = dtype, router

    def forward(self, x):
        return self.moe(dense(x, self.dtype), dense(self.router, self.dtype))

    def backward(self, out, g):
        out.backward(friendly.tensor(g.astype(np.float32)))

    def state(self) -> dict:
        """Every weight's bits, every state tensor's bits and the per-tile step counts."""
        out = {}
        for n, p in zip(NAMES, self.params):
            out[n] = bits(p)
            for key, v in self.opt.state(p).items():
                out[f"{n}.{key}"] = list(v) if key == "step" else (None if v is None else bits(v))
        return out


def tight_budget(itemsize: int) -> int:
    """One and a half experts' weights, gradients (the weights' dtype) and two Float32 moments: a step must hold
    one expert's, and the 6 experts' weights and gradients alone are 4x more."""
    return 3 * 3 * I * H * (2 * itemsize + 8) // 2


def batches(seed, steps, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((20, H)) * scale
        g = rng.standard_normal((20, H)).astype(np.float32)
        out.append((np.asarray(x, np.float32), g))
    return out


def assert_same(a: Block, b: Block, what: str):
    sa, sb = a.state(), b.state()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == sb[k], f"{what}: {k} differs"  # bound 0: the same update on the same values


# ---------------------------------------------------------------- bit-identity


@pytest.mark.parametrize("budget", [False, True], ids=["in-RAM", "budget"])
@pytest.mark.parametrize("dtype", [DType.Float32, DType.BFloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("kind", list(KINDS))
def test_bit_identical_to_stepping_after_backward(kind, dtype, budget):
    seed = seed_of(f"{kind}{dtype.name}{budget}")
    prob = problem(seed, dtype, 2)
    itemsize = 4 if dtype == DType.Float32 else 2
    budget_bytes = tight_budget(itemsize) if budget else None
    after = Block(prob, dtype, kind, False, budget_bytes)
    inside = Block(prob, dtype, kind, True, budget_bytes)
    assert inside.opt.step_in_backward and not after.opt.step_in_backward
    for step, (x, g) in enumerate(batches(seed + 1, 3, dtype)):
        for blk in (after, inside):
            blk.backward(blk.forward(x), g)
            blk.opt.step()
            blk.opt.zero_grad()
        assert_same(after, inside, f"step {step}")
    st = inside.opt.stats()
    # Every routed tile was stepped in backward, none by step(); the reference stepped as many after backward.
    assert st["tiles_stepped_in_backward"] == st["tiles_stepped"] == after.opt.stats()["tiles_stepped"] > 0
    assert st["tiles_skipped"] == after.opt.stats()["tiles_skipped"]
    if budget:
        assert inside.budget.stats()["peak_bytes"] <= budget_bytes
        # A gradient stepped in backward is never written out (the reference's is under this budget:
        # test_the_reference_writes_gradients_under_the_same_budget), and none stays resident.
        x, g = batches(seed + 2, 1, dtype)[0]
        inside.backward(inside.forward(x), g)
        grads = [p.grad for p in inside.params]
        assert all(gr.carrier.stats()["bytes_evicted"] == 0 for gr in grads)
        assert all(gr.carrier.stats()["primary_tiles"] == 0 for gr in grads)


@pytest.mark.parametrize("state_dtype", [DType.BFloat16, sw.optim.STATE_8BIT], ids=["bf16-state", "8bit-state"])
def test_bit_identical_with_compact_state(state_dtype):
    """BFloat16 and 8-bit moments: the state is decoded, updated and encoded by the same per-tile update either way."""
    seed = seed_of(f"compact{state_dtype}")
    dtype = DType.BFloat16
    prob = problem(seed, dtype, 2)
    after = Block(prob, dtype, "AdamW", False, tight_budget(2), state_dtype=state_dtype)
    inside = Block(prob, dtype, "AdamW", True, tight_budget(2), state_dtype=state_dtype)
    for step, (x, g) in enumerate(batches(seed + 1, 3, dtype)):
        for blk in (after, inside):
            blk.backward(blk.forward(x), g)
            blk.opt.step()
            blk.opt.zero_grad()
        assert_same(after, inside, f"step {step}")
    assert inside.opt.stats()["tiles_stepped_in_backward"] == after.opt.stats()["tiles_stepped"] > 0


def test_the_reference_writes_gradients_under_the_same_budget():
    """The counterpart of the budget case above: stepping after backward under that budget writes gradient tiles
    to their scratch file (what stepping in backward saves)."""
    seed = seed_of("reference-writes")
    dtype = DType.BFloat16
    prob = problem(seed, dtype, 2)
    blk = Block(prob, dtype, "AdamW", False, tight_budget(2))
    x, g = batches(seed + 1, 1, dtype)[0]
    blk.backward(blk.forward(x), g)
    assert sum(p.grad.carrier.stats()["bytes_evicted"] for p in blk.params) > 0


def test_accumulation_under_no_step():
    """Two micro-batches: the first under no_step() only accumulates; the second's backward steps the experts it
    reaches, step() the ones only the first reached. Bit-identical to accumulating both and stepping after."""
    seed = seed_of("accumulation")
    dtype = DType.Float32
    prob = problem(seed, dtype, 2)
    (x1, g1), (x2, g2) = batches(seed + 1, 2, dtype)
    x2, g2 = x2[:1], g2[:1]  # one token: two experts, so step() has tiles left to step
    after = Block(prob, dtype, "AdamW", False)
    inside = Block(prob, dtype, "AdamW", True)
    after.backward(after.forward(x1), g1)
    after.backward(after.forward(x2), g2)
    after.opt.step()
    with inside.opt.no_step():
        inside.backward(inside.forward(x1), g1)
    assert inside.opt.stats()["tiles_stepped"] == 0
    inside.backward(inside.forward(x2), g2)
    assert inside.opt.stats()["tiles_stepped_in_backward"] == 3 * 2  # two experts' three tiles
    inside.opt.step()
    st = inside.opt.stats()
    assert st["tiles_stepped"] == after.opt.stats()["tiles_stepped"] > st["tiles_stepped_in_backward"]
    assert_same(after, inside, "two micro-batches")


def test_a_weight_used_by_two_graphs_steps_after_its_last_backward():
    """Two forwards before their backwards: a tile either graph routes is stepped only once both have delivered
    its gradient (its reservation count falls to zero); bit-identical to stepping after both."""
    seed = seed_of("two-graphs")
    dtype = DType.Float32
    prob = problem(seed, dtype, 2)
    (x1, g1), (x2, g2) = batches(seed + 1, 2, dtype)
    after = Block(prob, dtype, "Adam", False)
    inside = Block(prob, dtype, "Adam", True)
    for blk in (after, inside):
        o1, o2 = blk.forward(x1), blk.forward(x2)
        blk.backward(o2, g2)
        if blk is inside:
            # Tiles routed by both graphs still wait for the first graph's backward.
            first = blk.opt.stats()["tiles_stepped_in_backward"]
        blk.backward(o1, g1)
        blk.opt.step()
    st = inside.opt.stats()
    assert st["tiles_stepped_in_backward"] == st["tiles_stepped"] == after.opt.stats()["tiles_stepped"]
    assert first < st["tiles_stepped_in_backward"]
    assert_same(after, inside, "two graphs")


# ---------------------------------------------------------------- refusals


def test_a_forward_before_step_is_refused_and_changes_nothing():
    seed = seed_of("forward-before-step")
    dtype = DType.Float32
    blk = Block(problem(seed, dtype, 2), dtype, "AdamW", True)
    (x1, g1), (x2, _) = batches(seed + 1, 2, dtype)
    blk.backward(blk.forward(x1), g1)
    before, calls = blk.state(), blk.moe.stats()["calls"]
    with pytest.raises(RuntimeError, match="stepped in backward and step\\(\\) has not run"):
        blk.forward(x2)
    assert blk.state() == before and blk.moe.stats()["calls"] == calls
    blk.opt.step()  # closes the step: the next forward is accepted
    blk.forward(x2)


def test_clipping_by_the_total_norm_is_refused_and_changes_nothing():
    seed = seed_of("clip")
    dtype = DType.Float32
    blk = Block(problem(seed, dtype, 2), dtype, "SGD", True)
    x, g = batches(seed + 1, 1, dtype)[0]
    with blk.opt.no_step():  # gradients kept, so there is something to scale
        blk.backward(blk.forward(x), g)
    grads = [bits(p.grad) for p in blk.params]
    for fn, args in ((sw.optim.grad_norm, (2.0,)), (sw.optim.scale_grads, (0.5,))):
        with pytest.raises(ValueError, match="step_in_backward.*clipping by the total norm"):
            fn(blk.params, *args)
    assert [bits(p.grad) for p in blk.params] == grads


def test_one_such_optimizer_per_parameter():
    seed = seed_of("two-optimizers")
    dtype = DType.Float32
    blk = Block(problem(seed, dtype, 2), dtype, "AdamW", True)
    with pytest.raises(ValueError, match="another consumer already takes its gradients"):
        sw.optim.SGD([blk.moe.w2], lr=0.1, step_in_backward=True)
    # The first one still steps in backward.
    x, g = batches(seed + 1, 1, dtype)[0]
    blk.backward(blk.forward(x), g)
    assert blk.opt.stats()["tiles_stepped_in_backward"] > 0
    blk.opt.step()
    # Once it is gone its hooks are too: backward accumulates, and another optimizer may take the parameters.
    params = blk.params
    del blk.opt
    blk.backward(blk.forward(x), g)
    assert all(p.grad.carrier.stats()["primary_tiles"] > 0 for p in params)
    sw.optim.SGD(params, lr=0.1, step_in_backward=True)


# ---------------------------------------------------------------- through strideweave.torch

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import hf_families as zoo
    root = tmp_path_factory.mktemp("sib")
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = zoo.saved(family, root, seed_of(family))["float32"]
        return cache[family]

    return get


def run_torch(folder, budget, sib, accumulate):
    """Three steps of AdamW under a warm-up schedule (the lr changes every step), 1 or 2 micro-batches each."""
    import strideweave.torch as swt
    from test_torch_optim import ids_for, named_weights
    model = swt.from_pretrained(folder, budget).train()
    opt = swt.AdamW(model, lr=3e-3, weight_decay=0.05, step_in_backward=sib)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 3)
    for step in range(3):
        micro = [ids_for(seed_of(folder) + 10 * step + m) for m in range(2 if accumulate else 1)]
        for m, ids in enumerate(micro):
            last = m == len(micro) - 1
            ctx = opt.no_step() if (sib and not last) else _null()
            with ctx:
                model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return named_weights(model, swt.offloaded_experts(model)), opt


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("accumulate", [False, True], ids=["one-batch", "accumulate"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_torch_bridge_bit_identical(saved, family, accumulate):
    folder = saved(family)
    # A budget of a quarter of the experts' Float32 bytes: tiles are evicted and promoted during the steps.
    import hf_families as zoo
    from test_torch_optim import expert_bytes, load_reference
    budget = expert_bytes(load_reference(folder), family) // 4
    want, _ = run_torch(folder, budget, False, accumulate)
    got, opt = run_torch(folder, budget, True, accumulate)
    assert zoo.ZOO[family].name == family
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k  # bound 0
    engines = [tg.engine for tg in opt._tiled_groups if tg.engine is not None]
    assert sum(e.stats()["tiles_stepped_in_backward"] for e in engines) > 0


def test_torch_clip_grad_norm_refused(saved):
    import strideweave.torch as swt
    model = swt.from_pretrained(saved("mixtral"), 1 << 30).train()
    opt = swt.AdamW(model, lr=1e-3, step_in_backward=True)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(seed_of("clip-torch")))
    with opt.no_step():
        model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(ValueError, match="step_in_backward=True.*clipping by the total norm"):
        swt.clip_grad_norm_(model, 1e-3)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters() if p.grad is not None)
