"""The README's table of tested versions, written from the environments the tests ran in.

Two steps, both run by make:

    python tools/tested_versions.py record lowest-3.11 FREEZE   # make test-lowest, after its tests
    python tools/tested_versions.py record locked-3.11 FREEZE   # make lint, from .venv
    python tools/tested_versions.py table                       # both: the README's table

`record` keeps, from an environment's `pip freeze` (or `uv pip freeze`), the versions of the
dependencies that pyproject.toml declares (the package's and its extras'), in
.github/tested-versions/LABEL.txt. `table` writes one row per dependency, what the metadata allows
and the version in each record (a column per record), between the README's markers

    <!-- tested-versions -->
    ...
    <!-- /tested-versions -->

Both only check by default, and fail when the record or the table is not what the environment
gives; --write (make's WRITE=1) rewrites them. So no version in the table is typed by hand, and
a floor that moves, or a lock that does, fails until the table says so.
"""

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / ".github" / "tested-versions"
README = ROOT / "README.md"
START, END = "<!-- tested-versions -->", "<!-- /tested-versions -->"
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(?:;(.*))?$")
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;+]+)")
# A record's label: what its environment is, and its Python. The lowest first, then the lock.
LABEL = re.compile(r"^(lowest|locked)-(3\.\d+)$")
HEADINGS = {"lowest": "lowest, Python {}", "locked": "the lock, Python {}"}


def normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[tuple[str, str]]]:
    """Each dependency of the package and its extras: [(specifier, marker)], in the order of
    pyproject.toml (the package's own extras, attnbook[...], are left out)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    rows: dict[str, list[tuple[str, str]]] = {}
    for requirement in requirements:
        name, _, specifier, marker = REQUIREMENT.match(requirement).groups()
        if normalise(name) == normalise(project["name"]):
            continue
        entry = (specifier.strip() or "any", (marker or "").strip())
        if entry not in rows.setdefault(normalise(name), []):
            rows[normalise(name)].append(entry)
    return rows


def pinned(text: str) -> dict[str, str]:
    """name -> version from `pip freeze` lines (name==version). A local version such as
    2.11.0+cu130 is given without its build tag, which says how torch was built, not which."""
    versions = {}
    for line in text.splitlines():
        found = PINNED.match(line.strip())
        if found:
            versions[normalise(found.group(1))] = found.group(2)
    return versions


def record_text(freeze: str, names) -> str:
    """What a record holds: the declared dependencies' versions in an environment."""
    versions = pinned(freeze)
    return ("# Written by tools/tested_versions.py from the environment's pip freeze: the "
            "versions of\n# pyproject.toml's dependencies (README, \"Tested versions\").\n"
            + "".join(f"{name}=={versions[name]}\n" for name in sorted(names) if name in versions))


def table(rows: dict[str, list[tuple[str, str]]], records: dict[str, dict[str, str]]) -> str:
    """The README's table: a row per dependency, a column per record."""
    def where(marker):  # python_version < '3.13' reads "Python < 3.13"
        return re.sub(r"python_version\s*([<>=!]+)\s*['\"]([^'\"]+)['\"]", r"Python \1 \2", marker)

    def allowed(entries):
        return "; ".join(f"`{s}`" + (f" ({where(m)})" if m else "") for s, m in entries)

    def order(label):
        kind, python = LABEL.match(label).groups()
        return kind != "lowest", tuple(map(int, python.split(".")))

    labels = sorted(records, key=order)
    header = ["package", "pyproject.toml allows"] + [
        HEADINGS[LABEL.match(label).group(1)].format(LABEL.match(label).group(2))
        for label in labels]
    lines = [header] + [[name, allowed(entries)] + [records[label].get(name, "not installed")
                                                     for label in labels]
                        for name, entries in rows.items()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |"
           for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def _settle(path: Path, old: str, new: str, write: bool, how: str) -> int:
    """Nothing to do, a rewrite (write) or a failure that shows what it should be."""
    if old == new:
        print(f"{path.relative_to(ROOT)}: up to date")
        return 0
    if write:
        path.write_text(new)
        print(f"{path.relative_to(ROOT)}: rewritten")
        return 0
    print(f"{path.relative_to(ROOT)} is not what {how} gives ({how} WRITE=1 rewrites it). "
          f"It should read:\n{new}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite instead of checking")
    steps = parser.add_subparsers(dest="step", required=True)
    record = steps.add_parser("record", help="an environment's versions, into its record")
    record.add_argument("label", help="lowest-3.11, locked-3.11, ...")
    record.add_argument("freeze", type=Path, help="the environment's pip freeze")
    steps.add_parser("table", help="the README's table, from the records")
    args = parser.parse_args(argv)
    rows = declared()
    if args.step == "record":
        if not LABEL.match(args.label):
            parser.error(f"label must be lowest-3.N or locked-3.N, got label={args.label!r}")
        path = RECORDS / f"{args.label}.txt"
        old = path.read_text() if path.exists() else ""
        new = record_text(args.freeze.read_text(), rows)
        if not pinned(new):
            parser.error(f"{args.freeze} pins none of pyproject.toml's dependencies")
        RECORDS.mkdir(parents=True, exist_ok=True)
        return _settle(path, old, new, args.write, "make test-lowest" if args.label.startswith(
            "lowest") else "make lint")
    records = {p.stem: pinned(p.read_text()) for p in sorted(RECORDS.glob("*.txt"))
               if LABEL.match(p.stem)}
    text = README.read_text()
    found = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.DOTALL)
    if found is None:
        print(f"README.md: no {START} ... {END} markers", file=sys.stderr)
        return 1
    new = text[:found.start(1)] + table(rows, records) + "\n" + text[found.end(1):]
    return _settle(README, text, new, args.write, "make test-lowest")


if __name__ == "__main__":
    sys.exit(main())
