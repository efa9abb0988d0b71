# Do not edit: tools/tangle.py generates this file from chapters/15-flash-attention-triton.md.
"""How Triton runs the book's kernels: compiled for a GPU, or in its interpreter on the CPU, chosen
once, explicitly, before anything imports triton.

Built and explained in the book's chapter chapters/15-flash-attention-triton.md.
"""

__all__ = [
    "use_triton_interpreter",
]

# chapters/15-flash-attention-triton.md, "Choosing the interpreter"
import os
import sys

# What Triton (3.7's getenv_bool) reads as true in TRITON_INTERPRET, in any case; any other
# value, the empty string and " 1" included, means compiled kernels.
_TRUE = ("1", "true", "on", "yes", "y")


def use_triton_interpreter() -> bool:
    """Ask for Triton's CPU interpreter (TRITON_INTERPRET=1) on a machine without a GPU, unless
    TRITON_INTERPRET is set already; return whether Triton will interpret. Call it before
    anything imports triton, which fixes the choice (chapter 15, "Choosing the
    interpreter"); if triton was imported in compiled mode without a GPU, RuntimeError says so."""
    import torch  # torch itself does not import triton

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        if "triton" in sys.modules:  # too late: its library is decorated already
            raise RuntimeError("triton was imported in compiled mode, but without a GPU the "
                               "kernels need its interpreter: call use_triton_interpreter() "
                               "before anything imports triton, or set TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE
