"""attnbook.tiling (chapters 13 and 14) against chapter 1, PyTorch and closed-form block counts."""

import dataclasses
import math
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.attention import scaled_dot_product_attention, softmax
from attnbook.cost import attention_flops
from attnbook.tiling import (
    GPUS,
    GPUSpec,
    attention_bytes,
    attention_traffic,
    block_schedule,
    find_gpu,
    flash_attention_numpy,
    kernel_query_rows,
    online_softmax,
    online_softmax_update,
    roofline_seconds,
    schedule_flops,
)


def causal_mask(lq, lk):
    """Bottom-right aligned: query i may see key j iff j <= i + (lk - lq)."""
    return np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq)


def reference(Q, K, V, causal=False, scale=None):
    mask = causal_mask(Q.shape[-2], K.shape[-2]) if causal else None
    return scaled_dot_product_attention(Q, K, V, mask=mask, scale=scale)[0]


def torch_reference(Q, K, V, mask=None, scale=None):
    q, k, v = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in (Q, K, V))
    m = None if mask is None else torch.from_numpy(mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale).numpy()


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        yield


# --- online softmax -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_online_softmax_matches_two_pass_softmax(seed):
    rng = np.random.default_rng(seed)
    shape = (*rng.integers(1, 4, size=rng.integers(0, 3)), int(rng.integers(1, 300)))
    x = rng.normal(scale=10.0 ** rng.integers(-1, 3), size=shape)
    for block in (1, 3, 64, 1000):
        np.testing.assert_allclose(online_softmax(x, block), softmax(x), rtol=1e-13, atol=1e-300)


def test_online_softmax_update_equals_two_pass_on_every_prefix():
    rng = np.random.default_rng(7)
    x = rng.normal(scale=5.0, size=(3, 50))
    m, l = np.full(3, -np.inf), np.zeros(3)
    for start in range(0, 50, 7):
        m, l = online_softmax_update(m, l, x[:, start:start + 7])
        seen = x[:, :start + 7]
        np.testing.assert_array_equal(m, seen.max(axis=1))
        np.testing.assert_allclose(l, np.exp(seen - seen.max(axis=1, keepdims=True)).sum(1),
                                   rtol=1e-14)


def test_online_softmax_forbidden_rows_and_huge_scores(no_warnings):
    x = np.array([[1000.0, -np.inf, 1001.0, 999.0, -np.inf], [-np.inf] * 5])
    out = online_softmax(x, block_size=2)
    np.testing.assert_allclose(out[0], softmax(x[0]), rtol=1e-15)
    np.testing.assert_array_equal(out[1], np.zeros(5))
    # a block of -inf arriving first leaves (m, l) = (-inf, 0)
    m, l = online_softmax_update(-np.inf, 0.0, np.array([-np.inf, -np.inf]))
    assert m == -np.inf and l == 0.0


# --- flash_attention_numpy ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_flash_matches_chapter_1_random_shapes(seed):
    rng = np.random.default_rng(100 + seed)
    batch = tuple(int(n) for n in rng.integers(1, 4, size=rng.integers(0, 3)))
    lq, lk, d, dv = (int(n) for n in rng.integers(1, 150, size=4))
    Q, K = rng.normal(size=(*batch, lq, d)), rng.normal(size=(*batch, lk, d))
    V = rng.normal(size=(*batch, lk, dv))
    causal = bool(seed % 2)
    block = int(rng.choice([1, 5, 16, 64, 200])) if lq * lk < 5000 else int(rng.choice([16, 64]))
    scale = None if seed % 3 else float(rng.uniform(0.1, 2.0))
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        ours = flash_attention_numpy(Q, K, V, causal=causal, block_size=block, scale=scale)
    assert ours.shape == (*batch, lq, dv) and ours.dtype == np.float64
    np.testing.assert_allclose(ours, reference(Q, K, V, causal, scale), atol=1e-12)


@pytest.mark.parametrize("lq, lk", [(70, 130), (130, 70), (64, 64), (65, 63), (1, 100), (100, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_matches_torch_when_every_row_has_a_key(lq, lk, causal):
    rng = np.random.default_rng(lq * 1000 + lk)
    Q, K, V = rng.normal(size=(2, lq, 8)), rng.normal(size=(2, lk, 8)), rng.normal(size=(2, lk, 3))
    mask = causal_mask(lq, lk) if causal else None
    ours = flash_attention_numpy(Q, K, V, causal=causal, block_size=16)
    rows = slice(None) if mask is None else mask.any(axis=1)  # torch: rows without keys differ
    np.testing.assert_allclose(ours[:, rows], torch_reference(Q, K, V, mask)[:, rows], atol=1e-12)


@pytest.mark.parametrize("block", [1, 2, 3, 4, 8])
def test_rows_with_no_allowed_key_are_zero_without_warnings(block, no_warnings):
    rng = np.random.default_rng(block)
    lq, lk = 11, 4
    Q, K, V = rng.normal(size=(lq, 6)), rng.normal(size=(lk, 6)), rng.normal(size=(lk, 2))
    out = flash_attention_numpy(Q, K, V, causal=True, block_size=block)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[: lq - lk], 0.0)
    np.testing.assert_allclose(out, reference(Q, K, V, causal=True), atol=1e-12)


def test_block_size_does_not_change_the_result():
    rng = np.random.default_rng(3)
    Q, K, V = rng.normal(size=(37, 8)), rng.normal(size=(53, 8)), rng.normal(size=(53, 5))
    outs = [flash_attention_numpy(Q, K, V, causal=True, block_size=b) for b in (1, 7, 37, 53, 999)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], atol=1e-14)


def test_length_one_and_empty_queries():
    rng = np.random.default_rng(4)
    V = rng.normal(size=(1, 3))
    out = flash_attention_numpy(rng.normal(size=(1, 4)), rng.normal(size=(1, 4)), V, causal=True)
    np.testing.assert_allclose(out, V)
    empty = flash_attention_numpy(np.ones((0, 4)), np.ones((5, 4)), np.ones((5, 2)))
    assert empty.shape == (0, 2)


def test_leading_dimensions_broadcast():
    rng = np.random.default_rng(5)
    Q = rng.normal(size=(2, 3, 20, 8))
    K, V = rng.normal(size=(1, 1, 30, 8)), rng.normal(size=(2, 1, 30, 4))  # shared across heads
    ours = flash_attention_numpy(Q, K, V, causal=True, block_size=8)
    assert ours.shape == (2, 3, 20, 4)
    np.testing.assert_allclose(ours, reference(Q, K, V, causal=True), atol=1e-12)


def test_dtypes():
    rng = np.random.default_rng(6)
    Q, K, V = rng.normal(size=(40, 16)), rng.normal(size=(50, 16)), rng.normal(size=(50, 16))
    expected = reference(Q, K, V)
    for dtype, tolerance in [(np.float32, 1e-5), (np.float16, 5e-3)]:
        ours = flash_attention_numpy(*(a.astype(dtype) for a in (Q, K, V)), block_size=16)
        assert ours.dtype == dtype
        np.testing.assert_allclose(ours.astype(np.float64), expected, atol=tolerance)
    ints = [np.arange(12).reshape(3, 4) % 3] * 3
    np.testing.assert_allclose(flash_attention_numpy(*ints, block_size=2), reference(*ints))


def test_large_scores_do_not_overflow(no_warnings):
    rng = np.random.default_rng(8)
    Q, K = 100 * rng.normal(size=(30, 16)), 100 * rng.normal(size=(45, 16))
    V = rng.normal(size=(45, 2))
    np.testing.assert_allclose(flash_attention_numpy(Q, K, V, block_size=8), reference(Q, K, V),
                               atol=1e-12)


def test_peak_memory_is_linear_not_quadratic():
    rng = np.random.default_rng(9)
    n, block = 1024, 64
    Q, K, V = (rng.normal(size=(n, 32)) for _ in range(3))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    out = flash_attention_numpy(Q, K, V, block_size=block)
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    # the output plus a few tiles; one n x n float64 matrix alone would be 8 MB
    assert peak < out.nbytes + 6 * block * block * 8
    assert peak < n * n * 8 / 10


# --- the causal block schedule --------------------------------------------------------------


def tiles_from_the_mask(lq, lk, block):
    mask, tiles = causal_mask(lq, lk), []
    for q0 in range(0, lq, block):
        for k0 in range(0, lk, block):
            tile = mask[q0:q0 + block, k0:k0 + block]
            if tile.any():
                tiles.append((q0, min(q0 + block, lq), k0, min(k0 + block, lk), not tile.all()))
    return tiles


@pytest.mark.parametrize("block", [1, 2, 3, 5, 16])
def test_schedule_equals_the_tiles_read_off_the_mask(block):
    for lq in range(1, 25):
        for lk in range(1, 25):
            assert block_schedule(lq, lk, block, causal=True) == tiles_from_the_mask(lq, lk, block)


@pytest.mark.parametrize("n_blocks, block", [(1, 64), (4, 64), (16, 64), (33, 8), (10, 7)])
def test_causal_tile_counts_closed_form(n_blocks, block):
    N = n_blocks * block
    schedule = block_schedule(N, N, block, causal=True)
    assert len(schedule) == n_blocks * (n_blocks + 1) // 2
    assert sum(t[-1] for t in schedule) == n_blocks  # only the diagonal needs the mask
    assert len(block_schedule(N, N, block)) == n_blocks**2
    # offset a multiple of the block: query block i needs key blocks 0..i + offset / block
    schedule = block_schedule(N, N + 3 * block, block, causal=True)
    assert len(schedule) == n_blocks * (n_blocks + 1) // 2 + 3 * n_blocks


def test_decoding_query_sees_every_tile_unmasked():
    schedule = block_schedule(1, 1000, 64, causal=True)
    assert len(schedule) == 16 and not any(t[-1] for t in schedule)


# --- bad input ------------------------------------------------------------------------------

OK = {"Q": np.ones((3, 8)), "K": np.ones((4, 8)), "V": np.ones((4, 2))}

BAD_BLOCK_SIZES = [
    (0, ValueError, "block_size must be at least 1, got block_size=0"),
    (-3, ValueError, "block_size must be at least 1, got block_size=-3"),
    (2.5, TypeError, "block_size must be an int, got block_size=2.5"),
    ("8", TypeError, "block_size must be an int, got block_size='8'"),
    (True, TypeError, "block_size must be an int, got block_size=True"),
    (None, TypeError, "block_size must be an int, got block_size=None"),
]


@pytest.mark.parametrize("value, error, message", BAD_BLOCK_SIZES)
def test_bad_block_size(value, error, message):
    with pytest.raises(error, match=message):
        flash_attention_numpy(**OK, block_size=value)
    with pytest.raises(error, match=message):
        online_softmax(np.ones(5), block_size=value)
    with pytest.raises(error, match=message):
        block_schedule(4, 4, block_size=value)


def test_numpy_integer_block_size_is_accepted():
    out = flash_attention_numpy(**OK, block_size=np.int64(2))
    np.testing.assert_allclose(out, reference(OK["Q"], OK["K"], OK["V"]))


BAD_SHAPES = [
    ({"Q": (3, 8), "K": (4, 6), "V": (4, 2)}, r"Q has shape \(3, 8\), K has shape \(4, 6\)"),
    ({"Q": (3, 8), "K": (4, 8), "V": (5, 2)}, r"K has shape \(4, 8\), V has shape \(5, 2\)"),
    ({"Q": (8,), "K": (4, 8), "V": (4, 2)}, r"Q must have at least 2 dimensions.*\(8,\)"),
    ({"Q": (3, 8), "K": (0, 8), "V": (0, 2)}, r"K must have at least one key.*\(0, 8\)"),
    ({"Q": (2, 3, 8), "K": (3, 4, 8), "V": (3, 4, 2)},
     r"Q has shape \(2, 3, 8\), K has shape \(3, 4, 8\)"),
]


@pytest.mark.parametrize("shapes, message", BAD_SHAPES)
def test_bad_shapes_name_the_shapes(shapes, message):
    arrays = {name: np.ones(shape) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=message):
        flash_attention_numpy(**arrays)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: flash_attention_numpy(OK["Q"], OK["K"], np.array([["a", "b"]] * 4)),
         TypeError, "V must hold real numbers"),
        (lambda: online_softmax(np.array(["a", "b"])), TypeError, "x must hold real numbers"),
        (lambda: online_softmax(np.float64(3.0)), ValueError, r"x must have at least 1 dim.*\(\)"),
        (lambda: block_schedule(-1, 4), ValueError, "Lq must be at least 0, got Lq=-1"),
        (lambda: block_schedule(4, 2.0), TypeError, "Lk must be an int, got Lk=2.0"),
        (lambda: block_schedule(4, 4, causal="no"), TypeError,
         "causal must be True or False, got causal='no'"),
        (lambda: block_schedule(4, 4, causal=1), TypeError, "causal must be True or False"),
        (lambda: flash_attention_numpy(**OK, causal="no"), TypeError,
         "causal must be True or False, got causal='no'"),
        (lambda: flash_attention_numpy(**OK, causal=None), TypeError,
         "causal must be True or False"),
        (lambda: flash_attention_numpy(**OK, scale="a"), TypeError,
         "scale must be a real number, got scale='a'"),
        (lambda: flash_attention_numpy(**OK, scale=float("nan")), ValueError,
         "scale must be a finite number.*got scale=nan"),
        (lambda: flash_attention_numpy(np.ones((3, 0)), np.ones((5, 0)), np.ones((5, 2))),
         ValueError, r"dk >= 1.*Q has shape \(3, 0\), K has shape \(5, 0\)"),
        (lambda: flash_attention_numpy(np.arange(4), np.ones((5, 4)), np.ones((5, 2))),
         ValueError, r"Q must have at least 2 dimensions.*\(4,\)"),
        (lambda: online_softmax_update(-np.inf, 0.0, np.float64(1.0)), ValueError,
         r"block must have at least 1 dimension, got shape \(\)"),
        (lambda: online_softmax_update(-np.inf, 0.0, np.array(["a"])), TypeError,
         "block must hold real numbers"),
    ],
)
def test_other_bad_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_numpy_bools_and_scalar_scales_are_accepted():
    rng = np.random.default_rng(11)
    Q, K, V = rng.normal(size=(5, 8)), rng.normal(size=(7, 8)), rng.normal(size=(7, 3))
    for causal in (np.bool_(True), np.bool_(False)):
        np.testing.assert_allclose(flash_attention_numpy(Q, K, V, causal=causal, block_size=2),
                                   reference(Q, K, V, causal=bool(causal)), atol=1e-12)
        assert block_schedule(5, 7, 2, causal) == block_schedule(5, 7, 2, bool(causal))
    np.testing.assert_allclose(flash_attention_numpy(Q, K, V, scale=np.float32(0.5)),
                               reference(Q, K, V, scale=0.5), atol=1e-12)


# --- No silent wrong answers ------------------------------------------------------


@pytest.mark.parametrize("where", ["Q", "K"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("block", [2, 64])
def test_non_finite_queries_or_keys_give_nan_as_in_torch(where, bad, block):
    rng = np.random.default_rng(12)
    arrays = {"Q": rng.normal(size=(6, 4)), "K": rng.normal(size=(5, 4)),
              "V": rng.normal(size=(5, 3))}
    arrays[where][1 if where == "Q" else 3, 0] = bad
    with np.errstate(invalid="ignore"):
        ours = flash_attention_numpy(**arrays, block_size=block)
        expected = torch_reference(**arrays)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(expected))  # never a row of zeros
    assert np.isnan(ours).any()
    np.testing.assert_allclose(ours[~np.isnan(ours)], expected[~np.isnan(expected)], atol=1e-12)


@pytest.mark.parametrize("where", ["K", "V"])
@pytest.mark.parametrize("lq, lk", [(9, 9), (12, 7), (5, 11)])
def test_every_row_that_may_see_a_nan_is_nan_at_every_block_size(where, lq, lk):
    # Rows the causal mask hides the NaN from may be NaN or not (by tile, by backend); the rows
    # that may see it are NaN everywhere: here, at every block size and in PyTorch.
    rng = np.random.default_rng(14)
    arrays = {"Q": rng.normal(size=(lq, 4)), "K": rng.normal(size=(lk, 4)),
              "V": rng.normal(size=(lk, 3))}
    j = lk - 2  # a late key: the rows before row j + lq - lk may not see it
    arrays[where][j] = np.nan
    sees = np.arange(lq) + (lk - lq) >= j  # query i sees key j iff j <= i + lk - lq
    with np.errstate(invalid="ignore"):
        assert np.isnan(torch_reference(**arrays, mask=causal_mask(lq, lk))[sees]).all()
        assert np.isnan(reference(**arrays, causal=True)[sees]).all()  # chapter 1's
        for block in range(1, lq + 2):
            ours = flash_attention_numpy(**arrays, causal=True, block_size=block)
            assert np.isnan(ours[sees]).all(), block


def test_nan_with_a_causal_mask_keeps_dead_rows_zero():
    rng = np.random.default_rng(13)
    Q, K, V = rng.normal(size=(8, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 2))
    K[0, 0] = np.nan  # every live query sees key 0
    with np.errstate(invalid="ignore"):
        out = flash_attention_numpy(Q, K, V, causal=True, block_size=2)
    assert (out[:5] == 0).all()  # the first Lq - Lk queries see no key: zeros, the convention
    assert np.isnan(out[5:]).all()


def test_scores_that_overflow_float32_give_nan():
    Q, K = np.full((3, 4), 1e20, np.float32), np.full((5, 4), 1e20, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = flash_attention_numpy(Q, K, np.ones((5, 2), np.float32), block_size=2)
    assert np.isnan(out).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_online_softmax_of_non_finite_scores_is_nan(bad):
    x = np.array([[0.0, 1.0, bad, 2.0], [0.0, 1.0, 3.0, 2.0]])
    with np.errstate(invalid="ignore"):
        out = online_softmax(x, block_size=2)
    assert np.isnan(out[0]).all()
    np.testing.assert_allclose(out[1], softmax(x[1]), rtol=1e-14)


def test_float16_running_sums_are_float32():
    # a float16 sum stops growing at 2048 (adding 1 rounds back): 1 / 2048 = 4.9e-4
    out = online_softmax(np.zeros(5000, np.float16), block_size=1)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), 1 / 5000, rtol=1e-3)
    m, l = -np.inf, 0.0
    for _ in range(5000):
        m, l = online_softmax_update(m, l, np.zeros(1, np.float16))
    assert l == 5000 and np.asarray(l).dtype == np.float32


def test_a_float64_state_stays_float64_beside_a_float32_block():
    # Before, the state was rounded to the block's float32 and lost the 1e-9.
    m, l = np.array([1.0 + 1e-9]), np.array([1.0 + 1e-9])
    m2, l2 = online_softmax_update(m, l, np.array([[-50.0]], np.float32))
    assert m2.dtype == l2.dtype == np.float64
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_allclose(l2, l + np.exp(-50.0 - m), rtol=1e-15)  # the formula
    # np.float64 is a subclass of float: it was taken for a Python number and rounded to float32
    m3, l3 = online_softmax_update(np.float64(-np.inf), np.float64(0.0), np.ones(3, np.float32))
    assert m3.dtype == l3.dtype == np.float64


def test_empty_blocks_and_rows():
    assert online_softmax(np.zeros((3, 0))).shape == (3, 0)
    m, l = online_softmax_update(np.array([1.0]), np.array([2.0]), np.zeros((1, 0)))
    assert m.tolist() == [1.0] and l.tolist() == [2.0]


def test_no_private_names_of_other_modules_are_imported():
    import ast
    import inspect

    from attnbook import tiling

    for node in ast.walk(ast.parse(inspect.getsource(tiling))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnbook"):
            assert not [a.name for a in node.names if a.name.startswith("_")], node.module


# --- memory traffic, FLOPs and the roofline ------------------------------------------------


def visited_pairs(lq, lk, bq, bk, causal):
    """(query rows, key rows, scores) of each tile pair a kernel must visit, read off the mask."""
    mask = causal_mask(lq, lk) if causal else np.ones((lq, lk), bool)
    return [(min(q0 + bq, lq) - q0, min(k0 + bk, lk) - k0,
             int(mask[q0:q0 + bq, k0:k0 + bk].size))
            for q0 in range(0, lq, bq) for k0 in range(0, lk, bk)
            if mask[q0:q0 + bq, k0:k0 + bk].any()]


SHAPES = [(1, 1, 1, 1), (1, 9, 4, 4), (9, 1, 4, 4), (100, 100, 16, 16), (77, 130, 16, 7),
          (130, 77, 5, 32), (64, 64, 64, 64), (65, 63, 64, 16), (50, 50, 200, 200)]


@pytest.mark.parametrize("lq, lk, bq, bk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_traffic_equals_the_tiles_read_off_the_mask(lq, lk, bq, bk, causal):
    d, pairs = 8, visited_pairs(lq, lk, bq, bk, causal)
    key_rows, query_rows = sum(p[1] for p in pairs), sum(p[0] for p in pairs)
    forward = attention_traffic(lq, lk, d, causal=causal, block_q=bq, block_k=bk, itemsize=2)
    assert forward == {"Q": 2 * lq * d, "K": 2 * key_rows * d, "V": 2 * key_rows * d,
                       "O": 2 * lq * d, "lse": 4 * lq}
    backward = attention_traffic(lq, lk, d, causal=causal, backward=True, block_q=bq,
                                 block_k=bk, itemsize=4)
    assert backward["dO"] == 4 * d * (2 * lq + query_rows)
    assert backward["K"] == backward["V"] == 4 * d * (lk + key_rows)
    assert backward["Q"] == 4 * d * (lq + query_rows) and backward["lse"] == 4 * (lq + query_rows)
    assert backward["dQ"] == 4 * lq * d and backward["dK"] == backward["dV"] == 4 * lk * d
    assert attention_bytes(lq, lk, d, causal=causal, block_q=bq, block_k=bk) == sum(
        forward.values())
    scores = sum(p[2] for p in pairs)
    assert schedule_flops(lq, lk, d, causal=causal, block_q=bq, block_k=bk) == 4 * d * scores
    assert schedule_flops(lq, lk, d, causal=causal, backward=True, block_q=bq,
                          block_k=bk) == 14 * d * scores


@pytest.mark.parametrize("seed", range(6))
def test_the_tally_of_flash_attention_numpy_equals_the_count(seed):
    rng = np.random.default_rng(200 + seed)
    batch = tuple(int(n) for n in rng.integers(1, 3, size=rng.integers(0, 3)))
    lq, lk, d = (int(n) for n in rng.integers(1, 90, size=3))
    block, causal = int(rng.choice([1, 3, 16, 64, 100])), bool(seed % 2)
    Q, K = rng.normal(size=(*batch, lq, d)), rng.normal(size=(*batch, lk, d))
    V = rng.normal(size=(*batch, lk, d))
    tally = {"K": 5}  # a tally adds to what is there
    out = flash_attention_numpy(Q, K, V, causal=causal, block_size=block, tally=tally)
    np.testing.assert_array_equal(out, flash_attention_numpy(Q, K, V, causal, block))
    counted = attention_traffic(lq, lk, d, causal=causal, block_q=block, block_k=block,
                                itemsize=1)
    heads = math.prod(batch)
    assert tally == {"Q": heads * counted["Q"], "K": 5 + heads * counted["K"],
                     "V": heads * counted["V"], "O": heads * counted["O"]}


def test_traffic_closed_forms():
    n, d, b = 4096, 64, 64
    naive = attention_traffic(n, n, d, "naive", itemsize=2)
    assert naive["S"] == naive["P"] == 2 * 2 * n * n
    assert attention_traffic(n, n, d, "naive", causal=True) == naive  # written whole
    naive_bwd = attention_traffic(n, n, d, "naive", backward=True, itemsize=2)
    assert naive_bwd["P"] + naive_bwd["dP"] + naive_bwd["dS"] == 7 * 2 * n * n
    tiled = attention_traffic(n, n, d, block_q=b, block_k=b)
    assert tiled["K"] == (n // b) * n * d * 2
    once = attention_traffic(n, n, d, block_q=n, block_k=n)
    assert once["K"] == n * d * 2 and sum(once.values()) == 4 * n * d * 2 + 4 * n
    # causal: query tile i loads key tiles 0..i
    causal = attention_traffic(n, n, d, causal=True, block_q=b, block_k=b)
    assert causal["K"] == (n // b) * (n // b + 1) // 2 * b * d * 2
    # more queries than keys, causal: the first query tiles see no key and load none
    assert attention_traffic(200, 10, 4, causal=True, block_q=10, block_k=10)["K"] == 10 * 4 * 2
    assert schedule_flops(n, n, d, "naive", causal=True) == attention_flops(n, n, d)
    assert schedule_flops(n, n, d) == attention_flops(n, n, d)
    assert schedule_flops(n, n, d, "naive", backward=True) == 2 * attention_flops(n, n, d)
    assert schedule_flops(n, n, d, causal=True) > attention_flops(n, n, d, causal=True)


def test_gpus_and_the_roofline():
    for key, gpu in GPUS.items():
        assert find_gpu(f"NVIDIA {key.lower()}-SXM") is gpu and isinstance(gpu, GPUSpec)
        ridge = gpu.peak_flops(2) / gpu.bandwidth
        compute_binds = roofline_seconds(2 * ridge, 1.0, key)
        assert math.isclose(compute_binds, 2 / gpu.bandwidth, rel_tol=1e-12)
        assert roofline_seconds(0.5 * ridge, 1.0, gpu) == 1 / gpu.bandwidth  # memory binds
        assert roofline_seconds(1e9, 0, gpu, itemsize=4) == 1e9 / gpu.fp32_flops
        assert gpu.fp32_flops < gpu.fp16_flops
    assert find_gpu("Tesla T4") is GPUS["T4"]
    assert find_gpu("NVIDIA A100-SXM4-80GB") is GPUS["A100"]
    assert roofline_seconds(0, 0, "H100") == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPUS["T4"].bandwidth = 1.0


def test_kernel_query_rows_are_chapter_15s_forward_tiles():
    # chapter 14 counts chapter 15's kernel with these tiles: its launch table's first entry,
    # which depends on the head size (at 128 the A100 takes 128 rows, not 64)
    launch_settings = pytest.importorskip("attnbook.kernels").launch_settings
    capability = {"T4": 75, "A100": 80, "H100": 90, "H200": 90}
    assert sorted(GPUS) == sorted(capability)
    for key in GPUS:
        for d in (16, 32, 64, 128):
            rows = launch_settings("forward", 2, d, capability[key])[0][0]
            assert kernel_query_rows(key, d) == rows, (key, d)
    assert kernel_query_rows("A100", 64) == 64 and kernel_query_rows("A100", 128) == 128


@pytest.mark.parametrize(
    "gpu, d, message",
    [
        ("V100", 64, "gpu must be one of ['A100', 'H100', 'H200', 'T4'], got gpu='V100'"),
        ("T4", 0, "d must be at least 1, got d=0"),
        *[("H100", d, f"d must be 16, 32, 64 or 128 (the head sizes of chapter 15's kernel), "
                      f"got d={d}") for d in (256, 65, 3)],  # 65 and 3 were given 128's tile
    ],
)
def test_kernel_query_rows_refuses_what_chapter_15_has_no_tile_for(gpu, d, message):
    with pytest.raises(ValueError) as raised:
        kernel_query_rows(gpu, d)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: attention_traffic(0, 4, 8), ValueError, "Lq must be at least 1, got Lq=0"),
        (lambda: attention_traffic(4, 4.0, 8), TypeError, "Lk must be an int, got Lk=4.0"),
        (lambda: attention_traffic(4, 4, True), TypeError, "d must be an int, got d=True"),
        (lambda: attention_traffic(4, 4, 8, "flash"), ValueError,
         r"method must be one of \['naive', 'tiled'\], got method='flash'"),
        (lambda: attention_traffic(4, 4, 8, causal=1), TypeError, "causal must be True or False"),
        (lambda: attention_traffic(4, 4, 8, backward="no"), TypeError,
         "backward must be True or False"),
        (lambda: attention_traffic(4, 4, 8, block_q=0), ValueError, "block_q must be at least 1"),
        (lambda: attention_bytes(4, 4, 8, block_k=None), TypeError, "block_k must be an int"),
        (lambda: attention_traffic(4, 4, 8, itemsize=0), ValueError, "itemsize must be at least"),
        (lambda: schedule_flops(4, 4, 8, method=None), TypeError, "method must be one of"),
        (lambda: find_gpu("NVIDIA V100"), ValueError,
         "device_name must name one of .*, got device_name='NVIDIA V100'"),
        (lambda: find_gpu(3), TypeError, "device_name must be an instance of str"),
        (lambda: find_gpu("NVIDIA A100-PCIE-40GB"), ValueError, "is a PCIE board"),
        (lambda: find_gpu("NVIDIA A100-SXM4-40GB"), ValueError, "is a 40GB board"),
        (lambda: find_gpu("NVIDIA H100 PCIe"), ValueError, "is a PCIE board, whose peaks"),
        (lambda: find_gpu("NVIDIA H100 NVL"), ValueError, "is a NVL board"),
        (lambda: find_gpu("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), ValueError,
         "device_name='NVIDIA H100 80GB HBM3 MIG 1g.10gb' is a MIG slice, which has a share"),
        (lambda: find_gpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb"), ValueError, "is a MIG slice"),
        (lambda: roofline_seconds(-1, 1, "T4"), ValueError, "flops must be a finite number"),
        (lambda: roofline_seconds(1, float("nan"), "T4"), ValueError,
         "bytes_moved must be a finite number"),
        (lambda: roofline_seconds(1, 1, "V100"), ValueError, "gpu must be one of"),
        (lambda: roofline_seconds(1, 1, 3), TypeError, "gpu must be an instance of GPUSpec"),
        (lambda: roofline_seconds(1, 1, "T4", itemsize=8), ValueError,
         "itemsize must be 2 or 4, got itemsize=8"),
        (lambda: GPUS["A100"].peak_flops(2.0), TypeError, "itemsize must be an int"),
        (lambda: flash_attention_numpy(**OK, tally={"Q": "0"}), TypeError,
         "tally\\['Q'\\] must be an int, got tally\\['Q'\\]='0'"),
        (lambda: flash_attention_numpy(**OK, tally=[]), TypeError,
         "tally must be an instance of dict, got tally=\\[\\]"),
    ],
)
def test_bad_traffic_and_roofline_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name,key", [
    ("Tesla T4", "T4"), ("NVIDIA T4", "T4"), ("nvidia t4", "T4"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB HBM2e", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100-SXM5-80GB", "H100"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 141GB HBM3e", "H200"),
    ("NVIDIA T400", None), ("NVIDIA T400 4GB", None), ("NVIDIA RTX A1000", None),
    ("NVIDIA RTX A1000 6GB Laptop GPU", None), ("NVIDIA GH200 480GB", None),
    ("Tesla T40", None), ("NVIDIA H1000", None), ("NVIDIA XA100", None),
])
def test_find_gpu_matches_whole_model_names(name, key):
    """A key inside a longer model name ("T400", "RTX A1000") is another GPU, whose
    peaks are not the key's (4x to 25x off): refused, naming the GPU."""
    if key is None:
        with pytest.raises(ValueError, match=f"got device_name='{name}'"):
            find_gpu(name)
    else:
        assert find_gpu(name) is GPUS[key]


@pytest.mark.parametrize("m,l,error,match", [
    (np.zeros(3), np.zeros(2), ValueError, r"m must have shape \(2,\), block's rows, got shape \(3,\)"),
    (np.zeros(2), np.zeros((2, 1)), ValueError, r"l must have shape \(2,\), block's rows"),
    (np.zeros(2), "a", TypeError, "l must hold real numbers"),
    (np.zeros(2, complex), np.zeros(2), TypeError, "m must hold real numbers"),
])
def test_online_softmax_update_names_a_running_state_that_does_not_fit(m, l, error, match):
    """Bad input: numpy's broadcasting error or a UFuncTypeError before."""
    with pytest.raises(error, match=match):
        online_softmax_update(m, l, np.zeros((2, 3)))


@pytest.mark.parametrize("field,value,error", [
    ("bandwidth", float("nan"), ValueError), ("bandwidth", 0.0, ValueError),
    ("fp16_flops", -1.0, ValueError), ("fp32_flops", float("inf"), ValueError),
    ("bandwidth", "320e9", TypeError), ("name", None, TypeError), ("source", 3, TypeError),
])
def test_a_gpu_spec_with_impossible_peaks_is_refused(field, value, error):
    """A NaN bandwidth gave roofline_seconds a finite 1.0 and a
    zero one a ZeroDivisionError; a spec is checked when made or replaced."""
    with pytest.raises(error, match=field):
        dataclasses.replace(GPUS["T4"], **{field: value})
    assert dataclasses.replace(GPUS["T4"], bandwidth=1e12).bandwidth == 1e12


def test_find_gpu_refuses_a_name_of_two_gpus():
    with pytest.raises(ValueError, match="names A100 and H100: name one GPU"):
        find_gpu("NVIDIA A100 H100")
