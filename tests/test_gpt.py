"""attnbook.gpt (chapter 10) against transformers' GPT-2, its own uncached path, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnbook.gpt import GPT, CharTokenizer, GPTConfig, KVCache, _next_token

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(seed=0, context=32, dtype=torch.float32, **sizes):
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=50, context_length=context, d_model=32, num_layers=2, num_heads=4,
                  dropout=0.0) | sizes
    return GPT(GPTConfig(**kwargs)).to(dtype).eval()


def random_hf_gpt2(seed=0, spread=0.2, **overrides):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                            n_positions=64, bos_token_id=0, eos_token_id=0)
                                     | overrides)
    model = transformers.GPT2LMHeadModel(config).eval()
    if spread:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(1.0 if ("ln_" in name and name.endswith("weight")) else 0.0, spread)
    return model


# --- configuration ---------------------------------------------------------------------------

def test_config_defaults_are_gpt2_small():
    c = GPTConfig()
    assert (c.vocab_size, c.context_length, c.d_model, c.num_layers, c.num_heads, c.d_ff) == \
        (50257, 1024, 768, 12, 12, 3072)
    assert (c.eps, c.bias, c.head_dim) == (1e-5, True, 64)


def test_replace_derives_what_follows_from_the_fields():
    """dataclasses.replace gives a config whose derived sizes follow the new fields (they were
    stored once, and went stale, while d_ff and the dropout rates were fields)."""
    import dataclasses

    c = GPTConfig(context_length=64)
    wider = dataclasses.replace(c, context_length=128, d_model=128, num_heads=4, dropout=0.0)
    assert (wider.context_length, wider.d_ff, wider.head_dim) == (128, 512, 32)
    assert wider.block.attention.dropout == 0.0 and wider.block.dropout == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.context_length = 128
    with pytest.raises(ValueError, match="num_heads=5"):
        dataclasses.replace(c, num_heads=5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(d_model=100, num_heads=12), ValueError, "num_heads=12"),
    (dict(vocab_size=0), ValueError, "vocab_size=0"),
    (dict(context_length=0), ValueError, "context_length=0"),
    (dict(num_layers=2.0), TypeError, "num_layers=2.0"),
    (dict(dropout=1.5), ValueError, "dropout=1.5"),
    (dict(eps=0.0), ValueError, "eps=0.0"),
    (dict(bias="yes"), TypeError, "bias='yes'"),
    (dict(backend="flash"), ValueError, "backend='flash'"),
])
def test_bad_configs(kwargs, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**kwargs)


# --- against transformers' GPT-2 ------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_logits_equal_transformers_gpt2(seed):
    hf = random_hf_gpt2(seed)
    ours = GPT.from_hf_gpt2(hf)
    assert not ours.training
    g = torch.Generator().manual_seed(seed)
    for b, length in [(1, 1), (2, 17), (3, 64)]:
        ids = torch.randint(100, (b, length), generator=g)
        with torch.no_grad():
            expected = hf(ids).logits
            torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=0)
        assert expected.std() > 1 or length == 1


def test_logits_equal_untouched_random_gpt2_and_parameter_count():
    hf = random_hf_gpt2(spread=0)  # transformers' own initialisation
    ours = GPT.from_hf_gpt2(hf)
    ids = torch.randint(100, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_greedy_generation_equals_transformers_generate():
    hf = random_hf_gpt2(1)
    ours = GPT.from_hf_gpt2(hf)
    prompts = torch.randint(100, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.generate(prompts, max_new_tokens=25, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    for use_cache in (True, False):
        assert torch.equal(ours.generate(prompts, 25, temperature=0, use_cache=use_cache), theirs)


def test_conversion_keeps_training_mode_and_dtype():
    hf = random_hf_gpt2().train().double()
    ours = GPT.from_hf_gpt2(hf)
    assert ours.training and ours.tok_emb.weight.dtype == torch.float64
    assert ours.config.dropout == hf.config.resid_pdrop


@pytest.mark.parametrize("overrides, match", [
    (dict(activation_function="relu"), "activation_function='relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
])
def test_conversion_refuses_what_it_does_not_implement(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT.from_hf_gpt2(random_hf_gpt2(spread=0, **overrides))


def test_conversion_refuses_other_objects():
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        GPT.from_hf_gpt2(torch.nn.Linear(2, 2))


def test_from_hf_gpt2_refuses_a_model_on_the_meta_device_by_name():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=40, n_positions=8)
    with torch.device("meta"):  # shapes, no weights (before: a raw aten::equal error)
        theirs = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"model must hold its weights.*meta device"):
        GPT.from_hf_gpt2(theirs)


def test_from_hf_gpt2_refuses_a_block_layernorm_eps_other_than_ln_fs_by_name():
    # GPTConfig has one eps; load_state_dict copies a LayerNorm's weights but not its eps, so
    # before, such a model converted with ln_f's eps in every block: other logits, silently
    hf = random_hf_gpt2(1)
    hf.transformer.h[1].ln_1.eps = 1e-2
    with pytest.raises(ValueError, match=r"LayerNorms must each hold a weight and a bias and "
                                         r"have ln_f's eps=1e-05 .* unlike \['h\.1\.ln_1\.eps=0\.01'\] "
                                         r"\(1 in all\)"):
        GPT.from_hf_gpt2(hf)
    hf.transformer.h[1].ln_1.eps = hf.transformer.ln_f.eps  # all alike again: converted
    assert GPT.from_hf_gpt2(hf).blocks[1].attn_norm.eps == hf.transformer.ln_f.eps


def test_from_hf_gpt2_names_two_of_many_layernorms_whose_eps_differ_and_counts_them():
    hf = random_hf_gpt2(spread=0, n_layer=48, n_embd=8)  # before: all 96 listed, ~2,000 characters
    for block in hf.transformer.h:
        block.ln_1.eps = block.ln_2.eps = 1e-3
    with pytest.raises(ValueError) as refused:
        GPT.from_hf_gpt2(hf)
    message = str(refused.value)
    assert "['h.0.ln_1.eps=0.001', 'h.0.ln_2.eps=0.001'] (96 in all)" in message
    assert "h.1.ln_1" not in message and len(message) < 300


@pytest.mark.parametrize("strip", ["elementwise_affine", "del weight", "del bias"])
def test_from_hf_gpt2_refuses_a_layernorm_without_weights_by_name(strip):
    # before: a raw RuntimeError of load_state_dict (missing keys), or an AttributeError
    hf = random_hf_gpt2(spread=0)
    if strip == "elementwise_affine":
        hf.transformer.h[1].ln_2 = torch.nn.LayerNorm(32, elementwise_affine=False)
    else:
        delattr(hf.transformer.h[1].ln_2, strip.split()[1])
    with pytest.raises(ValueError, match=r"LayerNorms must each hold a weight and a bias .* "
                                         r"unlike \['h\.1\.ln_2 without a weight or bias'\] "
                                         r"\(1 in all\)"):  # not its eps, which is ln_f's
        GPT.from_hf_gpt2(hf)


def test_from_hf_gpt2_refuses_a_block_norm_that_is_not_a_layernorm_by_name():
    # R-FIN55: an RMSNorm in ln_1 was refused by name, then (4c77d5b) raised a raw RuntimeError
    hf = random_hf_gpt2(spread=0)
    hf.transformer.h[1].ln_1 = torch.nn.RMSNorm(32, eps=hf.transformer.ln_f.eps)
    with pytest.raises(ValueError, match=r"LayerNorms must each hold a weight and a bias .* "
                                         r"unlike \['h\.1\.ln_1 without a weight or bias'\]"):
        GPT.from_hf_gpt2(hf)


def test_from_hf_gpt2_refuses_a_model_without_blocks_by_name():
    with pytest.raises(ValueError, match=r"^model.transformer.h must hold at least one block"):
        GPT.from_hf_gpt2(random_hf_gpt2(spread=0, n_layer=0))  # before: a raw IndexError
    hf = random_hf_gpt2(spread=0)
    hf.transformer.h = torch.nn.ModuleList()  # the config still says 2: the modules are read
    with pytest.raises(ValueError, match=r"^model.transformer.h must hold at least one block"):
        GPT.from_hf_gpt2(hf)


# --- the model --------------------------------------------------------------------------------

def test_causal_and_shapes():
    model = tiny_gpt()
    idx = torch.randint(50, (2, 20))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 50
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (2, 20, 50)
    assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])
    assert model(torch.tensor([[3]])).shape == (1, 1, 50)


def test_initial_loss_is_near_log_vocab():
    model = tiny_gpt()
    idx = torch.randint(50, (4, 32))
    with torch.no_grad():
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    assert abs(loss.item() - math.log(50)) < 0.05


def test_model_trains():
    model = tiny_gpt().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.arange(32).repeat(8, 1) % 7  # a periodic sequence: easy to learn
    for _ in range(60):
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5


# --- the KV cache -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_prefill_and_steps_equal_one_pass(seed):
    g = torch.Generator().manual_seed(seed)
    model = tiny_gpt(seed)
    b = int(torch.randint(1, 4, (1,), generator=g))
    length = int(torch.randint(2, 33, (1,), generator=g))
    prefill = int(torch.randint(1, length, (1,), generator=g))
    idx = torch.randint(50, (b, length), generator=g)
    with torch.no_grad():
        full = model(idx)
        cache = model.make_kv_cache(b)
        parts = [model(idx[:, :prefill], kv_cache=cache)]
        parts += [model(idx[:, t:t + 1], kv_cache=cache) for t in range(prefill, length)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)
    assert cache.length == length


def test_chunks_of_any_size_and_float64():
    model = tiny_gpt(dtype=torch.float64)
    idx = torch.randint(50, (2, 30))
    cache = model.make_kv_cache(2)
    parts = [model(idx[:, a:b], kv_cache=cache) for a, b in [(0, 4), (4, 5), (5, 17), (17, 30)]]
    torch.testing.assert_close(torch.cat(parts, 1), model(idx), atol=1e-12, rtol=0)
    assert cache.keys.dtype == torch.float64


def test_cached_forward_works_with_gradients_enabled():
    model = tiny_gpt()
    idx = torch.randint(50, (1, 10))
    cache = model.make_kv_cache(1)
    out = torch.cat([model(idx[:, :4], kv_cache=cache), model(idx[:, 4:], kv_cache=cache)], 1)
    torch.testing.assert_close(out, model(idx), atol=1e-5, rtol=0)


def test_reset_and_smaller_capacity():
    model = tiny_gpt()
    idx = torch.randint(50, (2, 8))
    cache = model.make_kv_cache(2, capacity=8)
    first = model(idx, kv_cache=cache)
    cache.reset()
    torch.testing.assert_close(model(idx, kv_cache=cache), first)
    one = model.make_kv_cache(1, capacity=1)
    torch.testing.assert_close(model(idx[:1, :1], kv_cache=one), model(idx[:1, :1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cache_memory_formula(dtype):
    model = tiny_gpt(dtype=dtype)
    cache = model.make_kv_cache(3)
    c = model.config
    expected = 2 * c.num_layers * 3 * c.num_heads * c.context_length * c.head_dim * dtype.itemsize
    assert cache.nbytes == cache.keys.nbytes + cache.values.nbytes == expected
    assert cache.keys.shape == (c.num_layers, 3, c.num_heads, c.context_length, c.head_dim)
    meta = KVCache(96, 1, 96, 2048, 128, torch.float16, device="meta")
    assert meta.nbytes == 2 * 96 * 96 * 2048 * 128 * 2


# --- generation ------------------------------------------------------------------------------

def plain_greedy(model, idx, n):
    limit = model.config.context_length
    with torch.no_grad():
        for _ in range(n):
            idx = torch.cat([idx, model(idx[:, -limit:])[:, -1].argmax(-1, keepdim=True)], 1)
    return idx


@pytest.mark.parametrize("prompt_len, new", [(1, 10), (5, 40), (32, 5), (40, 3)])
def test_greedy_with_and_without_cache(prompt_len, new):
    model = tiny_gpt()
    prompt = torch.randint(50, (2, prompt_len))
    expected = plain_greedy(model, prompt, new)
    for use_cache in (True, False):
        out = model.generate(prompt, new, temperature=0, use_cache=use_cache)
        assert out.shape == (2, prompt_len + new) and torch.equal(out, expected)


@pytest.mark.parametrize("prompt_len, new, size", [(1, 10, 11), (5, 40, 32), (20, 12, 32),
                                                    (40, 3, 32), (6, 0, 6)])
def test_generate_allocates_the_cache_the_tokens_need(monkeypatch, prompt_len, new, size):
    """min(context_length, prompt + new tokens) positions, not always context_length (V6); the
    tokens are those of the plain loop (the test above), the window moving past the context."""
    model, made = tiny_gpt(), []
    make = model.make_kv_cache
    monkeypatch.setattr(model, "make_kv_cache", lambda *args: made.append(make(*args)) or made[-1])
    prompt = torch.randint(50, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, new, temperature=0)
    assert [cache.capacity for cache in made] == [size] and torch.equal(
        out, plain_greedy(model, prompt, new))
    sampled = model.generate(prompt, new, generator=torch.Generator().manual_seed(2))
    assert made[-1].capacity == size and torch.equal(sampled, model.generate(
        prompt, new, generator=torch.Generator().manual_seed(2), use_cache=False))


@pytest.mark.parametrize("seed", range(3))
def test_sampling_with_and_without_cache_same_seed(seed):
    model = tiny_gpt(seed)
    prompt = torch.randint(50, (3, 4))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(seed)
        outs.append(model.generate(prompt, 45, temperature=0.9, top_k=20, use_cache=use_cache))
    assert torch.equal(*outs) and torch.equal(outs[0][:, :4], prompt)
    by_generator = [model.generate(prompt, 45, generator=torch.Generator().manual_seed(seed),
                                   use_cache=use_cache) for use_cache in (True, False)]
    assert torch.equal(*by_generator)


def test_top_k_one_is_greedy_and_zero_new_tokens():
    model = tiny_gpt()
    prompt = torch.randint(50, (2, 3))
    assert torch.equal(model.generate(prompt, 12, top_k=1),
                       model.generate(prompt, 12, temperature=0))
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_generate_restores_training_mode_and_keeps_graph_free():
    model = tiny_gpt().train()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 5)
    assert model.training and not out.requires_grad


# --- bad input --------------------------------------------------------------------------------

MODEL = tiny_gpt()


def full_cache(batch):
    cache = MODEL.make_kv_cache(batch)
    MODEL(torch.zeros(batch, 30, dtype=torch.long), kv_cache=cache)
    return cache


@pytest.mark.parametrize("call, error, match", [
    (lambda: MODEL(torch.zeros(2, 3)), TypeError, "idx must hold integer"),
    (lambda: MODEL([[1, 2]]), TypeError, "idx must be a torch.Tensor"),
    (lambda: MODEL(torch.zeros(3, dtype=torch.long)), ValueError,
     r"^idx must have 2 dimensions, \(B, T\), got shape \(3,\)$"),
    (lambda: MODEL(torch.full((1, 3), 50)), ValueError, "vocab_size=50"),
    (lambda: MODEL(torch.zeros(1, 33, dtype=torch.long)), ValueError,
     r"^idx must be at most context_length=32 tokens long, got shape \(1, 33\)$"),
    (lambda: MODEL(torch.zeros(2, 3, dtype=torch.long), kv_cache=full_cache(2)), ValueError,
     r"idx of length 3 does not fit: kv_cache holds 30 .* capacity 32"),
    (lambda: MODEL(torch.zeros(2, 1, dtype=torch.long), kv_cache=MODEL.make_kv_cache(3)),
     ValueError, r"kv_cache.keys \(layers, batch, .*\) must have shape \(2, 2, 4, \*, 8\), got "
                 r"shape \(2, 3, "),
    (lambda: MODEL(torch.zeros(1, 1, dtype=torch.long), kv_cache="cache"), TypeError,
     "kv_cache must be an instance of KVCache"),
    (lambda: MODEL(torch.zeros(1, 1, dtype=torch.long),
                   kv_cache=tiny_gpt(num_layers=3).make_kv_cache(1)), ValueError,
     r"must have shape \(2, 1, 4, \*, 8\), got shape \(3, 1, "),
    (lambda: MODEL.make_kv_cache(0), ValueError, "batch_size=0"),
    (lambda: MODEL.make_kv_cache(1, capacity=33), ValueError, "capacity=33"),
    (lambda: MODEL.generate(torch.zeros(1, 1, dtype=torch.long), -1), ValueError,
     "max_new_tokens=-1"),
    (lambda: MODEL.generate(torch.zeros(1, 1, dtype=torch.long), 2, temperature=-1.0),
     ValueError, "temperature=-1.0"),
    (lambda: MODEL.generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=0), ValueError,
     "top_k=0"),
    (lambda: MODEL.generate(torch.zeros(1, 1), 2), TypeError, "idx must hold integer"),
    (lambda: GPT("config"), TypeError, "config must be an instance of GPTConfig"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_refused_chunk_leaves_the_cache_unchanged():
    cache = full_cache(2)
    keys = cache.keys.clone()
    with pytest.raises(ValueError):
        MODEL(torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)
    assert cache.length == 30 and torch.equal(cache.keys, keys)


# --- the tokenizer ----------------------------------------------------------------------------

def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("hello, world\n")
    assert tok.vocab_size == len(set("hello, world\n"))
    ids = tok.encode("low, hello")
    assert ids.dtype == torch.int64 and tok.decode(ids) == "low, hello"
    assert tok.itos == sorted(tok.itos)
    with pytest.raises(ValueError, match=r"\['z'\]"):
        tok.encode("zoo")
    with pytest.raises(ValueError, match="vocab_size=10"):
        tok.decode([0, 10])
    with pytest.raises(ValueError, match=r"len\(text\) must be at least 1"):
        CharTokenizer("")


# --- One way to check, no silent wrong answers ------------------------------------

def test_imports_no_private_name_of_another_module():
    import ast
    import inspect

    import attnbook.gpt as gpt

    tree = ast.parse(inspect.getsource(gpt))
    private = [f"{node.module}.{alias.name}" for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnbook")
               for alias in node.names if alias.name.startswith("_")]
    assert private == []


def zero_logits_gpt():
    model = tiny_gpt()
    with torch.no_grad():
        model.tok_emb.weight.zero_()  # every logit is exactly 0: all 50 tokens tie
    return model


def test_top_k_keeps_exactly_k_tokens_when_values_tie():
    model = zero_logits_gpt()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 60, top_k=2,
                         generator=torch.Generator().manual_seed(0))
    assert len(set(out[0, 1:].tolist())) == 2


@pytest.mark.parametrize("temperature", [1e-44, 5e-324])
def test_a_tiny_temperature_is_greedy_not_an_overflow(temperature):
    model = tiny_gpt()
    prompt = torch.randint(50, (2, 3), generator=torch.Generator().manual_seed(0))
    for use_cache in (True, False):
        assert torch.equal(model.generate(prompt, 8, temperature=temperature, use_cache=use_cache),
                           model.generate(prompt, 8, temperature=0))


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_non_finite_logits_are_refused_not_turned_into_a_token(temperature):
    model = tiny_gpt()
    with torch.no_grad():
        model.norm_f.weight[0] = float("nan")
    with pytest.raises(ValueError, match="logits are not all finite"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=temperature)


def test_uint8_ids_are_read_as_ids():
    ids = torch.randint(50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(MODEL(ids.to(torch.uint8)), MODEL(ids), atol=0, rtol=0)
    out = MODEL.generate(ids.to(torch.uint8), 3, temperature=0)
    assert out.dtype == torch.int64 and torch.equal(out, MODEL.generate(ids, 3, temperature=0))


@pytest.mark.parametrize("device", ["tpu:x", "cuda"])
def test_cache_device_is_checked(device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=f"device={device!r}"):
        KVCache(2, 1, 4, 8, 8, device=device)


def test_config_has_one_dropout_rate_in_gpt2s_three_places():
    model = GPT(GPTConfig(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2,
                          dropout=0.3))
    block = model.blocks[0]
    assert (model.drop.p, block.self_attn.config.dropout, block.dropout.p) == (0.3, 0.3, 0.3)
    assert block.ff.dropout.p == 0.0  # GPT-2 has no dropout between the two feed-forward layers


def test_conversion_refuses_gpt2_dropout_rates_that_differ():
    hf = random_hf_gpt2(spread=0, embd_pdrop=0.0, attn_pdrop=0.2, resid_pdrop=0.3)
    with pytest.raises(ValueError, match="dropout layers must each be an nn.Dropout of its drop.p"):
        GPT.from_hf_gpt2(hf)
    later = random_hf_gpt2(spread=0, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1, n_layer=3)
    later.transformer.h[2].mlp.dropout.p = 0.5  # before: only layer 0's rates were read
    with pytest.raises(ValueError, match=r"an nn.Dropout of its drop\.p=0\.1 \(GPTConfig has one "
                                         r"rate\), unlike \['h\.2\.mlp\.dropout\.p=0\.5'\] \(1 in all\)"):
        GPT.from_hf_gpt2(later)
    same = GPT.from_hf_gpt2(random_hf_gpt2(spread=0, embd_pdrop=0.2, attn_pdrop=0.2,
                                           resid_pdrop=0.2))
    assert (same.drop.p, same.blocks[1].self_attn.config.dropout, same.blocks[1].dropout.p) == \
        (0.2, 0.2, 0.2)


@pytest.mark.parametrize("edit", [dict(n_positions=128), dict(n_embd=64), dict(n_head=4),
                                  dict(n_inner=16), dict(n_layer=3), dict(vocab_size=90),
                                  dict(layer_norm_epsilon=0.5)])
def test_conversion_reads_sizes_from_the_modules_not_an_edited_config(edit):
    hf = random_hf_gpt2(1)
    for name, value in edit.items():
        setattr(hf.config, name, value)  # the config now describes another model
    ours = GPT.from_hf_gpt2(hf)
    ids = torch.randint(100, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    assert (ours.config.context_length, ours.config.d_model, ours.config.num_heads) == (64, 32, 2)


def test_conversion_refuses_gpt_neo_with_a_clear_error():
    config = transformers.GPTNeoConfig(num_layers=1, attention_types=[[["global"], 1]],
                                       hidden_size=32, num_heads=2, vocab_size=100,
                                       max_position_embeddings=64, bos_token_id=0,
                                       eos_token_id=0)
    with pytest.raises(TypeError, match="GPT2LMHeadModel, got GPTNeoForCausalLM"):
        GPT.from_hf_gpt2(transformers.GPTNeoForCausalLM(config))


def test_the_layers_keep_the_cache_and_advance_it():
    cache = MODEL.make_kv_cache(2, capacity=16)
    assert len(cache.layers) == 2 and cache.length == 0
    assert cache.layers[1].keys.data_ptr() == cache.keys[1].data_ptr()  # views, not copies
    with torch.no_grad():
        MODEL(torch.zeros(2, 5, dtype=torch.long), kv_cache=cache)
    assert [layer.length for layer in cache.layers] == [5, 5] and cache.length == 5
    assert cache.keys[:, :, :, :5].abs().sum() > 0 and cache.keys[:, :, :, 5:].abs().sum() == 0
    cache.reset()
    assert cache.length == 0 and all(layer.length == 0 for layer in cache.layers)
    cache.layers[0].length = 3  # as if a call had been interrupted after its first layer
    with pytest.raises(RuntimeError, match=r"the layers hold \[3, 0\] positions: reset\(\)"):
        MODEL(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)  # refused before it runs
    assert [layer.length for layer in cache.layers] == [3, 0]


def test_a_cache_of_another_dtype_is_refused_and_left_unchanged():
    cache = KVCache(2, 1, 4, 32, 8, torch.float64)
    with pytest.raises(TypeError, match="float64"):
        MODEL(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)
    assert cache.length == 0 and not cache.keys.any()


def test_char_tokenizer_follows_the_error_policy():
    tok = CharTokenizer("abc")
    with pytest.raises(TypeError, match="text=5"):
        CharTokenizer(5)
    with pytest.raises(TypeError, match="integer ids"):
        tok.decode(torch.tensor([True, False]))
    assert tok.decode([]) == "" and tok.decode(torch.tensor([[2, 0]])) == "ca"


def host_reads_during(fn, monkeypatch) -> int:
    """How many times fn() reads a tensor's value on the host (item, int, bool, tolist, ...): on
    a GPU each such read waits for the device to finish everything queued before it."""
    count = [0]
    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    fn()
    monkeypatch.undo()
    return count[0]


@pytest.mark.parametrize("temperature, use_cache", [(0, True), (0.8, True), (0.8, False)])
def test_generation_reads_nothing_on_the_host_per_token(monkeypatch, temperature, use_cache):
    model, prompt = tiny_gpt(), torch.randint(50, (2, 3), generator=torch.Generator().manual_seed(0))

    def reads(tokens):
        g = torch.Generator().manual_seed(0)
        return host_reads_during(lambda: model.generate(prompt, tokens, temperature=temperature,
                                                        top_k=5, use_cache=use_cache, generator=g),
                                 monkeypatch)

    few, many = reads(2), reads(20)
    assert few == many and few <= 4, (few, many)  # the checks of the call, not one per token


def test_generation_refuses_logits_that_turn_non_finite_late():
    model = tiny_gpt()
    prompt = torch.zeros(1, 2, dtype=torch.long)
    calls = [0]
    original = model._logits

    def late_nan(idx, cache, real=None):  # finite for the first two tokens, then NaN
        calls[0] += 1
        out = original(idx, cache, real)
        return out if calls[0] <= 2 else out * float("nan")

    model._logits = late_nan
    with pytest.raises(ValueError, match="logits are not all finite"):
        model.generate(prompt, 5, temperature=0.8)


@pytest.mark.parametrize("bad", [float("nan"), math.inf, -math.inf])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_generation_refuses_one_non_finite_logit_of_one_row_at_one_step(bad, temperature):
    # One logit among 2 x 50, at the third step only: a -inf, which no argmax would pick, too.
    model, calls = tiny_gpt(), [0]
    original = model._logits

    def one_bad(idx, cache, real=None):
        calls[0] += 1
        out = original(idx, cache, real).clone()
        if calls[0] == 3:
            out[1, -1, 7] = bad
        return out

    model._logits = one_bad
    with pytest.raises(ValueError, match="logits are not all finite"):
        model.generate(torch.zeros(2, 2, dtype=torch.long), 5, temperature=temperature,
                       generator=torch.Generator().manual_seed(0))
    assert calls[0] == 5  # the refusal comes after the loop: no read of the device per token


@pytest.mark.parametrize("new", [0, 4])
def test_generated_ids_are_ordinary_tensors_a_training_step_can_read(new):
    """generate runs under torch.inference_mode; what it returns must still serve as the input
    of a training step (an embedding keeps its ids for the backward pass), and be a new tensor."""
    model, prompt = tiny_gpt().train(), torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(prompt, new, temperature=0)
    assert not out.is_inference() and out.shape == (2, 3 + new)
    model(out).sum().backward()  # refused for an inference tensor: "saved for backward"
    assert model.tok_emb.weight.grad is not None
    out[0, 0] = 1  # writing the result leaves the prompt as it was
    assert prompt[0, 0] == 0


def test_conversion_refuses_another_kind_of_model_by_its_model_type():
    # A GPT-Neo has transformer, lm_head and a tied embedding too: only model_type tells it apart.
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    neo = GPTNeoForCausalLM(GPTNeoConfig(num_layers=1, attention_types=[[["global"], 1]],
                                         hidden_size=32, num_heads=2, vocab_size=100,
                                         max_position_embeddings=64, bos_token_id=0,
                                         eos_token_id=0))
    with pytest.raises(TypeError, match="model must be a GPT2LMHeadModel, got GPTNeoForCausalLM"):
        GPT.from_hf_gpt2(neo)


def test_idx_on_another_device_than_the_model_is_refused_by_name():
    model = tiny_gpt().to("meta")  # a device other than idx's, on any machine
    with pytest.raises(ValueError, match="^idx must be on the model's device meta, got idx on cpu$"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_a_hand_made_kv_cache_larger_than_the_context_is_refused_past_it():
    model = tiny_gpt()
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_heads, c.context_length + 8, c.head_dim)
    model(torch.zeros(1, c.context_length, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match=f"at most context_length={c.context_length}"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


@pytest.mark.parametrize("temperature", [0, 0.8])
@pytest.mark.parametrize("generator", [3, "seed", torch.zeros(1)])
def test_generate_refuses_a_generator_that_is_not_one_before_generating(temperature, generator):
    # generator=3 reached torch.multinomial after the prefill (a TypeError naming no argument),
    # and with temperature 0 it was never used at all
    model, calls = tiny_gpt(), [0]
    original = model._logits

    def counted(idx, cache):
        calls[0] += 1
        return original(idx, cache)

    model._logits = counted
    with pytest.raises(TypeError, match="^generator must be an instance of Generator or "
                                        "NoneType, got generator="):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=temperature,
                       generator=generator)
    assert calls[0] == 0  # refused before the model ran


class _GeneratorSaying(torch.Generator):
    """A CPU generator that reports the device `said`: a GPU on a machine without one, or meta,
    where PyTorch 2.13 cannot make one."""

    said = "cuda:0"

    @property
    def device(self):
        return torch.device(self.said)


class _GeneratorOnMeta(_GeneratorSaying):
    said = "meta"


@pytest.mark.parametrize("temperature", [0, 0.8])
@pytest.mark.parametrize("generator, message", [
    (_GeneratorSaying(), "^generator must be on cpu, the device of the tensors it draws, got "
                         "generator on cuda:0$"),
    (_GeneratorOnMeta(), "^generator must draw random numbers, got generator on the meta device")])
def test_generate_refuses_a_generator_that_cannot_draw_on_the_models_device(temperature, generator,
                                                                            message):
    # only its type was checked: a GPU generator for a CPU model went on to torch.multinomial
    # (this stand-in, a CPU generator, even sampled), and with temperature 0 it was never looked at
    model = tiny_gpt()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=temperature,
                       generator=generator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_a_gpu_takes_a_cuda_generator_and_refuses_a_cpu_one():
    model, prompt = tiny_gpt().cuda(), torch.zeros(1, 2, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="^generator must be on cuda"):
        model.generate(prompt, 3, generator=torch.Generator())
    drawn = [model.generate(prompt, 5, generator=torch.Generator("cuda").manual_seed(1))
             for _ in range(2)]
    assert torch.equal(*drawn) and drawn[0].shape == (1, 7)


@pytest.mark.parametrize("idx, match", [
    (torch.zeros(3, dtype=torch.long), r"^idx must have 2 dimensions, \(B, T\), got shape \(3,\)$"),
    (torch.zeros(1, 0, dtype=torch.long), r"^idx must hold at least one row and one token, got "
                                          r"shape \(1, 0\)$")])
def test_each_rule_of_idx_has_its_own_message_with_a_cache_too(idx, match):
    # one message covered every rule, and with a KV cache (no length limit of its own) it said
    # "T at most context_length=inf"
    for cache in (None, MODEL.make_kv_cache(len(idx) or 1)):
        with pytest.raises(ValueError, match=match):
            MODEL(idx, kv_cache=cache)


def test_a_compiled_model_refuses_float_idx_as_eager_does():
    # torch.compile without fullgraph runs the refusing check eagerly: the same TypeError. With
    # fullgraph=True, Dynamo reports any exception raised while tracing as its own Unsupported
    # error (the message is in its text): nothing the package can change
    model = tiny_gpt().eval()
    with pytest.raises(TypeError, match="^idx must hold integer ids, got dtype torch.float32$"):
        torch.compile(model, backend="eager")(torch.zeros(1, 3))


def residual_std(num_layers, scaled):
    """The residual stream's std after the last block at initialisation, width 128 (chapter 10's
    1/sqrt(2 n_layer) scaling of the two output projections, or plain std 0.02 without it)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, context_length=64, d_model=128, num_layers=num_layers,
                          num_heads=4, dropout=0.0)).eval()
    with torch.no_grad():
        if not scaled:
            for block in model.blocks:
                for proj in (block.self_attn.out_proj, block.ff.fc2):
                    proj.weight.normal_(0.0, 0.02)
        x = model.tok_emb(torch.randint(100, (4, 64))) + model.pos_emb(torch.arange(64))
        for block in model.blocks:
            x = block(x, None, is_causal=True)
    return x.std().item()


def test_the_residual_scaling_keeps_a_deep_stream_at_a_shallow_ones_scale():
    """Chapter 10, "The model": scaled, 48 layers start with about the stream of one layer;
    unscaled, the sum of 96 contributions starts several times larger."""
    shallow, deep = residual_std(1, scaled=True), residual_std(48, scaled=True)
    assert abs(deep / shallow - 1) < 0.2
    assert residual_std(48, scaled=False) > 4 * deep


def test_a_tiny_temperature_draws_among_tied_largest_logits_where_greedy_takes_the_first():
    """Chapter 10, "Generating text": the limit of a tiny temperature is greedy only without ties."""
    z, g = torch.tensor([[2.0, 2.0, 0.5, 0.0, -1.0]]), torch.Generator().manual_seed(0)
    draws = torch.cat([_next_token(z, 1e-300, None, g) for _ in range(200)]).flatten()
    assert set(draws.tolist()) == {0, 1} and (_next_token(z, 0, None, g) == 0).all()
