"""BERT.from_hf_bert (chapter 8) given a model wrapped by torch.compile, whole or in part: the
conversion of the model it wraps, as for the GPT converters of chapters 10 and 19."""

import pytest
import torch

from attnbook.bert import BERT

transformers = pytest.importorskip("transformers")


def tiny_hf_bert(kind, seed=0):
    """A transformers BERT as chapter 8 builds one, weights drawn wider than its initialisation."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=16, pad_token_id=0)
    model = kind(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model


def compiled_part(model):
    """`model` with its encoder (BertForMaskedLM's `bert`) alone wrapped by torch.compile."""
    model.bert = torch.compile(model.bert)
    return model


WRAPS = {"whole": torch.compile, "part": compiled_part}


@pytest.mark.parametrize("kind, wrap", [("BertForMaskedLM", "whole"), ("BertModel", "whole"),
                                        ("BertForMaskedLM", "part")])  # BertModel: no `bert`
@pytest.mark.parametrize("training", [False, True])
def test_from_hf_bert_of_a_compiled_model_converts_the_model_it_wraps(kind, wrap, training):
    hf = tiny_hf_bert(getattr(transformers, kind)).train(training)
    plain = BERT.from_hf_bert(hf)
    plain_weights = {name: value.clone() for name, value in plain.state_dict().items()}
    compiled = WRAPS[wrap](hf)
    assert "_orig_mod." in "".join(compiled.state_dict())  # the wrapper renames the parameters
    ours = BERT.from_hf_bert(compiled)  # never run: the conversion reads weights, not outputs
    assert ours.config == plain.config and ours.training == training
    if kind == "BertModel":  # the MLM head keeps its random initialisation, in both
        plain_weights = {n: v for n, v in plain_weights.items() if not n.startswith("mlm_head.")}
    got = ours.state_dict()
    for name, value in plain_weights.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[1, 8:] = 0  # padding, masked out
    real = ids != 0
    ours.eval()
    plain.eval()
    plain.mlm_head.load_state_dict(ours.mlm_head.state_dict())  # BertModel: the same random head
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=real), plain(ids, attention_mask=real),
                                   rtol=0, atol=0)
        if kind == "BertForMaskedLM":  # and against transformers' own model, uncompiled
            reference = tiny_hf_bert(transformers.BertForMaskedLM).eval()  # the same weights
            logits = reference(input_ids=ids, attention_mask=real.long()).logits
            torch.testing.assert_close(ours(ids, attention_mask=real)[real], logits[real],
                                       rtol=1e-4, atol=1e-4)


def test_from_hf_bert_still_refuses_a_compiled_model_of_another_kind():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(TypeError, match="model must be a transformers BertForMaskedLM or "
                                        "BertModel, got GPT2LMHeadModel"):
        BERT.from_hf_bert(torch.compile(gpt2))


def test_the_gpt2_converter_takes_a_compiled_model_as_well():
    # the behaviour from_hf_bert now shares: a compiled model converts as the model it wraps
    from attnbook.gpt import GPT

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    plain, compiled = GPT.from_hf_gpt2(gpt2), GPT.from_hf_gpt2(torch.compile(gpt2))
    for (name, mine), theirs in zip(compiled.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
