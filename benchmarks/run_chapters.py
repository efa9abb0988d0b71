"""Run every chapter as a plain Python script, so that its GPU path runs: gpu_session.sh --chapters.

A GPU machine lent for a short while may have PyTorch, Triton and the chapters' libraries but no
Jupyter, no jupytext and no network. So each notebook (notebooks/NN-slug.ipynb, which the tangler
generates from chapters/NN-slug.md) is turned into a script with the standard library alone: its
code cells in order, without the setup cell (which installs the package on Colab and reads the
installed package's version: here the package comes from code/ on PYTHONPATH), IPython's `%` and
`!` lines commented out. Each script runs in notebooks/, as the notebook does, with a time limit;
the run stops starting chapters when its budget is spent. It writes OUT/chapters.csv (chapter,
status, seconds) and OUT/scripts/, and exits non-zero if any chapter failed.

    python benchmarks/run_chapters.py --out DIR [--budget 330] [NN ...]   # prefixes: 03 12 a1
    python benchmarks/run_chapters.py --small --out DIR                   # a CPU dry run: 01
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SETUP_CELL = "# Setup. On Google Colab"  # how the tangler's setup cell starts


def script(notebook: Path) -> str:
    """The notebook's code cells as one Python script, without the setup cell and magics."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    parts = []
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.startswith(SETUP_CELL):
            continue
        parts.append("\n".join("# " + line if line.lstrip().startswith(("%", "!")) else line
                               for line in source.splitlines()))
    return "\n\n".join(parts) + "\n"


def run(path: Path, timeout: float) -> tuple[str, float, str]:
    """Run one script in notebooks/: (status, seconds, the end of its output)."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(path)], cwd=NOTEBOOKS, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stderr or b"")[-1500:]
        return "timeout", time.perf_counter() - start, tail.decode(errors="replace") \
            if isinstance(tail, bytes) else tail
    status = "ok" if done.returncode == 0 else f"failed ({done.returncode})"
    return status, time.perf_counter() - start, (done.stderr if done.returncode else "")[-1500:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="chapters whose names start so (all)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="CPU dry run: chapter 1 alone")
    parser.add_argument("--budget", type=float, default=330, help="seconds for all chapters")
    parser.add_argument("--timeout", type=float, default=200, help="seconds for one chapter")
    args = parser.parse_args(argv)
    prefixes = args.prefixes or (["01"] if args.small else [""])
    notebooks = [nb for nb in sorted(NOTEBOOKS.glob("*.ipynb"))
                 if any(nb.stem.startswith(p) for p in prefixes)]
    if not notebooks:
        parser.error(f"no notebook in {NOTEBOOKS} starts with {prefixes}")
    (args.out / "scripts").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MPLBACKEND", "Agg")
    start, rows = time.perf_counter(), []
    for notebook in notebooks:
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            rows.append((notebook.stem, "not run: the budget was spent", 0.0))
            print(f"{notebook.stem:<32} not run: the budget was spent", flush=True)
            continue
        path = args.out / "scripts" / f"{notebook.stem}.py"
        path.write_text(script(notebook), encoding="utf-8")
        status, seconds, tail = run(path, min(args.timeout, left))
        rows.append((notebook.stem, status, seconds))
        print(f"{notebook.stem:<32} {status:<12} {seconds:7.1f} s", flush=True)
        if tail:
            print("    " + tail.strip().replace("\n", "\n    "), flush=True)
    with (args.out / "chapters.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["chapter", "status", "seconds"])
        writer.writerows((name, status, f"{seconds:.1f}") for name, status, seconds in rows)
    print(f"wrote {args.out / 'chapters.csv'}: {sum(r[1] == 'ok' for r in rows)} of {len(rows)} "
          f"chapters ok in {time.perf_counter() - start:.0f} s")
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
