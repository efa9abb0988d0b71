# Do not edit: tools/tangle.py generates this file from chapters/a1-conventions.md.
"""The argument checks that need only Python and NumPy, which the NumPy chapters import without
loading PyTorch; attnbook.conventions gathers them with the tensor checks.

Built and explained in the book's chapter chapters/a1-conventions.md.
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
    "check_alias",
    "check_instance",
    "check_callable",
    "check_array",
    "compute_dtype",
]

# chapters/a1-conventions.md, "One way to check an argument"
import math
import numbers
import operator
from collections.abc import Collection

import numpy as np


def type_error(name: str, value, wanted: str) -> TypeError:
    """The TypeError of the package's policy: `name` must be `wanted`, and what it got."""
    return TypeError(f"{name} must be {wanted}, got {name}={value!r} of type {type(value).__name__}")


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as a Python int from `minimum` to `maximum`: not a bool, a float or a string.
    Whatever Python can use as an index counts, such as np.int64(3) or a 0-d integer tensor."""
    try:  # a bool tensor's dtype is named, so that this module needs no torch
        if isinstance(value, (bool, np.bool_)) or str(getattr(value, "dtype", "")) == "torch.bool":
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise type_error(name, value, "an int") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {name}={value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {name}={value!r}")
    return number


def check_bool(name: str, value) -> bool:
    """`value` as a bool: True or False, not 1, "yes" or None."""
    if not isinstance(value, (bool, np.bool_)):
        raise type_error(name, value, "True or False")
    return bool(value)


def check_real(name: str, value, low: float = -math.inf, high: float = math.inf, *,
               open_low: bool = False, open_high: bool = False) -> float:
    """`value` as a finite float in the interval from `low` to `high` (closed unless open_*)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise type_error(name, value, "a real number")
    value = float(value)
    above = value > low if open_low else value >= low
    below = value < high if open_high else value <= high
    if not (math.isfinite(value) and above and below):
        interval = f" in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        interval = "" if (low, high) == (-math.inf, math.inf) else interval
        raise ValueError(f"{name} must be a finite number{interval}, got {name}={value!r}")
    return value


def check_probability(name: str, value) -> float:
    """A probability, such as a dropout rate: a number in [0, 1]."""
    return check_real(name, value, 0.0, 1.0)


def check_positive(name: str, value) -> float:
    """A finite number above 0, such as an epsilon, a base or a temperature."""
    return check_real(name, value, 0.0, open_low=True)


def check_scale(scale, head_dim: int) -> float:
    """The factor applied to q·k: 1/sqrt(head_dim) for None, else any finite number."""
    return head_dim ** -0.5 if scale is None else check_real("scale", scale)


def check_choice(name: str, value, choices: Collection[str]) -> str:
    """One of `choices`, given as a string."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {name}={value!r}")
    return value


def check_alias(name: str, value, alias_name: str, alias, default) -> tuple[str, object]:
    """(the name it was given under, the value) of a setting given as `name` or as its deprecated
    alias: `default` if neither is given, an error if both are given and differ. The name is for
    the next check's message: ``check_int(*check_alias(...), minimum=1)``."""
    if value is None:
        return (name, default) if alias is None else (alias_name, alias)
    if alias is not None and alias != value:
        raise ValueError(f"{name}={value!r} and its deprecated alias {alias_name}={alias!r} differ")
    return name, value


def check_instance(name: str, value, kind: type):
    """`value`, an instance of `kind` (a class, or a tuple of classes)."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise type_error(name, value, f"an instance of {names}")
    return value


def check_callable(name: str, value):
    """`value`, something that can be called: a function, a lambda, a module."""
    if not callable(value):
        raise type_error(name, value, "callable")
    return value


# chapters/a1-conventions.md, "One way to check an argument"
def check_array(name: str, x, min_ndim: int = 0) -> np.ndarray:
    """`x` as a NumPy array of real numbers with at least `min_ndim` axes; integers become float64."""
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.float64)
    elif not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must hold real numbers, got {name} of dtype {x.dtype}")
    if x.ndim < min_ndim:
        axes = "dimension" if min_ndim == 1 else "dimensions"
        raise ValueError(f"{name} must have at least {min_ndim} {axes}, got shape {x.shape}")
    return x


def compute_dtype(dtype):
    """The dtype a sum over `dtype` data is accumulated in: float32 for float16 and bfloat16.

    Works for torch and NumPy dtypes alike; other dtypes compute in themselves.
    """
    if type(dtype).__module__ == "torch":  # a torch.dtype: torch is loaded, since it made it
        import torch

        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return np.promote_types(np.dtype(dtype), np.float32) if np.dtype(dtype) == np.float16 \
        else np.dtype(dtype)
