# Do not edit: tools/tangle.py generates this file from chapters/12-cost.md.
"""What attention costs: operations, time, the memory of the scores, of saved tensors and of the KV
cache.

Built and explained in the book's chapter chapters/12-cost.md.
"""

__all__ = [
    "attention_flops",
    "time_call",
    "loglog_slope",
    "score_matrix_bytes",
    "numpy_peak_bytes",
    "saved_tensor_bytes",
    "kv_cache_bytes_per_token",
]

# chapters/12-cost.md, "Counting the work"
import math
import time
import tracemalloc
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from attnbook.checks import (
    check_array,
    check_bool,
    check_callable,
    check_device,
    check_instance,
    check_int,
    check_real,
    type_error,
)


def attention_flops(q_len: int, k_len: int, head_dim: int, num_heads: int = 1, batch: int = 1,
                    causal: bool = False, value_dim: int | None = None) -> int:
    """FLOPs of the two matrix products, 2 * q_len * k_len * (head_dim + value_dim) per head and
    sequence (value_dim defaults to head_dim); `causal` counts only a bottom-right mask's pairs."""
    q_len, k_len, head_dim, num_heads, batch = _check_counts(
        q_len=q_len, k_len=k_len, head_dim=head_dim, num_heads=num_heads, batch=batch)
    value_dim = head_dim if value_dim is None else check_int("value_dim", value_dim, minimum=1)
    n = min(q_len, k_len)  # causal: the last n queries see k_len - n + 1, ..., k_len keys
    pairs = n * (2 * k_len - n + 1) // 2 if check_bool("causal", causal) else q_len * k_len
    return 2 * batch * num_heads * pairs * (head_dim + value_dim)


def _check_counts(**counts: object) -> list[int]:  # each of `counts`, an int >= 1, in order
    return [check_int(name, value, minimum=1) for name, value in counts.items()]


# chapters/12-cost.md, "Measuring the time"
def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
              min_time_s: float = 0.0, device: str | torch.device | None = None) -> float:
    """The fastest of `repeats` or more runs of fn() (up to 10,000 until `min_time_s` is spent),
    in seconds, after `warmup` untimed ones; on a CUDA `device`, synchronising around each."""
    check_callable("fn", fn)
    repeats, warmup = check_int("repeats", repeats, minimum=1), check_int("warmup", warmup, 0)
    min_time_s = check_real("min_time_s", min_time_s, 0.0)
    cuda = device is not None and check_device("device", device).type == "cuda"
    wait: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    best, spent, runs = math.inf, 0.0, 0
    while runs < repeats or (spent < min_time_s and runs < 10_000):
        wait()
        begin = time.perf_counter()
        fn()
        wait()
        seconds = time.perf_counter() - begin
        best, spent, runs = min(best, seconds), spent + seconds, runs + 1
    return best


# chapters/12-cost.md, "Measuring the time"
def loglog_slope(x: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """The least-squares slope of log(y) against log(x): p for y = c * x**p."""
    xs, ys = (check_array(name, v).astype(np.float64) for name, v in (("x", x), ("y", y)))
    for name, v in (("x", xs), ("y", ys)):
        if v.ndim != 1 or v.size < 2 or not (np.isfinite(v) & (v > 0)).all():
            raise ValueError(f"{name} must be 1-D, of 2+ finite positive numbers, got {name}={v}")
    if xs.size != ys.size or np.ptp(xs) == 0:
        raise ValueError(f"x and y must have the same length and x must vary, got x={xs}, y={ys}")
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


# chapters/12-cost.md, "The memory of the score matrix"
def score_matrix_bytes(q_len: int, k_len: int, num_heads: int = 1, batch: int = 1,
                       dtype_bytes: int = 4) -> int:
    """Bytes of one (batch, num_heads, q_len, k_len) matrix of `dtype_bytes` numbers."""
    return math.prod(_check_counts(q_len=q_len, k_len=k_len, num_heads=num_heads, batch=batch,
                                   dtype_bytes=dtype_bytes))


# chapters/12-cost.md, "The memory of the score matrix"
def numpy_peak_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """(fn(), the peak bytes tracemalloc traced during the call beyond those held before): NumPy's
    arrays, not PyTorch's tensors. Works with tracemalloc running or not, and nested in itself,
    but resets tracemalloc's peak (it has no way to restore it): read your own peak before."""
    check_callable("fn", fn)
    if started := not tracemalloc.is_tracing():
        tracemalloc.start()
    peak = tracemalloc.get_traced_memory()[1]  # what enclosing calls saw, before the reset:
    _PEAKS[:] = [max(p, peak) for p in _PEAKS] + [0]
    tracemalloc.reset_peak()
    before = _PEAKS[-1] = tracemalloc.get_traced_memory()[0]
    try:
        result = fn()
        peak = max(_PEAKS[-1], tracemalloc.get_traced_memory()[1]) - before
    finally:
        _PEAKS.pop()
        if started:
            tracemalloc.stop()
    return result, peak


_PEAKS: list[int] = []  # the peak so far of each numpy_peak_bytes in progress, outermost first


# chapters/12-cost.md, "What training keeps"
def saved_tensor_bytes(fn: Callable[[], object], exclude: Sequence[torch.Tensor] = ()
                       ) -> tuple[object, int]:
    """(fn(), bytes of the tensors autograd saves for the backward pass while fn runs): each block
    of memory once, leaving out 0-d tensors and those sharing memory with one in `exclude`. Meta
    tensors are refused: with no memory, their blocks cannot be told apart."""
    check_callable("fn", fn)
    if not isinstance(exclude, Iterable) or isinstance(exclude, torch.Tensor):
        raise type_error("exclude", exclude, "a sequence of tensors, such as model.parameters()")
    exclude = [check_instance(f"exclude[{i}]", t, torch.Tensor) for i, t in enumerate(exclude)]
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_meta:  # every meta block's address is 0: all would count as one
            raise ValueError("saved_tensor_bytes counts memory: fn saved a tensor on the meta device")
        if t.dim() > 0 and storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(saved.values())


# chapters/12-cost.md, "The KV cache"
def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                             dtype_bytes: int = 2) -> int:
    """Bytes a KV cache adds per token: 2 * num_layers * num_kv_heads * head_dim * dtype_bytes."""
    return 2 * math.prod(_check_counts(num_layers=num_layers, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, dtype_bytes=dtype_bytes))
