# Do not edit: tools/tangle.py generates this file from chapters/03-heads.md and chapters/04-heads-at-work.md and chapters/07-blocks.md.
"""The layers of a Transformer: multi-head attention with its fast path and KV cache, the block and
its parts. Attention and the block are unchecked cores built from a frozen config, each with a
checked public layer around it.

Built and explained in the book's chapters chapters/03-heads.md and chapters/04-heads-at-work.md and chapters/07-blocks.md.
"""

__all__ = [
    "causal_mask",
    "attend",
    "ATTENTION_BACKENDS",
    "AttentionConfig",
    "Attention",
    "MultiHeadAttention",
    "from_torch",
    "LayerCache",
    "head_gate_grad",
    "mask_heads",
    "FeedForward",
    "SwiGLU",
    "RMSNorm",
    "BlockConfig",
    "Block",
    "TransformerBlock",
    "from_torch_encoder_layer",
]

# chapters/03-heads.md, "The attention core"
from collections.abc import Callable  # noqa: F401 (chapter 7's activations)
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnbook.attention import compute_dtype
from attnbook.checks import (
    autocast_dtype,  # noqa: F401 (chapter 4's LayerCache)
    check_bool,
    check_choice,
    check_device,
    check_divisible,
    check_fields,
    check_instance,
    check_int,
    check_mask,
    check_positive,  # noqa: F401 (chapter 7's block)
    check_probability,
    check_scale,
    check_tensor,
    check_tokens,
    check_writable,  # noqa: F401 (chapter 4's LayerCache)
    type_error,
)
from attnbook.positions import ALiBi, Rotary  # noqa: F401 (chapter 7's variants)


def _causal_mask(q_len: int, k_len: int, device: torch.device | None) -> torch.Tensor:
    """causal_mask's computation, for sizes the caller has checked: the book's layers call it."""
    query_positions = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)  # (Lq, 1)
    return torch.arange(k_len, device=device)[None, :] <= query_positions  # (Lq, Lk)


def causal_mask(q_len: int, k_len: int | None = None, *,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (q_len, k_len), True where query i may attend key j <= i + (k_len - q_len):
    the queries are the last q_len of the k_len positions (bottom-right). k_len defaults to q_len."""
    q_len = check_int("q_len", q_len, 1)
    k_len = q_len if k_len is None else check_int("k_len", k_len, 1)
    return _causal_mask(q_len, k_len, None if device is None else check_device("device", device))


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis where `mask` allows; a row with no allowed entry gives zeros."""
    if mask is None:
        return scores.softmax(dim=-1)
    allowed = mask.any(dim=-1, keepdim=True)  # does the query see any key at all?
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~allowed, 0.0)
    return scores.softmax(dim=-1) * allowed


# chapters/03-heads.md, "The attention core"
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            dropout_p: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attend's computation, on arguments already checked: (outputs, weights)."""
    (b, h, lq, d), (kv_heads, lk) = q.shape, k.shape[1:3]
    work = compute_dtype(q.dtype)  # float32 for float16 and bfloat16
    rows = (h // kv_heads) * lq  # a group's queries, stacked: (B, Hkv, rows, d)
    scores = q.reshape(b, kv_heads, rows, d).to(work) @ k.transpose(-2, -1).to(work) * scale
    weights = _masked_softmax(scores.view(b, h, lq, lk), mask)  # (B, H, Lq, Lk)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = (weights.view(b, kv_heads, rows, lk) @ v.to(work)).view(b, h, lq, v.shape[-1])
    if mask is not None:  # a query with no key: zeros, even where 0 x a NaN value would be NaN
        out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return out.to(q.dtype), weights.to(q.dtype)  # (B, H, Lq, dv), (B, H, Lq, Lk)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           dropout_p: float = 0.0, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, Lq, d) over k (B, Hkv, Lk, d) and v (B, Hkv, Lk, dv): outputs
    (B, H, Lq, dv) and weights (B, H, Lq, Lk); query head h reads key/value head h // (H // Hkv).
    `mask`: bool, True = may attend (a query with none gets zeros); float16 computes in float32."""
    q, k, v = _check_qkv(q, k, v)
    (b, h, lq, d), lk = q.shape, k.shape[2]
    mask = None if mask is None else check_mask("mask", mask, (b, h, lq, lk), q.device)
    return _attend(q, k, v, mask, check_probability("dropout_p", dropout_p), check_scale(scale, d))


def _check_qkv(q: object, k: object, v: object) -> tuple[torch.Tensor, ...]:
    q = check_tensor("q", q, 4)
    b, h, _, d = q.shape
    k = check_tensor("k", k, 4, dtype=q.dtype, device=q.device, shape=(b, None, None, d))
    v = check_tensor("v", v, 4, dtype=q.dtype, device=q.device, shape=(*k.shape[:3], None))
    for name, size in (("k.shape[1]", k.shape[1]), ("k.shape[2]", k.shape[2]), ("q.shape[3]", d)):
        check_int(name, size, 1)  # a head, a key and a feature at least
    check_divisible("q.shape[1]", h, "kv_heads", k.shape[1])
    return q, k, v


# chapters/03-heads.md, "The fast path"
def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, is_causal: bool, dropout_p: float) -> torch.Tensor:
    """attend's outputs (B, H, Lq, dv), `is_causal` aligned bottom-right. A mask has two
    dimensions at least (the checks of a call make it so), as in the other backends."""
    return _attend(q, k, v, _with_causal(mask, is_causal, q, k), dropout_p, q.shape[-1] ** -0.5)[0]


def _with_causal(mask: torch.Tensor | None, is_causal: bool, q: torch.Tensor,
                 k: torch.Tensor) -> torch.Tensor | None:
    """`mask` and, with `is_causal`, the bottom-right causal mask: a key must pass both."""
    if not is_causal or q.shape[2] == 1:  # one query, the last position: it sees every key
        return mask
    causal = _causal_mask(q.shape[2], k.shape[2], q.device)  # (Lq, Lk)
    return causal if mask is None else mask & causal


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    is_causal: bool, dropout_p: float) -> torch.Tensor:
    """attend's outputs by PyTorch's SDPA; float16 and bfloat16 on a CPU go to attend, which
    computes them in float32, as it does on every device."""
    if mask is not None or q.shape[2] != k.shape[2] or q.element_size() == 2:
        return _sdpa_general(q, k, v, mask, is_causal, dropout_p)  # the cases SDPA needs help in
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_general(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool, dropout_p: float) -> torch.Tensor:
    """_sdpa_attention with a mask, unequal lengths or two-byte numbers."""
    if q.device.type == "cpu" and q.element_size() == 2:
        return _explicit_attention(q, k, v, mask, is_causal, dropout_p)
    if is_causal and (mask is not None or q.shape[2] != k.shape[2]):  # SDPA's is top-left
        mask, is_causal = _with_causal(mask, True, q, k), False
    shared = q.shape[1] != k.shape[1]  # key/value heads shared by groups of query heads
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                                              enable_gqa=shared)
    seen = mask.any(dim=-1, keepdim=True)  # does the query see any key? (..., Lq, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen, dropout_p=dropout_p,
                                         enable_gqa=shared)
    return out.masked_fill(~seen, 0.0)  # the rows that saw nothing: zeros, as in attend


def _nan_where_not_finite(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """out, NaN in the rows whose query holds a NaN or an infinity (SDPA's CPU kernel gives
    them zeros in cross-attention); the other rows, however large, as they are."""
    finite = q.isfinite().all(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    return out.masked_fill(~finite, float("nan"))


# chapters/03-heads.md, "The fast path"
def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, is_causal: bool, dropout_p: float) -> torch.Tensor:
    """attend's outputs by chapter 15's kernel when it takes the call, else by SDPA."""
    if not _kernel_takes(q, k, v, mask, dropout_p):
        return _sdpa_attention(q, k, v, mask, is_causal, dropout_p)
    from attnbook.kernels import _flash_attention  # imports Triton, only when asked for

    group = q.shape[1] // k.shape[1]  # the kernel has no shared heads: they are repeated for it
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    out = _flash_attention(q, k, v, is_causal, q.shape[-1] ** -0.5)
    lq, lk = q.shape[2], k.shape[2]
    if is_causal and lq > lk:  # the first lq - lk queries see no key: zeros, even by a NaN value
        out = out.masked_fill(torch.arange(lq, device=q.device)[:, None] < lq - lk, 0.0)
    return out


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  dropout_p: float) -> bool:
    """Whether chapter 15's kernel computes this call: Triton installed; a GPU, or a CPU with
    Triton's interpreter (float32 only there); no mask, no dropout, no empty tensor; a head size
    of 16, 32, 64 or 128 for q, k and v; float16, float32 or (compiled, on a GPU that has it)
    bfloat16, which the interpreter gets wrong."""
    try:
        from attnbook.kernels import INTERPRETED  # imports Triton, only when its backend is asked
    except ImportError:  # Triton is not installed
        return False
    dtypes: tuple[torch.dtype, ...]  # those the kernel computes right on this device
    if q.device.type != "cuda":
        dtypes = (torch.float32,) if INTERPRETED and not q.is_meta else ()
    elif torch.cuda.get_device_capability(q.device) >= (8, 0) and not INTERPRETED:
        dtypes = (torch.float16, torch.float32, torch.bfloat16)
    else:
        dtypes = (torch.float16, torch.float32)
    return (mask is None and dropout_p == 0.0 and min(q.numel(), k.numel()) > 0
            and q.dtype in dtypes and q.shape[-1] in (16, 32, 64, 128)
            and v.shape[-1] == q.shape[-1])


_BACKENDS = {"explicit": _explicit_attention, "sdpa": _sdpa_attention, "triton": _triton_attention}
ATTENTION_BACKENDS = tuple(_BACKENDS)  # the names a layer's backend may take


# chapters/03-heads.md, "The module"
@dataclass(frozen=True)
class AttentionConfig:
    """The settings of a multi-head attention layer; `num_kv_heads` None means `num_heads`."""

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None
    bias: bool = True
    dropout: float = 0.0  # on the attention weights, in training mode
    backend: str = "sdpa"  # one of ATTENTION_BACKENDS, used when the weights are not asked for

    def __post_init__(self) -> None:
        check_fields(self, {"d_model": (check_int, 1), "num_heads": (check_int, 1),
                            "num_kv_heads": (check_int, 1), "dropout": (check_probability,),
                            "bias": (check_bool,), "backend": (check_choice, ATTENTION_BACKENDS)},
                     optional=("num_kv_heads",))  # each field, checked, as a plain Python value
        check_divisible("d_model", self.d_model, "num_heads", self.num_heads)
        check_divisible("num_heads", self.num_heads, "num_kv_heads", self.kv_heads)

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# chapters/03-heads.md, "The module"
class Attention(nn.Module):
    """Multi-head attention built from an AttentionConfig; its calls are not checked (see
    MultiHeadAttention). Each projection's weight starts Xavier-uniform, its bias at zero."""

    def __init__(self, config: AttentionConfig, rotary: nn.Module | None = None,
                 fast: nn.Module | None = None) -> None:
        super().__init__()
        config = check_instance("config", config, AttentionConfig)
        # chapter 7's variants: RoPE turns q and k, rotary(q, k, start, position_ids) -> (q, k),
        # position_ids None or (B, Lq); ALiBi attends with a bias, fast(q, k, v, mask, is_causal,
        # dropout_p) -> out, whose `with_weights` gives (out, weights) too
        for name, hook in (("rotary", rotary), ("fast", fast)):
            if hook is not None and not callable(hook):
                raise type_error(name, hook, "callable or None")
        self.rotary = _unturned if rotary is None else rotary
        self.fast: Any = fast  # None: the backend's function; a variant's has with_weights
        self.config, width, kv_width = config, config.d_model, config.kv_heads * config.head_dim
        self.d_model, self.num_heads = config.d_model, config.num_heads  # sizes the checks and
        self.num_kv_heads, self.head_dim = config.kv_heads, config.head_dim  # chapter 4 read
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (  # nn.Linear(d_model, width)
            nn.Linear(width, w, bias=config.bias) for w in (width, kv_width, kv_width, width))
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            if config.bias:
                nn.init.zeros_(proj.bias)

    @property
    def backend(self) -> str:  # the config's, read-only: a new backend is a new config
        return self.config.backend

    @property
    def dropout(self) -> float:
        return self.config.dropout

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, is_causal: bool = False,
                return_weights: bool = False, cache: Any = None,  # chapter 4's LayerCache
                position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from x (B, Lq, d_model) to context (B, Lk, d_model; default x): the outputs
        (B, Lq, d_model) and, with `return_weights`, the weights (B, nh, Lq, Lk), else None.
        `is_causal` aligns bottom-right; `cache` (self-attention only; chapter 4's LayerCache)
        keeps earlier keys and values, which x's join first; a mask has two dimensions at least.
        `position_ids` (B, Lq), x's positions for a `rotary` hook, replace the cache's count."""
        if context is not None or cache is not None or return_weights:
            return self._attend_with(x, context, mask, is_causal, return_weights, cache,
                                     position_ids)  # cross-attention, a cache or the weights
        q, k, v = self._heads(x, x)  # (B, nh, L, hs), (B, nkv, L, hs) twice
        q, k = self.rotary(q, k, 0, position_ids)
        fast = _BACKENDS[self.config.backend] if self.fast is None else self.fast
        out = fast(q, k, v, mask, is_causal, self.config.dropout * self.training)  # in training
        return self.out_proj(out.transpose(1, 2).flatten(2)), None  # (B, L, d_model), no weights

    def _heads(self, x: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (B, nh, Lq, hs) from x, k and v (B, nkv, Lk, hs) from source."""
        q = _split_heads(self.q_proj(x), self.num_heads)
        return q, *(_split_heads(p(source), self.num_kv_heads) for p in (self.k_proj, self.v_proj))

    def _attend_with(self, x: torch.Tensor, context: torch.Tensor | None,
                     mask: torch.Tensor | None, is_causal: bool, return_weights: bool,
                     cache: Any,
                     position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward with a context, a cache or the weights asked for."""
        q, k, v = self._heads(x, x if context is None else context)
        q, k = self.rotary(q, k, 0 if cache is None else cache.length, position_ids)  # x's first
        if cache is not None:
            k, v = cache._append(k, v)  # this chunk's and every earlier position: (B, nkv, Lk, hs)
        dropout_p = self.config.dropout if self.training else 0.0
        if return_weights and self.fast is not None:  # a variant's own, with its bias
            out, weights = self.fast.with_weights(q, k, v, mask, is_causal, dropout_p)
        elif return_weights:  # only the explicit computation has them
            mask = _with_causal(mask, is_causal, q, k)
            out, weights = _attend(q, k, v, mask, dropout_p, self.head_dim ** -0.5)
        else:
            fast = _BACKENDS[self.config.backend] if self.fast is None else self.fast
            out, weights = fast(q, k, v, mask, is_causal, dropout_p), None
        if context is not None:  # a query the keys do not share: a bad one must still show
            out = _nan_where_not_finite(out, q)
        return self.out_proj(out.transpose(1, 2).flatten(2)), weights  # (B, Lq, d_model), ...


def _unturned(q: torch.Tensor, k: torch.Tensor, start: int,
              position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k  # no positions inside attention: GPT-2's and BERT's are added to the inputs


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, heads * hs) -> (B, heads, L, hs)."""
    b, length, width = t.shape
    return t.view(b, length, heads, width // heads).transpose(1, 2)


# chapters/03-heads.md, "The module"
class MultiHeadAttention(Attention):
    """Multi-head attention, batch first, with `num_kv_heads` (default `num_heads`) key/value
    heads shared by the query heads; every call is checked. The arguments are AttentionConfig's."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, dropout: float = 0.0, backend: str = "sdpa") -> None:
        super().__init__(AttentionConfig(d_model, num_heads, num_kv_heads, bias, dropout, backend))

    def forward(  # type: ignore[override]  # no position_ids; the weights only when asked
            self, x: torch.Tensor, context: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, is_causal: bool = False,
            return_weights: bool = False, cache: Any = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Attention.forward, after checking the call, without `position_ids` (positions count
        from the cache's length): the outputs, and the weights only with `return_weights`."""
        mask = _check_attention_call(self, x, context, mask, is_causal, return_weights, cache)
        out, weights = super().forward(x, context, mask, is_causal, return_weights, cache)
        return (out, weights) if return_weights else out


# chapters/03-heads.md, "The module"
def _check_attention_call(layer: Attention, x: object, context: object, mask: object,
                          is_causal: object, return_weights: object,
                          cache: Any) -> torch.Tensor | None:
    """Refuse, naming the argument, what Attention.forward cannot compute; return the mask with
    two dimensions at least."""
    x = check_tokens("x", x, layer.q_proj.weight)
    if context is not None:
        context = check_tokens("context", context, layer.k_proj.weight, batch=x.shape[0])
    check_bool("is_causal", is_causal), check_bool("return_weights", return_weights)
    (b, lq, _), lk = x.shape, x.shape[1] if context is None else context.shape[1]
    if cache is not None:
        if context is not None:
            raise ValueError("a cache is for self-attention: give a context or a cache, not both")
        if not callable(getattr(cache, "_check_call", None)):  # chapter 4's LayerCache has it
            raise type_error("cache", cache, "a LayerCache")
        cache._check_call(layer, x)  # x's keys and values must fit the cache
        lk += cache.length
    if mask is not None:  # a 0-d or (Lk,) mask as (1, 1) or (1, Lk), for SDPA
        mask = check_mask("mask", mask, (b, layer.num_heads, lq, lk), x.device)
        return mask[(None,) * (2 - mask.dim())]
    return None


# chapters/03-heads.md, "Checking against PyTorch's MultiheadAttention"
def from_torch(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """A MultiHeadAttention with the weights, device, dtype and mode of `module`, which reads and
    returns `module`'s layout: (B, L, d_model) batch first, (L, B, d_model) sequence first
    (batch_first=False, PyTorch's default), or unbatched (L, d_model) in either. Its masks and
    weights stay batch first, as everywhere in the book: (B, H, Lq, Lk), or (H, Lq, Lk)
    unbatched."""
    check_instance("module", module, nn.MultiheadAttention)
    if module.in_proj_weight is None or module.bias_k is not None or module.add_zero_attn:
        raise ValueError("module must have kdim == vdim == embed_dim, add_bias_kv=False and "
                         f"add_zero_attn=False, got {module}")
    has_bias = module.in_proj_bias is not None
    ours = _TorchLayout(module.embed_dim, module.num_heads, bias=has_bias,
                        dropout=module.dropout).to(module.in_proj_weight)  # dtype, device
    ours.batch_first = bool(module.batch_first)
    names = ("q_proj", "k_proj", "v_proj")  # in_proj_* holds the three stacked: (3 d_model, ...)
    state = {f"{n}.weight": w for n, w in zip(names, module.in_proj_weight.chunk(3))}
    state |= {f"out_proj.{k}": t for k, t in module.out_proj.state_dict().items()}
    if has_bias:
        state |= {f"{n}.bias": b for n, b in zip(names, module.in_proj_bias.chunk(3))}
    ours.load_state_dict(state)
    return ours.train(module.training)


# chapters/03-heads.md, "Checking against PyTorch's MultiheadAttention"
class _TorchLayout(MultiHeadAttention):
    """MultiHeadAttention for inputs and outputs in an nn.MultiheadAttention's layout: (L, B,
    d_model) sequence first, (B, L, d_model) batch first, or unbatched (L, d_model) in either (its
    weights then (H, Lq, Lk)); made by from_torch."""

    batch_first = False  # from_torch sets the module's

    def forward(self, x: Any, context: Any = None, *args: Any,  # type: ignore[override]
                **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        d, batch_axis = self.d_model, 0 if self.batch_first else 1
        layout = f"(B, L, {d})" if self.batch_first else f"(L, B, {d})"
        for name, t in (("x", x), ("context", context)):  # shapes as the caller wrote them
            if isinstance(t, torch.Tensor) and (t.dim() not in (2, 3) or t.shape[-1] != d):
                raise ValueError(f"{name} must have shape {layout}, or (L, {d}) unbatched, "
                                 f"got shape {tuple(t.shape)}")
        if isinstance(x, torch.Tensor) and isinstance(context, torch.Tensor):
            _check_context_like_x(x, context, batch_axis)
        unbatched = isinstance(x, torch.Tensor) and x.dim() == 2  # a batch of one

        def flip(t: Any) -> Any:  # (L, B, d) <-> (B, L, d), or (L, d) -> (1, L, d); the rest left to checks
            if not isinstance(t, torch.Tensor) or t.dim() != (2 if unbatched else 3):
                return t
            return t[None] if unbatched else t.transpose(0, 1) if batch_axis else t

        result = super().forward(flip(x), flip(context), *args, **kwargs)
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = out[0] if unbatched else flip(out)  # (Lq, d_model), or x's layout
        if not isinstance(result, tuple):
            return out
        return out, weights[0] if unbatched and weights is not None else weights


def _check_context_like_x(x: torch.Tensor, context: torch.Tensor, batch_axis: int) -> None:
    """context, as the caller wrote it: of x's rank, with x's batch size on `batch_axis`."""
    d, b = x.shape[-1], None if x.dim() == 2 else x.shape[batch_axis]
    wanted = f"(S, {d})" if b is None else f"({b}, S, {d})" if batch_axis == 0 else f"(S, {b}, {d})"
    if context.dim() != x.dim() or (b is not None and context.shape[batch_axis] != b):
        raise ValueError(f"context must have shape {wanted}, as x of shape {tuple(x.shape)} "
                         f"asks, got shape {tuple(context.shape)}")


# chapters/04-heads-at-work.md, "Keeping keys and values for generation"
class LayerCache:
    """One attention layer's keys and values for the positions read so far, in storage `keys`
    and `values` (B, num_kv_heads, capacity, head_dim) that the caller allocates; `length`
    counts the positions filled. It keeps no autograd history: use it under torch.no_grad()."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = check_tensor("keys", keys, 4)  # (B, num_kv_heads, capacity, head_dim)
        self.values = check_tensor("values", values, 4, dtype=keys.dtype, device=keys.device,
                                   shape=(*keys.shape[:3], None))  # (B, nkv, capacity, d_v)
        for name, storage in (("keys", keys), ("values", values)):
            check_writable(name, storage)
            # append writes in place: outside no_grad, that fails on a leaf that requires
            # grad and, on a non-leaf, silently records autograd history
            if storage.requires_grad:
                raise ValueError(f"{name} requires grad, but a LayerCache keeps no autograd "
                                 "history: allocate it without requires_grad, or detach() it")
        if keys.numel() and not keys.is_meta and keys.data_ptr() == values.data_ptr():
            raise ValueError("keys and values are the same memory: give each its own storage")
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reset(self) -> None:
        """Forget every position; the storage is kept, to be written over."""
        self.length = 0

    # chapters/04-heads-at-work.md, "Keeping keys and values for generation"
    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k and v (B, num_kv_heads, n, head_dim) after the positions so far; return all
        the keys and values so far, (B, num_kv_heads, length, head_dim)."""
        k = check_tensor("k", k, 4, dtype=self.keys.dtype, device=self.keys.device,
                         shape=(*self.keys.shape[:2], None, self.keys.shape[3]))
        v = check_tensor("v", v, 4, dtype=self.values.dtype, device=self.values.device,
                         shape=(*self.values.shape[:2], k.shape[2], self.values.shape[3]))
        _check_fits(self, k.shape[2], k.requires_grad or v.requires_grad)
        return self._append(k, v)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # append's computation, on a chunk already checked (by append, or by the layer's call)
        start, n = self.length, k.shape[2]
        self.keys[:, :, start:start + n], self.values[:, :, start:start + n] = k, v
        self.length += n
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    # chapters/04-heads-at-work.md, "Keeping keys and values for generation"
    def _check_call(self, layer: Attention, x: torch.Tensor) -> None:
        """Refuse, as append would, a call of `layer` on x (B, n, d_model) that would not fit."""
        b, hkv, hs, w = x.shape[0], layer.num_kv_heads, layer.head_dim, layer.k_proj.weight
        for name in ("keys", "values"):
            check_tensor(f"cache.{name}", getattr(self, name), 4, device=w.device,
                         shape=(b, hkv, None, hs))
        dtype = autocast_dtype(w) or w.dtype  # what q, k, v are
        if self.keys.dtype != dtype:  # else rounded
            raise ValueError(f"cache holds {self.keys.dtype}, but the layer's keys and values are "
                             f"{dtype}: allocate the cache in {dtype}")
        _check_fits(self, x.shape[1], x.requires_grad or w.requires_grad)

    @classmethod
    def _over(cls, keys: torch.Tensor, values: torch.Tensor) -> "LayerCache":
        """A LayerCache over storage its caller made itself (chapter 10's KVCache): unchecked."""
        cache = cls.__new__(cls)
        cache.keys, cache.values, cache.length = keys, values, 0
        return cache


def _check_fits(cache: "LayerCache", n: int, requires_grad: bool) -> None:
    if cache.length + n > cache.capacity:
        raise ValueError(f"k of {n} positions does not fit: the cache holds {cache.length} "
                         f"positions of its capacity {cache.capacity}")
    if torch.is_grad_enabled() and requires_grad:
        raise ValueError("k and v require grad: use a LayerCache under torch.no_grad()")


# chapters/04-heads-at-work.md, "Which heads can go"
def head_gate_grad(attn: Attention) -> torch.Tensor:
    """The gradient of the last backward pass's loss with respect to a gate g_h on each head's
    output at g_h = 1, (num_heads,), read from out_proj.weight and its .grad (chapter 4,
    "Which heads can go"): the input of out_proj is the heads side by side, so scaling head h by
    g_h scales its block of columns, and dL/dg_h = sum(W[:, block h] * dL/dW[:, block h])."""
    check_instance("attn", attn, Attention)
    weight = attn.out_proj.weight  # (d_model, nh * hs)
    if weight.grad is None:
        raise ValueError("attn.out_proj.weight.grad is None: call loss.backward() first")
    products = (weight * weight.grad).view(weight.shape[0], attn.num_heads, attn.head_dim)
    return products.sum(dim=(0, 2)).detach()  # (nh,)


def mask_heads(attn: Attention, heads: "list[int] | tuple[int, ...] | range | torch.Tensor"
               ) -> Attention:
    """Silence `heads` (indices from 0 to num_heads - 1) of `attn`, in place: zero their blocks
    of columns of out_proj.weight, so their finite outputs never reach the layer's output (a
    NaN or an infinity still does: 0 * NaN is NaN)."""
    check_instance("attn", attn, Attention)
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__") \
            or getattr(heads, "ndim", 1) != 1:  # an int, None, a 0-d or 2-d array or tensor
        raise TypeError(f"heads must be a sequence of head indices, got heads={heads!r}")
    heads = [check_int("heads", h, 0, attn.num_heads - 1) for h in heads]
    hs = attn.head_dim
    with torch.no_grad():
        for h in heads:
            attn.out_proj.weight[:, h * hs:(h + 1) * hs] = 0.0
    return attn


# chapters/07-blocks.md, "The feed-forward network"
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


# chapters/07-blocks.md, "The feed-forward network"
class FeedForward(nn.Module):
    """fc2(dropout(act(fc1(x)))) at each position on its own; d_ff defaults to 4 * d_model.
    Its settings are checked; x is left to PyTorch, as nn.Linear leaves it (a block checks it)."""

    def __init__(self, d_model: int, d_ff: int | None = None, activation: str = "gelu",
                 dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        d_model, bias = check_int("d_model", d_model, 1), check_bool("bias", bias)
        d_ff = 4 * d_model if d_ff is None else check_int("d_ff", d_ff, 1)
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.act = _ACTIVATIONS[check_choice("activation", activation, _ACTIVATIONS)]()
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.dropout(self.act(self.fc1(x))))  # (..., d_ff) inside
        return out  # (..., d_model)


# chapters/07-blocks.md, "The feed-forward network"
class SwiGLU(nn.Module):
    """fc2(dropout(silu(gate(x)) * fc1(x))), the gated feed-forward network of Llama; d_ff
    defaults to 4 * d_model. Its settings are checked; x is left to PyTorch, as in FeedForward."""

    def __init__(self, d_model: int, d_ff: int | None = None, dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        d_model, bias = check_int("d_model", d_model, 1), check_bool("bias", bias)
        d_ff = 4 * d_model if d_ff is None else check_int("d_ff", d_ff, 1)
        self.gate, self.fc1 = (nn.Linear(d_model, d_ff, bias=bias) for _ in range(2))
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.dropout(F.silu(self.gate(x)) * self.fc1(x)))
        return out  # (..., d_model)


# chapters/07-blocks.md, "Normalisation"
class RMSNorm(nn.Module):
    """x / sqrt(mean(x**2) + eps) * weight over the last axis, in float32 for float16/bfloat16.
    Its settings are checked, and the width of x, which would otherwise broadcast."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = check_positive("eps", eps)
        self.weight = nn.Parameter(torch.ones(check_int("d_model", d_model, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != self.weight.shape:  # a width of 1 would broadcast: a wrong answer
            raise ValueError(f"x must end in a dimension of size {self.weight.shape[0]}, "
                             f"got shape {tuple(x.shape)}")
        work = x.to(compute_dtype(x.dtype))
        normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


# chapters/07-blocks.md, "The block"
@dataclass(frozen=True)
class BlockConfig:
    """The settings of a Transformer block; d_ff None means 4 * d_model, and attn_dropout and
    ff_dropout None mean `dropout`."""

    d_model: int
    num_heads: int
    d_ff: int | None = None
    dropout: float = 0.0
    norm_first: bool = True
    cross_attention: bool = False
    activation: str = "gelu"
    norm: str = "layernorm"
    eps: float = 1e-5
    num_kv_heads: int | None = None
    bias: bool = True
    attn_dropout: float | None = None
    ff_dropout: float | None = None
    backend: str = "sdpa"
    positions: str = "none"  # inside the self-attention: "rope" or "alibi" (chapter 5)
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        check_fields(self, {  # BlockConfig's own fields (the attention's are AttentionConfig's)
            "dropout": (check_probability,), "attn_dropout": (check_probability,),
            "ff_dropout": (check_probability,), "norm_first": (check_bool,), "cross_attention":
            (check_bool,), "activation": (check_choice, (*_ACTIVATIONS, "swiglu")),
            "norm": (check_choice, ("layernorm", "rmsnorm")), "eps": (check_positive,),
            "d_ff": (check_int, 1), "positions": (check_choice, ("none", "rope", "alibi")),
            "rope_base": (check_positive,)}, optional=("d_ff", "attn_dropout", "ff_dropout"))
        attention = self.attention  # AttentionConfig checks the attention's settings
        for name in ("d_model", "num_heads", "num_kv_heads", "bias"):
            object.__setattr__(self, name, getattr(attention, name))
        if self.positions == "rope":  # RoPE turns pairs of a head's coordinates
            check_divisible("head_dim", attention.head_dim, "2", 2)

    @property
    def attention(self) -> AttentionConfig:
        rate = self.dropout if self.attn_dropout is None else self.attn_dropout
        return AttentionConfig(self.d_model, self.num_heads, self.num_kv_heads, self.bias, rate,
                               self.backend)


# chapters/07-blocks.md, "The block"
_Out = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # x, weights
_Own = tuple[bool, LayerCache | None, torch.Tensor | None]  # the self-attention's last arguments


class Block(nn.Module):
    """Self-attention, optional cross-attention and a feed-forward network, each in a residual
    connection with a normalisation, pre-norm or post-norm; its calls are not checked."""

    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        c = self.config = check_instance("config", config, BlockConfig)
        self.self_attn = Attention(c.attention, *_inside_attention(c))
        self.attn_norm = _make_norm(c)
        self.cross_attn = Attention(c.attention) if c.cross_attention else None
        self.cross_norm: Any = _make_norm(c) if c.cross_attention else None  # with cross_attn
        ff_dropout = c.dropout if c.ff_dropout is None else c.ff_dropout
        self.ff = SwiGLU(c.d_model, c.d_ff, ff_dropout, c.bias) if c.activation == "swiglu" \
            else FeedForward(c.d_model, c.d_ff, c.activation, ff_dropout, c.bias)
        self.ff_norm, self.dropout = _make_norm(c), nn.Dropout(c.dropout)

    @property
    def plain(self) -> bool:  # forward's own path (pre-norm, self-attention only), else _sublayers
        return (self.config.norm_first, self.cross_attn is None) == (True, True)  # the layers held

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                is_causal: bool = False, context: torch.Tensor | None = None,
                context_mask: torch.Tensor | None = None, return_weights: bool = False,
                cache: LayerCache | None = None, position_ids: torch.Tensor | None = None
                ) -> _Out:
        """(B, L, d_model) -> (B, L, d_model), and with `return_weights` the self- and cross-
        attention weights (or None). `mask`, `is_causal`, `cache` and `position_ids` go to the
        self-attention, `context` (B, Lc, d_model) and `context_mask` to the cross-attention, if
        the block has it."""
        own = (return_weights, cache, position_ids)  # the self-attention's last arguments
        if return_weights or not self.plain:
            return self._sublayers(x, mask, is_causal, context, context_mask, own)
        h = self.self_attn(self.attn_norm(x), None, mask, is_causal, *own)[0]
        x = x + self.dropout(h)  # pre-norm: x + f(norm(x)) for each sublayer f
        out: torch.Tensor = x + self.dropout(self.ff(self.ff_norm(x)))
        return out

    def _sublayers(self, x: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, context: torch.Tensor | None,
                   context_mask: torch.Tensor | None, own: _Own) -> _Out:
        """forward with the weights, a cross-attention or norm_first=False."""
        return_weights = own[0]
        if not self.config.norm_first:
            return self._post_norm(x, mask, is_causal, context, context_mask, own)
        h, self_w = self.self_attn(self.attn_norm(x), None, mask, is_causal, *own)
        x, cross_w = x + self.dropout(h), None  # pre-norm: x + f(norm(x)) for each sublayer f
        if self.cross_attn is not None:
            h, cross_w = self.cross_attn(self.cross_norm(x), context, context_mask, False,
                                         return_weights)
            x = x + self.dropout(h)
        x = x + self.dropout(self.ff(self.ff_norm(x)))
        return (x, self_w, cross_w) if return_weights else x

    def _post_norm(self, x: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, context: torch.Tensor | None,
                   context_mask: torch.Tensor | None, own: _Own) -> _Out:
        """forward with norm_first=False: norm(x + f(x)) for each sublayer f."""
        h, self_w = self.self_attn(x, None, mask, is_causal, *own)
        return_weights = own[0]
        x, cross_w = self.attn_norm(x + self.dropout(h)), None
        if self.cross_attn is not None:
            h, cross_w = self.cross_attn(x, context, context_mask, False, return_weights)
            x = self.cross_norm(x + self.dropout(h))
        x = self.ff_norm(x + self.dropout(self.ff(x)))
        return (x, self_w, cross_w) if return_weights else x


# chapters/07-blocks.md, "The block"
def _inside_attention(c: BlockConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """The self-attention's `rotary` and `fast` (chapter 3) for c.positions: RoPE turns q and
    k, ALiBi attends with a bias; None keeps the attention's own."""
    rotary = Rotary(c.attention.head_dim, c.rope_base) if c.positions == "rope" else None
    alibi = _ALiBiAttention(c.num_heads, c.backend) if c.positions == "alibi" else None
    return rotary, alibi


class _ALiBiAttention(nn.Module):
    """Attention with chapter 5's bias added to the scores, where `mask` (with is_causal, the
    causal mask too) allows a key: written out for the weights and the explicit backend, else by
    SDPA (Triton's kernel takes no bias). A query with no allowed key gets zeros. A bool mask of
    the keys (B, 1, 1, Lk), a padded batch's (chapter 19), counts the distances over each row's
    allowed keys alone, as BLOOM does, so padding inside a row changes nothing."""

    def __init__(self, num_heads: int, backend: str) -> None:
        super().__init__()
        self.alibi, self.backend = ALiBi(num_heads), backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                dropout_p: float) -> torch.Tensor:
        if self.backend == "explicit" or (q.device.type == "cpu" and q.element_size() == 2):
            return self.with_weights(q, k, v, mask, is_causal, dropout_p)[0]
        bias = self.alibi(q.shape[2], k.shape[2], _key_at(mask)).to(q.dtype)  # ([B,] nh, Lq, Lk)
        allowed = _with_causal(mask, is_causal, q, k)
        if allowed is not None:  # a row of -inf would be NaN: it attends to all, then zeros
            seen = allowed.any(dim=-1, keepdim=True)
            bias = bias.masked_fill(~(allowed | ~seen), float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out if allowed is None else out.masked_fill(~seen, 0.0)

    def with_weights(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                     dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(outputs (B, nh, Lq, hs), weights (B, nh, Lq, Lk)), computed in float32 at least."""
        allowed, work = _with_causal(mask, is_causal, q, k), compute_dtype(q.dtype)
        group = q.shape[1] // k.shape[1]  # key/value heads repeated for their query heads
        k, v = (t.repeat_interleave(group, dim=1).to(work) for t in (k, v))
        scores = q.to(work) @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        bias = self.alibi(q.shape[2], k.shape[2], _key_at(mask)).to(work)  # ([B,] nh, Lq, Lk)
        weights = _masked_softmax(scores + bias, allowed)
        out = F.dropout(weights, p=dropout_p) @ v if dropout_p > 0.0 else weights @ v
        if allowed is not None:  # a query with no key: zeros, even by a NaN value
            out = out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
        return out.to(q.dtype), weights.to(q.dtype)


def _key_at(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Each key's position (B, Lk) among its row's allowed ones, for a keys' mask (B, 1, 1, Lk)."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
        return None
    return mask[:, 0, 0].cumsum(-1)  # a masked key's is its allowed neighbour's: it is never read


def _make_norm(c: BlockConfig) -> nn.Module:
    if c.norm == "rmsnorm":
        return RMSNorm(c.d_model, c.eps)  # it has no bias
    return nn.LayerNorm(c.d_model, eps=c.eps, bias=c.bias)


# chapters/07-blocks.md, "The block"
class TransformerBlock(Block):
    """A Block whose calls are checked; the arguments are BlockConfig's fields."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None,
                 dropout: float = 0.0, norm_first: bool = True, cross_attention: bool = False,
                 activation: str = "gelu", norm: str = "layernorm", eps: float = 1e-5,
                 num_kv_heads: int | None = None, bias: bool = True,
                 attn_dropout: float | None = None, ff_dropout: float | None = None,
                 backend: str = "sdpa", positions: str = "none",
                 rope_base: float = 10000.0) -> None:
        super().__init__(BlockConfig(d_model, num_heads, d_ff, dropout, norm_first,
                                     cross_attention, activation, norm, eps, num_kv_heads, bias,
                                     attn_dropout, ff_dropout, backend, positions, rope_base))

    def forward(  # type: ignore[override]  # without position_ids
            self, x: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False,
            context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
            return_weights: bool = False, cache: LayerCache | None = None) -> Any:
        """Block.forward, after checking the call, without `position_ids`: positions count from
        the cache's length (GPT passes a padded batch's own to its unchecked Blocks)."""
        check_tensor("x", x, 3, size=self.config.d_model)
        mask = _check_attention_call(self.self_attn, x, None, mask, is_causal, return_weights,
                                     cache)
        if self.cross_attn is None and (context is not None or context_mask is not None):
            raise ValueError("block has no cross-attention: context and context_mask must be None")
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("block has cross-attention: it needs a context, got context=None")
            context_mask = _check_attention_call(self.cross_attn, x, context, context_mask, False,
                                                 False, None)
        return super().forward(x, mask, is_causal, context, context_mask, return_weights, cache)


# chapters/07-blocks.md, "Checking against PyTorch"
def from_torch_encoder_layer(layer: nn.TransformerEncoderLayer) -> TransformerBlock:
    """A TransformerBlock copy of `layer` (batch_first; ReLU or GELU), on its device and dtype."""
    check_instance("layer", layer, nn.TransformerEncoderLayer)
    kind = _activation_name(layer.activation)
    if kind is None or not layer.self_attn.batch_first:
        raise ValueError("layer must be batch_first with activation relu, gelu or "
                         f"GELU(approximate='tanh'), got {layer}")
    ours = TransformerBlock(layer.linear1.in_features, layer.self_attn.num_heads,
                            d_ff=layer.linear1.out_features, dropout=layer.dropout.p,
                            norm_first=layer.norm_first, activation=kind, eps=layer.norm1.eps,
                            bias=layer.linear1.bias is not None).to(layer.linear1.weight)
    ours.self_attn.load_state_dict(from_torch(layer.self_attn).state_dict())
    for mine, theirs in [(ours.ff.fc1, layer.linear1), (ours.ff.fc2, layer.linear2),
                         (ours.attn_norm, layer.norm1), (ours.ff_norm, layer.norm2)]:
        mine.load_state_dict(theirs.state_dict())
    return ours.train(layer.training)


def _activation_name(fn: Any) -> str | None:
    """The FeedForward activation that a TransformerEncoderLayer's `activation` computes."""
    if isinstance(fn, nn.GELU):
        return "gelu_tanh" if fn.approximate == "tanh" else "gelu"
    return "relu" if isinstance(fn, nn.ReLU) else {F.relu: "relu", F.gelu: "gelu"}.get(fn)
