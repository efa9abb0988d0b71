"""GPT's variants: positions learned, RoPE, ALiBi or none; LayerNorm or RMSNorm; a GELU
or SwiGLU feed-forward network; grouped-query and multi-query heads; biases; a tied or untied
output layer. Each is built from the chapters' own parts, keeps its KV cache exact, generates the
same tokens with and without it, compiles whole, checks its input once, and refuses bad settings
by name. The parts inside attention are compared with chapter 5's functions and with attention
written out with the scores."""

import dataclasses
import inspect

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from _hf_compare import assert_greedy_tokens_equal
from test_backends import check_calls  # calls of attnbook.checks' functions

from attnbook.gpt import GPT, GPTConfig
from attnbook.layers import Attention, AttentionConfig, Block, BlockConfig, SwiGLU, TransformerBlock
from attnbook.positions import ALiBi, Rotary, alibi_bias, apply_rope

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(vocab_size=40, context_length=24, d_model=32, num_layers=2, num_heads=4,
             dropout=0.0)
VARIANTS = {
    "gpt2": {},
    "rope": dict(positions="rope"),
    "alibi": dict(positions="alibi"),
    "no-positions": dict(positions="none"),
    "rmsnorm-swiglu": dict(norm="rmsnorm", ffn="swiglu", ff_width=40),
    "grouped-query": dict(positions="rope", num_kv_heads=2),
    "multi-query-alibi": dict(positions="alibi", num_kv_heads=1),
    "untied-no-bias": dict(tied=False, bias=False),
    "bloom": dict(positions="alibi", embed_norm=True),
    "llama": None,  # GPTConfig.llama
}


def config(name: str, **more) -> GPTConfig:
    fields = VARIANTS[name]
    sizes = {**SIZES, **more}
    return GPTConfig.llama(**sizes) if fields is None else GPTConfig(**sizes, **fields)


def model(name: str, **more) -> GPT:
    torch.manual_seed(3)
    gpt = GPT(config(name, **more)).eval()
    with torch.no_grad():  # wider weights than the initialisation's: differences show
        for p in gpt.parameters():
            p.mul_(3.0)
    return gpt


def ids(batch=3, length=18, seed=0):
    return torch.randint(40, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_defaults_are_gpt2s_and_keep_its_parameters():
    c = GPTConfig()
    assert (c.positions, c.norm, c.ffn, c.num_kv_heads, c.tied, c.bias) == \
        ("learned", "layernorm", "gelu", None, True, True)
    names = set(GPT(GPTConfig(**SIZES)).state_dict())
    assert "pos_emb.weight" in names and not any(n.startswith("lm_head") for n in names)
    assert all(".ff.gate." not in n for n in names)


def test_the_llama_preset_and_its_parts():
    c = GPTConfig.llama(**SIZES)
    assert (c.positions, c.norm, c.ffn, c.bias, c.tied, c.eps) == \
        ("rope", "rmsnorm", "swiglu", False, False, 1e-6)
    assert GPTConfig.llama(**SIZES, positions="alibi").positions == "alibi"  # fields win
    gpt = GPT(c)
    assert gpt.pos_emb is None and gpt.lm_head is not None
    block = gpt.blocks[0]
    assert isinstance(block.ff, SwiGLU) and isinstance(block.self_attn.rotary, Rotary)
    assert type(gpt.norm_f).__name__ == "RMSNorm" and block.self_attn.q_proj.bias is None


@pytest.mark.parametrize("d_model, width", [(4096, 11008), (5120, 13824), (8192, 22016), (64, 256)])
def test_the_llama_preset_narrows_the_feed_forward_as_llama_does(d_model, width):
    # Llama's widths: 2/3 * 4 * d rounded up to a multiple of 256 (7B, 13B, 65B; tiny: 256)
    assert GPTConfig.llama(d_model=d_model, num_heads=32 if d_model > 64 else 4).d_ff == width
    assert GPTConfig.llama(d_model=d_model, num_heads=4, ff_width=100).d_ff == 100  # given wins


@pytest.mark.parametrize("name", VARIANTS)
def test_the_kv_cache_gives_the_logits_of_one_pass(name):
    gpt, idx = model(name), ids()
    with torch.no_grad():
        full = gpt(idx)
        cache = gpt.make_kv_cache(batch_size=3)
        steps = [gpt(idx[:, :5], kv_cache=cache)]
        steps += [gpt(idx[:, t:t + 1], kv_cache=cache) for t in range(5, 18)]
    assert full.std() > 0.5  # the logits differ from token to token: a real comparison
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generation_is_the_same_with_and_without_the_cache(name):
    gpt, prompt = model(name), ids(length=4, seed=1)
    out = {use: gpt.generate(prompt, 30, temperature=0, use_cache=use) for use in (True, False)}
    assert out[True].shape == (3, 34)  # past the context of 24: the window moves
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)


@pytest.mark.parametrize("name", VARIANTS)
def test_the_positions_matter_where_the_variant_has_them(name):
    """Swapping two earlier tokens changes a one-layer model's last logits unless it has no
    positions: without any, attending to the same set of tokens gives the same last output."""
    gpt, idx = model(name, num_layers=1), ids(batch=1)
    swapped = idx.clone()
    swapped[:, [2, 6]] = idx[:, [6, 2]]
    with torch.no_grad():
        moved = (gpt(idx)[:, -1] - gpt(swapped)[:, -1]).abs().max().item()
    if name == "no-positions":
        assert moved < 1e-4
    else:
        assert moved > 1e-3


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_compiles_whole(name):
    gpt, idx = model(name), ids()
    dynamo.reset()
    explained = dynamo.explain(gpt)(idx)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        explained.break_reasons
    gpt.train()
    targets = ids(seed=5)

    def step(x):
        logits = gpt(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(idx)
    loss.backward()
    grads = [p.grad.clone() for p in gpt.parameters()]
    gpt.zero_grad()
    step(idx).backward()
    torch.testing.assert_close(loss, step(idx), rtol=1e-4, atol=1e-5)
    for got, wanted in zip(grads, [p.grad for p in gpt.parameters()], strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-5)


def compiled_steps(gpt: GPT, idx: torch.Tensor, steps: int) -> tuple[torch.Tensor, int]:
    """The logits of a prefill of 4 tokens and `steps` one-token steps through the KV cache by
    torch.compile(gpt, fullgraph=True), and how many graphs it compiled for them."""
    graphs = []

    def counting(graph, inputs):  # a backend that counts, then runs the graph as traced
        graphs.append(graph)
        return graph.forward

    dynamo.reset()
    step, cache = torch.compile(gpt, fullgraph=True, backend=counting), gpt.make_kv_cache(len(idx))
    with torch.no_grad():
        logits = [step(idx[:, :4], kv_cache=cache)]
        logits += [step(idx[:, t:t + 1], kv_cache=cache) for t in range(4, 4 + steps)]
    return torch.cat(logits, dim=1), len(graphs)


@pytest.mark.parametrize("name", VARIANTS)
def test_a_compiled_step_with_the_cache_compiles_twice_however_many_steps(name):
    """The prefill, then one step whose cache length is a symbol: 2 graphs for 3 steps or 8
    (the cache's length read through a set compiled once per length, up to the limit of 8).
    The cache is not filled: ALiBi's step compiles once more for the step that fills it (its
    keys are then the whole storage, not a slice of it; measured on torch 2.13)."""
    gpt, idx = model(name, context_length=32), ids(length=24)
    counts = {}
    for steps in (3, 8):
        logits, counts[steps] = compiled_steps(gpt, idx, steps)
        with torch.no_grad():
            cache = gpt.make_kv_cache(3)
            eager = [gpt(idx[:, :4], kv_cache=cache)]
            eager += [gpt(idx[:, t:t + 1], kv_cache=cache) for t in range(4, 4 + steps)]
        torch.testing.assert_close(logits, torch.cat(eager, dim=1), atol=1e-5, rtol=1e-5)
    assert counts == {3: 2, 8: 2}, counts


def test_a_cache_whose_layers_disagree_is_refused_before_the_step():
    gpt, idx = model("rope"), ids()
    cache = gpt.make_kv_cache(3)
    cache.layers[1].length = 2  # as an interrupted call would leave it
    with pytest.raises(RuntimeError, match=r"the layers hold \[0, 2\] positions: reset\(\)"):
        gpt(idx[:, :1], kv_cache=cache)


@pytest.mark.parametrize("name", VARIANTS)
def test_a_variant_checks_its_input_once(name):
    idx, counts = ids(batch=2, length=8), {}
    for layers in (2, 4):
        gpt = model(name, num_layers=layers)
        counts[layers] = (check_calls(lambda g=gpt: g(idx)),
                          check_calls(lambda g=gpt: g.generate(idx[:, :3], 6, temperature=0)))
    assert counts[2] == counts[4] and counts[2][0] <= 10, counts


# The parts inside attention, against chapter 5's functions and attention written out --------


def reference_attention(gpt: GPT, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's self-attention of x (B, T, d) written out: scores, chapter 5's RoPE on q and k
    or ALiBi's bias, the causal mask, softmax, with key/value heads repeated for their groups."""
    attn, c = gpt.blocks[0].self_attn, gpt.config
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
    k, v = (p(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
            for p in (attn.k_proj, attn.v_proj))
    if c.positions == "rope":
        q, k = apply_rope(q), apply_rope(k)
    k, v = (z.repeat_interleave(c.num_heads // c.kv_heads, dim=1) for z in (k, v))
    scores = q @ k.transpose(-2, -1) / c.head_dim ** 0.5
    if c.positions == "alibi":
        scores = scores + alibi_bias(c.num_heads, t)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
    return attn.out_proj(out)


@pytest.mark.parametrize("name", ["rope", "alibi", "grouped-query", "multi-query-alibi", "llama"])
def test_attention_inside_a_variant_is_attention_written_out(name):
    gpt, x = model(name), torch.randn(2, 9, 32)
    with torch.no_grad():
        ours, _ = gpt.blocks[0].self_attn(x, is_causal=True)
        torch.testing.assert_close(ours, reference_attention(gpt, x), atol=1e-4, rtol=1e-4)


def test_rotary_and_alibi_continue_the_positions():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    turned_q, turned_k = Rotary(8)(q, k, start=10)
    at = torch.arange(10, 13)
    torch.testing.assert_close(turned_q, apply_rope(q, at), rtol=0, atol=0)
    torch.testing.assert_close(turned_k, apply_rope(k, at), rtol=0, atol=0)
    torch.testing.assert_close(ALiBi(4)(3, 13), alibi_bias(4, 3, 13), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2,), (1, 2), (3, 2)])
def test_rotary_takes_position_ids_of_every_row_or_each_rows_own(shape):
    q, k = torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8)  # H = L = 2: heads must not be rows
    rows = torch.arange(5, 7) + torch.arange(3)[:, None] * 4  # (3, 2): 5 6, 9 10, 13 14
    rows = rows if shape[0] == 3 else rows[:1].expand(3, 2)  # or every row at 5 6
    turned = Rotary(8)(q, k, 0, rows[:1].reshape(shape) if shape[0] != 3 else rows)
    for b in range(3):
        for mine, x in zip(turned, (q, k)):
            torch.testing.assert_close(mine[b], apply_rope(x[b], rows[b]), rtol=0, atol=0)


def test_alibi_with_the_keys_positions_measures_each_rows_distances():
    key_at = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 1, 1, 2]])  # row 1: keys 1-2 a padding gap
    bias = ALiBi(4)(2, 5, key_at)  # (B, nh, Lq, Lk)
    torch.testing.assert_close(bias[0], alibi_bias(4, 2, 5), rtol=0, atol=0)
    torch.testing.assert_close(bias[1][..., [0, 3, 4]], alibi_bias(4, 2, 3), rtol=0, atol=0)


def test_swiglu_is_the_gated_formula():
    layer, x = SwiGLU(6, 10), torch.randn(4, 6)
    gate, up = layer.gate(x), layer.fc1(x)
    torch.testing.assert_close(layer(x), layer.fc2(gate / (1 + torch.exp(-gate)) * up))


# Bad settings, refused by name -------------------------------------------------------------


@pytest.mark.parametrize("field, value, error, match", [
    ("positions", "sinusoidal", ValueError, "positions must be one of"),
    ("norm", "batchnorm", ValueError, "norm must be one of"),
    ("ffn", "relu", ValueError, "ffn must be one of"),
    ("num_kv_heads", 3, ValueError, "num_kv_heads=3"),
    ("num_kv_heads", 0, ValueError, "num_kv_heads"),
    ("tied", "yes", TypeError, "tied"),
    ("bias", 1.0, TypeError, "bias"),
    ("ff_width", 0, ValueError, "ff_width must be"),
    ("ff_width", 2.5, TypeError, "ff_width"),
    ("embed_norm", 1, TypeError, "embed_norm"),
    ("rope_base", 0.0, ValueError, "rope_base"),
])
def test_bad_settings_are_refused_by_name(field, value, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**SIZES, **{field: value})


def test_settings_that_do_not_go_together_are_refused_by_name():
    with pytest.raises(ValueError, match="head_dim=3 is not divisible"):  # RoPE turns pairs
        GPTConfig(**{**SIZES, "d_model": 12}, positions="rope")


# ALiBi on every path: the weights asked for, every backend, a query with no key -------------


def alibi_block(**fields) -> Block:
    torch.manual_seed(0)
    return Block(BlockConfig(16, 4, positions="alibi", **fields)).eval()


def alibi_weights(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The block's causal self-attention weights (B, nh, T, T), ALiBi written out in float64."""
    attn, (b, t, _) = block.self_attn, x.shape
    q, k = (p(block.attn_norm(x)).double().view(b, t, -1, 4).transpose(1, 2)
            for p in (attn.q_proj, attn.k_proj))
    k = k.repeat_interleave(4 // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) / 2.0 + alibi_bias(4, t).double()  # head size 4
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


@pytest.mark.parametrize("fields", [{}, dict(num_kv_heads=2)])
def test_alibi_block_with_its_weights_computes_the_same(fields):
    block, x = alibi_block(**fields), torch.randn(2, 5, 16)
    with torch.no_grad():
        out, weights, _ = block(x, is_causal=True, return_weights=True)
        torch.testing.assert_close(out, block(x, is_causal=True))
        torch.testing.assert_close(weights.double(), alibi_weights(block, x))


@pytest.mark.parametrize("backend", ["explicit", "triton"])
def test_alibi_takes_every_backend(backend):
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(alibi_block(backend=backend)(x, is_causal=True),
                                   alibi_block()(x, is_causal=True))
    assert dataclasses.replace(config("alibi"), backend=backend).backend == backend


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_alibi_gives_zeros_to_a_query_with_no_key(backend, return_weights):
    block, x = alibi_block(backend=backend), torch.randn(1, 4, 16)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False  # query 1 may read no key
    with torch.no_grad():
        out = block.self_attn(block.attn_norm(x), mask=mask, return_weights=return_weights)
        weights = out[1] if return_weights else None
        out = out[0]
    attn = block.self_attn
    torch.testing.assert_close(out[0, 1], attn.out_proj.bias)  # zeros before out_proj
    assert torch.isfinite(out).all()
    if weights is not None:
        assert (weights[0, :, 1] == 0).all()


def test_alibi_guards_the_row_with_no_key_itself(monkeypatch):
    """SDPA's CUDA math kernel gives NaN where a float mask is -inf across a row; the CPU's
    gives zeros. Here SDPA answers NaN for such a row, and the layer must still give zeros."""
    real = F.scaled_dot_product_attention

    def nan_for_empty_rows(q, k, v, attn_mask=None, **kwargs):
        out = real(q, k, v, attn_mask=attn_mask, **kwargs)
        if attn_mask is not None and attn_mask.dtype.is_floating_point:
            empty = torch.isneginf(attn_mask).all(dim=-1, keepdim=True)
            out = out.masked_fill(empty, float("nan"))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", nan_for_empty_rows)
    block, x = alibi_block(), torch.randn(1, 4, 16)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    with torch.no_grad():
        out, _ = block.self_attn(block.attn_norm(x), mask=mask)
    torch.testing.assert_close(out[0, 2], block.self_attn.out_proj.bias)


def test_attention_checks_its_hooks_when_built():
    c = AttentionConfig(16, 4)
    for name in ("rotary", "fast"):
        with pytest.raises(TypeError, match=f"{name} must be callable or None, got {name}=5"):
            Attention(c, **{name: 5})


def test_transformer_block_takes_every_field_of_block_config():
    torch.manual_seed(0)
    ours = TransformerBlock(16, 4, positions="rope", rope_base=500.0)
    assert ours.config == BlockConfig(16, 4, positions="rope", rope_base=500.0)
    assert [f.name for f in dataclasses.fields(BlockConfig)] == list(
        inspect.signature(TransformerBlock).parameters)


# Llama's weights (chapter 19) ---------------------------------------------------------------


def hf_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    fields = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


@pytest.mark.parametrize("overrides", [{}, dict(num_key_value_heads=1),
                                       dict(tie_word_embeddings=True),
                                       dict(attention_bias=True, mlp_bias=True),
                                       dict(rope_theta=500.0, rms_norm_eps=1e-5)])
def test_from_hf_llama_computes_llamas_logits_and_tokens(overrides):
    theirs = hf_llama(**overrides)
    if "rope_theta" in overrides:  # transformers 5 keeps it in rope_parameters
        assert (getattr(theirs.config, "rope_parameters", None)
                or {"rope_theta": theirs.config.rope_theta})["rope_theta"] == 500.0
    ours, idx = GPT.from_hf_llama(theirs), ids(batch=2, length=20)
    assert not ours.training and ours.config.positions == "rope"
    with torch.no_grad():
        wanted = theirs(idx).logits
        torch.testing.assert_close(ours(idx), wanted, atol=1e-4, rtol=1e-4)
    assert wanted.std() > 1
    assert_greedy_tokens_equal(ours, theirs, idx[:, :5], 20)


def test_from_hf_llama_keeps_the_dtype_and_mode():
    theirs = hf_llama().double().train()
    ours = GPT.from_hf_llama(theirs)
    assert ours.training and ours.tok_emb.weight.dtype == torch.float64


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(attention_bias=True, mlp_bias=False), "mlp_bias=False and .*attention_bias=True must"),
    (dict(attention_bias=False, mlp_bias=True), "mlp_bias=True and .*attention_bias=False must"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
])
def test_from_hf_llama_refuses_what_it_does_not_compute(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT.from_hf_llama(hf_llama(**overrides))


def test_from_hf_llama_refuses_a_tied_flag_whose_weights_differ():
    theirs = hf_llama()  # its own output layer, then a flag that says it is the embedding
    theirs.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings=True.*lm_head.weight"):
        GPT.from_hf_llama(theirs)


def test_from_hf_llama_refuses_other_models():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(TypeError, match="model must be a LlamaForCausalLM, got GPT2LMHeadModel"):
        GPT.from_hf_llama(GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8)))
    with pytest.raises(TypeError, match="got Linear"):
        GPT.from_hf_llama(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("tied", [True, False])
def test_from_hf_llama_refuses_a_model_on_the_meta_device_by_name(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):  # shapes, no weights (before: a raw aten::equal error, or a copy)
        theirs = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"model must hold its weights.*meta device"):
        GPT.from_hf_llama(theirs)


@pytest.mark.parametrize("field, value", [("num_key_value_heads", None), ("num_key_value_heads", 4),
                                          ("intermediate_size", 40), ("vocab_size", 61),
                                          ("hidden_size", 48)])
def test_from_hf_llama_refuses_config_sizes_its_modules_disagree_with(field, value):
    # AT53-V F3: a raw "size mismatch" from load_state_dict (set through __dict__, because
    # transformers' config refuses such values when they are set)
    theirs = hf_llama()
    theirs.config.__dict__[field] = value
    with pytest.raises(ValueError, match=rf"^model\.config\.{field}={value!r} disagrees"):
        GPT.from_hf_llama(theirs)


def test_from_hf_llama_names_a_missing_rope_theta():
    # AT53-V F4: AttributeError "'LlamaConfig' object has no attribute 'rope_theta'"
    theirs = hf_llama()
    theirs.config.__dict__["rope_parameters"] = None
    with pytest.raises(TypeError, match=r"^model\.config\.rope_parameters\['rope_theta'\]"):
        GPT.from_hf_llama(theirs)


def test_from_hf_llama_names_the_config_field_of_a_bad_epsilon():
    with pytest.raises(ValueError, match=r"^model\.config\.rms_norm_eps must be"):
        GPT.from_hf_llama(hf_llama(rms_norm_eps=0.0))


@pytest.mark.parametrize("num_heads", [3, 6, 12, 13, 16])
@pytest.mark.parametrize("convert", ["built", "moved"])
def test_alibi_slopes_in_a_float64_model_are_the_float64_closed_form(num_heads, convert):
    # ALiBi's slopes in the model's dtype: a float64 GPT (built so, or moved there) has the
    # closed form 2**(-8 (h+1) / m) (and 2m's odd ones) to float64 rounding, not float32's 2.6e-9
    c = config("alibi", num_heads=num_heads, d_model=4 * num_heads)
    if convert == "built":
        with torch.device("cpu"):
            torch.set_default_dtype(torch.float64)
            try:
                gpt = GPT(c)
            finally:
                torch.set_default_dtype(torch.float32)
    else:
        gpt = GPT(c).double()
    m = 2 ** (num_heads.bit_length() - 1)
    exponents = [8 * (h + 1) / m for h in range(m)] + [4 * (2 * j + 1) / m for j in range(num_heads - m)]
    closed = torch.tensor([2.0 ** -e for e in exponents], dtype=torch.float64)
    alibi = gpt.blocks[0].self_attn.fast.alibi
    bias = alibi(2, 5)  # (nh, 2, 5): the last two of five positions
    assert bias.dtype == torch.float64
    distance = (torch.arange(3, 5)[:, None] - torch.arange(5)[None]).abs().double()
    torch.testing.assert_close(bias, -closed[:, None, None] * distance, rtol=1e-15, atol=0)
