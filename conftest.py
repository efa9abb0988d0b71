"""Seconds per test file from the run: the notebooks' are printed after the tests and saved so that
the book built by `make test` can show them (tools/verified_cache.py); all of them are saved so that
the next runs can hand the longest files out first (FILE_SECONDS)."""

import json
import os
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parent
TIMES_FILE = ROOT / "_build" / "notebook-times.json"
# Seconds per file from one `make pytest` run: refreshed by copying _build/file-seconds.json, which
# every run writes, over it. Only their order matters; a file it lacks goes last.
FILE_SECONDS = ROOT / "tests" / "file-seconds.json"
_seconds: dict[str, float] = defaultdict(float)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (make pytest), longest files first. The workers take files in this order
    (make's --no-loadscope-reorder): a long notebook taken last would keep one worker busy for
    minutes after the other ran out of work. A stable sort: each file's tests keep their order."""
    if "PYTEST_XDIST_WORKER" in os.environ and FILE_SECONDS.exists():
        seconds = json.loads(FILE_SECONDS.read_text())
        items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter):
    notebooks = {p: s for p, s in sorted(_seconds.items()) if p.endswith(".ipynb")}
    if notebooks:  # for a notebook, setup is its kernel's start
        terminalreporter.section("chapter execution times (nbval)")
        for path, seconds in notebooks.items():
            terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
        TIMES_FILE.parent.mkdir(exist_ok=True)
        TIMES_FILE.write_text(json.dumps({p: round(s, 1) for p, s in notebooks.items()}, indent=1))
    if any(path.startswith("tests/") for path in _seconds):  # make test-portable's keeps make test's
        TIMES_FILE.parent.mkdir(exist_ok=True)
        (TIMES_FILE.parent / "file-seconds.json").write_text(
            json.dumps({p: round(s, 1) for p, s in sorted(_seconds.items())}, indent=1) + "\n")


def pytest_configure(config):
    # Without a GPU, Triton must interpret kernels on the CPU, and that is fixed when triton is
    # first imported, which some torch modules do (torch.utils.flop_counter) before any test
    # reaches attnbook.kernels: chosen here, first, by the package's one function for it
    # (chapter 15). The notebooks' kernels inherit this environment too.
    from attnbook.triton_mode import use_triton_interpreter

    use_triton_interpreter()
