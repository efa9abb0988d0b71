"""attnbook.exercises (appendices F and G): answers that swallow a NaN, hide a source that is all
padding badly, change their inputs' gradients or round through a narrower dtype fail, and the
report says what went wrong in terms that fit the inputs (session 51's findings)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_exercises import assert_fails_with_hint
from test_exercises_parts_1_2 import bert_input, heads_numpy, rms_norm, softmax_backward
from test_exercises_parts_3_4 import attention_backward, unpatchify

from attnbook.exercises import check


def _nan_to_zero(candidate):
    """The same answer with every NaN of its output replaced by 0 (np.nan_to_num)."""
    def swallowed(*args):
        out = candidate(*args)
        if isinstance(out, tuple):
            return tuple(torch.nan_to_num(t, nan=0.0) for t in out)
        return torch.nan_to_num(out, nan=0.0) if torch.is_tensor(out) else np.nan_to_num(out)
    swallowed.__name__ = f"{candidate.__name__}_without_nan"
    return swallowed


def cross_attention_nan_to_num(q, k, v, src_keep):  # the attacker's F1 answer, in float32
    dtype = q.dtype
    q, k, v = (x.to(torch.promote_types(dtype, torch.float32)) for x in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~src_keep[:, None, None, :], -math.inf)
    return (torch.nan_to_num(s.softmax(-1)) @ v).to(dtype)


def cross_attention_minus_inf(q, k, v, src_keep):  # NaN where a source is all padding
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.masked_fill(~src_keep[:, None, None, :], -math.inf).softmax(-1) @ v


def cross_attention_minus_1e9(q, k, v, src_keep):  # the mean of v where a source is all padding
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.masked_fill(~src_keep[:, None, None, :], -1e9).softmax(-1) @ v


def softmax_backward_unguarded(scores, grad):  # a stable softmax: NaN on a fully masked row
    shifted = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    return p * (grad - (p * grad).sum(axis=-1, keepdims=True))


def rms_norm_hf(x, weight, eps=1e-6):  # x.float(): float64 narrowed to float32
    w = x.float()
    return weight * (w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


WRONG = [  # (exercise, answer, the case it fails first, words of that case's hint)
    ("2.3", _nan_to_zero(softmax_backward), "a NaN score in row 1", "never replace a NaN"),
    ("2.3", softmax_backward_unguarded, "a row with every key masked", "subtract 0 there"),
    ("3.3", _nan_to_zero(heads_numpy), "a NaN in sequence 0, position 2", "never replace"),
    ("7.1", _nan_to_zero(rms_norm), "a NaN at position 1", "never replace a NaN"),
    ("7.1", rms_norm_hf, "float64: three positions of 8 features", "x.float() narrows"),
    ("8.2", _nan_to_zero(bert_input), "a NaN in one word's vector", "never replace a NaN"),
    ("11.1", cross_attention_nan_to_num, "a NaN in a source key", "never replace a NaN"),
    ("11.1", cross_attention_minus_inf, "a source that is all padding", "gets zeros"),
    ("11.1", cross_attention_minus_1e9, "a source that is all padding", "-1e9"),
    ("16.1", _nan_to_zero(attention_backward), "a NaN in query 2", "never replace a NaN"),
    ("18.1", _nan_to_zero(unpatchify), "a NaN pixel", "nowhere else"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG,
                         ids=[f"{e}-{c.__name__}" for e, c, _, _ in WRONG])
def test_a_wrong_answer_fails_with_the_hint_for_its_mistake(exercise, candidate, case, words):
    assert_fails_with_hint(exercise, candidate, case, words)


def test_an_answer_that_turns_on_its_inputs_gradients_is_reported():
    def backward_through_the_inputs(q, k, v, dout, causal):  # the attacker's F4 answer
        for t in (q, k, v):
            t.requires_grad_()
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(dout)
        return q.grad, k.grad, v.grad
    result = check("16.1", backward_through_the_inputs, show=False)
    assert not result.passed and result.cases_passed == 0
    assert "changed its input q's requires_grad or .grad" in result.problem


def test_float16_answers_computed_in_bfloat16_fail():
    def rms_norm_bfloat16(x, weight, eps=1e-6):
        work = x.to(torch.bfloat16) if x.dtype == torch.float16 else x
        out = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.to(work.dtype)).to(x.dtype)
    result = check("7.1", rms_norm_bfloat16, show=False)
    assert result.case == "float16 numbers in the hundreds"
    assert "bfloat16 rounding size" in result.problem


def test_a_rearrangement_must_be_exact():
    def unpatchify_through_bfloat16(patches, image_size, channels):
        out = unpatchify(patches, image_size, channels)
        return out.to(torch.bfloat16).to(out.dtype) if out.dtype == torch.float16 else out
    result = check("18.1", unpatchify_through_bfloat16, show=False)
    assert result.case == "float16" and "never round" in result.hint


def test_the_rounding_note_names_eps_for_float64_and_the_dtype_it_fits():
    def rms_norm_without_eps(x, weight):
        return rms_norm(x, weight, eps=0.0)
    missing_eps = check("7.1", rms_norm_without_eps, show=False)
    assert "such as eps" in missing_eps.problem
    # float64 in and out, eps left out: the note must not only say "compute in float64"
    assert missing_eps.problem.endswith("compute in float64 or wider, or check that constant")

    def bert_input_default_eps(ids, segments, word, position, token_type, gamma, beta):
        x = F.embedding(ids, word) + position[: ids.shape[1]] + F.embedding(segments, token_type)
        return F.layer_norm(x, x.shape[-1:], gamma, beta)  # PyTorch's eps, 1e-5, not 1e-12
    default_eps = check("8.2", bert_input_default_eps, show=False)  # float64's first band
    assert default_eps.problem.endswith("may be float32 rounding size (or of a constant such as "
                                        "eps): compute in float64 or wider, or check that constant")

    def heads_through_float16(x, W_Q, W_K, W_V, W_O, num_heads):
        rounded = (a.astype(np.float16).astype(np.float64) for a in (x, W_Q, W_K, W_V, W_O))
        return heads_numpy(*rounded, num_heads)
    in_float16 = check("3.3", heads_through_float16, show=False)
    assert "float16 or bfloat16 rounding size" in in_float16.problem

    wrong_in_float32 = check("11.1", lambda q, k, v, keep: q[..., :1, :].expand_as(q) * 0 + 7,
                             show=False)  # a wrong answer, far from any rounding
    assert "rounding" not in wrong_in_float32.problem


def test_a_wider_dtype_is_reported_with_what_to_return():
    def bert_input_float64(*args):
        return bert_input(*(a.double() if a.is_floating_point() else a for a in args))
    result = check("8.2", bert_input_float64, show=False)
    assert result.case == "float32 tables"
    assert "expected torch.float32: return torch.float32 (compute wider" in result.problem
    assert ".to(torch.float32)" in result.problem


@pytest.mark.parametrize("make, words", [
    (lambda: torch.zeros(1, 1, 2, 2, dtype=torch.float64, device="meta"), "meta device"),
    (lambda: torch.zeros(1, 1, 2, 2, dtype=torch.float64).to_sparse(), "torch.sparse_coo"),
])
def test_meta_and_sparse_answers_are_named_as_such(make, words):
    result = check("18.1", lambda patches, image_size, channels: make(), show=False)
    assert result.case == "one 2 x 2 image, patches of one pixel"
    assert words in result.problem and "real numbers" not in result.problem
