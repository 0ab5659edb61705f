"""``strideweave.torch.SGD`` / ``Adam`` / ``AdamW`` (one torch optimizer over a model whose experts are offloaded)
and ``strideweave.torch.clip_grad_norm_`` (docs/guide.md, "Fine-tuning with your own loop").

* ``test_plain_loop_parity``: three steps of an ordinary loop (transformers' linear schedule with warm-up, 2
  micro-batches of accumulation, clip_grad_norm_, Trainer-style groups without weight decay for biases and norms)
  on a tiny Mixtral and DeepSeek-V3 opened by ``from_pretrained`` under a budget below experts + gradients +
  moments, against the same loop with torch's optimizer, scheduler and clip_grad_norm_ on the untouched in-RAM
  model; every torch parameter and every expert weight (``binding.gather``) within a bound derived step by step
  (the derivation is at ``propagate_adamw`` / ``propagate_sgd``).
* ``test_accumulation_*``: several backwards add into the tiled gradients as torch's AccumulateGrad adds, and 2
  micro-batches give the update one large batch gives.
* state: ``save_state`` / ``load_state`` and ``state_dict`` with ``state_folder``: a resumed run continues bit for
  bit as the uninterrupted one.
* error paths: type, message, and nothing changed.

Seeds: the model of family F is drawn from ``BASE_SEED + crc32(F)``; batches from that seed + 100 + step * 10 +
micro-batch; each test prints its seeds.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import transformers

import hf_families as zoo
import strideweave as sw
import strideweave.torch as swt

BASE_SEED = 3300
FAMILIES = ["mixtral", "deepseek_v3"]
MICRO = (2, 16)  # one micro-batch: batch, sequence (32 tokens, 64 (token, expert) pairs over 8 experts)
ACCUM = 2
STEPS = 3
U = 2.0 ** -24  # Float32 unit roundoff


def seed_of(family: str) -> int:
    return BASE_SEED + zlib.crc32(family.encode())


def ids_for(seed: int, shape=MICRO) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, zoo.VOCAB, shape, generator=g)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_optim")
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = zoo.saved(family, root, seed_of(family))["float32"]
        return cache[family]

    return get


def load_reference(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def expert_bytes(reference, family: str) -> int:
    """Bytes of every experts module's weights (Float32) in the reference."""
    f = zoo.ZOO[family]
    return sum(p.numel() * 4 for m in zoo.experts_modules(reference, f).values() for n, p in m.named_parameters()
               if not n.endswith("_bias"))


def open_offloaded(folder: str, reference, family: str):
    """from_pretrained under a budget of a quarter of the expert weights: weights + gradients + two moments are
    16x the budget, so tiles and moments are evicted during the steps."""
    budget = expert_bytes(reference, family) // 4
    model = swt.from_pretrained(folder, budget).eval()
    return model, swt.offloaded_experts(model), budget


def no_decay(name: str) -> bool:
    """Trainer's grouping: biases and norms get no weight decay."""
    return name.endswith("bias") or "norm" in name.lower()


def groups(named, extra_decay, wd):
    decay = [p for n, p in named if not no_decay(n)] + list(extra_decay)
    rest = [p for n, p in named if no_decay(n)]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def named_weights(model, bindings) -> dict:
    """name -> Float64 copy of every parameter as transformers names it (experts through gather)."""
    out = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    for path, b in bindings.items():
        for pn in b.parameter_names:
            out[f"{path}.{pn}"] = b.gather(pn).double()
    return out


def named_grads(model, bindings) -> dict:
    out = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    for path, b in bindings.items():
        for pn in b.parameter_names:
            out[f"{path}.{pn}"] = b.gather(pn, grad=True).double()
    return out


class Routing:
    """Captures the top-k expert indices each experts module is given (a forward pre-hook)."""

    def __init__(self, model, paths):
        self.seen = {p: [] for p in paths}
        modules = dict(model.named_modules())
        self.handles = [modules[p].register_forward_pre_hook(self._hook(p), with_kwargs=True) for p in paths]

    def _hook(self, path):
        def hook(mod, args, kwargs):
            values = list(args) + list(kwargs.values())
            self.seen[path].append(values[1].detach().clone())
        return hook

    def take(self) -> dict:
        out = {p: list(v) for p, v in self.seen.items()}
        for v in self.seen.values():
            v.clear()
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------------------- bound propagation
#
# Both runs are torch's update rule applied to gradients that differ: the offloaded run's gradient after clipping,
# g' = g + e, against the reference's g, with |e| <= delta elementwise (delta MEASURED at each step, after
# clipping; that the gradients themselves agree is asserted separately against the Float32 parity bound). In exact
# arithmetic the update rule is then perturbed as follows (elementwise, all bounds in Float64, from the reference's
# own state after the step), and each run also rounds: the engine is torch's arithmetic operation by operation
# (tests/test_optim.py: bit-identical for the same inputs, except torch's MKL sqrt, within 1 ulp), so for equal
# inputs the two differ by test_optim's per-step bound 2 (4 * 2^-23 |w_t - w_{t-1}| + 2 * 2^-24 |w_t|); for
# different inputs each rounded intermediate (moment, buffer) differs from its exact value by one rounding on
# each side, 2u of its magnitude per step, carried with the recursion it enters.


def propagate_adamw(bound: dict, name: str, delta, state: dict, lr: float, betas, eps: float, w_new, w_old):
    """AdamW (torch.optim.AdamW, per element, step t): m_t = b1 m + (1 - b1) g, v_t = b2 v + (1 - b2) g^2,
    w_t = w (1 - lr wd) - lr (m_t / c1) / (sqrt(v_t / c2) + eps), c1 = 1 - b1^t, c2 = 1 - b2^t.
      |m'_t - m_t| <= Dm_t = b1 Dm + (1 - b1) delta + 2u |m_t|.
      sqrt(v_t) is the 2-norm of (sqrt((1 - b2) b2^(t-k)) g_k)_k, so (reverse triangle inequality)
      |sqrt(v'_t) - sqrt(v_t)| <= Ds_t = sqrt(V_t) + R_t, V_t = b2 V + (1 - b2) delta^2 (the same norm of the
      perturbations), R_t = R + 2u sqrt(v_t) (each side's rounding of v, relative u, is u/2 on the root, kept
      as a running sum).
      With s = sqrt(v_t / c2) + eps and s' >= max(sqrt(v_t / c2) - Ds_t / sqrt(c2), 0) + eps:
      |m'/s' - m/s| <= |m' - m| / s' + |m| |s' - s| / (s s'), so the update differs by at most
      lr (Dm_t / c1 / s' + |m_t| / c1 (Ds_t / sqrt(c2)) / (s s')).
      The decay factor 1 - lr wd lies in [0, 1], so Dw_t = Dw + that + the rounding term."""
    b1, b2 = betas
    m = state["exp_avg"].double()
    v = state["exp_avg_sq"].double()
    t = float(state["step"])
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    b = bound.setdefault(name, {"Dw": torch.zeros_like(m), "Dm": torch.zeros_like(m), "V": torch.zeros_like(m),
                                "R": torch.zeros_like(m)})
    b["Dm"] = b1 * b["Dm"] + (1 - b1) * delta + 2 * U * m.abs()
    b["V"] = b2 * b["V"] + (1 - b2) * delta ** 2
    b["R"] = b["R"] + 2 * U * v.sqrt()
    ds = b["V"].sqrt() + b["R"]
    s = (v / c2).sqrt() + eps
    s_low = ((v / c2).sqrt() - ds / c2 ** 0.5).clamp(min=0) + eps
    du = b["Dm"] / c1 / s_low + m.abs() / c1 * (ds / c2 ** 0.5) / (s * s_low)
    rounding = 2 * (4 * 2.0 ** -23 * (w_new - w_old).abs() + 2 * U * w_new.abs())
    b["Dw"] = b["Dw"] + lr * du + rounding


def propagate_sgd(bound: dict, name: str, delta, state: dict, lr: float, momentum: float, wd: float, w_new,
                  w_old):
    """SGD (torch.optim.SGD, dampening 0, no nesterov): d = g + wd w, buf_t = momentum buf + d (buf_1 = d),
    w_t = w - lr buf_t.
      |d' - d| <= delta + wd Dw + 2u |d|  (one rounding each side; |d| <= |buf_t| + momentum |buf_{t-1}|, bounded
      here by the generous 2u (|buf_t| + |buf_{t-1}|) below);
      |buf'_t - buf_t| <= Db_t = momentum Db + that + 2 * 2u |buf_t| (the scale and the add round);
      Dw_t = Dw + lr Db_t + 2u |w_t| (the subtraction rounds on each side); SGD's arithmetic is bit-identical to
      torch's for equal inputs (tests/test_optim.py), so no other term."""
    buf = state["momentum_buffer"].double()
    b = bound.setdefault(name, {"Dw": torch.zeros_like(buf), "Db": torch.zeros_like(buf),
                                "prev": torch.zeros_like(buf)})
    dd = delta + wd * b["Dw"] + 2 * U * (buf.abs() + b["prev"].abs())
    b["Db"] = momentum * b["Db"] + dd + 4 * U * buf.abs()
    b["Dw"] = b["Dw"] + lr * b["Db"] + 2 * U * w_new.abs()
    b["prev"] = buf


# --------------------------------------------------------------------------------------------- the plain loop


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("algorithm", ["AdamW", "SGD"])
def test_plain_loop_parity(family, algorithm, folders):
    """Three steps: zero_grad; 2 micro-batches, each (loss / 2).backward(); clip_grad_norm_ (max_norm below the
    total, so it scales); step; the scheduler's step. transformers' get_linear_schedule_with_warmup (2 warm-up
    steps of 4: lr x 0, 0.5, 1), weight decay 0.01 except biases and norms. Reference: torch's optimizer, scheduler
    and clip_grad_norm_ on the in-RAM model.

    Checked each step: the routing is the same in both models (no near tie) and reaches every expert (so torch's
    fused (E, ...) parameter and the per-expert tiles move alike: the tiled optimizer skips an expert without a
    gradient, torch does not); the gradients before clipping agree within the Float32 parity bound
    (tests/test_hf_families.py: 1e-5 of the largest magnitude per micro-batch, 2x after the first step as in
    test_sgd_steps); the returned total norms within ||g' - g||_2 (triangle inequality) plus each side's
    summation error, (N + 2) u of the norm for N gradient elements; the schedule's lr reached the engines.
    After the steps every weight is within the propagated bound (propagate_adamw / propagate_sgd)."""
    seed = seed_of(family)
    print(f"family={family} algorithm={algorithm} model seed={seed} batch seeds={seed + 100}+10*step+micro")
    folder = folders(family)
    reference = load_reference(folder)
    model, bindings, budget = open_offloaded(folder, reference, family)
    E = zoo.E
    wd, max_norm = 0.01, 0.5
    if algorithm == "AdamW":
        lr, kw = 1e-2, dict(betas=(0.9, 0.999), eps=1e-8)
        ref_opt = torch.optim.AdamW(groups(list(reference.named_parameters()), [], wd), lr=lr, **kw)
        opt = swt.AdamW(groups(list(model.named_parameters()), bindings.values(), wd), lr=lr, **kw)
    else:
        lr, kw = 0.1, dict(momentum=0.9)
        ref_opt = torch.optim.SGD(groups(list(reference.named_parameters()), [], wd), lr=lr, **kw)
        opt = swt.SGD(groups(list(model.named_parameters()), bindings.values(), wd), lr=lr, **kw)
    assert isinstance(opt, torch.optim.Optimizer)
    ref_sched = transformers.get_linear_schedule_with_warmup(ref_opt, num_warmup_steps=2, num_training_steps=4)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=4)
    engines = [g.engine for g in opt._tiled_groups if g.engine is not None]
    assert len(engines) == 1 and opt.tiled_param_groups[1] == []

    ref_params = dict(reference.named_parameters())
    name_group = {}
    for gi, g in enumerate(ref_opt.param_groups):
        for p in g["params"]:
            name_group[next(n for n, q in ref_params.items() if q is p)] = gi
    expert_names = [f"{path}.{pn}" for path, b in bindings.items() for pn in b.parameter_names]
    for n in expert_names:
        assert name_group[n] == 0, "the experts are in the weight-decay group on both sides"
    ref_routing, routing = Routing(reference, list(bindings)), Routing(model, list(bindings))
    start = named_weights(model, bindings)
    bound: dict = {}
    lrs = []
    try:
        for s in range(STEPS):
            batches = [ids_for(seed + 100 + 10 * s + k) for k in range(ACCUM)]
            ref_opt.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            micro_max = {}
            for ids in batches:
                before = {n: (p.grad.detach().clone() if p.grad is not None else None)
                          for n, p in reference.named_parameters()}
                (reference(input_ids=ids, labels=ids).loss / ACCUM).backward()
                for n, p in reference.named_parameters():
                    part = p.grad if before[n] is None else p.grad - before[n]
                    micro_max[n] = micro_max.get(n, 0.0) + float(part.abs().max())
                (model(input_ids=ids, labels=ids).loss / ACCUM).backward()
            r_ref, r_off = ref_routing.take(), routing.take()
            for path in bindings:
                for k in range(ACCUM):
                    assert torch.equal(r_ref[path][k], r_off[path][k]), f"step {s}: {path} routed differently"
                reached = torch.unique(torch.cat([i.reshape(-1) for i in r_ref[path]]))
                assert reached.numel() == E, f"step {s}: {path} reached only experts {reached.tolist()}"

            g_ref = named_grads(reference, {})
            g_off = named_grads(model, bindings)
            assert set(g_ref) == set(g_off)
            factor = 1.0 if s == 0 else 2.0
            for n, g in g_ref.items():
                err = float((g_off[n] - g).abs().max())
                assert err <= factor * 1e-5 * micro_max[n], f"step {s} {n}: gradient error {err:.3e}"
            diff_norm = sum(float(((g_off[n] - g) ** 2).sum()) for n, g in g_ref.items()) ** 0.5
            count = sum(g.numel() for g in g_ref.values())

            n_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            n_off = swt.clip_grad_norm_(model, max_norm)
            assert isinstance(n_off, torch.Tensor) and n_off.dtype == torch.float32 and n_off.dim() == 0
            assert float(n_ref) > 2 * max_norm, f"step {s}: total norm {float(n_ref)} does not clip"
            tol = diff_norm + 2 * (count + 2) * U * float(n_ref)
            assert abs(float(n_off) - float(n_ref)) <= tol, f"step {s}: norms {float(n_off)} vs {float(n_ref)}"

            clipped_ref = named_grads(reference, {})
            clipped_off = named_grads(model, bindings)
            # Each side multiplied its gradients by its own c = min(max_norm / (total + 1e-6), 1) (torch's
            # Float32 value), one rounding each: |c' g' - c g| <= c' |g' - g| + |c' - c| |g| + u (|c g| + |c' g'|).
            c_ref = float(torch.clamp(max_norm / (n_ref + 1e-6), max=1.0))
            c_off = float(torch.clamp(max_norm / (n_off + 1e-6), max=1.0))
            assert c_ref < 0.5 and c_off < 0.5
            for n, g in clipped_ref.items():
                tol = c_off * (g_off[n] - g_ref[n]).abs() + abs(c_off - c_ref) * g_ref[n].abs() + \
                    U * (g.abs() + clipped_off[n].abs())
                excess = float(((clipped_off[n] - g).abs() - tol).max())
                assert excess <= 0, f"step {s} {n}: clipped gradient off by {excess:.3e} beyond its bound"
            w_old = named_weights(reference, {})
            ref_opt.step()
            opt.step()
            lrs.append(ref_opt.param_groups[0]["lr"])
            assert engines[0].lr == opt.param_groups[0]["lr"] == lrs[-1]
            w_new = named_weights(reference, {})
            for n, p in ref_params.items():
                if n not in clipped_ref:  # no gradient on either side: neither optimizer touches it
                    assert n not in clipped_off
                    bound.setdefault(n, {"Dw": torch.zeros_like(w_new[n])})
                    continue
                delta = (clipped_off[n] - clipped_ref[n]).abs()
                state = ref_opt.state[p]
                if algorithm == "AdamW":
                    propagate_adamw(bound, n, delta, state, lrs[-1], kw["betas"], kw["eps"], w_new[n], w_old[n])
                else:
                    g_wd = wd if name_group[n] == 0 else 0.0
                    propagate_sgd(bound, n, delta, state, lrs[-1], kw["momentum"], g_wd, w_new[n], w_old[n])
            ref_sched.step()
            sched.step()
    finally:
        ref_routing.remove()
        routing.remove()
    assert lrs == [0.0, 0.5 * lr, lr], f"the schedule: {lrs}"

    got = named_weights(model, bindings)
    want = named_weights(reference, {})
    assert set(got) == set(want)
    worst = 0.0
    for n, w in want.items():
        excess = float(((got[n] - w).abs() - bound[n]["Dw"]).max())
        assert excess <= 0, f"{family} {algorithm} {n}: exceeds its bound by {excess:.3e}"
        worst = max(worst, float(((got[n] - w).abs() / (bound[n]["Dw"] + 1e-300)).max()))
    for n in expert_names:  # every expert moved: the steps reached the tiles
        moved = (got[n] - start[n]).abs().reshape(E, -1).amax(dim=1)
        assert bool((moved > 0).all()), f"{n}: experts {torch.nonzero(moved == 0).flatten().tolist()} never moved"
    print(f"worst error / bound: {worst:.3f}; budget {budget} bytes")


# ------------------------------------------------------------------------------------------------ accumulation


def backward(model, ids, scale=1.0):
    (model(input_ids=ids, labels=ids).loss * scale).backward()


@pytest.mark.parametrize("family", FAMILIES)
def test_accumulation_adds_like_torch(family, folders):
    """Two backwards before a step: every gradient, torch's and each expert's tiled one, is exactly the Float32
    sum fl(G1 + G2) of the two backwards' gradients taken alone (torch's AccumulateGrad adds the new gradient into
    the old one, one rounding; bound 0), so the optimizer steps exactly what torch's accumulation would give it."""
    seed = seed_of(family)
    print(f"family={family} model seed={seed} batch seeds={seed + 200}, {seed + 201}")
    folder = folders(family)
    reference = load_reference(folder)
    model, bindings, _ = open_offloaded(folder, reference, family)
    opt = swt.AdamW(model)
    a, b = ids_for(seed + 200), ids_for(seed + 201)
    alone = []
    for ids in (a, b):
        opt.zero_grad()
        backward(model, ids, 1 / ACCUM)
        alone.append({n: g.float() for n, g in named_grads(model, bindings).items()})
    opt.zero_grad()
    assert all(t.grad is None for b_ in bindings.values() for t in b_.tiled.values()), "zero_grad drops tiled grads"
    backward(model, a, 1 / ACCUM)
    backward(model, b, 1 / ACCUM)
    both = named_grads(model, bindings)
    for n, g in both.items():
        want = alone[0][n] + alone[1][n]  # Float32 addition, one rounding
        assert torch.equal(g.float(), want), f"{n}: accumulated gradient is not fl(G1 + G2)"


@pytest.mark.parametrize("family", FAMILIES)
def test_accumulation_matches_one_large_batch(family, folders):
    """2 micro-batches of (2, 16) tokens, each (loss / 2).backward(), then an SGD step, against one backward over
    the (4, 16) batch they make, then the same step (equal sequence lengths and no padding: the large batch's mean
    loss is the mean of the two means, exactly, the division by 2 being exact).

    Both gradients are Float32 evaluations of the same exact gradient G (the Float64 gradient of the in-RAM model
    converted to Float64); each lies within the Float32 parity bound of tests/test_hf_families.py, 1e-5 of the
    largest |G| of its tensor (per micro-batch: twice that for the sum of two). SGD (no momentum, no decay) then
    moves each weight by lr g with one rounding: |w_acc - w_big| <= lr (|g_acc - G| + |g_big - G|) + 2u |w|, taken
    with the bound above for the gradient terms."""
    seed = seed_of(family)
    print(f"family={family} model seed={seed} batch seeds={seed + 300}, {seed + 301}")
    folder = folders(family)
    reference = load_reference(folder)
    a, b = ids_for(seed + 300), ids_for(seed + 301)
    big = torch.cat([a, b])
    exact = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              experts_implementation="eager").double()
    backward(exact, big)
    G = {n: p.grad.detach().clone() for n, p in exact.named_parameters() if p.grad is not None}
    del exact
    lr = 0.5
    runs = []
    for micro in (True, False):
        model, bindings, _ = open_offloaded(folder, reference, family)
        opt = swt.SGD(model, lr=lr)
        if micro:
            backward(model, a, 1 / ACCUM)
            backward(model, b, 1 / ACCUM)
        else:
            backward(model, big)
        grads = named_grads(model, bindings)
        for n, g in grads.items():
            tol = (2 if micro else 1) * 1e-5 * float(G[n].abs().max())
            err = float((g - G[n]).abs().max())
            assert err <= tol, f"{'micro' if micro else 'large'} batch {n}: {err:.3e} > {tol:.3e}"
        opt.step()
        runs.append((grads, named_weights(model, bindings)))
    (g_acc, w_acc), (g_big, w_big) = runs
    for n, w in w_big.items():
        tol = lr * 3e-5 * float(G[n].abs().max()) + 2 * U * float(w.abs().max())
        err = float((w_acc[n] - w).abs().max())
        assert err <= tol, f"{n}: accumulated update differs from the large batch's by {err:.3e} > {tol:.3e}"


# ------------------------------------------------------------------------------------------------------- state


def run_steps(model, bindings, opt, sched, seed, steps):
    for s in steps:
        opt.zero_grad()
        for k in range(ACCUM):
            backward(model, ids_for(seed + 400 + 10 * s + k), 1 / ACCUM)
        swt.clip_grad_norm_(model, 0.5)
        opt.step()
        sched.step()


@pytest.mark.parametrize("how", ["save_state", "state_dict"])
def test_resume_is_bit_identical(how, folders, tmp_path):
    """AdamW with a warm-up schedule: 3 steps uninterrupted, against 1 step, then the weights saved
    (swt.save_pretrained), the optimizer's state saved (save_state(folder), or state_dict() with state_folder
    set and torch.save), the scheduler's state_dict; a fresh model, optimizer and scheduler loading them; 2 more
    steps. Every weight and every moment bit for bit the same (bound 0: the same arithmetic on the same bits)."""
    family = "mixtral"
    seed = seed_of(family)
    print(f"family={family} model seed={seed} batch seeds={seed + 400}+10*step+micro")
    folder = folders(family)
    reference = load_reference(folder)

    def fresh(path):
        model, bindings, _ = open_offloaded(path, reference, family)
        opt = swt.AdamW(groups(list(model.named_parameters()), bindings.values(), 0.01), lr=1e-2)
        sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=4)
        return model, bindings, opt, sched

    model, bindings, opt, sched = fresh(folder)
    run_steps(model, bindings, opt, sched, seed, range(3))
    want = named_weights(model, bindings)
    want_state = {p: {k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]}
    del model, bindings, opt, sched

    model, bindings, opt, sched = fresh(folder)
    run_steps(model, bindings, opt, sched, seed, range(1))
    weights = tmp_path / "weights"
    swt.save_pretrained(model, weights)
    state = tmp_path / "state"
    if how == "save_state":
        opt.save_state(state)
    else:
        with pytest.raises(RuntimeError, match="state_folder"):
            opt.state_dict()
        opt.state_folder = state
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
    sched_state = sched.state_dict()
    del model, bindings, opt, sched

    model, bindings, opt, sched = fresh(str(weights))
    if how == "save_state":
        opt.load_state(state)
    else:
        opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    sched.load_state_dict(sched_state)
    run_steps(model, bindings, opt, sched, seed, range(1, 3))
    got = named_weights(model, bindings)
    assert set(got) == set(want)
    for n, w in want.items():
        assert torch.equal(got[n], w), f"{how}: {n} differs after resuming"
    got_state = [opt.state[p] for g in opt.param_groups for p in g["params"]]
    for (_, a), b in zip(want_state.items(), got_state):
        for k in a:
            assert torch.equal(a[k], b[k])
    for b in bindings.values():  # the tiled moments and per-expert step counts went through the files
        engine = opt._tiled_groups[0].engine
        for t in b.tiled.values():
            assert engine.state(t)["step"] == [3] * zoo.E


# ------------------------------------------------------------------------------------------------- error paths


@pytest.fixture
def stepped(folders):
    """An offloaded Mixtral with torch and tiled gradients present, and a snapshot to check nothing changed."""
    family = "mixtral"
    seed = seed_of(family)
    print(f"family={family} model seed={seed} batch seed={seed + 500}")
    folder = folders(family)
    reference = load_reference(folder)
    model, bindings, _ = open_offloaded(folder, reference, family)
    backward(model, ids_for(seed + 500))

    def snapshot():
        return named_weights(model, bindings), named_grads(model, bindings)

    return model, bindings, snapshot


def assert_same(before, after):
    for a, b in zip(before, after):
        assert set(a) == set(b)
        for n in a:
            assert torch.equal(a[n], b[n]), f"{n} changed"


def test_refuses_wrong_types(stepped):
    model, bindings, snapshot = stepped
    before = snapshot()
    binding = next(iter(bindings.values()))
    cases = [
        ([1.0], "parameter 0 must be a torch Parameter"),
        ([next(model.parameters()), model.lm_head], "parameter 1 must be a torch Parameter"),
        ({"params": list(model.parameters())}, "got a dict"),
        (set(model.parameters()), "ordered collection"),
        (42, "got int"),
        ([{"params": [binding]}, [next(model.parameters())]], "must be a dict like the others"),
    ]
    for params, fragment in cases:
        with pytest.raises(TypeError, match=fragment):
            swt.AdamW(params)
    with pytest.raises(TypeError, match="parameter 0 must be a torch Parameter"):
        swt.clip_grad_norm_(["x"], 1.0)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        swt.clip_grad_norm_(model, "1.0")
    opt = swt.SGD(model, lr=0.1)
    groups_before = len(opt.param_groups)
    with pytest.raises(TypeError, match="param_group must be a dict"):
        opt.add_param_group([binding])
    assert len(opt.param_groups) == len(opt.tiled_param_groups) == groups_before
    assert_same(before, snapshot())


def test_refuses_a_tiled_tensor_not_a_bound_experts(stepped, tmp_path):
    """A strideweave tiled tensor of one's own (not a binding's): strideweave.optim is for those."""
    import numpy as np
    from strideweave import friendly
    import strideweave.safetensors as st

    model, bindings, snapshot = stepped
    before = snapshot()
    path = str(tmp_path / "own.safetensors")
    st.save(path, {f"e{e}": friendly.tensor(np.ones((2, 3), np.float32)) for e in range(2)})
    own = st.open(path).tiled(["e0", "e1"])
    for params in ([own], [{"params": [next(model.parameters()), own]}]):
        with pytest.raises(ValueError, match="not the tiled tensor of a bound experts module"):
            swt.AdamW(params)
    with pytest.raises(ValueError, match="not the tiled tensor of a bound experts module"):
        swt.clip_grad_norm_([own], 1.0)
    opt = swt.AdamW(model)
    with pytest.raises(ValueError, match="not the tiled tensor of a bound experts module"):
        opt.add_param_group({"params": [own]})
    assert len(opt.param_groups) == 1
    assert_same(before, snapshot())


def test_refuses_an_empty_parameter_list(stepped, folders):
    model, bindings, snapshot = stepped
    before = snapshot()
    with pytest.raises(ValueError, match="empty parameter list"):
        swt.AdamW([])
    with pytest.raises(ValueError, match="empty parameter list"):
        swt.SGD([{"params": []}, {"params": []}])
    frozen = load_reference(folders("mixtral"))
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="empty parameter list"):
        swt.Adam(frozen)
    assert_same(before, snapshot())


def test_refuses_duplicates_and_options_the_engine_lacks(stepped):
    model, bindings, snapshot = stepped
    before = snapshot()
    binding = next(iter(bindings.values()))
    with pytest.raises(ValueError, match="more than one parameter group"):
        swt.AdamW([{"params": [binding]}, {"params": [binding.tiled["down"]]}])
    with pytest.raises(ValueError, match="amsgrad"):
        swt.Adam([{"params": [binding], "amsgrad": True}])
    opt = swt.AdamW([{"params": [binding]}])
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [binding.tiled["down"]]})
    with pytest.raises(ValueError, match="maximize"):
        opt.add_param_group({"params": list(bindings.values())[1:], "maximize": True})
    assert len(opt.param_groups) == len(opt.tiled_param_groups) == 1
    opt.param_groups[0]["amsgrad"] = True  # changed after construction: refused at step, before anything moves
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    assert_same(before, snapshot())


def test_a_bad_scheduled_value_moves_nothing(stepped):
    """A group's lr driven below 0 (by hand or a scheduler): the step raises the engine's ValueError while the
    values are pushed, before torch's step or any engine's step runs."""
    model, bindings, snapshot = stepped
    before = snapshot()
    opt = swt.AdamW(groups(list(model.named_parameters()), bindings.values(), 0.01), lr=1e-2)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert_same(before, snapshot())
    assert all(not opt.state[p] for g in opt.param_groups for p in g["params"])


def test_clip_refuses_a_nonfinite_norm(stepped):
    model, bindings, snapshot = stepped
    model.lm_head.weight.grad[0, 0] = float("inf")
    before = snapshot()
    with pytest.raises(RuntimeError, match="non-finite"):
        swt.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    assert_same(before, snapshot())


def test_load_state_refuses_other_groups(stepped, tmp_path):
    model, bindings, snapshot = stepped
    opt = swt.AdamW(model)
    opt.step()
    opt.save_state(tmp_path / "s")
    before = snapshot()
    other = swt.AdamW([{"params": list(bindings.values())[:1]}])
    with pytest.raises(ValueError, match="tiled groups of sizes"):
        other.load_state(tmp_path / "s")
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        other.load_state(tmp_path / "nothing")
    assert all(not other.state[p] for g in other.param_groups for p in g["params"])
    assert_same(before, snapshot())


def test_zero_grad_clears_the_experts(stepped):
    model, bindings, _ = stepped
    opt = swt.SGD(model, lr=0.1)
    assert all(t.grad is not None for b in bindings.values() for t in b.tiled.values())
    opt.zero_grad()
    assert all(t.grad is None for b in bindings.values() for t in b.tiled.values())
    assert all(p.grad is None for p in model.parameters())
