"""The fine-tuning command's data: sizes, the JSON-lines file, tokenization and packing (no torch here).

Packing (Note [Packing]): each record becomes one token sequence (a ``text`` record: the tokenizer's encoding with
its own special tokens, as ``tokenizer(text)`` gives it; a ``messages`` record: the chat template applied to the
conversation, then encoded without adding special tokens again), followed by the tokenizer's end-of-sequence token
unless it already ends with it. For epoch ``k`` the records are put in the order of a permutation drawn from
``numpy.random.default_rng([seed, k])`` and their sequences concatenated into one stream, which is cut into rows of
``seq_len`` tokens; the tail shorter than a row is dropped. A micro-batch is ``batch_tokens // seq_len`` consecutive
rows, an optimizer step ``grad_accum`` consecutive micro-batches, and the rows left over at the end of an epoch
(fewer than a step's) are dropped. Every row is full, so every micro-batch predicts the same number of tokens and
the mean of the micro-batches' mean losses is the mean loss of the step's whole batch. A document may span two rows
(or two steps): attention is not masked at the end-of-sequence token (the usual packing of causal language-model
pre-training). The order is a function of the seed, the epoch and the records only: step ``s`` reads epoch
``s // steps_per_epoch``, so a resumed run needs nothing but the step count to continue where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import numpy as np


class CommandError(Exception):
    """A bad input, reported as one line (exit status 2)."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "--budget") -> int:
    """A byte count from "1073741824", "64MB" (10**6), "64MiB" (2**20), "1.5GB", ... (case-insensitive).
    CommandError for anything else or a size below 1 byte."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise CommandError(f"{what} {text!r} is not a size (a byte count, or a number with a unit: kB, MB, GB, TB, "
                           "KiB, MiB, GiB, TiB)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise CommandError(f"{what} {text!r} is below 1 byte")
    return size


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def read_records(path: str) -> tuple[list, str]:
    """([(line number, record)], sha256 of the file's bytes). Each non-blank line is a JSON object with a string
    ``text`` or a list ``messages`` of {"role": str, "content": str} (other keys ignored). CommandError naming the
    line for anything else, and for a file without a record."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CommandError(f"data file {path!r} does not exist") from None
    except IsADirectoryError:
        raise CommandError(f"data file {path!r} is a folder, not a JSON-lines file") from None
    except OSError as e:
        raise CommandError(f"data file {path!r} cannot be read: {e.strerror}") from None
    digest = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise CommandError(f"{path}:{line}: not UTF-8 text") from None
    records = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CommandError(f"{path}:{number}: not a JSON object ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise CommandError(f"{path}:{number}: a JSON {type(record).__name__}, not an object with \"text\" or "
                               "\"messages\"")
        has_text, has_messages = "text" in record, "messages" in record
        if has_text == has_messages:
            raise CommandError(f"{path}:{number}: an object needs exactly one of \"text\" and \"messages\", it has "
                               f"{'both' if has_text else 'neither'}")
        if has_text and not isinstance(record["text"], str):
            raise CommandError(f"{path}:{number}: \"text\" is a {type(record['text']).__name__}, not a string")
        if has_messages:
            msgs = record["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise CommandError(f"{path}:{number}: \"messages\" must be a non-empty list of objects with string "
                                   "\"role\" and \"content\"")
        records.append((number, record))
    if not records:
        raise CommandError(f"data file {path!r} has no records (one JSON object per line: {{\"text\": ...}} or "
                           "{\"messages\": [...]})")
    return records, digest


def tokenize(records: list, tokenizer: Any, path: str) -> list:
    """One list of token ids per record (Note [Packing]), each ending with the end-of-sequence token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise CommandError("the model folder's tokenizer has no end-of-sequence token (eos_token) to separate "
                           "packed records")
    template = getattr(tokenizer, "chat_template", None)
    out = []
    for number, record in records:
        if "text" in record:
            ids = list(tokenizer(record["text"])["input_ids"])
        else:
            if not template:
                raise CommandError(f"{path}:{number}: a \"messages\" record, but the model folder's tokenizer has "
                                   "no chat template")
            try:
                chat = tokenizer.apply_chat_template(record["messages"], tokenize=False)
            except Exception as e:  # the template's own error (a jinja2 exception, raise_exception)
                raise CommandError(f"{path}:{number}: the chat template refused the messages: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            ids = list(tokenizer(chat, add_special_tokens=False)["input_ids"])
        if not ids or ids[-1] != eos:
            ids.append(eos)
        out.append(ids)
    return out


class Packing:
    """The rows of every step (Note [Packing])."""

    def __init__(self, sequences: list, seq_len: int, rows_per_batch: int, grad_accum: int, seed: int) -> None:
        self.sequences = [np.asarray(s, dtype=np.int64) for s in sequences]
        self.seq_len, self.rows_per_batch, self.grad_accum, self.seed = seq_len, rows_per_batch, grad_accum, seed
        self.total_tokens = int(sum(len(s) for s in self.sequences))
        self.rows_per_epoch = self.total_tokens // seq_len
        self.steps_per_epoch = self.rows_per_epoch // (rows_per_batch * grad_accum)
        self._epoch: Any = None

    @property
    def step_tokens(self) -> int:
        return self.seq_len * self.rows_per_batch * self.grad_accum

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))

    def rows(self, epoch: int) -> np.ndarray:
        """(rows_per_epoch, seq_len) int64 rows of `epoch`."""
        if self._epoch is None or self._epoch[0] != epoch:
            stream = np.concatenate([self.sequences[i] for i in self.order(epoch)])
            n = self.rows_per_epoch * self.seq_len
            self._epoch = (epoch, stream[:n].reshape(self.rows_per_epoch, self.seq_len))
        return self._epoch[1]

    def step(self, step: int) -> list:
        """The micro-batches of optimizer step `step` (0-based): grad_accum arrays of (rows_per_batch, seq_len)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        rows = self.rows(epoch)
        first = i * self.rows_per_batch * self.grad_accum
        return [rows[first + j * self.rows_per_batch:first + (j + 1) * self.rows_per_batch]
                for j in range(self.grad_accum)]
