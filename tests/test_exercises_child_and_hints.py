"""attnbook.exercises (appendix F): what a candidate does in a child process (an exception that
cannot travel, a thread left running, an exit, an answer too large to send in time) never makes
`check` raise or hang; and which hint a report gives when the candidate raises or returns a
narrower dtype."""

import os
import threading
import time

import numpy as np
import pytest
import torch
from test_exercises_parts_1_2 import heads_numpy, softmax_backward

from attnbook import exercises
from attnbook.exercises import EXERCISES, Case, Exercise, check


def _doubling(rng):
    x = torch.from_numpy(rng.standard_normal(4))
    return {"x": x}, 2 * x


@pytest.fixture()
def in_child(monkeypatch):
    """A one-case exercise 'child' whose calls run in a child process."""
    exercise = Exercise("double x", (Case("four numbers", _doubling, "CASE HINT"),),
                        in_child=lambda: True, crash_hint="CRASH HINT")
    monkeypatch.setitem(EXERCISES, "child", exercise)
    return "child"


class ShapeError(Exception):
    def __init__(self, got, wanted):  # two arguments: pickle cannot rebuild it from its args
        super().__init__(f"{got} is not {wanted}")


class Slow:
    """An answer whose pickling takes 4 s: its sending runs past a 1 s limit."""

    def __getstate__(self):
        time.sleep(4)
        return {}


def test_an_exception_that_cannot_be_unpickled_is_reported_as_text(in_child):
    def raises(x):
        raise ShapeError((2, 3), (3, 2))

    result = check(in_child, raises, show=False)
    assert not result.passed and result.problem == "raised ShapeError: (2, 3) is not (3, 2)"
    assert result.hint == "CASE HINT"


def test_an_exception_that_cannot_be_pickled_is_reported_as_text(in_child):
    def raises(x):
        raise ValueError("bad", lambda: 0)

    result = check(in_child, raises, show=False)
    assert result.problem.startswith("raised ValueError: ('bad', <function"), result.problem


def test_an_exception_whose_message_fails_is_reported_in_a_thread():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    def raises(x, positions):
        raise Unprintable()

    result = check("5.1", raises, show=False)
    assert result.problem == "raised Unprintable: (its message cannot be shown)"


def test_a_thread_left_running_in_the_child_is_not_waited_for(in_child):
    def leaves_a_thread(x):
        threading.Thread(target=time.sleep, args=(120,), daemon=False).start()
        return 2 * x

    started = time.perf_counter()  # a generous limit: a loaded machine forks slowly (3 s failed)
    result = check(in_child, leaves_a_thread, timeout=30, show=False)
    assert result.passed, result
    assert time.perf_counter() - started < 120  # the child was killed, not joined for 120 s


@pytest.mark.parametrize("code", [0, 3])
def test_an_exit_is_reported_as_an_exit_without_the_crash_hint(in_child, code):
    def exits(x):
        os._exit(code)

    result = check(in_child, exits, show=False)
    assert result.problem.startswith(f"its process exited with code {code}"), result.problem
    assert result.hint is None


def test_an_answer_too_large_to_send_in_time_is_said_so(in_child):
    result = check(in_child, lambda x: Slow(), timeout=1, show=False)
    assert "too large to send back" in result.problem and "no answer" not in result.problem


def test_a_candidate_that_raises_on_its_case_gets_the_case_hint():
    def gathers_minus_100(logits, labels):  # indexes the logits with the label -100
        chosen = labels != -100
        picked = logits.gather(-1, labels[..., None])[..., 0]
        return (logits.logsumexp(-1) - picked)[chosen].mean()

    result = check("9.3", gathers_minus_100, show=False)
    assert result.problem.startswith("raised ") and "never index the logits with -100" in result.hint


def test_a_float32_numpy_answer_for_float64_inputs_gets_a_dtype_hint():
    def in_float32(X, W_Q, W_K, W_V):  # right numbers, rounded to float32 at the end
        return exercises._causal_rows(X, W_Q, W_K, W_V).astype(np.float32)

    result = check("1.2", in_float32, show=False)
    assert "has dtype float32, expected float64 or wider" in result.problem, result.problem
    assert result.hint == exercises._DTYPE_HINT


# ---- the cases of appendix G that the findings named ---------------------------------------------

def test_a_masked_multiply_fails_on_a_nan_logit_at_an_ignored_position():
    def masked_multiply(logits, labels):  # every position's loss, times a 0/1 mask
        chosen = labels != -100
        losses = logits.logsumexp(-1) - logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (losses * chosen).sum() / chosen.sum()

    result = check("9.3", masked_multiply, show=False)
    assert result.case == "a NaN and an inf logit at positions labelled -100", result
    assert "an unchosen position's logits are never read" in result.hint


def test_the_roofline_nan_hint_names_the_argument_order():
    def python_min(intensity, gpu):
        from attnbook.tiling import GPUS
        spec = GPUS[gpu]
        return np.array([min(spec.peak_flops(2), i * spec.bandwidth)
                         for i in intensity.ravel()]).reshape(intensity.shape)

    result = check("14.2", python_min, show=False)
    assert result.case == "a NaN among the intensities" and "min(peak, x)" in result.hint


def test_a_float16_case_names_float16_arithmetic_only_where_it_catches_it():
    # measured: answers in their inputs' float16 arithmetic throughout fail these cases (the
    # inputs share a large common part), so their hints name float16 arithmetic as the mistake
    assert not check("2.3", lambda s, g: softmax_backward(s, g, work=s.dtype), show=False).passed
    assert not check("3.3", lambda *a: heads_numpy(*a, work=a[0].dtype), show=False).passed
    for exercise_id in ("2.3", "3.3", "4.2", "11.1", "16.1", "19.3"):
        hint = next(c.hint for c in EXERCISES[exercise_id].cases if c.name.startswith("float16"))
        assert hint.startswith(exercises._F16), exercise_id
