# Do not edit: tools/tangle.py generates this file from chapters/02-scaling.md.
"""Why scores are divided by the square root of d: random scores, the softmax's peak and its
Jacobian.

Built and explained in the book's chapter chapters/02-scaling.md.
"""

__all__ = [
    "random_scores",
    "softmax_peak",
    "softmax_jacobian",
    "softmax_jacobian_norm",
]

# chapters/02-scaling.md, "An experiment with random queries and keys"
import numpy as np
import numpy.typing as npt

from attnbook.attention import compute_dtype, softmax
from attnbook.checks import check_array, check_bool, check_int

_BLOCK = 2**21  # how many random numbers (or Jacobian entries) to hold in memory at once


def random_scores(d: int, num_keys: int = 8, trials: int = 10_000, scaled: bool = True,
                  seed: int = 0) -> np.ndarray:
    """Scores (trials, num_keys) of a random query against `num_keys` fresh random keys per trial:
    standard normal entries in dimension `d` (default_rng(seed)), divided by sqrt(d) if `scaled`."""
    d, num_keys, trials = (check_int(name, n, minimum=1) for name, n in
                           (("d", d), ("num_keys", num_keys), ("trials", trials)))
    seed, scaled = check_int("seed", seed, minimum=0), check_bool("scaled", scaled)
    rng = np.random.default_rng(seed)
    scores = np.empty((trials, num_keys))
    block = max(1, _BLOCK // ((num_keys + 1) * d))  # trials per block
    for start in range(0, trials, block):
        n = min(block, trials - start)
        q = rng.standard_normal((n, d, 1))  # (n, d, 1): one query per trial, as a column
        k = rng.standard_normal((n, num_keys, d))  # (n, num_keys, d): fresh keys per trial
        scores[start:start + n] = (k @ q)[..., 0]
    return scores / np.sqrt(d) if scaled else scores


# chapters/02-scaling.md, "An experiment with random queries and keys"
def softmax_peak(d: int, num_keys: int = 8, trials: int = 10_000, scaled: bool = True,
                 seed: int = 0) -> float:
    """Mean over trials of the largest softmax weight of `random_scores` (same arguments)."""
    scores = random_scores(d, num_keys, trials, scaled, seed)
    return float(softmax(scores, axis=-1).max(axis=-1).mean())


# chapters/02-scaling.md, "What saturation does to gradients"
def softmax_jacobian(scores: npt.ArrayLike) -> np.ndarray:
    """Jacobian diag(p) - p p^T of the softmax over the last axis: (..., n) -> (..., n, n), entry
    [..., i, j] = d p_i / d scores_j. A masked key (score -inf) gets a zero row and column."""
    scores = check_array("scores", scores)
    if scores.ndim == 0 or scores.shape[-1] == 0:
        raise ValueError(f"scores must have shape (..., n) with n >= 1, got shape {scores.shape}")
    p = softmax(scores.astype(compute_dtype(scores.dtype), copy=False), axis=-1)  # (..., n)
    jacobian: np.ndarray = p[..., :, None] * (np.eye(p.shape[-1], dtype=p.dtype) - p[..., None, :])
    return jacobian.astype(scores.dtype, copy=False)  # float16 computed in float32


# chapters/02-scaling.md, "What saturation does to gradients"
def softmax_jacobian_norm(d: int, num_keys: int = 8, trials: int = 10_000, scaled: bool = True,
                          seed: int = 0) -> float:
    """Mean Frobenius norm of the softmax Jacobian on the draws of `softmax_peak` (same args)."""
    scores = random_scores(d, num_keys, trials, scaled, seed)
    block = max(1, _BLOCK // num_keys**2)
    norms = [np.linalg.norm(softmax_jacobian(scores[start:start + block]), axis=(-2, -1))
             for start in range(0, len(scores), block)]
    return float(np.concatenate(norms).mean())
