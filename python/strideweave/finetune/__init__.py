"""The fine-tuning command: ``python -m strideweave.finetune MODEL_DIR --data FILE.jsonl --output OUT_DIR --budget
SIZE`` (docs/guide.md, "The fine-tuning command").

MODEL_DIR is a transformers MoE checkpoint folder with its tokenizer (what ``save_pretrained`` of a model and of its
tokenizer write). The command opens it with ``strideweave.torch.from_pretrained`` (the experts bound to the
checkpoint's tiles, never loaded whole), reads FILE.jsonl (one ``{"text": ...}`` or ``{"messages": [...]}`` object
per line; messages go through the tokenizer's chat template), tokenizes and packs it (``_data``, Note [Packing]),
and trains every parameter with ``strideweave.torch.AdamW``, ``transformers.get_linear_schedule_with_warmup``,
``strideweave.torch.clip_grad_norm_`` and gradient accumulation. OUT_DIR receives ``loss.csv`` (step, loss, lr,
tokens), ``loss.png``, ``checkpoint-N`` folders every ``--save-every`` steps (resumable with ``--resume``) and, at
the end, the fine-tuned model as a complete Hugging Face checkpoint (``strideweave.torch.save_pretrained``) with the
tokenizer beside it: ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` opens it.

What the budget covers: the resident tiles of the experts' weights, of their gradients and of the AdamW moments of
the experts (one ``strideweave.ResidencyBudget``; the rest lives in the checkpoint, in scratch files beside it, and
in the page cache). Outside it, in RAM as in any PyTorch run: the non-expert weights, their gradients and moments,
the activations of a micro-batch, and the fixed cost of torch and transformers.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the same command runs on every rank: the experts sharded across the ranks,
each micro-batch's rows split over them, the one-process run's steps (``_dist``, Note [The command under torchrun]);
a rank lost mid-run stops the others with an error naming it (Note [A lost rank]).

Importing this package imports neither torch nor transformers; ``main`` imports them when it runs.
"""

from __future__ import annotations

from ._data import CommandError, Packing, parse_size, read_records, tokenize

__all__ = ["CommandError", "Packing", "main", "parse_size", "read_records", "tokenize"]


def main(argv: list | None = None) -> int:
    """Runs the command with `argv` (default ``sys.argv[1:]``); returns the exit status (0, 2 for bad input)."""
    from ._run import main as run
    return run(argv)
