"""What torch.compile does to a training step on the CPU, ours and transformers' (issue 44).

One plain training step (forward, cross-entropy, backward, an AdamW step: lr 1e-4, weight decay
0.01 on every parameter, no clipping, random token ids) of the book's GPT (chapter 10) and of
transformers' GPT2LMHeadModel at the same sizes; not the recipe's train_step that chapter 19
times, which clips and decays only the weight matrices, each run eager and compiled, all four
in one process on one thread. "Compiled" means the model under `torch.compile(model,
fullgraph=True)` (inductor; a graph break is an error, on both sides), as chapter 19 and nanoGPT
compile it: its forward pass and, through AOTAutograd, its backward pass are compiled; the loss
and AdamW's step run eager in all four. Dropout is 0 and both models attend with
scaled_dot_product_attention.

Before timing, each compiled step's first loss is checked against its eager twin's (same weights,
same batch), and the time of that first call, which compiles (the compile caches are off), is
recorded apart. Then the four steps are timed interleaved (eager ours, compiled ours, eager
theirs, compiled theirs, in turns) by attnbook.notebook.median_seconds, after its warm-up: the
median of `--repeats` readings of the thread's CPU time (which other programs on a busy machine
inflate less than the wall clock, though not at all is not guaranteed), and, as a check, of the
wall clock. The speed-up is eager / compiled by the CPU time; wall_speed_up is the same by the
wall clock, and a row where the two fall on opposite sides of 1 has a direction neither clock
settles.

    python benchmarks/compile_train_step.py              # the sizes below, 15 repeats (~20 min
                                                         # on a busy two-core machine)
    python benchmarks/compile_train_step.py --quick --repeats 3   # one tiny size, a smoke test

Sizes: "chapter" is chapter 19's model and batch (batch 16, length 64, width 64, 2 layers, 4
heads) with a vocabulary of 96 tokens (the chapter's character tokenizer has 103);
"medium" is models_vs_transformers.py's (batch 8, length 256, width 256, 4 layers, 4 heads, 4096
tokens). Writes OUT/compile_train_step.json (OUT defaults to benchmarks/results/cpu): the command,
the versions, and one record per size and model; prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from attnbook.gpt import GPT, GPTConfig
from attnbook.notebook import median_seconds

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # batch, length, width, layers, heads, vocabulary
    "chapter": (16, 64, 64, 2, 4, 96),
    "medium": (8, 256, 256, 4, 4, 4096),
    "tiny": (2, 16, 32, 1, 2, 64),  # --quick
}


def models(width: int, layers: int, heads: int, vocab: int, length: int):
    """Ours and transformers' GPT-2 of the same sizes, no dropout, both on SDPA."""
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=vocab, context_length=length, d_model=width,
                         num_layers=layers, num_heads=heads, dropout=0.0))
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa"))
    return {"ours": (ours, lambda m, x: m(x)),
            "transformers": (theirs, lambda m, x: m(x, use_cache=False).logits)}


def training_step(model, logits_of, x, y, compiled: bool):
    """One step, forward to AdamW; compiled: the model under torch.compile, fullgraph."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model, fullgraph=True) if compiled else model

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits_of(run, x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def measure(size: str, repeats: int) -> list[dict]:
    b, t, width, layers, heads, vocab = SIZES[size]
    torch._dynamo.reset()  # no compiled code, or its guards, left from the last size
    torch.manual_seed(1)
    ids = torch.randint(vocab, (b, t + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    steps, rows = {}, []
    for name in ("ours", "transformers"):
        for compiled in (False, True):  # each a fresh model from the same seed
            model, logits_of = models(width, layers, heads, vocab, t)[name]
            steps[name, compiled] = step = training_step(model, logits_of, x, y, compiled)
            start = time.perf_counter()
            loss = step()  # compiles, when compiled
            first = time.perf_counter() - start
            if not compiled:
                eager_loss = loss
            elif not torch.allclose(loss, eager_loss, rtol=1e-4, atol=1e-5):  # same weights, batch
                sys.exit(f"{size} {name}: compiled loss {loss.item()} != eager {eager_loss.item()}")
            rows.append({"size": size, "model": name, "mode": "compiled" if compiled else "eager",
                         "first_call_s": round(first, 2)})
    calls = list(steps.values())
    thread = median_seconds(*calls, repeats=repeats)
    wall = median_seconds(*calls, repeats=repeats, clock=time.perf_counter)
    for row, t_thread, t_wall in zip(rows, thread, wall, strict=True):
        row.update(ms=round(1e3 * t_thread, 3), wall_ms=round(1e3 * t_wall, 3))
    for row in rows:
        eager = next(r for r in rows if r["model"] == row["model"] and r["mode"] == "eager")
        row["speed_up"] = round(eager["ms"] / row["ms"], 3)
        row["wall_speed_up"] = round(eager["wall_ms"] / row["wall_ms"], 3)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="one tiny size: a smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # before compiling: inductor's kernels then use one thread
    torch.compiler.config.force_disable_caches = True  # first_call_s: a compile, not a cache hit
    rows = []
    print(f"{'size':>8} {'model':>13} {'mode':>9} {'step ms':>9} {'wall ms':>9} "
          f"{'speed-up':>9} {'first call s':>13}")
    for size in ("tiny",) if args.quick else ("chapter", "medium"):
        for row in measure(size, args.repeats):
            rows.append(row)
            print(f"{row['size']:>8} {row['model']:>13} {row['mode']:>9} {row['ms']:>9.2f} "
                  f"{row['wall_ms']:>9.2f} {row['speed_up']:>9.3f} {row['first_call_s']:>13.1f}",
                  flush=True)
    record = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "machine": platform.machine()},
        "threads": 1, "repeats": args.repeats,
        "sizes": {row["size"]: SIZES[row["size"]] for row in rows},
        "clock": "ms: median thread CPU time (attnbook.notebook.median_seconds); wall_ms: the "
                 "same with the wall clock; first_call_s: wall time of the first step (compiles); "
                 "speed_up, wall_speed_up: eager / this row by each clock",
        "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_train_step.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
