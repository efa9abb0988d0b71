"""flash_attention as a custom operator (chapter 16): torch.ops.attnbook.flash_attention
passes torch.library.opcheck, and a GPT and a MultiHeadAttention on the Triton backend compile
with fullgraph=True and no graph break, with eager's outputs and gradients. Run in Triton's
interpreter on the CPU, as the other kernel tests are."""

import math

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
    assert ops.count("attnbook._flash_attention") == (2 if name == "gpt" else 1)  # one per layer
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
    for op in (torch.ops.attnbook.flash_attention, torch.ops.attnbook._flash_attention):
        torch.library.opcheck(op.default, (q, k, v, causal, scale))  # checked, and its twin
    with torch.no_grad():
        o, lse = torch.ops.attnbook.flash_attention.default(q, k, v, causal, scale)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.attnbook.flash_attention_backward.default,
                          (q.detach(), k.detach(), v.detach(), o, lse, do, causal, scale))


def qkv(lq=5, lk=7, d=16, requires_grad=False):
    torch.manual_seed(3)
    return [torch.randn(1, 2, n, d, device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)
            for n in (lq, lk, lk)]


def bad_operator_calls():
    # (arguments of torch.ops.attnbook.flash_attention, error, words of its message); AT52-K F1
    q, k, v = qkv()
    return [
        ((q, k, v[:, :, :3], False, 0.25), ValueError, "v must have shape"),  # read past v
        ((q.expand(2, -1, -1, -1), k, v, False, 0.25), ValueError, "k must have shape"),
        ((q, k, torch.randn(1, 2, 7, 32, device=DEVICE), False, 0.25), ValueError, "v must"),
        ((*(torch.randn(1, 1, 4, 48, device=DEVICE),) * 3, False, 0.25), ValueError, "head_dim"),
        ((*(t.double() for t in (q, k, v)), False, 0.25), TypeError, "q has dtype"),
        ((q, k.half(), v, False, 0.25), TypeError, "k"),
        ((q[0], k[0], v[0], False, 0.25), ValueError, "q"),
        ((q, k, v, False, float("inf")), ValueError, "scale"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_the_operator_checks_its_arguments_as_flash_attention_does(case):
    args, error, words = bad_operator_calls()[case]
    with pytest.raises(error, match=words):
        torch.ops.attnbook.flash_attention(*args)


def test_the_logsumexp_output_has_no_gradient():
    # AT52-K F2: a loss on the logsumexp raised nothing and gave zero gradients
    q, k, v = qkv(requires_grad=True)
    out, lse = torch.ops.attnbook.flash_attention(q, k, v, False, 0.25)
    expected = torch.logsumexp(0.25 * q.double() @ k.double().mT, dim=-1) * math.log2(math.e)
    torch.testing.assert_close(lse.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    assert out.requires_grad and not lse.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()


def test_forward_mode_ad_is_refused_by_name():
    # AT52-K F3: jvp and forward_ad gave zero or no tangents, silently
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="flash_attention supports first-order"):
        torch.func.jvp(lambda a: kernels.flash_attention(a, k, v), (q,), (torch.ones_like(q),))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match="flash_attention supports first-order"):
            kernels.flash_attention(dual, k, v)


def test_higher_order_gradients_are_refused_by_name():
    # AT52-K F4: torch.func.grad and create_graph=True failed with PyTorch's own words
    q, k, v = qkv(requires_grad=True)
    with pytest.raises(RuntimeError, match="flash_attention supports first-order"):
        torch.func.grad(lambda a: kernels.flash_attention(a, k, v).sum())(q.detach())
    with pytest.raises(RuntimeError, match="flash_attention supports first-order"):
        torch.autograd.grad(kernels.flash_attention(q, k, v).square().sum(), q,
                            create_graph=True)


def test_the_default_scale_compiles_whole_with_dynamic_shapes():
    # AT52-K F5: the symbolic default scale broke the graph in check_real
    compiled = torch.compile(lambda a: kernels.flash_attention(a, a, a), fullgraph=True,
                             dynamic=True, backend="aot_eager")
    for lq in (7, 9):
        q = qkv(lq, lq, 32)[0]
        expected = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(),
                                                                    q.double())
        torch.testing.assert_close(compiled(q).double(), expected, **TOLERANCE)


def backward_arguments():
    """Arguments of torch.ops.attnbook.flash_attention_backward that run: q, k, v, o, lse, do."""
    q, k, v = qkv(5, 7, 16)
    with torch.no_grad():
        o, lse = torch.ops.attnbook.flash_attention(q, k, v, False, 0.25)
    return [q, k, v, o, lse, torch.randn_like(o), False, 0.25]


def bad_backward_calls():
    # (argument index, its replacement, error, words): the backward operator, called directly,
    # checked as the forward one is (before: it read past a short `o` or ran on a bad dtype)
    q = backward_arguments()[0]
    return [
        (3, torch.randn(1, 2, 3, 16, device=DEVICE), ValueError, "o must have shape"),
        (5, torch.randn(1, 2, 5, 32, device=DEVICE), ValueError, "do must have shape"),
        (5, torch.randn(1, 2, 5, 16, device=DEVICE).half(), TypeError, "do"),
        (3, torch.randn(1, 2, 5, 16, device=DEVICE, dtype=torch.float64), TypeError, "o"),
        (4, torch.randn(1, 2, 3, device=DEVICE), ValueError, "lse must have shape"),
        (4, torch.randn(1, 2, 5, device=DEVICE).half(), TypeError, "lse"),
        (4, torch.randn(1, 2, 5, 1, device=DEVICE), ValueError, "lse"),
        (2, torch.randn(1, 2, 6, 16, device=DEVICE), ValueError, "v must have shape"),
        (0, q.double(), TypeError, "q has dtype"),
        (7, float("nan"), ValueError, "scale"),
    ]  # a str for a tensor: the operator's schema refuses it, naming the argument


@pytest.mark.parametrize("case", range(10))
def test_the_backward_operator_checks_its_arguments_by_name(case):
    at, bad, error, words = bad_backward_calls()[case]
    args = backward_arguments()
    args[at] = bad
    with pytest.raises(error, match=words):
        torch.ops.attnbook.flash_attention_backward(*args)


def test_the_backward_operator_called_directly_gives_autograds_gradients():
    q, k, v = (t.requires_grad_() for t in qkv(5, 7, 16))
    out = kernels.flash_attention(q, k, v, scale=0.25)
    do = torch.randn_like(out)
    out.backward(do)
    args = backward_arguments()
    grads = torch.ops.attnbook.flash_attention_backward(*args[:5], do, False, 0.25)
    for mine, wanted in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, wanted, rtol=0, atol=0)


@pytest.mark.parametrize("dims", [(0, 0, 0), (1, None, None), (None, 2, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_vmap_over_flash_attention_is_each_calls(dims, causal):
    # vmap worked before the operator (the Python function traced through) and was then
    # refused: a vmap rule folds the mapped dimension into the batch
    torch.manual_seed(4)
    full = [torch.randn(3, 1, 2, n, 16, device=DEVICE) for n in (5, 7, 7)]  # 3 calls
    args = [t if d is None else t.movedim(0, d) for t, d in zip(
        [t if d is not None else t[0] for t, d in zip(full, dims)], dims)]
    mapped = torch.vmap(lambda q, k, v: kernels.flash_attention(q, k, v, causal), in_dims=dims)(*args)
    for i in range(3):
        one = [t[i] if d is not None else t[0] for t, d in zip(full, dims)]
        torch.testing.assert_close(mapped[i], kernels.flash_attention(*one, causal),
                                   rtol=0, atol=0)


def test_vmap_over_the_operators_and_a_gradient_through_it():
    torch.manual_seed(5)
    q, k, v = (torch.randn(4, 1, 2, 6, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    for op in (torch.ops.attnbook.flash_attention, torch.ops.attnbook._flash_attention):
        out, lse = torch.vmap(lambda a, b, c, op=op: op(a, b, c, True, 0.3))(q, k, v)
        wanted = torch.stack([op(q[i], k[i], v[i], True, 0.3)[0] for i in range(4)])
        torch.testing.assert_close(out, wanted, rtol=0, atol=0)
        assert lse.shape == (4, 1, 2, 6)
    mapped = torch.vmap(lambda a, b, c: kernels.flash_attention(a, b, c, True))(q, k, v)
    (dq,) = torch.autograd.grad(mapped.square().sum(), q)
    (wanted,) = torch.autograd.grad(sum(kernels.flash_attention(q[i], k[i], v[i], True).square().sum()
                                        for i in range(4)), q)
    torch.testing.assert_close(dq, wanted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lse_view", ["strided", "expanded"])
def test_the_backward_operator_reads_a_strided_logsumexp_by_its_values(lse_view):
    # AT53-V F5: the kernels indexed lse as bh * Lq + row, ignoring its strides (dQ off by 0.88)
    args = backward_arguments()
    wanted = torch.ops.attnbook.flash_attention_backward(*args)
    lse = args[4]
    if lse_view == "strided":
        args[4] = lse.transpose(1, 2).contiguous().transpose(1, 2)  # equal values, other strides
    else:  # one head's rows read twice: compare with the contiguous copy of the same values
        args[4] = lse[:, :1].expand(lse.shape)
        wanted = torch.ops.attnbook.flash_attention_backward(*args[:4], args[4].contiguous(),
                                                             *args[5:])
    for mine, expected in zip(torch.ops.attnbook.flash_attention_backward(*args), wanted):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)


@pytest.mark.parametrize("op, at, name", [("flash_attention", 1, "k"), ("flash_attention", 2, "v"),
                                          ("flash_attention_backward", 3, "o"),
                                          ("flash_attention_backward", 4, "lse"),
                                          ("flash_attention_backward", 0, "k")])
def test_a_meta_tensor_among_the_operators_arguments_is_refused_by_name(op, at, name):
    # AT53-V F6: the dispatcher sent mixed meta and CPU arguments to the fake kernel, which
    # returned uninitialised memory (or, with q on meta, meta outputs) with no error
    args = backward_arguments() if op.endswith("backward") else [*qkv(), False, 0.25]
    args[at] = args[at].to("meta")
    with pytest.raises(ValueError, match=f"{name} must be on device"):
        getattr(torch.ops.attnbook, op)(*args)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp"])
def test_transforms_around_vmap_are_refused_by_name(transform):
    # AT53-V F8: grad and vjp of vmap(flash_attention) raised PyTorch's "must override the
    # setup_context", jvp its "Batching rule not implemented for aten::_unpack_dual"
    q, k, v = (t.unsqueeze(0).expand(2, -1, -1, -1, -1).clone() for t in qkv())
    mapped = torch.vmap(kernels.flash_attention)
    calls = {"grad": lambda: torch.func.grad(lambda a: mapped(a, k, v).sum())(q),
             "vjp": lambda: torch.func.vjp(lambda a: mapped(a, k, v), q),
             "jvp": lambda: torch.func.jvp(lambda a: mapped(a, k, v), (q,), (torch.ones_like(q),))}
    with pytest.raises(RuntimeError, match="flash_attention supports first-order"):
        calls[transform]()
