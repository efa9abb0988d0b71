"""Execute the book's chapters side by side into the site build's execution cache.

`make book` builds the site with `execute_notebooks: cache` (_config.yml): myst-nb looks each
chapter up in the Jupyter cache and executes, one after another, the chapters it does not find.
This fills that cache first, running the missing chapters in WORKERS processes at once, each
chapter exactly as myst-nb would run it: the chapter read as myst-nb reads it (so the cache key
matches), executed by the same function (jupyter-cache's single_nb_execution), in the chapter's
own folder (`run_in_temp: false`), with the configured timeout and errors not allowed. The build
then finds every chapter in the cache and executes nothing. Each worker's kernel gets its share
of the cores as its thread count, as `make test` gives its workers.

    python tools/execute_chapters.py CACHE_DIR [--workers N] [CHAPTER_PREFIX ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from jupyter_cache.executors.utils import single_nb_execution
from myst_nb.core.read import read_myst_markdown_notebook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tangle import ROOT, notebook_path, read_chapters  # noqa: E402

# Seconds per notebook from the last nbval run (make test writes it): the longest chapters start
# first, so that no worker is left with a long one at the end.
TIMES = ROOT / "_build" / "notebook-times.json"


def read(path: Path):
    return read_myst_markdown_notebook(path.read_text(), path=path)


def run(path: Path, timeout: int, threads: int):
    """Execute one chapter: (the executed notebook, seconds, the traceback or None). The caller
    alone writes the cache, whose database is not made for writers in several processes."""
    os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads))
    nb = read(path)
    result = single_nb_execution(nb, cwd=str(path.parent), timeout=timeout, allow_errors=False)
    return nb, result.time, result.exc_string


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("only", nargs="*", help="chapter prefixes to run, e.g. 01 (default: all)")
    args = parser.parse_args()
    execute = yaml.safe_load((ROOT / "_config.yml").read_text())["execute"]
    assert execute["execute_notebooks"] == "cache" and not execute["run_in_temp"], execute

    cache = get_cache(args.cache_dir)
    missing = []
    for chapter in read_chapters():
        if args.only and not any(chapter.slug.startswith(prefix) for prefix in args.only):
            continue
        try:
            cache.match_cache_notebook(read(chapter.path))
        except KeyError:
            missing.append(chapter)
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    missing.sort(key=lambda c: -times.get(notebook_path(c).relative_to(ROOT).as_posix(), 0))
    print(f"execute_chapters: {len(missing)} chapters to run, {args.workers} at a time", flush=True)
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    start, failed = time.perf_counter(), []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        jobs = {pool.submit(run, c.path, execute["timeout"], threads): c for c in missing}
        for job in as_completed(jobs):
            nb, seconds, error = job.result()
            chapter = jobs[job]
            print(f"  {chapter.relpath}: {'failed' if error else 'ok'} in {seconds:.0f} s",
                  flush=True)
            if error:
                failed.append(f"{chapter.relpath}:\n{error}")
                continue
            bundle = CacheBundleIn(nb, str(chapter.path), data={"execution_seconds": seconds})
            cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
    print(f"execute_chapters: done in {time.perf_counter() - start:.0f} s", flush=True)
    for message in failed:  # the build would stop on these too: say why now
        print(message, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
