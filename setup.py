"""Adds the PEP 561 marker `attnbook/py.typed` to the built package.

Everything else about the package is declared in pyproject.toml. The marker cannot live in
code/attnbook/, whose files tools/tangle.py writes from the chapters and removes when no chapter
writes them (only code/attnbook/data/ is exempt), so it is written into the build instead: into
every wheel, and so into every install from the sdist or the repository. tests/test_packaging.py
checks that a built wheel holds it.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithMarker(build_py):
    """build_py, then an empty `py.typed` beside the package's modules."""

    def run(self) -> None:
        super().run()
        marker = Path(self.build_lib, "attnbook", "py.typed")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        marker = str(Path(self.build_lib, "attnbook", "py.typed"))
        return [*super().get_outputs(include_bytecode), marker]


setup(cmdclass={"build_py": BuildPyWithMarker})
