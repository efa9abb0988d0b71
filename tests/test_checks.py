"""attnbook.checks (appendix H): one error policy, one check per concept."""

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from attnbook import checks as c


@pytest.mark.parametrize("value, minimum", [(3, None), (np.int32(5), 1), (0, 0), (-2, None)])
def test_check_int_returns_a_python_int(value, minimum):
    got = c.check_int("n", value, minimum)
    assert got == value and type(got) is int


@pytest.mark.parametrize("value, error", [(True, TypeError), (np.True_, TypeError),
                                          (2.0, TypeError), ("2", TypeError), (None, TypeError),
                                          (0, ValueError)])
def test_check_int_names_the_argument_and_its_value(value, error):
    with pytest.raises(error, match=r"num_heads must be .*got num_heads=" + repr(value)[:4]):
        c.check_int("num_heads", value, minimum=1)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_settings_are_refused(value):
    for check in (c.check_real, c.check_positive, c.check_probability):
        with pytest.raises(ValueError, match="must be a finite number"):
            check("eps", value)
    with pytest.raises(ValueError, match="scale"):
        c.check_scale(value, 16)


def test_intervals_and_their_ends():
    assert c.check_probability("p", 0) == 0.0 and c.check_probability("p", 1) == 1.0
    with pytest.raises(ValueError, match=r"in \[0.0, 1.0\]"):
        c.check_probability("p", 1.0000001)
    with pytest.raises(ValueError, match=r"in \(0.0, inf\]"):
        c.check_positive("eps", 0.0)
    assert c.check_real("x", 2, 0, 2) == 2.0
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        c.check_real("x", 2, 0, 2, open_high=True)


@pytest.mark.parametrize("value", [True, "yes", 0.5, None])
def test_bools_are_not_numbers_and_numbers_are_not_bools(value):
    with pytest.raises(TypeError):
        c.check_real("eps", True)
    if not isinstance(value, bool):
        with pytest.raises(TypeError, match=f"causal must be True or False, got causal={value!r}"):
            c.check_bool("causal", value)


def test_scale_defaults_to_one_over_root_d():
    assert c.check_scale(None, 64) == 0.125 and c.check_scale(3, 64) == 3.0
    with pytest.raises(TypeError):
        c.check_scale("big", 64)


def test_choice():
    assert c.check_choice("norm", "layer", ("layer", "rms")) == "layer"
    with pytest.raises(ValueError, match=r"norm must be one of \['layer', 'rms'\], got norm='batch'"):
        c.check_choice("norm", "batch", ("rms", "layer"))


@pytest.mark.parametrize("value", [3, None, b"layer", ["layer"]])
def test_choice_of_the_wrong_type_is_a_type_error(value):
    # the policy: a wrong type raises TypeError (it was a ValueError, for 3 and None too)
    with pytest.raises(TypeError, match=r"norm must be one of \['layer', 'rms'\], got norm=.* of type"):
        c.check_choice("norm", value, ("rms", "layer"))


@pytest.mark.parametrize("value", [10**400, -(10**400), Fraction(10**400, 3), 10**5000 // 7],
                         ids=["10**400", "-10**400", "Fraction", "10**5000//7"])
@pytest.mark.parametrize("check", [
    lambda v: c.check_real("eps", v), lambda v: c.check_positive("eps", v),
    lambda v: c.check_probability("eps", v), lambda v: c.check_scale(v, 64)])
def test_a_number_beyond_a_float_is_refused_by_name(check, value):
    # float(10**400) raises OverflowError: it escaped every check built on check_real
    with pytest.raises(ValueError, match=r"(eps|scale) must be a finite number.*beyond a float"):
        check(value)


@pytest.mark.skipif(np.finfo(np.longdouble).max <= np.finfo(np.float64).max,
                    reason="longdouble is float64 on this machine")
def test_a_finite_longdouble_beyond_a_float_is_not_called_inf():
    # it was refused as "got eps=inf", a value the caller never gave
    with pytest.raises(ValueError, match=r"got eps=np.longdouble\('1e\+4000'\), beyond a float"):
        c.check_real("eps", np.longdouble("1e4000"))
    with pytest.raises(ValueError, match=r"got eps=inf$"):
        c.check_real("eps", np.longdouble("inf"))


def test_device():
    assert c.check_device("device", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must name a device"):
        c.check_device("device", "gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this machine has no CUDA GPU"):
            c.check_device("device", "cuda:0")


def test_token_ids_become_int64_and_are_range_checked():
    ids = c.check_token_ids("ids", torch.tensor([[0, 7]], dtype=torch.uint8), 8)
    assert ids.dtype == torch.int64 and ids.tolist() == [[0, 7]]
    labels = ids.clone()
    labels[0, 0] = -100  # the label that uint8 would have wrapped to 156
    assert labels[0, 0] == -100
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=8\), got values from 0 to 8"):
        c.check_token_ids("ids", torch.tensor([0, 8]), 8)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), [1, 2]):
        with pytest.raises(TypeError, match="ids must"):
            c.check_token_ids("ids", bad, 8)


@pytest.mark.parametrize("dtype, work", [(torch.float16, torch.float32),
                                         (torch.bfloat16, torch.float32),
                                         (torch.float32, torch.float32),
                                         (torch.float64, torch.float64),
                                         (np.float16, np.float32), (np.float64, np.float64),
                                         ("float16", np.float32)])
def test_compute_dtype(dtype, work):
    from attnbook.attention import compute_dtype

    assert compute_dtype(dtype) == work


def test_check_array():
    assert c.check_array("x", [[1, 2]], min_ndim=2).dtype == np.float64
    f16 = np.zeros((2, 3), np.float16)
    assert c.check_array("x", f16) is f16  # no copy, dtype kept
    with pytest.raises(TypeError, match="Q must hold real numbers, got Q of dtype <U1"):
        c.check_array("Q", [["a"]])
    with pytest.raises(TypeError, match="complex"):
        c.check_array("Q", np.ones((2, 2), np.complex64))
    with pytest.raises(ValueError, match=r"Q must have at least 2 dimensions, got shape \(3,\)"):
        c.check_array("Q", [1.0, 2.0, 3.0], min_ndim=2)



class _OwnReason:
    def __array__(self, dtype=None, copy=None):
        raise ValueError("my own reason")


RAGGED = {"a ragged list": [[1.0, 2.0], [3.0]], "a ragged 3-deep list": [[[1.0]], [[1.0, 2.0]]],
          "a ragged object array": np.array([[1.0], [2.0, 3.0]], dtype=object),
          "a list of ragged arrays": [np.zeros(2), np.zeros(3)]}


@pytest.mark.parametrize("ragged", RAGGED)
def test_ragged_input_has_one_policy_in_check_array_and_chapter_1s_mask(ragged):
    """check_array called a ragged object array a dtype error, where chapter 1's mask check
    called it ragged: both now read it through as_rectangular."""
    from attnbook.attention import scaled_dot_product_attention
    with pytest.raises(ValueError, match="^x must be rectangular, and NumPy says: .*inhomogeneous"):
        c.as_rectangular("x", RAGGED[ragged])
    with pytest.raises(ValueError, match="^x must be rectangular"):
        c.check_array("x", RAGGED[ragged])
    with pytest.raises(ValueError, match="^mask must be rectangular"):  # before its dtype
        scaled_dot_product_attention(np.ones((2, 1)), np.ones((2, 1)), np.ones((2, 1)),
                                     mask=RAGGED[ragged])


def test_as_rectangular_relabels_only_a_ragged_nesting():
    """Every ValueError of np.asarray was called "must be rectangular", an array's own too."""
    from attnbook.attention import scaled_dot_product_attention
    for check in (lambda x: c.as_rectangular("x", x), lambda x: c.check_array("x", x),
                  lambda x: scaled_dot_product_attention(np.ones((2, 1)), np.ones((2, 1)),
                                                         np.ones((2, 1)), mask=x)):
        with pytest.raises(ValueError, match="^my own reason$"):
            check(_OwnReason())
    kept = np.zeros((2, 3), np.float32)
    assert c.as_rectangular("x", kept) is kept  # no copy
    read = c.as_rectangular("x", np.array([[1.0, 2.0]], dtype=object))  # its elements decide
    assert read.dtype == np.float64 and read.tolist() == [[1.0, 2.0]]


def test_check_tensor():
    x = torch.zeros(2, 3, 8)
    assert c.check_tensor("x", x, ndim=(2, 3), size=8) is x
    assert c.check_tensor("x", x, ndim=3) is x and c.check_tensor("x", x) is x
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got x=\\[1.0\\] of type list"):
        c.check_tensor("x", [1.0])
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got dtype torch.int64"):
        c.check_tensor("x", torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"x must have 2 or 3 dimensions, got shape \(8,\)"):
        c.check_tensor("x", torch.zeros(8), ndim=(2, 3))
    with pytest.raises(ValueError, match=r"x must end in a dimension of size 4, got shape \(2, 8\)"):
        c.check_tensor("x", torch.zeros(2, 8), size=4)
    with pytest.raises(ValueError, match="size 4"):
        c.check_tensor("x", torch.tensor(1.0), size=4)


def test_messages_read_as_english():
    with pytest.raises(ValueError, match=r"^scale must be a finite number, got scale=inf$"):
        c.check_scale(math.inf, 64)
    with pytest.raises(ValueError, match=r"at least 1 dimension, got shape \(\)"):
        c.check_array("block", 3.0, min_ndim=1)


def test_anything_usable_as_an_index_is_an_int():
    assert c.check_int("n", torch.tensor(4)) == 4 and type(c.check_int("n", torch.tensor(4))) is int
    assert c.check_int("n", np.uint8(7), minimum=1) == 7
    for bad in (torch.tensor(True), torch.tensor(2.0), torch.tensor([1, 2]), np.float64(3.0), "3"):
        with pytest.raises(TypeError, match="n must be an int"):
            c.check_int("n", bad)


def test_check_tensor_dtype_and_device():
    x = torch.zeros(2, 4)
    assert c.check_tensor("x", x, dtype=torch.float32, device=torch.device("cpu")) is x
    with pytest.raises(TypeError, match="x must be a torch.float64 tensor, got dtype torch.float32"):
        c.check_tensor("x", x, dtype=torch.float64)
    with pytest.raises(ValueError, match="x must be on device meta, got x on cpu"):
        c.check_tensor("x", x, device=torch.device("meta"))


def test_check_int_maximum():
    assert c.check_int("pad_id", 0, minimum=0, maximum=0) == 0
    with pytest.raises(ValueError, match=r"pad_id must be at most 9, got pad_id=10"):
        c.check_int("pad_id", 10, minimum=0, maximum=9)
    with pytest.raises(ValueError, match="at least 0"):
        c.check_int("pad_id", -1, minimum=0, maximum=9)


def test_check_instance_and_callable():
    marker = object()
    assert c.check_instance("config", marker, object) is marker
    with pytest.raises(TypeError, match=r"config must be an instance of int or str, got config=\[\] of type list"):
        c.check_instance("config", [], (int, str))
    assert c.check_callable("fn", print) is print
    with pytest.raises(TypeError, match=r"fn must be callable, got fn=3 of type int"):
        c.check_callable("fn", 3)


@pytest.mark.parametrize("shape", [(4,), (1, 4), (3, 1), (1, 3, 4), (2, 1, 3, 1)])
def test_check_mask_accepts_what_broadcasts(shape):
    mask = torch.ones(shape, dtype=torch.bool)
    assert c.check_mask("mask", mask, (2, 1, 3, 4)) is mask
    torch.broadcast_shapes(mask.shape, (2, 1, 3, 4))  # the rule agrees with PyTorch's


@pytest.mark.parametrize("mask, error", [
    (torch.zeros(3, 4), TypeError),  # a float mask: PyTorch would add it, we refuse it
    ([[True]], TypeError),
    (torch.ones(5, dtype=torch.bool), ValueError),
    (torch.ones(1, 2, 1, 3, 4, dtype=torch.bool), ValueError),
])
def test_check_mask_refuses(mask, error):
    with pytest.raises(error, match="key_mask"):
        c.check_mask("key_mask", mask, (2, 1, 3, 4))
    with pytest.raises(ValueError, match="must be on device meta"):
        c.check_mask("m", torch.ones(4, dtype=torch.bool), (3, 4), device="meta")


def test_check_tensor_shape_with_any_sizes():
    x = torch.zeros(2, 5, 8)
    assert c.check_tensor("k", x, shape=(2, None, 8)) is x
    assert c.check_tensor("k", x, shape=(None, None, None)) is x
    for shape in [(2, None), (2, None, 8, 1), (3, None, 8), (2, 5, 4)]:
        with pytest.raises(ValueError, match=r"k must have shape \(.*\*?.*\), got shape \(2, 5, 8\)"):
            c.check_tensor("k", x, shape=shape)
    with pytest.raises(ValueError, match=r"k must have shape \(2, \*, 64\)"):
        c.check_tensor("k", x, shape=(2, None, 64))


def test_check_token_ids_shape_and_device():
    ids = torch.tensor([[1, 2, 3]])
    assert c.check_token_ids("idx", ids, 5, shape=(None, 3), device="cpu").shape == (1, 3)
    with pytest.raises(ValueError, match=r"idx must have shape \(\*, \*\), got shape \(3,\)"):
        c.check_token_ids("idx", ids[0], 5, shape=(None, None))
    with pytest.raises(ValueError, match="idx must be on device meta"):
        c.check_token_ids("idx", ids, 5, device="meta")
    with pytest.raises(TypeError, match="integer ids"):  # the dtype is checked before the shape
        c.check_token_ids("idx", ids.float()[0], 5, shape=(None, None))


def test_an_object_that_only_looks_like_int64_ids_is_refused_by_name():
    """The usual case's one comparison includes the type: attributes alone do not pass."""
    from types import SimpleNamespace

    lookalike = SimpleNamespace(dtype=torch.int64, layout=torch.strided, is_meta=False)
    with pytest.raises(TypeError, match="idx must be a torch.Tensor of integer ids"):
        c.check_token_ids("idx", lookalike, 5)


UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_unsigned_token_ids_become_int64_or_are_refused_by_value(dtype):
    """PyTorch has no min or max for uint16/32/64 ("min_all" NotImplementedError)."""
    ids = c.check_token_ids("ids", torch.tensor([[3, 0, 9]], dtype=dtype), 10)
    assert ids.dtype == torch.int64 and ids.tolist() == [[3, 0, 9]]
    assert c.check_token_ids("ids", torch.zeros(0, 2, dtype=dtype), 10).shape == (0, 2)
    transposed = torch.tensor([[1, 2], [3, 4]], dtype=dtype).T  # not contiguous
    assert c.check_token_ids("ids", transposed, 5).tolist() == [[1, 3], [2, 4]]
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=10\), got values "
                                         r"from 0 to 10"):
        c.check_token_ids("ids", torch.tensor([0, 10], dtype=dtype), 10)


def test_uint64_ids_of_2_to_the_63_or_more_are_out_of_range():
    big = torch.tensor([1, 2**63 + 5], dtype=torch.uint64)
    with pytest.raises(ValueError, match=r"idx must lie in \[0, vocab_size=10\).*2\*\*63"):
        c.check_token_ids("idx", big, 10)


@pytest.mark.parametrize("dtype", UNSIGNED[1:])
def test_models_that_take_ids_accept_unsigned_ids(dtype):
    from attnbook.bert import BERT, BERTConfig
    from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
    from attnbook.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    ids = torch.tensor([[5, 1, 7, 3], [2, 2, 0, 6]])
    gpt = GPT(GPTConfig(vocab_size=10, context_length=8, d_model=16, num_layers=1, num_heads=2,
                        dropout=0.0)).eval()
    torch.testing.assert_close(gpt(ids.to(dtype)), gpt(ids))
    bert = BERT(BERTConfig(vocab_size=10, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                           context_length=8, dropout=0.0)).eval()
    types = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    torch.testing.assert_close(bert(ids.to(dtype), types.to(dtype)), bert(ids, types))
    encdec = EncoderDecoder(EncoderDecoderConfig(src_vocab=10, tgt_vocab=10, d_model=16,
                                                 num_heads=2, num_layers=1, context_length=8,
                                                 dropout=0.0)).eval()
    torch.testing.assert_close(encdec(ids.to(dtype), ids.to(dtype)), encdec(ids, ids))
    with pytest.raises(ValueError, match="idx must lie"):
        gpt(torch.tensor([[1, 12]], dtype=dtype))


@pytest.mark.parametrize("vocab_size,error", [(True, TypeError), (4.5, TypeError), (0, ValueError),
                                              (2**63, ValueError), (2**64, ValueError)])
def test_check_token_ids_checks_vocab_size(vocab_size, error):
    # past int64's largest id a range check cannot be done on int64 ids (2**63 wrapped to a
    # negative bound and refused ids in range; 2**64 raised OverflowError): refused by name
    with pytest.raises(error, match="^vocab_size must"):
        c.check_token_ids("ids", torch.tensor([1, 2], dtype=torch.long), vocab_size)
    assert c.check_token_ids("ids", torch.tensor([0, 2**63 - 2]), 2**63 - 1).tolist()[1] == 2**63 - 2


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_sparse_token_ids_are_refused_by_name(dtype):
    ids = torch.tensor([[0, 1], [1, 0]], dtype=dtype).to_sparse()  # raised NotImplementedError
    with pytest.raises(TypeError, match="ids must be a dense tensor, got layout torch.sparse_coo"):
        c.check_token_ids("ids", ids, 5)


def test_token_ids_on_the_meta_device_are_refused_by_name():
    # A meta tensor has a shape and no values: the range check cannot run, and PyTorch's own
    # error ("cannot be called on meta tensors") would name no argument.
    with pytest.raises(ValueError, match="ids must hold values, got a tensor on the meta device"):
        c.check_token_ids("ids", torch.zeros(2, 3, dtype=torch.long, device="meta"), 5)


def test_a_device_this_machine_lacks_is_refused(monkeypatch):
    """A device the machine lacks, "mps" (or "xpu"), and a GPU
    index past the last one, passed check_device and failed later, deep inside PyTorch."""
    for kind, backend in (("mps", torch.backends.mps), ("xpu", getattr(torch, "xpu", None))):
        if backend is not None and not backend.is_available():
            with pytest.raises(ValueError, match=f"device='{kind}', but this machine has no "
                                                 f"{kind} device"):
                c.check_device("device", kind)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert c.check_device("device", "cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device='cuda:2', but this machine has 2 cuda device"):
        c.check_device("device", "cuda:2")
    assert c.check_device("device", "meta") == torch.device("meta")


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu", 0)])
def test_cpu_and_cpu_0_are_one_device(device):
    """torch.device("cpu:0") != torch.device("cpu"), yet a CPU tensor is on both: the checks
    refused a tensor on the very device they asked for ("must be on device cpu:0, got cpu")."""
    x = torch.zeros(2, 3)
    assert c.check_tensor("x", x, device=device) is x
    mask = torch.ones(3, dtype=torch.bool)
    assert c.check_mask("mask", mask, (2, 3), device) is mask
    with pytest.raises(ValueError, match="x must be on device meta, got x on cpu"):
        c.check_tensor("x", x, device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_is_the_current_gpu():
    x = torch.zeros(2, device="cuda")  # on cuda:<current>
    assert c.check_tensor("x", x, device="cuda") is x
    assert c.check_tensor("x", x, device=f"cuda:{torch.cuda.current_device()}") is x


def test_check_writable_refuses_shared_elements():
    x = torch.zeros(2, 3)
    assert c.check_writable("x", x) is x and c.check_writable("x", x.T) is not None
    assert c.check_writable("x", torch.zeros(1, 3).expand(1, 3)).shape == (1, 3)  # size 1
    with pytest.raises(ValueError, match=r"keys has stride 0 \(an expanded tensor, strides "
                                         r"\(0, 1\)\)"):
        c.check_writable("keys", torch.zeros(3).expand(2, 3))


@pytest.mark.parametrize("by", [0, -2])
def test_check_divisible_refuses_a_divisor_below_1_by_name(by):
    # 0 raised ZeroDivisionError ("integer modulo by zero"), naming neither argument; -2 passed
    with pytest.raises(ValueError, match=f"^num_heads must be at least 1, got num_heads={by}"):
        c.check_divisible("d_model", 4, "num_heads", by)
    assert c.check_divisible("d_model", 6, "num_heads", 3) == 6
    with pytest.raises(ValueError, match="d_model=6 is not divisible by num_heads=4"):
        c.check_divisible("d_model", 6, "num_heads", 4)


@pytest.mark.parametrize("by", [True, 2.0, np.float64(2.0), "2"])
def test_check_divisible_refuses_a_divisor_that_is_not_an_int_by_name(by):
    # True passed as 1 and 2.0 as 2 (8 % 2.0 == 0.0); "2" raised "not all arguments converted"
    with pytest.raises(TypeError, match="^num_heads must be an int, got num_heads=" + re.escape(repr(by))):
        c.check_divisible("d_model", 8, "num_heads", by)
    assert c.check_divisible("d_model", 8, "num_heads", np.int64(2)) == 8


@pytest.mark.parametrize("value", [True, 8.0, np.float64(8.0), "8"])
def test_check_divisible_refuses_a_value_that_is_not_an_int_by_name(value):
    # "8" raised a raw "not all arguments converted" TypeError; 8.0 came back as a float; True passed
    with pytest.raises(TypeError, match="^d_model must be an int, got d_model=" + re.escape(repr(value))):
        c.check_divisible("d_model", value, "num_heads", 2 if value is not True else 1)
    out = c.check_divisible("d_model", np.int64(8), "num_heads", 2)
    assert out == 8 and type(out) is int


def _generator_saying(device: str) -> torch.Generator:
    """A CPU generator that reports another device: cuda:0 on a machine without a GPU, or meta,
    where PyTorch 2.13 cannot make one (torch.Generator(device="meta") raises)."""

    class Saying(torch.Generator):
        @property
        def device(self):
            return torch.device(device)

    return Saying()


def test_check_generator_takes_a_generator_on_the_tensors_device_or_none():
    cpu = torch.Generator()
    assert c.check_generator("generator", cpu, torch.device("cpu")) is cpu
    assert c.check_generator("generator", cpu, "cpu:0") is cpu  # PyTorch has one CPU device
    assert c.check_generator("generator", None, "cpu") is None  # PyTorch's default generator
    gpu = _generator_saying("cuda:0")
    with pytest.raises(ValueError, match=r"^generator must be on cpu, the device of the tensors "
                                         r"it draws, got generator on cuda:0$"):
        c.check_generator("generator", gpu, torch.device("cpu"))
    with pytest.raises(ValueError, match="^generator must be on cuda:0, .* got generator on cpu$"):
        c.check_generator("generator", cpu, "cuda:0")  # compared without asking for a GPU


def test_check_generator_refuses_a_meta_generator_and_what_is_not_one_by_name():
    with pytest.raises(ValueError, match="^g must draw random numbers, got g on the meta device"):
        c.check_generator("g", _generator_saying("meta"), "meta")  # even for meta tensors
    for value in (3, "seed", torch.zeros(1)):
        with pytest.raises(TypeError, match="^g must be an instance of Generator or NoneType, got g="):
            c.check_generator("g", value, "cpu")


def test_check_generator_refuses_what_names_no_device_by_name_even_with_no_generator():
    for device in (None, 1.5, "bogus", "cpu:x"):
        for generator in (None, torch.Generator()):
            with pytest.raises(ValueError, match=f"^device must name a device .*, got device={re.escape(repr(device))}$"):
                c.check_generator("g", generator, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_check_generator_matches_cuda_generators_to_cuda_tensors_of_the_same_gpu():
    gpu = torch.Generator(device="cuda")
    assert c.check_generator("g", gpu, torch.device("cuda")) is gpu
    assert c.check_generator("g", gpu, torch.device("cuda", torch.cuda.current_device())) is gpu
    with pytest.raises(ValueError, match="^g must be on cpu"):
        c.check_generator("g", gpu, "cpu")
    with pytest.raises(ValueError, match="^g must be on cuda"):
        c.check_generator("g", torch.Generator(), "cuda")


def test_check_text_takes_any_string_utf_8_can_hold():
    assert c.check_text("title", "héllo, 世界 🙂") == "héllo, 世界 🙂"
    assert c.check_text("title", "") == ""
    with pytest.raises(ValueError, match=r"^title must be encodable as UTF-8, got title='a\\ud800'"):
        c.check_text("title", "a\ud800")  # a lone surrogate: no file or page can hold it
    with pytest.raises(TypeError, match="^title must be an instance of str, got title=b'x'"):
        c.check_text("title", b"x")


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("TRUE", True), (" On ", True), ("yes\n", True), ("Yes", True),
    ("0", False), ("false", False), ("Off", False), (" NO ", False), ("no", False)])
def test_env_flag_reads_the_true_and_false_words_in_any_case(monkeypatch, value, expected):
    monkeypatch.setenv("ATTNBOOK_TEST_FLAG", value)
    assert c.env_flag("ATTNBOOK_TEST_FLAG", not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_env_flag_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("ATTNBOOK_TEST_FLAG", raising=False)
    assert c.env_flag("ATTNBOOK_TEST_FLAG", default) is default
    for empty in ("", "  "):
        monkeypatch.setenv("ATTNBOOK_TEST_FLAG", empty)
        assert c.env_flag("ATTNBOOK_TEST_FLAG", default) is default


@pytest.mark.parametrize("value", ["2", "y", "n", "ture", "enabled", "1.0", "-1"])
def test_env_flag_refuses_any_other_value_naming_the_variable_and_its_value(monkeypatch, value):
    monkeypatch.setenv("ATTNBOOK_TEST_FLAG", value)
    with pytest.raises(ValueError, match="^ATTNBOOK_TEST_FLAG must be 1, true, on, yes or 0, false, "
                                         "off, no .*, got ATTNBOOK_TEST_FLAG=" + re.escape(repr(value))):
        c.env_flag("ATTNBOOK_TEST_FLAG", False)


@pytest.mark.parametrize("value", ["ye\u017f", "FAL\u017fE", "o\ufb00", "\u00a01\u3000", "\uff11"])
def test_env_flag_reads_ascii_words_only(monkeypatch, value):
    """str.upper maps the long s to S and the ligature ff to FF, and strip() drops Unicode spaces:
    none of these is one of the words."""
    monkeypatch.setenv("ATTNBOOK_TEST_FLAG", value)
    with pytest.raises(ValueError, match="^ATTNBOOK_TEST_FLAG must be 1, true, on, yes or 0, "):
        c.env_flag("ATTNBOOK_TEST_FLAG", False)


@pytest.mark.parametrize("name", [None, 3, b"X"])
def test_env_flag_name_is_a_string(name):
    with pytest.raises(TypeError, match="^name must be an instance of str"):
        c.env_flag(name, False)


def test_env_flag_default_is_a_bool(monkeypatch):
    monkeypatch.delenv("ATTNBOOK_TEST_FLAG", raising=False)
    with pytest.raises(TypeError, match="^default must be True or False"):
        c.env_flag("ATTNBOOK_TEST_FLAG", "yes")


def test_check_holds_weights_refuses_a_module_on_the_meta_device_by_its_name():
    c.check_holds_weights("encoder", torch.nn.Linear(2, 2))  # weights with values: no error
    c.check_holds_weights("encoder", torch.nn.ReLU())  # no parameters: nothing to hold
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"^encoder must hold its weights, got a Sequential whose "
                                         r"parameters \['0.weight', '0.bias'\] \(2 in all\) are on "
                                         r"the meta device \(meta tensors hold shapes, no values\)"):
        c.check_holds_weights("encoder", empty)
    partly = torch.nn.Sequential(torch.nn.Linear(2, 2), empty[0])  # one layer loaded, one not
    with pytest.raises(ValueError, match=r"parameters \['1.weight', '1.bias'\] \(2 in all\)"):
        c.check_holds_weights("encoder", partly)


@pytest.mark.parametrize("model", [None, torch.zeros(2), {"weight": torch.zeros(2)}])
def test_check_holds_weights_refuses_what_is_not_a_module_by_its_name(model):
    with pytest.raises(TypeError, match="^encoder must be an instance of Module, got "):
        c.check_holds_weights("encoder", model)


def test_check_holds_weights_refuses_a_name_that_is_not_a_string_by_type():
    # before: the module passed first was taken as the name, and the error printed its repr
    with pytest.raises(TypeError, match=r"^name must be an instance of str, got name=Linear\(in_"):
        c.check_holds_weights(torch.nn.Linear(2, 2), "model")


@pytest.mark.parametrize("mask, left, match", [
    (torch.tensor([[1, 2]]), False, "hold only 0 and 1"),
    (torch.tensor([[0, 0]]), False, r"have a real token \(a 1\) in every row"),
    (torch.tensor([[1, 0]]), True, "pad on the left only"),
    (torch.tensor([[1.0, 1.0]]), False, r"be a bool or integer tensor of shape \(1, 2\) on cpu, got "
                                        "torch.float32"),
    (torch.tensor([[1, 1, 1]]), False, r"of shape \(1, 2\) on cpu, got shape \(1, 3\)"),
])
def test_check_padding_mask_refuses_a_bad_mask_by_name(mask, left, match):
    with pytest.raises((TypeError, ValueError), match=f"^attention_mask must .*{match}"):
        c.check_padding_mask("attention_mask", mask, torch.zeros(1, 2, dtype=torch.long), left=left)


def test_check_padding_mask_gives_the_padding_or_none_where_there_is_none():
    ids = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert torch.equal(c.check_padding_mask("m", mask, ids, left=True), mask == 1)
    assert c.check_padding_mask("m", torch.ones(2, 3, dtype=torch.bool), ids) is None
    assert c.check_padding_mask("m", None, ids) is None
    held = torch.tensor([[False, True, True, True], [True, True, True, True]])  # a cache's
    after = c.check_padding_mask("m", None, ids[:, :1], cached=2, held=held)  # its padding kept
    assert torch.equal(after, torch.tensor([[False, True, True], [True, True, True]]))
    with pytest.raises(ValueError, match="^m must agree with kv_cache's mask"):
        c.check_padding_mask("m", torch.ones(2, 3, dtype=torch.long), ids[:, :1], 2, held)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(left=2), TypeError, "^left must be True or False"),  # before: 2 & True == 0, accepted
    (dict(left=np.bool_(True)), None, None),  # before: a raw NotImplementedError
    (dict(cached=-1), ValueError, "^cached must be at least 0"),
    (dict(held="x"), TypeError, "^held must be an instance of Tensor"),
    (dict(ids="x"), TypeError, "^ids must be an instance of Tensor"),
])
def test_check_padding_mask_checks_its_other_arguments_by_name(kwargs, error, match):
    # R-E55: public since chapter 10 uses it; its other arguments raised raw errors
    args = {"mask": torch.tensor([[1, 0]]), "ids": torch.zeros(1, 2, dtype=torch.long), **kwargs}
    if error is None:
        with pytest.raises(ValueError, match="pad on the left only"):  # left=np.True_ is True
            c.check_padding_mask("attention_mask", **args)
        return
    with pytest.raises(error, match=match):
        c.check_padding_mask("attention_mask", **args)


def _length_times(x):  # compiled below with dynamic=True: x.shape[0] is a symbol
    return x * c.check_int("x.shape[0]", x.shape[0], 2, 8)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=True)


def test_check_int_takes_a_size_that_torch_compile_traces():
    """A torch.SymInt passes as an int with no graph break (fullgraph=True), for any length."""
    compiled = _compiled(_length_times)
    for length in (3, 5, 8):
        assert torch.equal(compiled(torch.ones(length)), torch.full((length,), float(length)))


@pytest.mark.parametrize("length, match", [(9, "at most 8"), (1, "at least 2")])
def test_check_int_holds_a_traced_size_to_its_bounds_by_name(length, match):
    """Under fullgraph, dynamo cannot let the refusal out of the graph: its Unsupported error
    carries the ValueError's message (not a TorchRuntimeError from the fake tensors)."""
    compiled = _compiled(_length_times)
    compiled(torch.ones(5))  # a graph for any length first, then a length outside the bounds
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"ValueError\('x.shape\[0\] must be " + match):
        compiled(torch.ones(length))


def test_check_int_takes_a_numpy_int_under_fullgraph():
    """A NumPy int is an int eagerly, and under fullgraph too (reading a `dtype` attribute of
    anything, as check_int once did to tell a bool tensor, does not trace)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, k: x * c.check_int("k", k, 1, 8), fullgraph=True)
    assert torch.equal(compiled(torch.ones(2), np.int64(5)), torch.full((2,), 5.0))
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"k must be at most 8"):
        compiled(torch.ones(2), np.int64(9))


def test_check_int_under_a_plain_torch_compile_raises_the_value_error_by_name():
    """torch.compile(model) as a user writes it: the length turns symbolic at the second call, and
    a length outside the bounds at a later call is refused with the eager ValueError."""
    torch._dynamo.reset()
    compiled = torch.compile(_length_times, backend="aot_eager")
    for length in (3, 5, 7):
        assert torch.equal(compiled(torch.ones(length)), torch.full((length,), float(length)))
    with pytest.raises(ValueError, match=r"^x.shape\[0\] must be at most 8, got x.shape\[0\]=9$"):
        compiled(torch.ones(9))
    with pytest.raises(ValueError, match=r"^x.shape\[0\] must be at least 2, got x.shape\[0\]=1$"):
        compiled(torch.ones(1))


def test_check_int_traces_a_bound_that_the_compiler_made_dynamic():
    """An int argument under dynamic=True is a symbol too: no bound is formatted before the test."""
    compiled = _compiled(lambda x, k: x * c.check_int("n", x.shape[0], 1, k))
    for length, k in ((4, 5), (6, 7), (8, 8)):
        assert torch.equal(compiled(torch.ones(length), k), torch.full((length,), float(length)))
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"ValueError\('n must be at most 7'\)"):
        compiled(torch.ones(9), 7)


def test_check_int_takes_only_torch_symint_as_a_symbol():
    """A class that is merely named SymInt is no int: the TypeError of the policy."""
    class SymInt:
        def __repr__(self):
            return "SymInt(3)"

    with pytest.raises(TypeError, match=r"^n must be an int, got n=SymInt\(3\) of type SymInt$"):
        c.check_int("n", SymInt())
    with pytest.raises(TypeError, match=r"^n must be an int, got n=SymInt\(3\) of type SymInt$"):
        c.check_int("n", SymInt(), 1, 8)


def test_check_int_keeps_a_symbolic_size_symbolic_outside_torch_compile():
    """make_fx and torch.export (strict or not) trace a torch.SymInt as such: operator.index would
    fix it to the example's value, a graph right for length 5 only (export: 'Constraints
    violated')."""
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(_length_times, tracing_mode="symbolic")(torch.ones(5))
    assert torch.equal(traced(torch.ones(7)), torch.full((7,), 7.0))

    class LengthTimes(torch.nn.Module):
        def forward(self, x):
            return _length_times(x)

    lengths = {"x": {0: torch.export.Dim("n", min=2, max=8)}}
    for strict in (False, True):  # strict: a torch._check with a message lambda fails to export
        exported = torch.export.export(LengthTimes(), (torch.ones(5),), strict=strict,
                                       dynamic_shapes=lengths)
        assert torch.equal(exported.module()(torch.ones(7)), torch.full((7,), 7.0))


def test_check_int_puts_the_bounds_of_a_size_known_only_at_run_time_into_the_graph():
    """A size computed from a tensor's values (an unbacked symbol, u0) passes the traced test;
    torch._check puts its bounds into the graph, which refuses it naming the bound, not the
    argument (appendix H, "Checks that a compiled model keeps")."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(lambda x: x * c.check_int("n", (x > 0).sum().item(), 0, 8),
                                 fullgraph=True, backend="eager")
        assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 4.0))
        with pytest.raises(RuntimeError, match=r"u\d+ <= 8"):
            compiled(torch.ones(9))


def test_an_exported_program_does_not_check_a_lower_bound_of_2():
    """PyTorch's gap that appendix H names: torch.export assumes every dynamic size is at least
    2, so lengths 1 and 0 pass the exported program where the eager call refuses them. If this
    test fails, PyTorch has closed the gap and the appendix's sentence must go."""
    class LengthTimes(torch.nn.Module):
        def forward(self, x):
            return _length_times(x)  # check_int(..., 2, 8)

    exported = torch.export.export(LengthTimes(), (torch.ones(5),),
                                   dynamic_shapes={"x": {0: torch.export.Dim("n", max=8)}})
    for length in (1, 0):
        with pytest.raises(ValueError, match="must be at least 2"):
            _length_times(torch.ones(length))
        assert torch.equal(exported.module()(torch.ones(length)), torch.full((length,), float(length)))


def test_check_int_refuses_in_eager_code_as_before():
    """Outside torch.compile (torch imported), the refusals keep their type and their message."""
    with pytest.raises(ValueError, match=r"^n must be at least 1, got n=np.int64\(0\)$"):
        c.check_int("n", np.int64(0), 1)
    with pytest.raises(ValueError, match=r"^n must be at most 4, got n=6$"):
        c.check_int("n", torch.ones(6).shape[0], maximum=4)
    with pytest.raises(TypeError, match="n must be an int, got n=tensor"):
        c.check_int("n", torch.tensor(True))


def test_check_fields_sets_each_named_field_to_its_checked_value_in_order():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Config:
        width: object = 4
        rate: object = 0.5
        extra: object = None

    table = {"width": (c.check_int, 1), "rate": (c.check_probability,), "extra": (c.check_int, 0)}
    config = Config(np.int64(8), 1)
    c.check_fields(config, table, optional=("extra",))
    assert (config.width, config.rate, config.extra) == (8, 1.0, None)
    assert type(config.width) is int and type(config.rate) is float  # plain Python values
    with pytest.raises(TypeError, match="^extra must be an int, got extra=None"):
        c.check_fields(Config(), table)  # None only where optional allows it
    with pytest.raises(ValueError, match="^width must be at least 1, got width=0"):
        c.check_fields(Config(0, 2.0), table)  # the first field of the table first


def test_check_tokens_under_autocast_refuses_only_float64_which_autocast_leaves():
    weight = torch.nn.Linear(16, 16).weight  # float32: autocast casts what the projections get
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for good in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                     torch.float8_e5m2):  # autocast casts each; nn.Linear then takes it
            assert c.check_tokens("x", torch.zeros(2, 3, 16, dtype=good), weight).dtype == good
            torch.nn.functional.linear(torch.zeros(2, 3, 16, dtype=good), weight)
        with pytest.raises(TypeError, match=r"^x must be of a dtype torch.autocast casts "
                                            r"\(not float64.*got dtype torch.float64$"):
            c.check_tokens("x", torch.zeros(2, 3, 16, dtype=torch.float64), weight)
