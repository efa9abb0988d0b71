# Do not edit: tools/tangle.py generates this file from the chapters in chapters/.
"""attnbook: Transformer attention built from scratch, one chapter at a time.

Modules, in the order the book builds them:

- attnbook.attention (chapters/01-queries-keys-values.md): Scaled dot-product attention in
  NumPy: a softmax whose exponentials cannot overflow, masks, and the shape check of Q, K and V.
- attnbook.scaling (chapters/02-scaling.md): Why scores are divided by the square root of d:
  random scores, the softmax's peak and its Jacobian.
- attnbook.layers (chapters/03-heads.md): The layers of a Transformer: multi-head attention with
  its fast path and KV cache, the block and its parts. Attention and the block are unchecked
  cores built from a frozen config, each with a checked public layer around it.
- attnbook.positions (chapters/05-positions.md): Positions: sinusoidal encodings, rotary
  embeddings (RoPE) and ALiBi biases.
- attnbook.masks (chapters/06-masks.md): Boolean attention masks: causal, padding, and both
  combined.
- attnbook.bert (chapters/08-bert.md): An encoder-only model, BERT: embeddings, the
  masked-language-model head, token masking, and Hugging Face BERT weights.
- attnbook.gpt (chapters/10-gpt.md): A decoder-only model, GPT: generation with a KV cache,
  GPT-2's weights, and a character tokenizer.
- attnbook.recipe (chapters/10-gpt.md): The book's one training recipe: AdamW with decay on
  matrices only, warm-up and cosine decay, clipping, one step, and the batches and held-out loss
  of a run.
- attnbook.encdec (chapters/11-encoder-decoder.md): The original Transformer's encoder-decoder,
  with greedy decoding.
- attnbook.cost (chapters/12-cost.md): What attention costs: operations, time, the memory of the
  scores, of saved tensors and of the KV cache.
- attnbook.tiling (chapters/13-tiling.md): FlashAttention's algorithm in NumPy: the online
  softmax and attention computed tile by tile.
- attnbook.kernels (chapters/15-flash-attention-triton.md): FlashAttention in Triton: the
  forward and backward kernels, and flash_attention for PyTorch tensors.
- attnbook.triton_mode (chapters/15-flash-attention-triton.md): How Triton runs the book's
  kernels: compiled for a GPU, or in its interpreter on the CPU, chosen once, explicitly, before
  anything imports triton.
- attnbook.efficient (chapters/17-efficient-attention.md): Beyond quadratic attention:
  sliding-window, global and block-sparse masks with tile skipping, linear attention, FAVOR+
  random features, retention, and the small models and recall task that compare them.
- attnbook.vit (chapters/18-vision-transformer.md): The Vision Transformer: images cut into
  patches, a class token and learned positions, on the book's Transformer blocks.
- attnbook.notebook (chapters/a1-conventions.md): What a chapter uses to run as a notebook:
  numbers glued into the prose, timings, FLOP counts, and whether pretrained weights can be
  downloaded.
- attnbook.corpus (chapters/a1-conventions.md): The book's training text: a fixed snapshot of
  the Python documentation's topics.
- attnbook.train (chapters/a2-training-at-scale.md): Training the book's GPT on one or many
  processes: torch.distributed's DDP and FSDP2, launched by torchrun, with distributed
  checkpoints.
- attnbook.viz (chapters/a3-pictures.md): An attention explorer: attention weights over a
  sentence's tokens as HTML that Jupyter, Colab and the book's site display, with nothing
  fetched from outside.
- attnbook.compile_check (chapters/a4-compiling.md): Compile the kernels of chapters 15 and 16
  for a GPU that need not be present, and read what they use.
- attnbook.train_command (chapters/a5-training-command.md): The attnbook-train command line: its
  options, read without loading PyTorch, and its entry point.
- attnbook.exercises (chapters/a6-checking-exercises.md): A check of the reader's own answer to
  an exercise: seeded cases from small to hard, compared with the package's reference, with a
  short report and a hint.
- attnbook.checks (chapters/a8-argument-checks.md): The package's argument checks: one error
  policy, one check per concept. It imports PyTorch only when a tensor is checked, so the NumPy
  modules use it without loading PyTorch.
"""

import importlib
from types import ModuleType

__version__ = "0.1.0"
__all__ = [
    "attention",
    "scaling",
    "layers",
    "positions",
    "masks",
    "bert",
    "gpt",
    "recipe",
    "encdec",
    "cost",
    "tiling",
    "kernels",
    "triton_mode",
    "efficient",
    "vit",
    "notebook",
    "corpus",
    "train",
    "viz",
    "compile_check",
    "train_command",
    "exercises",
    "checks",
]


def __getattr__(name: str) -> ModuleType:
    # Modules load on first use, so `import attnbook` stays cheap and a module with an
    # optional dependency (triton, transformers) costs nothing until it is used.
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
