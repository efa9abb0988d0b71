"""`mypy --strict` (set up by [tool.mypy] in pyproject.toml) finds nothing in the modules listed
here (issue 39, "A package that behaves like one"): the package's type check passes module by
module, and a module that passes stays so. Skipped where mypy is not installed (CI's `typecheck`
job installs it)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLEAN = ("__init__", "attention", "bert", "checks", "compile_check", "corpus", "cost",
         "efficient", "encdec", "exercises", "masks", "notebook", "positions", "recipe", "scaling",
         "tiling",
         "train", "train_command", "vit", "viz")


def test_mypy_strict_finds_no_error_in_the_clean_modules():
    pytest.importorskip("mypy")
    files = [f"code/attnbook/{name}.py" for name in CLEAN]
    result = subprocess.run([sys.executable, "-m", "mypy", *files], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr  # 2: mypy could not run
    # mypy also reports the modules these import; only the listed ones must be clean
    errors = [line for line in result.stdout.splitlines()
              if line.startswith(tuple(files)) and ": error:" in line]
    assert errors == [], "\n".join(errors)
