"""attnbook.efficient (chapter 17) against explicit formulas, loops and the book's softmax."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_backends import check_calls
from test_gpt import host_reads_during

from attnbook.efficient import (
    block_sparse_attention,
    block_sparse_mask,
    global_token_mask,
    linear_attention,
    performer_attention,
    positive_features,
    random_features,
    retention,
    retention_step,
    sliding_window_mask,
    tile_layout,
)
from attnbook.layers import attend
from attnbook.masks import causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = ("parallel", "recurrent", "chunkwise")


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def window_loop(lq, lk, w):
    return torch.tensor([[i + lk - lq - w < j <= i + lk - lq for j in range(lk)]
                         for i in range(lq)], dtype=torch.bool)


def linear_reference(q, k, v, causal=False, eps=1e-6, phi=lambda x: F.elu(x) + 1):
    sim = phi(q) @ phi(k).transpose(-2, -1)
    if causal:
        sim = sim * causal_mask(q.shape[-2], k.shape[-2])
    return sim @ v / (sim.sum(dim=-1, keepdim=True) + eps)


def retention_reference(q, k, v, gamma):
    q, k, v = (x.double().numpy() for x in (q, k, v))
    h, L = q.shape[1], q.shape[2]
    gammas = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (h,))
    n = np.arange(L)
    decay = np.where(n[:, None] >= n[None, :],
                     gammas[:, None, None] ** np.maximum(n[:, None] - n[None, :], 0), 0.0)
    return torch.from_numpy(np.einsum("bhnd,bhmd,hnm,bhme->bhne", q, k, decay, v))


# --- masks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 5), (3, 8), (8, 3), (1, 9)])
def test_sliding_window_mask_matches_loop(lq, lk):
    for w in range(1, lk + 3):
        assert torch.equal(sliding_window_mask(lq, lk, w), window_loop(lq, lk, w))
    assert torch.equal(sliding_window_mask(lq, lk, lk + 5), causal_mask(lq, lk))
    diagonal = torch.from_numpy(np.eye(lq, lk, lk - lq, dtype=bool))  # j = i + lk - lq
    assert torch.equal(sliding_window_mask(lq, lk, 1), diagonal)


def test_window_of_one_sees_itself_only():
    mask = sliding_window_mask(6, 6, 1)
    assert torch.equal(mask, torch.eye(6, dtype=torch.bool))


def test_global_and_block_masks_match_loops():
    for lq, lk, n in [(5, 5, 0), (4, 9, 2), (9, 4, 3), (1, 1, 1)]:
        loop = torch.tensor([[0 <= i + lk - lq < n or j < n for j in range(lk)]
                             for i in range(lq)])
        assert torch.equal(global_token_mask(lq, lk, n), loop)
    layout = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    for b, lq, lk in [(3, 12, 15), (3, 10, 13), (1, 4, 5)]:
        loop = torch.tensor([[bool(layout[i // b, j // b]) for j in range(lk)] for i in range(lq)])
        assert torch.equal(block_sparse_mask(layout, b, lq, lk), loop)


@pytest.mark.parametrize("call,match", [
    (lambda: sliding_window_mask(4, 4, 0), "window"),
    (lambda: sliding_window_mask(4, 4, 2.0), "window"),
    (lambda: sliding_window_mask(4, 4, True), "window"),
    (lambda: sliding_window_mask(0, 4, 2), "lq"),
    (lambda: sliding_window_mask(4, -1, 2), "lk"),
    (lambda: global_token_mask(4, 4, -1), "num_global"),
    (lambda: block_sparse_mask(torch.ones(2, 2), 2), "layout"),
    (lambda: block_sparse_mask(torch.ones(2, 2, dtype=torch.bool), 0), "block_size"),
    (lambda: block_sparse_mask(torch.ones(2, 2, dtype=torch.bool), 2, lq=5), "lq"),
])
def test_mask_arguments_are_checked(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


# --- tile skipping --------------------------------------------------------------------------


@pytest.mark.parametrize("L,block", [(1, 4), (37, 8), (64, 16), (50, 64)])
def test_block_sparse_attention_equals_attend(L, block):
    q, k, v = randn(2, 3, L, 8, seed=1), randn(2, 3, L, 8, seed=2), randn(2, 3, L, 5, seed=3)
    for mask in (sliding_window_mask(L, L, 5), causal_mask(L),
                 sliding_window_mask(L, L, 3) | global_token_mask(L, L, 2),
                 torch.ones(L, L, dtype=torch.bool)):
        torch.testing.assert_close(block_sparse_attention(q, k, v, mask, block),
                                   attend(q, k, v, mask)[0], rtol=1e-12, atol=1e-12)


def test_block_sparse_attention_rectangular_float32_and_empty_rows():
    q, k, v = (randn(1, 2, n, 4, seed=s, dtype=torch.float32) for s, n in ((0, 10), (1, 23),
                                                                          (2, 23)))
    mask = sliding_window_mask(10, 23, 4)
    mask[:3] = False  # three queries see no key
    out = block_sparse_attention(q, k, v, mask, 4)
    torch.testing.assert_close(out, attend(q, k, v, mask)[0])
    assert out.dtype == torch.float32 and torch.equal(out[:, :, :3], torch.zeros(1, 2, 3, 4))
    assert torch.equal(block_sparse_attention(q, k, v, torch.zeros(10, 23, dtype=torch.bool), 4),
                       torch.zeros(1, 2, 10, 4))


def test_tile_layout_counts_window_tiles():
    layout = tile_layout(sliding_window_mask(256, 256, 64), 32)
    n, r = 8, 2
    assert layout.shape == (8, 8) and int(layout.sum()) == n * (r + 1) - r * (r + 1) // 2
    assert torch.equal(tile_layout(torch.ones(5, 7, dtype=torch.bool), 3),
                       torch.ones(2, 3, dtype=torch.bool))


def test_block_sparse_attention_propagates_nan():
    q, k, v = randn(1, 1, 8, 4), randn(1, 1, 8, 4, seed=1), randn(1, 1, 8, 4, seed=2)
    q[0, 0, 5, 0] = math.nan
    out = block_sparse_attention(q, k, v, causal_mask(8), 4)
    assert out[0, 0, 5].isnan().all() and not out[0, 0, :5].isnan().any()


@pytest.mark.parametrize("call,match", [
    (lambda q: block_sparse_attention(q, q, q, torch.ones(4, 4), 2), "mask"),
    (lambda q: block_sparse_attention(q, q, q, torch.ones(4, 5, dtype=torch.bool), 2), "mask"),
    (lambda q: block_sparse_attention(q, q, q, torch.ones(3, 4, 4, dtype=torch.bool), 2), "mask"),
    (lambda q: block_sparse_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool), 0),
     "block_size"),
    (lambda q: block_sparse_attention(q[0], q, q, torch.ones(4, 4, dtype=torch.bool)), "q"),
    (lambda q: block_sparse_attention(q, q.float(), q, torch.ones(4, 4, dtype=torch.bool)), "k"),
])
def test_block_sparse_arguments_are_checked(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(randn(1, 2, 4, 3))


# --- linear attention -----------------------------------------------------------------------


@pytest.mark.parametrize("lq,lk", [(1, 1), (20, 20), (5, 17), (17, 5), (1, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_matches_formula(lq, lk, causal):
    q, k, v = randn(2, 3, lq, 6, seed=1), randn(2, 3, lk, 6, seed=2), randn(2, 3, lk, 4, seed=3)
    torch.testing.assert_close(linear_attention(q, k, v, causal),
                               linear_reference(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_linear_attention_float32_feature_map_any_leading_dims():
    q, k, v = randn(7, 4, dtype=torch.float32), randn(9, 4, seed=1, dtype=torch.float32), \
        randn(9, 3, seed=2, dtype=torch.float32)
    phi = torch.relu
    out = linear_attention(q, k, v, False, feature_map=phi, eps=1e-3)
    assert out.shape == (7, 3) and out.dtype == torch.float32
    torch.testing.assert_close(out, linear_reference(q, k, v, False, 1e-3, phi))
    q4 = randn(2, 2, 3, 5, 4, dtype=torch.float32)
    assert linear_attention(q4, q4, q4, True).shape == q4.shape


def test_linear_attention_float16_and_nan_and_blind_queries():
    q, k, v = (randn(1, 2, 8, 4, seed=s) for s in range(3))
    half = linear_attention(q.half(), k.half(), v.half(), True)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), linear_attention(q, k, v, True), atol=2e-3, rtol=2e-3)
    out = linear_attention(q[:, :, :8], k[:, :, :3], v[:, :, :3], True)  # Lq > Lk
    assert torch.equal(out[:, :, :5], torch.zeros(1, 2, 5, 4))  # these queries see no key
    k[0, 0, 4, 1] = math.nan
    out = linear_attention(q, k, v, True)
    assert out[0, 0, 4:].isnan().all() and not out[0, 0, :4].isnan().any()
    assert linear_attention(q, k, v, False)[0, 0].isnan().all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(causal=1), "causal"), (dict(eps=0.0), "eps"), (dict(feature_map=3), "feature_map"),
])
def test_linear_attention_arguments_are_checked(kwargs, match):
    q = randn(1, 4, 3)
    with pytest.raises((TypeError, ValueError), match=match):
        linear_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("feature_map,error,match", [
    (lambda x: x, ValueError, r"feature_map\(q\) must be non-negative"),  # negative features
    (lambda x: x.sum(-1), ValueError, r"feature_map\(q\) must have shape \(2, 5, \*\)"),
    (lambda x: x.exp()[0], ValueError, r"feature_map\(q\)"),  # a leading axis lost
    (lambda x: x.exp().tolist(), TypeError, r"feature_map\(q\) must be a torch.Tensor"),
    (lambda x: (x > 0).long(), TypeError, r"feature_map\(q\) must be a floating-point tensor"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_checks_what_a_custom_feature_map_returns(feature_map, error, match,
                                                                    causal):
    q, k, v = randn(2, 5, 4), randn(2, 6, 4, seed=1), randn(2, 6, 3, seed=2)
    with pytest.raises(error, match=match):
        linear_attention(q, k, v, causal, feature_map=feature_map)


def test_a_feature_map_that_only_fails_on_the_keys_is_named_for_them():
    q, k, v = randn(2, 5, 4).abs(), -randn(2, 6, 4, seed=1).abs() - 0.1, randn(2, 6, 3, seed=2)
    with pytest.raises(ValueError, match=r"feature_map\(k\) must be non-negative"):
        linear_attention(q, k, v, feature_map=lambda x: x)
    relu = linear_attention(q, k.abs(), v, feature_map=torch.relu)  # zeros are allowed
    torch.testing.assert_close(relu, linear_reference(q, k.abs(), v, False, 1e-6, torch.relu))


@pytest.mark.parametrize("shapes,match", [
    (((4, 3), (4, 2), (4, 3)), "k"), (((4, 3), (4, 3), (5, 3)), "v"),
    (((3,), (3,), (3,)), "q"), (((4, 3), (0, 3), (0, 3)), "k.shape"),
])
def test_linear_attention_shapes_are_checked(shapes, match):
    q, k, v = (torch.zeros(s, dtype=torch.float64) for s in shapes)
    with pytest.raises(ValueError, match=match):
        linear_attention(q, k, v)
    with pytest.raises(TypeError, match="k"):
        linear_attention(randn(4, 3), torch.zeros(4, 3, dtype=torch.int64), randn(4, 3))


# --- FAVOR+ ---------------------------------------------------------------------------------


def test_random_features_are_orthogonal_in_blocks_and_reproducible():
    w = random_features(40, 16, True, torch.Generator().manual_seed(0), torch.float64)
    assert w.shape == (40, 16)
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(16, dtype=torch.float64))
    again = random_features(40, 16, True, torch.Generator().manual_seed(0), torch.float64)
    assert torch.equal(w, again)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_positive_features_estimate_softmax_kernel_without_bias(orthogonal):
    q, k = randn(2, 8, seed=5) * 0.2
    gen = torch.Generator().manual_seed(1)
    est = torch.stack([positive_features(q, w) @ positive_features(k, w)
                       for w in (random_features(8, 8, orthogonal, gen, torch.float64)
                                 for _ in range(3000))])
    assert abs(float(est.mean()) - math.exp(float(q @ k))) < 4 * float(est.std()) / math.sqrt(3000)
    assert (est > 0).all()


def test_performer_converges_to_softmax_attention():
    q, k, v = (randn(1, 2, 32, 8, seed=s) * 0.5 for s in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gen = torch.Generator().manual_seed(0)
    few = (performer_attention(q, k, v, 4, generator=gen) - exact).abs().mean()
    many = (performer_attention(q, k, v, 4096, generator=gen) - exact).abs().mean()
    assert many < few / 4 and many < 0.02
    assert (performer_attention(q, k, v, 4096, True, gen, orthogonal=False)
            - causal).abs().mean() < 0.03
    blind = performer_attention(q[:, :, :8], k[:, :, :3], v[:, :, :3], 16, True, gen)
    assert torch.equal(blind[:, :, :5], torch.zeros(1, 2, 5, 8))


def test_performer_float32_large_scores_and_nan():
    q, k, v = (randn(1, 1, 16, 8, seed=s, dtype=torch.float32) * 10 for s in range(3))
    out = performer_attention(q, k, v, 64, generator=torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and out.isfinite().all()
    q[0, 0, 3, 0] = math.nan
    assert performer_attention(q, k, v, 64)[0, 0, 3].isnan().all()


def favor_reference(q, k, v, w, causal):
    """FAVOR+'s estimate with the features w, exactly, in float64: each similarity
    phi(q_i) . phi(k_j) kept as its logarithm, so that no feature underflows."""
    q, k, v, w = (x.double() for x in (q, k, v, w))
    scale = q.shape[-1] ** -0.25
    logq, logk = ((x * scale) @ w.T - (x * scale).pow(2).sum(-1, keepdim=True) / 2 for x in (q, k))
    log_sim = (logq[..., :, None, :] + logk[..., None, :, :]).logsumexp(dim=-1)  # (..., Lq, Lk)
    if causal:
        log_sim = log_sim.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    return log_sim.softmax(dim=-1) @ v  # the sqrt(m)s and the constants cancel


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,lq", [(1.0, 128), (7.0, 128), (7.0, 40)])
def test_performer_float32_matches_its_features_in_float64_with_large_scores(causal, s, lq):
    """The key constant is taken over the keys a query sees: under the causal mask, an early
    query's keys do not underflow against a later, larger key (47c9c8f returned zeros)."""
    q, k, v = (randn(1, 1, n, 64, seed=seed, dtype=torch.float32) * s
               for seed, n in enumerate((lq, 128, 128)))
    out = performer_attention(q, k, v, 128, causal, torch.Generator().manual_seed(1))
    w = random_features(128, 64, True, torch.Generator().manual_seed(1), torch.float32)
    exact = favor_reference(q, k, v, w, causal)
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4 * s)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_float64_matches_its_features_where_float32_underflows(causal):
    """Scores far past the estimate's use (q, k ~ 15 N(0, 1)): float32 products of a query and
    a key whose largest features lie apart underflow (the docstring's limit); float64 does not."""
    q, k, v = (randn(1, 1, 128, 64, seed=seed, dtype=torch.float64) * s
               for seed, s in enumerate((15, 15, 1)))
    out = performer_attention(q, k, v, 128, causal, torch.Generator().manual_seed(1))
    w = random_features(128, 64, True, torch.Generator().manual_seed(1), torch.float64)
    torch.testing.assert_close(out, favor_reference(q, k, v, w, causal), rtol=1e-9, atol=1e-9)


def test_performer_causal_rescaling_over_many_chunks_with_growing_keys():
    """Keys that grow along the sequence raise the running largest in every chunk: the state
    carried into the third and fourth chunk of 64 must be rescaled at each chunk's end."""
    q, k, v = (randn(1, 2, n, 64, seed=seed, dtype=torch.float32) for seed, n in enumerate(
        (200, 256, 256)))
    k = k * torch.linspace(0.5, 1.5, 256)[:, None]  # 56 keys before the first query, 4 chunks
    out = performer_attention(q, k, v, 128, True, torch.Generator().manual_seed(1))
    w = random_features(128, 64, True, torch.Generator().manual_seed(1), torch.float32)
    torch.testing.assert_close(out.double(), favor_reference(q, k, v, w, True), rtol=1e-4,
                               atol=1e-4)


def test_performer_causal_keys_with_no_finite_log_feature_and_a_nan_key():
    """A finite key whose |k D^-1/4|^2 overflows float32 has every log-feature -inf: its
    features are 0 (04c70a5 gave NaN to every row when such keys came first). A NaN key
    reaches only the queries that see it, as in PyTorch's attention, wherever the chunks end."""
    q, k, v = (randn(1, 1, 100, 16, seed=s, dtype=torch.float32) for s in range(3))
    k[0, 0, :2] = 1e19  # keys 0 and 1: features 0, so queries 0 and 1 see no key (0 / tiny = 0)
    w = random_features(32, 16, True, torch.Generator().manual_seed(1), torch.float32)
    for causal in (True, False):
        out = performer_attention(q, k, v, 32, causal, torch.Generator().manual_seed(1))
        exact = favor_reference(q, k, v, w, causal)  # in float64, keys 0 and 1 weigh ~e^-1e37
        exact[..., :2 if causal else 0, :] = 0.0  # but are all a causal query 0 or 1 sees
        torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)
    k[0, 0, 70, 0] = math.nan  # in the second chunk of 64, after queries 64..69
    out = performer_attention(q, k, v, 32, True, torch.Generator().manual_seed(1))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out.isnan().any(-1), sdpa.isnan().any(-1))
    assert out[0, 0, :70].isfinite().all() and out[0, 0, 70:].isnan().all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_features=0), "num_features"), (dict(num_features=2.5), "num_features"),
    (dict(num_features=4, generator=3), "generator"),
    (dict(num_features=4, orthogonal="yes"), "orthogonal"),
    (dict(num_features=4, causal=None), "causal"),
])
def test_performer_arguments_are_checked(kwargs, match):
    q = randn(1, 4, 3)
    with pytest.raises((TypeError, ValueError), match=match):
        performer_attention(q, q, q, **kwargs)


# --- retention ------------------------------------------------------------------------------


@pytest.mark.parametrize("L,chunk", [(1, 64), (1, 1), (5, 64), (64, 64), (100, 64), (37, 5),
                                     (20, 1)])
@pytest.mark.parametrize("gamma", [0.9, 1.0, "per-head"])
def test_retention_modes_match_formula(L, chunk, gamma):
    gamma = torch.tensor([0.3, 0.9, 1.0], dtype=torch.float64) if gamma == "per-head" else gamma
    q, k, v = randn(2, 3, L, 4, seed=1), randn(2, 3, L, 4, seed=2), randn(2, 3, L, 6, seed=3)
    reference = retention_reference(q, k, v, gamma)
    for mode in MODES:
        out = retention(q, k, v, gamma, mode, chunk)
        assert out.shape == (2, 3, L, 6)
        assert float((out - reference).abs().max()) < 1e-9


def test_retention_float32_float16_and_nan():
    q, k, v = (randn(1, 2, 40, 4, seed=s, dtype=torch.float32) for s in range(3))
    gamma = torch.tensor([0.8, 0.95])
    ref = retention_reference(q, k, v, gamma.double()).float()
    for mode in MODES:
        torch.testing.assert_close(retention(q, k, v, gamma, mode, 16), ref, rtol=1e-4, atol=1e-4)
        half = retention(q.half(), k.half(), v.half(), 0.9, mode, 16)
        assert half.dtype == torch.float16
    k[0, 1, 10, 0] = math.nan
    for mode in MODES:
        out = retention(q, k, v, 0.9, mode, 16)
        assert out[0, 1, 10:].isnan().all() and not out[0, 1, :10].isnan().any()
        assert not out[0, 0].isnan().any()


def test_retention_step_equals_recurrent_mode_with_constant_state():
    q, k, v = randn(1, 3, 30, 4), randn(1, 3, 30, 4, seed=1), randn(1, 3, 30, 5, seed=2)
    gamma = torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)
    state, outs = None, []
    for n in range(30):
        out, state = retention_step(q[:, :, n], k[:, :, n], v[:, :, n], gamma, state)
        assert state.shape == (1, 3, 4, 5)
        outs.append(out)
    torch.testing.assert_close(torch.stack(outs, 2), retention(q, k, v, gamma, "recurrent"))


@pytest.mark.parametrize("gamma,match", [
    (0.0, "gamma"), (1.5, "gamma"), (-0.1, "gamma"), (math.nan, "gamma"), ("0.9", "gamma"),
    (torch.tensor([0.9, 0.9]), "gamma"), (torch.tensor([0.9, 0.0, 0.5]), "gamma"),
    (torch.tensor([1, 1, 1]), "gamma"),
])
def test_retention_gamma_is_checked(gamma, match):
    q = randn(1, 3, 4, 2)
    with pytest.raises((TypeError, ValueError), match=match):
        retention(q, q, q, gamma)


@pytest.mark.parametrize("call,match", [
    (lambda q: retention(q, q, q, 0.9, mode="fast"), "mode"),
    (lambda q: retention(q, q, q, 0.9, chunk_size=0), "chunk_size"),
    (lambda q: retention(q[0], q[0], q[0], 0.9), "q"),
    (lambda q: retention(q, q[:, :, :2], q, 0.9), "k"),
    (lambda q: retention(q, q, q[:, :, :2], 0.9), "v"),
    (lambda q: retention_step(q[:, :, 0], q[:, :, 0], q[:, :, 0], 0.9, torch.zeros(1)), "state"),
])
def test_retention_arguments_are_checked(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(randn(1, 3, 4, 2))


# --- broadcast masks, negative positions, tiny gamma, empty inputs --------------------


@pytest.mark.parametrize("shape", [(1, 23), (23, 1), (23,), (), (2, 1, 23, 23), (1, 3, 1, 23),
                                   (2, 3, 23, 23)])
def test_block_sparse_attention_broadcast_masks_equal_attend(shape):
    q, k, v = randn(2, 3, 23, 4, seed=1), randn(2, 3, 23, 4, seed=2), randn(2, 3, 23, 5, seed=3)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(4)) < 0.3
    for block in (4, 7, 64):
        torch.testing.assert_close(block_sparse_attention(q, k, v, mask, block),
                                   attend(q, k, v, mask)[0], rtol=1e-12, atol=1e-12)


def test_block_sparse_attention_empty_and_keyless_inputs():
    q = randn(1, 2, 6, 4)
    empty = block_sparse_attention(q[:, :, :0], q, q, torch.ones(0, 6, dtype=torch.bool), 4)
    assert empty.shape == (1, 2, 0, 4)
    with pytest.raises(ValueError, match=r"k\.shape\[-2\]"):  # attend refuses no keys too
        block_sparse_attention(q, q[:, :, :0], q[:, :, :0], torch.ones(6, 0, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        block_sparse_attention(q, q, q, torch.ones(3, 6, 6, dtype=torch.bool))


@pytest.mark.parametrize("lq,lk,n", [(4, 2, 0), (4, 2, 1), (6, 3, 2), (5, 5, 2), (2, 5, 3),
                                     (7, 1, 1)])
def test_global_token_mask_queries_before_the_keys_are_not_global(lq, lk, n):
    loop = torch.tensor([[0 <= i + lk - lq < n or j < n for j in range(lk)] for i in range(lq)])
    assert torch.equal(global_token_mask(lq, lk, n), loop)
    assert not global_token_mask(4, 2, 0).any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fn", ["linear", "performer"])
def test_linear_and_performer_with_no_queries(fn, causal):
    k, v = randn(2, 3, 5, 4, seed=1), randn(2, 3, 5, 6, seed=2)
    q = randn(2, 3, 0, 4)
    out = linear_attention(q, k, v, causal) if fn == "linear" else \
        performer_attention(q, k, v, 8, causal, torch.Generator().manual_seed(0))
    assert out.shape == (2, 3, 0, 6) and out.dtype == torch.float64


def test_random_and_positive_features_check_dtype_and_shape():
    with pytest.raises(TypeError, match="dtype"):
        random_features(4, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype"):
        random_features(4, 4, dtype="float32")
    with pytest.raises(ValueError, match="x"):
        positive_features(torch.tensor(1.0), torch.ones(3, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_retention_with_a_gamma_that_underflows(dtype, chunk):
    q, k, v = (randn(1, 2, 10, 4, seed=s) for s in range(3))
    reference = retention_reference(q, k, v, 1e-46).to(dtype)  # 1e-46 is 0 in float32
    diagonal = ((q * k).sum(-1, keepdim=True) * v).to(dtype)  # o_n = (q_n . k_n) v_n
    torch.testing.assert_close(reference, diagonal)
    for mode in MODES:
        out = retention(q.to(dtype), k.to(dtype), v.to(dtype), 1e-46, mode, chunk)
        assert out.isfinite().all()
        torch.testing.assert_close(out, reference)
    tensor_gamma = torch.tensor([1e-46, 0.5], dtype=dtype)
    if dtype == torch.float32:  # the (H,) tensor holds 0: refused, as 0 is outside (0, 1]
        with pytest.raises(ValueError, match="gamma"):
            retention(q.float(), k.float(), v.float(), tensor_gamma)


@pytest.mark.parametrize("mode", MODES)
def test_retention_with_no_positions(mode):
    q = randn(2, 3, 0, 4)
    out = retention(q, q, randn(2, 3, 0, 5), 0.9, mode, 4)
    assert out.shape == (2, 3, 0, 5) and out.dtype == torch.float64


def test_retention_three_forms_are_three_code_paths():
    """The recurrent mode is the state recurrence written out: it matches a loop over
    retention_step and the parallel form, and the chunkwise form with any chunk."""
    q, k, v = randn(1, 2, 13, 3, seed=5), randn(1, 2, 13, 3, seed=6), randn(1, 2, 13, 2, seed=7)
    gamma = torch.tensor([0.7, 0.95], dtype=torch.float64)
    S = torch.zeros(1, 2, 3, 2, dtype=torch.float64)
    outs = []
    for n in range(13):  # S_n = gamma S_(n-1) + k_n^T v_n, o_n = q_n S_n, by hand
        S = gamma[None, :, None, None] * S + k[:, :, n, :, None] * v[:, :, n, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, n], S))
    by_hand = torch.stack(outs, 2)
    for mode, chunk in [("recurrent", 64), ("parallel", 64), ("chunkwise", 1), ("chunkwise", 4),
                        ("chunkwise", 13)]:
        torch.testing.assert_close(retention(q, k, v, gamma, mode, chunk), by_hand,
                                   rtol=1e-12, atol=1e-12)


def test_gradients_of_block_sparse_attention_and_retention_match_their_references():
    q, k, v = (randn(1, 2, 13, 4, seed=s).requires_grad_() for s in range(3))
    mask = sliding_window_mask(13, 13, 3) | global_token_mask(13, 13, 1)
    ours = torch.autograd.grad(block_sparse_attention(q, k, v, mask, 4).square().sum(), (q, k, v))
    reference = torch.autograd.grad(attend(q, k, v, mask)[0].square().sum(), (q, k, v))
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    parallel = torch.autograd.grad(retention(q, k, v, 0.8).square().sum(), (q, k, v))
    for mode in ("recurrent", "chunkwise"):
        grads = torch.autograd.grad(retention(q, k, v, 0.8, mode, 4).square().sum(), (q, k, v))
        for a, b in zip(grads, parallel):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_elu_feature_map_checks_x():
    from attnbook.efficient import elu_feature_map

    x = randn(3, 4)
    torch.testing.assert_close(elu_feature_map(x), torch.where(x > 0, x + 1, x.exp()))
    for bad in ("a", torch.tensor([1, 2])):
        with pytest.raises(TypeError, match="x"):
            elu_feature_map(bad)


# --- causal linear attention in chunks -----------------------------------------------------


@pytest.mark.parametrize("lq,lk,chunk", [(37, 37, 8), (37, 37, 1), (37, 37, 100), (5, 37, 8),
                                         (37, 5, 4), (64, 64, 16)])
def test_chunked_causal_linear_attention_matches_the_definition(lq, lk, chunk):
    q, k, v = randn(2, 3, lq, 6, seed=4), randn(2, 3, lk, 6, seed=5), randn(2, 3, lk, 5, seed=6)
    out = linear_attention(q, k, v, True, chunk_size=chunk)
    torch.testing.assert_close(out, linear_reference(q, k, v, True), rtol=1e-12, atol=1e-12)
    phi = torch.relu  # zeros in the features: a chunk's rows may be all zero, as in the formula
    torch.testing.assert_close(linear_attention(q, k, v, True, phi, 1e-3, chunk),
                               linear_reference(q, k, v, True, 1e-3, phi), rtol=1e-12, atol=1e-12)


def test_chunked_causal_linear_attention_keeps_no_state_per_position():
    from torch.profiler import ProfilerActivity, profile

    n, d = 1024, 32
    q, k, v = (randn(1, 1, n, d, seed=s, dtype=torch.float32) for s in range(3))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        linear_attention(q, k, v, True)  # chunks of 64 by default
    largest = max(event.cpu_memory_usage for event in prof.events())  # bytes of one allocation
    assert 0 < largest <= n * d * 4  # the output's size; a state per position is n * d * d * 4


def test_linear_attention_checks_chunk_size():
    q = randn(1, 4, 3)
    for bad, error in ((0, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="chunk_size"):
            linear_attention(q, q, q, True, chunk_size=bad)


# --- block-sparse attention from a tile layout ---------------------------------------------


@pytest.mark.parametrize("lq,lk,block", [(23, 23, 4), (10, 23, 4), (23, 10, 3), (1, 9, 4),
                                         (9, 1, 2), (16, 16, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_attention_from_a_layout_equals_attend(lq, lk, block, causal):
    q, k, v = randn(2, 3, lq, 4, seed=1), randn(2, 3, lk, 4, seed=2), randn(2, 3, lk, 5, seed=3)
    nq, nk = -(-lq // block), -(-lk // block)
    layout = torch.rand(nq, nk, generator=torch.Generator().manual_seed(lq + lk)) < 0.5
    layout[0, 0] = True
    dense = block_sparse_mask(layout, block, lq, lk)
    if causal:
        dense = dense & causal_mask(lq, lk)
    out = block_sparse_attention(q, k, v, layout=layout, block_size=block, causal=causal)
    torch.testing.assert_close(out, attend(q, k, v, dense)[0], rtol=1e-12, atol=1e-12)
    empty = torch.zeros(nq, nk, dtype=torch.bool)  # no tile: every query gets zeros
    assert torch.equal(block_sparse_attention(q, k, v, layout=empty, block_size=block),
                       torch.zeros(2, 3, lq, 5, dtype=torch.float64))


def test_block_sparse_attention_from_a_layout_computes_its_tiles_only():
    from torch.profiler import ProfilerActivity, profile

    from attnbook.notebook import flop_counter

    n, b, d = 2048, 64, 32
    q, k, v = (randn(1, 1, n, d, seed=s, dtype=torch.float32) for s in range(3))
    layout = sliding_window_mask(n // b, n // b, 3)  # 3 tiles per block row, fewer in the first
    tiles = int(layout.sum())
    with flop_counter() as flops:
        block_sparse_attention(q, k, v, layout=layout, block_size=b, causal=True)
    assert flops.get_total_flops() == tiles * 2 * b * b * (d + d)  # scores and output, per tile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        block_sparse_attention(q, k, v, layout=layout, block_size=b, causal=True)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert largest <= tiles * b * b * 4  # the tiles' scores; a dense score matrix is n * n * 4


def test_block_sparse_attention_from_a_layout_float16_nan_and_gradients():
    q, k, v = (randn(1, 2, 12, 4, seed=s) for s in range(3))
    layout = torch.tensor([[True, False, False], [True, True, False], [False, True, True]])
    dense = block_sparse_mask(layout, 4) & causal_mask(12)
    half = block_sparse_attention(q.half(), k.half(), v.half(), layout=layout, block_size=4,
                                  causal=True)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), attend(q, k, v, dense)[0], atol=2e-3, rtol=2e-3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours = torch.autograd.grad(block_sparse_attention(*leaves, layout=layout, block_size=4,
                                                      causal=True).square().sum(), leaves)
    reference = torch.autograd.grad(attend(*leaves, dense)[0].square().sum(), leaves)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    k[0, 0, 5, 0] = math.nan  # key 5 sits in tile 1: the queries of block rows 1 and 2 see it
    out = block_sparse_attention(q, k, v, layout=layout, block_size=4, causal=True)
    assert out[0, 0, 5:].isnan().all() and not out[0, 0, :5].isnan().any()
    assert not out[0, 1].isnan().any()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(), ValueError, "either mask or layout"),
    (dict(mask=torch.ones(8, 8, dtype=torch.bool), layout=torch.ones(2, 2, dtype=torch.bool)),
     ValueError, "either mask or layout"),
    (dict(layout=torch.ones(2, 3, dtype=torch.bool)), ValueError, r"layout.*\(2, 2\)"),
    (dict(layout=torch.ones(3, dtype=torch.bool)), ValueError, r"layout of shape \(3,\)"),
    (dict(layout=torch.ones(2, 2)), TypeError, "layout must be a torch.bool"),
    (dict(layout=torch.ones(2, 2, dtype=torch.bool), causal=1), TypeError, "causal"),
])
def test_block_sparse_attention_layout_arguments_are_checked(kwargs, error, match):
    q = randn(1, 2, 8, 3)
    with pytest.raises(error, match=match):
        block_sparse_attention(q, q, q, block_size=4, **kwargs)


def test_block_sparse_attention_layout_broadcasts_as_a_mask_does():
    q, k, v = randn(1, 2, 12, 4), randn(1, 2, 12, 4, seed=1), randn(1, 2, 12, 3, seed=2)
    row = torch.tensor([True, False, True])  # the same key tiles for every block of queries
    out = block_sparse_attention(q, k, v, layout=row, block_size=4)
    torch.testing.assert_close(out, attend(q, k, v, block_sparse_mask(row.expand(3, 3), 4))[0],
                               rtol=1e-12, atol=1e-12)


# --- the test models, in the package -------------------------------------------------------


def _mixer_reference(mixer, x):
    """Mixer's output from its weights, each kind through this file's or PyTorch's reference."""
    B, T, C = x.shape
    q, k, v = (t.view(B, T, mixer.h, C // mixer.h).transpose(1, 2)
               for t in (x @ mixer.qkv.weight.T).chunk(3, dim=-1))
    if mixer.kind == "softmax":
        y = attend(q, k, v, causal_mask(T))[0]
    elif mixer.kind == "window":
        y = attend(q, k, v, window_loop(T, T, mixer.window))[0]
    elif mixer.kind == "linear":
        y = linear_reference(q, k, v, causal=True)
    else:
        y = retention_reference(q * (C // mixer.h) ** -0.5, k, v, mixer.gamma)
    y = y.transpose(1, 2).reshape(B * T, C)
    if mixer.kind == "retention":
        y = F.group_norm(y, mixer.h, mixer.norm.weight, mixer.norm.bias, mixer.norm.eps)
    return (y @ mixer.out.weight.T).view(B, T, C)


@pytest.mark.parametrize("kind", ["softmax", "window", "linear", "retention"])
def test_mixer_matches_its_references(kind):
    from attnbook.efficient import Mixer

    torch.manual_seed(0)
    mixer = Mixer(16, 4, kind, window=3).double()
    x = randn(2, 11, 16, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), _mixer_reference(mixer, x), rtol=1e-10, atol=1e-10)


def test_tiny_lm_shapes_causality_and_arguments():
    from attnbook.efficient import MIXERS, Mixer, TinyLM

    for kind in MIXERS:
        torch.manual_seed(0)
        model = TinyLM(20, 10, kind, window=3).double()
        idx = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(1))
        logits = model(idx)
        assert logits.shape == (2, 7, 20)
        changed = idx.clone()
        changed[:, 4] = (changed[:, 4] + 1) % 20  # a later token cannot change earlier outputs
        torch.testing.assert_close(model(changed)[:, :4], logits[:, :4], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"idx\.shape\[1\]"):
        TinyLM(20, 10)(torch.zeros(1, 11, dtype=torch.long))
    for call, error, match in [(lambda: Mixer(10, 4), ValueError, "d_model=10"),
                               (lambda: Mixer(8, 2, "rnn"), ValueError, "kind"),
                               (lambda: Mixer(8, 2, window=0), ValueError, "window"),
                               (lambda: TinyLM(0, 4), ValueError, "vocab")]:
        with pytest.raises(error, match=match):
            call()


def test_recall_batch_answers_are_the_values_of_the_keys_asked():
    from attnbook.efficient import recall_batch

    x, y, asked = recall_batch(torch.Generator().manual_seed(0), 16, keys=6, values=5, pairs=4,
                               asked=3)
    assert x.shape == (16, 7) and y.shape == (16, 3) and asked == slice(4, None)
    for row, answers in zip(x.tolist(), y.tolist()):
        pairs = {token // 5: token % 5 for token in row[:4]}  # key -> value
        assert len(pairs) == 4  # distinct keys
        assert [pairs[token - 6 * 5] for token in row[4:]] == answers
    for kwargs, error, match in [(dict(pairs=7, keys=6), ValueError, "pairs"),
                                 (dict(size=0), ValueError, "size"),
                                 (dict(values=1.5), TypeError, "values")]:
        with pytest.raises(error, match=match):
            recall_batch(torch.Generator(), **kwargs)
    with pytest.raises(TypeError, match="generator"):
        recall_batch(0)


@pytest.mark.parametrize("kind", ["softmax", "window", "linear", "retention"])
def test_tiny_lm_compiles_whole(kind):
    from attnbook.efficient import TinyLM

    torch.manual_seed(0)
    model = TinyLM(20, 16, kind, window=3)
    idx = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # no graph break
    torch.testing.assert_close(compiled(idx), model(idx))


# --- checked once, at the entry point ------------------------------------------------------


def test_block_sparse_attention_checks_as_much_at_any_length():
    """Its checks do not grow with the tiles: it calls tile_layout's core, and no public
    function per tile row."""
    def calls(length, block):
        q = randn(1, 2, length, 16, dtype=torch.float32)
        mask = sliding_window_mask(length, length, 2 * block)
        layout = tile_layout(mask, block)
        return (check_calls(lambda: block_sparse_attention(q, q, q, mask, block)),
                check_calls(lambda: block_sparse_attention(q, q, q, layout=layout,
                                                           block_size=block, causal=True)))
    short, long = calls(256, 32), calls(1024, 32)
    assert short == long == calls(256, 16), (short, long)
    assert max(short) <= 27, short  # 31 when it called the public tile_layout


def test_performer_checks_its_inputs_once_and_reads_nothing_on_the_host(monkeypatch):
    """performer_attention runs the cores of random_features and linear_attention: no second
    check of q, k and v, and no check of its own features that reads them on the host."""
    q, k, v = (randn(1, 2, 64, 16, seed=s, dtype=torch.float32) for s in range(3))
    g = torch.Generator().manual_seed(0)
    linear = check_calls(lambda: linear_attention(q, k, v, True))
    performer = check_calls(lambda: performer_attention(q, k, v, 32, True, g))
    assert performer <= linear + 2, (performer, linear)  # + num_features, orthogonal - eps, chunk
    assert host_reads_during(lambda: performer_attention(q, k, v, 32, True, g), monkeypatch) == 0
    # the default feature map, elu + 1, is positive by construction: nothing to read either
    assert host_reads_during(lambda: linear_attention(q, k, v, True), monkeypatch) == 0


@pytest.mark.parametrize("fn", [
    lambda q, k, v: linear_attention(q, k, v, causal=True),
    lambda q, k, v: retention(q, k, v, 0.9, "chunkwise", 16),
    lambda q, k, v: retention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], 0.9),
    lambda q, k, v: block_sparse_attention(q, k, v, layout=torch.ones(1, 1, dtype=torch.bool),
                                           block_size=q.shape[2]),
])
def test_qkv_are_checked_by_one_validator_whose_cost_does_not_grow(fn):
    short, long = (check_calls(lambda n=n: fn(*(randn(2, 4, n, 8, seed=s) for s in range(3))))
                   for n in (16, 128))
    assert short == long, (short, long)
