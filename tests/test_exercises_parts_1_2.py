"""attnbook.exercises, appendix G's parts I and II (chapters 2, 3, 4, 7, 8 and 11): each
exercise passes a right answer written independently of the package, and fails the wrong answers
readers write at the case whose hint names their mistake."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_exercises import assert_fails_with_hint

from attnbook.exercises import EXERCISES, check

# ---- right answers, each written without the package's reference ---------------------------


def softmax_backward(scores, grad, work=None):
    """2.3: J^T g = p * (g - p . g), the softmax written out (a row with no key: p = 0), in
    float32 or wider (`work`: the dtype to compute in instead)."""
    dtype = scores.dtype
    work = np.promote_types(dtype, np.float32) if work is None else work
    scores, grad = scores.astype(work), grad.astype(work)
    top = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - np.where(np.isneginf(top), 0.0, top))
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total == 0, 1.0, total)
    return (p * (grad - (p * grad).sum(axis=-1, keepdims=True))).astype(dtype)


def heads_numpy(x, W_Q, W_K, W_V, W_O, num_heads, work=None):
    """3.3 with a loop over heads and a stable softmax, in float32 or wider (or `work`)."""
    dtype = x.dtype
    work = np.promote_types(dtype, np.float32) if work is None else work
    x, W_Q, W_K, W_V, W_O = (a.astype(work) for a in (x, W_Q, W_K, W_V, W_O))
    d_head = x.shape[-1] // num_heads
    outputs = []
    for h in range(num_heads):
        cols = slice(h * d_head, (h + 1) * d_head)
        q, k, v = x @ W_Q[:, cols], x @ W_K[:, cols], x @ W_V[:, cols]  # (B, L, d_head)
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_head)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        outputs.append(e / e.sum(axis=-1, keepdims=True) @ v)
    return (np.concatenate(outputs, axis=-1) @ W_O).astype(dtype)


def grouped_sdpa(q, k, v):
    """4.2 through PyTorch's SDPA, the key/value heads repeated for each group."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rms_norm(x, weight, eps=1e-6):
    """7.1 through torch.nn.functional.rms_norm, in float32 or wider."""
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    return (F.rms_norm(work, (x.shape[-1],), eps=eps) * weight.to(work.dtype)).to(x.dtype)


def bert_input(ids, segments, word, position, token_type, gamma, beta, widen=True):
    """8.2 with torch.nn.functional.embedding and layer_norm, in float32 or wider (widen=False:
    in the tables' dtype, whose float16 sum loses what the LayerNorm keeps)."""
    dtype = word.dtype
    if widen:
        word, position, token_type, gamma, beta = (t.to(torch.promote_types(dtype, torch.float32))
                                                   for t in (word, position, token_type, gamma, beta))
    x = F.embedding(ids, word) + position[: ids.shape[1]] + F.embedding(segments, token_type)
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps=1e-12).to(dtype)


def cross_attention(q, k, v, src_keep):
    """11.1 through PyTorch's SDPA with a boolean mask over the keys."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=src_keep[:, None, None, :])


RIGHT = [("2.3", softmax_backward), ("3.3", heads_numpy), ("4.2", grouped_sdpa),
         ("7.1", rms_norm), ("8.2", bert_input), ("11.1", cross_attention)]


@pytest.mark.parametrize("exercise, candidate", RIGHT, ids=[e for e, _ in RIGHT])
def test_a_right_answer_written_another_way_passes(exercise, candidate):
    result = check(exercise, candidate, show=False)
    assert result.passed, result
    assert result.cases_passed == len(EXERCISES[exercise].cases) >= 4


# ---- wrong answers, of the kinds readers write ----------------------------------------------


def backward_without_mean(scores, grad):  # p * g: the diagonal of J alone
    shifted = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    return p * grad


def backward_summing_everything(scores, grad):  # p . g over the whole array, not per row
    shifted = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    return p * (grad - (p * grad).sum())


def backward_without_max(scores, grad):  # e^s overflows for large scores
    p = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
    return p * (grad - (p * grad).sum(axis=-1, keepdims=True))


def heads_scaled_by_d_model(x, W_Q, W_K, W_V, W_O, num_heads):  # sqrt(d_model), not sqrt(d_head)
    return _heads(x, W_Q, W_K, W_V, W_O, num_heads, np.sqrt(x.shape[-1]))


def _heads(x, W_Q, W_K, W_V, W_O, num_heads, scale, split=None):
    """3.3 with a given scale and way of cutting (B, L, d_model) into (B, H, L, d_head)."""
    b, length, d = x.shape
    split = split or (lambda t: t.reshape(b, length, num_heads, -1).transpose(0, 2, 1, 3))
    q, k, v = (split(x @ W) for W in (W_Q, W_K, W_V))
    s = q @ np.swapaxes(k, -1, -2) / scale
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    out = e / e.sum(axis=-1, keepdims=True) @ v  # (B, H, L, d_head)
    return out.transpose(0, 2, 1, 3).reshape(b, length, d) @ W_O


def heads_cut_without_transpose(x, W_Q, W_K, W_V, W_O, num_heads):  # straight to (B, H, L, d)
    b, length, d = x.shape
    return _heads(x, W_Q, W_K, W_V, W_O, num_heads, np.sqrt(d // num_heads),
                  lambda t: t.reshape(b, num_heads, length, -1))


def heads_softmax_over_queries(x, W_Q, W_K, W_V, W_O, num_heads):
    b, length, d = x.shape
    q, k, v = (x @ W for W in (W_Q, W_K, W_V))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(d // num_heads)  # one head's scores: H = 1 only
    e = np.exp(s - s.max(axis=-2, keepdims=True))
    return e / e.sum(axis=-2, keepdims=True) @ v @ W_O


def grouped_with_repeat(q, k, v):  # k.repeat: head h reads key/value head h % H_kv
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1),
                                          is_causal=True)


def grouped_not_causal(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v)


def grouped_stacked_by_view(q, k, v):  # chapter 4's stacked solution with view: a strided q fails
    b, h, length, d = q.shape
    group = h // k.shape[1]
    q2, k2, v2 = (x.to(torch.promote_types(x.dtype, torch.float32)) for x in (q, k, v))
    stacked = q2.view(b, k.shape[1], group * length, d)  # (B, H_kv, G L, d)
    causal = torch.ones(length, length, dtype=torch.bool).tril().repeat(group, 1)  # (G L, L)
    scores = (stacked @ k2.transpose(-2, -1) / d**0.5).masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ v2).view(b, h, length, d).to(q.dtype)


def rms_norm_centred(x, weight, eps=1e-6):  # LayerNorm without its shift: subtracts the mean
    work = x.double()
    centred = work - work.mean(-1, keepdim=True)
    return (centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight).to(x.dtype)


def rms_norm_eps_outside(x, weight, eps=1e-6):  # x / (rms + eps)
    work = x.double()
    return (work / (work.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight).to(x.dtype)


def rms_norm_in_input_dtype(x, weight, eps=1e-6):  # x^2 in float16 overflows
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def bert_input_positions_from_ids(ids, segments, word, position, token_type, gamma, beta):
    x = word[ids] + position[ids] + token_type[segments]
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps=1e-12)


def bert_input_without_norm(ids, segments, word, position, token_type, gamma, beta):
    return word[ids] + position[: ids.shape[1]] + token_type[segments]


def cross_attention_causal(q, k, v, src_keep):  # the decoder's self-attention mask reused
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=src_keep[:, None, None, :] & causal)


def cross_attention_ignoring_padding(q, k, v, src_keep):
    return F.scaled_dot_product_attention(q, k, v)


def cross_attention_keeping_padding(q, k, v, src_keep):  # True read as "hide"
    hide = src_keep[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~hide | hide.all(-1, keepdim=True))


WRONG = [
    ("2.3", backward_without_mean, "one key", "(g - p . g)"),
    ("2.3", backward_summing_everything, "a batch of rows, 3 x 5 x 6", "last axis only"),
    ("2.3", backward_without_max, "scores in the thousands", "709.78"),
    ("3.3", heads_scaled_by_d_model, "six positions, four heads of 4", "not sqrt(d_model)"),
    ("3.3", heads_cut_without_transpose, "six positions, four heads of 4", "move H before L"),
    ("3.3", heads_softmax_over_queries, "five positions, one head of 16", "over the keys"),
    ("4.2", grouped_with_repeat, "8 query heads sharing 2 key/value heads", "repeat_interleave"),
    ("4.2", grouped_not_causal, "four positions, one head", "keys 0..i"),
    ("4.2", grouped_stacked_by_view,
     "q, k and v as a layer's head split leaves them (not contiguous)", "use q.reshape"),
    ("7.1", rms_norm_centred, "one position, one feature", "subtracting the mean"),
    ("7.1", rms_norm_eps_outside, "one position, one feature", "eps inside the root"),
    ("7.1", rms_norm_in_input_dtype, "float16 numbers in the hundreds", "65504"),
    ("8.2", bert_input_positions_from_ids, "one token", "position[0]"),
    ("8.2", bert_input_without_norm, "one token", "LayerNorm"),
    ("11.1", cross_attention_causal, "six source tokens, four target tokens", "no causal mask"),
    ("11.1", cross_attention_ignoring_padding, "sources of 3, 7 and 5 tokens, padded to 7",
     "hide the keys"),
    ("11.1", cross_attention_keeping_padding, "sources of 3, 7 and 5 tokens, padded to 7",
     "True at real source tokens"),
]


@pytest.mark.parametrize("exercise, candidate, case, words", WRONG,
                         ids=[f"{e}-{c.__name__}" for e, c, _, _ in WRONG])
def test_a_wrong_answer_fails_with_the_hint_for_its_mistake(exercise, candidate, case, words):
    assert_fails_with_hint(exercise, candidate, case, words)


def test_every_hint_that_names_a_section_names_one_of_its_chapter():
    chapters = Path(__file__).resolve().parents[1] / "chapters"
    for exercise_id in ("2.3", "3.3", "4.2", "7.1", "8.2", "9.3", "10.2", "11.1"):
        for case in EXERCISES[exercise_id].cases:
            for number, section in re.findall(r'chapter (\d+), "([^"]+)"', case.hint):
                source = next(chapters.glob(f"{int(number):02d}-*.md")).read_text()
                assert f"## {section}\n" in source, (exercise_id, case.name, section)
