"""The `notebook` extra holds everything the chapters import: checked, and imported.

Reads every `import x` and `from x import` of the chapters' code cells (chapters/*.md), keeps
the modules outside the standard library and the package, and checks that each one's
distribution is what `pip install "attnbook[notebook]"` installs: named in pyproject.toml's
`notebook` extra, or in the package's own dependencies or the extras the notebook extra takes
in. Then it imports each module in this Python, so that a floor whose release cannot be imported
beside the others (a matplotlib built for NumPy 1 beside NumPy 2) fails `make test-lowest`.

    python tools/notebook_imports.py            # check and import (make test-lowest)
    python tools/notebook_imports.py --list     # the modules and their distributions
"""

import argparse
import importlib
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_][\w.]*)\s+import\b|import\s+([A-Za-z_][\w.]*))",
                    re.MULTILINE)
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Distributions whose import name is not their own.
DISTRIBUTION = {"sklearn": "scikit-learn", "IPython": "ipython", "PIL": "pillow",
                "yaml": "pyyaml"}
# Imported by the chapters only inside a book build (appendix A's glue falls back without it).
BOOK_ONLY = {"myst_nb"}


def chapter_imports(chapters=ROOT / "chapters") -> dict[str, tuple[list[str], set[str]]]:
    """Top-level module -> (the chapters that import it, the modules of it they import: a
    broken binary may fail in matplotlib.pyplot, not in matplotlib), for the modules outside the
    standard library and the package."""
    found: dict[str, tuple[list[str], set[str]]] = {}
    for chapter in sorted(chapters.glob("*.md")):
        for cell in CELL.findall(chapter.read_text()):
            for a, b in IMPORT.findall(cell):
                top = (a or b).split(".")[0]
                if top in sys.stdlib_module_names or top in ("attnbook", "__future__"):
                    continue
                stems, modules = found.setdefault(top, ([], set()))
                modules.add(a or b)
                if chapter.stem not in stems:
                    stems.append(chapter.stem)
    return found


def notebook_distributions(pyproject=ROOT / "pyproject.toml") -> set[str]:
    """The distributions `attnbook[notebook]` names: its own, the package's dependencies and
    those of the extras it takes in (attnbook[hf], ...), whatever their markers."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    names, seen = set(), set()

    def normalise(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    def add(requirements):
        for requirement in requirements:
            name, inner = re.match(r"\s*([A-Za-z0-9][\w.-]*)\s*(?:\[([^\]]*)\])?",
                                   requirement).groups()
            if normalise(name) != normalise(project["name"]):
                names.add(normalise(name))
                continue
            for extra in (e.strip() for e in (inner or "").split(",")):
                if extra and extra not in seen:
                    seen.add(extra)
                    add(extras[extra])

    add(list(project.get("dependencies", [])) + [f"{project['name']}[notebook]"])
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list, check nothing")
    args = parser.parse_args(argv)
    imports = chapter_imports()
    if not imports:
        print("no chapter imports found: is chapters/ here?", file=sys.stderr)
        return 1
    declared = notebook_distributions()
    failures = []
    for module, (chapters, modules) in sorted(imports.items(), key=lambda i: i[0].lower()):
        distribution = DISTRIBUTION.get(module, module).lower().replace("_", "-")
        where = f"{module} ({distribution}; {len(chapters)} chapters: {', '.join(chapters)})"
        if args.list:
            print(where)
            continue
        if module in BOOK_ONLY:
            print(f"book build only: {where}")
            continue
        if distribution not in declared:
            failures.append(f"not in the notebook extra: {where}")
            continue
        try:
            for name in sorted(modules):
                importlib.import_module(name)
        except Exception as error:  # an ImportError, or what a broken binary raises
            failures.append(f"cannot be imported: {where}: {name}: {type(error).__name__}: "
                            f"{error}")
            continue
        print(f"ok: {where}: {', '.join(sorted(modules))}")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
