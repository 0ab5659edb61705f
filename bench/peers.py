"""peers: bench/finetune.py's model and step, StrideWeave beside what people use instead on a CPU-only machine.

Systems, each run in a fresh process (its peak RSS, ``ru_maxrss``, is its own), round after round in this order:

* PyTorch in RAM: bench/finetune.py's reference, the example's own worker (``examples/finetune_moe.py
  --_torch-worker``: every tensor in RAM, bf16 compute, Float32 master weights and moments, torch.optim.AdamW).
* StrideWeave: bench/finetune.py's worker (the example's ``train``: the checkpoint opened where it lies, one
  ResidencyBudget of a fifth of experts + gradients + moments, sw.optim.AdamW with Float32 moments).
* DeepSpeed ZeRO-3, parameters and optimizer offloaded to CPU (``deepspeed==0.19.8``, requirements-peers.txt).
* ZeRO-Infinity: the same with ``offload_param`` and ``offload_optimizer`` on device "nvme" (a temporary folder on
  this machine's disk; DeepSpeed's async_io op, built against libaio-dev). Reported as not measured, with the
  reason, when the op cannot be built.

DeepSpeed runs the way a CPU-only user runs it without the deepspeed launcher: DeepSpeed's CPU accelerator, one
process, torch.distributed initialised here with gloo on loopback (world size 1, rank 0; no oneCCL). The model is
the same computation as the reference worker's (the routers, embedding and unembedding frozen, as buffers; one
``nn.Module`` per expert so that ZeRO-3 gathers an expert's parameters when it is called), built inside
``deepspeed.zero.Init`` (partitioned, and so offloaded, as it is built) from the same checkpoint, read one tensor at a
time. Its config is ZeRO stage 3 with the sizes transformers' DeepSpeed integration fills in for "auto" (reduce
bucket H^2, prefetch bucket 0.9 H^2, persistence threshold 10 H, H the hidden size; DeepSpeed's own defaults,
a 5e8-element reduce bucket and a 5e7-element prefetch bucket, are sized for far larger models), bf16 enabled
(bf16 parameters, Float32 master weights and moments in the offloaded optimizer), optimizer AdamW with the
example's lr and weight decay. The optimizer is DeepSpeedCPUAdam (DeepSpeed's cpu_adam op, JIT-built by DeepSpeed
with ninja before the first round, outside every timed run); when it cannot be built, the run uses torch's AdamW
(``torch_adam``, ``zero_force_ds_cpu_optimizer`` false) and the record says so. An expert that no token is routed
to in a step has no gradient in the reference and in StrideWeave (their AdamW skips it); ZeRO-3's optimizer steps
its flattened Float32 partition as a whole.

Every system times the same ``steps`` steps of 512 tokens (loading not timed; DeepSpeed's initialize not timed);
tokens/s = steps x tokens / wall. Per round: ours / ZeRO-3-CPU throughput ("ratio", higher is better; target
>= 1.0) and ours / ZeRO-3-CPU peak RSS ("memory_ratio", lower is better; target <= 0.25); ZeRO-Infinity and PyTorch
in RAM are context cases. The record (harness format, as bench/finetune.py's) adds each system's median tokens/s
and peak RSS, its ratios against PyTorch in RAM and against StrideWeave, the CPU (lscpu's model name) and the
1-minute load average at start and end (PyTorch's OpenMP threads slow down many times over on a loaded machine).

Only ``make bench FULL=1`` runs it (bench/run_all.py --full), after installing requirements-peers.txt and
libaio-dev. Default: 2 rounds of the example's 24 steps (3-4 minutes on 2 cores); --quick: 1 round of 8.

Usage: python bench/peers.py [--quick] [--reps ROUNDS] [--quiet]
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _moe  # noqa: E402
import finetune  # noqa: E402  (its workload, checkpoint and workers)
import harness  # noqa: E402

TARGET = 1.0  # StrideWeave tokens/s / ZeRO-3-CPU tokens/s, higher is better
MEMORY_TARGET = 0.25  # StrideWeave peak RSS / ZeRO-3-CPU peak RSS, lower is better
MiB = 1 << 20
SYSTEMS = ("PyTorch in RAM", "StrideWeave", "ZeRO-3 CPU offload", "ZeRO-Infinity NVMe")


def cpu_model() -> str:
    """lscpu's model name (the table's CPU), with the logical CPU count."""
    name = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{name}, {os.cpu_count()} CPUs"


# ---------------------------------------------------------------- DeepSpeed (in its own process)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_ops() -> dict:
    """JIT-builds DeepSpeed's cpu_adam, async_io and shared-memory comm ops through its CPU accelerator (torch caches
    them under ~/.cache/torch_extensions), so that no timed worker builds them. Returns, per op, None when it loads,
    else the reason."""
    from deepspeed.accelerator import get_accelerator

    out = {}
    for name, builder in (("cpu_adam", "CPUAdamBuilder"), ("async_io", "AsyncIOBuilder"),
                          ("shm_comm", "ShareMemCommBuilder")):
        try:
            b = get_accelerator().create_op_builder(builder)
            if b is None or not b.is_compatible(verbose=False):
                out[name] = f"{name} is not compatible here (DeepSpeed's op check; async_io needs libaio-dev)"
                continue
            b.load(verbose=False)
            out[name] = None
        except Exception as e:  # noqa: BLE001  (a build failure is reported, not raised)
            lines = str(e).strip().splitlines()
            out[name] = f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return out


def ds_config(cfg, mode: str, cpu_adam: bool, nvme_path: str | None) -> dict:
    """ZeRO stage 3 with parameters and optimizer on `mode` ("cpu" or "nvme"); the "auto" sizes of transformers'
    DeepSpeed integration for hidden size H."""
    H = cfg.hidden
    largest = max(cfg.hidden * cfg.intermediate, cfg.vocab * cfg.hidden)
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": H * H,
        "stage3_prefetch_bucket_size": int(0.9 * H * H),
        "stage3_param_persistence_threshold": 10 * H,
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    if mode == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        # buffer_size: the largest parameter (elements); max_in_cpu 0: nothing of the parameters kept in CPU memory.
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False, "buffer_count": 5,
                                 "buffer_size": largest, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False,
                                     "buffer_count": 4}
    conf = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": cfg.weight_decay, "torch_adam": not cpu_adam}},
        "zero_force_ds_cpu_optimizer": cpu_adam,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if cfg.dtype == "bfloat16":
        conf["bf16"] = {"enabled": True}
    if mode == "nvme":
        conf["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    return conf


def _deepspeed_worker(job: dict) -> dict:
    """One DeepSpeed run (ZeRO-3, job["mode"] "cpu" or "nvme") of the example's steps; prints nothing else."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    import warnings

    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0,
                            world_size=1)
    import deepspeed
    from safetensors import safe_open

    ex = finetune.load_example()
    cfg = ex.Config(**job["cfg"])
    folder = job["folder"]
    dt = getattr(torch, cfg.dtype)
    conf = ds_config(cfg, job["mode"], job["cpu_adam"], job.get("nvme_path"))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    files = {}
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        for name, shard in json.load(f)["weight_map"].items():
            files[name] = os.path.join(folder, shard)

    def read(name: str):
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name)

    class Expert(torch.nn.Module):
        def __init__(self, layer: int, e: int):
            super().__init__()
            for m in ex.MATRICES:
                setattr(self, m, torch.nn.Parameter(read(ex.expert_name(layer, e, m)).to(dt)))

        def forward(self, x):
            return (torch.nn.functional.silu(x @ self.w1.T) * (x @ self.w3.T)) @ self.w2.T

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("emb", read("model.embed_tokens.weight"))
            self.register_buffer("unemb", read("lm_head.weight"))
            for layer in range(cfg.layers):
                self.register_buffer(f"router{layer}", read(ex.gate_name(layer)))
            self.experts = torch.nn.ModuleList(
                torch.nn.ModuleList(Expert(layer, e) for e in range(cfg.experts)) for layer in range(cfg.layers))

        def forward(self, tokens, targets):
            # The reference worker's computation (examples/finetune_moe.py torch_worker), expert by expert.
            h = self.emb[tokens]
            for layer in range(cfg.layers):
                probs = torch.softmax((h @ getattr(self, f"router{layer}").T).float(), dim=1)
                w, idx = probs.topk(cfg.top_k, dim=1)
                w = w / w.sum(1, keepdim=True)
                out = torch.zeros_like(h)
                for e in idx.unique().tolist():
                    rows, slot = (idx == e).nonzero(as_tuple=True)
                    y = self.experts[layer][e](h[rows])
                    out = out.index_add(0, rows, (y * w[rows, slot][:, None]).to(h.dtype))
                h = h + out
            logits = (h @ self.unemb.T).float()
            return torch.nn.functional.cross_entropy(logits, targets)

    with deepspeed.zero.Init(config_dict_or_path=conf, remote_device=job["mode"], dtype=dt):
        model = Layers()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=conf)
    succ = torch.from_numpy(ex.successor(cfg))
    losses = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        tokens = torch.from_numpy(ex.batch_tokens(cfg, step))
        loss = engine(tokens, succ[tokens])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().item())
    wall = time.perf_counter() - start
    out = {"wall": wall, "tokens_per_s": cfg.steps * cfg.tokens / wall, "peak_rss": ex.peak_rss_bytes(),
           "first_loss": losses[0], "last_loss": losses[-1], "threads": torch.get_num_threads(),
           "optimizer": type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, "optimizer")
           else type(engine.optimizer).__name__}
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- the benchmark


def _ratios(num: list, den: list, key: str) -> list:
    return [a[key] / b[key] for a, b in zip(num, den)]


def _case(name: str, ours: list, other: list):
    r = _ratios(ours, other, "tokens_per_s")
    return harness.Case(name=name, ratio=statistics.median(r), ratio_min=min(r), ratio_max=max(r),
                        ours_s=statistics.median(a["wall"] for a in ours),
                        reference_s=statistics.median(b["wall"] for b in other),
                        reps=len(r), inner=1, ratios=r)


def main(argv=None) -> None:
    args = harness.parse_args("peers", argv, __doc__)
    ex = finetune.load_example()
    rounds = args.reps or (1 if args.quick else 2)
    cfg = ex.Config(steps=8 if args.quick else ex.Config().steps, check=False, progress=False)
    cpu = cpu_model()
    load_start = os.getloadavg()[0]
    harness.log(args, f"CPU: {cpu}; load average {load_start:.2f} (1 min)")
    built = _moe._run([sys.executable, os.path.abspath(__file__), "--_build-ops"], "DeepSpeed op build")
    cpu_adam = built["cpu_adam"] is None
    notes = {}
    if not cpu_adam:
        notes["ZeRO-3 CPU offload"] = (f"DeepSpeedCPUAdam could not be built ({built['cpu_adam']}): torch.optim.AdamW "
                                       f"(torch_adam) instead")
        notes["ZeRO-Infinity NVMe"] = notes["ZeRO-3 CPU offload"]
    not_measured = {}
    if built["async_io"] is not None:
        not_measured["ZeRO-Infinity NVMe"] = f"DeepSpeed's async_io op cannot be built: {built['async_io']}"
    harness.log(args, f"DeepSpeed ops: cpu_adam {'built' if cpu_adam else built['cpu_adam']}; async_io "
                      f"{'built' if built['async_io'] is None else built['async_io']}")
    runs = {s: [] for s in SYSTEMS if s not in not_measured}
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as directory:
        folder = os.path.join(directory, "mixtral")
        ex.write_checkpoint(cfg, folder)
        payload = {"cfg": dataclasses.asdict(cfg), "folder": folder}
        sw_job = json.dumps(payload)
        for k in range(rounds):
            for system in runs:
                if system == "PyTorch in RAM":
                    r = _moe._run([sys.executable, finetune.EXAMPLE, "--_torch-worker", sw_job], system)
                elif system == "StrideWeave":
                    r = _moe._run([sys.executable, finetune.__file__, "--_worker", sw_job], system)
                else:
                    nvme = os.path.join(directory, f"nvme-{k}")
                    mode = "cpu" if system == "ZeRO-3 CPU offload" else "nvme"
                    if mode == "nvme":
                        os.makedirs(nvme)
                    job = dict(payload, mode=mode, cpu_adam=cpu_adam, nvme_path=nvme)
                    r = _moe._run([sys.executable, os.path.abspath(__file__), "--_deepspeed-worker",
                                   json.dumps(job)], system)
                    shutil.rmtree(nvme, ignore_errors=True)
                runs[system].append(r)
                harness.log(args, f"round {k + 1}/{rounds}: {system:<20} {r['tokens_per_s']:7.0f} tokens/s, peak RSS "
                                  f"{r['peak_rss'] / MiB:6.0f} MiB" + (f" ({r['optimizer']}, loss {r['first_loss']:.3f}"
                                                                       f" -> {r['last_loss']:.3f})"
                                                                       if "optimizer" in r else ""))
    ours, ds3, torch_ram = runs["StrideWeave"], runs["ZeRO-3 CPU offload"], runs["PyTorch in RAM"]
    cases = [_case("vs ZeRO-3 CPU offload", ours, ds3)]
    if "ZeRO-Infinity NVMe" in runs:
        cases.append(_case("vs ZeRO-Infinity NVMe", ours, runs["ZeRO-Infinity NVMe"]))
    cases.append(_case("vs PyTorch in RAM", ours, torch_ram))
    for c in cases:
        c.bytes = sum(cfg.state_bytes().values())
    mem = _ratios(ours, ds3, "peak_rss")
    memory_ratio = statistics.median(mem)
    rec = harness.record(
        "peers", cases, target=TARGET, better="higher", quick=args.quick,
        untargeted={c.name for c in cases[1:]},
        note=(f"ratio = StrideWeave tokens/s / that system's tokens/s; memory ratio (peak RSS StrideWeave / ZeRO-3 "
              f"CPU offload, lower is better) {memory_ratio:.3f} [{min(mem):.3f}, {max(mem):.3f}], target "
              f"{MEMORY_TARGET:g}; CPU {cpu}"))
    systems = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rss = statistics.median(r["peak_rss"] for r in rs)
        systems[name] = {
            "tokens_per_s": round(tps, 1), "tokens_per_s_min": round(min(r["tokens_per_s"] for r in rs), 1),
            "tokens_per_s_max": round(max(r["tokens_per_s"] for r in rs), 1), "peak_rss": int(rss),
            "throughput_vs_pytorch": round(tps / statistics.median(r["tokens_per_s"] for r in torch_ram), 4),
            "memory_vs_pytorch": round(rss / statistics.median(r["peak_rss"] for r in torch_ram), 4),
            "throughput_vs_ours": round(tps / statistics.median(r["tokens_per_s"] for r in ours), 4),
            "memory_vs_ours": round(rss / statistics.median(r["peak_rss"] for r in ours), 4),
            "runs": len(rs),
        }
        if "optimizer" in rs[0]:
            systems[name]["optimizer"] = rs[0]["optimizer"]
            systems[name]["loss"] = [round(rs[0]["first_loss"], 4), round(rs[0]["last_loss"], 4)]
        if name in notes:
            systems[name]["note"] = notes[name]
    memory_ok = memory_ratio <= MEMORY_TARGET
    rec.update({
        "ratio_label": "StrideWeave tokens/s / DeepSpeed ZeRO-3 (CPU offload) tokens/s",
        "memory_ratio": round(memory_ratio, 4),
        "memory_ratio_min": round(min(mem), 4),
        "memory_ratio_max": round(max(mem), 4),
        "memory_target": MEMORY_TARGET,
        "memory_better": "lower",
        "memory_meets_target": memory_ok,
        "targets_met": rec["meets_target"] and memory_ok,
        "ours_tokens_per_s": systems["StrideWeave"]["tokens_per_s"],
        "reference_tokens_per_s": systems["ZeRO-3 CPU offload"]["tokens_per_s"],
        "ours_peak_rss": systems["StrideWeave"]["peak_rss"],
        "reference_peak_rss": systems["ZeRO-3 CPU offload"]["peak_rss"],
        "systems": systems,
        "not_measured": not_measured,
        "cpu": cpu,
        "steps": cfg.steps,
        "tokens_per_step": cfg.tokens,
        "rounds": rounds,
        "deepspeed": "0.19.8",
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # 1-minute, at start and end
    })
    harness.log(args, f"\n{'system (' + cpu + ')':<44} {'tokens/s':>9} {'peak RSS':>10} {'x PyTorch':>10} "
                      f"{'RSS x PyTorch':>14} {'ours / it':>10} {'our RSS / its':>14}")
    for name, s in systems.items():
        harness.log(args, f"{name:<44} {s['tokens_per_s']:>9.0f} {s['peak_rss'] / MiB:>6.0f} MiB "
                          f"{s['throughput_vs_pytorch']:>10.3f} {s['memory_vs_pytorch']:>14.3f} "
                          f"{1 / s['throughput_vs_ours']:>10.3f} {1 / s['memory_vs_ours']:>14.3f}")
    for name, why in not_measured.items():
        harness.log(args, f"{name:<44} not measured: {why}")
    harness.log(args, f"load average (1 min) at start and end: {rec['load_average']}")
    harness.log(args, f"target: StrideWeave >= {TARGET:g}x ZeRO-3 CPU offload's throughput "
                      f"({'met' if rec['meets_target'] else 'MISSED'}: {rec['ratio']:.3f}) at <= {MEMORY_TARGET:g}x "
                      f"its peak RSS ({'met' if memory_ok else 'MISSED'}: {memory_ratio:.3f})")
    harness.emit(rec)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--_build-ops":
        print(json.dumps(_build_ops()))
    elif len(sys.argv) == 3 and sys.argv[1] == "--_deepspeed-worker":
        print(json.dumps(_deepspeed_worker(json.loads(sys.argv[2]))))
    else:
        main()
