"""attnbook.exercises: the NaN cases of 4.2 and 14.2 and the float16 cases of 2.3, 3.3, 4.2, 8.2,
11.1 and 16.1 (appendix G). A right float16 answer passes them (the right answers of
test_exercises_parts_*.py, which pass every case); answers that turn a NaN into a number, that
keep float32's result, or that normalise in float16, fail them with their own report."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_exercises import assert_fails_with_hint

from attnbook import exercises
from attnbook.exercises import EXERCISES, check
from attnbook.tiling import GPUS

# ---- NaN: 4.2 and 14.2 ------------------------------------------------------------------------


def grouped(q, k, v, *, nan_to_num=False, added_mask=False, keep_float32=False):
    """Causal grouped-query attention by broadcasting (chapter 4's exercise 2), in float32 or
    wider; the keywords make the mistakes below."""
    b, h, length, d = q.shape
    work = torch.promote_types(q.dtype, torch.float32)
    groups = q.to(work).view(b, k.shape[1], h // k.shape[1], length, d)  # (B, H_kv, G, L, d)
    scores = groups @ k.to(work)[:, :, None].transpose(-2, -1) / math.sqrt(d)
    if nan_to_num:
        scores = scores.nan_to_num(0.0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if added_mask:  # -inf added: a NaN score at a hidden key stays NaN
        scores = scores + torch.zeros(length, length, dtype=work).masked_fill(~causal, -math.inf)
    else:
        scores = scores.masked_fill(~causal, -math.inf)
    out = (scores.softmax(-1) @ v.to(work)[:, :, None]).reshape(b, h, length, d)
    return out if keep_float32 else out.to(q.dtype)


def roofline_fmin(intensity, gpu):  # np.fmin drops a NaN
    spec = GPUS[gpu]
    return np.fmin(spec.peak_flops(2), intensity * spec.bandwidth)


def roofline_where(intensity, gpu):  # NaN < peak is False: the peak
    spec = GPUS[gpu]
    memory = intensity * spec.bandwidth
    return np.where(memory < spec.peak_flops(2), memory, spec.peak_flops(2))


NAN_42 = "a NaN in key/value head 1's key at position 3"
NAN_142 = "a NaN among the intensities"
WRONG_NAN = [
    ("4.2", lambda q, k, v: grouped(q, k, v, nan_to_num=True), NAN_42, "never replace a NaN"),
    ("4.2", lambda q, k, v: grouped(q, k, v, added_mask=True), NAN_42, "masked_fill"),
    ("14.2", roofline_fmin, NAN_142, "np.fmin"),
    ("14.2", roofline_where, NAN_142, "np.where(x < peak, x, peak)"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG_NAN,
                         ids=["nan_to_num", "mask_added", "fmin", "where"])
def test_an_answer_that_turns_a_nan_into_a_number_fails_on_the_nan_case(
        exercise, candidate, case, words):
    assert_fails_with_hint(exercise, candidate, case, words)
    result = check(exercise, candidate, show=False)
    assert result.max_diff == math.inf  # a number where the reference has NaN, or the reverse


def test_the_right_answers_keep_the_nan_where_the_chapters_say():
    assert check("4.2", grouped, show=False).passed
    intensity = np.array([2.0, np.nan, 900.0])
    roof = np.minimum(GPUS["H100"].peak_flops(2), intensity * GPUS["H100"].bandwidth)
    assert np.isnan(roof[1]) and np.isfinite(roof[[0, 2]]).all()
    # the NaN case's expected outputs: NaN exactly in group 1's heads from position 3, sequence 0
    inputs, expected = EXERCISES["4.2"].cases[-1].build(np.random.default_rng(0))
    nan_rows = expected.isnan().any(-1)  # (B, H, L)
    assert nan_rows[0, 3:, 3:].all() and nan_rows.sum() == 3 * 4 and not nan_rows[1].any()


# ---- float16 ----------------------------------------------------------------------------------

FLOAT16 = {"2.3": "float16, 300 keys, gradients near 1000",
           "3.3": "float16, tokens with a large common part",
           "4.2": "float16, keys with a large common part",
           "8.2": "float16 tables, word vectors with a large common part",
           "11.1": "float16, keys with a large common part",
           "16.1": "float16, keys and values with large common parts",
           "19.3": "float16, keys with a large common part"}


@pytest.mark.parametrize("exercise", FLOAT16)
def test_each_exercise_has_a_float16_case_at_float16_tolerance(exercise):
    case = next(c for c in EXERCISES[exercise].cases if c.name == FLOAT16[exercise])
    inputs, expected = case.build(np.random.default_rng(0))
    dtypes = {str(x.dtype).removeprefix("torch.") for x in inputs.values() if hasattr(x, "dtype")}
    assert "float16" in dtypes and "float16" in str(expected[0].dtype if isinstance(
        expected, tuple) else expected.dtype)
    assert EXERCISES[exercise].tolerance is None  # the dtype's: (1e-3, 2e-3)


def bert_input_normalised_in_float16(ids, segments, word, position, token_type, gamma, beta):
    x = word[ids] + position[: ids.shape[1]] + token_type[segments]  # (B, L, d) in float16
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-12) * gamma + beta


def cross_attention_kept_in_float32(q, k, v, src_keep):
    work = [x.to(torch.promote_types(x.dtype, torch.float32)) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*work, attn_mask=src_keep[:, None, None, :])


def backward_kept_in_float32(q, k, v, dout, causal):
    leaves = [x.detach().to(torch.promote_types(x.dtype, torch.float32)).requires_grad_()
              for x in (q, k, v)]
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask if causal else None)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def test_a_float16_layer_norm_in_float16_arithmetic_fails_with_its_hint():
    assert_fails_with_hint("8.2", bert_input_normalised_in_float16,
                           "float16 tables, word vectors with a large common part",
                           "normalise in float32")
    result = check("8.2", bert_input_normalised_in_float16, show=False)
    # the word vectors near 200 move the answer far past a few roundings: the hint, not a note
    # on rounding in the problem, says to compute in float32
    assert result.hint.startswith("float16 input: compute in float32 and round to float16 once")
    assert "round" not in result.problem and result.max_diff > 0.1


@pytest.mark.parametrize("exercise, candidate", [
    ("4.2", lambda q, k, v: grouped(q, k, v, keep_float32=True)),
    ("11.1", cross_attention_kept_in_float32), ("16.1", backward_kept_in_float32)],
    ids=["4.2", "11.1", "16.1"])
def test_a_float16_answer_left_in_float32_fails_on_the_float16_case(exercise, candidate):
    result = check(exercise, candidate, show=False)
    assert result.case == FLOAT16[exercise], result
    assert "expected torch.float16" in result.problem and result.hint == exercises._DTYPE_HINT
