"""Expert parallelism and data parallelism over ``torch.distributed`` (docs/guide.md, "Fine-tuning on several
processes or hosts"; Note [Experts across ranks] in python/strideweave/torch/_distributed.py).

The runs: a tiny Mixtral (6 experts per MoE layer, 2 MoE layers) and a tiny DeepSeek-V3 (4 routed experts, 2
groups with one chosen per token, a shared expert, 2 MoE layers after a dense one), both computed by the SparseMoE
node, and a tiny GPT-OSS (4 experts, fused transposed interleaved gate/up with expert biases, computed by the
per-expert math; its biases are replicated parameters whose gradient only the owner computes), each saved with
``save_pretrained`` from seeded random weights, are fine-tuned for ``STEPS`` steps (backward of each rank's mean
loss, ``all_reduce_gradients``, ``clip_grad_norm_`` below the total, AdamW with weight decay) on one global batch
per step by 1, 2 and 4 processes (this file run as a script: gloo on loopback, a ``file://`` rendezvous, a timeout
on every wait), each rank opening the checkpoint with ``from_pretrained(..., process_group=WORLD)`` under a budget
of 3 experts' weights (below its share of experts + gradients + AdamW moments: 4 x its share, at least 8 experts'
weights), and the global batch's rows split evenly over the ranks. With 6 experts over 4 ranks the shares are
uneven (1, 2, 1, 2).

* ``test_matches_one_process``: the reference is the same steps with torch's AdamW and clip_grad_norm_ on the
  in-RAM model over the whole global batch in this process (the plain-loop reference of tests/test_torch_optim.py);
  every run's routing is the reference's, the gradients, norms and clipped gradients within their bounds, and
  after the steps every weight (experts gathered from the shares of all ranks) within the bound propagated through
  AdamW (``propagate_adamw`` of tests/test_torch_optim.py, from the measured gradient differences); the N-process
  weights are within the 1-process run's by the sum of the two bounds (triangle inequality).
* ``test_a_rank_reads_only_its_experts``: opened again with a budget that holds everything, one step reads from
  the checkpoint exactly the bytes of the rank's own experts, once each (``ckpt.bytes_read``: a tile of another
  expert resident at any time would have added its bytes), and none of another expert's tiles is resident at the
  end; in the small-budget run too, no other expert's tile is resident at the end, and evictions happened.
* ``test_replicated_parameters_are_identical_on_every_rank``: bit for bit, after the steps.
* the refusals, in a worker of 2 ranks: ``gather`` without ``experts=``;
  and in this process: the argument checks.

Seeds: the model of family F is drawn from ``BASE_SEED + crc32(F)``, step s's global batch from that seed + 100 + s;
the fixture prints them.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import zlib

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

BASE_SEED = 3600
# family -> config overrides: E = 6 (not a multiple of 4) and E = 4; DeepSeek-V3 with two MoE layers.
FAMILIES = {"mixtral": dict(num_local_experts=6),
            "deepseek_v3": dict(n_routed_experts=4, n_group=2, topk_group=1, num_hidden_layers=3),
            "gpt_oss": dict(num_local_experts=4)}
WORLDS = (1, 2, 4)
GLOBAL = (4, 16)  # global batch: 4 sequences of 16 tokens (every rank of 4 gets one)
STEPS = 3
LR, BETAS, EPS, WD, MAX_NORM = 1e-2, (0.9, 0.999), 1e-8, 0.01, 0.5
BUDGET_EXPERTS = 3  # each rank's budget, in one expert's weight bytes (gate + up + down, Float32)
TIMEOUT = 240  # seconds for every run of every world size together (they run concurrently)
COLLECTIVE_TIMEOUT = 120  # seconds a collective may wait before torch.distributed gives up


def seed_of(family: str) -> int:
    return BASE_SEED + zlib.crc32(family.encode())


def global_batch(family: str, step: int):
    import torch
    import hf_families as zoo
    g = torch.Generator().manual_seed(seed_of(family) + 100 + step)
    return torch.randint(0, zoo.VOCAB, GLOBAL, generator=g)


def rows_of(rank: int, world: int) -> slice:
    per = GLOBAL[0] // world
    return slice(rank * per, (rank + 1) * per)


def expert_bytes(family: str) -> int:
    """One expert's weight bytes (gate, up and down projections, Float32)."""
    import hf_families as zoo
    config = zoo.tiny_config(family, **FAMILIES[family])
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return 3 * inter * config.hidden_size * 4


# ============================================================================================ the worker (a rank)


def _owned_weights(bindings: dict, grad: bool) -> dict:
    """name -> this rank's share of each expert parameter (experts axis first), as transformers names them."""
    out = {}
    for path, b in bindings.items():
        for pn in b.parameter_names:
            out[f"{path}.{pn}"] = b.gather(pn, grad=grad, experts=b.experts_range).double()
    return out


def _replicated(model, grad: bool) -> dict:
    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grad else p
        if t is not None:
            out[n] = t.detach().double().clone()
    return out


def _tile_valid(binding, experts) -> list:
    """The experts among `experts` with any tile of any role resident (in the primary tier) now."""
    return [e for e in experts
            if any(t.carrier.tile_state((0, 0, e)).location == "primary" for t in binding.tiled.values())]


def _train(family: str, folder: str, budget: int, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import strideweave.torch as swt
    group = dist.group.WORLD
    model = swt.from_pretrained(folder, budget, process_group=group)
    bindings = swt.offloaded_experts(model)
    ckpt = next(iter(bindings.values())).checkpoint
    opt = swt.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    routing = {p: [] for p in bindings}
    modules = dict(model.named_modules())

    def hook(path):
        def record(mod, args, kwargs):
            values = list(args) + list(kwargs.values())
            routing[path].append(values[1].detach().reshape(-1, values[1].shape[-1]).clone())
        return record

    handles = [modules[p].register_forward_pre_hook(hook(p), with_kwargs=True) for p in bindings]
    steps = []
    for s in range(STEPS):
        ids = global_batch(family, s)[rows_of(rank, world)]
        before = {**_replicated(model, False), **_owned_weights(bindings, False)}
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        swt.all_reduce_gradients(model)
        pre = {**_replicated(model, True), **_owned_weights(bindings, True)}
        norm = swt.clip_grad_norm_(model, MAX_NORM)
        post = {**_replicated(model, True), **_owned_weights(bindings, True)}
        opt.step()
        steps.append({"before": before, "pre": pre, "post": post, "norm": float(norm)})
    for h in handles:
        h.remove()
    out = {"steps": steps, "routing": routing,
           "weights": {**_replicated(model, False), **_owned_weights(bindings, False)},
           "shares": {p: (b.experts_range.start, b.experts_range.stop) for p, b in bindings.items()},
           "expert_names": sorted(f"{p}.{pn}" for p, b in bindings.items() for pn in b.parameter_names),
           "experts": {p: b.spec.experts for p, b in bindings.items()},
           "expert_bytes": {p: b.expert_bytes for p, b in bindings.items()},
           "others_resident": {p: _tile_valid(b, [e for e in range(b.spec.experts) if e not in b.experts_range])
                               for p, b in bindings.items()},
           "evictions": sum(t.carrier.stats()["evictions"] for b in bindings.values() for t in b.tiled.values()),
           "bytes_read": ckpt.bytes_read, "budget": budget}
    if world > 1 and rank == 0 and family == "mixtral":
        out["refusals"] = _refusals(model, bindings, folder)
    del opt, model, bindings
    return out


def _refusals(model, bindings, folder) -> dict:
    """The refusals of a model sharded over several ranks (type, message, and nothing written)."""
    out = {}
    read = next(iter(bindings.values())).checkpoint.bytes_read
    b = next(iter(bindings.values()))
    try:
        b.gather("gate_up_proj")
        out["gather"] = None
    except Exception as e:  # noqa: BLE001
        out["gather"] = (type(e).__name__, str(e))
    other = next(e for e in range(b.spec.experts) if e not in b.experts_range)
    try:
        b.gather("gate_up_proj", experts=[other])
        out["gather_other"] = None
    except Exception as e:  # noqa: BLE001
        out["gather_other"] = (type(e).__name__, str(e))
    out["read_during_refusals"] = next(iter(bindings.values())).checkpoint.bytes_read - read
    return out


def _read_once(family: str, folder: str, rank: int, world: int) -> dict:
    """Opened with a budget that holds every expert, weights, gradients and moments: one step (forward, backward,
    all_reduce_gradients, clip_grad_norm_, AdamW's step) reads each tile it needs once and never evicts."""
    import strideweave.torch as swt
    import torch.distributed as dist
    model = swt.from_pretrained(folder, 1 << 30, process_group=dist.group.WORLD)
    bindings = swt.offloaded_experts(model)
    ckpt = next(iter(bindings.values())).checkpoint
    opened = ckpt.bytes_read
    opt = swt.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ids = global_batch(family, 0)[rows_of(rank, world)]
    model(input_ids=ids, labels=ids).loss.backward()
    swt.all_reduce_gradients(model)
    swt.clip_grad_norm_(model, MAX_NORM)
    opt.step()
    return {"opened": opened, "bytes_read": ckpt.bytes_read,
            "owned_bytes": sum(len(b.experts_range) * b.expert_bytes for b in bindings.values()),
            "others_resident": {p: _tile_valid(b, [e for e in range(b.spec.experts) if e not in b.experts_range])
                                for p, b in bindings.items()},
            "evictions": sum(t.carrier.stats()["evictions"] for b in bindings.values() for t in b.tiled.values())}


def worker(config_path: str) -> None:
    import datetime
    import torch
    import torch.distributed as dist
    with open(config_path) as f:
        cfg = json.load(f)
    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        result = {}
        for family, spec in cfg["families"].items():
            result[family] = {"train": _train(family, spec["folder"], spec["budget"], rank, world),
                              "read_once": _read_once(family, spec["folder"], rank, world)}
        torch.save(result, cfg["out"] + ".part")
        os.replace(cfg["out"] + ".part", cfg["out"])
    finally:
        dist.destroy_process_group()


# ============================================================================================ the tests

import torch  # noqa: E402 (the worker above imports what it needs itself)

import hf_families as zoo  # noqa: E402
import strideweave.torch as swt  # noqa: E402
from test_torch_optim import Routing, U, propagate_adamw  # noqa: E402


def _spawn_all(root, folders: dict) -> dict:
    """Every world size's ranks at once (each rank runs both families); {world: [result per rank]}."""
    procs = []
    for world in WORLDS:
        init = "file://" + os.path.join(str(root), f"rendezvous-{world}")
        for rank in range(world):
            cfg = {"rank": rank, "world": world, "init": init, "out": os.path.join(str(root), f"out-{world}-{rank}.pt"),
                   "families": {f: {"folder": folders[f], "budget": BUDGET_EXPERTS * expert_bytes(f)}
                                for f in FAMILIES}}
            path = os.path.join(str(root), f"cfg-{world}-{rank}.json")
            with open(path, "w") as fh:
                json.dump(cfg, fh)
            log = open(os.path.join(str(root), f"log-{world}-{rank}.txt"), "w")
            env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       OMP_NUM_THREADS="1")
            procs.append((world, rank, cfg, log,
                          subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdout=log,
                                           stderr=subprocess.STDOUT, env=env)))
    deadline = time.monotonic() + TIMEOUT
    failed = []
    # Woken by whichever process ends first (a pidfd is readable once its process has exited): the first failure
    # ends the wait at once, instead of its peers waiting out their collective timeout.
    fds = {os.pidfd_open(p.pid): (world, rank, p) for world, rank, cfg, log, p in procs}
    try:
        while fds and not failed:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                failed += [f"world {w} rank {r}: still running after {TIMEOUT} s" for w, r, _ in fds.values()]
                break
            for fd in ready:
                world, rank, p = fds.pop(fd)
                os.close(fd)
                if p.wait() != 0:
                    failed.append(f"world {world} rank {rank}: exit status {p.returncode}")
    finally:
        for fd in fds:
            os.close(fd)
        for world, rank, cfg, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            log.close()
    if failed:
        logs = []
        for world, rank, cfg, log, p in procs:
            with open(log.name) as fh:
                logs.append(f"--- world {world} rank {rank}\n" + fh.read()[-3000:])
        raise AssertionError("; ".join(failed) + "\n" + "\n".join(logs))
    out: dict = {}
    for world, rank, cfg, log, p in procs:
        out.setdefault(world, []).append(torch.load(cfg["out"], weights_only=False))
    return out


def _reference(family: str, folder: str) -> dict:
    """The same steps with torch's AdamW and clip_grad_norm_ on the in-RAM model over the whole global batch, with
    what the bounds need: per step the gradient before and after clipping, the norm, each world size's partial
    gradients' largest magnitudes (sum over ranks of max |part_r|, part_r the gradient of rank r's loss / N), the
    routing and AdamW's state; the weights before and after each step."""
    import transformers
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    params = dict(reference.named_parameters())
    paths = list(zoo.experts_modules(reference, zoo.ZOO[family]))
    routing = Routing(reference, paths)
    steps = []
    try:
        for s in range(STEPS):
            ids = global_batch(family, s)
            opt.zero_grad(set_to_none=True)
            reference(input_ids=ids, labels=ids).loss.backward()
            step_routing = {p: v[0].reshape(-1, v[0].shape[-1]) for p, v in routing.take().items()}
            pre = {n: p.grad.detach().double().clone() for n, p in params.items() if p.grad is not None}
            norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
            post = {n: p.grad.detach().double().clone() for n, p in params.items() if p.grad is not None}
            w_old = {n: p.detach().double().clone() for n, p in params.items()}
            opt.step()
            w_new = {n: p.detach().double().clone() for n, p in params.items()}
            state = {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                     for n, p in params.items()}
            steps.append({"pre": pre, "post": post, "norm": norm, "routing": step_routing,
                          "w_old": w_old, "w_new": w_new, "state": state})
    finally:
        routing.remove()
    return {"steps": steps, "weights": {n: p.detach().double().clone() for n, p in params.items()},
            "paths": paths}


def _gradient_at(folder: str, family: str, weights: dict, step: int, world: int) -> tuple:
    """torch's gradient on the in-RAM model set to `weights` (a run's weights before `step`) over the global batch
    split as `world` ranks split it, accumulated part by part (part_r: the gradient of rank r's loss / N), and
    sum_r max |part_r| per parameter: (gradient, largest magnitudes)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    assert set(params) == set(weights)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n].float())
    ids = global_batch(family, step)
    part_max: dict = {}
    previous: dict = {}
    for r in range(world):
        sub = ids[rows_of(r, world)]
        (model(input_ids=sub, labels=sub).loss / world).backward()
        for n, p in params.items():
            if p.grad is not None:
                part = p.grad - previous[n] if n in previous else p.grad
                part_max[n] = part_max.get(n, 0.0) + float(part.abs().max())
                previous[n] = p.grad.detach().clone()
    return {n: g.double() for n, g in previous.items()}, part_max


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    folders = {}
    for family, overrides in FAMILIES.items():
        print(f"family={family} model seed={seed_of(family)} batch seeds={seed_of(family) + 100}+step")
        model = zoo.build(family, seed_of(family), **overrides)
        folders[family] = os.path.join(str(root), family)
        model.save_pretrained(folders[family])
    results = _spawn_all(root, folders)
    references = {f: _reference(f, folders[f]) for f in FAMILIES}
    return {"results": results, "references": references, "folders": folders}


def _assemble(ranks: list, key, family_result) -> dict:
    """name -> the whole tensor from every rank's values of `key` (experts: the shares concatenated in rank
    order along the experts axis; replicated parameters, expert biases included: rank 0's)."""
    first = family_result(ranks[0])
    out = dict(key(first))
    for n in first["expert_names"]:
        out[n] = torch.cat([key(family_result(r))[n] for r in ranks], dim=0)
    return out


def _global_routing(ranks: list, family: str, path: str, step: int) -> torch.Tensor:
    return torch.cat([r[family]["train"]["routing"][path][step] for r in ranks], dim=0)


def test_expert_share_partitions_the_experts():
    """expert_share(E, r, N) is [floor(E r / N), floor(E (r + 1) / N)): contiguous, in rank order, covering range(E)
    once, sizes differing by at most one (empty shares when E < N)."""
    for E in range(0, 13):
        for N in range(1, 9):
            shares = [swt.expert_share(E, r, N) for r in range(N)]
            assert [e for s in shares for e in s] == list(range(E)), (E, N)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1, (E, N)
            assert all(s.start == E * r // N for r, s in enumerate(shares))
    assert [tuple(swt.expert_share(6, r, 4)) for r in range(4)] == [(0,), (1, 2), (3,), (4, 5)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_one_process(family, world, runs):
    """The N-process run against torch's in-RAM reference over the global batch, step by step:

    * routing: every rank's top-k indices, concatenated in rank order, are the reference's for the global batch
      (no near tie moved a token: a tie would make the comparison meaningless, so it fails here instead), and every
      expert is reached (torch steps every expert; the tiled optimizer skips an expert without a gradient);
    * gradients after all_reduce_gradients, before clipping, against torch's on the in-RAM model set to the run's
      own weights before the step (so both compute at the same point; the trajectories themselves drift apart by
      the propagated bound) over the same split of the batch: within the Float32 parity bound of
      tests/test_hf_families.py (1e-5 of the largest magnitude, per part: sum over ranks of max |part_r| with part_r
      the gradient of rank r's loss / N) plus the all-reduce's N - 1 additions, (N - 1) u of that sum (the division
      by N = 1, 2, 4 is exact); owned experts' gradients, the sum over every rank's tokens times 1 / N, alike;
    * the norm: within ||g' - g||_2 (triangle inequality) plus each side's summation error, (count + N + 2) u of
      the norm (count gradient elements; the tiled norm's N partial sums of squares added once more);
    * the clipped gradients: c' |g' - g| + |c' - c| |g| + u (|c g| + |c' g'|) (each side's own factor, one rounding);
    * after the steps every weight within the bound propagated through AdamW from the measured differences of the
      clipped gradients (``propagate_adamw``, tests/test_torch_optim.py); and within the 1-process run's weights by
      the sum of the two runs' bounds (triangle inequality)."""
    print(f"family={family} world={world} model seed={seed_of(family)}")
    got, bound, worst = _checked(family, world, runs)
    if world > 1:
        one, one_bound, _ = _checked(family, 1, runs)
        for n in got:
            excess = float(((got[n] - one[n]).abs() - bound[n]["Dw"] - one_bound[n]["Dw"]).max())
            assert excess <= 0, f"{family} N={world} against N=1, {n}: exceeds the two bounds by {excess:.3e}"
    print(f"worst error / bound: {worst:.3f}")


def _checked(family: str, world: int, runs) -> tuple:
    """Asserts the step-by-step checks of test_matches_one_process for one run; (weights, bounds, worst ratio)."""
    cache = runs.setdefault("checked", {})
    if (family, world) in cache:
        return cache[(family, world)]
    ref = runs["references"][family]
    ranks = runs["results"][world]
    assert len(ranks) == world
    train = [r[family]["train"] for r in ranks]
    E = train[0]["experts"]
    for path in ref["paths"]:  # the shares partition the experts, in rank order
        assert [tuple(range(*t["shares"][path])) for t in train] == \
            [tuple(swt.expert_share(E[path], r, world)) for r in range(world)]
    bound: dict = {}
    for s, rs in enumerate(ref["steps"]):
        for path in ref["paths"]:
            got = _global_routing(ranks, family, path, s)
            assert torch.equal(got, rs["routing"][path]), f"step {s}: {path} routed differently"
            assert torch.unique(got).numel() == E[path], f"step {s}: {path} reached only {torch.unique(got).tolist()}"
        pre = _assemble(ranks, lambda t: t["steps"][s]["pre"], lambda r: r[family]["train"])
        post = _assemble(ranks, lambda t: t["steps"][s]["post"], lambda r: r[family]["train"])
        assert set(pre) == set(rs["pre"]), f"step {s}: gradients of {set(pre) ^ set(rs['pre'])}"
        before = _assemble(ranks, lambda t: t["steps"][s]["before"], lambda r: r[family]["train"])
        at, part_max = _gradient_at(runs["folders"][family], family, before, s, world)
        assert set(at) == set(pre)
        for n, g in at.items():
            err = float((pre[n] - g).abs().max())
            tol = (1e-5 + (world - 1) * U) * part_max[n]
            assert err <= tol, f"step {s} {n}: gradient error {err:.3e} > {tol:.3e}"
        diff_norm = sum(float(((pre[n] - g) ** 2).sum()) for n, g in rs["pre"].items()) ** 0.5
        count = sum(g.numel() for g in rs["pre"].values())
        norms = [t["steps"][s]["norm"] for t in train]
        assert len(set(norms)) == 1, f"step {s}: the ranks' norms differ: {norms}"
        n_ref, n_got = rs["norm"], norms[0]
        assert n_ref > 2 * MAX_NORM, f"step {s}: total norm {n_ref} does not clip"
        tol = diff_norm + 2 * (count + world + 2) * U * n_ref
        assert abs(n_got - n_ref) <= tol, f"step {s}: norms {n_got} vs {n_ref} (bound {tol:.3e})"
        c_ref = float(torch.clamp(MAX_NORM / (torch.tensor(n_ref, dtype=torch.float32) + 1e-6), max=1.0))
        c_got = float(torch.clamp(MAX_NORM / (torch.tensor(n_got, dtype=torch.float32) + 1e-6), max=1.0))
        for n, g in rs["post"].items():
            tol = c_got * (pre[n] - rs["pre"][n]).abs() + abs(c_got - c_ref) * rs["pre"][n].abs() + \
                U * (g.abs() + post[n].abs())
            excess = float(((post[n] - g).abs() - tol).max())
            assert excess <= 0, f"step {s} {n}: clipped gradient off by {excess:.3e} beyond its bound"
        for n in rs["w_new"]:
            delta = (post[n] - rs["post"][n]).abs()
            propagate_adamw(bound, n, delta, rs["state"][n], LR, BETAS, EPS, rs["w_new"][n], rs["w_old"][n])
    got = _assemble(ranks, lambda t: t["weights"], lambda r: r[family]["train"])
    assert set(got) == set(ref["weights"])
    worst = 0.0
    for n, w in ref["weights"].items():
        excess = float(((got[n] - w).abs() - bound[n]["Dw"]).max())
        assert excess <= 0, f"{family} N={world} {n}: exceeds its bound by {excess:.3e}"
        worst = max(worst, float(((got[n] - w).abs() / (bound[n]["Dw"] + 1e-300)).max()))
    moved = sum(float((got[n] - ref["steps"][0]["w_old"][n]).abs().max()) > 0 for n in got)
    assert moved == len(got), "every parameter moved"
    cache[(family, world)] = (got, bound, worst)
    return cache[(family, world)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_rank_reads_only_its_experts(family, world, runs):
    """Opened with a budget that holds everything, one step reads from the checkpoint exactly the bytes of the
    rank's own experts (every one is routed at step 0; each tile read once, nothing evicted): not one byte of
    another rank's experts, and no other expert's tile resident. In the training run (budget of 3 experts, below
    4 x the share: weights, gradients, two moments) evictions happened, the bytes read are at least the share, and
    no other expert's tile is resident at the end."""
    for rank, r in enumerate(runs["results"][world]):
        once = r[family]["read_once"]
        assert once["opened"] == 0, f"rank {rank}: opening read {once['opened']} bytes"
        assert once["evictions"] == 0
        assert once["bytes_read"] == once["owned_bytes"] > 0, \
            f"rank {rank} of {world}: read {once['bytes_read']} bytes, its experts are {once['owned_bytes']}"
        assert all(v == [] for v in once["others_resident"].values()), once["others_resident"]
        train = r[family]["train"]
        share = sum((hi - lo) * train["expert_bytes"][p] for p, (lo, hi) in train["shares"].items())
        assert train["budget"] < 4 * share, f"rank {rank}: budget {train['budget']} not below 4 x {share}"
        assert train["evictions"] > 0
        assert train["bytes_read"] >= share
        assert all(v == [] for v in train["others_resident"].values()), train["others_resident"]


def test_replicated_parameters_are_identical_on_every_rank(runs):
    """After the steps every torch parameter is bit for bit the same on every rank (the all-reduce gives every rank
    the same sum, the clipping factor is the same, and each rank steps the same values)."""
    for world in WORLDS[1:]:
        for family in FAMILIES:
            weights = [r[family]["train"]["weights"] for r in runs["results"][world]]
            replicated = weights[0].keys() - set(runs["results"][world][0][family]["train"]["expert_names"])
            for n in replicated:
                for rank, w in enumerate(weights[1:], 1):
                    assert torch.equal(w[n], weights[0][n]), f"{family} N={world}: {n} differs on rank {rank}"


def test_refusals_on_a_sharded_model(runs, tmp_path):
    """With 2 ranks: gather without experts= or of another rank's expert refuses (ValueError), and neither reads a
    byte (saving across ranks: tests/test_distributed_save.py)."""
    refusals = runs["results"][2][0]["mixtral"]["train"]["refusals"]
    kind, message = refusals["gather"]
    assert kind == "ValueError" and "give experts=" in message
    kind, message = refusals["gather_other"]
    assert kind == "ValueError" and "not in this rank's share" in message
    assert refusals["read_during_refusals"] == 0


def test_argument_checks(runs):
    """process_group must be a torch.distributed ProcessGroup (TypeError, nothing opened); all_reduce_gradients
    needs a model opened with a group or a group (ValueError, no gradient changed)."""
    folder = runs["folders"]["mixtral"]
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        swt.from_pretrained(folder, 1 << 20, process_group="world")
    model = swt.from_pretrained(folder, 1 << 20)
    ids = global_batch("mixtral", 0)[:1]
    model(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(ValueError, match="was not opened with a process group"):
        swt.all_reduce_gradients(model)
    with pytest.raises(TypeError, match="expected a model"):
        swt.all_reduce_gradients([1])
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters() if p.grad is not None)


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one rank (gloo) in this process, destroyed after the test."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "rendezvous"), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_refusals_with_a_group(one_rank, runs, tmp_path):
    """Llama4's experts cannot be sharded yet: TypeError, raised before transformers builds the model; an optimizer
    stepping in backward: all_reduce_gradients raises ValueError and no gradient changed; clip_grad_norm_ takes a
    ProcessGroup or None (TypeError)."""
    llama = os.path.join(str(tmp_path), "llama4")
    zoo.build("llama4", seed_of("llama4")).save_pretrained(llama)
    with pytest.raises(TypeError, match="Llama4's experts cannot be sharded across ranks yet"):
        swt.from_pretrained(llama, 1 << 20, process_group=one_rank)
    model = swt.from_pretrained(runs["folders"]["mixtral"], 1 << 20, process_group=one_rank)
    opt = swt.AdamW(model, lr=LR, step_in_backward=True)
    ids = global_batch("mixtral", 0)[:1]
    model(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(ValueError, match="step_in_backward=True"):
        swt.all_reduce_gradients(model)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters() if p.grad is not None)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        swt.clip_grad_norm_(model, 1.0, process_group="world")
    del opt


def test_offload_experts_takes_a_group(one_rank, runs):
    """offload_experts(..., process_group=) shards as from_pretrained does: with one rank it owns every expert, and
    the logits through the exchange path are transformers' within the Float32 parity bound of
    tests/test_hf_families.py (1e-5 of the largest magnitude: the only difference is the order of the experts'
    Float32 sums)."""
    import transformers
    folder = runs["folders"]["mixtral"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    bindings = swt.offload_experts(model, folder, 1 << 20, process_group=one_rank)
    assert [b.experts_range for b in bindings] == [range(6), range(6)]
    assert all(b.process_group is one_rank for b in bindings)
    ids = global_batch("mixtral", 0)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = model(input_ids=ids).logits
    err, tol = float((got - want).abs().max()), 1e-5 * float(want.abs().max())
    assert err <= tol, f"logits off by {err:.3e} > {tol:.3e}"


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    worker(sys.argv[1])
