"""The fine-tuning command end to end, checked against the same steps in RAM (what ``make demo`` runs first).

1. Builds a small Qwen3-MoE from its config with seeded random weights (Float32) and trains a byte-level BPE
   tokenizer with the ``tokenizers`` library on text that ships with the machine (the licence texts under
   /usr/share/common-licenses on Debian; Python's own standard-library sources where those are missing). Nothing
   is downloaded. Both are saved with ``save_pretrained`` (the tokenizer as a ``PreTrainedTokenizerFast``, with a
   chat template).
2. Writes a JSON-lines data file: paragraphs of that text as ``{"text": ...}`` records and a few ``{"messages":
   [...]}`` conversations (the chat template applies).
3. Runs ``python -m strideweave.finetune MODEL --data FILE --output OUT --budget SIZE`` in a child process, with a
   budget that the experts' weights, gradients and AdamW moments exceed ``--ratio`` times (8 by default, at least 5).
4. Replays the same steps in RAM: the untouched model opened by transformers, ``torch.optim.AdamW`` with the same
   two parameter groups, ``get_linear_schedule_with_warmup``, ``torch.nn.utils.clip_grad_norm_``, the same
   gradient accumulation over the same batches (``strideweave.finetune.Packing``: same data, same order).
5. Reloads OUT with ``transformers.AutoModelForCausalLM.from_pretrained`` and checks every weight and every step's
   loss against the replay within the bound derived below; prints PASS or FAIL (exit status 1).

Note [The bound of the check]
The two runs do the same Float32 arithmetic in different orders: the command's experts are computed by StrideWeave
(its SparseMoE, the experts' gradients accumulated into tiles) and everything else by the same torch code, so at
identical weights a step's gradients agree within the repository's Float32 parity bound, ``1e-5 max|g|`` per tensor
(tests/test_hf_families.py: sums of at most a few hundred products, each rounding at most 2^-24 of the sum of
|terms|, with margin). The weights then differ by the earlier steps' differences, which move the next gradient by a
further amount of the same order: ``dg = 2e-5 max|g|`` per tensor and micro-batch (the micro-batches' bounds add).
Clipping scales both gradients by ``c = min(1, max_norm / (|g| + 1e-6))``; the norms differ by at most
``|dg|_2`` (the triangle inequality), so ``|dc| <= c |dg|_2 / |g|`` while it clips, and the clipped gradient
differs by ``c dg + |dc| |g|`` per element. AdamW (torch's arithmetic, which the command's optimizer reproduces)
then moves these differences elementwise, tracked as bounds ``Dm``, ``Dv``, ``Dw`` from the replay's own ``m``,
``v``, ``g``:

    Dm' = b1 Dm + (1 - b1) Dg                     Dv' = b2 Dv + (1 - b2) (2 |g| Dg + Dg^2)
    den = sqrt(v') / sqrt(bc2) + eps              den_lo = sqrt(max(v' - Dv', 0)) / sqrt(bc2) + eps
    Dw' = Dw (1 - lr wd) + lr / bc1 (Dm' / den_lo + |m'| (1 / den_lo - 1 / den)) + 2^-22 (|w| + lr |m'| / den)

(|m1/d1 - m2/d2| <= |m1 - m2| / d2 + |m1| |1/d1 - 1/d2| with d2 in [den_lo, den_hi], 1/x convex; the last term,
the two runs' roundings of the update, 2 x 2 x 2^-24 of what the step adds, and of m and v below). Each step's loss
is compared within ``1e-5 |loss|`` (the forward's parity at identical weights) plus ``2 sum |g| Dw`` (first order
in the weights' differences, the replay's gradient, x 2 for the higher orders). The check reports how much of the
training movement the bound leaves undetected: it must be small for a PASS to mean anything (``--min-resolved``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

U = 2.0 ** -24  # Float32's unit roundoff
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="working folder (default: a temporary one, removed)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--moe-intermediate", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--ratio", type=float, default=8.0, help="experts + gradients + moments over the budget (>= 5)")
    p.add_argument("--save-every", type=int, default=None, help="the command's --save-every (default: steps / 2)")
    p.add_argument("--seed", type=int, default=0)
    # Measured at the defaults: 91% of the trained weights move more than 10x their bound (the rest are weights
    # whose gradient is small next to their tensor's largest, where AdamW's update, about lr whatever the
    # gradient, is sensitive to the gradient's rounding); 0.75 leaves room for other data and sizes.
    p.add_argument("--min-resolved", type=float, default=0.75,
                   help="fraction of the trained weights whose movement must exceed 10x the bound")
    return p.parse_args(argv)


def corpus() -> list:
    """Texts that ship with the machine: Debian's licence texts, else Python's standard-library sources."""
    files = sorted(f for f in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(f) and not os.path.islink(f))
    source = "/usr/share/common-licenses"
    if not files:
        import argparse as a, json as j, textwrap as t  # noqa: E401
        files, source = [a.__file__, j.__file__, t.__file__], "Python's standard library"
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    print(f"corpus: {len(files)} files from {source}, {sum(len(t) for t in texts):,} characters")
    return texts


def make_tokenizer(texts: list, vocab: int):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    t.chat_template = CHAT_TEMPLATE
    return t


def make_model(cfg):
    import torch
    import transformers
    config = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
        moe_intermediate_size=cfg.moe_intermediate, num_hidden_layers=cfg.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=cfg.hidden // 4, num_experts=cfg.experts, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=cfg.seq_len, initializer_range=0.1,
        tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = transformers.Qwen3MoeForCausalLM(config)
    return model.float()


def write_data(path: str, texts: list) -> int:
    paragraphs = [p.strip() for t in texts for p in t.split("\n\n") if len(p.strip()) > 40]
    n = 0
    with open(path, "w") as f:
        for i, p in enumerate(paragraphs[:400]):
            if i % 10 == 9:  # a conversation about the paragraph
                f.write(json.dumps({"messages": [{"role": "user", "content": "Quote a licence paragraph."},
                                                 {"role": "assistant", "content": p}]}) + "\n")
            else:
                f.write(json.dumps({"text": p}) + "\n")
            n += 1
    return n


def replay(cfg, model_dir: str, data: str):
    """The same steps in RAM with torch: (model, losses, bounds {name: Dw}, gradient-based loss bounds)."""
    import torch
    import transformers

    from strideweave.finetune import Packing, read_records, tokenize
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    packing = Packing(tokenize(read_records(data)[0], tokenizer, data), cfg.seq_len, cfg.batch_tokens // cfg.seq_len,
                      cfg.grad_accum, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    model.config.use_cache = False
    params = dict(model.named_parameters())
    decay = [n for n, p in params.items() if p.dim() >= 2]
    groups = [{"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in params.items() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, cfg.warmup, cfg.steps)
    wd_of = {n: (cfg.weight_decay if n in set(decay) else 0.0) for n in params}
    b1, b2 = opt.defaults["betas"]
    eps = opt.defaults["eps"]
    Dw = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    Dm = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    Dv = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    losses, loss_bounds = [], []
    for step in range(cfg.steps):
        dg = {n: torch.zeros((), dtype=torch.float64) for n in params}
        total = 0.0
        previous = {n: torch.zeros_like(p) for n, p in params.items()}
        for rows in packing.step(step):
            ids = torch.from_numpy(rows)
            out = model(input_ids=ids, labels=ids, use_cache=False)
            (out.loss / cfg.grad_accum).backward()
            total += float(out.loss.detach())
            for n, p in params.items():  # this micro-batch's part of the gradient, and its parity bound
                part = p.grad - previous[n]
                dg[n] += 2e-5 * float(part.abs().max())
                previous[n] = p.grad.clone()
        loss = total / cfg.grad_accum
        grads = {n: p.grad.double() for n, p in params.items()}
        # |dloss| <= 1e-5 |loss| + 2 sum |g| Dw (first order in the weights' differences, x 2)
        loss_bounds.append(1e-5 * abs(loss) + 2 * sum(float((grads[n].abs() * Dw[n]).sum()) for n in params))
        losses.append(loss)
        norm = float(torch.sqrt(sum((g * g).sum() for g in grads.values())))
        norm_err = float(np.sqrt(sum(float(dg[n]) ** 2 * params[n].numel() for n in params)))
        c = min(1.0, cfg.max_grad_norm / (norm + 1e-6)) if cfg.max_grad_norm > 0 else 1.0
        # Either run clips when its norm, within norm_err of this one, exceeds max_norm.
        clips = cfg.max_grad_norm > 0 and norm + norm_err >= cfg.max_grad_norm
        dc = c * norm_err / max(norm - norm_err, 1e-30) if clips else 0.0
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=False)
        lr = float(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        with torch.no_grad():
            for n, p in params.items():
                g = grads[n] * c
                Dg = c * dg[n] + dc * grads[n].abs()
                st = opt.state[p]
                t = float(st["step"])
                bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
                m, v = st["exp_avg"].double(), st["exp_avg_sq"].double()
                Dm[n] = b1 * Dm[n] + (1 - b1) * Dg + 4 * U * m.abs()
                Dv[n] = b2 * Dv[n] + (1 - b2) * (2 * g.abs() * Dg + Dg * Dg) + 4 * U * v
                den = v.sqrt() / bc2 ** 0.5 + eps
                den_lo = (v - Dv[n]).clamp(min=0).sqrt() / bc2 ** 0.5 + eps
                Dw[n] = Dw[n] * (1 - lr * wd_of[n]) + lr / bc1 * (Dm[n] / den_lo + m.abs() * (1 / den_lo - 1 / den)) \
                    + 4 * U * (p.detach().double().abs() + lr / bc1 * m.abs() / den)
        opt.zero_grad(set_to_none=True)
    return model, losses, loss_bounds, Dw


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.ratio < 5:
        raise SystemExit("--ratio must be >= 5")
    began = time.perf_counter()
    tmp = None
    if cfg.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="finetune-demo-")
        cfg.dir = tmp.name
    os.makedirs(cfg.dir, exist_ok=True)
    try:
        return run(cfg, began)
    finally:
        if tmp is not None:
            tmp.cleanup()


def run(cfg, began: float) -> int:
    import torch
    import transformers

    model_dir = os.path.join(cfg.dir, "model")
    data = os.path.join(cfg.dir, "data.jsonl")
    out_dir = os.path.join(cfg.dir, "out")
    texts = corpus()
    tokenizer = make_tokenizer(texts, cfg.vocab)
    model = make_model(cfg)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    records = write_data(data, texts)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model

    # One expert: gate and up (I, H), down (H, I), Float32. Training holds its weights, its gradient and two
    # Float32 moments: 4 x that per expert in all; the budget is 1/ratio of every expert's four.
    expert = 3 * cfg.moe_intermediate * cfg.hidden * 4
    everything = 4 * expert * cfg.experts * cfg.layers
    budget = int(everything / cfg.ratio)
    print(f"model: Qwen3-MoE, {cfg.layers} layers x {cfg.experts} experts of {expert:,} bytes; tokenizer: byte-level "
          f"BPE, {len(tokenizer)} tokens; data: {records} records")
    print(f"experts + gradients + moments: {everything:,} bytes = {everything / budget:.1f} x the budget "
          f"({budget:,} bytes)")
    cmd = [sys.executable, "-m", "strideweave.finetune", model_dir, "--data", data, "--output", out_dir,
           "--budget", str(budget), "--max-steps", str(cfg.steps), "--batch-tokens", str(cfg.batch_tokens),
           "--seq-len", str(cfg.seq_len), "--grad-accum", str(cfg.grad_accum), "--lr", repr(cfg.lr),
           "--weight-decay", repr(cfg.weight_decay), "--warmup", str(cfg.warmup),
           "--max-grad-norm", repr(cfg.max_grad_norm), "--save-every", str(cfg.save_every if cfg.save_every is not None else max(1, cfg.steps // 2)),
           "--seed", str(cfg.seed)]
    print("$ python -m strideweave.finetune " + " ".join(cmd[3:]), flush=True)
    started = time.perf_counter()
    code = subprocess.call(cmd)
    print(f"the command: exit status {code}, {time.perf_counter() - started:.1f} s")
    if code != 0:
        print("FAIL: the command failed")
        return 1

    reference, ref_losses, loss_bounds, Dw = replay(cfg, model_dir, data)
    with open(os.path.join(out_dir, "loss.csv")) as f:
        rows = [line.strip().split(",") for line in f.readlines()[1:]]
    cmd_losses = [float(r[1]) for r in rows]
    failures = []
    if len(cmd_losses) != cfg.steps:
        failures.append(f"loss.csv has {len(cmd_losses)} steps, expected {cfg.steps}")
    for s, (a, b, bound) in enumerate(zip(cmd_losses, ref_losses, loss_bounds)):
        if not abs(a - b) <= bound:
            failures.append(f"step {s + 1}: loss {a!r} vs {b!r} in RAM, |difference| {abs(a - b):.3e} > {bound:.3e}")
    worst_loss = max((abs(a - b) / bd for a, b, bd in zip(cmd_losses, ref_losses, loss_bounds)), default=0.0)

    trained = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    got = dict(trained.named_parameters())
    ref = dict(reference.named_parameters())
    if sorted(got) != sorted(ref):
        failures.append(f"the output's parameters differ from the model's: {sorted(set(got) ^ set(ref))[:5]}")
    worst, resolved, moved_elems = 0.0, 0, 0
    for n in sorted(set(got) & set(ref)):
        err = (got[n].detach().double() - ref[n].detach().double()).abs()
        bound = Dw[n]
        over = err > bound
        if bool(over.any()):
            i = int((err - bound).argmax())
            failures.append(f"{n}: |command - RAM| {float(err.flatten()[i]):.3e} > bound {float(bound.flatten()[i]):.3e}"
                            f" at element {i}")
        worst = max(worst, float((err / bound.clamp(min=1e-300)).max()))
        moved = (ref[n].detach().double() - original[n].double()).abs()
        resolved += int((moved > 10 * bound).sum())
        moved_elems += int((moved > 0).sum())
    fraction = resolved / max(moved_elems, 1)
    experts_names = [n for n in ref if ".experts." in n]
    experts_moved = all(not torch.equal(got[n], original[n]) for n in experts_names)
    if not experts_names or not experts_moved:
        failures.append("the command left some experts' weights unchanged")
    if fraction < cfg.min_resolved:
        failures.append(f"the bound resolves only {fraction:.1%} of the trained weights (movement > 10x bound); "
                        "the check would not catch an error")
    print(f"losses: command {cmd_losses[0]:.4f} -> {cmd_losses[-1]:.4f}, in RAM {ref_losses[0]:.4f} -> "
          f"{ref_losses[-1]:.4f}; worst |difference| / bound: losses {worst_loss:.3f}, weights {worst:.3f}")
    print(f"{len(ref)} tensors compared ({len(experts_names)} of experts); {fraction:.1%} of the trained weights moved "
          "more than 10x their bound")
    print(f"elapsed {time.perf_counter() - began:.1f} s")
    for f in failures[:20]:
        print("  " + f)
    print("PASS" if not failures else f"FAIL ({len(failures)} problems)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
