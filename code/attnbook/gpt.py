# Do not edit: tools/tangle.py generates this file from chapters/10-gpt.md and chapters/19-gpt-variants.md.
"""A decoder-only model, GPT: generation with a KV cache, GPT-2's weights, and a character
tokenizer.

Built and explained in the book's chapters chapters/10-gpt.md and chapters/19-gpt-variants.md.
"""

__all__ = [
    "GPTConfig",
    "GPT",
    "KVCache",
    "CharTokenizer",
]

# chapters/10-gpt.md, "The model"
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from attnbook.checks import (
    check_bool,
    check_choice,
    check_device,
    check_float_dtype,
    check_generator,
    check_holds_weights,
    check_instance,
    check_int,
    check_padding_mask,
    check_positive,
    check_probability,
    check_real,
    check_tensor,
    check_token_ids,
)
from attnbook.layers import Block, BlockConfig, LayerCache, RMSNorm


# chapters/10-gpt.md, "The model"
@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a GPT (GPT-2 small's by default)."""

    vocab_size: int = 50257
    context_length: int = 1024
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    dropout: float = 0.1  # on the embeddings, the attention weights and the sublayers' outputs
    eps: float = 1e-5
    bias: bool = True
    backend: str = "sdpa"
    positions: str = "learned"  # or, inside attention, "rope" or "alibi" (chapter 5); "none"
    norm: str = "layernorm"  # or "rmsnorm" (chapter 7)
    ffn: str = "gelu"  # GELU's tanh form, or "swiglu" (chapter 7)
    num_kv_heads: int | None = None  # fewer key/value heads than heads (chapter 4)
    tied: bool = True  # the output layer is the token embedding
    ff_width: int | None = None  # None: 4 * d_model
    rope_base: float = 10000.0
    embed_norm: bool = False  # normalise the token embeddings before the first block (BLOOM)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        object.__setattr__(self, "dropout", check_probability("dropout", self.dropout))
        object.__setattr__(self, "eps", check_positive("eps", self.eps))
        check_choice("positions", self.positions, ("learned", "rope", "alibi", "none"))
        check_choice("ffn", self.ffn, ("gelu", "swiglu"))
        for name in ("tied", "embed_norm"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        if self.ff_width is not None:  # named here, not as the block's d_ff
            object.__setattr__(self, "ff_width", check_int("ff_width", self.ff_width, 1))
        self.block  # noqa: B018 (BlockConfig checks the rest: heads, widths, norm, bias, backend)

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model if self.ff_width is None else self.ff_width

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def block(self) -> BlockConfig:
        return BlockConfig(self.d_model, self.num_heads, self.d_ff, self.dropout, norm_first=True,
                           activation={"gelu": "gelu_tanh"}.get(self.ffn, self.ffn), norm=self.norm,
                           eps=self.eps, num_kv_heads=self.num_kv_heads, bias=self.bias,
                           ff_dropout=0.0, backend=self.backend, rope_base=self.rope_base,
                           positions={"learned": "none"}.get(self.positions, self.positions))

    # chapters/19-gpt-variants.md, "What changes"
    @classmethod
    def llama(cls, **fields: Any) -> "GPTConfig":
        """Llama's choices, then `fields`: RoPE, RMSNorm, SwiGLU, no biases, untied, no dropout,
        and a feed-forward width of 2/3 * 4 * d_model rounded up to a multiple of 256."""
        d = fields.get("d_model", cls.d_model)
        width = 256 * -(-(8 * d // 3) // 256)  # Llama-7B: d = 4096 gives 11008
        return cls(**{**dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False,
                             tied=False, dropout=0.0, eps=1e-6, ff_width=width), **fields})


def _norm(c: GPTConfig) -> nn.Module:
    """The config's normalisation over d_model: LayerNorm (GPT-2) or RMSNorm (Llama)."""
    return nn.LayerNorm(c.d_model, eps=c.eps, bias=c.bias) if c.norm == "layernorm" \
        else RMSNorm(c.d_model, c.eps)


# chapters/10-gpt.md, "The model"
class GPT(nn.Module):
    """A decoder-only Transformer language model: GPT-2, or a variant (chapter 10, "The model")."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = check_instance("config", config, GPTConfig)
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.context_length, c.d_model) if c.positions == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c.block) for _ in range(c.num_layers))
        self.emb_norm = _norm(c) if c.embed_norm else nn.Identity()
        self.norm_f = _norm(c)  # pre-norm blocks leave the residual stream un-normalised
        self.lm_head = None if c.tied else nn.Linear(c.d_model, c.vocab_size, bias=False)
        for module in self.modules():  # Hugging Face's GPT-2 initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in cast("list[Block]", self.blocks):
            for proj in (block.self_attn.out_proj, block.ff.fc2):  # residual-stream writers
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * c.num_layers))

    def forward(self, idx: torch.Tensor, kv_cache: "KVCache | None" = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size); with `kv_cache`, idx continues its positions, no grads.
        `attention_mask` (B, cached + T): 1 at a real token, 0 at padding (chapter 19)."""
        if kv_cache is not None or attention_mask is not None:  # the sections that follow
            return self._forward_cached(idx, kv_cache, attention_mask)
        idx = _check_idx(self, idx, self.config.context_length)
        positions = torch.arange(idx.shape[1], device=idx.device)[None]  # (1, T)
        return self._run(self.tok_emb(idx), positions, None, [None] * len(self.blocks))

    def _run(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
             caches: Sequence[LayerCache | None]) -> torch.Tensor:
        """Logits (B, T, vocab_size) of token embeddings x (B, T, d_model) at position_ids."""
        x = self.emb_norm(x)  # BLOOM's: normalised token embeddings, (B, T, d_model)
        x = self.drop(x + (0 if self.pos_emb is None else self.pos_emb(position_ids)))
        for block, cache in zip(self.blocks, caches):
            x = block(x, mask, is_causal=True, cache=cache, position_ids=position_ids)  # (B,T,d)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight  # tied?
        return F.linear(self.norm_f(x), head)  # (B, T, vocab_size)

    # chapters/10-gpt.md, "GPT-2's weights"
    @classmethod
    def from_hf_gpt2(cls, model: Any) -> "GPT":  # a GPT2LMHeadModel
        """A GPT with the weights, device, dtype and mode of a transformers GPT2LMHeadModel."""
        hf: Any = getattr(model, "config", None)
        body: Any = getattr(model, "transformer", None)
        if getattr(hf, "model_type", None) != "gpt2" or not hasattr(model, "lm_head"):
            raise TypeError(f"model must be a GPT2LMHeadModel, got {type(model).__name__}")
        check_holds_weights("model", model)  # not built on the meta device, without values
        supported = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
                     "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}
        for name, allowed in supported.items():
            if (value := getattr(hf, name)) not in allowed:
                raise ValueError(f"model.config.{name}={value!r} is not supported (only {allowed})")
        if not torch.equal(model.lm_head.weight, body.wte.weight):
            raise ValueError("model.lm_head.weight must equal model.transformer.wte.weight (tied)")
        if len(body.h) == 0:  # nothing to read the sizes below from
            raise ValueError("model.transformer.h must hold at least one block, got none")
        (vocab, d), attn = body.wte.weight.shape, body.h[0].attn  # sizes from the modules
        d_ff = body.h[0].mlp.c_fc.weight.shape[1]  # GPT-2's 4 * d unless n_inner says otherwise
        if odd := [f"{n}.p={m.p}" if type(m) is nn.Dropout else f"{n}: {type(m).__name__}"
                   for n, m in body.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)
                   and (type(m) is not nn.Dropout or m.p != body.drop.p)]:  # every layer's, any kind
            raise ValueError(f"model's dropout layers must each be an nn.Dropout of its drop.p="
                             f"{body.drop.p} (GPTConfig has one rate), unlike {odd[:2]} ({len(odd)} in all)")
        if odd := [f"{n}.eps={m.eps}" if m.eps != body.ln_f.eps else f"{n} without a weight or bias"
                   for n, m in body.named_modules() if n.split(".")[-1] in ("ln_1", "ln_2", "ln_f") and (
                       m.eps != body.ln_f.eps or m.state_dict().keys() != {"weight", "bias"})]:
            raise ValueError(f"model's LayerNorms must each hold a weight and a bias and have ln_f's eps="
                             f"{body.ln_f.eps} (GPTConfig has one), unlike {odd[:2]} ({len(odd)} in all)")
        config = GPTConfig(vocab_size=vocab, context_length=body.wpe.weight.shape[0], d_model=d,
                           num_layers=len(body.h), num_heads=attn.num_heads, eps=body.ln_f.eps,
                           dropout=body.drop.p, ff_width=None if d_ff == 4 * d else d_ff)
        ours = cls(config).to(device=body.wte.weight.device, dtype=body.wte.weight.dtype)
        with torch.no_grad():
            ours.tok_emb.weight.copy_(body.wte.weight)
            cast(nn.Embedding, ours.pos_emb).weight.copy_(body.wpe.weight)
            ours.norm_f.load_state_dict(body.ln_f.state_dict())
            for block, theirs in zip(cast("list[Block]", ours.blocks), body.h, strict=True):
                sa = block.self_attn
                for i, proj in enumerate((sa.q_proj, sa.k_proj, sa.v_proj)):  # c_attn: [q | k | v]
                    _copy_conv1d(proj, theirs.attn.c_attn, slice(i * d, (i + 1) * d))
                _copy_conv1d(sa.out_proj, theirs.attn.c_proj)
                _copy_conv1d(block.ff.fc1, theirs.mlp.c_fc)
                _copy_conv1d(block.ff.fc2, theirs.mlp.c_proj)
                block.attn_norm.load_state_dict(theirs.ln_1.state_dict())
                block.ff_norm.load_state_dict(theirs.ln_2.state_dict())
        return ours.train(model.training)

    # chapters/10-gpt.md, "The KV cache"
    def make_kv_cache(self, batch_size: int, capacity: int | None = None) -> "KVCache":
        """An empty KVCache in the model's dtype and device, of `capacity` <= context_length."""
        c, weight = self.config, self.tok_emb.weight
        capacity = check_int("capacity", c.context_length if capacity is None else capacity,
                             maximum=c.context_length)  # KVCache checks that it is at least 1
        return KVCache(c.num_layers, batch_size, c.kv_heads, capacity, c.head_dim,
                       weight.dtype, weight.device)

    def _forward_cached(self, idx: torch.Tensor, kv_cache: "KVCache | None",
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
        """forward with a KV cache or a padded batch's attention_mask."""
        idx = _check_idx(self, idx, self.config.context_length if kv_cache is None else math.inf)
        cached = 0 if kv_cache is None else _check_kv_cache(self, kv_cache, idx)
        real = check_padding_mask("attention_mask", attention_mask, idx, cached,
                                  getattr(kv_cache, "attention_mask", None))  # None: no padding
        with torch.set_grad_enabled(torch.is_grad_enabled() and kv_cache is None):  # cache: none
            return self._logits(idx, kv_cache, real)

    def _logits(self, idx: torch.Tensor, kv_cache: "KVCache | None",
                real: torch.Tensor | None = None) -> torch.Tensor:
        # the cache's and the padding's positions and mask, on checked arguments (generate's too)
        start, caches = (0, [None] * len(self.blocks)) if kv_cache is None else \
            (kv_cache.length, kv_cache.layers)
        position_ids, mask = torch.arange(start, start + idx.shape[1], device=idx.device)[None], None
        x = self.tok_emb(idx)  # (B, T, d_model)
        if real is not None:  # a padded batch: a real token's position counts the real ones before it
            real = real[:, -(start + idx.shape[1]):]  # generate's grows past the cache's window
            if kv_cache is not None:  # it keeps its positions' padding, (B, capacity), for later calls
                kv_cache.attention_mask = F.pad(real, (0, kv_cache.capacity - real.shape[1]), value=True)
            position_ids, mask = (real.cumsum(-1) - 1).clamp(min=0)[:, start:], real[:, None, None, :]
            x = x.masked_fill(~real[:, start:, None], 0.0)  # padding's, NaN too: finite (chapter 19)
        return self._run(x, position_ids, mask, caches)

    # chapters/10-gpt.md, "Generating text"
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, use_cache: bool = True,
                 generator: torch.Generator | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) and `max_new_tokens` tokens more, generated in eval mode: the likeliest for
        temperature 0, else drawn from softmax(logits / temperature) among the `top_k` likeliest.
        `attention_mask` (B, T), 0 at padding on the left of a prompt (chapter 19)."""
        seq, limit = _check_idx(self, idx), self.config.context_length
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        temperature = check_real("temperature", temperature, 0.0)
        top_k = None if top_k is None else check_int("top_k", top_k, 1)
        generator = check_generator("generator", generator, seq.device)  # before any sampling
        real = check_padding_mask("attention_mask", attention_mask, seq, left=True)  # None: no padding
        size = min(limit, seq.shape[1] + max_new_tokens)  # no more than the tokens it will hold
        use_cache, was_training = check_bool("use_cache", use_cache), self.training
        self.eval()
        try:
            with torch.inference_mode():  # no gradients, nor autograd's bookkeeping per operation
                cache = self.make_kv_cache(len(seq), size) if use_cache else None
                largest = self.tok_emb.weight.new_zeros(())  # the largest |logit|; NaN stays NaN
                for _ in range(max_new_tokens):
                    if cache is not None and cache.length == limit:  # the window moved: reread it
                        cache.reset()
                    cached = cache is not None and cache.length > 0  # after the prefill
                    logits = self._logits(seq[:, -1:] if cached else seq[:, -limit:], cache, real)
                    largest = torch.maximum(largest, logits[:, -1].abs().amax())  # on the device
                    next_id = _next_token(logits[:, -1], temperature, top_k, generator)  # (B, 1)
                    seq = torch.cat([seq, next_id], dim=1)  # (B, T + 1)
                    real = None if real is None else F.pad(real, (0, 1), value=True)  # a real token
        finally:
            self.train(was_training)
        if not largest.isfinite():  # read once per call: a test per token would wait for the GPU
            raise ValueError("the model's logits are not all finite, so no token can be chosen")
        return seq.clone()  # made outside inference mode: a tensor autograd may use later

    # chapters/19-gpt-variants.md, "Llama's weights"
    @classmethod
    def from_hf_llama(cls, model: Any) -> "GPT":  # a LlamaForCausalLM
        """A GPT with the weights, device, dtype and mode of a transformers LlamaForCausalLM
        (chapter 19, "Llama's weights"): RoPE, RMSNorm, SwiGLU and shared key/value heads."""
        hf, body = _check_causal_lm(model, "llama", "LlamaForCausalLM", "model", "embed_tokens")
        rope = getattr(hf, "rope_parameters", None) or {"rope_theta": getattr(hf, "rope_theta", None),
                                                        **(getattr(hf, "rope_scaling", None) or {})}
        d, heads = body.embed_tokens.weight.shape[1], hf.num_attention_heads  # d: the weights'
        found = {"hidden_act": hf.hidden_act, "rope_type": rope.get("rope_type", "default"),
                 "head_dim": getattr(hf, "head_dim", d // heads),
                 "attention_dropout": hf.attention_dropout, "pretraining_tp": hf.pretraining_tp}
        for name, wanted in {"hidden_act": "silu", "rope_type": "default", "head_dim": d // heads,
                             "attention_dropout": 0.0, "pretraining_tp": 1}.items():
            if (value := found[name]) != wanted:
                raise ValueError(f"model.config.{name}={value!r} is not supported, only {wanted!r}")
        _check_llama_sizes(hf, body, d // heads)
        if hf.mlp_bias != hf.attention_bias:  # our GPT has one `bias` for both
            raise ValueError(f"model.config.mlp_bias={hf.mlp_bias!r} and model.config.attention_bias="
                             f"{hf.attention_bias!r} must be equal: our GPT has one bias setting")
        config = GPTConfig.llama(
            vocab_size=hf.vocab_size, context_length=hf.max_position_embeddings, d_model=d,
            num_layers=len(body.layers), num_heads=heads, num_kv_heads=hf.num_key_value_heads,
            ff_width=hf.intermediate_size, bias=hf.attention_bias, tied=hf.tie_word_embeddings,
            rope_base=check_positive("model.config.rope_parameters['rope_theta']",
                                     rope.get("rope_theta")),
            eps=check_positive("model.config.rms_norm_eps", hf.rms_norm_eps))  # the user's name
        weight = body.embed_tokens.weight
        ours = cls(config).to(device=weight.device, dtype=weight.dtype)
        pairs = [(ours.tok_emb, body.embed_tokens), (ours.norm_f, body.norm)]
        pairs += [] if ours.lm_head is None else [(ours.lm_head, model.lm_head)]  # None: tied
        for block, layer in zip(cast("list[Block]", ours.blocks), body.layers, strict=True):
            attn, mlp, sa = layer.self_attn, layer.mlp, block.self_attn
            gate = cast(nn.Linear, block.ff.gate)  # the SwiGLU's: GPTConfig.llama chose it
            pairs += [(block.attn_norm, layer.input_layernorm), (sa.q_proj, attn.q_proj),
                      (sa.k_proj, attn.k_proj), (sa.v_proj, attn.v_proj), (sa.out_proj, attn.o_proj),
                      (block.ff_norm, layer.post_attention_layernorm), (gate, mlp.gate_proj),
                      (block.ff.fc1, mlp.up_proj), (block.ff.fc2, mlp.down_proj)]
        for mine, theirs in pairs:
            mine.load_state_dict(theirs.state_dict())
        return ours.train(model.training)

    # chapters/19-gpt-variants.md, "BLOOM's weights"
    @classmethod
    def from_hf_bloom(cls, model: Any, context_length: int = 2048) -> "GPT":  # a BloomForCausalLM
        """A GPT with the weights, device, dtype and mode of a transformers BloomForCausalLM
        (chapter 19, "BLOOM's weights"): ALiBi, a LayerNorm on the embeddings, fused q, k, v.
        BLOOM has no table of positions: `context_length` is ours to choose."""
        hf, body = _check_causal_lm(model, "bloom", "BloomForCausalLM", "transformer",
                                    "word_embeddings")
        for name in ("apply_residual_connection_post_layernorm", "hidden_dropout",
                     "attention_dropout"):  # ours: pre-norm residuals, dropout on the embeddings
            if value := getattr(hf, name):
                raise ValueError(f"model.config.{name}={value!r} is not supported, only False or 0")
        if hf.slow_but_exact and hf.pretraining_tp > 1:
            raise ValueError(f"model.config.slow_but_exact=True with pretraining_tp="
                             f"{hf.pretraining_tp} is not supported: our GPT does not sum by slices")
        words = body.word_embeddings
        (vocab, d), heads = words.weight.shape, hf.n_head
        config = GPTConfig(vocab_size=vocab, context_length=context_length, d_model=d,
                           num_layers=len(body.h), num_heads=heads, dropout=0.0,
                           eps=check_positive("model.config.layer_norm_epsilon",
                                              hf.layer_norm_epsilon), positions="alibi", embed_norm=True,
                           tied=hf.tie_word_embeddings)
        ours = cls(config).to(device=words.weight.device, dtype=words.weight.dtype)
        pairs = [(ours.tok_emb, words), (ours.emb_norm, body.word_embeddings_layernorm),
                 (ours.norm_f, body.ln_f)]
        pairs += [] if ours.lm_head is None else [(ours.lm_head, model.lm_head)]  # None: tied
        for block, layer in zip(cast("list[Block]", ours.blocks), body.h, strict=True):
            attn, mlp, sa = layer.self_attention, layer.mlp, block.self_attn
            pairs += [(block.attn_norm, layer.input_layernorm), (sa.out_proj, attn.dense),
                      (block.ff_norm, layer.post_attention_layernorm), (block.ff.fc1,
                      mlp.dense_h_to_4h), (block.ff.fc2, mlp.dense_4h_to_h)]
            fused = attn.query_key_value.state_dict()  # weight (3d, d) and bias (3d,)
            fused = {k: v.unflatten(0, (heads, 3, -1)) for k, v in fused.items()}  # (heads, 3, ...)
            for i, proj in enumerate((sa.q_proj, sa.k_proj, sa.v_proj)):  # per head: q, k, v rows
                proj.load_state_dict({k: v[:, i].flatten(0, 1) for k, v in fused.items()})
        for mine, theirs in pairs:
            mine.load_state_dict(theirs.state_dict())
        return ours.train(model.training)


# chapters/10-gpt.md, "The model"
def _check_idx(model: "GPT", idx: object, longest: float = math.inf) -> torch.Tensor:
    """idx (B, T) as int64 ids of the vocabulary on the model's device, T at most `longest`."""
    idx, device = check_token_ids("idx", idx, model.config.vocab_size), model.tok_emb.weight.device
    if (idx.dim(), 0 in idx.shape, idx.device) != (2, False, device) or idx.shape[1] > longest:
        raise _idx_error(tuple(idx.shape), idx.device, device, longest)  # which rule: only here
    return idx


def _idx_error(shape: tuple[int, ...], on: object, device: object, longest: float) -> ValueError:
    """The error of the first rule of _check_idx that idx, of `shape` on `on`, breaks."""
    return ValueError(  # whole strings: torch.compile cannot add two strings while tracing
        f"idx must have 2 dimensions, (B, T), got shape {shape}" if len(shape) != 2 else
        f"idx must hold at least one row and one token, got shape {shape}" if 0 in shape else
        f"idx must be at most context_length={longest} tokens long, got shape {shape}"
        if shape[1] > longest else f"idx must be on the model's device {device}, got idx on {on}")


# chapters/10-gpt.md, "GPT-2's weights"
def _copy_conv1d(linear: nn.Linear, conv: Any, columns: slice = slice(None)) -> None:
    """nn.Linear <- the output `columns` of GPT-2's Conv1D, whose weight is (in, out)."""
    linear.weight.copy_(conv.weight[:, columns].T)
    linear.bias.copy_(conv.bias[columns])


# chapters/10-gpt.md, "The KV cache"
class KVCache:
    """A GPT's keys and values: `layers[i]` is layer i's LayerCache, over views of `keys[i]`."""

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        sizes = dict(num_layers=num_layers, batch_size=batch_size, num_heads=num_heads,
                     capacity=capacity, head_dim=head_dim)
        shape = tuple(check_int(name, value, minimum=1) for name, value in sizes.items())
        dtype = check_float_dtype("dtype", dtype)
        device = None if device is None else check_device("device", device)
        self.keys, self.values = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.layers = [LayerCache._over(k, v) for k, v in zip(self.keys, self.values)]  # views
        self.capacity = shape[3]
        self.attention_mask: torch.Tensor | None = None  # (B, capacity) after padding, False there

    @property
    def length(self) -> int:
        """The positions filled, in every layer alike (GPT.forward checks it, once a call)."""
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        """Memory held: 2 * layers * batch * heads * capacity * head_dim * bytes per number."""
        return self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        """Forget every position; the memory is kept and overwritten by the next calls."""
        for layer in self.layers:
            layer.reset()
        self.attention_mask = None

    def __repr__(self) -> str:
        layers, b, h, c, hd = self.keys.shape
        return (f"KVCache(layers={layers}, batch_size={b}, heads={h}, length={self.length}, "
                f"capacity={c}, head_dim={hd}, dtype={self.keys.dtype}, nbytes={self.nbytes})")


# chapters/10-gpt.md, "The KV cache"
def _check_kv_cache(model: "GPT", kv_cache: object, idx: torch.Tensor) -> int:
    """The positions kv_cache holds, once checked to be the model's, with room for idx (B, n)."""
    c, (b, n) = model.config, idx.shape
    cache = check_instance("kv_cache", kv_cache, KVCache)
    weight = model.tok_emb.weight  # the layers' keys and values come out in its dtype and device
    check_tensor("kv_cache.keys (layers, batch, heads, capacity, head_dim)", cache.keys,
                 dtype=weight.dtype, device=weight.device,
                 shape=(c.num_layers, b, c.kv_heads, None, c.head_dim))  # capacity: any
    if any(layer.length != cache.length for layer in cache.layers):  # only an interrupted call
        raise RuntimeError(f"the layers hold {[layer.length for layer in cache.layers]} positions: reset()")
    if cache.length + n > min(cache.capacity, c.context_length):  # one made by hand may hold more
        raise ValueError(f"idx of length {n} does not fit: kv_cache holds {cache.length} positions "
                         f"of its capacity {cache.capacity}, at most context_length={c.context_length}")
    return cache.length


# chapters/10-gpt.md, "Generating text"
def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of logits (B, V) -> (B, 1) (chapter 10, "Generating text").

    A non-finite logit is read as 0: the caller refuses such logits (GPT.generate, once)."""
    logits = logits.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    if top_k is not None and top_k < logits.shape[-1]:  # exactly k, even where values tie
        top = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, -math.inf).scatter(-1, top.indices, top.values)
    z = logits.double()  # less the largest logit, so that z / temperature <= 0 cannot overflow
    z = (z - z.amax(dim=-1, keepdim=True)) / temperature  # (B, V)
    return torch.multinomial(z.softmax(dim=-1), 1, generator=generator)  # (B, 1)


# chapters/10-gpt.md, "Characters as tokens"
class CharTokenizer:
    """Characters as tokens: the vocabulary is the sorted set of the characters of `text`."""

    def __init__(self, text: str) -> None:
        check_int("len(text)", len(check_instance("text", text, str)), minimum=1)
        self.itos = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.itos)}
        self.vocab_size = len(self.itos)

    def encode(self, text: str) -> torch.Tensor:
        """`text` as 1-D int64 ids; a character outside the vocabulary is an error."""
        if unknown := sorted(set(text) - self.stoi.keys()):
            raise ValueError(f"text holds characters outside the vocabulary: {unknown[:10]}")
        return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.int64)

    def decode(self, ids: object) -> str:
        ids = torch.as_tensor(ids).flatten()
        ids = check_token_ids("ids", ids if len(ids) else ids.long(), self.vocab_size)  # [] is fine
        return "".join(self.itos[i] for i in ids.tolist())


# chapters/19-gpt-variants.md, "Llama's weights"
def _check_llama_sizes(hf: Any, body: Any, head_dim: int) -> None:  # transformers'
    """Refuses a Llama config whose sizes its modules' weights contradict, by the config's name
    (set through its __dict__: transformers' own checks run when a field is set)."""
    (vocab, d), sizes = body.embed_tokens.weight.shape, {}
    for layer in body.layers[:1]:  # transformers builds every layer alike
        sizes = {"num_key_value_heads": layer.self_attn.k_proj.out_features // head_dim,
                 "intermediate_size": layer.mlp.up_proj.out_features}
    for name, size in {"vocab_size": vocab, "hidden_size": d, **sizes}.items():
        if (value := getattr(hf, name, None)) != size:
            raise ValueError(f"model.config.{name}={value!r} disagrees with the model's weights, "
                             f"which give {size}")


def _check_causal_lm(model: Any, model_type: str, kind: str, body_name: str, table: str
                     ) -> tuple[Any, Any]:
    """(model.config, the body) of transformers' `kind`, with its weights, whose lm_head is its
    embedding `table` where its config says tied: Llama's and BLOOM's converters' first check."""
    hf: Any = getattr(model, "config", None)  # None: not a transformers model
    body = getattr(model, body_name, None)
    if getattr(hf, "model_type", None) != model_type or body is None or not hasattr(model, "lm_head"):
        raise TypeError(f"model must be a {kind}, got {type(model).__name__}")
    check_holds_weights("model", model)
    if hf.tie_word_embeddings and not torch.equal(model.lm_head.weight, getattr(body, table).weight):
        raise ValueError("model.config.tie_word_embeddings=True, but model.lm_head.weight differs "
                         f"from model.{body_name}.{table}.weight")
    return hf, body
