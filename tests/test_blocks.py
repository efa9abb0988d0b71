"""Tests of attnbook.layers (chapter 7) against PyTorch's layers and formulas."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnbook.layers import (
    FeedForward,
    RMSNorm,
    TransformerBlock,
    from_torch,
    from_torch_encoder_layer,
)
from attnbook.masks import attention_mask, causal_mask, padding_mask

DOUBLE = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _randomise(module, seed=0, std=0.3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, std)
    return module


def _encoder_layer(d, heads, d_ff, activation, norm_first, bias=True, seed=0):
    layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=d_ff, dropout=0.0,
                                       activation=activation, batch_first=True,
                                       norm_first=norm_first, bias=bias, dtype=DOUBLE)
    return _randomise(layer, seed).eval()


# FeedForward ------------------------------------------------------------------------------


@pytest.mark.parametrize(("activation", "fn"), [
    ("relu", F.relu), ("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
@pytest.mark.parametrize("bias", [True, False])
def test_feed_forward_matches_formula(activation, fn, bias):
    ff = _randomise(FeedForward(12, 20, activation=activation, bias=bias)).double()
    x = torch.randn(3, 5, 12, dtype=DOUBLE)
    h = fn(x @ ff.fc1.weight.T + (ff.fc1.bias if bias else 0))
    expected = h @ ff.fc2.weight.T + (ff.fc2.bias if bias else 0)
    torch.testing.assert_close(ff(x), expected)


def test_feed_forward_default_width_and_positionwise():
    ff = FeedForward(8)
    assert ff.fc1.out_features == 32 and ff.fc2.in_features == 32 and ff.fc1.out_features == 32
    x = torch.randn(2, 6, 8)
    per_position = torch.stack([ff(x[:, i : i + 1])[:, 0] for i in range(6)], dim=1)
    torch.testing.assert_close(ff(x), per_position)


def test_feed_forward_dropout_only_in_training():
    ff = FeedForward(8, dropout=0.5)
    x = torch.randn(4, 8)
    torch.testing.assert_close(ff.eval()(x), ff.eval()(x))
    torch.manual_seed(0)
    assert not torch.allclose(ff.train()(x), ff.eval()(x))


# RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_rmsnorm_matches_numpy(seed):
    g = torch.Generator().manual_seed(seed)
    d = int(torch.randint(1, 40, (1,), generator=g))
    norm = RMSNorm(d, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g, dtype=DOUBLE))
    x = 5 * torch.randn(3, 4, d, generator=g, dtype=DOUBLE)
    xn, w = x.numpy(), norm.weight.detach().numpy()
    expected = w * xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(norm(x).detach().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_rmsnorm_matches_torch():
    ours, theirs = RMSNorm(16, eps=1e-5), nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_half_precision(dtype):
    norm = RMSNorm(64)
    x = 300 * torch.randn(4, 64)  # squares overflow float16 if computed there
    out = norm(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), norm(x.to(dtype).float()), atol=2e-2, rtol=2e-2)


def test_rmsnorm_zero_input_is_finite():
    assert torch.equal(RMSNorm(4)(torch.zeros(2, 4)), torch.zeros(2, 4))


# TransformerBlock against PyTorch ---------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_block_matches_torch_encoder_layer(activation, norm_first, bias):
    layer = _encoder_layer(24, 3, 40, activation, norm_first, bias=bias)
    ours = from_torch_encoder_layer(layer)
    x = torch.randn(4, 6, 24, dtype=DOUBLE)
    pad = padding_mask([6, 3, 1, 5])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), layer(x))
        torch.testing.assert_close(ours(x, mask=attention_mask(pad)),
                                   layer(x, src_key_padding_mask=~pad))
        torch.testing.assert_close(ours(x, mask=attention_mask(pad, causal=True)),
                                   layer(x, src_mask=~causal_mask(6), src_key_padding_mask=~pad))
        torch.testing.assert_close(ours(x, is_causal=True), layer(x, src_mask=~causal_mask(6)))


def test_from_torch_encoder_layer_copies_by_hand():
    """Independent of from_torch_encoder_layer: copy the weights by hand and compare."""
    layer = _encoder_layer(16, 4, 32, "gelu", True)
    ours = TransformerBlock(16, 4, 32, norm_first=True).double().eval()
    ours.self_attn.load_state_dict(from_torch(layer.self_attn).state_dict())
    with torch.no_grad():
        ours.ff.fc1.weight.copy_(layer.linear1.weight)
        ours.ff.fc1.bias.copy_(layer.linear1.bias)
        ours.ff.fc2.weight.copy_(layer.linear2.weight)
        ours.ff.fc2.bias.copy_(layer.linear2.bias)
        for mine, theirs in ((ours.attn_norm, layer.norm1), (ours.ff_norm, layer.norm2)):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
    x = torch.randn(2, 5, 16, dtype=DOUBLE)
    converted = from_torch_encoder_layer(layer)
    torch.testing.assert_close(ours(x), converted(x))
    assert converted.training == layer.training and converted.config.norm_first


@pytest.mark.parametrize("norm_first", [False, True])
def test_cross_attention_block_matches_torch_decoder_layer(norm_first):
    dec = _randomise(nn.TransformerDecoderLayer(16, 2, 24, dropout=0.0, activation="relu",
                                                batch_first=True, norm_first=norm_first,
                                                dtype=DOUBLE)).eval()
    ours = TransformerBlock(16, 2, 24, norm_first=norm_first, cross_attention=True,
                            activation="relu").double().eval()
    ours.self_attn.load_state_dict(from_torch(dec.self_attn).state_dict())
    ours.cross_attn.load_state_dict(from_torch(dec.multihead_attn).state_dict())
    for mine, theirs in [(ours.ff.fc1, dec.linear1), (ours.ff.fc2, dec.linear2),
                         (ours.attn_norm, dec.norm1), (ours.cross_norm, dec.norm2),
                         (ours.ff_norm, dec.norm3)]:
        mine.load_state_dict(theirs.state_dict())
    tgt, memory = torch.randn(3, 4, 16, dtype=DOUBLE), torch.randn(3, 6, 16, dtype=DOUBLE)
    mem_pad = padding_mask([6, 2, 4])
    with torch.no_grad():
        expected = dec(tgt, memory, tgt_mask=~causal_mask(4), memory_key_padding_mask=~mem_pad)
        got = ours(tgt, is_causal=True, context=memory, context_mask=mem_pad[:, None, None, :])
    torch.testing.assert_close(got, expected)


# TransformerBlock properties --------------------------------------------------------------


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_block_attributes_and_shapes(norm, norm_first):
    block = TransformerBlock(32, 4, norm=norm, norm_first=norm_first, cross_attention=True,
                             num_kv_heads=2)
    kind = nn.LayerNorm if norm == "layernorm" else RMSNorm
    for sub in (block.attn_norm, block.cross_norm, block.ff_norm):
        assert isinstance(sub, kind)
    assert block.self_attn.num_kv_heads == 2 and block.ff.fc1.out_features == 128
    out, self_w, cross_w = block(torch.randn(2, 5, 32), context=torch.randn(2, 3, 32),
                                 return_weights=True)
    assert out.shape == (2, 5, 32) and self_w.shape == (2, 4, 5, 5)
    assert cross_w.shape == (2, 4, 5, 3)
    assert TransformerBlock(32, 4)(torch.randn(1, 1, 32), return_weights=True)[2] is None


def test_block_pre_norm_formula():
    block = _randomise(TransformerBlock(16, 2, cross_attention=True)).eval()
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    h = x + block.self_attn(block.attn_norm(x))[0]  # the core: (outputs, weights or None)
    h = h + block.cross_attn(block.cross_norm(h), ctx)[0]
    h = h + block.ff(block.ff_norm(h))
    torch.testing.assert_close(block(x, context=ctx), h)


def test_block_post_norm_formula():
    block = _randomise(TransformerBlock(16, 2, norm_first=False, norm="rmsnorm")).eval()
    x = torch.randn(2, 5, 16)
    h = block.attn_norm(x + block.self_attn(x, is_causal=True)[0])
    h = block.ff_norm(h + block.ff(h))
    torch.testing.assert_close(block(x, is_causal=True), h)


@pytest.mark.parametrize("length", [1, 2, 9])
def test_block_is_causal(length):
    block = TransformerBlock(16, 4).eval()
    x = torch.randn(2, length, 16)
    y = x.clone()
    y[:, -1] += 1.0
    torch.testing.assert_close(block(x, is_causal=True)[:, :-1], block(y, is_causal=True)[:, :-1])


def test_block_padding_invariance():
    block = TransformerBlock(16, 4).eval()
    pad = padding_mask([5, 2])
    x = torch.randn(2, 5, 16)
    y = x.clone()
    y[1, 2:] = torch.randn(3, 16)  # change only the padded positions
    mask = attention_mask(pad)
    torch.testing.assert_close(block(x, mask=mask)[pad], block(y, mask=mask)[pad])


def test_fully_masked_rows_give_no_nan():
    block = TransformerBlock(16, 4, cross_attention=True).eval()
    nothing = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    out = block(torch.randn(1, 3, 16), context=torch.randn(1, 4, 16), context_mask=nothing)
    assert torch.isfinite(out).all()


def test_dropout_is_applied_in_training_only():
    block = TransformerBlock(16, 4, dropout=0.3)
    x = torch.randn(2, 5, 16)
    block.eval()
    torch.testing.assert_close(block(x), block(x))
    block.train()
    torch.manual_seed(0)
    assert not torch.allclose(block(x), block.eval()(x))


def test_float16_block_runs():
    block = TransformerBlock(16, 4).half().eval()
    out = block(torch.randn(2, 5, 16).half(), is_causal=True)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


# Bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(d_model=30, num_heads=4), ValueError, "d_model=30"),
    (dict(d_model=32, num_heads=4, activation="swish"), ValueError, "activation='swish'"),
    (dict(d_model=32, num_heads=4, norm="batchnorm"), ValueError, "norm='batchnorm'"),
    (dict(d_model=32, num_heads=4, dropout=-0.1), ValueError, "dropout=-0.1"),
    (dict(d_model=32, num_heads=4, eps=0), ValueError, "eps=0"),
    (dict(d_model=32, num_heads=4, d_ff=0), ValueError, "d_ff=0"),
    (dict(d_model=32, num_heads=4, d_ff=2.5), TypeError, "d_ff=2.5"),
    (dict(d_model=32, num_heads=4, norm_first="yes"), TypeError, "norm_first='yes'"),
    (dict(d_model=32, num_heads=4, cross_attention=1), TypeError, "cross_attention=1"),
    (dict(d_model=32, num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads=3"),
])
def test_block_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        TransformerBlock(**kwargs)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: FeedForward(0), ValueError, "d_model=0"),
    (lambda: FeedForward(8, activation="tanh"), ValueError, "activation='tanh'"),
    (lambda: FeedForward(8, dropout=2), ValueError, "dropout=2"),
    (lambda: RMSNorm(8, eps=-1.0), ValueError, "eps=-1.0"),
    (lambda: RMSNorm(True), TypeError, "d_model=True"),
    (lambda: from_torch_encoder_layer(nn.Linear(2, 2)), TypeError, "Linear"),
    (lambda: from_torch_encoder_layer(nn.TransformerEncoderLayer(8, 2, activation=torch.tanh)),
     ValueError, "batch_first"),
])
def test_other_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_context_only_with_cross_attention():
    x = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="context"):
        TransformerBlock(8, 2)(x, context=x)
    with pytest.raises(ValueError, match="context=None"):
        TransformerBlock(8, 2, cross_attention=True)(x)


def test_bad_mask_is_refused():
    block = TransformerBlock(8, 2)
    with pytest.raises(TypeError, match="mask"):
        block(torch.randn(1, 3, 8), mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match="shape"):
        block(torch.randn(1, 3, 8), mask=torch.ones(4, 4, dtype=torch.bool))


# One way to check arguments, no silent wrong answers --------------------------------


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: TransformerBlock(8, 2, dropout="x"), TypeError, "dropout='x'"),  # as in heads
    (lambda: TransformerBlock(8, 2, eps=float("nan")), ValueError, "eps=nan"),
    (lambda: TransformerBlock(8, 2, eps=True), TypeError, "eps=True"),
    (lambda: TransformerBlock(8, 2, norm="rmsnorm", eps=float("nan")), ValueError, "eps=nan"),
    (lambda: RMSNorm(8, eps=float("nan")), ValueError, "eps=nan"),
    (lambda: RMSNorm(8, eps=True), TypeError, "eps=True"),
    (lambda: TransformerBlock(8, 2, bias="no"), TypeError, "bias='no'"),
    (lambda: FeedForward(8, bias="no"), TypeError, "bias='no'"),
    (lambda: FeedForward(8, dropout="0.1"), TypeError, "dropout='0.1'"),
    (lambda: TransformerBlock(8, 2)(torch.randn(1, 3, 8), return_weights="yes"), TypeError,
     "return_weights='yes'"),
])
def test_settings_are_checked_by_the_conventions(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: TransformerBlock(8, 2)(torch.randn(1, 3, 4)), ValueError, r"x must end in .*size 8"),
    (lambda: TransformerBlock(8, 2)(torch.randn(3, 8)), ValueError, r"x must have 3 dimensions"),
    (lambda: TransformerBlock(8, 2, norm_first=False)(np.zeros((1, 3, 8))), TypeError,
     "x must be a torch.Tensor"),
])
def test_inputs_are_checked(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_context_mask_without_cross_attention_is_refused():
    x, nothing = torch.randn(1, 3, 8), torch.zeros(1, 1, 1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="no cross-attention: context and context_mask"):
        TransformerBlock(8, 2)(x, context_mask=nothing)  # was ignored: this mask forbids all


def test_tanh_gelu_is_copied_as_tanh_gelu():
    layer = _encoder_layer(16, 2, 24, nn.GELU(approximate="tanh"), True)
    ours = from_torch_encoder_layer(layer)
    assert ours.config.activation == "gelu_tanh"
    x = 3 * torch.randn(2, 5, 16, dtype=DOUBLE)
    # With gradients on, PyTorch runs the layer as defined; under no_grad its fused fast path
    # computes exact GELU whatever the module says, so it is not the reference here.
    torch.testing.assert_close(ours(x), layer(x), rtol=1e-12, atol=1e-12)
    exact = from_torch_encoder_layer(_encoder_layer(16, 2, 24, "gelu", True))
    assert (exact(x) - ours(x)).abs().max() > 1e-5  # the two GELUs differ visibly


@pytest.mark.parametrize(("activation", "kind"), [
    ("relu", "relu"), ("gelu", "gelu"), (F.relu, "relu"), (F.gelu, "gelu"), (nn.ReLU(), "relu"),
    (nn.GELU(), "gelu")])
def test_activation_is_read_from_public_attributes(activation, kind):
    import copy

    layer = _encoder_layer(8, 2, 16, activation, False)
    twin = copy.deepcopy(layer)
    del twin.activation_relu_or_gelu  # a private attribute that a PyTorch version may not have
    ours = from_torch_encoder_layer(twin)
    assert ours.config.activation == kind
    x = torch.randn(2, 3, 8, dtype=DOUBLE)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), layer(x))

