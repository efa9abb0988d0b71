"""How much of the package is argument checking: lines and check lines per module.

    python tools/package_stats.py            the package in code/attnbook/
    python tools/package_stats.py --rev REV  the package as it was at a git revision

A *code line* is a line of a module that is not blank, a comment or a docstring. A *check line* is
a code line of a statement that only checks: a `raise`, an `if` whose every branch raises, a `try`
whose handlers only raise, an `assert`, or a call of a function whose name starts with `check_` or
`_check` (the call's own line, in whatever statement it sits). *Written* check lines leave out
those calls: they are the checks spelled out where they stand, rather than delegated to a check
function. These are the figures issue 12's goals are stated in.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "code/attnbook"


def _only_raises(body: list[ast.stmt]) -> bool:
    return bool(body) and all(isinstance(s, ast.Raise) or (isinstance(s, ast.If) and _raising_if(s))
                              for s in body)


def _raising_if(node: ast.If) -> bool:
    return _only_raises(node.body) and (not node.orelse or _only_raises(node.orelse))


def _lines(node: ast.AST) -> set[int]:
    return set(range(node.lineno, node.end_lineno + 1))


def _is_check_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
    return name.startswith(("check_", "_check"))


def code_lines(source: str) -> set[int]:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines -= _lines(body[0])
    return lines


def check_lines(source: str, calls: bool = True) -> set[int]:
    """The lines of checks written out, and with `calls` also of calls to check functions."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Raise, ast.Assert)) or (isinstance(node, ast.If) and _raising_if(node)):
            lines |= _lines(node)
        elif isinstance(node, ast.Try) and node.handlers and all(_only_raises(h.body)
                                                                for h in node.handlers):
            lines |= _lines(node)
        elif calls and _is_check_call(node):
            lines |= _lines(node)
    return lines


def sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {p.name: p.read_text() for p in sorted((ROOT / PACKAGE).glob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{PACKAGE}"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{PACKAGE}/{n}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
            for n in names if n.endswith(".py")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision instead of the working tree")
    parser.add_argument("--since", metavar="REV", help="also compare the lines of the modules "
                        "that existed at REV with their lines then")
    args = parser.parse_args()
    print(f"{'module':<18}{'lines':>7}{'code':>7}{'checks':>8}{'share':>7}"
          f"{'written':>9}{'share':>7}")
    totals = [0, 0, 0, 0]

    def show(name, row):
        print(f"{name:<18}{row[0]:>7}{row[1]:>7}{row[2]:>8}{row[2] / max(row[1], 1):>7.0%}"
              f"{row[3]:>9}{row[3] / max(row[1], 1):>7.0%}")

    now = sources(args.rev)
    for name, source in now.items():
        code = code_lines(source)
        row = [len(source.splitlines()), len(code), len(check_lines(source) & code),
               len(check_lines(source, calls=False) & code)]
        totals = [t + r for t, r in zip(totals, row)]
        show(name, row)
    show("total", totals)
    if args.since:
        then = sources(args.since)
        before = sum(len(source.splitlines()) for source in then.values())
        after = sum(len(now[name].splitlines()) for name in then if name in now)
        print(f"the {len(then)} modules of {args.since}: {before} lines then, {after} now "
              f"({after / before - 1:+.1%})")


if __name__ == "__main__":
    main()
