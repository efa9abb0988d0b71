"""flash_attention as a custom operator (chapter 16, issue 44): torch.ops.attnbook.flash_attention
passes torch.library.opcheck, and a GPT and a MultiHeadAttention on the Triton backend compile
with fullgraph=True and no graph break, with eager's outputs and gradients. Run in Triton's
interpreter on the CPU, as the other kernel tests are."""

import pytest
import torch
import torch._dynamo as dynamo

pytest.importorskip("triton", reason="Triton (the triton extra) has wheels for Linux only")

from attnbook import kernels  # noqa: E402
from attnbook.gpt import GPT, GPTConfig  # noqa: E402
from attnbook.layers import MultiHeadAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cpu" if kernels.INTERPRETED else "cuda"
DTYPE = torch.float32  # the Triton backend's one dtype in the interpreter
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=2,
                         dropout=0.0, backend="triton")).to(DEVICE)  # head size 16


def mha():
    torch.manual_seed(0)
    return MultiHeadAttention(32, 2, num_kv_heads=1, backend="triton").to(DEVICE)


def gpt_inputs():
    return (torch.randint(3, 50, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE),)


def mha_inputs():
    return (torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE),)


# name: (model, its inputs, keyword arguments); 11 tokens: not a multiple of any tile
CASES = {"gpt": (gpt, gpt_inputs, {}), "multi-head-attention": (mha, mha_inputs, {"is_causal": True})}


@pytest.fixture
def forward_calls(monkeypatch):
    """The forward kernel's launches (the operator runs chapter 15's _forward, which launches)."""
    calls = []
    real = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, name, *args: (
        name == "forward" and calls.append(1)) or real(kernel, name, *args))
    return calls


@pytest.mark.parametrize("name", CASES)
def test_a_model_on_the_triton_backend_has_no_graph_break(name, forward_calls):
    """Before the operator, dynamo traced into the launch (the interpreter's NumPy pointers): an
    InterpreterError under explain, Unsupported (UntypedStorage.data_ptr) under fullgraph."""
    make, inputs, kwargs = CASES[name]
    model = make().eval()
    dynamo.reset()
    explained = dynamo.explain(model)(*inputs(), **kwargs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        explained.break_reasons
    ops = [str(node.target).removesuffix(".default") for graph in explained.graphs
           for node in graph.graph.nodes]
    assert ops.count("attnbook.flash_attention") == (2 if name == "gpt" else 1)  # one per layer
    assert forward_calls  # the kernels ran, not SDPA


@pytest.mark.parametrize("name", CASES)
def test_compiled_outputs_and_gradients_are_eagers(name, forward_calls):
    make, inputs, kwargs = CASES[name]
    model = make().train()

    def step(*args):
        out = model(*args, **kwargs)
        return out, out.square().mean()

    dynamo.reset()
    compiled_out, compiled_loss = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs())
    compiled_loss.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    compiled_calls = len(forward_calls)
    model.zero_grad()
    eager_out, eager_loss = step(*inputs())
    eager_loss.backward()
    assert compiled_calls == len(forward_calls) - compiled_calls > 0  # one per layer, both ways
    torch.testing.assert_close(compiled_out, eager_out, **TOLERANCE)
    for got, wanted in zip(compiled_grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, wanted, **TOLERANCE)


def test_compiled_kernels_equal_the_eager_function():
    """flash_attention itself inside a compiled function: the same output and gradients."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE, requires_grad=True) for n in (9, 13, 13))
    dynamo.reset()
    compiled = torch.compile(lambda *t: kernels.flash_attention(*t, causal=True), fullgraph=True,
                             backend="aot_eager")
    results = []
    for fn in (compiled, lambda *t: kernels.flash_attention(*t, causal=True)):
        out = fn(q, k, v)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for got, wanted in zip(*results, strict=True):
        torch.testing.assert_close(got, wanted, **TOLERANCE)


def operator_inputs(lq, lk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, d, generator=g, dtype=dtype).to(DEVICE) for n in (lq, lk, lk)]


# (Lq, Lk, D, causal, dtype): lengths that are not a multiple of a tile, both dtypes
OPCHECK = [(5, 7, 16, True, torch.float32), (33, 20, 32, False, torch.float32),
           (17, 17, 16, True, torch.float16), (3, 40, 64, False, torch.float16)]


@pytest.mark.parametrize("lq, lk, d, causal, dtype", OPCHECK)
def test_the_operators_pass_opcheck(lq, lk, d, causal, dtype):
    """torch.library.opcheck: the schema, the fake (shapes and strides as the kernels give
    them), the autograd registration and AOTAutograd with dynamic shapes, for the forward
    operator with gradients required, and for the backward operator."""
    q, k, v = (t.requires_grad_() for t in operator_inputs(lq, lk, d, dtype, seed=lq))
    scale = d ** -0.5
    torch.library.opcheck(torch.ops.attnbook.flash_attention.default, (q, k, v, causal, scale))
    with torch.no_grad():
        o, lse = torch.ops.attnbook.flash_attention.default(q, k, v, causal, scale)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.attnbook.flash_attention_backward.default,
                          (q.detach(), k.detach(), v.detach(), o, lse, do, causal, scale))
