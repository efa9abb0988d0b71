# Do not edit: tools/tangle.py generates this file from chapters/a2-training-at-scale.md.
"""Training the book's GPT on one or many processes: torch.distributed's DDP and FSDP2, launched by
torchrun, with distributed checkpoints.

Built and explained in the book's chapter chapters/a2-training-at-scale.md.
"""

__all__ = [
    "DTYPES",
    "RUN_OPTIONS",
    "TRUST",
    "parse_options",
    "corpus",
    "batch_share",
    "distribute",
    "memory_per_process",
    "train",
    "main",
    "RUN_FILES",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "MANIFEST",
    "read_manifest",
    "MODEL_FORMAT",
    "load_model",
    "sample",
]

# chapters/a2-training-at-scale.md, "The command and its options"
import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from attnbook.conventions import check_instance, check_int, check_real
from attnbook.corpus import python_topics
from attnbook.gpt import GPT, CharTokenizer, GPTConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# What a checkpoint records of its run and a resumed run must repeat: they fix the model and the
# course of training (a step's data, its dropout, its update).
RUN_OPTIONS = ("model", "context", "d_model", "layers", "heads", "dropout", "lr", "seed", "dtype",
               "global_batch")
TRUST = ("What is trusted: nothing in --out or --run can run code. --resume reads a checkpoint "
         "only if every file matches the SHA-256 that its manifest.json lists, and then unpickles "
         "its .metadata admitting only torch.distributed.checkpoint's metadata types, and tensors "
         "only with torch.load(weights_only=True); `sample` reads model.pt with "
         "torch.load(weights_only=True). The hashes catch damage, not forgery: whoever can write "
         "to the folder can still hand you other weights, so resume and sample your own runs.")


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of `python -m attnbook.train gpt ...` (training) or `... sample ...` (see
    --help); a bad one exits with a message naming it."""
    parser = argparse.ArgumentParser(
        prog="python -m attnbook.train", epilog=TRUST,
        description="Train the book's character-level GPT on the book's corpus, on one process or, "
                    "under torchrun, on several (DDP or FSDP2); or continue a prompt with it.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{gpt,sample}")
    gpt = commands.add_parser("gpt", help="train the GPT", epilog=TRUST)
    gpt.set_defaults(model="gpt")
    _training_options(gpt.add_argument)
    again = gpt.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its latest checkpoint (or start it "
                            "where it has none)")
    again.add_argument("--overwrite", action="store_true",
                       help="delete the run in --out (model.pt, log.jsonl, checkpoints/) first")
    sample = commands.add_parser("sample", help="print a prompt and its continuation by a "
                                 "trained model", epilog=TRUST)
    _sample_options(sample.add_argument)
    options = parser.parse_args(argv)
    if options.command == "sample":
        if not options.prompt:
            sample.error("argument --prompt: must not be empty")
        return options
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if options.global_batch % processes:
        gpt.error(f"argument --global-batch: {options.global_batch} sequences cannot be shared "
                  f"equally by {processes} processes")
    if options.d_model % options.heads:
        gpt.error(f"argument --heads: {options.heads} heads do not divide "
                  f"--d-model {options.d_model}")
    return options


# chapters/a2-training-at-scale.md, "The command and its options"
def _training_options(add) -> None:
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
        help="save a checkpoint every K steps (what --resume continues from)")
    add("--print-every", type=_number(float, 0), default=10.0, metavar="SECONDS",
        help="a progress line at most every SECONDS (default 10), and at the first and last step")
    add("--out", type=Path, required=True,
        help="the run's folder: model.pt, log.jsonl and checkpoints/; it must not hold another "
             "run, unless --resume or --overwrite is given")


def _sample_options(add) -> None:
    add("--run", type=Path, required=True, help="a run's folder (the --out of `gpt`)")
    add("--prompt", required=True, help="the text to continue")
    add("--tokens", type=_number(int, 0), default=200, help="characters to add (default 200)")
    add("--temperature", type=_number(float, 0), default=0.0,
        help="0 (default): the likeliest character each time; above 0: drawn at that temperature")
    add("--seed", type=_number(int, 0), default=0, help="the draws' seed (default 0)")


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
    """Chapter 10's training text as int64 character ids, and the size of its vocabulary."""
    tokenizer = CharTokenizer(text := _corpus_text())
    return tokenizer.encode(text), tokenizer.vocab_size


def _corpus_text() -> str:
    topics = python_topics()
    return "\n\n".join(topics[key].strip() for key in sorted(topics))


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

    Writes, in options.out: model.pt (what `sample` needs, see load_model), log.jsonl (one line
    per step: step, loss, tokens_per_second), and every options.checkpoint_every steps a
    checkpoint under checkpoints/. Raises ValueError, before anything is written, for an
    options.out that holds another run (without resume or overwrite) and for a checkpoint that
    is damaged, of other options, or beyond options.steps.
    """
    rank, processes, device = _start_processes()
    try:
        _train(options, on_step, rank, processes, device)
    except BaseException:  # an error, a refusal or Ctrl-C: no collective may wait for the others
        _leave_processes(orderly=False)
        raise
    _leave_processes(orderly=True)


def _train(options, on_step, rank: int, processes: int, device: torch.device) -> None:
    latest = _prepare_out(options, rank, processes)  # refuses, or says what to resume from
    text = _corpus_text()
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    torch.manual_seed(options.seed)  # the same initial weights in every process
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=options.context,
                       d_model=options.d_model, num_layers=options.layers,
                       num_heads=options.heads, dropout=options.dropout)
    model = distribute(GPT(config).to(device, DTYPES[options.dtype]), options.strategy)
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # weight decay on matrices only
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": others, "weight_decay": 0.0}], lr=options.lr)
    torch.manual_seed(options.seed + 1 + rank)  # each process its own dropout
    start = 0 if latest is None else load_checkpoint(latest, model, optimizer)
    progress = _Progress(options, start, rank)
    with _open_log(options.out, start, rank) as log:  # rank 0's; None in the others
        for step in range(start + 1, options.steps + 1):
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
            progress.step(step, loss, seconds)
            if options.checkpoint_every and step % options.checkpoint_every == 0:
                save_checkpoint(options.out, step, model, optimizer, options)
            if on_step:
                on_step(step)
    _save_model(options, model, tokenizer, rank)
    progress.finish(options.out)


# chapters/a2-training-at-scale.md, "The training loop"
def main(argv: list[str] | None = None) -> None:
    """`python -m attnbook.train ...` (or `attnbook-train ...`), alone or under torchrun.

    A refusal or a damaged file exits with status 1 and one line saying why; Ctrl-C exits with
    status 130, saying where the last checkpoint is and which command resumes from it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    options = parse_options(argv)
    first = int(os.environ.get("RANK", "0")) == 0  # the process that speaks for all
    try:
        if options.command == "sample":
            print(sample(options.run, options.prompt, options.tokens, options.temperature,
                         options.seed))
        else:
            train(options)
    except KeyboardInterrupt:
        if first:
            print(_interrupted(options, argv), file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except ValueError as error:
        if first:
            print(f"python -m attnbook.train: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _interrupted(options: argparse.Namespace, argv: list[str]) -> str:
    """What Ctrl-C leaves, and the command that continues from it."""
    again = [a for a in argv if a != "--overwrite"] + ([] if "--resume" in argv else ["--resume"])
    launcher = ("python -m attnbook.train" if "WORLD_SIZE" not in os.environ
                else "torchrun <the same torchrun options> -m attnbook.train")
    latest = latest_checkpoint(options.out)
    where = ("no checkpoint was written (--checkpoint-every K writes them), so it starts again "
             "from step 1" if latest is None else
             f"the last checkpoint is {latest} (step {int(latest.name[5:])})")
    return (f"stopped by Ctrl-C: {where}. To resume:\n  {launcher} {shlex.join(again)}")


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


def _leave_processes(orderly: bool) -> None:
    """Leave the process group. In order, every process first waits for all the others (so that
    none tears down its connections while another still uses them, or exits while its store
    still serves them); after a failure, at once, since the others may never arrive."""
    if dist.is_initialized():
        if orderly:
            dist.barrier()
        dist.destroy_process_group()


def _mean_over_processes(value: torch.Tensor) -> float:
    if dist.is_initialized():
        dist.all_reduce(value)
        value = value / dist.get_world_size()
    return value.item()


# chapters/a2-training-at-scale.md, "The run's folder"
RUN_FILES = ("model.pt", "log.jsonl", "checkpoints")  # what a run writes in its --out


def _prepare_out(options: argparse.Namespace, rank: int, processes: int) -> Path | None:
    """Check options.out before anything is written: the checkpoint to resume from (checked
    against the options), or None; a run already there is refused, or deleted (--overwrite)."""
    out, latest = options.out, latest_checkpoint(options.out) if options.resume else None
    found = [name for name in RUN_FILES if (out / name).exists()]
    if latest is not None:
        _check_resumable(latest, options, processes)
    elif options.resume and "model.pt" in found:
        raise ValueError(f"--resume: {out} holds a finished run (model.pt) and no checkpoint to "
                         f"resume from; give another --out, or --overwrite to train it again")
    elif found and not (options.resume or options.overwrite):
        raise ValueError(f"--out {out} already holds a run ({', '.join(found)}): give --resume "
                         f"to continue it, --overwrite to delete it and start afresh, or "
                         f"another --out")
    _barrier()  # every process has looked before rank 0 deletes anything
    if rank == 0:
        for name in found if options.overwrite else ():
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    return latest


def _check_resumable(path: Path, options: argparse.Namespace, processes: int) -> None:
    manifest = read_manifest(path)
    recorded = manifest["options"]
    for name in RUN_OPTIONS:
        flag = name if name == "model" else "--" + name.replace("_", "-")
        if recorded.get(name) != getattr(options, name):
            raise ValueError(f"--resume: the checkpoint {path} was written with {flag} "
                             f"{recorded.get(name)}, and this run has {flag} "
                             f"{getattr(options, name)}: resume with the run's own options, or "
                             f"start afresh with another --out")
    if manifest["processes"] != processes:
        raise ValueError(f"--resume: the checkpoint {path} was written by {manifest['processes']} "
                         f"processes, and this run has {processes}: resume with as many")
    if manifest["step"] > options.steps:
        raise ValueError(f"--resume: the latest checkpoint, {path}, is at step "
                         f"{manifest['step']}, beyond --steps {options.steps}: give --steps "
                         f"{manifest['step']} or more, or start afresh with another --out")


# chapters/a2-training-at-scale.md, "The run's folder"
def _open_log(out: Path, start: int, rank: int):
    """Rank 0's log.jsonl, open for appending, holding the previous log's lines of steps 1 to
    `start` (those a resumed run keeps); None in the other processes. The kept lines are written
    to a new file, flushed to disk and renamed over the old one before training goes on, so
    that a process killed at any moment leaves one log or the other, whole."""
    if rank != 0:
        return contextlib.nullcontext()
    path, partial = out / "log.jsonl", out / "log.jsonl.partial"
    with partial.open("w") as kept:
        kept.writelines(_log_lines(path, start) if start else [])
        kept.flush()
        os.fsync(kept.fileno())
    os.replace(partial, path)
    return path.open("a")


def _log_lines(path: Path, last_step: int) -> list[str]:
    """The lines of the log at `path` of steps 1 to `last_step`. A torn last line (the process
    was killed while writing it) is dropped; any other line that is not a step's is an error."""
    lines = path.read_text(errors="replace").splitlines(keepends=True) if path.exists() else []
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int):
                raise TypeError(step)
        except (ValueError, TypeError, KeyError):  # JSONDecodeError is a ValueError
            if number == len(lines) and not line.endswith("\n"):
                break  # torn
            raise ValueError(f"{path}, line {number}, is not a line of attnbook.train's log: "
                             f"{line[:80]!r}") from None
        if step <= last_step:
            kept.append(line)
    return kept


class _Progress:
    """Rank 0's progress on stderr: a line at the first step, at most every
    options.print_every seconds after it, and at the last; then a summary."""

    def __init__(self, options: argparse.Namespace, start: int, rank: int) -> None:
        self.quiet, self.start, self.steps = rank != 0, start, options.steps
        self.every, self.tokens = options.print_every, options.global_batch * options.context
        self.began = self.shown = time.perf_counter()
        self.since, self.seconds, self.total, self.loss = 0, 0.0, 0.0, math.nan

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.since, self.seconds, self.total, self.loss = (
            self.since + 1, self.seconds + seconds, self.total + seconds, loss)
        now = time.perf_counter()
        if self.quiet or not (step in (self.start + 1, self.steps) or
                              now - self.shown >= self.every):
            return
        print(f"step {step}/{self.steps}: loss {loss:.4f}, "
              f"{self.tokens * self.since / self.seconds:,.0f} tokens/s", file=sys.stderr,
              flush=True)
        self.shown, self.since, self.seconds = now, 0, 0.0

    def finish(self, out: Path) -> None:
        if self.quiet:
            return
        done = self.steps - self.start
        said = (f"nothing to train: the checkpoint is at step {self.steps}" if not done else
                f"trained steps {self.start + 1} to {self.steps} in "
                f"{time.perf_counter() - self.began:.1f} s, "
                f"{self.tokens * done / self.total:,.0f} tokens/s, final loss {self.loss:.4f}")
        print(f"{said}; wrote {out / 'model.pt'} and {out / 'log.jsonl'}", file=sys.stderr,
              flush=True)


# chapters/a2-training-at-scale.md, "Checkpoints, and what they trust"
def save_checkpoint(out: Path, step: int, model: nn.Module, optimizer,
                    options: argparse.Namespace | None = None) -> Path:
    """Save everything a resumed run needs as out/checkpoints/step-<step>/, by every process,
    with a manifest.json (by rank 0) of the step, the run's `options` and every file's SHA-256."""
    path = out / "checkpoints" / f"step-{step:08d}"
    partial = path.with_name(path.name + ".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a process killed while saving left
    _barrier()
    try:
        with _single_process_quiet():
            dcp.save(_checkpoint_state(model, optimizer, step), checkpoint_id=partial,
                     no_dist=not dist.is_initialized())
    except CheckpointException as error:  # DCP wraps even a Ctrl-C in it
        _reraise_interrupt(error)
        raise
    _barrier()
    if _rank() == 0:
        files = {p.name: _sha256(p) for p in sorted(partial.iterdir())}
        recorded = None if options is None else {n: getattr(options, n) for n in RUN_OPTIONS}
        _write_durably(partial / MANIFEST, json.dumps(
            {"written_by": "attnbook.train", "step": step, "processes": _world(),
             "options": recorded, "files": files}, indent=1))
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # complete: only now can a run resume from it
    _barrier()
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer) -> int:
    """Load a checkpoint of save_checkpoint into `model` and `optimizer`; the step it was at.

    Its files are checked against its manifest first (read_manifest), and nothing in it is
    unpickled but its metadata's own types; a checkpoint that fails either, or does not fit
    `model`, raises ValueError naming the folder."""
    read_manifest(path)
    state = _checkpoint_state(model, optimizer, 0)
    try:
        _read_metadata(path)  # here first, so that DCP does not try other files after a refusal
        with _single_process_quiet():
            dcp.load(state, storage_reader=_TrustedReader(path), planner=_TrustedPlanner(),
                     no_dist=not dist.is_initialized())
        _, optimizer_state = dcp_state.get_state_dict(model, optimizer)  # its param_groups
        dcp_state.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                 optim_state_dict={"state": state["optimizer"], "param_groups":
                                                   optimizer_state["param_groups"]})
        torch.set_rng_state(state[f"rng_state_{_rank()}"])
    except (CheckpointException, Exception) as error:  # CheckpointException is a BaseException
        _reraise_interrupt(error)
        raise ValueError(f"checkpoint {path} cannot be loaded: {_reason(error)}") from None
    return int(state["step"])


def latest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint of the latest step under out/checkpoints, if there is one."""
    found = [p for p in (out / "checkpoints").glob("step-*") if re.fullmatch(r"step-\d+", p.name)]
    return max(found, default=None, key=lambda p: int(p.name[5:]))


def _checkpoint_state(model: nn.Module, optimizer, step: int) -> dict:
    """Tensors only, so that no value of a checkpoint is a pickle. The optimizer's
    hyperparameters (its param_groups) are not saved: they follow from the options, which the
    manifest records and a resumed run must repeat."""
    model_state, optimizer_state = dcp_state.get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state["state"],
            "step": torch.tensor(step), f"rng_state_{_rank()}": torch.get_rng_state()}


# chapters/a2-training-at-scale.md, "Checkpoints, and what they trust"
MANIFEST = "manifest.json"


def read_manifest(path: Path) -> dict:
    """The manifest.json of checkpoint `path`, once every file of the folder has been checked
    against the SHA-256 it lists; a ValueError names the folder and what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} has no {MANIFEST}: it was not written by this "
                         f"version of attnbook.train, and is not read") from None
    except (OSError, ValueError) as error:  # a JSONDecodeError or a UnicodeDecodeError
        raise ValueError(f"checkpoint {path}: its {MANIFEST} is damaged ({error})") from None
    fields = {"written_by": str, "step": int, "processes": int, "options": (dict, type(None)),
              "files": dict}
    if not (isinstance(manifest, dict) and manifest.get("written_by") == "attnbook.train" and
            all(isinstance(manifest.get(k), kind) for k, kind in fields.items())):
        raise ValueError(f"checkpoint {path}: its {MANIFEST} is not attnbook.train's")
    manifest["options"] = manifest["options"] or {}
    present = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    if present != sorted(manifest["files"]):
        raise ValueError(f"checkpoint {path} is damaged: it holds {present}, and its {MANIFEST} "
                         f"lists {sorted(manifest['files'])}")
    for name in present:
        if _sha256(path / name) != manifest["files"][name]:
            raise ValueError(f"checkpoint {path} is damaged: {name} does not match the SHA-256 "
                             f"in its {MANIFEST}")
    return manifest


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's .metadata admitting only what DCP's metadata is made of (its
    own dataclasses, torch.Size, dtypes, layouts and paths): a pickle that names anything else,
    such as os.system, is refused before it can call it."""

    ADMITTED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                *((module, p) for module in ("pathlib", "pathlib._local")  # 3.13: _local
                  for p in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}

    def find_class(self, module: str, name: str):
        found = getattr(sys.modules.get(module), name, None)
        if ((module, name) in self.ADMITTED or isinstance(found, torch.dtype) and module == "torch"
                or module == Metadata.__module__ and isinstance(found, type)
                and found.__module__ == module):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"its .metadata names {module}.{name}, which a checkpoint's "
                                     f"metadata does not hold: not read")


def _read_metadata(path: Path, name: str = ".metadata") -> Metadata:
    with open(path / name, "rb") as file:
        metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"its {name} holds a {type(metadata).__name__}")
    return metadata


class _TrustedReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = _read_metadata(Path(self.path),
                                  ".metadata" if rank is None else f"__{rank}.metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TrustedPlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:  # DCP would unpickle it, whatever it holds
        raise ValueError(f"it stores {read_item.dest_index.fqn} as a pickle, where "
                         f"attnbook.train stores tensors only: not read")


def _reason(error: BaseException) -> str:
    """The first line of what went wrong, from inside a CheckpointException if need be."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _reraise_interrupt(error: BaseException) -> None:
    """A Ctrl-C that DCP caught in a process, and wrapped in a CheckpointException, as itself."""
    failures = error.failures.values() if isinstance(error, CheckpointException) else ()
    if any(isinstance(failure[0], KeyboardInterrupt) for failure in failures):
        raise KeyboardInterrupt from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# chapters/a2-training-at-scale.md, "What a trained model holds"
MODEL_FORMAT = "attnbook.train model, version 1"


def _save_model(options: argparse.Namespace, model: nn.Module, tokenizer: CharTokenizer,
                rank: int) -> None:
    """Rank 0 writes out/model.pt: all that rebuilds the model, in types that
    torch.load(..., weights_only=True) reads; to a new file renamed over the old one."""
    weights = dcp_state.get_model_state_dict(  # a collective: every process takes part
        model, options=dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    config = dataclasses.asdict(_unwrapped(model).config)
    saved = {"format": MODEL_FORMAT, "config": config, "vocabulary": "".join(tokenizer.itos),
             "model": weights, "step": options.steps,
             "options": {name: getattr(options, name) for name in RUN_OPTIONS}}
    partial = options.out / "model.pt.partial"
    torch.save(saved, partial)
    os.replace(partial, options.out / "model.pt")


def load_model(run) -> tuple[GPT, CharTokenizer]:
    """The model and tokenizer of a run's model.pt (`run` is the folder or the file), in eval
    mode; read with torch.load(weights_only=True), so that it holds data and no code."""
    run = Path(check_instance("run", run, (str, os.PathLike)))
    path = run / "model.pt" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"run={str(run)!r} holds no model.pt: train one first "
                         f"(python -m attnbook.train gpt --out {run})")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(saved, dict) and saved.get("format") == MODEL_FORMAT):
            raise TypeError("not attnbook.train's model.pt (an older one holds weights only)")
        tokenizer = CharTokenizer(saved["vocabulary"])
        model = GPT(GPTConfig(**saved["config"]))
        model.to(next(iter(saved["model"].values())).dtype).load_state_dict(saved["model"])
    except Exception as error:  # an UnpicklingError, a wrong type or size, a missing key
        raise ValueError(f"{path} cannot be read as a model: {_reason(error)}") from None
    return model.eval(), tokenizer


def sample(run, prompt: str, tokens: int = 200, temperature: float = 0.0, seed: int = 0) -> str:
    """`prompt` and `tokens` characters more, written by the model of a run (load_model): the
    likeliest each time at temperature 0, else drawn at `temperature`, seeded by `seed`."""
    check_int("len(prompt)", len(check_instance("prompt", prompt, str)), minimum=1)
    tokens, seed = check_int("tokens", tokens, minimum=0), check_int("seed", seed, minimum=0)
    temperature = check_real("temperature", temperature, 0.0)
    model, tokenizer = load_model(run)
    if unknown := sorted(set(prompt) - set(tokenizer.itos)):
        raise ValueError(f"prompt holds characters the model has never seen: {unknown[:10]}")
    idx = tokenizer.encode(prompt)[None].to(model.tok_emb.weight.device)  # (1, T)
    out = model.generate(idx, tokens, temperature=temperature,
                         generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0])


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


if __name__ == "__main__":  # python -m attnbook.train
    main()
