"""The models compile whole (DESIGN.md, appendix A): torch.compile(fullgraph=True) takes each
model's forward pass and a training step, torch._dynamo.explain finds no graph break, and
torch.export takes GPT's forward; the compiled outputs and gradients are eager's."""

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F

from attnbook.bert import BERT, BERTConfig
from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
from attnbook.gpt import GPT, GPTConfig
from attnbook.layers import MultiHeadAttention, TransformerBlock

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(d_model=32, num_heads=4, dropout=0.0)
VOCAB, LENGTH = 50, 8
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32: the compiler may fuse and reorder sums


def gpt(backend="sdpa", layers=2):
    return GPT(GPTConfig(vocab_size=VOCAB, context_length=16, num_layers=layers, backend=backend,
                         **TINY))


def bert():
    return BERT(BERTConfig(vocab_size=VOCAB, context_length=16, num_layers=1, d_ff=64, **TINY))


def encdec():
    return EncoderDecoder(EncoderDecoderConfig(src_vocab=VOCAB, tgt_vocab=VOCAB, num_layers=1,
                                               context_length=16, **TINY))


def ids(seed=0, batch=2, length=LENGTH):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def tokens(seed=0):
    return torch.randn(2, LENGTH, 32, generator=torch.Generator().manual_seed(seed))


def padding():  # BERT's attention_mask as transformers' tokenizers give it: int64, 1 = real
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, 5:] = 0
    return mask


def causal_mask():
    return torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()


TARGETS = ids(1)  # GPT's next tokens: made outside the compiled step (a Generator cannot be traced)

# (name, model, its inputs, a loss of its output): the models and layers a reader builds
CASES = {
    "gpt": (gpt, lambda: (ids(),), lambda out: F.cross_entropy(out.flatten(0, 1),
                                                                TARGETS.flatten())),
    "gpt-explicit": (lambda: gpt("explicit"), lambda: (ids(),), lambda out: out.square().mean()),
    "bert": (bert, lambda: (ids(), None, padding()), lambda out: out.square().mean()),
    "encoder-decoder": (encdec, lambda: (ids(), ids(1), [LENGTH, 5]),
                        lambda out: out.square().mean()),
    "multi-head-attention": (lambda: MultiHeadAttention(32, 4, num_kv_heads=2),
                             lambda: (tokens(), tokens(1), causal_mask()),
                             lambda out: out.square().mean()),
    "transformer-block": (lambda: TransformerBlock(32, 4, dropout=0.0),
                          lambda: (tokens(), causal_mask()), lambda out: out.square().mean()),
}


def build(name):
    make, inputs, loss = CASES[name]
    torch.manual_seed(0)
    return make(), inputs(), loss


@pytest.mark.parametrize("name", CASES)
def test_the_forward_pass_has_no_graph_break(name):
    model, inputs, _ = build(name)
    dynamo.reset()
    explained = dynamo.explain(model.eval())(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        explained.break_reasons


@pytest.mark.parametrize("name", CASES)
def test_a_compiled_training_step_gives_eagers_outputs_and_gradients(name):
    """Forward and loss compiled whole, in training mode (AOTAutograd traces the backward with
    them, so a graph break or an untraceable op in either fails here); the backward run by
    loss.backward(), as a training loop does. The backend "aot_eager" traces as the default
    compiler does and runs the traced graphs without generating code: seconds, not minutes."""
    model, inputs, loss_of = build(name)
    model.train()

    def step(*args):
        out = model(*args)
        return out, loss_of(out)

    dynamo.reset()
    compiled_out, compiled_loss = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    compiled_loss.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager_out, eager_loss = step(*inputs)
    eager_loss.backward()
    torch.testing.assert_close(compiled_out, eager_out, **TOLERANCE)
    torch.testing.assert_close(compiled_loss, eager_loss, **TOLERANCE)
    for got, wanted in zip(compiled_grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, wanted, **TOLERANCE)


def test_torch_export_takes_gpts_forward_for_any_batch_and_length():
    model, (idx,), _ = build("gpt")
    model.eval()
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length", max=16)
    exported = torch.export.export(model, (idx,), dynamic_shapes={"idx": {0: batch, 1: length}})
    with torch.no_grad():
        for other in (idx, ids(2, batch=3, length=16), ids(3, batch=1, length=2)):
            torch.testing.assert_close(exported.module()(other), model(other), **TOLERANCE)


def test_compiled_models_still_refuse_what_eager_refuses():
    """Under the compiler the id values are not read (appendix A): the refusal that remains is
    the embedding's, and the eager call beside it still names the argument."""
    model = gpt(layers=1).eval()
    bad = torch.tensor([[3, VOCAB]])
    with pytest.raises(ValueError, match=r"^idx must lie in \[0, vocab_size=50\), got values "
                                         r"from 3 to 50$"):
        model(bad)
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(ids())  # traced on good ids: the bad ones run the same graph
    with pytest.raises((IndexError, RuntimeError), match="index out of range"):
        compiled(bad)
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(Exception, match="idx must have shape"):  # shapes are still checked: under
        compiled(empty)  # fullgraph, dynamo reports our ValueError as an unsupported exception
    with pytest.raises(ValueError, match="^idx must have shape"):  # without, it is ours
        torch.compile(model, backend="aot_eager")(empty)
    with pytest.raises(ValueError, match="^attention_mask must be boolean or hold only 0 and 1"):
        bert()(ids(), attention_mask=padding() * 2)


def test_generation_with_the_kv_cache_recompiles_for_each_length():
    """Chapter 10's documented limit: the cache's length is a Python int that grows each step,
    so a compiled step is compiled again for each new length, up to dynamo's recompile limit."""
    model, (idx,), _ = build("gpt")
    model.eval()
    cache = model.make_kv_cache(2)
    dynamo.reset()
    step = torch.compile(model._logits, fullgraph=True, backend="eager")
    with torch.no_grad(), dynamo.config.patch(recompile_limit=2):
        step(idx, cache)  # the prefill
        step(idx[:, -1:], cache)  # one token: a new length, compiled again
        with pytest.raises(dynamo.exc.FailOnRecompileLimitHit):
            step(idx[:, -1:], cache)
