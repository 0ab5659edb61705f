"""moe_block: one MoE layer shaped like a small real model, StrideWeave against transformers and its offloading.

The layer: transformers' Mixtral sparse-MoE block (``MixtralSparseMoeBlock``: softmax router, top-2, renormalised;
SwiGLU experts) at hidden 1024, intermediate 2816, 32 experts (277M expert parameters: 1.1 GB in Float32, 0.55 GB
in BFloat16), 128 tokens a call. A one-layer ``MixtralForCausalLM`` with random weights (nothing is downloaded) is
saved once per dtype with ``save_pretrained``, so the checkpoint has Mixtral's per-expert layout
(``model.layers.0.block_sparse_moe.experts.{e}.w1/w2/w3.weight``), and the page cache holds it.

Cases, each Float32 and BFloat16, each in a fresh process (its memory is its own), every process importing torch
and transformers as a transformers user's does:

* ``in RAM``: the model read with ``from_pretrained``; every call runs ``model.model.layers[0].mlp`` with
  transformers' default experts implementation (inference, ``torch.no_grad``).
* ``accelerate disk offload``: ``from_pretrained`` with a ``device_map`` that puts
  ``model.layers.0.mlp.experts`` on "disk" and an ``offload_folder`` (the rest on "cpu"). transformers fuses the
  per-expert tensors at load and re-saves the fused ``gate_up_proj``/``down_proj`` into the offload folder (not
  timed); every call then loads both fused tensors, all 32 experts, and drops them after.
* ``safe_open on demand``: the router's weight read once; every call routes, opens the checkpoint with
  ``safetensors.safe_open`` and gets only the routed experts' w1/w3/w2, and runs them as transformers' eager loop
  does (with 128 tokens and top-2, nearly every expert is routed each call).
* ``strideweave``: ``sw.safetensors.open`` of the same file, the experts' tiles where they lie
  (``ckpt.tiled``), one ``sw.moe.SparseMoE`` under a ``sw.ResidencyBudget`` of a quarter of the experts' weight
  bytes; every call runs ``moe(x, router_weight)`` on the hidden states (``strideweave.torch.from_torch``, no copy)
  under ``sw.no_grad()``. With a quarter of the experts resident and nearly all routed, most experts are promoted
  (mapped from the page cache) every call.
* ``in RAM train`` / ``strideweave train``: one training step a call (forward, then backward of a random
  cotangent; the expert gradients are dropped after each step: ``zero_grad(set_to_none=True)`` / ``.grad = None``).
  StrideWeave's budget is a quarter of the experts' weights plus their gradients (half of the weights' bytes): its
  gradient tiles are written to their scratch tier when the budget needs the room. accelerate's disk offload gives
  offloaded weights no gradients, so it has no training case.

Each worker times ``--calls`` calls (one untimed call first) on fresh inputs drawn with NumPy (the same values in
every worker), and reports the median seconds a call, tokens/s, the peak resident memory of the whole process
(loading included) and the peak during the calls (the kernel's high-water mark ``VmHWM``, reset after setup through
``/proc/self/clear_refs``), its resident size before any weight was read (the interpreter, torch, transformers and
the inputs) and its setup time. (Not ``ru_maxrss``: a child's carries the resident size of the process that forked
it across ``exec``. The checkpoints are written by a worker process too, so the parent that forks the workers stays
small.)

The record (the last line, JSON) has one case per comparison with a target: StrideWeave's tokens/s over the
reference's (higher is better): inference against ``in RAM`` (target >= 1.0) and against accelerate (>= 2.0), the
training step against ``in RAM train`` (>= 0.8); the safe_open comparison is listed in the note. Its memory ratio
is the worse of StrideWeave's peak RSS over the in-RAM process's, inference and training (target <= 0.35); each
comparison also gives the ratio of the peaks above the imports. The processes run one after another, not
interleaved, so the ranges come from the fastest and slowest calls of both sides.

Usage: python bench/moe_block.py [--quick] [--calls N] [--dtypes float32 bfloat16] [--quiet]
       [--hidden 1024 --intermediate 2816 --experts 32 --top-k 2 --tokens 128]
SW_PROMOTION_PATH=map|read in the environment forces how StrideWeave promotes its tiles (default: auto, Note
[Promotion by the cheaper path]); the workers' stats count the promotions by path (promoted_mapped, promoted_read).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import harness  # noqa: E402
MiB = 1 << 20
INFERENCE = ("in RAM", "accelerate disk offload", "safe_open on demand", "strideweave")
TRAINING = ("in RAM train", "strideweave train")
MODES = INFERENCE + TRAINING
# Budgets of the StrideWeave cases, as fractions of the experts' weight bytes: inference a quarter of the experts;
# a training step a quarter of the experts' weights plus their gradients (half of the weights' bytes).
BUDGET = {"strideweave": 0.25, "strideweave train": 0.5}
# Targets: inference >= 1.0x the in-RAM block's throughput and >= 2x accelerate's disk offload, a training step
# >= 0.8x the in-RAM step, each at <= 0.35x the in-RAM process's peak RSS.
TARGETS = {"in RAM": 1.0, "accelerate disk offload": 2.0, "in RAM train": 0.8}
MEMORY_TARGET = 0.35


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/moe_block.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 timed calls a case instead of 10")
    p.add_argument("--calls", type=int, default=None, help="timed calls a case (overrides the mode's default)")
    p.add_argument("--quiet", action="store_true", help="print only the final JSON line")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="the cases to run (default: all)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.calls is not None and args.calls < 1:
        p.error("--calls must be >= 1")
    return args


def log(args, *parts) -> None:
    if not args.quiet:
        print(*parts, flush=True)


# ---------------------------------------------------------------------------------------------- the checkpoint


def mixtral_config(shape: dict):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=128, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                         num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                         max_position_embeddings=shape["tokens"], tie_word_embeddings=False)


def write_checkpoints(shape: dict, dtypes: list, directory: str) -> dict:
    """A one-layer Mixtral with random weights (seed 0), saved with save_pretrained once per dtype:
    {dtype: folder}."""
    import torch
    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    model = MixtralForCausalLM(mixtral_config(shape))
    out = {}
    for name in dtypes:
        folder = os.path.join(directory, name)
        model.to(getattr(torch, name)).save_pretrained(folder)
        out[name] = folder
    return out


def warm_page_cache(folder: str) -> None:
    for entry in os.listdir(folder):
        with open(os.path.join(folder, entry), "rb") as fh:
            while fh.read(8 << 20):
                pass


# ---------------------------------------------------------------------------------------------- one worker


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status ("VmHWM", "VmRSS") in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_now() -> int:
    """The process's resident high-water mark in bytes (VmHWM), since start or the last reset."""
    return status_bytes("VmHWM")


def current_rss() -> int:
    """The process's resident size in bytes now (VmRSS)."""
    return status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Resets the high-water mark to the current resident size (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def worker(job: dict) -> dict:
    if job["mode"] == "write":
        return write_checkpoints(job["shape"], job["dtypes"], job["directory"])
    import torch
    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    mode, folder, shape, calls = job["mode"], job["folder"], job["shape"], job["calls"]
    dtype = getattr(torch, job["dtype"])
    H, T = shape["hidden"], shape["tokens"]
    rng = np.random.default_rng(1)
    inputs = [torch.from_numpy(rng.standard_normal((1, T, H), dtype=np.float32)).to(dtype) for _ in range(calls + 1)]
    cotangents = [torch.from_numpy(rng.standard_normal((1, T, H), dtype=np.float32)).to(dtype)
                  for _ in range(calls + 1)]
    baseline_rss = current_rss()  # the interpreter, torch and the inputs: before any weight is touched
    started = time.perf_counter()
    stats = None
    offload = None
    if mode in ("in RAM", "in RAM train"):
        model = MixtralForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        block = model.model.layers[0].mlp

        if mode == "in RAM":
            def call(x, g):
                return block(x)
        else:
            def call(x, g):  # one training step of the block: forward, backward, gradients dropped after
                x = x.detach().requires_grad_(True)
                block(x).backward(g)
                block.zero_grad(set_to_none=True)
    elif mode == "accelerate disk offload":
        offload = tempfile.mkdtemp(prefix="sw-bench-moe-block-offload-")
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                      "model.layers.0.self_attn": "cpu", "model.layers.0.input_layernorm": "cpu",
                      "model.layers.0.post_attention_layernorm": "cpu", "model.layers.0.mlp.gate": "cpu",
                      "model.layers.0.mlp.experts": "disk"}
        model = MixtralForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map,
                                                   offload_folder=offload).eval()
        block = model.model.layers[0].mlp
        if block.experts.gate_up_proj.device.type != "meta":
            raise SystemExit("moe_block: accelerate kept the experts in memory; the disk offload did not happen")

        def call(x, g):
            return block(x)
    elif mode == "safe_open on demand":
        from safetensors import safe_open

        path = os.path.join(folder, "model.safetensors")
        prefix = "model.layers.0.block_sparse_moe"
        with safe_open(path, "pt") as f:
            router = f.get_tensor(f"{prefix}.gate.weight")
        k = shape["top_k"]
        act = torch.nn.functional.silu

        def call(x, g):
            x = x.view(-1, H)
            logits = torch.nn.functional.linear(x, router)
            probs = torch.softmax(logits.float(), dim=-1)
            top, index = torch.topk(probs, k, dim=-1)
            top /= top.sum(dim=-1, keepdim=True)
            out = torch.zeros_like(x)
            with safe_open(path, "pt") as f:
                for e in torch.unique(index).tolist():
                    tok, slot = torch.where(index == e)
                    w1 = f.get_tensor(f"{prefix}.experts.{e}.w1.weight")
                    w3 = f.get_tensor(f"{prefix}.experts.{e}.w3.weight")
                    w2 = f.get_tensor(f"{prefix}.experts.{e}.w2.weight")
                    xe = x[tok]
                    h = act(torch.nn.functional.linear(xe, w1)) * torch.nn.functional.linear(xe, w3)
                    y = torch.nn.functional.linear(h, w2) * top[tok, slot, None]
                    out.index_add_(0, tok, y.to(out.dtype))
            return out
    elif mode in ("strideweave", "strideweave train"):
        import strideweave as sw
        from strideweave.torch import from_torch

        prefix = "model.layers.0.block_sparse_moe"
        ckpt = sw.safetensors.open(folder)  # opened where it lies: headers only
        experts = {w: ckpt.tiled([f"{prefix}.experts.{e}.{w}.weight" for e in range(shape["experts"])])
                   for w in ("w1", "w2", "w3")}
        weight_bytes = 3 * H * shape["intermediate"] * shape["experts"] * (4 if job["dtype"] == "float32" else 2)
        budget = sw.ResidencyBudget(int(BUDGET[mode] * weight_bytes))
        moe = sw.moe.SparseMoE(experts["w1"], experts["w2"], experts["w3"], top_k=shape["top_k"], budget=budget)
        with sw.no_grad():  # the router's (E, H) weight, copied into memory: a leaf of its own
            src = ckpt.tensor(f"{prefix}.gate.weight")
            router = sw.move(src, sw.CPU(0, dtype=src.dtype()))

        if mode == "strideweave":
            def call(x, g):
                with sw.no_grad():
                    return moe(from_torch(x.view(-1, H)), router)
        else:
            def call(x, g):  # one training step: forward, backward (expert gradients tiled), gradients dropped
                out = moe(from_torch(x.view(-1, H)), router)
                out.backward(from_torch(g.view(-1, H)))
                for t in experts.values():
                    t.grad = None
                router.grad = None

        def stats():
            st = dict(moe.stats())
            b = budget.stats()
            st.update({"budget_bytes": budget.max_bytes, "budget_peak_bytes": b["peak_bytes"],
                       "budget_evictions": b["evictions"], "weight_bytes": weight_bytes})
            for t in experts.values():  # promotions by path, the untimed first call included
                for k, v in t.carrier.secondary.promotion_stats().items():
                    if k.endswith("_per_mib"):  # each path's cost estimate: the largest of the three tiers'
                        st[k] = max(st.get(k, -1), v)
                    elif k.endswith("_bytes"):  # buffers alive now and at each tier's peak (peaks: summed)
                        st[k] = st.get(k, 0) + v
                    else:
                        st[f"promoted_{k}"] = st.get(f"promoted_{k}", 0) + v
            return st
    else:
        raise SystemExit(f"moe_block: unknown worker mode {mode!r}")
    setup_s = time.perf_counter() - started

    times = []
    training = mode in TRAINING
    with torch.set_grad_enabled(training):
        call(inputs[0], cotangents[0])  # untimed: first-call costs (allocator, thread pool)
        setup_peak = peak_rss_now()
        hwm_reset = reset_peak_rss()
        for x, g in zip(inputs[1:], cotangents[1:]):
            t0 = time.perf_counter()
            call(x, g)
            times.append(time.perf_counter() - t0)
    calls_peak = peak_rss_now() if hwm_reset else None
    whole_peak = max(setup_peak, peak_rss_now())
    if offload is not None:
        shutil.rmtree(offload, ignore_errors=True)
    s = statistics.median(times)
    return {"mode": mode, "dtype": job["dtype"], "s_per_call": s, "s_min": min(times), "s_max": max(times),
            "tokens_per_s": T / s, "calls": len(times), "setup_s": setup_s,
            "peak_rss": whole_peak, "calls_peak_rss": calls_peak, "baseline_rss": baseline_rss,
            "torch_threads": torch.get_num_threads(), "stats": stats() if stats else None}


def run_worker(job: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(job)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"moe_block: the {job['mode']} ({job['dtype']}) worker failed (exit status "
                         f"{proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))), flush=True)
        return
    calls = args.calls or (3 if args.quick else 10)
    shape = {"hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts, "top_k": args.top_k,
             "tokens": args.tokens}
    directory = tempfile.mkdtemp(prefix="sw-bench-moe-block-")
    results = []
    try:
        t0 = time.perf_counter()
        folders = run_worker({"mode": "write", "dtype": ",".join(args.dtypes), "shape": shape, "dtypes": args.dtypes,
                              "directory": directory})
        log(args, f"checkpoints written in {time.perf_counter() - t0:.1f} s: " + ", ".join(
            f"{k} {sum(os.path.getsize(os.path.join(v, f)) for f in os.listdir(v)) / MiB:.0f} MiB"
            for k, v in folders.items()))
        for name in args.dtypes:
            warm_page_cache(folders[name])
            for mode in [m for m in MODES if m in args.modes]:
                r = run_worker({"mode": mode, "dtype": name, "folder": folders[name], "shape": shape,
                                "calls": calls})
                results.append(r)
                peak = "n/a" if r["calls_peak_rss"] is None else f"{r['calls_peak_rss'] / MiB:.0f} MiB"
                log(args, f"{name:9s} {mode:24s} {r['s_per_call'] * 1e3:9.1f} ms/call "
                          f"[{r['s_min'] * 1e3:.1f}, {r['s_max'] * 1e3:.1f}]  {r['tokens_per_s']:8.0f} tokens/s  "
                          f"peak RSS {r['peak_rss'] / MiB:.0f} MiB (calls {peak}), setup {r['setup_s']:.1f} s")
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    references = []
    for r in results:
        base = next(b for b in results if b["dtype"] == r["dtype"] and b["mode"] == "in RAM")
        references.append({
            "name": f"{r['mode']}, {r['dtype']}", "tokens_per_s": round(r["tokens_per_s"], 1),
            "s_per_call": round(r["s_per_call"], 5), "s_min": round(r["s_min"], 5), "s_max": round(r["s_max"], 5),
            "calls": r["calls"], "setup_s": round(r["setup_s"], 2), "peak_rss": r["peak_rss"],
            "calls_peak_rss": r["calls_peak_rss"], "baseline_rss": r["baseline_rss"],
            "throughput_vs_in_ram": round(r["tokens_per_s"] / base["tokens_per_s"], 4),
            "peak_rss_vs_in_ram": round(r["peak_rss"] / base["peak_rss"], 4),
            "torch_threads": r["torch_threads"], "stats": r["stats"],
        })

    # StrideWeave against each reference of its dtype: throughput ratio (higher is better; range from the
    # fastest and slowest calls of both sides) and peak-RSS ratio (whole process, lower is better).
    cases, memory, rows = [], [], []
    for name in args.dtypes:
        by_mode = {r["mode"]: r for r in results if r["dtype"] == name}
        for ours_mode, ref_mode in (("strideweave", "in RAM"), ("strideweave", "accelerate disk offload"),
                                    ("strideweave", "safe_open on demand"), ("strideweave train", "in RAM train")):
            a, b = by_mode.get(ours_mode), by_mode.get(ref_mode)
            if a is None or b is None:
                continue
            label = f"{'training step' if ours_mode in TRAINING else 'inference'} vs {ref_mode}, {name}"
            ratio = b["s_per_call"] / a["s_per_call"]
            cases.append(harness.Case(name=label, ratio=ratio, ratio_min=b["s_min"] / a["s_max"],
                                      ratio_max=b["s_max"] / a["s_min"], ours_s=a["s_per_call"],
                                      reference_s=b["s_per_call"], reps=a["calls"], inner=1))
            mem = a["peak_rss"] / b["peak_rss"]
            above = (a["peak_rss"] - a["baseline_rss"]) / max(1, b["peak_rss"] - b["baseline_rss"])
            if ref_mode in ("in RAM", "in RAM train"):
                memory.append((mem, label))
            rows.append({"case": label, "throughput_ratio": round(ratio, 4), "peak_rss_ratio": round(mem, 4),
                         "peak_rss_above_imports_ratio": round(above, 4), "target": TARGETS.get(ref_mode)})
            log(args, f"{label:52s} throughput {ratio:6.3f} [{b['s_min'] / a['s_max']:.3f}, "
                      f"{b['s_max'] / a['s_min']:.3f}]  peak RSS {mem:.3f} (above the imports {above:.3f})"
                      + (f"  target >= {TARGETS[ref_mode]:g}" if ref_mode in TARGETS else ""))
    if not cases:
        print(json.dumps({"bench": "moe_block", "quick": args.quick, "shape": shape, "references": references}))
        return
    case_targets = {c.name: TARGETS[c.name.split(" vs ")[1].rsplit(",", 1)[0]] for c in cases
                    if c.name.split(" vs ")[1].rsplit(",", 1)[0] in TARGETS}
    context = [c for c in cases if c.name not in case_targets]  # safe_open: a comparison, no target
    targeted = [c for c in cases if c.name in case_targets]
    rec = harness.record("moe_block", targeted or cases, target=1.0, better="higher", quick=args.quick,
                         case_targets=case_targets,
                         note="ratio = StrideWeave tokens/s / reference tokens/s; " + "; ".join(
                             c.summary() for c in context))
    worst_mem, worst_label = max(memory)
    rec.update({
        "ratio_label": "StrideWeave tokens/s / reference tokens/s",
        "memory_ratio": round(worst_mem, 4),
        "memory_ratio_min": round(min(m for m, _ in memory), 4),
        "memory_ratio_max": round(worst_mem, 4),
        "memory_case": worst_label,
        "memory_target": MEMORY_TARGET,
        "memory_better": "lower",
        "memory_meets_target": worst_mem <= MEMORY_TARGET,
        "targets_met": rec["meets_target"] and worst_mem <= MEMORY_TARGET,
        "shape": shape, "budget_fractions": BUDGET, "comparisons": rows, "references": references,
    })
    harness.emit(rec)


if __name__ == "__main__":
    main()
