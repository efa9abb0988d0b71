"""A padded position's embedding never reaches a real token (chapter 10's GPT and chapter 11's
encoder-decoder, as tests/test_bert_padding_nan.py for chapter 8's BERT).

The explicit backend gives a padded key a weight of 0, but 0 x NaN is NaN, and SDPA's masked
score is NaN + (-inf), NaN: a NaN (or inf) in the padding token's row of the embedding table made
every real token of a padded row NaN. The models zero the padded positions' embeddings before the
blocks, so a padded key and value are finite and contribute exactly 0: the real positions are bit
for bit those of a clean run, on every variant and backend, through the KV cache and generate
too (the triton backend computes a masked call with SDPA). With a tied output layer the padding
token's own logit column is NaN, so the tests compare the other columns. A NaN in a *real*
token's row still makes its sequence NaN."""

import pytest
import torch
from test_padded import left_padded, prompts
from test_variants import VARIANTS, model

from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 0  # test_padded's padding id
BACKENDS = ["explicit", "sdpa"]
BAD = [float("nan"), float("inf")]


def poisoned(gpt, bad: float) -> None:
    with torch.no_grad():
        gpt.tok_emb.weight[PAD] = bad


def real_logits(logits: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The real positions' logits, less the padding token's own score (its row, if tied)."""
    return logits[real.bool()][:, torch.arange(logits.shape[-1]) != PAD]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("backend", [*BACKENDS, "triton"])  # Triton: interpreted on a CPU
@pytest.mark.parametrize("name", VARIANTS)
def test_a_non_finite_padding_embedding_leaves_the_real_logits_as_they_were(name, backend, bad):
    gpt, (idx, mask) = model(name, backend=backend), left_padded(prompts())
    with torch.no_grad():
        clean = real_logits(gpt(idx, attention_mask=mask), mask)
        poisoned(gpt, bad)
        out = real_logits(gpt(idx, attention_mask=mask), mask)
    assert clean.isfinite().all() and clean.std() > 0.5  # a real comparison
    torch.testing.assert_close(out, clean, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", VARIANTS)
def test_through_the_kv_cache_too(name, backend):
    gpt, (idx, mask) = model(name, backend=backend), left_padded(prompts(seed=2))
    more = torch.randint(1, 40, (4, 3), generator=torch.Generator().manual_seed(3))
    whole_mask = torch.cat([mask, torch.ones_like(more)], 1)
    runs = []
    for bad in (None, float("nan")):
        if bad is not None:
            poisoned(gpt, bad)
        with torch.no_grad():
            cache = gpt.make_kv_cache(4)
            steps = [gpt(idx, cache, mask)]
            for t in range(3):  # later calls: the cache keeps the padding's keys and values
                steps.append(gpt(more[:, t:t + 1], cache, whole_mask[:, :idx.shape[1] + t + 1]))
        runs.append(real_logits(torch.cat(steps, 1), whole_mask))
    assert runs[0].isfinite().all()
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["untied-no-bias", "llama"])  # tied: the NaN row is a logit
def test_generate_chooses_the_same_tokens(name, use_cache):
    gpt, (idx, mask) = model(name), left_padded(prompts(seed=1))
    clean = gpt.generate(idx, 20, temperature=0, use_cache=use_cache, attention_mask=mask)
    pad = min(set(range(40)) - set(clean[:, :7][mask.bool()].tolist() + clean[:, 7:].flatten().tolist()))
    idx = idx.masked_fill(~mask.bool(), pad)  # padding by a token no row reads or generates
    torch.testing.assert_close(gpt.generate(idx, 20, temperature=0, use_cache=use_cache,
                                            attention_mask=mask)[:, 7:], clean[:, 7:], rtol=0, atol=0)
    with torch.no_grad():
        gpt.tok_emb.weight[pad] = float("nan")
    out = gpt.generate(idx, 20, temperature=0, use_cache=use_cache, attention_mask=mask)
    torch.testing.assert_close(out[:, 7:], clean[:, 7:], rtol=0, atol=0)  # past the context of 24


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gpt2", "bloom", "llama"])
def test_a_nan_in_a_real_tokens_embedding_still_reaches_its_sequence(name, backend):
    gpt, (idx, mask) = model(name, backend=backend), left_padded(prompts())
    token = int(idx[1, 2])  # a real token of row 1 (its prompt: the last 7 positions)
    assert mask[1, 2] and token != PAD
    with torch.no_grad():
        gpt.tok_emb.weight[token] = float("nan")
        out = gpt(idx, attention_mask=mask)
    assert out[1, 2:].isnan().all()  # it and every later position read it
    others = torch.arange(40) != token  # its own score is NaN in every row if tied
    for row in (0, 2, 3):  # the other rows, unless they hold the same token
        holds = bool((idx[row][mask[row].bool()] == token).any())
        assert bool(out[row][mask[row].bool()][:, others].isfinite().all()) != holds


@pytest.mark.parametrize("name", ["gpt2", "bloom"])
def test_an_all_real_mask_is_the_run_without_one_even_with_a_nan_padding_row(name):
    gpt, idx = model(name), torch.randint(1, 40, (3, 9), generator=torch.Generator().manual_seed(4))
    poisoned(gpt, float("nan"))  # the token never occurs: nothing to zero
    with torch.no_grad():
        plain = gpt(idx)[..., 1:]
        assert plain.isfinite().all()
        torch.testing.assert_close(gpt(idx, attention_mask=torch.ones_like(idx))[..., 1:], plain,
                                   rtol=0, atol=0)


# --- chapter 11's encoder-decoder --------------------------------------------------------------

VOCAB = 11


def tiny_encdec(backend: str, **more) -> EncoderDecoder:
    torch.manual_seed(0)
    config = EncoderDecoderConfig(src_vocab=VOCAB, tgt_vocab=VOCAB + 2, d_model=16, num_heads=2,
                                  num_layers=2, d_ff=24, context_length=12, dropout=0.0,
                                  backend=backend, **more)
    model = EncoderDecoder(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model


def src_tgt() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source ids (3, 8) padded on the right, their lengths, and targets (3, 6) padded too."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([8, 5, 2])
    src = torch.randint(3, VOCAB, (3, 8), generator=g)
    src[torch.arange(8)[None, :] >= lengths[:, None]] = PAD
    tgt = torch.randint(3, VOCAB, (3, 6), generator=g)
    tgt[:, 0] = 1  # BOS
    tgt[1, 4:], tgt[2, 2:] = PAD, PAD
    return src, lengths, tgt


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [True, False])
def test_a_non_finite_padding_embedding_reaches_no_real_source_or_target_token(
        backend, bad, norm_first):
    model, (src, lengths, tgt) = tiny_encdec(backend, norm_first=norm_first), src_tgt()
    real_tgt = tgt != PAD
    with torch.no_grad():
        clean = model(src, tgt, src_lengths=lengths)
        memory = model.encode(src, src_lengths=lengths)
        model.src_embed.tokens.weight[PAD] = bad
        model.tgt_embed.tokens.weight[PAD] = bad
        out = model(src, tgt, src_lengths=lengths)
        padding = model.source_padding(src, lengths)
        torch.testing.assert_close(model.encode(src, lengths)[padding], memory[padding],
                                   rtol=0, atol=0)
    assert clean[real_tgt].isfinite().all() and clean[real_tgt].std() > 0.5
    torch.testing.assert_close(out[real_tgt], clean[real_tgt], rtol=0, atol=0)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_callers_non_finite_memory_at_padding_reaches_no_target_token(backend, bad):
    # decode(tgt, memory, src_padding) as a caller who runs encode and decode itself (chapter 12)
    model, (src, lengths, tgt) = tiny_encdec(backend), src_tgt()
    real_tgt, padding = tgt != PAD, model.source_padding(src, lengths)
    with torch.no_grad():
        memory = model.encode(src, src_lengths=lengths)
        clean = model.decode(tgt, memory, padding)
        out = model.decode(tgt, memory.masked_fill(~padding[..., None], bad), padding)
    assert clean[real_tgt].isfinite().all() and clean[real_tgt].std() > 0.5
    torch.testing.assert_close(out[real_tgt], clean[real_tgt], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_decoding_is_unchanged_by_a_nan_padding_row(backend):
    model, (src, lengths, _) = tiny_encdec(backend), src_tgt()
    clean = model.greedy_decode(src, 6, src_lengths=lengths)
    with torch.no_grad():
        model.src_embed.tokens.weight[PAD] = float("nan")
        model.tgt_embed.tokens.weight[PAD] = float("nan")  # finished rows read it
    torch.testing.assert_close(model.greedy_decode(src, 6, src_lengths=lengths), clean,
                               rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_in_a_real_source_token_still_reaches_its_target(backend):
    model, (src, lengths, tgt) = tiny_encdec(backend), src_tgt()
    token = int(src[1, 3])  # real: row 1 holds 5 tokens
    with torch.no_grad():
        model.src_embed.tokens.weight[token] = float("nan")
        out = model(src, tgt, src_lengths=lengths)
    assert out[1].isnan().all()  # every target position reads the whole source
    for row in (0, 2):
        holds = bool((src[row, :int(lengths[row])] == token).any())
        assert bool(out[row].isnan().all()) == holds
