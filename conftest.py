"""Per-notebook execution times from the nbval run: printed after the tests, and saved so that
the book built by `make test` can show them (tools/verified_cache.py)."""

import json
from collections import defaultdict
from pathlib import Path

TIMES_FILE = Path(__file__).parent / "_build" / "notebook-times.json"
_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):  # setup (the kernel's start), the cell, teardown
        _seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    terminalreporter.section("chapter execution times (nbval)")
    for path, seconds in sorted(_seconds.items()):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
    TIMES_FILE.parent.mkdir(exist_ok=True)
    TIMES_FILE.write_text(json.dumps({p: round(s, 1) for p, s in sorted(_seconds.items())}, indent=1))


def pytest_configure(config):
    # Without a GPU, Triton must interpret kernels on the CPU, and that is fixed when triton is
    # first imported, which some torch modules do (torch.utils.flop_counter) before any test
    # reaches attnbook.kernels: chosen here, first, by the package's one function for it
    # (chapter 15). The notebooks' kernels inherit this environment too.
    from attnbook.triton_mode import use_triton_interpreter

    use_triton_interpreter()
