"""attnbook.exercises (appendix F), issue 40 item by item: a case's mask is described by its
content, not only its shape; the place of the largest difference is a tuple of Python ints that
a test compares and a reader reads as it prints; every teaching chapter's solution passes its
checkable exercise, and each exercise fails two or more wrong answers with their hints."""

import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from attnbook.exercises import EXERCISES, check


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


# ---- issue 40's coverage: every teaching chapter, its solution, two wrong answers each --------

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"
NOT_CHECKABLE = {19: "its exercises ask for a parameter count and a converted model's tying"}


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
    import test_exercises_float16_arithmetic
    import test_exercises_nan_and_reports
    import test_exercises_nan_float16
    import test_exercises_parts_1_2
    import test_exercises_parts_3_4
    wrong = [*test_exercises.WRONG, *test_exercises_ch9_ch10.WRONG,
             *test_exercises_nan_and_reports.WRONG, *test_exercises_nan_float16.WRONG_NAN,
             *test_exercises_parts_1_2.WRONG, *test_exercises_parts_3_4.WRONG,
             *test_exercises_float16_arithmetic.FLOAT16_ARITHMETIC]
    counts = Counter(exercise for exercise, *_ in wrong)
    counts["15.3"] = 5  # test_exercises_ch15.py's wrong kernels (a parametrized list)
    assert set(counts) == set(EXERCISES) and min(counts.values()) >= 2, counts
