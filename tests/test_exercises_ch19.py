"""attnbook.exercises, appendix G's chapter 19 (causal attention with ALiBi, as in BLOOM): a right
answer written without the package passes, with transformers' formula for the slopes computed in
Python floats (transformers' own float32 slopes fail on float64 input, as the exercise's dtype rule
says), and the wrong answers readers write fail at the case whose hint names their mistake
(test_exercises_float16_arithmetic.py: the float16 case catches float16 arithmetic)."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_exercises import assert_fails_with_hint

from attnbook.exercises import EXERCISES, TOLERANCES, check
from attnbook.positions import alibi_slopes


def bloom_slopes(n):
    """The slopes as transformers' BLOOM writes them: powers of a base, the heads past the largest
    power of two m taking the odd powers of the base of 2m (a list of Python floats)."""
    m = 2 ** math.floor(math.log2(n))
    base, extra = 2.0 ** (-8.0 / m), 2.0 ** (-4.0 / m)
    return [base**p for p in range(1, m + 1)] + [extra**p for p in range(1, 2 * (n - m), 2)]


def alibi_by_positions(q, k, v, work=None, slopes=bloom_slopes, sign=-1.0, scale_bias=False,
                       top_left=False, bias_at="scores"):
    """19.3: BLOOM's slopes, each key's bias from the positions, the later keys hidden with
    torch.where, in float32 or wider (or `work`); the keywords make the readers' mistakes."""
    (h, lq, d), lk = q.shape[1:], k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32) if work is None else work
    q2, k2, v2 = (x.to(work) for x in (q, k, v))
    query_at = torch.arange(lq)[:, None] + (0 if top_left else lk - lq)  # (Lq, 1)
    key_at = torch.arange(lk)[None, :]  # (1, Lk)
    bias = sign * torch.tensor(slopes(h), dtype=work)[:, None, None] * (query_at - key_at)
    scores = q2 @ k2.transpose(-2, -1)
    if bias_at == "scores":  # "weights": added to the softmax's weights; None: left out
        scores = (scores + bias) / math.sqrt(d) if scale_bias else scores / math.sqrt(d) + bias
    else:
        scores = scores / math.sqrt(d)
    weights = torch.softmax(torch.where(key_at <= query_at, scores, -math.inf), dim=-1)
    if bias_at == "weights":
        weights = weights + torch.where(key_at <= query_at, bias, 0.0)
    return (weights @ v2).to(q.dtype)


def test_bloom_slopes_are_chapter_5s_for_1_to_64_heads():
    for n in range(1, 65):
        torch.testing.assert_close(torch.tensor(bloom_slopes(n), dtype=torch.float64),
                                   alibi_slopes(n, dtype=torch.float64), rtol=1e-14, atol=0)


def test_a_right_answer_written_another_way_passes():
    result = check("19.3", alibi_by_positions, show=False)
    assert result.passed, result
    assert result.cases_passed == len(EXERCISES["19.3"].cases) >= 8


# ---- wrong answers, of the kinds readers write ----------------------------------------------


def alibi_rewarding_distance(q, k, v):  # + m (i - j): far keys favoured
    return alibi_by_positions(q, k, v, sign=1.0)


def alibi_without_bias(q, k, v):  # the scores alone: causal attention
    return alibi_by_positions(q, k, v, bias_at=None)


def alibi_bias_after_softmax(q, k, v):  # the bias added to the weights
    return alibi_by_positions(q, k, v, bias_at="weights")


def alibi_not_causal(q, k, v):  # every key read, the bias |i - j| both ways
    b, h, lq, d = q.shape
    lk = k.shape[2]
    distance = (torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)).abs().to(q.dtype)
    slopes = torch.tensor(bloom_slopes(h), dtype=q.dtype)[:, None, None]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d) - slopes * distance
    return torch.softmax(scores, dim=-1) @ v


def alibi_bias_scaled(q, k, v):  # (q . k - m (i - j)) / sqrt(d)
    return alibi_by_positions(q, k, v, scale_bias=True)


def alibi_slopes_from_one(q, k, v):  # 2^(-8 h / n) for h = 0..n-1: the first slope is 1
    def shifted(n):
        return [2.0 ** (-8.0 * h / n) for h in range(n)]
    return alibi_by_positions(q, k, v, slopes=shifted)


def alibi_slopes_reversed(q, k, v):  # 1/256 first: the steepest slope on the last head
    return alibi_by_positions(q, k, v, slopes=lambda n: bloom_slopes(n)[::-1])


def alibi_geometric_slopes(q, k, v):  # 2^(-8 (h + 1) / n) for any n: BLOOM's only at 2^k
    def geometric(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    return alibi_by_positions(q, k, v, slopes=geometric)


def alibi_top_left(q, k, v):  # query i at position i, as PyTorch's is_causal
    return alibi_by_positions(q, k, v, top_left=True)


def alibi_float32_slopes(q, k, v):  # torch.tensor(slopes): float32 even for float64 inputs
    def rounded(n):
        return torch.tensor(bloom_slopes(n), dtype=torch.float32).tolist()
    return alibi_by_positions(q, k, v, slopes=rounded)


def alibi_with_a_minus_inf_bias(q, k, v):  # a float mask: a NaN key's NaN + -inf stays NaN
    work = torch.promote_types(q.dtype, torch.float32)
    lq, lk = q.shape[2], k.shape[2]
    distance = (torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)).to(work)
    slopes = torch.tensor(bloom_slopes(q.shape[1]), dtype=work)[:, None, None]
    bias = torch.where(distance >= 0, -slopes * distance, -math.inf)
    return F.scaled_dot_product_attention(*(x.to(work) for x in (q, k, v)),
                                          attn_mask=bias).to(q.dtype)


def alibi_nan_to_num(q, k, v):
    return alibi_by_positions(q, k.nan_to_num(0.0), v)


WRONG = [
    ("19.3", alibi_rewarding_distance, "one head, 200 positions, d = 1", "a penalty, subtracted"),
    ("19.3", alibi_without_bias, "one head, 200 positions, d = 1", "gets the bias -m (i - j)"),
    ("19.3", alibi_bias_after_softmax, "one head, 200 positions, d = 1", "before the softmax"),
    ("19.3", alibi_not_causal, "one head, 200 positions, d = 1", "keys 0..i only"),
    ("19.3", alibi_bias_scaled, "one head, 200 positions, d = 16", "not divided by sqrt(d)"),
    ("19.3", alibi_slopes_from_one, "one head, 200 positions, d = 1", "slope is m = 2^-8"),
    ("19.3", alibi_slopes_reversed, "eight heads, seven positions", "in that order"),
    ("19.3", alibi_geometric_slopes, "six heads, BLOOM's count in chapter 19",
     "every other slope of 8 heads"),
    ("19.3", alibi_top_left, "one new query after nine cached keys", "i + Lk - Lq"),
    ("19.3", alibi_float32_slopes, "a batch of 2, 12 heads, 5 queries after 40 keys",
     "in the inputs' dtype"),
    ("19.3", alibi_with_a_minus_inf_bias, "a NaN in head 1's key at position 3", "masked_fill"),
    ("19.3", alibi_nan_to_num, "a NaN in head 1's key at position 3", "never replace a NaN"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG,
                         ids=[f"{e}-{c.__name__}" for e, c, _, _ in WRONG])
def test_a_wrong_answer_fails_with_the_hint_for_its_mistake(exercise, candidate, case, words):
    assert_fails_with_hint(exercise, candidate, case, words)


@pytest.mark.parametrize("candidate", [alibi_rewarding_distance, alibi_without_bias,
                                       alibi_bias_after_softmax, alibi_bias_scaled])
def test_a_wrong_bias_is_not_reported_as_rounding(candidate):
    """A wrong bias moves the output far more than a rounding does, so the report does not tell
    a reader who computes in float64 to compute in float64 (appendix G: the cases' 200
    positions)."""
    result = check("19.3", candidate, show=False)
    assert not result.passed and result.case.startswith("one head, 200 positions"), result
    assert "largest difference" in result.problem and "rounding" not in result.problem, result


def test_transformers_float32_slopes_fail_the_float64_case_that_needs_float64_slopes():
    """transformers' BLOOM builds its slopes in float32 (build_alibi_tensor): on float64 input
    that is float32 rounding, which the exercise's dtype rule does not allow and the report
    names; the same answer with Python-float slopes passes (above)."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")

    def alibi_with_transformers_bias(q, k, v):
        (b, h, lq, d), lk = q.shape, k.shape[2]
        work = torch.promote_types(q.dtype, torch.float32)
        bias = bloom.build_alibi_tensor(torch.ones(b, lk), h, work).view(b, h, 1, lk)  # m_h j
        scores = q.to(work) @ k.to(work).transpose(-2, -1) / math.sqrt(d) + bias  # a row shift
        later = torch.arange(lk) > torch.arange(lq)[:, None] + lk - lq
        return (scores.masked_fill(later, -math.inf).softmax(dim=-1) @ v.to(work)).to(q.dtype)

    result = check("19.3", alibi_with_transformers_bias, show=False)
    assert result.case == "a batch of 2, 12 heads, 5 queries after 40 keys", result
    assert "in the inputs' dtype" in result.hint and "float32 rounding size" in result.problem


def test_the_reference_is_the_models_alibi_attention():
    """The cases' expected answers equal the package's own ALiBi attention inside a GPT block
    (chapter 7's path), which the chapter compares with transformers' BLOOM."""
    from attnbook.layers import Block, BlockConfig

    for number, case in enumerate(EXERCISES["19.3"].cases[:8]):  # the float64 and float32 cases
        inputs, expected = case.build(np.random.default_rng([sum(map(ord, "19.3")), number]))
        q, k, v = inputs.values()
        block = Block(BlockConfig(q.shape[1] * 4, q.shape[1], positions="alibi")).to(q.dtype)
        out, _ = block.self_attn.fast.with_weights(q, k, v, None, True, 0.0)
        torch.testing.assert_close(out, expected, **dict(zip(("atol", "rtol"),
                                                             TOLERANCES[str(q.dtype)[6:]])))


def test_every_hint_that_names_a_section_names_one_of_its_chapter():
    chapters = Path(__file__).resolve().parents[1] / "chapters"
    named = 0
    for case in EXERCISES["19.3"].cases:
        for number, section in re.findall(r'chapter (\d+), "([^"]+)"', case.hint):
            source = next(chapters.glob(f"{int(number):02d}-*.md")).read_text()
            assert f"## {section}\n" in source, (case.name, section)
            named += 1
    assert named >= 5


def _chapters_listed(text, before):
    """The chapter numbers of a list such as "chapters 2 to 4, 7, 18 and 19" after `before`."""
    listed = re.search(before + r" chapters ((?:\d+(?: to \d+)?(?:, | and ))*\d+(?: to \d+)?)",
                       " ".join(text.split()))
    assert listed, before
    numbers = set()
    for part in re.split(r", | and ", listed.group(1)):
        first, _, last = part.partition(" to ")
        numbers |= set(range(int(first), int(last or first) + 1))
    return numbers


def test_appendix_f_and_the_readme_list_every_chapter_whose_exercise_appendix_g_checks():
    root = Path(__file__).resolve().parents[1]
    in_g = {int(n) for n in re.findall(r'^EXERCISES\["(\d+)\.\d+"\]',
                                       (root / "chapters/a7-exercise-cases.md").read_text(), re.M)}
    assert {2, 9, 10, 19} <= in_g
    assert _chapters_listed((root / "chapters/a6-checking-exercises.md").read_text(),
                            "appendix G adds those of") == in_g
    assert _chapters_listed((root / "README.md").read_text(), "checkable exercises of") == in_g
