"""The book's models against Hugging Face transformers' on the CPU, one thread (issue 26).

Each row times the same work on both sides, with the same sizes, interleaved (ours, theirs,
ours, ...) by attnbook.notebook.median_seconds, whose clock is the thread's CPU time, which
other programs on a busy machine do not inflate; the median of 15 is kept:

- gpt-train-step:  GPT (chapter 10) vs GPT2LMHeadModel: forward, cross-entropy, backward and an
                   AdamW step, batch 8, length 256, width 256, 4 layers, 4 heads;
- gpt-generate:    greedy generation of 128 tokens after a 16-token prompt with the KV cache,
                   GPT.generate(temperature=0) vs GPT2LMHeadModel.generate(do_sample=False);
- bert-forward:    BERT.encode (chapter 8) vs BertModel (no pooler), batch 8, length 256,
                   width 256, 4 layers, 4 heads, with a padding mask, under no_grad;
- mha-fwd-bwd:     MultiHeadAttention (chapter 3) vs torch.nn.MultiheadAttention, forward and
                   backward, batch 8, length 256, width 512, 8 heads.

Dropout is 0 on both sides, and both sides attend with scaled_dot_product_attention (ours by
its default backend, transformers' by attn_implementation="sdpa"). The ratio is ours / theirs.

    python benchmarks/models_vs_transformers.py                   # writes the CSV below
    python benchmarks/models_vs_transformers.py --repeats 3 --quick  # smaller sizes, a smoke test

Writes OUT/models_vs_transformers.csv (OUT defaults to benchmarks/results/cpu) and, next to it,
models_vs_transformers.txt with the command line and the versions.
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from attnbook.bert import BERT, BERTConfig
from attnbook.gpt import GPT, GPTConfig
from attnbook.layers import MultiHeadAttention, from_torch
from attnbook.notebook import median_seconds

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 4096


def gpt_pair(batch, length, width, layers, heads):
    ours = GPT(GPTConfig(vocab_size=VOCAB, context_length=1024, d_model=width,
                         num_layers=layers, num_heads=heads, dropout=0.0))
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=1024, n_embd=width, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa"))
    return ours, theirs


def gpt_train_step(quick):
    b, t, w, layers, heads = (2, 64, 64, 2, 2) if quick else (8, 256, 256, 4, 4)
    ours, theirs = gpt_pair(b, t, w, layers, heads)
    ids = torch.randint(VOCAB, (b, t + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (ours, theirs)]

    def step(model, optimizer, logits_of):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits_of(model).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()

    return (lambda: step(ours, optimizers[0], lambda m: m(x)),
            lambda: step(theirs, optimizers[1], lambda m: m(x).logits))


def gpt_generate(quick):
    prompt_len, new = (8, 16) if quick else (16, 128)
    ours, theirs = gpt_pair(1, prompt_len, 64 if quick else 256, 2 if quick else 4, 4)
    ours.eval(), theirs.eval()
    prompt = torch.randint(VOCAB, (1, prompt_len))
    theirs.generation_config.pad_token_id = 0

    def run_theirs():
        with torch.no_grad():
            return theirs.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, use_cache=True)

    assert ours.generate(prompt, new, temperature=0.0).shape == run_theirs().shape  # same work
    return (lambda: ours.generate(prompt, new, temperature=0.0), run_theirs)


def bert_forward(quick):
    b, t, w, layers, heads = (2, 64, 64, 2, 2) if quick else (8, 256, 256, 4, 4)
    ours = BERT(BERTConfig(vocab_size=VOCAB, d_model=w, num_layers=layers, num_heads=heads,
                           d_ff=4 * w, context_length=512, dropout=0.0)).eval()
    theirs = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=w, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * w, max_position_embeddings=512, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa"),
        add_pooling_layer=False).eval()
    ids = torch.randint(1, VOCAB, (b, t))
    keep = torch.ones(b, t, dtype=torch.long)
    keep[: b // 2, t // 2:] = 0  # half the batch padded to half its length

    def run(fn):
        with torch.no_grad():
            return fn()

    return (lambda: run(lambda: ours.encode(ids, attention_mask=keep)),
            lambda: run(lambda: theirs(input_ids=ids, attention_mask=keep).last_hidden_state))


def mha_fwd_bwd(quick):
    b, t, w, heads = (2, 64, 64, 2) if quick else (8, 256, 512, 8)
    theirs = nn.MultiheadAttention(w, heads, batch_first=True)
    ours = from_torch(theirs)
    assert isinstance(ours, MultiHeadAttention)
    x = torch.randn(b, t, w, requires_grad=True)

    def run_ours():
        ours(x).sum().backward()

    def run_theirs():
        theirs(x, x, x, need_weights=False)[0].sum().backward()

    return run_ours, run_theirs


WORK = {"gpt-train-step": gpt_train_step, "gpt-generate": gpt_generate,
        "bert-forward": bert_forward, "mha-fwd-bwd": mha_fwd_bwd}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--only", choices=sorted(WORK), action="append")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name in args.only or WORK:
        ours, theirs = WORK[name](args.quick)
        t_ours, t_theirs = median_seconds(ours, theirs, repeats=args.repeats,
                                         batch_seconds=1e-9)  # one call per reading
        rows.append({"work": name, "ours_ms": round(1e3 * t_ours, 2),
                     "transformers_ms": round(1e3 * t_theirs, 2),
                     "ratio": round(t_ours / t_theirs, 3)})
        print(f"{name:>15}: ours {1e3 * t_ours:8.1f} ms, theirs {1e3 * t_theirs:8.1f} ms, "
              f"ratio {t_ours / t_theirs:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "models_vs_transformers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "models_vs_transformers.txt").write_text(
        f"command: python {' '.join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {platform.machine()}, threads 1, repeats {args.repeats}, "
        "clock: thread CPU time (attnbook.notebook.median_seconds)\n")


if __name__ == "__main__":
    main()
