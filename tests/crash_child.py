"""The job tests/test_crash.py kills: a small fine-tuning run whose weights, gradients and AdamW moments are offloaded.

Pieces (examples/finetune_moe.py's, small): ``E`` expert tiles of ``T`` Float32 values in a safetensors checkpoint
opened where it lies (``ckpt.tiled(names, mutable=True)``: the weights' tier writes the checkpoint in place), a
gradient ``TiledEvictable`` over a named ``FileBacked`` file of the same geometry, ``sw.optim.AdamW`` (its moments
in TiledEvictables over their own scratch files), every carrier under ONE ``sw.ResidencyBudget`` of a few tiles,
so dirty tiles of all four are evicted all the time. ``--crash-safe`` opens both files crash-safe.

Step ``k`` (0-based): the gradient is ``gradient(k)`` (written into the gradient carrier, which evicts and writes
its tiles), then ``opt.step()``. Every ``--flush-every`` steps both tiers are flushed; every ``--save-every`` steps
the weights and moments are saved (``sw.safetensors.save``, atomic) to ``save.safetensors``. Progress lines on
stdout, each written after the event it reports::

    B k                 step k began
    F k                 both flushes after step k returned
    S k                 the save after step k returned

``--reference OUT.npz`` runs every step without a budget and writes each tile's hash after each step instead
(``w``, ``g``, ``m``, ``v``: arrays of shape (steps + 1, E); row 0 is the state before step 0): the values a
killed run's files are checked against. The budget changes no value (eviction moves bytes, does no arithmetic).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys

import numpy as np

import strideweave as sw
from strideweave import _core
from strideweave.carriers.tiled_evictable import TiledEvictable

LR, WEIGHT_DECAY = 1e-2, 1e-2


def names(e: int) -> list[str]:
    return [f"w.{i}" for i in range(e)]


def initial_weights(e: int, t: int) -> np.ndarray:
    return np.random.default_rng(1234).standard_normal((e, t)).astype(np.float32)


def gradient(step: int, e: int, t: int) -> np.ndarray:
    """Step `step`'s gradient, tile-major (tile i is row i)."""
    return np.random.default_rng(10_000 + step).standard_normal((e, t)).astype(np.float32)


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=8).hexdigest()


def tile_view(carrier, i: int, t: int) -> sw.Tensor:
    return sw.Tensor(carrier, i * t, sw.column_major(t))


class Job:
    def __init__(self, folder: str, e: int, t: int, crash_safe: bool, budget_tiles: int | None):
        self.e, self.t = e, t
        self.budget = sw.ResidencyBudget(budget_tiles * t * 4) if budget_tiles else None
        self.ckpt = sw.safetensors.open(os.path.join(folder, "experts.safetensors"))
        self.w = self.ckpt.tiled(names(e), mutable=True, crash_safe=crash_safe)
        wc = self.w.carrier
        if self.budget is not None:
            wc.set_residency_budget(self.budget)
        self.g_file = sw.FileBacked(os.path.join(folder, "grads.f32"), crash_safe=crash_safe)
        self.g_carrier = TiledEvictable(sw.CPU(0), self.g_file, wc.grid_shape, wc.tile_shape,
                                        residency_budget=self.budget)
        self.g = sw.Tensor(self.g_carrier, 0, self.w.layout)
        self.opt = sw.optim.AdamW([self.w], lr=LR, weight_decay=WEIGHT_DECAY)

    def step(self, k: int) -> None:
        _core._fill_from_array(self.g_carrier, gradient(k, self.e, self.t).reshape(-1))
        self.w.grad = self.g
        self.opt.step()

    def flush(self) -> None:
        self.w.carrier.flush()
        self.g_carrier.flush()

    def moments(self):
        st = self.opt.state(self.w)
        return st["exp_avg"].carrier, st["exp_avg_sq"].carrier

    def save(self, path: str) -> None:
        m, v = self.moments()
        tensors = {}
        for i in range(self.e):
            tensors[f"w.{i}"] = tile_view(self.w.carrier, i, self.t)
            tensors[f"m.{i}"] = tile_view(m, i, self.t)
            tensors[f"v.{i}"] = tile_view(v, i, self.t)
        sw.safetensors.save(path, tensors)

    def hashes(self) -> dict:
        m, v = self.moments()
        out = {}
        for key, c in (("w", self.w.carrier), ("g", self.g_carrier), ("m", m), ("v", v)):
            out[key] = [digest(np.asarray(tile_view(c, i, self.t))) for i in range(self.e)]
        return out


def prepare(folder: str, e: int, t: int) -> None:
    """The files a run starts from: the checkpoint and a zero gradient file."""
    os.makedirs(folder, exist_ok=True)
    w = initial_weights(e, t)
    tensors = {n: sw.friendly.tensor(w[i]) for i, n in enumerate(names(e))}
    sw.safetensors.save(os.path.join(folder, "experts.safetensors"), tensors)
    np.zeros(e * t, np.float32).tofile(os.path.join(folder, "grads.f32"))


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # unbuffered: the line is in the pipe before anything after it runs


def zygote(argv) -> int:
    """``--zygote``: strideweave imported once; each line ``RUN ARGS...`` on stdin forks a job run with those
    arguments (its stderr to ``FOLDER/stderr.txt``) and reports ``P pid``; the next line, ``KILL`` or ``WAIT``,
    kills it with SIGKILL or lets it finish, then ``X status`` (os.waitpid's) is reported. Saves the interpreter's start and the imports per run (tests/test_crash.py kills
    dozens)."""
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        args = line.split()[1:]
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                fd = os.open(os.path.join(args[0], "stderr.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 2)
                rc = main(args)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(rc)
        say(f"P {pid}")
        # The parent says KILL (at its random moment) or WAIT (the job finished); the job is reaped only after
        # that, so the pid SIGKILL reaches is still the job's (a finished job is a zombie until then).
        if sys.stdin.readline().strip() == "KILL":
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        say(f"X {status}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tile", type=int, default=1 << 18, help="Float32 values per tile")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--budget-tiles", type=int, default=6)
    ap.add_argument("--flush-every", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--crash-safe", action="store_true")
    ap.add_argument("--prepare", action="store_true", help="write the starting files and exit")
    ap.add_argument("--reference", metavar="OUT_NPZ")
    a = ap.parse_args(argv)
    if a.prepare:
        prepare(a.folder, a.experts, a.tile)
        return 0
    if a.reference:
        job = Job(a.folder, a.experts, a.tile, False, None)
        rows = [job.hashes()]
        for k in range(a.steps):
            job.step(k)
            rows.append(job.hashes())
        np.savez(a.reference, **{key: np.array([r[key] for r in rows]) for key in ("w", "g", "m", "v")})
        return 0
    job = Job(a.folder, a.experts, a.tile, a.crash_safe, a.budget_tiles)
    save_path = os.path.join(a.folder, "save.safetensors")
    for k in range(a.steps):
        say(f"B {k}")
        job.step(k)
        if (k + 1) % a.flush_every == 0:
            job.flush()
            say(f"F {k}")
        if (k + 1) % a.save_every == 0:
            job.save(save_path)
            say(f"S {k}")
    say("D")
    return 0


if __name__ == "__main__":
    sys.exit(zygote(sys.argv[2:]) if sys.argv[1:2] == ["--zygote"] else main())
