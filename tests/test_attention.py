"""attnbook.attention (chapter 1) against PyTorch and against a plain-loop formula."""

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.attention import scaled_dot_product_attention, softmax


def torch_reference(Q, K, V, mask=None, scale=None):
    q, k, v = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in (Q, K, V))
    attn_mask = None if mask is None else torch.from_numpy(np.asarray(mask).astype(bool))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale).numpy()


def loop_reference(q, K, V, allowed, scale):
    """One query, written out: the weighted average of the allowed values."""
    scores = [float(q @ k) * scale for k, ok in zip(K, allowed) if ok]
    values = [v for v, ok in zip(V, allowed) if ok]
    if not scores:
        return np.zeros(V.shape[-1])
    top = max(scores)
    exps = [np.exp(s - top) for s in scores]
    return sum(e * v for e, v in zip(exps, values)) / sum(exps)


@pytest.mark.parametrize("seed", range(5))
def test_softmax_matches_torch(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=10.0 ** rng.integers(-2, 4), size=tuple(rng.integers(1, 6, size=3)))
    for axis in (0, 1, -1):
        expected = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
        np.testing.assert_allclose(softmax(x, axis=axis), expected, rtol=1e-12, atol=1e-300)


def test_softmax_extremes():
    np.testing.assert_allclose(softmax(np.array([1000.0, 1000.0])), [0.5, 0.5])
    np.testing.assert_array_equal(softmax(np.array([[-np.inf, -np.inf]])), [[0.0, 0.0]])
    np.testing.assert_array_equal(softmax(np.array([-np.inf, 0.0])), [0.0, 1.0])
    assert softmax(np.array([1, 2, 3])).dtype == np.float64
    assert softmax(np.array([1, 2], dtype=np.float32)).dtype == np.float32


@pytest.mark.parametrize("dtype, big", [(np.float64, 1e308), (np.float32, 3e38)])
def test_softmax_of_a_range_wide_row_is_exact_and_silent(dtype, big):
    # -big - big overflows to -inf, whose exponential is 0: the right weight, with no warning
    # (even under np.errstate(over="raise")); a NaN or +inf row gives NaN, silently too
    with np.errstate(all="raise"):
        np.testing.assert_array_equal(softmax(np.array([big, -big], dtype)), [1.0, 0.0])
        assert np.isnan(softmax(np.array([np.nan, 0.0], dtype))).all()
        assert np.isnan(softmax(np.array([np.inf, 0.0], dtype))).all()


@pytest.mark.parametrize("row", [np.array([0.0, -1000.0]),  # exp(-1000) underflows float64
                                 np.array([0.0, -200.0], np.float32),  # and float32
                                 np.array([0.0, -20.0], np.float16),  # the cast back to float16
                                 np.r_[np.zeros(5000), -700.0]])  # the division by 5,000
def test_softmax_of_a_row_that_underflows_is_silent(row):
    # a weight too small for the dtype rounds to 0 (or a subnormal), as in torch.softmax, with
    # no FloatingPointError even under np.errstate(all="raise")
    with np.errstate(all="raise"):
        weights = softmax(row)
    expected = torch.softmax(torch.from_numpy(row.astype(np.float64)), -1).numpy()
    assert weights.dtype == row.dtype
    np.testing.assert_allclose(weights.astype(np.float64), expected, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("seed", range(8))
def test_sdpa_matches_torch_random_shapes_and_masks(seed):
    rng = np.random.default_rng(seed)
    batch = tuple(rng.integers(1, 4, size=rng.integers(0, 3)))
    lq, lk, dk, dv = (int(n) for n in rng.integers(1, 20, size=4))
    Q, K = rng.normal(size=batch + (lq, dk)), rng.normal(size=batch + (lk, dk))
    V = rng.normal(size=batch + (lk, dv))
    mask = rng.random(batch + (lq, lk)) < 0.6
    scale = None if seed % 2 else float(rng.uniform(0.1, 2.0))
    out, weights = scaled_dot_product_attention(Q, K, V, mask=mask, scale=scale)
    assert out.shape == batch + (lq, dv) and weights.shape == batch + (lq, lk)
    np.testing.assert_allclose(out, torch_reference(Q, K, V, mask, scale), atol=1e-12)
    # every row sums to 1, except rows with no allowed key, which are all zero
    row_sums = weights.sum(-1)
    np.testing.assert_allclose(row_sums, mask.any(-1).astype(float), atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_sdpa_matches_a_loop_over_keys(seed):
    rng = np.random.default_rng(100 + seed)
    lq, lk, d = 4, 9, 5
    Q, K, V = rng.normal(size=(lq, d)), rng.normal(size=(lk, d)), rng.normal(size=(lk, 3))
    mask = rng.random((lq, lk)) < 0.5
    mask[0] = False  # a row with nothing allowed
    out, _ = scaled_dot_product_attention(Q, K, V, mask=mask, scale=0.7)
    for i in range(lq):
        np.testing.assert_allclose(out[i], loop_reference(Q[i], K, V, mask[i], 0.7), atol=1e-12)


def test_length_one():
    rng = np.random.default_rng(0)
    V = rng.normal(size=(1, 4))
    out, weights = scaled_dot_product_attention(rng.normal(size=(1, 3)), rng.normal(size=(1, 3)), V)
    np.testing.assert_array_equal(weights, [[1.0]])
    np.testing.assert_allclose(out, V)


def test_fully_masked_rows_give_zeros_without_warnings():
    rng = np.random.default_rng(1)
    Q, K, V = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 2))
    mask = np.zeros((2, 3, 5), dtype=bool)
    mask[0, 1, 2] = True
    with np.errstate(all="raise"):
        out, weights = scaled_dot_product_attention(Q, K, V, mask=mask)
    assert np.isfinite(out).all()
    expected = np.zeros_like(out)
    expected[0, 1] = V[0, 2]
    np.testing.assert_allclose(out, expected)
    assert weights[1].sum() == 0


def test_mask_broadcasting_and_0_1_masks():
    rng = np.random.default_rng(2)
    Q, K, V = rng.normal(size=(2, 3, 4, 8)), rng.normal(size=(2, 3, 6, 8)), rng.normal(size=(2, 3, 6, 5))
    key_mask = rng.random((2, 1, 1, 6)) < 0.7
    key_mask[..., 0] = True
    as_bool, _ = scaled_dot_product_attention(Q, K, V, mask=key_mask)
    as_int, _ = scaled_dot_product_attention(Q, K, V, mask=key_mask.astype(np.int64))
    np.testing.assert_array_equal(as_bool, as_int)
    full = np.broadcast_to(key_mask, (2, 3, 4, 6))
    np.testing.assert_allclose(as_bool, torch_reference(Q, K, V, full), atol=1e-12)


def test_float32_stays_float32_and_large_scores_do_not_overflow():
    rng = np.random.default_rng(3)
    Q = (rng.normal(size=(4, 16)) * 100).astype(np.float32)
    K = (rng.normal(size=(6, 16)) * 100).astype(np.float32)
    V = rng.normal(size=(6, 2)).astype(np.float32)
    out, weights = scaled_dot_product_attention(Q, K, V)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


BAD_INPUTS = [
    ("Q and K must end in the same size", ValueError, dict(Q=(3, 8), K=(4, 6), V=(4, 2))),
    ("K and V must have the same length", ValueError, dict(Q=(3, 8), K=(4, 8), V=(5, 2))),
    ("Q must have at least 2 dimensions", ValueError, dict(Q=(8,), K=(4, 8), V=(4, 2))),
    ("K must have at least one key", ValueError, dict(Q=(3, 8), K=(0, 8), V=(0, 2))),
    ("leading .batch. dimensions", ValueError, dict(Q=(2, 3, 8), K=(3, 4, 8), V=(3, 4, 2))),
]


@pytest.mark.parametrize("message, error, shapes", BAD_INPUTS)
def test_bad_shapes_are_refused_with_a_message_naming_them(message, error, shapes):
    arrays = {name: np.ones(shape) for name, shape in shapes.items()}
    with pytest.raises(error, match=message):
        scaled_dot_product_attention(**arrays)


@pytest.mark.parametrize(
    "mask, message",
    [
        (np.ones((3, 5), bool), r"mask of shape \(3, 5\) does not broadcast"),
        (np.ones(3, bool), r"mask of shape \(3,\) does not broadcast"),
        (np.full((3, 4), 0.5), "mask must be boolean or hold only 0 and 1"),
        ([], r"mask of shape \(0,\) does not broadcast"),  # not "float": `[]` holds no numbers
        (np.ones((3, 4), [("a", int)]), r"hold only 0 and 1, got dtype \[\('a'"),  # structured
        (np.ones((3, 4), "m8[s]"), r"hold only 0 and 1, got dtype timedelta64\[s\]"),
        (np.ones((3, 4), int).astype(object) * Fraction(1), "hold only 0 and 1, got dtype object"),
        ([[True] * 4, [True] * 3, [True] * 4], "mask must be rectangular"),  # a ragged list
        (np.array([[[True] * 4, [True] * 3, [True] * 4]], dtype=object)[0],  # rows of lists
         "mask must be rectangular"),
    ],
)
def test_bad_masks(mask, message):
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(np.ones((3, 8)), np.ones((4, 8)), np.ones((4, 2)), mask=mask)


@pytest.mark.parametrize("name", ["Q", "K", "V"])
def test_a_ragged_list_is_refused_by_its_name(name):
    arrays = dict(Q=np.ones((3, 8)), K=np.ones((4, 8)), V=np.ones((4, 2)))
    rows = arrays[name].tolist()
    arrays[name] = [rows[0][:-1], *rows[1:]]  # the first row one number short
    with pytest.raises(ValueError, match=f"{name} must be rectangular"):
        scaled_dot_product_attention(**arrays)


@pytest.mark.parametrize(
    "mask, dtype",
    [
        (np.zeros((3, 4)), "float64"),
        (np.ones((3, 4), np.float32), "float32"),
        (np.eye(3, 4, dtype=np.complex128), "complex128"),
        (np.zeros((3, 4)).astype(object), "float64"),  # the elements decide, not dtype object
        (np.array([[np.float16(1)] * 4] * 3, dtype=object), "float16"),
        ([[True, 1.0, 0, False]] * 3, "float64"),
        (torch.zeros(3, 4, dtype=torch.bfloat16), "torch.bfloat16"),  # np.asarray fails on these
        (torch.ones(3, 4, requires_grad=True), "torch.float32"),
    ],
)
def test_float_masks_are_refused_as_ambiguous(mask, dtype):
    # PyTorch adds a float mask to the scores, so zeros mean "attend everywhere" there; reading
    # them as False would silently give "attend nowhere" (all-zero weights)
    Q, K, V = np.ones((3, 8)), np.ones((4, 8)), np.ones((4, 2))
    additive = torch.from_numpy(np.zeros((3, 4)))
    reference = F.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (Q, K, V)),
                                               attn_mask=additive)
    assert torch.equal(reference, torch.ones(3, 2, dtype=torch.float64))  # zeros: all allowed
    with pytest.raises(ValueError, match=r"mask must be boolean or hold only 0 and 1 as integers, "
                                         rf"got dtype {dtype}: a float mask is ambiguous"):
        scaled_dot_product_attention(Q, K, V, mask=mask)
    values = np.real(np.array(mask.tolist() if hasattr(mask, "tolist") else mask, dtype=complex))
    as_int, _ = scaled_dot_product_attention(Q, K, V, mask=values.astype(np.int64))
    as_bool, _ = scaled_dot_product_attention(Q, K, V, mask=values.astype(bool))
    assert np.array_equal(as_int, as_bool)  # the same 0/1 as integers is still accepted


def test_non_numeric_input_is_a_type_error():
    with pytest.raises(TypeError, match="V must hold real numbers"):
        scaled_dot_product_attention(np.ones((3, 8)), np.ones((4, 8)), np.array([["a", "b"]] * 4))
    with pytest.raises(TypeError, match="x must hold real numbers"):
        softmax(np.array([1 + 2j]))


@pytest.mark.parametrize(
    "arrays, message",
    [
        (dict(Q=np.arange(4), K=np.ones((5, 4)), V=np.ones((5, 2))),
         r"Q must have at least 2 dimensions.*\(4,\)"),
        (dict(Q=np.ones((3, 4)), K=np.arange(4), V=np.ones((5, 2))),
         r"K must have at least 2 dimensions.*\(4,\)"),
        (dict(Q=np.ones((3, 0)), K=np.ones((5, 0)), V=np.ones((5, 2))),
         r"dk >= 1.*Q has shape \(3, 0\), K has shape \(5, 0\)"),
    ],
)
def test_integer_and_empty_inputs_are_checked_like_floats(arrays, message):
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(**arrays)


@pytest.mark.parametrize(
    "scale, error, message",
    [
        ("a", TypeError, r"scale must be a real number, got scale='a' of type str"),
        (True, TypeError, r"scale must be a real number.*scale=True"),
        (np.ones(2), TypeError, r"scale must be a real number.*ndarray"),
        (float("nan"), ValueError, r"scale must be a finite number.*got scale=nan"),
        (-np.inf, ValueError, r"scale must be a finite number.*got scale=-inf"),
    ],
)
def test_bad_scales(scale, error, message):
    with pytest.raises(error, match=message):
        scaled_dot_product_attention(np.ones((3, 8)), np.ones((4, 8)), np.ones((4, 2)),
                                     scale=scale)


def test_numpy_scalar_scales_are_accepted_and_keep_float32():
    rng = np.random.default_rng(4)
    Q, K, V = (rng.normal(size=(3, 5, 8)).astype(np.float32) for _ in range(3))
    for scale in (np.float32(0.3), np.float64(0.3), 0.3, np.int64(1)):
        out, weights = scaled_dot_product_attention(Q, K, V, scale=scale)
        assert out.dtype == weights.dtype == np.float32
        np.testing.assert_allclose(out, torch_reference(Q, K, V, scale=float(scale)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_large_float16_inputs_are_computed_in_float32(seed):
    # |q.k| up to 100 * 100 * 64 = 640,000, past float16's largest number, 65504.
    rng = np.random.default_rng(seed)
    Q = np.full((2, 3, 64), 100.0, np.float16)
    K = rng.choice([-100.0, 100.0], size=(2, 7, 64)).astype(np.float16)
    K[:, 0] = 100.0
    V = rng.normal(size=(2, 7, 5)).astype(np.float16)
    mask = rng.random((3, 7)) < 0.7
    mask[:, 0] = True
    with np.errstate(over="raise", invalid="raise"):  # (exp underflows to 0, as it should)
        out, weights = scaled_dot_product_attention(Q, K, V, mask=mask)
    assert out.dtype == weights.dtype == np.float16 and np.isfinite(out).all()
    np.testing.assert_allclose(out.astype(np.float64), torch_reference(Q, K, V, mask),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(weights.astype(np.float64).sum(-1), 1.0, rtol=2e-3)


# --- No silent wrong answers --------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_scores_give_nan_as_in_torch(bad):
    x = np.array([[0.0, bad, 1.0], [0.0, 2.0, 1.0]])
    expected = torch.softmax(torch.from_numpy(x), -1).numpy()
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(np.isnan(softmax(x)), np.isnan(expected))
        np.testing.assert_allclose(softmax(x)[1], expected[1], rtol=1e-12)
        if bad != -np.inf:  # -inf is a forbidden key, not a wrong number
            assert np.isnan(softmax(x)[0]).all()


@pytest.mark.parametrize("where", ["Q", "K"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_queries_or_keys_give_nan_not_zeros(where, bad):
    rng = np.random.default_rng(5)
    arrays = {"Q": rng.normal(size=(3, 4)), "K": rng.normal(size=(5, 4)),
              "V": rng.normal(size=(5, 2))}
    arrays[where][1 if where == "Q" else 0, 2] = bad
    with np.errstate(invalid="ignore"):
        out, weights = scaled_dot_product_attention(**arrays)
        expected = torch_reference(**arrays)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out).any() and np.isnan(weights).any()
    if where == "Q":  # only the query's own row is lost
        assert np.isnan(out[1]).all() and np.isfinite(np.delete(out, 1, 0)).all()


def test_minus_infinity_from_the_data_reads_as_forbidden_like_torch():
    # chapter 1: -inf means "forbidden" wherever it comes from; a query whose every score is -inf
    # because of its own data gives zeros, as in PyTorch, while the other queries are unaffected
    Q = np.array([[-np.inf, 0.0], [1.0, 0.5]])
    K, V = np.array([[1.0, 0.0], [2.0, 0.0]]), np.array([[1.0, 2.0], [3.0, 4.0]])
    out, weights = scaled_dot_product_attention(Q, K, V)
    expected = torch_reference(Q, K, V)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(weights[0], 0.0)
    np.testing.assert_array_equal(expected[0], 0.0)
    np.testing.assert_allclose(out[1], expected[1], rtol=1e-12)


def test_scores_that_overflow_float32_give_nan_and_masked_rows_stay_zero():
    Q = np.full((2, 4), 1e20, np.float32)
    K, V = np.full((3, 4), 1e20, np.float32), np.ones((3, 2), np.float32)
    mask = np.array([[True, True, True], [False, False, False]])
    with np.errstate(over="ignore", invalid="ignore"):
        out, weights = scaled_dot_product_attention(Q, K, V, mask=mask)
    assert np.isnan(out[0]).all() and np.isnan(weights[0]).all()  # inf - inf: lost, and seen
    assert (out[1] == 0).all() and (weights[1] == 0).all()  # no allowed key: the convention


def test_float16_softmax_sums_in_float32():
    p = softmax(np.zeros(70000, np.float16))
    assert p.dtype == np.float16
    assert abs(p.astype(np.float64).sum() - 1) < 1e-2  # in float16 the sum overflowed: zeros
    x = np.random.default_rng(0).normal(size=(4, 3000)).astype(np.float16)
    np.testing.assert_allclose(softmax(x).astype(np.float64), softmax(x.astype(np.float64)),
                               rtol=2e-3, atol=1e-6)


def test_empty_arrays():
    assert softmax(np.zeros((3, 0))).shape == (3, 0)  # softmax over an empty axis: empty
    assert softmax(np.zeros((0, 4))).shape == (0, 4)
    assert softmax(np.zeros((3, 0)), axis=0).shape == (3, 0)
    out, weights = scaled_dot_product_attention(np.ones((0, 8)), np.ones((4, 8)), np.ones((4, 2)))
    assert out.shape == (0, 2) and weights.shape == (0, 4)
    out, weights = scaled_dot_product_attention(*(np.ones((0, 3, 8)),) * 3)
    assert out.shape == (0, 3, 8) and weights.shape == (0, 3, 3)
    with pytest.raises(ValueError, match=r"K must have at least one key.*\(0, 8\)"):
        scaled_dot_product_attention(np.ones((3, 8)), np.ones((0, 8)), np.ones((0, 2)))


def test_check_qkv_is_public_and_returns_real_arrays():
    from attnbook.attention import check_qkv

    Q, K, V = check_qkv(np.ones((3, 4), int), np.ones((5, 4)), np.ones((5, 2), np.float32))
    assert Q.dtype == np.float64 and V.dtype == np.float32
    with pytest.raises(ValueError, match=r"leading \(batch\) dimensions.*Q has shape \(2, 3, 4\)"):
        check_qkv(np.ones((2, 3, 4)), np.ones((3, 5, 4)), np.ones((3, 5, 2)))


def test_the_numpy_chapters_modules_import_without_torch():
    # Attention, scaling and tiling (chapters 1, 2 and 13) need only NumPy; torch is
    # made unimportable, so that any import of it, however indirect, fails.
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['torch'] = None; "
            "import attnbook.attention as a, attnbook.scaling, attnbook.tiling as t, numpy as np; "
            "q = np.eye(4); out, w = a.scaled_dot_product_attention(q, q, q); "
            "assert np.allclose(t.flash_attention_numpy(q, q, q, block_size=2), out); "
            "assert a.check_array is __import__('attnbook.checks').checks.check_array; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'attnbook'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["['attnbook',", "'attnbook.attention',",
                                     "'attnbook.checks',", "'attnbook.scaling',",
                                     "'attnbook.tiling',", "'torch']"]


def test_divide_or_zero_keeps_non_finite_numerators_non_finite():
    from attnbook.attention import divide_or_zero

    with np.errstate(invalid="ignore"):  # inf * 0
        out = divide_or_zero(np.array([np.nan, np.inf, 1.0]), np.array([0.0, 0.0, 0.0]))
    assert np.isnan(out[:2]).all() and out[2] == 0.0


def test_divide_or_zero_broadcasts_and_takes_integers_like_np_divide():
    from attnbook.attention import divide_or_zero

    for x, total in [(np.array([1, 2]), np.array([3, 3])), (np.ones((3, 1)), np.full((3, 4), 2.0))]:
        np.testing.assert_array_equal(divide_or_zero(x, total), np.divide(x, total))
    with pytest.raises(ValueError, match=r"x of shape \(2,\) and total of shape \(3,\)"):
        divide_or_zero(np.ones(2), np.ones(3))
    for total in (2.0, 2, 0):  # a Python number keeps x's dtype, as in x / 2.0 (was float64)
        assert divide_or_zero(np.ones(3, np.float32), total).dtype == np.float32


@pytest.mark.parametrize("x", [3.0, np.float64(3.0), np.array(3.0)])
def test_softmax_of_a_scalar_names_x(x):
    with pytest.raises(ValueError, match=r"x must have at least 1 dimension, got shape \(\)"):
        softmax(x)


@pytest.mark.parametrize("dtype", [torch.ones(2, dtype=torch.float16), None,
                                   np.ones(2, dtype=np.float16), "no such dtype"])
def test_compute_dtype_refuses_what_is_not_a_dtype(dtype):
    from attnbook.attention import compute_dtype

    with pytest.raises(TypeError, match="dtype must be a NumPy or torch dtype"):
        compute_dtype(dtype)


@pytest.mark.parametrize("mask", [np.array([1, 1, 0, 1, 1], bool), np.bool_(True),
                                  np.array([True, False, True, True, False])])
def test_one_and_zero_dimensional_masks_broadcast_as_in_torch(mask):
    rng = np.random.default_rng(5)
    Q, K, V = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    out, _ = scaled_dot_product_attention(Q, K, V, mask=mask)
    np.testing.assert_allclose(out, torch_reference(Q, K, V, mask))


@pytest.mark.parametrize("x", [torch.ones(2, 3, dtype=torch.bfloat16),
                               torch.ones(2, 3, requires_grad=True)])
def test_tensors_without_a_numpy_array_are_a_type_error_naming_them(x):
    with pytest.raises(TypeError, match="x must be a NumPy array or a CPU tensor"):
        softmax(x)
    with pytest.raises(TypeError, match="Q must be a NumPy array or a CPU tensor"):
        scaled_dot_product_attention(x, np.ones((2, 3)), np.ones((2, 3)))


@pytest.mark.parametrize("scale", [10**400, Fraction(-(10**400), 7)], ids=["10**400", "Fraction"])
def test_a_scale_beyond_a_float_is_refused_by_name(scale):
    # float(10**400) raised a raw OverflowError inside check_scale
    Q = np.ones((2, 4))
    with pytest.raises(ValueError, match="scale must be a finite number.*beyond a float"):
        scaled_dot_product_attention(Q, Q, Q, scale=scale)
