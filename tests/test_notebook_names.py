"""A notebook runs alone, its cells in order: each name its code uses must be defined by one of its
cells or imports, even where a chapter's `# noqa: F821` leaves the name to a later chapter's cell
of the same package module (chapter 10's GPT calls chapter 19's padding helpers)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def undefined_names(notebook: Path) -> set[str]:
    """The names that ruff's F821 finds undefined in the notebook's code, its noqa comments ignored."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F821", "--ignore-noqa", "--no-cache",
         "--output-format", "json", "--stdin-filename", notebook.stem + ".py", "-"],
        input=code, capture_output=True, text=True, check=False)
    assert found.returncode in (0, 1), found.stderr  # 1: it found some
    return {f["message"].split("`")[1] for f in json.loads(found.stdout)}


def test_the_check_finds_a_name_no_cell_defines(tmp_path):
    cell = {"cell_type": "code", "source": ["x = _check_padding(1)  # noqa: F821\n", "%time y = x"]}
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert undefined_names(tmp_path / "nb.ipynb") == {"_check_padding"}


@pytest.mark.parametrize("chapter", ["10-gpt"])
def test_every_name_a_notebook_uses_is_defined_in_it(chapter):
    assert undefined_names(ROOT / "notebooks" / f"{chapter}.ipynb") == set()
