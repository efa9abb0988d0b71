# Do not edit: tools/tangle.py generates this file from chapters/01-queries-keys-values.md.
"""Scaled dot-product attention in NumPy: a softmax whose exponentials cannot overflow, masks, and
the shape check of Q, K and V.

Built and explained in the book's chapter chapters/01-queries-keys-values.md.
"""

__all__ = [
    "compute_dtype",
    "softmax",
    "divide_or_zero",
    "scaled_dot_product_attention",
    "check_qkv",
]

# chapters/01-queries-keys-values.md, "Scores, softmax and the weighted sum"
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import numpy.typing as npt

from attnbook.checks import as_rectangular, check_array, check_scale, type_error

if TYPE_CHECKING:  # for the annotations only: this module runs without torch
    import torch


@overload
def compute_dtype(dtype: "torch.dtype") -> "torch.dtype": ...
@overload
def compute_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]: ...


def compute_dtype(dtype: Any) -> "torch.dtype | np.dtype[Any]":  # typed by the two above
    """The dtype a sum over `dtype` data is accumulated in: float32 for float16 and bfloat16.

    Works for torch and NumPy dtypes alike; other dtypes compute in themselves.
    """
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":  # torch is loaded
        import torch

        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    try:  # np.dtype(None) would be float64; a tensor or an array is not a dtype
        dtype = np.dtype(dtype if dtype is not None else "no dtype")
    except (TypeError, ValueError):
        raise type_error("dtype", dtype, "a NumPy or torch dtype") from None
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def softmax(x: npt.ArrayLike, axis: int = -1) -> np.ndarray:
    """Softmax along `axis`, no exponential overflows: a slice of all -inf gives zeros, NaN or inf gives
    NaN (as in torch.softmax). float16 is computed in float32; integers become float64."""
    x = check_array("x", x, min_ndim=1)
    work = x.astype(compute_dtype(x.dtype), copy=False)
    shift = np.max(work, axis=axis, keepdims=True, initial=-np.inf)  # -inf for an empty slice
    shift[np.isneginf(shift)] = 0.0  # all -inf: exp(-inf - 0) = 0, never -inf - (-inf)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # no warning for these:
        # exponents <= 0, and a difference past the float range rounds to -inf (exp gives 0);
        # a weight too small for the dtype rounds to 0 (in exp, the division or the cast back);
        # NaN where the row holds NaN or +inf (inf - inf), as the docstring says
        exps = np.exp(work - shift)
        weights = divide_or_zero(exps, exps.sum(axis=axis, keepdims=True))  # 0 if all -inf
        return weights.astype(x.dtype, copy=False)


def divide_or_zero(x: npt.ArrayLike, total: npt.ArrayLike) -> np.ndarray:
    """x / total, and x * 0 where total is 0: 0 for a query with no allowed key, while a NaN or
    inf in x gives NaN. x and total broadcast; integers become float64."""
    number = type(total) in (int, float)  # x / 2.0 keeps x's dtype, and so does this
    x, total, given = check_array("x", x), check_array("total", total), total
    try:  # no temporary as large as x: see chapter 12
        dtype = np.result_type(x, given if number else total)
        out = np.empty(np.broadcast_shapes(x.shape, total.shape), dtype)
    except ValueError:
        raise ValueError(f"x of shape {x.shape} and total of shape {total.shape} do not broadcast"
                         ) from None
    np.divide(x, total, out=out, where=total != 0)
    np.multiply(x, 0, out=out, where=total == 0)
    return out


# chapters/01-queries-keys-values.md, "Scaling, batches and masks"
def scaled_dot_product_attention(Q: npt.ArrayLike, K: npt.ArrayLike, V: npt.ArrayLike,
                                 mask: npt.ArrayLike | None = None, scale: float | None = None
                                 ) -> tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention in NumPy: Q (..., Lq, dk), K (..., Lk, dk), V (..., Lk, dv)
    -> (output (..., Lq, dv), weights (..., Lq, Lk)). `mask` (bool, or integers 0/1) is True
    where a query may attend; `scale` defaults to 1/sqrt(dk)."""
    Q, K, V = check_qkv(Q, K, V)
    scale = check_scale(scale, Q.shape[-1])
    dtype = np.result_type(Q, K, V)
    Q, K, V = (x.astype(compute_dtype(dtype), copy=False) for x in (Q, K, V))
    scores = (Q @ np.swapaxes(K, -1, -2)) * scale  # (..., Lq, Lk)
    if mask is not None:
        scores = np.where(_as_mask(mask, scores.shape), scores, -np.inf)
    weights = softmax(scores, axis=-1)  # (..., Lq, Lk)
    return (weights @ V).astype(dtype, copy=False), weights.astype(dtype, copy=False)


# chapters/01-queries-keys-values.md, "Scaling, batches and masks"
def check_qkv(Q: npt.ArrayLike, K: npt.ArrayLike, V: npt.ArrayLike
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q (..., Lq, dk), K (..., Lk, dk) and V (..., Lk, dv) as real arrays whose shapes fit:
    dk >= 1, Lk >= 1, and leading dimensions that broadcast."""
    Q, K, V = (check_array(name, x, min_ndim=2) for name, x in zip("QKV", (Q, K, V)))
    shapes = f"Q has shape {Q.shape}, K has shape {K.shape}, V has shape {V.shape}"
    for fits, fact in [(Q.shape[-1] == K.shape[-1], "Q and K must end in the same size dk"),
                       (Q.shape[-1] >= 1, "Q and K must have dk >= 1 (the size they end in)"),
                       (K.shape[-2] == V.shape[-2], "K and V must have the same length Lk"),
                       (K.shape[-2] >= 1, "K must have at least one key"),
                       (_broadcast(Q.shape[:-2], K.shape[:-2], V.shape[:-2]) is not None,
                        "the leading (batch) dimensions of Q, K and V must broadcast")]:
        if not fits:
            raise ValueError(f"{fact}: {shapes}")
    return Q, K, V


def _as_mask(mask: npt.ArrayLike, scores_shape: tuple[int, ...]) -> np.ndarray:
    """`mask` (True or 1 = may attend) as a bool array that broadcasts to the scores' shape."""
    dtype: Any = getattr(mask, "dtype", None)  # read first: np.asarray fails on bfloat16 tensors
    if not _is_float(dtype):
        array = as_rectangular("mask", mask)  # an object array of floats holds floats
        dtype = array.dtype if array.size else np.dtype(bool)  # `[]` holds no numbers to misread
    if _is_float(dtype):  # PyTorch adds a float mask to the scores: there 0.0 allows
        raise ValueError(f"mask must be boolean or hold only 0 and 1 as integers, got dtype "
                         f"{dtype}: a float mask is ambiguous, as PyTorch adds it to the "
                         "scores (0.0 = may attend)")
    if not (dtype.kind == "b" or dtype.kind in "iu" and np.isin(array, (0, 1)).all()):
        raise ValueError(f"mask must be boolean or hold only 0 and 1, got dtype {dtype}")
    if _broadcast(array.shape, scores_shape) != scores_shape:
        raise ValueError(f"mask of shape {array.shape} does not broadcast to {scores_shape}")
    return array.astype(bool, copy=False)


def _is_float(dtype: Any) -> bool:
    """Whether `dtype`, NumPy's or PyTorch's, is a floating-point or complex type."""
    if isinstance(dtype, np.dtype):
        return dtype.kind in "fc"
    return bool(getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False))


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape that `shapes` broadcast to, or None if they do not."""
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        return None
