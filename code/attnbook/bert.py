# Do not edit: tools/tangle.py generates this file from chapters/08-bert.md and chapters/09-pretraining.md.
"""An encoder-only model, BERT: embeddings, the masked-language-model head, token masking, and
Hugging Face BERT weights.

Built and explained in the book's chapters chapters/08-bert.md and chapters/09-pretraining.md.
"""

__all__ = [
    "MINILM_FILES",
    "minilm_path",
    "BERTConfig",
    "BERTEmbeddings",
    "MaskedLMHead",
    "BERT",
    "mean_pool",
    "mask_tokens",
]

# chapters/08-bert.md, "Inputs: tokens, positions and segments"
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnbook.attention import compute_dtype
from attnbook.checks import (
    check_fields,
    check_generator,  # noqa: F401 (chapter 9's mask_tokens, in this module, uses it)
    check_holds_weights,
    check_instance,
    check_int,
    check_positive,
    check_probability,
    check_tensor,
    check_token_ids,
)
from attnbook.layers import Block, BlockConfig
from attnbook.notebook import MINILM_FILES as MINILM_FILES  # appendix A's, offered here too
from attnbook.notebook import minilm_path as minilm_path


@dataclass(frozen=True)
class BERTConfig:
    """The sizes of a BERT model, by default BERT-base's. pad_id=None: no padding token;
    attn_dropout=None: the attention weights get `dropout` too."""

    vocab_size: int = 30522
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 3072
    context_length: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1  # on the embeddings and the sublayers' outputs
    attn_dropout: float | None = None
    eps: float = 1e-12
    pad_id: int | None = 0
    backend: str = "sdpa"

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "context_length",
                 "type_vocab_size")  # each at least 1; each field, checked, as a plain Python value
        check_fields(self, {name: (check_int, 1) for name in sizes} | {
            "dropout": (check_probability,), "attn_dropout": (check_probability,),
            "eps": (check_positive,)}, optional=("attn_dropout",))
        check_fields(self, {"pad_id": (check_int, 0, self.vocab_size - 1)}, optional=("pad_id",))
        self.block  # noqa: B018 (BlockConfig checks the rest: the heads and the backend)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def block(self) -> BlockConfig:
        """Every block's settings: post-norm, as in the original Transformer, with exact GELU,
        and no dropout inside the FFN (as in BERT)."""
        return BlockConfig(self.d_model, self.num_heads, self.d_ff, self.dropout, norm_first=False,
                           activation="gelu", eps=self.eps, attn_dropout=self.attn_dropout,
                           ff_dropout=0.0, backend=self.backend)


# chapters/08-bert.md, "Inputs: tokens, positions and segments"
class BERTEmbeddings(nn.Module):
    """(B, L) ids and token types -> LayerNorm(word + position + type embedding), dropout. Its
    config and calls are not checked: BERT and BERT.encode check theirs."""

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.position = nn.Embedding(config.context_length, config.d_model)
        self.token_type = nn.Embedding(config.type_vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (L,)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        out: torch.Tensor = self.dropout(self.norm(x))  # (B, L, d_model)
        return out


# chapters/08-bert.md, "The encoder and the masked-LM head"
class MaskedLMHead(nn.Module):
    """(..., d_model) -> LayerNorm(GELU(dense(hidden))) @ word_embeddings.T + bias. Its config
    and calls are not checked: BERT and BERT.encode check theirs."""

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(F.gelu(self.dense(hidden))), word_embeddings, self.bias)


# chapters/08-bert.md, "The encoder and the masked-LM head"
class BERT(nn.Module):
    """BERT: input_ids (B, L), token_type_ids (default zeros) -> logits (B, L, vocab_size).
    `attention_mask` (B, L), bool or 0/1, is True/1 at real tokens, False/0 at padding."""

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.config = c = check_instance("config", config, BERTConfig)
        self.embeddings = BERTEmbeddings(c)
        self.layers = nn.ModuleList(Block(c.block) for _ in range(c.num_layers))
        self.mlm_head = MaskedLMHead(c)
        for module in (*self.embeddings.modules(), *self.mlm_head.modules()):  # BERT's init
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if c.pad_id is not None:  # the padding token's embedding stays zero
            nn.init.zeros_(self.embeddings.word.weight[c.pad_id])

    def encode(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output (B, L, d_model), before the head."""
        return self._encode(*_check_encode(self.config, input_ids, token_type_ids,
                                           attention_mask))

    def _encode(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                real: torch.Tensor | None) -> torch.Tensor:
        # encode's computation, on inputs already checked; real: (B, L) bool, or None
        mask = None if real is None else real[:, None, None, :]  # (B, 1, 1, L): keys only
        x: torch.Tensor = self.embeddings(input_ids, token_type_ids)  # (B, L, d_model)
        if real is not None:  # padding's vectors, NaN ones too, never reach a real token
            x = x.masked_fill(~real[..., None], 0.0)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.encode(input_ids, token_type_ids, attention_mask)
        logits: torch.Tensor = self.mlm_head(hidden, self.embeddings.word.weight)
        return logits  # (B, L, vocab_size)

    @classmethod
    def from_hf_bert(cls, model: nn.Module) -> "BERT":
        """A BERT with the weights, device, dtype and mode of a transformers BertForMaskedLM,
        or of a BertModel (the encoder alone: then the MLM head keeps its random weights)."""
        return _from_hf_bert(cls, model)  # defined in the section on loading weights


# chapters/08-bert.md, "The encoder and the masked-LM head"
def _check_encode(c: BERTConfig, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                  attention_mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """encode's arguments, checked: (input_ids, token_type_ids) as int64, and the mask as bool."""
    input_ids = check_token_ids("input_ids", input_ids, c.vocab_size)
    if input_ids.ndim != 2 or 0 in input_ids.shape or input_ids.shape[1] > c.context_length:
        raise ValueError(f"input_ids must have shape (B, L) with 1 <= L <= context_length="
                         f"{c.context_length}, got {tuple(input_ids.shape)}")
    shape, device = tuple(input_ids.shape), input_ids.device
    if token_type_ids is None:  # segment A throughout: nothing to check
        token_type_ids = torch.zeros_like(input_ids)
    else:
        token_type_ids = check_token_ids("token_type_ids", token_type_ids, c.type_vocab_size,
                                         shape, device, "type_vocab_size")
    if attention_mask is not None:
        attention_mask = _token_mask("attention_mask", attention_mask, shape, device)
    return input_ids, token_type_ids, attention_mask


def _token_mask(name: str, mask: object, shape: tuple[int, ...], device: torch.device
                ) -> torch.Tensor:
    """`mask`, one flag per token, of `shape` on `device`, bool or 0/1, as bool. Only a mask
    that is not bool has its values checked; under torch.compile, inside the graph (appendix H)."""
    wanted = f"{name} must be a tensor of shape {shape} on {device}, bool or 0/1"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{wanted}, got {type(mask).__name__}")
    if tuple(mask.shape) != shape or mask.device != device:
        raise ValueError(f"{wanted}, got shape {tuple(mask.shape)} on {mask.device}")
    if mask.dtype != torch.bool:
        zero_or_one = ((mask == 0) | (mask == 1)).all()  # NaN, 0.5 or 2 is neither
        refusal = f"{name} must be boolean or hold only 0 and 1"
        if torch.compiler.is_compiling():  # a RuntimeError when the graph runs, with no read
            torch._assert_async(zero_or_one, refusal)
        elif not zero_or_one:
            raise ValueError(f"{refusal}, got dtype {mask.dtype}")
    return mask != 0


# chapters/08-bert.md, "Loading a pretrained BERT's weights"
_HF_LAYER_NAMES = {  # ours, under layers.{i}. -> transformers', under bert.encoder.layer.{i}.
    "self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value", "self_attn.out_proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm", "ff_norm": "output.LayerNorm",
    "ff.fc1": "intermediate.dense", "ff.fc2": "output.dense",
}


def _hf_bert_names(num_layers: int) -> dict[str, str]:
    """Our parameter names -> those of a transformers BertForMaskedLM."""
    names = {f"embeddings.{part}.weight": f"bert.embeddings.{part}_embeddings.weight"
             for part in ("word", "position", "token_type")}
    modules = {"embeddings.norm": "bert.embeddings.LayerNorm",
               "mlm_head.dense": "cls.predictions.transform.dense",
               "mlm_head.norm": "cls.predictions.transform.LayerNorm"}
    modules |= {f"layers.{i}.{ours}": f"bert.encoder.layer.{i}.{theirs}"
                for i in range(num_layers) for ours, theirs in _HF_LAYER_NAMES.items()}
    names |= {f"{ours}.{p}": f"{theirs}.{p}" for ours, theirs in modules.items()
              for p in ("weight", "bias")}
    names["mlm_head.bias"] = "cls.predictions.decoder.bias"  # tied to cls.predictions.bias
    return names


# chapters/08-bert.md, "Loading a pretrained BERT's weights"
def _from_hf_bert(cls: type[BERT], model: Any) -> BERT:
    """BERT.from_hf_bert: the sizes come from the weights and modules, not model.config."""
    # model: Any, as transformers' classes (optional, not imported here) are read by attribute
    encoder_only = _check_hf_model(model)  # True for a BertModel; refusals in the next cell
    prefix = "bert." if encoder_only else ""  # BertModel's names lack "bert."; no pooler used
    theirs = {prefix + key.replace("_orig_mod.", ""): value  # "_orig_mod.": added by torch.compile
              for key, value in model.state_dict().items()}  # (of the model or of a part of it)
    layers = {key.split(".")[3] for key in theirs if key.startswith("bert.encoder.layer.")}
    names = _hf_bert_names(max(len(layers), 1))
    if encoder_only:  # no MLM head to copy: ours keeps its random initialisation
        names = {mine: name for mine, name in names.items() if not mine.startswith("mlm_head.")}
    _check_hf_weights(theirs, names)
    word = theirs["bert.embeddings.word_embeddings.weight"]  # (vocab_size, d_model)
    bert = model if encoder_only else model.bert
    embeddings, attention = bert.embeddings, bert.encoder.layer[0].attention.self
    config = BERTConfig(
        vocab_size=len(word), d_model=word.shape[1], num_layers=len(layers),
        num_heads=attention.num_attention_heads,
        d_ff=len(theirs["bert.encoder.layer.0.intermediate.dense.weight"]),
        context_length=len(theirs["bert.embeddings.position_embeddings.weight"]),
        type_vocab_size=len(theirs["bert.embeddings.token_type_embeddings.weight"]),
        dropout=embeddings.dropout.p, attn_dropout=attention.dropout.p,
        eps=embeddings.LayerNorm.eps,
        pad_id=embeddings.word_embeddings.padding_idx)
    ours = cls(config).to(device=word.device, dtype=word.dtype)
    ours.load_state_dict({mine: theirs[name] for mine, name in names.items()},
                         strict=not encoder_only)
    return ours.train(model.training)


# chapters/08-bert.md, "Loading a pretrained BERT's weights"
def _check_hf_model(model: Any) -> bool:
    """from_hf_bert's refusals before reading the weights; True for a BertModel (the encoder)."""
    encoder_only = hasattr(model, "encoder") and hasattr(model, "embeddings")  # a BertModel
    parts = ("config", "state_dict", "training") + (() if encoder_only else ("bert", "cls"))
    if not all(hasattr(model, a) for a in parts):
        raise TypeError("model must be a transformers BertForMaskedLM or BertModel, "
                        f"got {type(getattr(model, '_orig_mod', model)).__name__}")  # compiled
    check_holds_weights("model", model)  # a model on the meta device: shapes, no values
    for name, wanted in (("hidden_act", "gelu"), ("is_decoder", False),
                         ("position_embedding_type", "absolute")):
        if (found := getattr(model.config, name, wanted)) != wanted:
            raise ValueError(f"model.config.{name} must be {wanted!r}, got {found!r}")
    return encoder_only


def _check_hf_weights(theirs: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    """from_hf_bert's refusals of the weights: every name in `names` present, the output tied."""
    if missing := [name for name in names.values() if name not in theirs]:
        raise ValueError(f"model has no parameters {missing[:3]}...: not a BertForMaskedLM?")
    word = theirs["bert.embeddings.word_embeddings.weight"]  # (vocab_size, d_model)
    if not torch.equal(theirs.get("cls.predictions.decoder.weight", word), word):
        raise ValueError("model's cls.predictions.decoder.weight is not tied to its embeddings")


# chapters/08-bert.md, "A trained encoder that ships offline: MiniLM"
def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L, d) hidden states, (B, L) mask (True/1 = real token) -> (B, d), the mean over the
    real tokens: a sentence vector (chapter 8, "A trained encoder that ships offline")."""
    hidden = check_tensor("hidden", hidden, ndim=3)
    keep = _token_mask("attention_mask", attention_mask, tuple(hidden.shape[:2]),
                       hidden.device)[..., None]  # (B, L, 1)
    total = torch.where(keep, hidden, 0).sum(1, dtype=compute_dtype(hidden.dtype))  # (B, d)
    return (total / keep.sum(1).clamp(min=1)).to(hidden.dtype)


# chapters/09-pretraining.md, "Masked language modelling"
def mask_tokens(input_ids: torch.Tensor, mask_id: int, vocab_size: int, *,
                can_mask: torch.Tensor | None = None, p: float = 0.15,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's 80/10/10 corruption: each token where `can_mask` (default: all) is chosen with
    probability `p` becomes `mask_id`, a random id or stays. Returns int64 (corrupted ids,
    labels): the original ids where chosen, else -100. `generator` is on input_ids' device."""
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    input_ids, p = check_token_ids("input_ids", input_ids, vocab_size), check_probability("p", p)
    mask_id = check_int("mask_id", mask_id, 0, vocab_size - 1)
    shape, device = tuple(input_ids.shape), input_ids.device
    can_mask = (torch.ones(shape, dtype=torch.bool, device=device) if can_mask is None
                else _token_mask("can_mask", can_mask, shape, device))  # chapter 8's check
    generator = check_generator("generator", generator, device)
    chosen = (torch.rand(shape, generator=generator, device=device) < p) & can_mask
    # kind < 0.8: [MASK], < 0.9: a random id, else kept
    kind = torch.rand(shape, generator=generator, device=device)
    random_ids = torch.randint(vocab_size, shape, generator=generator, device=device)
    corrupted = torch.where(chosen & (kind < 0.8), mask_id, input_ids)
    corrupted = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, corrupted)
    return corrupted, torch.where(chosen, input_ids, -100)
