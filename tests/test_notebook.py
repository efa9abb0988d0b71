"""attnbook.notebook (appendix A): glue for the prose, at the precision a cell asserts."""

import math
import sys

import pytest

from attnbook.notebook import glue, significant


@pytest.mark.parametrize("value, digits", [(0.017515176143916008, 4), (4.291691890436166, 3),
                                           (-8123456.0, 2), (2.5e-7, 1), (0.99996, 3), (7, 1)])
def test_significant_agrees_with_python_formatting(value, digits):
    assert significant(value, digits) == float(f"{value:.{digits}g}")


def test_significant_keeps_zero_and_non_finite_values():
    assert significant(0.0, 3) == 0.0
    assert math.isnan(significant(float("nan"), 3))
    assert significant(float("inf"), 2) == float("inf")


@pytest.mark.parametrize("digits, error", [(0, ValueError), (-1, ValueError), (2.0, TypeError),
                                           (True, TypeError), ("3", TypeError)])
def test_significant_names_a_bad_digits(digits, error):
    with pytest.raises(error, match="digits"):
        significant(1.5, digits)


def recorded(monkeypatch) -> list:
    calls = []
    myst_nb = pytest.importorskip("myst_nb")  # the book's toolchain, absent from a package run

    monkeypatch.setattr(myst_nb, "glue", lambda name, value, display: calls.append(
        (name, value, display)))
    return calls


def test_glue_records_through_myst_nb_rounded_when_asked(monkeypatch):
    calls = recorded(monkeypatch)
    glue("ratio", 0.017515176143916008, digits=3)
    glue("count", 79)
    assert calls == [("ratio", 0.0175, False), ("count", 79, False)]


def test_glue_does_nothing_without_myst_nb(monkeypatch):
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # import myst_nb now raises ImportError
    assert glue("ratio", 0.5, digits=2) is None


def test_glue_refuses_to_round_what_is_not_a_number():
    with pytest.raises(TypeError, match="ratio='high'"):
        glue("ratio", "high", digits=2)
