"""Tests of attnbook.masks (chapter 6) against independent references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.attention import scaled_dot_product_attention
from attnbook.masks import attention_mask, causal_mask, padding_mask

SIZES = [(q, k) for q in range(1, 9) for k in range(1, 9)] + [(1, 64), (64, 1), (33, 40)]


def _tril_reference(q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)


def _padding_loops(lengths, max_len, side="right"):
    rows = [[(j < n) if side == "right" else (j >= max_len - n) for j in range(max_len)]
            for n in lengths]
    return torch.tensor(rows, dtype=torch.bool).reshape(len(lengths), max_len)


# causal_mask ------------------------------------------------------------------------------


@pytest.mark.parametrize(("q_len", "k_len"), SIZES)
def test_causal_mask_equals_shifted_tril(q_len, k_len):
    mask = causal_mask(q_len, k_len)
    assert mask.dtype == torch.bool and mask.shape == (q_len, k_len)
    assert torch.equal(mask, _tril_reference(q_len, k_len))


@pytest.mark.parametrize("length", [1, 2, 7, 50])
def test_causal_mask_square_default(length):
    assert torch.equal(causal_mask(length), causal_mask(length, length))
    additive = torch.nn.Transformer.generate_square_subsequent_mask(length)
    assert torch.equal(causal_mask(length), additive == 0)


@pytest.mark.parametrize(("q_len", "k_len"), [(1, 1), (1, 9), (3, 5), (6, 6), (2, 11)])
def test_causal_mask_matches_torch_causal_lower_right(q_len, k_len):
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(q_len * 100 + k_len)
    q = torch.randn(2, q_len, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, k_len, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, k_len, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_len, k_len)),
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len)))


def test_causal_mask_differs_from_is_causal_when_rectangular():
    top_left = torch.ones(3, 5, dtype=torch.bool).tril()
    assert not torch.equal(causal_mask(3, 5), top_left)
    assert causal_mask(1, 5).all()  # one new token sees every cached key


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_new", [1, 2, 5])
def test_kv_cache_rows_equal_full_causal_attention(seed, n_new):
    g = torch.Generator().manual_seed(seed)
    T = 9
    Q, K, V = torch.randn(3, 2, 3, T, 16, generator=g, dtype=torch.float64).unbind(0)
    full = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    mask = causal_mask(n_new, T)
    new = F.scaled_dot_product_attention(Q[..., -n_new:, :], K, V, attn_mask=mask)
    torch.testing.assert_close(new, full[..., -n_new:, :], rtol=1e-12, atol=1e-12)
    ours, _ = scaled_dot_product_attention(Q[..., -n_new:, :].numpy(), K.numpy(), V.numpy(),
                                           mask=mask.numpy())
    np.testing.assert_allclose(ours, full[..., -n_new:, :].numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("q_len", "k_len"), [(2, 1), (5, 3), (9, 4)])
def test_more_queries_than_keys_gives_empty_rows_and_zeros(q_len, k_len):
    mask = causal_mask(q_len, k_len)
    n_empty = q_len - k_len
    assert not mask[:n_empty].any() and mask[n_empty:].any(dim=-1).all()
    rng = np.random.default_rng(q_len)
    q, k, v = rng.normal(size=(q_len, 4)), rng.normal(size=(k_len, 4)), rng.normal(size=(k_len, 3))
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask.numpy())
    assert not np.isnan(out).any()
    assert (out[:n_empty] == 0).all() and (weights[:n_empty] == 0).all()
    np.testing.assert_allclose(weights[n_empty:].sum(-1), 1.0)


def test_causal_mask_accepts_numpy_and_tensor_ints_and_device():
    assert torch.equal(causal_mask(np.int64(3), torch.tensor(4)), _tril_reference(3, 4))
    assert causal_mask(3, device="cpu").device.type == "cpu"


# padding_mask -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_matches_loops(seed, side):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 12, size=int(rng.integers(1, 8)))
    lengths[0] = max(lengths[0], 1)
    max_len = int(lengths.max()) + int(rng.integers(0, 4))
    reference = _padding_loops(lengths.tolist(), max_len, side)
    for given in (lengths.tolist(), tuple(lengths.tolist()), lengths, torch.from_numpy(lengths),
                  torch.from_numpy(lengths).to(torch.int32)):
        mask = padding_mask(given, max_len, side=side)
        assert mask.dtype == torch.bool and torch.equal(mask, reference)
    assert torch.equal(padding_mask(lengths, side=side),
                       _padding_loops(lengths.tolist(), int(lengths.max()), side))


def test_padding_mask_numpy_formula_and_row_sums():
    lengths = np.array([5, 3, 1, 0, 5])
    mask = padding_mask(lengths)
    np.testing.assert_array_equal(mask.numpy(), np.arange(5)[None, :] < lengths[:, None])
    np.testing.assert_array_equal(mask.sum(-1).numpy(), lengths)
    np.testing.assert_array_equal(padding_mask(lengths, side="left").sum(-1).numpy(), lengths)
    assert torch.equal(padding_mask(lengths, side="left"), mask.flip(-1))


def test_padding_mask_edge_cases():
    assert padding_mask([1]).shape == (1, 1) and padding_mask([1]).all()
    assert padding_mask([0, 0]).shape == (2, 0)
    assert padding_mask([], max_len=3).shape == (0, 3)
    assert padding_mask([0], max_len=2).sum() == 0
    assert padding_mask(torch.tensor([2, 1])).device.type == "cpu"


# attention_mask ---------------------------------------------------------------------------


def _attention_loops(lengths, lq, lk, causal):
    return torch.tensor([[[[(j < n) and (not causal or j <= i + lk - lq) for j in range(lk)]
                           for i in range(lq)]] for n in lengths], dtype=torch.bool)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("lengths", "q_len"),
                         [([4, 2, 3], None), ([6, 1], 3), ([3], 5), ([1], 1), ([7, 7], 2)])
def test_attention_mask_matches_loops(lengths, q_len, causal):
    mask = attention_mask(padding_mask(lengths), causal=causal, q_len=q_len)
    lk = max(lengths)
    lq = lk if q_len is None else q_len
    assert mask.dtype == torch.bool and mask.shape == (len(lengths), 1, lq, lk)
    assert torch.equal(mask, _attention_loops(lengths, lq, lk, causal))
    assert torch.equal(mask, padding_mask(lengths)[:, None, None, :]
                       & (causal_mask(lq, lk) if causal else torch.ones(lq, lk, dtype=torch.bool)))


def test_attention_mask_without_padding():
    assert torch.equal(attention_mask(q_len=4, causal=True), causal_mask(4)[None, None])
    assert torch.equal(attention_mask(q_len=2, k_len=5, causal=True), causal_mask(2, 5)[None, None])
    assert attention_mask(k_len=3).shape == (1, 1, 3, 3) and attention_mask(k_len=3).all()
    kp = padding_mask([2, 3])
    assert torch.equal(attention_mask(kp, k_len=3), attention_mask(kp))


def test_attention_mask_positional_arguments_and_array_input():
    kp = padding_mask([2, 3])
    assert torch.equal(attention_mask(kp, True, 2), attention_mask(kp, causal=True, q_len=2))
    assert torch.equal(attention_mask(kp.numpy()), attention_mask(kp))
    assert torch.equal(attention_mask(kp.tolist(), True), attention_mask(kp, causal=True))


def test_attention_mask_result_is_writable_copy():
    kp = padding_mask([2, 3])
    mask = attention_mask(kp, causal=True)
    mask[1, 0, 0, 0] = False  # one entry, not a whole broadcast column
    assert mask[1, 0, 1:, 0].all() and torch.equal(kp, padding_mask([2, 3]))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_equals_sequences_alone(seed, causal):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 9, (4,), generator=g)]
    B, H, L, d = len(lengths), 3, max(lengths), 8
    Q, K, V = torch.randn(3, B, H, L, d, generator=g, dtype=torch.float64).unbind(0)
    mask = attention_mask(padding_mask(lengths), causal=causal)
    batched = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    ours, _ = scaled_dot_product_attention(Q.numpy(), K.numpy(), V.numpy(), mask=mask.numpy())
    np.testing.assert_allclose(ours, batched.numpy(), rtol=1e-10, atol=1e-12)
    for b, n in enumerate(lengths):
        alone = F.scaled_dot_product_attention(Q[b, :, :n], K[b, :, :n], V[b, :, :n],
                                               is_causal=causal)
        torch.testing.assert_close(batched[b, :, :n], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_cross_attention_ignores_padded_encoder_positions(seed):
    g = torch.Generator().manual_seed(seed)
    enc_lengths, Lq, H, d = [6, 3, 1], 4, 2, 8
    B, Lk = len(enc_lengths), max(enc_lengths)
    Q = torch.randn(B, H, Lq, d, generator=g, dtype=torch.float64)
    K, V = torch.randn(2, B, H, Lk, d, generator=g, dtype=torch.float64).unbind(0)
    mask = attention_mask(padding_mask(enc_lengths), q_len=Lq)
    assert mask.shape == (B, 1, Lq, Lk)
    ours, weights = scaled_dot_product_attention(Q.numpy(), K.numpy(), V.numpy(), mask=mask.numpy())
    theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-10, atol=1e-12)
    pad = ~padding_mask(enc_lengths)
    assert (weights.transpose(0, 3, 1, 2)[pad.numpy()] == 0).all()
    K2, V2 = K.clone(), V.clone()
    K2[pad[:, None, :].expand(B, H, Lk)] = 1e4
    V2[pad[:, None, :].expand(B, H, Lk)] = -1e4
    ours2, _ = scaled_dot_product_attention(Q.numpy(), K2.numpy(), V2.numpy(), mask=mask.numpy())
    assert np.array_equal(ours2, ours)
    torch.testing.assert_close(F.scaled_dot_product_attention(Q, K2, V2, attn_mask=mask), theirs,
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_fully_masked_rows_give_zeros_not_nan(dtype):
    mask = attention_mask(padding_mask([4, 2], side="left"), causal=True)
    assert int((~mask.any(-1)).sum()) == 2
    rng = np.random.default_rng(0)
    Q, K, V = (rng.normal(size=(2, 1, 4, 8)).astype(dtype) for _ in range(3))
    out, weights = scaled_dot_product_attention(Q, K, V, mask=mask.numpy())
    assert out.dtype == dtype and not np.isnan(out).any()
    assert (out[1, 0, :2] == 0).all() and (weights[1, 0, :2] == 0).all()
    naive = (torch.from_numpy(Q.astype(np.float64)) @ torch.from_numpy(K.astype(np.float64))
             .transpose(-1, -2)).masked_fill(~mask, -torch.inf).softmax(-1)
    assert naive[1, 0, :2].isnan().all()  # what the chapter warns about


def test_multihead_attention_needs_inverted_mask():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    lengths = [5, 3]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        out, _ = mha(x, x, x, key_padding_mask=~padding_mask(lengths))
        alone, _ = mha(x[1:, :3], x[1:, :3], x[1:, :3])
        torch.testing.assert_close(out[1:, :3], alone)
        causal_out, _ = mha(x, x, x, attn_mask=~causal_mask(5))
        prefix, _ = mha(x[:, :3], x[:, :3], x[:, :3])
        torch.testing.assert_close(causal_out[:, 2], prefix[:, -1])


# bad input --------------------------------------------------------------------------------

BAD_INPUTS = [
    (causal_mask, (0,), {}, ValueError, "q_len.*0"),
    (causal_mask, (-3,), {}, ValueError, "q_len.*-3"),
    (causal_mask, (3, 0), {}, ValueError, "k_len.*0"),
    (causal_mask, (2.0,), {}, TypeError, "q_len.*2.0"),
    (causal_mask, ("3",), {}, TypeError, "q_len.*'3'"),
    (causal_mask, (True,), {}, TypeError, "q_len.*True"),
    (causal_mask, (3, 2.5), {}, TypeError, "k_len.*2.5"),
    (causal_mask, (torch.tensor(2.0),), {}, TypeError, "q_len"),
    (padding_mask, ([3, -1, 2],), {}, ValueError, r"lengths\[1\].*-1"),
    (padding_mask, ([3, 7],), {"max_len": 5}, ValueError, "max_len must be at least 7, got max_len=5"),
    (padding_mask, ([2.5, 3],), {}, TypeError, r"lengths\[0\].*2.5"),
    (padding_mask, (torch.tensor([1.0, 2.0]),), {}, TypeError, "lengths.*float"),
    (padding_mask, (torch.tensor([True]),), {}, TypeError, "lengths.*bool"),
    (padding_mask, (torch.tensor([[1, 2]]),), {}, ValueError, r"lengths.*\(1, 2\)"),
    (padding_mask, (3,), {}, TypeError, "lengths.*3"),
    (padding_mask, ("abc",), {}, TypeError, "lengths.*abc"),
    (padding_mask, ([],), {}, ValueError, "lengths is empty"),
    (padding_mask, ([1, 2],), {"max_len": -1}, ValueError, "max_len.*-1"),
    (padding_mask, ([1, 2],), {"max_len": 2.0}, TypeError, "max_len.*2.0"),
    (padding_mask, ([1, 2],), {"side": "middle"}, ValueError, "side.*middle"),
    (attention_mask, (), {}, ValueError, "key_padding, k_len or q_len"),
    (attention_mask, (torch.ones(2, 3),), {}, TypeError, "key_padding.*float32"),
    (attention_mask, ([[1, 0]],), {}, TypeError, "key_padding.*int64"),
    (attention_mask, ("abc",), {}, TypeError, "key_padding.*abc"),
    (attention_mask, (torch.ones(3, dtype=torch.bool),), {}, ValueError, r"key_padding.*\(3,\)"),
    (attention_mask, (torch.ones(2, 0, dtype=torch.bool),), {}, ValueError, "key_padding"),
    (attention_mask, (torch.ones(2, 3, dtype=torch.bool),), {"k_len": 4}, ValueError,
     "k_len = 4.*3"),
    (attention_mask, (), {"q_len": 0}, ValueError, "q_len.*0"),
    (attention_mask, (), {"k_len": 2, "q_len": 1.5}, TypeError, "q_len.*1.5"),
    (attention_mask, (), {"q_len": 3, "causal": 1}, TypeError, "causal.*1"),
]


@pytest.mark.parametrize(("function", "args", "kwargs", "error", "message"), BAD_INPUTS)
def test_bad_input_names_the_argument(function, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        function(*args, **kwargs)


# One way to check arguments -----------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda device: causal_mask(3, device=device),
    lambda device: padding_mask([2, 1], device=device),
    lambda device: attention_mask(q_len=2, device=device),
    lambda device: attention_mask(padding_mask([2, 1]), device=device),
])
def test_a_bad_device_is_named(call):
    with pytest.raises(ValueError, match=r"device must name a device.*device='tpu:x'"):
        call("tpu:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but this machine has no CUDA GPU"):
            call("cuda")
    assert call(torch.device("cpu")).device.type == "cpu"


@pytest.mark.parametrize("lengths,error,match", [
    ({0: 3, 1: 2}, TypeError, r"lengths must be a sequence or 1-D tensor of ints, got \{0: 3"),
    ({3, 1}, TypeError, r"lengths must be a sequence or 1-D tensor of ints, got \{"),
    (frozenset({2}), TypeError, "lengths must be a sequence"),
    (np.array([[1, 2]]), ValueError, r"lengths must be 1-D, got shape \(1, 2\)"),
    (np.array(3), ValueError, r"lengths must be 1-D, got shape \(\)"),
])
def test_padding_mask_refuses_lengths_without_an_order(lengths, error, match):
    """A dict's keys ({0: 3, 1: 2} gave lengths 0 and 1) and a
    set's arbitrary order were read silently as lengths; a 2-D array named lengths[0]."""
    with pytest.raises(error, match=match):
        padding_mask(lengths)


def test_padding_mask_refuses_lengths_without_values():
    with pytest.raises(ValueError, match="lengths must hold values"):
        padding_mask(torch.tensor([1, 2], device="meta"))
