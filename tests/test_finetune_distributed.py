"""``python -m strideweave.finetune`` under torchrun (Note [The command under torchrun], Note [A lost rank] in
python/strideweave/finetune/_dist.py; docs/guide.md, "Fine-tuning on several processes or hosts", "Under torchrun").

The model: tests/test_finetune_command.py's tiny Qwen3-MoE (8 experts per MoE layer, 2 layers) with its byte-level
BPE tokenizer and 60 paragraphs of a licence text, so nothing is downloaded. The runs (4 steps of 2 micro-batches
of 2 rows of 32 tokens, AdamW with weight decay, warm-up, clipping below the total norm, a checkpoint every 2
steps):

* one process: ``strideweave.finetune.main`` in this process;
* two processes as two hosts: two torchrun agents (``--nnodes 2 --node-rank 0/1 --nproc-per-node 1
  --master-addr 127.0.0.1 --master-port P``, the multi-host arguments on loopback), each rank owning 4 experts of
  each layer and one row of each micro-batch;
* two processes under one agent (``--nproc-per-node 2``) with rank 1 killed by the command's test hook
  (``STRIDEWEAVE_FINETUNE_TEST_KILL``), mid-step or mid-checkpoint, then resumed with ``--resume`` on 2 ranks and
  on 1; and rank 0 killed mid-step, named by rank 1;
* a micro-batch that does not split over the ranks, refused by every rank.

Every subprocess has a timeout; the collectives' timeout (``--dist-timeout``) is COLLECTIVE_TIMEOUT.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strideweave.finetune as ft  # noqa: E402

import hf_families as zoo  # noqa: E402  (tests/hf_families.py)
from test_finetune_command import VOCAB, corpus, make_tokenizer, paragraphs, safetensors_of  # noqa: E402
from test_torch_optim import U, propagate_adamw  # noqa: E402

STEPS, SEQ, ROWS, ACCUM = 4, 32, 2, 2
LR, WD, WARMUP, MAX_NORM, SEED = 1e-3, 0.1, 1, 0.5, 2  # seed 2: no near tie in routing (checked)
OPTIONS = ["--budget", "256KiB", "--batch-tokens", str(SEQ * ROWS), "--seq-len", str(SEQ), "--grad-accum",
           str(ACCUM), "--max-steps", str(STEPS), "--lr", repr(LR), "--warmup", str(WARMUP), "--max-grad-norm",
           repr(MAX_NORM), "--weight-decay", repr(WD), "--seed", str(SEED), "--save-every", "2", "--no-progress"]
COLLECTIVE_TIMEOUT = 90  # seconds (--dist-timeout): a survivor that only stopped by it fails the fault test
RUN_TIMEOUT = 240  # seconds for any torchrun launch
# A survivor stops within: detection (immediate: the killed rank's sockets are closed by the kernel, and torchrun's
# agent sends SIGTERM within its 0.1 s monitor interval) + the probe for the lost rank (LOST_WAIT = 5 s) + its exit
# and torchrun's report (interpreter shutdown, a few seconds on this loaded 2-core machine). 30 s leaves room for
# the load and is a third of COLLECTIVE_TIMEOUT, so a survivor that waited for the timeout instead fails.
STOP_BOUND = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]


def command(folders, out, *extra) -> list:
    return ["-m", "strideweave.finetune", folders["model"], "--data", folders["data"], "--output", str(out),
            *OPTIONS, "--dist-timeout", str(COLLECTIVE_TIMEOUT), *map(str, extra)]


def environment(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_two_hosts(folders, out) -> None:
    """Two torchrun agents, one rank each, rendezvous on 127.0.0.1 as two hosts would (node rank 0 hosts it)."""
    port = free_port()
    procs = [subprocess.Popen(torchrun("--nnodes", 2, "--node-rank", node, "--nproc-per-node", 1, "--master-addr",
                                       "127.0.0.1", "--master-port", port, *command(folders, out)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
             for node in (0, 1)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for node, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node}: exit status {p.returncode}\n{text[-4000:]}"


def run_one_host(folders, out, *extra, env=None) -> tuple:
    """torchrun --nproc-per-node 2 on loopback: (exit status, output, seconds)."""
    began = time.time()
    r = subprocess.run(torchrun("--nproc-per-node", 2, "--master-addr", "127.0.0.1", "--master-port", free_port(),
                                *command(folders, out, *extra)),
                       capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env or environment())
    return r.returncode, r.stdout + r.stderr, time.time()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"model": the tiny Qwen3-MoE + tokenizer, "data": 60 paragraphs}, as tests/test_finetune_command.py builds
    them."""
    root = tmp_path_factory.mktemp("finetune-distributed")
    model = zoo.build("qwen3_moe", 0, vocab_size=VOCAB)
    out = {"model": str(root / "model"), "data": str(root / "data.jsonl"), "root": root}
    model.save_pretrained(out["model"])
    make_tokenizer(corpus(), True).save_pretrained(out["model"])
    with open(out["data"], "w") as f:
        for p in paragraphs(60):
            f.write(json.dumps({"text": p}) + "\n")
    return out


@pytest.fixture(scope="module")
def runs(folders):
    """The one-process run (in this process) and the two-process run (two agents, as two hosts)."""
    root = folders["root"]
    one, two = root / "one", root / "two"
    code = ft.main([folders["model"], "--data", folders["data"], "--output", str(one), *OPTIONS])
    assert code == 0
    run_two_hosts(folders, two)
    return {"one": one, "two": two}


@pytest.fixture(scope="module")
def reference(folders):
    """The replay in RAM with the bounds for 1 and 2 ranks (``replay``)."""
    print(f"model seed 0, data seed {SEED}")
    return replay(folders, (1, 2))


# ------------------------------------------------------------------------------------------------ the replay


def replay(folders, worlds) -> dict:
    """The command's steps in RAM with torch (Float32; the same groups, schedule, clipping and accumulation over
    the same rows), with each micro-batch's gradient accumulated rank part by rank part (the rows rank r of N
    takes), and, for each world size N in `worlds`, the bound Dw on each weight's distance to the command's run on
    N ranks (examples/finetune_command_demo.py, Note [The bound of the check], with the gradient's bound per part):

      dg = sum over micro-batches and rank parts of (2e-5 + (N - 1) u) max|part|

    per tensor: each part's Float32 parity bound (1e-5 of its largest magnitude, tests/test_hf_families.py), doubled
    for the earlier steps' weight differences moving the gradient by as much again (the demo's derivation), plus
    all_reduce_gradients' N - 1 additions of the parts (u each of their sum; the division by N = 1, 2 is exact).
    Clipping: the norms differ by at most ||dg||_2 (triangle inequality), so while it clips the factor moves by
    dc <= c ||dg||_2 / (|g| - ||dg||_2), and the clipped gradients by Dg = c dg + dc |g|; AdamW then carries Dg into
    Dw (propagate_adamw of tests/test_torch_optim.py, with each side's rounding). Each step's loss: within
    1e-5 |loss| + 2 sum |g| Dw (the forward's parity at equal weights, and first order in the weights' distance,
    doubled for the higher orders).

    Also returned: per step and MoE layer the smallest gap between the k-th and (k+1)-th router logits relative to
    the largest logit (the runs route alike only if no token is near a tie)."""
    from strideweave.finetune import Packing, read_records, tokenize
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["model"])
    packing = Packing(tokenize(read_records(folders["data"])[0], tokenizer, folders["data"]), SEQ, ROWS, ACCUM, SEED)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["model"], dtype=torch.float32).train()
    model.config.use_cache = False
    params = dict(model.named_parameters())
    original = {n: p.detach().double().clone() for n, p in params.items()}
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    betas, eps = opt.defaults["betas"], opt.defaults["eps"]
    k = model.config.num_experts_per_tok
    gaps: list = []
    hooks = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            def hook(mod, args, output):
                top = torch.topk(output[0].detach(), k + 1, dim=-1).values
                gaps.append(float(((top[:, k - 1] - top[:, k]) / output[0].detach().abs().max()).min()))
            hooks.append(module.register_forward_hook(hook))
    bounds = {N: {} for N in worlds}
    losses, loss_bounds = [], {N: [] for N in worlds}
    try:
        for step in range(STEPS):
            dg = {N: {n: 0.0 for n in params} for N in worlds}
            previous = {n: torch.zeros_like(p) for n, p in params.items()}
            total = 0.0
            for rows in packing.step(step):
                for N in worlds:
                    assert ROWS % N == 0
                parts = 2  # the finest split of the worlds compared (1 and 2 ranks); a part is one row here
                for r in range(parts):
                    ids = torch.from_numpy(rows[r * ROWS // parts:(r + 1) * ROWS // parts])
                    out = model(input_ids=ids, labels=ids, use_cache=False)
                    (out.loss / (parts * ACCUM)).backward()
                    total += float(out.loss.detach()) / parts
                    for n, p in params.items():
                        part = float((p.grad - previous[n]).abs().max())
                        for N in worlds:
                            dg[N][n] += (2e-5 + (N - 1) * U) * part
                        previous[n] = p.grad.clone()
            loss = total / ACCUM
            grads = {n: p.grad.double() for n, p in params.items()}
            norm = float(torch.sqrt(sum((g * g).sum() for g in grads.values())))
            assert norm > 2 * MAX_NORM, f"step {step}: total norm {norm} does not clip"
            clip = {}
            for N in worlds:
                Dw = bounds[N]
                loss_bounds[N].append(1e-5 * abs(loss) + 2 * sum(float((grads[n].abs() * Dw[n]["Dw"]).sum())
                                                                 for n in Dw))
                norm_err = sum(dg[N][n] ** 2 * params[n].numel() for n in params) ** 0.5
                c = min(1.0, MAX_NORM / (norm + 1e-6))
                dc = c * norm_err / (norm - norm_err)
                clip[N] = (c, dc)
            losses.append(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=False)
            lr = float(sched.get_last_lr()[0])
            w_old = {n: p.detach().double().clone() for n, p in params.items()}
            opt.step()
            sched.step()
            for n, p in params.items():
                for N in worlds:
                    c, dc = clip[N]
                    delta = c * dg[N][n] + dc * grads[n].abs()
                    propagate_adamw(bounds[N], n, delta, opt.state[p], lr, betas, eps, p.detach().double(), w_old[n])
            opt.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    return {"weights": {n: p.detach().double() for n, p in params.items()}, "original": original,
            "bounds": {N: {n: b["Dw"] for n, b in bounds[N].items()} for N in worlds}, "losses": losses,
            "loss_bounds": loss_bounds, "gap": min(gaps)}


def weights_of(folder) -> dict:
    return {n: t.double() for n, t in safetensors_of(folder).items()}


def torch_names(folder) -> dict:
    """The saved checkpoint as transformers loads it (experts fused as the module holds them), in Float64."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return {n: p.detach().double() for n, p in model.named_parameters()}


def losses_of(folder) -> list:
    rows = (folder / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,tokens"
    return [r.split(",") for r in rows[1:]]


# ------------------------------------------------------------------------------------------------------ tests


def test_two_processes_match_one(folders, runs, reference):
    """The command on 2 ranks (two torchrun agents, as two hosts) and in one process: both final checkpoints (as
    transformers loads them) within their bounds of the in-RAM replay (docstring of ``replay``), and so of each
    other by the sum of the two bounds; the same steps, tokens and learning rates in loss.csv, the losses within
    their bounds; the bound resolves the training (most weights move by more than 10 times it); and no token's
    routing is near a tie: the gap between the k-th and (k+1)-th router logit is above 1e-4 of the largest logit,
    10 times the forward's Float32 parity bound (1e-5, tests/test_hf_families.py), which with the weights' distance
    (a fraction of that here) bounds how far the runs' logits are apart, so both runs route every token alike (the
    data seed is one for which this holds: with seed 3 a token's gap is 8e-6)."""
    ref = reference
    assert ref["gap"] > 1e-4, f"a token's routing is near a tie (relative gap {ref['gap']:.2e})"
    got = {1: torch_names(runs["one"]), 2: torch_names(runs["two"])}
    for N, weights in got.items():
        assert sorted(weights) == sorted(ref["weights"])
        worst = 0.0
        for n, w in ref["weights"].items():
            err = (weights[n] - w).abs()
            excess = float((err - ref["bounds"][N][n]).max())
            assert excess <= 0, f"{N} rank(s): {n} exceeds its bound by {excess:.3e}"
            worst = max(worst, float((err / ref["bounds"][N][n].clamp(min=1e-300)).max()))
        print(f"{N} rank(s): worst |run - replay| / bound {worst:.3f}")
    for n in ref["weights"]:
        excess = float(((got[2][n] - got[1][n]).abs() - ref["bounds"][1][n] - ref["bounds"][2][n]).max())
        assert excess <= 0, f"2 ranks against 1: {n} exceeds the two bounds by {excess:.3e}"
    moved = resolved = 0
    for n, w in ref["weights"].items():
        movement = (w - ref["original"][n]).abs()
        moved += int((movement > 0).sum())
        resolved += int((movement > 10 * ref["bounds"][2][n]).sum())
    print(f"{resolved / moved:.1%} of the trained weights moved more than 10x their bound")
    assert resolved / moved > 0.75, "the bound is too loose for the comparison to mean anything"
    one, two = losses_of(runs["one"]), losses_of(runs["two"])
    assert [r[0] for r in one] == [r[0] for r in two] == [str(s) for s in range(1, STEPS + 1)]
    assert [r[2] for r in one] == [r[2] for r in two] and [r[3] for r in one] == [r[3] for r in two]
    assert [int(r[3]) for r in two] == [SEQ * ROWS * ACCUM * s for s in range(1, STEPS + 1)]  # the global batch
    for N, rows in ((1, one), (2, two)):
        for s, (row, loss, bound) in enumerate(zip(rows, ref["losses"], ref["loss_bounds"][N])):
            assert abs(float(row[1]) - loss) <= bound, f"{N} rank(s), step {s + 1}: loss {row[1]} vs {loss!r}"


def test_two_processes_write_one_checkpoint(runs):
    """The 2-rank run's OUT_DIR is what one process writes: checkpoint-2, checkpoint-4 (complete: trainer state,
    index, optimizer state), loss.csv, loss.png, the final model and tokenizer, nothing hidden left; the
    replicated and expert tensors of every checkpoint are those the index names, every one written once."""
    names = sorted(os.listdir(runs["two"]))
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-2", "checkpoint-4"]
    assert not [n for n in names if n.startswith(".")], names
    assert {"loss.csv", "loss.png", "config.json", "tokenizer.json"} <= set(names)
    for folder in (runs["two"], runs["two"] / "checkpoint-2", runs["two"] / "checkpoint-4"):
        assert sorted(weights_of(folder)) == sorted(weights_of(runs["one"])), folder
    for ck in ("checkpoint-2", "checkpoint-4"):
        state = json.loads((runs["two"] / ck / "trainer_state.json").read_text())
        assert state["step"] == int(ck[11:]) and state["ranks"] == 2
        assert (runs["two"] / ck / "optimizer").is_dir()


def test_micro_batch_not_divisible_is_refused(folders, tmp_path):
    """A micro-batch whose rows do not split evenly over the ranks: every rank refuses before anything is written
    (one error line, from rank 0, exit status 2 from each rank; no output folder)."""
    out = tmp_path / "out"
    code, text, _ = run_one_host(folders, out, "--batch-tokens", str(SEQ * 3))
    assert code != 0, text
    lines = [ln for ln in text.splitlines() if ln.startswith("python -m strideweave.finetune: error:")]
    assert len(lines) == 1 and "cannot be split evenly over 2 ranks" in lines[0], text[-3000:]
    assert "exitcode  : 2" in text, text[-3000:]
    assert not out.exists()


KILLED = re.compile(r"test hook: rank 1 SIGKILL at step (\d+) \((\w+)\) at ([0-9.]+)")


@pytest.mark.parametrize("step,where", [(3, "forward"), (4, "save")])
def test_a_rank_killed_stops_the_other_and_resume_continues(folders, runs, reference, tmp_path, step, where):
    """Rank 1 sends itself SIGKILL (the command's test hook) at step 3 after its first micro-batch's forward, or at
    step 4 after writing its part of checkpoint-4: rank 0 exits with status 1 within STOP_BOUND seconds of the
    kill, naming rank 1 as lost; OUT_DIR holds checkpoint-2 only, bit for bit the uninterrupted 2-rank run's, and
    no hidden temporary folder; ``--resume`` on 2 ranks then finishes with the uninterrupted run's loss.csv and
    final weights, bit for bit. After the kill mid-step, a copy of OUT_DIR resumed in one process (the experts
    and their moments re-sharded from 2 ranks to 1 on load) finishes within the 2-rank bound of the replay (steps 1
    and 2 on 2 ranks, 3 and 4 on one: each step's gradient bound for 2 ranks covers one rank's), its loss.csv
    starting with the 2-rank run's two rows."""
    out = tmp_path / "out"
    env = environment(STRIDEWEAVE_FINETUNE_TEST_KILL=f"1:{step}:{where}")
    code, text, ended = run_one_host(folders, out, env=env)
    killed = KILLED.search(text)
    assert killed and killed.group(1, 2) == (str(step), where), text[-4000:]
    assert code != 0
    survivor = [ln for ln in text.splitlines() if ln.startswith("python -m strideweave.finetune: error:")]
    assert len(survivor) == 1, text[-4000:]
    phase = f"at step {step}" if where == "forward" else f"while writing checkpoint-{step}"
    assert f"rank 1 of 2 was lost {phase}" in survivor[0], survivor[0]
    assert "rerun with --resume to continue from step 2" in survivor[0], survivor[0]
    assert "exitcode  : 1" in text, text[-4000:]  # rank 0's own status, in torchrun's report
    elapsed = ended - float(killed.group(3))
    print(f"rank 0 and torchrun stopped {elapsed:.1f} s after the kill (bound {STOP_BOUND} s)")
    assert elapsed < STOP_BOUND
    names = sorted(os.listdir(out))
    assert names == ["checkpoint-2", "loss.csv"], names
    for sub in (".", "optimizer"):
        a, b = safetensors_of(out / "checkpoint-2" / sub), safetensors_of(runs["two"] / "checkpoint-2" / sub)
        assert sorted(a) == sorted(b) and a, sub
        for n in a:
            assert torch.equal(a[n], b[n]), f"checkpoint-2/{sub}: {n}"

    if where == "forward":
        other = tmp_path / "other"
        shutil.copytree(out, other)
        code = ft.main([folders["model"], "--data", folders["data"], "--output", str(other), *OPTIONS, "--resume"])
        assert code == 0
        got = torch_names(other)
        for n, w in reference["weights"].items():
            excess = float(((got[n] - w).abs() - reference["bounds"][2][n]).max())
            assert excess <= 0, f"resumed on 1 rank: {n} exceeds its bound by {excess:.3e}"
        rows, two = losses_of(other), losses_of(runs["two"])
        assert rows[:2] == two[:2] and [r[2:] for r in rows] == [r[2:] for r in two]
        for s, row in enumerate(rows[2:], 2):
            assert abs(float(row[1]) - reference["losses"][s]) <= reference["loss_bounds"][2][s], row

    code, text, _ = run_one_host(folders, out, "--resume")
    assert code == 0, text[-4000:]
    assert (out / "loss.csv").read_bytes() == (runs["two"] / "loss.csv").read_bytes()
    a, b = safetensors_of(out), safetensors_of(runs["two"])
    assert sorted(a) == sorted(b) and a
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_rank_0_killed_is_named_by_rank_1(folders, tmp_path):
    """Rank 0 (which writes loss.csv and renames checkpoints) killed at step 3 mid-step: rank 1 names it, within
    STOP_BOUND seconds (torchrun's agent hosts the rendezvous store, so rank 1 can still ask it), and OUT_DIR keeps
    the complete checkpoint-2 and no other checkpoint-N."""
    out = tmp_path / "out"
    code, text, ended = run_one_host(folders, out, env=environment(STRIDEWEAVE_FINETUNE_TEST_KILL="0:3:forward"))
    killed = re.search(r"test hook: rank 0 SIGKILL at step 3 \(forward\) at ([0-9.]+)", text)
    assert killed and code != 0, text[-4000:]
    survivor = [ln for ln in text.splitlines() if ln.startswith("python -m strideweave.finetune: error:")]
    assert len(survivor) == 1 and "rank 0 of 2 was lost at step 3" in survivor[0], text[-4000:]
    assert "rerun with --resume to continue from step 2" in survivor[0], survivor[0]
    assert ended - float(killed.group(1)) < STOP_BOUND
    assert [n for n in sorted(os.listdir(out)) if n.startswith("checkpoint-")] == ["checkpoint-2"]
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
