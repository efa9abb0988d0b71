"""GPT.from_hf_gpt2 and what it reads (session 56): a feed-forward width other than 4 * d_model
(GPT-2's `n_inner`) becomes GPTConfig's ff_width, where it was refused; a dropout layer of another
kind than nn.Dropout (nn.AlphaDropout, nn.Dropout1d, ...), which it did not look at, is refused
by name, as is a rate that differs, whatever the mode (ours has nn.Dropout only)."""

import pytest
import torch
from test_gpt import random_hf_gpt2
from torch import nn

from attnbook.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("n_inner", [48, 200])
def test_a_feed_forward_width_other_than_4d_is_read_as_ff_width(n_inner):
    hf = random_hf_gpt2(2, n_inner=n_inner)
    ours = GPT.from_hf_gpt2(hf)
    assert ours.config.ff_width == ours.config.d_ff == n_inner
    ids = torch.randint(100, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits
        assert theirs.std() > 0.5  # a real comparison
        torch.testing.assert_close(ours(ids), theirs, atol=1e-4, rtol=0)


def test_gpt2s_own_width_leaves_ff_width_to_the_config():
    # ff_width=None derives 4 * d_model, so that the converted config equals GPT-2's preset sizes
    # and dataclasses.replace(config, d_model=...) derives the width again
    ours = GPT.from_hf_gpt2(random_hf_gpt2(2))
    assert ours.config.ff_width is None and ours.config.d_ff == 4 * ours.config.d_model


@pytest.mark.parametrize("kind", [nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Dropout1d])
@pytest.mark.parametrize("where", ["drop", "h.1.attn.resid_dropout"])
def test_a_dropout_layer_of_another_kind_is_refused_by_name(kind, where):
    hf = random_hf_gpt2(spread=0, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
    parent, name = hf.transformer.get_submodule(where.rpartition(".")[0]), where.rpartition(".")[2]
    setattr(parent, name, kind(0.1))  # the same rate: only the kind differs
    with pytest.raises(ValueError, match=rf"must each be an nn\.Dropout of its drop\.p=0\.1 .*"
                                         rf"unlike \['{where}: {kind.__name__}'\] \(1 in all\)"):
        GPT.from_hf_gpt2(hf.eval())  # in eval mode too: a later train() would differ


def test_plain_dropout_of_one_rate_is_still_read():
    hf = random_hf_gpt2(spread=0, embd_pdrop=0.2, attn_pdrop=0.2, resid_pdrop=0.2)
    ours = GPT.from_hf_gpt2(hf.train())
    assert ours.training and ours.drop.p == 0.2
