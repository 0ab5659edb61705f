"""Fine-tuning the MoE layers of a Mixtral-format checkpoint whose experts, gradients and Adam moments exceed memory.

This is the job StrideWeave is for. The example

1. writes a Mixtral-format checkpoint with the ``safetensors`` package (in a child process, so that PyTorch never
   enters this process's memory): one shard per layer plus ``model.safetensors.index.json``, tensors named as
   transformers names a Mixtral's, ``model.layers.{L}.block_sparse_moe.experts.{e}.w1/w2/w3.weight`` (PyTorch's
   ``(out, in)`` matrices), ``model.layers.{L}.block_sparse_moe.gate.weight``, ``model.embed_tokens.weight`` and
   ``lm_head.weight``; BFloat16 by default (``--dtype float32`` for a Float32 one). Nothing is downloaded;
2. opens it where it lies (``sw.safetensors.open(folder)``, then ``ckpt.tiled(names)`` per layer and matrix: one
   tile per expert, the file's bytes, no copy), one ``sw.moe.SparseMoE`` per layer, every carrier under ONE
   ``sw.ResidencyBudget`` (``--budget-ratio``: experts + gradients + Adam moments are that many times the budget,
   4 or more);
3. trains the experts with ``sw.optim.AdamW`` (Float32 moments, in TiledEvictables beside the weights under the
   same budget) on a synthetic next-token-like objective, and prints a progress bar and a summary;
4. checks the run against a dense PyTorch run of the same steps, saves the fine-tuned experts atomically to a NEW
   checkpoint with ``sw.safetensors.save`` (written tile by tile, the original is never written), reopens it and
   verifies a forward pass against the in-memory model. The exit status is 1 when a check fails.

The model and the objective
---------------------------
A vocabulary of ``V`` tokens, a fixed random successor rule ``succ`` (a permutation of the vocabulary): the target
of token ``t`` is ``succ[t]``. A step takes ``--tokens`` random tokens ``x`` and computes, all in StrideWeave and
in the checkpoint's dtype,

    h_0 = E[x]                                   (the embedding rows: frozen)
    h_(l+1) = h_l + MoE_l(h_l)                   (a Mixtral sparse-MoE block, top-2, SwiGLU experts)
    logits = h_L U^T,  p = sw.softmax(logits)    (U, the unembedding: frozen)
    loss = -mean_t log p[t, succ[x_t]]

and hands the cotangent ``(p - onehot) / T`` of the logits to backward (the cross-entropy's gradient). The routers
are frozen (the checkpoint's gate weights; top-2 routing is computed by StrideWeave, ``moe.route``), so only the
experts train: ``AdamW(lr, weight_decay)`` over every layer's w1, w2 and w3. The layers are backpropagated one at a
time: each layer's input is a fresh leaf (a copy of ``h_l``, ``T x H`` values), ``h_(l+1).backward(g)`` gives
``g_l``, the gradient of ``h_l``, which goes to the layer below. So a step's graph holds one layer's saved
activations at a time during backward, and the check can compare every layer's inputs, outputs and gradients.

Prefetching
-----------
The routers are frozen and ``h_0`` is a lookup, so layer 0's routing of step ``s + 1`` is known before step ``s``
starts: it is computed with the router alone, and that layer's experts are prefetched (``moe.prefetch``) after
step ``s``'s optimizer step, while the next batch is prepared. Within a step each layer prefetches all its routed
experts as soon as its routing is known (``moe.prefetch(indices)`` before ``moe.experts``), and the block itself
keeps the next expert's tiles in flight while one computes. The optimizer steps layer 0 last, so its experts are
the most recently used tiles when the next forward starts. ``--no-prefetch`` turns the example's two prefetches
off (the block's own stays); the summary's "waiting for I/O" and hit rate show the difference. Measured at the
defaults on a shared 2-core machine, two paired runs of the training alone: the hit rate is 80% with the
prefetches and 34% without, but the blocks' wait for tiles is about 0.04 s of 12-15 s either way (the checkpoint,
overlay and scratch files are in the page cache, and the block's own one-expert lookahead already hides those
reads), and throughput was within the noise (819 and 1032 tokens/s with, 868 and 862 without). The prefetches
pay off when tiles come from a device rather than from the page cache.

The check (``--no-check`` skips it)
-----------------------------------
The check replays the same steps from the original checkpoint, StrideWeave without a budget (every value must be
the same as the budgeted run's: eviction and promotion move bytes and do no arithmetic) in lockstep with PyTorch:

* every layer, on ``--check-every``-th steps: the block's output, the gradient of its input and its experts'
  gradients against PyTorch in Float64 on StrideWeave's actual inputs (``h_l``, the incoming gradient, the same
  routing decisions), element by element within a derived bound (Note [The bound of the check]);
* the routing: where the Float64 logits' top-2 is more than twice the logits' error bound away from a tie (and
  the second probability does not underflow Float32, where the block's softmax makes it tie with the other
  underflowed ones), StrideWeave's experts must be the exact top-2 (asserted; the tokens closer to a tie are
  counted and keep StrideWeave's decision);
* every step: ``torch.optim.AdamW`` with one ``nn.Parameter`` per expert matrix (Float32 copies of the weights,
  Float32 moments, ``foreach=False``; a matrix without gradient has ``grad None``, as sw.optim skips its tile),
  stepped with StrideWeave's gradients, each weight rounded to the checkpoint's dtype after the step: the weights
  must be bit-identical to StrideWeave's (bound 0: the same Float32 arithmetic, then the same rounding; torch's
  square root replaced by the correctly rounded one, as in tests/test_optim.py);
* the saved checkpoint holds exactly PyTorch's final weights, and a forward pass over the reopened checkpoint gives
  exactly the logits of the in-memory model.

The replay holds every expert, gradient and moment in memory (it has no budget). ``--check-sample N`` is the check
for runs bigger than RAM: no replay; on the checked steps the budgeted run itself records, to files beside the
checkpoint, each sampled layer's input, output gradient and routing and, for N sampled experts (seeded; printed),
their weights, gradients, AdamW moments and step counts before and after the optimizer step. Afterwards, one
record in memory at a time, the same comparisons run on the sample: the routing of the sampled layers, each
sampled expert's weight gradients in Float64 within the same bound (an expert's gradient needs only its own rows,
so the other experts are not needed; an unrouted expert's gradient must be implicit), each sampled AdamW step
against ``torch.optim.AdamW`` started from the recorded state (weights, both moments and the step count, bit for
bit), and the sample's saved values. The recording's time is left out of the run's wall time.
``bench/bigger_than_ram.py`` runs the example this way under a memory cgroup smaller than the state.

Note [The bound of the check]
-----------------------------
Each compared quantity ``F`` is a function of rounded intermediates ``q_s`` (the router logits, h1, h3, silu(h1),
their product, y, y * w, each output row after each expert, the residual sum; in backward dY, dA, dh1, dh3, the
weight gradients and their rounding at the leaf, the routing weights' gradient, the input's gradient sums). Each
site rounds a value of magnitude ``m_s`` with relative error at most ``u_s = u + 2 gamma_n`` (``u`` the dtype's
unit roundoff, 2^-8 for BFloat16, 2^-24 for Float32; ``gamma_n = n 2^-24 / (1 - n 2^-24)`` for the Float32 sum of
``n`` products before it, ``n`` at most the largest of T, H and I). ``F`` is multilinear in the sites, except
through silu (|silu(z)| <= |z|, |z silu'(z)| <= 1.1 |z|, |silu'| <= 1.1, |z silu''(z)| <= 0.6) and the top-2
softmax weights (|w| <= 1, |dw_i / dl_j| <= 1/4), so one rounding moves ``F`` by at most ``u_s`` times ``F``'s
magnitude ``M_F``: the same computation on absolute values, silu replaced by ``1.1 z``, its derivative by 1.1 and
the routing weights by ``1 + (l_i + l_j) / 4``, run by PyTorch's autograd in Float64 on |x|, |weights|, |g|. Over
at most ``K = 24`` sites, ``|F_sw - F_exact| <= ((1 + u_s)^K - 1) M_F``. The residual sum and the incoming gradient
add ``|h_l|`` and ``|g|`` to the magnitudes. The bound is loose for BFloat16 (about 0.1 M_F: the quantities are
sums of many signed terms, so M_F is often much larger than |F|); the worst ratio |error| / bound is printed. With
``--dtype float32`` it is about 1.5e-3 M_F, and tests/test_finetune_example.py shows the check failing when one
element of one expert's gradient is lost.

Flags: ``--layers --experts --hidden --intermediate --vocab --tokens --steps --seconds --lr --weight-decay --budget-ratio
--dtype --dir --seed --check-every --check-sample N --no-check --no-prefetch --no-progress --plot FILE.png --compare
--summary-json FILE``. ``make demo``
runs the defaults: about a minute on a 2-core machine. ``--plot`` draws the resident bytes of each tier (weights,
gradients, moments) after each step's backward and optimizer step, and the throughput; ``--compare`` runs the
same training in PyTorch with everything in RAM (bf16 compute, Float32 master weights and moments,
``torch.optim.AdamW``) in a fresh process, side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import ml_dtypes
import numpy as np

import strideweave as sw
from strideweave import friendly

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_offload import fmt_bytes, peak_rss_bytes, print_table  # noqa: E402  (the smaller example's reporting)

MiB = 1 << 20
MATRICES = ("w1", "w2", "w3")
U_DTYPE = {"bfloat16": 2.0**-8, "float32": 2.0**-24}
NP_DTYPE = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
SW_DTYPE = {"bfloat16": sw.DType.BFloat16, "float32": sw.DType.Float32}
SITES = 24  # K of Note [The bound of the check]


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass
class Config:
    layers: int = 4
    experts: int = 8
    hidden: int = 256
    intermediate: int = 512
    vocab: int = 512
    tokens: int = 512
    steps: int = 24
    seconds: float = 0.0  # > 0: train for that long instead of `steps` steps (then `steps` is the steps done)
    top_k: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.01
    budget_ratio: float = 5.0  # experts + gradients + moments = budget_ratio x the residency budget
    dtype: str = "bfloat16"
    dir: str | None = None
    seed: int = 0
    check: bool = True
    check_every: int = 12  # the Float64 comparison on steps 0, check_every, 2 check_every, ... and the last
    check_sample: int = 0  # > 0: check that many sampled experts within the budgeted run instead of a full replay
    summary_json: str | None = None
    prefetch: bool = True
    progress: bool = True
    plot: str | None = None
    compare: bool = False

    def validate(self) -> None:
        for name in ("layers", "experts", "hidden", "intermediate", "vocab", "tokens", "steps", "top_k",
                     "check_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.check_sample < 0:
            raise ValueError("--check-sample must be >= 0")
        if not self.seconds >= 0:
            raise ValueError("--seconds must be >= 0")
        if self.top_k >= self.experts:
            raise ValueError("--top-k must be smaller than --experts")
        if self.budget_ratio < 1:
            raise ValueError("--budget-ratio must be >= 1")
        if self.lr < 0 or self.weight_decay < 0:
            raise ValueError("--lr and --weight-decay must be >= 0")
        if self.dtype not in U_DTYPE:
            raise ValueError("--dtype must be bfloat16 or float32")

    @property
    def itemsize(self) -> int:
        return NP_DTYPE[self.dtype].itemsize

    def expert_params(self) -> int:
        """Parameters of all experts of all layers."""
        return self.layers * self.experts * 3 * self.hidden * self.intermediate

    def state_bytes(self) -> dict:
        """Bytes of the experts, their gradients (the weights' dtype) and AdamW's two Float32 moments."""
        n = self.expert_params()
        return {"weights": n * self.itemsize, "gradients": n * self.itemsize, "moments": 2 * 4 * n}

    def budget_bytes(self) -> int:
        return int(sum(self.state_bytes().values()) / self.budget_ratio)


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, help_ in (("layers", "MoE layers"), ("experts", "experts per layer"), ("hidden", "hidden size H"),
                        ("intermediate", "expert intermediate size I"), ("vocab", "vocabulary"),
                        ("tokens", "tokens per step"), ("steps", "optimizer steps"), ("top_k", "experts per token")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                       help=f"{help_} (default %(default)s)")
    p.add_argument("--seconds", type=float, default=d.seconds,
                   help="train for this many seconds instead of --steps steps: the first step that starts after "
                        "them is the last one (0: off; default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (default %(default)s)")
    p.add_argument("--budget-ratio", type=float, default=d.budget_ratio,
                   help="experts + gradients + moments over the residency budget (default %(default)s)")
    p.add_argument("--dtype", choices=sorted(U_DTYPE), default=d.dtype, help="checkpoint dtype (default %(default)s)")
    p.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (default %(default)s)")
    p.add_argument("--check-every", type=int, default=d.check_every,
                   help="Float64 comparison every N steps, and on the last (default %(default)s)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the comparison with PyTorch")
    p.add_argument("--check-sample", type=int, default=d.check_sample, metavar="N",
                   help="check N sampled experts within the budgeted run instead of replaying every step "
                        "(memory stays bounded: for runs bigger than RAM)")
    p.add_argument("--summary-json", metavar="FILE", default=None, help="also write the summary as JSON")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="no prefetch of the next step's and each layer's routed experts")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="residency per tier and throughput chart")
    p.add_argument("--compare", action="store_true", help="also run the training in PyTorch, all in RAM")
    a = p.parse_args(argv)
    cfg = Config(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Config)})
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg


# ---------------------------------------------------------------- the checkpoint


def expert_name(layer: int, e: int, m: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{m}.weight"


def gate_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.gate.weight"


def matrix_shape(cfg: Config, m: str) -> tuple[int, int]:
    """PyTorch's (out, in): w1 and w3 are (I, H), w2 is (H, I)."""
    return (cfg.hidden, cfg.intermediate) if m == "w2" else (cfg.intermediate, cfg.hidden)


def initial_matrix(cfg: Config, layer: int, e: int, m: int) -> np.ndarray:
    """Expert e's matrix m of a layer (Float32, before rounding to the checkpoint's dtype), reproducible alone."""
    out, inp = matrix_shape(cfg, MATRICES[m])
    rng = np.random.default_rng([cfg.seed, 10, layer, e, m])
    return rng.standard_normal((out, inp), dtype=np.float32) * np.float32(1 / np.sqrt(inp))


def frozen_tensors(cfg: Config) -> dict:
    """The embedding, the unembedding and the routers (Float32, before rounding)."""
    rng = np.random.default_rng([cfg.seed, 11])
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab, cfg.hidden), dtype=np.float32),
         "lm_head.weight": rng.standard_normal((cfg.vocab, cfg.hidden), dtype=np.float32) / np.sqrt(cfg.hidden)}
    for layer in range(cfg.layers):
        t[gate_name(layer)] = rng.standard_normal((cfg.experts, cfg.hidden), dtype=np.float32) / np.sqrt(cfg.hidden)
    return {k: v.astype(np.float32) for k, v in t.items()}


def write_checkpoint_here(cfg: Config, folder: str) -> None:
    """Writes the checkpoint with the safetensors package, one shard per layer (runs in the child process)."""
    import torch
    from safetensors.torch import save_file

    dt = getattr(torch, cfg.dtype)
    os.makedirs(folder, exist_ok=True)
    weight_map = {}
    frozen = frozen_tensors(cfg)
    shards = cfg.layers + 1
    for layer in range(cfg.layers + 1):
        shard = f"model-{layer + 1:05d}-of-{shards:05d}.safetensors"
        if layer < cfg.layers:
            tensors = {expert_name(layer, e, m): torch.from_numpy(initial_matrix(cfg, layer, e, k)).to(dt)
                       for e in range(cfg.experts) for k, m in enumerate(MATRICES)}
            tensors[gate_name(layer)] = torch.from_numpy(frozen[gate_name(layer)]).to(dt)
        else:
            tensors = {n: torch.from_numpy(frozen[n]).to(dt) for n in ("model.embed_tokens.weight", "lm_head.weight")}
        save_file(tensors, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def run_child(flag: str, cfg: Config, folder: str, what: str) -> str:
    """Runs this file with `flag` in a fresh process; returns its output (SystemExit with its errors if it failed)."""
    payload = json.dumps({"cfg": dataclasses.asdict(cfg), "folder": folder})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), flag, payload],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr}")
    return proc.stdout


def write_checkpoint(cfg: Config, folder: str) -> None:
    """The checkpoint, written by a child process (PyTorch and safetensors are its dependencies, not ours)."""
    run_child("--_write-checkpoint", cfg, folder, "writing the checkpoint")


# ---------------------------------------------------------------- data


def successor(cfg: Config) -> np.ndarray:
    return np.random.default_rng([cfg.seed, 12]).permutation(cfg.vocab)


def batch_tokens(cfg: Config, step: int) -> np.ndarray:
    """Step `step`'s tokens (step -1: the held-out batch of the reload check)."""
    return np.random.default_rng([cfg.seed, 13, step + 1]).integers(0, cfg.vocab, size=cfg.tokens)


def bits(a: np.ndarray) -> np.ndarray:
    """The bytes of `a`'s values (for bit-for-bit comparisons)."""
    return np.ascontiguousarray(a).view(np.uint8)


def dense(a: np.ndarray) -> sw.Tensor:
    """A dense CPU tensor holding a copy of `a` (in its dtype)."""
    return friendly.tensor(np.array(a, copy=True))


# ---------------------------------------------------------------- the model in StrideWeave


class Model:
    """The MoE layers of a checkpoint opened where it lies, and the frozen parts around them."""

    def __init__(self, cfg: Config, folder: str, budget=None, prefetch: bool = True):
        self.cfg, self.prefetch = cfg, prefetch
        self.np_dtype = NP_DTYPE[cfg.dtype]
        self.ckpt = sw.safetensors.open(folder)
        # Frozen tensors: read once into memory (V x H and E x H values; the experts stay in the file).
        self.embedding = np.asarray(self.ckpt.tensor("model.embed_tokens.weight")).copy()
        self.unembedding = dense(np.asarray(self.ckpt.tensor("lm_head.weight")))
        self.routers = [dense(np.asarray(self.ckpt.tensor(gate_name(l)))) for l in range(cfg.layers)]
        self.blocks = []
        for layer in range(cfg.layers):
            w = {m: self.ckpt.tiled([expert_name(layer, e, m) for e in range(cfg.experts)]) for m in MATRICES}
            self.blocks.append(sw.moe.SparseMoE(w["w1"], w["w2"], w["w3"], top_k=cfg.top_k, budget=budget))
        self.budget = budget
        # Layer 0 last: the optimizer steps its experts last, so they are the freshest tiles for the next forward.
        self.params = [getattr(b, m) for b in reversed(self.blocks) for m in MATRICES]

    def weights(self, layer: int, m: str) -> sw.Tensor:
        return getattr(self.blocks[layer], m)

    def route_first_layer(self, tokens: np.ndarray) -> sw.Tensor:
        """Layer 0's routing of `tokens` (the router alone: the experts are not needed)."""
        with sw.no_grad():
            _, _, idx = self.blocks[0].route(dense(self.embedding[tokens]), self.routers[0])
        return idx

    def forward(self, tokens: np.ndarray, record: bool = False) -> dict:
        """The forward pass. Each layer's input is a fresh leaf (a copy of h_l): see the module docstring."""
        leaves, outputs, routes = [], [], []
        h = dense(self.embedding[tokens])
        for layer, moe in enumerate(self.blocks):
            x = h if layer == 0 else dense(np.asarray(h))
            _, w, idx = moe.route(x, self.routers[layer])
            if self.prefetch:
                moe.prefetch(idx)
            h = sw.add(x, moe.experts(x, w, idx))
            leaves.append(x)
            outputs.append(h)
            if record:
                routes.append((np.asarray(w).copy(), np.asarray(idx).copy()))
        top = dense(np.asarray(h))
        logits = sw.matmul(top, self.unembedding)  # (T, V)
        return {"leaves": leaves, "outputs": outputs, "routes": routes, "top": top, "logits": logits}

    def backward(self, fwd: dict, tokens: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        """Cross-entropy's cotangent (p - onehot) / T into the logits, then the layers one at a time."""
        cfg = self.cfg
        with sw.no_grad():
            p = np.asarray(sw.softmax(fwd["logits"], 1)).astype(np.float64)
        rows = np.arange(cfg.tokens)
        loss = float(-np.mean(np.log(np.maximum(p[rows, targets], 1e-30))))
        g = p.copy()
        g[rows, targets] -= 1.0
        g /= cfg.tokens
        fwd["logits"].backward(dense(g.astype(self.np_dtype)))
        grad = fwd["top"].grad
        for layer in reversed(range(cfg.layers)):
            fwd["outputs"][layer].backward(grad)
            grad = fwd["leaves"][layer].grad
        # The frozen leaves got gradients too (every float tensor is differentiable): drop them.
        self.unembedding.grad = None
        for r in self.routers:
            r.grad = None
        return loss, p

    def release(self) -> None:
        """Releases the experts' carriers (their gradients and optimizer state go with their own owners)."""
        for b in self.blocks:
            for m in MATRICES:
                getattr(b, m).carrier.release()


# ---------------------------------------------------------------- statistics of the tiers


def tier_bytes(model: Model, opt) -> dict:
    """Resident bytes now, per tier: the weights' and gradients' from their carriers, the moments' as the rest of
    the budget's resident bytes (every tile of the three draws from it; opt.state(p) would decode 8-bit state)."""
    w = g = 0
    for p in model.params:
        w += p.carrier.stats()["primary_bytes"]
        if p.grad is not None:
            g += p.grad.carrier.stats()["primary_bytes"]
    return {"weights": w, "gradients": g, "moments": model.budget.stats()["resident_bytes"] - w - g}


def gradient_traffic(model: Model) -> dict:
    """Bytes read back into and written out of the current gradients' tiles."""
    r = w = 0
    for p in model.params:
        if p.grad is not None:
            st = p.grad.carrier.stats()
            r += st["bytes_promoted"]
            w += st["bytes_evicted"]
    return {"read": r, "written": w}


# ---------------------------------------------------------------- the offloaded run


def train(cfg: Config, folder: str, progress=None, recorder=None) -> dict:
    """The fine-tuning run under the budget. Returns the summary numbers and the model (still open). A
    `SampleRecorder` records its sampled experts on the checked steps (its time is not counted in the wall time)."""
    budget = sw.ResidencyBudget(cfg.budget_bytes())
    model = Model(cfg, folder, budget=budget, prefetch=cfg.prefetch)
    opt = sw.optim.AdamW(model.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    succ = successor(cfg)
    grads = {"read": 0, "written": 0}
    per_step = []
    if cfg.seconds:
        cfg.steps = sys.maxsize  # until the time is up; then the steps done
    steps = itertools.count() if cfg.seconds else range(cfg.steps)
    if progress is not None:
        steps = progress(steps)
    start = time.perf_counter()
    train_start_unix = time.time()
    next_idx = model.route_first_layer(batch_tokens(cfg, 0)) if cfg.prefetch else None
    for step in steps:
        t0 = time.perf_counter()
        if cfg.seconds and t0 - start >= cfg.seconds:
            cfg.steps = step + 1  # this step is the last (and so checked)
        tokens = batch_tokens(cfg, step)
        recording = recorder is not None and recorder.checks(step)
        fwd = model.forward(tokens, record=recording)
        loss, _ = model.backward(fwd, tokens, succ[tokens])
        if recording:
            recorder.after_backward(model, opt, fwd, step)
        del fwd
        after_backward = tier_bytes(model, opt)
        traffic = gradient_traffic(model)
        opt.step()
        if recording:
            recorder.after_step(model, opt, step)
        traffic_after = gradient_traffic(model)  # a step reads gradient tiles back; nothing writes them
        grads["read"] += traffic_after["read"]
        grads["written"] += traffic_after["written"]
        after_step = tier_bytes(model, opt)
        opt.zero_grad()
        if cfg.prefetch and step + 1 < cfg.steps:
            next_idx = model.route_first_layer(batch_tokens(cfg, step + 1))
            model.blocks[0].prefetch(next_idx)
        recorded = recorder.seconds.pop(step, 0.0) if recording else 0.0
        per_step.append({"loss": loss, "seconds": time.perf_counter() - t0 - recorded, "after_backward": after_backward,
                         "after_step": after_step, "grad_read_in_backward": traffic["read"]})
        if progress is not None and hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{loss:.3f}")
        if step + 1 >= cfg.steps:
            break
    train_end_unix = time.time()
    wall = time.perf_counter() - start - (recorder.total_seconds if recorder is not None else 0.0)
    moe = [b.stats() for b in model.blocks]
    weights_read = sum(p.carrier.stats()["bytes_promoted"] for p in model.params)
    weights_written = sum(p.carrier.stats()["bytes_evicted"] for p in model.params)
    o = opt.stats()
    return {
        "model": model, "opt": opt, "budget": budget, "wall": wall, "per_step": per_step,
        "tokens_per_s": cfg.steps * cfg.tokens / wall,
        "expert_visits": sum(s["expert_visits"] for s in moe), "hits": sum(s["hits"] for s in moe),
        "wait_seconds": sum(s["wait_seconds"] for s in moe),
        "weights_read": weights_read, "weights_written": weights_written, "checkpoint_read": model.ckpt.bytes_read,
        "gradients_read": grads["read"], "gradients_written": grads["written"],
        "moments_read": o["state"]["bytes_promoted"], "moments_written": o["state"]["bytes_evicted"],
        "budget_peak": budget.stats()["peak_bytes"], "budget_evictions": budget.stats()["evictions"],
        "peak_rss": peak_rss_bytes(), "first_loss": per_step[0]["loss"], "last_loss": per_step[-1]["loss"],
        "steps": cfg.steps, "train_start_unix": train_start_unix, "train_end_unix": train_end_unix,
    }


# ---------------------------------------------------------------- saving and reloading


def save_experts(cfg: Config, model: Model, path: str) -> None:
    """The fine-tuned experts, one (out, in) tensor per expert over the tiled weights' carriers (no copy): the save
    reads each tile's bytes where they are (resident tile or tier) and writes a new file atomically."""
    tensors = {}
    for layer in range(cfg.layers):
        for m in MATRICES:
            full = model.weights(layer, m)
            out, inp = matrix_shape(cfg, m)
            for e in range(cfg.experts):
                layout = sw.Layout(sw.Shape(out, inp), sw.Stride(inp, 1))  # tile e: row-major (out, in)
                tensors[expert_name(layer, e, m)] = sw.Tensor(full.carrier, e * out * inp, layout)
    sw.safetensors.save(path, tensors, metadata={"format": "pt"})


def forward_logits(model: Model, tokens: np.ndarray) -> np.ndarray:
    with sw.no_grad():
        return np.asarray(model.forward(tokens)["logits"]).copy()


class Reloaded(Model):
    """The model over the saved experts (and the original checkpoint's frozen tensors)."""

    def __init__(self, cfg: Config, folder: str, experts_path: str):
        super().__init__(cfg, folder, budget=None, prefetch=False)
        ckpt = sw.safetensors.open(experts_path)
        self.saved = ckpt
        self.blocks = []
        budget = sw.ResidencyBudget(cfg.budget_bytes())  # the experts alone may not fit in memory either
        for layer in range(cfg.layers):
            w = {m: ckpt.tiled([expert_name(layer, e, m) for e in range(cfg.experts)]) for m in MATRICES}
            self.blocks.append(sw.moe.SparseMoE(w["w1"], w["w2"], w["w3"], top_k=cfg.top_k, budget=budget))
        self.params = [getattr(b, m) for b in reversed(self.blocks) for m in MATRICES]


# ---------------------------------------------------------------- the check against PyTorch


def block_reference(torch, x, router, w1, w2, w3, idx, g, absolute: bool, only=None):
    """One Mixtral block in Float64 on given inputs and routing (or its magnitudes: see Note [The bound of the
    check]): returns (out, dx, {(e, m): dW}). w1, w2, w3: indexable by expert. `only`: the experts to include (all
    routed ones by default); an expert's weight gradients need only its own rows, whatever the others do."""
    x = x.clone().requires_grad_()
    experts = set(idx.reshape(-1).tolist())
    experts = sorted(experts if only is None else experts & set(only))
    ws = {(e, m): t[e].clone().requires_grad_() for e in experts for m, t in (("w1", w1), ("w2", w2), ("w3", w3))}
    logits = x @ router.T
    sel = logits.gather(1, idx)
    if absolute:
        w = 1.0 + 0.25 * sel.sum(1, keepdim=True).expand_as(sel)
    else:
        probs = torch.softmax(logits, dim=1).gather(1, idx)
        w = probs / probs.sum(1, keepdim=True)
    out = torch.zeros_like(x)
    for e in experts:
        rows, slot = (idx == e).nonzero(as_tuple=True)
        xe = x[rows]
        h1, h3 = xe @ ws[(e, "w1")].T, xe @ ws[(e, "w3")].T
        a = 1.1 * h1 if absolute else torch.nn.functional.silu(h1)
        out = out.index_add(0, rows, ((a * h3) @ ws[(e, "w2")].T) * w[rows, slot][:, None])
    (out * g).sum().backward()
    return out.detach(), x.grad, {k: v.grad for k, v in ws.items()}


def site_unit(cfg: Config) -> float:
    n = max(cfg.tokens, cfg.hidden, cfg.intermediate, cfg.vocab)
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    return U_DTYPE[cfg.dtype] + 2 * gamma


class Worst:
    """The largest |error| / bound seen per quantity."""

    def __init__(self):
        self.ratio = {}

    def add(self, name: str, got, want, bound) -> None:
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        r = float(np.max(np.abs(got - want) / (np.asarray(bound, dtype=np.float64) + 1e-300)))
        self.ratio[name] = max(self.ratio.get(name, 0.0), r)


def check_routing(cfg: Config, x, router, idx_np: np.ndarray, counts: dict) -> None:
    """Routing: the exact top-k wherever the Float64 logits (x, router: Float64 torch tensors) are more than twice
    their bound away from a tie."""
    logits = (x @ router.T).numpy()
    mag = (x.abs() @ router.abs().T).numpy()
    order = np.argsort(-logits, axis=1, kind="stable")
    gap = logits[np.arange(cfg.tokens), order[:, cfg.top_k - 1]] - logits[np.arange(cfg.tokens), order[:, cfg.top_k]]
    bound = site_unit(cfg) * mag.max(axis=1)
    # The block takes the top-k of the Float32 softmax of its logits: where the k-th probability underflows
    # below Float32's normal range, it ties with the others that underflow (the lower expert wins), so those
    # tokens are near ties too, whatever their logits' gap.
    top = logits[np.arange(cfg.tokens), order[:, 0]]
    kth = logits[np.arange(cfg.tokens), order[:, cfg.top_k - 1]]
    clear = (gap > 2 * bound) & (kth - top - np.log(cfg.experts) > np.log(2.0**-126) + 2 * bound)
    same = np.sort(order[:, :cfg.top_k], axis=1) == np.sort(idx_np, axis=1)
    counts["near_ties"] += int((~clear).sum())
    counts["routing_mismatch"] += int((clear & ~same.all(axis=1)).sum())
    counts["routed_tokens"] += cfg.tokens


def check_step(torch, cfg: Config, model: Model, fwd: dict, weights: dict, grads: dict, worst: Worst,
               counts: dict) -> None:
    """Every layer of one step against the Float64 reference on StrideWeave's own inputs. `weights` and `grads`:
    (layer, matrix) -> the (E, out, in) values of the experts and of their gradients."""
    f64 = lambda a: torch.from_numpy(np.asarray(a).astype(np.float64))  # noqa: E731
    factor = (1 + site_unit(cfg)) ** SITES - 1
    for layer in range(cfg.layers):
        x = f64(fwd["leaves"][layer])
        g = f64(fwd["leaves"][layer + 1].grad if layer + 1 < cfg.layers else fwd["top"].grad)
        router = f64(model.routers[layer])
        w_sw, idx_np = fwd["routes"][layer]
        idx = torch.from_numpy(idx_np.astype(np.int64))
        stacks = {m: [f64(weights[(layer, m)][e]) for e in range(cfg.experts)] for m in MATRICES}
        out, dx, dws = block_reference(torch, x, router, stacks["w1"], stacks["w2"], stacks["w3"], idx, g, False)
        mout, mdx, mdws = block_reference(torch, x.abs(), router.abs(), *[[t.abs() for t in stacks[m]] for m in MATRICES],
                                          idx, g.abs(), True)
        check_routing(cfg, x, router, idx_np, counts)
        h_sw = fwd["outputs"][layer]
        worst.add("layer output h + MoE(h)", h_sw, (x + out).numpy(), factor * (x.abs() + mout).numpy())
        worst.add("gradient of the layer input", fwd["leaves"][layer].grad, (g + dx).numpy(),
                  factor * (g.abs() + mdx).numpy())
        for (e, m), dw in dws.items():
            got = grads[(layer, m)][e]
            worst.add("expert weight gradients", got, dw.numpy(), factor * mdws[(e, m)].numpy())
        for e in range(cfg.experts):
            if e not in idx_np:
                for m in MATRICES:
                    loc = model.weights(layer, m).grad.carrier.tile_state((0, 0, e)).location
                    counts["untouched_not_implicit"] += int(loc != "implicit")
    # The logits (the softmax and the loss's cotangent are computed from StrideWeave's logits).
    top = f64(fwd["top"])
    u = f64(model.unembedding)
    worst.add("logits", fwd["logits"], (top @ u.T).numpy(), factor * (top.abs() @ u.abs().T).numpy())


def all_experts(full: sw.Tensor) -> np.ndarray:
    """The (E, out, in) values of a tiled (out, in, E) tensor, through one projection of every tile (a dense copy;
    reading a tiled tensor slot by slot would be far slower)."""
    every = sw.TileSelection(((0,), (0,), tuple(range(full.layout.shape.extents[-1]))))
    with sw.no_grad():
        dense_copy = full.carrier.project(full, every).wait()
    return np.moveaxis(np.asarray(dense_copy), -1, 0)


def expert_stacks(model: Model, grad: bool = False) -> dict:
    """(layer, matrix) -> the (E, out, in) values of the experts (or of their gradients)."""
    return {(layer, m): all_experts(model.weights(layer, m).grad if grad else model.weights(layer, m))
            for layer in range(model.cfg.layers) for m in MATRICES}


def replay_with_torch(cfg: Config, folder: str, progress=None) -> dict:
    """The check: the same steps without a budget, in lockstep with PyTorch (see the module docstring)."""
    import torch

    torch.manual_seed(cfg.seed)
    model = Model(cfg, folder, budget=None, prefetch=False)
    opt = sw.optim.AdamW(model.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    keys = [(layer, m, e) for layer in range(cfg.layers) for m in MATRICES for e in range(cfg.experts)]
    stacks = expert_stacks(model)
    params = {k: torch.nn.Parameter(torch.from_numpy(stacks[k[:2]][k[2]].astype(np.float32))) for k in keys}
    ref = torch.optim.AdamW(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    succ = successor(cfg)
    worst, counts = Worst(), {"near_ties": 0, "routing_mismatch": 0, "routed_tokens": 0, "untouched_not_implicit": 0}
    mismatched_weights = 0
    checked = []
    steps = range(cfg.steps)
    if progress is not None:
        steps = progress(steps)
    original_sqrt = torch.Tensor.sqrt
    for step in steps:
        tokens = batch_tokens(cfg, step)
        fwd = model.forward(tokens, record=True)
        model.backward(fwd, tokens, succ[tokens])
        gstacks = expert_stacks(model, grad=True)
        if step % cfg.check_every == 0 or step == cfg.steps - 1:
            check_step(torch, cfg, model, fwd, stacks, gstacks, worst, counts)
            checked.append(step)
        del fwd
        grads = {(layer, m): model.weights(layer, m).grad for layer in range(cfg.layers) for m in MATRICES}
        for k, p in params.items():
            state = grads[k[:2]].carrier.tile_state((0, 0, k[2])).location
            p.grad = None if state == "implicit" else torch.from_numpy(gstacks[k[:2]][k[2]].astype(np.float32))
            with torch.no_grad():
                p.copy_(torch.from_numpy(stacks[k[:2]][k[2]].astype(np.float32)))
        opt.step()
        torch.Tensor.sqrt = lambda self: torch.sqrt(self.double()).to(self.dtype)  # correctly rounded
        try:
            ref.step()
        finally:
            torch.Tensor.sqrt = original_sqrt
        opt.zero_grad()
        stacks = expert_stacks(model)
        for k, p in params.items():
            want = p.detach().numpy().astype(model.np_dtype)
            mismatched_weights += int(np.count_nonzero(bits(stacks[k[:2]][k[2]]) != bits(want)))
    final = {k: p.detach().numpy().astype(model.np_dtype) for k, p in params.items()}
    model.release()
    return {"worst": worst.ratio, "counts": counts, "mismatched_weights": mismatched_weights, "final": final,
            "checked_steps": checked}


# ---------------------------------------------------------------- the sampled check (--check-sample N)


def tile_values(full: sw.Tensor, e: int):
    """Tile e of a tiled (out, in, E) tensor: its (out, in) values through a one-tile projection (promoted under the
    run's budget like any tile), or None when the tile is implicit (a gradient never written, a moment never set)."""
    if full.carrier.tile_state((0, 0, e)).location == "implicit":
        return None
    with sw.no_grad():
        t = full.carrier.project(full, sw.TileSelection(((0,), (0,), (e,)))).wait()
    return np.asarray(t)[..., 0].copy()


def save_arrays(path: str, arrays: dict) -> None:
    """np.savez of `arrays` (None values left out; BFloat16 ones stored as their uint16 bits)."""
    out = {}
    for k, v in arrays.items():
        if v is None:
            continue
        v = np.asarray(v)
        out[k + ".bf16" if v.dtype == NP_DTYPE["bfloat16"] else k] = v.view(np.uint16) if v.dtype == NP_DTYPE["bfloat16"] else v
    np.savez(path, **out)


def load_arrays(path: str) -> dict:
    with np.load(path) as z:
        return {(k[:-5] if k.endswith(".bf16") else k): (z[k].view(NP_DTYPE["bfloat16"]) if k.endswith(".bf16") else z[k])
                for k in z.files}


class SampleRecorder:
    """What the sampled check needs, recorded to disk during the budgeted run itself, on the checked steps: each
    sampled layer's input h_l, the gradient g of its output and its routing; each sampled expert's weights,
    gradients, AdamW moments and step counts before its optimizer step, and its weights, moments and counts after.
    Nothing is kept in memory: a run bigger than RAM stays bounded (the records are a few tiles per checked step)."""

    def __init__(self, cfg: Config, directory: str):
        self.cfg, self.directory = cfg, directory
        pairs = [(layer, e) for layer in range(cfg.layers) for e in range(cfg.experts)]
        chosen = np.random.default_rng([cfg.seed, 14]).choice(len(pairs), min(cfg.check_sample, len(pairs)), replace=False)
        self.sample = sorted(pairs[int(i)] for i in chosen)
        self.layers = sorted({layer for layer, _ in self.sample})
        self.steps: list[int] = []
        self.seconds: dict = {}  # step -> seconds spent recording it (not counted in the run's wall time)
        self.total_seconds = 0.0
        os.makedirs(directory, exist_ok=True)

    def checks(self, step: int) -> bool:
        return step % self.cfg.check_every == 0 or step == self.cfg.steps - 1

    def path(self, step: int, what: str) -> str:
        return os.path.join(self.directory, f"step{step:05d}-{what}.npz")

    def _timed(self, step: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.seconds[step] = self.seconds.get(step, 0.0) + dt
        self.total_seconds += dt

    def after_backward(self, model: Model, opt, fwd: dict, step: int) -> None:
        t0 = time.perf_counter()
        cfg = self.cfg
        for layer in self.layers:
            g = fwd["leaves"][layer + 1].grad if layer + 1 < cfg.layers else fwd["top"].grad
            w, idx = fwd["routes"][layer]
            save_arrays(self.path(step, f"layer{layer}"),
                        {"x": np.asarray(fwd["leaves"][layer]), "g": np.asarray(g), "w": w, "idx": idx})
        for layer, e in self.sample:
            for m in MATRICES:
                p = model.weights(layer, m)
                st = opt.state(p)
                save_arrays(self.path(step, f"before-{layer}-{e}-{m}"), {
                    "w": tile_values(p, e), "grad": None if p.grad is None else tile_values(p.grad, e),
                    "exp_avg": tile_values(st["exp_avg"], e), "exp_avg_sq": tile_values(st["exp_avg_sq"], e),
                    "count": np.int64(st["step"][e])})
        self.steps.append(step)
        self._timed(step, t0)

    def after_step(self, model: Model, opt, step: int) -> None:
        t0 = time.perf_counter()
        for layer, e in self.sample:
            for m in MATRICES:
                p = model.weights(layer, m)
                st = opt.state(p)
                save_arrays(self.path(step, f"after-{layer}-{e}-{m}"), {
                    "w": tile_values(p, e), "exp_avg": tile_values(st["exp_avg"], e),
                    "exp_avg_sq": tile_values(st["exp_avg_sq"], e), "count": np.int64(st["step"][e])})
        self._timed(step, t0)


def adamw_expected(torch, before: dict, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8):
    """torch.optim.AdamW's step from a recorded state `before` ("w", "count", and "grad", "exp_avg", "exp_avg_sq"
    where present): one nn.Parameter (Float32 copy of the weights), the recorded gradient and moments,
    foreach=False, the correctly rounded square root (as in the full check). Returns (weights rounded to the
    recorded weights' dtype, exp_avg, exp_avg_sq, count); a matrix without gradient is left as it was."""
    zeros = np.zeros(before["w"].shape, np.float32)
    count = int(before["count"])
    if "grad" not in before:
        return before["w"], before.get("exp_avg", zeros), before.get("exp_avg_sq", zeros), count
    p = torch.nn.Parameter(torch.from_numpy(before["w"].astype(np.float32)))
    p.grad = torch.from_numpy(before["grad"].astype(np.float32))
    ref = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    if count > 0:
        ref.state[p] = {"step": torch.tensor(float(count)),
                        "exp_avg": torch.from_numpy(before.get("exp_avg", zeros).copy()),
                        "exp_avg_sq": torch.from_numpy(before.get("exp_avg_sq", zeros).copy())}
    original_sqrt = torch.Tensor.sqrt
    torch.Tensor.sqrt = lambda self: torch.sqrt(self.double()).to(self.dtype)  # correctly rounded
    try:
        ref.step()
    finally:
        torch.Tensor.sqrt = original_sqrt
    st = ref.state[p]
    return (p.detach().numpy().astype(before["w"].dtype), st["exp_avg"].numpy(), st["exp_avg_sq"].numpy(),
            count + 1)


def adamw_mismatch(torch, cfg: Config, before: dict, after: dict) -> int:
    """Bytes of the weights and moments after one step (and a wrong step count) that differ from torch.optim.AdamW
    stepped from the recorded state (adamw_expected)."""
    zeros = np.zeros(before["w"].shape, np.float32)
    want_w, want_m, want_v, want_count = adamw_expected(torch, before, cfg.lr, cfg.weight_decay)
    got = (after["w"], after.get("exp_avg", zeros), after.get("exp_avg_sq", zeros))
    differ = sum(int(np.count_nonzero(bits(a) != bits(b))) for a, b in zip(got, (want_w, want_m, want_v)))
    return differ + int(int(after["count"]) != want_count)


def verify_sample(cfg: Config, folder: str, recorder: SampleRecorder, saved) -> dict:
    """The sampled check, from the records (one record in memory at a time), against PyTorch: each sampled layer's
    routing, each sampled expert's weight gradients in Float64 within Note [The bound of the check] (an unrouted
    expert's gradient must be implicit), its AdamW step bit for bit, and its saved values."""
    import torch

    f64 = lambda a: torch.from_numpy(np.asarray(a).astype(np.float64))  # noqa: E731
    factor = (1 + site_unit(cfg)) ** SITES - 1
    ckpt = sw.safetensors.open(folder)
    routers = {layer: f64(ckpt.tensor(gate_name(layer))) for layer in recorder.layers}
    worst = Worst()
    counts = {"near_ties": 0, "routing_mismatch": 0, "routed_tokens": 0, "untouched_not_implicit": 0,
              "routed_without_gradient": 0}
    mismatched = 0
    for step in recorder.steps:
        for layer in recorder.layers:
            rec = load_arrays(recorder.path(step, f"layer{layer}"))
            x, g, idx_np = f64(rec["x"]), f64(rec["g"]), rec["idx"]
            check_routing(cfg, x, routers[layer], idx_np, counts)
            idx = torch.from_numpy(idx_np.astype(np.int64))
            for e in [e for ly, e in recorder.sample if ly == layer]:
                before = {m: load_arrays(recorder.path(step, f"before-{layer}-{e}-{m}")) for m in MATRICES}
                if e in idx_np:
                    ws = [{e: f64(before[m]["w"])} for m in MATRICES]
                    _, _, dws = block_reference(torch, x, routers[layer], *ws, idx, g, False, only=[e])
                    _, _, mdws = block_reference(torch, x.abs(), routers[layer].abs(),
                                                 *[{e: w[e].abs()} for w in ws], idx, g.abs(), True, only=[e])
                    for m in MATRICES:
                        if "grad" not in before[m]:
                            counts["routed_without_gradient"] += 1
                        else:
                            worst.add("expert weight gradients", before[m]["grad"], dws[(e, m)].numpy(),
                                      factor * mdws[(e, m)].numpy())
                else:
                    counts["untouched_not_implicit"] += sum("grad" in before[m] for m in MATRICES)
                for m in MATRICES:
                    mismatched += adamw_mismatch(torch, cfg, before[m],
                                                 load_arrays(recorder.path(step, f"after-{layer}-{e}-{m}")))
    last = recorder.steps[-1]  # the last step is always checked: its weights after are the final ones
    saved_diff = 0
    for layer, e in recorder.sample:
        for m in MATRICES:
            final = load_arrays(recorder.path(last, f"after-{layer}-{e}-{m}"))["w"]
            saved_diff += int(np.count_nonzero(bits(np.asarray(saved.tensor(expert_name(layer, e, m)))) != bits(final)))
    ok = (max(worst.ratio.values(), default=0.0) <= 1.0 and mismatched == 0 and saved_diff == 0
          and counts["routing_mismatch"] == 0 and counts["untouched_not_implicit"] == 0
          and counts["routed_without_gradient"] == 0 and "expert weight gradients" in worst.ratio)
    return {"worst": worst.ratio, "counts": counts, "mismatched_weights": mismatched, "saved_mismatches": saved_diff,
            "checked_steps": list(recorder.steps), "sample": [list(p) for p in recorder.sample], "ok": ok}


# ---------------------------------------------------------------- PyTorch, everything in RAM


def torch_worker(cfg: Config, folder: str) -> dict:
    """The same training in PyTorch in this (fresh) process: every tensor in RAM, bf16 compute, Float32 master
    weights and moments, torch.optim.AdamW (default implementation and threads)."""
    import torch
    from safetensors.torch import load_file

    dt = getattr(torch, cfg.dtype)
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    master = {(layer, m, e): torch.nn.Parameter(tensors.pop(expert_name(layer, e, m)).float())
              for layer in range(cfg.layers) for m in MATRICES for e in range(cfg.experts)}
    emb, unemb = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    routers = [tensors[gate_name(l)] for l in range(cfg.layers)]
    opt = torch.optim.AdamW(list(master.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    succ = torch.from_numpy(successor(cfg))
    start = time.perf_counter()
    for step in range(cfg.steps):
        tokens = torch.from_numpy(batch_tokens(cfg, step))
        h = emb[tokens]
        for layer in range(cfg.layers):
            probs = torch.softmax((h @ routers[layer].T).float(), dim=1)
            w, idx = probs.topk(cfg.top_k, dim=1)
            w = w / w.sum(1, keepdim=True)
            out = torch.zeros_like(h)
            for e in idx.unique().tolist():
                rows, slot = (idx == e).nonzero(as_tuple=True)
                p1, p2, p3 = (master[(layer, m, e)].to(dt) for m in MATRICES)
                xe = h[rows]
                y = (torch.nn.functional.silu(xe @ p1.T) * (xe @ p3.T)) @ p2.T
                out = out.index_add(0, rows, (y * w[rows, slot][:, None]).to(dt))
            h = h + out
        logits = (h @ unemb.T).float()
        loss = torch.nn.functional.cross_entropy(logits, succ[tokens])
        loss.backward()
        opt.step()
        opt.zero_grad()
    wall = time.perf_counter() - start
    return {"wall": wall, "tokens_per_s": cfg.steps * cfg.tokens / wall, "peak_rss": peak_rss_bytes()}


def compare(cfg: Config, folder: str) -> dict:
    """The PyTorch run in a fresh process, so that its peak resident memory is its own."""
    return json.loads(run_child("--_torch-worker", cfg, folder, "the PyTorch run").strip().splitlines()[-1])


# ---------------------------------------------------------------- reporting


def summary_rows(cfg: Config, r: dict) -> list:
    sb = cfg.state_bytes()
    total = sum(sb.values())
    return [
        ("model", f"{cfg.layers} MoE layers x {cfg.experts} experts, H {cfg.hidden}, I {cfg.intermediate}, "
                  f"top-{cfg.top_k}, vocab {cfg.vocab}, {cfg.dtype}"),
        ("experts + gradients + moments", f"{fmt_bytes(sb['weights'])} + {fmt_bytes(sb['gradients'])} + "
                                          f"{fmt_bytes(sb['moments'])} = {fmt_bytes(total)}"),
        ("residency budget", f"{fmt_bytes(cfg.budget_bytes())} (the state is {total / cfg.budget_bytes():.1f}x it; "
                             f"peak admitted {fmt_bytes(r['budget_peak'])}, {r['budget_evictions']} evictions)"),
        ("steps x tokens", f"{cfg.steps} x {cfg.tokens}, AdamW lr {cfg.lr:g}, weight decay {cfg.weight_decay:g}"),
        ("loss", f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"),
        ("wall time", f"{r['wall']:.2f} s"),
        ("tokens/s", f"{r['tokens_per_s']:.0f}"),
        ("expert hit rate", f"{r['hits'] / max(1, r['expert_visits']):.1%} ({r['hits']} of {r['expert_visits']} "
                            f"expert visits, forward and backward, found their tiles resident)"),
        ("weights: read / written", f"{fmt_bytes(r['weights_read'])} / {fmt_bytes(r['weights_written'])} "
                                    f"(checkpoint bytes read: {fmt_bytes(r['checkpoint_read'])}; written: to the "
                                    f"scratch overlay, never to the checkpoint)"),
        ("gradients: read / written", f"{fmt_bytes(r['gradients_read'])} / {fmt_bytes(r['gradients_written'])}"),
        ("moments: read / written", f"{fmt_bytes(r['moments_read'])} / {fmt_bytes(r['moments_written'])}"),
        ("waiting for I/O", f"{r['wait_seconds']:.2f} s (the blocks waiting for expert tiles)"),
        ("peak RSS", f"{fmt_bytes(r['peak_rss'])} (process, after training) for {fmt_bytes(total)} of "
                     f"experts + gradients + moments ({r['peak_rss'] / total:.2f}x)"),
    ]


def plot(cfg: Config, r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = []
    series = {k: [] for k in ("weights", "gradients", "moments")}
    for s, rec in enumerate(r["per_step"]):
        for j, when in enumerate(("after_backward", "after_step")):
            x.append(s + 0.5 * j)
            for k in series:
                series[k].append(rec[when][k] / MiB)
    for k, v in series.items():
        ax0.plot(x, v, marker=".", label=k)
    ax0.axhline(cfg.budget_bytes() / MiB, color="k", linestyle="--", label="budget")
    ax0.set_xlabel("step (after backward, after the optimizer step)")
    ax0.set_ylabel("resident MiB")
    ax0.set_title("residency per tier")
    ax0.legend()
    ax1.plot(range(cfg.steps), [cfg.tokens / rec["seconds"] for rec in r["per_step"]], marker=".")
    ax1.set_xlabel("step")
    ax1.set_ylabel("tokens/s")
    ax1.set_ylim(bottom=0)
    ax1.set_title("throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main(argv=None, cfg: Config | None = None) -> dict:
    """Runs the example; returns the summary (``ok`` False when a check failed)."""
    cfg = cfg or parse_args(argv)
    cfg.validate()
    progress = None
    if cfg.progress:
        from tqdm import tqdm

        progress = lambda it: tqdm(it, desc="steps", unit="step", file=sys.stderr)  # noqa: E731
    ctx = tempfile.TemporaryDirectory(prefix="finetune_moe_") if cfg.dir is None else nullcontext(cfg.dir)
    with ctx as directory:
        folder = os.path.join(directory, "mixtral")
        t0 = time.perf_counter()
        write_checkpoint(cfg, folder)
        size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        print(f"checkpoint: {cfg.layers} layers x {cfg.experts} experts, {fmt_bytes(size)} of {cfg.dtype} in "
              f"{cfg.layers + 1} shards, written by the safetensors package in {time.perf_counter() - t0:.1f} s")
        recorder = SampleRecorder(cfg, os.path.join(directory, "check-sample")) \
            if cfg.check and cfg.check_sample else None
        r = train(cfg, folder, progress, recorder)
        print_table("StrideWeave MoE fine-tuning summary", summary_rows(cfg, r))
        summary = {k: v for k, v in r.items() if k not in ("model", "opt", "budget")}
        failures = []
        # Save atomically to a new checkpoint, reopen it, and compare a forward pass with the in-memory model.
        saved = os.path.join(directory, "finetuned.safetensors")
        held_out = batch_tokens(cfg, -1)
        in_memory = forward_logits(r["model"], held_out)
        t0 = time.perf_counter()
        save_experts(cfg, r["model"], saved)
        t_save = time.perf_counter() - t0
        r["model"].release()
        reloaded = Reloaded(cfg, folder, saved)
        again = forward_logits(reloaded, held_out)
        same = np.array_equal(bits(again), bits(in_memory))
        summary["reload_ok"] = bool(same)
        print(f"\nsaved the fine-tuned experts to {saved} ({fmt_bytes(os.path.getsize(saved))} in {t_save:.1f} s, "
              f"atomically); the reopened checkpoint's forward pass equals the in-memory one bit for bit: "
              f"{'PASS' if same else 'FAIL'}")
        if not same:
            failures.append("reload")
        if cfg.check and recorder is not None:
            t0 = time.perf_counter()
            c = verify_sample(cfg, folder, recorder, reloaded.saved)
            summary["check"] = c
            counts = c["counts"]
            print(f"\ncheck of {len(c['sample'])} sampled experts (layer, expert) {c['sample']} (seed {cfg.seed}) "
                  f"against PyTorch, recorded within the run on steps {c['checked_steps']} "
                  f"({time.perf_counter() - t0:.1f} s):")
            for name, ratio in c["worst"].items():
                print(f"  {name:<32} worst |error| / bound {ratio:.3g}  (Float64 reference on the run's own inputs)")
            print(f"  routing of the sampled layers: {counts['routed_tokens']} token-layers checked, "
                  f"{counts['near_ties']} near ties, {counts['routing_mismatch']} others differ from the exact "
                  f"top-{cfg.top_k}; unrouted experts with a gradient: {counts['untouched_not_implicit']}, routed "
                  f"ones without: {counts['routed_without_gradient']}")
            print(f"  each sampled AdamW step vs torch.optim.AdamW from the recorded state (weights, both moments, "
                  f"step count): {c['mismatched_weights']} bytes differ (bound 0)")
            print(f"  saved checkpoint vs the run's final weights of the sample: {c['saved_mismatches']} bytes "
                  f"differ (bound 0)")
            print(f"  {'PASS' if c['ok'] else 'FAIL'}")
            if not c["ok"]:
                failures.append("check")
        elif cfg.check:
            t0 = time.perf_counter()
            c = replay_with_torch(cfg, folder, progress)
            saved_values = {k: np.asarray(reloaded.saved.tensor(expert_name(k[0], k[2], k[1]))) for k in c["final"]}
            saved_diff = sum(int(np.count_nonzero(bits(saved_values[k]) != bits(v)))
                             for k, v in c["final"].items())
            counts = c["counts"]
            ok = (max(c["worst"].values()) <= 1.0 and c["mismatched_weights"] == 0 and saved_diff == 0
                  and counts["routing_mismatch"] == 0 and counts["untouched_not_implicit"] == 0)
            summary["check"] = {"worst": c["worst"], "counts": counts, "mismatched_weights": c["mismatched_weights"],
                                "saved_mismatches": saved_diff, "checked_steps": c["checked_steps"], "ok": ok}
            print(f"\ncheck against PyTorch ({time.perf_counter() - t0:.1f} s), replaying the {cfg.steps} steps:")
            for name, ratio in c["worst"].items():
                print(f"  {name:<32} worst |error| / bound {ratio:.3g}  (Float64 reference, steps {c['checked_steps']})")
            print(f"  routing: {counts['routed_tokens']} token-layers checked, {counts['near_ties']} within twice the "
                  f"logits' error bound of a tie (StrideWeave's decision kept), {counts['routing_mismatch']} others "
                  f"differ from the exact top-{cfg.top_k}")
            print(f"  weights after each AdamW step vs torch.optim.AdamW (one nn.Parameter per expert matrix, "
                  f"Float32 moments): {c['mismatched_weights']} bytes differ (bound 0)")
            print(f"  saved checkpoint vs PyTorch's final weights: {saved_diff} bytes differ (bound 0)")
            print(f"  {'PASS' if ok else 'FAIL'}")
            if not ok:
                failures.append("check")
        reloaded.release()
        if cfg.plot:
            plot(cfg, r, cfg.plot)
            print(f"plot written to {cfg.plot}")
        if cfg.compare:
            o = compare(cfg, folder)
            summary["compare"] = o
            print(f"\n{'same training':<40} {'tokens/s':>10} {'wall s':>8} {'peak RSS':>11}")
            print(f"{'StrideWeave (checkpoint + budget)':<40} {r['tokens_per_s']:>10.0f} {r['wall']:>8.2f} "
                  f"{fmt_bytes(r['peak_rss']):>11}")
            print(f"{'PyTorch, everything in RAM':<40} {o['tokens_per_s']:>10.0f} {o['wall']:>8.2f} "
                  f"{fmt_bytes(o['peak_rss']):>11}")
            print("(PyTorch in a fresh process; its load of the checkpoint is not counted in its wall time)")
        summary["ok"] = not failures
        summary["failures"] = failures
        summary["peak_rss_end"] = peak_rss_bytes()  # with the save, the reload and the check
        if cfg.summary_json:
            with open(cfg.summary_json, "w") as f:
                json.dump(summary, f, indent=1, default=str)
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--_write-checkpoint", "--_torch-worker"):
        job = json.loads(sys.argv[2])
        job_cfg = Config(**job["cfg"])
        if sys.argv[1] == "--_write-checkpoint":
            write_checkpoint_here(job_cfg, job["folder"])
        else:
            print(json.dumps(torch_worker(job_cfg, job["folder"])))
    else:
        result = main()
        sys.exit(0 if result["ok"] else 1)
