"""Chapter 17's efficient attention against PyTorch's attention on the CPU, one thread (issue 45).

Each row times one method and the attention it replaces at one length N, one head of 64, batch
1, float32, interleaved by attnbook.notebook.median_seconds (the thread's CPU time, which other
programs on a busy machine do not inflate), median of `--repeats`:

- linear-causal: linear_attention(causal=True) in chunks of 64 vs
                 F.scaled_dot_product_attention(is_causal=True);
- block-layout:  block_sparse_attention given the layout of a window of 256 (causal inside
                 its tiles) vs SDPA with the window's dense bool mask;
- block-mask:    block_sparse_attention given that dense mask (it finds the layout itself)
                 vs the same SDPA call; the column find_ms is tile_layout(mask) alone;
- favor-causal:  performer_attention(causal=True) with 256 features vs SDPA causal;
- retention:     retention(gamma=0.99, "chunkwise", chunks of 64) vs SDPA causal.

The ratio is method / reference: below 1, the method is faster.

    python benchmarks/efficient_attention.py                      # N = 512 ... 8192
    python benchmarks/efficient_attention.py --quick --repeats 1  # N = 256 and 512, a smoke test

Writes OUT/efficient_attention.csv (OUT defaults to benchmarks/results/cpu) and, next to it,
efficient_attention.txt with the command line and the versions.
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from attnbook.efficient import (
    block_sparse_attention,
    linear_attention,
    performer_attention,
    retention,
    sliding_window_mask,
    tile_layout,
)
from attnbook.notebook import median_seconds

ROOT = Path(__file__).resolve().parent.parent
D, BLOCK, WINDOW = 64, 64, 256


def _rows(n: int, repeats: int) -> list[dict]:
    """The five comparisons at length n."""
    q, k, v = (torch.randn(1, 1, n, D) for _ in range(3))
    mask = sliding_window_mask(n, n, WINDOW)
    layout = sliding_window_mask(-(-n // BLOCK), -(-n // BLOCK), WINDOW // BLOCK + 1)
    causal = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    dense = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
    work = {
        "linear-causal": (partial(linear_attention, q, k, v, causal=True), causal),
        "block-layout": (partial(block_sparse_attention, q, k, v, layout=layout,
                                 block_size=BLOCK, causal=True), dense),
        "block-mask": (partial(block_sparse_attention, q, k, v, mask, BLOCK), dense),
        "favor-causal": (partial(performer_attention, q, k, v, 256, True,
                                 torch.Generator().manual_seed(0)), causal),
        "retention": (partial(retention, q, k, v, 0.99, "chunkwise"), causal),
    }
    find_s = median_seconds(partial(tile_layout, mask, BLOCK), repeats=repeats)[0]
    rows = []
    for name, (method, reference) in work.items():
        t_method, t_reference = median_seconds(method, reference, repeats=repeats)
        rows.append({"work": name, "n": n, "method_ms": round(1e3 * t_method, 3),
                     "reference_ms": round(1e3 * t_reference, 3),
                     "ratio": round(t_method / t_reference, 3),
                     "find_ms": round(1e3 * find_s, 3) if name == "block-mask" else "",
                     "tiles": round(float(layout.float().mean()), 4)
                     if name.startswith("block") else ""})
        print(f"N = {n:>5} {name:>13}: {1e3 * t_method:9.2f} ms against {1e3 * t_reference:9.2f}"
              f" ms, ratio {t_method / t_reference:.3f}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lengths = [256, 512] if args.quick else [512, 1024, 2048, 4096, 8192]
    rows = [row for n in lengths for row in _rows(n, args.repeats)]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "efficient_attention.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "efficient_attention.txt").write_text(
        f"command: python {' '.join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"threads 1, repeats {args.repeats}, "
        "clock: thread CPU time (attnbook.notebook.median_seconds)\n")


if __name__ == "__main__":
    main()
