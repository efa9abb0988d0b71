"""Benchmark attnbook.kernels.flash_attention (chapter 15) against PyTorch's attention.

Providers, each timed for the forward pass ("fwd") and forward plus backward ("fwd+bwd"):

- ours:           attnbook.kernels.flash_attention, the book's Triton kernels;
- sdpa-flash, sdpa-efficient, sdpa-math, sdpa-cudnn:
                  torch.nn.functional.scaled_dot_product_attention restricted to one backend with
                  torch.nn.attention.sdpa_kernel; a backend that refuses a setting is recorded
                  with status "unavailable";
- naive:          softmax(scale * Q K^T) V in PyTorch, with the attention matrix materialised.

    python benchmarks/flash_attention.py            # GPU: float16 and bfloat16, D = 64, 128,
                                                    # N = 512 .. 16384
    python benchmarks/flash_attention.py --small    # CPU, Triton's interpreter, tiny sizes (CI)
    python benchmarks/flash_attention.py --roofline # the bound of this GPU for the same sizes

Writes OUT/flash_attention.csv and OUT/flash_attention.png (OUT defaults to benchmarks/results),
or, with --roofline, OUT/roofline.csv: for each size, the time below which no kernel that moves
chapter 15's bytes and does its FLOPs can run on this GPU (attnbook.tiling's roofline_seconds,
with attention_bytes and schedule_flops for our launcher's tiles, and for tiles as long as the
sequence: every input read once), and the TFLOP/s that time means in this benchmark's count.
Naive attention and SDPA's math backend, which hold the N x N matrix, are skipped ("skipped")
where it would not fit in the GPU's free memory. A dtype that our kernels refuse on this GPU
(bfloat16 below compute capability 8.0: a T4, a V100) is skipped for every provider, with one
row (provider "ours", status "unsupported", the sizes left blank) naming it. Rows are written
as they are measured to OUT/flash_attention.csv.partial, which replaces flash_attention.csv when
the run completes: an interrupted run keeps the earlier results and the rows it measured.

FLOPs: the forward pass does two matrix products, Q K^T and P V, 4 * B * H * Lq * Lk * D
floating-point operations, half of them under a causal mask; the backward pass does five (S
recomputed, dV, dP, dQ, dK), counted as 2.5 times the forward, so fwd+bwd = 3.5 x forward.
Timings on a GPU use triton.testing.do_bench; peak memory is torch.cuda.max_memory_allocated
during one call, minus what was allocated before it (inputs included in neither).
Batch and heads follow the FlashAttention papers: B * N = 16384 tokens and H * D = 2048.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

COLUMNS = ["provider", "mode", "dtype", "device", "batch", "heads", "seqlen", "head_dim",
           "causal", "ms", "tflops", "peak_mem_mb", "status"]
MODES = ("fwd", "fwd+bwd")
SIZES = ("batch", "heads", "seqlen", "head_dim", "causal")  # the columns that set one point
MATERIALISE = ("naive", "sdpa-math")  # providers that hold the N x N matrix of scores
SDPA_BACKENDS = {  # provider name -> name of the torch.nn.attention.SDPBackend member
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}


def flops(batch: int, heads: int, n: int, head_dim: int, causal: bool, mode: str) -> float:
    forward = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    return forward * (3.5 if mode == "fwd+bwd" else 1.0)


def naive_attention(q, k, v, causal: bool):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def sdpa_provider(backend_name: str):
    """F.scaled_dot_product_attention restricted to one backend, or None if torch lacks it."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3
        return None
    backend = getattr(SDPBackend, backend_name, None)
    if backend is None:
        return None

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def providers() -> dict:
    from attnbook.kernels import flash_attention

    found = {"ours": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)}
    for name, backend_name in SDPA_BACKENDS.items():
        found[name] = sdpa_provider(backend_name)
    found["naive"] = naive_attention
    return found


def step(fn, q, k, v, do, causal: bool, mode: str):
    """One call to time: the forward pass, or the forward and the gradients of q, k and v."""
    def forward():
        with torch.no_grad():
            return fn(q, k, v, causal)

    def forward_backward():
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)

    return forward if mode == "fwd" else forward_backward


def time_ms(call, device: str, repeats: int) -> float:
    if device == "cuda":  # short warm-up and repeats (ms): the whole run must fit a GPU lease
        import triton.testing

        return float(triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def peak_memory_mb(call, device: str) -> float:
    if device != "cuda":
        return math.nan  # no allocator statistics on the CPU
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(fn, config: dict, mode: str, repeats: int) -> dict:
    b, h, n, d = config["batch"], config["heads"], config["seqlen"], config["head_dim"]
    device, dtype, causal = config["device"], config["dtype"], config["causal"]
    row = {"provider": config["provider"], "mode": mode, "ms": math.nan, "tflops": math.nan,
           "peak_mem_mb": math.nan, **{key: config[key] for key in SIZES},
           "dtype": str(dtype).replace("torch.", ""), "device": device}
    if fn is None:
        return {**row, "status": "unavailable"}
    if config["provider"] in MATERIALISE and device == "cuda":
        # scores, weights and (backward) their gradients: N x N numbers per (batch, head) each
        matrices = (2 if mode == "fwd" else 5) * b * h * n * n * dtype.itemsize
        if matrices > 0.8 * torch.cuda.mem_get_info()[0]:
            return {**row, "status": "skipped"}
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn(b, h, n, d, device=device, dtype=dtype)
    call = step(fn, q, k, v, do, causal, mode)
    try:
        with warnings.catch_warnings():  # SDPA warns about every backend it cannot use
            warnings.simplefilter("ignore")
            call()  # warm-up: compiles our kernels; raises if a backend refuses the setting
            ms = time_ms(call, device, repeats)
            peak = peak_memory_mb(call, device)
    except RuntimeError as error:
        oom = isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)
        status = "oom" if oom else "unavailable"
        if device == "cuda":
            torch.cuda.empty_cache()
        return {**row, "status": status}
    tflops = flops(b, h, n, d, causal, mode) / (ms * 1e-3) / 1e12
    return {**row, "ms": ms, "tflops": tflops, "peak_mem_mb": peak, "status": "ok"}


def check_ours(device: str, dtype: torch.dtype, head_dim: int, causal: bool) -> float:
    """Max |ours - PyTorch| on one small case, so that a broken kernel is never timed."""
    from attnbook.kernels import flash_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, head_dim, device=device, dtype=dtype) for _ in range(3))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    error = (flash_attention(q, k, v, causal=causal).float() - expected).abs().max().item()
    if error > {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]:
        raise SystemExit(f"ours differs from PyTorch by {error:.2g} (D={head_dim}, "
                         f"causal={causal}, {dtype}): not benchmarking a wrong kernel")
    return error


def configs(small: bool):
    if small:
        device, dtypes, dims, lengths = "cpu", (torch.float32,), (16,), (64, 128)
    else:
        device, dtypes, dims, lengths = "cuda", (torch.float16, torch.bfloat16), (64, 128), (
            512, 1024, 2048, 4096, 8192, 16384)
    for dtype in dtypes:
        for head_dim in dims:
            for causal in (False, True):
                for n in lengths:
                    batch = 1 if small else max(1, 16384 // n)
                    heads = 2 if small else 2048 // head_dim
                    yield {"device": device, "dtype": dtype, "head_dim": head_dim,
                           "causal": causal, "seqlen": n, "batch": batch, "heads": heads}


ROOFLINE_COLUMNS = ["gpu", "dtype", "batch", "heads", "seqlen", "head_dim", "causal", "mode",
                    "tiles", "block_q", "block_k", "flops", "bytes", "bound_ms", "bound_tflops"]


def roofline(small: bool) -> list[dict]:
    """The roofline bound (attnbook.tiling, chapter 14) of every size the benchmark measures, on
    this GPU (on a CPU, --small: the H100, as an illustration). "launcher": the bytes and FLOPs
    of chapter 15's kernels with the launcher's tiles on this GPU (the forward kernel's for the
    forward pass, the dK, dV kernel's for forward + backward); "inputs once": tiles as long as
    the sequence, so that every input is read once (no causal skip, so not under a mask)."""
    from attnbook import tiling
    from attnbook.kernels import launch_settings

    if small:
        name, capability = "H100", 90
    else:
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        capability = 10 * major + minor
    gpu = tiling.find_gpu(name)  # ValueError for a GPU without datasheet figures there
    rows = []
    for config in configs(small):
        b, h, n, d = (config[key] for key in ("batch", "heads", "seqlen", "head_dim"))
        causal, itemsize = config["causal"], config["dtype"].itemsize
        for mode in MODES:
            kernel = "forward" if mode == "fwd" else "dkdv"
            block_q, block_k, _, _ = launch_settings(kernel, itemsize, d, capability)[0]
            for tiles, (bq, bk) in [("launcher", (block_q, block_k)), ("inputs once", (n, n))]:
                if tiles == "inputs once" and causal:
                    continue
                shape = dict(causal=causal, backward=mode == "fwd+bwd", block_q=bq, block_k=bk)
                work = b * h * tiling.schedule_flops(n, n, d, **shape)
                moved = b * h * tiling.attention_bytes(n, n, d, itemsize=itemsize, **shape)
                seconds = tiling.roofline_seconds(work, moved, gpu, itemsize)
                rows.append({"gpu": gpu.name, "dtype": str(config["dtype"])[6:], "batch": b,
                             "heads": h, "seqlen": n, "head_dim": d, "causal": causal,
                             "mode": mode, "tiles": tiles, "block_q": bq, "block_k": bk,
                             "flops": work, "bytes": moved, "bound_ms": seconds * 1e3,
                             "bound_tflops": flops(b, h, n, d, causal, mode) / seconds / 1e12})
    return rows


def csv_fields(row: dict, columns: list[str]) -> dict:
    """A row as written: floats to 4 significant digits, NaN as an empty field."""
    return {key: (f"{row[key]:.4g}" if isinstance(row[key], float) and not math.isnan(row[key])
                  else "" if isinstance(row[key], float) else row[key]) for key in columns}


def write_csv(rows: list[dict], path: Path, columns: list[str] = COLUMNS) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(csv_fields(row, columns) for row in rows)


def plot(rows: list[dict], path: Path) -> bool:
    """TFLOP/s against N, a panel per pass, head size and mask. False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(len(MODES), max(1, len(panels)), figsize=(3.2 * len(panels), 5.5),
                             squeeze=False, sharex=True)
    for i, mode in enumerate(MODES):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            for provider in dict.fromkeys(r["provider"] for r in rows):
                points = [(r["seqlen"], r["tflops"]) for r in rows
                          if (r["provider"], r["mode"]) == (provider, mode) and r["status"] == "ok"
                          and (r["dtype"], r["head_dim"], r["causal"]) == panel]
                if points:
                    ax.plot(*zip(*points), "o-", label=provider, markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            dtype, head_dim, causal = panel
            ax.set_title(f"{dtype} {mode}, D={head_dim}{', causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("sequence length N")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="tiny float32 sizes on the CPU in Triton's interpreter (for CI)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="folder for flash_attention.csv and flash_attention.png")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per point on CPU")
    parser.add_argument("--roofline", action="store_true",
                        help="write the roofline bound of this GPU (roofline.csv) instead")
    args = parser.parse_args(argv)
    if args.roofline:
        if not (args.small or torch.cuda.is_available()):
            parser.error("the roofline of this machine's GPU needs a CUDA GPU; use --small")
        rows = roofline(args.small)
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, args.out / "roofline.csv", ROOFLINE_COLUMNS)
        for r in rows:
            if r["seqlen"] in (4096, 16384) or args.small:
                print(f"{r['gpu']} {r['dtype']} {r['mode']:>7} D={r['head_dim']:<3} "
                      f"N={r['seqlen']:<6} causal={r['causal']!s:<5} {r['tiles']:>11}: "
                      f"at most {r['bound_tflops']:7.1f} TFLOP/s ({r['bound_ms']:.3g} ms)")
        print(f"wrote {args.out / 'roofline.csv'}")
        return 0
    if args.small:  # must happen before attnbook.kernels (and so triton) is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        parser.error("the full benchmark needs a CUDA GPU; use --small on a CPU")

    found = providers()
    rows: list[dict] = []
    refused = set()  # the dtypes our kernels refuse on this GPU
    args.out.mkdir(parents=True, exist_ok=True)
    # rows go to a .partial file as measured, which replaces the finished CSV only at the end:
    # an interrupted rerun keeps both the earlier complete results and the rows it measured
    partial = args.out / "flash_attention.csv.partial"
    with partial.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for config in configs(args.small):
            if config["dtype"] in refused:
                continue
            if config["seqlen"] == min(c["seqlen"] for c in configs(args.small)):
                try:
                    error = check_ours(config["device"], config["dtype"], config["head_dim"],
                                       config["causal"])
                except TypeError as refusal:
                    if "flash_attention takes" not in str(refusal):
                        raise  # a bug, not _check_inputs' refusal of bfloat16 below 8.0
                    refused.add(config["dtype"])
                    # one row for every size of this dtype, so it names none of them
                    row = {**measure(None, {**config, "provider": "ours"}, "", args.repeats),
                           **dict.fromkeys(SIZES, ""), "status": "unsupported"}
                    writer.writerow(csv_fields(row, COLUMNS))
                    f.flush()
                    print(f"skipped {row['dtype']}: {refusal}", flush=True)
                    continue
                print(f"check: {config['dtype']} D={config['head_dim']} "
                      f"causal={config['causal']}: max |ours - SDPA| = {error:.1e}", flush=True)
            for name, fn in found.items():
                for mode in MODES:
                    row = measure(fn, {**config, "provider": name}, mode, args.repeats)
                    rows.append(row)
                    writer.writerow(csv_fields(row, COLUMNS))
                    f.flush()  # written as measured: a later error loses none of them
                    print(f"{name:>15} {mode:>7} D={row['head_dim']:<3} N={row['seqlen']:<6} "
                          f"causal={row['causal']!s:<5} {row['status']:>11} {row['tflops']:9.3g} "
                          f"TFLOP/s {row['peak_mem_mb']:9.1f} MB", flush=True)
    partial.replace(args.out / "flash_attention.csv")
    print(f"wrote {args.out / 'flash_attention.csv'}")
    if plot(rows, args.out / "flash_attention.png"):
        print(f"wrote {args.out / 'flash_attention.png'}")
    else:
        print("matplotlib is not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
