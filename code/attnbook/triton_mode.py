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
    interpreter"); if triton was imported in compiled mode and the interpreter is asked for,
    by this call or by TRITON_INTERPRET set since, RuntimeError says so."""
    import torch  # torch itself does not import triton

    asked = os.environ.get("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    interpreting = asked.lower() in _TRUE
    triton = sys.modules.get("triton")  # its library is decorated when it is first imported
    if interpreting and triton and type(triton.language.standard.sum).__name__ != \
            "InterpretedFunction":
        raise RuntimeError("triton was imported in compiled mode, but the kernels are asked to "
                           "run in its interpreter: call use_triton_interpreter() (or set "
                           "TRITON_INTERPRET=1) before anything imports triton")
    if interpreting:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return interpreting
