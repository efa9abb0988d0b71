"""A mask with no padding: GPT.forward and GPT.generate given an all-ones
`attention_mask` take the path without a mask, so the logits are those without one to the last
bit on every backend and variant (before: 1.2e-7 apart on the Triton and ALiBi paths). The check
that reads the mask once a call reads this fact in the same read: no further sync."""

import pytest
import torch
from test_variants import VARIANTS, model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
@pytest.mark.parametrize("backend", ["explicit", "sdpa", "triton"])
@pytest.mark.parametrize("name", VARIANTS)
def test_an_all_real_mask_gives_the_logits_of_no_mask_exactly(name, backend, dtype):
    gpt = model(name, backend=backend)
    idx = torch.randint(40, (3, 11), generator=torch.Generator().manual_seed(5))
    ones = torch.ones(idx.shape, dtype=dtype)
    with torch.no_grad():
        plain = gpt(idx)
        assert plain.std() > 0.5  # logits that differ: a real comparison
        torch.testing.assert_close(gpt(idx, attention_mask=ones), plain, rtol=0, atol=0)
        pieces = []
        for mask in (ones, None):  # and through the cache, whose later call sees every position
            cache = gpt.make_kv_cache(3)
            first = gpt(idx[:, :6], cache, None if mask is None else mask[:, :6])
            pieces.append(torch.cat([first, gpt(idx[:, 6:], cache, mask)], 1))
            assert cache.attention_mask is None  # nothing padded held: later calls need none
        torch.testing.assert_close(pieces[0], pieces[1], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("name", ["alibi", "llama"])
def test_an_all_real_mask_generates_the_tokens_of_no_mask(name, backend):
    gpt = model(name, backend=backend)
    idx = torch.randint(40, (2, 5), generator=torch.Generator().manual_seed(6))
    for use_cache in (True, False):
        torch.testing.assert_close(
            gpt.generate(idx, 8, temperature=0, use_cache=use_cache,
                         attention_mask=torch.ones_like(idx)),
            gpt.generate(idx, 8, temperature=0, use_cache=use_cache), rtol=0, atol=0)
