"""The attention backends (chapter 3, "The fast path") agree on every model, forward and
gradients, with padding and causal masks and fully masked rows; the models check their inputs
once, at the entry point."""

import dataclasses
import sys
from functools import partial

import pytest
import torch

from attnbook.bert import BERT, BERTConfig
from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
from attnbook.gpt import GPT, GPTConfig
from attnbook.layers import (
    _BACKENDS,
    ATTENTION_BACKENDS,
    Attention,
    AttentionConfig,
    Block,
    LayerCache,
    MultiHeadAttention,
    TransformerBlock,
    attend,
)
from attnbook.masks import causal_mask, padding_mask
from attnbook.notebook import flop_counter
from attnbook.vit import ViT, ViTConfig

DOUBLE = torch.float64


def _pairs(dtype):
    """(backend, reference) pairs to compare: SDPA in float64, the Triton kernel in float32
    (it takes float16 and float32 only), each against the book's explicit attention."""
    return [("sdpa", "explicit")] if dtype == DOUBLE else [("triton", "explicit")]


def _grads(module, loss):
    loss.backward()
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def _compare(make, run, dtype, atol):
    """Build the same module (same seed) with each backend of a pair; run(module) -> output;
    the outputs and every parameter's gradient must agree, and be finite."""
    for backend, reference in _pairs(dtype):
        results = []
        for name in (backend, reference):
            torch.manual_seed(0)
            module = make(name).to(dtype)
            out = run(module)
            assert torch.isfinite(out).all(), name
            results.append((out.detach(), _grads(module, out.square().mean())))
        (out, grads), (ref, ref_grads) = results
        torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            assert torch.isfinite(grads[name]).all(), name
            torch.testing.assert_close(grads[name], ref_grads[name], atol=atol, rtol=atol,
                                       msg=lambda m, n=name: f"{n}: {m}")


DTYPES = [pytest.param(DOUBLE, 1e-10, id="sdpa-float64"),
          pytest.param(torch.float32, 2e-4, id="triton-float32")]


# The layer: every mask, fully masked rows, shared heads, the cache ----------------------------


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("case", ["none", "causal", "padding", "random", "causal+padding"])
def test_layer_backends_agree(case, kv_heads, dtype, atol):
    b, lq, d = 2, 6, 32  # head_dim 16, which the kernel takes
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, lq, d, generator=gen)
    mask, is_causal = None, case.startswith("causal")
    if "padding" in case:
        mask = padding_mask([6, 3])[:, None, None, :]  # (B, 1, 1, L)
    if case == "random":
        mask = torch.rand(b, 1, lq, lq, generator=gen) < 0.5
        mask[0, 0, 2] = False  # a query that sees no key: zeros, not NaN
        mask[1, 0, :, 0] = True

    def make(backend):
        return MultiHeadAttention(d, 2, num_kv_heads=kv_heads, backend=backend)

    def run(layer):
        return layer(x.to(dtype), mask=mask, is_causal=is_causal)

    _compare(make, run, dtype, atol)


def test_a_query_that_sees_nothing_gets_zeros_and_zero_gradients():
    layer = MultiHeadAttention(16, 2).double()
    x = torch.randn(1, 4, 16, dtype=DOUBLE, requires_grad=True)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 1] = False  # query 1 sees nothing
    for backend in ("sdpa", "explicit"):
        layer.config = dataclasses.replace(layer.config, backend=backend)
        out = layer(x, mask=mask)
        # older releases of PyTorch's SDPA give NaN there; the layer: out_proj's bias
        expected = layer.out_proj.bias.expand(16)
        torch.testing.assert_close(out[0, 1], expected)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_a_query_that_sees_nothing_gets_zeros_when_a_value_is_nan(backend):
    # query 0 sees no key; key/value position 1 holds NaN: an empty sum is 0 on every backend,
    # and every query whose weights touch position 1 (query 2 sees it; query 1 masks it, but its
    # weighted sum still multiplies it by 0) gives NaN, as PyTorch's SDPA does
    q, k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    k[0, 0, 1] = v[0, 0, 1] = float("nan")
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0], mask[1, 1] = False, False
    layer = Attention(AttentionConfig(8, 1, backend=backend))
    out = _BACKENDS[layer.backend](q, k, v, mask, False, 0.0)
    torch.testing.assert_close(out[0, 0, 0], torch.zeros(8), rtol=0, atol=0)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out[0, 0, 1:].isnan().all() and reference[0, 0, 1:].isnan().all()
    # causal with more queries than keys (bottom-right): query 0 sees no key; the kernel gave NaN
    q3 = torch.randn(1, 1, 3, 16)
    k2, v2 = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    v2[0, 0, 1, 0] = float("nan")
    out = _BACKENDS[backend](q3, k2, v2, None, True, 0.0)
    torch.testing.assert_close(out[0, 0, 0], torch.zeros(16), rtol=0, atol=0)
    assert out[0, 0, 1:, 0].isnan().all()


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_cross_attention_gives_nan_only_for_a_query_that_is_not_finite(backend):
    # large finite queries (float64's 1e200, float32's 1e37 summed over a head) stay finite;
    # a query holding a NaN or an infinity gives NaN, which SDPA's CPU kernel alone does not
    for dtype, big in ((DOUBLE, 1e200), (torch.float32, 1e37)):
        q = torch.full((1, 2, 3, 64), big, dtype=dtype)
        q[0, :, 1, 0], q[0, :, 2, 5] = float("nan"), float("inf")
        layer = Attention(AttentionConfig(128, 2, backend=backend)).to(dtype)
        layer.q_proj = torch.nn.Identity()  # the heads' queries, as given
        x = q.transpose(1, 2).flatten(2)  # (1, 3, 128)
        context = torch.randn(1, 5, 128, dtype=dtype)
        out, _ = layer(x, context)
        assert out[0, 0].isfinite().all() and out[0, 1:].isnan().all(), (dtype, backend)


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_the_cache_gives_the_same_steps_on_every_backend(backend):
    torch.manual_seed(2)
    layer = MultiHeadAttention(32, 4, num_kv_heads=2, backend=backend).double().eval()
    x = torch.randn(2, 7, 32, dtype=DOUBLE)
    cache = LayerCache(torch.zeros(2, 2, 7, 8, dtype=DOUBLE), torch.zeros(2, 2, 7, 8, dtype=DOUBLE))
    with torch.no_grad():
        steps = [layer(x[:, :4], is_causal=True, cache=cache)]
        steps += [layer(x[:, i:i + 1], is_causal=True, cache=cache) for i in range(4, 7)]
        layer.config = dataclasses.replace(layer.config, backend="explicit")
        torch.testing.assert_close(torch.cat(steps, 1), layer(x, is_causal=True))


def test_weights_come_from_attend_on_every_backend():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 16, dtype=DOUBLE)
    layer = MultiHeadAttention(16, 2).double()
    out, weights = layer(x, is_causal=True, return_weights=True)
    q, k, v = (p(x).view(2, 5, 2, 8).transpose(1, 2) for p in (layer.q_proj, layer.k_proj,
                                                              layer.v_proj))
    _, expected = attend(q, k, v, causal_mask(5))
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(out, layer(x, is_causal=True))


def test_the_backend_is_checked_everywhere():
    for make in (lambda: MultiHeadAttention(8, 2, backend="flash"),
                 lambda: TransformerBlock(8, 2, backend="flash"),
                 lambda: GPTConfig(backend="flash"), lambda: BERTConfig(backend="flash"),
                 lambda: EncoderDecoderConfig(5, 5, backend="flash"),
                 lambda: ViTConfig(backend="flash")):
        with pytest.raises(ValueError, match="backend must be one of .*'sdpa'.*backend='flash'"):
            make()
    assert set(ATTENTION_BACKENDS) == {"explicit", "sdpa", "triton"}


def test_flops_are_counted_the_same_on_the_fast_path():
    x = torch.randn(2, 16, 64)
    counts = []
    for backend in ("explicit", "sdpa"):
        torch.manual_seed(0)
        layer = MultiHeadAttention(64, 4, backend=backend)
        with torch.no_grad(), flop_counter() as counter:
            layer(x, is_causal=True)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 4 * 2 * 2 * 16 * 64 * 64 + 2 * 2 * 2 * 16 * 16 * 64


# Every model --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("norm_first", [True, False])
def test_blocks_agree(norm_first, dtype, atol):
    gen = torch.Generator().manual_seed(4)
    x, memory = torch.randn(2, 5, 32, generator=gen), torch.randn(2, 4, 32, generator=gen)
    memory_mask = padding_mask([4, 2])[:, None, None, :]

    def make(backend):
        return TransformerBlock(32, 2, 48, norm_first=norm_first, cross_attention=True,
                                backend=backend)

    def run(block):
        return block(x.to(dtype), is_causal=True, context=memory.to(dtype),
                     context_mask=memory_mask)

    _compare(make, run, dtype, atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_gpt_agrees(dtype, atol):
    ids = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(5))

    def make(backend):
        return GPT(GPTConfig(vocab_size=20, context_length=8, d_model=32, num_layers=2,
                             num_heads=2, dropout=0.0, backend=backend))

    _compare(make, lambda model: model(ids), dtype, atol)


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_gpt_generates_the_same_tokens(backend):
    torch.manual_seed(6)
    config = GPTConfig(vocab_size=20, context_length=8, d_model=32, num_layers=2, num_heads=2,
                       backend=backend)
    model = GPT(config).double()
    prompt = torch.randint(0, 20, (2, 3), generator=torch.Generator().manual_seed(6))
    cached = model.generate(prompt, 9, temperature=0.0)  # past the context: the window moves
    torch.manual_seed(6)
    reference = GPT(GPTConfig(**{**vars(config), "backend": "explicit"})).double()
    assert torch.equal(cached, reference.generate(prompt, 9, temperature=0.0, use_cache=False))


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_bert_agrees_with_padding_and_an_empty_sequence(dtype, atol):
    ids = torch.randint(1, 20, (3, 6), generator=torch.Generator().manual_seed(7))
    keep = padding_mask([6, 2, 0])  # the third sequence is all padding: rows that see nothing

    def make(backend):
        return BERT(BERTConfig(vocab_size=20, d_model=32, num_layers=2, num_heads=2, d_ff=48,
                               context_length=8, dropout=0.0, backend=backend))

    _compare(make, lambda model: model(ids, attention_mask=keep), dtype, atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_encoder_decoder_agrees(dtype, atol):
    gen = torch.Generator().manual_seed(8)
    src, tgt = torch.randint(3, 20, (2, 6), generator=gen), torch.randint(3, 20, (2, 5), generator=gen)
    tgt[1, 3:] = 0  # the target's padding, under the causal mask

    def make(backend):
        return EncoderDecoder(EncoderDecoderConfig(src_vocab=20, tgt_vocab=20, d_model=32,
                                                   num_heads=2, num_layers=1, d_ff=48,
                                                   context_length=8, dropout=0.0,
                                                   backend=backend))

    _compare(make, lambda model: model(src, tgt, src_lengths=[6, 3]), dtype, atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_vit_agrees(dtype, atol):
    images = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(9))

    def make(backend):
        return ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=32,
                             num_layers=2, num_heads=2, d_ff=48, backend=backend))

    _compare(make, lambda model: model(images.to(dtype)), dtype, atol)


def test_models_ask_for_weights_only_when_asked():
    torch.manual_seed(10)
    vit = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=16,
                        num_layers=2, num_heads=2, d_ff=16))
    asked = []
    for block in vit.blocks:
        block.self_attn.register_forward_hook(
            lambda m, args, out: asked.append(out[1] is not None))  # (outputs, weights or None)
    images = torch.randn(1, 1, 8, 8)
    logits = vit(images)
    assert asked == [False, False]
    logits_too, weights = vit(images, return_weights=True)
    assert asked[2:] == [True, True] and len(weights) == 2
    torch.testing.assert_close(logits, logits_too)


# Checked once, at the boundary --------------------------------------------------------------


def check_calls(fn) -> int:
    """Calls of functions of attnbook.checks, the package's one module of checks (appendix H)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_globals.get("__name__") == "attnbook.checks":
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _gpt(layers: int, backend: str) -> GPT:
    torch.manual_seed(11)
    return GPT(GPTConfig(vocab_size=64, context_length=32, d_model=32, num_layers=layers,
                         num_heads=2, dropout=0.0, backend=backend))  # head size 16: the kernel's


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_a_gpt_checks_its_input_once_on_every_backend(backend):
    """The checks are made at the model's entry points only: as many for 1 layer as for 2 (a
    check in each layer would add one), and for 10 generated tokens as for 11 (a check in each
    step would add one). Small, as the profiler slows Triton's interpreter many times over."""
    idx = torch.randint(64, (2, 16))
    counts = {}
    for layers in (1, 2):
        model = _gpt(layers, backend)
        counts[layers] = (check_calls(lambda m=model: m(idx)),
                          check_calls(lambda m=model: m.generate(idx[:, :4], 10, temperature=0.0)),
                          check_calls(lambda m=model: m.generate(idx[:, :4], 11, temperature=0.0)))
    forward, ten, eleven = counts[1]
    assert counts[2] == counts[1] and ten == eleven, counts
    assert forward <= 10 and ten <= 30, counts


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of a tensor's value into Python (int, bool, float, item, tolist): on a
    GPU, each makes the host wait for the device."""

    READS = {"__int__", "__bool__", "__float__", "__index__", "item", "tolist"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def host_reads(fn) -> int:
    with _HostReads() as reads:
        fn()
    return reads.count


def _bert(layers: int, backend: str) -> BERT:
    torch.manual_seed(12)
    return BERT(BERTConfig(vocab_size=20, d_model=32, num_layers=layers, num_heads=2, d_ff=48,
                           context_length=16, dropout=0.0, backend=backend)).eval()


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_bert_checks_its_input_once_on_every_backend(backend):
    """encode checks at its entry point only: as many checks and host reads for 4 layers as for
    2, and its core, _encode, checks nothing."""
    ids, types, keep = torch.randint(20, (2, 10)), torch.randint(2, (2, 10)), padding_mask([10, 6])
    counts = {}
    for layers in (2, 4):
        model = _bert(layers, backend)
        for name, call in {"bool mask": partial(model, ids, attention_mask=keep),
                           "0/1 mask and types": partial(model, ids, types, keep.long())}.items():
            counts[layers, name] = (check_calls(call), host_reads(call))
    assert all(counts[2, name] == counts[4, name] for _, name in counts), counts
    assert max(calls for calls, _ in counts.values()) <= 10, counts
    model = _bert(2, backend)
    assert check_calls(lambda: model._encode(ids, types, None)) == 0


def test_bert_reads_only_the_values_that_can_be_wrong():
    """The default token types (zeros) and a bool mask are not read: encode then reads the
    device no more often than checking input_ids alone does. A 0/1 mask costs one read."""
    from attnbook.checks import check_token_ids

    model, ids = _bert(2, "sdpa"), torch.randint(20, (2, 10))
    keep = padding_mask([10, 6])
    ids_alone = host_reads(lambda: check_token_ids("input_ids", ids, 20))
    assert host_reads(lambda: model.encode(ids)) == ids_alone
    assert host_reads(lambda: model.encode(ids, attention_mask=keep)) == ids_alone
    assert host_reads(lambda: model.encode(ids, attention_mask=keep.long())) == ids_alone + 1


def _vit(layers: int, backend: str) -> ViT:
    torch.manual_seed(13)
    return ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=32,
                         num_layers=layers, num_heads=2, d_ff=48, backend=backend)).eval()


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_vit_checks_its_input_once_on_every_backend(backend):
    """ViT.forward checks the images and the flag once: as many calls into attnbook.checks for
    4 layers as for 2, with the weights or without, and no host reads."""
    images = torch.randn(2, 1, 8, 8)
    counts = {}
    for layers in (2, 4):
        model = _vit(layers, backend)
        for weights in (False, True):
            counts[layers, weights] = check_calls(partial(model, images, return_weights=weights))
    assert len(set(counts.values())) == 1 and counts[2, False] <= 10, counts
    assert host_reads(lambda: _vit(2, backend)(images, return_weights=True)) == 0


def test_bare_layers_check_and_the_cores_in_a_model_do_not():
    block = TransformerBlock(8, 2)
    with pytest.raises(ValueError, match="x must end in"):
        block(torch.randn(1, 3, 4))
    with pytest.raises(TypeError, match="mask must be a torch.bool"):
        block(torch.randn(1, 3, 8), mask=torch.ones(3, 3))
    with pytest.raises(TypeError, match="cache must be"):
        block(torch.randn(1, 3, 8), cache="no")
    model = GPT(GPTConfig(vocab_size=8, context_length=4, d_model=8, num_layers=1, num_heads=2))
    inner = model.blocks[0]
    assert type(inner) is Block and type(inner.self_attn) is Attention
    assert check_calls(lambda: inner(torch.randn(1, 3, 8), is_causal=True)) == 0


def test_the_triton_backend_runs_the_kernel_where_it_can(monkeypatch):
    from attnbook import kernels

    calls = []
    real = kernels._flash_attention
    monkeypatch.setattr(kernels, "_flash_attention",
                        lambda q, k, v, causal, scale: calls.append(causal)
                        or real(q, k, v, causal, scale))
    layer = MultiHeadAttention(32, 2, num_kv_heads=1, backend="triton")
    x = torch.randn(1, 5, 32)
    torch.testing.assert_close(layer(x, is_causal=True),
                               layer(x, mask=causal_mask(5)), atol=1e-5, rtol=1e-5)
    layer(x)
    assert calls == [True, False]
    layer(x, mask=padding_mask([3], 5)[:, None, None, :])  # the kernel takes no mask: SDPA does
    layer(x, return_weights=True)  # the weights: attend
    assert len(calls) == 2


def test_two_byte_attention_on_a_cpu_without_avx512_runs_in_float32():
    """PyTorch's CPU SDPA stops on bfloat16 where AVX-512 is missing ('pack_vnni2'): the fast path
    computes 2-byte data in float32, as attend does, so a model runs on any CPU."""
    import os
    import subprocess
    import sys

    script = """
import torch
from attnbook.gpt import GPT, GPTConfig
torch.manual_seed(0)
config = GPTConfig(vocab_size=64, context_length=512, d_model=64, num_layers=1, num_heads=4,
                   dropout=0.0)  # head size 16, 300 positions: where the CPU kernel stopped
for dtype in (torch.bfloat16, torch.float16):
    fast = GPT(config).eval().to(dtype)
    slow = GPT(GPTConfig(**{**config.__dict__, "backend": "explicit"})).eval().to(dtype)
    slow.load_state_dict(fast.state_dict())
    ids = torch.randint(64, (1, 300))
    cache = fast.make_kv_cache(1)
    with torch.no_grad():
        a, b = fast(ids, kv_cache=cache), slow(ids)
    assert a.dtype == dtype and torch.allclose(a.float(), b.float(), atol=0.05), dtype
print("ok")
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
