"""`mypy --strict` (set up by [tool.mypy] in pyproject.toml) finds nothing in the package, so that
type checkers can trust its annotations: every module of code/attnbook, found by a glob, so a new
module is checked without being listed. The exceptions live in pyproject.toml, each with its
reason: a module whose errors are still being fixed (`ignore_errors`; a test below fails once it passes
without), and the @triton.jit functions of attnbook.kernels, whose parameters stay unannotated
(the tests below check what mypy then cannot). The mypy tests skip where mypy is not installed
(CI's `typecheck` job installs it and runs `mypy`)."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "code" / "attnbook"
KERNELS = PACKAGE / "kernels.py"


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy")
    result = subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 2: mypy could not run
    return result


def test_mypy_strict_finds_no_error_in_any_module():
    files = sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))
    assert "code/attnbook/kernels.py" in files and len(files) > 20
    result = _mypy(*files)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert errors == [] and result.returncode == 0, result.stdout
    assert f"no issues found in {len(files)} source files" in result.stdout


def _excused() -> list[str]:
    # The modules whose errors pyproject.toml tells mypy to ignore (until their fixes land).
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    return [module for o in overrides if o.get("ignore_errors") for module in
            ([o["module"]] if isinstance(o["module"], str) else o["module"])]


@pytest.mark.parametrize("module", _excused())
def test_an_excused_module_still_needs_its_excuse(module, tmp_path):
    # Without pyproject.toml's settings (so without the excuse): --strict, untyped imports as Any
    path = f"code/{module.replace('.', '/')}.py"
    empty = tmp_path / "mypy.ini"
    empty.write_text("[mypy]\n")
    result = _mypy("--config-file", str(empty), "--strict", "--ignore-missing-imports", path)
    own = [line for line in result.stdout.splitlines() if line.startswith(path)]
    assert own, f"{module} passes mypy --strict now: delete its ignore_errors in pyproject.toml"


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]


def _is_jit(function: ast.FunctionDef) -> bool:
    return any(ast.unparse(d) == "triton.jit" for d in function.decorator_list)


def _unannotated(function: ast.FunctionDef) -> list[str]:
    args = function.args
    names = [a for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                         args.kwarg) if a is not None and a.annotation is None]
    return [a.arg for a in names] + (["return"] if function.returns is None else [])


def test_every_function_of_kernels_but_the_triton_ones_is_fully_annotated():
    # pyproject.toml lets attnbook.kernels hold unannotated functions, for its @triton.jit ones:
    # every other function (the host's Python) must be annotated as --strict asks elsewhere.
    functions = _functions(ast.parse(KERNELS.read_text()))
    host = [f for f in functions if not _is_jit(f)]
    assert len(host) > 20 and len(functions) - len(host) >= 13  # both kinds were found
    missing = {f.name: _unannotated(f) for f in host if _unannotated(f)}
    assert missing == {}, f"annotate these (name: parameters, or return): {missing}"


def test_triton_kernel_parameters_are_annotated_with_tl_constexpr_or_not_at_all():
    # Triton reads a kernel parameter's annotation: tl.constexpr makes a compile-time constant,
    # int or tl.int32 a 32-bit integer whatever the value, float stops its specialisation, and a
    # "const" pointer is read-only. Annotating them for mypy would change the compiled kernels.
    jit = [f for f in _functions(ast.parse(KERNELS.read_text())) if _is_jit(f)]
    annotations = {ast.unparse(a.annotation) for f in jit for a in f.args.args if a.annotation}
    assert annotations == {"tl.constexpr"}
    assert all(f.returns is None for f in jit)
