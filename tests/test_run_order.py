"""make pytest hands pytest-xdist's workers the longest files first (the root conftest.py)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def _order(monkeypatch, tmp_path, worker, nodeids):
    conftest = _root_conftest()
    table = tmp_path / "file-seconds.json"
    table.write_text(json.dumps({"tests/test_short.py": 1.0, "notebooks/long.ipynb": 90.0}))
    monkeypatch.setattr(conftest, "FILE_SECONDS", table)
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = _items(*nodeids)
    conftest.pytest_collection_modifyitems(None, items)
    return [item.nodeid for item in items]


COLLECTED = ["tests/test_new.py::test_b", "tests/test_short.py::test_a",
             "tests/test_short.py::test_z", "notebooks/long.ipynb::Cell 0",
             "notebooks/long.ipynb::Cell 1", "tests/test_new.py::test_c"]


def test_a_worker_takes_the_longest_file_first_each_files_tests_in_their_order(monkeypatch,
                                                                                 tmp_path):
    assert _order(monkeypatch, tmp_path, True, COLLECTED) == [
        "notebooks/long.ipynb::Cell 0", "notebooks/long.ipynb::Cell 1",
        "tests/test_short.py::test_a", "tests/test_short.py::test_z",
        "tests/test_new.py::test_b", "tests/test_new.py::test_c"]  # not in the table: last


def test_a_run_without_workers_keeps_the_collected_order(monkeypatch, tmp_path):
    assert _order(monkeypatch, tmp_path, False, COLLECTED) == COLLECTED


def test_the_committed_table_names_files_that_exist():
    table = json.loads((ROOT / "tests" / "file-seconds.json").read_text())
    assert table and all((ROOT / path).is_file() for path in table), table.keys()


def _summary(monkeypatch, tmp_path, seconds):
    conftest = _root_conftest()
    monkeypatch.setattr(conftest, "TIMES_FILE", tmp_path / "notebook-times.json")
    monkeypatch.setattr(conftest, "_seconds", dict(seconds))
    conftest.pytest_terminal_summary(SimpleNamespace(section=lambda *a: None,
                                                     write_line=lambda *a: None))
    table = tmp_path / "file-seconds.json"
    return json.loads(table.read_text()) if table.exists() else None


def test_the_table_is_written_by_a_run_of_tests_not_by_the_notebooks_alone(monkeypatch,
                                                                             tmp_path):
    both = {"tests/test_short.py": 1.04, "notebooks/long.ipynb": 90.0}
    assert _summary(monkeypatch, tmp_path, both) == {"notebooks/long.ipynb": 90.0,
                                                     "tests/test_short.py": 1.0}
    # make test-portable runs the notebooks alone after make test: make test's table stays
    assert _summary(monkeypatch, tmp_path, {"notebooks/long.ipynb": 30.0})["tests/test_short.py"]
    assert _summary(monkeypatch, tmp_path / "x", {"notebooks/long.ipynb": 30.0}) is None
