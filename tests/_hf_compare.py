"""Shared by the converters' tests (chapter 19): our GPT's greedy tokens, with and without the KV
cache, against transformers' own `generate` from the same prompt."""

import torch


def assert_greedy_tokens_equal(ours: torch.nn.Module, theirs: torch.nn.Module,
                               prompt: torch.Tensor, new_tokens: int) -> None:
    """Greedy generation by `ours` (a GPT), with and without its cache, gives the tokens that
    transformers' `theirs` generates (no end token: pad_token_id=0, every prompt token real)."""
    with torch.no_grad():
        wanted = theirs.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(prompt))
    for use_cache in (True, False):
        torch.testing.assert_close(ours.generate(prompt, new_tokens, temperature=0,
                                                 use_cache=use_cache), wanted, rtol=0, atol=0)
