# Do not edit: tools/tangle.py generates this file from chapters/05-positions.md.
"""Positions: sinusoidal encodings, rotary embeddings (RoPE) and ALiBi biases.

Built and explained in the book's chapter chapters/05-positions.md.
"""

__all__ = [
    "sinusoidal_encoding",
    "apply_rope",
    "alibi_slopes",
    "alibi_bias",
    "Rotary",
    "ALiBi",
]

# chapters/05-positions.md, "Sinusoidal encodings"
import math
from collections.abc import Callable
from typing import Self

import numpy as np
import torch
from torch import nn

from attnbook.attention import compute_dtype
from attnbook.checks import (
    check_array,
    check_device,
    check_divisible,
    check_float_dtype,
    check_int,
    check_positive,
    check_tensor,
)


def sinusoidal_encoding(num_positions: int, d_model: int) -> np.ndarray:
    """The original Transformer's positions, float64 (num_positions, d_model): row p holds
    sin(p * w_i) in column 2i and cos(p * w_i) in column 2i + 1, w_i = 10000**(-2i / d_model)."""
    num_positions, d_model = (check_int(name, n, minimum=1) for name, n in
                              (("num_positions", num_positions), ("d_model", d_model)))
    columns = np.arange(d_model)
    frequencies = 1.0 / 10000.0 ** (2.0 * (columns // 2) / d_model)  # columns 2i, 2i + 1: w_i
    angles = np.arange(num_positions, dtype=np.float64)[:, None] * frequencies  # (P, d_model)
    return np.where(columns % 2 == 0, np.sin(angles), np.cos(angles))


# chapters/05-positions.md, "Rotary position embeddings (RoPE)"
def apply_rope(x: torch.Tensor, positions: torch.Tensor | None = None,
               base: float = 10000.0) -> torch.Tensor:
    """RoPE on `x` (..., L, d), d even, row l standing at `positions[l]` (default l): half-split
    pairs (i, i + d/2), as in GPT-NeoX and Llama, turned by position * base**(-2i/d), computed in
    float64 (float32 on MPS). Returns x's shape and dtype."""
    x, base = _rope_input(x), check_positive("base", base)
    return _rope(x, _as_positions(positions, x.shape[-2], x.device, _wide(x.device)), base)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """apply_rope's computation, on checked arguments: positions (L,), or (..., L) broadcasting
    with x's leading dimensions, in _wide's dtype."""
    work, d, wide = compute_dtype(x.dtype), x.shape[-1], positions.dtype
    frequencies = base ** (-torch.arange(0, d, 2, device=x.device, dtype=wide) / d)  # (d/2,)
    angles = positions[..., None] * frequencies  # (..., L, d/2)
    cos, sin = angles.cos().to(work), angles.sin().to(work)
    x1, x2 = x.to(work).chunk(2, dim=-1)  # (..., L, d/2) each: pair i is (x1[i], x2[i])
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


# chapters/05-positions.md, "Rotary position embeddings (RoPE)"
def _wide(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _rope_input(x: object) -> torch.Tensor:
    """`x` checked as apply_rope's input: a float16-or-wider tensor (..., L, d), d even."""
    x = check_tensor("x", x)
    if x.dtype.itemsize == 1:  # float8: PyTorch has no arithmetic for it
        raise TypeError(f"x must be float16 or wider, got dtype {x.dtype}")
    d = x.shape[-1] if x.dim() else 0  # x is (..., L, d)
    if x.dim() < 2 or d < 2 or d % 2:
        raise ValueError(f"x must have shape (..., L, d) with an even d >= 2, got shape "
                         f"{tuple(x.shape)} (d = {d})")
    return x


def _as_positions(positions: object, length: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """`positions` (default 0..length-1) as a `dtype` tensor of shape (length,) on `device`."""
    if positions is None:
        return torch.arange(length, device=device, dtype=dtype)
    if not isinstance(positions, torch.Tensor):  # a list or an array: checked as NumPy data
        positions = torch.from_numpy(np.array(check_array("positions", positions)))  # 0-d stays
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must hold real numbers, got dtype {positions.dtype}")
    if positions.is_meta and device.type != "meta":
        raise ValueError("positions must hold values, got a tensor on the meta device")
    return check_tensor("positions", positions.to(device, dtype), shape=(length,))


# chapters/05-positions.md, "ALiBi: a penalty for distance"
def alibi_slopes(num_heads: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi's slopes (num_heads,): 2**(-8/n), 2**(-16/n), ..., 2**(-8) for a power of two n, as in
    Press et al. (2022); else, as in their code, those of the power of two n' below, then every
    other one of 2n'."""
    num_heads, dtype = check_int("num_heads", num_heads, minimum=1), check_float_dtype("dtype", dtype)
    device = None if device is None else check_device("device", device)
    lower = 2 ** int(math.log2(num_heads))
    slopes = _geometric_slopes(lower) + _geometric_slopes(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=dtype, device=device)


def _geometric_slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]  # each rounded once, not a power's


# chapters/05-positions.md, "ALiBi: a penalty for distance"
def alibi_bias(num_heads: int, q_len: int, k_len: int | None = None, *,
               dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi's bias (num_heads, q_len, k_len), [h, i, j] = -slope_h * abs(k_len - q_len + i - j):
    the queries are the last q_len of k_len positions (default q_len). float16 and bfloat16 are
    computed in float32, where a distance past 65,504 is finite, and rounded back."""
    q_len = check_int("q_len", q_len, minimum=1)
    k_len = q_len if k_len is None else check_int("k_len", k_len, minimum=1)
    if check_float_dtype("dtype", dtype).itemsize == 1:  # float8: no arithmetic in PyTorch
        raise TypeError(f"dtype must be float16 or wider, got {dtype}")
    slopes = alibi_slopes(num_heads, dtype=compute_dtype(dtype), device=device)  # (nh,)
    return _alibi_bias(slopes, q_len, k_len).to(dtype)


def _alibi_bias(slopes: torch.Tensor, q_len: int, k_len: int,
                key_at: torch.Tensor | None = None) -> torch.Tensor:
    """alibi_bias's computation, in the dtype of `slopes` (nh,), for checked sizes: (nh, Lq, Lk),
    or (B, nh, Lq, Lk) from `key_at` (B, Lk), each key's own position, the queries the last q_len."""
    if key_at is None:
        query_at = torch.arange(q_len, device=slopes.device) + (k_len - q_len)
        key_at = torch.arange(k_len, device=slopes.device)
    else:
        query_at = key_at[:, -q_len:]
    distance = (query_at[..., :, None] - key_at[..., None, :]).abs()  # (B or none, Lq, Lk)
    return 0.0 - slopes[:, None, None] * distance.unsqueeze(-3).to(slopes.dtype)  # no -0.0


# chapters/05-positions.md, "Inside a model's attention"
class Rotary(nn.Module):
    """RoPE inside attention: q and k (B, H, L, head_dim) at positions start..start+L-1, or at
    `position_ids` (B, L), each row's own (a padded batch, chapter 19), or (L,), every row's,
    turned as apply_rope turns them. Settings checked when made; calls not checked (chapter 7)."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = check_divisible("head_dim", check_int("head_dim", head_dim, 2), "2", 2)
        self.base = check_positive("base", base)

    def forward(self, q: torch.Tensor, k: torch.Tensor, start: int,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is None:
            position_ids = torch.arange(start, start + q.shape[2], device=q.device)[None]  # (1, L)
        at = position_ids.to(_wide(q.device)).reshape(-1, 1, q.shape[2])  # (B or 1, 1, L): all heads
        return _rope(q, at, self.base), _rope(k, at, self.base)


class ALiBi(nn.Module):
    """ALiBi inside attention: the bias (num_heads, q_len, k_len) of alibi_bias, in the slopes'
    dtype (float32 at least). The slopes are a buffer, so they follow the model's device and
    dtype, and are computed anew in the new dtype when it moves: a float64 model's are float64's."""

    slopes: torch.Tensor  # a buffer

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        slopes = alibi_slopes(num_heads, dtype=torch.get_default_dtype())  # (nh,)
        self.register_buffer("slopes", slopes, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch's is untyped
        # .to(), .double(), .cuda() move the slopes; then they are computed anew, not rounded
        self.slopes = alibi_slopes(len(self.slopes), dtype=self.slopes.dtype,  # from the closed form
                                   device=self.slopes.device)
        return self

    def forward(self, q_len: int, k_len: int, key_at: torch.Tensor | None = None) -> torch.Tensor:
        """(nh, Lq, Lk); with `key_at` (B, Lk), the keys' own positions, (B, nh, Lq, Lk)."""
        slopes = self.slopes.to(compute_dtype(self.slopes.dtype))
        return _alibi_bias(slopes, q_len, k_len, key_at)
