"""A notebook runs alone, its cells in order: each name its code uses must be defined by one of its
cells or imports, even where a chapter's `# noqa: F821` leaves the name to another chapter's cell
of the same package module (chapter 10's GPT calls chapter 19's padding helpers)."""

import json
import re
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def undefined_names(notebook: Path) -> set[str]:
    """The names that ruff's F821 finds undefined in the notebook's code, its noqa comments ignored."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    code = "\n".join(line for line in code.splitlines()  # IPython's magics and shell escapes,
                     if not re.match(r"\s*(%|!(?!=))", line))  # not a line that starts with !=
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F821", "--ignore-noqa", "--no-cache",
         "--output-format", "json", "--stdin-filename", notebook.stem + ".py", "-"],
        input=code, capture_output=True, text=True, check=False)
    assert found.returncode in (0, 1), found.stderr  # 1: it found some
    return {f["message"].split("`")[1] for f in json.loads(found.stdout)}


def appendix_b_names() -> set[str]:
    """The names that appendix B's cells of attnbook.train define or import at module level: the
    part of the tangled module before appendix E's first cell."""
    module = (ROOT / "code" / "attnbook" / "train.py").read_text()
    part_b = module.split('\n# chapters/a5-training-command.md, "')[0]
    table = symtable.symtable(part_b, "train.py", "exec")
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


# Names a notebook takes in a way ruff cannot read, each with its one-line reason.
TAKEN = {
    # Appendix E continues appendix B's module, and takes B's names with globals().update(...).
    "a5-training-command": appendix_b_names,
}


def test_the_check_finds_a_name_no_cell_defines(tmp_path):
    cell = {"cell_type": "code", "source": ["x = _check_padding(1)  # noqa: F821\n", "%time y = x"]}
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert undefined_names(tmp_path / "nb.ipynb") == {"_check_padding"}


def test_appendix_b_names_are_bs_alone():
    names = appendix_b_names()
    assert {"train", "_random_states", "json", "DistributedDataParallel", "socket", "_rank"} <= names
    assert not names & {"read_manifest", "save_checkpoint", "_Progress", "WORK"}  # E's, or no one's


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_name_a_notebook_uses_is_defined_in_it(notebook):
    taken = TAKEN[notebook]() if notebook in TAKEN else set()
    assert undefined_names(ROOT / "notebooks" / f"{notebook}.ipynb") - taken == set()
