"""Exercise 15.3 (appendix G, chapter 15's cases): check passes a right answer and fails wrong ones
at the case whose hint names their mistake. The cases build with the package's Triton kernels, in
the interpreter (the root conftest chooses it before anything imports Triton)."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton (the triton extra) has wheels for Linux only")

from attnbook.exercises import EXERCISES, check  # noqa: E402


def scores(q, k, dtype=torch.float64):
    return (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])


def bottom_right(lq, lk, device):
    """Query i sees key j iff j <= i + lk - lq (chapter 6's causal mask)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


def right(q, k, causal):
    """An answer written apart from the kernels: float64 scores, torch.logsumexp."""
    s = scores(q, k)
    if causal:
        s = s.masked_fill(~bottom_right(q.shape[-2], k.shape[-2], q.device), -math.inf)
    return torch.logsumexp(s, -1).float()  # -inf for a row of -inf


def base_two(q, k, causal):
    """The kernel's m + log2(l), not divided by log2(e)."""
    return right(q, k, causal) / math.log(2)


def top_left(q, k, causal):
    """The causal mask aligned top-left: query i sees key j iff j <= i."""
    s = scores(q, k)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(0), -math.inf)
    return torch.logsumexp(s, -1).float()


def nan_for_no_key(q, k, causal):
    """The running maximum subtracted even where it is still -inf: NaN for a row with no key."""
    s = scores(q, k)
    if causal:
        s = s.masked_fill(~bottom_right(q.shape[-2], k.shape[-2], q.device), -math.inf)
    m = s.amax(-1, keepdim=True)
    return (m.squeeze(-1) + (s - m).exp().sum(-1).log()).float()


def no_running_maximum(q, k, causal):
    """exp of the scores themselves, in float32."""
    s = scores(q, k, torch.float32)
    if causal:
        s = s.masked_fill(~bottom_right(q.shape[-2], k.shape[-2], q.device), -math.inf)
    return s.exp().sum(-1).log()


def contiguous_strides(x):
    """The strides x would have if it were contiguous, (H L D, L D, D, 1)."""
    return torch.empty(x.shape).stride()


def k_read_as_contiguous(q, k, causal):
    """A kernel that passes k's strides as if k were contiguous: it reads the wrong numbers."""
    wrong = torch.as_strided(k, k.shape, contiguous_strides(k), k.storage_offset())
    return right(q, wrong, causal)


def test_a_right_answer_passes_every_case(capsys):
    result = check("15.3", right)
    assert result.passed and result.cases == len(EXERCISES["15.3"].cases) == 7
    assert capsys.readouterr().out == ("check 15.3 (the logsumexp of each query row, in Triton): "
                                       "passed all 7 cases.\n")


@pytest.mark.parametrize("candidate, case, words", [
    (base_two, "one query, one key", "divide m + log2(l) by log2(e)"),
    (top_left, "causal, 40 queries, 100 keys", "aligned bottom-right"),
    (nan_for_no_key, "causal, 100 queries, 40 keys", "-inf, not NaN"),
    (no_running_maximum, "scores in the thousands", "overflows float32"),
    (k_read_as_contiguous, "q and k strided along D", "read q and k through their own"),
], ids=lambda x: getattr(x, "__name__", None))
def test_a_wrong_answer_fails_at_the_case_that_names_its_mistake(candidate, case, words):
    result = check("15.3", candidate, show=False)
    assert not result.passed and result.case == case, (result.case, result.problem)
    assert words in result.hint, result.hint


def test_the_expected_answers_agree_with_torch():
    # The cases' expected answers come from the package's kernel: they must be the natural
    # logsumexp, -inf where a row sees no key, as an independent computation gives.
    from attnbook.kernels import INTERPRETED

    assert INTERPRETED
    for number, case in enumerate(EXERCISES["15.3"].cases):
        inputs, expected = case.build(np.random.default_rng(number))
        ours = right(*inputs.values())
        assert expected.dtype == torch.float32 and expected.shape == ours.shape, case.name
        assert torch.equal(expected.isneginf(), ours.isneginf()), case.name
        torch.testing.assert_close(expected, ours, rtol=1e-5, atol=1e-4)
