"""A glued number must not show digits its record does not have.

A chapter records a result with `glue(name, value, digits=2)` (appendix A), which keeps two
significant digits, and quotes it in the prose as {glue:text}`name:.1%`. That format shows three
digits, so a record of 0.25 reads "25.0%", a precision the cell never had, and a record of 0.7
(one digit of 0.65) reads "70%". This check reads every {glue:text}`name:format` of the chapters
whose value was glued with `digits=` (glue then records `name__digits` too), formats the value
the committed notebook recorded, as the site does, and fails when the text shows more
significant digits than that. Values glued
without `digits` are exact (counts, sizes) and may show all their digits.

    python tools/glue_digits_check.py      # exit 1 and list the glue roles that show too many digits
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
from tangle import DIGITS_SUFFIX, GLUE, glued_values  # the one reader of glue roles, records

ROOT = Path(__file__).resolve().parents[1]


def shown_digits(text: str) -> int | None:
    """How many significant digits a number as the site shows it carries; None for no number.

    "0.25" has 2, "25.0%" 3 and "100.0%" 4 (a zero after the point is claimed), "1,086" 4,
    "2.5e-07" 2; "400" and "70%" have 1, as the convention reads trailing zeros of a whole
    number: they may only place the point."""
    mantissa = re.split(r"[eE]", text.strip().replace(",", "").rstrip("%"))[0].lstrip("+-")
    if not re.fullmatch(r"\d*\.?\d*", mantissa) or not re.search(r"[1-9]", mantissa):
        return None
    digits = mantissa.replace(".", "").lstrip("0")
    return len(digits if "." in mantissa else digits.rstrip("0"))


def problems(chapter_text: str, values: dict[str, str]) -> list[str]:
    """The glue roles of one chapter whose format shows more digits than their record has.
    `values` holds the notebook's records, among them `name__digits` for each value glued with
    digits= (appendix A's glue records it)."""
    from myst_nb.core.variables import format_plain_text

    found = []
    for match in GLUE.finditer(chapter_text):
        name, _, spec = match.group(1).partition(":")
        digits = values.get(name + DIGITS_SUFFIX)
        if name not in values or digits is None:
            continue  # not rounded (exact), or not recorded: the book build reports that
        shown = format_plain_text(values[name], spec or "s")
        showing = shown_digits(shown)
        if showing is not None and showing > int(digits):
            found.append(f"{{glue:text}}`{match.group(1)}` shows {shown!r}, {showing} significant "
                         f"digits, but {name} was glued with digits={digits} "
                         f"(record {values[name]})")
    return found


def check_book(root: Path = ROOT) -> list[str]:
    found = []
    for chapter in sorted((root / "chapters").glob("*.md")):
        notebook = root / "notebooks" / f"{chapter.stem}.ipynb"
        if not notebook.exists():
            continue
        values = glued_values(nbformat.read(notebook, as_version=4))
        found += [f"{chapter.name}: {p}" for p in problems(chapter.read_text(), values)]
    return found


if __name__ == "__main__":
    found = check_book()
    print("\n".join(found) or "glue_digits_check: every glued number shows only the digits it has")
    sys.exit(1 if found else 0)
