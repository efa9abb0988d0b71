# Do not edit: tools/tangle.py generates this file from chapters/11-encoder-decoder.md.
"""The book's three models, BERT, GPT and the encoder-decoder, in one place.

Built and explained in the book's chapter chapters/11-encoder-decoder.md.
"""

__all__ = [
    "BERT",
    "BERTConfig",
    "EncoderDecoder",
    "EncoderDecoderConfig",
    "GPT",
    "GPTConfig",
]

# chapters/11-encoder-decoder.md, "Three kinds of Transformer"
from attnbook.bert import BERT, BERTConfig
from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
from attnbook.gpt import GPT, GPTConfig
