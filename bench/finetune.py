"""finetune: the examples/finetune_moe.py workload, StrideWeave offloaded against PyTorch with everything in RAM.

Targets: throughput ratio >= 0.9 (StrideWeave tokens/s / PyTorch tokens/s) at <= 0.3 x PyTorch's peak resident
memory.

Workload (the example's defaults unless --quick): a Mixtral-format BFloat16 checkpoint written once with the
safetensors package (4 MoE layers of 8 SwiGLU experts, H 256, I 512: 24 MiB of experts), fine-tuned for a number
of steps of 512 tokens on the example's synthetic next-token objective (fixed random successor rule over a
512-token vocabulary, frozen embedding, unembedding and routers, top-2 routing, cross-entropy), AdamW on every
expert (lr 1e-3, weight decay 0.01).

StrideWeave: the example's ``train``: the checkpoint opened where it lies (``ckpt.tiled``), one ``SparseMoE`` per
layer, ``sw.optim.AdamW`` with Float32 moments, everything under one ``ResidencyBudget`` of a fifth of experts +
gradients + moments (the rest lives in the checkpoint's overlay and scratch files), the next step's experts
prefetched.

Reference: the example's PyTorch worker: every tensor loaded into RAM (not timed), the same model and objective in
bf16, Float32 master weights (one ``nn.Parameter`` per expert matrix) and moments, ``torch.optim.AdamW`` with its
defaults (the foreach implementation), PyTorch's default threads.

Each run is a fresh process (its peak RSS is its own), A B A B. Per pair: throughput ratio = ours tokens/s /
reference tokens/s ("ratio", higher is better) and memory ratio = ours peak RSS / reference peak RSS
("memory_ratio", lower is better); the record reports the median and range of each and whether each target is
met. --quick: 2 pairs of 12 steps; the full run: 3 pairs of the example's 24 steps.

Rows (``ROWS``): the first is the run above, the record's targeted case (its name, ratio and memory ratio as
before). The others are context cases for the optimizer's options, on the same workload and the same budget in
bytes (a fifth of experts + gradients + Float32 moments: compact state leaves more of the budget to the rest):
``state_dtype=BFloat16`` moments, and the same model written in Float32 (weights, gradients and moments Float32;
its reference is the PyTorch worker on that checkpoint, Float32 throughout). A row whose option the installed
strideweave does not have (``step_in_backward=True``, ``state_dtype=STATE_8BIT`` until they exist) is skipped
and named in the record's "skipped_rows"; a context row whose run fails is named with its error in
"failed_rows" (the targeted row failing fails the benchmark). The rows of one checkpoint dtype share each pair's
PyTorch run: StrideWeave once per row, then PyTorch, per pair; each row's ratios are against its pair's PyTorch
run. The worker takes a row's options in its job ("optim"): the example's ``train`` builds its optimizer as
``sw.optim.AdamW(params, lr=..., weight_decay=...)``, and the worker, a fresh process that runs only that, binds
the name to a subclass that adds the row's keyword arguments. Every case object in the record carries its own
memory ratio and its two sides' tokens/s and peak RSS.

Usage: python bench/finetune.py [--quick] [--reps N] [--quiet]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _moe  # noqa: E402
import harness  # noqa: E402

TARGET = 0.9  # throughput ratio, higher is better
MEMORY_TARGET = 0.3  # peak-RSS ratio, lower is better
MiB = 1 << 20
EXAMPLE = os.path.join(ROOT, "examples", "finetune_moe.py")


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_moe", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# The rows: (case name, checkpoint dtype, the optimizer's extra keyword arguments). The first is the targeted case
# (None: its historical name, built from the Config). Keyword values are JSON: "bfloat16" stands for
# sw.DType.BFloat16 and "8bit" for sw.optim.STATE_8BIT; a row whose keyword the installed sw.optim.AdamW does not
# take is skipped (step_in_backward and the 8-bit state: rows ready for when they land).
ROWS = [
    (None, "bfloat16", {}),
    ("bf16, BFloat16 moments", "bfloat16", {"state_dtype": "bfloat16"}),
    ("bf16, 8-bit moments", "bfloat16", {"state_dtype": "8bit"}),
    ("bf16, step in backward", "bfloat16", {"step_in_backward": True}),
    ("bf16, step in backward, BFloat16 moments", "bfloat16", {"step_in_backward": True, "state_dtype": "bfloat16"}),
    ("fp32, Float32 moments", "float32", {}),
    ("fp32, BFloat16 moments", "float32", {"state_dtype": "bfloat16"}),
    ("fp32, step in backward", "float32", {"step_in_backward": True}),
]


def _optim_kwargs(sw, options: dict) -> dict:
    """A row's JSON options as sw.optim.AdamW's keyword arguments."""
    values = {"bfloat16": lambda: sw.DType.BFloat16, "float32": lambda: sw.DType.Float32,
              "8bit": lambda: sw.optim.STATE_8BIT}
    return {k: values[v]() if isinstance(v, str) else v for k, v in options.items()}


def missing_option(options: dict) -> str | None:
    """Why the installed strideweave cannot run a row (an option it does not have), or None."""
    import inspect

    import strideweave as sw

    params = inspect.signature(sw.optim.AdamW.__init__).parameters
    for k, v in options.items():
        if k not in params:
            return f"sw.optim.AdamW has no {k}"
        if v == "8bit" and not hasattr(sw.optim, "STATE_8BIT"):
            return "sw.optim has no STATE_8BIT"
    return None


def _strideweave_worker(job: dict) -> dict:
    ex = load_example()
    options = job.get("optim") or {}
    if options:
        # The example's train builds sw.optim.AdamW(params, lr=..., weight_decay=...); this process runs only that.
        base, extra = ex.sw.optim.AdamW, _optim_kwargs(ex.sw, options)

        class AdamW(base):
            def __init__(self, params, *args, **kwargs):
                super().__init__(params, *args, **kwargs, **extra)

        ex.sw.optim.AdamW = AdamW
    cfg = ex.Config(**job["cfg"])
    r = ex.train(cfg, job["folder"])
    out = {"wall": r["wall"], "tokens_per_s": r["tokens_per_s"], "peak_rss": r["peak_rss"],
           "wait_seconds": r["wait_seconds"], "hit_rate": r["hits"] / max(1, r["expert_visits"]),
           "moments_read": r["moments_read"], "weights_read": r["weights_read"]}
    r["model"].release()
    return out


def _pair_case(name: str, cfg, ours: list, ref: list):
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, ref)]
    return harness.Case(
        name=name, ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
        ours_s=statistics.median(a["wall"] for a in ours), reference_s=statistics.median(b["wall"] for b in ref),
        reps=len(ratios), inner=1, bytes=sum(cfg.state_bytes().values()), ratios=ratios,
    )


def main(argv=None) -> None:
    args = harness.parse_args("finetune", argv, __doc__)
    ex = load_example()
    pairs = args.reps or (2 if args.quick else 3)
    cfg = ex.Config(steps=12 if args.quick else ex.Config().steps, check=False, progress=False)
    main_name = f"{cfg.steps} steps, {cfg.layers} layers x {cfg.experts} experts, budget 1/{cfg.budget_ratio:g}"
    rows, skipped = [], {}
    for name, dtype, options in ROWS:
        why = missing_option(options)
        if why is None:
            rows.append((name or main_name, dtype, options))
        else:
            skipped[name] = why
            harness.log(args, f"row {name!r} skipped: {why}")
    runs = {name: ([], []) for name, _, _ in rows}  # name -> (ours, ref)
    failed = {}  # context rows whose StrideWeave run failed: name -> the error's last line
    cfgs = {}
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as directory:
        for dtype in dict.fromkeys(d for _, d, _ in rows):
            c = dataclasses.replace(cfg, dtype=dtype)
            cfgs[dtype] = c
            folder = os.path.join(directory, f"mixtral-{dtype}")
            ex.write_checkpoint(c, folder)
            base = {"cfg": dataclasses.asdict(c), "folder": folder}
            group = [(n, o) for n, d, o in rows if d == dtype]
            for k in range(pairs):
                mine = []
                for n, o in group:
                    if n in failed:
                        continue
                    try:
                        mine.append((n, _moe._run([sys.executable, os.path.abspath(__file__), "--_worker",
                                                   json.dumps(dict(base, optim=o))], f"StrideWeave ({n})")))
                    except SystemExit as e:
                        if n == main_name:
                            raise
                        # A context row that fails is reported (record's "failed_rows"), not measured.
                        failed[n] = str(e).strip().splitlines()[-1]
                        harness.log(args, f"row {n!r} failed: {failed[n]}")
                b = _moe._run([sys.executable, EXAMPLE, "--_torch-worker", json.dumps(base)], "PyTorch")
                for n, a in mine:
                    runs[n][0].append(a)
                    runs[n][1].append(b)
                    harness.log(args, f"{n}: pair {k + 1}/{pairs}: StrideWeave {a['tokens_per_s']:.0f} tokens/s, "
                                f"peak RSS {a['peak_rss'] / MiB:.0f} MiB (I/O wait {a['wait_seconds']:.2f} s, hit "
                                f"rate {a['hit_rate']:.1%}); PyTorch in RAM {b['tokens_per_s']:.0f} tokens/s, "
                                f"peak RSS {b['peak_rss'] / MiB:.0f} MiB")
    rows = [r for r in rows if r[0] not in failed]
    ours, ref = runs[main_name]
    case = _pair_case(main_name, cfg, ours, ref)
    rec = _moe.record_with_memory(args, "finetune", case, ours, ref, TARGET, MEMORY_TARGET, "everything in RAM")
    cases = [case] + [_pair_case(n, cfgs[d], *runs[n]) for n, d, _ in rows[1:]]
    rows_rec = harness.record("finetune", cases, target=TARGET, better="higher", quick=args.quick,
                              untargeted={c.name for c in cases[1:]})
    for c, (n, d, o) in zip(rows_rec["cases"], rows):
        a, b = runs[n]
        mem = [x["peak_rss"] / y["peak_rss"] for x, y in zip(a, b)]
        c.update({"dtype": d, "optim": o, "memory_ratio": round(statistics.median(mem), 4),
                  "memory_ratio_min": round(min(mem), 4), "memory_ratio_max": round(max(mem), 4),
                  "ours_tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in a), 1),
                  "reference_tokens_per_s": round(statistics.median(y["tokens_per_s"] for y in b), 1),
                  "ours_peak_rss": int(statistics.median(x["peak_rss"] for x in a)),
                  "reference_peak_rss": int(statistics.median(y["peak_rss"] for y in b))})
        if c is not rows_rec["cases"][0]:
            harness.log(args, f"{n}: throughput ratio {c['ratio']:.3f} [{c['ratio_min']:.3f}, {c['ratio_max']:.3f}]"
                              f", memory ratio {c['memory_ratio']:.3f} (context)")
    rec["cases"] = rows_rec["cases"]
    if len(cases) > 1:
        rec["detail"] += "; other rows (untargeted): " + "; ".join(c.summary() for c in cases[1:])
    rec.update({
        "state_bytes": sum(cfg.state_bytes().values()),
        "steps": cfg.steps,
        "pairs": len(case.ratios),
        "skipped_rows": skipped,
        "failed_rows": failed,
    })
    harness.emit(rec)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
        print(json.dumps(_strideweave_worker(json.loads(sys.argv[2]))))
    else:
        main()
