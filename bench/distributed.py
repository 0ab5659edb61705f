"""distributed: fine-tuning a transformers MoE on 1, 2 and 4 processes (expert parallelism over
``torch.distributed``, gloo on loopback), measured per rank. Not a ratio benchmark and not in ``make bench``'s run
(bench/run_all.py leaves it out): a documented run (docs/performance.md, "Fine-tuning on several processes").

The model: a Mixtral (default) or DeepSeek-V3 from ``tests/hf_families.py``'s zoo at hidden 256, expert
intermediate 512, 8 routed experts, top-2, 4 layers (DeepSeek-V3: layer 0 dense, 3 MoE layers, one shared
expert), built from its config with seeded weights (``--seed``, printed) in Float32 and saved with
``save_pretrained`` into a temporary folder. Every world size fine-tunes that same folder on the same global batch
per step (``--batch`` sequences of ``--seq`` tokens, step s drawn from seed + 100 + s; rank r of N takes rows
``[r B / N, (r + 1) B / N)``): each rank is a process of its own (this file with ``--worker``, spawned here, a
``file://`` rendezvous, a timeout on every collective) that opens the folder with
``strideweave.torch.from_pretrained(folder, budget, process_group=WORLD)`` and runs, per step, forward and
backward of its rows' mean loss, ``all_reduce_gradients``, ``clip_grad_norm_(model, 1.0)`` and
``strideweave.torch.AdamW``'s step. Step 0 is a warm-up; the others are timed, between barriers. Each rank runs
torch with ``cores // N`` threads (at least one).

Each rank's budget is ``--budget-fraction`` (default 1/4) of its own share of experts + gradients + AdamW moments
(4 x the share's weight bytes), so the whole job has the same total budget at every world size and every rank
must evict: its scratch files fill with what the budget does not hold.

Reported per rank (the table; every figure is the rank's own):

* peak RSS (``VmHWM`` of /proc/self/status at the end), the RSS before ``from_pretrained`` (the interpreter with
  torch and transformers imported, the process group joined) and after it and the optimizer's construction, so
  the differences are what opening and training cost;
* the experts it owns per MoE layer and their weight bytes over all layers (the share: E / N experts a layer),
  the bytes it read from the checkpoint's files (``Checkpoint.bytes_read`` over the whole run: the share once,
  plus the re-reads of clean tiles the budget evicted before they were stepped) and the bytes its scratch files
  hold on disk at the end of a step (the most over the steps): the sum of the allocated blocks (``st_blocks`` x
  512) of every file the process has open whose name is gone, the engine's anonymous overlays and scratch files
  (the experts' stepped weights the budget evicted, their gradients, AdamW's moments);
* tokens/s of the whole job (the global batch's tokens over the median timed step, the same on every rank: the
  steps start and end on barriers);
* the seconds per step spent inside ``torch.distributed.all_to_all_single`` (the experts' exchanges: the library
  calls the module's attribute, which the worker wraps with a timer and a byte counter before opening the model;
  the library itself is unchanged) and inside ``torch.distributed.all_reduce`` (the replicated gradients, the
  clipping norm). A blocking collective returns when its peers have arrived, so these times include waiting for
  the slowest rank (load imbalance, oversubscribed cores), not only moving bytes;
* the bytes per step the exchanges send to other ranks (rows sent to itself are not communication) and what they
  pass in all (self included): hidden rows and their outputs forward, their gradients backward, the experts'
  indices, the counts; and the bytes of the tensors all-reduced.

Checked exactly (``check``; a failure is printed and the exit status is 1): the exchanges' bytes averaged over
the ranks against the formula (4 exchanges of T k rows of H values per MoE layer and step, T k indices, N
counts), the shares partitioning the experts, and every replicated gradient all-reduced. An extra exchange in
backward, for one, fails it. Printed after the table, on paper: the same formula for a DeepSeek-V3-sized model
(``DeepseekV3Config()``'s defaults, built on the meta device) at ``--estimate-tokens`` tokens per rank, with the
all-reduce of its replicated gradients, in seconds at 10 and 100 Gbit/s.

The record (last line, JSON): ``{"bench": "distributed", "measurement": true, ...}`` with every rank's figures and
the model's sizes; no ratio and no target (bench/run_all.py does not run it).

What a 2-core machine shows: bytes (read, on disk, exchanged) and RSS per rank are the rank's own and do not
depend on the cores; speed does: 2 and 4 processes share 2 cores (4 oversubscribe them), so tokens/s and the
time in the collectives (which include the waits for a descheduled peer) say nothing about scaling across hosts.

Usage: python bench/distributed.py [--family mixtral|deepseek_v3] [--worlds 1 2 4] [--steps 4] [--batch 8]
[--seq 64] [--hidden 256] [--intermediate 512] [--layers 4] [--budget-fraction 0.25] [--estimate-tokens 4096]
[--quick] (--quick: 3 steps of 4 x 32 tokens; the default takes under a minute on 2 cores.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
COLLECTIVE_TIMEOUT = 300  # seconds a collective waits before torch.distributed gives up (no hang)
RUN_TIMEOUT = 900  # seconds for one world size's processes together
MAX_NORM, LR = 1.0, 1e-4


# ============================================================================================ measuring, in a rank


def vm_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM: peak resident set; VmRSS: now)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def scratch_on_disk() -> tuple:
    """(allocated bytes, apparent bytes, files) of the files this process has open whose name is gone: the
    engine's anonymous overlays and scratch files (O_TMPFILE, or created and unlinked)."""
    allocated = apparent = files = 0
    fd_dir = "/proc/self/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
            if not target.startswith("/") or not target.endswith(" (deleted)"):
                continue
            st = os.stat(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile (the listing's own fd among them)
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        allocated += st.st_blocks * 512
        apparent += st.st_size
        files += 1
    return allocated, apparent, files


class Meter:
    """Wraps torch.distributed.all_to_all_single and all_reduce (module attributes, looked up at each call by the
    library): time inside them and bytes, while `on`."""

    def __init__(self, dist, rank: int, world: int):
        self.dist, self.rank, self.world, self.on = dist, rank, world, False
        self.a2a_s = self.ar_s = 0.0
        self.a2a_calls = self.ar_calls = 0
        self.sent = {"rows": 0, "ids": 0, "counts": 0}  # bytes to other ranks
        self.passed = {"rows": 0, "ids": 0, "counts": 0}  # bytes handed to the exchange, self included
        self.rows_sent = self.rows_received = 0  # (token, expert) rows of hidden values, other ranks only
        self.ar_bytes = 0
        self._a2a, self._ar = dist.all_to_all_single, dist.all_reduce
        dist.all_to_all_single, dist.all_reduce = self.all_to_all_single, self.all_reduce

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if not self.on:
            return self._a2a(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
        t0 = time.perf_counter()
        result = self._a2a(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
        self.a2a_s += time.perf_counter() - t0
        self.a2a_calls += 1
        n = input.shape[0]
        row = input.element_size() * math.prod(input.shape[1:])
        splits = list(input_split_sizes) if input_split_sizes else [n // self.world] * self.world
        recv = list(output_split_sizes) if output_split_sizes else [output.shape[0] // self.world] * self.world
        kind = "rows" if input.is_floating_point() else ("counts" if input_split_sizes is None else "ids")
        self.passed[kind] += n * row
        self.sent[kind] += (n - splits[self.rank]) * row
        if kind == "rows":
            self.rows_sent += n - splits[self.rank]
            self.rows_received += sum(recv) - recv[self.rank]
        return result

    def all_reduce(self, tensor, *args, **kwargs):
        if not self.on:
            return self._ar(tensor, *args, **kwargs)
        t0 = time.perf_counter()
        result = self._ar(tensor, *args, **kwargs)
        self.ar_s += time.perf_counter() - t0
        self.ar_calls += 1
        self.ar_bytes += tensor.numel() * tensor.element_size()
        return result


def global_batch(cfg: dict, step: int):
    import torch
    g = torch.Generator().manual_seed(cfg["seed"] + 100 + step)
    return torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)


def worker(config_path: str) -> None:
    import torch
    import torch.distributed as dist
    with open(config_path) as fh:
        cfg = json.load(fh)
    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        import strideweave.torch as swt
        meter = Meter(dist, rank, world)
        rss_before = vm_kib("VmRSS") * 1024
        share_experts = sum(len(swt.expert_share(cfg["experts"], rank, world)) for _ in range(cfg["moe_layers"]))
        budget = max(cfg["expert_bytes"], int(cfg["budget_fraction"] * 4 * share_experts * cfg["expert_bytes"]))
        model = swt.from_pretrained(cfg["folder"], budget, process_group=dist.group.WORLD)
        bindings = list(swt.offloaded_experts(model).values())
        ckpt = bindings[0].checkpoint
        opt = swt.AdamW(model, lr=LR)
        rss_opened = vm_kib("VmRSS") * 1024
        per = cfg["batch"] // world
        rows = slice(rank * per, (rank + 1) * per)
        walls, a2a, ar, disk, losses, read = [], [], [], [], [], []
        for step in range(cfg["steps"]):
            timed = step > 0
            ids = global_batch(cfg, step)[rows]
            dist.barrier()
            meter.on = timed
            a2a0, ar0 = meter.a2a_s, meter.ar_s
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            swt.all_reduce_gradients(model)
            swt.clip_grad_norm_(model, MAX_NORM)
            opt.step()
            meter.on = False
            dist.barrier()
            wall = time.perf_counter() - t0
            losses.append(float(loss))
            disk.append(scratch_on_disk())
            read.append(ckpt.bytes_read)
            if timed:
                walls.append(wall)
                a2a.append(meter.a2a_s - a2a0)
                ar.append(meter.ar_s - ar0)
        timed_steps = cfg["steps"] - 1
        result = {
            "rank": rank, "world": world, "threads": cfg["threads"], "budget": budget,
            "owned": [[b.experts_range.start, b.experts_range.stop] for b in bindings],
            "share_bytes": sum(len(b.experts_range) * b.expert_bytes for b in bindings),
            "bytes_read": ckpt.bytes_read, "bytes_read_after_step": read,
            "scratch_allocated": max(d[0] for d in disk), "scratch_apparent": max(d[1] for d in disk),
            "scratch_files": max(d[2] for d in disk),
            "budget_peak": bindings[0].budget.stats()["peak_bytes"],
            "evictions": sum(t.carrier.stats()["evictions"] for b in bindings for t in b.tiled.values()),
            "rss_before": rss_before, "rss_opened": rss_opened, "peak_rss": vm_kib("VmHWM") * 1024,
            "wall_s": sum(walls), "step_s": statistics.median(walls),
            "a2a_s_per_step": sum(a2a) / timed_steps, "ar_s_per_step": sum(ar) / timed_steps,
            "a2a_calls_per_step": meter.a2a_calls / timed_steps,
            "sent_per_step": {k: v / timed_steps for k, v in meter.sent.items()},
            "passed_per_step": {k: v / timed_steps for k, v in meter.passed.items()},
            "passed_total": dict(meter.passed), "timed_steps": timed_steps,
            "rows_sent_per_step": meter.rows_sent / timed_steps,
            "rows_received_per_step": meter.rows_received / timed_steps,
            "ar_bytes_per_step": meter.ar_bytes / timed_steps, "ar_calls_per_step": meter.ar_calls / timed_steps,
            "losses": losses,
        }
        del opt, model, bindings, ckpt
        with open(cfg["out"] + ".part", "w") as fh:
            json.dump(result, fh)
        os.replace(cfg["out"] + ".part", cfg["out"])
    finally:
        dist.destroy_process_group()


# ============================================================================================ the driver


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def build_model(args, folder: str) -> dict:
    """The seeded model saved in `folder`; its sizes."""
    sys.path.insert(0, TESTS)
    import hf_families as zoo
    overrides = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, max_position_embeddings=max(64, args.seq))
    if args.family == "mixtral":
        overrides.update(intermediate_size=args.intermediate, num_local_experts=args.experts)
    else:  # deepseek_v3: layer 0 dense (first_k_dense_replace=1), the others MoE with a shared expert
        overrides.update(moe_intermediate_size=args.intermediate, intermediate_size=2 * args.intermediate,
                         n_routed_experts=args.experts)
    model = zoo.build(args.family, args.seed, **overrides)
    model.save_pretrained(folder)
    config = model.config
    k = getattr(config, "num_experts_per_tok")
    moe_layers = sum(1 for n, _ in model.named_modules() if n.endswith(".mlp.experts"))
    expert_bytes = 3 * args.intermediate * args.hidden * 4
    params = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    return {"k": k, "moe_layers": moe_layers, "expert_bytes": expert_bytes, "vocab": config.vocab_size,
            "replicated_params": params, "experts_bytes_total": moe_layers * args.experts * expert_bytes}


def run_world(args, folder: str, sizes: dict, world: int, root: str) -> list:
    init = "file://" + os.path.join(root, f"rendezvous-{world}")
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = []
    for rank in range(world):
        cfg = {"rank": rank, "world": world, "init": init, "out": os.path.join(root, f"out-{world}-{rank}.json"),
               "folder": folder, "threads": threads, "steps": args.steps, "batch": args.batch, "seq": args.seq,
               "seed": args.seed, "experts": args.experts, "budget_fraction": args.budget_fraction, **sizes}
        path = os.path.join(root, f"cfg-{world}-{rank}.json")
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        log = open(os.path.join(root, f"log-{world}-{rank}.txt"), "w")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        procs.append((rank, cfg, log, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", path],
                                                       stdout=log, stderr=subprocess.STDOUT, env=env)))
    deadline = time.monotonic() + RUN_TIMEOUT
    failed = []
    try:
        for rank, cfg, log, p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank}: still running after {RUN_TIMEOUT} s")
                continue
            if p.returncode != 0:
                failed.append(f"rank {rank}: exit status {p.returncode}")
    finally:
        for rank, cfg, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            log.close()
    if failed:
        tails = []
        for rank, cfg, log, p in procs:
            with open(log.name) as fh:
                tails.append(f"--- world {world} rank {rank}\n" + fh.read()[-3000:])
        raise SystemExit(f"world {world}: " + "; ".join(failed) + "\n" + "\n".join(tails))
    out = []
    for rank, cfg, log, p in procs:
        with open(cfg["out"]) as fh:
            out.append(json.load(fh))
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--family", default="mixtral", choices=["mixtral", "deepseek_v3"])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=4, help="steps per run, the first a warm-up (default 4)")
    p.add_argument("--batch", type=int, default=8, help="sequences in the global batch (a multiple of every world)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512, help="expert intermediate size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="each rank's budget: this fraction of its share of experts + gradients + moments")
    p.add_argument("--seed", type=int, default=3636)
    p.add_argument("--estimate-tokens", type=int, default=4096,
                   help="tokens per rank and step of the DeepSeek-V3-sized estimate (default 4096)")
    p.add_argument("--quick", action="store_true", help="3 steps of 4 x 32 tokens")
    p.add_argument("--quiet", action="store_true", help="only the JSON record")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.quick:
        args.steps, args.batch, args.seq = 3, 4, 32
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first is a warm-up)")
    bad = [w for w in args.worlds if w < 1 or args.batch % w]
    if bad:
        p.error(f"--batch {args.batch} must be a multiple of every world size (not of {bad})")
    sys.path.insert(0, HERE)
    import harness

    def say(*parts):
        if not args.quiet:
            print(*parts, flush=True)

    root = tempfile.mkdtemp(prefix="sw-bench-distributed-")
    try:
        folder = os.path.join(root, args.family)
        sizes = build_model(args, folder)
        machine = cpu_model()
        tokens = args.batch * args.seq
        say(f"CPU: {machine}, {os.cpu_count()} cores; {args.family}, seed {args.seed}: H {args.hidden}, expert "
            f"intermediate {args.intermediate}, {args.experts} experts x {sizes['moe_layers']} MoE layers, top-"
            f"{sizes['k']}: {mib(sizes['experts_bytes_total'])} MiB of experts (Float32), "
            f"{sizes['replicated_params']:,} replicated parameters; global batch {args.batch} x {args.seq} = "
            f"{tokens} tokens, {args.steps} steps (the first a warm-up); budget per rank {args.budget_fraction:g} of "
            f"its share of experts + gradients + moments")
        runs = {}
        for world in args.worlds:
            t0 = time.monotonic()
            runs[world] = run_world(args, folder, sizes, world, root)
            say(f"  world {world}: {time.monotonic() - t0:.1f} s")
        if not args.quiet:
            table(runs, sizes, args, tokens)
        problems = check(runs, sizes, args, tokens)
        for line in problems:
            print(f"CHECK FAILED: {line}", flush=True)
        paper = estimate(args.estimate_tokens)
        if not args.quiet:
            print_estimate(paper)
        record = {"bench": "distributed", "measurement": True, "quick": args.quick, "machine": machine,
                  "cores": os.cpu_count(), "python": platform.python_version(), "family": args.family,
                  "hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts,
                  "moe_layers": sizes["moe_layers"], "k": sizes["k"], "tokens_per_step": tokens,
                  "steps": args.steps, "budget_fraction": args.budget_fraction,
                  "runs": {str(w): [{**r, "tokens_per_s": tokens / r["step_s"]} for r in rs]
                           for w, rs in runs.items()},
                  "estimate": paper, "check_failures": problems}
        harness.emit(record)
        if problems:
            return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def check(runs: dict, sizes: dict, args, tokens: int) -> list:
    """What the figures must satisfy exactly, whatever the machine's speed; one line per failure.

    * The exchanges: a rank hands over its T k (token, expert) rows of H values forward and the gradients of their
      outputs backward (2 T k rows), and the R_r rows routed to its own experts (outputs forward, input gradients
      backward: 2 R_r rows); the R_r of all ranks sum to N T k, so the mean over the ranks is exactly 4 T k rows
      per MoE layer (Float32: 4 bytes a value), plus T k expert indices (int64) and N counts (int64). An extra,
      missing or widened exchange changes the measured bytes.
    * The shares: the ranks' experts partition every layer's experts (their weight bytes sum to the model's).
    * The all-reduce: every replicated gradient (P Float32 values) is reduced at least once a step.
    """
    H, k, L = args.hidden, sizes["k"], sizes["moe_layers"]
    out = []
    for world, ranks in runs.items():
        T = tokens // world
        want = {"rows": 4 * L * T * k * H * 4, "ids": L * T * k * 8, "counts": L * world * 8}
        for key in want:  # in integers: the totals over the ranks and the timed steps
            got = sum(r["passed_total"][key] for r in ranks)
            expected = world * ranks[0]["timed_steps"] * want[key]
            if got != expected:
                out.append(f"N = {world}: the exchanges' {key} average {got / (world * ranks[0]['timed_steps']):,.1f} "
                           f"bytes per rank and step, the formula {want[key]:,}")
        shares = sum(r["share_bytes"] for r in ranks)
        if shares != sizes["experts_bytes_total"]:
            out.append(f"N = {world}: the ranks' shares hold {shares:,} bytes of experts, the model "
                       f"{sizes['experts_bytes_total']:,}")
        low = [r["rank"] for r in ranks if r["ar_bytes_per_step"] < 4 * sizes["replicated_params"]]
        if low:
            out.append(f"N = {world}: ranks {low} all-reduced fewer bytes per step than the replicated gradients' "
                       f"{4 * sizes['replicated_params']:,}")
    return out


def table(runs: dict, sizes: dict, args, tokens: int) -> None:
    H, k, L = args.hidden, sizes["k"], sizes["moe_layers"]
    print()
    print("| N | rank | experts owned / layer | share of expert weights, MiB | read from checkpoint, MiB | "
          "scratch on disk, MiB | budget, MiB | peak RSS, MiB (before opening; opened) | tokens/s (job) | step, s | "
          "all_to_all, s/step | all_reduce, s/step | sent to other ranks, KiB/step (rows + indices + counts) | "
          "all-reduced, KiB/step |")
    print("|" + "---|" * 14)
    for world, ranks in runs.items():
        for r in ranks:
            owned = r["owned"][0]
            sent = r["sent_per_step"]
            print(f"| {world} | {r['rank']} | {owned[1] - owned[0]} ({owned[0]}-{owned[1] - 1}) | "
                  f"{mib(r['share_bytes'])} | {mib(r['bytes_read'])} | {mib(r['scratch_allocated'])} | "
                  f"{mib(r['budget'])} | {mib(r['peak_rss'])} ({mib(r['rss_before'])}; {mib(r['rss_opened'])}) | "
                  f"{tokens / r['step_s']:,.0f} | {r['step_s']:.3f} | {r['a2a_s_per_step']:.3f} | "
                  f"{r['ar_s_per_step']:.3f} | {sent['rows'] / 1024:,.0f} + {sent['ids'] / 1024:,.0f} + "
                  f"{sent['counts'] / 1024:,.2f} | {r['ar_bytes_per_step'] / 1024:,.0f} |")
    print()
    one = runs[min(runs)][0]
    print(f"Per rank, against the rank of N = {min(runs)} (mean over the ranks; x N when the share falls as 1 / N):")
    for world, ranks in runs.items():
        def rel(key):
            return statistics.mean(r[key] for r in ranks) / one[key]
        print(f"  N = {world}: share of expert weights {rel('share_bytes'):.3f} (x N: {rel('share_bytes') * world:.3f}), "
              f"read from the checkpoint {rel('bytes_read'):.3f} (x N: {rel('bytes_read') * world:.3f}), scratch on "
              f"disk {rel('scratch_allocated'):.3f} (x N: {rel('scratch_allocated') * world:.3f}), peak RSS "
              f"{rel('peak_rss'):.3f}, peak RSS above the RSS before opening "
              f"{statistics.mean(r['peak_rss'] - r['rss_before'] for r in ranks) / (one['peak_rss'] - one['rss_before']):.3f}")
    print()
    print(f"Per rank and step, the exchanges by formula: 4 exchanges x L x T k rows x H x 4 bytes (rows) + L x T k x 8 "
          f"(indices) passed, of which (N - 1) / N leave the rank when routing is uniform; L = {L} MoE layers, k = {k}, "
          f"H = {H}, T = tokens per rank")
    for world, ranks in runs.items():
        T = tokens // world
        rows = 4 * L * T * k * H * 4
        ids = L * T * k * 8
        passed = statistics.mean(r["passed_per_step"]["rows"] for r in ranks)
        passed_ids = statistics.mean(r["passed_per_step"]["ids"] for r in ranks)
        sent = statistics.mean(r["sent_per_step"]["rows"] + r["sent_per_step"]["ids"] for r in ranks)
        print(f"  N = {world}: T = {T}: formula {mib(rows + ids)} MiB passed ({mib(rows)} rows + {ids / 1024:,.0f} KiB "
              f"indices), measured {mib(passed + passed_ids)} MiB; uniform share to others "
              f"{mib((rows + ids) * (world - 1) / world)} MiB, measured {mib(sent)} MiB (mean over ranks); "
              f"all-reduced {mib(ranks[0]['ar_bytes_per_step'])} MiB "
              f"({sizes['replicated_params']:,} replicated Float32 gradients = "
              f"{mib(4 * sizes['replicated_params'])} MiB)")


def estimate(T: int) -> dict:
    """The communication per rank and optimizer step of a DeepSeek-V3-sized model (transformers'
    ``DeepseekV3Config()`` defaults, built on the meta device: no weights), BFloat16 values, T tokens per rank:
    the experts' exchanges, 4 L T k H b bytes handed over (hidden rows and outputs forward, their gradients
    backward) plus 8 bytes of expert index per pair, of which (N - 1) / N leave the rank when routing is uniform;
    and a ring all-reduce of the replicated gradients, 2 (N - 1) / N P b bytes sent per rank (once per optimizer
    step, whatever the micro-batches). Against it, the experts' own arithmetic per rank: 6 flops per weight and
    token (forward 2, backward 4) over k routed + the shared experts' 3 H I weights."""
    import torch
    import transformers
    c = transformers.DeepseekV3Config()
    with torch.device("meta"):
        m = transformers.DeepseekV3ForCausalLM(c)
    replicated = sum(p.numel() for n, p in m.named_parameters() if ".experts." not in n)
    total = sum(p.numel() for p in m.parameters())
    del m
    H, k, I = c.hidden_size, c.num_experts_per_tok, c.moe_intermediate_size
    L = c.num_hidden_layers - c.first_k_dense_replace
    b = 2
    per_token_layer = 4 * k * H * b + k * 8
    flops_token_layer = 6 * (k + c.n_shared_experts) * 3 * H * I
    rows = []
    for N in (2, 8, 64):
        exchange = L * T * per_token_layer * (N - 1) / N
        allreduce = 2 * (N - 1) / N * replicated * b
        row = {"N": N, "exchange_bytes": exchange, "all_reduce_bytes": allreduce}
        for gbit in (10, 100):
            rate = gbit * 1e9 / 8
            row[f"exchange_s_{gbit}"] = exchange / rate
            row[f"all_reduce_s_{gbit}"] = allreduce / rate
            row[f"break_even_tflops_{gbit}"] = flops_token_layer / (per_token_layer * (N - 1) / N / rate) / 1e12
        rows.append(row)
    return {"model": "DeepseekV3Config() defaults", "H": H, "k": k, "moe_intermediate": I, "moe_layers": L,
            "routed_experts": c.n_routed_experts, "parameters": total, "replicated_parameters": replicated,
            "bytes_per_value": b, "tokens_per_rank": T, "bytes_per_token_and_layer": per_token_layer,
            "expert_flops_per_token_and_layer": flops_token_layer,
            "expert_flops_per_rank_and_step": flops_token_layer * L * T, "rows": rows}


def print_estimate(e: dict) -> None:
    gb = 1e9
    print()
    print(f"On paper, a DeepSeek-V3-sized model ({e['model']}: H {e['H']}, top-{e['k']} of {e['routed_experts']}, "
          f"{e['moe_layers']} MoE layers, {e['parameters'] / 1e9:.1f} B parameters of which "
          f"{e['replicated_parameters'] / 1e9:.2f} B replicated), BFloat16, T = {e['tokens_per_rank']} tokens per "
          f"rank and step: the exchanges hand over 4 k H b + 8 k = {e['bytes_per_token_and_layer']:,} bytes per "
          f"token and MoE layer; the experts' arithmetic is {e['expert_flops_per_token_and_layer'] / 1e9:.2f} GFLOP "
          f"per token and MoE layer ({e['expert_flops_per_rank_and_step'] / 1e12:,.0f} TFLOP per rank and step)")
    print("| N | exchanges, GB/rank/step | at 10 Gbit/s, s | at 100 Gbit/s, s | all-reduce (ring), GB/rank/step | "
          "at 10 Gbit/s, s | at 100 Gbit/s, s | experts' flop rate at which the exchange takes as long as the "
          "arithmetic, TFLOP/s (10 / 100 Gbit/s) |")
    print("|" + "---|" * 8)
    for r in e["rows"]:
        print(f"| {r['N']} | {r['exchange_bytes'] / gb:,.1f} | {r['exchange_s_10']:,.1f} | {r['exchange_s_100']:,.1f} | "
              f"{r['all_reduce_bytes'] / gb:,.1f} | {r['all_reduce_s_10']:,.1f} | {r['all_reduce_s_100']:,.1f} | "
              f"{r['break_even_tflops_10']:,.1f} / {r['break_even_tflops_100']:,.0f} |")


if __name__ == "__main__":
    sys.exit(main())
