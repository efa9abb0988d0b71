"""GPT.from_hf_bloom (chapter 19, "BLOOM's weights"): a transformers BloomForCausalLM
built from small random configurations, offline, converted into our GPT (ALiBi, a LayerNorm on the
embeddings, GELU's tanh form, the fused per-head q, k, v rows, biases, tied or untied output). The
logits agree within float32 precision, greedy generation gives transformers' tokens, the KV cache
agrees with one pass, and what the conversion cannot represent is refused by name."""

import pytest
import torch
from _hf_compare import assert_greedy_tokens_equal

from attnbook.gpt import GPT
from attnbook.positions import alibi_slopes

pytestmark = pytest.mark.usefixtures("one_thread")
transformers = pytest.importorskip("transformers")
bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


def hf_bloom(seed: int = 4, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    fields = dict(vocab_size=60, hidden_size=24, n_layer=2, n_head=4, bos_token_id=None,
                  eos_token_id=None)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(**{**fields, **overrides}))
    with torch.no_grad():  # wider than the initialisation's, so that differences show
        for name, p in model.named_parameters():
            p.normal_(1.0 if "layernorm" in name or "ln_f" in name else 0.0, 0.2)
    return model.eval()


def ids(batch=2, length=20, seed=0, vocab=60):
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_heads", range(1, 17))
def test_alibi_slopes_are_blooms(num_heads):
    # BLOOM's slopes for a head count that is not a power of two interleave the next power's
    theirs = bloom._get_alibi_slopes(num_heads, torch.device("cpu"))
    torch.testing.assert_close(alibi_slopes(num_heads), theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_heads", [3, 5, 6, 7, 12])
def test_alibi_slopes_rule_in_the_text(num_heads):
    # chapter 19's sentence: all slopes of the largest power of two m below n, then every
    # other slope of 2m for the remaining n - m heads (BLOOM's _get_alibi_slopes as reference)
    m = 2 ** (num_heads.bit_length() - 1)
    rule = torch.cat([alibi_slopes(m), alibi_slopes(2 * m)[::2][: num_heads - m]])
    theirs = bloom._get_alibi_slopes(num_heads, torch.device("cpu"))
    torch.testing.assert_close(rule, theirs, rtol=1e-6, atol=0)


CONFIGS = [dict(n_head=1, n_layer=1, hidden_size=8), dict(n_head=2, n_layer=2, hidden_size=16),
           dict(n_head=4, n_layer=3), dict(n_head=6, n_layer=2), dict(n_head=6, n_layer=1,
           tie_word_embeddings=False), dict(n_head=3, n_layer=2, layer_norm_epsilon=1e-3)]


@pytest.mark.parametrize("overrides", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_from_hf_bloom_computes_blooms_logits(overrides, seed):
    theirs = hf_bloom(seed, **overrides)
    ours, idx = GPT.from_hf_bloom(theirs, context_length=32), ids(seed=seed)
    c = ours.config
    assert (c.positions, c.embed_norm, c.num_heads, c.num_layers, c.tied, c.dropout) == (
        "alibi", True, overrides["n_head"], overrides["n_layer"],
        overrides.get("tie_word_embeddings", True), 0.0)
    assert not ours.training and c.eps == theirs.config.layer_norm_epsilon
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in theirs.parameters())
    with torch.no_grad():
        wanted = theirs(idx).logits
        torch.testing.assert_close(ours(idx), wanted, atol=1e-5, rtol=1e-5)  # seen: 1.2e-6
    assert wanted.std() > 0.5  # logits not small by construction


@pytest.mark.parametrize("overrides", CONFIGS[1:4])
def test_from_hf_bloom_generates_blooms_tokens_and_its_cache_is_exact(overrides):
    theirs, idx = hf_bloom(**overrides), ids(length=24)
    ours = GPT.from_hf_bloom(theirs, context_length=48)
    with torch.no_grad():  # the cache, filled in two pieces, gives the logits of one pass
        cache = ours.make_kv_cache(2)
        pieces = torch.cat([ours(idx[:, :9], kv_cache=cache), ours(idx[:, 9:], kv_cache=cache)], 1)
        torch.testing.assert_close(pieces, ours(idx), atol=1e-5, rtol=1e-5)
    assert_greedy_tokens_equal(ours, theirs, idx[:, :5], 25)


def test_from_hf_bloom_keeps_the_dtype_and_mode_and_takes_the_context_length():
    ours = GPT.from_hf_bloom(hf_bloom().double().train())
    assert ours.training and ours.tok_emb.weight.dtype == torch.float64
    assert ours.config.context_length == 2048  # BLOOM's training length, by default
    with pytest.raises(ValueError, match="context_length"):
        GPT.from_hf_bloom(hf_bloom(), context_length=0)


@pytest.mark.parametrize("overrides, match", [
    (dict(apply_residual_connection_post_layernorm=True),
     "apply_residual_connection_post_layernorm=True is not supported"),
    (dict(hidden_dropout=0.1), "hidden_dropout=0.1 is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(hidden_dropout=0.1, attention_dropout=0.2), "hidden_dropout=0.1"),
    (dict(slow_but_exact=True, pretraining_tp=2), "slow_but_exact=True with pretraining_tp=2"),
])
def test_from_hf_bloom_refuses_what_it_does_not_compute(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT.from_hf_bloom(hf_bloom(**overrides))


def test_from_hf_bloom_takes_pretraining_tp_without_slow_but_exact():
    theirs = hf_bloom(pretraining_tp=2)  # the ordinary projections: nothing to refuse
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_hf_bloom(theirs)(ids()), theirs(ids()).logits,
                                   atol=1e-4, rtol=1e-4)


def test_from_hf_bloom_refuses_a_tied_flag_whose_weights_differ():
    theirs = hf_bloom(tie_word_embeddings=False)  # its own output layer, then a flag that lies
    theirs.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings=True.*lm_head.weight differs"):
        GPT.from_hf_bloom(theirs)


def test_from_hf_bloom_refuses_other_models():
    with pytest.raises(TypeError, match="model must be a BloomForCausalLM, got GPT2LMHeadModel"):
        GPT.from_hf_bloom(transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8)))
    with pytest.raises(TypeError, match="got Linear"):
        GPT.from_hf_bloom(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("tied", [True, False])
def test_from_hf_bloom_refuses_a_model_on_the_meta_device_by_name(tied):
    # built under torch.device("meta") (as accelerate's init_empty_weights does): shapes, no
    # weights; before: a raw aten::equal error from the tied check, or meta weights copied
    config = transformers.BloomConfig(vocab_size=60, hidden_size=24, n_layer=2, n_head=4,
                                      tie_word_embeddings=tied)
    with torch.device("meta"):
        theirs = transformers.BloomForCausalLM(config)
    with pytest.raises(ValueError, match=r"model must hold its weights.*meta device"):
        GPT.from_hf_bloom(theirs)


@pytest.mark.parametrize("epsilon", [0.0, -1e-5])
def test_from_hf_bloom_names_the_config_field_of_a_bad_epsilon(epsilon):
    # GPTConfig refuses eps <= 0 (a constant row would be 0/0); the user wrote
    # layer_norm_epsilon, so that is the name in the refusal (before: "eps must be ...")
    with pytest.raises(ValueError, match=r"^model\.config\.layer_norm_epsilon must be"):
        GPT.from_hf_bloom(hf_bloom(layer_norm_epsilon=epsilon))
