"""The fine-tuning command on several ranks: under ``torchrun`` (docs/guide.md, "Fine-tuning on several processes or
hosts", "Under torchrun").

Note [The command under torchrun]
When the environment says the command runs as one of several ranks (``WORLD_SIZE`` > 1, with ``RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun sets them and torch.distributed's ``env://`` rendezvous reads
them), the command initialises a gloo process group with an explicit timeout (``--dist-timeout``) and every rank
runs the same program on the same inputs:

* Checks: every rank checks the arguments, the model folder, the data and OUT_DIR itself; the ranks then agree
  (``agree``: one ``all_gather_object``), and a failure on any rank stops every rank with the same one-line error
  naming that rank, before anything is written. Rank 0 then creates OUT_DIR (or, resuming, removes the later
  checkpoints) and writes ``loss.csv``; the ranks agree once more that each of them sees it (OUT_DIR must be on a
  filesystem every rank shares: checkpoints are written by all of them into one folder).
* Data: every rank packs the same rows (Note [Packing]); micro-batch ``j`` of step ``s`` is the one-process run's,
  and rank ``r`` of ``N`` takes its rows ``[R r / N, R (r + 1) / N)`` (``R`` rows a micro-batch, a multiple of
  ``N``: refused otherwise). Each rank's loss is the mean over its own tokens, the same count on every rank (every
  row is full), so the mean of the ranks' losses is the one-process loss and ``all_reduce_gradients`` (after the
  last micro-batch, before clipping and the step) makes every gradient the one-process gradient (Note [Experts
  across ranks]); the global batch, the steps, the schedule and the clipping are the one-process run's. The logged
  loss is the ranks' losses averaged (an ``all_reduce`` in Float64).
* Output: rank 0 alone writes ``loss.csv``, ``loss.png``, the progress and the summary. Checkpoints and the final
  model are written collectively: every rank calls ``save_pretrained`` and the optimizer's ``save_state`` on the
  same hidden temporary folder (named from rank 0's process id, broadcast at the start), rank 0 writes
  ``trainer_state.pt`` and ``trainer_state.json``, the ranks meet at a barrier once all of them have written, and
  only then does rank 0 rename the folder to ``checkpoint-N``: a rank lost while a checkpoint is being written
  leaves no ``checkpoint-N``, only the hidden folder (removed by the next run).

Note [A lost rank]
A rank that dies (killed, out of memory, its host gone) stops the others within a bounded time, with an error naming
it:

1. Detection. A killed process's sockets are closed by its kernel, so a survivor's pending or next gloo operation
   with it fails at once ("Connection closed by peer"); every collective of a step involves every rank, so that is
   within the time between two collectives of one rank's own work. Under torchrun the agent also notices the exit
   within its ``--monitor-interval`` (0.1 s by default) and sends the others SIGTERM, which the command turns into
   the same path. A rank that hangs without closing its sockets (a host unplugged) is detected when the collective
   waiting for it times out: ``--dist-timeout`` seconds.
2. Naming. On a failed collective (or SIGTERM) a rank writes ``alive/<rank>`` into the rendezvous store (torchrun's
   agent hosts it, so it outlives the workers; it is rank 0's store without torchrun) and waits up to
   ``LOST_WAIT`` seconds for every rank's key; the ranks that did not write theirs are named as lost (a rank that
   failed on its own first wrote ``failed/<rank>`` with its error, which is quoted instead). A SIGTERM arriving
   while this runs is ignored (torchrun waits 30 s before SIGKILL).
3. Exit: the error on stderr (``rank 1 of 2 was lost at step 3 ...``), exit status 1, and, on rank 0, the clean-up
   of Note [No partial output folder] (a complete checkpoint is kept and the message says to ``--resume``).

So a survivor stops within: detection (immediate for a killed process; at most the collective timeout otherwise) +
``LOST_WAIT`` + its exit. tests/test_finetune_distributed.py kills rank 1 mid-step and mid-checkpoint and checks
that the survivor stops in well under the collective timeout it gives, naming rank 1.

Test hook: ``STRIDEWEAVE_FINETUNE_TEST_KILL=RANK:STEP:WHERE`` makes rank RANK send itself SIGKILL during step STEP
(1-based): WHERE ``forward`` after the first micro-batch's forward, ``save`` after writing its part of
``checkpoint-STEP`` and before the barrier that precedes the rename. It prints one line first
(``test hook: rank R SIGKILL at step S (WHERE) at <time.time()>``). For the tests only.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from typing import Any, Optional

from ._data import CommandError

LOST_WAIT = 5.0  # seconds a rank waits for the others' answers after a failed collective
KILL_HOOK = "STRIDEWEAVE_FINETUNE_TEST_KILL"


class Stopped(BaseException):
    """SIGTERM (torchrun's agent stopping the group) while training."""


def world_size_from_environment() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise CommandError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def is_collective_failure(e: BaseException) -> bool:
    """A failure of torch.distributed's transport (gloo's errors are RuntimeErrors naming gloo)."""
    import torch.distributed as dist
    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or "gloo" in text or "Connection closed by peer" in text


class Ranks:
    """This process's place among the ranks and the few collectives the command needs besides the model's."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise CommandError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: run the "
                               "command under torchrun (torchrun --nproc-per-node N -m strideweave.finetune ...)")
        self.timeout_s = timeout_s
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store: Any = None
        self._prefix = "strideweave.finetune/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", "none"),
                                                           os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.probing = False
        self.run_id = self.broadcast(os.getpid())
        signal.signal(signal.SIGTERM, self._on_sigterm)

    # ---- collectives -------------------------------------------------------------------------------------------

    def broadcast(self, value: Any) -> Any:
        import torch.distributed as dist
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, error: Optional[str]) -> None:
        """Every rank's `error` (None: fine) gathered; CommandError on every rank when any rank has one (the
        lowest rank's, naming it)."""
        import torch.distributed as dist
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        for r, e in enumerate(errors):
            if e is not None:
                raise CommandError(e if all(x == e for x in errors) else f"rank {r} of {self.world}: {e}")

    def mean(self, value: float) -> float:
        """The ranks' values averaged (Float64)."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t[0]) / self.world

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.group)

    def close(self) -> None:
        import torch.distributed as dist
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- faults ------------------------------------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.probing:
            raise Stopped()

    def store(self) -> Any:
        if self._store is None:
            import torch.distributed as dist
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=datetime.timedelta(seconds=LOST_WAIT))
        return self._store

    def record_failure(self, message: str) -> None:
        """Best effort: `message` under ``failed/<rank>`` for the other ranks' error."""
        try:
            self.store().set(f"{self._prefix}failed/{self.rank}", message[:2000])
        except Exception:  # noqa: BLE001 (the store may be gone with rank 0)
            pass

    def lost(self) -> tuple:
        """(the ranks that did not answer within LOST_WAIT seconds, {rank: its recorded failure}) (Note [A lost
        rank]); (None, {}) when the store cannot be reached."""
        self.probing = True
        try:
            store = self.store()
            store.set(f"{self._prefix}alive/{self.rank}", "1")
            deadline = time.monotonic() + LOST_WAIT
            waiting = []
            for r in range(self.world):  # the store's own wait, each bounded by what is left of LOST_WAIT
                if r == self.rank:
                    continue
                left = max(0.0, deadline - time.monotonic())
                try:
                    store.wait([f"{self._prefix}alive/{r}"], datetime.timedelta(seconds=left))
                except Exception:  # noqa: BLE001 (timed out: rank r did not answer)
                    if not store.check([f"{self._prefix}alive/{r}"]):
                        waiting.append(r)
            failed = {}
            for r in waiting:
                if store.check([f"{self._prefix}failed/{r}"]):
                    failed[r] = store.get(f"{self._prefix}failed/{r}").decode(errors="replace")
            return waiting, failed
        except Exception:  # noqa: BLE001 (the store's host is gone)
            return None, {}

    def describe_loss(self, where: str, cause: str) -> str:
        """The error naming the lost ranks (`where`: "at step 3", "while writing checkpoint-4")."""
        lost, failed = self.lost()
        if lost is None:
            return (f"rank {self.rank} of {self.world}: {cause} {where}, and the rendezvous store "
                    f"({os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}) cannot be reached to tell which rank "
                    "was lost")
        if not lost:
            return f"rank {self.rank} of {self.world}: {cause} {where}; every rank answered (none was lost)"
        names = ", ".join(str(r) for r in lost)
        quoted = "".join(f"; rank {r} failed: {m}" for r, m in failed.items())
        return (f"rank{'s' if len(lost) > 1 else ''} {names} of {self.world} {'were' if len(lost) > 1 else 'was'} "
                f"lost {where} (no answer within {LOST_WAIT:g} s after {cause} on rank {self.rank}: killed, or its "
                f"host unreachable){quoted}")


def kill_hook(ranks: Optional[Ranks], step: int, where: str) -> None:
    """The test hook of Note [A lost rank]: SIGKILL this process at (rank, step, where) when the environment asks."""
    spec = os.environ.get(KILL_HOOK)
    if not spec or ranks is None:
        return
    rank, at, place = spec.split(":")
    if int(rank) == ranks.rank and int(at) == step and place == where:
        print(f"test hook: rank {ranks.rank} SIGKILL at step {step} ({where}) at {time.time():.3f}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
