"""bigger_than_ram: the fine-tuning command on a transformers MoE whose experts + gradients + moments exceed a memory
cgroup's limit (4x by default), checked on sampled experts.

Not a ratio benchmark and not part of ``make bench`` or CI: a documented run (docs/performance.md, "Bigger than
RAM") that shows the main job completing through the front door when the process cannot hold its state. It

1. outside the cgroup, builds a Qwen3-MoE from its config with seeded random weights in BFloat16
   (examples/finetune_command_demo.py's ``make_model``), trains a byte-level BPE tokenizer locally on text that
   ships with the machine (the demo's ``corpus`` and ``make_tokenizer``), saves both with ``save_pretrained``,
   writes a JSON-lines data file (the demo's ``write_data``) and drops the model's files from the page cache (so
   the run inside reads them and is charged for them);
2. makes a memory cgroup (cgroup v2: a child of this process's cgroup with ``memory.max`` and ``memory.swap.max =
   0``; cgroup v1: a child of its memory cgroup with ``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes``
   where swap accounting exists) and runs ``python -m strideweave.finetune MODEL --data FILE --output OUT --budget
   SIZE ...`` inside it, unchanged, with a recording hook around it (below): the model is opened with
   ``strideweave.torch.from_pretrained``, trained, checkpointed (``--save-every``) and written back with
   ``save_pretrained``, all under the limit. Page cache the run touches is charged to the cgroup too, so the limit
   bounds its whole footprint; going over kills the run (OOM), reported as a failure;
3. outside again, checks N sampled experts (seeded, printed) from the records, one record in memory at a time,
   without the whole model.

The recording hook (this file run with ``--child``, inside the cgroup) imports the command and wraps three of
``strideweave.torch``'s public attributes before calling ``strideweave.finetune.main`` with the command's own
arguments: ``from_pretrained`` (to put forward hooks on the experts modules: every layer's routed experts, for the
minimum of Note [Bytes moved per step], and the sampled layers' records), ``clip_grad_norm_`` and ``AdamW.step``
(around which the tier counters are read). The command's code is not changed. On the checked steps (the first and
the last by default) it writes to files beside the run: for each sampled layer and micro-batch the experts module's
inputs (hidden states, top-k indices and weights) and the gradient of its output; for each sampled expert and matrix
the gradient before clipping, the clipping's total norm, then, just before the optimizer step, the weights, the
clipped gradient, both AdamW moments, the tile's step count and its parameter group's lr, betas, eps and weight
decay, and after the step the weights, moments and count. Tiles are read through one-tile projections under the
run's budget; the recording's time is left out of the reported throughput.

What is checked (every sampled expert, every checked step):

* its weight gradients (the sum over the step's micro-batches, before clipping) against PyTorch in Float64 on the
  recorded inputs of its experts module: the expert's SwiGLU on its routed rows, times their routing weights,
  against the recorded output gradient, within the bound of examples/finetune_moe.py's Note [The bound of the
  check] (each of at most K = 24 rounding sites on the weight-gradient path, here about 10 plus one per
  micro-batch's accumulation into the BFloat16 tile, moves the result by at most ``u_s`` times its magnitude
  ``M_F``, the same computation on absolute values with silu replaced by ``1.1 z``; ``u_s = 2^-8 + 2 gamma_n``,
  ``n`` the largest of the tokens, H and I), so ``|g - g64| <= ((1 + u_s)^24 - 1) M_F``. An expert no token was
  routed to must have no gradient (an implicit tile). The report gives the worst |error| / bound, the fraction
  of gradient elements larger than their bound (those an error of their own size would not hide) and, for
  information only, the measured |error|_F / |g|_F. In BFloat16 this bound is loose: about 0.1 M_F, and M_F is
  tens of times |g| (sums of many signed terms), so no element exceeds it and only gross errors fail it (in a
  small trial, a negated gate gradient reached 0.56 of the bound and passed). ``--dtype float32`` makes it sharp
  (about 3e-3 M_F at the default sizes; in the same trial 83% of the elements exceed their bound, and a negated,
  1.5x-scaled or zeroed-at-its-largest gradient fails it at 37-148x), at 16 bytes of state per expert weight
  instead of 12;
* the clipping: the clipped gradient is the recorded one times torch's factor ``min(1, max_norm / (total +
  1e-6))`` (from the recorded total, as ``strideweave.torch.clip_grad_norm_`` computes it) within one BFloat16
  rounding of a Float32 product: ``|g_c - f g| <= (2^-8 + 2^-23) |f g|``;
* its AdamW step, bit for bit: ``torch.optim.AdamW`` (``foreach=False``) on one ``nn.Parameter`` holding the
  Float32 values of the recorded BFloat16 weights, with the recorded clipped gradient, moments, step count and
  group options, the weights rounded to BFloat16 after the step (the engine keeps Float32 moments for BFloat16
  weights by design; torch would keep BFloat16 ones for a BFloat16 parameter), torch's square root replaced by
  the correctly rounded one (as tests/test_optim.py); the weights, both moments and the count must be identical.
  A tile without gradient must be left as it was. The report counts the weights the step changed, so a PASS
  cannot come from steps that moved nothing;
* the saved model: the sampled experts' tensors read one by one from the output folder's safetensors equal the
  last checked step's weights after the step bit for bit (the last step is always checked), and the output holds
  every tensor of the input model with its shape and dtype.

With ``--state-dtype bfloat16`` or ``8bit`` (the command's option: the moments stored in BFloat16 or block-wise
8-bit) the gradient and clipping checks are unchanged, but the AdamW step is not replayed (``torch.optim.AdamW``
keeps no such moments; tests/test_optim.py checks those steps against their references): instead every sampled
routed expert's step count must grow by one and an expert no token reached must keep its weights and count bit
for bit (with 8-bit moments the counts are not recorded: the engine's ``state()`` decodes every moment tile of the
parameter into a full Float32 copy, 3 GiB at the default sizes, which the limit does not hold). With ``--step-in-backward`` (the command's option; it needs ``--max-grad-norm 0``, which this script then
uses) each expert is stepped inside backward the moment its gradient is final and the gradient is dropped: there is
no gradient left to record, no clipping and no ``step()`` that sees a gradient, so the gradient check, the clipping
check and the AdamW replay are all skipped. What is checked in that mode: the weights, count (and Float32 moments)
of each sampled expert recorded before the checked step's first forward and after its ``step()``; a routed expert's
count grew by one and some of the sampled weights changed, an unrouted expert's weights, moments and count are
unchanged bit for bit; the saved model equals the last checked step's weights, and holds every tensor. That the
update itself equals stepping after backward bit for bit is tests/test_step_in_backward.py's (through
``strideweave.torch`` for a Mixtral and a GPT-OSS), not replayed here.

Note [Bytes moved per step]
The report gives, per optimizer step, the bytes the experts moved between their tiers, from the engines' counters
read before the step's first forward and after its ``step()`` (so a checkpoint written between steps is not in any
step): weights read (every bound experts module's tiled weights: bytes promoted, from the model's files or the
scratch overlay their stepped values went to; the part read from the model's files, ``Checkpoint.bytes_read``, in
parentheses) and written (dirty tiles evicted, or flushed); gradients written and read (the step's tiled ``.grad``
of every expert weight, read after ``step()`` and before ``zero_grad`` drops it: evictions to its scratch file and
promotions back, by backward's accumulation and by the step); optimizer state read and written (the
``strideweave.optim`` engines' state traffic). The non-expert weights (torch's, in RAM) are not counted. The
recording's own reads fall in the checked steps, so the medians are over the other steps.

The minimum for the chosen state, per step: each expert routed in the step is stepped, so its moments are read
(unless it was never stepped before: they are zeros, nothing to read) and written (8 bytes per value in Float32, 4
in BFloat16, 4 * ceil((n + 4 ceil(n / 256)) / 4) per tile of n values for each 8-bit moment, about 2.03 per value
for the two), and its new weights written once; no gradient is written or read (one consumed where it is made
never is). The weights: a micro-batch's forward and backward both need each routed expert's weights, and between
the two the budget can keep at most B bytes of them (B = the budget, everything else it must hold ignored), so a
micro-batch whose routed experts' weights are T bytes reads at least 2 T - min(T, B): once when the budget holds
them all, twice when it holds none. (Reuse at the other turn, from a backward's last layers to the next forward's
first, is not subtracted; nor is the state a step in backward must hold beside the weights.) With ``--grad-accum``
above 1, an expert's gradient must also survive from one micro-batch's backward to the last; the minimum counts
no bytes for that, so with accumulation it is below what any run can reach when the gradients do not fit.

What is not checked: the experts that were not sampled, and the steps that were not checked (they ran the same
code, unrecorded); the non-expert weights (torch's own AdamW on torch's parameters); the total gradient norm itself
(it needs every gradient; only its use is checked); the routing (transformers' code, before the experts); the
losses against an in-RAM run (that needs the whole model in RAM: ``make demo`` checks the command end to end at
sizes that fit, examples/finetune_command_demo.py).

Needs a writable cgroup (root, or a delegated cgroup v2 subtree); without one it says so. Where cgroups are not
writable, ``systemd-run --user --scope -p MemoryMax=1G -p MemorySwapMax=0 python -m strideweave.finetune ...``
gives the same bound (without the sampled check).

Usage: python bench/bigger_than_ram.py [--limit-mib 1024] [--dir DIR] [--step-in-backward] [--state-dtype
{float32,bfloat16,8bit}] [sizes and options, see --help]
(default: 4 layers x 32 experts, H 1024, moe_intermediate 1024, BFloat16: 768 MiB of experts, 4.5 GiB of experts +
gradients + moments under a 1 GiB limit, budget 256 MiB; 6 steps of 2 x 256 tokens, a checkpoint at step 3;
steps 1 and 6 checked on 4 sampled experts).
``python bench/bigger_than_ram.py --example [-- EXAMPLE FLAGS...]`` runs examples/finetune_moe.py (StrideWeave's own
blocks, no transformers) under the limit instead, with its own ``--check-sample``, as before the command existed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "finetune_moe.py")
DEMO_DIR = os.path.join(ROOT, "examples")
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_EXAMPLE_FLAGS = ["--layers", "4", "--experts", "8", "--hidden", "1024", "--intermediate", "2048",
                         "--steps", "6", "--check-every", "5", "--check-sample", "4", "--budget-ratio", "6",
                         "--no-progress"]
ROLES = ("gate", "up", "down")
U_BF16 = 2.0 ** -8
SITES = 24  # K of examples/finetune_moe.py's Note [The bound of the check]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


class Cgroup:
    """A memory cgroup made for one run (v2 or v1), removed by close()."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        name = f"strideweave-bigger-than-ram-{os.getpid()}"
        lines = open("/proc/self/cgroup").read().splitlines()
        v1 = [ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1].split(",").count("memory")]
        v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
        if v1 and os.path.isdir("/sys/fs/cgroup/memory"):
            self.version = 1
            self.path = os.path.join("/sys/fs/cgroup/memory", v1[0].lstrip("/"), name)
        elif v2 and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.version = 2
            self.path = os.path.join("/sys/fs/cgroup", v2[0].lstrip("/"), name)
        else:
            raise SystemExit("no memory cgroup found (neither cgroup v2 nor a v1 memory hierarchy)")
        try:
            os.mkdir(self.path)
            if self.version == 2:
                self._write("memory.max", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                    self._write("memory.swap.max", "0")
            else:
                self._write("memory.limit_in_bytes", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                    self._write("memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError as e:
            raise SystemExit(f"cannot make a memory cgroup at {self.path}: {e} (needs root or a delegated cgroup; "
                             f"see this script's docstring for systemd-run)") from e

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def enter(self) -> None:
        """Moves the calling process into the cgroup (run in the child before exec)."""
        self._write("cgroup.procs", str(os.getpid()))

    def peak_bytes(self) -> int | None:
        v = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(v) if v else None

    def limit_hits(self) -> str:
        if self.version == 2:
            events = dict(ln.split() for ln in (self._read("memory.events") or "").splitlines() if ln)
            return f"memory.events: max {events.get('max', '?')}, oom {events.get('oom', '?')}, oom_kill {events.get('oom_kill', '?')}"
        return f"memory.failcnt {(self._read('memory.failcnt') or '?').strip()}"

    def close(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


# ---------------------------------------------------------------- records (files of arrays)


def save_arrays(path: str, arrays: dict) -> None:
    """np.savez of `arrays` (None values left out; BFloat16 ones stored as their uint16 bits)."""
    import numpy as np
    out = {}
    for k, v in arrays.items():
        if v is None:
            continue
        v = np.asarray(v)
        if v.dtype.name == "bfloat16":
            out[k + ".bf16"] = v.view(np.uint16)
        else:
            out[k] = v
    np.savez(path, **out)


def load_arrays(path: str) -> dict:
    import ml_dtypes
    import numpy as np
    with np.load(path) as z:
        return {(k[:-5] if k.endswith(".bf16") else k):
                (z[k].view(ml_dtypes.bfloat16) if k.endswith(".bf16") else z[k]) for k in z.files}


def record_path(directory: str, step: int, what: str) -> str:
    return os.path.join(directory, f"step{step:05d}-{what}.npz")


def torch_to_numpy(x):
    """A torch tensor's values as NumPy (BFloat16 as ml_dtypes.bfloat16, bit for bit)."""
    import ml_dtypes
    import torch
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return x.numpy().copy()


# ---------------------------------------------------------------- inside the cgroup: the command, recorded


class Recorder:
    """The recording hook around the command (the module docstring says what it records and why)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.dir = spec["records"]
        self.sample = [tuple(p) for p in spec["sample"]]
        self.layers = sorted({layer for layer, _ in self.sample})
        self.checked = set(spec["checked_steps"])
        self.total = spec["steps"]
        self.step = 0  # the optimizer step the next forward belongs to
        self.micro = 0  # micro-batch index within the step
        self.bindings: dict = {}  # layer -> OffloadedExperts
        self.seconds = 0.0
        self.first_forward = None
        self.trained_at = None
        self.rss_after_training = None
        self.sib = bool(spec.get("step_in_backward"))
        self.state_dtype = spec.get("state_dtype", "float32")
        self.budget_bytes = int(spec.get("budget_bytes", 0))
        self.all_bindings: list = []  # every bound experts module (the traffic counts all of them)
        self.window = None  # the tier counters when the current step's first forward began
        self.touched: list = []  # per micro-batch of the current step: {layer: set of routed experts}
        self.stepped_before: set = set()  # (layer, expert) stepped in an earlier step (their state exists)
        self.traffic: list = []  # per optimizer step: measured bytes and the minimum (Note [Bytes moved per step])
        self.optimizer = None  # the command's optimizer, once its step() has run
        os.makedirs(self.dir, exist_ok=True)

    def install(self) -> None:
        import torch

        import strideweave.torch as swt
        opened, clip, adamw = swt.from_pretrained, swt.clip_grad_norm_, swt.AdamW
        original_step = adamw.step
        rec = self

        def from_pretrained(*args, **kwargs):
            model = opened(*args, **kwargs)
            rec.attach(model)
            return model

        def clip_grad_norm_(model_or_parameters, max_norm, *args, **kwargs):
            checked = rec.step in rec.checked
            if checked:
                rec.tiles(rec.step, "pre", lambda b, t, e: {"grad": rec.tile(t.grad, e)})
            total = clip(model_or_parameters, max_norm, *args, **kwargs)
            if checked:
                t0 = time.perf_counter()
                with torch.no_grad():  # torch's factor, as strideweave.torch.clip_grad_norm_ computes it
                    factor = float(torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
                with open(record_path(rec.dir, rec.step, "clip").replace(".npz", ".json"), "w") as f:
                    json.dump({"total": float(total), "max_norm": float(max_norm), "factor": factor}, f)
                rec.seconds += time.perf_counter() - t0
            return total

        def step(optimizer, *args, **kwargs):
            s = rec.step
            rec.optimizer = optimizer
            if s in rec.checked and not rec.sib:
                rec.before_step(optimizer, s)
            result = original_step(optimizer, *args, **kwargs)
            rec.close_window(optimizer, s)
            if s in rec.checked:
                rec.tiles(s, "after", lambda b, t, e: rec.moments(optimizer, t, e, with_grad=False))
            rec.step, rec.micro = s + 1, 0
            if rec.step == rec.total:
                rec.trained_at = time.perf_counter()
                rec.rss_after_training = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return result

        swt.from_pretrained, swt.clip_grad_norm_ = from_pretrained, clip_grad_norm_
        adamw.step = step

    # ---- hooks

    def attach(self, model) -> None:
        import strideweave.torch as swt
        for name, binding in swt.offloaded_experts(model).items():
            self.all_bindings.append(binding)
            model.get_submodule(name).register_forward_hook(self._routing_hook(binding.layer), with_kwargs=True)
            if binding.layer in self.layers:
                self.bindings[binding.layer] = binding
                model.get_submodule(name).register_forward_hook(self._forward_hook(binding.layer), with_kwargs=True)
        missing = set(self.layers) - set(self.bindings)
        if missing:
            raise SystemExit(f"bigger_than_ram: no bound experts module in layers {sorted(missing)}")
        model.register_forward_pre_hook(self._first_forward)

    def _first_forward(self, module, args) -> None:
        if self.first_forward is None:
            self.first_forward = time.perf_counter()
        if self.window is None and module.training:
            self.open_window()

    def _routing_hook(self, layer: int):
        def hook(module, args, kwargs, output):
            if not output.requires_grad:
                return None
            idx = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            m = len(self.touched) - 1 if self.touched and layer not in self.touched[-1] else len(self.touched)
            if m == len(self.touched):
                self.touched.append({})
            self.touched[m][layer] = {int(e) for e in idx.unique().tolist()}
            return None
        return hook

    def _forward_hook(self, layer: int):
        def hook(module, args, kwargs, output):
            if self.step not in self.checked or not output.requires_grad:
                return None
            t0 = time.perf_counter()
            names = ("hidden_states", "top_k_index", "top_k_weights")
            values = dict(zip(names, args))
            values.update({k: v for k, v in kwargs.items() if k in names})
            path = record_path(self.dir, self.step, f"layer{layer}-mb{self.micro}")
            if layer == self.layers[-1]:
                self.micro += 1
            arrays = {"x": torch_to_numpy(values["hidden_states"]), "idx": torch_to_numpy(values["top_k_index"]),
                      "w": torch_to_numpy(values["top_k_weights"])}
            self.seconds += time.perf_counter() - t0

            def grad_hook(grad):
                t1 = time.perf_counter()
                arrays["dy"] = torch_to_numpy(grad)
                save_arrays(path, arrays)
                self.seconds += time.perf_counter() - t1

            output.register_hook(grad_hook)
            return None
        return hook

    # ---- traffic (Note [Bytes moved per step] in run_command's report)

    def counters(self, optimizer=None) -> dict:
        """The experts' tier counters now: weights read (promoted, from the checkpoint or its overlay) and written
        (evicted dirty, or flushed), the checkpoint's bytes read, and the optimizer state's promotions and
        evictions (every tiled group's engine)."""
        c = {"weights_read": 0, "weights_written": 0, "checkpoint_read": 0, "state_read": 0, "state_written": 0}
        ckpts = {}
        for b in self.all_bindings:
            ckpts[id(b.checkpoint)] = b.checkpoint
            for t in b.tiled.values():
                st = t.carrier.stats()
                c["weights_read"] += st["bytes_promoted"]
                c["weights_written"] += st["bytes_evicted"] + st["bytes_flushed"]
        c["checkpoint_read"] = sum(k.bytes_read for k in ckpts.values())
        if optimizer is not None:
            for tg in optimizer._tiled_groups:  # the strideweave.optim engines of the tiled parameter groups
                if tg.engine is not None:
                    st = tg.engine.stats()["state"]
                    c["state_read"] += st["bytes_promoted"]
                    c["state_written"] += st["bytes_evicted"]
        return c

    def open_window(self) -> None:
        import numpy as np
        t0 = time.perf_counter()
        if self.sib and self.step in self.checked and self.optimizer is not None:
            # stepping in backward: the state before the step is recorded before its first forward
            opt = self.optimizer
            self.tiles(self.step, "before", lambda b, t, e: self.moments(opt, t, e, with_grad=False, hyper=True))
        elif self.sib and self.step in self.checked:
            # the first step: the recorder meets the optimizer at its first step(), so the weights alone (the
            # moments and counts are zero: nothing was stepped)
            self.tiles(self.step, "before", lambda b, t, e: {"w": self.tile(t, e), "count": np.int64(0)})
        self.window = self.counters(self.optimizer)
        self.touched = []
        self.seconds += time.perf_counter() - t0

    def close_window(self, optimizer, step: int) -> None:
        t0 = time.perf_counter()
        before = self.window  # (its state counters are 0 before the first step: no engine had stepped)
        now = self.counters(optimizer)
        d = {k: now[k] - before[k] for k in now}
        g_read = g_written = 0
        for b in self.all_bindings:  # this step's gradients (zero_grad drops them after the step)
            for t in b.tiled.values():
                g = t.grad
                if g is not None:
                    st = g.carrier.stats()
                    g_read += st["bytes_promoted"]
                    g_written += st["bytes_evicted"] + st["bytes_flushed"]
                del g
        d.update(gradients_read=g_read, gradients_written=g_written)
        d.update(self.minimum())
        d.update(step=step + 1, checked=step in self.checked,
                 micro_batches=len(self.touched))
        self.traffic.append(d)
        self.window = None
        self.seconds += time.perf_counter() - t0

    def state_bytes_of(self, b) -> int:
        """Bytes of one expert's two AdamW moments as the chosen state stores them (Note [Compact optimizer state]
        in cpp/include/strideweave/optim.hpp): Float32 8 per value, BFloat16 4, 8-bit per tile of n values
        4 * ceil((n + 4 * ceil(n / 256)) / 4) each (codes and a Float32 absmax per block of 256: about 2.03 per
        value for the two)."""
        total = 0
        for shape in b.tile_shapes.values():
            n = 1
            for x in shape:
                n *= int(x)
            if self.state_dtype == "float32":
                total += 2 * 4 * n
            elif self.state_dtype == "bfloat16":
                total += 2 * 2 * n
            else:
                total += 2 * 4 * -(-(n + 4 * -(-n // 256)) // 4)
        return total

    def minimum(self) -> dict:
        """The least bytes this step must move between tiers for the experts (Note [Bytes moved per step])."""
        by_layer = {b.layer: b for b in self.all_bindings}
        weights_read = 0
        stepped: set = set()
        for mb in self.touched:
            t = sum(len(es) * by_layer[layer].expert_bytes for layer, es in mb.items())
            weights_read += 2 * t - min(t, self.budget_bytes)
            stepped |= {(layer, e) for layer, es in mb.items() for e in es}
        state = {key: self.state_bytes_of(by_layer[key[0]]) for key in stepped}
        out = {"min_weights_read": weights_read,
               "min_weights_written": sum(by_layer[layer].expert_bytes for layer, _ in stepped),
               "min_state_read": sum(v for key, v in state.items() if key in self.stepped_before),
               "min_state_written": sum(state.values()),
               "experts_stepped": len(stepped), "experts_first_stepped": len(stepped - self.stepped_before)}
        self.stepped_before |= stepped
        return out

    # ---- tiles

    @staticmethod
    def tile(full, e: int):
        """Tile e of a tiled (out, in, E) tensor through a one-tile projection under the run's budget, or None
        when it is implicit (a gradient never written, a moment never set)."""
        import numpy as np

        import strideweave as sw
        if full is None or full.carrier.tile_state((0, 0, e)).location == "implicit":
            return None
        with sw.no_grad():
            t = full.carrier.project(full, sw.TileSelection(((0,), (0,), (e,)))).wait()
        return np.asarray(t)[..., 0].copy()

    def tiles(self, step: int, what: str, fn) -> None:
        t0 = time.perf_counter()
        for layer, e in self.sample:
            b = self.bindings[layer]
            for role in ROLES:
                save_arrays(record_path(self.dir, step, f"{what}-{layer}-{e}-{role}"), fn(b, b.tiled[role], e))
        self.seconds += time.perf_counter() - t0

    @staticmethod
    def group_of(optimizer, t) -> int:
        for i, tensors in enumerate(optimizer.tiled_param_groups):
            if any(x is t for x in tensors):
                return i
        raise SystemExit("bigger_than_ram: a sampled expert's tile is in no parameter group")

    def moments(self, optimizer, t, e: int, with_grad: bool, hyper: bool = False) -> dict:
        import numpy as np
        i = self.group_of(optimizer, t)
        out = {"w": self.tile(t, e)}
        if self.state_dtype != "8bit":  # 8-bit: state() decodes every tile into a full Float32 copy (no count)
            state = optimizer._tiled_groups[i].engine.state(t)  # the group's strideweave.optim engine
            out["count"] = np.int64(state["step"][e])
        if self.state_dtype == "float32":  # (BFloat16 and 8-bit moments are not replayed: no torch counterpart)
            out.update(exp_avg=self.tile(state.get("exp_avg"), e), exp_avg_sq=self.tile(state.get("exp_avg_sq"), e))
        if with_grad or hyper:
            g = optimizer.param_groups[i]
            out.update(lr=np.float64(g["lr"]), beta1=np.float64(g["betas"][0]),
                       beta2=np.float64(g["betas"][1]), eps=np.float64(g["eps"]),
                       weight_decay=np.float64(g["weight_decay"]))
        if with_grad:
            out.update(grad=self.tile(t.grad, e))
        return out

    def before_step(self, optimizer, step: int) -> None:
        self.tiles(step, "before", lambda b, t, e: self.moments(optimizer, t, e, with_grad=True))


def child_main(spec_path: str, argv: list) -> int:
    """Inside the cgroup: the command with the recording hook; writes the run's figures to the spec's summary."""
    with open(spec_path) as f:
        spec = json.load(f)
    rec = Recorder(spec)
    rec.install()
    import strideweave.finetune
    code = strideweave.finetune.main(argv)
    end_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if code == 0:
        train = (rec.trained_at or 0.0) - (rec.first_forward or 0.0)
        with open(spec["summary"], "w") as f:
            json.dump({"train_seconds": train, "recording_seconds": rec.seconds,
                       "peak_rss_training": rec.rss_after_training, "peak_rss_end": end_rss,
                       "micro_batches": rec.micro, "traffic": rec.traffic}, f)
    return code


# ---------------------------------------------------------------- outside: the model, the data


def state_bytes(a) -> dict:
    """Experts' weights and gradients (the model's dtype) and AdamW moments (two, as --state-dtype stores them:
    8, 4 or about 2.03 bytes per weight)."""
    n = a.layers * a.experts * 3 * a.hidden * a.moe_intermediate
    size = 2 if a.dtype == "bfloat16" else 4
    per = {"float32": 8.0, "bfloat16": 4.0, "8bit": 2.0 * (1 + 4 / 256)}[a.state_dtype]
    return {"weights": size * n, "gradients": size * n, "moments": int(per * n)}


def drop_from_page_cache(folder: str) -> None:
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def build(a, model_dir: str, data: str) -> int:
    """The model (BFloat16) and tokenizer saved with save_pretrained, and the data file; returns the records."""
    import torch
    sys.path.insert(0, DEMO_DIR)
    import finetune_command_demo as demo
    texts = demo.corpus()
    tokenizer = demo.make_tokenizer(texts, a.vocab)
    cfg = argparse.Namespace(vocab=a.vocab, hidden=a.hidden, moe_intermediate=a.moe_intermediate, layers=a.layers,
                             experts=a.experts, seq_len=a.seq_len, seed=a.seed)
    model = demo.make_model(cfg).to(getattr(torch, a.dtype))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    drop_from_page_cache(model_dir)
    return demo.write_data(data, texts)


# ---------------------------------------------------------------- outside: the check


class SafetensorsFolder:
    """Tensors of a save_pretrained folder read one at a time (safetensors' own reader)."""

    def __init__(self, folder: str):
        from safetensors import safe_open
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.handles = [safe_open(os.path.join(folder, n), "pt") for n in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def meta(self) -> dict:
        return {k: (tuple(h.get_slice(k).get_shape()), h.get_slice(k).get_dtype()) for k, h in self.where.items()}

    def tensor(self, name: str):
        return self.where[name].get_tensor(name)


def bits(a):
    import numpy as np
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def expert_reference(torch, micro_batches: list, e: int, W: dict, absolute: bool) -> dict:
    """The expert's weight gradients in Float64 over the recorded micro-batches of its experts module: the SwiGLU
    expert on its routed rows times their routing weights, against the recorded output gradient (``absolute``:
    the magnitudes of Note [The bound of the check], silu -> 1.1 z, everything on absolute values)."""
    ws = {r: (W[r].abs() if absolute else W[r]).clone().requires_grad_() for r in ROLES}
    for mb in micro_batches:
        rows, slot = (mb["idx"] == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        x, w, dy = mb["x"][rows], mb["w"][rows, slot], mb["dy"][rows]
        if absolute:
            x, w, dy = x.abs(), w.abs(), dy.abs()
        h1, h3 = x @ ws["gate"].T, x @ ws["up"].T
        act = 1.1 * h1 if absolute else torch.nn.functional.silu(h1)
        y = ((act * h3) @ ws["down"].T) * w[:, None]
        (y * dy).sum().backward()
    return {r: (ws[r].grad if ws[r].grad is not None else torch.zeros_like(ws[r])) for r in ROLES}


def adamw_expected(torch, before: dict):
    """torch.optim.AdamW's step from the recorded state, with the recorded hyperparameters: examples/finetune_moe.py's
    ``adamw_expected`` (weights rounded to the weights' dtype, exp_avg, exp_avg_sq, count)."""
    sys.path.insert(0, DEMO_DIR)
    import finetune_moe
    return finetune_moe.adamw_expected(torch, before, float(before["lr"]), float(before["weight_decay"]),
                                       (float(before["beta1"]), float(before["beta2"])), float(before["eps"]))


def verify(a, records: str, sample: list, steps: list, model_dir: str, out_dir: str) -> dict:
    """The sampled check (module docstring), one record in memory at a time."""
    import numpy as np
    import torch

    f64 = lambda v: torch.from_numpy(np.asarray(v).astype(np.float64))  # noqa: E731
    n = max(a.batch_tokens, a.hidden, a.moe_intermediate)
    u = U_BF16 if a.dtype == "bfloat16" else 2.0 ** -24
    u_s = u + 2 * (n * 2.0 ** -24 / (1 - n * 2.0 ** -24))
    factor = (1 + u_s) ** SITES - 1
    r = {"grad_worst": 0.0, "grad_resolved": 0, "grad_elements": 0, "grad_err_sq": 0.0, "grad_sq": 0.0,
         "clip_worst": 0.0, "adamw_mismatches": 0,
         "weights_changed": 0, "weights_stepped": 0, "unrouted_with_grad": 0, "routed_without_grad": 0,
         "routed_tokens": 0, "saved_mismatches": 0, "missing_records": 0, "output_tensors_differ": 0,
         "clip_factors": [], "count_mismatches": 0, "unrouted_changed": 0}
    sib = a.step_in_backward
    exact_adamw = not sib and a.state_dtype == "float32"  # torch.optim.AdamW keeps Float32 moments only
    layers = sorted({layer for layer, _ in sample})
    for step in steps:
        clip_path = record_path(records, step, "clip").replace(".npz", ".json")
        clip = None
        if os.path.exists(clip_path):
            with open(clip_path) as f:
                clip = json.load(f)
            r["clip_factors"].append(clip["factor"])
        elif not sib and a.max_grad_norm > 0:
            r["missing_records"] += 1
        for layer in layers:
            mbs = []
            for m in range(a.grad_accum):
                path = record_path(records, step, f"layer{layer}-mb{m}")
                if not os.path.exists(path):
                    r["missing_records"] += 1
                    continue
                rec = load_arrays(path)
                k = rec["idx"].shape[-1]
                mbs.append({"x": f64(rec["x"]).reshape(-1, a.hidden), "dy": f64(rec["dy"]).reshape(-1, a.hidden),
                            "w": f64(rec["w"]).reshape(-1, k),
                            "idx": torch.from_numpy(rec["idx"].astype(np.int64)).reshape(-1, k)})
            for e in [e for ly, e in sample if ly == layer]:
                tokens = sum(int((mb["idx"] == e).sum()) for mb in mbs)
                r["routed_tokens"] += tokens
                # the gradient before clipping (without clipping: the one the step used); none stepping in backward
                pre = {ro: load_arrays(record_path(records, step, f"pre-{layer}-{e}-{ro}")) if clip else
                       load_arrays(record_path(records, step, f"before-{layer}-{e}-{ro}")) for ro in ROLES}
                before = {ro: load_arrays(record_path(records, step, f"before-{layer}-{e}-{ro}")) for ro in ROLES}
                after = {ro: load_arrays(record_path(records, step, f"after-{layer}-{e}-{ro}")) for ro in ROLES}
                if tokens == 0:
                    r["unrouted_with_grad"] += sum("grad" in pre[ro] or "grad" in before[ro] for ro in ROLES)
                    for ro in ROLES:  # an expert no token reached is not stepped: weights, moments, count kept
                        for key in ("w", "exp_avg", "exp_avg_sq"):
                            x, y = before[ro].get(key), after[ro].get(key)
                            if (x is None) != (y is None):
                                r["unrouted_changed"] += 1
                            elif x is not None:
                                r["unrouted_changed"] += int(np.count_nonzero(bits(x) != bits(y)))
                        if "count" in after[ro]:
                            r["count_mismatches"] += int(int(after[ro]["count"]) != int(before[ro]["count"]))
                else:
                    for ro in ROLES:  # a routed expert is stepped once
                        if "count" in after[ro]:
                            r["count_mismatches"] += int(int(after[ro]["count"]) != int(before[ro]["count"]) + 1)
                        r["weights_changed"] += int(np.count_nonzero(bits(after[ro]["w"]) != bits(before[ro]["w"])))
                        r["weights_stepped"] += after[ro]["w"].size
                if tokens and not sib:
                    W = {ro: f64(before[ro]["w"]) for ro in ROLES}
                    want = expert_reference(torch, mbs, e, W, absolute=False)
                    mag = expert_reference(torch, mbs, e, W, absolute=True)
                    for ro in ROLES:
                        if "grad" not in pre[ro] or "grad" not in before[ro]:
                            r["routed_without_grad"] += 1
                            continue
                        g, bound = f64(pre[ro]["grad"]), factor * mag[ro]
                        err = (g - want[ro]).abs()
                        r["grad_worst"] = max(r["grad_worst"], float((err / (bound + 1e-300)).max()))
                        r["grad_resolved"] += int((want[ro].abs() > bound).sum())
                        r["grad_elements"] += want[ro].numel()
                        r["grad_err_sq"] += float((err * err).sum())
                        r["grad_sq"] += float((want[ro] * want[ro]).sum())
                        if clip is None:
                            continue
                        # clipping: g_c = f g within one BFloat16 rounding of a Float32 product
                        fg = g * clip["factor"]
                        cerr = (f64(before[ro]["grad"]) - fg).abs()
                        cb = (u + 2.0 ** -23) * fg.abs()
                        r["clip_worst"] = max(r["clip_worst"], float((cerr / (cb + 1e-300)).max()))
                for ro in ROLES if exact_adamw else ():
                    ww, wm, wv, wc = adamw_expected(torch, before[ro])
                    got = (after[ro]["w"], after[ro].get("exp_avg"), after[ro].get("exp_avg_sq"))
                    for x, y in zip(got, (ww, wm, wv)):
                        if x is None:
                            r["adamw_mismatches"] += int(np.count_nonzero(np.asarray(y)))
                        else:
                            r["adamw_mismatches"] += int(np.count_nonzero(bits(x) != bits(np.asarray(y, x.dtype))))
                    r["adamw_mismatches"] += int(int(after[ro]["count"]) != wc)
    # the saved model: the sampled experts are the last checked step's weights after the step
    saved, original = SafetensorsFolder(out_dir), SafetensorsFolder(model_dir)
    got_meta, want_meta = saved.meta(), original.meta()
    r["output_tensors_differ"] = len(set(got_meta.items()) ^ set(want_meta.items()))
    last = steps[-1]
    for layer, e in sample:
        for ro in ROLES:
            final = load_arrays(record_path(records, last, f"after-{layer}-{e}-{ro}"))["w"]
            t = saved.tensor(f"model.layers.{layer}.mlp.experts.{e}.{ro}_proj.weight")
            t = torch_to_numpy(t)
            r["saved_mismatches"] += int(np.count_nonzero(bits(t) != bits(final)))
    r["ok"] = (r["grad_worst"] <= 1.0 and r["clip_worst"] <= 1.0 and r["adamw_mismatches"] == 0
               and r["unrouted_with_grad"] == 0 and r["routed_without_grad"] == 0 and r["saved_mismatches"] == 0
               and r["missing_records"] == 0 and r["output_tensors_differ"] == 0
               and (sib or r["grad_elements"] > 0) and r["weights_changed"] > 0 and r["count_mismatches"] == 0
               and r["unrouted_changed"] == 0)
    return r


# ---------------------------------------------------------------- the runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--limit-mib", type=int, default=1024, help="the cgroup's memory limit")
    p.add_argument("--dir", default=None, help="folder for the model, the run and its records (default: temporary)")
    p.add_argument("--keep", action="store_true", help="keep the working folder (with --dir)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the model's dtype (float32: a much sharper gradient check, 16 bytes of state per weight)")
    p.add_argument("--budget", default="256MiB", help="the command's --budget")
    p.add_argument("--steps", type=int, default=6, help="the command's --max-steps")
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="the command's --max-grad-norm (default 1.0; 0 with --step-in-backward, which needs it)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="the command's --step-in-backward (no gradient written; the check then has no gradient to "
                   "compare: see the docstring)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16", "8bit"), default="float32",
                   help="the command's --state-dtype (the experts' AdamW moments)")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=4, help="sampled experts")
    p.add_argument("--check-steps", default=None,
                   help="comma-separated 0-based optimizer steps to check (default: the first and the last; the "
                   "last is always added)")
    p.add_argument("--example", action="store_true",
                   help="run examples/finetune_moe.py under the limit instead (its flags after --)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rest[:1] == ["--"]:
        a.rest = a.rest[1:]
    if a.max_grad_norm is None:
        a.max_grad_norm = 0.0 if a.step_in_backward else 1.0
    elif a.step_in_backward and a.max_grad_norm > 0:
        p.error(f"--step-in-backward needs --max-grad-norm 0 (got {a.max_grad_norm}): the total norm needs every "
                "gradient before any expert is stepped")
    return a


def run_command(a) -> int:
    import random
    state = state_bytes(a)
    total = sum(state.values())
    limit = a.limit_mib * MiB
    if total <= limit:
        raise SystemExit(f"experts + gradients + moments ({total / MiB:.0f} MiB) must exceed the limit "
                         f"({a.limit_mib} MiB): choose larger sizes or a lower limit")
    if a.grad_accum > SITES - 12:
        raise SystemExit(f"--grad-accum {a.grad_accum}: the gradient bound counts at most {SITES - 12} accumulations")
    pairs = [(layer, e) for layer in range(a.layers) for e in range(a.experts)]
    sample = sorted(random.Random(a.seed * 1000 + 14).sample(pairs, min(a.sample, len(pairs))))
    steps = sorted({0, a.steps - 1} if a.check_steps is None else
                   {int(s) for s in a.check_steps.split(",")} | {a.steps - 1})
    if steps[0] < 0 or steps[-1] >= a.steps:
        raise SystemExit(f"--check-steps must be within 0..{a.steps - 1}")
    print(f"CPU: {cpu_name()}; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cg = Cgroup(limit)
    tmp = tempfile.TemporaryDirectory(prefix="bigger_than_ram_", dir=a.dir) if not a.keep else None
    directory = tmp.name if tmp else tempfile.mkdtemp(prefix="bigger_than_ram_", dir=a.dir)
    try:
        model_dir, data = os.path.join(directory, "model"), os.path.join(directory, "data.jsonl")
        out_dir, records = os.path.join(directory, "out"), os.path.join(directory, "records")
        t0 = time.perf_counter()
        n_records = build(a, model_dir, data)
        print(f"built outside the cgroup in {time.perf_counter() - t0:.0f} s: Qwen3-MoE, {a.layers} layers x "
              f"{a.experts} experts, H {a.hidden}, moe_intermediate {a.moe_intermediate}, {a.dtype}; {n_records} "
              f"records of data")
        print(f"experts {state['weights'] / MiB:.0f} MiB + gradients {state['gradients'] / MiB:.0f} MiB + moments "
              f"{state['moments'] / MiB:.0f} MiB = {total / GiB:.2f} GiB = {total / limit:.2f}x the cgroup v"
              f"{cg.version} limit of {a.limit_mib} MiB (swap off); the command's budget {a.budget}")
        print(f"sampled experts (layer, expert): {sample}; checked steps (1-based): {[s + 1 for s in steps]}")
        summary = os.path.join(directory, "summary.json")
        spec = os.path.join(directory, "spec.json")
        with open(spec, "w") as f:
            json.dump({"records": records, "sample": sample, "checked_steps": steps, "steps": a.steps,
                       "summary": summary, "step_in_backward": a.step_in_backward, "state_dtype": a.state_dtype,
                       "budget_bytes": parse_size(a.budget)}, f)
        command = [model_dir, "--data", data, "--output", out_dir, "--budget", a.budget, "--max-steps",
                   str(a.steps), "--batch-tokens", str(a.batch_tokens), "--seq-len", str(a.seq_len),
                   "--grad-accum", str(a.grad_accum), "--lr", repr(a.lr), "--weight-decay", repr(a.weight_decay),
                   "--warmup", "0", "--max-grad-norm", repr(a.max_grad_norm), "--save-every", str(a.save_every),
                   "--seed", str(a.seed), "--no-progress", "--state-dtype", a.state_dtype]
        if a.step_in_backward:
            command.append("--step-in-backward")
        print("running in the cgroup: python -m strideweave.finetune " + " ".join(command), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec, "--"] + command,
                              preexec_fn=cg.enter, check=False)
        wall = time.perf_counter() - t0
        peak = cg.peak_bytes()
        print(f"\nexit status {proc.returncode} after {wall:.0f} s; {cg.limit_hits()}")
        if peak is not None:
            print(f"cgroup peak charge (RSS + page cache): {peak / MiB:.0f} MiB of the {a.limit_mib} MiB limit")
        if proc.returncode != 0 or not os.path.exists(summary):
            print("FAIL: the run did not complete" + (" (killed: over the limit)" if proc.returncode in (-9, 137)
                                                      else ""))
            return 1
        with open(summary) as f:
            s = json.load(f)
        tokens = a.steps * a.batch_tokens * a.grad_accum
        seconds = s["train_seconds"] - s["recording_seconds"]
        print(f"process peak RSS after training {s['peak_rss_training'] / MiB:.0f} MiB "
              f"({s['peak_rss_training'] / total:.2f}x the state, {s['peak_rss_training'] / limit:.2f}x the limit); "
              f"at the end (with the save) {s['peak_rss_end'] / MiB:.0f} MiB")
        print(f"training: {tokens} tokens in {seconds:.1f} s without the recording ({s['recording_seconds']:.1f} s): "
              f"{tokens / seconds:.1f} tokens/s")
        report_traffic(s["traffic"], a)
        sizes = {name: sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(os.path.join(out_dir, name))
                           for fn in fns) for name in os.listdir(out_dir) if name.startswith("checkpoint-")}
        model_bytes = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir)
                          if n.endswith(".safetensors"))
        print(f"output: {', '.join(f'{k} {v / MiB:.0f} MiB' for k, v in sorted(sizes.items()))}; the model "
              f"{model_bytes / MiB:.0f} MiB")
        t0 = time.perf_counter()
        r = verify(a, records, sample, steps, model_dir, out_dir)
        parts = []
        if not a.step_in_backward:
            parts.append(f"gradients worst |error| / bound {r['grad_worst']:.3g} over {r['grad_elements']} elements "
                         f"({r['grad_resolved'] / max(r['grad_elements'], 1):.1%} larger than their bound; measured "
                         f"|error|_F / |g|_F {(r['grad_err_sq'] / max(r['grad_sq'], 1e-300)) ** 0.5:.2g})")
            if a.max_grad_norm > 0:
                parts.append(f"clipping (factors {', '.join(f'{x:.4g}' for x in r['clip_factors'])}) worst "
                             f"{r['clip_worst']:.3g}")
        if not a.step_in_backward and a.state_dtype == "float32":
            parts.append(f"AdamW steps: {r['adamw_mismatches']} values differ from torch.optim.AdamW")
        else:
            parts.append("no AdamW replay (" + ("stepped in backward: no gradient left" if a.step_in_backward else
                                                f"{a.state_dtype} moments") + "; docstring)")
        parts.append(f"{r['weights_changed']} of {r['weights_stepped']} routed experts' weights changed by the "
                     f"steps, step counts wrong {r['count_mismatches']}, unrouted experts changed "
                     f"{r['unrouted_changed']} ({r['routed_tokens']} routed tokens)")
        parts.append(f"saved: {r['saved_mismatches']} differ, {r['output_tensors_differ']} tensors' names/shapes/"
                     f"dtypes differ from the input model's; unrouted with a gradient {r['unrouted_with_grad']}, "
                     f"routed without {r['routed_without_grad']}, missing records {r['missing_records']}")
        print(f"check ({time.perf_counter() - t0:.0f} s, outside the cgroup), {len(sample)} experts x {len(steps)} "
              f"steps: " + "; ".join(parts))
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("check PASS" if r["ok"] else "check FAIL")
        return 0 if r["ok"] else 1
    finally:
        cg.close()
        if tmp is not None:
            tmp.cleanup()
        else:
            print(f"kept {directory}")


def parse_size(text: str) -> int:
    from strideweave.finetune._data import parse_size as parse  # the command's own reading of --budget
    return parse(text)


TRAFFIC = (("weights_read", "weights read"), ("weights_written", "weights written"),
           ("gradients_written", "gradients written"), ("gradients_read", "gradients read"),
           ("state_read", "state read"), ("state_written", "state written"))
MINIMUM = (("min_weights_read", "weights read"), ("min_weights_written", "weights written"),
           ("min_state_read", "state read"), ("min_state_written", "state written"))


def report_traffic(traffic: list, a) -> dict:
    """Prints the experts' bytes moved per step against the minimum (Note [Bytes moved per step]); returns the
    medians over the steps measured (not the checked ones, whose recording reads tiles)."""
    import statistics
    for d in traffic:
        d["moved"] = sum(d[k] for k, _ in TRAFFIC)
        d["minimum"] = sum(d[k] for k, _ in MINIMUM)
    print("experts' bytes moved between tiers per step (MiB; weights read includes the checkpoint's reads; "
          "* = a checked step, its recording's reads included):")
    print("  step  " + "  ".join(f"{label:>17}" for _, label in TRAFFIC) + "      moved    minimum  ratio  (from "
          "the checkpoint)")
    for d in traffic:
        print(f"  {d['step']:>3}{'*' if d['checked'] else ' '}  " + "  ".join(f"{d[k] / MiB:17.1f}" for k, _ in TRAFFIC)
              + f"  {d['moved'] / MiB:9.1f}  {d['minimum'] / MiB:9.1f}  {d['moved'] / max(d['minimum'], 1):5.2f}"
              f"  ({d['checkpoint_read'] / MiB:.1f})")
    measured = [d for d in traffic if not d["checked"]]
    if not measured:
        print("no unchecked step to measure the traffic on (every step was checked)")
        return {}
    med = {k: statistics.median(d[k] for d in measured) for k in
           [k for k, _ in TRAFFIC] + [k for k, _ in MINIMUM] + ["moved", "minimum", "experts_stepped"]}
    ratio = statistics.median(d["moved"] / max(d["minimum"], 1) for d in measured)
    print(f"median over steps {[d['step'] for d in measured]}: moved {med['moved'] / MiB:.0f} MiB ("
          + ", ".join(f"{label} {med[k] / MiB:.0f}" for k, label in TRAFFIC) + f"); minimum for "
          f"{a.state_dtype} moments {med['minimum'] / MiB:.0f} MiB ("
          + ", ".join(f"{label} {med[k] / MiB:.0f}" for k, label in MINIMUM)
          + f"; {med['experts_stepped']:.0f} experts stepped); moved / minimum {ratio:.2f} (median of the steps' "
          f"ratios): target <= 1.2x {'MET' if ratio <= 1.2 else 'MISSED'}")
    med["ratio"] = ratio
    return med


def run_example(a) -> int:
    """examples/finetune_moe.py under the limit, with its own --check-sample (the flags after --)."""
    flags = a.rest or DEFAULT_EXAMPLE_FLAGS
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import finetune_moe  # the example's own sizes

    cfg = finetune_moe.parse_args(flags)
    state = sum(cfg.state_bytes().values())
    limit = a.limit_mib * MiB
    if state <= limit:
        raise SystemExit(f"experts + gradients + moments ({state / MiB:.0f} MiB) must exceed the limit "
                         f"({a.limit_mib} MiB): choose larger sizes or a lower limit")
    if not cfg.check_sample:
        raise SystemExit("pass --check-sample N: the full replay holds the whole state in memory")
    cg = Cgroup(limit)
    try:
        with tempfile.TemporaryDirectory(prefix="bigger_than_ram_", dir=a.dir) as directory:
            summary_path = os.path.join(directory, "summary.json")
            cmd = [sys.executable, EXAMPLE] + flags + ["--dir", directory, "--summary-json", summary_path]
            print(f"CPU: {cpu_name()}; cgroup v{cg.version} limit {a.limit_mib} MiB (swap off) for "
                  f"{state / MiB:.0f} MiB of experts + gradients + moments ({state / limit:.2f}x the limit)")
            print("running:", " ".join(cmd[1:]), flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, preexec_fn=cg.enter, check=False)
            wall = time.perf_counter() - t0
            peak = cg.peak_bytes()
            print(f"\nexit status {proc.returncode} after {wall:.0f} s; {cg.limit_hits()}")
            if peak is not None:
                print(f"cgroup peak charge (RSS + page cache): {peak / MiB:.0f} MiB of the {a.limit_mib} MiB limit")
            if proc.returncode != 0 or not os.path.exists(summary_path):
                print("FAIL: the run did not complete" + (" (killed: over the limit)" if proc.returncode in (-9, 137)
                                                          else ""))
                return 1
            s = json.load(open(summary_path))
            ok = bool(s["ok"]) and s.get("check", {}).get("ok", False)
            print(f"process peak RSS after training {s['peak_rss'] / MiB:.0f} MiB "
                  f"({s['peak_rss'] / state:.2f}x the state, {s['peak_rss'] / limit:.2f}x the limit); "
                  f"tokens/s {s['tokens_per_s']:.0f}; peak RSS at the end (save, reload, check) "
                  f"{s['peak_rss_end'] / MiB:.0f} MiB; check {'PASS' if ok else 'FAIL'}")
            return 0 if ok else 1
    finally:
        cg.close()


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child is not None:
        return child_main(a.child, a.rest)
    if a.example:
        return run_example(a)
    if a.rest:
        raise SystemExit(f"unexpected arguments {a.rest} (flags after -- go to the example, with --example)")
    return run_command(a)


if __name__ == "__main__":
    sys.exit(main())
