"""Check that every chapter links a glossary term it uses before the chapter that defines it.

book/glossary.md's `{glossary}` block defines each term and names, with a link such as
`[chapter 4](../chapters/04-heads-at-work.md)`, the chapter that defines it. A chapter that uses
a term earlier in the book (numbered chapters first, then the appendices) must make its first
use of it a `{term}` role, {term}`text <entry>` or {term}`entry`, so that the reader can look it
up before meeting its definition. Uses are found in the prose only: not in code cells, code
spans, math, headings, roles or links; case-insensitively, as whole words, a plural `s` allowed.

    python tools/terms_check.py          list each first use that should be a link; exit 1 if any
    python tools/terms_check.py --fix    make each such first use a {term} link, nothing else
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "book" / "glossary.md"
CHAPTERS = ROOT / "chapters"

DEFINED_IN = re.compile(r"\]\(\.\./chapters/([0-9]{2}|a[0-9])-[\w-]+\.md")
TERM_ROLE = re.compile(r"\{term\}`([^`<]*?)(?:\s*<([^`>]*)>)?`")
# What is not prose: fenced blocks, math, inline code and roles, link targets, HTML comments.
NOT_PROSE = re.compile(
    r"^(`{3,}|:{3,})[^\n]*\{code-cell\}.*?^\1[ \t]*$"  # code cells
    r"|^(`{3,})(?!`*\{admonition\})[^\n]*\n.*?^\2[ \t]*$"  # other code fences
    r"|\$\$.*?\$\$|\$[^$\n]+\$"  # math
    r"|\{\w+(?::\w+)?\}`[^`]*`|`[^`\n]*`"  # roles, inline code
    r"|\]\([^)]*\)|<!--.*?-->"  # link targets, comments
    r"|^#.*?$|^:[\w-]+:.*?$|^---\n.*?\n---$",  # headings, directive options, front matter
    re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Term:
    name: str  # the glossary entry
    chapter: int  # the position, in the book, of the chapter that defines it


def order(key: str) -> int:
    """Numbered chapters first, then the appendices: 01 -> 1, ..., a1 -> 101."""
    return 100 + int(key[1:]) if key.startswith("a") else int(key)


def glossary_terms(text: str) -> list[Term]:
    block = text[text.index("```{glossary}"):]
    block = block[block.index("\n") + 1:block.index("\n```\n")]
    terms = []
    for entry in re.split(r"\n(?=\S)", block.strip("\n")):
        name, _, body = entry.partition("\n")
        found = DEFINED_IN.search(body)
        if found is None:
            raise ValueError(f"glossary entry {name!r} links to no chapter that defines it")
        terms.append(Term(name.strip(), order(found.group(1))))
    return terms


def chapter_order(path: Path) -> int:
    return order(path.name.split("-", 1)[0])


def prose_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) of each stretch of prose."""
    spans, start = [], 0
    for match in NOT_PROSE.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    return spans + [(start, len(text))]


def word(name: str) -> re.Pattern:
    return re.compile(rf"(?<![\w-]){re.escape(name)}s?(?![\w-])", re.IGNORECASE)


def first_uses(text: str, term: Term) -> tuple[int | None, int | None]:
    """Where the term is first used as plain prose, and first linked: offsets, or None."""
    plain = next((m.start() for a, b in prose_spans(text) for m in word(term.name).finditer(text, a, b)),
                 None)
    linked = next((m.start() for m in TERM_ROLE.finditer(text)
                   if (m.group(2) or m.group(1)).strip().lower() == term.name.lower()), None)
    return plain, linked


def problems(text: str, chapter: int, terms: list[Term]) -> list[tuple[Term, int]]:
    """The terms this chapter uses before their chapter without linking them first."""
    found = []
    for term in terms:
        if term.chapter <= chapter:
            continue
        plain, linked = first_uses(text, term)
        if plain is not None and (linked is None or plain < linked):
            found.append((term, plain))
    return found


def fix(text: str, chapter: int, terms: list[Term]) -> str:
    for term, _ in problems(text, chapter, terms):  # one at a time: offsets move
        plain, _ = first_uses(text, term)
        match = word(term.name).match(text, plain)
        written = match.group(0)
        role = (f"{{term}}`{written}`" if written.lower() == term.name.lower()
                else f"{{term}}`{written} <{term.name}>`")
        text = text[:plain] + role + text[match.end():]
    return text


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="link each such first use")
    args = parser.parse_args(argv)
    terms = glossary_terms((root / "book" / "glossary.md").read_text())
    missing = 0
    for path in sorted((root / "chapters").glob("*.md"), key=chapter_order):
        text = path.read_text()
        if args.fix:
            fixed = fix(text, chapter_order(path), terms)
            if fixed != text:
                path.write_text(fixed)
                print(f"linked the first uses of glossary terms in {path.relative_to(root)}")
            continue
        for term, offset in problems(text, chapter_order(path), terms):
            line = text.count("\n", 0, offset) + 1
            print(f"{path.relative_to(root)}:{line}: {term.name!r} used before the chapter that "
                  f"defines it; link its first use: {{term}}`{term.name}`", file=sys.stderr)
            missing += 1
    if not args.fix:
        print(f"terms check: {len(terms)} glossary terms, {missing} first uses to link")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
