"""attnbook.exercises, appendix G's parts III and IV (chapters 12, 14, 16 and 18): a right answer
written independently of the book's passes every case, and the wrong answers readers write fail
the case whose hint names their mistake."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_exercises import (
    test_a_wrong_answer_fails_with_the_hint_for_its_mistake as fails_with_hint,
)

from attnbook.exercises import EXERCISES, check
from attnbook.tiling import GPUS

OURS = ("12.3", "14.2", "16.1", "18.1")

# ---- right answers, each written independently of the reference in appendix G ---------------


def keys_seen(q_len, k_len):
    """12.3: query i stands at position i + k_len - q_len and sees the keys up to it."""
    return (torch.arange(q_len) + (k_len - q_len) + 1).clamp(min=0)


def attainable(intensity, gpu):
    """14.2: the lower of the two roofs, element by element."""
    spec = GPUS[gpu]
    return np.minimum(spec.peak_flops(2), intensity * spec.bandwidth)


def attention_backward(q, k, v, dout, causal, delta=True, scale=None, top_left=False,
                       delta_dim=-1):
    """16.1 from chapter 16's formulas, in float32 or wider; the keyword arguments make the
    wrong answers below (no delta or one along the wrong axis, another scale, a top-left mask)."""
    dtype, work = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, dout = (x.to(work) for x in (q, k, v, dout))
    lq, lk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ k.transpose(-2, -1)  # (..., Lq, Lk)
    if causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool).tril(0 if top_left else lk - lq)
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).masked_fill(s.isneginf().all(-1, keepdim=True), 0.0)  # no key: 0
    dp = dout @ v.transpose(-2, -1)
    d_row = (p * dp).sum(delta_dim, keepdim=True) if delta else 0.0
    ds = p * (dp - d_row)
    grads = scale * ds @ k, scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout
    return tuple(g.to(dtype) for g in grads)


def backward_by_autograd(q, k, v, dout, causal):
    """16.1 through PyTorch's own attention: differentiate it, a query with no key masked out."""
    lq, lk = q.shape[-2], k.shape[-2]
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
    if mask is not None and not mask.any(-1).all():  # SDPA gives NaN there: count those rows out
        seeing = mask.any(-1)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
        out[..., seeing, :] = F.scaled_dot_product_attention(
            leaves[0][..., seeing, :], *leaves[1:], attn_mask=mask[seeing])
    else:
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    return tuple(g.to(q.dtype) for g in torch.autograd.grad(out, leaves, dout.double()))


def unpatchify(patches, image_size, channels):
    """18.1 with F.fold, which puts non-overlapping blocks back in place."""
    p = math.isqrt(patches.shape[-1] // channels)
    return F.fold(patches.transpose(1, 2), image_size, p, stride=p)


RIGHT = [("12.3", keys_seen), ("14.2", attainable), ("16.1", attention_backward),
         ("16.1", backward_by_autograd), ("18.1", unpatchify)]


@pytest.mark.parametrize("exercise, candidate", RIGHT, ids=[c.__name__ for _, c in RIGHT])
def test_a_right_answer_passes_every_case(exercise, candidate):
    result = check(exercise, candidate, show=False)
    assert result.passed and result.cases_passed == len(EXERCISES[exercise].cases), result


def test_every_exercise_of_parts_3_and_4_has_a_right_answer_here():
    assert {exercise for exercise, _ in RIGHT} == set(OURS) <= set(EXERCISES)


# ---- wrong answers of the kinds readers write: (exercise, candidate, failing case, hint words) --


def keys_seen_excluding_itself(q_len, k_len):
    return keys_seen(q_len, k_len) - 1


def keys_seen_top_left(q_len, k_len):  # query i at position i: PyTorch's is_causal
    return torch.arange(1, q_len + 1).clamp(max=k_len)


def keys_seen_unclamped(q_len, k_len):
    return torch.arange(q_len) + (k_len - q_len) + 1


def roofline_sum_of_times(intensity, gpu):  # computing and moving one after the other
    spec = GPUS[gpu]
    return intensity / (intensity / spec.peak_flops(2) + 1 / spec.bandwidth)


def roofline_without_peak(intensity, gpu):  # the bandwidth's roof alone
    return intensity * GPUS[gpu].bandwidth


def roofline_float32_peak(intensity, gpu):
    spec = GPUS[gpu]
    return np.minimum(spec.peak_flops(4), intensity * spec.bandwidth)


def roofline_python_min(intensity, gpu):
    spec = GPUS[gpu]
    return np.array([min(spec.peak_flops(2), i * spec.bandwidth) for i in intensity])


def backward_without_delta(q, k, v, dout, causal):
    return attention_backward(q, k, v, dout, causal, delta=False)


def backward_without_scale(q, k, v, dout, causal):
    return attention_backward(q, k, v, dout, causal, scale=1.0)


def backward_top_left(q, k, v, dout, causal):
    return attention_backward(q, k, v, dout, causal, top_left=True)


def backward_delta_along_queries(q, k, v, dout, causal):  # delta summed down the columns
    return attention_backward(q, k, v, dout, causal, delta_dim=-2)


def backward_nan_rows(q, k, v, dout, causal):  # softmax of a row of -inf: NaN, kept
    scale = 1 / math.sqrt(q.shape[-1])
    s = scale * q @ k.transpose(-2, -1)
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), -math.inf)
    p = torch.softmax(s, dim=-1)
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def unpatchify_rows_and_columns_swapped(patches, image_size, channels):
    return unpatchify(patches, image_size, channels).transpose(-2, -1)


def unpatchify_channel_last(patches, image_size, channels):  # each patch read as (p, p, C)
    b, n, size = patches.shape
    p, side = math.isqrt(size // channels), image_size // math.isqrt(size // channels)
    x = patches.view(b, side, side, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, image_size, image_size)


def unpatchify_patch_order_lost(patches, image_size, channels):  # (rows, p) read as (p, rows)
    b, n, size = patches.shape
    p, side = math.isqrt(size // channels), image_size // math.isqrt(size // channels)
    x = patches.view(b, side, side, channels, p, p).permute(0, 3, 4, 1, 5, 2)
    return x.reshape(b, channels, image_size, image_size)


WRONG = [
    ("12.3", keys_seen_excluding_itself, "one query, one key", "not [0]"),
    ("12.3", keys_seen_top_left, "one new query, 2049 cached keys", "bottom-right"),
    ("12.3", keys_seen_unclamped, "6 queries, 3 keys", "never below 0"),
    ("14.2", roofline_sum_of_times, "intensity 1 on the H100", "not their sum"),
    ("14.2", roofline_without_peak, "intensity 1000 on the H100", "GPUS[gpu].peak_flops(2)"),
    ("14.2", roofline_float32_peak, "intensity 1000 on the H100", "float16 peak"),
    ("16.1", backward_without_delta, "one query, one key", "delta = dout . out"),
    ("16.1", backward_delta_along_queries, "5 queries, 7 keys, d = 1", "the keys, dim=-1"),
    ("16.1", backward_without_scale, "6 queries and keys, d = 16", "1/sqrt(d)"),
    ("16.1", backward_top_left, "causal, 3 queries, 10 keys", "bottom-right"),
    ("16.1", backward_nan_rows, "causal, 6 queries, 3 keys", "not NaN"),
    ("18.1", unpatchify_rows_and_columns_swapped, "one 2 x 2 image, patches of one pixel",
     "row-major"),
    ("18.1", unpatchify_patch_order_lost, "4 x 4, patches of 2 x 2", "patch row before"),
    ("18.1", unpatchify_channel_last, "6 x 6, three channels, patches of 3 x 3", "channel first"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG,
                         ids=[f"{e}-{c.__name__}" for e, c, _, _ in WRONG])
def test_a_wrong_answer_fails_with_the_hint_for_its_mistake(exercise, candidate, case, words):
    fails_with_hint(exercise, candidate, case, words)  # appendix F's test, on these answers


def test_python_min_on_an_array_is_reported_as_raised_on_the_grid_case():
    result = check("14.2", roofline_python_min, show=False)
    assert result.case == "a grid of intensities on the T4" and result.problem.startswith("raised")


def test_a_count_as_floats_is_reported_as_a_wrong_dtype():
    result = check("12.3", lambda q_len, k_len: keys_seen(q_len, k_len).float(), show=False)
    assert result.case == "one query, one key" and "dtype torch.float32" in result.problem


def test_each_wrong_answer_is_a_mistake_on_its_own_exercise():  # every exercise: two or more
    counts = {exercise: sum(e == exercise for e, *_ in WRONG) for exercise in OURS}
    assert min(counts.values()) >= 2, counts
