"""Run every notebook as a reader on Google Colab would: alone, top to bottom, in an environment
like Colab's, with its own first cell installing the package.

The environment (made by `make colab-check` in .venv-colab) has Colab's Python (3.12) and the
newest numpy, matplotlib, transformers, tqdm, scikit-learn and torch that pip takes, and none of
requirements.txt: no Sphinx, no myst-nb, no jupyter-book. Each notebook is copied alone into an
empty folder and executed there, under a stand-in `google.colab` module, so that its setup cell
takes the Colab branch: it pip-installs the package from this clone instead of GitHub, at the
clone's commit (HEAD) instead of the branch it names (the only changes made to the notebook; the
package must be committed, since pip installs from git). The package is uninstalled before each
notebook, as on a fresh Colab runtime. Outputs are not compared (a reader's run differs in the
last digits); any error fails the check.

    .venv-colab/bin/python tools/colab_check.py [NOTEBOOK ...] [--report FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tangle import pin, repository  # noqa: E402

# Imported at the kernel's start, as Colab's own module is, so `"google.colab" in sys.modules`.
STAND_IN = {
    "google/colab/__init__.py": '"""A stand-in for Colab\'s module (tools/colab_check.py)."""\n',
    "sitecustomize.py": "import google.colab  # noqa: F401\n",
}


def stand_in(folder: Path) -> Path:
    for rel, text in STAND_IN.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


def clone_commit() -> str:
    """This clone's HEAD, refused while code/ or pyproject.toml has uncommitted changes: pip
    installs the package from git, which would not see them."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    if git("status", "--porcelain", "--untracked-files=all", "--", "code", "pyproject.toml"):
        raise SystemExit("code/ or pyproject.toml has uncommitted changes, which the notebooks "
                         "would not install from this clone's git: commit them first")
    return git("rev-parse", "HEAD")


def pointed_at_this_clone(nb: nbformat.NotebookNode, commit: str) -> nbformat.NotebookNode:
    """`nb` installing the package of `commit` from this clone instead of its branch on GitHub."""
    url, _ = repository()
    setup = nb.cells[0]
    if f"git+{url}@" not in setup.source:
        raise SystemExit(f"the setup cell does not install from {url}: {setup.source[:200]}")
    setup.source = setup.source.replace(f"git+{url}@", f"git+file://{ROOT}@")
    return pin(nb, commit)


def run_notebook(path: Path, colab_module: Path, commit: str) -> dict:
    nb = pointed_at_this_clone(nbformat.read(path, as_version=4), commit)
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "attnbook"],
                   capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(colab_module))
    env.pop("TRITON_INTERPRET", None)  # Colab does not set it: a chapter decides for itself
    with tempfile.TemporaryDirectory(prefix="colab-") as empty:
        client = NotebookClient(nb, timeout=1200, kernel_name="python3",
                                resources={"metadata": {"path": empty}})
        start = time.perf_counter()
        error = None
        try:
            client.execute(env=env)
        except CellExecutionError as failure:
            error = str(failure).strip().splitlines()[-1]
        seconds = time.perf_counter() - start
    first = "".join(o.get("text", "") for o in nb.cells[0].get("outputs", [])).strip()
    return {"notebook": path.name, "seconds": round(seconds, 1), "setup": first,
            "status": "ok" if error is None else "error", "error": error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--report", type=Path, default=ROOT / "_build" / "colab-check.json")
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    commit = clone_commit()
    with tempfile.TemporaryDirectory(prefix="colab-module-") as folder:
        colab_module = stand_in(Path(folder))
        results = []
        for path in paths:
            print(f"{path.name} ...", flush=True)
            results.append(run_notebook(path, colab_module, commit))
            r = results[-1]
            print(f"  {r['status']} in {r['seconds']} s; first cell: {r['setup']}"
                  + (f"\n  {r['error']}" if r["error"] else ""), flush=True)
    versions = subprocess.run([sys.executable, "-m", "pip", "list", "--format=json"],
                              capture_output=True, text=True).stdout
    wanted = {"numpy", "torch", "triton", "matplotlib", "transformers", "tqdm", "scikit-learn"}
    report = {
        "python": sys.version.split()[0],
        "packages": {p["name"]: p["version"] for p in json.loads(versions)
                     if p["name"].lower() in wanted},
        "notebooks": results,
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    failed = [r["notebook"] for r in results if r["status"] != "ok"]
    print(f"colab check on Python {report['python']}, {report['packages']}: "
          f"{len(results) - len(failed)} of {len(results)} notebooks ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
