"""attnbook.cost (chapter 12) against FlopCounterMode, nbytes, tracemalloc and autograd's graph."""

import time
import tracemalloc
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.attention import scaled_dot_product_attention
from attnbook.cost import (
    attention_flops,
    kv_cache_bytes_per_token,
    loglog_slope,
    numpy_peak_bytes,
    saved_tensor_bytes,
    score_matrix_bytes,
    time_call,
)
from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
from attnbook.gpt import GPT, GPTConfig
from attnbook.layers import MultiHeadAttention, attend
from attnbook.masks import causal_mask
from attnbook.notebook import flop_counter


def naive_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def counted_flops(fn, *args, **kwargs):
    with torch.no_grad(), flop_counter() as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


# --- attention_flops --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_attention_flops_matches_flop_counter(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, lq, lk, d, dv = (int(x) for x in torch.randint(1, 40, (6,), generator=g))
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, h, lk, d), torch.randn(b, h, lk, dv)
    expected = counted_flops(naive_attention, q, k, v)
    assert attention_flops(lq, lk, d, num_heads=h, batch=b, value_dim=dv) == expected
    # a mask applied after computing every score changes nothing in the count
    assert counted_flops(naive_attention, q, k, v, causal_mask(lq, lk)) == expected


def test_attention_flops_on_meta_tensors_at_long_lengths():
    for n in (8192, 65536):
        q = torch.empty(1, 12, n, 64, device="meta")
        assert attention_flops(n, n, 64, num_heads=12) == counted_flops(naive_attention, q, q, q)


@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 50), (50, 1), (7, 7), (5, 9), (9, 5),
                                   (128, 1000), (1000, 128)])
def test_causal_flops_count_the_pairs_causal_mask_allows(lq, lk):
    allowed = int(causal_mask(lq, lk).sum())
    assert attention_flops(lq, lk, 16, causal=True) == 2 * allowed * (16 + 16)
    assert attention_flops(lq, lk, 16, num_heads=3, batch=2, causal=True, value_dim=8) \
        == 2 * 2 * 3 * allowed * (16 + 8)


def test_doubling_the_length_quadruples_the_work():
    for n in (1, 3, 100, 4096):
        assert attention_flops(2 * n, 2 * n, 64) == 4 * attention_flops(n, n, 64)
        assert attention_flops(n, n, 64, causal=True) == 2 * n * (n + 1) * 64
    assert attention_flops(10, 20, 8) == attention_flops(10, 20, 8, value_dim=8)


# --- score_matrix_bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_score_matrix_bytes_matches_numpy_weights(dtype):
    rng = np.random.default_rng(0)
    for heads, lq, lk in [(1, 1, 1), (3, 17, 5), (2, 64, 200)]:
        Q = rng.standard_normal((heads, lq, 8)).astype(dtype)
        K = rng.standard_normal((heads, lk, 8)).astype(dtype)
        _, weights = scaled_dot_product_attention(Q, K, K)
        nbytes = score_matrix_bytes(lq, lk, heads, dtype_bytes=np.dtype(dtype).itemsize)
        assert weights.nbytes == nbytes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_score_matrix_bytes_matches_torch_weights(dtype):
    q, k = torch.randn(2, 4, 9, 8, dtype=dtype), torch.randn(2, 4, 33, 8, dtype=dtype)
    _, weights = attend(q, k, k)
    size = weights.element_size()
    assert weights.numel() * size == score_matrix_bytes(9, 33, 4, 2, dtype_bytes=size)


# --- kv_cache_bytes_per_token ---------------------------------------------------------------


def test_kv_cache_bytes_per_token_gpt3():
    per_token = kv_cache_bytes_per_token(96, 96, 128, dtype_bytes=2)
    assert per_token == 2 * 96 * 12288 * 2 == 4.5 * 2**20
    assert 2048 * per_token == 9 * 2**30


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_kv_cache_bytes_per_token_matches_projected_keys_and_values(kv_heads):
    layers, tokens = 3, 37
    modules = [MultiHeadAttention(64, 8, num_kv_heads=kv_heads) for _ in range(layers)]
    x = torch.randn(1, tokens, 64)
    with torch.no_grad():
        stored = sum(t.half().numel() * 2 for m in modules for t in (m.k_proj(x), m.v_proj(x)))
    assert stored == tokens * kv_cache_bytes_per_token(layers, kv_heads, 8, dtype_bytes=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_per_token_matches_gpt_cache(dtype):
    config = GPTConfig(vocab_size=50, context_length=64, d_model=48, num_layers=3, num_heads=4,
                       dropout=0.0)
    torch.manual_seed(0)
    model = GPT(config).eval().to(dtype)
    size = torch.finfo(dtype).bits // 8
    per_token = kv_cache_bytes_per_token(3, 4, 12, dtype_bytes=size)
    for prompt_len in (1, 17):
        cache = model.make_kv_cache(batch_size=2, capacity=prompt_len)
        with torch.no_grad():
            model(torch.randint(50, (2, prompt_len)), kv_cache=cache)
        assert cache.nbytes == 2 * prompt_len * per_token  # two sequences
    assert model.make_kv_cache(batch_size=1).nbytes == 64 * per_token  # the whole context


def test_kv_cache_bytes_per_token_matches_cross_attention_keys_and_values():
    torch.manual_seed(0)
    model = EncoderDecoder(EncoderDecoderConfig(
        src_vocab=20, tgt_vocab=20, d_model=32, num_heads=4, num_layers=1, num_decoder_layers=3,
        context_length=32, dropout=0.0)).eval()
    src = torch.randint(3, 20, (1, 25))
    with torch.no_grad():
        memory = model.encode(src)
        stored = sum(proj(memory).numel() * 4 for block in model.decoder
                     for proj in (block.cross_attn.k_proj, block.cross_attn.v_proj))
    assert stored == 25 * kv_cache_bytes_per_token(3, 4, 8, dtype_bytes=4)


# --- time_call and loglog_slope ---------------------------------------------------------------


def test_time_call_runs_warmup_and_repeats_and_returns_the_fastest():
    calls = []
    best = time_call(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and 0 <= best
    assert time_call(partial(time.sleep, 0.005), repeats=2) >= 0.005


def test_time_call_min_time_adds_runs():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002)

    time_call(work, repeats=1, warmup=0, min_time_s=0.02)
    assert len(calls) >= 2  # one run of >= 2 ms cannot fill 20 ms


@pytest.mark.parametrize("p", [-1.5, 0.0, 1.0, 2.0, 3.3])
def test_loglog_slope_recovers_a_power_law(p):
    x = np.array([3.0, 10.0, 100.0, 1000.0])
    assert loglog_slope(x, 2.5 * x**p) == pytest.approx(p, abs=1e-12)


def test_loglog_slope_matches_polyfit():
    rng = np.random.default_rng(1)
    x = np.geomspace(1, 1e4, 9)
    y = x**1.8 * np.exp(rng.normal(scale=0.2, size=x.size))
    assert loglog_slope(list(x), list(y)) == pytest.approx(np.polyfit(np.log(x), np.log(y), 1)[0])


# --- numpy_peak_bytes -----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 1000, 10**6])
def test_numpy_peak_bytes_of_an_array(size):
    array, peak = numpy_peak_bytes(partial(np.ones, size))
    assert array.nbytes <= peak < array.nbytes + 1024


def test_numpy_peak_bytes_counts_temporaries_and_nests():
    total, peak = numpy_peak_bytes(lambda: np.ones(10**6).sum())
    assert total == 10**6 and 8 * 10**6 <= peak < 8 * 10**6 + 1024
    tracemalloc.start()
    try:
        numpy_peak_bytes(partial(np.ones, 10**6))  # a big peak before...
        _, peak = numpy_peak_bytes(partial(np.ones, 10))  # ...must not leak into the next
        assert peak < 1024 and tracemalloc.is_tracing()
    finally:
        tracemalloc.stop()


def test_numpy_peak_bytes_nested_leaves_the_outer_peak_right():
    # 8 MB come and go, then an inner measurement of 80 kB: the outer peak keeps the 8 MB
    (_, inner), outer = numpy_peak_bytes(lambda: (np.ones(10**6).sum(),
                                                  numpy_peak_bytes(partial(np.ones, 10**4)))[1])
    assert 8 * 10**4 <= inner < 8 * 10**4 + 64 * 1024
    assert 8 * 10**6 <= outer < 8 * 10**6 + 64 * 1024
    assert not tracemalloc.is_tracing()


def test_numpy_peak_bytes_of_attention_is_three_score_matrices():
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((512, 32), dtype=np.float32) for _ in range(3))
    _, peak = numpy_peak_bytes(partial(scaled_dot_product_attention, Q, K, V))
    three = 3 * score_matrix_bytes(512, 512)
    assert three <= peak < three + 128 * 1024


# --- saved_tensor_bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("b,h,n", [(1, 1, 1), (1, 2, 64), (2, 3, 100)])
def test_saved_tensor_bytes_of_written_out_attention_is_the_weights(b, h, n):
    q, k, v = (torch.randn(b, h, n, 16, requires_grad=True) for _ in range(3))
    out, saved = saved_tensor_bytes(partial(naive_attention, q, k, v), exclude=(q, k, v))
    assert saved == score_matrix_bytes(n, n, h, b)
    assert out.shape == (b, h, n, 16)


def test_saved_tensor_bytes_of_fused_attention_is_linear():
    sizes = []
    for n in (128, 256, 512):
        q, k, v = (torch.randn(1, 2, n, 32, requires_grad=True) for _ in range(3))
        _, saved = saved_tensor_bytes(partial(F.scaled_dot_product_attention, q, k, v),
                                      exclude=(q, k, v))
        sizes.append(saved)
    assert sizes[1] == 2 * sizes[0] and sizes[2] == 2 * sizes[1]


def test_saved_tensor_bytes_without_grad_or_exclusions():
    q = torch.randn(1, 1, 50, 8)
    assert saved_tensor_bytes(partial(naive_attention, q, q, q))[1] == 0  # nothing needs grad
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(5, 8)
    _, saved = saved_tensor_bytes(lambda: (x @ w).sum())
    assert saved == x.numel() * 4  # mm saves its input x (w only for x's gradient, not needed)


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: attention_flops(0, 4, 8), ValueError, "q_len"),
    (lambda: attention_flops(4, -1, 8), ValueError, "k_len"),
    (lambda: attention_flops(4, 4, 2.0), TypeError, "head_dim"),
    (lambda: attention_flops(4, 4, 8, num_heads=True), TypeError, "num_heads"),
    (lambda: attention_flops(4, 4, 8, batch=0), ValueError, "batch"),
    (lambda: attention_flops(4, 4, 8, value_dim=0), ValueError, "value_dim"),
    (lambda: attention_flops(4, 4, 8, causal=1), TypeError, "causal"),
    (lambda: score_matrix_bytes(4, 4, dtype_bytes=0), ValueError, "dtype_bytes"),
    (lambda: score_matrix_bytes(4, "4"), TypeError, "k_len"),
    (lambda: score_matrix_bytes(4, 4, num_heads=0), ValueError, "num_heads"),
    (lambda: kv_cache_bytes_per_token(0, 8, 64), ValueError, "num_layers"),
    (lambda: kv_cache_bytes_per_token(2, 0, 64), ValueError, "num_kv_heads"),
    (lambda: kv_cache_bytes_per_token(2, 8, 6.5), TypeError, "head_dim"),
    (lambda: kv_cache_bytes_per_token(2, 8, 64, dtype_bytes=0), ValueError, "dtype_bytes"),
    (lambda: time_call(42), TypeError, "fn"),
    (lambda: time_call(print, repeats=0), ValueError, "repeats"),
    (lambda: time_call(print, warmup=-1), ValueError, "warmup"),
    (lambda: time_call(print, min_time_s=-1.0), ValueError, "min_time_s"),
    (lambda: loglog_slope([1, 2], [1, 2, 3]), ValueError, "same length"),
    (lambda: loglog_slope([1], [1]), ValueError, "x must"),
    (lambda: loglog_slope([1, 0], [1, 2]), ValueError, "x must"),
    (lambda: loglog_slope([1, 2], [1, -2]), ValueError, "y must"),
    (lambda: loglog_slope([2, 2], [1, 2]), ValueError, "x must"),
    (lambda: numpy_peak_bytes(None), TypeError, "fn"),
    (lambda: saved_tensor_bytes("f"), TypeError, "fn"),
    (lambda: saved_tensor_bytes(print, exclude=[np.ones(2)]), TypeError, "exclude"),
    (lambda: saved_tensor_bytes(print, exclude=5), TypeError, "^exclude must be"),  # was raw
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- No silent wrong answers -------------------------------------------------------


def test_numpy_peak_bytes_nested_keeps_the_outer_peak():
    """An inner measurement resets tracemalloc's peak; the outer one must still see its own."""
    def outer():
        np.ones(10**6).sum()  # 8 MB, freed before the inner measurement starts
        return numpy_peak_bytes(partial(np.ones, 10**4))[1]

    inner_peak, outer_peak = numpy_peak_bytes(outer)
    assert 8 * 10**4 <= inner_peak < 8 * 10**4 + 1024
    assert 8 * 10**6 <= outer_peak < 8 * 10**6 + 1024 and outer_peak >= inner_peak
    # an inner peak larger than anything before it counts for the outer one too
    inner_peak, outer_peak = numpy_peak_bytes(
        lambda: numpy_peak_bytes(lambda: np.ones(10**6).sum())[1])
    assert 8 * 10**6 <= inner_peak <= outer_peak < 8 * 10**6 + 2048
    assert not tracemalloc.is_tracing()


@pytest.mark.parametrize("device", ["tpu:x", 3.5] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_time_call_checks_its_device(device):
    with pytest.raises((TypeError, ValueError), match="device"):
        time_call(print, device=device)


def test_saved_tensor_bytes_refuses_meta_tensors():
    # every meta block's address is 0, so all saved tensors merged into one: 0 bytes counted on
    # meta where the same call on the CPU counts the softmax's output
    def scores(q, k):
        return torch.softmax(q @ k.T, dim=-1).exp().sum()

    q, k = (torch.randn(64, 64, requires_grad=True) for _ in range(2))
    assert saved_tensor_bytes(partial(scores, q, k), exclude=(q,))[1] > 0
    q, k = (torch.empty(64, 64, device="meta", requires_grad=True) for _ in range(2))
    with pytest.raises(ValueError, match="meta device"):
        saved_tensor_bytes(partial(scores, q, k), exclude=(q,))


def test_saved_tensor_bytes_excludes_a_module_s_parameters_given_as_a_generator():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    kept = saved_tensor_bytes(lambda: layer(x).sum(), exclude=layer.parameters())[1]
    assert kept == saved_tensor_bytes(lambda: layer(x).sum(), exclude=list(layer.parameters()))[1]
