"""The fine-tuning command's run: arguments, checks before anything is written, the training loop, checkpoints and
resuming, the outputs (the package's docstring says what it does; ``_data`` how the data is packed).

Note [No partial output folder]
Everything that can be checked before training is checked before OUT_DIR is created: the arguments, the model folder
(its config, its tokenizer, that it has MoE layers StrideWeave binds, that the budget holds what a step needs of one
expert), the data file (every line) and that OUT_DIR's parent is a folder. OUT_DIR is then created (it must not exist,
or be empty; with ``--resume`` it must hold a checkpoint). A checkpoint is written into a hidden temporary folder and
renamed to ``checkpoint-N`` once complete (its ``trainer_state.json`` written last), so a ``checkpoint-N`` is always
whole. When the run fails later (a full disk, an interruption), the OUT_DIR this run created is removed unless it
holds a complete checkpoint, which is kept so that ``--resume`` continues from it (the error says so). Under
torchrun the ranks agree on these checks before rank 0 creates OUT_DIR, and a checkpoint's hidden folder is renamed
only once every rank has written its part (Note [The command under torchrun] in ``_dist``).

Note [Resuming exactly]
A checkpoint holds everything the rest of the run depends on: the weights (``save_pretrained``: the experts from
their tiles, the rest from the model), the optimizer's state (the experts' moments streamed to files, the others'
with torch), the scheduler's state, torch's and Python's random generators, the step and token counts and the loss
history. The data order is a function of the seed and the step (Note [Packing]). ``--resume`` opens the model from
the checkpoint's weights and restores the rest, so steps N+1.. compute exactly what the uninterrupted run computes
(tests/test_finetune_command.py checks bit-identity). The options that change the result must be the same as the
interrupted run's (checked: a different value is refused, naming it); the budget, ``--save-every`` and the progress
display may differ. Checkpoints of later steps left by the interrupted run are removed when the resumed run starts.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import random
import shutil
import sys
import time
from typing import Any

from ._data import CommandError, Packing, format_bytes, parse_size, read_records, tokenize
from ._dist import Ranks, Stopped, is_collective_failure, kill_hook, world_size_from_environment

PROG = "python -m strideweave.finetune"
DTYPES = ("auto", "float32", "bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16", "8bit")


def _state_dtype(name: str) -> Any:
    """The tiled engines' state_dtype for --state-dtype."""
    import strideweave as sw
    return {"float32": None, "bfloat16": sw.DType.BFloat16, "8bit": sw.optim.STATE_8BIT}[name]
STATE_JSON = "trainer_state.json"
STATE_PT = "trainer_state.pt"
OPTIMIZER_DIR = "optimizer"
# The options whose values the run's arithmetic depends on: a resumed run must have the same.
RESULT_OPTIONS = ("data_sha256", "lr", "weight_decay", "epochs", "max_steps", "batch_tokens", "seq_len",
                  "grad_accum", "warmup", "max_grad_norm", "dtype", "seed", "total_steps", "step_in_backward",
                  "state_dtype")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit status 2 (argparse's own prints the usage first)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Fine-tune a Hugging Face MoE model whose experts (with their gradients "
                "and AdamW moments) live in the checkpoint's tiles under a memory budget.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a transformers MoE checkpoint folder with its tokenizer")
    p.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help='one JSON object per line: {"text": ...} or {"messages": [{"role": ..., "content": ...}]}')
    p.add_argument("--output", required=True, metavar="OUT_DIR", help="where checkpoints, loss.csv, loss.png and "
                   "the fine-tuned model go (must not exist or be empty, unless --resume)")
    p.add_argument("--budget", required=True, metavar="SIZE", help="bytes of experts' weights, gradients and "
                   "AdamW moments held in memory at once, e.g. 512MiB, 4GB")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (unless --max-steps)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps in all (overrides --epochs)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per packed row (default: --batch-tokens, at most the model's context)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps, then linear decay to 0")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the total gradient norm (0: no clipping)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="step each expert inside backward, the moment its gradient is final (its gradient is never "
                   "written out; needs --max-grad-norm 0)")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="float32",
                   help="how the experts' AdamW moments are stored (bfloat16: half the bytes; 8bit: block-wise "
                   "8-bit, about a quarter)")
    p.add_argument("--save-every", type=int, default=500, help="write OUT_DIR/checkpoint-N every N steps (0: never)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from OUT_DIR's latest checkpoint (or the checkpoint folder given)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the non-expert weights' dtype (the experts are the checkpoint's)")
    p.add_argument("--seed", type=int, default=42, help="data order and torch's random generator")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a summary line only)")
    p.add_argument("--dist-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="under torchrun: how long a collective waits for the other ranks before failing (a rank "
                   "killed is noticed at once; this bounds a rank that hangs)")
    return p


def main(argv: Any = None) -> int:
    args = build_parser().parse_args(argv)
    run = _Run(args)
    try:
        run.run()
    except BaseException as e:  # noqa: BLE001 (each kind reported by _failed; anything else re-raised there)
        failure = e
        while True:
            try:
                return _failed(run, failure)
            except Stopped:  # SIGTERM before the report began (Note [A lost rank]): report the first failure
                continue
    if run.ranks is not None:
        run.ranks.close()
    return 0


def _failed(run: Any, e: BaseException) -> int:
    """Reports the failure `e` of `run` (one line on stderr) after the clean-up, and returns the exit status; a
    failure that is not the command's to report is re-raised."""
    if run.ranks is not None:
        run.ranks.probing = True  # a SIGTERM from here on is ignored (Note [A lost rank])
    if isinstance(e, CommandError):  # the same on every rank (agreed before anything is written): rank 0 says it
        run.cleanup()
        if run.rank == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        message = f"writing the output failed: {e.strerror or e}{where}"
        run.record_failure(message)
        run.cleanup()
        print(f"{PROG}: error: {run.on_rank()}{message}{run.kept()}", file=sys.stderr)
        return 2
    if isinstance(e, KeyboardInterrupt):
        run.cleanup()
        print(f"{PROG}: {run.on_rank()}interrupted at step {run.step}{run.kept()}", file=sys.stderr)
        return 130
    if run.ranks is not None and (isinstance(e, Stopped) or is_collective_failure(e)):
        # torchrun's agent stopping the group, or a collective failing: which rank was lost (Note [A lost rank])
        cause = "SIGTERM" if isinstance(e, Stopped) else "a collective failed"
        message = run.ranks.describe_loss(run.where, cause)
        run.cleanup()
        detail = "" if isinstance(e, Stopped) else \
            f"\n  (the collective's error: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
        print(f"{PROG}: error: {message}{run.kept()}{detail}", file=sys.stderr)
        return 1
    run.record_failure(f"{type(e).__name__}: {e}")
    run.cleanup()
    raise e


def _check_args(args: Any) -> None:
    def positive(name: str, value: Any, zero: bool = False) -> None:
        if value is not None and (value < 0 or (value == 0 and not zero)):
            raise CommandError(f"--{name} must be {'>= 0' if zero else '> 0'}, got {value}")
    positive("lr", args.lr)
    positive("weight-decay", args.weight_decay, zero=True)
    positive("epochs", args.epochs)
    positive("max-steps", args.max_steps)
    positive("batch-tokens", args.batch_tokens)
    positive("seq-len", args.seq_len)
    positive("grad-accum", args.grad_accum)
    positive("warmup", args.warmup, zero=True)
    positive("max-grad-norm", args.max_grad_norm, zero=True)
    positive("save-every", args.save_every, zero=True)
    if args.step_in_backward and args.max_grad_norm > 0:
        raise CommandError(f"--step-in-backward steps each expert before the other gradients exist, so it cannot "
                           f"clip by the total norm: give --max-grad-norm 0 (got {args.max_grad_norm})")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def complete_checkpoints(out: str) -> list:
    """[(step, folder)] of OUT_DIR's complete checkpoints, by step."""
    found = []
    if os.path.isdir(out):
        for name in os.listdir(out):
            if name.startswith("checkpoint-") and name[11:].isdigit() and \
                    os.path.isfile(os.path.join(out, name, STATE_JSON)):
                found.append((int(name[11:]), os.path.join(out, name)))
    return sorted(found)


class _Run:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.out = os.path.abspath(args.output)
        self.created = False
        self.step = 0
        self.where = "before the first step"  # what the run is doing, for a lost rank's error
        self.ranks: Any = None  # a _dist.Ranks under torchrun (Note [The command under torchrun])

    @property
    def rank(self) -> int:
        return 0 if self.ranks is None else self.ranks.rank

    def on_rank(self) -> str:
        return "" if self.ranks is None else f"rank {self.ranks.rank} of {self.ranks.world}: "

    def record_failure(self, message: str) -> None:
        if self.ranks is not None:
            self.ranks.record_failure(message)

    # ---- failure -----------------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Removes OUT_DIR when this run created it and it holds no complete checkpoint (Note [No partial output
        folder]); a checkpoint's temporary folder is removed either way. On several ranks, rank 0 does it."""
        if self.rank != 0 or not os.path.isdir(self.out):
            return
        self._remove_temporaries()
        if self.created and not complete_checkpoints(self.out):
            shutil.rmtree(self.out, ignore_errors=True)

    def kept(self) -> str:
        ckpts = complete_checkpoints(self.out)
        if self.created and not ckpts:
            return f"; {self.out} was removed"
        if ckpts:
            return f"; {ckpts[-1][1]} is kept: rerun with --resume to continue from step {ckpts[-1][0]}"
        return ""

    # ---- the run -----------------------------------------------------------------------------------------------

    def run(self) -> None:
        args = self.args
        _check_args(args)
        world = world_size_from_environment()
        if world > 1:
            if args.step_in_backward:
                raise CommandError("--step-in-backward cannot run on several ranks: each expert would be stepped in "
                                   "backward, before all_reduce_gradients averages the gradients over the ranks")
            if not args.dist_timeout > 0:
                raise CommandError(f"--dist-timeout must be > 0, got {args.dist_timeout}")
            self.ranks = Ranks(args.dist_timeout)
        ranks = self.ranks
        try:
            prepared = self._prepare()
            error = None
        except CommandError as e:
            if ranks is None:
                raise
            prepared, error = None, str(e)
        if ranks is not None:
            ranks.agree(error)  # every rank's checks passed, or every rank stops with the same error
        model, tokenizer, optimizer, scheduler, packing, budget, budget_bytes, total, resume_from, state = prepared

        import torch

        import strideweave.torch as swt
        history: list = []
        tokens = 0
        start = 0
        if state is not None:
            start, tokens, history = state["step"], state["tokens"], [tuple(r) for r in state["history"]]
            _load_optimizer(optimizer, resume_from)
            extra = torch.load(os.path.join(resume_from, STATE_PT), weights_only=False)
            scheduler.load_state_dict(extra["scheduler"])
            torch.set_rng_state(extra["torch_rng"])
            random.setstate(extra["python_rng"])
            if self.rank == 0:
                for step, folder in complete_checkpoints(self.out):
                    if step > start:
                        shutil.rmtree(folder)
                self._remove_temporaries()
        elif self.rank == 0:
            os.makedirs(self.out, exist_ok=True)
            self.created = not self.out_existed
        self.step = start
        if self.rank == 0:
            self._write_csv(history)
        if ranks is not None:
            ranks.barrier()  # rank 0 has written loss.csv: every rank must see it (one shared OUT_DIR)
            ranks.agree(None if os.path.isfile(os.path.join(self.out, "loss.csv")) else
                        f"{self.out} is not on a filesystem every rank shares (rank {ranks.rank} does not see the "
                        "loss.csv rank 0 wrote there): checkpoints are written by every rank into one folder")

        rows = packing.rows_per_batch
        share = slice(rows * ranks.rank // ranks.world, rows * (ranks.rank + 1) // ranks.world) if ranks else \
            slice(0, rows)
        progress = self._progress(total, start) if self.rank == 0 else None
        began, trained = time.perf_counter(), 0
        for step in range(start, total):
            self.where = f"at step {step + 1}"
            loss_sum = 0.0
            micro = list(packing.step(step))
            for m, batch in enumerate(micro):
                ids = torch.from_numpy(batch[share])
                out = model(input_ids=ids, labels=ids, use_cache=False)
                if m == 0:
                    kill_hook(ranks, step + 1, "forward")
                # With --step-in-backward the last micro-batch's backward steps the experts; the others accumulate.
                with optimizer.no_step() if m + 1 < len(micro) else contextlib.nullcontext():
                    (out.loss / args.grad_accum).backward()
                loss_sum += float(out.loss.detach())
                del out
            if ranks is not None:
                # Each rank's loss is the mean over its own tokens, as many on every rank (Note [The command under
                # torchrun]): the average of the ranks' gradients and losses is the one-process run's.
                swt.all_reduce_gradients(model)
                loss_sum = ranks.mean(loss_sum)
            loss = loss_sum / args.grad_accum
            if args.max_grad_norm > 0:
                swt.clip_grad_norm_(model, args.max_grad_norm)
            lr = float(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            tokens += packing.step_tokens
            trained += packing.step_tokens
            self.step = step + 1
            history.append((self.step, loss, lr, tokens))
            if self.rank == 0:
                self._append_csv(history[-1])
            stats = budget.stats()
            rate = trained / max(time.perf_counter() - began, 1e-9)
            if progress is not None:
                progress.set_postfix_str(f"loss {loss:.4f}, lr {lr:.2e}, {rate:,.0f} tok/s, resident "
                                         f"{format_bytes(stats['resident_bytes'])} of {format_bytes(budget_bytes)}",
                                         refresh=False)
                progress.update(1)
            if args.save_every and self.step % args.save_every == 0:
                self._save_checkpoint(model, optimizer, scheduler, history, tokens)
        if progress is not None:
            progress.close()
        if self.rank == 0:
            self._plot(history)
        self._save_final(model, tokenizer)
        stats = budget.stats()
        elapsed = time.perf_counter() - began
        first = f"{history[0][1]:.4f} -> " if history else ""
        if self.rank == 0:
            where = f" on {ranks.world} ranks (budget per rank)" if ranks else ""
            print(f"{PROG}: {total - start} steps, {trained} tokens in {elapsed:.1f} s "
                  f"({trained / max(elapsed, 1e-9):,.0f} tok/s){where}; loss {first}{history[-1][1]:.4f}; budget peak "
                  f"{format_bytes(stats['peak_bytes'])} of {format_bytes(budget_bytes)}; wrote "
                  f"{self.out}{self.plot_note}", file=sys.stderr)

    def _prepare(self) -> tuple:
        """Everything checked and opened before OUT_DIR is written (Note [No partial output folder]): (model,
        tokenizer, optimizer, scheduler, packing, budget, budget bytes, total steps, checkpoint to resume from,
        its state)."""
        args = self.args
        budget_bytes = parse_size(args.budget)
        model_dir = os.path.abspath(args.model_dir)
        if not os.path.isdir(model_dir):
            raise CommandError(f"model folder {args.model_dir!r} does not exist" if not os.path.exists(model_dir)
                               else f"model folder {args.model_dir!r} is not a folder")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise CommandError(f"model folder {args.model_dir!r} has no config.json (a folder as save_pretrained "
                               "writes it)")
        resume_from = self._check_output()
        records, digest = read_records(args.data)

        import torch
        import transformers

        import strideweave as sw
        import strideweave.torch as swt
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:  # transformers raises OSError, ValueError, ... for a folder without a tokenizer
            raise CommandError(f"model folder {args.model_dir!r} has no tokenizer transformers can open "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        sequences = tokenize(records, tokenizer, args.data)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        text_config = getattr(config, "text_config", None) or config
        context = getattr(text_config, "max_position_embeddings", None)
        seq_len = args.seq_len or (min(args.batch_tokens, context) if context else args.batch_tokens)
        if context and seq_len > context:
            raise CommandError(f"--seq-len {seq_len} is longer than the model's context ({context} tokens)")
        if args.batch_tokens % seq_len:
            raise CommandError(f"--batch-tokens {args.batch_tokens} is not a multiple of the row length {seq_len} "
                               "(--seq-len)")
        rows = args.batch_tokens // seq_len
        if self.ranks is not None and rows % self.ranks.world:
            raise CommandError(f"a micro-batch of {rows} rows (--batch-tokens {args.batch_tokens} / --seq-len "
                               f"{seq_len}) cannot be split evenly over {self.ranks.world} ranks: give a multiple of "
                               f"{self.ranks.world} rows")
        packing = Packing(sequences, seq_len, rows, args.grad_accum, args.seed)
        if packing.steps_per_epoch < 1:
            raise CommandError(f"the data holds {packing.total_tokens} tokens, fewer than one optimizer step takes "
                               f"({packing.step_tokens}: --batch-tokens x --grad-accum)")
        total = args.max_steps or args.epochs * packing.steps_per_epoch
        self.fingerprint = {"data_sha256": digest, "lr": args.lr, "weight_decay": args.weight_decay,
                            "epochs": args.epochs, "max_steps": args.max_steps, "batch_tokens": args.batch_tokens,
                            "seq_len": seq_len, "grad_accum": args.grad_accum, "warmup": args.warmup,
                            "max_grad_norm": args.max_grad_norm, "dtype": args.dtype, "seed": args.seed,
                            "total_steps": total, "step_in_backward": args.step_in_backward,
                            "state_dtype": args.state_dtype}
        state = self._read_state(resume_from) if resume_from else None

        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        budget = sw.ResidencyBudget(budget_bytes)
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        source = resume_from or model_dir
        bar = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # "Loading weights" is not this command's progress
        try:
            model = swt.from_pretrained(source, budget, torch_dtype=dtype,
                                        process_group=self.ranks.group if self.ranks is not None else None)
        except (TypeError, ValueError) as e:
            raise CommandError(f"model folder {args.model_dir!r}: {e}") from None
        finally:
            if bar:
                transformers.utils.logging.enable_progress_bar()
        bindings = swt.offloaded_experts(model)
        need, tile_need = min_budget(bindings.values())
        if budget_bytes < need:
            raise CommandError(f"--budget {args.budget} ({budget_bytes} bytes) cannot hold what training needs "
                               f"resident at once ({need} bytes): one expert's weight tiles, and one tile with its "
                               f"gradient and two Float32 AdamW moments ({tile_need} bytes)")
        model.train()
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False
        optimizer = swt.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                              state_dtype=_state_dtype(args.state_dtype), step_in_backward=args.step_in_backward)
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup, total)
        return model, tokenizer, optimizer, scheduler, packing, budget, budget_bytes, total, resume_from, state

    # ---- output folder and checkpoints -------------------------------------------------------------------------

    def _check_output(self) -> Any:
        """The checkpoint folder to resume from (None for a new run); CommandError when OUT_DIR is not usable."""
        args, out = self.args, self.out
        parent = os.path.dirname(out)
        if not os.path.isdir(parent):
            raise CommandError(f"the folder {parent!r} that would hold --output does not exist")
        self.out_existed = os.path.exists(out)
        if self.out_existed and not os.path.isdir(out):
            raise CommandError(f"--output {args.output!r} exists and is not a folder")
        if args.resume is None:
            if self.out_existed and os.listdir(out):
                raise CommandError(f"--output {args.output!r} is not empty (use --resume to continue a run there, "
                                   "or another folder)")
            if not os.access(parent if not self.out_existed else out, os.W_OK):
                raise CommandError(f"cannot write into {parent if not self.out_existed else out!r}")
            return None
        if args.resume == "latest":
            ckpts = complete_checkpoints(out)
            if not ckpts:
                raise CommandError(f"--resume: {args.output!r} holds no complete checkpoint-N folder")
            return ckpts[-1][1]
        folder = os.path.abspath(args.resume)
        if not os.path.isfile(os.path.join(folder, STATE_JSON)):
            raise CommandError(f"--resume: {args.resume!r} is not a complete checkpoint (no {STATE_JSON})")
        if os.path.dirname(folder) != out:
            raise CommandError(f"--resume: {args.resume!r} is not a checkpoint of --output {args.output!r}")
        return folder

    def _read_state(self, folder: str) -> dict:
        with open(os.path.join(folder, STATE_JSON)) as f:
            state = json.load(f)
        old = state["options"]
        changed = [k for k in RESULT_OPTIONS if old.get(k) != self.fingerprint[k]]
        if changed:
            what = ", ".join(f"{k} {old.get(k)!r} -> {self.fingerprint[k]!r}" for k in changed)
            raise CommandError(f"--resume: the run in {self.args.output!r} was started with other options or data "
                               f"({what}); resuming would not continue it")
        return state

    def _write_csv(self, history: list) -> None:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(("step", "loss", "lr", "tokens"))
        for row in history:
            w.writerow((row[0], repr(row[1]), repr(row[2]), row[3]))
        _write_file(os.path.join(self.out, "loss.csv"), buf.getvalue().encode())

    def _append_csv(self, row: tuple) -> None:
        with open(os.path.join(self.out, "loss.csv"), "a") as f:
            f.write(f"{row[0]},{row[1]!r},{row[2]!r},{row[3]}\n")

    def _save_checkpoint(self, model: Any, optimizer: Any, scheduler: Any, history: list, tokens: int) -> None:
        import torch

        import strideweave.torch as swt
        final = os.path.join(self.out, f"checkpoint-{self.step}")
        self.where = f"while writing checkpoint-{self.step}"
        tmp = os.path.join(self.out, f".checkpoint-{self.step}.tmp-{self._tag()}")
        # On several ranks every rank writes its part into the same hidden folder, and rank 0 renames it once all
        # of them are done (Note [The command under torchrun]).
        swt.save_pretrained(model, tmp)
        _save_optimizer(optimizer, tmp)
        kill_hook(self.ranks, self.step, "save")
        if self.rank == 0:
            buf = io.BytesIO()
            torch.save({"scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                        "python_rng": random.getstate()}, buf)
            _write_file(os.path.join(tmp, STATE_PT), buf.getvalue())
            state = {"step": self.step, "tokens": tokens, "options": self.fingerprint, "history": history,
                     "ranks": 1 if self.ranks is None else self.ranks.world}
            _write_file(os.path.join(tmp, STATE_JSON), json.dumps(state, indent=1).encode())
            _fsync_dir(tmp)
        if self.ranks is not None:
            self.ranks.barrier()  # every rank's part is written
        if self.rank == 0:
            if os.path.exists(final):  # left by an earlier attempt at this step
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.out)
        if self.ranks is not None:
            self.ranks.barrier()

    def _tag(self) -> int:
        """The temporary folders' suffix: this process's id, or rank 0's on several ranks (the same folder)."""
        return os.getpid() if self.ranks is None else self.ranks.run_id

    def _remove_temporaries(self) -> None:
        """Hidden temporary folders a run stopped while writing left in OUT_DIR (never a checkpoint-N)."""
        for name in os.listdir(self.out):
            if name.startswith(".") and ".tmp-" in name:
                shutil.rmtree(os.path.join(self.out, name), ignore_errors=True)

    def _save_final(self, model: Any, tokenizer: Any) -> None:
        """The model (save_pretrained) and the tokenizer, written into a temporary folder and moved into OUT_DIR
        file by file (OUT_DIR keeps its checkpoints and loss files)."""
        import strideweave.torch as swt
        tmp = os.path.join(self.out, f".model.tmp-{self._tag()}")
        self.where = "while writing the final model"
        swt.save_pretrained(model, tmp)  # collective on several ranks
        if self.ranks is not None:
            self.ranks.barrier()
        if self.rank == 0:
            tokenizer.save_pretrained(tmp)
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(self.out, name))
            os.rmdir(tmp)
            _fsync_dir(self.out)
        if self.ranks is not None:
            self.ranks.barrier()

    def _plot(self, history: list) -> None:
        from ._plot import plot_loss
        drawn = plot_loss(os.path.join(self.out, "loss.png"), [r[0] for r in history], [r[1] for r in history])
        self.plot_note = "" if drawn == "matplotlib" else " (loss.png without labels: matplotlib is not installed)"

    def _progress(self, total: int, start: int) -> Any:
        if self.args.no_progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=total, initial=start, file=sys.stderr, unit="step", desc="fine-tuning", dynamic_ncols=True)


def _save_optimizer(optimizer: Any, folder: str) -> None:
    """The optimizer's state into `folder`/optimizer (torch's state dict; the experts' moments and step counts
    streamed to files by ``save_state``, never gathered into RAM)."""
    optimizer.save_state(os.path.join(folder, OPTIMIZER_DIR))


def _load_optimizer(optimizer: Any, folder: str) -> None:
    optimizer.load_state(os.path.join(folder, OPTIMIZER_DIR))


def min_budget(bindings: Any) -> tuple:
    """(the least budget training can run under, the optimizer step's part of it) in bytes: the forward and the
    backward of an expert hold its weight tiles resident (``from_pretrained`` refuses less), and the optimizer step
    of a tile holds the tile, its gradient (the weights' dtype) and its two Float32 moments
    (``strideweave.optim`` refuses less at the step)."""
    need, tile_need = 0, 0
    for b in bindings:
        size = b.spec.dtype.itemsize
        for shape in b.tile_shapes.values():
            elements = 1
            for n in shape:
                elements *= int(n)
            tile_need = max(tile_need, elements * (2 * size + 8))
        need = max(need, b.expert_bytes)
    return max(need, tile_need), tile_need


def param_groups(model: Any, weight_decay: float) -> list:
    """The optimizer's two groups: weight decay for the matrices (every parameter of 2 or more dimensions, and
    every bound experts module's tiles), none for vectors (norms' weights, biases), as is usual for transformers."""
    import strideweave.torch as swt
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2] + list(swt.offloaded_experts(model).values())
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
