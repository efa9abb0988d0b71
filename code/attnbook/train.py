# Do not edit: tools/tangle.py generates this file from chapters/a2-training-at-scale.md.
"""Training the book's GPT on one or many processes: torch.distributed's DDP and FSDP2, launched by
torchrun, with distributed checkpoints.

Built and explained in the book's chapter chapters/a2-training-at-scale.md.
"""

__all__ = [
    "DTYPES",
    "parse_options",
    "corpus",
    "batch_share",
    "distribute",
    "memory_per_process",
    "train",
    "main",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
]

# chapters/a2-training-at-scale.md, "The command and its options"
import argparse
import contextlib
import json
import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from attnbook.corpus import python_topics
from attnbook.gpt import GPT, CharTokenizer, GPTConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of `python -m attnbook.train` (see --help); a bad one exits with a message
    naming it."""
    parser = argparse.ArgumentParser(
        prog="python -m attnbook.train",
        description="Train the book's character-level GPT on the book's corpus, on one process or, "
                    "under torchrun, on several (DDP or FSDP2).")
    parser.add_argument("model", choices=["gpt"], help="the model to train")
    add = parser.add_argument
    add("--steps", type=_number(int, 1), default=200, help="optimizer steps in all (default 200)")
    add("--global-batch", type=_number(int, 1), default=32,
        help="sequences per step, over all processes (default 32)")
    add("--context", type=_number(int, 1), default=64, help="tokens per sequence (default 64)")
    add("--d-model", type=_number(int, 1), default=64, help="model width (default 64)")
    add("--layers", type=_number(int, 1), default=2, help="Transformer blocks (default 2)")
    add("--heads", type=_number(int, 1), default=4, help="attention heads (default 4)")
    add("--dropout", type=_number(float, 0, 1), default=0.0, help="dropout rate (default 0)")
    add("--lr", type=_number(float, 0, math.inf, open_low=True), default=3e-3,
        help="AdamW's learning rate (default 3e-3)")
    add("--seed", type=_number(int, 0), default=0, help="weights and batch order (default 0)")
    add("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype")
    add("--strategy", choices=["ddp", "fsdp"], default="ddp",
        help="under torchrun: replicate (ddp) or shard (fsdp) the model (default ddp)")
    add("--checkpoint-every", type=_number(int, 1), default=None, metavar="K",
        help="save a distributed checkpoint every K steps")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    add("--out", type=Path, required=True, help="directory for model.pt, log.jsonl, checkpoints")
    options = parser.parse_args(argv)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if options.global_batch % processes:
        parser.error(f"argument --global-batch: {options.global_batch} sequences cannot be shared "
                     f"equally by {processes} processes")
    if options.d_model % options.heads:
        parser.error(f"argument --heads: {options.heads} heads do not divide "
                     f"--d-model {options.d_model}")
    return options


def _number(kind: type, low: float, high: float = math.inf, open_low: bool = False):
    """An argparse `type` that reads a `kind` in [low, high] (open at low if open_low)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}"
                                             f", got {text!r}") from None
        if not (math.isfinite(value) and (value > low if open_low else value >= low)
                and value <= high):
            wanted = (f"{'above' if open_low else 'at least'} {low}" if high == math.inf
                      else f"in [{low}, {high}]")
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value
    return parse


# chapters/a2-training-at-scale.md, "One global batch, shared out"
def corpus() -> tuple[torch.Tensor, int]:
    """Chapter 8's training text as int64 character ids, and the size of its vocabulary."""
    topics = python_topics()
    text = "\n\n".join(topics[key].strip() for key in sorted(topics))
    tokenizer = CharTokenizer(text)
    return tokenizer.encode(text), tokenizer.vocab_size


def batch_share(ids: torch.Tensor, step: int, options: argparse.Namespace, rank: int = 0,
                processes: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Process `rank`'s share of global batch `step`: inputs and targets, (B / processes, T)."""
    generator = torch.Generator().manual_seed(options.seed * 1_000_003 + step)
    starts = torch.randint(len(ids) - options.context, (options.global_batch,),
                           generator=generator)  # (B,), the same in every process
    share = options.global_batch // processes
    mine = starts[rank * share:(rank + 1) * share].tolist()
    windows = torch.stack([ids[s:s + options.context + 1] for s in mine])  # (B / W, T + 1)
    return windows[:, :-1], windows[:, 1:]


# chapters/a2-training-at-scale.md, "What FSDP shards, and when it gathers"
def distribute(model: nn.Module, strategy: str) -> nn.Module:
    """`model` for the process group: replicated by DDP, or sharded by FSDP2, one block at a
    time and then the rest (embeddings, final norm). Unchanged without a process group."""
    if not dist.is_initialized():
        return model
    if strategy == "ddp":
        return DistributedDataParallel(model)
    for block in model.blocks:
        fully_shard(block)  # gathered just before the block runs, freed just after
    return fully_shard(model)


def memory_per_process(config: GPTConfig, processes: int, strategy: str) -> int:
    """Bytes per process of float32 weights, gradients and AdamW state (16 B per parameter)
    under DDP or FSDP, activations aside (see the text for what FSDP holds gathered)."""
    with torch.device("meta"):  # sizes only: no memory is allocated
        model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    if strategy == "ddp":
        return 16 * params
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    root = params - sum(p.numel() for p in model.blocks.parameters())  # embeddings, final norm
    return math.ceil(16 * params / processes) + 4 * root + 3 * 4 * block


# chapters/a2-training-at-scale.md, "The training loop"
def train(options: argparse.Namespace, on_step=None) -> None:
    """Train as `options` say (see parse_options); `on_step(step)` is called after each step.

    Writes options.out/model.pt (the full state_dict, by rank 0), options.out/log.jsonl (one line
    per step: step, loss, tokens_per_second) and, every options.checkpoint_every steps, a
    distributed checkpoint under options.out/checkpoints/.
    """
    rank, processes, device = _start_processes()
    ids, vocab_size = corpus()
    torch.manual_seed(options.seed)  # the same initial weights in every process
    config = GPTConfig(vocab_size=vocab_size, context_length=options.context,
                       d_model=options.d_model, num_layers=options.layers,
                       num_heads=options.heads, dropout=options.dropout)
    model = distribute(GPT(config).to(device, DTYPES[options.dtype]), options.strategy)
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # weight decay on matrices only
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": others, "weight_decay": 0.0}], lr=options.lr)
    torch.manual_seed(options.seed + 1 + rank)  # each process its own dropout
    start = 0
    if options.resume and (latest := latest_checkpoint(options.out)) is not None:
        start = load_checkpoint(latest, model, optimizer)
    log = _open_log(options.out, start, rank)
    steps = range(start + 1, options.steps + 1)
    for step in _progress(steps, rank):
        began = time.perf_counter()
        x, y = (t.to(device) for t in batch_share(ids, step, options, rank, processes))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # this share's mean
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces, FSDP reduce-scatters the gradients
        optimizer.step()
        loss = _mean_over_processes(loss.detach())
        seconds = time.perf_counter() - began
        if log:
            log.write(json.dumps({"step": step, "loss": loss, "tokens_per_second":
                                  options.global_batch * options.context / seconds}) + "\n")
            log.flush()
        if options.checkpoint_every and step % options.checkpoint_every == 0:
            save_checkpoint(options.out, step, model, optimizer)
        if on_step:
            on_step(step)
    if log:
        log.close()
    full = dcp_state.get_model_state_dict(
        model, options=dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, options.out / "model.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """`python -m attnbook.train ...`, alone or under torchrun."""
    options = parse_options(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    train(options)


def _start_processes() -> tuple[int, int, torch.device]:
    """This process's rank, the number of processes and its device; under torchrun, joins the
    process group (NCCL on GPUs, gloo on CPUs)."""
    gpu = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:  # plain python: one process
        return 0, 1, torch.device("cuda" if gpu else "cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    rank, processes = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's store outlives a restart, and with it the addresses the processes published:
    # a restarted process could read a dead one's (pytorch/pytorch#167288). A prefix of the
    # attempt's number keeps each attempt's keys apart.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), processes,
                          is_master=rank == 0 and not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore(
        f"attnbook-attempt-{attempt}", store), rank=rank, world_size=processes)
    return rank, processes, device


def _mean_over_processes(value: torch.Tensor) -> float:
    if dist.is_initialized():
        dist.all_reduce(value)
        value = value / dist.get_world_size()
    return value.item()


def _progress(steps: range, rank: int):
    """tqdm's progress bar on rank 0 only (and no bar where tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return steps
    return tqdm(steps, initial=steps.start - 1, total=steps.stop - 1, disable=rank != 0,
                desc="training", unit="step")


def _open_log(out: Path, start: int, rank: int):
    """Rank 0's log.jsonl, keeping the lines of steps 1 to `start` (those a resumed run keeps)."""
    if rank != 0:
        return None
    path = out / "log.jsonl"
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if json.loads(line)["step"] <= start] if start and path.exists() else []
    log = path.open("w")
    log.writelines(kept)
    return log


# chapters/a2-training-at-scale.md, "The training loop"
def save_checkpoint(out: Path, step: int, model: nn.Module, optimizer) -> Path:
    """Save everything a resumed run needs as out/checkpoints/step-<step>/, by every process."""
    path = out / "checkpoints" / f"step-{step:08d}"
    partial = path.with_name(path.name + ".partial")
    with _single_process_quiet():
        dcp.save(_checkpoint_state(model, optimizer, step), checkpoint_id=partial,
                 no_dist=not dist.is_initialized())
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # complete: only now can a run resume from it
    _barrier()
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer) -> int:
    """Load a checkpoint of save_checkpoint into `model` and `optimizer`; the step it was at."""
    state = _checkpoint_state(model, optimizer, 0)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    dcp_state.set_state_dict(model, optimizer, model_state_dict=state["model"],
                             optim_state_dict=state["optimizer"])
    torch.set_rng_state(state[f"rng_state_{_rank()}"])
    return state["step"]


def latest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint of the latest step under out/checkpoints, if there is one."""
    found = [p for p in (out / "checkpoints").glob("step-*") if re.fullmatch(r"step-\d+", p.name)]
    return max(found, default=None, key=lambda p: int(p.name[5:]))


def _checkpoint_state(model: nn.Module, optimizer, step: int) -> dict:
    model_state, optimizer_state = dcp_state.get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "step": step,
            f"rng_state_{_rank()}": torch.get_rng_state()}  # one per process: its own dropout


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":  # python -m attnbook.train
    main()
