# Do not edit: tools/tangle.py generates this file from chapters/a2-training-at-scale.md and chapters/a5-training-command.md.
"""Training the book's GPT on one or many processes: torch.distributed's DDP and FSDP2, launched by
torchrun, with distributed checkpoints.

Built and explained in the book's chapters chapters/a2-training-at-scale.md and chapters/a5-training-command.md.
"""

__all__ = [
    "main",
    "parse_options",
    "DTYPES",
    "corpus",
    "batch_share",
    "distribute",
    "memory_per_process",
    "train",
    "run",
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

# chapters/a2-training-at-scale.md, "One global batch, shared out"
import argparse  # noqa: F811 (notebook)
import contextlib  # noqa: F811 (notebook)
import dataclasses
import hashlib
import json
import math  # noqa: F811 (notebook)
import os  # noqa: F811 (notebook)
import pickle
import re
import shlex
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path  # noqa: F811 (notebook)
from typing import Any, Callable, Iterator, TextIO, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from attnbook.checks import check_choice, check_instance, check_int, check_real
from attnbook.corpus import python_topics
from attnbook.gpt import GPT, CharTokenizer, GPTConfig
from attnbook.recipe import (
    Recipe,
    batch,
    held_out_loss,
    held_out_split,
    learning_rate,
    make_optimizer,
    train_step,
)
from attnbook.train_command import (  # noqa: F811 (notebook)
    PROGRAM,
    RESUMABLE,
    RUN_OPTIONS,
    check_run_options,
    explain,
    lock_out,
    torchrun_environment,
)
from attnbook.train_command import main as main  # python -m attnbook.train
from attnbook.train_command import parse_options as parse_options  # noqa: F811 (notebook)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
    x, y = batch(ids, step, options.global_batch, options.context, options.seed)  # (B, T) each
    share = options.global_batch // processes
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


# chapters/a2-training-at-scale.md, "What FSDP shards, and when it gathers"
def distribute(model: GPT, strategy: str) -> nn.Module:
    """`model` for the process group: replicated by DDP, or sharded by FSDP2, one block at a
    time and then the rest (embeddings, final norm). Unchanged without a process group."""
    if not dist.is_initialized():
        return model
    if strategy == "ddp":
        return DistributedDataParallel(model)
    for block in model.blocks:
        fully_shard(block)  # gathered just before the block runs, freed just after
    return cast(nn.Module, fully_shard(model))  # the same model, its class made FSDP's


def memory_per_process(config: GPTConfig, processes: int, strategy: str) -> int:
    """Bytes per process of float32 weights, gradients and AdamW state (16 B per parameter)
    under DDP or FSDP, activations aside (see the text for what FSDP holds gathered)."""
    processes = check_int("processes", processes, 1)
    with torch.device("meta"):  # sizes only: no memory is allocated
        model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    if check_choice("strategy", strategy, ("ddp", "fsdp")) == "ddp":
        return 16 * params
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    root = params - sum(p.numel() for p in model.blocks.parameters())  # embeddings, final norm
    return math.ceil(16 * params / processes) + 2 * 4 * root + 3 * 4 * block  # root: w and grad


# chapters/a2-training-at-scale.md, "The training loop"
def train(options: argparse.Namespace, on_step: Callable[[int], object] | None = None) -> None:
    """Train as `options` say (see parse_options); `on_step(step)` is called after each step.

    Writes in options.out model.pt (see load_model), log.jsonl (a line per step: step, loss, lr,
    tokens_per_second, held_out_loss where measured) and checkpoints/. Raises ValueError, before
    anything is written, for an options.out in use, holding another run (without resume or
    overwrite), damaged, of other options, or beyond options.steps."""
    rank, processes, device = _start_processes()
    try:  # the lock is released when the run ends, or its process does
        with _lock(options, rank) or contextlib.nullcontext():
            _train(options, on_step, rank, processes, device)
    except BaseException:  # an error, a refusal or Ctrl-C: no collective may wait for the others
        _leave_processes(orderly=False)
        raise
    _leave_processes(orderly=True)


def _train(options: argparse.Namespace, on_step: Callable[[int], object] | None, rank: int,
           processes: int, device: torch.device) -> None:
    text = _corpus_text()
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    train_ids, held_ids = held_out_split(ids)
    latest = _prepare_out(options, rank, processes, len(held_ids))  # refuses, or says from where
    torch.manual_seed(options.seed)  # the same initial weights in every process
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=options.context,
                       d_model=options.d_model, num_layers=options.layers,
                       num_heads=options.heads, dropout=options.dropout)
    model = distribute(GPT(config).to(device, DTYPES[options.dtype]), options.strategy)
    recipe = Recipe(lr=options.lr, warmup=options.warmup, min_lr_ratio=options.min_lr_ratio,
                    weight_decay=options.weight_decay, clip=options.clip or math.inf)
    optimizer = make_optimizer(model, recipe)  # chapter 10's recipe, as the chapter trains
    torch.manual_seed(options.seed + 1 + rank)  # each process its own dropout
    start = 0 if latest is None else load_checkpoint(latest, model, optimizer)
    held_x, held_y = (t.to(device) for t in batch(held_ids, 0, 64, options.context))  # fixed
    progress = _Progress(options, start, rank)
    with _open_log(options.out, start, rank) as log:  # rank 0's; None in the others
        if latest is not None and rank == 0:
            print(f"resuming {options.out} from its checkpoint {latest.name} (step {start})",
                  file=sys.stderr, flush=True)
        for step in range(start + 1, options.steps + 1):
            began = time.perf_counter()
            x, y = (t.to(device) for t in batch_share(train_ids, step, options, rank, processes))
            lr = learning_rate(recipe, step, options.steps)
            # gradients all-reduced (DDP) or reduce-scattered (FSDP), then the loop's one read
            loss, norm = _read_step(*train_step(model, optimizer, x, y, lr, recipe.clip))
            if not (math.isfinite(loss) and math.isfinite(norm)):  # stop before saving it
                raise ValueError(_diverged(options.out, step, loss, norm))
            seconds = time.perf_counter() - began
            line = {"step": step, "loss": loss, "grad_norm": norm, "lr": lr,
                    "tokens_per_second": options.global_batch * options.context / seconds}
            if step % options.eval_every == 0 or step == options.steps:  # every process
                line["held_out_loss"] = held_out_loss(model, held_x, held_y)
            if log:
                log.write(json.dumps(line) + "\n")
                log.flush()
            progress.step(line, seconds)
            if options.checkpoint_every and step % options.checkpoint_every == 0:
                save_checkpoint(options.out, step, model, optimizer, options)  # and prunes
            if on_step:
                on_step(step)
    _save_model(options, model, tokenizer, rank)
    progress.finish(options.out)


# chapters/a2-training-at-scale.md, "The training loop"
def run(options: argparse.Namespace, argv: list[str]) -> int:
    """Run the command that `options` (parse_options of `argv`) describe; its exit status: 0
    when it succeeds; 1, with one line on stderr, for a refusal, a damaged file, an unusable folder
    or a step whose loss or gradient norm is not finite; 130 for Ctrl-C, saying how to resume."""
    env = None  # torchrun's variables: its rank 0, or the one process, speaks for all
    try:
        if options.command == "sample":
            print(sample(options.run, options.prompt, options.tokens, options.temperature,
                         options.seed, options.top_k))
        else:
            env = torchrun_environment()  # or a ValueError
            train(options)
    except KeyboardInterrupt:
        if (env or {"RANK": 0})["RANK"] == 0:
            print(_interrupted(options, env is not None), file=sys.stderr, flush=True)
        return 130
    except (ValueError, OSError) as error:
        if (env or {"RANK": 0})["RANK"] == 0:
            print(f"{PROGRAM}: error: {explain(error, options)}", file=sys.stderr, flush=True)
        return 1
    return 0


def _interrupted(options: argparse.Namespace, torchrun: bool) -> str:
    """What Ctrl-C leaves, and the command that continues from it (which reads the run's own
    options from the folder), started by torchrun or not."""
    if options.command == "sample":
        return "stopped by Ctrl-C"
    again = ["gpt", "--resume", "--out", str(options.out)]
    launcher = "torchrun <the same torchrun options> -m attnbook.train" if torchrun else PROGRAM
    return (f"stopped by Ctrl-C: {_last_checkpoint(options.out)}. To resume:\n  {launcher} "
            f"{shlex.join(again)}")


def _diverged(out: Path, step: int, loss: float, norm: float) -> str:
    """Why a run stopped at a step whose loss or gradient norm is not finite: nothing of that
    step was logged or saved, and no checkpoint was deleted."""
    return (f"step {step}: the loss is {loss} and the gradient norm {norm}; stopped before "
            f"saving anything of this step: {_last_checkpoint(out)}")


def _last_checkpoint(out: Path) -> str:
    latest = latest_checkpoint(out)
    if latest is None:
        return ("no checkpoint was written (--checkpoint-every K writes them), so it starts again "
                "from step 1, with the run's options")
    return f"the last checkpoint is {latest} (step {int(latest.name[5:])})"


def _start_processes() -> tuple[int, int, torch.device]:
    """This process's rank, the number of processes and its device; under torchrun, joins the
    process group (NCCL on GPUs, gloo on CPUs)."""
    gpu, env = torch.cuda.is_available(), torchrun_environment()  # checked (appendix E)
    if env is None:  # plain python, or WORLD_SIZE=1 alone: one process
        return 0, 1, torch.device("cuda" if gpu else "cpu")
    device = torch.device("cuda", env["LOCAL_RANK"]) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    rank, processes = env["RANK"], env["WORLD_SIZE"]
    # torchrun's store outlives a restart, and with it the addresses the processes published:
    # a restarted process could read a dead one's (pytorch/pytorch#167288). A prefix of the
    # attempt's number keeps each attempt's keys apart.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:  # torchrun's agent serves its store before it starts the processes: do not wait for one
        if agent_store:
            socket.create_connection((env["MASTER_ADDR"], env["MASTER_PORT"]), timeout=10).close()
    except OSError as error:
        raise ValueError(f"TORCHELASTIC_USE_AGENT_STORE=True (set by torchrun's agent), but no "
                         f"store answers at MASTER_ADDR:MASTER_PORT ({error.strerror or error}): "
                         f"start it with torchrun, or unset TORCHELASTIC_USE_AGENT_STORE") from None
    store = dist.TCPStore(env["MASTER_ADDR"], env["MASTER_PORT"], processes,
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


def _in_every_process(ok: bool) -> bool:
    """Whether `ok` holds in every process: a collective, which every process must call."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([int(ok)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _read_step(loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
    """A step's loss, the mean over the processes, and its gradient norm (every process's), read
    from the device in one transfer: the loop's one read a step (the model's check of its
    token ids, chapter 10's GPT.forward, reads the device once more)."""
    check_instance("loss", loss, torch.Tensor)
    check_instance("norm", norm, torch.Tensor)
    if dist.is_initialized():
        dist.all_reduce(loss)  # queued on the device, like the step's own work
        loss = loss / dist.get_world_size()
    if isinstance(norm, DTensor):  # FSDP's norm: the same value, as a plain tensor
        norm = norm.full_tensor()
    loss_read, norm_read = torch.stack([loss.double(), norm.double()]).tolist()  # exact, any dtype
    return loss_read, norm_read


def _random_states(model: nn.Module) -> dict[str, torch.Tensor]:
    """This process's random states, which dropout draws from: the CPU's and, for a model on a
    GPU, that GPU's (a checkpoint saves them, so that a resumed run drops what an unbroken one would)."""
    rank, device = _rank(), next(model.parameters()).device
    states = {f"rng_state_{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"cuda_rng_state_{rank}"] = torch.cuda.get_rng_state(device)
    return states


def _only_saved(state: dict[str, Any], metadata: Metadata) -> None:
    """Leave out of `state` a GPU's random state that a checkpoint written on a CPU lacks."""
    for name in [name for name in state if name.startswith("cuda_rng_state_")]:
        if name not in metadata.state_dict_metadata:
            del state[name]  # the GPU's generator keeps its own state


def _set_random_states(state: dict[str, Any], model: nn.Module) -> None:
    torch.set_rng_state(state[f"rng_state_{_rank()}"])
    if f"cuda_rng_state_{_rank()}" in state:
        torch.cuda.set_rng_state(state[f"cuda_rng_state_{_rank()}"],
                                 next(model.parameters()).device)


# chapters/a5-training-command.md, "The run's folder"
RUN_FILES = ("model.pt", "log.jsonl", "checkpoints", "run.json")  # what a run writes in --out


def _lock(options: argparse.Namespace, rank: int) -> TextIO | None:
    """Rank 0's lock_out (main's, for one process); what it cannot lock, every process refuses."""
    lock = refusal = None
    try:
        lock = vars(options).get("lock") or (lock_out(options.out) if rank == 0 else None)
    except (ValueError, OSError) as error:
        refusal = error
    if not _in_every_process(refusal is None):
        raise refusal or ValueError(f"--out {options.out} is refused by rank 0")
    return lock


def _prepare_out(options: argparse.Namespace, rank: int, processes: int,
                 held_out: int) -> Path | None:
    """Check options.out before anything is written, and the checkpoint to resume from (or None)
    whose options (or run.json's) a resumed run takes; --context must fit `held_out`."""
    out, latest = options.out, latest_checkpoint(options.out) if options.resume else None
    found = [name for name in RUN_FILES if (out / name).exists()]
    if latest is not None:
        _check_resumable(latest, options, processes)
    elif options.resume and "model.pt" in found:
        raise ValueError(f"--resume: {out} holds a finished run (model.pt) and no checkpoint to "
                         f"resume from; give another --out, or --overwrite to train it again")
    elif options.resume and "run.json" in found:  # stopped before its first checkpoint
        _take_run_options(_read_sealed(out / "run.json"), lambda name: out / "run.json", options)
    elif found and not (options.resume or options.overwrite):
        raise ValueError(f"--out {out} already holds a run ({', '.join(found)}): give --resume to "
                         f"continue it, --overwrite to delete it and start afresh, or another --out")
    if options.context >= held_out:
        raise ValueError(f"--context {options.context} is not shorter than the held-out text "
                         f"({held_out} characters): give a shorter --context")
    if rank == 0 and getattr(options, "run_steps", None) not in (None, options.steps):
        print(f"note: --steps {options.steps}, where the run had {options.run_steps}: the learning "
              f"rate follows a {options.steps}-step schedule from here on, so the result is that "
              f"of neither uninterrupted run", file=sys.stderr, flush=True)
    _barrier()  # every process has looked before rank 0 deletes anything
    if rank == 0:
        for name in found if options.overwrite else ():
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out.mkdir(parents=True, exist_ok=True)
        _write_sealed(out / "run.json", _run_options(options))
    _barrier()
    return latest


def _check_resumable(path: Path, options: argparse.Namespace, processes: int) -> None:
    """Take the run's options; refuse other processes, a finished run, a checkpoint past --steps."""
    manifest, latest = read_manifest(path), path.parent.parent / "run.json"
    sealed = _read_sealed(latest, advice=f"move it away to resume with the options {path} "
                          "records") if latest.exists() else {}  # what may change, as last started
    last = {name: sealed[name] for name in RESUMABLE if name in sealed}
    _take_run_options(manifest["options"] | last, lambda n: latest if n in last else path, options)
    options.run_steps = manifest["options"]["steps"] if manifest["step"] < options.steps else None
    if manifest["processes"] != processes:
        raise ValueError(f"--resume: the checkpoint {path} was written by {manifest['processes']} "
                         f"processes, and this run has {processes}: resume with as many")
    done = _finished_at(options.out, path) if (options.out / "model.pt").exists() else 0
    if options.steps <= done and done >= manifest["step"]:  # an older model.pt is no finish
        raise ValueError(f"--resume: the run in {options.out} has finished, at step {done}: give "
                         f"--steps above {done} to train it further, or another --out")
    if manifest["step"] > options.steps:
        raise ValueError(f"--resume: the latest checkpoint, {path}, is at step "
                         f"{manifest['step']}, beyond --steps {options.steps}: give --steps "
                         f"{manifest['step']} or more, or start afresh with another --out")


def _take_run_options(recorded: dict[str, Any], where: Callable[[str], Path],
                      options: argparse.Namespace) -> None:
    """Take the run's options where not given, `where(name)` recording each; refuse others given."""
    flag: Callable[[str], str] = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    given = set(getattr(options, "given", RUN_OPTIONS + RESUMABLE)) | {"model"}
    if wrong := [n for n in check_run_options(recorded) if n not in given or n not in RESUMABLE]:
        flags = ", ".join(map(flag, wrong))  # a given RESUMABLE one replaces the recorded one
        by_file: dict[str, list[str]] = {}  # the file that records each of them: its flags
        for name in wrong:
            by_file.setdefault(str(where(name)), []).append(flag(name))
        held = "; ".join(f"{f} records no sound {', '.join(fs)}" for f, fs in by_file.items())
        raise ValueError(f"--resume: {held} (damaged, or written by an older attnbook-train): "
                         + (f"give {flags} anew" if set(wrong) <=
                         set(RESUMABLE) else "start afresh with another --out"))
    if differ := [f"{flag(name)} {getattr(options, name)} (the run's: {recorded[name]})"
                  for name in RUN_OPTIONS if name in given and getattr(options, name) != recorded[name]]:
        raise ValueError(f"--resume: the run in {options.out} was trained with other options: "
                         f"{'; '.join(differ)}. Leave them out to resume with the run's own, or "
                         f"start afresh with another --out")
    for name in RUN_OPTIONS + RESUMABLE:
        setattr(options, name, getattr(options, name) if name in given else recorded[name])


def _run_options(options: argparse.Namespace) -> dict[str, Any]:
    """What a checkpoint and run.json record of a run: RUN_OPTIONS and RESUMABLE."""
    return {name: getattr(options, name) for name in RUN_OPTIONS + RESUMABLE}


def _finished_at(out: Path, checkpoint: Path) -> int:
    """The step of the run whose model.pt is in `out` (and whose latest checkpoint `checkpoint`)."""
    try:
        return int(torch.load(out / "model.pt", map_location="cpu", weights_only=True)["step"])
    except Exception as error:  # an UnpicklingError, a missing key, a damaged file
        raise ValueError(f"{out / 'model.pt'} cannot be read: {_reason(error)}; move it away and "
                         f"--resume from the checkpoint {checkpoint}, or give another --out") from None


# chapters/a5-training-command.md, "The run's folder"
def _open_log(out: Path, start: int, rank: int) -> contextlib.AbstractContextManager[TextIO | None]:
    """Rank 0's log.jsonl for appending (others: None), its steps 1 to `start` first rewritten."""
    if rank != 0:
        return contextlib.nullcontext()
    path, partial = out / "log.jsonl", out / "log.jsonl.partial"
    lines = _log_lines(path, start) if start else []  # refused here, before anything is written
    _write_durably(partial, "".join(lines))  # flushed to the disk before it replaces the log
    os.replace(partial, path)
    return path.open("a")


def _log_lines(path: Path, last_step: int) -> list[str]:
    """The log's lines of steps 1 to `last_step`: a torn last line dropped, a garbled refused."""
    lines = path.read_text(errors="replace").splitlines(keepends=True) if path.exists() else []
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            if not isinstance(step := json.loads(line)["step"], int):
                raise TypeError(step)
        except (ValueError, TypeError, KeyError):  # JSONDecodeError is a ValueError
            if number == len(lines) and not line.endswith("\n"):
                break  # torn
            raise ValueError(f"{path}, line {number}, is not a line of attnbook.train's log: "
                             f"{line[:80]!r}") from None
        if step <= last_step:
            kept.append(line)
    if len(kept) < last_step:  # a log deleted or cut by hand: go on, and say what is missing
        print(f"{path} holds {len(kept)} of the checkpoint's {last_step} steps: the resumed log "
              f"goes on without the others", file=sys.stderr, flush=True)
    return kept


class _Progress:
    """Rank 0's progress on stderr, at times the text says; then a summary."""

    def __init__(self, options: argparse.Namespace, start: int, rank: int) -> None:
        self.quiet, self.start, self.steps = rank != 0, start, options.steps
        self.every, self.tokens = options.print_every, options.global_batch * options.context
        self.began = self.shown = time.perf_counter()
        self.since, self.seconds, self.total, self.last = 0, 0.0, 0.0, dict[str, float]()

    def step(self, line: dict[str, float], seconds: float) -> None:
        """Count a step's seconds; print its log `line` if it is time to."""
        self.since, self.seconds, self.total, self.last = (
            self.since + 1, self.seconds + seconds, self.total + seconds, line)
        now = time.perf_counter()
        if self.quiet or not (line["step"] in (self.start + 1, self.steps) or
                              "held_out_loss" in line or now - self.shown >= self.every):
            return
        held = f", held-out loss {line['held_out_loss']:.4f}" if "held_out_loss" in line else ""
        print(f"step {line['step']}/{self.steps}: loss {line['loss']:.4f}{held}, lr "
              f"{line['lr']:.2e}, {self.tokens * self.since / self.seconds:,.0f} tokens/s",
              file=sys.stderr, flush=True)
        self.shown, self.since, self.seconds = now, 0, 0.0

    def finish(self, out: Path) -> None:
        if self.quiet:
            return
        done = self.steps - self.start
        said = (f"nothing to train: the checkpoint is at step {self.steps}" if not done else
                f"trained steps {self.start + 1} to {self.steps} in {time.perf_counter() - self.began:.1f}"
                f" s ({self.tokens * done / self.total:,.0f} tokens/s in the steps alone), final loss "
                f"{self.last['loss']:.4f}, held-out loss {self.last['held_out_loss']:.4f}")
        print(f"{said}; wrote {out / 'model.pt'}, {out / 'log.jsonl'}", file=sys.stderr, flush=True)


# chapters/a5-training-command.md, "Checkpoints, and what they trust"
def save_checkpoint(out: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    options: argparse.Namespace | None = None) -> Path:
    """Save what a resumed run needs as out/checkpoints/step-<step>/, by every process, with a
    manifest.json of the step, `options` and every file's SHA-256; keep options.keep_checkpoints."""
    step = check_int("step", step, 0)  # and keep, before anything is written or deleted
    keep = check_int("options.keep_checkpoints", options.keep_checkpoints, 1) if options else None
    path = out / "checkpoints" / f"step-{step:08d}"
    partial = path.with_name(path.name + ".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a process killed while saving left
    _barrier()
    with _dcp_call():
        dcp.save(_checkpoint_state(model, optimizer, step), checkpoint_id=partial,
                 no_dist=not dist.is_initialized())
    _barrier()
    if _rank() == 0:
        files = {p.name: _sha256(p) for p in sorted(partial.iterdir())}
        manifest = {"written_by": "attnbook.train", "step": step, "processes": _world(),
                    "options": None if options is None else _run_options(options), "files": files}
        _write_sealed(partial / MANIFEST, manifest)
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # complete: only now can a run resume from it
        if keep is not None:  # delete all but it and the latest keep - 1 others
            others = [c for c in _checkpoints(out) if c != path]
            for old in others[:max(len(others) - keep + 1, 0)]:
                shutil.rmtree(old)
    _barrier()
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint of save_checkpoint into `model` and `optimizer`; the step it was at. A
    ValueError names a checkpoint that fails read_manifest, pickles other than its metadata's
    types, or does not fit `model`."""
    read_manifest(path)
    state = _checkpoint_state(model, optimizer, 0)
    try:
        _only_saved(state, _read_metadata(path))  # first: DCP tries no other file after a refusal
        with _dcp_call():
            dcp.load(state, storage_reader=_TrustedReader(path), planner=_TrustedPlanner(),
                     no_dist=not dist.is_initialized())
        _, optimizer_state = dcp_state.get_state_dict(model, optimizer)  # its param_groups
        dcp_state.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                 optim_state_dict={"state": state["optimizer"], "param_groups":
                                                   optimizer_state["param_groups"]})
        _set_random_states(state, model)
    except (CheckpointException, Exception) as error:  # CheckpointException is a BaseException
        raise ValueError(f"checkpoint {path} cannot be loaded: {_reason(error)}") from None
    return int(state["step"])


def latest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint of the latest step under out/checkpoints, if there is one."""
    return next(reversed(_checkpoints(out)), None)


def _checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints under out/checkpoints, oldest first."""
    found = [p for p in (out / "checkpoints").glob("step-*") if re.fullmatch(r"step-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                      step: int) -> dict[str, Any]:
    """Tensors only (no value is a pickle); the optimizer's param_groups follow from the options."""
    model_state, optimizer_state = dcp_state.get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state["state"],
            "step": torch.tensor(step), **_random_states(model)}


# chapters/a5-training-command.md, "Checkpoints, and what they trust"
MANIFEST = "manifest.json"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest.json of checkpoint `path`, once the folder's file names, then each file's
    SHA-256, match it (no stray folder or pipe is opened); a ValueError names what is wrong."""
    manifest = _read_sealed(path / MANIFEST, f"checkpoint {path}: its {MANIFEST}")
    fields: dict[str, type | tuple[type, ...]] = {"step": int, "processes": int, "files": dict,
                                                 "options": (dict, type(None))}
    if not (manifest.get("written_by") == "attnbook.train" and
            all(isinstance(manifest.get(k), kind) for k, kind in fields.items())):
        raise ValueError(f"checkpoint {path}: its {MANIFEST} is not attnbook.train's")
    manifest["options"] = manifest["options"] or {}
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    if wrong := sorted(present ^ manifest["files"].keys()) or sorted(  # the names, then hashes
            name for name in present if _sha256(path / name) != manifest["files"][name]):
        raise ValueError(f"checkpoint {path} is damaged: {', '.join(wrong)} (added, missing or "
                         f"changed) does not match the SHA-256 in its {MANIFEST}")
    return manifest


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a .metadata admitting only what DCP's metadata is made of (its dataclasses,
    torch.Size, dtypes, layouts, paths): anything else, such as os.system, is refused uncalled."""

    ADMITTED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                *((module, p) for module in ("pathlib", "pathlib._local")  # 3.13: _local
                  for p in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}

    def find_class(self, module: str, name: str) -> Any:
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
    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        rank = kwargs.get("rank")
        metadata = _read_metadata(Path(self.path),
                                  ".metadata" if rank is None else f"__{rank}.metadata")
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # as DCP
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TrustedPlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item: dcp.ReadItem, value: object) -> None:  # DCP unpickles these
        raise ValueError(f"it stores {read_item.dest_index.fqn} as a pickle, where "
                         f"attnbook.train stores tensors only: not read")


def _reason(error: BaseException) -> str:
    """The first line of what went wrong, from inside a CheckpointException if need be."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """The SHA-256 of a manifest's fields, which the manifest records beside them."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _write_sealed(path: Path, fields: dict[str, Any]) -> None:
    """`fields` as JSON with their SHA-256 beside them: a manifest.json, or a run's run.json."""
    _write_durably(path, json.dumps({**fields, "sha256": _manifest_digest(fields)}, indent=1))


def _read_sealed(path: Path, name: str = "", advice: str = "start afresh with another --out"
                 ) -> dict[str, Any]:
    """The fields of a file of _write_sealed, once they match its SHA-256; else a ValueError."""
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # missing, unreadable, not JSON, or not UTF-8
        raise ValueError(f"{name or path} cannot be read ({getattr(error, 'strerror', 0) or error})"
                         f": {advice}") from None
    if not isinstance(fields, dict) or fields.pop("sha256", None) != _manifest_digest(fields):
        raise ValueError(f"{name or path} is damaged, or not attnbook.train's (it does not match "
                         f"its own SHA-256): {advice}")
    return fields


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def _dcp_call() -> Iterator[None]:
    """Around a DCP call: no warning that it assumes one process (we know); a Ctrl-C as itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as error:  # DCP wraps even a Ctrl-C in it
            if any(isinstance(failed[0], KeyboardInterrupt) for failed in error.failures.values()):
                raise KeyboardInterrupt from None
            raise


# chapters/a5-training-command.md, "What a trained model holds"
MODEL_FORMAT = "attnbook.train model, version 1"


def _save_model(options: argparse.Namespace, model: nn.Module, tokenizer: CharTokenizer,
                rank: int) -> None:
    """Rank 0 writes out/model.pt, renamed over the old: all that rebuilds the model."""
    weights = dcp_state.get_model_state_dict(  # a collective: every process takes part
        model, options=dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    config = dataclasses.asdict(_unwrapped(model).config)
    saved = {"format": MODEL_FORMAT, "config": config, "vocabulary": "".join(tokenizer.itos),
             "model": weights, "step": options.steps, "options": _run_options(options)}
    partial = options.out / "model.pt.partial"
    torch.save(saved, partial)
    os.replace(partial, options.out / "model.pt")


def load_model(run: str | os.PathLike[str]) -> tuple[GPT, CharTokenizer]:
    """The model and tokenizer of a run's model.pt (`run` is the folder or the file), in eval
    mode; read with torch.load(weights_only=True), so that it holds data and no code."""
    check_instance("run", run, (str, os.PathLike))
    run = Path(run)
    path = run / "model.pt" if run.is_dir() else run
    if not path.is_file():
        started = run.is_dir() and any((run / name).exists() for name in RUN_FILES)
        advice = (f"its training did not finish; finish it with {PROGRAM} gpt --resume --out "
                  f"{run}" if started else f"train one first: {PROGRAM} gpt --out {run}")
        raise ValueError(f"run={str(run)!r} holds no model.pt: {advice}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(saved, dict) and saved.get("format") == MODEL_FORMAT):
            raise TypeError("not attnbook.train's model.pt (an older one holds weights only)")
        tokenizer, model = CharTokenizer(saved["vocabulary"]), GPT(GPTConfig(**saved["config"]))
        model.to(next(iter(saved["model"].values())).dtype).load_state_dict(saved["model"])
    except Exception as error:  # an UnpicklingError, a wrong type or size, a missing key
        raise ValueError(f"{path} cannot be read as a model (damaged, or not attnbook-train's "
                         f"model.pt): {_reason(error)}") from None
    return model.eval(), tokenizer


def sample(run: str | os.PathLike[str], prompt: str, tokens: int = 200,
           temperature: float = 0.8, seed: int = 0, top_k: int | None = 10) -> str:
    """`prompt` and `tokens` characters more by the model of a run (load_model), as chapter 10
    samples: drawn at `temperature` among the `top_k` likeliest (None: all), seeded by `seed`."""
    check_int("len(prompt)", len(check_instance("prompt", prompt, str)), minimum=1)
    tokens, seed = check_int("tokens", tokens, minimum=0), check_int("seed", seed, minimum=0)
    temperature = check_real("temperature", temperature, 0.0)
    model, tokenizer = load_model(run)
    if unknown := sorted(set(prompt) - set(tokenizer.itos)):
        raise ValueError(f"prompt holds characters the model has never seen: {unknown[:10]}")
    idx = tokenizer.encode(prompt)[None].to(model.tok_emb.weight.device)  # (1, T)
    out = model.generate(idx, tokens, temperature=temperature, top_k=top_k,
                         generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0])


def _unwrapped(model: nn.Module) -> GPT:  # the book's GPT, DDP's or not
    return cast(GPT, model.module if isinstance(model, DistributedDataParallel) else model)


if __name__ == "__main__":  # python -m attnbook.train
    main()
