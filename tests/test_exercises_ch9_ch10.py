"""attnbook.exercises, appendix G's chapters 9 and 10 (the masked-language-model loss, the
warm-up and cosine schedule): a right answer written without the package passes, and the wrong
answers readers write fail at the case whose hint names their mistake."""

import math

import pytest
import torch
from test_exercises import assert_fails_with_hint

from attnbook.exercises import EXERCISES, check

# ---- 9.3: the masked-language-model loss ------------------------------------------------------


def mlm_loss(logits, labels):
    """logsumexp minus the label's logit, averaged over the chosen positions of the batch."""
    chosen = labels != -100
    picked = logits[chosen]  # (N, V)
    own = picked.gather(-1, labels[chosen][:, None])[:, 0]
    return (torch.logsumexp(picked, dim=-1) - own).mean()


def _nll(logits, labels):
    """-log p of the label at every position, 0 where the label is -100: (B, L)."""
    chosen = labels != -100
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return -picked * chosen, chosen


def mlm_over_every_position(logits, labels):  # divided by B * L, not by the chosen count
    nll, _ = _nll(logits, labels)
    return nll.sum() / labels.numel()


def mlm_mean_of_sequence_means(logits, labels):  # each sequence weighs the same
    nll, chosen = _nll(logits, labels)
    return (nll.sum(-1) / chosen.sum(-1)).nan_to_num().mean()


def mlm_without_max(logits, labels):  # log(sum(e^s)) overflows for large logits
    chosen = labels != -100
    picked = logits[chosen]
    own = picked.gather(-1, labels[chosen][:, None])[:, 0]
    return (picked.exp().sum(-1).log() - own).mean()


def mlm_zero_when_nothing_chosen(logits, labels):  # a count clamped at 1: 0 / 1 = 0
    nll, chosen = _nll(logits, labels)
    return nll.sum() / chosen.sum().clamp(min=1)


def mlm_nan_to_num(logits, labels):  # NaN logits read as 0
    return mlm_loss(logits.nan_to_num(0.0), labels)


# ---- 10.2: the learning-rate schedule ---------------------------------------------------------


def _cosine(step, steps, lr, warmup, low, first=1):
    done = (step - first - warmup) / max(steps - warmup, 1)
    return lr * (low + (1 - low) * (1 + torch.cos(math.pi * done)) / 2)


def schedule(steps, lr, warmup, min_lr_ratio):
    """Every step at once: a line up to lr, then half a cosine down to min_lr_ratio * lr."""
    step = torch.arange(1, steps + 1, dtype=torch.float64)
    rise = lr * step / max(warmup, 1)
    return torch.where(step <= warmup, rise, _cosine(step, steps, lr, warmup, min_lr_ratio))


def schedule_from_step_0(steps, lr, warmup, min_lr_ratio):  # steps counted 0..steps-1
    step = torch.arange(steps, dtype=torch.float64)
    down = _cosine(step, steps, lr, warmup, min_lr_ratio, first=0)
    return torch.where(step < warmup, lr * step / max(warmup, 1), down)


def schedule_to_zero(steps, lr, warmup, min_lr_ratio):  # the floor forgotten
    return schedule(steps, lr, warmup, 0.0)


def schedule_clamped(steps, lr, warmup, min_lr_ratio):  # a cosine to 0, clamped at the floor
    return schedule(steps, lr, warmup, 0.0).clamp(min=lr * min_lr_ratio)


def schedule_reaching_the_floor(steps, lr, warmup, min_lr_ratio):  # done = 1 at the last step
    step = torch.arange(1, steps + 1, dtype=torch.float64)
    down = _cosine(step, steps, lr, warmup, min_lr_ratio, first=0)
    return torch.where(step <= warmup, lr * step / max(warmup, 1), down)


def schedule_in_float32(steps, lr, warmup, min_lr_ratio):  # arange's default dtype, widened late
    step = torch.arange(1, steps + 1, dtype=torch.float32)
    down = _cosine(step, steps, lr, warmup, min_lr_ratio)
    return torch.where(step <= warmup, lr * step / max(warmup, 1), down).double()


RIGHT = [("9.3", mlm_loss), ("10.2", schedule)]


@pytest.mark.parametrize("exercise, candidate", RIGHT, ids=[e for e, _ in RIGHT])
def test_a_right_answer_written_another_way_passes(exercise, candidate):
    result = check(exercise, candidate, show=False)
    assert result.passed, result
    assert result.cases_passed == len(EXERCISES[exercise].cases) >= 6


WRONG = [
    ("9.3", mlm_over_every_position, "one sequence, three of eight positions chosen", "not by L"),
    ("9.3", mlm_mean_of_sequence_means, "4 sequences with 1, 3, 0 and 6 chosen positions",
     "not a mean of each sequence's mean"),
    ("9.3", mlm_without_max, "logits in the thousands", "709.78"),
    ("9.3", mlm_zero_when_nothing_chosen, "no chosen position", "NaN (0 / 0"),
    ("9.3", mlm_nan_to_num, "a NaN logit at a chosen position", "never replace a NaN"),
    ("10.2", schedule_from_step_0, "four steps, all warm-up", "steps count from 1"),
    ("10.2", schedule_reaching_the_floor, "one step, no warm-up", "done = 0"),
    ("10.2", schedule_in_float32, "ten steps of cosine down to 0", "compute in float64"),
    ("10.2", schedule_to_zero, "500 steps, 30 of warm-up, floor 0.1", "not to 0"),
    ("10.2", schedule_clamped, "500 steps, 30 of warm-up, floor 0.1", "not one clamped"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG,
                         ids=[f"{e}-{c.__name__}" for e, c, _, _ in WRONG])
def test_a_wrong_answer_fails_with_the_hint_for_its_mistake(exercise, candidate, case, words):
    assert_fails_with_hint(exercise, candidate, case, words)


def test_a_float32_schedule_is_told_the_rounding_it_shows():
    result = check("10.2", schedule_in_float32, show=False)
    assert "float32 rounding size" in result.problem

