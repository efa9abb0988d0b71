"""attnbook.exercises (appendix F), the report's details: a case's mask is described by its
content, not only its shape; the place of the largest difference is a tuple of Python ints that
a test compares and a reader reads as it prints; every teaching chapter's solution passes its
checkable exercise, and each exercise fails two or more wrong answers with their hints."""

import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from test_exercises import linear_sums_in_input_dtype

from attnbook.exercises import EXERCISES, CheckResult, check


def cross_attention_minus_inf(q, k, v, src_keep):  # NaN where a source is all padding
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.masked_fill(~src_keep[:, None, None, :], -math.inf).softmax(-1) @ v


def test_a_mask_in_the_inputs_is_described_by_its_true_entries_and_its_empty_rows():
    result = check("11.1", cross_attention_minus_inf, show=False)
    assert result.case == "a source that is all padding", result
    # src_keep of sources of 0 and 3 tokens, padded to 3: sequence 0 has no token
    assert "src_keep (2, 3) bool with 3 of 6 True, none in row [0]" in result.inputs
    assert "src_keep (2, 3) bool with 3 of 6 True" in str(result).replace("\n           ", " ")


def test_a_full_mask_names_no_empty_row():
    result = check("11.1", lambda q, k, v, src_keep: torch.zeros_like(q), show=False)
    assert result.case == "one source token, one target token", result
    assert result.inputs.endswith("src_keep (1, 1) bool with 1 of 1 True")


def test_where_is_a_tuple_of_python_ints():
    result = check("11.1", cross_attention_minus_inf, show=False)
    assert result.where == (0, 0, 0, 0) and all(type(i) is int for i in result.where)
    assert repr(result.where) == "(0, 0, 0, 0)"
    assert result.max_diff == math.inf and isinstance(result.max_diff, float)
    assert np.isinf(result.max_diff)


# ---- every teaching chapter's exercise: its solution passes, two wrong answers fail -----------

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"
NOT_CHECKABLE: dict[int, str] = {}  # a chapter whose exercises no check can judge, and why


def test_every_teaching_chapter_has_a_checkable_exercise_its_solution_passes():
    for number in range(1, 20):
        source = next(CHAPTERS.glob(f"{number:02d}-*.md")).read_text()
        solutions = source[source.index("\n## Exercises\n"):]
        called = re.findall(r'assert check\("(\d+\.\d+)", \w+(?:, show=False)?\)\.passed', solutions)
        if number in NOT_CHECKABLE:
            assert called == [], number
            continue
        assert called and all(e.split(".")[0] == str(number) for e in called), (number, called)
        assert set(called) <= set(EXERCISES), called
    ids = {int(e.split(".")[0]) for e in EXERCISES}
    assert ids == set(range(1, 20)) - set(NOT_CHECKABLE)


def test_every_checkable_exercise_has_two_wrong_answers_each_tested_with_its_hint():
    import test_exercises
    import test_exercises_ch9_ch10
    import test_exercises_ch19
    import test_exercises_float16_arithmetic
    import test_exercises_nan_and_reports
    import test_exercises_nan_float16
    import test_exercises_parts_1_2
    import test_exercises_parts_3_4
    wrong = [*test_exercises.WRONG, *test_exercises_ch9_ch10.WRONG, *test_exercises_ch19.WRONG,
             *test_exercises_nan_and_reports.WRONG, *test_exercises_nan_float16.WRONG_NAN,
             *test_exercises_parts_1_2.WRONG, *test_exercises_parts_3_4.WRONG,
             *test_exercises_float16_arithmetic.FLOAT16_ARITHMETIC]
    counts = Counter(exercise for exercise, *_ in wrong)
    counts["15.3"] = 5  # test_exercises_ch15.py's wrong kernels (a parametrized list)
    assert set(counts) == set(EXERCISES) and min(counts.values()) >= 2, counts


# ---- session 53: the reports of AT53-X (F1-F5) and reader53-X (#9) ----


def grouped_half_unshifted(q, k, v):
    """4.2 in float16 with e^s of the raw scores: e^s is inf once s > 11.09 in float16."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    e = s.masked_fill(~causal, -math.inf).exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def test_a_float16_answer_that_overflows_gets_the_overflow_hint_not_the_rounding_one():
    from attnbook.exercises import _EXP16, _F16

    result = check("4.2", grouped_half_unshifted, show=False)
    assert result.case == "float16, keys with a large common part", result
    assert "yours nan" in result.problem or "yours inf" in result.problem, result
    assert result.hint == _EXP16 and "largest score" in result.hint
    assert _F16 not in result.hint


def test_a_float64_nan_where_the_answer_is_finite_keeps_the_cases_hint():
    result = check("11.1", cross_attention_minus_inf, show=False)
    assert result.hint == EXERCISES["11.1"].cases[3].hint


def test_a_0d_output_is_named_without_an_empty_index():
    from attnbook.exercises import _difference

    problem, diff, where = _difference(np.array(1.0), np.array(2.0), (1e-10, 1e-9))
    assert where == () and diff == 1.0
    assert problem.startswith("largest difference 1 at output: yours 1"), problem


def test_where_indexes_the_output_the_problem_names_in_a_tuple():
    from attnbook.exercises import _difference

    expected = (np.zeros(2), np.zeros((2, 3)))
    problem, _, where = _difference((np.zeros(2), np.eye(2, 3)), expected, (1e-10, 1e-9))
    assert "at output[1][0, 0]" in problem and where == (0, 0)
    assert "`output[2]` of a tuple" in " ".join(CheckResult.__doc__.split())


def test_every_row_with_no_true_is_counted_and_the_first_named():
    from attnbook.exercises import _describe

    keep = np.ones((4, 3), dtype=bool)
    keep[[0, 2]] = False
    assert _describe({"m": keep}) == "m (4, 3) bool with 6 of 12 True, none in 2 rows, the first [0]"
    one = torch.ones(3, 1, dtype=torch.bool)
    one[1] = False
    assert _describe({"m": one}) == "m (3, 1) bool with 2 of 3 True, none in row [1]"
    empty = torch.zeros(3, 0, dtype=torch.bool)  # rows of length 0 have no True
    assert _describe({"m": empty}) == "m (3, 0) bool with 0 of 0 True, none in 3 rows, the first [0]"
    assert _describe({"m": np.zeros((0, 5), bool)}) == "m (0, 5) bool with 0 of 0 True"


def test_a_large_expanded_mask_is_counted_without_a_float64_copy():
    import tracemalloc

    from attnbook.exercises import _describe

    row = np.zeros((1, 1, 1024), dtype=bool)
    row[..., :5] = True
    masks = {"numpy": np.broadcast_to(row, (8, 512, 1024)),  # 4 Mi entries, 4 KiB stored
             "torch": torch.from_numpy(row).expand(8, 512, 1024)}
    tracemalloc.start()
    try:
        text = _describe(masks)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert text == ("numpy (8, 512, 1024) bool with 20480 of 4194304 True, "
                    "torch (8, 512, 1024) bool with 20480 of 4194304 True")
    assert peak < 2**20, peak  # a float64 copy would be 32 MiB, a bool one 4 MiB


def test_chapter_3s_layer_in_float16_fails_the_float16_case_as_its_hint_says():
    from attnbook.layers import MultiHeadAttention

    def layer_in_float16(x, W_Q, W_K, W_V, W_O, num_heads):
        dtype = torch.from_numpy(x).dtype  # the layer in the inputs' dtype: float16 here
        layer = MultiHeadAttention(x.shape[-1], num_heads, bias=False).to(dtype)
        with torch.no_grad():
            for linear, W in zip((layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj),
                                 (W_Q, W_K, W_V, W_O)):
                linear.weight.copy_(torch.from_numpy(W.T))
            return layer(torch.from_numpy(x)).numpy()

    result = check("3.3", layer_in_float16, show=False)
    assert result.case == "float16, tokens with a large common part", result
    assert "MultiHeadAttention run in float16 fails this case" in result.hint
    def layer_in_float32(x, *rest):  # the same layer, widened: passes every case
        wide = np.promote_types(x.dtype, np.float32)
        return layer_in_float16(*(w.astype(wide) for w in (x, *rest[:4])), rest[4]).astype(x.dtype)

    assert check("3.3", layer_in_float32, show=False).passed


def rope_with_one_entry(value):
    """5.1 answered right, except that the float16 answer's first entry is `value`."""
    from attnbook.exercises import _rope_interleaved

    def rope(x, positions):
        y = _rope_interleaved(x.double(), positions).to(x.dtype)
        if x.dtype == torch.float16:
            y[0, 0, 0] = value
        return y
    return rope


def test_an_infinite_float16_answer_is_reported_as_inf_with_the_cases_own_hint():
    """inf must stay inf in the report (np.nan_to_num once made it 1.8e308); RoPE declares no
    overflow hint (nothing in it can pass 65504), so the case's own hint stays."""
    exercise = EXERCISES["5.1"]
    for value in (math.inf, -math.inf, math.nan):
        result = check("5.1", rope_with_one_entry(value), show=False)
        assert result.case.startswith("float16") and result.max_diff == math.inf, result
        assert f"largest difference inf at output[0, 0, 0]: yours {value}" in result.problem
        assert result.hint == next(c.hint for c in exercise.cases if c.name == result.case)
        assert "65504" not in result.hint, result


def bert_input_variance_by_moments(ids, segments, word, position, token_type, gamma, beta):
    """8.2 in float16 with the textbook variance E[x^2] - E[x]^2, which cancels to 0 or below."""
    x = word[ids] + position[: ids.shape[1]] + token_type[segments]
    mean = x.mean(-1, keepdim=True)
    variance = (x * x).mean(-1, keepdim=True) - mean * mean
    return (x - mean) / torch.sqrt(variance + 1e-12) * gamma + beta


def test_a_float16_nan_or_inf_from_cancellation_keeps_the_cases_hint_not_an_overflow_one():
    """8.2's float16 LayerNorm by moments gives inf and NaN although nothing passes 65504 (the
    variance cancels to 0 or below, and eps = 1e-12 is 0 in float16): the case's hint says so,
    and no overflow hint may replace it (one did, before exercises declared their own)."""
    exercise = EXERCISES["8.2"]
    number, case = next((i, c) for i, c in enumerate(exercise.cases) if "float16" in c.name)
    inputs, _ = case.build(np.random.default_rng([sum(map(ord, "8.2")), number]))
    x = inputs["word"][inputs["ids"]] + inputs["position"][: inputs["ids"].shape[1]] \
        + inputs["token_type"][inputs["segments"]]
    assert float((x.float() * x.float()).max()) < 65504 and float(torch.tensor(1e-12).half()) == 0
    result = check("8.2", bert_input_variance_by_moments, show=False)
    assert result.case == case.name and result.max_diff == math.inf, result
    assert result.hint == case.hint and "65504" not in result.hint, result


def test_a_wider_numpy_answer_to_a_float16_case_gets_no_overflow_hint():
    """A float64 answer with a NaN did not overflow float16: 3.3's case hint, not _EXP16."""
    from attnbook.exercises import _EXP16

    exercise = EXERCISES["3.3"]
    built = [c.build(np.random.default_rng([sum(map(ord, "3.3")), i]))
             for i, c in enumerate(exercise.cases)]

    def lookup_then_nan(*args):
        x = args[0]
        expected = next(e for inputs, e in built if inputs["x"].dtype == x.dtype
                        and inputs["x"].shape == x.shape and np.array_equal(inputs["x"], x))
        if args[0].dtype != np.float16:
            return expected
        answer = expected.astype(np.float64)
        answer[0, 1, 2] = np.nan
        return answer

    result = check("3.3", lookup_then_nan, show=False)
    assert result.case.startswith("float16") and "yours nan" in result.problem, result
    assert result.hint != _EXP16 and result.hint == next(
        c.hint for c in exercise.cases if c.name == result.case), result


def test_17_3s_float16_hints_name_what_overflows_on_the_cases_inputs():
    """The case's hint says the running sums reach thousands, the overflow hint that the
    numerator phi(q_i) . S_i passes 65504 in some rows (each once): measured on the case's own
    inputs, in float64; a float16 cumsum answer gets the overflow hint, which names no softmax."""
    exercise = EXERCISES["17.3"]
    number, case = next((i, c) for i, c in enumerate(exercise.cases) if "float16" in c.name)
    inputs, _ = case.build(np.random.default_rng([sum(map(ord, "17.3")), number]))
    q, k, v = (inputs[name].double() for name in "qkv")
    fq, fk = (torch.nn.functional.elu(t) + 1 for t in (q, k))
    sums = torch.cumsum(fk[..., :, None] * v[..., None, :], dim=-3), torch.cumsum(fk, dim=-2)
    numerator = torch.einsum("...ld,...ldv->...lv", fq, sums[0])  # (..., L, Dv)
    assert 1000 <= max(float(s.abs().max()) for s in sums) < 65504
    overflowing = int((numerator.abs() > 65504).any(-1).sum())
    assert 0 < overflowing < numerator.shape[-2]  # some rows, not all
    assert "running sums reach thousands" in case.hint and "numerator" not in case.hint
    assert "numerator phi(q_i) . S_i passes" in exercise.overflow_hint
    result = check("17.3", linear_sums_in_input_dtype, show=False)
    assert result.case == case.name and "yours inf" in result.problem, result
    assert result.hint == exercise.overflow_hint and "numerator" in result.hint
    assert "score" not in result.hint and "e^s" not in result.hint


def test_a_mask_of_the_wrong_dtype_is_told_its_dtype_without_advice_to_compute_wider():
    def int_window(q_len, k_len, window):  # the right mask, as int32 rather than bool
        distance = torch.arange(q_len)[:, None] + (k_len - q_len) - torch.arange(k_len)
        return ((distance >= 0) & (distance < window)).int()
    result = check("6.1", int_window, show=False)
    assert result.case == "one query, one key, window 1", result
    assert result.problem == ("output has dtype torch.int32, expected torch.bool: return "
                              "torch.bool (.to(torch.bool))")
    assert result.hint is None  # "compute wider" means nothing for a mask


def causal_loop_in(dtype):
    """Exercise 1.2's loop, right, but computed in `dtype` and returned as float64."""
    def loop(X, W_Q, W_K, W_V):
        X, W_Q, W_K, W_V = (a.astype(dtype) for a in (X, W_Q, W_K, W_V))
        Q, K, V = X @ W_Q, X @ W_K, X @ W_V
        rows = []
        for i in range(len(X)):
            s = Q[i] @ K[: i + 1].T / np.sqrt(Q.shape[1]).astype(dtype)
            w = np.exp(s - s.max())
            rows.append(w / w.sum() @ V[: i + 1])
        return np.array(rows).astype(np.float64)
    return loop


def test_a_rounding_note_puts_the_cases_logic_hint_after_a_word_on_rounding():
    result = check("1.2", causal_loop_in(np.float16), show=False)
    assert result.case == "one position" and "float16 or bfloat16 rounding size" in result.problem
    assert result.hint.startswith("rule out the rounding noted above first; if it stays: with "
                                  "one position the output is its own value")
    wrong = check("1.2", lambda X, W_Q, W_K, W_V: X @ W_K, show=False)  # far from rounding
    assert wrong.case == "one position" and wrong.hint.startswith("with one position")

    def float32_in_float16(*args):  # right for float64 inputs; float32 ones computed in float16
        return causal_loop_in(np.float64 if args[0].dtype == np.float64 else np.float16)(*args)
    in_float16 = check("1.2", float32_in_float16, show=False)
    assert in_float16.case == "float32" and "rounding size" in in_float16.problem
    assert in_float16.hint == EXERCISES["1.2"].cases[5].hint  # about rounding already: no word


def test_a_float16_case_hint_names_bfloat16s_bits_too():
    def grouped_in_bfloat16(q, k, v):  # float16 inputs computed in bfloat16, others as given
        group, out = q.shape[1] // k.shape[1], q.dtype
        work = torch.bfloat16 if out == torch.float16 else out
        q, k, v = (x.to(work) for x in (q, k.repeat_interleave(group, 1),
                                        v.repeat_interleave(group, 1)))
        lq, lk = q.shape[2], k.shape[2]
        later = torch.arange(lk) > torch.arange(lq)[:, None] + lk - lq
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(later, -math.inf)
        return (s.softmax(-1) @ v).to(out)
    result = check("4.2", grouped_in_bfloat16, show=False)
    assert result.case == "float16, keys with a large common part", result
    assert "float16 or bfloat16 arithmetic rounds every intermediate result (to 11 or 8 " \
        "significant bits)" in result.hint
