"""Tests of attnbook.encdec (chapter 11) against torch.nn.Transformer and the model's properties."""

import dataclasses
import warnings

import pytest
import torch
from test_backends import check_calls
from test_gpt import host_reads_during
from torch import nn

from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
from attnbook.layers import from_torch
from attnbook.masks import causal_mask, padding_mask
from attnbook.positions import sinusoidal_encoding

PAD, BOS, EOS, VOCAB = 0, 1, 2, 11


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0, dtype=torch.float64, **overrides):
    torch.manual_seed(seed)
    sizes = dict(src_vocab=VOCAB, tgt_vocab=VOCAB + 2, d_model=16, num_heads=2, num_layers=2,
                 d_ff=24, context_length=12, dropout=0.0)
    sizes.update(overrides)
    return EncoderDecoder(EncoderDecoderConfig(**sizes)).to(dtype).eval()


def _batch(seed, b=4, ls=7, lt=5, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, ls + 1, (b,), generator=g)
    lengths[0] = ls
    src = torch.randint(3, vocab, (b, ls), generator=g)
    src[~padding_mask(lengths, ls)] = PAD
    tgt_in = torch.randint(3, vocab, (b, lt), generator=g)
    tgt_in[:, 0] = BOS
    return src, tgt_in, lengths


# Configuration ----------------------------------------------------------------------------


def test_config_and_keywords_build_the_same_model():
    config = EncoderDecoderConfig(src_vocab=9, tgt_vocab=10, d_model=16, num_heads=4,
                                  num_layers=1, num_decoder_layers=3)
    model = EncoderDecoder(config)
    assert len(model.encoder) == 1 and len(model.decoder) == 3
    assert all(block.cross_attn is not None for block in model.decoder)
    assert all(block.cross_attn is None for block in model.encoder)
    assert model.decoder[0].ff.fc1.out_features == 64  # default 4 * d_model
    other = EncoderDecoder(EncoderDecoderConfig(src_vocab=9, tgt_vocab=10, d_model=16,
                                                num_heads=4, num_layers=1, num_decoder_layers=3))
    assert other.config == config
    assert model.lm_head.out_features == 10


def test_sinusoidal_and_learned_positions():
    model = _model(dtype=torch.float32)
    expected = torch.from_numpy(sinusoidal_encoding(12, 16)).float()
    torch.testing.assert_close(model.src_embed.positions, expected)
    assert "src_embed.positions" not in model.state_dict()  # a fixed table, not a weight
    learned = _model(positions="learned", dtype=torch.float32)
    assert isinstance(learned.tgt_embed.positions, nn.Parameter)
    assert learned.tgt_embed.positions.shape == (12, 16)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(src_vocab=0), ValueError, "src_vocab=0"),
    (dict(tgt_vocab=2.0), TypeError, "tgt_vocab=2.0"),
    (dict(d_model=30, num_heads=4), ValueError, "d_model=30"),
    (dict(num_layers=0), ValueError, "num_layers=0"),
    (dict(num_decoder_layers=0), ValueError, "num_decoder_layers=0"),
    (dict(d_ff=0), ValueError, "d_ff=0"),
    (dict(eos_id=20), ValueError, "eos_id=20"),
    (dict(bos_id=-1), ValueError, "bos_id=-1"),
    (dict(pad_id=10, src_vocab=5), ValueError, "pad_id=10"),
    (dict(bos_id=0), ValueError, "bos_id=0"),
    (dict(positions="rotary"), ValueError, "positions='rotary'"),
    (dict(norm_first=1), TypeError, "norm_first=1"),
])
def test_config_bad_values(kwargs, error, match):
    sizes = dict(src_vocab=12, tgt_vocab=12, d_model=16, num_heads=4)
    sizes.update(kwargs)
    with pytest.raises(error, match=match):
        EncoderDecoderConfig(**sizes)


def test_model_bad_construction():
    with pytest.raises(ValueError, match="activation='swish'"):
        EncoderDecoder(EncoderDecoderConfig(src_vocab=5, tgt_vocab=5, d_model=8, num_heads=2,
                                            activation="swish"))
    with pytest.raises(TypeError, match="config must be"):
        EncoderDecoder({"src_vocab": 5})
    with pytest.raises(TypeError):  # one way to build it: a config, not its fields
        EncoderDecoder(src_vocab=5, tgt_vocab=5, d_model=8, num_heads=2)


# Against torch.nn.Transformer -------------------------------------------------------------


def _torch_copy(ours, norm_first):
    c = ours.config
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="enable_nested_tensor")
        theirs = nn.Transformer(c.d_model, c.num_heads, c.num_layers, len(ours.decoder),
                                c.d_ff, dropout=0.0, activation=c.activation, batch_first=True,
                                norm_first=norm_first, dtype=torch.float64).eval()
    theirs.encoder.use_nested_tensor = False  # keep its reference path simple
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.3)
    for mine, layer in zip([*ours.encoder, *ours.decoder],
                           [*theirs.encoder.layers, *theirs.decoder.layers]):
        mine.self_attn.load_state_dict(from_torch(layer.self_attn).state_dict())
        mine.ff.fc1.load_state_dict(layer.linear1.state_dict())
        mine.ff.fc2.load_state_dict(layer.linear2.state_dict())
        mine.attn_norm.load_state_dict(layer.norm1.state_dict())
        if mine.cross_attn is None:
            mine.ff_norm.load_state_dict(layer.norm2.state_dict())
        else:
            mine.cross_attn.load_state_dict(from_torch(layer.multihead_attn).state_dict())
            mine.cross_norm.load_state_dict(layer.norm2.state_dict())
            mine.ff_norm.load_state_dict(layer.norm3.state_dict())
    if norm_first:
        ours.encoder_norm.load_state_dict(theirs.encoder.norm.state_dict())
        ours.decoder_norm.load_state_dict(theirs.decoder.norm.state_dict())
    else:  # post-norm: no final norms in our model
        theirs.encoder.norm = theirs.decoder.norm = None
    return theirs


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matches_torch_transformer(norm_first, activation):
    ours = _model(norm_first=norm_first, activation=activation)
    theirs = _torch_copy(ours, norm_first)
    src, tgt_in, lengths = _batch(1)
    src_pad = padding_mask(lengths, src.shape[1])
    with torch.no_grad():
        hidden = theirs(ours.src_embed(src, src_pad), ours.tgt_embed(tgt_in, tgt_in != PAD),
                        tgt_mask=~causal_mask(tgt_in.shape[1]), src_key_padding_mask=~src_pad,
                        memory_key_padding_mask=~src_pad)
        torch.testing.assert_close(ours(src, tgt_in, src_lengths=lengths), ours.lm_head(hidden))


# Properties -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("norm_first", [True, False])
def test_shapes_and_padding_invariance(seed, norm_first):
    model = _model(seed, norm_first=norm_first)
    src, tgt_in, lengths = _batch(seed, b=3 + seed, ls=4 + seed, lt=2 + 2 * seed)
    logits = model(src, tgt_in, src_lengths=lengths)
    assert logits.shape == (*tgt_in.shape, VOCAB + 2)
    torch.testing.assert_close(model(src, tgt_in), logits)  # padding from pad_id == lengths
    junk = torch.where(src == PAD, torch.randint(3, VOCAB, src.shape), src)
    torch.testing.assert_close(model(junk, tgt_in, src_lengths=lengths), logits)
    assert not torch.allclose(model(junk, tgt_in), logits)  # without lengths: junk is real


@pytest.mark.parametrize("seed", range(3))
def test_decoder_is_causal(seed):
    model = _model(seed)
    src, tgt_in, lengths = _batch(seed, lt=8)
    logits = model(src, tgt_in, lengths)
    for j in range(1, 8):
        changed = tgt_in.clone()
        changed[:, j:] = torch.randint(3, VOCAB, changed[:, j:].shape)
        out = model(src, changed, lengths)
        torch.testing.assert_close(out[:, :j], logits[:, :j])


def test_encode_decode_split_and_cross_weights():
    model = _model()
    src, tgt_in, lengths = _batch(2, b=3, ls=6, lt=4)
    pad = model.source_padding(src, lengths)
    memory = model.encode(src, lengths)
    assert memory.shape == (3, 6, 16)
    logits, weights = model.decode(tgt_in, memory, pad, return_weights=True)
    torch.testing.assert_close(logits, model(src, tgt_in, lengths))
    assert len(weights) == 2 and weights[0].shape == (3, 2, 4, 6)
    assert (weights[-1].masked_select(~pad[:, None, None, :].expand_as(weights[-1])) == 0).all()
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(3, 2, 4, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(3))
def test_encode_is_zero_at_padding_and_each_source_alone_elsewhere(seed):
    model = _model(seed)
    src, _, lengths = _batch(seed, b=4, ls=6)
    memory = model.encode(src, lengths)  # (B, Ls, d_model)
    pad = ~padding_mask(lengths, src.shape[1])
    assert pad.any() and (memory[pad] == 0).all()  # exactly 0, not merely small
    for row, n in enumerate(lengths.tolist()):  # the real positions: the source without padding
        torch.testing.assert_close(memory[row, :n], model.encode(src[row:row + 1, :n])[0])


def test_length_one_and_dropout_modes():
    model = _model(dtype=torch.float32, dropout=0.2)
    src, tgt = torch.tensor([[5]]), torch.tensor([[BOS]])
    assert model(src, tgt).shape == (1, 1, VOCAB + 2)
    torch.testing.assert_close(model(src, tgt), model(src, tgt))  # eval: no dropout
    model.train()
    torch.manual_seed(0)
    x = torch.randint(3, VOCAB, (4, 8))
    assert not torch.allclose(model(x, x), model(x, x))


# Greedy decoding --------------------------------------------------------------------------


class _Scripted(EncoderDecoder):
    """Emits token 5 until position stop[b], then EOS: tests the decoding loop itself."""

    def __init__(self, stop):
        super().__init__(EncoderDecoderConfig(src_vocab=VOCAB, tgt_vocab=VOCAB, d_model=8,
                                              num_heads=2, context_length=12))
        self.stop = torch.tensor(stop)

    def _decode(self, tgt_in, memory, src_padding, return_weights=False):
        b, t = tgt_in.shape
        logits = torch.zeros(b, t, VOCAB)
        position = torch.arange(t)[None, :].expand(b, t)
        logits[..., 5] = 1.0
        logits[..., EOS] = (position >= self.stop[:, None]).float() * 2.0
        return logits, []  # _decode's (logits, cross-attention weights)


def test_greedy_stops_at_eos_per_row():
    model = _Scripted([2, 0, 4])
    out = model.greedy_decode(torch.full((3, 3), 4))
    expected = torch.tensor([[5, 5, EOS, PAD, PAD],
                             [EOS, PAD, PAD, PAD, PAD],
                             [5, 5, 5, 5, EOS]])
    assert torch.equal(out, expected)


def test_greedy_respects_max_new_tokens():
    model = _Scripted([20, 20])
    assert model.greedy_decode(torch.full((2, 3), 4), max_new_tokens=6).shape == (2, 6)
    assert model.greedy_decode(torch.full((2, 3), 4)).shape == (2, 12)  # config.context_length


def test_greedy_eos_forced_by_bias():
    model = _model(dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[EOS] = 10.0
    out = model.greedy_decode(torch.randint(3, VOCAB, (5, 4)))
    assert torch.equal(out, torch.full((5, 1), EOS))


@pytest.mark.parametrize("seed", range(3))
def test_greedy_batched_equals_one_by_one(seed):
    model = _model(seed, dtype=torch.float32)
    src, _, lengths = _batch(seed, b=4)
    together = model.greedy_decode(src, max_new_tokens=8, src_lengths=lengths)
    for i in range(4):
        alone = model.greedy_decode(src[i : i + 1, : lengths[i]], max_new_tokens=8)[0]
        assert torch.equal(together[i, : len(alone)], alone)
        assert (together[i, len(alone):] == PAD).all()
        assert EOS not in alone[:-1].tolist()


# Bad input --------------------------------------------------------------------------------


def _bad_calls():
    model = _model(dtype=torch.float32)
    src, tgt = torch.randint(3, VOCAB, (2, 5)), torch.full((2, 3), BOS)
    memory = model.encode(src)
    return [
        (lambda: model(src.float(), tgt), TypeError, "src"),
        (lambda: model(src.numpy(), tgt), TypeError, "src"),
        (lambda: model(src[0], tgt), ValueError, "src must have shape"),
        (lambda: model(torch.full((2, 5), VOCAB), tgt), ValueError, "src must lie in"),
        (lambda: model(torch.randint(3, VOCAB, (2, 13)), tgt), ValueError,
         "src's length must be at most 12"),
        (lambda: model(src, tgt[:1]), ValueError, "tgt_in must have shape"),
        (lambda: model(src, torch.full((2, 3), VOCAB + 2)), ValueError, "tgt_in must lie in"),
        (lambda: model(src, tgt, src_lengths=[5, 6]), ValueError, "src_lengths"),
        (lambda: model.decode(tgt, memory[..., :8]), ValueError, "memory"),
        (lambda: model.greedy_decode(src, max_new_tokens=13), ValueError, "max_new_tokens=13"),
        (lambda: model.greedy_decode(src, max_new_tokens=0), ValueError, "max_new_tokens=0"),
    ]


@pytest.mark.parametrize("index", range(11))
def test_bad_inputs(index):
    call, error, match = _bad_calls()[index]
    with pytest.raises(error, match=match):
        call()


def test_training_steps_reduce_loss():
    """Fit one small copy batch: the model, its masks and its loss are wired together."""
    model = _model(dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    src = torch.randint(3, VOCAB, (16, 4), generator=torch.Generator().manual_seed(0))
    tgt_in = torch.cat([torch.full((16, 1), BOS), src], dim=1)
    tgt_out = torch.cat([src, torch.full((16, 1), EOS)], dim=1)
    losses = []
    for _ in range(15):
        logits = model(src, tgt_in)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# No silent wrong answers -----------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[5], torch.tensor([[5, 3]]), [5, 0], [6, 3], torch.tensor(5)])
def test_src_lengths_must_be_one_length_per_source(lengths):
    """One length for a batch of two was broadcast over the batch; 0 or > Ls made no sense."""
    model = _model(dtype=torch.float32)
    src, tgt = torch.randint(3, VOCAB, (2, 5)), torch.full((2, 3), BOS)
    with pytest.raises(ValueError, match="src_lengths"):
        model(src, tgt, src_lengths=lengths)
    with pytest.raises(ValueError, match="src_lengths"):
        model.encode(src, lengths)


def test_decode_checks_src_padding():
    model = _model(dtype=torch.float32)
    src, tgt = torch.randint(3, VOCAB, (2, 5)), torch.full((2, 3), BOS)
    memory, pad = model.encode(src), torch.ones(2, 5, dtype=torch.bool)
    torch.testing.assert_close(model.decode(tgt, memory, pad), model.decode(tgt, memory))
    for bad, error in [(pad.float(), TypeError), (pad.tolist(), TypeError),
                       (pad[:1], ValueError), (pad[:, :4], ValueError), (pad[0], ValueError),
                       (pad.to("meta"), ValueError)]:  # another device than memory's
        with pytest.raises(error, match="src_padding"):
            model.decode(tgt, memory, bad)
    with pytest.raises(TypeError, match="return_weights"):
        model.decode(tgt, memory, pad, return_weights="yes")


def test_greedy_decode_runs_in_eval_mode_and_restores_the_mode():
    model = _model(seed=3, dtype=torch.float32, dropout=0.5)
    src = torch.randint(3, VOCAB, (16, 7), generator=torch.Generator().manual_seed(0))
    expected = model.eval().greedy_decode(src, max_new_tokens=8)
    model.train()
    first, second = model.greedy_decode(src, max_new_tokens=8), model.greedy_decode(src, max_new_tokens=8)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert model.training and all(m.training for m in model.modules())
    with pytest.raises(ValueError, match="src_lengths"):
        model.greedy_decode(src, src_lengths=[7])
    assert model.training
    assert not model.eval().greedy_decode(src, max_new_tokens=2).requires_grad and not model.training


def test_small_integer_ids_work_like_int64():
    model = _model()
    src, tgt_in, lengths = _batch(4)
    logits = model(src, tgt_in, src_lengths=lengths)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        torch.testing.assert_close(model(src.to(dtype), tgt_in.to(dtype), lengths), logits)


def test_greedy_decode_restores_each_module_mode():
    """A block the caller froze in eval mode inside a training model stays in eval mode."""
    model = _model(dtype=torch.float32, dropout=0.5).train()
    model.encoder[0].eval(), model.decoder[1].self_attn.eval()
    before = {name: m.training for name, m in model.named_modules()}
    model.greedy_decode(torch.full((2, 3), 4), max_new_tokens=2)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert not model.encoder[0].training and model.decoder[0].training


def test_decode_refuses_memory_of_another_dtype():
    model = _model(dtype=torch.float32)
    memory = model.encode(torch.randint(3, VOCAB, (2, 5)))
    with pytest.raises(TypeError, match="memory must be a torch.float32 tensor, got dtype "
                                        "torch.float64"):
        model.decode(torch.full((2, 3), BOS), memory.double())


@pytest.mark.parametrize("lengths", ["ab", [None, None], [5.0, 3.0], torch.tensor([True, True]),
                                     torch.tensor([5.0, 3.0]), 5])
def test_src_lengths_of_the_wrong_type_are_named(lengths):
    model = _model(dtype=torch.float32)
    src, tgt = torch.randint(3, VOCAB, (2, 5)), torch.full((2, 3), BOS)
    with pytest.raises(TypeError, match="src_lengths"):
        model(src, tgt, src_lengths=lengths)
    torch.testing.assert_close(model(src, tgt, src_lengths=torch.tensor([5, 3])),
                               model(src, tgt, src_lengths=[5, 3]))


def test_max_len_is_no_longer_a_name_of_greedy_decode():
    """One name per idea: the number of tokens to decode is max_new_tokens, as in GPT.generate."""
    with pytest.raises(TypeError, match="max_len"):
        _model(dtype=torch.float32).greedy_decode(torch.full((1, 3), 4), max_len=2)


# Frozen config, derived sizes -------------------------------------------------------------


def test_config_is_frozen_and_replace_keeps_derived_sizes_consistent():
    config = EncoderDecoderConfig(src_vocab=9, tgt_vocab=9, d_model=16, num_heads=4,
                                  num_layers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3
    deeper = EncoderDecoder(dataclasses.replace(config, num_layers=3))
    assert len(deeper.encoder) == 3 and len(deeper.decoder) == 3  # None: as many as the encoder
    wider = EncoderDecoder(dataclasses.replace(config, d_model=32, num_heads=4))
    assert wider.decoder[0].ff.fc1.out_features == 128  # d_ff None: 4 * the new d_model
    assert dataclasses.replace(config, num_decoder_layers=1).num_decoder_layers == 1
    with pytest.raises(ValueError, match="dropout"):  # the blocks' settings, checked at once
        EncoderDecoderConfig(src_vocab=9, tgt_vocab=9, d_model=16, num_heads=4, dropout=1.5)


# Checked once, at the entry points --------------------------------------------------------


def _never_ends(steps_model):
    with torch.no_grad():  # EOS can never win: greedy decoding runs all its steps
        steps_model.lm_head.bias[EOS] = -1e9
    return steps_model


def _entry_point_checks(layers):
    model = _never_ends(_model(dtype=torch.float32, num_layers=layers, context_length=24))
    src, tgt_in, lengths = _batch(0)
    memory = model.encode(src)
    return dict(forward=check_calls(lambda: model(src, tgt_in, lengths)),
                encode=check_calls(lambda: model.encode(src, lengths)),
                decode=check_calls(lambda: model.decode(tgt_in, memory, src != PAD)),
                ten=check_calls(lambda: model.greedy_decode(src, 10, lengths)),
                twenty=check_calls(lambda: model.greedy_decode(src, 20, lengths)))


def test_entry_points_check_once_whatever_the_depth_and_the_steps():
    counts = _entry_point_checks(1)
    assert counts["ten"] == counts["twenty"] <= 30, counts  # none per token
    assert max(counts.values()) <= 30, counts
    assert _entry_point_checks(4) == counts  # none per layer


def test_greedy_decode_reads_one_result_per_step_its_stop_test(monkeypatch):
    """The loop's only host sync is `done.all()`: 10 more steps, 10 more reads."""
    model = _never_ends(_model(dtype=torch.float32, context_length=24))
    src, _, lengths = _batch(1)
    ten, twenty = (host_reads_during(lambda n=n: model.greedy_decode(src, n, lengths), monkeypatch)
                   for n in (10, 20))
    assert twenty - ten == 10, (ten, twenty)
