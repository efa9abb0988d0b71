# Do not edit: tools/tangle.py generates this file from chapters/a8-argument-checks.md.
"""The package's argument checks: one error policy, one check per concept. It imports PyTorch only
when a tensor is checked, so the NumPy modules use it without loading PyTorch.

Built and explained in the book's chapter chapters/a8-argument-checks.md.
"""

__all__ = [
    "type_error",
    "check_int",
    "check_bool",
    "check_real",
    "check_probability",
    "check_positive",
    "check_scale",
    "check_choice",
    "check_divisible",
    "check_instance",
    "check_text",
    "env_flag",
    "check_callable",
    "check_fields",
    "as_rectangular",
    "check_array",
    "check_device",
    "check_generator",
    "check_float_dtype",
    "check_holds_weights",
    "check_token_ids",
    "check_tensor",
    "check_mask",
    "check_padding_mask",
    "check_writable",
    "check_tokens",
    "autocast_dtype",
]

# chapters/a8-argument-checks.md, "The checks, one per concept"
import math
import numbers
import operator
import os
import sys
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

if TYPE_CHECKING:  # for the annotations only: the tensor checks import torch when they run
    import torch

_T = TypeVar("_T")  # what a check returns: the class it was asked for, or the value's own
_Shape = tuple[int | None, ...] | None  # a tensor's sizes, None where any size will do


def _shown(value: object) -> str:
    """`value` as a message repeats it: its repr, cut to 60 characters (10**400 has 401 digits)."""
    try:
        text = repr(value)
    except ValueError:  # Python refuses to write an int of more than 4,300 digits
        return f"<{type(value).__name__} too long to show>"
    return text if len(text) <= 60 else text[:57] + "..."  # not a tensor


def type_error(name: str, value: object, wanted: str) -> TypeError:
    """The TypeError of the package's policy: `name` must be `wanted`, and what it got."""
    shown, kind = _shown(value), type(value).__name__
    return TypeError(f"{name} must be {wanted}, got {name}={shown} of type {kind}")


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as a Python int from `minimum` to `maximum`: not a bool, a float or a string.
    Whatever Python can use as an index counts, such as np.int64(3) or a 0-d integer tensor, and
    a size that a compiler traces as a symbol (a torch.SymInt), which is kept a symbol."""
    torch, number = sys.modules.get("torch"), cast(int, value)  # torch: loaded wherever one traces
    # a torch.SymInt stays as it is: operator.index would fix a symbol to the traced size's value
    if type(value) is not int and not (torch and isinstance(value, torch.SymInt)):
        try:  # a tensor exists only where torch is loaded; dynamo traces isinstance, not getattr
            if isinstance(value, (bool, np.bool_)) or (
                    torch and isinstance(value, torch.Tensor) and value.dtype == torch.bool):
                raise TypeError
            number = operator.index(value)  # type: ignore[arg-type]  # the check itself
        except TypeError:
            raise type_error(name, value, "an int") from None
    if torch is not None and torch.compiler.is_compiling():  # the size may be a symbol
        return _check_traced_int(name, number, minimum, maximum)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {name}={value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {name}={value!r}")
    return number


def _check_traced_int(name: str, number: int, minimum: int | None, maximum: int | None) -> int:
    """check_int's bounds while torch.compile traces, where `number` and the bounds may be symbols.

    guard_or_true answers a comparison for the size being traced and keeps the answer as a guard
    (a later size on the other side of the bound makes the compiler trace again, and that trace
    raises), and answers True for a size that only the running graph knows: torch._check puts the
    bounds into the graph for it, without a message, which strict torch.export would refuse. The
    messages give a traced bound its value with int(). The compiler has loaded both modules."""
    torch, shapes = sys.modules["torch"], sys.modules["torch.fx.experimental.symbolic_shapes"]
    if minimum is not None and not shapes.guard_or_true(number >= minimum):
        raise ValueError(f"{name} must be at least {int(minimum)}")
    if maximum is not None and not shapes.guard_or_true(number <= maximum):
        raise ValueError(f"{name} must be at most {int(maximum)}")
    torch._check(minimum is None or number >= minimum)
    torch._check(maximum is None or number <= maximum)
    return number


def check_bool(name: str, value: object) -> bool:
    """`value` as a bool: True or False, not 1, "yes" or None."""
    if not isinstance(value, (bool, np.bool_)):
        raise type_error(name, value, "True or False")
    return bool(value)


def check_real(name: str, value: object, low: float = -math.inf, high: float = math.inf, *,
               open_low: bool = False, open_high: bool = False) -> float:
    """`value` as a finite float in the interval from `low` to `high` (closed unless open_*)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise type_error(name, value, "a real number")
    interval = f" in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    interval = "" if (low, high) == (-math.inf, math.inf) else interval
    try:  # an int or a Fraction beyond a float's range, such as 10**400, raises OverflowError
        number = float(value)  # and a finite np.longdouble beyond it becomes inf
        if math.isinf(number) and isinstance(value, np.floating) and np.isfinite(value):
            raise OverflowError
    except OverflowError:
        raise ValueError(f"{name} must be a finite number{interval}, got {name}={_shown(value)}, "
                         "beyond a float's range") from None
    above = number > low if open_low else number >= low
    below = number < high if open_high else number <= high
    if not (math.isfinite(number) and above and below):
        raise ValueError(f"{name} must be a finite number{interval}, got {name}={number!r}")
    return number


def check_probability(name: str, value: object) -> float:
    """A probability, such as a dropout rate: a number in [0, 1]."""
    return check_real(name, value, 0.0, 1.0)


def check_positive(name: str, value: object) -> float:
    """A finite number above 0, such as an epsilon, a base or a temperature."""
    return check_real(name, value, 0.0, open_low=True)


def check_scale(scale: object, head_dim: int) -> float:
    """The factor applied to q·k: 1/sqrt(head_dim) for None, else any finite number."""
    return head_dim ** -0.5 if scale is None else check_real("scale", scale)


def check_choice(name: str, value: object, choices: Collection[str]) -> str:
    """One of `choices`, given as a string: another type is a TypeError, as the policy says."""
    if not isinstance(value, str):
        raise type_error(name, value, f"one of {sorted(choices)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {name}={value!r}")
    return value


def check_divisible(name: str, value: int, by_name: str, by: int) -> int:
    """`value`, which `by` divides: a width split into heads, query heads into key/value groups.
    Both are ints (not bools, floats or strings), `by` at least 1: value % 0 would name neither."""
    value, by = check_int(name, value), check_int(by_name, by, 1)
    if value % by:
        raise ValueError(f"{name}={value} is not divisible by {by_name}={by}")
    return value


def check_instance(name: str, value: object, kind: type[_T] | tuple[type[_T], ...]) -> _T:
    """`value`, an instance of `kind` (a class, or a tuple of classes)."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise type_error(name, value, f"an instance of {names}")
    return value


def check_text(name: str, value: object) -> str:
    """`value`, a string that UTF-8 can encode: not one with a lone surrogate, such as "\\ud800".
    Control characters, "\\x00" included, pass: a caller that writes a page must escape them."""
    text = check_instance(name, value, str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be encodable as UTF-8, got {name}={value!r}") from None
    return text


def env_flag(name: str, default: bool) -> bool:
    """The environment variable `name` read as a switch: 1, true, on or yes is True, 0, false, off
    or no is False (ASCII, any case, spaces around ignored), unset or empty is `default`."""
    default, value = check_bool("default", default), os.environ.get(check_text("name", name), "")
    word = value.strip().upper() if value.isascii() else value  # "ſ".upper() is "S"
    if word in ("", "1", "TRUE", "ON", "YES", "0", "FALSE", "OFF", "NO"):
        return word in ("1", "TRUE", "ON", "YES") if word else default
    raise ValueError(f"{name} must be 1, true, on, yes or 0, false, off, no (in any case), "
                     f"got {name}={value!r}")


def check_callable(name: str, value: _T) -> _T:
    """`value`, something that can be called: a function, a lambda, a module."""
    if not callable(value):
        raise type_error(name, value, "callable")
    return value


def check_fields(config: object, checks: Mapping[str, tuple[Any, ...]],
                 optional: Collection[str] = ()) -> None:
    """Set each field of the frozen dataclass `config` that `checks` names, in its order, to its
    checked value: `check(name, value, *arguments)` for `checks[name] = (check, *arguments)`. A
    field named in `optional` may be None, which is kept (a default that other fields give)."""
    for name, (check, *arguments) in checks.items():
        if getattr(config, name) is not None or name not in optional:
            object.__setattr__(config, name, check(name, getattr(config, name), *arguments))


# chapters/a8-argument-checks.md, "The checks, one per concept"
def as_rectangular(name: str, x: object) -> np.ndarray:
    """`x` as a NumPy array, an object array re-read by its elements (which decide its dtype); a
    ValueError naming `name` for nested sequences of different lengths."""
    try:
        array = np.asarray(x)
        return np.asarray(array.tolist()) if array.dtype == object else array
    except ValueError as error:
        if "inhomogeneous" not in str(error):  # NumPy's word for a ragged nesting
            raise
        raise ValueError(f"{name} must be rectangular, and NumPy says: {error}") from None


def check_array(name: str, x: object, min_ndim: int = 0) -> np.ndarray:
    """`x` as a NumPy array of real numbers with at least `min_ndim` axes; integers become float64."""
    try:  # a bfloat16 tensor, one that requires grad or one on a GPU has no NumPy array
        x = as_rectangular(name, x)
    except (TypeError, RuntimeError) as error:
        raise TypeError(f"{name} must be a NumPy array or a CPU tensor (float16, float32 or "
                        f"float64, without grad), got {name} of type {type(x).__name__}: {error}") from None
    if np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.float64)
    elif not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must hold real numbers, got {name} of dtype {x.dtype}")
    if x.ndim < min_ndim:
        axes = "dimension" if min_ndim == 1 else "dimensions"
        raise ValueError(f"{name} must have at least {min_ndim} {axes}, got shape {x.shape}")
    return x


# chapters/a8-argument-checks.md, "The checks, one per concept"
def check_device(name: str, device: object) -> "torch.device":
    """`device` (a string or torch.device) as a torch.device that this machine has."""
    import torch  # here, not at the top: the NumPy chapters import this module without torch

    found = _device_named(name, device)
    if found.type in ("cpu", "meta"):  # always there; asking would also break torch.compile
        return found
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={device!r}, but this machine has no CUDA GPU")
    # torch.cuda, torch.xpu, ...; MPS says whether it is there in torch.backends
    backend = torch.backends.mps if found.type == "mps" else getattr(torch, found.type, None)
    if not getattr(backend, "is_available", lambda: True)():
        raise ValueError(f"{name}={device!r}, but this machine has no {found.type} device")
    count = getattr(backend, "device_count", None) if found.type != "mps" else None
    if found.index is not None and count is not None and found.index >= count():
        raise ValueError(f"{name}={device!r}, but this machine has {count()} {found.type} "
                         f"device(s), numbered from 0")
    return found


def _device_named(name: str, device: object) -> "torch.device":
    """`device` read as a torch.device, without asking whether this machine has it."""
    import torch

    try:
        return torch.device(device)  # type: ignore[call-overload, no-any-return]  # the check
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must name a device such as 'cpu' or 'cuda', "
                         f"got {name}={device!r}") from None


def _same_device(actual: "torch.device", wanted: "torch.device | str") -> bool:
    """Whether a tensor on `actual` is on `wanted`: "cuda" is the current GPU, and "cpu:0" is
    "cpu" (PyTorch has one CPU device; a CPU tensor's device has no index)."""
    import torch

    wanted = torch.device(wanted)
    if actual.type != wanted.type:
        return False
    if actual.type == "cuda" and None in (actual.index, wanted.index):
        current = torch.cuda.current_device()
        actual, wanted = (torch.device("cuda", current if d.index is None else d.index)
                          for d in (actual, wanted))
    return actual.index is None or wanted.index is None or actual.index == wanted.index


def check_generator(name: str, generator: object, device: object) -> "torch.Generator | None":
    """`generator`, a torch.Generator on the device of the tensors it draws: a CPU one for CPU
    tensors, a CUDA one of the same GPU for CUDA tensors. None is PyTorch's default generator."""
    import torch

    device = _device_named("device", device)  # named, but not asked for: tensors are there
    if (generator := check_instance(name, generator, (torch.Generator, type(None)))) is None:
        return None
    if generator.device.type == "meta":  # torch makes none; a stand-in saying so draws nothing
        raise ValueError(f"{name} must draw random numbers, got {name} on the meta device")
    if not _same_device(generator.device, device):
        raise ValueError(f"{name} must be on {device}, the device of the tensors it draws, "
                         f"got {name} on {generator.device}")
    return generator


def check_float_dtype(name: str, dtype: object) -> "torch.dtype":
    """`dtype`, a floating-point torch.dtype, such as torch.float32."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise type_error(name, dtype, "a floating-point torch.dtype")
    return dtype


def check_holds_weights(name: str, model: "torch.nn.Module") -> None:
    """`model` (transformers' too) with its weights: no parameter on the meta device, where a
    model built before its weights are loaded keeps their shapes but no values."""
    import torch  # here, not at the top: the NumPy chapters import this module without torch

    named = check_instance(check_text("name", name), model, torch.nn.Module).named_parameters()
    if meta := [n for n, p in named if p.is_meta]:
        raise ValueError(f"{name} must hold its weights, got a {type(model).__name__} whose "
                         f"parameters {meta[:3]} ({len(meta)} in all) are on the meta device (meta "
                         "tensors hold shapes, no values): load its weights first")


def check_token_ids(name: str, ids: object, vocab_size: int, shape: _Shape = None,
                    device: "torch.device | None" = None, size_name: str = "vocab_size"
                    ) -> "torch.Tensor":
    """`ids`, an integer tensor (unsigned dtypes included) with every id in [0, vocab_size), of
    `shape` (None entries allow any size) on `device`, as int64; `size_name` names the bound.

    int64, so that a label such as -100 can be stored next to them: in uint8 it would wrap to 156.
    """
    import torch

    if type(vocab_size) is not int or not 1 <= vocab_size <= _INT64_MAX:  # a model's own: no call
        vocab_size = check_int("vocab_size", vocab_size, 1, _INT64_MAX)  # ids are int64
    given = (type(ids), getattr(ids, "dtype", None), getattr(ids, "layout", None),
             getattr(ids, "is_meta", None), shape, device)  # one comparison for the usual case,
    plain = given == (torch.Tensor, torch.int64, torch.strided, False, None, None)  # dense int64
    ids = cast("torch.Tensor", ids) if plain else _as_int64(name, ids, vocab_size, shape, device,
                                                            size_name)
    if torch.compiler.is_compiling():  # a read would cut the graph: the graph checks, and
        in_range = ((ids >= 0) & (ids < vocab_size)).all()  # raises RuntimeError when it runs
        torch._assert_async(in_range, f"{name} must lie in [0, {size_name}={vocab_size})")
        return ids
    if bool(((ids < 0) | (ids >= vocab_size)).any()):  # one read of the device
        raise ValueError(f"{name} must lie in [0, {size_name}={vocab_size}), got values from "
                         f"{int(ids.min())} to {int(ids.max())}")
    return ids


_INT64_MAX = 2**63 - 1  # the largest id an int64 tensor holds, so the largest vocab_size checked


def _as_int64(name: str, ids: object, vocab_size: int, shape: _Shape,
              device: "torch.device | None", size_name: str) -> "torch.Tensor":
    """Integer ids of any dtype, of `shape` on `device`, as int64; what is not a tensor, a sparse
    tensor, a float, bool or complex dtype, and a tensor with no values (on the meta device) are
    refused."""
    import torch

    if not isinstance(ids, torch.Tensor):
        raise type_error(name, ids, "a torch.Tensor of integer ids")
    if ids.layout != torch.strided:  # sparse ids have no comparison to check their range with
        raise TypeError(f"{name} must be a dense tensor, got layout {ids.layout}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must hold integer ids, got dtype {ids.dtype}")
    _check_shape_and_device(name, ids, shape, device)
    if ids.is_meta:  # a meta tensor has a shape but no values to check
        raise ValueError(f"{name} must hold values, got a tensor on the meta device")
    if ids.dtype == torch.uint64:  # PyTorch has no min or max for uint16, uint32 and uint64;
        wide = ids.view(torch.int64)  # an id of 2**63 or more reads as negative: out of range
        if ids.numel() and int(wide.min()) < 0:
            raise ValueError(f"{name} must lie in [0, {size_name}={vocab_size}), got an id of "
                             "2**63 or more (dtype torch.uint64)")
        return wide
    return ids.long()  # every other integer dtype fits in int64


def _check_shape_and_device(name: str, x: "torch.Tensor", shape: _Shape,
                            device: "torch.device | None") -> None:
    fits = shape is None or x.dim() == len(shape)
    for wanted_size, size in zip(shape or (), x.shape):  # a loop: no generator to resume
        fits = fits and wanted_size in (None, size)
    if not fits:
        wanted = ", ".join("*" if s is None else str(s) for s in shape or ())
        raise ValueError(f"{name} must have shape ({wanted}), got shape {tuple(x.shape)}")
    if device is not None and x.device != device and not _same_device(x.device, device):
        raise ValueError(f"{name} must be on device {device}, got {name} on {x.device}")


def check_tensor(name: str, x: object, ndim: int | tuple[int, ...] | None = None,
                 size: int | None = None, dtype: "torch.dtype | None" = None,
                 device: "torch.device | None" = None, shape: _Shape = None) -> "torch.Tensor":
    """`x`, a floating-point torch.Tensor with `ndim` dimensions (one count or a tuple of them),
    a last dimension of `size`, the given `dtype`, `device` and `shape` (a _Shape); None: any."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise type_error(name, x, "a torch.Tensor")
    if not x.is_floating_point() or dtype not in (None, x.dtype):
        raise TypeError(f"{name} must be a {dtype or 'floating-point'} tensor, got dtype {x.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if ndims is not None and x.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, "
                         f"got shape {tuple(x.shape)}")
    if size is not None and (x.dim() == 0 or x.shape[-1] != size):
        raise ValueError(f"{name} must end in a dimension of size {size}, "
                         f"got shape {tuple(x.shape)}")
    _check_shape_and_device(name, x, shape, device)
    return x


def check_mask(name: str, mask: object, shape: tuple[int, ...],
               device: "torch.device | None" = None) -> "torch.Tensor":
    """`mask`, a bool tensor (True = may attend) that broadcasts to `shape`, on `device`."""
    import torch

    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a torch.bool tensor, True = may attend (a float mask, "
                        f"which PyTorch adds to the scores, is not accepted), got {got}")
    fits = mask.dim() <= len(shape)
    for size, wanted in zip(mask.shape[::-1], shape[::-1]):  # aligned from the right
        fits = fits and size in (1, wanted)
    if not fits:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to "
                         f"{tuple(shape)}")
    _check_shape_and_device(name, mask, None, device)
    return mask


def check_padding_mask(name: str, mask: object, ids: "torch.Tensor", cached: int = 0,
                       held: "torch.Tensor | None" = None, left: bool = False) -> "torch.Tensor | None":
    """`mask` (B, cached + T) of the token ids (B, T) that follow `cached` positions, bool or 0/1
    (1 at a real token, 0 at padding), as bool: a real token in every row, with `left` padding
    only before one, and over the cached positions the padding that `held` (B, >= cached), a KV
    cache's mask, holds there (none if None); a mask of None: real tokens after them. One read
    of the device, none when compiled. None (not compiled) where there is no padding to apply."""
    import torch

    check_instance("ids", ids, torch.Tensor)
    left = check_bool("left", left)
    cached = check_int("cached", cached, 0)  # traced, the cache's own symbolic length
    held = None if held is None else check_instance("held", held, torch.Tensor)[:, :cached]
    if mask is None and held is not None:  # the cached padding, then real tokens
        mask = torch.cat([held, torch.ones_like(ids, dtype=held.dtype)], dim=1)
    if mask is None:
        return None
    shape = (len(ids), cached + ids.shape[1])
    wanted = f"{name} must be a bool or integer tensor of shape {shape} on {ids.device}"
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{wanted}, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if tuple(mask.shape) != shape or mask.device != ids.device:
        raise ValueError(f"{wanted}, got shape {tuple(mask.shape)} on {mask.device}")
    real = mask != 0
    faults = {"hold only 0 and 1": (real & (mask != 1)).any(),  # (B, L) -> ()
              "have a real token (a 1) in every row": ~real.any(dim=-1).all(),
              "pad on the left only: no 0 after a 1": left & (real[:, :-1] > real[:, 1:]).any(),
              "agree with kv_cache's mask over the positions it holds":
                  (real[:, :cached] != (True if held is None else held)).any()}
    if torch.compiler.is_compiling():  # a RuntimeError when the graph runs
        for fact, fault in faults.items():
            torch._assert_async(~fault, f"{name} must {fact}")
        return real
    *bad, every = torch.stack([*faults.values(), real.all()]).tolist()  # one read of the device
    if any(bad):
        raise ValueError(f"{name} must {next(f for f, b in zip(faults, bad) if b)}")
    return None if every and held is None else real  # no padding: the path without a mask


def check_writable(name: str, x: "torch.Tensor") -> "torch.Tensor":
    """`x`, a tensor that an in-place write can fill: no two of its elements share memory, as
    they do along a dimension of stride 0 (an expanded tensor)."""
    for stride, size in zip(x.stride(), x.shape):  # a loop, not any(): no generator to run
        if stride == 0 and size > 1:
            raise ValueError(f"{name} has stride 0 (an expanded tensor, strides {x.stride()}): "
                             "allocate it with torch.zeros, or clone() it")
    return x


# chapters/a8-argument-checks.md, "A layer's input under autocast"
def check_tokens(name: str, t: object, weight: "torch.Tensor",
                  batch: int | None = None) -> "torch.Tensor":
    """`t`, (batch, length, d_model), on the device of `weight`, in its dtype, or under autocast
    any dtype autocast casts (not float64, which it leaves: nn.Linear would then fail)."""
    import torch  # here, not at the top: the NumPy chapters import this module without torch

    casts = autocast_dtype(weight) is not None
    t = check_tensor(name, t, dtype=None if casts else weight.dtype, device=weight.device,
                     shape=(batch, None, weight.shape[1]))  # (B, L, d_model)
    if casts and t.dtype == torch.float64:
        raise TypeError(f"{name} must be of a dtype torch.autocast casts (not float64, which it "
                        f"leaves uncast), got dtype {t.dtype}")
    return t


def autocast_dtype(weight: "torch.Tensor") -> "torch.dtype | None":
    """The dtype nn.Linear with `weight` casts its input to: autocast's, when autocast is on for
    its device and the weight is not float64 (which autocast leaves); else None."""
    import torch  # here, not at the top: the NumPy chapters import this module without torch

    try:
        if torch.is_autocast_enabled(weight.device.type) and weight.dtype != torch.float64:
            return torch.get_autocast_dtype(weight.device.type)
    except RuntimeError:  # a device with no autocast at all, such as meta
        pass
    return None
