"""attnbook.models gathers the three model families of Part II under one name."""

import attnbook.bert
import attnbook.encdec
import attnbook.gpt
import attnbook.models


def test_models_are_the_chapters_own_classes():
    assert attnbook.models.BERT is attnbook.bert.BERT
    assert attnbook.models.BERTConfig is attnbook.bert.BERTConfig
    assert attnbook.models.GPT is attnbook.gpt.GPT
    assert attnbook.models.GPTConfig is attnbook.gpt.GPTConfig
    assert attnbook.models.EncoderDecoder is attnbook.encdec.EncoderDecoder
    assert sorted(attnbook.models.__all__) == [
        "BERT", "BERTConfig", "EncoderDecoder", "EncoderDecoderConfig", "GPT", "GPTConfig",
    ]


def test_models_has_its_own_description():
    """It was described by chapter 11's title, "Encoder-decoder: the original Transformer."."""
    first_line = attnbook.models.__doc__.splitlines()[0]
    assert first_line != attnbook.encdec.__doc__.splitlines()[0]
    assert all(name in first_line for name in ("BERT", "GPT", "encoder-decoder"))
