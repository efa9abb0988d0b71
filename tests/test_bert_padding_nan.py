"""A padded position's embedding never reaches a real token (chapter 8's BERT):
with the padding masked by `attention_mask`, a NaN in the padding token's row of the embedding
table leaves every real token's output as it was, on each backend. The mask gives a padded key a
weight of exactly 0, but 0 x NaN is NaN: BERT zeroes the padded positions' embeddings before the
layers. A NaN in a real token's row still makes its sequence's outputs NaN."""

import pytest
import torch

from attnbook.bert import BERT, BERTConfig

PAD = 0
BACKENDS = ["explicit", "sdpa"]


def tiny_bert(backend: str) -> BERT:
    torch.manual_seed(0)
    config = BERTConfig(vocab_size=30, d_model=16, num_layers=2, num_heads=2, d_ff=32,
                        context_length=12, pad_id=PAD, backend=backend)
    model = BERT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 30, (3, 10), generator=torch.Generator().manual_seed(1))
    real = torch.arange(10)[None, :] < torch.tensor([10, 6, 2])[:, None]  # padding on the right
    return ids.masked_fill(~real, PAD), real


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_padding_embedding_leaves_the_real_tokens_as_they_were(backend, bad):
    model, (ids, real) = tiny_bert(backend), padded_batch()
    with torch.no_grad():
        clean = model.encode(ids, attention_mask=real)
        model.embeddings.word.weight[PAD] = bad
        hidden = model.encode(ids, attention_mask=real)
        logits = model(ids, attention_mask=real)
    assert clean[real].isfinite().all() and clean[real].std() > 0.1  # a real comparison
    torch.testing.assert_close(hidden[real], clean[real], rtol=0, atol=0)
    others = torch.arange(30) != PAD  # the padding token's own score: its NaN row, tied
    assert logits[real][:, others].isfinite().all() and not logits[..., PAD].isfinite().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_in_a_real_tokens_embedding_still_reaches_its_sequence(backend):
    model, (ids, real) = tiny_bert(backend), padded_batch()
    with torch.no_grad():
        model.embeddings.word.weight[ids[1, 3]] = float("nan")  # a real token of sequence 1
        hidden = model.encode(ids, attention_mask=real)
    assert hidden[1][real[1]].isnan().all()  # every real token of sequence 1 reads it
    for row in (0, 2):  # the others, unless they hold the same token
        assert bool(hidden[row][real[row]].isfinite().all()) == bool((ids[row] != ids[1, 3]).all())


def test_the_same_model_on_a_batch_without_padding_is_unchanged():
    model, (ids, _) = tiny_bert("sdpa"), padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(model.encode(ids, attention_mask=torch.ones_like(ids)),
                                   model.encode(ids), rtol=0, atol=0)
