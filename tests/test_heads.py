"""attnbook.layers (chapters 3 and 4) against torch.nn.MultiheadAttention and scaled_dot_product_attention."""

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from attnbook.layers import (
    LayerCache,
    MultiHeadAttention,
    attend,
    from_torch,
    head_gate_grad,
    mask_heads,
)
from attnbook.notebook import flop_counter

DOUBLE = torch.float64


def random_torch_mha(d_model, num_heads, bias=True, seed=0):
    torch.manual_seed(seed)
    module = nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True, dtype=DOUBLE)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
    return module.eval()


def copy_by_hand(module):
    """An independent copy of a torch MultiheadAttention's weights (not using from_torch)."""
    bias = module.in_proj_bias is not None
    ours = MultiHeadAttention(module.embed_dim, module.num_heads, bias=bias).to(DOUBLE).eval()
    d = module.embed_dim
    with torch.no_grad():
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.weight.copy_(module.in_proj_weight[i * d:(i + 1) * d])
            if bias:
                proj.bias.copy_(module.in_proj_bias[i * d:(i + 1) * d])
        ours.out_proj.load_state_dict(module.out_proj.state_dict())
    return ours


def random_mask(generator, shape, p=0.6):
    return torch.rand(shape, generator=generator) < p


@pytest.mark.parametrize("seed", range(6))
def test_matches_torch_multihead_attention(seed):
    g = torch.Generator().manual_seed(seed)
    num_heads = [1, 2, 4, 8][seed % 4]
    d_model = num_heads * int(torch.randint(1, 9, (1,), generator=g))
    b, lq, lk = (int(n) for n in torch.randint(1, 7, (3,), generator=g))
    module = random_torch_mha(d_model, num_heads, bias=seed % 3 != 0, seed=seed)
    x = torch.randn(b, lq, d_model, generator=g, dtype=DOUBLE)
    context = torch.randn(b, lk, d_model, generator=g, dtype=DOUBLE)
    mask = random_mask(g, (b, num_heads, lq, lk))
    mask[..., -1] = True  # no fully masked row: PyTorch returns NaN there
    for ours in (copy_by_hand(module), from_torch(module)):
        out_t, w_t = module(x, context, context, attn_mask=~mask.reshape(-1, lq, lk),
                            average_attn_weights=False)
        out, w = ours(x, context, mask=mask, return_weights=True)
        torch.testing.assert_close(out, out_t)
        torch.testing.assert_close(w, w_t)
        out_t, mean_t = module(x, x, x)
        out, w = ours(x, return_weights=True)
        torch.testing.assert_close(out, out_t)
        torch.testing.assert_close(w.mean(1), mean_t)


def test_key_padding_and_causal_masks_match_torch():
    module = random_torch_mha(16, 4)
    ours = from_torch(module)
    x = torch.randn(3, 6, 16, dtype=DOUBLE)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    out_t, _ = module(x, x, x, key_padding_mask=padding)
    torch.testing.assert_close(ours(x, mask=~padding[:, None, None, :]), out_t)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    out_t, _ = module(x, x, x, attn_mask=future)
    torch.testing.assert_close(ours(x, is_causal=True), out_t)
    # mask and is_causal together: both apply
    out_t, _ = module(x, x, x, attn_mask=future | padding[:, None, :].repeat_interleave(4, 0))
    torch.testing.assert_close(ours(x, mask=~padding[:, None, None, :], is_causal=True), out_t)


@pytest.mark.parametrize("seed", range(6))
def test_attend_matches_sdpa(seed):
    g = torch.Generator().manual_seed(100 + seed)
    b, kv_heads, group = (int(n) for n in torch.randint(1, 4, (3,), generator=g))
    lq, lk, d, dv = (int(n) for n in torch.randint(1, 10, (4,), generator=g))
    q = torch.randn(b, kv_heads * group, lq, d, generator=g, dtype=DOUBLE)
    k = torch.randn(b, kv_heads, lk, d, generator=g, dtype=DOUBLE)
    v = torch.randn(b, kv_heads, lk, dv, generator=g, dtype=DOUBLE)
    mask = random_mask(g, (b, 1, lq, lk), p=0.5)
    mask[:, :, 0] = True
    scale = None if seed % 2 else 0.3
    out, w = attend(q, k, v, mask, scale=scale)
    repeated = [t.repeat_interleave(group, dim=1) for t in (k, v)]
    expected = F.scaled_dot_product_attention(q, *repeated, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out, expected)
    assert out.shape == (b, kv_heads * group, lq, dv) and w.shape == (b, kv_heads * group, lq, lk)
    torch.testing.assert_close(w.sum(-1), mask.any(-1).to(DOUBLE).expand(w.shape[:-1]))


@pytest.mark.parametrize("lq,lk", [(1, 1), (4, 4), (3, 7), (1, 5)])
def test_causal_is_bottom_right(lq, lk):
    torch.manual_seed(lq * 10 + lk)
    layer = MultiHeadAttention(8, 2).double()
    x, context = torch.randn(2, lq, 8, dtype=DOUBLE), torch.randn(2, lk, 8, dtype=DOUBLE)
    out, w = layer(x, context, is_causal=True, return_weights=True)
    for i in range(lq):  # query i may see keys up to lk - lq + i, and no further
        assert (w[:, :, i, : lk - lq + i + 1] > 0).all()
        assert (w[:, :, i, lk - lq + i + 1:] == 0).all()
    q = layer.q_proj(x).view(2, lq, 2, 4).transpose(1, 2)
    k, v = (p(context).view(2, lk, 2, 4).transpose(1, 2) for p in (layer.k_proj, layer.v_proj))
    heads = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk))
    torch.testing.assert_close(out, layer.out_proj(heads.transpose(1, 2).reshape(2, lq, 8)))


def test_causal_with_fewer_keys_than_queries_gives_zeros_first():
    layer = MultiHeadAttention(8, 2)
    out, w = layer(torch.randn(1, 5, 8), torch.randn(1, 2, 8), is_causal=True, return_weights=True)
    assert (w[:, :, :3] == 0).all() and (out[:, :3] == 0).all()  # fresh biases are zero
    assert not out.isnan().any()


def test_fully_masked_rows_are_zero_and_have_finite_gradients():
    torch.manual_seed(0)
    layer = MultiHeadAttention(12, 3)
    x = torch.randn(2, 4, 12, requires_grad=True)
    mask = torch.ones(2, 3, 4, 4, dtype=torch.bool)
    mask[0, :, 1] = False  # query 1 of sequence 0 sees nothing in any head
    mask[1, 2, 3] = False  # one head of one query sees nothing
    out, w = layer(x, mask=mask, return_weights=True)
    assert (out[0, 1] == 0).all() and (w[0, :, 1] == 0).all() and (w[1, 2, 3] == 0).all()
    assert not out.isnan().any()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_query_equals_full_attention_on_repeated_heads(num_kv_heads):
    torch.manual_seed(num_kv_heads)
    d, heads = 32, 8
    group, hd = heads // num_kv_heads, d // heads
    gqa = MultiHeadAttention(d, heads, num_kv_heads=num_kv_heads).double()
    assert gqa.k_proj.weight.shape == (num_kv_heads * hd, d) == gqa.v_proj.weight.shape
    full = MultiHeadAttention(d, heads).double()
    with torch.no_grad():
        for parameter in gqa.parameters():
            parameter.normal_(0.0, 0.3)
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for mine, shared in ((full.k_proj, gqa.k_proj), (full.v_proj, gqa.v_proj)):
            mine.weight.copy_(shared.weight.view(num_kv_heads, hd, d)
                              .repeat_interleave(group, 0).reshape(d, d))
            mine.bias.copy_(shared.bias.view(num_kv_heads, hd).repeat_interleave(group, 0).flatten())
    x, context = torch.randn(2, 5, d, dtype=DOUBLE), torch.randn(2, 7, d, dtype=DOUBLE)
    mask = random_mask(torch.Generator().manual_seed(0), (2, heads, 5, 7))
    for args in [dict(is_causal=True), dict(context=context, mask=mask)]:
        out_g, w_g = gqa(x, return_weights=True, **args)
        out_f, w_f = full(x, return_weights=True, **args)
        torch.testing.assert_close(out_g, out_f)
        torch.testing.assert_close(w_g, w_f)


def test_attributes_and_shapes():
    layer = MultiHeadAttention(48, 6, num_kv_heads=2, bias=False)
    assert isinstance(layer, nn.Module)
    assert all(isinstance(getattr(layer, n), nn.Linear)
               for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert type(layer.head_dim) is int and layer.head_dim == 8
    assert layer.q_proj.weight.shape == (48, 48) and layer.k_proj.weight.shape == (16, 48)
    assert layer.q_proj.bias is None and layer.out_proj.bias is None
    x = torch.randn(2, 1, 48)  # length 1
    out = layer(x)
    out2, w = layer(x, return_weights=True)
    assert out.shape == (2, 1, 48) and w.shape == (2, 6, 1, 1)
    torch.testing.assert_close(w, torch.ones(2, 6, 1, 1))
    torch.testing.assert_close(out, out2)


@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 1, 1, 7), (1, 3, 5, 7), (3, 1, 7), (2, 3, 5, 7)])
def test_masks_broadcast(shape):
    torch.manual_seed(1)
    layer = MultiHeadAttention(12, 3)
    mask = torch.rand(shape) < 0.7
    x, context = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    _, w = layer(x, context, mask=mask, return_weights=True)
    assert (w[~mask.expand(2, 3, 5, 7)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_close_to_float32(dtype):
    torch.manual_seed(2)
    layer = MultiHeadAttention(32, 4)
    x = torch.randn(2, 6, 32)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    expected = layer(x, mask=mask, is_causal=True)
    out = copy_layer(layer).to(dtype)(x.to(dtype), mask=mask, is_causal=True)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def copy_layer(layer):
    twin = MultiHeadAttention(layer.d_model, layer.num_heads)
    twin.load_state_dict(layer.state_dict())
    return twin


def test_dropout_only_in_training():
    torch.manual_seed(3)
    layer = MultiHeadAttention(16, 2, dropout=0.5).double()
    x = torch.randn(2, 8, 16, dtype=DOUBLE)
    layer.eval()
    out_eval, w_eval = layer(x, return_weights=True)
    torch.testing.assert_close(layer(x), out_eval)  # SDPA, without the weights
    layer.config = dataclasses.replace(layer.config, backend="explicit")
    torch.testing.assert_close(layer(x), out_eval, rtol=0, atol=0)  # attend, as with them
    layer.train()
    out_train, w_train = layer(x, return_weights=True)
    dropped = w_train == 0
    assert dropped.any() and (~dropped).any()
    torch.testing.assert_close(w_train[~dropped], 2 * w_eval[~dropped])
    assert not torch.allclose(out_train, out_eval)


def test_parameters_and_flops_do_not_depend_on_heads():
    counts, flops = set(), set()
    x = torch.randn(1, 16, 64)
    for heads in (1, 2, 8, 16):
        layer = MultiHeadAttention(64, heads)
        counts.add(sum(p.numel() for p in layer.parameters()))
        with torch.no_grad(), flop_counter() as counter:
            layer(x)
        flops.add(counter.get_total_flops())
    assert counts == {4 * (64 * 64 + 64)}
    assert flops == {4 * 2 * 16 * 64 * 64 + 2 * 2 * 16 * 16 * 64}


def test_from_torch_keeps_dtype_mode_and_refuses_other_layouts():
    module = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.1)
    ours = from_torch(module)
    assert ours.training and ours.dropout == 0.1 and ours.q_proj.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="kdim"):
        from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    with pytest.raises(TypeError, match="module"):
        from_torch(nn.Linear(8, 8))


@pytest.mark.parametrize("args,error,match", [
    ((10, 3), ValueError, r"d_model=10.*num_heads=3"),
    ((16, 8, 3), ValueError, r"num_heads=8.*num_kv_heads=3"),
    ((16, 4, 8), ValueError, r"num_heads=4.*num_kv_heads=8"),
    ((16, 0), ValueError, r"num_heads"),
    ((16, 4, 0), ValueError, r"num_kv_heads"),
    ((0, 4), ValueError, r"d_model"),
    ((16.0, 4), TypeError, r"d_model"),
    ((16, 4, None, True, 1.5), ValueError, r"dropout"),
    ((16, 4, None, True, -0.1), ValueError, r"dropout must be a finite number in \[0.0, 1.0\]"),
    ((16, 4, None, True, True), TypeError, r"dropout=True of type bool"),
    ((16, 4, None, True, "0.1"), TypeError, r"dropout='0.1'"),
])
def test_constructor_rejects_bad_sizes(args, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(*args)


LAYER = MultiHeadAttention(16, 4)
X = torch.randn(2, 5, 16)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=torch.randn(5, 16)), ValueError, r"x must have shape .*\(5, 16\)"),
    (dict(x=torch.randn(2, 5, 8)), ValueError, r"x must have shape \(\*, \*, 16\)"),
    (dict(x=X.numpy()), TypeError, r"x must be a torch.Tensor"),
    (dict(x=X, context=torch.randn(2, 7, 8)), ValueError, r"context .*\(2, 7, 8\)"),
    (dict(x=X, context=torch.randn(3, 7, 16)), ValueError, r"context .*\(2, \*, 16\)"),
    (dict(x=X, context=torch.randn(7, 16)), ValueError, r"context"),
    (dict(x=X, mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, r"mask of shape \(5, 6\)"),
    (dict(x=X, mask=torch.ones(3, 4, 5, 5, dtype=torch.bool)), ValueError, r"mask"),
    (dict(x=X, mask=torch.ones(1, 2, 4, 5, 5, dtype=torch.bool)), ValueError, r"mask"),
    (dict(x=X, mask=torch.ones(5, 5)), TypeError, r"mask .*float32"),
    (dict(x=X, mask=torch.ones(5, 5, dtype=torch.int64)), TypeError, r"mask"),
    (dict(x=X.double()), TypeError, r"x must be a torch.float32 tensor, got dtype torch.float64"),
    (dict(x=X, context=torch.randn(2, 7, 16).half()), TypeError,
     r"context must be a torch.float32 tensor, got dtype torch.float16"),
    (dict(x=X, context=torch.randn(2, 7, 16, device="meta")), ValueError,
     r"context must be on device cpu, got context on meta"),
    (dict(x=X, is_causal="no"), TypeError, r"is_causal must be True or False, got is_causal='no'"),
    (dict(x=X, is_causal=1), TypeError, r"is_causal"),
])
def test_forward_rejects_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        LAYER(**kwargs)


@pytest.mark.parametrize("shapes,error,match", [
    (((2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 7, 8)), ValueError, r"v .*\(2, 4, 7, 8\)"),
    (((2, 4, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8)), ValueError, r"kv_heads"),
    (((2, 4, 5, 8), (2, 4, 6, 4), (2, 4, 6, 8)), ValueError, r"k .*\(2, 4, 6, 4\)"),
    (((4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 8)), ValueError, r"q must have 4 dimensions"),
])
def test_attend_rejects_bad_shapes(shapes, error, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(error, match=match):
        attend(q, k, v)


Q4 = torch.zeros(1, 2, 3, 4)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=Q4.long(), k=Q4.long(), v=Q4.long()), TypeError,
     r"q must be a floating-point tensor, got dtype torch.int64"),
    (dict(q=Q4, k=Q4.double(), v=Q4), TypeError,
     r"k must be a torch.float32 tensor, got dtype torch.float64"),
    (dict(q=Q4, k=Q4, v=Q4.to("meta")), ValueError, r"v must be on device cpu, got v on meta"),
    (dict(q=Q4, k=torch.zeros(1, 2, 0, 4), v=torch.zeros(1, 2, 0, 4)), ValueError,
     r"k.shape\[2\] must be at least 1, got k.shape\[2\]=0"),
    (dict(q=Q4, k=torch.zeros(1, 0, 3, 4), v=torch.zeros(1, 0, 3, 4)), ValueError,
     r"k.shape\[1\] must be at least 1, got k.shape\[1\]=0"),
    (dict(q=torch.zeros(1, 2, 3, 0), k=torch.zeros(1, 2, 3, 0), v=Q4), ValueError,
     r"q.shape\[3\] must be at least 1, got q.shape\[3\]=0"),
    (dict(q=Q4, k=Q4, v=Q4, dropout_p=-0.5), ValueError, r"dropout_p=-0.5"),
    (dict(q=Q4, k=Q4, v=Q4, dropout_p=1.5), ValueError, r"dropout_p=1.5"),
    (dict(q=Q4, k=Q4, v=Q4, dropout_p=float("nan")), ValueError, r"dropout_p=nan"),
    (dict(q=Q4, k=Q4, v=Q4, dropout_p=None), TypeError, r"dropout_p=None"),
    (dict(q=Q4, k=Q4, v=Q4, scale="a"), TypeError, r"scale must be a real number.*'a'"),
    (dict(q=Q4, k=Q4, v=Q4, scale=float("inf")), ValueError, r"scale must be a finite"),
])
def test_attend_rejects_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        attend(**kwargs)


def test_attend_accepts_numpy_and_int_scales():
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 1, 2, 4, 8, generator=gen, dtype=DOUBLE)
    for scale in (np.float32(0.5), 2, np.float64(0.25)):
        torch.testing.assert_close(attend(q, k, v, scale=scale)[0],
                                   F.scaled_dot_product_attention(q, k, v, scale=float(scale)))


def large_half(gen, shape_q, shape_k, dv):
    """float16 q = 100 everywhere and k = +-100 with key 0 all +100: q.k up to 640,000."""
    q = torch.full(shape_q, 100.0, dtype=torch.float16)
    k = (torch.randint(0, 2, shape_k, generator=gen) * 200 - 100).half()
    k[..., 0, :] = 100.0
    v = torch.randn(*shape_k[:-1], dv, generator=gen).half()
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_attend_large_low_precision_inputs_do_not_overflow(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (t.to(dtype) for t in large_half(gen, (2, 4, 5, 64), (2, 2, 7, 64), 8))
    mask = torch.rand(5, 7, generator=gen) < 0.6
    mask[:, 0] = True
    out, weights = attend(q, k, v, mask)
    assert out.dtype == weights.dtype == dtype and out.isfinite().all()
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                              attn_mask=mask, enable_gqa=True)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_module_large_float16_inputs_do_not_overflow():
    # identity projections: the module's attention sees x itself, exactly representable
    gen = torch.Generator().manual_seed(7)
    q, k, v = large_half(gen, (1, 6, 128), (1, 9, 128), 128)
    layer = MultiHeadAttention(128, 2, bias=False).half()
    with torch.no_grad():
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
            proj.weight.copy_(torch.eye(128))
    out = layer(q, k)
    assert out.dtype == torch.float16 and out.isfinite().all()
    heads = [t.view(1, -1, 2, 64).transpose(1, 2).double() for t in (q, k)]
    expected = F.scaled_dot_product_attention(heads[0], heads[1], heads[1])
    torch.testing.assert_close(out.double(), expected.transpose(1, 2).reshape(1, 6, 128),
                               rtol=2e-3, atol=2e-3)


# The KV cache (chapter 4, "Keeping keys and values for generation") ------------------------


def _storage(layer, batch, capacity, dtype=DOUBLE):
    """Keys and values as views of one (2, B, nkv, capacity, hs) tensor, as chapter 10 keeps them."""
    return torch.zeros(2, batch, layer.num_kv_heads, capacity, layer.head_dim, dtype=dtype)


@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 2, 1], [7], [2, 5]])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@torch.no_grad()
def test_cached_chunks_equal_one_causal_call(chunks, num_kv_heads):
    torch.manual_seed(num_kv_heads)
    layer = MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads).double().eval()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.3)
    x = torch.randn(2, sum(chunks), 32, dtype=DOUBLE)
    full, full_w = layer(x, is_causal=True, return_weights=True)
    cache = LayerCache(*_storage(layer, 2, 9))
    start = 0
    for n in chunks:
        out, w = layer(x[:, start:start + n], is_causal=True, return_weights=True, cache=cache)
        torch.testing.assert_close(out, full[:, start:start + n])
        torch.testing.assert_close(w, full_w[:, :, start:start + n, :start + n])
        start += n
        assert cache.length == start and cache.capacity == 9
    cache.reset()
    assert cache.length == 0
    torch.testing.assert_close(layer(x[:, :2], is_causal=True, cache=cache), full[:, :2])


@torch.no_grad()
def test_cache_with_a_mask_and_views_of_a_larger_tensor():
    torch.manual_seed(1)
    layer = MultiHeadAttention(16, 2).double()
    x = torch.randn(1, 5, 16, dtype=DOUBLE)
    keep = torch.tensor([True, False, True, True, True])  # key 1 is padding
    full = layer(x, mask=keep, is_causal=True)
    storage = torch.zeros(3, 2, 1, 2, 8, 8, dtype=DOUBLE)  # (layers, k/v, B, nkv, capacity, hs)
    cache = LayerCache(storage[1, 0], storage[1, 1])
    first = layer(x[:, :3], mask=keep[:3], is_causal=True, cache=cache)
    second = layer(x[:, 3:], mask=keep, is_causal=True, cache=cache)
    torch.testing.assert_close(torch.cat([first, second], 1), full)
    assert storage[1, :, :, :, :5].abs().sum() > 0 and storage[[0, 2]].abs().sum() == 0


@torch.no_grad()
def test_block_passes_the_cache_to_its_self_attention():
    from attnbook.layers import TransformerBlock

    torch.manual_seed(2)
    block = TransformerBlock(16, 4, num_kv_heads=2).double().eval()
    x = torch.randn(2, 6, 16, dtype=DOUBLE)
    cache = LayerCache(*_storage(block.self_attn, 2, 6))
    pieces = [block(x[:, s:e], is_causal=True, cache=cache) for s, e in ((0, 4), (4, 5), (5, 6))]
    torch.testing.assert_close(torch.cat(pieces, 1), block(x, is_causal=True))


def _chapter_3_alone() -> tuple[str, dict]:
    """Chapter 3's exported cells, and the names they define run on their own (no chapter 4 cell
    ran)."""
    import sys
    from pathlib import Path

    import jupytext

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    try:
        import tangle
    finally:
        sys.path.remove(str(root / "tools"))
    path = root / "chapters" / "03-heads.md"
    cells = tangle.Chapter(path, jupytext.read(path, fmt="md:myst")).export_cells()
    assert {cell.module for cell in cells} == {"layers"}
    source, namespace = "\n\n".join(cell.source for cell in cells), {"__name__": "chapter_3_alone"}
    exec(compile(source, "<chapter 3, exported>", "exec"), namespace)
    return source, namespace


@torch.no_grad()
def test_chapter_3_code_stands_alone_and_takes_chapter_4s_cache():
    """Report 1 item 24: chapter 3's layer names nothing that only chapter 4 defines, yet a
    LayerCache works with it (checked and used) as with the package's layer."""
    source, chapter_3 = _chapter_3_alone()
    assert "F821" not in source and "LayerCache" not in chapter_3  # no undefined name, none hidden
    torch.manual_seed(4)
    package_layer = MultiHeadAttention(16, 4, num_kv_heads=2).double().eval()
    alone = chapter_3["MultiHeadAttention"](16, 4, num_kv_heads=2).double().eval()
    alone.load_state_dict(package_layer.state_dict())
    x = torch.randn(2, 5, 16, dtype=DOUBLE)
    cache = LayerCache(*_storage(alone, 2, 5))
    pieces = [alone(x[:, s:e], is_causal=True, cache=cache) for s, e in ((0, 3), (3, 5))]
    torch.testing.assert_close(torch.cat(pieces, 1), package_layer(x, is_causal=True))
    with pytest.raises(ValueError, match="does not fit: the cache holds 5 positions"):
        alone(x[:, :1], cache=cache)  # the cache's own check, called by chapter 3's
    with pytest.raises(TypeError, match="cache must be a LayerCache, got cache='no'"):
        alone(x, cache="no")


CACHE_LAYER = MultiHeadAttention(16, 4, num_kv_heads=2)


@pytest.mark.parametrize("k,v,error,match", [
    (torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4), ValueError,
     r"k of 3 positions does not fit: the cache holds 4 positions of its capacity 6"),
    (torch.zeros(1, 2, 1, 4), torch.zeros(2, 2, 1, 4), ValueError, r"k must have shape .*\(1, 2, 1, 4\)"),
    (torch.zeros(2, 4, 1, 4), torch.zeros(2, 2, 1, 4), ValueError, r"k must have shape"),
    (torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 4), ValueError, r"k must have shape"),
    (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 2, 4), ValueError, r"v must have shape .*\(2, 2, 1, 4\)"),
    (torch.zeros(2, 2, 1, 4).double(), torch.zeros(2, 2, 1, 4), TypeError, r"k must be a torch.float32 tensor, got dtype torch.float64"),
    (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4, device="meta"), ValueError, r"v must .*meta"),
    (torch.zeros(2, 2, 4), torch.zeros(2, 2, 1, 4), ValueError, r"k must have 4 dimensions"),
    ([0.0], torch.zeros(2, 2, 1, 4), TypeError, r"k must be a torch.Tensor"),
])
def test_cache_refuses_chunks_that_do_not_fit(k, v, error, match):
    cache = LayerCache(torch.zeros(2, 2, 6, 4), torch.zeros(2, 2, 6, 4))
    cache.append(torch.ones(2, 2, 4, 4), torch.ones(2, 2, 4, 4))
    with pytest.raises(error, match=match):
        cache.append(k, v)
    assert cache.length == 4  # a refused chunk leaves the cache as it was


@pytest.mark.parametrize("which", ["keys", "values"])
def test_cache_refuses_storage_that_requires_grad_by_name(which):
    # before, the cache was made, and its first append outside torch.no_grad() raised
    # "a leaf Variable that requires grad is being used in an in-place operation"
    storage = {"keys": torch.zeros(2, 2, 6, 4), "values": torch.zeros(2, 2, 6, 4)}
    storage[which].requires_grad_()
    with pytest.raises(ValueError, match=f"^{which} requires grad, but a LayerCache keeps no "
                                         "autograd history"):
        LayerCache(storage["keys"], storage["values"])
    cache = LayerCache(*(t.detach() for t in storage.values()))  # as the message advises
    keys, _ = cache.append(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert torch.equal(keys, torch.ones(2, 2, 1, 4))


def test_cache_arguments_are_checked():
    with pytest.raises(TypeError, match="keys must be a floating-point tensor"):
        LayerCache(torch.zeros(2, 2, 6, 4, dtype=torch.long), torch.zeros(2, 2, 6, 4))
    for values, error in [(torch.zeros(2, 2, 5, 4), ValueError),  # another capacity
                          (torch.zeros(1, 2, 6, 4), ValueError),  # another batch
                          (torch.zeros(2, 1, 6, 4), ValueError),  # other heads
                          (torch.zeros(2, 2, 6, 4).double(), TypeError)]:  # another dtype
        with pytest.raises(error, match="values must"):
            LayerCache(torch.zeros(2, 2, 6, 4), values)
    cache = LayerCache(torch.zeros(2, 2, 6, 4), torch.zeros(2, 2, 6, 3))  # d_v may differ from d_k
    keys, values = cache.append(torch.ones(2, 2, 6, 4), torch.ones(2, 2, 6, 3))
    assert keys.shape == (2, 2, 6, 4) and values.shape == (2, 2, 6, 3)
    x = torch.randn(2, 3, 16)
    cache = LayerCache(*_storage(CACHE_LAYER, 2, 4, torch.float32))
    with pytest.raises(ValueError, match="context or a cache, not both"):
        CACHE_LAYER(x, x, cache=cache)
    with pytest.raises(ValueError, match="k and v require grad.*torch.no_grad"):
        CACHE_LAYER(x, cache=cache)
    assert cache.length == 0
    with torch.no_grad():
        CACHE_LAYER(x, cache=cache)
        with pytest.raises(ValueError, match=r"mask of shape \(1, 3\)"):  # the keys are 0..3
            CACHE_LAYER(x[:, :1], mask=torch.ones(1, 3, dtype=torch.bool), cache=cache)
        with pytest.raises(ValueError, match="does not fit: the cache holds 3 positions of its "
                           "capacity 4"):
            CACHE_LAYER(x, cache=cache)
        assert cache.length == 3
        CACHE_LAYER(x[:, :1], mask=torch.ones(1, 4, dtype=torch.bool), cache=cache)
        assert cache.length == 4


# One way to check arguments, no silent wrong answers --------------------------------


def _private_imports(module) -> list[str]:
    """Names starting with _ that `module` imports from another attnbook module."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(module.__file__).read_text())
    return [f"{node.module}.{alias.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnbook")
            for alias in node.names if alias.name.startswith("_")]


@pytest.mark.parametrize("name", ["layers", "masks"])
def test_chapters_3_5_6_import_no_private_names(name):
    import importlib

    # the Triton backend calls the kernel's core, on arguments the layer has checked
    allowed = {"attnbook.kernels._flash_attention"}
    assert set(_private_imports(importlib.import_module(f"attnbook.{name}"))) <= allowed


@pytest.mark.parametrize("mask", [torch.zeros(5, 5), torch.zeros(5, 5, dtype=torch.float16),
                                  torch.full((5, 5), float("-inf"))])
def test_float_masks_are_refused_not_read_as_true_or_false(mask):
    # A float mask is PyTorch's additive mask: all zeros allows everything. Read as booleans it
    # would forbid everything, so it is refused, with the reason.
    with pytest.raises(TypeError, match=r"mask must be a torch.bool tensor.*float mask.*adds"):
        LAYER(X, mask=mask)
    with pytest.raises(TypeError, match=r"mask must be a torch.bool tensor.*float mask"):
        attend(Q4, Q4, Q4, mask=mask[:3, :3])


@pytest.mark.parametrize("make,error,match", [
    (lambda: MultiHeadAttention(16, 4, bias="no"), TypeError, "bias must be True or False"),
    (lambda: MultiHeadAttention(16, 4, bias=1), TypeError, "bias=1"),
    (lambda: MultiHeadAttention(16, 4, dropout=float("nan")), ValueError, "dropout=nan"),
    (lambda: LAYER(X, return_weights="yes"), TypeError, "return_weights='yes'"),
    (lambda: LAYER(X, return_weights=None), TypeError, "return_weights=None"),
])
def test_settings_of_the_wrong_type_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_from_torch_reads_no_private_attribute():
    import copy

    module = random_torch_mha(16, 4)
    twin = copy.deepcopy(module)
    del twin._qkv_same_embed_dim  # a private attribute that a PyTorch version may not have
    x = torch.randn(2, 5, 16, dtype=DOUBLE)
    torch.testing.assert_close(from_torch(twin)(x), module(x, x, x)[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_queries_and_keys_are_not_hidden(bad):
    gen = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(3, 1, 2, 4, 8, generator=gen).unbind(0)
    q[0, 1, 2, 3], k[0, 0, 1, 0] = bad, bad  # query 2 of head 1; key 1 of head 0
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    out, w = attend(q, k, v, mask)
    scores = (q.double() @ k.double().transpose(-2, -1) / 8**0.5).masked_fill(~mask, -torch.inf)
    reference = scores.softmax(-1)  # the formula, with -inf where the mask forbids
    assert torch.equal(w.isnan(), reference.isnan()) and w.isnan().any()
    assert torch.equal(out.isnan(), (reference @ v.double()).isnan())
    if bad != bad:  # NaN: wherever it was read, and only there
        assert w[0, 0, 1:].isnan().all() and w[0, 1, 2].isnan().all()
        assert w[0, 0, 0].isfinite().all() and w[0, 1, [0, 1, 3]].isfinite().all()


def test_runs_on_a_device_without_autocast():
    # The meta device (shapes only, no data) has no autocast: asking whether it is on must not fail.
    mha = MultiHeadAttention(16, 4).to("meta")
    x = torch.empty(2, 5, 16, device="meta")
    assert mha(x, is_causal=True).shape == (2, 5, 16)


@pytest.mark.parametrize("layer_dtype,x_dtype", [(torch.float32, DOUBLE), (DOUBLE, torch.float32),
                                                 (DOUBLE, torch.bfloat16)])
@pytest.mark.parametrize("argument", ["x", "context"])
@torch.no_grad()
def test_float64_is_refused_by_name_under_autocast_unless_everything_is_float64(
        layer_dtype, x_dtype, argument):
    # Autocast casts float16/bfloat16/float32 inputs but leaves float64 ones (and float64 weights):
    # nn.Linear, like nn.MultiheadAttention, then fails with "mat1 and mat2 must have the same dtype".
    layer = MultiHeadAttention(16, 2).to(layer_dtype)
    good, bad = torch.randn(1, 3, 16, dtype=layer_dtype), torch.randn(1, 3, 16, dtype=x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_mha = nn.MultiheadAttention(16, 2, batch_first=True, dtype=layer_dtype)
        with pytest.raises(RuntimeError, match="same dtype"):  # PyTorch's own layer: a raw error
            torch_mha(bad, bad, bad) if argument == "x" else torch_mha(good, bad, bad)
        refusal = (r"of a dtype torch.autocast casts \(not float64" if x_dtype == DOUBLE
                   else "a ")  # float64 input: autocast leaves it; else: not the layer's float64
        with pytest.raises(TypeError, match=rf"^{argument} must be {refusal}.*got dtype {x_dtype}$"):
            layer(bad) if argument == "x" else layer(good, bad)
        if layer_dtype == DOUBLE:  # all float64: autocast stays out, and the layer computes
            assert layer(good, good).dtype == DOUBLE
        else:  # float16, bfloat16, float32: autocast casts them all
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                assert layer(torch.randn(1, 3, 16, dtype=dtype)).dtype == torch.bfloat16


def gated_output(layer, x, gate, mask=None):
    """The layer's output with head h's output times gate[h], written with PyTorch's attention
    and key/value heads repeated for their groups (an independent reference)."""
    b, length, _ = x.shape
    q, k, v = (p(x).unflatten(-1, (-1, layer.head_dim)).transpose(1, 2)
               for p in (layer.q_proj, layer.k_proj, layer.v_proj))  # (B, heads, L, hs)
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    heads_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * gate[:, None, None]
    return layer.out_proj(heads_out.transpose(1, 2).reshape(b, length, -1))


@pytest.mark.parametrize("seed", range(4))
def test_head_gate_grad_is_the_gradient_of_a_gate(seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads = [(4, 4), (6, 2), (8, 1), (1, 1)][seed]
    layer = MultiHeadAttention(heads * 3, heads, num_kv_heads=kv_heads, bias=seed != 2).double()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.5, generator=g)
    length = [1, 5, 7, 3][seed]
    x = torch.randn(2, length, heads * 3, generator=g, dtype=DOUBLE)
    target = torch.randn(2, length, heads * 3, generator=g, dtype=DOUBLE)
    mask = random_mask(g, (2, 1, length, length))
    mask[..., 0] = True
    gate = torch.ones(heads, dtype=DOUBLE, requires_grad=True)
    ((gated_output(layer, x, gate, mask) - target) ** 2).sum().backward()
    layer.zero_grad()
    ((layer(x, mask=mask) - target) ** 2).sum().backward()
    torch.testing.assert_close(head_gate_grad(layer), gate.grad)
    assert head_gate_grad(layer).shape == (heads,) and not head_gate_grad(layer).requires_grad


def test_head_gate_grad_propagates_nan():
    layer = MultiHeadAttention(8, 2).double()
    layer(torch.randn(1, 3, 8, dtype=DOUBLE)).sum().backward()
    layer.out_proj.weight.grad[0, 5] = float("nan")  # in head 1's block of columns
    grad = head_gate_grad(layer)
    assert grad[1].isnan() and grad[0].isfinite()


@pytest.mark.parametrize("off", [[], [0], [1, 3], [0, 1, 2, 3]])
def test_mask_heads_equals_a_gate_of_zero(off):
    g = torch.Generator().manual_seed(len(off))
    layer = MultiHeadAttention(16, 4, num_kv_heads=2).double()
    x = torch.randn(3, 6, 16, generator=g, dtype=DOUBLE)
    gate = torch.tensor([0.0 if h in off else 1.0 for h in range(4)], dtype=DOUBLE)
    with torch.no_grad():
        expected = gated_output(layer, x, gate)
        assert mask_heads(layer, off) is layer
        torch.testing.assert_close(layer(x), expected)
    if len(off) == 4:  # nothing reaches the output but out_proj's bias
        torch.testing.assert_close(layer(x), layer.out_proj.bias.expand(3, 6, 16))


def test_mask_heads_keeps_float16_and_the_other_heads():
    layer = MultiHeadAttention(16, 4).half()
    before = layer.out_proj.weight.detach().clone()
    mask_heads(layer, [2])
    weight = layer.out_proj.weight
    assert weight.dtype == torch.float16 and (weight[:, 8:12] == 0).all()
    assert torch.equal(weight[:, :8], before[:, :8]) and torch.equal(weight[:, 12:], before[:, 12:])


def test_head_helpers_refuse_bad_input():
    layer = MultiHeadAttention(16, 4)
    with pytest.raises(TypeError, match="attn"):
        head_gate_grad(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="grad"):
        head_gate_grad(layer)
    with pytest.raises(TypeError, match="attn"):
        mask_heads(nn.MultiheadAttention(16, 4), [0])
    with pytest.raises(ValueError, match="heads"):
        mask_heads(layer, [4])
    with pytest.raises(ValueError, match="heads"):
        mask_heads(layer, [-1])
    with pytest.raises(TypeError, match="heads"):
        mask_heads(layer, [1.0])
    for one in (1, torch.tensor(1), "1"):  # one index, not a sequence of them
        with pytest.raises(TypeError, match="heads must be a sequence of head indices"):
            mask_heads(layer, one)
    before = layer.out_proj.weight.detach().clone()
    mask_heads(layer, torch.tensor([1, 3]))  # a 1-d tensor of indices is a sequence
    assert (layer.out_proj.weight[:, 4:8] == 0).all() and (layer.out_proj.weight[:, 12:] == 0).all()
    assert torch.equal(layer.out_proj.weight[:, :4], before[:, :4])


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_of_a_sequence_first_layer_gives_its_output_on_the_same_tensor(bias):
    """nn.MultiheadAttention(batch_first=False) reads (L, B, d_model); so does its copy."""
    g = torch.Generator().manual_seed(3)
    module = nn.MultiheadAttention(16, 4, bias=bias, dtype=DOUBLE)  # batch_first=False
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3, generator=g)
    module.eval()
    x = torch.randn(5, 3, 16, generator=g, dtype=DOUBLE)  # (L, B, d_model)
    context = torch.randn(7, 3, 16, generator=g, dtype=DOUBLE)
    mask = torch.rand(3, 4, 5, 7, generator=g) < 0.6
    mask[..., 0] = True
    ours = from_torch(module)
    assert isinstance(ours, MultiHeadAttention)
    out_t, w_t = module(x, context, context, attn_mask=~mask.reshape(12, 5, 7),
                        average_attn_weights=False)
    out, w = ours(x, context, mask=mask, return_weights=True)
    assert out.shape == (5, 3, 16)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(w, w_t)
    torch.testing.assert_close(ours(x), module(x, x, x)[0])
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    torch.testing.assert_close(ours(x, is_causal=True), module(x, x, x, attn_mask=causal)[0])
    with pytest.raises(ValueError, match=r"^x must have shape \(L, B, 16\), or \(L, 16\) "
                                         r"unbatched, got shape \(3, 5, 8\)$"):
        ours(x[..., :8].transpose(0, 1))  # the shape as given, not as the layer transposed it


@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_copy_takes_unbatched_input_as_the_module_does(batch_first):
    # nn.MultiheadAttention takes (L, d_model) in either layout; the sequence-first copy refused
    # it ("x must have shape (*, *, 16), got shape (5, 16)", the batch-first layout's words)
    g = torch.Generator().manual_seed(4)
    module = nn.MultiheadAttention(16, 4, dtype=DOUBLE, batch_first=batch_first)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3, generator=g)
    module.eval()
    x, context = (torch.randn(n, 16, generator=g, dtype=DOUBLE) for n in (5, 7))
    mask = torch.rand(5, 7, generator=g) < 0.6
    mask[:, 0] = True
    ours = from_torch(module)
    out_t, w_t = module(x, context, context, attn_mask=~mask, average_attn_weights=False)
    if batch_first:  # the book's layer is batched: a batch of one
        out, w = ours(x[None], context[None], mask=mask, return_weights=True)
        out, w = out[0], w[0]
    else:
        out, w = ours(x, context, mask=mask, return_weights=True)
    assert out.shape == (5, 16) and w.shape == (4, 5, 7)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(w, w_t)
    if not batch_first:
        torch.testing.assert_close(ours(x), module(x, x, x)[0])
        with pytest.raises(ValueError, match=r"^context must have shape \(L, B, 16\)"):
            ours(x, context[:, :8])


# What one backend accepts, every backend accepts, with the explicit backend's answer --


BACKENDS = ["explicit", "sdpa", "triton"]


def _backend_layer(backend, d_model=32, heads=2, dtype=torch.float32):
    if backend == "triton":
        pytest.importorskip("triton", reason="Triton (the triton extra) has wheels for Linux only")
    torch.manual_seed(0)
    return MultiHeadAttention(d_model, heads, backend=backend).to(dtype).eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer_dtype,cache_dtype", [(DOUBLE, torch.float32),
                                                     (torch.float32, DOUBLE),
                                                     (torch.float32, torch.float16)])
@torch.no_grad()
def test_a_cache_of_another_dtype_is_refused_on_every_backend(backend, layer_dtype, cache_dtype):
    layer = _backend_layer(backend, dtype=layer_dtype)
    cache = LayerCache(*torch.zeros(2, 1, 2, 8, 16, dtype=cache_dtype))
    with pytest.raises(ValueError, match=rf"cache holds {cache_dtype}.* {layer_dtype}"):
        layer(torch.randn(1, 3, 32, dtype=layer_dtype), is_causal=True, cache=cache)
    assert cache.length == 0 and not cache.keys.any()  # refused before any work


@torch.no_grad()
def test_a_cache_in_autocasts_dtype_is_accepted_under_autocast():
    layer = _backend_layer("sdpa")
    x = torch.randn(1, 3, 32)
    cache = LayerCache(*torch.zeros(2, 1, 2, 8, 16, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="cache holds torch.float32, but the layer's keys and "
                                             "values are torch.bfloat16: allocate the cache in "
                                             "torch.bfloat16$"):  # not "the layer's": float32
            layer(x, cache=LayerCache(*torch.zeros(2, 1, 2, 8, 16)))
    torch.testing.assert_close(out.float(), layer(x, is_causal=True), atol=0.05, rtol=0.05)


MASKS = {"0-d True": torch.tensor(True), "0-d False": torch.tensor(False),
         "(Lk,)": torch.tensor([True, False, True, True, False, True]),
         "(Lk,) none": torch.zeros(6, dtype=torch.bool), "(1,)": torch.tensor([False]),
         "(Lq, 1)": torch.tensor([[True], [False], [True], [True]]),
         "(B, 1, Lq, Lk)": torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(1)) < 0.5}


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("name", MASKS)
def test_every_backend_takes_every_mask_check_mask_takes(backend, is_causal, name):
    x, context = torch.randn(2, 4, 32), torch.randn(2, 6, 32)
    layer, reference = _backend_layer(backend), _backend_layer("explicit")
    out = layer(x, context, mask=MASKS[name], is_causal=is_causal)
    torch.testing.assert_close(out, reference(x, context, mask=MASKS[name], is_causal=is_causal))


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("x_shape,context_shape", [((0, 4, 32), None), ((1, 0, 32), None),
                                                   ((1, 4, 32), (1, 0, 32)),
                                                   ((0, 4, 32), (0, 6, 32))])
def test_empty_inputs_give_the_explicit_backends_result(backend, x_shape, context_shape):
    x = torch.randn(x_shape)
    context = None if context_shape is None else torch.randn(context_shape)
    out = _backend_layer(backend)(x, context)
    torch.testing.assert_close(out, _backend_layer("explicit")(x, context))
    assert out.shape == x.shape


@pytest.mark.parametrize("d_model,heads,dtype", [(32, 2, DOUBLE), (16, 2, torch.float32),
                                                 (96, 2, torch.float32)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_the_triton_backend_takes_what_its_kernel_does_not(d_model, heads, dtype, is_causal):
    # float64, and head sizes 8 and 48, which the kernel refuses: the backend hands them to SDPA
    x = torch.randn(2, 5, d_model, dtype=dtype)
    out = _backend_layer("triton", d_model, heads, dtype)(x, is_causal=is_causal)
    expected = _backend_layer("explicit", d_model, heads, dtype)(x, is_causal=is_causal)
    torch.testing.assert_close(out, expected)


@torch.no_grad()
def test_a_cache_refuses_storage_that_append_cannot_write_apart():
    """Keys and values in one tensor made every value overwrite its
    key silently; an expanded (stride 0) storage failed inside torch at the first append."""
    storage = torch.zeros(2, 2, 8, 4)
    with pytest.raises(ValueError, match="keys and values are the same memory"):
        LayerCache(storage, storage)
    with pytest.raises(ValueError, match=r"keys has stride 0 \(an expanded tensor"):
        LayerCache(torch.zeros(1, 2, 8, 4).expand(2, -1, -1, -1), storage)
    with pytest.raises(ValueError, match="values has stride 0"):
        LayerCache(storage, torch.zeros(2, 2, 8, 1).expand(-1, -1, -1, 4))
    both = torch.zeros(2, 2, 2, 8, 4)  # one tensor, two halves: apart, as chapter 4 does
    cache = LayerCache(*both)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    keys, values = cache.append(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)
    LayerCache(torch.zeros(1, 2, 8, 4).expand(1, -1, -1, -1), storage[:1])  # size 1: no sharing


@pytest.mark.parametrize("heads", [np.int64(1), np.array(1), torch.tensor(1), None, 1.0,
                                   torch.zeros(1, 2, dtype=torch.long), "01", b"\x01"])
def test_mask_heads_names_heads_that_are_not_a_sequence(heads):
    layer = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="heads must be a sequence of head indices, got heads="):
        mask_heads(layer, heads)
    assert layer.out_proj.weight.ne(0).all()  # nothing silenced


def test_a_row_of_minus_infinity_scores_from_the_data_gives_nan_in_attend_and_zeros_in_sdpa():
    """Appendix H: the explicit backend forbids a key through the mask only, so a row whose
    scores are all -inf because of the data gives NaN; PyTorch's SDPA (2.13) gives zeros."""
    q = torch.tensor([[[[-float("inf"), 0.0]]]])  # every score -inf: the data, not a mask
    k, v = torch.tensor([[[[1.0, 0.0], [2.0, 0.0]]]]), torch.ones(1, 1, 2, 3)
    assert (F.scaled_dot_product_attention(q, k, v) == 0).all()
    assert attend(q, k, v)[0].isnan().all()


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("masked", [False, True])
def test_a_query_that_is_not_finite_gives_nan_on_every_backend(backend, bad, masked):
    """Cross-attention, so that the bad value reaches the queries only: SDPA's CPU kernel alone
    would give that row zeros. A row the mask leaves with no key still gives zeros."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 2, backend=backend).eval()
    x, context = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    x[0, 1] = bad
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2] = False  # query 2 sees nothing
    out = layer(x, context, mask=mask if masked else None)
    assert out[0, 1].isnan().all()  # the bad query's row
    assert out[1].isfinite().all() and out[0, 0].isfinite().all()
    if masked:
        torch.testing.assert_close(out[:, 2], layer.out_proj.bias.expand(2, 32))  # zeros, projected


@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_copy_takes_unbatched_input_in_either_layout(batch_first):
    # the batch-first copy refused (L, d_model), which nn.MultiheadAttention(batch_first=True) takes
    g = torch.Generator().manual_seed(5)
    module = nn.MultiheadAttention(8, 2, dtype=DOUBLE, batch_first=batch_first).eval()
    x, context = (torch.randn(n, 8, generator=g, dtype=DOUBLE) for n in (5, 3))
    out_t, w_t = module(x, context, context, average_attn_weights=False)
    out, w = from_torch(module)(x, context, return_weights=True)
    assert out.shape == (5, 8) and w.shape == (2, 5, 3)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(w, w_t)


@pytest.mark.parametrize("batch_first,x_shape,context_shape,wanted", [
    (False, (5, 8), (3, 1, 8), "(S, 8)"),  # mixed ranks: was "(1, *, 8), got shape (1, 3, 8)"
    (False, (5, 1, 8), (3, 8), "(S, 1, 8)"),
    (False, (5, 2, 8), (3, 4, 8), "(S, 2, 8)"),  # was "(2, *, 8), got shape (4, 3, 8)"
    (True, (2, 5, 8), (4, 3, 8), "(2, S, 8)"),
    (True, (5, 8), (1, 3, 8), "(S, 8)"),
])
def test_from_torch_copy_names_the_context_shape_in_the_callers_layout(
        batch_first, x_shape, context_shape, wanted):
    ours = from_torch(nn.MultiheadAttention(8, 2, batch_first=batch_first))
    message = (f"^context must have shape {re.escape(wanted)}, as x of shape "
               f"{re.escape(str(x_shape))} asks, got shape {re.escape(str(context_shape))}$")
    with pytest.raises(ValueError, match=message):
        ours(torch.randn(x_shape), torch.randn(context_shape))
