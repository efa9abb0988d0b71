# Do not edit: tools/tangle.py generates this file from chapters/17-efficient-attention.md.
"""Beyond quadratic attention: sliding-window, global and block-sparse masks with tile skipping,
linear attention, FAVOR+ random features, retention, and the small models and recall task that
compare them.

Built and explained in the book's chapter chapters/17-efficient-attention.md.
"""

__all__ = [
    "sliding_window_mask",
    "global_token_mask",
    "block_sparse_mask",
    "tile_layout",
    "block_sparse_attention",
    "elu_feature_map",
    "linear_attention",
    "random_features",
    "positive_features",
    "performer_attention",
    "retention",
    "retention_step",
    "MIXERS",
    "Mixer",
    "TinyLM",
    "recall_batch",
]

# chapters/17-efficient-attention.md, "Sparse masks: a window, global tokens, blocks"
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnbook.attention import compute_dtype
from attnbook.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_device,
    check_divisible,
    check_float_dtype,
    check_instance,
    check_int,
    check_mask,
    check_real,
    check_tensor,
)


# chapters/17-efficient-attention.md, "Sparse masks: a window, global tokens, blocks"
def sliding_window_mask(lq: int, lk: int, window: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (lq, lk), True where query i, at position p = i + lk - lq (bottom-right, as
    masks.causal_mask), may see key j: p - window < j <= p, its `window` most recent keys."""
    lq, lk, window = check_int("lq", lq, 1), check_int("lk", lk, 1), check_int("window", window, 1)
    device = None if device is None else check_device("device", device)
    p = torch.arange(lq, device=device)[:, None] + (lk - lq)  # (Lq, 1) query positions
    j = torch.arange(lk, device=device)[None, :]  # (1, Lk) key positions
    return (j <= p) & (j > p - window)  # (Lq, Lk)


# chapters/17-efficient-attention.md, "Sparse masks: a window, global tokens, blocks"
def global_token_mask(lq: int, lk: int, num_global: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (lq, lk), True where query i (at position i + lk - lq) or key j is one of
    the first `num_global` positions: global tokens, as in Longformer and BigBird. With
    lq > lk, the first lq - lk queries sit before every key (negative positions): not global."""
    lq, lk = check_int("lq", lq, 1), check_int("lk", lk, 1)
    num_global = check_int("num_global", num_global, 0)
    device = None if device is None else check_device("device", device)
    p = torch.arange(lq, device=device)[:, None] + (lk - lq)  # (Lq, 1), negative before the keys
    return ((p >= 0) & (p < num_global)) | (torch.arange(lk, device=device)[None, :] < num_global)


def block_sparse_mask(layout: torch.Tensor, block_size: int, lq: int | None = None,
                      lk: int | None = None) -> torch.Tensor:
    """Boolean mask (lq, lk) that is True in the block_size x block_size tiles where the bool
    `layout` (nq, nk) is True; lq and lk default to nq * block_size and nk * block_size."""
    layout = check_mask("layout", layout, tuple(getattr(layout, "shape", ())))
    if layout.dim() != 2:
        raise ValueError(f"layout must have shape (nq, nk), got shape {tuple(layout.shape)}")
    (nq, nk), b = layout.shape, check_int("block_size", block_size, 1)
    lq = nq * b if lq is None else check_int("lq", lq, (nq - 1) * b + 1, nq * b)
    lk = nk * b if lk is None else check_int("lk", lk, (nk - 1) * b + 1, nk * b)
    return layout.repeat_interleave(b, 0).repeat_interleave(b, 1)[:lq, :lk].clone()


# chapters/17-efficient-attention.md, "Skipping the tiles a mask leaves empty"
def tile_layout(mask: torch.Tensor, block_size: int = 64) -> torch.Tensor:
    """The tiles of `mask` (Lq, Lk) that hold an allowed entry: a bool tensor
    (ceil(Lq / block_size), ceil(Lk / block_size)). The other tiles need not be computed."""
    mask = check_mask("mask", mask, tuple(getattr(mask, "shape", ())))
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (Lq, Lk), got shape {tuple(mask.shape)}")
    (lq, lk), b = mask.shape, check_int("block_size", block_size, 1)
    nq, nk = -(-lq // b), -(-lk // b)  # (Lq, Lk) -> (nq, nk), the last tiles padded
    return F.pad(mask, (0, nk * b - lk, 0, nq * b - lq)).view(nq, b, nk, b).any(3).any(1)


# chapters/17-efficient-attention.md, "Skipping the tiles a mask leaves empty"
def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ndim: int | tuple[int, ...] = tuple(range(2, 9)), same_length: bool = False,
               keys: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chapter 17's one check of q (..., Lq, D), k (..., Lk, D) and v (..., Lk, Dv)."""
    q = check_tensor("q", q, ndim)
    d, lk = q.shape[-1], q.shape[-2] if same_length else None  # k's length: Lq, or any
    k = check_tensor("k", k, q.dim(), dtype=q.dtype, device=q.device, shape=(*q.shape[:-2], lk, d))
    v = check_tensor("v", v, q.dim(), dtype=q.dtype, device=q.device, shape=(*k.shape[:-1], None))
    for name, size in (("k.shape[-2]", k.shape[-2]), ("q.shape[-1]", d)):
        if keys and size == 0:  # at least one key and one feature
            raise ValueError(f"{name} must be at least 1, got {name}={size}")
    return q, k, v


# chapters/17-efficient-attention.md, "Skipping the tiles a mask leaves empty"
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None = None, block_size: int = 64, *,
                           layout: torch.Tensor | None = None,
                           causal: bool = False) -> torch.Tensor:
    """Attention (B, H, Lq, dv) computing only the block_size x block_size tiles that the bool
    `layout` (ceil(Lq / block_size), ceil(Lk / block_size)) marks, all their entries allowed
    (with `causal`, j <= i + Lk - Lq); or layers.attend(q, k, v, mask)'s output for a bool `mask`
    (B, H, Lq, Lk), whose layout tile_layout finds. A query with no allowed key gets zeros."""
    q, k, v = _check_qkv(q, k, v, 4)  # at least a key and a feature, as in attend
    (b, h, lq, _), lk = q.shape, k.shape[2]
    bs, causal = check_int("block_size", block_size, 1), check_bool("causal", causal)
    tiles = (-(-lq // bs), -(-lk // bs))  # (nq, nk)
    if (mask is None) == (layout is None):
        raise ValueError(f"give either mask or layout, got {'neither' if mask is None else 'both'}")
    if layout is not None:
        layout = check_mask("layout", layout, tiles, q.device).expand(tiles)  # as a mask does
    else:
        mask = check_mask("mask", mask, (b, h, lq, lk), q.device)
        mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape).expand(-1, -1, lq, lk)
        layout = tile_layout(mask.flatten(0, 1).any(dim=0), bs)  # reads all Lq x Lk entries
    work = compute_dtype(q.dtype)
    return _block_sparse(q.to(work), k.to(work), v.to(work), layout, bs, mask, causal).to(q.dtype)


# chapters/17-efficient-attention.md, "Skipping the tiles a mask leaves empty"
def _block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, b: int,
                  mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    (lq, lk), (nq, nk) = (q.shape[2], k.shape[2]), layout.shape
    rows, cols = layout.nonzero(as_tuple=True)  # (T,) each: the tiles to compute
    q = q / math.sqrt(q.shape[-1])  # the softmax's scale, once per query rather than per score
    qt, kt, vt = (torch.unflatten(F.pad(x, (0, 0, 0, n * b - x.shape[2])), 2, (n, b))[:, :, i]
                  for x, n, i in ((q, nq, rows), (k, nk, cols), (v, nk, cols)))  # (B, H, T, b, .)
    qpos = rows[:, None, None] * b + torch.arange(b, device=q.device)[:, None]  # (T, b, 1)
    kpos = cols[:, None, None] * b + torch.arange(b, device=q.device)  # (T, 1, b)
    allowed = (qpos < lq) & (kpos < lk)  # (T, b, b): inside the matrix
    if causal:
        allowed = allowed & (kpos <= qpos + lk - lq)  # bottom-right, as causal_mask
    if mask is not None:  # (B', H', Lq, Lk) -> its entries in the tiles, (B', H', T, b, b)
        padded = F.pad(mask, (0, nk * b - lk, 0, nq * b - lq))  # (B', H', nq * b, nk * b)
        tiles = torch.unflatten(torch.unflatten(padded, 3, (nk, b)), 2, (nq, b))  # 2 x (n, b)
        allowed = allowed & tiles[:, :, rows, :, cols].permute(1, 2, 0, 3, 4)
    s = (qt @ kt.transpose(-2, -1)).masked_fill_(~allowed, -math.inf)  # (B, H, T, b, b)
    tile_top = s.detach().amax(dim=-1)  # (B, H, T, b); below, each query's max over its tiles
    top = tile_top.new_full((*q.shape[:2], nq, b), -math.inf).scatter_reduce(
        2, rows[:, None].expand(tile_top.shape), tile_top, "amax")  # (B, H, nq, b)
    p = torch.exp(s - top.masked_fill(top == -math.inf, 0.0)[:, :, rows, :, None])  # (B,H,T,b,b)
    num = q.new_zeros(*q.shape[:2], nq, b, v.shape[-1]).index_add(2, rows, p @ vt)
    den = q.new_zeros(*q.shape[:2], nq, b, 1).index_add(2, rows, p.sum(dim=-1, keepdim=True))
    out = num / den.clamp(min=torch.finfo(den.dtype).tiny)  # no key: 0 / tiny = 0
    return out.flatten(2, 3)[:, :, :lq]  # (B, H, Lq, dv)


# chapters/17-efficient-attention.md, "Linear attention"
def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1, positive everywhere: linear attention's default feature map."""
    return F.elu(check_tensor("x", x)) + 1.0


# chapters/17-efficient-attention.md, "Linear attention"
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     eps: float = 1e-6, chunk_size: int = 64) -> torch.Tensor:
    """Linear attention (Katharopoulos et al. 2020): output i = phi(q_i) S / (phi(q_i) . z + eps),
    S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j) over the keys i may see: all, or with
    `causal` j <= i + Lk - Lq, then in chunks of `chunk_size` keys (memory O(N D + D Dv)).
    q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv) -> (..., Lq, Dv); phi defaults to elu + 1."""
    q, k, v = _check_qkv(q, k, v)
    causal, eps = check_bool("causal", causal), check_real("eps", eps, 0.0, open_low=True)
    chunk_size, work = check_int("chunk_size", chunk_size, 1), compute_dtype(q.dtype)
    phi = elu_feature_map if feature_map is None else check_callable("feature_map", feature_map)
    fq, fk = phi(q.to(work)), phi(k.to(work))  # (..., Lq, D'), (..., Lk, D')
    for name, x, fx in () if feature_map is None else (("q", q, fq), ("k", k, fk)):
        check_tensor(f"feature_map({name})", fx, shape=(*x.shape[:-1], None))
        if bool((fx < 0).any()):  # phi(q_i) . z could then be 0 or negative
            raise ValueError(f"feature_map({name}) must be non-negative, got {float(fx.min()):.3g}")
    return _linear_attention(fq, fk, v.to(work), causal, eps, chunk_size).to(q.dtype)


def _linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, causal: bool, eps: float,
                      chunk: int) -> torch.Tensor:
    """Linear attention on the features fq (..., Lq, D') and fk (..., Lk, D'), none negative."""
    if causal:
        return _causal_linear(fq, fk, v, eps, chunk)
    state = fk.transpose(-2, -1) @ v  # (..., D', Dv): one state for every query
    return fq @ state / (fq @ fk.sum(dim=-2)[..., None] + eps)  # (..., Lq, Dv)


# chapters/17-efficient-attention.md, "Linear attention"
def _causal_linear(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, eps: float,
                   chunk: int, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Causal linear attention on features fq (..., Lq, D), fk (..., Lk, D), chunk by chunk.
    With `shift` (..., Lk), non-decreasing, key j's features are phi(k_j) / exp(shift_j), and the
    sums a query sees are kept over exp(shift) at its own position (rescaled as shift grows)."""
    (lq, lk), dv = (fq.shape[-2], fk.shape[-2]), v.shape[-1]
    blind = max(0, lq - lk)  # queries before the first key: zeros
    start = lk - (lq - blind)  # the first key position that has a query
    before = fk[..., :start, :]  # (..., start, D): the keys before every query
    if shift is not None and lk:  # the sums kept over exp(last), the last summed key's shift
        last = shift[..., max(start - 1, 0)]
        before = before * (shift[..., :start] - last[..., None]).exp()[..., None]
    state, norm = before.transpose(-2, -1) @ v[..., :start, :], before.sum(dim=-2)  # S, z
    outs = [fq.new_zeros(*fq.shape[:-2], blind, dv)]
    for c0 in range(start, lk, chunk):
        c1 = min(c0 + chunk, lk)  # keys c0..c1-1 and the queries at those positions
        qc = fq[..., c0 - start + blind:c1 - start + blind, :]  # (..., c, D)
        kc, vc = fk[..., c0:c1, :], v[..., c0:c1, :]  # (..., c, D), (..., c, Dv)
        sim = (qc @ kc.transpose(-2, -1)).tril()  # (..., c, c): causal inside the chunk
        past, seen, kt = qc @ state, qc @ norm[..., None], kc.transpose(-2, -1)  # kt: (..., D, c)
        if shift is not None:  # each to the query's own constant; the new sums to the last key's
            sc = shift[..., c0:c1]  # (..., c)
            sim = sim * (sc[..., None, :] - sc[..., :, None]).exp().tril()  # e^(sc_j - sc_i), j<=i
            carry = (last[..., None] - sc).exp()[..., None]  # (..., c, 1)
            past, seen, kt = past * carry, seen * carry, kt * (sc - sc[..., -1:]).exp()[..., None, :]
            decay, last = (last - sc[..., -1]).exp()[..., None], sc[..., -1]  # (..., 1), (...,)
            state, norm = state * decay[..., None], norm * decay
        outs.append((sim @ vc + past) / (sim.sum(dim=-1, keepdim=True) + seen + eps))
        state, norm = state + kt @ vc, norm + kt.sum(dim=-1)
    return torch.cat(outs, dim=-2)  # (..., Lq, Dv)


# chapters/17-efficient-attention.md, "FAVOR+: random features for the softmax"
def random_features(num_features: int, dim: int, orthogonal: bool = True,
                    generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`num_features` directions w ~ N(0, I_dim) as rows, (num_features, dim), drawn from
    `generator`. With `orthogonal`, each block of `dim` rows is orthogonal, each row with the
    length of a Gaussian vector, so that every row is still N(0, I_dim)."""
    m, d = check_int("num_features", num_features, 1), check_int("dim", dim, 1)
    orthogonal, dtype = check_bool("orthogonal", orthogonal), check_float_dtype("dtype", dtype)
    check_instance("generator", generator, (torch.Generator, type(None)))
    w = torch.randn(m, d, generator=generator, dtype=torch.float64)  # (m, d)
    if orthogonal:  # rotations from the QR factors of Gaussian matrices, (ceil(m / d), d, d)
        rotation, r = torch.linalg.qr(torch.randn(-(-m // d), d, d, generator=generator,
                                                  dtype=torch.float64))  # with the signs fixed,
        rotation = rotation * torch.sign(r.diagonal(dim1=-2, dim2=-1))[:, None]  # uniform
        rows = rotation.transpose(-2, -1).flatten(0, 1)[:m]  # orthonormal in blocks of d
        w = rows * w.norm(dim=1, keepdim=True)  # with the lengths of Gaussian vectors
    return w.to(dtype)


def positive_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FAVOR+'s `phi(x) = exp(w x - |x|^2 / 2) / sqrt(m)` for x (..., L, D) and w (m, D):
    `E[phi(q) . phi(k)] = exp(q . k)` when the rows of w are N(0, I_D). -> (..., L, m)."""
    x = check_tensor("x", x, tuple(range(1, 9)))
    w = check_tensor("w", w, 2, dtype=x.dtype, device=x.device, shape=(None, x.shape[-1]))
    return _log_features(x, w).exp() / math.sqrt(w.shape[0])


def _log_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T - (x * x).sum(dim=-1, keepdim=True) / 2  # log(phi(x) sqrt(m)): (..., L, m)


# chapters/17-efficient-attention.md, "FAVOR+: random features for the softmax"
def performer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_features: int,
                        causal: bool = False, generator: torch.Generator | None = None, *,
                        orthogonal: bool = True) -> torch.Tensor:
    """FAVOR+ (Choromanski et al. 2021): softmax(q k^T / sqrt(D)) v by `num_features` positive
    random features from `generator` (orthogonal by default); q (..., Lq, D), k (..., Lk, D), v
    (..., Lk, Dv) -> (..., Lq, Dv). In float32, rows underflow to 0 past q, k ~ 12 N(0, 1) (70 in float64)."""
    q, k, v = _check_qkv(q, k, v)
    causal, work = check_bool("causal", causal), compute_dtype(q.dtype)
    w = random_features(num_features, q.shape[-1], orthogonal, generator, work).to(q.device)
    scale = q.shape[-1] ** -0.25  # q.k / sqrt(D) = (q D^-1/4) . (k D^-1/4)
    logq, logk = (_log_features(x.to(work) * scale, w) for x in (q, k))  # (..., L, m)
    fq, v = (logq - logq.amax(dim=-1, keepdim=True)).exp(), v.to(work)  # a constant per query
    tiny = torch.finfo(work).tiny  # 0 / tiny = 0: no key seen, or every product underflowed
    top = logk.amax(dim=-1).clamp(min=torch.finfo(work).min)  # each key's largest, not -inf
    shift = top.cummax(dim=-1).values if causal else top.amax(dim=-1, keepdim=True)  # the largest
    fk = (logk - shift[..., None]).exp()  # over the keys a query sees; each constant cancels
    out = _causal_linear(fq, fk, v, tiny, 64, shift) if causal else _linear_attention(
        fq, fk, v, False, tiny, 64)
    return out.to(q.dtype)


# chapters/17-efficient-attention.md, "Retention: one model, three ways to compute it"
def _check_gamma(gamma: float | torch.Tensor, heads: int, device: torch.device) -> torch.Tensor:
    """`gamma`, a float or a tensor of shape (heads,), in (0, 1], as (heads,) float64."""
    if isinstance(gamma, torch.Tensor):
        gamma = check_tensor("gamma", gamma, 1, shape=(heads,))
        if not ((gamma > 0) & (gamma <= 1)).all():
            raise ValueError(f"gamma must lie in (0, 1], got gamma={gamma.tolist()}")
        return gamma.to(device=device, dtype=torch.float64)
    gamma = check_real("gamma", gamma, 0.0, 1.0, open_low=True)
    return torch.full((heads,), gamma, dtype=torch.float64, device=device)


# chapters/17-efficient-attention.md, "Retention: one model, three ways to compute it"
def _retention_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor) -> torch.Tensor:
    """(Q K^T * D) V over one stretch of positions, D[n, m] = g^(n - m) where n >= m."""
    n = torch.arange(q.shape[2], device=q.device)
    gap = n[:, None] - n[None, :]  # (L, L): n - m
    decay = g ** gap.clamp(min=0)  # (1, H, L, L)
    return torch.where(gap >= 0, (q @ k.transpose(-2, -1)) * decay, 0.0) @ v  # (B, H, L, Dv)


def _retention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_n = g S_(n-1) + k_n^T v_n and o_n = q_n S_n, for q, k (B, H, D) and v (B, H, Dv)."""
    state = g * state + k[..., :, None] * v[..., None, :]  # (B, H, D, Dv)
    return (q[..., None, :] @ state).squeeze(-2), state  # (B, H, Dv)


# chapters/17-efficient-attention.md, "Retention: one model, three ways to compute it"
def retention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float | torch.Tensor,
              mode: str = "parallel", chunk_size: int = 64) -> torch.Tensor:
    """Retention (Sun et al. 2023): (Q K^T * D) V with D[n, m] = gamma^(n - m) for n >= m, else 0;
    no softmax, scale or normalisation. q, k (B, H, L, D), v (B, H, L, Dv) -> (B, H, L, Dv);
    `gamma` a float or an (H,) tensor in (0, 1]; `mode` "parallel", "recurrent" (a D x Dv state)
    or "chunkwise" (chunks of `chunk_size`): the same result."""
    q, k, v = _check_qkv(q, k, v, 4, same_length=True, keys=False)
    mode = check_choice("mode", mode, ("parallel", "recurrent", "chunkwise"))
    chunk_size, dtype, work = check_int("chunk_size", chunk_size, 1), q.dtype, compute_dtype(q.dtype)
    g = _check_gamma(gamma, q.shape[1], q.device).to(work)[None, :, None, None]  # (1, H, 1, 1)
    q, k, v = q.to(work), k.to(work), v.to(work)
    if mode == "parallel" or q.shape[2] == 0:  # (no positions: an empty result in every mode)
        return _retention_parallel(q, k, v, g).to(dtype)
    state, outs = q.new_zeros(*q.shape[:2], q.shape[3], v.shape[3]), []  # (B, H, D, Dv): empty
    if mode == "recurrent":  # S_n = g S_(n-1) + k_n^T v_n, o_n = q_n S_n, one position at a time
        for n in range(q.shape[2]):
            out, state = _retention_step(q[:, :, n], k[:, :, n], v[:, :, n], g, state)
            outs.append(out)  # (B, H, Dv)
        return torch.stack(outs, dim=2).to(dtype)
    for c0 in range(0, q.shape[2], chunk_size):
        qc, kc, vc = (x[:, :, c0:c0 + chunk_size] for x in (q, k, v))  # (B, H, c, .)
        i = torch.arange(qc.shape[2], device=q.device)[:, None]  # (c, 1): offsets in the chunk
        inside = _retention_parallel(qc, kc, vc, g)  # the chunk's own positions
        before = (qc @ state) * g ** (i + 1)  # the earlier chunks, through the state
        outs.append(inside + before)  # (B, H, c, Dv)
        age = g ** (qc.shape[2] - 1 - i)  # (1, H, c, 1): how far each key is from the end
        state = g ** qc.shape[2] * state + (kc * age).transpose(-2, -1) @ vc  # (B, H, D, Dv)
    return torch.cat(outs, dim=2).to(dtype)


# chapters/17-efficient-attention.md, "Generation: a state of fixed size against a growing cache"
def retention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float | torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of retention: q, k (B, H, D) and v (B, H, Dv) of a new position and the state
    (B, H, D, Dv) of those before (None: none) -> (output (B, H, Dv), the new state), whose size
    does not depend on the number of steps."""
    q, k, v = _check_qkv(q, k, v, 3, same_length=True, keys=False)  # (B, H, D): H in Lq's place
    work, shape = compute_dtype(q.dtype), (*q.shape, v.shape[-1])
    state = torch.zeros(shape, dtype=work, device=q.device) if state is None else \
        check_tensor("state", state, 4, dtype=work, device=q.device, shape=shape)
    g = _check_gamma(gamma, q.shape[1], q.device).to(work)[None, :, None, None]  # (1, H, 1, 1)
    out, state = _retention_step(q.to(work), k.to(work), v.to(work), g, state)
    return out.to(q.dtype), state


# chapters/17-efficient-attention.md, "What each costs in quality"
MIXERS = ("softmax", "window", "linear", "retention")


class Mixer(nn.Module):
    """Chapter 17's causal token mixers with multi-head attention's projections, (B, T, d_model)
    -> (B, T, d_model): `kind` one of MIXERS, "window" seeing the last `window` positions."""

    gamma: torch.Tensor  # (num_heads,) retention's decays, a buffer

    def __init__(self, d_model: int, num_heads: int, kind: str = "softmax",
                 window: int = 8) -> None:
        super().__init__()
        self.h, self.kind = check_int("num_heads", num_heads, 1), check_choice("kind", kind, MIXERS)
        self.window = check_int("window", window, 1)
        check_divisible("d_model", check_int("d_model", d_model, 1), "num_heads", num_heads)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm = nn.GroupNorm(num_heads, d_model) if kind == "retention" else nn.Identity()
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(num_heads)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_model)
        B, T, C = x.shape
        q, k, v = (t.unflatten(-1, (self.h, -1)).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if self.kind in ("softmax", "window"):  # the causal mask is a window of T
            mask = sliding_window_mask(T, T, T if self.kind == "softmax" else self.window, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.kind == "linear":  # the cores: no check reads a tensor's value
            y = _causal_linear(F.elu(q) + 1, F.elu(k) + 1, v, 1e-6, 64)
        else:  # retention in its parallel form, as RetNet trains
            y = _retention_parallel(q * (C // self.h) ** -0.5, k, v, self.gamma[:, None, None])
        y = self.norm(y.transpose(1, 2).reshape(B * T, C)).view(B, T, C)
        out: torch.Tensor = self.out(y)
        return out


class TinyLM(nn.Module):
    """Chapter 17's test model: embeddings, one pre-norm block (a Mixer of `kind` and an MLP)
    and a linear read-out, (B, T) token ids, T <= `length` -> (B, T, vocab) logits."""

    def __init__(self, vocab: int, length: int, kind: str = "softmax", window: int = 8,
                 d_model: int = 32, num_heads: int = 4):
        super().__init__()
        vocab, length = check_int("vocab", vocab, 1), check_int("length", length, 1)
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(length, d_model)
        self.norm1, self.norm2, self.norm_f = (nn.LayerNorm(d_model) for _ in range(3))
        self.mix = Mixer(d_model, num_heads, kind, window)  # created third: fixes its init
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(),
                                 nn.Linear(2 * d_model, d_model))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        T = check_int("idx.shape[1]", idx.shape[1], 1, self.pos.num_embeddings)  # <= length
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        x = x + self.mix(self.norm1(x))
        logits: torch.Tensor = self.head(self.norm_f(x + self.mlp(self.norm2(x))))
        return logits


# chapters/17-efficient-attention.md, "Recall at a distance"
def recall_batch(generator: torch.Generator, size: int = 64, keys: int = 12, values: int = 8,
                 pairs: int = 12, asked: int = 8) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """Chapter 17's recall task: `pairs` tokens `key * values + value` (distinct keys), `asked`
    questions `keys * values + key` -> tokens (size, pairs + asked), answers (size, asked), slice."""
    generator = check_instance("generator", generator, torch.Generator)
    size, values, asked = (check_int(n, x, 1) for n, x in zip(("size", "values", "asked"),
                                                                (size, values, asked)))
    pairs = check_int("pairs", pairs, 1, check_int("keys", keys, 1))  # at most one per key
    key = torch.argsort(torch.rand(size, keys, generator=generator), dim=1)[:, :pairs]  # (B, P)
    value = torch.randint(0, values, (size, pairs), generator=generator)  # (B, P)
    pick = torch.randint(0, pairs, (size, asked), generator=generator)  # (B, A): pairs asked
    x = torch.cat([key * values + value, keys * values + key.gather(1, pick)], dim=1)
    return x, value.gather(1, pick), slice(pairs, None)  # answers at the questions only
