"""Facts about the package as it is published: its version in every file that states it, the
README's example and links, the changelog's form, and what the built sdist and wheel hold."""

import contextlib
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest

import attnbook

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Read as UTF-8 everywhere: the README holds Japanese titles, and Windows' default is not UTF-8.
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def cff_field(name: str, indent: str = "") -> str:
    """One scalar of CITATION.cff, read without a YAML parser (the file is flat where it matters)."""
    text = (ROOT / "CITATION.cff").read_text(encoding="utf-8")
    match = re.search(rf"^{indent}{name}:\s*\"?([^\"\n]+?)\"?\s*$", text, re.M)
    assert match, f"CITATION.cff has no {indent}{name}"
    return match.group(1)


def test_citation_states_the_package_version():
    assert VERSION == attnbook.__version__
    assert cff_field("version") == VERSION
    assert cff_field("edition", indent="  ") == VERSION  # the book's edition, in preferred-citation


def readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def test_readme_example_prints_what_the_readme_shows():
    section = readme_section("Using the package")
    (code,) = fenced(section, "python")
    shown = fenced(section, "text")[0]
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    assert printed.getvalue() == shown
    q, k, v = namespace["Q"], namespace["K"], namespace["V"]
    assert not np.array_equal(q, k) and not np.array_equal(k, v) and not np.array_equal(q, v)


def test_readme_installs_the_release_of_this_version():
    text = README.read_text(encoding="utf-8")
    installs = re.findall(r"pip install \"attnbook @ git\+(\S+)@(v[^\"]+)\"", text)
    assert installs == [("https://github.com/attnbook/attnbook", f"v{VERSION}")]


def test_readme_links_are_absolute_for_the_package_index():
    # The README is the package's long description, shown where relative links lead nowhere.
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    assert targets
    relative = [t for t in targets if not t.startswith(("https://", "#"))]
    assert relative == []


KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def test_changelog_is_in_keep_a_changelog_form():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[([^\]]+)\](.*)$", text, re.M)
    assert releases[0] == ("Unreleased", "")
    assert VERSION in [name for name, _ in releases]
    for name, _ in releases:
        body = text.split(f"## [{name}]", 1)[1].split("\n## ", 1)[0]
        kinds = re.findall(r"^### (.+)$", body, re.M)
        assert kinds and set(kinds) <= set(KINDS), (name, kinds)
        assert re.search(rf"^\[{re.escape(name)}\]: https://github\.com/attnbook/attnbook/", text, re.M)


def can_build() -> bool:
    if importlib.util.find_spec("build") is None or importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 77  # reads `license = "MIT"`


@pytest.mark.skipif(not can_build(), reason="needs build and setuptools>=77 (the lock has them)")
def test_the_built_sdist_and_wheel_hold_what_users_need(tmp_path):
    # Built from a copy of the files an sdist is made of, so the checkout gains no build folders.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "_build", "build", "notebooks", "chapters", "book", "*.egg-info",
            "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"),
         str(source)],
        check=True, capture_output=True,
    )
    (sdist,) = (tmp_path / "dist").glob("attnbook-*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("attnbook-*.whl")
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"CHANGELOG.md", "CITATION.cff", "REUSE.toml", "LICENSE", "LICENSES/MIT.txt",
            "LICENSES/CC-BY-4.0.txt", "conftest.py", "tests/conftest.py"} <= in_sdist
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
        metadata = zf.read(f"attnbook-{VERSION}.dist-info/METADATA").decode()
    assert "attnbook/py.typed" in in_wheel  # PEP 561: type checkers read the annotations
    licences = {n.split("/licenses/", 1)[1] for n in in_wheel if "/licenses/" in n}
    assert licences == {"LICENSE", "LICENSES/MIT.txt", "LICENSES/CC-BY-4.0.txt"}
    assert "License-Expression: MIT" in metadata
    assert "attnbook @ git+https://github.com/attnbook/attnbook@v" in metadata  # the README
