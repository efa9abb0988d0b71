# Do not edit: tools/tangle.py generates this file from chapters/11-encoder-decoder.md.
"""The original Transformer's encoder-decoder, with greedy decoding.

Built and explained in the book's chapter chapters/11-encoder-decoder.md.
"""

__all__ = [
    "EncoderDecoderConfig",
    "EncoderDecoder",
]

# chapters/11-encoder-decoder.md, "The model"
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from attnbook.checks import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_mask,
    check_tensor,
    check_token_ids,
)
from attnbook.layers import Block, BlockConfig, _causal_mask
from attnbook.masks import padding_mask
from attnbook.positions import sinusoidal_encoding

_Lengths = Sequence[int] | torch.Tensor | np.ndarray | None  # src_lengths: B ints, or None


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """The sizes of an EncoderDecoder; `context_length` is the longest source or target.
    num_decoder_layers None means num_layers, d_ff None means 4 * d_model (both resolved where
    they are used, so that dataclasses.replace keeps them consistent); norm_first=False is
    post-norm; `backend` as in chapter 10's GPTConfig."""

    src_vocab: int
    tgt_vocab: int
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    num_decoder_layers: int | None = None
    d_ff: int | None = None
    context_length: int = 64
    dropout: float = 0.1
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    positions: str = "sinusoidal"
    norm_first: bool = True
    activation: str = "relu"
    backend: str = "sdpa"

    def __post_init__(self) -> None:
        _check_config(self)  # in the collapsed cell of argument checks below

    @property
    def encoder_block(self) -> BlockConfig:
        return BlockConfig(self.d_model, self.num_heads, self.d_ff, self.dropout, self.norm_first,
                           activation=self.activation, backend=self.backend)

    @property
    def decoder_block(self) -> BlockConfig:  # with cross-attention to the encoder's output
        return replace(self.encoder_block, cross_attention=True)


# chapters/11-encoder-decoder.md, "The model"
class _Embedding(nn.Module):
    """Token embedding * sqrt(d_model) + position encoding, then dropout; a padded position's
    token embedding is 0, whatever its row holds (a NaN one included: it reaches no real token)."""

    def __init__(self, vocab: int, config: EncoderDecoderConfig) -> None:
        super().__init__()
        self.scale = math.sqrt(config.d_model)
        self.tokens = nn.Embedding(vocab, config.d_model, padding_idx=config.pad_id)
        nn.init.normal_(self.tokens.weight, std=config.d_model ** -0.5)
        nn.init.zeros_(self.tokens.weight[config.pad_id])
        if config.positions == "learned":
            self.positions = nn.Parameter(0.02 * torch.randn(config.context_length, config.d_model))
        else:
            table = torch.from_numpy(sinusoidal_encoding(config.context_length, config.d_model))
            self.register_buffer("positions", table.float(), persistent=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:  # real: (B, L)
        tokens = self.tokens(ids).masked_fill(~real[..., None], 0.0)  # (B, L, d_model)
        out: torch.Tensor = self.dropout(tokens * self.scale + self.positions[: ids.shape[1]])
        return out


# chapters/11-encoder-decoder.md, "The model"
class EncoderDecoder(nn.Module):
    """The original Transformer, built from an EncoderDecoderConfig: src (B, Ls), tgt_in (B, Lt)
    -> next-token logits (B, Lt, tgt_vocab). `src_lengths` (B,) gives the source's padding, else
    its pad_id positions do."""

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        self.config = c = check_instance("config", config, EncoderDecoderConfig)
        depth = c.num_layers if c.num_decoder_layers is None else c.num_decoder_layers
        self.src_embed, self.tgt_embed = _Embedding(c.src_vocab, c), _Embedding(c.tgt_vocab, c)
        self.encoder = nn.ModuleList(Block(c.encoder_block) for _ in range(c.num_layers))
        self.decoder = nn.ModuleList(Block(c.decoder_block) for _ in range(depth))
        norm = nn.LayerNorm if c.norm_first else (lambda d: nn.Identity())
        self.encoder_norm, self.decoder_norm = norm(c.d_model), norm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.tgt_vocab)

    def _encode(self, src: torch.Tensor, src_padding: torch.Tensor) -> torch.Tensor:
        """The encoder's output, the `memory` (B, Ls, d_model), for int64 ids src (B, Ls), 0 at the
        padded positions."""
        x, mask = self.src_embed(src, src_padding), src_padding[:, None, None, :]  # (B,1,1,Ls)
        for block in self.encoder:
            x = block(x, mask=mask)  # (B, Ls, d_model)
        memory: torch.Tensor = self.encoder_norm(x).masked_fill(~src_padding[..., None], 0.0)
        return memory

    # chapters/11-encoder-decoder.md, "The model"
    def _decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_padding: torch.Tensor | None,
                return_weights: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(Logits (B, Lt, tgt_vocab), [each block's cross-attention weights if return_weights])."""
        real, lt = tgt_in != self.config.pad_id, tgt_in.shape[1]  # the target's own padding
        self_mask = real[:, None, None, :] & _causal_mask(lt, lt, tgt_in.device)  # (B, 1, Lt, Lt)
        cross_mask = None if src_padding is None else src_padding[:, None, None, :]  # (B,1,1,Ls)
        x, weights = self.tgt_embed(tgt_in, real), []  # (B, Lt, d_model), list[torch.Tensor]
        for block in self.decoder:
            x = block(x, mask=self_mask, context=memory, context_mask=cross_mask,
                      return_weights=return_weights)
            if return_weights:  # only then do the blocks compute the weights
                x, _, cross_weights = x
                weights.append(cross_weights)
        return self.lm_head(self.decoder_norm(x)), weights

    # chapters/11-encoder-decoder.md, "The model"
    def _source(self, src: torch.Tensor, src_lengths: _Lengths) -> tuple[torch.Tensor, torch.Tensor]:
        """`src` checked, as int64 ids (B, Ls), and its padding mask (B, Ls)."""
        src = _check_ids("src", src, self.config.src_vocab, self.config.context_length)
        if src_lengths is None:
            return src, src != self.config.pad_id
        return src, _lengths_padding(src_lengths, len(src), src.shape[1], src.device)  # checked

    def source_padding(self, src: torch.Tensor, src_lengths: _Lengths = None) -> torch.Tensor:
        """(B, Ls) bool, True at real source tokens (chapter 6's padding mask)."""
        return self._source(src, src_lengths)[1]

    # chapters/11-encoder-decoder.md, "The model"
    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_lengths: _Lengths = None
                ) -> torch.Tensor:
        src, src_padding = self._source(src, src_lengths)
        tgt_in = _check_ids("tgt_in", tgt_in, self.config.tgt_vocab, self.config.context_length,
                            batch=src.shape[0])
        return self._decode(tgt_in, self._encode(src, src_padding), src_padding)[0]

    def encode(self, src: torch.Tensor, src_lengths: _Lengths = None) -> torch.Tensor:
        """The encoder's output, the `memory` (B, Ls, d_model), 0 at the padded source positions."""
        return self._encode(*self._source(src, src_lengths))

    def greedy_decode(self, src: torch.Tensor, max_new_tokens: int | None = None,
                      src_lengths: _Lengths = None) -> torch.Tensor:
        """Target ids (B, T <= max_new_tokens, default config.context_length): each row the
        tokens after BOS up to EOS, then pad_id. Runs in eval mode without gradients, then
        restores each module's mode."""
        c = self.config
        src, src_padding = self._source(src, src_lengths)
        steps = c.context_length if max_new_tokens is None else check_int(
            "max_new_tokens", max_new_tokens, 1, c.context_length)
        return _greedy_decode(self, src, src_padding, steps)

    # chapters/11-encoder-decoder.md, "The model"
    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor,
               src_padding: torch.Tensor | None = None, return_weights: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, Lt, tgt_vocab) for `tgt_in` given `memory` (B, Ls, d_model) and
        `src_padding` (B, Ls), True at real source tokens (None: all); with `return_weights`, also
        each decoder block's cross-attention weights (B, nh, Lt, Ls)."""
        tgt_in, memory, return_weights = _decode_args(self, tgt_in, memory, src_padding, return_weights)
        if src_padding is not None:  # 0 at padding, as encode gives: a NaN there reaches nothing
            memory = memory.masked_fill(~src_padding[..., None], 0.0)
        logits, weights = self._decode(tgt_in, memory, src_padding, return_weights)
        return (logits, weights) if return_weights else logits


# chapters/11-encoder-decoder.md, "The model"
def _check_config(c: EncoderDecoderConfig) -> None:
    def keep(name: str, value: object) -> None:  # the checked value, in a frozen dataclass
        object.__setattr__(c, name, value)

    for name in ("src_vocab", "tgt_vocab", "num_layers", "context_length"):
        keep(name, check_int(name, getattr(c, name), minimum=1))
    if c.num_decoder_layers is not None:  # None: num_layers, where it is used
        keep("num_decoder_layers", check_int("num_decoder_layers", c.num_decoder_layers, 1))
    keep("positions", check_choice("positions", c.positions, ("sinusoidal", "learned")))
    block = c.encoder_block  # BlockConfig checks the block's settings, under our names:
    for name in ("d_model", "num_heads", "d_ff", "dropout", "norm_first", "backend"):
        keep(name, getattr(block, name))  # as it keeps them (d_ff None: 4 * d_model)
    for name, vocab in (("pad_id", min(c.src_vocab, c.tgt_vocab)),
                        ("bos_id", c.tgt_vocab), ("eos_id", c.tgt_vocab)):
        keep(name, check_int(name, getattr(c, name), minimum=0, maximum=vocab - 1))
    if len({c.pad_id, c.bos_id, c.eos_id}) < 3:
        raise ValueError(f"pad_id={c.pad_id}, bos_id={c.bos_id} and "
                         f"eos_id={c.eos_id} must be three different tokens")


def _lengths_padding(src_lengths: Sequence[int] | torch.Tensor | np.ndarray, b: int, ls: int,
                     device: torch.device) -> torch.Tensor:
    """The padding mask (b, ls) of src_lengths: b ints in [1, ls], as a sequence, tensor or
    array. Under torch.compile a tensor's values are checked inside the graph (a RuntimeError
    when it runs), not read into Python (appendix H)."""
    wanted = f"src_lengths must hold {b} ints in [1, {ls}]"  # a repr only when refusing:
    if tuple(getattr(src_lengths, "shape", (b,))) != (b,):  # it would cut a traced graph
        raise ValueError(f"{wanted}, got {src_lengths=}")
    if isinstance(src_lengths, torch.Tensor) and torch.compiler.is_compiling():
        if (kind := src_lengths.dtype) == torch.bool or kind.is_floating_point or kind.is_complex:
            raise TypeError(f"{wanted}, got dtype {kind}")
        torch._assert_async(((src_lengths >= 1) & (src_lengths <= ls)).all(), wanted)
        return torch.arange(ls, device=device)[None, :] < src_lengths.to(device)[:, None]
    values = src_lengths.tolist() if hasattr(src_lengths, "tolist") else src_lengths
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{wanted}, got {src_lengths=}")
    if len(values) != b:
        raise ValueError(f"{wanted}, got {src_lengths=}")
    lengths = [check_int(f"src_lengths[{i}]", n, 1, ls) for i, n in enumerate(values)]
    return padding_mask(lengths, ls, device=device)


def _check_ids(name: str, ids: torch.Tensor, vocab: int, longest: int, batch: int | None = None
               ) -> torch.Tensor:
    ids = check_token_ids(name, ids, vocab, shape=(batch, None))
    check_int(f"{name}'s length", ids.shape[1], minimum=1, maximum=longest)
    return ids


def _decode_args(model: "EncoderDecoder", tgt_in: torch.Tensor, memory: torch.Tensor,
                 src_padding: torch.Tensor | None, return_weights: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """decode's arguments, checked: memory of the model's dtype and device, and the rest."""
    c, weight = model.config, model.lm_head.weight
    memory = check_tensor("memory", memory, ndim=3, size=c.d_model, dtype=weight.dtype,
                          device=weight.device)
    shape = tuple(memory.shape[:2])  # (B, Ls): src_padding's
    tgt_in = _check_ids("tgt_in", tgt_in, c.tgt_vocab, c.context_length, batch=shape[0])
    if src_padding is not None:
        check_mask("src_padding", src_padding, shape, device=memory.device)
        if src_padding.shape != shape:  # a (1, Ls) mask would broadcast over the batch
            raise ValueError(f"src_padding of shape {tuple(src_padding.shape)} is not {shape}")
    return tgt_in, memory, check_bool("return_weights", return_weights)


# chapters/11-encoder-decoder.md, "Greedy decoding"
@torch.no_grad()
def _greedy_decode(model: EncoderDecoder, src: torch.Tensor, src_padding: torch.Tensor,
                   steps: int) -> torch.Tensor:
    """Up to `steps` tokens for the checked ids src (B, Ls) of padding src_padding (B, Ls)."""
    c, modes = model.config, {m: m.training for m in model.modules()}  # each module's own
    model.eval()  # no dropout: the same source always gives the same output
    try:
        memory = model._encode(src, src_padding)  # (B, Ls, d_model), once for every step
        out = torch.full((src.shape[0], 1), c.bos_id, device=src.device)  # (B, 1 + steps)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)  # (B,)
        for _ in range(steps):
            next_id = model._decode(out, memory, src_padding)[0][:, -1].argmax(-1)  # (B,)
            out = torch.cat([out, next_id.masked_fill(done, c.pad_id)[:, None]], dim=1)
            done |= next_id == c.eos_id
            if done.all():  # the one read of a result per step: every row has ended
                break
    finally:
        for module, training in modes.items():
            module.training = training
    return out[:, 1:]
