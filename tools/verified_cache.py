"""Fill a Jupyter Book execution cache with the committed notebooks' outputs.

`make test` executes every chapter once, under nbval, which re-runs notebooks/NN-slug.ipynb and
fails unless each cell reproduces its committed output. Building the site afterwards must not run
every chapter a second time (Part II trains models for minutes), so the test build reads a cache
filled here: for each chapter, the chapter's own cells (read as myst-nb reads them, so the cache
key matches) with the outputs of its committed, just-verified notebook. `make book` does not use
this: it executes the chapters.

    python tools/verified_cache.py CACHE_DIR [--times notebook-times.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from myst_nb.core.read import read_myst_markdown_notebook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tangle import ROOT, chapter_source, notebook_path, read_chapters  # noqa: E402


def chapter_with_outputs(chapter) -> nbformat.NotebookNode:
    nb = read_myst_markdown_notebook(chapter.path.read_text(), path=chapter.path)
    committed = nbformat.read(notebook_path(chapter), as_version=4)
    executed = [c for c in committed.cells[1:] if c.cell_type == "code"]  # [0]: setup cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    if [c.source.strip() for c in code] != [chapter_source(c).strip() for c in executed]:
        raise SystemExit(f"{notebook_path(chapter)} does not match {chapter.relpath}: make notebooks")
    for cell, done in zip(code, executed):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir", type=Path)
    parser.add_argument("--times", type=Path, help="seconds per notebook, from the nbval run")
    args = parser.parse_args()
    times = json.loads(args.times.read_text()) if args.times and args.times.exists() else {}
    cache = get_cache(args.cache_dir)
    for chapter in read_chapters():
        seconds = times.get(notebook_path(chapter).relative_to(ROOT).as_posix())
        bundle = CacheBundleIn(
            chapter_with_outputs(chapter),
            str(chapter.path),
            data={"execution_seconds": seconds} if seconds is not None else {},
        )
        cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
    print(f"verified cache: {len(read_chapters())} chapters in {args.cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
