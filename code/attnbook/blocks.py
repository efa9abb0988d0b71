# Do not edit: tools/tangle.py generates this file from chapters/07-blocks.md.
"""The Transformer block: the feed-forward network, RMSNorm, pre- and post-norm residuals, and a
copy of torch.nn.TransformerEncoderLayer.

Built and explained in the book's chapter chapters/07-blocks.md.
"""

__all__ = [
    "FeedForward",
    "RMSNorm",
    "TransformerBlock",
    "from_torch_encoder_layer",
]

# chapters/07-blocks.md, "The feed-forward network"
import torch
import torch.nn.functional as F
from torch import nn

from attnbook.conventions import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_positive,
    check_probability,
    check_tensor,
    compute_dtype,
)
from attnbook.heads import LayerCache, MultiHeadAttention, from_torch

_ACTIVATIONS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


# chapters/07-blocks.md, "The feed-forward network"
class FeedForward(nn.Module):
    """fc2(dropout(act(fc1(x)))) at each position on its own; d_ff defaults to 4 * d_model.
    `check_inputs=False` (inside a block, which checks its own inputs) skips the check of x."""

    def __init__(self, d_model: int, d_ff: int | None = None, activation: str = "gelu",
                 dropout: float = 0.0, bias: bool = True, check_inputs: bool = True) -> None:
        super().__init__()
        self.check_inputs = check_bool("check_inputs", check_inputs)
        d_model, bias = check_int("d_model", d_model, 1), check_bool("bias", bias)
        d_ff = 4 * d_model if d_ff is None else check_int("d_ff", d_ff, 1)
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.act = _ACTIVATIONS[check_choice("activation", activation, _ACTIVATIONS)]()
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check_inputs:
            check_tensor("x", x, size=self.d_model)  # (..., d_model)
        return self.fc2(self.dropout(self.act(self.fc1(x))))  # (..., d_ff) inside


# chapters/07-blocks.md, "Normalisation"
class RMSNorm(nn.Module):
    """x / sqrt(mean(x**2) + eps) * weight over the last axis, in float32 for float16/bfloat16;
    `check_inputs=False` (inside a block) skips the check of x."""

    def __init__(self, d_model: int, eps: float = 1e-6, check_inputs: bool = True) -> None:
        super().__init__()
        self.d_model, self.eps = check_int("d_model", d_model, 1), check_positive("eps", eps)
        self.check_inputs = check_bool("check_inputs", check_inputs)
        self.weight = nn.Parameter(torch.ones(self.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check_inputs:
            check_tensor("x", x, size=self.d_model)
        work = x.to(compute_dtype(x.dtype))
        normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


# chapters/07-blocks.md, "The block"
class TransformerBlock(nn.Module):
    """Self-attention, optional cross-attention and a feed-forward network, each in a residual
    connection with a normalisation ("layernorm" or "rmsnorm"), pre-norm or post-norm."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None,
                 dropout: float = 0.0, norm_first: bool = True, cross_attention: bool = False,
                 activation: str = "gelu", norm: str = "layernorm", eps: float = 1e-5,
                 num_kv_heads: int | None = None, bias: bool = True,
                 attn_dropout: float | None = None, ff_dropout: float | None = None,
                 backend: str = "sdpa", check_inputs: bool = True) -> None:
        super().__init__()
        self.norm_first = check_bool("norm_first", norm_first)
        self.check_inputs = check_bool("check_inputs", check_inputs)
        cross_attention = check_bool("cross_attention", cross_attention)
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        attention = dict(d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         bias=bias, dropout=attn_dropout, backend=backend,
                         check_inputs=self.check_inputs)  # the block checks x; the layers the rest
        self.self_attn = MultiHeadAttention(**attention)
        self.d_model, self.num_heads = self.self_attn.d_model, self.self_attn.num_heads
        self.attn_norm = _make_norm(norm, d_model, eps, bias)
        self.cross_attn = self.cross_norm = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(**attention)
            self.cross_norm = _make_norm(norm, d_model, eps, bias)
        ff_dropout = dropout if ff_dropout is None else ff_dropout
        self.ff = FeedForward(d_model, d_ff, activation, ff_dropout, bias, check_inputs=False)
        self.ff_norm = _make_norm(norm, d_model, eps, bias)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                is_causal: bool = False, context: torch.Tensor | None = None,
                context_mask: torch.Tensor | None = None, return_weights: bool = False,
                cache: LayerCache | None = None):
        """(B, L, d_model) -> (B, L, d_model), and with `return_weights` the self- and cross-
        attention weights (or None). `mask`, `is_causal` and `cache` go to the self-attention,
        `context` (B, Lc, d_model) and `context_mask` to the cross-attention, if the block has it."""
        if self.check_inputs:
            _check_block_call(self, x, context, context_mask, return_weights)
        weights = {"self": None, "cross": None}  # filled with return_weights

        def attention(kind: str, h: torch.Tensor) -> torch.Tensor:
            if kind == "self":
                out = self.self_attn(h, mask=mask, is_causal=is_causal,
                                     return_weights=return_weights, cache=cache)
            else:
                out = self.cross_attn(h, context, mask=context_mask, return_weights=return_weights)
            if return_weights:
                out, weights[kind] = out
            return out

        drop, cross = self.dropout, self.cross_attn is not None
        if self.norm_first:  # pre-norm: x + f(norm(x))
            x = x + drop(attention("self", self.attn_norm(x)))
            if cross:
                x = x + drop(attention("cross", self.cross_norm(x)))
            x = x + drop(self.ff(self.ff_norm(x)))
        else:  # post-norm: norm(x + f(x))
            x = self.attn_norm(x + drop(attention("self", x)))
            if cross:
                x = self.cross_norm(x + drop(attention("cross", x)))
            x = self.ff_norm(x + drop(self.ff(x)))
        return (x, weights["self"], weights["cross"]) if return_weights else x


def _check_block_call(block: TransformerBlock, x, context, context_mask, return_weights) -> None:
    check_tensor("x", x, 3, size=block.d_model)
    check_bool("return_weights", return_weights)
    if block.cross_attn is None and (context is not None or context_mask is not None):
        raise ValueError("block has no cross-attention: context and context_mask must be None")
    if block.cross_attn is not None and context is None:
        raise ValueError("this block has cross-attention: it needs a context, got context=None")


def _make_norm(norm: str, d_model: int, eps: float, bias: bool) -> nn.Module:
    if check_choice("norm", norm, ("layernorm", "rmsnorm")) == "rmsnorm":
        return RMSNorm(d_model, eps, check_inputs=False)  # it has no bias
    return nn.LayerNorm(d_model, eps=check_positive("eps", eps), bias=bias)


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
    ours.self_attn = from_torch(layer.self_attn)
    for mine, theirs in [(ours.ff.fc1, layer.linear1), (ours.ff.fc2, layer.linear2),
                         (ours.attn_norm, layer.norm1), (ours.ff_norm, layer.norm2)]:
        mine.load_state_dict(theirs.state_dict())
    return ours.train(layer.training)


def _activation_name(fn) -> str | None:
    """The FeedForward activation that a TransformerEncoderLayer's `activation` computes."""
    if isinstance(fn, nn.GELU):
        return "gelu_tanh" if fn.approximate == "tanh" else "gelu"
    return "relu" if isinstance(fn, nn.ReLU) else {F.relu: "relu", F.gelu: "gelu"}.get(fn)
