# Do not edit: tools/tangle.py generates this file from chapters/11-tiling.md.
"""FlashAttention's algorithm in NumPy: the online softmax and attention computed tile by tile.

Built and explained in the book's chapter chapters/11-tiling.md.
"""

__all__ = [
    "online_softmax_update",
    "online_softmax",
    "block_schedule",
    "flash_attention_numpy",
]

# chapters/11-tiling.md, "Softmax from a stream of blocks"
import numpy as np

from attnbook.attention import check_qkv, divide_or_zero
from attnbook.conventions import check_array, check_bool, check_int, check_scale, compute_dtype


def online_softmax_update(m, l, block) -> tuple[np.ndarray, np.ndarray]:
    """Fold a block of scores (..., b) into the running max `m` and sum `l` (both (...,), starting
    at -inf and 0): then l = sum(exp(x - m)) over every score seen. float16 sums in float32."""
    block = check_array("block", block, min_ndim=1)
    block = block.astype(compute_dtype(block.dtype), copy=False)
    m_new, shift, alpha = _new_max(np.asarray(m, block.dtype), block)
    return m_new, alpha * l + np.exp(block - shift[..., None]).sum(axis=-1)


def _new_max(m: np.ndarray, block: np.ndarray):
    """The new running max, a shift that is 0 where that max is -inf, and exp(m_old - shift)."""
    m_new = np.maximum(m, block.max(axis=-1, initial=-np.inf))  # NaN, if any, propagates
    shift = np.where(np.isneginf(m_new), 0.0, m_new).astype(m_new.dtype)
    return m_new, shift, np.exp(m - shift)


# chapters/11-tiling.md, "Softmax from a stream of blocks"
def online_softmax(x, block_size: int = 64) -> np.ndarray:
    """Softmax along the last axis in two passes over blocks of `block_size`: the max and the
    normaliser together, then exp(x - m) / l. Equal to attention.softmax up to rounding."""
    x = check_array("x", x, min_ndim=1)
    block_size = check_int("block_size", block_size, minimum=1)
    work = compute_dtype(x.dtype)
    m = np.full(x.shape[:-1], -np.inf, work)  # (...,) running max
    l = np.zeros(x.shape[:-1], work)  # (...,) running sum of exp(x - m)
    for start in range(0, x.shape[-1], block_size):
        m, l = online_softmax_update(m, l, x[..., start:start + block_size])
    exps = np.exp(x.astype(work) - np.where(np.isneginf(m), 0.0, m)[..., None])  # (..., n)
    return divide_or_zero(exps, l[..., None]).astype(x.dtype, copy=False)


# chapters/11-tiling.md, "Attention in one pass over the keys"
def block_schedule(Lq: int, Lk: int, block_size: int = 64,
                   causal: bool = False) -> list[tuple[int, int, int, int, bool]]:
    """The tiles `flash_attention_numpy` computes, in order: (q0, q1, k0, k1, needs_mask), query
    rows q0..q1-1 against key columns k0..k1-1; with `causal`, none above the diagonal."""
    Lq, Lk = check_int("Lq", Lq, minimum=0), check_int("Lk", Lk, minimum=0)
    block_size, causal = check_int("block_size", block_size, 1), check_bool("causal", causal)
    return [(q0, min(q0 + block_size, Lq), *kb) for q0 in range(0, Lq, block_size)
            for kb in _key_blocks(q0, min(q0 + block_size, Lq), Lk, Lk - Lq, block_size, causal)]


def _key_blocks(q0: int, q1: int, lk: int, offset: int, block_size: int, causal: bool):
    """(k0, k1, needs_mask) for each key block that query rows q0..q1-1 must visit."""
    for k0 in range(0, lk, block_size):
        k1 = min(k0 + block_size, lk)
        if causal and k0 > q1 - 1 + offset:  # the last query may not see the first key:
            break  # this tile and every tile to its right are forbidden entirely
        yield k0, k1, causal and k1 - 1 > q0 + offset  # the first query may not see the last key


# chapters/11-tiling.md, "Attention in one pass over the keys"
def flash_attention_numpy(Q, K, V, causal: bool = False, block_size: int = 64,
                          scale: float | None = None) -> np.ndarray:
    """Tiled attention with the online softmax, in NumPy: the output of attention's
    scaled_dot_product_attention up to rounding, holding one tile of scores at a time. With
    `causal`, query i sees key j iff j <= i + (Lk - Lq) (bottom-right)."""
    Q, K, V = check_qkv(Q, K, V)
    block_size = check_int("block_size", block_size, minimum=1)
    causal, scale = check_bool("causal", causal), check_scale(scale, Q.shape[-1])
    dtype = np.result_type(Q, K, V)
    batch = np.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    Q, K, V = (np.broadcast_to(x.astype(compute_dtype(dtype), copy=False), batch + x.shape[-2:])
               for x in (Q, K, V))
    lq, offset = Q.shape[-2], K.shape[-2] - Q.shape[-2]
    out = np.empty(batch + (lq, V.shape[-1]), dtype)  # (..., Lq, dv)
    for q0 in range(0, lq, block_size):
        q = Q[..., q0:q0 + block_size, :]  # (..., bq, d)
        out[..., q0:q0 + block_size, :] = _attend_query_block(q, K, V, q0, offset, block_size,
                                                              causal, scale)
    return out


# chapters/11-tiling.md, "Attention in one pass over the keys"
def _attend_query_block(q, K, V, q0: int, offset: int, block_size: int, causal: bool,
                        scale: float) -> np.ndarray:
    """Outputs of the queries q (..., bq, d), rows q0.. of Q; causal: key j <= query i + offset."""
    bq, lk = q.shape[-2], K.shape[-2]
    m = np.full(q.shape[:-1], -np.inf, q.dtype)  # (..., bq) running max
    l = np.zeros(q.shape[:-1], q.dtype)  # (..., bq) running sum
    acc = np.zeros(q.shape[:-1] + V.shape[-1:], q.dtype)  # (..., bq, dv) unnormalised output
    for k0, k1, needs_mask in _key_blocks(q0, q0 + bq, lk, offset, block_size, causal):
        s = q @ np.swapaxes(K[..., k0:k1, :], -1, -2)  # (..., bq, bk): the only scores held
        s *= scale
        if needs_mask:
            s[..., np.arange(k0, k1) > np.arange(q0, q0 + bq)[:, None] + offset] = -np.inf
        m, shift, alpha = _new_max(m, s)
        s -= shift[..., None]
        np.exp(s, out=s)  # the tile now holds the unnormalised weights exp(s - m)
        l *= alpha
        l += s.sum(axis=-1)
        acc *= alpha[..., None]
        acc += s @ V[..., k0:k1, :]
        del s  # free this tile before the next one is made
    return divide_or_zero(acc, l[..., None])
