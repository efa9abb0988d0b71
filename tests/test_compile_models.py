"""The models compile whole (DESIGN.md, appendix H): torch.compile(fullgraph=True) takes each
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
    "encoder-decoder-tensor-lengths": (encdec, lambda: (ids(), ids(1), torch.tensor([LENGTH, 5])),
                                       lambda out: out.square().mean()),  # broke the graph once
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
    """Under the compiler the id values are not read into Python (appendix H): the graph checks
    them and raises a RuntimeError naming the argument; the eager call gives the ValueError."""
    model = gpt(layers=1).eval()
    bad = torch.tensor([[3, VOCAB]])
    with pytest.raises(ValueError, match=r"^idx must lie in \[0, vocab_size=50\), got values "
                                         r"from 3 to 50$"):
        model(bad)
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(ids())  # traced on good ids: the bad ones run the same graph
    with pytest.raises(RuntimeError, match=r"idx must lie in \[0, vocab_size=50\)"):
        compiled(bad)  # was the embedding's "index out of range", naming no argument
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(Exception, match="idx must hold at least one row and one token"):  # under
        compiled(empty)  # fullgraph, dynamo reports our ValueError as an unsupported exception
    with pytest.raises(ValueError, match="^idx must hold at least one row"):  # without, ours
        torch.compile(model, backend="aot_eager")(empty)
    with pytest.raises(ValueError, match="^attention_mask must be boolean or hold only 0 and 1"):
        bert()(ids(), attention_mask=padding() * 2)


def test_generation_with_the_kv_cache_compiles_once_past_the_prefill():
    """Chapter 10: the cache's length is a plain int, so the compiler, after the prefill and one
    step, makes it a symbol and compiles no more (it compiled once per length up to the limit)."""
    model, (idx,), _ = build("gpt")
    model.eval()
    cache = model.make_kv_cache(2)
    dynamo.reset()
    step = torch.compile(model._logits, fullgraph=True, backend="eager")
    with torch.no_grad(), dynamo.config.patch(recompile_limit=2):
        step(idx, cache)  # the prefill
        for _ in range(6):  # one token at a time: one graph for every length
            step(idx[:, -1:], cache)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_bert_refuses_a_mask_that_is_not_0_or_1(backend):
    """A float mask holding NaN, 0.5, 2 or -1 gave finite logits once compiled (the value check
    was skipped while tracing, and mask != 0 turned each into True); eager refuses it."""
    model = bert().eval()
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    good = padding().float()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids(), None, good), model(ids(), None, good),
                                   **TOLERANCE)
        for value in (float("nan"), 0.5, 2.0, -1.0):
            bad = good.clone()
            bad[0, 2] = value
            with pytest.raises(ValueError, match="^attention_mask must be boolean or hold only"):
                model(ids(), None, bad)
            with pytest.raises(RuntimeError, match="attention_mask must be boolean or hold only"):
                compiled(ids(), None, bad)


def test_a_compiled_encoder_decoder_refuses_tensor_lengths_out_of_range():
    """Lengths given as a tensor are checked inside the compiled graph; eager names the entry."""
    model = encdec().eval()
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        lengths = torch.tensor([LENGTH, 5])
        torch.testing.assert_close(compiled(ids(), ids(1), lengths),
                                   model(ids(), ids(1), [LENGTH, 5]), **TOLERANCE)
        for bad in ([LENGTH + 1, 5], [0, 5]):
            with pytest.raises(ValueError, match=r"^src_lengths\[0\] must be at"):
                model(ids(), ids(1), torch.tensor(bad))
            with pytest.raises(RuntimeError, match=r"src_lengths must hold 2 ints in \[1, 8\]"):
                compiled(ids(), ids(1), torch.tensor(bad))
