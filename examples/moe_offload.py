"""Mixture-of-Experts weights that do not fit in memory, end to end.

This is what StrideWeave is for. A synthetic two-matrix MoE layer

    y[t] = sum over the experts e routed for token t of  gate[t, e] * relu(x[t] W1_e^T) W2_e^T

keeps its expert weights in raw checkpoint files (one per matrix, written once
with NumPy's ``tofile``). Each file is opened in place as the *secondary* tier
of a ``TiledEvictable`` (``sw.FileBacked(path)`` reads and writes the file where
it lies; nothing is copied). At most ``--budget`` experts per matrix are kept in
the *primary* tier (host memory) by a residency policy (``LRUPolicy`` by
default). Every batch:

1. the router picks the top-2 experts of each token (expert popularity is
   Zipf-skewed, so a few experts are hot and the tail is cold);
2. the *next* batch's experts are prefetched with ``promote_async`` while this
   batch computes (the router's decisions are known one batch ahead), and the
   handles are waited before that batch projects them: a projection over tiles
   of an incomplete residency request raises ``RuntimeError`` ("wait");
3. expert by expert, ``carrier.project(W_full, TileSelection([[0], [e]]))``
   yields expert ``e`` as a compact dense ``(out, in)`` tensor. The resident
   tile already holds exactly those values in that order, so without a
   ``destination`` the projection shares the tile's memory copy-on-write
   instead of copying 4 MiB (nothing here writes either side); each
   projection asks the policy,
   which evicts the least recently used experts beyond the budget once the
   projection no longer needs them;
4. forward and backward run on the compact tensors, and each projection's
   backward scatter-adds the expert's gradient into the full-shaped *tiled*
   gradients ``W1_full.grad`` and ``W2_full.grad``. They accumulate across
   batches tile by tile and in place, experts no batch touched stay implicit
   zeros, and after each batch the gradient tiles of experts the next batch
   does not route to are evicted to the gradient's own (temporary-file)
   secondary tier, so gradients are bounded like the weights; the tiles of
   the next batch's experts that were written out earlier are promoted back
   alongside, so every backward adds into a resident tile in place.

The default Zipf exponent (3.0) routes a batch to about 15 experts, within the
budget. When a batch needs more experts than the budget, LRU with one expert
per request must evict some of the batch's own experts by its end, and they
are read again when the next batch needs them (try ``--zipf 2``).

At the end, the outputs and the accumulated gradients are checked element by
element against a Float64 NumPy computation of the same batches, each within
its own derived Float32 error bound (Note [A check that is right by
construction]), and a summary table is printed.

Why expert-last
---------------
A weight matrix of E experts, each ``(out, in)``, is laid out as one full
tensor of shape ``(out, (in, E))`` in column-major order: slot
``o + out * (i + in * e)``. Expert ``e`` is then the *contiguous* slot range
``[e * out * in, (e + 1) * out * in)``, so

* one tile (grid ``(1, E)``, tile ``(out, in)``) is one expert, and promoting
  it is one sequential ``pread`` of ``out * in * 4`` bytes from the checkpoint;
* projecting ``TileSelection([[0], [e1, e2, ...]])`` yields a compact
  ``(out, in * k)`` tensor in which expert ``j`` is again a contiguous,
  dense ``(out, in)`` column-major block, directly usable by ``sw.matmul``
  (which contracts mode 1 of both operands: ``(tokens, in) x (out, in)``);
* the checkpoint is just each expert's matrix written one after another.

The expert-first layout ``(E, out, in)`` would make every tile a strided set
of ``out * in`` single slots (E apart): each promotion would become ``out * in``
tiny reads, and gathers could not use bulk copies.

Run ``python examples/moe_offload.py --help`` for the flags; ``make demo`` runs
the defaults (about a minute on a 2-core machine). ``--compare`` runs the same
workload in PyTorch (every expert in RAM, and naive synchronous loading from
the file) in fresh processes; ``--plot FILE.png`` draws a residency heatmap and
the throughput over time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from contextlib import nullcontext

import numpy as np

import strideweave as sw
from strideweave.policies import LRUPolicy, PinnedPolicy

MiB = 1 << 20


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass
class Config:
    experts: int = 64
    d_model: int = 1024  # x and y columns: W1_e is (d_hidden, d_model), W2_e is (d_model, d_hidden)
    d_hidden: int = 1024
    budget: int = 16  # resident experts per matrix (lru, pinned)
    top_k: int = 2
    batches: int = 120
    tokens: int = 256
    zipf: float = 3.0  # expert popularity ~ 1 / rank**zipf (about 15 experts a batch at the defaults)
    policy: str = "lru"  # lru | pinned | none
    dir: str | None = None
    seed: int = 0
    check: bool = True
    progress: bool = True
    plot: str | None = None
    compare: bool = False

    def validate(self) -> None:
        for name in ("experts", "d_model", "d_hidden", "budget", "top_k", "batches", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.top_k > self.experts:
            raise ValueError("--top-k cannot exceed --experts")
        if self.policy not in ("lru", "pinned", "none"):
            raise ValueError("--policy must be lru, pinned or none")
        if self.zipf < 0:
            raise ValueError("--zipf must be >= 0")


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=d.experts, help="experts per matrix (default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="input/output features (default %(default)s)")
    p.add_argument("--d-hidden", type=int, default=d.d_hidden, help="hidden features per expert (default %(default)s)")
    p.add_argument("--budget", type=int, default=d.budget, help="resident experts per matrix (default %(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token (default %(default)s)")
    p.add_argument("--batches", type=int, default=d.batches, help="batches (default %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per batch (default %(default)s)")
    p.add_argument("--zipf", type=float, default=d.zipf, help="Zipf exponent of expert popularity (default %(default)s)")
    p.add_argument("--policy", choices=("lru", "pinned", "none"), default=d.policy,
                   help="lru: LRUPolicy(budget); pinned: the budget's most popular experts stay, the rest are "
                        "evicted after each batch; none: no policy, nothing is evicted (default %(default)s)")
    p.add_argument("--dir", default=None, help="directory for the checkpoint files (default: a temporary one)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (default %(default)s)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the Float64 correctness check")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="residency heatmap and throughput chart")
    p.add_argument("--compare", action="store_true", help="also run the workload in PyTorch (needs torch)")
    a = p.parse_args(argv)
    cfg = Config(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Config)})
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg


# ---------------------------------------------------------------- checkpoint and workload


MATRICES = ("w1", "w2")


def matrix_shape(cfg: Config, name: str) -> tuple[int, int]:
    """(rows, cols) of one expert: W1_e is (d_hidden, d_model), W2_e is (d_model, d_hidden)."""
    return (cfg.d_hidden, cfg.d_model) if name == "w1" else (cfg.d_model, cfg.d_hidden)


def checkpoint_path(directory: str, name: str) -> str:
    return os.path.join(directory, f"moe_{name}.f32")


def write_checkpoint(cfg: Config, directory: str) -> dict:
    """Writes each matrix once, expert after expert (column-major within an expert): the raw checkpoint.

    Experts are generated one at a time, so writing never holds more than one expert in memory.
    """
    paths = {}
    for m, name in enumerate(MATRICES):
        rows, cols = matrix_shape(cfg, name)
        rng = np.random.default_rng([cfg.seed, 1000 + m])
        scale = np.float32(1.0 / np.sqrt(cols))
        path = checkpoint_path(directory, name)
        with open(path, "wb") as f:
            for _ in range(cfg.experts):
                w = rng.standard_normal((cols, rows), dtype=np.float32)  # W_e^T in C order = W_e column-major
                w *= scale
                w.tofile(f)
        paths[name] = path
    return paths


def read_expert(path: str, e: int, rows: int, cols: int) -> np.ndarray:
    """Expert e of a checkpoint as a (rows, cols) NumPy array (one read)."""
    flat = np.fromfile(path, dtype=np.float32, count=rows * cols, offset=e * rows * cols * 4)
    return flat.reshape(cols, rows).T


def popularity(cfg: Config) -> np.ndarray:
    """Zipf-skewed routing prior: expert of rank r (a fixed random permutation) has weight 1 / (r+1)**zipf."""
    rng = np.random.default_rng([cfg.seed, 1])
    ranks = rng.permutation(cfg.experts)
    p = np.empty(cfg.experts)
    p[ranks] = 1.0 / np.arange(1, cfg.experts + 1) ** cfg.zipf
    return p / p.sum()


@dataclasses.dataclass
class Batch:
    x: np.ndarray  # (tokens, d_model)
    experts: np.ndarray  # (tokens, top_k) expert ids
    gates: np.ndarray  # (tokens, top_k) softmax over the chosen experts' router logits
    used: list  # sorted unique experts of the batch

    def tokens_of(self, e: int):
        """Token rows routed to e, and their gate values."""
        rows, slot = np.nonzero(self.experts == e)
        return rows, self.gates[rows, slot]


def make_batch(cfg: Config, b: int, log_p: np.ndarray) -> Batch:
    """Batch b, reproducible on its own: tokens, router logits (Zipf prior + Gumbel noise), top-k, gates."""
    rng = np.random.default_rng([cfg.seed, 2, b])
    x = rng.standard_normal((cfg.tokens, cfg.d_model), dtype=np.float32)
    logits = log_p[None, :] + rng.gumbel(size=(cfg.tokens, cfg.experts))  # Gumbel top-k: sampling without replacement
    experts = np.argpartition(-logits, cfg.top_k - 1, axis=1)[:, : cfg.top_k]
    chosen = np.take_along_axis(logits, experts, axis=1)
    g = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    gates = (g / g.sum(axis=1, keepdims=True)).astype(np.float32)
    return Batch(x, experts, gates, sorted(np.unique(experts).tolist()))


def cotangent(cfg: Config) -> np.ndarray:
    """The fixed random cotangent of the output rows used for every batch's backward."""
    return np.random.default_rng([cfg.seed, 3]).standard_normal((cfg.tokens, cfg.d_model), dtype=np.float32)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------- StrideWeave


def open_expert_weights(cfg: Config, path: str, name: str, policy):
    """The full tiled tensor over a checkpoint file opened in place: shape (rows, (cols, E)), one expert per tile."""
    rows, cols = matrix_shape(cfg, name)
    secondary = sw.FileBacked(path, mutable=False)  # the checkpoint itself: read in place, never written
    carrier = sw.TiledEvictable(sw.CPU(0), secondary, (1, cfg.experts), (rows, cols), residency_policy=policy)
    layout = sw.Layout(sw.Shape(rows, [cols, cfg.experts]), sw.Stride(1, [rows, rows * cols]))  # expert-last
    return carrier, sw.Tensor(carrier, 0, layout)


def make_policy(cfg: Config, p: np.ndarray):
    if cfg.policy == "lru":
        return LRUPolicy(cfg.budget)
    if cfg.policy == "pinned":
        hot = np.argsort(-p)[: cfg.budget]
        return PinnedPolicy(sw.TileSet([(0, int(e)) for e in hot]))
    return None


def expert_bytes(cfg: Config) -> int:
    return cfg.d_model * cfg.d_hidden * 4


def expert_tiles(experts) -> sw.TileSet:
    return sw.TileSet([(0, int(e)) for e in experts])


def resident_experts(carrier) -> set:
    return {e for (_, e) in carrier.primary_tiles.coordinates}


def evict_gradient_tiles(full, keep: set):
    """Starts evicting gradient tiles of experts not in `keep` (the next batch's experts) to the gradient's
    secondary tier; returns the pending handle, or None when there is nothing to evict.

    The writes run while the next batch computes. Its backward never touches these tiles (they are not its
    experts'), and StrideWeave adds into the other tiles of a tiled .grad in place while the eviction runs: a
    residency request's own reference does not count as someone else holding the gradient. A gradient sum that
    needed a tile under the request would raise and ask to wait for it. The handle is waited after that batch,
    before the next evictions are chosen.
    """
    if full.grad is None:
        return None
    carrier = full.grad.carrier
    victims = [t for t in carrier.primary_tiles.coordinates if t[1] not in keep]
    return carrier.evict_async(sw.TileSet(victims)) if victims else None


def prefetch_gradient_tiles(full, experts: set):
    """Starts promoting the gradient tiles of `experts` (the next batch's) that an earlier eviction wrote to the
    gradient's secondary tier; returns the pending handle, or None when there is nothing to promote.

    The next batch's backward then adds each expert's gradient into a resident tile in place, inside the matmul
    (no separate gradient buffer, no read of the file on the critical path). The handle is waited before that
    backward: the tiles it reads back are the ones the backward adds into.
    """
    if full.grad is None:
        return None
    carrier = full.grad.carrier
    wanted = [(0, e) for e in sorted(experts) if carrier.tile_state((0, e)).location == "secondary"]
    return carrier.promote_async(sw.TileSet(wanted)) if wanted else None


def gradient_stats(full) -> dict:
    return dict(full.grad.carrier.stats()) if full.grad is not None else {}


def make_room(carriers: dict, budget: int, resident: set, ahead: list, needed: set, recent: OrderedDict) -> None:
    """Before prefetching `ahead`, evicts the least recently projected experts that neither this batch nor the next
    needs, so that the prefetch does not take residency past the budget (as far as the two batches allow).

    LRUPolicy evicts only when a projection asks it, so without this the prefetched experts would come on top of
    the budget's worth it keeps. The victims are clean weight tiles: evicting them drops them, nothing is written.
    """
    incoming = [e for e in ahead if e not in resident]
    excess = len(resident) + len(incoming) - budget
    if excess <= 0:
        return
    victims = [e for e in recent if e in resident and e not in needed][:excess]
    if victims:
        for carrier in carriers.values():
            carrier.evict(expert_tiles(victims))


def processing_order(used: list, recent: OrderedDict) -> list:
    """The order in which a batch's experts are projected, so that LRU evictions never hit one still to come.

    Each projection asks the policy with one required expert; LRUPolicy then evicts the least recently required
    tiles beyond its capacity. Projecting first the batch's experts the LRU already tracks (oldest first), then
    the others, means every victim is either outside the batch or an expert this batch has already projected.
    `recent` mirrors the LRU's order (the example's own bookkeeping, not the policy's internals).
    """
    batch = set(used)
    tracked = [e for e in recent if e in batch]
    return tracked + [e for e in used if e not in recent]


def run_strideweave(cfg: Config, paths: dict, batches_fn, G: np.ndarray, p: np.ndarray, progress=None) -> dict:
    """The offloaded workload. Returns outputs, per-batch timings and residency, and the full tensors."""
    carriers, fulls = {}, {}
    for name in MATRICES:
        carriers[name], fulls[name] = open_expert_weights(cfg, paths[name], name, make_policy(cfg, p))
    pinned = set(np.argsort(-p)[: cfg.budget].tolist()) if cfg.policy == "pinned" else None
    outputs, per_batch = [], []
    hits = requests = 0
    prefetch_wait = project_time = compute = 0.0
    recent: OrderedDict = OrderedDict()  # projected experts, least recent first (mirrors LRUPolicy)
    peak_resident = 0
    # Gradient transfers started after the previous batch: the read-backs of this batch's experts' gradient tiles
    # are waited before its first backward (which adds into those tiles); the evictions of other experts' tiles
    # run on meanwhile (the backward adds into the tiles no request is transitioning, in place) and are waited
    # after the batch, before the next evictions are chosen.
    grad_reads, grad_writes = [], []

    def finish(handles: list) -> None:
        nonlocal evict_wait
        if handles:
            t = time.perf_counter()
            for h in handles:
                h.wait()
            handles.clear()  # drop the handles
            evict_wait += time.perf_counter() - t

    evict_wait = 0.0
    # Freed tile-sized buffers are kept mapped for reuse (sw.set_mapping_cache_limit): the promotions, gradient
    # tiles and matmul results of a batch allocate about as many 4 MiB buffers as its evictions free, but in
    # bursts. A job that bounds its memory bounds this too: 32 tiles spare most fresh mappings (whose first touch
    # zeroes every page) for about 15 MiB of peak memory, where the default (up to 1 GiB) would keep more.
    cache_limit = sw.set_mapping_cache_limit(32 * expert_bytes(cfg))
    start = time.perf_counter()
    batch = batches_fn(0)
    was_resident = set()
    prefetch = [carriers[name].promote_async(expert_tiles(batch.used)) for name in MATRICES]
    iterator = range(cfg.batches)
    if progress is not None:
        iterator = progress(iterator)
    for b in iterator:
        t0 = time.perf_counter()
        # Hits: the batch's experts that were resident when its routing became known (one batch ahead).
        missed = [e for e in batch.used if e not in was_resident]
        hit = len(batch.used) - len(missed)
        hits += hit
        requests += len(batch.used)
        # 1. Wait for this batch's prefetch: a projection over tiles of an incomplete request raises ('wait').
        if prefetch is not None:
            for h in prefetch:
                h.wait()
        prefetch_wait += time.perf_counter() - t0
        # 2. Prefetch the next batch's experts while this one computes. Tiles already resident are skipped, and
        #    so are this batch's own experts: its projections must not meet an incomplete request of ours.
        nxt = batches_fn(b + 1) if b + 1 < cfg.batches else None
        prefetch = None
        if nxt is not None:
            was_resident = resident_experts(carriers["w1"])
            ahead = [e for e in nxt.used if e not in set(batch.used)]
            if cfg.policy == "lru":
                make_room(carriers, cfg.budget, was_resident, ahead, set(batch.used) | set(nxt.used), recent)
            prefetch = [carriers[name].promote_async(expert_tiles(ahead)) for name in MATRICES]
        # 3. Expert by expert: project (one compact (rows, cols) matrix per weight), forward, backward.
        y = np.zeros((cfg.tokens, cfg.d_model), dtype=np.float32)
        resident_now = set()
        for e in processing_order(batch.used, recent):
            t1 = time.perf_counter()
            selection = sw.TileSelection([[0], [e]])
            # No destination: each one-expert projection shares the resident tile (copy-on-write), no copy.
            pending = [carriers[name].project(fulls[name], selection) for name in MATRICES]
            w1, w2 = (h.wait() for h in pending)
            t2 = time.perf_counter()
            resident_now |= resident_experts(carriers["w1"])
            peak_resident = max(peak_resident, max(len(resident_experts(c)) for c in carriers.values()))
            recent.pop(e, None)
            recent[e] = None
            while len(recent) > cfg.budget:
                recent.popitem(last=False)
            expert_forward_backward(batch, e, w1, w2, G, y, before_backward=lambda: finish(grad_reads))
            project_time += t2 - t1
            compute += time.perf_counter() - t2
        if cfg.check:  # kept for the correctness check only (1 MiB a batch)
            outputs.append(y)
        # 4. Residency housekeeping. Pinned mode evicts the experts outside its pinned set after the batch (the
        #    next batch's tiles are under its prefetch request and needed next: they stay). Gradient tiles stay
        #    only for the next batch's experts (its backward adds into them in place); evicting the others writes
        #    them to the gradient's own file, and the next batch's experts whose gradient tiles were written out
        #    earlier are read back meanwhile. Keeping the gradients of every resident expert instead halves those
        #    transfers (about 7% less CPU time) for 20-25 MiB more peak memory: the memory ratio would reach 0.35.
        t3 = time.perf_counter()
        upcoming = set(nxt.used) if nxt is not None else set()
        if pinned is not None:
            for name in MATRICES:
                extra = resident_experts(carriers[name]) - pinned - upcoming
                if extra:
                    carriers[name].evict(expert_tiles(extra))
        if cfg.policy != "none":
            finish(grad_writes)  # the previous evictions have ended: every tile's location is settled
            for name in MATRICES:
                h = evict_gradient_tiles(fulls[name], upcoming)
                if h is not None:
                    grad_writes.append(h)
                h = prefetch_gradient_tiles(fulls[name], upcoming)
                if h is not None:
                    grad_reads.append(h)
        compute += time.perf_counter() - t3
        per_batch.append({
            "seconds": time.perf_counter() - t0, "tokens": cfg.tokens, "used": list(batch.used),
            "resident": sorted(resident_now), "hits": hit, "missed": missed,
        })
        if nxt is not None:
            batch = nxt
    if prefetch is not None:
        for h in prefetch:
            h.wait()
    finish(grad_reads)
    finish(grad_writes)
    wall = time.perf_counter() - start
    sw.set_mapping_cache_limit(cache_limit)
    weight = [carriers[n].stats() for n in MATRICES]
    grads = [gradient_stats(fulls[n]) for n in MATRICES]
    total = lambda dicts, key: sum(d.get(key, 0) for d in dicts)  # noqa: E731
    return {
        "carriers": carriers, "fulls": fulls, "outputs": outputs, "per_batch": per_batch,
        "wall": wall, "prefetch_wait": prefetch_wait, "project": project_time, "compute": compute,
        "hits": hits, "requests": requests, "peak_resident_experts": peak_resident,
        "bytes_promoted": total(weight, "bytes_promoted"), "bytes_evicted": total(weight, "bytes_evicted"),
        "writes_skipped": total(weight, "writes_skipped"),
        "grad_bytes_promoted": total(grads, "bytes_promoted"), "grad_bytes_evicted": total(grads, "bytes_evicted"),
        "grad_writes_skipped": total(grads, "writes_skipped"),
        "grad_evict_wait": evict_wait, "peak_rss": peak_rss_bytes(),
    }


def release_run(r: dict) -> None:
    """Releases a run's tiled carriers and their gradients (their files with them)."""
    for name in MATRICES:
        full = r["fulls"][name]
        if full.grad is not None:
            full.grad.carrier.release()
        r["carriers"][name].release()


def expert_forward_backward(batch: Batch, e: int, w1, w2, G: np.ndarray, y: np.ndarray, before_backward=None) -> None:
    """Expert e's share of the batch: y[rows] += gate * relu(x W1_e^T) W2_e^T, then backward with G's rows.

    w1 and w2 are the projected compact (rows, cols) experts: backward runs through the matmuls into the
    projections, whose backward scatter-adds the expert's gradient into the tiled W1_full.grad / W2_full.grad
    (in place, tile by tile: the gradient of every other expert is untouched).
    """
    rows, gate = batch.tokens_of(e)
    # (t_e, d_model), gathered with NumPy. Like the gate below it is a Float32 leaf, so backward computes its
    # gradient as well (what a layer inside a network passes back to the previous one); this example drops it.
    xe = sw.friendly.tensor(batch.x[rows])
    h = sw.relu(sw.matmul(xe, w1))  # (t_e, d_hidden)
    ye = sw.matmul(h, w2)  # (t_e, d_model)
    ye = sw.elementwise_mul(ye, sw.friendly.tensor(gate.reshape(-1, 1)))  # the gate, broadcast over columns
    y[rows] += np.asarray(ye)
    if before_backward is not None:
        before_backward()
    ye.backward(sw.friendly.tensor(G[rows]))


# ---------------------------------------------------------------- correctness
#
# Note [A check that is right by construction]
# The reference is computed in Float64 from the same Float32 inputs (the checkpoint's weights, the batches'
# tokens and gates, the cotangent), and every quantity StrideWeave returns (the outputs y and the tiled
# gradients of W1 and W2) is compared element by element with a bound on the Float32 rounding error of that
# element, derived from the standard model of floating-point arithmetic (Higham, "Accuracy and Stability of
# Numerical Algorithms", 2nd ed., §3.1-§3.5): fl(a op b) = (a op b)(1 + d) with |d| <= u = 2^-24, so a dot
# product of n terms, summed in any order, with or without FMA, has |error| <= gamma(n) * sum |a_i| |b_i|,
# gamma(n) = n u / (1 - n u). Errors in the operands propagate linearly through the products: for an operand
# A computed with elementwise error bound E_A, |fl(A B) - A B| <= ((1 + gamma(n)) E_A + gamma(n) |A|) |B|.
# Each bound below follows from these two rules; the Float64 reference's own error (about n 2^-53 of the same
# absolute products) is covered by counting one extra rounding in every gamma.
#
# ReLU's kink: relu is 1-Lipschitz, so |relu(p^) - relu(p)| <= |p^ - p| and the forward needs no special case.
# Its derivative is not continuous: where the exact pre-activation p lies within its own rounding bound of 0,
# the Float32 value StrideWeave computes may have the other sign (or be 0), and either mask is a correct
# Float32 result. Such elements are counted, the reference uses the Float64 mask, and the bound of every
# gradient element they feed includes their whole contribution (|dh| + its bound) -- the only place the check
# accepts either answer, and only for those elements. A row in which StrideWeave's sign did flip differs from
# the reference by that term, nearly its whole bound: W1's largest ratio is then close to 1, and the check also
# reports the largest ratio over the rows no kink element feeds, to show how strict it is elsewhere.
#
# The check still catches real bugs: one batch's contribution of one expert dropped (or added twice) moves
# every element of that expert's gradient by a whole term, far above bounds that are a few thousand ulps of the
# absolute products (tests/test_moe_example.py checks both).

U32 = 2.0 ** -24


def gamma(n: int) -> float:
    """Bound on the relative error of n successive Float32 roundings (Higham's gamma_n)."""
    return n * U32 / (1.0 - n * U32)


def upper_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An upper bound on a @ b for non-negative a and b, computed in Float32 for speed: the two casts round each
    operand to within a factor (1 - u) and the product's summation to within (1 - gamma(n)) of the exact value,
    so dividing by (1 - gamma(n + 2)) bounds it from above."""
    n = a.shape[1]
    c = np.asarray(a, dtype=np.float32) @ np.asarray(b, dtype=np.float32)
    return c.astype(np.float64) / (1.0 - gamma(n + 2))


def expert_reference(cfg: Config, w1: np.ndarray, w2: np.ndarray, x: np.ndarray, gate: np.ndarray,
                     dy: np.ndarray, rounds: int) -> dict:
    """Float64 reference and per-element Float32 error bounds of one expert's share of a stack of token rows.

    x (n, d_model), gate (n, 1) and dy (n, d_model) are Float32 inputs; rounds is the number of roundings along
    the longest path of a gradient element's sum (the most rows one batch routes to the expert, plus one per batch
    whose contribution is added into the tiled gradient). Returns the output contributions y (n, d_model) with
    their bounds, the gradients' sums g1 (d_hidden, d_model), g2 (d_model, d_hidden) with their bounds, and the
    number of pre-activations at ReLU's kink."""
    x64, gate64, dy64 = (np.asarray(a, dtype=np.float64) for a in (x, gate, dy))
    ax = np.abs(x64)
    aw1, aw2 = np.abs(w1), np.abs(w2)
    g_in, g_hid, g_out = gamma(cfg.d_model + 1), gamma(cfg.d_hidden + 1), gamma(cfg.d_model + 1)
    # Forward. pre = x W1^T (d_model terms), h = relu(pre), out = h W2^T (d_hidden terms), y = gate * out.
    pre = x64 @ w1.T.astype(np.float64)
    e_pre = g_in * upper_product(ax, aw1.T)
    h = np.maximum(pre, 0.0)
    e_h = e_pre  # relu is 1-Lipschitz
    out = h @ w2.T.astype(np.float64)
    e_out = upper_product((1.0 + g_hid) * e_h + g_hid * h, aw2.T)
    y = gate64 * out
    e_y = np.abs(gate64) * (e_out + U32 * (np.abs(out) + e_out))  # one more rounding: the gate's product
    # Backward. dout = gate * dy (one rounding), dh = dout W2 (d_model terms), dpre = dh * mask,
    # g1 = dpre^T x and g2 = dout^T h, each summed over the rows of a batch and then over the batches.
    dout = gate64 * dy64
    adout = np.abs(dout)
    dh = dout @ w2.astype(np.float64)
    e_dh = ((1.0 + g_out) * U32 + g_out) * upper_product(adout, aw2)
    kink = np.abs(pre) <= e_pre  # the Float32 sign of pre may differ: either mask is right
    mask = pre > 0.0
    dpre = np.where(mask, dh, 0.0)
    e_dpre = np.where(kink, np.abs(dh) + e_dh, np.where(mask, e_dh, 0.0))
    g_sum = gamma(rounds + 1)
    g1 = dpre.T @ x64
    e_g1 = upper_product(((1.0 + g_sum) * e_dpre + g_sum * np.abs(dpre)).T, ax)
    g2 = dout.T @ h
    e_g2 = upper_product(adout.T, (U32 + g_sum * (1.0 + U32)) * (h + e_h) + e_h)
    return {"y": y, "e_y": e_y, "abs_y": np.abs(y), "g1": g1, "e_g1": e_g1, "g2": g2, "e_g2": e_g2,
            "kink": int(np.count_nonzero(kink)), "kink_rows": kink.any(axis=0)}


def error_ratio(diff: np.ndarray, bound: np.ndarray) -> float:
    """The largest diff / bound; an element whose bound is 0 (every term it sums is exactly 0) must be exact."""
    inexact = np.where(diff > 0, np.inf, 0.0)
    return float(np.max(np.divide(diff, bound, out=inexact, where=bound > 0)))


def check(cfg: Config, paths: dict, batches_fn, G: np.ndarray, result: dict, chunk_rows: int = 8192) -> dict:
    """Compares StrideWeave's outputs and tiled gradients with a Float64 reference, element by element, each
    within its own Float32 error bound (Note [A check that is right by construction]).

    For each touched expert, the rows routed to it in all batches are stacked (in chunks of `chunk_rows`), so the
    reference does a few large products per expert instead of several per batch; sums over batches are exact
    reorderings of the same terms, and their rounding is counted in the bounds."""
    used = sorted({e for r in result["per_batch"] for e in r["used"]})
    batches = [batches_fn(b) for b in range(cfg.batches)]
    y_ref = [np.zeros((cfg.tokens, cfg.d_model)) for _ in range(cfg.batches)]
    y_err = [np.zeros((cfg.tokens, cfg.d_model)) for _ in range(cfg.batches)]
    y_abs = [np.zeros((cfg.tokens, cfg.d_model)) for _ in range(cfg.batches)]
    worst = {"y": 0.0, "w1": 0.0, "w2": 0.0}
    worst_w1_strict = 0.0  # over the rows of W1's gradient that no pre-activation at the kink feeds
    max_abs = {"y": 0.0, "grad": 0.0}
    kinks = 0
    fulls = result["fulls"]
    for e in used:
        parts = [(b, *batch.tokens_of(e)) for b, batch in enumerate(batches)]
        parts = [(b, rows, gate) for b, rows, gate in parts if rows.size]
        rounds = max(rows.size for _, rows, _ in parts) + len(parts)
        w1 = read_expert(paths["w1"], e, *matrix_shape(cfg, "w1")).astype(np.float64)
        w2 = read_expert(paths["w2"], e, *matrix_shape(cfg, "w2")).astype(np.float64)
        g = {"w1": 0.0, "w2": 0.0}
        bound = {"w1": 0.0, "w2": 0.0}
        kink_rows = np.zeros(cfg.d_hidden, dtype=bool)
        start = 0
        while start < len(parts):  # whole batches per chunk, at least one
            stop, n = start, 0
            while stop < len(parts) and (stop == start or n + parts[stop][1].size <= chunk_rows):
                n += parts[stop][1].size
                stop += 1
            chunk = parts[start:stop]
            x = np.concatenate([batches[b].x[rows] for b, rows, _ in chunk])
            gate = np.concatenate([gate for _, _, gate in chunk])[:, None]
            dy = np.concatenate([G[rows] for _, rows, _ in chunk])
            ref = expert_reference(cfg, w1, w2, x, gate, dy, rounds)
            g["w1"] = g["w1"] + ref["g1"]
            g["w2"] = g["w2"] + ref["g2"]
            bound["w1"] = bound["w1"] + ref["e_g1"]
            bound["w2"] = bound["w2"] + ref["e_g2"]
            kinks += ref["kink"]
            kink_rows |= ref["kink_rows"]
            k = 0
            for b, rows, _ in chunk:
                y_ref[b][rows] += ref["y"][k:k + rows.size]
                y_err[b][rows] += ref["e_y"][k:k + rows.size]
                y_abs[b][rows] += ref["abs_y"][k:k + rows.size] + ref["e_y"][k:k + rows.size]
                k += rows.size
            start = stop
        for name in MATRICES:
            diff = np.abs(project_expert(fulls[name].grad, e).astype(np.float64) - g[name])
            max_abs["grad"] = max(max_abs["grad"], float(diff.max()))
            worst[name] = max(worst[name], error_ratio(diff, bound[name]))
            if name == "w1" and not kink_rows.all():
                worst_w1_strict = max(worst_w1_strict, error_ratio(diff[~kink_rows], bound[name][~kink_rows]))
    # Experts no batch routed to have implicit-zero gradient tiles.
    untouched = [e for e in range(cfg.experts) if e not in used]
    for name in MATRICES:
        grad_carrier = fulls[name].grad.carrier
        for e in untouched:
            state = grad_carrier.tile_state((0, e))
            assert state.location == "implicit", f"untouched expert {e} of {name}: gradient tile is {state.location}"
    # y[t] sums the top_k experts' contributions in Float32: top_k more roundings of at most their magnitudes.
    g_k = gamma(cfg.top_k)
    for b in range(cfg.batches):
        diff = np.abs(result["outputs"][b].astype(np.float64) - y_ref[b])
        max_abs["y"] = max(max_abs["y"], float(diff.max()))
        worst["y"] = max(worst["y"], error_ratio(diff, y_err[b] + g_k * y_abs[b]))
    ok = max(worst.values()) <= 1.0
    return {"worst_y": worst["y"], "worst_w1": worst["w1"], "worst_w2": worst["w2"], "worst_w1_strict": worst_w1_strict,
            "max_abs_err_y": max_abs["y"], "max_abs_err_grad": max_abs["grad"], "kink_elements": kinks, "ok": ok,
            "experts_checked": len(used), "untouched_implicit": len(untouched)}


def project_expert(grad_full, e: int) -> np.ndarray:
    """One expert of a tiled gradient, read through a projection (no grad)."""
    with sw.no_grad():
        compact = grad_full.carrier.project(grad_full, sw.TileSelection([[0], [e]])).wait()
    return np.array(np.asarray(compact), copy=True)


# ---------------------------------------------------------------- PyTorch comparison


def torch_worker(mode: str, cfg: Config, paths: dict) -> dict:
    """Runs the same workload in PyTorch in this (fresh) process; `mode` is "ram" or "naive"."""
    import torch

    p = popularity(cfg)
    log_p = np.log(p)
    G = cotangent(cfg)
    shapes = {n: matrix_shape(cfg, n) for n in MATRICES}
    grads = {n: {} for n in MATRICES}
    weights = None
    start = time.perf_counter()
    if mode == "ram":  # every expert resident, loaded once from the checkpoint
        weights = {n: [torch.from_numpy(np.ascontiguousarray(read_expert(paths[n], e, *shapes[n]))).requires_grad_()
                       for e in range(cfg.experts)] for n in MATRICES}
    load = time.perf_counter() - start
    io = 0.0
    start = time.perf_counter()
    for b in range(cfg.batches):
        batch = make_batch(cfg, b, log_p)
        if mode == "naive":  # each batch reads its experts from the file, synchronously, no cache
            t0 = time.perf_counter()
            ws = {n: {e: torch.from_numpy(np.ascontiguousarray(read_expert(paths[n], e, *shapes[n]))).requires_grad_()
                      for e in batch.used} for n in MATRICES}
            io += time.perf_counter() - t0
        else:
            ws = {n: {e: weights[n][e] for e in batch.used} for n in MATRICES}
        # The same gradients as StrideWeave computes: every Float32 tensor is differentiable there (it has no
        # requires_grad), so the tokens' and the gates' gradients are computed too, as a layer inside a network
        # needs them (they backpropagate into the previous layer and into the router).
        x = torch.from_numpy(batch.x).requires_grad_()
        gates = torch.from_numpy(batch.gates).requires_grad_()
        Gt = torch.from_numpy(G)
        for e in batch.used:
            rows, slot = np.nonzero(batch.experts == e)
            r, s = torch.from_numpy(rows), torch.from_numpy(slot)
            h = torch.relu(x[r] @ ws["w1"][e].T)
            ye = (h @ ws["w2"][e].T) * gates[r, s][:, None]
            ye.backward(Gt[r])
        if mode == "naive":  # gradients accumulate in RAM, per expert
            for n in MATRICES:
                for e, w in ws[n].items():
                    acc = grads[n].get(e)
                    grads[n][e] = w.grad if acc is None else acc + w.grad
    wall = time.perf_counter() - start
    return {"mode": mode, "wall": wall, "load": load, "io": io, "tokens_per_s": cfg.batches * cfg.tokens / wall,
            "peak_rss": peak_rss_bytes()}


def require_torch() -> None:
    """Fails clearly without PyTorch. Looks it up without importing it: importing would add to this process's RSS."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise SystemExit("--compare needs PyTorch, which is not installed: run `make bench` once "
                         "(it installs requirements-bench.txt into .venv) or `pip install torch`")


def compare(cfg: Config, paths: dict) -> list:
    """Each PyTorch variant in a fresh process, so its peak resident memory is its own."""
    require_torch()
    out = []
    for mode in ("ram", "naive"):
        payload = json.dumps({"mode": mode, "cfg": dataclasses.asdict(cfg), "paths": paths})
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_torch-worker", payload],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the PyTorch {mode} run failed:\n{proc.stderr}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# ---------------------------------------------------------------- reporting


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary_rows(cfg: Config, r: dict) -> list:
    expert_bytes = cfg.d_model * cfg.d_hidden * 4
    used = [len(x["used"]) for x in r["per_batch"]]
    return [
        ("experts x matrices", f"{cfg.experts} x 2 of {cfg.d_hidden} x {cfg.d_model} Float32 "
                               f"({fmt_bytes(2 * cfg.experts * expert_bytes)} on file)"),
        ("policy / budget", f"{cfg.policy} / {cfg.budget} experts per matrix"),
        ("batches x tokens, top-k", f"{cfg.batches} x {cfg.tokens}, top-{cfg.top_k}, zipf {cfg.zipf}"),
        ("experts used per batch", f"{np.mean(used):.1f} mean, {max(used)} max"),
        ("wall time", f"{r['wall']:.2f} s"),
        ("tokens/s", f"{r['tokens_per_s']:.0f}"),
        ("expert hit rate", f"{r['hit_rate']:.1%} ({r['hits']} of {r['requests']} batch-expert requests)"),
        ("weights: bytes promoted", fmt_bytes(r["bytes_promoted"])),
        ("weights: bytes evicted", f"{fmt_bytes(r['bytes_evicted'])} (clean tiles are dropped, never written)"),
        ("weights: writes skipped", f"{r['writes_skipped']}"),
        ("gradients: promoted / evicted", f"{fmt_bytes(r['grad_bytes_promoted'])} / "
                                           f"{fmt_bytes(r['grad_bytes_evicted'])}, "
                                           f"{r['grad_writes_skipped']} writes skipped"),
        ("waiting for prefetch I/O", f"{r['prefetch_wait']:.2f} s (reads not hidden behind compute)"),
        ("projecting (gather + misses)", f"{r['project']:.2f} s"),
        ("computing (fwd + bwd)", f"{r['compute']:.2f} s (includes {r['grad_evict_wait']:.2f} s waiting for gradient evictions and prefetches)"),
        ("peak resident experts", f"{r['peak_resident_experts']} per matrix "
                                  f"({fmt_bytes(2 * r['peak_resident_experts'] * expert_bytes)})"),
        ("peak resident memory", f"{fmt_bytes(r['peak_rss'])} (process RSS, before the check)"),
    ]


def print_table(title: str, rows: list) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 2 + max(len(v) for _, v in rows)))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def plot(cfg: Config, r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    grid = np.zeros((cfg.experts, cfg.batches))
    for b, rec in enumerate(r["per_batch"]):
        res = set(rec["resident"])
        for e in res:
            grid[e, b] = 1
        for e in rec["used"]:
            grid[e, b] = 2
        for e in rec["missed"]:
            grid[e, b] = 3
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    cmap = ListedColormap(["#f2f2f2", "#9ecae1", "#2171b5", "#e6550d"])
    ax0.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
    ax0.set_xlabel("batch")
    ax0.set_ylabel("expert")
    ax0.set_title(f"W1 expert residency per batch ({cfg.policy}, budget {cfg.budget})")
    from matplotlib.patches import Patch

    labels = ["not resident", "resident, unused", "used, was resident", "used, loaded for the batch"]
    ax0.legend(handles=[Patch(color=c, label=l) for c, l in zip(cmap.colors, labels)],
               loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8, frameon=False)
    tps = [rec["tokens"] / rec["seconds"] for rec in r["per_batch"]]
    t = np.cumsum([rec["seconds"] for rec in r["per_batch"]])
    ax1.plot(t, tps, marker=".")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("tokens/s (per batch)")
    ax1.set_title("throughput over time")
    ax1.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main(argv=None, cfg: Config | None = None) -> dict:
    """Runs the example; returns the summary numbers (used by the tests and benchmarks)."""
    cfg = cfg or parse_args(argv)
    cfg.validate()
    if cfg.compare:
        require_torch()  # fail before the work, not after it
    p = popularity(cfg)
    log_p = np.log(p)
    G = cotangent(cfg)

    def batches_fresh(b: int) -> Batch:  # every batch is reproducible on its own (the check regenerates them)
        return make_batch(cfg, b, log_p)

    ctx = tempfile.TemporaryDirectory(prefix="moe_offload_") if cfg.dir is None else nullcontext(cfg.dir)
    with ctx as directory:
        os.makedirs(directory, exist_ok=True)
        t0 = time.perf_counter()
        paths = write_checkpoint(cfg, directory)
        t_write = time.perf_counter() - t0
        print(f"checkpoint: {2 * cfg.experts} experts, {fmt_bytes(sum(os.path.getsize(x) for x in paths.values()))} "
              f"written once to {directory} in {t_write:.1f} s")
        progress = None
        if cfg.progress:
            from tqdm import tqdm

            progress = lambda it: tqdm(it, desc="batches", unit="batch", file=sys.stderr)  # noqa: E731
        pending = {}

        def prefetching_batches(b: int) -> Batch:
            # The loop asks for batch b + 1 while b is current: keep both.
            if b not in pending:
                pending[b] = make_batch(cfg, b, log_p)
                for k in [k for k in pending if k < b - 1]:
                    del pending[k]
            return pending[b]

        r = run_strideweave(cfg, paths, prefetching_batches, G, p, progress)
        r["tokens_per_s"] = cfg.batches * cfg.tokens / r["wall"]
        r["hit_rate"] = r["hits"] / r["requests"] if r["requests"] else 0.0
        print_table("StrideWeave MoE offload summary", summary_rows(cfg, r))
        summary = {k: v for k, v in r.items() if k not in ("carriers", "fulls", "outputs", "per_batch")}
        summary["per_batch"] = r["per_batch"]
        if cfg.check:
            t0 = time.perf_counter()
            c = check(cfg, paths, batches_fresh, G, r)
            summary["check"] = c
            print(f"\ncorrectness vs a Float64 reference ({c['experts_checked']} experts touched, "
                  f"{c['untouched_implicit']} untouched with implicit-zero gradients, {time.perf_counter() - t0:.1f} s): "
                  f"largest |error| / Float32 error bound, element by element: y {c['worst_y']:.2g}, "
                  f"grad W1 {c['worst_w1']:.2g} ({c['worst_w1_strict']:.2g} in rows no kink feeds), "
                  f"grad W2 {c['worst_w2']:.2g} (pass: <= 1; {c['kink_elements']} pre-activations at ReLU's kink, "
                  f"either mask accepted)"
                  f"  {'PASS' if c['ok'] else 'FAIL'}")
            assert c["ok"], "StrideWeave outputs or gradients differ from the Float64 reference by more than their Float32 error bounds"
        if cfg.plot:
            plot(cfg, r, cfg.plot)
            print(f"plot written to {cfg.plot}")
        if cfg.compare:
            others = compare(cfg, paths)
            rows = [("StrideWeave (file + budget)", r["tokens_per_s"], r["wall"], r["peak_rss"],
                     r["prefetch_wait"] + r["project"])]
            names = {"ram": "PyTorch, every expert in RAM", "naive": "PyTorch, sync load per batch"}
            for o in others:
                rows.append((names[o["mode"]], o["tokens_per_s"], o["wall"], o["peak_rss"], o["io"]))
            summary["compare"] = others
            print(f"\n{'same workload':<30} {'tokens/s':>10} {'wall s':>8} {'peak RSS':>11} {'I/O wait s':>11}")
            for name, tps, wall, rss, io in rows:
                print(f"{name:<30} {tps:>10.0f} {wall:>8.2f} {fmt_bytes(rss):>11} {io:>11.2f}")
            ram = next(o for o in others if o["mode"] == "ram")
            print(f"(each PyTorch run in a fresh process; the in-RAM run first read every expert in {ram['load']:.1f} s, "
                  f"not counted in its wall time)")
        release_run(r)  # before the directory goes away
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_torch-worker":
        job = json.loads(sys.argv[2])
        print(json.dumps(torch_worker(job["mode"], Config(**job["cfg"]), job["paths"])))
    else:
        main()
