"""Run every chapter that Colab opens on a GPU runtime with the GPU profile forced on the CPU, so
that every cell a GPU reader runs has run somewhere (`make gpu-profile`).

A chapter whose front matter says `attnbook: {gpu: true}` takes its sizes from
`attnbook.notebook.runtime()` (appendix A). With ATTNBOOK_PROFILE=gpu and ATTNBOOK_DEVICE=cpu it
uses the GPU's sizes, steps and lengths on the CPU. Each such notebook (notebooks/NN-slug.ipynb,
generated from its chapter) is executed top to bottom in a fresh kernel, in notebooks/, and
its record written to benchmarks/results/gpu-profile-on-cpu.json:

- `source_sha256`: the SHA-256 of chapters/NN-slug.md, so a stale record is seen;
- `status`: "ok", or the failing cell (its index, first line and error);
- `seconds`, and `glued`: every value the run recorded for the prose;
- `needs_gpu`: the cells with a branch that only a CUDA device takes (they mention `RUN.cuda`,
  `INTERPRETED` or `torch.cuda`): on the CPU they run their other branch, so they are listed
  for a GPU run (benchmarks/gpu_session.sh --chapters) to cover.

    python tools/gpu_chapters_on_cpu.py [NN ...] [--out FILE]   # default: every gpu: true chapter
    python tools/gpu_chapters_on_cpu.py --check                 # fail if a record is missing or stale

A run of some chapters keeps the other chapters' records.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import nbformat
import yaml
from tangle import glued_values  # every glued value of an executed notebook

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS, NOTEBOOKS = ROOT / "chapters", ROOT / "notebooks"
RECORD = ROOT / "benchmarks" / "results" / "gpu-profile-on-cpu.json"
PROFILE_ENV = {"ATTNBOOK_PROFILE": "gpu", "ATTNBOOK_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
               "MPLBACKEND": "Agg"}
# A cell with one of these takes a branch that only a CUDA device takes.
NEEDS_GPU = re.compile(r"\bRUN\.cuda\b|\bINTERPRETED\b|\btorch\.cuda\.")
SETUP_CELL = "# Setup. On Google Colab"  # the tangler's first cell, which reports the GPU
CELL_TIMEOUT = 3600  # seconds: the GPU's sizes on a CPU are slow by design


def gpu_chapters() -> list[Path]:
    """The chapters whose front matter asks Colab for a GPU runtime."""
    found = []
    for path in sorted(CHAPTERS.glob("*.md")):
        front = re.match(r"\A---\n(.*?)\n---\n", path.read_text(encoding="utf-8"), re.S)
        meta = yaml.safe_load(front.group(1)) if front else {}
        if (meta.get("attnbook") or {}).get("gpu") is True:
            found.append(path)
    return found


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def first_line(source: str) -> str:
    return next((line for line in source.splitlines() if line.strip()), "")[:100]


def gpu_cells(nb: nbformat.NotebookNode) -> list[dict]:
    return [{"cell": i, "first_line": first_line(cell.source)}
            for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and NEEDS_GPU.search(cell.source)
            and not cell.source.startswith(SETUP_CELL)]


def run(chapter: Path) -> dict:
    """Execute the chapter's notebook under the GPU profile: its record."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOKS / f"{chapter.stem}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    os.environ.update(PROFILE_ENV)  # the kernel inherits this process's environment
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start, status = time.perf_counter(), "ok"
    try:
        client.execute()
    except CellExecutionError as error:
        failed = next((i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                       and any(o.get("output_type") == "error" for o in cell.get("outputs", []))),
                      None)
        status = {"failed_cell": failed,
                  "first_line": first_line(nb.cells[failed].source) if failed is not None else "",
                  "error": str(error).strip().splitlines()[-1][:300]}
    return {"source_sha256": sha256(chapter), "status": status,
            "seconds": round(time.perf_counter() - start), "glued": glued_values(nb),
            "needs_gpu": gpu_cells(nb)}


def load() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}


def check(record: dict) -> list[str]:
    problems = []
    for chapter in gpu_chapters():
        entry = record.get("chapters", {}).get(chapter.stem)
        if entry is None:
            problems.append(f"{chapter.stem}: no GPU-profile record (make gpu-profile)")
        elif entry["source_sha256"] != sha256(chapter):
            problems.append(f"{chapter.stem}: the chapter changed since its GPU-profile run "
                            f"(make gpu-profile ONLY={chapter.stem[:2]})")
        elif entry["status"] != "ok":
            problems.append(f"{chapter.stem}: failed under the GPU profile: {entry['status']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="chapter prefixes, e.g. 07 12")
    parser.add_argument("--check", action="store_true", help="fail on a missing or stale record")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(load())
        print("\n".join(problems) or "gpu-profile: every record is current")
        return 1 if problems else 0
    chosen = [c for c in gpu_chapters() if not args.only or c.stem.startswith(tuple(args.only))]
    if not chosen:
        raise SystemExit(f"no gpu: true chapter starts with {args.only}")
    import torch

    failed = False
    for chapter in chosen:
        print(f"gpu-profile: {chapter.stem} ...", flush=True)
        entry = run(chapter)
        record = load()  # read again: another run may have recorded other chapters meanwhile
        current = {c.stem for c in gpu_chapters()}  # a renamed or split chapter's old entry goes
        record["chapters"] = {k: v for k, v in record.get("chapters", {}).items() if k in current}
        record["chapters"][chapter.stem] = entry
        record["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cpus": os.cpu_count(), "env": PROFILE_ENV}
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        failed |= entry["status"] != "ok"
        print(f"gpu-profile: {chapter.stem}: {entry['status']} in {entry['seconds']} s, "
              f"{len(entry['needs_gpu'])} cells with a branch for a CUDA device", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
