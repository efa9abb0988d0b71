"""Tests for attnbook.positions (chapter 5): sinusoidal encodings, RoPE and ALiBi."""

import math

import numpy as np
import pytest
import torch

from attnbook.attention import scaled_dot_product_attention
from attnbook.positions import alibi_bias, alibi_slopes, apply_rope, sinusoidal_encoding

# ---------------------------------------------------------------- independent references


def sinusoid_loops(num_positions, d_model):
    """The formula of Vaswani et al., one entry at a time."""
    out = np.empty((num_positions, d_model))
    for p in range(num_positions):
        for j in range(d_model):
            angle = p / 10000 ** (2 * (j // 2) / d_model)
            out[p, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return out


def rope_numpy_complex(x, positions, base=10000.0):
    """Half-split RoPE as complex multiplication: pair i is x_i + 1j * x_{i + d/2}."""
    x = np.asarray(x, dtype=np.float64)
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    theta = base ** (-2.0 * np.arange(half) / x.shape[-1])
    z = z * np.exp(1j * np.asarray(positions, dtype=np.float64)[:, None] * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def paper_slopes(n):
    """Press et al.'s rule, written as a recursion on the head count."""
    if math.log2(n).is_integer():
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]
    lower = 2 ** math.floor(math.log2(n))
    return paper_slopes(lower) + paper_slopes(2 * lower)[::2][: n - lower]


def alibi_loops(num_heads, q_len, k_len):
    slopes = paper_slopes(num_heads)
    out = np.empty((num_heads, q_len, k_len))
    for h in range(num_heads):
        for i in range(q_len):
            for j in range(k_len):
                out[h, i, j] = -slopes[h] * abs((k_len - q_len + i) - j)
    return out


# ---------------------------------------------------------------- order blindness


def test_self_attention_without_positions_is_permutation_equivariant():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 8))
    w_q, w_k, w_v = (rng.normal(size=(8, 8)) for _ in range(3))

    def attend(x):
        return scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v)[0]

    for _ in range(5):
        perm = rng.permutation(7)
        np.testing.assert_allclose(attend(x[perm]), attend(x)[perm], atol=1e-12)
    # adding positions breaks the symmetry
    pe = sinusoidal_encoding(7, 8)
    perm = np.array([1, 0, 2, 3, 4, 5, 6])
    assert not np.allclose(attend(x[perm] + pe), (attend(x + pe))[perm])


# ---------------------------------------------------------------- sinusoidal


def test_sinusoidal_table_of_four_positions():
    table = sinusoidal_encoding(4, 4)
    expected = [[math.sin(p), math.cos(p), math.sin(p / 100), math.cos(p / 100)] for p in range(4)]
    np.testing.assert_allclose(table, expected, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(
        np.round(table, 3),
        [[0.0, 1.0, 0.0, 1.0], [0.841, 0.540, 0.010, 1.0],
         [0.909, -0.416, 0.020, 1.0], [0.141, -0.990, 0.030, 1.0]],
    )


@pytest.mark.parametrize("num_positions,d_model", [(1, 1), (1, 8), (5, 1), (3, 5), (50, 64),
                                                   (17, 33), (200, 128)])
def test_sinusoidal_matches_formula(num_positions, d_model):
    table = sinusoidal_encoding(num_positions, d_model)
    assert table.shape == (num_positions, d_model) and table.dtype == np.float64
    np.testing.assert_allclose(table, sinusoid_loops(num_positions, d_model), rtol=0, atol=1e-12)


def test_sinusoidal_odd_width_ends_with_a_sine():
    table = sinusoidal_encoding(30, 7)
    np.testing.assert_allclose(table[:, -1], np.sin(np.arange(30) / 10000 ** (6 / 7)))
    np.testing.assert_allclose(table[:, :6], sinusoid_loops(30, 7)[:, :6])


@pytest.mark.parametrize("d_model", [4, 32, 64, 65])
def test_sinusoidal_dot_product_depends_on_offset_only(d_model):
    table = sinusoidal_encoding(300, d_model)[:, : d_model - d_model % 2]  # complete pairs only
    gram = table @ table.T
    for k in [0, 1, 7, 50, 199]:
        diagonal = np.diagonal(gram, offset=k)
        np.testing.assert_allclose(diagonal, diagonal[0], atol=1e-9)
        np.testing.assert_allclose(np.diagonal(gram, offset=-k), diagonal, atol=1e-9)


def test_sinusoidal_odd_width_unpaired_column_breaks_offset_property():
    gram = sinusoidal_encoding(50, 5) @ sinusoidal_encoding(50, 5).T
    assert np.ptp(np.diagonal(gram)) > 1e-4


def test_sinusoidal_shift_is_a_fixed_rotation():
    d_model, k = 16, 9
    table = sinusoidal_encoding(100, d_model)
    rotation = np.zeros((d_model, d_model))
    for i in range(d_model // 2):
        angle = k / 10000 ** (2 * i / d_model)
        c, s = math.cos(angle), math.sin(angle)
        rotation[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, -s], [s, c]]
    np.testing.assert_allclose(table[:-k] @ rotation, table[k:], atol=1e-12)


@pytest.mark.parametrize("args,error,name", [
    ((0, 4), ValueError, "num_positions"),
    ((-3, 4), ValueError, "num_positions"),
    ((4, 0), ValueError, "d_model"),
    ((4, -1), ValueError, "d_model"),
    ((4.0, 4), TypeError, "num_positions"),
    ((4, 2.5), TypeError, "d_model"),
    ((True, 4), TypeError, "num_positions"),
    (("4", 4), TypeError, "num_positions"),
])
def test_sinusoidal_bad_input(args, error, name):
    with pytest.raises(error, match=name):
        sinusoidal_encoding(*args)


def test_sinusoidal_accepts_numpy_integers():
    np.testing.assert_array_equal(sinusoidal_encoding(np.int64(3), np.int32(4)),
                                  sinusoidal_encoding(3, 4))


# ---------------------------------------------------------------- RoPE


@pytest.mark.parametrize("seed,shape", [(0, (5, 8)), (1, (2, 3, 7, 16)), (2, (1, 2)),
                                        (3, (4, 1, 64)), (4, (2, 2, 2, 33, 6))])
def test_rope_matches_complex_reference(seed, shape):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    default = np.arange(shape[-2])
    np.testing.assert_allclose(apply_rope(x).numpy(), rope_numpy_complex(x, default), atol=1e-12)
    positions = torch.randint(0, 10_000, (shape[-2],), generator=gen)
    np.testing.assert_allclose(apply_rope(x, positions).numpy(),
                               rope_numpy_complex(x, positions.numpy()), atol=1e-10)


def test_rope_custom_base_and_float_positions():
    x = torch.randn(3, 6, 10, dtype=torch.float64)
    positions = torch.tensor([0.0, 0.5, 2.25, 7.0, 100.0, 1e4])
    np.testing.assert_allclose(apply_rope(x, positions, base=500.0).numpy(),
                               rope_numpy_complex(x, positions.numpy(), base=500.0), atol=1e-10)


def test_rope_position_zero_is_identity_and_lengths_are_kept():
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, torch.zeros(9)), x)
    torch.testing.assert_close(apply_rope(x, torch.arange(9) * 37).norm(dim=-1), x.norm(dim=-1))


def test_rope_float32_matches_float64():
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    positions = torch.arange(5) + 3000
    out32 = apply_rope(x.float(), positions)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), apply_rope(x, positions), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_low_precision_keeps_dtype(dtype):
    x = torch.randn(3, 7, 16).to(dtype)
    out = apply_rope(x)
    assert out.dtype == dtype and out.shape == x.shape
    reference = rope_numpy_complex(x.double(), np.arange(7))
    tolerance = 1e-2 if dtype == torch.float16 else 5e-2
    np.testing.assert_allclose(out.double().numpy(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("seed", range(3))
def test_rope_score_depends_on_offset_only(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 32, generator=gen, dtype=torch.float64)

    def score(m, n):
        return float(apply_rope(q[None], torch.tensor([m]))[0] @ apply_rope(k[None],
                                                                        torch.tensor([n]))[0])

    for offset in [0, 1, -4, 25]:
        scores = [score(m, m - offset) for m in [30, 31, 100, 777, 5000]]
        np.testing.assert_allclose(scores, scores[0], rtol=1e-8, atol=1e-10)
    assert abs(score(5, 4) - score(5, 3)) > 1e-6


def test_rope_length_one_and_cache_consistency():
    x = torch.randn(2, 12, 8)
    torch.testing.assert_close(apply_rope(x[:, 11:], torch.tensor([11])), apply_rope(x)[:, 11:])
    torch.testing.assert_close(apply_rope(x[:, :1]), x[:, :1])


def test_rope_gradients_flow():
    x = torch.randn(3, 4, 8, requires_grad=True)
    apply_rope(x).square().sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())  # rotations keep lengths


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(x=torch.ones(4, 7)), ValueError, "d"),
    (dict(x=torch.ones(4, 0)), ValueError, "d"),
    (dict(x=torch.ones(8)), ValueError, "x"),
    (dict(x=torch.ones(4, 8), positions=torch.arange(5)), ValueError, "positions"),
    (dict(x=torch.ones(4, 8), positions=torch.arange(3)), ValueError, "positions"),
    (dict(x=torch.ones(4, 8), positions=torch.zeros(4, 1)), ValueError, "positions"),
    (dict(x=torch.ones(4, 8), base=0.0), ValueError, "base"),
    (dict(x=torch.ones(4, 8), base=-10.0), ValueError, "base"),
    (dict(x=torch.ones(4, 8, dtype=torch.int64)), TypeError, "x"),
    (dict(x=np.ones((4, 8))), TypeError, "x"),
    (dict(x=torch.ones(4, 8), positions="abc"), TypeError, "positions"),
    (dict(x=torch.ones(4, 8), positions=[0, 1, None, 3]), TypeError, "positions"),
    (dict(x=torch.ones(4, 8), positions=torch.ones(4, dtype=torch.bool)), TypeError, "positions"),
    (dict(x=torch.ones(4, 8), base=float("inf")), ValueError, "base"),
    (dict(x=torch.ones(4, 8), base=float("nan")), ValueError, "base"),
    (dict(x=torch.ones(4, 8), base=True), TypeError, "base"),  # a bool is no number
    (dict(x=torch.ones(4, 8), base=np.float32(-3.0)), ValueError, "base"),
])
def test_rope_bad_input(kwargs, error, name):
    with pytest.raises(error, match=rf"\b{name}\b"):
        apply_rope(**kwargs)


def test_rope_odd_d_message_names_d_and_its_value():
    with pytest.raises(ValueError, match="d = 7"):
        apply_rope(torch.ones(2, 3, 7))


# ---------------------------------------------------------------- ALiBi slopes


def test_alibi_slopes_eight_heads():
    assert alibi_slopes(8).tolist() == [1 / 2 ** h for h in range(1, 9)]


def test_alibi_slopes_six_heads_follow_the_paper():
    six = alibi_slopes(6, dtype=torch.float64).tolist()
    assert six == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 12, 16, 20, 32, 40, 96])
def test_alibi_slopes_match_rule(n):
    slopes = alibi_slopes(n, dtype=torch.float64)
    assert slopes.shape == (n,) and slopes.dtype == torch.float64
    np.testing.assert_allclose(slopes.numpy(), paper_slopes(n), rtol=1e-12)
    assert len(set(slopes.tolist())) == n and bool((slopes > 0).all())


def test_alibi_slopes_power_of_two_is_geometric():
    for n in [2, 4, 8, 16, 64]:
        slopes = alibi_slopes(n, dtype=torch.float64)
        np.testing.assert_allclose(slopes[0].item(), 2 ** (-8 / n))
        np.testing.assert_allclose((slopes[1:] / slopes[:-1]).numpy(), 2 ** (-8 / n))


# ---------------------------------------------------------------- ALiBi bias


@pytest.mark.parametrize("heads,q_len,k_len", [(1, 1, None), (4, 5, None), (6, 3, 7), (3, 1, 9),
                                               (8, 16, 16), (12, 4, 10), (5, 6, 4)])
def test_alibi_bias_matches_loops(heads, q_len, k_len):
    bias = alibi_bias(heads, q_len, k_len, dtype=torch.float64)
    k = q_len if k_len is None else k_len
    assert bias.shape == (heads, q_len, k) and bias.dtype == torch.float64
    np.testing.assert_allclose(bias.numpy(), alibi_loops(heads, q_len, k), rtol=1e-12, atol=0)


def test_alibi_bias_default_dtype_and_no_negative_zero():
    bias = alibi_bias(4, 6)
    assert bias.dtype == torch.float32
    diagonal = torch.diagonal(bias, dim1=-2, dim2=-1)
    assert bool((diagonal == 0).all()) and not bool(torch.signbit(diagonal).any())


def test_alibi_bias_is_bottom_right_aligned_and_symmetric():
    full = alibi_bias(8, 10)
    torch.testing.assert_close(alibi_bias(8, 3, 10), full[:, -3:])
    torch.testing.assert_close(full, full.transpose(-1, -2))  # keys after the query: |i - j|
    assert bool((full <= 0).all())


def test_alibi_bias_in_causal_attention_matches_manual_softmax():
    heads, length, d = 4, 6, 8
    q, k, v = torch.randn(3, 1, heads, length, d, dtype=torch.float64)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = alibi_bias(heads, length, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) + torch.from_numpy(
        alibi_loops(heads, length, length))
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, weights @ v)


@pytest.mark.parametrize("args,error,name", [
    ((0, 4), ValueError, "num_heads"),
    ((-2, 4), ValueError, "num_heads"),
    ((4, 0), ValueError, "q_len"),
    ((4, 3, 0), ValueError, "k_len"),
    ((4, 3, -5), ValueError, "k_len"),
    ((2.5, 4), TypeError, "num_heads"),
    ((4, 3.0), TypeError, "q_len"),
    ((4, 3, "7"), TypeError, "k_len"),
])
def test_alibi_bias_bad_input(args, error, name):
    with pytest.raises(error, match=name):
        alibi_bias(*args)


@pytest.mark.parametrize("n,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                     (None, TypeError)])
def test_alibi_slopes_bad_input(n, error):
    with pytest.raises(error, match="num_heads"):
        alibi_slopes(n)


@pytest.mark.parametrize("base", [np.float32(10000.0), np.float64(10000.0), np.int64(10000),
                                  10000])
def test_rope_accepts_any_real_base(base):
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, base=base), apply_rope(x, base=10000.0))


def test_rope_accepts_list_and_numpy_positions():
    x = torch.randn(3, 8, dtype=torch.float64)
    expected = apply_rope(x, torch.tensor([4, 9, 2]))
    torch.testing.assert_close(apply_rope(x, [4, 9, 2]), expected)
    torch.testing.assert_close(apply_rope(x, np.array([4, 9, 2])), expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64,
                                   "float32", np.float32])
def test_alibi_needs_a_floating_dtype(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        alibi_slopes(4, dtype=dtype)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        alibi_bias(4, 3, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_alibi_floating_dtypes(dtype):
    slopes = alibi_slopes(8, dtype=dtype)
    assert slopes.dtype == dtype
    torch.testing.assert_close(slopes.double(), alibi_slopes(8, dtype=torch.float64),
                               rtol=1e-2, atol=0)


# --- No silent wrong answers -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alibi_bias_low_precision_is_computed_in_float32(dtype):
    # Far keys: a float16 distance past 65,504 is inf, which would silently mask the key.
    bias = alibi_bias(8, 1, 70_000, dtype=dtype)
    exact = alibi_bias(8, 1, 70_000, dtype=torch.float64)
    assert bias.dtype == dtype and torch.isfinite(bias).all()
    torch.testing.assert_close(bias, exact.to(dtype), rtol=0, atol=0)  # one rounding, at the end
    assert abs(float(bias[-1, 0, 0]) + 69_999 / 256) < 1  # about -273.4, not -inf


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("call", [lambda: alibi_slopes(4, device="cuda"),
                                  lambda: alibi_bias(4, 3, device="cuda")])
def test_alibi_device_without_a_gpu_is_a_clear_error(call):
    with pytest.raises(ValueError, match="device='cuda', but this machine has no CUDA GPU"):
        call()


def test_alibi_device_is_checked_and_kept():
    assert alibi_bias(2, 3, device="cpu").device.type == "cpu"
    assert alibi_slopes(2, device=torch.device("cpu")).device.type == "cpu"
    with pytest.raises(ValueError, match="device must name a device"):
        alibi_slopes(2, device="tpu:x")


def test_float8_is_refused_by_name():
    """PyTorch has no arithmetic for float8: a TypeError naming the argument, not its own."""
    with pytest.raises(TypeError, match="dtype must be float16 or wider"):
        alibi_bias(2, 3, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="x must be float16 or wider"):
        apply_rope(torch.ones(1, 2, 4).to(torch.float8_e4m3fn))


def test_rope_positions_one_rule_for_scalars_and_meta():
    """A scalar is refused whether a Python int or a 0-d tensor; positions must hold values."""
    x = torch.ones(1, 1, 4)
    for scalar in (3, torch.tensor(3), np.int64(3)):
        with pytest.raises(ValueError, match="positions must have shape"):
            apply_rope(x, scalar)
    torch.testing.assert_close(apply_rope(x, [3]), apply_rope(x, torch.tensor([3])))
    with pytest.raises(ValueError, match="positions must hold values"):
        apply_rope(torch.ones(1, 2, 4), torch.tensor([0.0, 1.0], device="meta"))
