# Do not edit: tools/tangle.py generates this file from chapters/a5-training-command.md.
"""The attnbook-train command line: its options, read without loading PyTorch, and its entry point.

Built and explained in the book's chapter chapters/a5-training-command.md.
"""

__all__ = [
    "PROGRAM",
    "RUN_OPTIONS",
    "RESUMABLE",
    "TRUST",
    "parse_options",
    "torchrun_environment",
    "check_run_options",
    "DEFAULTS",
    "main",
    "lock_out",
    "explain",
]

# chapters/a5-training-command.md, "The command and its options"
import argparse
import math
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, TextIO

from attnbook.checks import check_instance

try:
    import fcntl  # POSIX: the lock on a run's folder
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # None: no lock on this platform

PROGRAM = "attnbook-train"
# What fixes the model and the course of training (a step's data, its dropout, its update): a
# checkpoint records them, and a resumed run takes them from it (a different one is refused).
RUN_OPTIONS = ("model", "context", "d_model", "layers", "heads", "dropout", "lr", "warmup",
               "min_lr_ratio", "weight_decay", "clip", "seed", "dtype", "global_batch")
# What a resumed run also takes from its checkpoint, unless given again: these may change.
RESUMABLE = ("steps", "checkpoint_every", "keep_checkpoints", "eval_every", "strategy")
TRUST = ("What is trusted: nothing in --out or --run is run as code, as far as two loaders are sound. "
         "--resume reads a checkpoint only if every file matches the SHA-256 its manifest.json "
         "lists, then unpickles its .metadata admitting only torch.distributed.checkpoint's metadata "
         "types, and tensors and `sample`'s model.pt only with torch.load(weights_only=True) (broken "
         "before PyTorch 2.6: CVE-2025-32434). The hashes catch damage, not forgery: whoever can "
         "write to the folder can hand you other weights; resume and sample your own runs.")


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of `attnbook-train gpt ...` or `... sample ...`; a bad one exits naming it, a
    bad torchrun environment is a ValueError naming it. `options.given`: the RUN_OPTIONS and
    RESUMABLE given (the others hold defaults, which a resumed run replaces by its own)."""
    parser = argparse.ArgumentParser(prog=PROGRAM, epilog=TRUST, description=(
        "Train the book's character-level GPT (chapter 10) on its corpus, in one process or "
        "several under torchrun (DDP or FSDP2); or continue a prompt."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{gpt,sample}")
    gpt = commands.add_parser("gpt", help="train the GPT")
    gpt.set_defaults(model="gpt")
    _training_options(gpt.add_argument)
    again = gpt.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its latest checkpoint, with the "
                            "run's own options (or start it where it has none)")
    again.add_argument("--overwrite", action="store_true",
                       help="delete the run in --out (model.pt, log.jsonl, checkpoints/) first")
    sample = commands.add_parser("sample", help="continue a prompt with a trained model")
    _sample_options(sample.add_argument)
    options = parser.parse_args(argv)
    if options.command == "sample":
        if not options.prompt:
            sample.error("argument --prompt: must not be empty")
        return options
    options.given = [name for name in DEFAULTS if getattr(options, name) is not None]
    for name in set(DEFAULTS) - set(options.given):
        setattr(options, name, DEFAULTS[name])
    count = (torchrun_environment() or {"WORLD_SIZE": 1})["WORLD_SIZE"]  # or a ValueError
    if options.global_batch % count:
        gpt.error(f"argument --global-batch: {options.global_batch} sequences cannot be shared "
                  f"equally by {count} processes")
    if options.d_model % options.heads:
        gpt.error(f"argument --heads: {options.heads} heads do not divide --d-model {options.d_model}")
    return options


_TORCHRUN = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # torchrun sets with WORLD_SIZE


def torchrun_environment() -> dict[str, Any] | None:
    """The variables torchrun set for this process: None for one process (no WORLD_SIZE, or
    WORLD_SIZE=1 alone); a ValueError naming the variable that is missing, empty or out of range."""
    if "WORLD_SIZE" not in os.environ:
        return None
    world = _whole("WORLD_SIZE", 1, math.inf)
    missing = [name for name in _TORCHRUN if name not in os.environ]
    if world == 1 and len(missing) == len(_TORCHRUN):
        return None
    if missing:
        raise ValueError(f"WORLD_SIZE={world} is set, as torchrun sets it, but not "
                         f"{', '.join(missing)}: start it with torchrun, or unset WORLD_SIZE")
    if not os.environ["MASTER_ADDR"]:
        raise ValueError("MASTER_ADDR='' (set by torchrun) must name rank 0's host")
    return {"WORLD_SIZE": world, "RANK": _whole("RANK", 0, world - 1),
            "LOCAL_RANK": _whole("LOCAL_RANK", 0, world - 1),
            "MASTER_ADDR": os.environ["MASTER_ADDR"], "MASTER_PORT": _whole("MASTER_PORT", 1, 65535)}


def _whole(name: str, low: int, high: float) -> int:
    """Environment variable `name` as a whole number from `low` to `high`, or a ValueError."""
    text = os.environ[name]
    if not (text.isascii() and text.isdigit() and low <= int(text) <= high):
        upto = f" to {high}" if high < math.inf else ""
        raise ValueError(f"{name}={text!r} (set by torchrun) must be a whole number from {low}{upto}")
    return int(text)


def check_run_options(recorded: dict[str, Any]) -> list[str]:
    """What is wrong with a run's recorded options (RUN_OPTIONS and RESUMABLE, read back from a
    checkpoint or run.json), judged by the command line's own rules: [] if nothing."""
    recorded = check_instance("recorded", recorded, dict)
    wrong = [name for name in RUN_OPTIONS + RESUMABLE if name not in recorded]
    for name, rule in _training_options(lambda *args, **kwargs: None).items():  # add: no parser
        value = recorded.get(name)
        if name not in wrong and not (value in rule if isinstance(rule, list) else
                                      type(value) in (int, float) and _read(rule, value)):
            wrong.append(name)
    if not {"heads", "d_model"} & set(wrong) and recorded["d_model"] % recorded["heads"]:
        wrong.append("heads")  # the command line's rule across two options: heads divide d_model
    return sorted(set(wrong) | ({"model"} if recorded.get("model") != "gpt" else set()))


def _read(rule: Callable[[str], object], value: object) -> bool:
    try:
        return rule(repr(value)) == value
    except argparse.ArgumentTypeError:
        return False


def _version() -> str:
    try:
        return metadata.version("attnbook")
    except metadata.PackageNotFoundError:  # a source tree that pip never installed
        return "(not installed)"


# chapters/a5-training-command.md, "The command and its options"
DEFAULTS = {"steps": 500, "global_batch": 32, "context": 64, "d_model": 128, "layers": 2,
            "heads": 4, "dropout": 0.0, "lr": 6e-3, "warmup": 30, "min_lr_ratio": 0.1,
            "weight_decay": 0.1, "clip": 1.0, "seed": 0, "dtype": "float32", "strategy": "ddp",
            "checkpoint_every": 0, "keep_checkpoints": 3, "eval_every": 50}  # chapter 10's sizes
MAX_SEED, MAX_STEPS = 2**12 - 1, 2**20 - 1  # recipe.batch's streams: 12 bits of seed, 20 of step


def _training_options(add: Callable[..., object]) -> dict[str, Any]:
    rules: dict[str, Any] = {}  # what each option accepts (its choices or its type): returned

    def option(flag: str, text: str, **kwargs: Any) -> None:  # default None: we know what was given
        name = flag[2:].replace("-", "_")
        rules[name] = kwargs.get("choices") or kwargs["type"]
        add(flag, default=None, help=f"{text} (default {DEFAULTS[name]})", **kwargs)

    option("--steps", "optimizer steps in all", type=_number(int, 1, MAX_STEPS))
    option("--global-batch", "sequences per step, over all processes", type=_number(int, 1))
    option("--context", "tokens per sequence", type=_number(int, 1))
    option("--d-model", "model width", type=_number(int, 1))
    option("--layers", "Transformer blocks", type=_number(int, 1))
    option("--heads", "attention heads", type=_number(int, 1))
    option("--dropout", "dropout rate", type=_number(float, 0, 1))
    option("--lr", "the peak learning rate", type=_number(float, 0, open_low=True))
    option("--warmup", "steps of linear warm-up to --lr", type=_number(int, 0))
    option("--min-lr-ratio", "where the cosine decay ends, as a share of --lr",
           type=_number(float, 0, 1))
    option("--weight-decay", "AdamW's weight decay, on weight matrices only",
           type=_number(float, 0))
    option("--clip", "the gradient's largest norm; 0: no clipping", type=_number(float, 0))
    option("--seed", "weights and batch order", type=_number(int, 0, MAX_SEED))
    option("--dtype", "parameter dtype", choices=["float32", "float64"])
    option("--strategy", "under torchrun: replicate (ddp) or shard (fsdp) the model",
           choices=["ddp", "fsdp"])
    option("--checkpoint-every", "save a checkpoint every K steps, what --resume continues "
           "from; 0: none", type=_number(int, 0), metavar="K")
    option("--keep-checkpoints", "keep the latest N checkpoints, delete older ones",
           type=_number(int, 1), metavar="N")
    option("--eval-every", "the loss on held-out text every K steps and at the last",
           type=_number(int, 1), metavar="K")
    add("--print-every", type=_number(float, 0), default=10.0, metavar="SECONDS",
        help="a progress line at most every SECONDS, and at the first and last step (default 10)")
    add("--out", type=_folder, required=True,
        help="the run's folder: model.pt, log.jsonl and checkpoints/; it must not hold another "
             "run, unless --resume or --overwrite is given")
    return rules


def _sample_options(add: Callable[..., object]) -> None:
    add("--run", type=_folder, required=True, help="a run's folder (the --out of `gpt`)")
    add("--prompt", required=True, help="the text to continue")
    add("--tokens", type=_number(int, 0), default=200, help="characters to add (default 200)")
    add("--temperature", type=_number(float, 0), default=0.8,
        help="characters are drawn at this temperature (default 0.8); 0: the likeliest each time")
    add("--top-k", type=_number(int, 1), default=10,
        help="drawn among the K likeliest characters only (default 10)")
    add("--seed", type=_number(int, 0), default=0, help="the draws' seed (default 0)")


def _folder(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("must name a folder, got ''")
    return Path(text)


def _number(kind: type[int] | type[float], low: float, high: float = math.inf,
            open_low: bool = False) -> Callable[[str], float]:
    """An argparse `type` that reads a `kind` in [low, high] (open at low if open_low)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}"
                                             f", got {text!r}") from None
        if not (low <= value <= high) or (open_low and value == low) or not math.isfinite(value):
            wanted = (f"{'above' if open_low else 'at least'} {low}" if high == math.inf
                      else f"in [{low}, {high}]")
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value
    return parse


# chapters/a5-training-command.md, "The command and its options"
def main(argv: list[str] | None = None) -> None:  # noqa: F811 (notebook)
    """`attnbook-train ...`: --help, --version, a bad option or torchrun environment, and an --out
    that one process cannot lock end here, before PyTorch loads (`python -m attnbook.train` loads
    it first); then attnbook.train.run runs the command, and a status other than 0 is the exit's."""
    argv = sys.argv[1:] if argv is None else list(argv)
    options = argparse.Namespace(command=None)  # until parse_options reads them
    try:
        options = parse_options(argv)  # torchrun's variables: refused by every process alike
        if options.command == "gpt" and torchrun_environment() is None:  # one process: it locks
            options.lock = lock_out(options.out)  # --out now, and holds it until it ends
    except (ValueError, OSError) as error:  # an OSError: an --out that cannot be made
        print(f"{PROGRAM}: error: {explain(error, options)}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        from attnbook import train  # PyTorch loads here
    except KeyboardInterrupt:
        print(f"{PROGRAM}: stopped by Ctrl-C before it began", file=sys.stderr)
        raise SystemExit(130) from None
    if status := train.run(options, argv):
        raise SystemExit(status)


def lock_out(out: Path) -> TextIO | None:
    """An advisory lock on out/.lock, held until the file returned is closed or the process ends
    (None without fcntl: Windows); a ValueError for an `out` that is a file, or that a run holds."""
    folder = check_instance("out", out, Path)  # a str is refused by name
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} is a file: give a folder (it is created if missing)")
    if fcntl is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".lock"  # our pid's file: not a link (O_NOFOLLOW: nor one made after this)
    if path.is_symlink() or path.exists() and not (path.is_file() and path.stat().st_nlink == 1):
        raise ValueError(f"--out {folder}: its .lock is a link or not a file: remove it")
    lock = open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with lock:  # closed: another run holds it
            raise ValueError(f"--out {folder} is in use by another run (process "
                             f"{lock.read().strip() or 'unknown'}): wait for it to end, or give "
                             f"another --out") from None
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)
    return lock


def explain(error: Exception, options: argparse.Namespace) -> str:
    """Why a command of `options` failed: a refusal's own words, or the --run or --out of an OSError."""
    if not isinstance(error, OSError):
        return str(error)
    why = f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
    return (f"cannot read --run {options.run}: {why}" if options.command == "sample" else
            f"cannot use --out {options.out}: {why}; give a writable folder on a disk with room")


if __name__ == "__main__":  # python -m attnbook.train_command
    main()
