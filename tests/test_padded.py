"""Padded batches (chapter 19): GPT.forward and GPT.generate take transformers'
`attention_mask` (1 at a real token, 0 at padding). A left-padded batch of prompts of different
lengths computes, for every variant and backend, what each prompt computes alone, with and without
the KV cache and past the context; GPT-2 and Llama match transformers given the same batch; the
padded forward compiles whole; bad masks are refused by name."""

import pytest
import torch
import torch._dynamo as dynamo
from test_backends import check_calls  # calls of attnbook.checks' functions
from test_variants import VARIANTS, model

from attnbook.gpt import GPT

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (3, 7, 1, 5)  # the prompts' lengths: the batch is padded to 7 on the left


def prompts(vocab=40, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in LENGTHS]


def left_padded(rows: list[torch.Tensor], dtype=torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both (B, longest): padding (id 0, mask 0) before each prompt."""
    longest = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=dtype)
    for i, r in enumerate(rows):
        idx[i, longest - len(r):], mask[i, longest - len(r):] = r, 1
    return idx, mask


@pytest.mark.parametrize("name", VARIANTS)
def test_a_padded_forward_gives_each_prompts_logits_alone(name):
    gpt, rows = model(name), prompts()
    idx, mask = left_padded(rows)
    with torch.no_grad():
        batched = gpt(idx, attention_mask=mask)
        for i, r in enumerate(rows):
            alone = gpt(r[None])[0]
            assert alone.std() > 0.5  # logits that differ: a real comparison
            torch.testing.assert_close(batched[i, -len(r):], alone, atol=2e-5, rtol=1e-5)
        assert batched.isfinite().all()  # the padding's own rows too


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", VARIANTS)
def test_a_padded_batch_generates_what_each_prompt_generates_alone(name, use_cache):
    gpt, rows = model(name), prompts(seed=1)
    idx, mask = left_padded(rows)
    out = gpt.generate(idx, 30, temperature=0, use_cache=use_cache, attention_mask=mask)
    assert out.shape == (4, 37)  # past the context of 24: the window moves
    for i, r in enumerate(rows):
        alone = gpt.generate(r[None], 30, temperature=0, use_cache=use_cache)
        torch.testing.assert_close(out[i, -30:], alone[0, -30:], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2", "rope", "alibi", "grouped-query"])
def test_the_cache_keeps_the_padding_masked_step_after_step(name):
    gpt, rows = model(name), prompts(seed=2)
    idx, mask = left_padded(rows)
    more = torch.randint(1, 40, (4, 6), generator=torch.Generator().manual_seed(3))
    whole, whole_mask = torch.cat([idx, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    with torch.no_grad():
        wanted = gpt(whole, attention_mask=whole_mask)
        cache = gpt.make_kv_cache(4)
        steps = [gpt(idx, cache, mask)]
        for t in range(6):
            steps.append(gpt(more[:, t:t + 1], cache, whole_mask[:, :idx.shape[1] + t + 1]))
    real = whole_mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], wanted[real], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.long, torch.uint8])
def test_a_mask_of_bool_or_any_integer_dtype_gives_the_same(dtype):
    gpt, rows = model("rope"), prompts()
    idx, mask = left_padded(rows)
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx, attention_mask=mask.to(dtype)),
                                   gpt(idx, attention_mask=mask), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2", "rope", "alibi", "grouped-query"])
def test_every_backend_gives_the_same_padded_logits(name):
    idx, mask = left_padded(prompts())
    logits = {}
    for backend in ("explicit", "sdpa", "triton"):
        gpt = model(name, backend=backend)
        with torch.no_grad():
            logits[backend] = gpt(idx, attention_mask=mask)
    for backend in ("sdpa", "triton"):
        torch.testing.assert_close(logits[backend], logits["explicit"], atol=2e-5, rtol=1e-5)


def test_a_mask_of_ones_changes_nothing():
    gpt, idx = model("llama"), torch.randint(40, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx, attention_mask=torch.ones_like(idx)), gpt(idx),
                                   atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(gpt.generate(idx, 5, temperature=0, attention_mask=torch.ones_like(idx)),
                               gpt.generate(idx, 5, temperature=0), rtol=0, atol=0)


# --- against transformers ----------------------------------------------------------------------


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """transformers' position ids for a padded batch, as its generate computes them."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def random_hf_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=40,
                                     n_positions=24, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if ("ln_" in name and name.endswith("weight")) else 0.0, 0.2)
    return hf


def random_hf_llama():
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=None)
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return hf


@pytest.mark.parametrize("make, convert", [(random_hf_gpt2, GPT.from_hf_gpt2),
                                           (random_hf_llama, GPT.from_hf_llama)],
                         ids=["gpt2", "llama"])
def test_a_padded_batch_gives_transformers_logits_and_tokens(make, convert):
    theirs = make()
    ours, (idx, mask) = convert(theirs), left_padded(prompts())
    real = mask.bool()
    with torch.no_grad():
        wanted = theirs(idx, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(idx, attention_mask=mask)
        generated = theirs.generate(idx, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
    assert wanted[real].std() > 1
    torch.testing.assert_close(got[real], wanted[real], atol=1e-4, rtol=1e-4)
    for use_cache in (True, False):
        torch.testing.assert_close(ours.generate(idx, 12, temperature=0, use_cache=use_cache,
                                                 attention_mask=mask), generated, rtol=0, atol=0)


# --- compiling and counting the checks ---------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "rope", "alibi", "grouped-query"])
def test_the_padded_forward_compiles_whole(name):
    gpt, (idx, mask) = model(name), left_padded(prompts())
    dynamo.reset()
    explained = dynamo.explain(gpt)(idx, attention_mask=mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        explained.break_reasons
    dynamo.reset()
    compiled = torch.compile(gpt, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx, attention_mask=mask),
                                   gpt(idx, attention_mask=mask), atol=2e-5, rtol=1e-5)
        with pytest.raises(RuntimeError, match="attention_mask must hold only 0 and 1"):
            compiled(idx, attention_mask=mask * 2)  # checked inside the graph, with no read


def test_padding_adds_no_check_per_layer_or_token():
    idx, mask = left_padded(prompts())
    counts = {}
    for layers in (2, 4):
        gpt = model("rope", num_layers=layers)
        counts[layers] = (check_calls(lambda g=gpt: g(idx, attention_mask=mask)),
                          check_calls(lambda g=gpt: g.generate(idx, 10, temperature=0,
                                                               attention_mask=mask)))
    assert counts[2] == counts[4] and counts[2][0] <= 10 and counts[2][1] <= 30, counts


# --- bad masks, refused by name ----------------------------------------------------------------


def bad_masks():
    idx, mask = left_padded(prompts())
    right = torch.ones_like(mask)
    right[0, 5:] = 0  # padding after the prompt
    empty = mask.clone()
    empty[2] = 0
    return idx, {
        "shape": (mask[:, 1:], ValueError, r"attention_mask must be a bool or integer tensor of "
                                           r"shape \(4, 7\)"),
        "float": (mask.float(), TypeError, "attention_mask must be a bool or integer tensor"),
        "list": (mask.tolist(), TypeError, "attention_mask must be a bool or integer tensor"),
        "device": (mask.to("meta"), ValueError, "attention_mask must be .* on cpu, got shape"),
        "values": (mask * 2, ValueError, "attention_mask must hold only 0 and 1"),
        "empty-row": (empty, ValueError, r"attention_mask must have a real token \(a 1\) in every row"),
        "right-padding": (right, ValueError, "attention_mask must pad on the left only"),
    }


@pytest.mark.parametrize("case", list(bad_masks()[1]))
def test_a_bad_mask_is_refused_by_name(case):
    gpt, (idx, cases) = model("rope"), bad_masks()
    mask, error, match = cases[case]
    with pytest.raises(error, match=match):
        gpt.generate(idx, 3, temperature=0, attention_mask=mask)
    if case == "right-padding":  # forward takes it: positions count the real tokens before
        with torch.no_grad():
            assert gpt(idx, attention_mask=mask).isfinite().all()
    else:
        with pytest.raises(error, match=match):
            gpt(idx, attention_mask=mask)


def test_with_a_cache_the_mask_covers_the_cached_positions_too():
    gpt, (idx, mask) = model("gpt2"), left_padded(prompts())
    cache = gpt.make_kv_cache(4)
    with torch.no_grad():
        gpt(idx, cache, mask)
        with pytest.raises(ValueError, match=r"of shape \(4, 8\)"):
            gpt(idx[:, :1], cache, mask[:, :1])  # the new token's alone: the cached are missing


@pytest.mark.parametrize("name", ["gpt2", "rope", "alibi"])
def test_a_cached_call_without_a_mask_keeps_the_padding_the_cache_holds(name):
    gpt, (idx, mask) = model(name), left_padded(prompts())
    more = torch.randint(1, 40, (4, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = gpt.make_kv_cache(4)
        gpt(idx, cache, mask)
        wanted = gpt(more, cache, torch.cat([mask, torch.ones_like(more)], 1))
        cache.reset()
        gpt(idx, cache, mask)
        torch.testing.assert_close(gpt(more, cache), wanted, rtol=0, atol=0)  # no mask: the same


def test_a_mask_that_disagrees_with_the_cache_is_refused_by_name():
    gpt, (idx, mask) = model("rope"), left_padded(prompts())
    one, other = torch.ones(4, 1, dtype=torch.long), torch.ones_like(mask)
    with torch.no_grad():
        cache = gpt.make_kv_cache(4)
        gpt(idx, cache, mask)
        with pytest.raises(ValueError, match="attention_mask must agree with kv_cache's mask"):
            gpt(one, cache, torch.cat([other, one], 1))  # the cached padding called real
        cache.reset()
        gpt(idx, cache)  # no padding cached
        with pytest.raises(ValueError, match="attention_mask must agree with kv_cache's mask"):
            gpt(one, cache, torch.cat([mask, one], 1))


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "triton"])
@pytest.mark.parametrize("name", ["gpt2", "rope", "alibi", "multi-query-alibi"])
def test_padding_inside_a_row_gives_the_prompts_logits_alone(name, backend):
    gpt = model(name, backend=backend)  # ALiBi's distances, as BLOOM's, skip the padding too
    idx = torch.tensor([[3, 4, 5, 6, 7, 8], [1, 0, 0, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        alone = gpt(torch.tensor([[1, 2, 3, 4]]))[0]
        assert alone.std() > 0.5
        torch.testing.assert_close(gpt(idx, attention_mask=mask)[1, [0, 3, 4, 5]], alone,
                                   atol=2e-5, rtol=1e-5)
