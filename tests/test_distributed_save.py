"""Saving and resuming a model whose experts are sharded over ranks (docs/guide.md, "Fine-tuning on several
processes or hosts"; Note [Saving across ranks] in python/strideweave/torch/_saving.py, Note [Optimizer state
across ranks] in python/strideweave/torch/_optim.py).

The runs (the tiny Mixtral of tests/test_distributed.py: 6 experts per MoE layer, 2 MoE layers, stored one matrix
per expert; its seeds, global batches, budget per rank and AdamW with clipping, imported from there):

* job "train", 2 processes (gloo on loopback, spawned as tests/test_distributed.py spawns them): ``TOTAL`` steps;
  after ``SAVED`` steps ``save_pretrained`` (collective) writes one checkpoint and the optimizer's ``save_state``
  its state, and the run goes on uninterrupted; then a save with the shard writer raising on rank 1, a tiny GPT-OSS
  saved (its experts are one tensor per projection: each rank writes its rows of it), an MXFP4 GPT-OSS saved with
  ``quantize=True`` (refused), and a tiny FP8 DeepSeek-V3 saved with ``quantize=True``;
* in this process, one process without a group: the same ``TOTAL`` steps over the whole global batch, saving
  the checkpoint and the optimizer's state after ``SAVED`` steps likewise;
* job "resume", 2 processes: the 2 ranks' checkpoint reopened with ``from_pretrained(process_group=)``, their
  state loaded, the remaining steps; job "split", 2 processes: the same from the one-process checkpoint and state;
* in this process, the saved checkpoint and the 2 ranks' state resumed by one process (the experts re-sharded on
  load), the remaining steps.

Seeds: those of tests/test_distributed.py (the model from ``seed_of("mixtral")``, step s's batch from that + 100 + s);
printed by the fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_distributed import (BETAS, BUDGET_EXPERTS, COLLECTIVE_TIMEOUT, EPS, FAMILIES, LR, MAX_NORM, WD,  # noqa: E402
                              _owned_weights, _replicated, expert_bytes, global_batch, rows_of, seed_of)

FAMILY = "mixtral"
SAVED, TOTAL = 2, 4  # steps before the save; steps in all
TIMEOUT = 180  # seconds for one job's processes


# ============================================================================================ the worker (a rank)


def _weights(model, bindings) -> dict:
    return {**_replicated(model, False), **_owned_weights(bindings, False)}


def _step(model, bindings, opt, ids, group) -> dict:
    """One step (backward of the mean loss over `ids`, the gradients averaged over the ranks when `group`, clipped,
    AdamW's step); the clipped gradients (this rank's share of the experts')."""
    import strideweave.torch as swt
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    if group is not None:
        swt.all_reduce_gradients(model)
    swt.clip_grad_norm_(model, MAX_NORM)
    post = {**_replicated(model, True), **_owned_weights(bindings, True)}
    opt.step()
    return post


def _run(folder: str, steps: range, rank: int, world: int, group, save: dict = None, state: str = None) -> dict:
    """Opens `folder` (sharded over `group`, or whole), optionally loads the optimizer state `state`, runs `steps`;
    with `save` ({"at": step, "checkpoint": folder, "state": folder}) saves before step `at`."""
    import strideweave.torch as swt
    model = swt.from_pretrained(folder, BUDGET_EXPERTS * expert_bytes(FAMILY), process_group=group)
    bindings = swt.offloaded_experts(model)
    opt = swt.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    if state is not None:
        opt.load_state(state)
    out = {"post": {}, "w_old": {}, "w_new": {}}
    for s in steps:
        if save is not None and s == save["at"]:
            out["saved"] = _weights(model, bindings)
            swt.save_pretrained(model, save["checkpoint"], max_shard_size=200_000)
            opt.save_state(save["state"])
            if save.get("state_dict") is not None:
                out["state_dict"] = _state_dict_round_trip(model, opt, save["state_dict"], rank)
        ids = global_batch(FAMILY, s)[rows_of(rank, world)]
        out["w_old"][s] = _weights(model, bindings)
        out["post"][s] = _step(model, bindings, opt, ids, group)
        out["w_new"][s] = _weights(model, bindings)
    out["weights"] = _weights(model, bindings)
    out["shares"] = {p: (b.experts_range.start, b.experts_range.stop) for p, b in bindings.items()}
    out["expert_names"] = sorted(f"{p}.{pn}" for p, b in bindings.items() for pn in b.parameter_names)
    out["model"], out["bindings"], out["opt"] = model, bindings, opt
    if save is not None and save.get("state_dict") is not None:  # a good save of the state, to fail over later
        opt.save_state(save["failed_state"])
        out["good_state_files"] = sorted(os.listdir(save["failed_state"]))
    return out


def _state_dict_round_trip(model, opt, folder: str, rank: int) -> dict:
    """state_dict() with a state_folder shared by the ranks, load_state_dict() of it into a new optimizer: the files
    each rank's dict names, and whether the new optimizer's state (written by save_state of its engines) equals the
    old one's, tile for tile, metadata included."""
    import strideweave.torch as swt
    from safetensors.numpy import load_file
    from safetensors import safe_open
    opt.state_folder = folder
    sd = opt.state_dict()
    fresh = swt.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    fresh.load_state_dict(sd)
    equal = True
    for i, (a, b) in enumerate(zip(opt._tiled_groups, fresh._tiled_groups)):
        paths = [os.path.join(folder, f"compare-{rank}-{i}-{k}.safetensors") for k in range(2)]
        a.engine.save_state(paths[0])
        b.engine.save_state(paths[1])
        tensors = [load_file(p) for p in paths]
        metas = []
        for p in paths:
            with safe_open(p, "np") as f:
                metas.append(f.metadata())
        equal = equal and metas[0] == metas[1] and tensors[0].keys() == tensors[1].keys() and \
            all((tensors[0][k].view("u1") == tensors[1][k].view("u1")).all() for k in tensors[0])
    torch_equal = str(opt._torch_cls.state_dict(opt)) == str(fresh._torch_cls.state_dict(fresh))
    opt.state_folder = None
    return {"files": sd["strideweave"]["files"], "equal": bool(equal), "torch_equal": torch_equal}


def _failing_save(model, target: str, rank: int) -> dict:
    """save_pretrained with the shard writer raising on rank 1, into a new target and into an existing one (the
    folder of the earlier good save, its files and their bytes recorded before and after): what each rank raised
    and what is left."""
    import strideweave.torch as swt
    import strideweave.torch._saving as saving
    parent = os.path.dirname(target)
    existing = os.path.join(parent, "existing")
    if rank == 0:
        os.makedirs(existing)
        with open(os.path.join(existing, "kept.txt"), "w") as f:
            f.write("the old folder")
    before = sorted(os.listdir(parent))
    writer = saving._write_shard
    if rank == 1:
        def broken(path, tensors, metadata, quantize=None):
            raise OSError(f"injected failure writing {os.path.basename(path)}")
        saving._write_shard = broken
    out = {"raised": [], "before": before}
    try:
        for where in (target, existing):
            try:
                swt.save_pretrained(model, where, max_shard_size=200_000)
                out["raised"].append(None)
            except Exception as e:  # noqa: BLE001 (recorded for the test)
                out["raised"].append((type(e).__name__, str(e)))
    finally:
        saving._write_shard = writer
    out["exists"] = os.path.lexists(target)
    out["after"] = sorted(os.listdir(parent))
    out["existing"] = {n: open(os.path.join(existing, n)).read() for n in sorted(os.listdir(existing))}
    return out


def _failing_state_save(opt, folder: str, rank: int) -> dict:
    """The optimizer's save_state into the folder of an earlier good save, the engine raising on rank 1: what each
    rank raised and the files left."""
    tg = next(tg for tg in opt._tiled_groups if tg.engine is not None)
    if rank == 1:
        def broken(path):
            raise OSError("injected failure writing the optimizer state")
        tg.engine.save_state = broken
    try:
        opt.save_state(folder)
        raised = None
    except Exception as e:  # noqa: BLE001 (recorded for the test)
        raised = (type(e).__name__, str(e))
    finally:
        tg.engine.__dict__.pop("save_state", None)
    return {"raised": raised, "files": sorted(os.listdir(folder))}


def swt_module():
    import strideweave.torch as swt
    return swt


def _fused(source: str, target: str, mxfp4_source: str, mxfp4_target: str, group) -> dict:
    """save_pretrained of a GPT-OSS (its experts stored fused, one tensor for all of them) sharded over the ranks,
    untouched; and of an MXFP4 GPT-OSS with quantize=True (refused)."""
    import strideweave.torch as swt
    model = swt.from_pretrained(source, 1 << 20, process_group=group)
    swt.save_pretrained(model, target, max_shard_size=20_000)
    model = swt.from_pretrained(mxfp4_source, 1 << 20, process_group=group)
    try:
        swt.save_pretrained(model, mxfp4_target, quantize=True)
        raised = None
    except Exception as e:  # noqa: BLE001 (recorded for the test)
        raised = (type(e).__name__, str(e))
    return {"raised": raised, "exists": os.path.lexists(mxfp4_target),
            "beside": sorted(n for n in os.listdir(os.path.dirname(mxfp4_target))
                             if os.path.basename(mxfp4_target) in n)}


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
        group = dist.group.WORLD
        if cfg["job"] == "train":
            out = _run(cfg["source"], range(TOTAL), rank, world, group,
                       save={"at": SAVED, "checkpoint": cfg["checkpoint"], "state": cfg["state"],
                             "state_dict": cfg["state_dict"], "failed_state": cfg["failed_state"]})
            out["failed_save"] = _failing_save(out["model"], cfg["failed_target"], rank)
            out["failed_state"] = _failing_state_save(out["opt"], cfg["failed_state"], rank)
            out["fused"] = _fused(cfg["fused_source"], cfg["fused_target"], cfg["mxfp4_source"],
                                  cfg["mxfp4_target"], group)
            swt_module().save_pretrained(swt_module().from_pretrained(cfg["fp8_source"], 1 << 22, process_group=group),
                                         cfg["fp8_target"], quantize=True, max_shard_size=100_000)
        elif cfg["job"] == "resume":
            out = _run(cfg["checkpoint"], range(SAVED, TOTAL), rank, world, group, state=cfg["state"])
        else:  # from the one-process run's checkpoint and state
            out = _run(cfg["one_checkpoint"], range(SAVED, TOTAL), rank, world, group, state=cfg["one_state"])
        del out["model"], out["bindings"], out["opt"]
        torch.save(out, cfg["out"] + ".part")
        os.replace(cfg["out"] + ".part", cfg["out"])
    finally:
        dist.destroy_process_group()


# ============================================================================================ the tests

import torch  # noqa: E402

import hf_families as zoo  # noqa: E402
from test_torch_optim import U, propagate_adamw  # noqa: E402


def _spawn(root: str, job: str, world: int, **paths) -> "list[subprocess.Popen]":
    procs = []
    init = "file://" + os.path.join(root, f"rendezvous-{job}")
    for rank in range(world):
        cfg = {"rank": rank, "world": world, "init": init, "job": job,
               "out": os.path.join(root, f"out-{job}-{rank}.pt"), **paths}
        path = os.path.join(root, f"cfg-{job}-{rank}.json")
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        log = open(os.path.join(root, f"log-{job}-{rank}.txt"), "w")
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        procs.append((cfg, log, subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdout=log,
                                                 stderr=subprocess.STDOUT, env=env)))
    return procs


def _collect(procs) -> list:
    deadline = time.monotonic() + TIMEOUT
    failed = []
    try:
        for cfg, log, p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"{cfg['job']} rank {cfg['rank']}: still running after {TIMEOUT} s")
                continue
            if p.returncode != 0:
                failed.append(f"{cfg['job']} rank {cfg['rank']}: exit status {p.returncode}")
    finally:
        for cfg, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            log.close()
    if failed:
        logs = []
        for cfg, log, p in procs:
            with open(log.name) as fh:
                logs.append(f"--- {cfg['job']} rank {cfg['rank']}\n" + fh.read()[-3000:])
        raise AssertionError("; ".join(failed) + "\n" + "\n".join(logs))
    return [torch.load(cfg["out"], weights_only=False) for cfg, _, _ in procs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("distributed-save"))
    print(f"family={FAMILY} model seed={seed_of(FAMILY)} batch seeds={seed_of(FAMILY) + 100}+step; "
          f"gpt_oss model seed={seed_of('gpt_oss')}")
    source = os.path.join(root, "source")
    zoo.build(FAMILY, seed_of(FAMILY), **FAMILIES[FAMILY]).save_pretrained(source)
    fused = os.path.join(root, "gpt_oss")
    zoo.build("gpt_oss", seed_of("gpt_oss"), **FAMILIES["gpt_oss"]).save_pretrained(fused)
    paths = {"source": source, "checkpoint": os.path.join(root, "saved-2"), "state": os.path.join(root, "state-2"),
             "failed_target": os.path.join(root, "failed", "target"), "fused_source": fused,
             "fused_target": os.path.join(root, "gpt_oss-saved"), "one_checkpoint": os.path.join(root, "saved-1"),
             "one_state": os.path.join(root, "state-1"), "fp8_source": os.path.join(root, "fp8"),
             "fp8_target": os.path.join(root, "fp8-saved-2"), "state_dict": os.path.join(root, "state-dict"),
             "failed_state": os.path.join(root, "failed-state")}
    from test_quantized_models import seed_of as fp8_seed, write_quantized
    print(f"FP8 deepseek_v3 seed={fp8_seed('deepseek_v3')}")
    write_quantized("deepseek_v3", paths["fp8_source"], fp8_seed("deepseek_v3"))
    paths["mxfp4_source"], paths["mxfp4_target"] = os.path.join(root, "mxfp4"), os.path.join(root, "mxfp4-saved")
    write_quantized("gpt_oss", paths["mxfp4_source"], fp8_seed("gpt_oss"))
    paths["fused_one"] = os.path.join(root, "gpt_oss-saved-1")
    swt_module().save_pretrained(swt_module().from_pretrained(fused, 1 << 20), paths["fused_one"])
    os.makedirs(os.path.join(root, "failed"))
    train = _spawn(root, "train", 2, **paths)
    one = _run(source, range(TOTAL), 0, 1, None,  # the one-process run, meanwhile
               save={"at": SAVED, "checkpoint": paths["one_checkpoint"], "state": paths["one_state"]})
    del one["model"], one["bindings"], one["opt"]
    paths["fp8_one"] = os.path.join(root, "fp8-saved-1")
    swt_module().save_pretrained(swt_module().from_pretrained(paths["fp8_source"], 1 << 22), paths["fp8_one"],
                                 quantize=True)
    trained = _collect(train)
    resume = _spawn(root, "resume", 2, **paths) + _spawn(root, "split", 2, **paths)
    resumed_one = _run(paths["checkpoint"], range(SAVED, TOTAL), 0, 1, None, state=paths["state"])
    del resumed_one["model"], resumed_one["bindings"], resumed_one["opt"]
    resumed = _collect(resume)
    return {"trained": trained, "one": one, "resumed": resumed[:2], "split": resumed[2:],
            "resumed_one": resumed_one, **paths}


def _assemble(ranks: list, key) -> dict:
    """name -> the whole tensor from every rank's `key(result)`: the experts' shares concatenated in rank order along
    the experts axis, the replicated parameters rank 0's."""
    out = dict(key(ranks[0]))
    for n in ranks[0]["expert_names"]:
        out[n] = torch.cat([key(r)[n] for r in ranks], dim=0)
    return out


def _loaded(folder: str) -> dict:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {n: p.detach().double() for n, p in model.named_parameters()}


def _adamw_bound(reference: dict, other: dict, steps: range, history: range) -> dict:
    """name -> the bound on |w' - w| after `steps`, propagated through AdamW (``propagate_adamw`` of
    tests/test_torch_optim.py, the bound of tests/test_distributed.py) from the measured differences of the two runs'
    clipped gradients at each step, the runs equal before the first of `steps`. The reference's AdamW state is
    recomputed in Float64 from its clipped gradients over `history` (m = b1 m + (1 - b1) g, v = b2 v + (1 - b2)
    g^2): the Float32 state the run holds differs from it by a few roundings of relative size u per step, which the
    bound's own rounding terms (2u |m|, 2u sqrt(v) per step) cover."""
    b1, b2 = BETAS
    moments: dict = {}
    bound: dict = {}
    for s in history:
        for n, g in reference["post"][s].items():
            m, v = moments.get(n, (torch.zeros_like(g), torch.zeros_like(g)))
            moments[n] = (b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g)
        if s not in steps:
            continue
        for n, g in reference["post"][s].items():
            state = {"exp_avg": moments[n][0], "exp_avg_sq": moments[n][1], "step": s + 1}
            delta = (other["post"][s][n] - g).abs()
            propagate_adamw(bound, n, delta, state, LR, BETAS, EPS, reference["w_new"][s][n], reference["w_old"][s][n])
    return bound


def _whole(ranks: list) -> dict:
    """A 2-rank run's record with every tensor assembled from the ranks."""
    steps = ranks[0]["post"].keys()
    return {"post": {s: _assemble(ranks, lambda r: r["post"][s]) for s in steps},
            "w_old": {s: _assemble(ranks, lambda r: r["w_old"][s]) for s in steps},
            "w_new": {s: _assemble(ranks, lambda r: r["w_new"][s]) for s in steps},
            "weights": _assemble(ranks, lambda r: r["weights"])}


def test_saved_by_two_ranks_is_what_they_hold(runs):
    """The checkpoint 2 ranks saved, loaded by transformers, holds bit for bit the weights the ranks held at the
    save (copying, no arithmetic): each expert from its owner's tiles (rank 1's experts included: they are only on
    rank 1), the replicated weights from rank 0; one index naming every tensor's shard once, every shard listed
    in the index written, and no file beside them but the config files."""
    trained = runs["trained"]
    assert [r["shares"] for r in trained] == [{p: (0, 3) for p in trained[0]["shares"]},
                                              {p: (3, 6) for p in trained[0]["shares"]}]
    saved = _assemble(trained, lambda r: r["saved"])
    loaded = _loaded(runs["checkpoint"])
    assert set(loaded) == set(saved)
    for n, w in saved.items():
        assert torch.equal(loaded[n], w), f"{n} differs from what the ranks held"
    with open(os.path.join(runs["checkpoint"], "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2, "the small max_shard_size gives several shards, on both ranks"
    assert sorted(os.listdir(runs["checkpoint"])) == sorted(shards + ["config.json", "generation_config.json",
                                                                      "model.safetensors.index.json"])
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    from safetensors import safe_open
    in_files = {}
    size = 0
    for s in shards:
        with safe_open(os.path.join(runs["checkpoint"], s), "pt") as f:
            for k in f.keys():
                assert k not in in_files, f"{k} in {s} and {in_files[k]}"
                in_files[k] = s
                t = f.get_tensor(k)
                size += t.numel() * t.element_size()
    assert in_files == index["weight_map"]
    assert index["metadata"]["total_size"] == size
    assert sorted(n for n in os.listdir(os.path.dirname(runs["checkpoint"])) if ".saved-2" in n) == []


def test_saved_by_two_ranks_matches_one_process(runs):
    """The 2-rank checkpoint against the one-process run's after the same steps, both loaded by transformers:
    within the bound propagated through AdamW from the two runs' measured clipped-gradient differences
    (``_adamw_bound``; the runs start from the same checkpoint), as tests/test_distributed.py bounds them."""
    two = _loaded(runs["checkpoint"])
    one = _loaded(runs["one_checkpoint"])
    reference = runs["one"]
    assert all(torch.equal(one[n], w) for n, w in reference["saved"].items())
    other = _whole(runs["trained"])
    bound = _adamw_bound(reference, other, range(SAVED), range(SAVED))
    worst = 0.0
    for n, w in one.items():
        excess = float(((two[n] - w).abs() - bound[n]["Dw"]).max())
        assert excess <= 0, f"{n}: the 2-rank checkpoint exceeds the bound by {excess:.3e}"
        worst = max(worst, float(((two[n] - w).abs() / (bound[n]["Dw"] + 1e-300)).max()))
    print(f"worst error / bound: {worst:.3f}")


def test_resume_on_two_ranks_continues_exactly(runs):
    """2 ranks resumed from the checkpoint and the state 2 ranks saved: the clipped gradients of every remaining
    step and the final weights are bit for bit the uninterrupted run's."""
    trained, resumed = _whole(runs["trained"]), _whole(runs["resumed"])
    for s in range(SAVED, TOTAL):
        for n, g in trained["post"][s].items():
            assert torch.equal(resumed["post"][s][n], g), f"step {s}: {n}'s gradient differs"
    for n, w in trained["weights"].items():
        assert torch.equal(resumed["weights"][n], w), f"{n} differs after resuming"
    moved = [n for n, w in trained["weights"].items() if not torch.equal(w, trained["w_old"][SAVED][n])]
    assert len(moved) == len(trained["weights"]), "every weight moved after the resume"


def _assert_resumed_within(reference: dict, resumed: dict) -> None:
    """Every final weight of `resumed` within the bound propagated through AdamW (over the steps after the resume)
    from the measured clipped-gradient differences against `reference`, the run that went on uninterrupted."""
    bound = _adamw_bound(reference, resumed, range(SAVED, TOTAL), range(TOTAL))
    worst = 0.0
    for n, w in reference["weights"].items():
        excess = float(((resumed["weights"][n] - w).abs() - bound[n]["Dw"]).max())
        assert excess <= 0, f"{n}: the resumed weights exceed the bound by {excess:.3e}"
        worst = max(worst, float(((resumed["weights"][n] - w).abs() / (bound[n]["Dw"] + 1e-300)).max()))
    print(f"worst error / bound: {worst:.3f}")


def test_resume_on_one_process_from_two_ranks(runs):
    """One process resumed from the 2 ranks' checkpoint and state (each expert's moments and step counts read from
    its saving rank's file): at the resume the weights are exactly the saved ones, and after the remaining steps
    every weight is within the bound propagated through AdamW from the measured clipped-gradient differences
    (the runs equal at the resume, moments included: a lost moment or step count moves the step by about lr)."""
    trained = _whole(runs["trained"])
    resumed = runs["resumed_one"]
    for n, w in resumed["w_old"][SAVED].items():
        assert torch.equal(w, trained["w_old"][SAVED][n]), f"{n} differs at the resume"
    _assert_resumed_within(trained, resumed)


def test_resume_on_two_ranks_from_one_process(runs):
    """2 ranks resumed from the one-process run's checkpoint and state (its one file holds every expert's state:
    each rank takes its own experts' tiles): at the resume the weights are exactly the saved ones, and after the
    remaining steps every weight is within the bound propagated through AdamW from the measured clipped-gradient
    differences against the one-process run that went on uninterrupted."""
    one = runs["one"]
    split = _whole(runs["split"])
    for n, w in split["w_old"][SAVED].items():
        assert torch.equal(w, one["w_old"][SAVED][n]), f"{n} differs at the resume"
    _assert_resumed_within(one, split)


def test_state_dict_across_ranks(runs):
    """state_dict() with one state_folder shared by the 2 ranks: each rank's dict names files of its own (nothing
    overwritten), and load_state_dict() of it into a new optimizer restores the same state, every tile's moments,
    step counts and the hyperparameters, and torch's state."""
    rounds = [r["state_dict"] for r in runs["trained"]]
    assert [r["files"] for r in rounds] == [["tiled_state.0.rank0-of-2.safetensors"],
                                            ["tiled_state.0.rank1-of-2.safetensors"]]
    for rank, r in enumerate(rounds):
        assert r["equal"] and r["torch_equal"], f"rank {rank}: the state after load_state_dict differs"


def test_failed_save_on_one_rank_leaves_nothing(runs):
    """The shard writer raising on rank 1, into a new target and into an existing folder: every rank raises (rank 1
    its own OSError, rank 0 RuntimeError naming rank 1 and its error), nothing appears under the new target's
    name, the existing folder keeps exactly its old file, and nothing is left beside them."""
    failed = [r["failed_save"] for r in runs["trained"]]
    for attempt in range(2):
        kind, message = failed[1]["raised"][attempt]
        assert kind == "OSError" and "injected failure" in message
        kind, message = failed[0]["raised"][attempt]
        assert kind == "RuntimeError" and "rank 1 failed (OSError: injected failure" in message
        assert "nothing was written" in message
    for rank, f in enumerate(failed):
        assert not f["exists"], f"rank {rank}: the target exists"
        assert f["existing"] == {"kept.txt": "the old folder"}, f"rank {rank}: {f['existing']}"
    assert failed[0]["before"] == failed[0]["after"] == ["existing"], failed[0]["after"]
    assert os.listdir(os.path.dirname(runs["failed_target"])) == ["existing"]


def test_failed_state_save_on_one_rank(runs):
    """The optimizer's save_state raising on rank 1 (into the folder of an earlier good save): every rank raises
    (rank 1 its own OSError, rank 0 RuntimeError naming rank 1), and no optimizer.pt is left, so load_state cannot
    take the folder for a complete state."""
    good = runs["trained"][0]["good_state_files"]
    assert good == ["optimizer.pt", "tiled_state.0.rank0-of-2.safetensors", "tiled_state.0.rank1-of-2.safetensors"]
    failed = [r["failed_state"] for r in runs["trained"]]
    assert failed[1]["raised"][0] == "OSError" and "injected failure" in failed[1]["raised"][1]
    kind, message = failed[0]["raised"]
    assert kind == "RuntimeError" and "rank 1 failed (OSError: injected failure" in message
    assert "optimizer.pt was not written" in message
    assert "optimizer.pt" not in os.listdir(runs["failed_state"])


def _saved_tensors(folder: str) -> tuple:
    """(the index, {name: torch tensor}) of a saved checkpoint folder, every tensor read with safetensors'
    safe_open from the shard the index names."""
    from safetensors import safe_open
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for name, filename in index["weight_map"].items():
        with safe_open(os.path.join(folder, filename), "pt") as f:
            out[name] = f.get_tensor(name)
    return index, out


def test_quantized_save_by_two_ranks(runs):
    """quantize=True on 2 ranks (a tiny FP8 DeepSeek-V3 of tests/test_quantized_models.py, stored one matrix per
    expert, opened and saved untouched): every tensor, e4m3 values and Float32 scales, is bit for bit what one
    process writes (each tensor is quantized from the same values by the same arithmetic, whichever rank writes
    it), config.json carries the same quantization_config, and transformers loads it."""
    import transformers

    index2, two = _saved_tensors(runs["fp8_target"])
    index1, one = _saved_tensors(runs["fp8_one"])
    assert len(set(index2["weight_map"].values())) > 2
    assert index2["metadata"] == index1["metadata"]
    assert set(two) == set(one)
    assert any(t.dtype == torch.float8_e4m3fn for t in two.values())
    for n, t in one.items():
        assert two[n].dtype == t.dtype and torch.equal(two[n].view(torch.uint8), t.view(torch.uint8)), n
    configs = [json.load(open(os.path.join(f, "config.json"))) for f in (runs["fp8_target"], runs["fp8_one"])]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["fp8_target"])
    assert sum(p.numel() for p in model.parameters()) > 0


def test_fused_experts_saved_by_two_ranks(runs):
    """A checkpoint storing all of a layer's experts in one tensor per projection (GPT-OSS: (E, H, 2I) and
    (E, I, H), Float32), opened by 2 ranks and saved untouched: each rank writes its experts' rows of those tensors
    into the one shard that holds them; every tensor is bit for bit what one process writes, transformers loads the
    result with the source's weights bit for bit, and each tensor is in one shard only."""
    index2, two = _saved_tensors(runs["fused_target"])
    index1, one = _saved_tensors(runs["fused_one"])
    assert index2["metadata"] == index1["metadata"] and set(two) == set(one)
    fused = [n for n in two if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4 and len(set(index2["weight_map"].values())) > 2
    assert sorted(os.listdir(runs["fused_target"])) == sorted(set(index2["weight_map"].values()) | {
        "config.json", "generation_config.json", "model.safetensors.index.json"}), "no slice file left behind"
    for n, t in one.items():
        assert torch.equal(two[n], t), n
    saved, source = _loaded(runs["fused_target"]), _loaded(runs["fused_source"])
    assert saved.keys() == source.keys()
    for n, w in source.items():
        assert torch.equal(saved[n], w), n


def test_fused_quantized_refused_across_ranks(runs):
    """quantize=True across ranks of a checkpoint storing its experts fused (an MXFP4 GPT-OSS): TypeError on every
    rank (each plans the same refusal before anything is written), nothing under the target name or beside it."""
    for rank, r in enumerate(runs["trained"]):
        kind, message = r["fused"]["raised"]
        assert kind == "TypeError", (rank, kind, message)
        assert "stores all its experts in one tensor" in message and "nothing was written" in message
        assert not r["fused"]["exists"] and r["fused"]["beside"] == []
    assert not os.path.lexists(runs["mxfp4_target"])

if __name__ == "__main__":
    worker(sys.argv[1])
