# Do not edit: tools/tangle.py generates this file from chapters/a6-checking-exercises.md and chapters/a7-exercise-cases.md.
"""A check of the reader's own answer to an exercise: seeded cases from small to hard, compared
with the package's reference, with a short report and a hint.

Built and explained in the book's chapters chapters/a6-checking-exercises.md and chapters/a7-exercise-cases.md.
"""

__all__ = [
    "TOLERANCES",
    "NARROWER",
    "Case",
    "Exercise",
    "CheckResult",
    "EXERCISES",
    "check",
]

# chapters/a6-checking-exercises.md, "Comparing an answer"
import copy
import gc
import math
import multiprocessing
import os
import pickle
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from attnbook.attention import scaled_dot_product_attention
from attnbook.checks import check_bool, check_callable, check_choice, check_real
from attnbook.efficient import linear_attention, sliding_window_mask
from attnbook.positions import apply_rope

TOLERANCES = {  # (absolute, relative): the relative one is 4.1 roundings of float16 (2^-11),
    "float16": (1e-3, 2e-3),  # 336 of float32 (2^-24) and 9.0e6 of float64 (2^-53); float16
    "float32": (2e-5, 2e-5),  # answers are rounded to float16 once
    "float64": (1e-10, 1e-9)}
NARROWER = {  # an input dtype: (the rounding of a narrower dtype, relative differences that fit,
    "float64": (("float32 rounding size", 1e-9, 1e-5, True),  # and whether a constant such as eps
                ("float16 or bfloat16 rounding size", 1e-5, 5e-2, True)),  # can give them too)
    "float32": (("float16 or bfloat16 rounding size", 1e-5, 5e-2, False),),
    "float16": (("float16 arithmetic or bfloat16 rounding size", 2e-3, 5e-2, False),)}
Built = tuple[dict[str, Any], Any]  # a case's inputs by name, and the answer it expects
Builder = Callable[[np.random.Generator], Built]  # a case's inputs from a seeded generator
_Found = tuple[str, float | None, tuple[int, ...] | None]  # problem, largest difference, where


def _kind(x: object) -> str:
    """What `x` is, in words: 'a torch.Tensor', 'a tuple of 2', 'None'."""
    if x is None:
        return "None"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__module__.split('.')[0]}.{type(x).__name__}".replace("a builtins.", "a ")


def _numbers(x: Any) -> np.ndarray:
    """An array or tensor of real numbers as float64 NumPy numbers (booleans become 0 and 1)."""
    if x.is_complex() if isinstance(x, torch.Tensor) else np.iscomplexobj(x):
        raise TypeError("complex numbers")
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


# chapters/a6-checking-exercises.md, "Comparing an answer"
def _difference(got: Any, expected: Any, tolerance: tuple[float, float], name: str = "output",
                narrowest: str = "float64") -> _Found | None:
    """(problem, largest difference, its index) where `got` is not `expected`, else None;
    `narrowest` is the least precise input's dtype, for the note on rounding."""
    if isinstance(expected, tuple):  # several outputs: compare them one by one
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"{name} is {_kind(got)}, expected a tuple of {len(expected)}", None, None
        for i, (g, e) in enumerate(zip(got, expected)):
            if found := _difference(g, e, tolerance, f"{name}[{i}]", narrowest):
                return found
        return None
    if not isinstance(got, torch.Tensor if isinstance(expected, torch.Tensor) else np.ndarray):
        return f"{name} is {_kind(got)}, expected {_kind(expected)}", None, None
    if tuple(got.shape) != tuple(expected.shape):
        return f"{name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}", None, None
    if isinstance(got, torch.Tensor) and got.dtype != expected.dtype:  # NumPy answers may widen
        wider = "compute wider if you like, then " if expected.is_floating_point() else ""
        return (f"{name} has dtype {got.dtype}, expected {expected.dtype}: return "
                f"{expected.dtype} ({wider}.to({expected.dtype}))", None, None)
    if isinstance(got, np.ndarray) and _narrower(got.dtype, expected.dtype):
        return (f"{name} has dtype {got.dtype}, expected {expected.dtype} or wider: a narrower "
                f"answer has lost digits", None, None)
    if isinstance(got, torch.Tensor) and (got.is_meta or got.layout != torch.strided):
        what = "on the meta device, with no numbers" if got.is_meta else f"of layout {got.layout}"
        return f"{name} is a tensor {what}, expected a dense tensor of numbers", None, None
    try:
        g = _numbers(got)
    except (TypeError, ValueError, RuntimeError):  # complex, strings, objects
        return f"{name} holds {got.dtype} values, expected real numbers", None, None
    e, (atol, rtol) = _numbers(expected), tolerance
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities differ by 0
        diff = np.where(g == e, 0.0, np.abs(g - e))
    diff = np.where(np.isnan(g) != np.isnan(e), np.inf, np.where(np.isnan(diff), 0.0, diff))
    if diff.size == 0 or np.all(diff <= atol + rtol * np.abs(np.nan_to_num(e))):
        return None
    where = tuple(map(int, np.unravel_index(int(np.argmax(diff)), diff.shape)))
    at = f"{name}[{', '.join(map(str, where))}]" if where else name  # a 0-d output: no index
    if str(expected.dtype) in ("bool", "torch.bool"):  # a mask: count entries
        wrong = int(np.count_nonzero(g != e))
        return (f"{wrong} of {e.size} entries differ, first at {at}: yours {bool(g[where])}, "
                f"expected {bool(e[where])}", float(diff[where]), where)
    digits = next((n for n in range(6, 18) if f"{g[where]:.{n}g}" != f"{e[where]:.{n}g}"), 17)
    return (f"largest difference {diff[where]:.3g} at {at}: yours {g[where]:.{digits}g}, expected "
            f"{e[where]:.{digits}g} (allowed: {atol:g} + {rtol:g} |expected|)"
            + _rounding_note(float(diff[where]) / max(1.0, abs(float(e[where]))), narrowest),
            float(diff[where]), where)


def _narrower(got: np.dtype, expected: np.dtype) -> bool:
    """True when both are floating and `got` has fewer bits than `expected`."""
    floating = np.issubdtype(got, np.floating) and np.issubdtype(expected, np.floating)
    return floating and np.finfo(got).bits < np.finfo(expected).bits


def _rounding_note(relative: float, narrowest: str) -> str:
    """A note when a relative difference lies in NARROWER's band for a narrower dtype."""
    wider = "float32 and round to float16 once" if narrowest == "float16" else f"{narrowest} or wider"
    eps = (" (or of a constant such as eps)", ", or check that constant")  # NARROWER's flag
    for rounding, low, high, eps_too in NARROWER.get(narrowest, ()):
        if low <= relative < high:
            also, check = eps if eps_too else ("", "")
            return f": a difference that may be {rounding}{also}: compute in {wider}{check}"
    return ""


# chapters/a6-checking-exercises.md, "Running a candidate"
def _call(candidate: Callable[..., object], args: tuple[object, ...],
          timeout: float) -> dict[str, Any]:
    """candidate(*args) in a daemon thread: {'value' or 'error', 'seconds'}, or {} after `timeout`."""
    box: dict[str, Any] = {}
    state = _global_state()

    def run() -> None:
        start = time.perf_counter()
        try:
            with np.errstate(all="ignore"):  # a NaN the reader's code makes is reported, not warned
                box["value"] = candidate(*args)
        except BaseException as error:  # the reader's exception, shown with its case
            box["error"] = error
        box["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, name="attnbook-exercise-check", daemon=True)
    thread.start()
    thread.join(min(timeout, threading.TIMEOUT_MAX))  # a day or a year: as long as the OS allows
    if not thread.is_alive():  # a function still running may change the state again later
        _restore(state)
    return {} if thread.is_alive() else box


def _global_state() -> tuple[Any, ...]:
    """What a candidate may change for everything after it: torch's default dtype, its number of
    threads, and the random states of torch and NumPy (gradient mode is the thread's own)."""
    return (torch.get_default_dtype(), torch.get_num_threads(), torch.get_rng_state(),
            np.random.get_state())


def _restore(state: tuple[Any, ...]) -> None:
    dtype, threads, torch_rng, numpy_rng = state
    torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.set_rng_state(torch_rng)
    np.random.set_state(numpy_rng)


def _change(before: Any, after: Any) -> str | None:
    """How `after` differs from what `before` held (NaN equals NaN), through tuples, or None."""
    if isinstance(before, (tuple, list)):
        return "in place" if len(before) != len(after) else next(
            filter(None, map(_change, before, after)), None)
    if isinstance(before, torch.Tensor) and (
            (before.requires_grad, before.grad is None) != (after.requires_grad, after.grad is None)):
        return "'s requires_grad or .grad: differentiate a detached copy (x.detach())"
    if isinstance(before, (np.ndarray, torch.Tensor)):
        same = (tuple(before.shape) == tuple(after.shape) and before.dtype == after.dtype
                and np.array_equal(_numbers(before), _numbers(after), equal_nan=True))
        return None if same else "in place"
    return None if before == after else "in place"


# chapters/a6-checking-exercises.md, "Running a candidate"
def _call_in_child(candidate: Callable[..., object], args: tuple[object, ...],
                   timeout: float) -> dict[str, Any]:
    """candidate(*args) in a forked child: _call's answer plus 'inputs' as the call left them,
    {'stopped': True} after `timeout`, {'crashed': a signal's name} or {'exited': its code}."""
    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    child = fork.Process(target=_answer_from_child, args=(candidate, args, send), daemon=True)
    child.start()
    send.close()  # the child holds the only writing end: its death ends the pipe
    try:
        box = _receive(receive, timeout)
    finally:  # a process, unlike a thread, can be stopped: one still running after its answer
        child.join(1.0)  # (a thread the candidate left, a huge send) is killed, never waited for
        if child.exitcode is None:
            child.kill()
            child.join()
        receive.close()
    if box is not None:
        return box
    code = child.exitcode  # the pipe closed with no answer: the child ended
    assert code is not None  # joined or killed above: it has an exit code
    if code >= 0:
        return {"exited": code}
    try:
        return {"crashed": signal.Signals(-code).name}
    except ValueError:
        return {"crashed": f"signal {-code}"}


def _receive(receive: Connection, timeout: float) -> dict[str, Any] | None:
    """The child's answer: first the call's own seconds, then the answer, each within `timeout`;
    None when the child ended without one."""
    wait = min(timeout, threading.TIMEOUT_MAX)
    try:
        if not receive.poll(wait):
            return {"stopped": True}
        seconds = pickle.loads(receive.recv_bytes())
        if not receive.poll(wait):  # the call ended in time; pickling and sending did not
            return {"too_large": seconds}
        return dict(pickle.loads(receive.recv_bytes()))
    except EOFError:
        return None
    except Exception:  # noqa: BLE001 (an answer whose class cannot be rebuilt here)
        return {"unsendable": "an object that cannot be rebuilt outside its child process"}


def _answer_from_child(candidate: Callable[..., object], args: tuple[object, ...],
                       send: Connection) -> None:
    """In the child: call, send the call's seconds, free what the call made, send the pickled
    answer (an exception as text, which needs no unpickling), and end without waiting for
    threads the candidate left running."""
    torch.set_num_threads(1)  # a forked OpenMP pool is not safe to use
    box = _call(candidate, args, math.inf)
    send.send_bytes(pickle.dumps(box["seconds"]))
    if "error" in box:
        box["error"] = _raised(box["error"])
    else:
        box["inputs"] = args
    try:
        payload = pickle.dumps(box)
    except Exception:  # noqa: BLE001 (a generator, a lock: anything pickle refuses)
        payload = pickle.dumps({"unsendable": _kind(box.get("value"))})
    del box
    gc.collect()  # a write out of bounds may abort here, when its memory is freed
    send.send_bytes(payload)
    send.close()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # not sys.exit: that would wait for the candidate's non-daemon threads


def _raised(error: BaseException) -> str:
    """'ShapeError: its message' for an exception, even one whose str() fails."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 (a reader's __str__ that raises)
        text = "(its message cannot be shown)"
    return f"{type(error).__name__}: {text}"


# chapters/a6-checking-exercises.md, "The exercises"
@dataclass(frozen=True)
class Case:
    """One input of an exercise: `build(rng)` gives (inputs by name, expected answer); `hint` says
    the likely mistake when this case is the first to fail, and where the chapter explains it."""

    name: str
    build: Builder
    hint: str


@dataclass(frozen=True)
class Exercise:
    """A title and its cases; `tolerance` (absolute, relative) replaces the dtype's when the
    answer only moves numbers: (0, 0), exact; `in_child()` True runs each call in a child
    process (where fork exists), and `crash_hint` says what a crash there means."""

    title: str
    cases: tuple[Case, ...]
    tolerance: tuple[float, float] | None = None
    in_child: Callable[[], bool] | None = None  # True: each call runs in a child process
    crash_hint: str | None = None  # what a crash of that process most likely means
    overflow_hint: str | None = None  # what overflows float16 here; None: the case's hint


@dataclass(frozen=True)
class CheckResult:
    """What `check` found: `passed`, or the first failing `case` (its number and name), its
    `inputs`, the `problem` in words, the `max_diff` and its index `where` when numbers differ
    (into the output the problem names, such as `output[2]` of a tuple; () for a 0-d output),
    and a `hint` (a crash's, an overflow's, the case's or a dtype's; None if none fits);
    `str(result)` is the report `check` prints."""

    exercise: str
    passed: bool
    cases_passed: int
    cases: int
    case: str | None = None
    inputs: str | None = None
    problem: str | None = None
    max_diff: float | None = None
    where: tuple[int, ...] | None = None
    hint: str | None = None
    title: str = ""

    def __str__(self) -> str:
        head = f"check {self.exercise} ({self.title})"
        if self.passed:
            return f"{head}: passed all {self.cases} cases."
        lines = [f"{head}: failed case {self.cases_passed + 1} of {self.cases}, \"{self.case}\""]
        for label, text in (("inputs", self.inputs), ("problem", self.problem), ("hint", self.hint)):
            if text is not None:
                lines.append(textwrap.fill(text, 96, initial_indent=f"  {label + ':':<9}",
                                           subsequent_indent=" " * 11, break_long_words=False))
        return "\n".join(lines)


# chapters/a6-checking-exercises.md, "The exercises"
def _describe(inputs: dict[str, Any]) -> str:
    """'X (6, 4) float64 with NaN at [3, 0], W_Q (4, 4) float64, ...'; a mask: see _mask_rows."""
    def one(x: Any) -> str:
        if isinstance(x, (tuple, list)):
            return "(" + ", ".join(map(one, x)) + ")"
        if not isinstance(x, (np.ndarray, torch.Tensor)):
            return repr(x)
        text = f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
        if text.endswith(" bool"):  # counted as booleans: no float64 copy of a large mask
            return text + _mask_rows(x.detach().cpu().numpy() if isinstance(x, torch.Tensor)
                                     else np.asarray(x, dtype=bool))
        nans = np.argwhere(np.isnan(_numbers(x)))
        return text + (f" with NaN at {nans[0].tolist()}" if len(nans) else "")
    return ", ".join(f"{name} {one(x)}" for name, x in inputs.items())


def _mask_rows(keep: np.ndarray) -> str:
    """' with 3 of 6 True, none in row [0]' or ', none in 2 rows, the first [0]' for a mask:
    its rows are along the last axis, and a row of length 0 has none."""
    text = f" with {np.count_nonzero(keep)} of {keep.size} True"
    if keep.ndim < 2:
        return text
    empty = np.argwhere(~keep.any(axis=-1))  # (rows with no True, ndim - 1)
    rows = " row" if len(empty) < 2 else f" {len(empty)} rows, the first"
    return text + (f", none in{rows} {empty[0].tolist()}" if len(empty) else "")


# chapters/a6-checking-exercises.md, "The exercises"
def _causal_rows(X: np.ndarray, W_Q: np.ndarray, W_K: np.ndarray, W_V: np.ndarray) -> np.ndarray:
    """Chapter 1: row i is query i's attention over positions 0..i alone."""
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    return np.concatenate([scaled_dot_product_attention(Q[i:i + 1], K[:i + 1], V[:i + 1])[0]
                           for i in range(len(X))])  # (L, dv)


def _tokens(length: int, d_model: int, d_k: int, d_v: int, dtype: npt.DTypeLike = np.float64,
            nan_at: int | None = None, scale: float = 1.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        X = rng.standard_normal((length, d_model)) * scale
        if nan_at is not None:
            X[nan_at, 0] = np.nan
        weights = [rng.standard_normal((d_model, d)) for d in (d_k, d_k, d_v)]
        inputs = dict(zip(("X", "W_Q", "W_K", "W_V"), (a.astype(dtype) for a in (X, *weights))))
        return inputs, _causal_rows(*inputs.values())
    return build


_CH1 = 'chapter 1, "{}"'
_F32 = "float32 input: compute in float32 or wider, never in float16, and return float32"
EXERCISES = {"1.2": Exercise("causal self-attention, one position at a time", (
    Case("one position", _tokens(1, 4, 4, 4),
         "with one position the output is its own value v_0 = x_0 W_V: position i reads "
         "positions 0..i, itself included, and the values come from W_V, the keys from W_K"),
    Case("four positions, d_k = 1", _tokens(4, 3, 1, 3),
         "position i reads positions 0..i only, never a later one: "
         + _CH1.format("From an average to attention")),
    Case("six positions, d_k = 16", _tokens(6, 8, 16, 4),
         "the scores are divided by sqrt(d_k) before the softmax: "
         + _CH1.format("Scaling, batches and masks")),
    Case("37 positions, d_k = 8, d_v = 5", _tokens(37, 16, 8, 5),
         "a longer sequence: check the loop's bounds, and that each row's softmax is over its own "
         "scores only"),
    Case("scores in the thousands", _tokens(5, 8, 8, 4, scale=30.0),
         "e^s overflows a float64 once s > 709.78: subtract each row's largest score before "
         "exponentiating: " + _CH1.format("Scores, softmax and the weighted sum")),
    Case("float32", _tokens(9, 8, 8, 8, np.float32), _F32),
    Case("a NaN in token 3", _tokens(6, 4, 4, 4, nan_at=3),
         "a NaN in token 3 reaches the outputs that read it (positions 3 and later) and no "
         "earlier one: keep each position from reading later ones, and never replace a NaN "
         "(the masked scaled_dot_product_attention is no reference here: its zero weights times "
         "the NaN value make every row NaN)"),
))}


# chapters/a6-checking-exercises.md, "The exercises"
def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Chapter 5: pairs (x_2i, x_2i+1) are apply_rope's pairs after reordering x_0, x_2, ..., x_1, x_3, ..."""
    d = x.shape[-1]
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # (d,)
    return apply_rope(x[..., order], positions)[..., order.argsort()]


def _rope_case(shape: tuple[int, ...], first_position: int = 0,
               dtype: npt.DTypeLike = np.float64, common: float = 0.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        x = torch.from_numpy((rng.standard_normal(shape) + common).astype(dtype))
        positions = torch.arange(first_position, first_position + shape[-2])
        return {"x": x, "positions": positions}, _rope_interleaved(x, positions)
    return build


_CH5 = 'chapter 5, "Rotary position embeddings (RoPE)"'
_OVERFLOW_HINT = ("float16 input, NaN or inf where the reference is finite: float16 stops at 65504, "
                  "and an intermediate result may have passed it: compute in float32 and round to "
                  "float16 once, at the end")
_EXP16 = _OVERFLOW_HINT + ("; in a softmax, e^s overflows once s > 11.09: subtract each row's "
                           "largest score first")  # the overflow hint where e^s is computed
_F16 = ("float16 input: compute in float32 and round to float16 once, at the end: float16 or "
        "bfloat16 arithmetic rounds every intermediate result (to 11 or 8 significant bits), and "
        "here that moves the answer by more than a few float16 roundings")
EXERCISES["5.1"] = Exercise("RoPE with interleaved pairs", (
    Case("position 0", _rope_case((1, 2)),
         "at position 0 every angle is 0: the output is x unchanged"),
    Case("one pair at positions 0 to 3", _rope_case((4, 2)),
         "the pair (x_0, x_1) at position m turns by the angle m, counter-clockwise: "
         "(x_0 cos m - x_1 sin m, x_0 sin m + x_1 cos m): " + _CH5),
    Case("eight coordinates at positions 10 to 14", _rope_case((2, 5, 8), 10),
         "pair i is the neighbours (x_2i, x_2i+1), turned by position * 10000^(-2i/d): check "
         "the pairing and the frequencies: " + _CH5),
    Case("37 positions, 16 coordinates, batch and heads", _rope_case((2, 3, 37, 16)),
         "a batch and heads in front: rotate the last axis, positions along the one before it"),
    Case("float16 at positions 3000 to 3006, coordinates with a large common part",
         _rope_case((2, 7, 16), 3000, dtype=np.float16, common=30.0),
         _F16 + ": compute the angles in float32 or wider (float16 rounds an angle near 3000 to a "
         "multiple of 2), and the turn too: the coordinates are near 30, where float16's steps "
         "are 1/64 and 1/32, and x_2i cos - x_2i+1 sin nearly cancels where cos is near sin"),
))


def _window_case(q_len: int, k_len: int, window: int) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        return ({"q_len": q_len, "k_len": k_len, "window": window},
                sliding_window_mask(q_len, k_len, window))
    return build


_CH6 = 'chapter 6, "{}"'
_WINDOW = "a window of w keeps the w most recent keys, the query's own included: p - w < j <= p"
EXERCISES["6.1"] = Exercise("a sliding-window mask", (
    Case("one query, one key, window 1", _window_case(1, 1, 1),
         "a query always sees its own position: the mask is [[True]]"),
    Case("4 x 4, window 1", _window_case(4, 4, 1), _WINDOW + ", so a window of 1 is the diagonal"),
    Case("7 x 7, window 3", _window_case(7, 7, 3), _WINDOW),
    Case("3 queries, 8 keys, window 3", _window_case(3, 8, 3),
         "queries are aligned bottom-right, as in causal_mask: query i stands at position "
         "i + k_len - q_len: " + _CH6.format("Which corner?")),
    Case("6 queries, 3 keys, window 2", _window_case(6, 3, 2),
         "the first q_len - k_len queries stand before every key and see none: their rows are all "
         "False: " + _CH6.format("Rows with nothing to see")),
    Case("a window wider than the keys", _window_case(5, 7, 10),
         "a window at least k_len wide is causal_mask itself: " + _CH6.format("The causal mask")),
))


# chapters/a6-checking-exercises.md, "The exercises"
def _partial(Q: np.ndarray, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, ...]:
    """Chapter 13: one worker's (m, l, a) over its keys: row maxima, sums of exponentials, and
    their products with V, not divided."""
    s = Q @ K.T / math.sqrt(Q.shape[-1])  # (Lq, Lk), in Q's dtype (a NumPy float64 would widen it)
    m = s.max(axis=-1)  # (Lq,)
    p = np.exp(s - m[:, None])
    return m, p.sum(axis=-1), p @ V


def _workers(lq: int, split: int, lk: int, d: int, scale: float = 1.0,
             dtype: npt.DTypeLike = np.float64, same_keys: bool = False, nan_key: int | None = None,
             idle: bool = False, both_idle: bool = False) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        Q = rng.standard_normal((lq, d)) * scale
        K, V = rng.standard_normal((lk, d)), rng.standard_normal((lk, 4))
        if same_keys:  # both workers hold the same keys: equal maxima
            K[split:] = K[:split]
        if nan_key is not None:
            K[nan_key, 0] = np.nan
        Q, K, V = (x.astype(dtype) for x in (Q, K, V))
        with np.errstate(invalid="ignore"):
            first, second, whole = (_partial(Q, K[r], V[r]) for r in
                                    (slice(0, split), slice(split, lk), slice(0, lk)))
        if idle:  # the first worker saw no keys: the merge is the second worker's sums
            first = (np.full(lq, -np.inf, dtype), np.zeros(lq, dtype), np.zeros((lq, 4), dtype))
            if both_idle:  # and for query 0, neither did the second
                second[0][0], second[1][0], second[2][0] = -np.inf, 0.0, 0.0
            whole = second
        return {"part1": first, "part2": second}, whole
    return build


_CH13 = 'chapter 13, "Softmax from a stream of blocks"'
EXERCISES["13.2"] = Exercise("merging two workers' partial softmaxes", (
    Case("equal maxima", _workers(1, 2, 4, 4, same_keys=True),
         "with equal maxima the merge is a sum: l = l1 + l2, a = a1 + a2, and m is unchanged"),
    Case("different maxima", _workers(3, 5, 12, 8),
         "bring both sums to the common maximum before adding: m = np.maximum(m1, m2), "
         "l = l1 e^(m1 - m) + l2 e^(m2 - m), and a likewise: " + _CH13),
    Case("scores in the thousands", _workers(2, 3, 7, 8, scale=1000.0),
         "exponentiate only differences m_i - m, which are <= 0: e^m itself overflows a float64 once m > 709.78"),
    Case("one key against 300", _workers(7, 1, 301, 16),
         "an uneven split: each query has its own maximum, so rescale row by row"),
    Case("a worker that saw no keys", _workers(3, 4, 9, 8, idle=True),
         "a worker with no keys has m = -inf, l = 0 and a = 0, and adds nothing: "
         "e^(-inf - m) = 0 where m is the other worker's finite maximum"),
    Case("a query neither worker saw a key for", _workers(3, 4, 9, 8, idle=True, both_idle=True),
         "with no keys on either side the merge is (-inf, 0, 0), as a row with no allowed key: "
         "e^(-inf - (-inf)) is NaN, so subtract 0 where m = -inf: " + _CH13),
    Case("float32", _workers(4, 6, 11, 8, dtype=np.float32), _F32),
    Case("a NaN in one key", _workers(3, 4, 9, 8, nan_key=2),
         "a NaN in a key makes every query's scores NaN, and the merge must keep it: "
         "np.maximum keeps a NaN, np.fmax and max() drop it"),
))


def _linear_case(shape: tuple[int, ...], dv: int, dtype: npt.DTypeLike = np.float64,
                 v_mean: float = 0.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        qk = rng.standard_normal((2, *shape))
        values = rng.standard_normal((*shape[:-1], dv)) + v_mean
        q, k, v = (torch.from_numpy(x.astype(dtype)) for x in (*qk, values))
        return {"q": q, "k": k, "v": v}, linear_attention(q, k, v, causal=True)
    return build


_CH17 = 'chapter 17, "Linear attention"'
EXERCISES["17.3"] = Exercise("causal linear attention", (
    Case("one position", _linear_case((1, 1, 4), 4),
         "the first position sees only itself, so its output is v_0 (up to eps): the sums run "
         "over keys 0..i, i included, and the output is divided by phi(q_i) . z_i: " + _CH17),
    Case("five positions", _linear_case((1, 5, 4), 3),
         "output i reads keys 0..i only: running sums (torch.cumsum) of phi(k_j) v_j^T and of "
         "phi(k_j) up to j = i, not sums over every key: " + _CH17),
    Case("a batch of 2, 3 heads, 9 positions", _linear_case((2, 3, 9, 8), 5),
         "a batch and heads in front: sum along the positions (axis -2), one state per batch "
         "and head"),
    Case("70 positions", _linear_case((1, 2, 70, 8), 6),
         "a longer sequence: check the running sums' bounds"),
    Case("float16, 2048 positions", _linear_case((1, 1, 2048, 8), 4, np.float16, v_mean=3.0),
         "float16 input: sum in float32 and round to float16 once, at the end: the running sums "
         "reach thousands here"),
), overflow_hint=_OVERFLOW_HINT + " (here the numerator phi(q_i) . S_i passes it in some rows)")


# chapters/a6-checking-exercises.md, "The check"
def check(exercise_id: str, candidate: Callable[..., object], *, timeout: float = 10.0,
          show: bool = True) -> CheckResult:
    """Appendix F: run `candidate` on exercise `exercise_id`'s cases in order, stop at the first
    that fails, print the report (unless `show` is False) and return the CheckResult. Each
    call may take `timeout` seconds (math.inf: no limit). A wrong answer never raises; a wrong
    argument to check does."""
    exercise = EXERCISES[check_choice("exercise_id", exercise_id, EXERCISES)]
    candidate = check_callable("candidate", candidate)
    timeout = _check_timeout(timeout)
    show = check_bool("show", show)
    result = _run_cases(exercise_id, exercise, candidate, timeout)
    if show:
        print(result)
    return result


def _check_timeout(timeout: object) -> float:
    """A number of seconds above 0, or math.inf for no limit."""
    if isinstance(timeout, (float, np.floating)) and timeout == math.inf:
        return math.inf
    if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 10**300:
        raise ValueError(f"timeout must be a number of seconds above 0 that a float can hold, "
                         f"or math.inf for no limit; got a timeout of {len(str(timeout))} digits")
    return check_real("timeout", timeout, 0.0, open_low=True)


def _run_cases(exercise_id: str, exercise: Exercise, candidate: Callable[..., object],
               timeout: float) -> CheckResult:
    """The first case `candidate` fails, or a pass."""
    count = len(exercise.cases)
    for number, case in enumerate(exercise.cases):
        inputs, expected = case.build(np.random.default_rng([sum(map(ord, exercise_id)), number]))
        kept = copy.deepcopy(inputs)
        in_child = exercise.in_child is not None and exercise.in_child() and \
            "fork" in multiprocessing.get_all_start_methods()
        done = (_call_in_child if in_child else _call)(candidate, tuple(inputs.values()), timeout)
        inputs = dict(zip(inputs, done.pop("inputs", inputs.values())))
        if found := _judge(done, inputs, kept, expected, timeout, exercise.tolerance):
            return CheckResult(exercise_id, False, number, count, case.name, _describe(kept),
                               *found, _hint(found, done, case, exercise, expected, _narrowest(kept)),
                               exercise.title)
    return CheckResult(exercise_id, True, count, count, title=exercise.title)


def _lost_finite(got: Any, expected: Any) -> bool:
    """True when float16 `got` (of `expected`'s shape) is NaN or inf where `expected` is finite."""
    if isinstance(expected, tuple):
        return isinstance(got, (tuple, list)) and any(map(_lost_finite, got, expected))
    if str(getattr(got, "dtype", "")).removeprefix("torch.") != "float16":
        return False  # a wider answer (NumPy's may be) need not have passed float16's range
    try:
        g, e = _numbers(got), _numbers(expected)
    except (TypeError, ValueError, RuntimeError, AttributeError):  # not numbers
        return False
    return g.shape == e.shape and bool(np.any(~np.isfinite(g) & np.isfinite(e)))


def _judge(done: dict[str, Any], inputs: dict[str, Any], kept: dict[str, Any], expected: Any,
           timeout: float, tolerance: tuple[float, float] | None = None) -> _Found | None:
    """(problem, largest difference, its index) for one call, or None when it is right."""
    if not done:
        return f"no answer after {timeout:g} s (it goes on in the background until it returns)", None, None
    for outcome, problem in _CHILD_OUTCOMES.items():  # a child process that gave no answer
        if outcome in done:
            return problem.format(timeout=timeout, **done), None, None
    if "error" in done:  # from a child process, the exception comes as text
        error = done["error"]
        return f"raised {error if isinstance(error, str) else _raised(error)}", None, None
    if done["seconds"] > timeout:  # one long call that holds the GIL cannot be interrupted
        return (f"took {done['seconds']:.3g} s, more than the {timeout:g} s allowed", None, None)
    for name in inputs:
        if how := _change(kept[name], inputs[name]):
            where = name + how if how.startswith("'") else f"{name} {how}: work on a copy"
            return f"changed its input {where}", None, None
    narrowest = _narrowest(kept)
    return _difference(done["value"], expected, tolerance or TOLERANCES[narrowest],
                       narrowest=narrowest)


_CHILD_OUTCOMES = {  # _call_in_child's outcomes other than an answer or an error, in words
    "stopped": "no answer after {timeout:g} s: its process was stopped",
    "unsendable": "output is {unsendable}, which cannot leave its child process: return a tensor",
    "too_large": "answered in {too_large:.3g} s, but the answer was too large to send back from "
                 "its child process within {timeout:g} s",
    "crashed": "its process crashed ({crashed}) on this case; your notebook goes on",
    "exited": "its process exited with code {exited} (os._exit or sys.exit) before answering; "
              "your notebook goes on",
}


def _hint(found: _Found, done: dict[str, Any], case: Case, exercise: Exercise,
          expected: Any, narrowest: str = "float64") -> str | None:
    """A crash: the exercise's crash hint; a float16 answer NaN or inf where `expected` is finite:
    its overflow hint, if any; numbers that differ or a raise on this case's inputs: the case's hint
    (after a word on a noted rounding for float64 inputs); a wrong float dtype: the dtype's."""
    if "crashed" in done:
        return exercise.crash_hint
    if found[1] == math.inf and exercise.overflow_hint and _lost_finite(done["value"], expected):
        return exercise.overflow_hint
    if found[1] is not None or found[0].startswith("raised "):
        rounding = "rounding size" in found[0] and narrowest == "float64"  # NARROWER's labels
        return "rule out the rounding noted above first; if it stays: " * rounding + case.hint
    return _DTYPE_HINT if "float" in found[0].partition(", expected ")[2].split(":")[0] else None


_DTYPE_HINT = ("return the dtype the reference returns: compute wider if you like (x.double(), "
               "x.astype(np.float64)), then convert the answer back")


def _narrowest(inputs: dict[str, Any]) -> str:
    """The least precise floating dtype among the inputs ('float64' when none is floating)."""
    def dtypes(x: Any) -> list[str]:
        if isinstance(x, (tuple, list)):
            return [d for item in x for d in dtypes(item)]
        return [str(x.dtype).removeprefix("torch.")] if hasattr(x, "dtype") else []
    found = [d for x in inputs.values() for d in dtypes(x) if d in TOLERANCES]
    return max(found, key=lambda d: TOLERANCES[d], default="float64")


# chapters/a7-exercise-cases.md, "Chapter 2"
def _ch2_backward_case(shape: tuple[int, ...], dtype: npt.DTypeLike = np.float64,
                       spread: float = 1.0, masked: int | slice | None = None,
                       nan_row: int | None = None, grad_offset: float = 0.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        # imported here, not at the top, so that appendix F's import cell need not change
        from attnbook.scaling import softmax_jacobian

        scores = rng.standard_normal(shape) * spread
        grad = rng.standard_normal(shape) + grad_offset  # J g ignores a constant added to g
        if masked is not None:  # a key index, or slice(None) for a row with every key masked
            scores[..., masked] = -np.inf
        if nan_row is not None:
            scores[nan_row, 0] = np.nan
        scores, grad = scores.astype(dtype), grad.astype(dtype)
        jacobian = softmax_jacobian(scores.astype(np.float64))  # (..., n, n), symmetric
        expected = (jacobian @ grad.astype(np.float64)[..., None])[..., 0]
        return {"scores": scores, "grad": grad}, expected.astype(dtype)
    return build


_CH2 = 'chapter 2, "What saturation does to gradients"'
EXERCISES["2.3"] = Exercise("the gradient through the softmax", (
    Case("one key", _ch2_backward_case((1,)),
         "with one key p = 1 whatever the score, so no gradient reaches it: p * (g - p . g) is 0"),
    Case("eight keys", _ch2_backward_case((8,)),
         "J g = p * (g - p . g): each weight's gradient minus the weighted mean of all of them, "
         "times p: " + _CH2),
    Case("a batch of rows, 3 x 5 x 6", _ch2_backward_case((3, 5, 6)),
         "each row is its own softmax: p . g is a sum over the last axis only (keepdims=True)"),
    Case("scores in the thousands", _ch2_backward_case((4, 7), spread=1000.0),
         "e^s overflows a float64 once s > 709.78: subtract each row's largest score before "
         "exponentiating"),
    Case("a masked key", _ch2_backward_case((3, 6), masked=2),
         "a masked key (score -inf) has p = 0 and gets no gradient: " + _CH2),
    Case("a row with every key masked", _ch2_backward_case((1, 2), masked=slice(None)),
         "a row with no allowed key has p = 0 (the package's rule), so its gradient is 0, not "
         "NaN: a stable softmax subtracts a maximum of -inf; subtract 0 there: " + _CH2),
    Case("float32", _ch2_backward_case((5, 9), np.float32), _F32),
    Case("float16, 300 keys, gradients near 1000", _ch2_backward_case(
        (4, 300), np.float16, spread=4.0, grad_offset=1000.0),
         _F16 + ": g and p . g are near 1000, where float16's steps are 0.5, while their "
         "difference g - p . g is a few units at most; compute the softmax and p . g in "
         "float32"),
    Case("a NaN score in row 1", _ch2_backward_case((3, 5), nan_row=1),
         "a NaN score makes its row's weights, and so its row's gradient, NaN; the other rows "
         "stay as they are: never replace a NaN (np.nan_to_num)"),
), overflow_hint=_EXP16)


# chapters/a7-exercise-cases.md, "Chapter 3"
def _ch3_heads_case(batch: int, length: int, d_model: int, heads: int,
                    dtype: npt.DTypeLike = np.float64, nan_at: tuple[int, int] | None = None,
                    common: float = 0.0, qk_scale: float = 1.0) -> Builder:
    """`common`: the size of a part every token shares (scores of tens, far from 0, that
    differ by tens in a row); `qk_scale` multiplies W_Q and W_K."""
    def build(rng: np.random.Generator) -> Built:
        from attnbook.layers import MultiHeadAttention

        x = rng.standard_normal((batch, length, d_model))
        if common:
            x = x + common * rng.standard_normal(d_model)  # (d_model,): the same in every token
        if nan_at is not None:  # (sequence, position)
            x[nan_at + (0,)] = np.nan
        weights = rng.standard_normal((4, d_model, d_model)) / np.sqrt(d_model)
        weights[:2] *= qk_scale
        x, weights = x.astype(dtype), weights.astype(dtype)  # the inputs, rounded to dtype
        layer = MultiHeadAttention(d_model, heads, bias=False).double()  # float64; weight = W.T
        names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight")
        layer.load_state_dict(dict(zip(names, (torch.from_numpy(W.T) for W in weights))))
        with torch.no_grad():
            expected = layer(torch.from_numpy(x).double()).numpy()
        inputs = dict(zip(("x", "W_Q", "W_K", "W_V", "W_O"), (x, *weights)))
        return {**inputs, "num_heads": heads}, expected.astype(dtype)
    return build


_CH3 = 'chapter 3, "One matrix, many heads"'
EXERCISES["3.3"] = Exercise("multi-head self-attention in NumPy", (
    Case("one position, one head", _ch3_heads_case(1, 1, 4, 1),
         "one position reads only itself: its output is x W_V W_O"),
    Case("five positions, one head of 16", _ch3_heads_case(1, 5, 16, 1),
         "the scores are divided by sqrt(d_head) before the softmax, over the keys (last axis): "
         + _CH3),
    Case("six positions, four heads of 4", _ch3_heads_case(1, 6, 16, 4),
         "head h is columns h * d_head to (h + 1) * d_head of each projection, divided by "
         "sqrt(d_head), not sqrt(d_model): reshape to (B, L, H, d_head), then move H before L; "
         + _CH3),
    Case("a batch of 3, 37 positions, 8 heads", _ch3_heads_case(3, 37, 32, 8),
         "a batch in front: split and join the heads of every sequence the same way"),
    Case("float32", _ch3_heads_case(2, 9, 16, 4, np.float32), _F32),
    Case("float16, tokens with a large common part", _ch3_heads_case(
        2, 33, 32, 4, np.float16, common=3.0, qk_scale=2.0),
         _F16 + ": the tokens share a large part, so the scores reach tens, where "
         "float16's steps are up to 1/16, and a rounded score moves its weight by up to a few percent; "
         "x.astype(np.float32) and the weights likewise, then .astype(np.float16) at the end. "
         "Chapter 3's MultiHeadAttention run in float16 fails this case too: its projections "
         "round q, k and v to float16 (the exercise asks for float32 arithmetic)"),
    Case("a NaN in sequence 0, position 2", _ch3_heads_case(2, 5, 8, 2, nan_at=(0, 2)),
         "every position reads position 2's key and value, so sequence 0's outputs are all NaN "
         "and sequence 1's are not: never replace a NaN (np.nan_to_num)"),
), overflow_hint=_EXP16)


# chapters/a7-exercise-cases.md, "Chapter 4"
def _draw_qkv(rng: np.random.Generator, shape: tuple[int, int, int, int, int, int],
              dtype: torch.dtype, nan_key: tuple[int, int] | None,
              key_common: float) -> tuple[torch.Tensor, ...]:
    """q (B, H, Lq, d), k and v (B, H_kv, Lk, d) for shape (B, H, H_kv, Lq, Lk, d): normal draws
    rounded to dtype, in float64. `key_common`: the size of a part every key of a head shares
    (each row's scores shift by one large constant); `nan_key`: (key/value head, position) of
    sequence 0's key made NaN."""
    batch, heads, kv_heads, lq, lk, d = shape
    q_draw = rng.standard_normal((batch, heads, lq, d))
    k_draw, v_draw = rng.standard_normal((2, batch, kv_heads, lk, d))
    if key_common:
        k_draw = k_draw + key_common * rng.standard_normal((batch, kv_heads, 1, d))
    if nan_key is not None:
        k_draw[(0, *nan_key, 0)] = np.nan
    return tuple(torch.from_numpy(a).to(dtype).double() for a in (q_draw, k_draw, v_draw))


def _ch4_grouped_case(batch: int, heads: int, kv_heads: int, length: int, d: int,
                      dtype: torch.dtype = torch.float64, nan_key: tuple[int, int] | None = None,
                      key_common: float = 0.0, split_layout: bool = False) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.layers import attend, causal_mask

        q, k, v = _draw_qkv(rng, (batch, heads, kv_heads, length, length, d), dtype, nan_key,
                            key_common)
        expected = attend(q, k, v, causal_mask(length))[0].to(dtype)
        if split_layout:  # (B, L, H, d) in memory, as chapter 3's head split leaves them
            q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}, expected
    return build


_CH4 = 'chapter 4, "Sharing keys and values"'
_F16_KEYS = (_F16 + ": the keys share a large part, so the scores are large, and a score rounded "
             "to float16 moves its weight by up to about 1%, several times float16's tolerance; "
             "compute the scores (and any bias), softmax and sums in float32 (q.float()), then "
             ".half()")  # 4.2, 11.1 and 19.3
EXERCISES["4.2"] = Exercise("causal grouped-query attention", (
    Case("one position", _ch4_grouped_case(1, 2, 1, 1, 4),
         "one position reads only itself: each query head's output is its group's v_0"),
    Case("four positions, one head", _ch4_grouped_case(1, 1, 1, 4, 8),
         "position i reads keys 0..i, itself included, and the scores are divided by sqrt(d): "
         'chapter 3, "The attention core"'),
    Case("8 query heads sharing 2 key/value heads", _ch4_grouped_case(1, 8, 2, 5, 4),
         "a group is consecutive heads: query heads 0..3 read key/value head 0, heads 4..7 head 1 "
         "(q.reshape(B, H_kv, G·L, d), the mask tiled G times; repeat_interleave if you copy): "
         + _CH4),
    Case("a batch of 2, 12 heads, 3 key/value heads, 37 positions",
         _ch4_grouped_case(2, 12, 3, 37, 8),
         "a batch in front: group the heads of every sequence the same way"),
    Case("float32", _ch4_grouped_case(2, 6, 2, 9, 8, torch.float32), _F32),
    Case("float16, keys with a large common part", _ch4_grouped_case(
        2, 8, 2, 40, 16, torch.float16, key_common=8.0), _F16_KEYS),
    Case("q, k and v as a layer's head split leaves them (not contiguous)", _ch4_grouped_case(
        2, 8, 2, 5, 4, split_layout=True), "q.view cannot merge G and L here: use q.reshape"),
    Case("a NaN in key/value head 1's key at position 3", _ch4_grouped_case(
        2, 6, 2, 7, 4, nan_key=(1, 3)),
         "a NaN key reaches the outputs that read it, group 1's query heads at positions 3 and "
         "later in sequence 0, and no other: mask the scores with masked_fill (a NaN times a "
         "zero weight, or plus -inf, stays NaN), and never replace a NaN (torch.nan_to_num)"),
), overflow_hint=_EXP16)


# chapters/a7-exercise-cases.md, "Chapter 7"
def _ch7_rms_case(shape: tuple[int, ...], dtype: torch.dtype = torch.float64, offset: float = 0.0,
                  scale: float = 1.0, nan_at: int | None = None) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.layers import RMSNorm

        x = torch.from_numpy(rng.standard_normal(shape) * scale + offset).to(dtype)
        if nan_at is not None:  # a position
            x[nan_at, 0] = float("nan")
        weight = torch.from_numpy(rng.standard_normal(shape[-1])).to(dtype)
        norm = RMSNorm(shape[-1]).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            return {"x": x, "weight": weight}, norm(x)
    return build


_CH7 = 'chapter 7, "Normalisation"'
EXERCISES["7.1"] = Exercise("RMSNorm as a function", (
    Case("one position, one feature", _ch7_rms_case((1, 1)),
         "with one feature x / sqrt(x^2 + eps) is nearly the sign of x, times weight (eps inside the "
         "root; subtracting the mean, as LayerNorm does, would give 0): " + _CH7),
    Case("float64: three positions of 8 features", _ch7_rms_case((3, 8)),
         "x / sqrt(mean(x^2) + eps) times weight, computed in x's dtype when it is float32 or "
         "wider: x.float() narrows float64 to float32; widen float16 only: " + _CH7),
    Case("positions with a mean far from 0", _ch7_rms_case((3, 8), offset=5.0),
         "RMSNorm does not subtract the mean (that is LayerNorm): it divides x by "
         "sqrt(mean(x^2) + eps): " + _CH7),
    Case("a batch of 2, 5 positions, 16 features", _ch7_rms_case((2, 5, 16)),
         "each position is normalised on its own: the mean of x^2 is over the last axis only "
         "(keepdim=True): " + _CH7),
    Case("small numbers, where eps counts", _ch7_rms_case((4, 8), scale=1e-3),
         "eps is added inside the square root, to mean(x^2), with its default 1e-6: " + _CH7),
    Case("float16 numbers in the hundreds", _ch7_rms_case((3, 16), torch.float16, scale=300.0),
         "float16 input: square and average in float32 (300^2 = 90000 is past float16's largest "
         "number, 65504), and return float16"),
    Case("a NaN at position 1", _ch7_rms_case((3, 8), nan_at=1),
         "a NaN makes its position's mean(x^2), and so that whole position, NaN; the other "
         "positions stay as they are: never replace a NaN")))


# chapters/a7-exercise-cases.md, "Chapter 8"
def _ch8_embedding_case(batch: int, length: int, vocab: int = 20, d: int = 8,
                        dtype: torch.dtype = torch.float64, nan_word: bool = False,
                        word_common: float = 0.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.bert import BERTConfig, BERTEmbeddings

        ids, segments = (torch.from_numpy(rng.integers(0, n, (batch, length))) for n in (vocab, 2))
        config = BERTConfig(vocab_size=vocab, d_model=d, num_layers=1, num_heads=1, d_ff=d,
                            context_length=64, dropout=0.0)
        layer = BERTEmbeddings(config).double().eval()
        tables = {name: torch.from_numpy(rng.standard_normal(shape)) for name, shape in
                  (("word", (vocab, d)), ("position", (64, d)), ("token_type", (2, d)),
                   ("gamma", (d,)), ("beta", (d,)))}
        tables["word"] += word_common  # LayerNorm subtracts it again: the answer ignores it
        tables = {name: t.to(dtype).double() for name, t in tables.items()}  # dtype's numbers
        if nan_word:  # a NaN in the vector of the first token's id
            tables["word"][ids[0, 0], 0] = float("nan")
        layer.load_state_dict(dict(zip(  # the tables, in order, under the layer's own names
            ("word.weight", "position.weight", "token_type.weight", "norm.weight", "norm.bias"),
            tables.values())))
        with torch.no_grad():
            expected = layer(ids, segments).to(dtype)
        tables = {name: t.to(dtype) for name, t in tables.items()}
        return {"ids": ids, "segments": segments, **tables}, expected
    return build


_CH8 = 'chapter 8, "Inputs: tokens, positions and segments"'
EXERCISES["8.2"] = Exercise("BERT's input layer", (
    Case("one token", _ch8_embedding_case(1, 1),
         "the vector is LayerNorm(word[id] + position[0] + token_type[segment]), with gamma, beta "
         "and eps = 1e-12: " + _CH8),
    Case("seven tokens", _ch8_embedding_case(1, 7),
         "the position table is indexed by the positions 0..L-1, not by the ids: " + _CH8),
    Case("a batch of 3 sequences of 37 tokens", _ch8_embedding_case(3, 37),
         "every sequence uses positions 0..L-1, and the LayerNorm is over the last axis only"),
    Case("float32 tables", _ch8_embedding_case(2, 9, dtype=torch.float32), _F32),
    Case("float16 tables, word vectors with a large common part", _ch8_embedding_case(
        2, 9, d=64, dtype=torch.float16, word_common=200.0),
         _F16 + ": add the three vectors and normalise in float32 (tables.float()), then .half(): "
         "the word vectors are near 200, where float16's steps are 0.125, so a float16 sum loses "
         "what LayerNorm keeps once it subtracts the mean; eps = 1e-12 is 0 in float16"),
    Case("a NaN in one word's vector", _ch8_embedding_case(2, 6, nan_word=True),
         "a NaN in a word's row of the table makes every token with that id NaN after the "
         "LayerNorm, and no other token: never replace a NaN")))


# chapters/a7-exercise-cases.md, "Chapter 9"
def _ch9_mlm_case(chosen: list[list[bool]], vocab: int = 11, dtype: torch.dtype = torch.float64,
                  spread: float = 1.0, nan_chosen: bool = False,
                  nan_ignored: bool = False) -> Builder:
    """`chosen`: one list per sequence, True where the position carries a label."""
    def build(rng: np.random.Generator) -> Built:
        keep = torch.tensor(chosen)  # (B, L) bool
        logits = torch.from_numpy(rng.standard_normal((*keep.shape, vocab)) * spread)
        if nan_chosen:  # a NaN logit at the first chosen position
            logits[tuple(keep.nonzero()[0].tolist()) + (0,)] = float("nan")
        if nan_ignored:  # a NaN and an inf logit at the first two positions whose label is -100
            first, second = (tuple(at.tolist()) for at in (~keep).nonzero()[:2])
            logits[first + (0,)], logits[second + (1,)] = float("nan"), float("inf")
        labels = torch.where(keep, torch.from_numpy(rng.integers(0, vocab, keep.shape)), -100)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                     ignore_index=-100)
        return {"logits": logits.to(dtype), "labels": labels}, expected.to(dtype)
    return build


_CH9 = 'chapter 9, "{}"'
EXERCISES["9.3"] = Exercise("the masked-language-model loss", (
    Case("one chosen position", _ch9_mlm_case([[True]]),
         "the loss of a position is -log p of its label: logsumexp(logits) - logits[label], "
         "from the logits over the vocabulary (the last axis): " + _CH9.format(
             "Masked language modelling")),
    Case("one sequence, three of eight positions chosen",
         _ch9_mlm_case([[False, True, False, False, True, True, False, False]]),
         "a position whose label is -100 carries no loss and does not count: divide by the "
         "number of chosen positions, not by L, and never index the logits with -100: "
         + _CH9.format("Masked language modelling")),
    Case("4 sequences with 1, 3, 0 and 6 chosen positions", _ch9_mlm_case(
        [[i < n for i in range(6)] for n in (1, 3, 0, 6)], vocab=17),
         "the mean is over every chosen position of the batch, not a mean of each sequence's "
         "mean: a sequence with more blanks weighs more (and one with none weighs nothing)"),
    Case("logits in the thousands", _ch9_mlm_case([[True, False, True]], spread=1000.0),
         "e^s overflows a float64 once s > 709.78: subtract each position's largest logit "
         "before exponentiating (torch.logsumexp does)"),
    Case("float32 logits", _ch9_mlm_case([[True, True, False], [False, True, True]],
                                         dtype=torch.float32), _F32),
    Case("no chosen position", _ch9_mlm_case([[False, False], [False, False]]),
         "with no chosen position the loss has no mean: NaN (0 / 0, as cross_entropy gives), "
         "not 0, which would read as a perfect model"),
    Case("a NaN logit at a chosen position", _ch9_mlm_case(
        [[False, True, True], [True, False, False]], nan_chosen=True),
         "a NaN logit at a chosen position makes its loss, and so the mean, NaN: never replace "
         "a NaN (torch.nan_to_num)"),
    Case("a NaN and an inf logit at positions labelled -100", _ch9_mlm_case(
        [[True, False, True], [False, True, True]], nan_ignored=True),
         "select the chosen positions (logits[labels != -100]): an unchosen position's logits "
         "are never read, while a loss multiplied by a 0/1 mask keeps NaN * 0 = NaN: "
         + _CH9.format("Masked language modelling"))))


# chapters/a7-exercise-cases.md, "Chapter 10"
def _ch10_schedule_case(steps: int, lr: float, warmup: int, min_lr_ratio: float) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.recipe import Recipe, learning_rate

        recipe = Recipe(lr=lr, warmup=warmup, min_lr_ratio=min_lr_ratio)
        expected = [learning_rate(recipe, step, steps) for step in range(1, steps + 1)]
        return ({"steps": steps, "lr": lr, "warmup": warmup, "min_lr_ratio": min_lr_ratio},
                torch.tensor(expected, dtype=torch.float64))
    return build


_CH10 = 'chapter 10, "The training recipe"'
EXERCISES["10.2"] = Exercise("the warm-up and cosine learning-rate schedule", (
    Case("one step, no warm-up", _ch10_schedule_case(1, 0.5, 0, 0.1),
         "without a warm-up the first step has the full rate lr: the cosine starts at "
         "done = 0 (and dividing by warmup = 0 is never needed): " + _CH10),
    Case("four steps, all warm-up", _ch10_schedule_case(4, 1.0, 4, 0.1),
         "steps count from 1: warm-up step s has the rate lr * s / warmup, so step 1 is "
         "lr / warmup, not 0, and the last warm-up step has lr: " + _CH10),
    Case("ten steps of cosine down to 0", _ch10_schedule_case(10, 1.0, 0, 0.0),
         "after the warm-up, done = (step - 1 - warmup) / (steps - warmup) runs from 0 at the "
         "first step after it, so the first cosine step has lr and the last is just above the "
         "floor; compute in float64 (torch.arange(1, steps + 1, dtype=torch.float64)): " + _CH10),
    Case("500 steps, 30 of warm-up, floor 0.1", _ch10_schedule_case(500, 1.0, 30, 0.1),
         "the cosine runs over the steps after the warm-up and falls to min_lr_ratio * lr, not "
         "to 0: lr * (low + (1 - low) * (1 + cos(pi * done)) / 2), a scaled cosine, not one "
         "clamped at the floor: " + _CH10),
    Case("a warm-up longer than the run", _ch10_schedule_case(12, 1.0, 30, 0.1),
         "a run that ends inside its warm-up only rises: lr * step / warmup, never reaching lr"),
    Case("a floor of 1: a constant rate after the warm-up", _ch10_schedule_case(20, 2.0, 7, 1.0),
         "min_lr_ratio = 1 keeps the rate at lr once the warm-up is over")))


# chapters/a7-exercise-cases.md, "Chapter 11"
def _ch11_cross_case(lengths: list[int], lt: int, heads: int = 2, d: int = 4,
                     dtype: torch.dtype = torch.float64, nan_key: tuple[int, int] | None = None,
                     key_common: float = 0.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:  # q, k, v drawn as chapter 4's (one group)
        from attnbook.layers import attend

        batch, ls = len(lengths), max(lengths)
        q, k, v = _draw_qkv(rng, (batch, heads, heads, lt, ls, d), dtype, nan_key, key_common)
        src_keep = torch.arange(ls)[None, :] < torch.tensor(lengths)[:, None]  # (B, Ls)
        inputs = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "src_keep": src_keep}
        return inputs, attend(q, k, v, src_keep[:, None, None, :])[0].to(dtype)
    return build


_CH11 = 'chapter 11, "The model"'
EXERCISES["11.1"] = Exercise("cross-attention over a padded source", (
    Case("one source token, one target token", _ch11_cross_case([1], 1),
         "with one source token every target position reads its value: the output is v_0"),
    Case("six source tokens, four target tokens", _ch11_cross_case([6], 4),
         "cross-attention has no causal mask: every target position reads the whole source, "
         "the scores divided by sqrt(d): " + _CH11),
    Case("sources of 3, 7 and 5 tokens, padded to 7", _ch11_cross_case([3, 7, 5], 6),
         "src_keep is True at real source tokens: hide the keys where it is False, along the "
         "keys' axis (src_keep[:, None, None, :]), never the queries: " + _CH11),
    Case("a source that is all padding", _ch11_cross_case([0, 3], 2),
         "a target position with no source token to read gets zeros (the package's rule), not "
         "NaN from masking with -inf nor the mean of v from masking with -1e9: " + _CH11),
    Case("float32", _ch11_cross_case([9, 4], 5, dtype=torch.float32), _F32),
    Case("float16, keys with a large common part", _ch11_cross_case(
        [40, 17], 16, heads=2, d=16, dtype=torch.float16, key_common=16.0), _F16_KEYS),
    Case("a NaN in a source key", _ch11_cross_case([4, 3], 3, nan_key=(0, 0)),
         "a NaN in a real source token's key makes that head's scores, and so its outputs for "
         "that sequence, NaN: never replace a NaN (torch.nan_to_num)"),
), overflow_hint=_EXP16)


# chapters/a7-exercise-cases.md, "Chapter 12"
def _ch12_keys_case(q_len: int, k_len: int) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.layers import causal_mask
        return {"q_len": q_len, "k_len": k_len}, causal_mask(q_len, k_len).sum(-1)  # (Lq,) int64
    return build


_CH12 = 'chapter 12, "Counting the work"'
EXERCISES["12.3"] = Exercise("the keys each query sees under a causal mask", (
    Case("one query, one key", _ch12_keys_case(1, 1),
         "a query sees its own position: the count is [1], not [0]: " + _CH12),
    Case("4 queries, 4 keys", _ch12_keys_case(4, 4),
         "query i of a square mask sees keys 0..i, i + 1 of them: " + _CH12),
    Case("one new query, 2049 cached keys", _ch12_keys_case(1, 2049),
         "the mask is bottom-right: the queries are the last q_len positions, so one new query "
         "sees every cached key, not only the first: " + _CH12),
    Case("3 queries, 8 keys", _ch12_keys_case(3, 8),
         "query i stands at position i + k_len - q_len and sees i + k_len - q_len + 1 keys"),
    Case("6 queries, 3 keys", _ch12_keys_case(6, 3),
         "the first q_len - k_len queries stand before every key and see none: a count is never "
         "below 0 (clamp it): " + _CH12),
    Case("1000 queries, 4096 keys", _ch12_keys_case(1000, 4096),
         "a longer mask, with more keys than queries: a count is at most k_len, and query i's "
         "is i + k_len - q_len + 1; an off-by-one in the offset shows here: " + _CH12),
))


# chapters/a7-exercise-cases.md, "Chapter 14"
def _ch14_roofline_case(intensity: npt.ArrayLike, gpu: str, ridge: bool = False) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.tiling import GPUS, roofline_seconds
        spec = GPUS[gpu]
        values = np.asarray(intensity, dtype=np.float64)
        if ridge:
            values = np.append(values, spec.peak_flops(2) / spec.bandwidth)
        moved = 1e9  # bytes; the FLOPs are intensity x bytes
        expected = np.array([  # a NaN intensity has no roof: NaN (roofline_seconds refuses it)
            np.nan if np.isnan(i) else i * moved / roofline_seconds(i * moved, moved, gpu)
            for i in values.ravel()]).reshape(values.shape)
        return {"intensity": values, "gpu": gpu}, expected
    return build


_CH14 = 'chapter 14, "The roofline: which side binds"'
EXERCISES["14.2"] = Exercise("the roofline: attainable FLOP/s against arithmetic intensity", (
    Case("intensity 1 on the H100", _ch14_roofline_case([1.0], "H100"),
         "at 1 FLOP per byte the memory binds: the kernel reaches intensity x bandwidth, the "
         "longer of the two times, not their sum: " + _CH14),
    Case("intensity 1000 on the H100", _ch14_roofline_case([1000.0], "H100"),
         "above the ridge point the arithmetic binds: the roof is the float16 peak, "
         "GPUS[gpu].peak_flops(2), never more: " + _CH14),
    Case("a grid of intensities on the T4", _ch14_roofline_case(
        np.geomspace(0.1, 1e4, 15).reshape(3, 5), "T4"),
         "an array of any shape: take the lower roof element by element (np.minimum), not with "
         "Python's min"),
    Case("no arithmetic at all, and the A100's ridge point",
         _ch14_roofline_case([0.0, 2e3], "A100", ridge=True),
         "at intensity 0 a kernel does no arithmetic: 0 FLOP/s; at the ridge both roofs meet"),
    Case("a NaN among the intensities", _ch14_roofline_case([[2.0, np.nan], [np.nan, 900.0]], "H100"),
         "a NaN intensity gives NaN, not a roof: np.minimum keeps a NaN, while np.fmin (in either "
         "order), Python's min(peak, x) and np.where(x < peak, x, peak) turn it into the peak "
         "(min(x, peak) and np.where(peak < x, peak, x) happen to keep it)"),
))


# chapters/a7-exercise-cases.md, "Chapter 15"
def _ch15_rows(shape: tuple[int, int, int], lq: int, lk: int, causal: bool, spread: float = 1.0,
               strided: bool = False) -> Builder:
    """Chapter 15, exercise 3: q (B, H, lq, D) and k (B, H, lk, D) in float32, and the natural
    logsumexp of each row of q k^T / sqrt(D) by the package's forward kernel (-inf: no key)."""
    def build(rng: np.random.Generator) -> Built:
        from attnbook import kernels  # imports Triton: only once a case is built

        device = "cpu" if kernels.INTERPRETED else "cuda"
        (b, h, d), scale = shape, shape[-1] ** -0.5
        q, k = (torch.from_numpy(rng.standard_normal((b, h, n, d))).float().to(device)
                for n in (lq, lk))
        q = q * spread
        if strided:  # the same numbers, stored with stride 1 along the rows, not along D
            q, k = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k))
        _, lse = kernels._forward(q, k, k, causal, scale)  # (B, H, lq), base 2
        return ({"q": q, "k": k, "causal": causal},
                torch.where(lse.isinf(), float("-inf"), lse / kernels._LOG2E))
    return build


def _ch15_interpreted() -> bool:
    """Triton's interpreter runs the reader's kernel (no GPU): a crash would end the notebook,
    so appendix F's check runs each call in a child process."""
    from attnbook import kernels
    return kernels.INTERPRETED


_CH15 = 'chapter 15, "{}"'
EXERCISES["15.3"] = Exercise("the logsumexp of each query row, in Triton", (
    Case("one query, one key", _ch15_rows((1, 1, 16), 1, 1, False),
         "one key: the logsumexp is its score q . k / sqrt(D). The kernel works in base 2 (the "
         "scores are scaled by log2(e)): divide m + log2(l) by log2(e) for natural logarithms"),
    Case("70 queries, 100 keys", _ch15_rows((1, 2, 32), 70, 100, False),
         "lengths that are not multiples of the tile: mask the loads, and give the keys past Lk a "
         "score of -inf, not 0: " + _CH15.format("The forward kernel")),
    Case("causal, 40 queries, 100 keys", _ch15_rows((1, 2, 32), 40, 100, True),
         "the causal mask is aligned bottom-right: query i sees key j iff j <= i + Lk - Lq "
         "(_key_range, _scores): " + _CH15.format("The forward kernel")),
    Case("causal, 100 queries, 40 keys", _ch15_rows((1, 2, 32), 100, 40, True),
         "the first Lq - Lk rows see no key: their logsumexp is -inf, not NaN; subtract 0 where "
         "the running maximum is still -inf: " + _CH15.format("The forward kernel")),
    Case("a batch of 2 and 3 heads", _ch15_rows((2, 3, 16), 65, 33, True),
         "each program finds its batch and head with _program, and writes its row of the output "
         "at bh * Lq: " + _CH15.format("The Triton programming model")),
    Case("scores in the thousands", _ch15_rows((1, 2, 32), 50, 80, False, spread=300.0),
         "exponentiate scores minus the running maximum: exp2 of a score in the thousands "
         "overflows float32: " + _CH15.format("From tiles to programs")),
    Case("q and k strided along D", _ch15_rows((1, 2, 32), 37, 45, False, strided=True),
         "read q and k through their own four strides each: neither is contiguous along D: "
         + _CH15.format("The Triton programming model")),
), in_child=_ch15_interpreted, crash_hint=(
    "a load or store outside a tensor's memory: mask every tl.load and tl.store by the rows "
    "and keys that exist (mask=rows < Lq, other=0.0): " + _CH15.format("The forward kernel")))


# chapters/a7-exercise-cases.md, "Chapter 16"
def _ch16_backward_case(shape: tuple[int, ...], lq: int, lk: int, causal: bool = False,
                        dtype: npt.DTypeLike = np.float64, nan_query: int | None = None,
                        common: tuple[float, float] = (0.0, 0.0)) -> Builder:
    """(B, H) batch and heads, lq queries and lk keys of width d = shape[-1]; `common`: the
    sizes of a part every key, and every value, of a head shares."""
    def build(rng: np.random.Generator) -> Built:
        from attnbook.layers import attend, causal_mask
        *lead, d = shape
        draws = [rng.standard_normal((*lead, n, d)) for n in (lq, lk, lk, lq)]  # q, k, v, dout
        if any(common):  # a part shared by every key, and every value, of a head
            draws[1:3] = (x + size * rng.standard_normal((*lead, 1, d))
                          for x, size in zip(draws[1:3], common))
        q, k, v, dout = (torch.from_numpy(x.astype(dtype)) for x in draws)
        if nan_query is not None:
            q[..., nan_query, 0] = float("nan")
        wide = [x.double().requires_grad_() for x in (q, k, v)]
        out = attend(wide[0], wide[1], wide[2], mask=causal_mask(lq, lk) if causal else None)[0]
        grads = torch.autograd.grad(out, wide, dout.double())
        return ({"q": q, "k": k, "v": v, "dout": dout, "causal": causal},
                tuple(g.to(q.dtype) for g in grads))
    return build


_CH16 = 'chapter 16, "The backward pass"'
EXERCISES["16.1"] = Exercise("the backward pass of attention", (
    Case("one query, one key", _ch16_backward_case((1, 1, 4), 1, 1),
         "with one key the weight is 1 whatever the score, so dq and dk are 0 and dv is dout: "
         "the softmax's Jacobian subtracts each row's delta = dout . out: " + _CH16),
    Case("5 queries, 7 keys, d = 1", _ch16_backward_case((1, 1, 1), 5, 7),
         "delta_i = sum_j P_ij dP_ij runs along query i's row (the keys, dim=-1); dv = P^T dout "
         "and dk = scale dS^T q sum over the queries: check each axis: " + _CH16),
    Case("6 queries and keys, d = 16", _ch16_backward_case((1, 1, 16), 6, 6),
         "the scores are scale q k^T with scale = 1/sqrt(d): the same scale multiplies dq and "
         "dk: " + _CH16),
    Case("causal, 7 queries and keys", _ch16_backward_case((1, 1, 8), 7, 7, causal=True),
         "masked weights are 0 in P, and so in dS: compute P with the mask, then the formulas "
         "as they are"),
    Case("causal, 3 queries, 10 keys", _ch16_backward_case((1, 1, 8), 3, 10, causal=True),
         "the causal mask is bottom-right: query i sees keys j <= i + Lk - Lq"),
    Case("causal, 6 queries, 3 keys", _ch16_backward_case((1, 1, 8), 6, 3, causal=True),
         "a query that sees no key has P = 0 in its row, so zero gradients, not NaN: "
         + _CH16),
    Case("a batch of 2, 3 heads, 70 positions", _ch16_backward_case((2, 3, 16), 70, 70, True),
         "a batch and heads in front: transpose the last two axes only (k.transpose(-2, -1))"),
    Case("float32", _ch16_backward_case((1, 2, 16), 33, 40, True, np.float32), _F32),
    Case("float16, keys and values with large common parts", _ch16_backward_case(
        (1, 2, 16), 33, 40, True, np.float16, common=(4.0, 30.0)),
         _F16 + ": with values far from 0, dP = dout v^T is large and dP - delta nearly cancels, "
         "and float16's steps are about 1/16 for the typical |dP| of about 100; compute P, "
         "delta and the products in float32, then return float16 gradients"),
    Case("a NaN in query 2", _ch16_backward_case((1, 1, 4), 4, 5, nan_query=2),
         "a NaN in query 2 makes its row of P NaN: dq's row 2 and every dk and dv are NaN, the "
         "other rows of dq are not: never replace a NaN (torch.nan_to_num)"),
), overflow_hint=_EXP16)


# chapters/a7-exercise-cases.md, "Chapter 18"
def _ch18_patches_case(batch: int, channels: int, size: int, p: int,
                       dtype: npt.DTypeLike = np.float64, nan_pixel: bool = False) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.vit import patchify
        images = torch.from_numpy(rng.standard_normal((batch, channels, size, size)).astype(dtype))
        if nan_pixel:  # one pixel of the last image
            images[-1, 0, 1, 2] = float("nan")
        return {"patches": patchify(images, p), "image_size": size, "channels": channels}, images
    return build


_CH18 = 'chapter 18, "An image as a sequence of patches"'
EXERCISES["18.1"] = Exercise("unpatchify, the inverse of patchify", (
    Case("one 2 x 2 image, patches of one pixel", _ch18_patches_case(1, 1, 2, 1),
         "with p = 1 each patch is one pixel, in row-major order: left to right, then down"),
    Case("4 x 4, patches of 2 x 2", _ch18_patches_case(1, 1, 4, 2),
         "patches come row by row of patches, and each is flattened row by row: put the patch "
         "row before the offset within it on each axis: " + _CH18),
    Case("6 x 6, three channels, patches of 3 x 3", _ch18_patches_case(1, 3, 6, 3),
         "each patch is flattened channel first, (C, p, p), not with the channel last: " + _CH18),
    Case("one patch covering an 8 x 8 image", _ch18_patches_case(2, 2, 8, 8),
         "a single patch is the whole image, flattened as (C, H, W)"),
    Case("a batch of 5, 12 x 12, two channels, patches of 4 x 4", _ch18_patches_case(5, 2, 12, 4),
         "a batch in front: keep each image's patches apart"),
    Case("float16", _ch18_patches_case(3, 1, 8, 2, np.float16),
         "rearranging moves numbers without changing them: keep the patches' dtype, and "
         "never round through another one"),
    Case("a NaN pixel", _ch18_patches_case(2, 2, 4, 2, nan_pixel=True),
         "a NaN pixel is moved like any number: it lands at its own place in its own image, "
         "and nowhere else")), tolerance=(0.0, 0.0))


# chapters/a7-exercise-cases.md, "Chapter 19"
def _ch19_alibi_case(batch: int, heads: int, lq: int, lk: int, d: int,
                     dtype: torch.dtype = torch.float64, nan_key: tuple[int, int] | None = None,
                     key_common: float = 0.0) -> Builder:
    def build(rng: np.random.Generator) -> Built:
        from attnbook.layers import causal_mask
        from attnbook.positions import alibi_bias

        q, k, v = _draw_qkv(rng, (batch, heads, heads, lq, lk, d), dtype, nan_key, key_common)
        scores = q @ k.transpose(-2, -1) / d**0.5 + alibi_bias(heads, lq, lk, dtype=torch.float64)
        weights = scores.masked_fill(~causal_mask(lq, lk), float("-inf")).softmax(dim=-1)
        return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}, (weights @ v).to(dtype)
    return build


_CH19 = 'chapter 19, "BLOOM\'s weights"'
_CH5_ALIBI = 'chapter 5, "ALiBi: a penalty for distance"'
EXERCISES["19.3"] = Exercise("causal attention with ALiBi, as in BLOOM", (
    Case("one head, one position", _ch19_alibi_case(1, 1, 1, 1, 4),
         "one position reads only itself, at distance 0, where the bias is 0: the output is v_0"),
    Case("one head, 200 positions, d = 1", _ch19_alibi_case(1, 1, 200, 200, 1),
         "query i reads keys 0..i only, and each score q . k / sqrt(d) gets the bias "
         "-m (i - j) before the softmax: a penalty, subtracted, that grows with the distance; "
         "one head's slope is m = 2^-8: " + _CH5_ALIBI),
    Case("one head, 200 positions, d = 16", _ch19_alibi_case(1, 1, 200, 200, 16),
         "divide q . k by sqrt(d), then add the bias: the bias itself is not divided by sqrt(d): "
         + _CH5_ALIBI),
    Case("eight heads, seven positions", _ch19_alibi_case(1, 8, 7, 7, 4),
         "for a power of two n, head h (from 0) has slope 2^(-8 (h + 1) / n): 1/2, 1/4, ..., "
         "1/256 for eight heads, in that order; the first is not 1: " + _CH5_ALIBI),
    Case("six heads, BLOOM's count in chapter 19", _ch19_alibi_case(1, 6, 7, 7, 4),
         "six is not a power of two, and 2^(-8 (h + 1) / 6) is not BLOOM's rule: take the four "
         "slopes of 4 heads, then every other slope of 8 heads (the first, the third) for the "
         "two heads left: " + _CH19),
    Case("one new query after nine cached keys", _ch19_alibi_case(1, 2, 1, 10, 4),
         "the queries are the last Lq of the Lk positions, as after a KV cache: query i stands "
         "at i + Lk - Lq, reads every key up to there, and its distance to key j is "
         "i + Lk - Lq - j: " + _CH5_ALIBI),
    Case("a batch of 2, 12 heads, 5 queries after 40 keys", _ch19_alibi_case(2, 12, 5, 40, 8),
         "12 heads: the 8 slopes of 8 heads, then the first, third, fifth and seventh of 16 "
         "heads', such as 2^-0.5, in the inputs' dtype (a float32 slope of 2^-0.5 is off by "
         "1e-8): " + _CH19),
    Case("float32", _ch19_alibi_case(2, 3, 9, 9, 8, torch.float32), _F32),
    Case("float16, keys with a large common part", _ch19_alibi_case(
        2, 4, 40, 40, 16, torch.float16, key_common=8.0), _F16_KEYS),
    Case("a NaN in head 1's key at position 3", _ch19_alibi_case(2, 3, 7, 7, 4, nan_key=(1, 3)),
         "a NaN key reaches the queries that read it, head 1's at positions 3 and later in "
         "sequence 0, and no other: hide the later keys with masked_fill (a NaN plus -inf stays "
         "NaN), and never replace a NaN (torch.nan_to_num)"),
), overflow_hint=_EXP16)
