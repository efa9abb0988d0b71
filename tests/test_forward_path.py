"""The GPT forward pass a reader follows (chapters 3, 7 and 10): short, and the same numbers as the
paths it leaves out (a cache, padding, the weights, cross-attention, post-norm blocks)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from attnbook.gpt import GPT, GPTConfig
from attnbook.layers import ATTENTION_BACKENDS, Block, BlockConfig

_BOUNDARY = Path(__file__).resolve().parents[1] / "benchmarks" / "boundary.py"


def _boundary():
    spec = importlib.util.spec_from_file_location("boundary", _BOUNDARY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_training_forward_a_reader_follows_is_short():
    """At most 100 code lines, 20 conditionals and 3 files, measured as benchmarks/boundary.py
    measures it (108 code lines and 41 conditionals before the plain path left the cache, padding
    and weights to other methods)."""
    model = GPT(GPTConfig(vocab_size=50, context_length=64, d_model=32, num_layers=4,
                          num_heads=2)).train()
    idx = torch.randint(0, 50, (2, 16))
    functions, lines, branches, files = _boundary().forward_path(lambda: model(idx))
    assert lines <= 100 and branches <= 20 and len(files) <= 3, (functions, lines, branches, files)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_the_plain_forward_equals_the_padded_and_the_cached_path(backend):
    """The plain path (no cache, no mask) against the general one that a mask of ones and a
    cache filled in two calls take: the same logits on every backend."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=40, context_length=32, d_model=32, num_layers=2,
                          num_heads=2, dropout=0.0, backend=backend)).eval()
    idx = torch.randint(40, (2, 12))
    plain = model(idx)
    torch.testing.assert_close(model(idx, attention_mask=torch.ones_like(idx)), plain)
    cache = model.make_kv_cache(2)
    cached = torch.cat([model(idx[:, :5], kv_cache=cache), model(idx[:, 5:], kv_cache=cache)], 1)
    torch.testing.assert_close(cached, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first, cross", [(True, False), (False, False), (True, True)])
def test_a_block_gives_the_same_output_with_and_without_the_weights(norm_first, cross):
    """Block.forward's own path (pre-norm self-attention) and _sublayers (the weights, post-norm,
    cross-attention) compute one function."""
    torch.manual_seed(4)
    block = Block(BlockConfig(16, 2, norm_first=norm_first, cross_attention=cross)).eval()
    x, context = torch.randn(2, 5, 16), (torch.randn(2, 3, 16) if cross else None)
    out = block(x, None, True, context)
    with_weights = block(x, None, True, context, return_weights=True)
    torch.testing.assert_close(out, with_weights[0])
    assert with_weights[1].shape == (2, 2, 5, 5)


@pytest.mark.parametrize("norm_first, cross", [(True, False), (False, False), (True, True)])
def test_a_block_without_the_attributes_init_sets_still_takes_its_path(norm_first, cross):
    """A Block unpickled from a state saved before `plain` was an attribute, or made by __new__,
    lacked `plain` (an AttributeError in forward); it follows from the config."""
    torch.manual_seed(5)
    block = Block(BlockConfig(16, 2, norm_first=norm_first, cross_attention=cross)).eval()
    state = {k: v for k, v in block.__dict__.items() if k != "plain"}
    restored = Block.__new__(Block)
    restored.__setstate__(state)
    x, context = torch.randn(2, 5, 16), (torch.randn(2, 3, 16) if cross else None)
    assert restored.plain == (norm_first and not cross)
    torch.testing.assert_close(restored(x, None, True, context), block(x, None, True, context))


def test_both_paths_of_a_block_run_the_layers_it_holds_after_its_config_is_replaced():
    """forward and its return_weights path agree on a Block whose config was replaced after it was
    built: both apply the cross-attention it holds (`plain` once read the config, and so skipped
    it on the plain path only)."""
    import dataclasses

    torch.manual_seed(6)
    block = Block(BlockConfig(16, 2, cross_attention=True)).eval()
    block.config = dataclasses.replace(block.config, cross_attention=False)
    x, context = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    out = block(x, None, True, context)
    torch.testing.assert_close(out, block(x, None, True, context, return_weights=True)[0])
    assert not torch.allclose(out, block(x, None, True, torch.zeros(2, 3, 16)))  # context read


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_an_empty_batch_or_prompt_is_refused_by_name(shape):
    model = GPT(GPTConfig(vocab_size=10, context_length=8, d_model=16, num_layers=1, num_heads=2))
    for call in (lambda: model(torch.zeros(shape, dtype=torch.long)),
                 lambda: model.generate(torch.zeros(shape, dtype=torch.long), 2)):
        with pytest.raises(ValueError, match=r"idx must hold at least one row and one token, got shape"):
            call()
