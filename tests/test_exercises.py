"""attnbook.exercises (appendix F): right answers written other ways pass, the wrong answers
readers write fail with the hint meant for their mistake, and candidates that misbehave (wrong
kind or shape, None, a generator, an exception, a changed input, a slow call) are reported,
never raised."""

import collections
import math
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook import exercises
from attnbook.attention import scaled_dot_product_attention
from attnbook.efficient import elu_feature_map
from attnbook.exercises import EXERCISES, CheckResult, check

# ---- right answers, each written independently of the book's solution -----------------------


def causal_loop_torch(X, W_Q, W_K, W_V):
    """1.2 through PyTorch's SDPA with is_causal (an independent implementation)."""
    q, k, v = (torch.from_numpy(X @ W) for W in (W_Q, W_K, W_V))
    rows = [F.scaled_dot_product_attention(q[None, i:i + 1], k[None, :i + 1], v[None, :i + 1])[0]
            for i in range(len(X))]
    return torch.cat(rows).numpy()


def rope_interleaved_complex(x, positions):
    """5.1 as complex multiplication: pair (x_2i, x_2i+1) is x_2i + i x_2i+1, times e^(i m theta_i)."""
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones((), dtype=torch.float64), positions.double()[:, None] * theta)  # (L, d/2)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * turn).reshape(x.shape).to(x.dtype)


def local_mask_loops(q_len, k_len, window):
    """6.1 by loops over queries and keys."""
    return torch.tensor([[0 <= i + k_len - q_len - j < window for j in range(k_len)]
                         for i in range(q_len)], dtype=torch.bool).reshape(q_len, k_len)


def merge(part1, part2):
    """13.2: both sums brought to the common maximum (0 where neither worker saw a key)."""
    (m1, l1, a1), (m2, l2, a2) = part1, part2
    m = np.maximum(m1, m2)
    shift = np.where(np.isneginf(m), 0.0, m)
    c1, c2 = np.exp(m1 - shift), np.exp(m2 - shift)
    return m, c1 * l1 + c2 * l2, c1[:, None] * a1 + c2[:, None] * a2


def rope_as_rotation_matrix(x, positions):
    """5.1 as chapter 5 writes RoPE: x @ R_m.T, R_m block-diagonal with 2 x 2 rotations."""
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * theta  # (L, d/2)
    R = torch.zeros(len(positions), d, d, dtype=torch.float64)  # (L, d, d)
    c, s = angles.cos(), angles.sin()
    for i in range(d // 2):
        R[:, 2 * i, 2 * i], R[:, 2 * i, 2 * i + 1] = c[:, i], -s[:, i]
        R[:, 2 * i + 1, 2 * i], R[:, 2 * i + 1, 2 * i + 1] = s[:, i], c[:, i]
    return (x.double()[..., None, :] @ R.transpose(-2, -1)).squeeze(-2).to(x.dtype)


def causal_linear_cumsum(q, k, v, eps=1e-6):
    """17.3 with running sums (torch.cumsum), in float32 or wider."""
    work = torch.promote_types(q.dtype, torch.float32)
    fq, fk, v = F.elu(q.to(work)) + 1, F.elu(k.to(work)) + 1, v.to(work)
    states = (fk[..., :, None] * v[..., None, :]).cumsum(-3)  # (..., L, D, Dv)
    norms = fk.cumsum(-2)  # (..., L, D)
    num = (fq[..., None, :] @ states).squeeze(-2)  # (..., L, Dv)
    return (num / ((fq * norms).sum(-1, keepdim=True) + eps)).to(q.dtype)


RIGHT = {"1.2": causal_loop_torch, "5.1": rope_interleaved_complex, "6.1": local_mask_loops,
         "13.2": merge, "17.3": causal_linear_cumsum}


@pytest.mark.parametrize("exercise", sorted(RIGHT))  # appendix G's: tests/test_exercises_parts_*.py
def test_a_right_answer_passes_every_case(exercise, capsys):
    result = check(exercise, RIGHT[exercise])
    assert result.passed and result.cases_passed == result.cases == len(EXERCISES[exercise].cases)
    assert capsys.readouterr().out == f"check {exercise} ({result.title}): passed all {result.cases} cases.\n"


def test_rope_as_chapter_5s_rotation_matrix_passes():  # no case asks what the chapter never says
    assert check("5.1", rope_as_rotation_matrix, show=False).passed


# ---- wrong answers of the kinds readers write: (exercise, candidate, failing case, hint words) --


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def loop_without_sqrt_d(X, W_Q, W_K, W_V):
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    return np.stack([_softmax(K[:i + 1] @ Q[i]) @ V[:i + 1] for i in range(len(X))])


def loop_reading_one_ahead(X, W_Q, W_K, W_V):  # range(i + 2): the causal bound off by one
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    return np.stack([_softmax(K[:i + 2] @ Q[i] / np.sqrt(Q.shape[1])) @ V[:i + 2]
                     for i in range(len(X))])


def loop_keys_values_swapped(X, W_Q, W_K, W_V):
    return causal_loop_torch(X, W_Q, W_V, W_K)


def loop_mask_after_softmax(X, W_Q, W_K, W_V):  # all keys in the softmax, later ones zeroed after
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    weights = _softmax(Q @ K.T / np.sqrt(Q.shape[1])) * np.tri(len(X))
    return weights @ V


def rope_turning_backwards(x, positions):
    return rope_interleaved_complex(x, -positions)


def rope_half_split(x, positions):  # pairs (i, i + d/2): apply_rope's layout, not the exercise's
    from attnbook.positions import apply_rope
    return apply_rope(x, positions)


def rope_frequencies_halved(x, positions):  # base**(-i/d) where the exponent is -2i/d
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d // 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones((), dtype=torch.float64), positions.double()[:, None] * theta)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * turn).reshape(x.shape).to(x.dtype)


def window_off_by_one(q_len, k_len, window):  # p - w <= j: one key too many
    p = torch.arange(q_len)[:, None] + (k_len - q_len)
    j = torch.arange(k_len)
    return (j <= p) & (j >= p - window)


def window_top_left(q_len, k_len, window):  # query i at position i, not i + k_len - q_len
    p, j = torch.arange(q_len)[:, None], torch.arange(k_len)
    return (j <= p) & (j > p - window)


def merge_without_rescaling(part1, part2):  # the running max not rescaled
    (m1, l1, a1), (m2, l2, a2) = part1, part2
    return np.maximum(m1, m2), l1 + l2, a1 + a2


def merge_keeping_first_max(part1, part2):  # m = m1: the new maximum never taken
    (m1, l1, a1), (m2, l2, a2) = part1, part2
    c2 = np.exp(m2 - m1)
    return m1, l1 + c2 * l2, a1 + c2[:, None] * a2


def merge_through_exp_of_max(part1, part2):  # e^m1 l1 + e^m2 l2: overflows for large scores
    (m1, l1, a1), (m2, l2, a2) = part1, part2
    m = np.maximum(m1, m2)
    l_raw, a_raw = np.exp(m1) * l1 + np.exp(m2) * l2, np.exp(m1)[:, None] * a1 + np.exp(m2)[:, None] * a2
    return m, l_raw / np.exp(m), a_raw / np.exp(m)[:, None]


def merge_with_fmax(part1, part2):  # np.fmax drops a NaN
    (m1, l1, a1), (m2, l2, a2) = part1, part2
    m = np.fmax(m1, m2)
    shift = np.where(np.isneginf(m), 0.0, m)
    c1, c2 = np.nan_to_num(np.exp(m1 - shift)), np.exp(m2 - shift)
    return m, c1 * l1 + c2 * l2, c1[:, None] * a1 + c2[:, None] * a2


def linear_not_causal(q, k, v, eps=1e-6):
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    return fq @ (fk.transpose(-2, -1) @ v) / (fq @ fk.sum(-2)[..., None] + eps)


def linear_excluding_itself(q, k, v, eps=1e-6):  # sums over keys 0..i-1: off by one
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    states = (fk[..., :, None] * v[..., None, :]).cumsum(-3) - fk[..., :, None] * v[..., None, :]
    norms = fk.cumsum(-2) - fk
    return (fq[..., None, :] @ states).squeeze(-2) / ((fq * norms).sum(-1, keepdim=True) + eps)


def linear_without_normaliser(q, k, v, eps=1e-6):
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    return (fq[..., None, :] @ (fk[..., :, None] * v[..., None, :]).cumsum(-3)).squeeze(-2)


def loop_without_max(X, W_Q, W_K, W_V):  # the softmax chapter 1 warns against: e^s overflows
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    rows = []
    for i in range(len(X)):
        e = np.exp(K[:i + 1] @ Q[i] / np.sqrt(Q.shape[1]))
        rows.append(e / e.sum() @ V[:i + 1])
    return np.stack(rows)


def loop_masked_sdpa(X, W_Q, W_K, W_V):  # the chapter's other check: a mask, not a loop
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    return scaled_dot_product_attention(Q, K, V, mask=np.tri(len(X), dtype=bool))[0]


def loop_half_for_float32(X, W_Q, W_K, W_V):  # float64 kept, anything narrower taken to float16
    narrow = X.dtype != np.float64
    args = [a.astype(np.float16) if narrow else a for a in (X, W_Q, W_K, W_V)]
    return causal_loop_torch(*(a.astype(np.float64) for a in args))


def rope_angles_in_float16(x, positions):  # the angles formed in x's dtype
    d = x.shape[-1]
    theta = (10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)).to(x.dtype)
    angles = positions.to(x.dtype)[:, None] * theta  # (L, d/2), float16 for float16 x
    c, s = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)


def merge_nan_when_both_idle(part1, part2):  # e^(m1 - m) with m = -inf: NaN
    (m1, l1, a1), (m2, l2, a2) = part1, part2
    m = np.maximum(m1, m2)
    c1, c2 = np.exp(m1 - m), np.exp(m2 - m)
    return m, c1 * l1 + c2 * l2, c1[:, None] * a1 + c2[:, None] * a2


def merge_half_for_float32(part1, part2):  # anything narrower than float64 computed in float16
    narrow = part1[0].dtype != np.float64
    cast = (lambda p: tuple(x.astype(np.float16) for x in p)) if narrow else (lambda p: p)
    return tuple(x.astype(part1[0].dtype) for x in merge(cast(part1), cast(part2)))


def linear_sums_in_input_dtype(q, k, v, eps=1e-6):  # running sums kept in float16
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    states, norms = (fk[..., :, None] * v[..., None, :]).cumsum(-3), fk.cumsum(-2)
    return (fq[..., None, :] @ states).squeeze(-2) / ((fq * norms).sum(-1, keepdim=True) + eps)


def linear_in_float32(q, k, v, eps=1e-6):  # computes in float32 or wider, never casts back
    work = torch.promote_types(q.dtype, torch.float32)
    return causal_linear_cumsum(q.to(work), k.to(work), v.to(work), eps)


WRONG = [
    ("1.2", loop_without_sqrt_d, "six positions, d_k = 16", "sqrt(d_k)"),
    ("1.2", loop_reading_one_ahead, "four positions, d_k = 1", "never a later one"),
    ("1.2", loop_keys_values_swapped, "one position", "the values come from W_V"),
    ("1.2", loop_mask_after_softmax, "four positions, d_k = 1", "never a later one"),
    ("1.2", loop_without_max, "scores in the thousands", "709.78"),
    ("1.2", loop_half_for_float32, "float32", "never in float16"),
    ("1.2", loop_masked_sdpa, "a NaN in token 3", "is no reference here"),
    ("5.1", rope_angles_in_float16,
     "float16 at positions 3000 to 3006, coordinates with a large common part", "float32 or wider"),
    ("5.1", rope_turning_backwards, "one pair at positions 0 to 3", "counter-clockwise"),
    ("5.1", rope_half_split, "eight coordinates at positions 10 to 14", "pairing"),
    ("5.1", rope_frequencies_halved, "eight coordinates at positions 10 to 14", "frequencies"),
    ("6.1", window_off_by_one, "4 x 4, window 1", "p - w < j <= p"),
    ("6.1", window_top_left, "3 queries, 8 keys, window 3", "bottom-right"),
    ("13.2", merge_without_rescaling, "different maxima", "common maximum"),
    ("13.2", merge_keeping_first_max, "different maxima", "m = np.maximum(m1, m2)"),
    ("13.2", merge_nan_when_both_idle, "a query neither worker saw a key for", "(-inf, 0, 0)"),
    ("13.2", merge_half_for_float32, "float32", "never in float16"),
    ("13.2", merge_through_exp_of_max, "scores in the thousands", "overflows"),
    ("13.2", merge_with_fmax, "a NaN in one key", "np.fmax"),
    ("17.3", linear_not_causal, "five positions", "not sums over every key"),
    ("17.3", linear_excluding_itself, "one position", "i included"),
    ("17.3", linear_without_normaliser, "one position", "divided by"),
    ("17.3", linear_sums_in_input_dtype, "float16, 2048 positions",  # its numerator overflows
     "numerator phi(q_i) . S_i passes it"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG,
                         ids=[f"{e}-{c.__name__}" for e, c, _, _ in WRONG])
def test_a_wrong_answer_fails_with_the_hint_for_its_mistake(exercise, candidate, case, words):
    assert_fails_with_hint(exercise, candidate, case, words)


def assert_fails_with_hint(exercise, candidate, case, words):
    """`candidate` fails exercise `exercise` first at `case`, whose hint holds `words` (appendix G's
    tests use it too)."""
    result = check(exercise, candidate, show=False)
    assert not result.passed and result.case == case, result
    assert words in result.hint
    assert EXERCISES[exercise].cases[result.cases_passed].name == case
    assert str(result).startswith(f"check {exercise} (") and f'"{case}"' in str(result)


def test_a_wrong_dtype_is_reported_with_a_dtype_hint_not_a_numeric_one():
    result = check("17.3", linear_in_float32, show=False)
    assert result.case == "float16, 2048 positions" and result.hint == exercises._DTYPE_HINT
    assert "has dtype torch.float32, expected torch.float16" in result.problem


def test_a_difference_of_rounding_size_says_so_with_the_digits_that_differ():
    def loop_in_float32(X, W_Q, W_K, W_V):
        return causal_loop_torch(*(a.astype(np.float32) for a in (X, W_Q, W_K, W_V))).astype(np.float64)
    result = check("1.2", loop_in_float32, show=False)
    assert result.case == "one position" and "rounding size" in result.problem
    yours, expected = result.problem.split("yours ")[1].split(" (allowed")[0].split(", expected ")
    assert yours != expected


def test_a_wrong_mask_counts_its_wrong_entries():
    result = check("6.1", window_off_by_one, show=False)
    assert "3 of 16 entries differ" in result.problem and "yours True, expected False" in result.problem
    assert "allowed" not in result.problem


def test_a_numeric_failure_reports_the_largest_difference_and_where():
    result = check("1.2", loop_without_sqrt_d, show=False)
    assert result.max_diff is not None and result.max_diff > 1e-9 and len(result.where) == 2
    assert f"{result.max_diff:.3g}" in result.problem
    assert "X (6, 8) float64" in result.inputs


def test_a_lost_nan_is_a_failure_at_its_place():
    def loop_hiding_nan(X, W_Q, W_K, W_V):
        return np.nan_to_num(causal_loop_torch(X, W_Q, W_K, W_V))
    result = check("1.2", loop_hiding_nan, show=False)
    assert result.case == "a NaN in token 3" and result.max_diff == np.inf
    assert result.where[0] >= 3 and "NaN at [3, 0]" in result.inputs


# ---- candidates that misbehave --------------------------------------------------------------


def test_the_wrong_kind_or_shape_is_reported_not_raised():
    numpy_for_tensor = check("6.1", lambda *a: local_mask_loops(*a).numpy(), show=False)
    assert "is a numpy.ndarray, expected a torch.Tensor" in numpy_for_tensor.problem
    tensor_for_numpy = check("1.2", lambda *a: torch.from_numpy(causal_loop_torch(*a)), show=False)
    assert "is a torch.Tensor, expected a numpy.ndarray" in tensor_for_numpy.problem
    shape = check("5.1", lambda x, p: rope_interleaved_complex(x, p)[None], show=False)
    assert "has shape (1, 1, 2), expected (1, 2)" in shape.problem
    both = check("1.2", lambda *a: (causal_loop_torch(*a), None), show=False)
    assert "is a tuple of 2, expected a numpy.ndarray" in both.problem
    short = check("13.2", lambda p1, p2: merge(p1, p2)[:2], show=False)
    assert "is a tuple of 2, expected a tuple of 3" in short.problem
    complex_out = check("1.2", lambda *a: causal_loop_torch(*a).astype(complex), show=False)
    assert "complex128 values, expected real numbers" in complex_out.problem
    for result in (numpy_for_tensor, tensor_for_numpy, shape, both, short, complex_out):
        assert not result.passed and result.cases_passed == 0 and result.max_diff is None
        assert result.hint is None  # the case's hint names a numeric mistake, not this one


def test_none_and_a_generator_are_reported():
    def forgets_return(q_len, k_len, window):
        local_mask_loops(q_len, k_len, window)

    def yields(q_len, k_len, window):
        yield local_mask_loops(q_len, k_len, window)

    assert "output is None, expected a torch.Tensor" in check("6.1", forgets_return, show=False).problem
    assert "output is a generator" in check("6.1", yields, show=False).problem


def test_an_exception_is_shown_with_its_case(capsys):
    def broken(x, positions):
        raise ZeroDivisionError("my bug")

    result = check("5.1", broken)
    assert result.problem == "raised ZeroDivisionError: my bug" and result.case == "position 0"
    assert "raised ZeroDivisionError: my bug" in capsys.readouterr().out


def test_a_candidate_that_changes_its_input_is_caught_even_when_right():
    def merge_in_place(part1, part2):
        m, l, a = merge(part1, part2)
        part1[1][...] = l  # the right answer, written over the first worker's sums
        return m, part1[1], a

    def rope_in_place(x, positions):
        x.copy_(rope_interleaved_complex(x, positions))
        return x

    merged = check("13.2", merge_in_place, show=False)
    assert not merged.passed and "changed its input part1 in place" in merged.problem
    rope = check("5.1", rope_in_place, show=False)
    assert rope.case == "one pair at positions 0 to 3" and "changed its input x" in rope.problem


def test_a_slow_candidate_is_stopped_waiting_for_not_hung_on():
    release = threading.Event()

    def stuck(q_len, k_len, window):
        release.wait()  # returns only once the test lets it
        return local_mask_loops(q_len, k_len, window)

    result = check("6.1", stuck, timeout=0.1, show=False)
    still_waiting = not release.is_set()  # check came back while the call had not returned
    release.set()
    assert still_waiting and not result.passed and result.case == "one query, one key, window 1"
    assert result.problem.startswith("no answer after 0.1 s") and result.hint is None


def test_a_call_that_returns_after_its_time_limit_fails(monkeypatch):
    # one long C call holds the GIL, so check can only see its time once it returns: the clock
    # below makes every call last 100 s. One clock per thread: a candidate an earlier test left
    # running in this process reads the clock too when it ends, and made this one last 200 s
    ticks = collections.defaultdict(lambda: iter(range(0, 10**6, 100)))
    monkeypatch.setattr(exercises.time, "perf_counter",
                        lambda: float(next(ticks[threading.get_ident()])))
    result = check("6.1", local_mask_loops, timeout=10, show=False)
    assert not result.passed and result.case == "one query, one key, window 1"
    assert result.problem == "took 100 s, more than the 10 s allowed" and result.hint is None


def test_a_time_limit_beyond_what_the_os_can_wait_is_as_long_as_it_can():
    assert check("13.2", merge, timeout=1e12, show=False).passed  # threading.TIMEOUT_MAX is less
    assert check("13.2", merge, timeout=math.inf, show=False).passed  # no limit


def test_check_restores_torch_state_a_candidate_changes():
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.manual_seed(1)
    rng_state = torch.get_rng_state()

    def rope_changing_state(x, positions):
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(threads + 1)
        torch.manual_seed(0)
        np.random.seed(0)
        return rope_interleaved_complex(x, positions)

    try:
        assert check("5.1", rope_changing_state, show=False).passed
        assert torch.get_default_dtype() == dtype and torch.get_num_threads() == threads
        assert torch.equal(torch.get_rng_state(), rng_state)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)


def test_check_leaves_the_callers_random_state_alone():
    np.random.seed(0)
    torch.manual_seed(0)
    numpy_state, torch_state = np.random.get_state()[1].copy(), torch.get_rng_state()
    check("17.3", causal_linear_cumsum, show=False)
    assert np.array_equal(np.random.get_state()[1], numpy_state)
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_the_cases_are_the_same_on_every_call():
    first, second = (check("1.2", loop_without_sqrt_d, show=False) for _ in range(2))
    assert first == second


# ---- check's own arguments ------------------------------------------------------------------


@pytest.mark.parametrize("exercise_id, error", [("3.9", ValueError), ("1.2 ", ValueError),
                                                 ("", ValueError), (1.2, TypeError),
                                                 (None, TypeError)])
def test_an_unknown_exercise_is_refused_listing_the_ids(exercise_id, error):
    with pytest.raises(error, match=r"exercise_id must be one of \[.*'1\.2'.*'17\.3'"):
        check(exercise_id, merge)


@pytest.mark.parametrize("timeout, error", [(0, ValueError), (-1, ValueError), (float("nan"), ValueError),
                                            (-math.inf, ValueError), pytest.param(10**400, ValueError, id="10**400"),
                                            ("1", TypeError), (True, TypeError)])
def test_a_bad_timeout_is_refused(timeout, error):
    with pytest.raises(error, match="timeout"):
        check("13.2", merge, timeout=timeout)


def test_a_candidate_that_cannot_be_called_is_a_type_error():
    with pytest.raises(TypeError, match="candidate"):
        check("13.2", "merge")
    calls = []
    with pytest.raises(TypeError, match="show"):
        check("13.2", lambda *parts: calls.append(parts), show="no")
    assert calls == []  # refused before any case ran


def test_the_result_is_plain_text():
    result = check("6.1", window_top_left, show=False)
    assert isinstance(result, CheckResult) and "\n  hint:    " in str(result)
    assert all(len(line) <= 100 for line in str(result).splitlines()[1:])
