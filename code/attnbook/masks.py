# Do not edit: tools/tangle.py generates this file from chapters/06-masks.md.
"""Boolean attention masks: causal, padding, and both combined.

Built and explained in the book's chapter chapters/06-masks.md.
"""

__all__ = [
    "causal_mask",
    "padding_mask",
    "attention_mask",
]

# chapters/06-masks.md, "The causal mask"
import contextlib
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Literal

import torch

from attnbook.checks import check_bool, check_choice, check_device, check_int
from attnbook.layers import causal_mask as causal_mask  # chapter 3's, offered here with the rest


# chapters/06-masks.md, "Padding"
def padding_mask(lengths: Sequence[int] | torch.Tensor, max_len: int | None = None, *,
                 side: Literal["right", "left"] = "right",
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (B, max_len), True at the lengths[b] real tokens of sequence b: first for
    side="right", last for "left". max_len defaults to max(lengths), device to that of lengths."""
    counts = _check_lengths(lengths)
    check_choice("side", side, ("right", "left"))
    if max_len is None and not counts:
        raise ValueError("lengths is empty, so max_len cannot default to max(lengths)")
    longest = max(counts, default=0)
    max_len = longest if max_len is None else check_int("max_len", max_len, longest)
    device = getattr(lengths, "device", "cpu") if device is None else device  # a list's: CPU
    device = check_device("device", device)
    lengths = torch.tensor(counts, dtype=torch.int64, device=device)[:, None]  # (B, 1)
    positions = torch.arange(max_len, device=device)[None, :]  # (1, max_len)
    return positions < lengths if side == "right" else positions >= max_len - lengths


# chapters/06-masks.md, "Padding"
def _check_lengths(lengths: object) -> list[int]:
    if getattr(lengths, "ndim", 1) != 1:  # a tensor or an array
        raise ValueError(f"lengths must be 1-D, got shape {tuple(getattr(lengths, 'shape', ()))}")
    if getattr(lengths, "is_meta", False):  # a shape but no values
        raise ValueError("lengths must hold values, got a tensor on the meta device")
    lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
    if isinstance(lengths, (str, bytes, Set, Mapping)) or not isinstance(lengths, Iterable):
        # a set has no order, and a dict's keys are not its lengths
        raise TypeError(f"lengths must be a sequence or 1-D tensor of ints, got {lengths!r}")
    return [check_int(f"lengths[{i}]", n, 0) for i, n in enumerate(lengths)]


# chapters/06-masks.md, "One mask for a batch"
def attention_mask(key_padding: torch.Tensor | None = None, causal: bool = False,
                   q_len: int | None = None, k_len: int | None = None, *,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (B, 1, Lq, Lk), True where a query may attend a key: a real one, by
    `key_padding` (B, Lk; default B = 1, all real), and with `causal` one of causal_mask(Lq, Lk).
    Lk is key_padding's, else k_len, else q_len; Lq is q_len, else Lk. On `device`, else
    key_padding's."""
    causal = check_bool("causal", causal)
    device = None if device is None else check_device("device", device)
    keys = _check_key_padding(key_padding, k_len, q_len).to(device=device)  # (B, Lk)
    lq = keys.shape[1] if q_len is None else check_int("q_len", q_len, 1)
    mask = keys[:, None, None, :].expand(-1, 1, lq, -1)  # (B, 1, Lq, Lk)
    if causal:
        mask = mask & causal_mask(lq, keys.shape[1], device=keys.device)
    return mask.clone()


# chapters/06-masks.md, "One mask for a batch"
def _check_key_padding(key_padding: object, k_len: int | None, q_len: int | None) -> torch.Tensor:
    if key_padding is None:
        if k_len is None and q_len is None:
            raise ValueError("attention_mask needs key_padding, k_len or q_len; got none")
        lk = check_int(*(("q_len", q_len) if k_len is None else ("k_len", k_len)), 1)
        return torch.ones(1, lk, dtype=torch.bool)
    with contextlib.suppress(TypeError, ValueError, RuntimeError):
        key_padding = torch.as_tensor(key_padding)  # a list or an array
    if not isinstance(key_padding, torch.Tensor) or key_padding.dtype != torch.bool:
        got = f"dtype {key_padding.dtype}" if torch.is_tensor(key_padding) else repr(key_padding)
        raise TypeError(f"key_padding must be a boolean tensor (True = real key), got {got}")
    if key_padding.ndim != 2:
        raise ValueError(f"key_padding must have shape (B, Lk), got {tuple(key_padding.shape)}")
    check_int("key_padding.shape[1]", key_padding.shape[1], 1)  # Lk, at least one key
    if k_len is not None and check_int("k_len", k_len, 1) != key_padding.shape[1]:
        raise ValueError(f"k_len = {k_len} differs from key_padding's Lk = {key_padding.shape[1]}")
    return key_padding
