"""attnbook.compile_check (appendix D): the kernels compiled ahead of time for GPUs we lack.

Triton compiles for a T4, an A100 and an H100 on the CPU, and ptxas reports the machine code's
registers and spills. These tests hold the launcher's tile table to the rule the chapter states,
so a change to a kernel that makes it spill, or no longer fit a T4, fails here without a GPU.

Compiling is slow (from under a second to half a minute per kernel and GPU: ptxas is slow on
kernels that spill), so the module compiles each request once, and only those that can change
what a test checks (see _tile_table_plan), and only as far as the test reads: where a rule reads
nothing but the shared memory (the T4's tiles), a shared_only request stops before LLVM and
ptxas. The `compiler` fixture gathers the requests of the selected tests and compiles them in as
few batches as it can. compile_kernels keeps each report
in the folder ATTNBOOK_COMPILE_CACHE names (here _build/compile-check/ unless it names another;
`make clean` removes it) under a key made of the request, the source of attnbook.kernels and
attnbook.compile_check, what Triton keys its own cache on (its sources and library, ptxas's
version, the environment variables it lists) and the Python version. A repeated run reads the
reports back, and so does appendix D's notebook when `make test` runs it after this module; a
fresh clone, or any change to the kernels, to compile_check or to Triton, compiles again.
ATTNBOOK_COMPILE_CACHE= (empty) turns the disk cache off.

The tile table and the launch settings were chosen with the Triton that requirements.txt pins,
and another release allocates registers differently. So what the compiler decides (spills, shared
memory, tensor cores) is asserted under that Triton only. Under any other, the same requests are
compiled and compared with the same rule, and what breaks it is this Triton's compile report: the
test is marked xfail with the report's summary, the whole report is given as a
CompileReportWarning and written to _build/compile-report-triton-<version>.txt, and the package's
tests pass on a release nobody here chose. README, "Tested versions", says how such a report
becomes a new tile table.
"""

import json
import os
import re
import sys
import threading
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton (the triton extra) has wheels for Linux only")

from attnbook import compile_check, kernels  # noqa: E402
from attnbook.compile_check import (  # noqa: E402
    GPUS,
    KERNELS,
    SHARED_MEMORY,
    Compiled,
    choose_tiles,
    compile_kernels,
    largest_tiles,
)

HEAD_DIMS = (16, 32, 64, 128)
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "_build" / "compile-check"


def _tile_rows(kernel, head_dim, element_size) -> int:
    """The launcher's tile for `kernel`, `head_dim` and `element_size`."""
    return kernels.TILE_ROWS[kernel, element_size][head_dim]


def _request(kernel, gpu, dtype, head_dim, causal=True, block=None, block_n=None, warps=None,
             stages=None, wide=False, shared_only=False) -> dict:
    """A request with its defaults filled in as compile_kernels fills them (block None: the
    launcher's settings on that GPU; a block alone: square tiles, 4 warps, 2 stages), so that
    equal compilations have equal requests."""
    return compile_check._checked(dict(kernel=kernel, gpu=gpu, dtype=dtype, head_dim=head_dim,
                                       causal=causal, block=block, block_n=block_n, warps=warps,
                                       stages=stages, wide=wide, shared_only=shared_only))


def _clean(r: Compiled) -> bool:
    """What choose_tiles asks of one compiled candidate: it fits the GPU's shared memory, and
    spills nothing unless the GPU is the T4 (whose report may therefore be shared_only)."""
    return r.fits and (r.gpu == "T4" or r.spill_bytes == 0)


class _Compiler:
    """compile_kernels, remembered for the session (and across runs by compile_kernels itself,
    in the folder that ATTNBOOK_COMPILE_CACHE names)."""

    def __init__(self):
        self.reports = {}

    def __call__(self, requests: list[dict]) -> list[Compiled]:
        keys = [json.dumps(_request(**r), sort_keys=True) for r in requests]
        # key -> the request as given (block None stays None for compile_kernels)
        todo = {key: r for key, r in zip(keys, requests) if key not in self.reports}
        for key, report in zip(todo, compile_kernels(list(todo.values()))):
            # compile_kernels reports what _request filled in (block None: the launcher's tile)
            assert {f: getattr(report, f) for f in json.loads(key)} == json.loads(key), report
            self.reports[key] = report
        return [self.reports[key] for key in keys]


def _tile_table_plan(dtype: str):
    """The fewest compilations that prove TILE_ROWS for `dtype`: (own, larger).

    TILE_ROWS holds, for each kernel and head dimension, the largest square tile of 64 and 32
    rows (4 warps, 2 stages) that is clean on every GPU, and 16 where neither is. A larger tile,
    or a wider head, holds more in shared memory and in registers, never less (the chapter's
    report and test_report_describes_the_compiled_kernel show it), so it is enough to show, for
    each tile t that a kernel's row of the table holds, that t is clean on every GPU at the
    widest head that takes t (`own`, when t is 64 or 32), and that 2t is not clean on some GPU
    at the narrowest head that takes t (`larger`, (dtype, kernel, head_dim, 2t), when t < 64).
    The rule reads only the T4's shared memory, so the T4 compiles shared_only (no LLVM, PTX or
    ptxas: its spilling tiles took up to a minute each).
    """
    own, larger = [], []
    for kernel in KERNELS:
        tiles = [_tile_rows(kernel, d, ELEMENT_SIZE[dtype]) for d in HEAD_DIMS]
        assert tiles == sorted(tiles, reverse=True), (kernel, tiles)  # wider heads, smaller tiles
        for t in sorted(set(tiles)):
            heads = [d for d, tile in zip(HEAD_DIMS, tiles) if tile == t]
            if t in (64, 32):
                own += [_request(kernel, g, dtype, max(heads), block=t, shared_only=g == "T4")
                        for g in GPUS]
            if t < 64:
                larger.append((dtype, kernel, min(heads), 2 * t))
    return own, larger


def _locked_triton(lock: Path) -> str | None:
    """The Triton that the lock pins (None without a lock, as in a bare copy of the tests)."""
    found = lock.exists() and re.search(r"^triton==(\S+)$", lock.read_text(), re.MULTILINE)
    return found.group(1) if found else None


# The tile table and the launch settings were derived with the Triton of the lock: another
# release allocates registers differently (Triton 3.6 spills 8 B in the A100's dK/dV kernel at
# D=128, 3.9 some float32 tiles that fit with 3.7), so under it they are compared, not asserted.
LOCKED_TRITON = _locked_triton(ROOT / "requirements.txt")
TRITON = kernels.triton.__version__
REPORT_FILE = ROOT / "_build" / f"compile-report-triton-{TRITON}.txt"
# The newer releases that the launch settings (LAUNCH, WIDE_LAUNCH) were also compiled clean
# with: a spill of one of them fails there too (appendix D). 3.9.0 spilled 16 to 24 B
# in the dK, dV kernel at D = 128 with LAUNCH's former 64 x 64 tiles and 8 warps.
TUNED_TRITONS = ("3.9.0",)


_REPORTED: set[Path] = set()  # the report files this run has begun


class CompileReportWarning(UserWarning):
    """What another Triton than the lock's compiles differently from the rule the tests hold."""


def _describe(r: Compiled) -> str:
    """One line of the compile report."""
    shared = (f"{'WIDE ' if r.wide else ''}{r.kernel:7} {r.gpu:4} {r.dtype:8} D={r.head_dim:<3} "
              f"{r.block}x{r.block_n} "
              f"warps {r.warps} stages {r.stages}: {r.shared_bytes} B shared of "
              f"{SHARED_MEMORY[r.gpu]}")
    if r.shared_only:
        return f"{shared} (compiled for the shared memory only)"
    return (f"{shared}, {r.registers} registers, {r.spill_bytes} B spilled, "
            f"{'tensor cores' if r.tensor_cores else 'no tensor cores'}")


def _hold(rule: str, broken: list[str], triton: str = TRITON, locked: str | None = LOCKED_TRITON,
          report_file: Path = REPORT_FILE, also: tuple = ()) -> None:
    """`broken`, the report's lines that break `rule`, fail the test under the lock's Triton
    and the releases in `also`. Under another they are that Triton's compile report: given in
    full as a CompileReportWarning and in report_file, and the test is xfailed with its summary."""
    if not broken:
        return
    if triton == locked or triton in also:
        which = "the locked Triton" if triton == locked else "Triton"
        pytest.fail(f"{rule}, under {which} {triton}:\n" + "\n".join(broken))
    report = (f"Triton {triton} (the lock pins {locked}): {len(broken)} compiled kernels break "
              f"the rule '{rule}':\n" + "\n".join(broken))
    report_file.parent.mkdir(parents=True, exist_ok=True)
    with report_file.open("a" if report_file in _REPORTED else "w") as f:  # this run's report
        f.write(report + "\n\n")
    _REPORTED.add(report_file)
    warnings.warn(report, CompileReportWarning, stacklevel=2)
    where = report_file.relative_to(ROOT) if report_file.is_relative_to(ROOT) else report_file
    pytest.xfail(f"Triton {triton} is not the lock's {locked}: {len(broken)} break '{rule}' "
                 f"(the report: {where})")


# The GPUs a larger tile is tried on, one after the other until one rejects it: the A100 rejects
# most (spills), the H100 the few that the A100 accepts, the T4 by its shared memory only.
REJECTS_FIRST = ("A100", "H100", "T4")


def _larger_tiles(compiler, larger) -> list[Compiled]:
    """Larger tiles (dtype, kernel, head_dim, block), each compiled GPU by GPU in the order of
    REJECTS_FIRST until one rejects it (or all accept it): one batch per GPU, for all of them."""
    compiled, pending = [], list(larger)
    for gpu in REJECTS_FIRST:
        reports = compiler([_request(k, gpu, t, d, block=b, shared_only=gpu == "T4")
                            for t, k, d, b in pending])
        compiled += reports
        pending = [c for c, r in zip(pending, reports) if _clean(r)]
    return compiled


# bfloat16 at the head dimensions LAUNCH names (16 and 32 take 64's settings, and need less).
BFLOAT16 = [dict(kernel=kernel, gpu=gpu, dtype="bfloat16", head_dim=d)
            for kernel in KERNELS for d in (64, 128) for gpu in ("A100", "H100")]
# Every candidate of kernels.LAUNCH, in float16, at the head dimensions that its entries name.
LAUNCH_CANDIDATES = [
    dict(kernel=kernel, gpu=gpu, dtype="float16", head_dim=d, block=m, block_n=n, warps=w,
         stages=s)
    for (capability, kernel), by_dim in kernels.LAUNCH.items() for d, settings in by_dim.items()
    for m, n, w, s in settings for gpu in GPUS if GPUS[gpu] == capability]
REPORT = [dict(kernel="forward", gpu="H100", dtype="float16", head_dim=64, causal=False,
               block=32),
          dict(kernel="forward", gpu="H100", dtype="float16", head_dim=64, causal=False,
               block=64)]
FLOAT32_DQ = [dict(kernel="dq", gpu="A100", dtype="float32", head_dim=16, block=None)]
# The dK, dV kernel as a 32-bit and as a WIDE launch, at one setting.
WIDE = [dict(kernel="dkdv", gpu="H100", dtype="float16", head_dim=128, block=32, block_n=32,
             warps=4, stages=3, wide=wide) for wide in (False, True)]
# Every candidate of a WIDE launch (64-bit rows), in float16: WIDE_LAUNCH's where it has them.
WIDE_CANDIDATES = [
    dict(kernel=kernel, gpu=gpu, dtype="float16", head_dim=d, block=m, block_n=n, warps=w,
         stages=s, wide=True)
    for capability, kernel in kernels.LAUNCH for d in (64, 128)
    for m, n, w, s in kernels.launch_settings(kernel, 2, d, capability, wide=True)
    for gpu in GPUS if GPUS[gpu] == capability]
# float32 on the T4, at the launcher's settings (the portable tiles): appendix D's second report.
FLOAT32_T4 = [dict(kernel=kernel, gpu="T4", dtype="float32", head_dim=d)
              for kernel in KERNELS for d in HEAD_DIMS]
# float16 on the T4, compiled in full elsewhere: at the launcher's settings, and the portable
# dK, dV tile of D = 128 that appendix D compiles (the tile table's own T4 request).
T4_FLOAT16 = [r for r in LAUNCH_CANDIDATES if r["gpu"] == "T4"] + [
    dict(kernel="dkdv", gpu="T4", dtype="float16", head_dim=128, block=32)]
# Full compiles (the T4's, two of the H100's) beside their shared_only twins.
SHARED_ONLY = [twin for r in FLOAT32_T4 + T4_FLOAT16 + REPORT
               for twin in (r, dict(r, shared_only=True))]


@pytest.fixture(scope="module")
def compiler(request):
    """One _Compiler for the module. It has compiled, in as few batches as it can, what the
    selected tests of the module compile: their own requests in one batch with the first GPU of
    every larger tile, then the larger tiles that GPU accepted, on the next GPU, and so on."""
    compiler = _Compiler()
    first, larger = [], []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:  # nbval cells have none
            continue
        name = getattr(item, "originalname", item.name)
        if name == "test_tile_table_is_the_largest_tile_that_compiles_cleanly":
            own, more = _tile_table_plan(item.callspec.params["dtype"])
            first += own + [_request(k, REJECTS_FIRST[0], t, d, block=b) for t, k, d, b in more]
            larger += more
        first += {"test_bfloat16_compiles_as_cleanly_as_float16_on_gpus_that_have_it": BFLOAT16,
                  "test_every_launch_candidate_compiles_cleanly_on_its_gpu": LAUNCH_CANDIDATES,
                  "test_report_describes_the_compiled_kernel": REPORT,
                  "test_float32_products_do_not_use_tensor_cores": FLOAT32_DQ,
                  "test_wide_requests_compile_the_64_bit_rows": WIDE,
                  "test_every_wide_launch_candidate_compiles_cleanly_on_its_gpu": WIDE_CANDIDATES,
                  "test_float32_kernels_fit_the_t4_and_spill_nothing": FLOAT32_T4,
                  "test_shared_only_reports_the_shared_memory_of_a_full_compile": SHARED_ONLY,
                  }.get(name, [])
    # compile_kernels deals the requests out to its processes in turn: the slowest first (the
    # larger tiles, which spill heavily, biggest first), so that they are dealt out evenly
    first.sort(key=lambda r: -(r.get("block") or 0) ** 2 * r["head_dim"])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ATTNBOOK_COMPILE_CACHE", os.environ.get("ATTNBOOK_COMPILE_CACHE", str(CACHE)))
        compiler(first)
        _larger_tiles(compiler, larger)  # only the second GPU on: the first was in the batch
    return compiler


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_tile_table_is_the_largest_tile_that_compiles_cleanly(dtype, compiler):
    own, larger = _tile_table_plan(dtype)
    broken = []
    for r in compiler(own):  # every tile of 64 or 32 rows is clean on every GPU
        assert r.block == r.block_n == _tile_rows(r.kernel, r.head_dim, ELEMENT_SIZE[dtype]), r
        if not _clean(r):
            broken.append(f"the table's tile: {_describe(r)}")
    compiled = _larger_tiles(compiler, larger)
    for _, kernel, d, b in larger:  # the next larger tile breaks the rule on some GPU
        tried = [r for r in compiled if (r.kernel, r.head_dim, r.block) == (kernel, d, b)]
        if all(_clean(r) for r in tried):
            broken += [f"a larger tile, clean on every GPU: {_describe(r)}" for r in tried]
    _hold(f"TILE_ROWS[{dtype}] holds the largest clean tile", broken)


def test_largest_tiles_applies_choose_tiles_to_every_candidate(monkeypatch):
    # largest_tiles without the compiler: it asks for the 64- and 32-row tiles of every kernel
    # and head dimension on every GPU, and returns choose_tiles of what comes back.
    asked = []

    def fake_compile(requests, workers=None):
        asked.extend(_request(**r) for r in requests)
        return [Compiled(**_request(**r), shared_bytes=(65 if (r["kernel"], r["gpu"], r["block"])
                                                        == ("forward", "T4", 64) else 16) * 1024,
                         **_measured(r["gpu"] == "T4", spill_bytes=8 if (
                             r["kernel"], r["gpu"], r["block"]) == ("dkdv", "H100", 64) else 0))
                for r in requests]

    monkeypatch.setattr(compile_check, "compile_kernels", fake_compile)
    chosen = largest_tiles("float32")
    assert sorted(map(json.dumps, asked)) == sorted(
        json.dumps(_request(k, g, "float32", d, block=b, shared_only=g == "T4"))
        for k in KERNELS for d in HEAD_DIMS for b in (64, 32) for g in GPUS)
    assert chosen == {(k, d): 64 if k == "dq" else 32 for k in KERNELS for d in HEAD_DIMS}


def _measured(shared_only, registers=128, spill_bytes=0, tensor_cores=True) -> dict:
    """What ptxas reports, or for a shared_only report the Nones that stand for it."""
    if shared_only:
        return dict(registers=None, spill_bytes=None, tensor_cores=None)
    return dict(registers=registers, spill_bytes=spill_bytes, tensor_cores=tensor_cores)


def _fake(gpu, block, shared_kb=16, spill=0):
    return Compiled("dq", gpu, "float16", 64, True, block, block, 4, 2, shared_kb * 1024, 100,
                    spill, True)


def _on_all(block, **t4):
    return [_fake("T4", block, **t4), _fake("A100", block), _fake("H100", block)]


def test_choose_tiles_states_the_chapters_rule():
    assert choose_tiles(_on_all(64) + _on_all(32)) == {("dq", 64): 64}
    # a spill on the T4 does not count; the T4's shared memory does
    assert choose_tiles(_on_all(64, spill=100) + _on_all(32)) == {("dq", 64): 64}
    assert choose_tiles(_on_all(64, shared_kb=65) + _on_all(32)) == {("dq", 64): 32}
    # a spill on a large GPU rules a tile out; with no clean tile, 16
    spilling = [_fake("T4", 32), _fake("A100", 32, spill=4), _fake("H100", 32)]
    assert choose_tiles(_on_all(64, shared_kb=65) + spilling) == {("dq", 64): 16}
    # a tile that was not compiled is not chosen
    assert choose_tiles(_on_all(32)) == {("dq", 64): 32}
    # the T4's shared memory alone is enough: a shared_only report of it counts as a full one
    t4_part = [replace(r, **_measured(True), shared_only=True) if r.gpu == "T4" else r
               for r in _on_all(64, shared_kb=65) + _on_all(32)]
    assert choose_tiles(t4_part) == {("dq", 64): 32}
    assert choose_tiles(t4_part[3:]) == {("dq", 64): 32}


def test_the_gpus_whose_spills_are_ignored_are_named_once(monkeypatch):
    """The T4 was written out three times (what choose_tiles refuses, what it reads, what
    largest_tiles asks for): a change to the rule needed three edits."""
    monkeypatch.setattr(compile_check, "SPILLS_IGNORED", frozenset({"T4", "A100"}))
    a100_part = [replace(r, **_measured(True), shared_only=True) if r.gpu == "A100" else r
                 for r in _on_all(64) + _on_all(32)]
    assert choose_tiles(a100_part) == {("dq", 64): 64}  # a shared_only A100 report is taken
    spilling = [_fake("T4", 64), _fake("A100", 64, spill=4), _fake("H100", 64)]
    assert choose_tiles(spilling) == {("dq", 64): 64}  # and the A100's spills are not read
    asked = []
    monkeypatch.setattr(compile_check, "compile_kernels", lambda c, workers: asked.extend(c) or [])
    compile_check.largest_tiles("float16", head_dims=(64,), kernels=("dq",))
    assert {r["gpu"] for r in asked if r["shared_only"]} == {"T4", "A100"} and len(asked) == 6


def test_choose_tiles_refuses_a_full_report_without_spills():
    # Before, a full A100 report with spill_bytes None counted as spilling: 16 rows, silently.
    unmeasured = replace(_fake("A100", 64), **_measured(True))
    with pytest.raises(ValueError, match="full report for the A100 with spill_bytes None"):
        choose_tiles([_fake("T4", 64), unmeasured, _fake("H100", 64)])


def test_choose_tiles_refuses_mixed_dtypes_and_rectangular_tiles():
    # Before, a float16 64-row tile that spilled beside a float32 32-row one gave 32 rows, a
    # tile never compiled in float16; and a 64x16 tile was taken for a 64x64 one.
    fp16_64 = _fake("A100", 64, spill=4)
    fp32_32 = replace(_fake("A100", 32), dtype="float32")
    with pytest.raises(ValueError, match="compiled must hold square tiles of one dtype, got "
                       "32x32 rows of float32 beside float16"):
        choose_tiles([fp16_64, fp32_32])
    with pytest.raises(ValueError, match="got 64x16 rows of float16"):
        choose_tiles([replace(_fake("A100", 64), block_n=16)])


@pytest.mark.parametrize("call, error, message", [
    (lambda: choose_tiles([replace(_fake("A100", 64), gpu="V100")]), ValueError,
     "compiled gpu must be one of .*, got compiled gpu='V100'"),
    (lambda: choose_tiles([{"gpu": "T4"}]), TypeError, "compiled item must be an instance of"),
    (lambda: choose_tiles(None), TypeError, "compiled must be an instance of list"),
    (lambda: choose_tiles([replace(_fake("H100", 64), **_measured(True), shared_only=True)]),
     ValueError, "compiled holds a shared_only report for the H100, whose spills choose_tiles"),
    (lambda: compile_kernels(None), TypeError, "requests must be an instance of list"),
    (lambda: largest_tiles("float16", head_dims=64), TypeError,
     "head_dims must be an instance of tuple or list, got head_dims=64"),
    (lambda: largest_tiles("float16", kernels="forward"), TypeError,
     "kernels must be an instance of tuple or list, got kernels='forward'"),
])
def test_bad_tile_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_tuple_of_results_or_requests_is_taken_as_a_list():
    # the first argument checks took only a list; any sequence worked before them
    assert choose_tiles(()) == choose_tiles([]) == {}
    assert compile_kernels(()) == []


def test_bfloat16_compiles_as_cleanly_as_float16_on_gpus_that_have_it(compiler):
    broken = []
    for r in compiler(BFLOAT16):
        assert (r.block, r.block_n, r.warps, r.stages) == kernels.launch_settings(
            r.kernel, 2, r.head_dim, GPUS[r.gpu])[0]
        if not (r.fits and r.spill_bytes == 0 and r.tensor_cores):
            broken.append(_describe(r))
    _hold("bfloat16 fits, spills nothing and uses tensor cores", broken, also=TUNED_TRITONS)


# What a GPU of compute capability 8.6 or 8.9 (RTX 30 and 40, A10, L4) gives one program; it
# takes the A100's settings, so their defaults must fit there too.
SM86_SHARED_MEMORY = 99 * 1024


def test_every_launch_candidate_compiles_cleanly_on_its_gpu(compiler):
    assert len(LAUNCH_CANDIDATES) >= len(kernels.LAUNCH) * 2  # two head dimensions per entry
    broken = []
    for r in compiler(LAUNCH_CANDIDATES):
        clean = r.fits and r.spill_bytes == 0
        clean &= r.tensor_cores == (r.gpu != "T4")  # the T4's tl.dot: no tensor cores here
        if r.gpu == "A100" and (r.block, r.block_n, r.warps, r.stages) == kernels.LAUNCH[
                80, r.kernel][r.head_dim][0]:
            clean &= r.shared_bytes <= SM86_SHARED_MEMORY
        if not clean:
            broken.append(_describe(r))
    _hold("every launch candidate fits, spills nothing, uses tensor cores but on the T4, and the "
          "A100's first fits an RTX 30 or 40", broken, also=TUNED_TRITONS)


def test_every_wide_launch_candidate_compiles_cleanly_on_its_gpu(compiler):
    """A tensor of 2**31 elements or more makes a WIDE launch, which compiles other code (64-bit
    rows): its candidates are held to the rule of the 32-bit ones. Before WIDE_LAUNCH, the dK, dV
    kernel spilled there with LAUNCH's settings (Triton 3.7.1: 16 B at D = 128 on the A100 and
    the H100, 8 B at D = 64 on the A100)."""
    broken = []
    for r in compiler(WIDE_CANDIDATES):
        assert r.wide
        if not (r.fits and r.spill_bytes == 0 and r.tensor_cores == (r.gpu != "T4")):
            broken.append(_describe(r))
    _hold("every WIDE launch candidate fits, spills nothing and uses tensor cores but on the T4",
          broken, also=TUNED_TRITONS)


def test_report_describes_the_compiled_kernel(compiler):
    small, large = compiler(REPORT)
    assert (small.kernel, small.gpu, small.dtype, small.head_dim, small.causal, small.block) == (
        "forward", "H100", "float16", 64, False, 32)
    # A larger tile needs more shared memory for its K and V tiles, and more registers.
    assert 0 < small.shared_bytes < large.shared_bytes <= SHARED_MEMORY["H100"]
    assert 0 < small.registers <= large.registers <= 255
    assert small.tensor_cores and large.tensor_cores


def test_float32_products_do_not_use_tensor_cores(compiler):
    # input_precision="ieee" asks for true float32 products: no TF32 tensor-core instructions.
    (r,) = compiler(FLOAT32_DQ)  # block None: the launcher's tile
    assert not r.tensor_cores
    assert r.block == _tile_rows("dq", 16, 4)


def test_wide_requests_compile_the_64_bit_rows(compiler):
    # The same kernel and settings with WIDE set: the report says so, and the compiler's report
    # differs from the 32-bit one's (64-bit row offsets take other registers).
    narrow, wide = compiler(WIDE)
    assert (narrow.wide, wide.wide) == (False, True)
    assert (narrow.block, narrow.block_n, narrow.warps) == (wide.block, wide.block_n, wide.warps)
    assert (narrow.registers, narrow.spill_bytes) != (wide.registers, wide.spill_bytes)


def test_float32_kernels_fit_the_t4_and_spill_nothing(compiler):
    # Chapter 15 and appendix D say that the T4 runs the float32 kernels at the portable tiles
    # without spilling; choose_tiles holds those tiles to the T4's shared memory only.
    broken = []
    for r in compiler(FLOAT32_T4):
        assert r.block == _tile_rows(r.kernel, r.head_dim, 4)  # the launcher's tile
        if not (r.fits and r.spill_bytes == 0):
            broken.append(_describe(r))
    _hold("float32 on the T4 fits and spills nothing", broken)


def test_shared_only_reports_the_shared_memory_of_a_full_compile(compiler):
    # shared_only stops before LLVM, PTX and ptxas, where the full compile reads shared memory
    # off its third stage: the two agree, and the shared_only report claims nothing else.
    reports = compiler(SHARED_ONLY)
    for full, part in zip(reports[::2], reports[1::2]):
        assert not full.shared_only and part.shared_only
        assert part == replace(full, registers=None, spill_bytes=None, tensor_cores=None,
                               shared_only=True)
    assert {(r.gpu, r.dtype) for r in reports} == {("T4", "float32"), ("T4", "float16"),
                                                   ("H100", "float16")}


def _spilling(gpu="A100", spill=8):
    return Compiled("dkdv", gpu, "float16", 128, True, 64, 64, 8, 2, 74240, 255, spill, True)


def test_hold_fails_under_the_locked_triton():
    _hold("spills nothing", [], triton="3.7.1", locked="3.7.1")  # nothing broken: passes
    with pytest.raises(pytest.fail.Exception, match="spills nothing, under the locked Triton "
                       "3.7.1:\ndkdv    A100 float16  D=128 64x64 warps 8 stages 2: 74240 B"):
        _hold("spills nothing", [_describe(_spilling())], triton="3.7.1", locked="3.7.1")


def test_hold_reports_another_triton_without_failing(tmp_path):
    report_file = tmp_path / "report.txt"
    line = _describe(_spilling())
    assert line.endswith("255 registers, 8 B spilled, tensor cores")
    part = replace(_spilling(), registers=None, spill_bytes=None, tensor_cores=None,
                   shared_only=True)
    assert _describe(part) == line.split(", 255 registers")[0] + (
        " (compiled for the shared memory only)")
    with pytest.warns(CompileReportWarning, match="Triton 3.6.0 \\(the lock pins 3.7.1\\): 1 "
                      "compiled kernels break the rule 'spills nothing'") as caught:
        with pytest.raises(pytest.xfail.Exception, match="Triton 3.6.0 is not the lock's 3.7.1"):
            _hold("spills nothing", [line], triton="3.6.0", locked="3.7.1",
                  report_file=report_file)
    assert line in str(caught[0].message) and line in report_file.read_text()
    with pytest.raises(pytest.xfail.Exception), pytest.warns(CompileReportWarning):
        _hold("fits", [line], triton="3.6.0", locked="3.7.1", report_file=report_file)
    # one run's report holds both rules once; a report left by an earlier run is replaced
    assert report_file.read_text().count(line) == 2 and "rule 'fits'" in report_file.read_text()
    stale = tmp_path / "stale.txt"
    stale.write_text("an earlier run's report\n")
    with pytest.raises(pytest.xfail.Exception), pytest.warns(CompileReportWarning):
        _hold("fits", [line], triton="3.6.0", locked="3.7.1", report_file=stale)
    assert "earlier" not in stale.read_text() and line in stale.read_text()
    _hold("spills nothing", [], triton="3.6.0", locked="3.7.1", report_file=tmp_path / "none")
    assert not (tmp_path / "none").exists()  # nothing broken: nothing reported


def test_locked_triton_is_the_locks_pin(tmp_path):
    assert LOCKED_TRITON == _locked_triton(ROOT / "requirements.txt")
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\ntriton==3.7.1\n")
    assert _locked_triton(tmp_path / "requirements.txt") == "3.7.1"
    assert _locked_triton(tmp_path / "missing.txt") is None  # no lock: every Triton is compared


def test_gpus_are_named_with_their_limits():
    assert set(GPUS) == set(SHARED_MEMORY) == {"T4", "A100", "H100"}
    assert GPUS["T4"] < GPUS["A100"] < GPUS["H100"]


@pytest.mark.parametrize("request_, message", [
    (dict(kernel="backward", gpu="T4", dtype="float16", head_dim=64), "request kernel must be"),
    (dict(kernel="dq", gpu="V100", dtype="float16", head_dim=64), "request gpu must be"),
    (dict(kernel="dq", gpu="T4", dtype="float64", head_dim=64), "request dtype must be"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=48), "request head_dim must be"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, block=24), "request block must"),
    (dict(kernel="dq", gpu="T4", dtype="float16"), "must be a dict with kernel, gpu"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, threads=256),
     "request key must be one of"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, warps=3), "request warps must"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, stages=0), "request stages must"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, block_n=24),
     "request block_n must"),
    ("forward", "must be a dict with kernel, gpu"),
])
def test_bad_requests_are_refused_before_compiling(request_, message):
    with pytest.raises(ValueError, match=message):
        compile_kernels([request_])


def test_compiling_in_an_interpreting_process_is_refused():
    from attnbook.compile_check import _compile_here

    if not kernels.INTERPRETED:
        pytest.skip("the kernels are compiled in this process")
    with pytest.raises(RuntimeError, match="interpreted mode"):
        _compile_here("forward", "T4", "float16", 64, True, 64, 64, 4, 2, False, False)


# What the launcher passes for each parameter of a typical call, as a table written out by hand
# before the kinds were derived from the kernels: the derivation must reproduce it.
_QKV = ("stride_qb:i32/16 stride_qh:i32/16 stride_qm:i32/16 stride_qd:1 stride_kb:i32/16 "
        "stride_kh:i32/16 stride_kn:i32/16 stride_kd:1 stride_vb:i32/16 stride_vh:i32/16 "
        "stride_vn:i32/16 stride_vd:1")
_META = ("CAUSAL:constexpr BLOCK_M:constexpr BLOCK_N:constexpr HEAD_DIM:constexpr WIDE:constexpr "
         "TILES_FIRST:constexpr")
_BACKWARD = (f"Q:*T K:*T V:*T DO:*T LSE:*fp32 DELTA:*fp32 {_QKV} stride_dob:i32/16 "
             "stride_doh:i32/16 stride_dom:i32/16 stride_dod:1 H:i32 Lq:i32/16 Lk:i32/16 "
             "qk_scale:fp32 scale:fp32")
WRITTEN_OUT = {
    "forward": f"Q:*T K:*T V:*T O:*T LSE:*fp32 {_QKV} stride_ob:i32/16 stride_oh:i32/16 "
               f"stride_om:i32/16 stride_od:1 H:i32 Lq:i32/16 Lk:i32/16 qk_scale:fp32 {_META}",
    "dkdv": f"{_BACKWARD} DK:*T DV:*T stride_dkb:i32/16 stride_dkh:i32/16 stride_dkn:i32/16 "
            f"stride_dkd:1 {_META}",
    "dq": f"{_BACKWARD} DQ:*T stride_dqb:i32/16 stride_dqh:i32/16 stride_dqm:i32/16 "
          f"stride_dqd:1 {_META}",
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_parameter_kinds_come_from_the_kernel_in_its_order(kernel):
    kinds = compile_check.parameter_kinds(kernel)
    assert list(kinds) == kernels.TRITON_KERNELS[kernel].arg_names
    assert kinds == dict(p.split(":") for p in WRITTEN_OUT[kernel].split())


def test_a_parameter_no_rule_types_is_refused_by_name(monkeypatch):
    def _new_kernel(Q, K, weird, BLOCK_M: "tl.constexpr"):  # noqa: F821 (an annotation only)
        pass

    class Fake:
        fn = _new_kernel

    monkeypatch.setitem(kernels.TRITON_KERNELS, "forward", Fake)
    with pytest.raises(ValueError, match="kernel 'forward' has a parameter 'weird' that no rule"):
        compile_check.parameter_kinds("forward")
    with pytest.raises(ValueError, match="kernel must be one of"):
        compile_check.parameter_kinds("backward")


def test_signature_is_the_launchers_specialisation_of_a_typical_call():
    signature, constants, attrs = compile_check._signature("dq", "bfloat16")
    names = list(signature)
    assert signature["Q"] == signature["DQ"] == "*bf16" and signature["LSE"] == "*fp32"
    assert signature["H"] == signature["stride_qb"] == "i32" and signature["scale"] == "fp32"
    assert signature["stride_dqd"] == signature["HEAD_DIM"] == "constexpr"
    assert constants == {f"stride_{t}d": 1 for t in ("q", "k", "v", "do", "dq")}
    aligned = {names[i] for (i,) in attrs}
    assert {"Q", "DELTA", "DQ", "stride_kb", "stride_doh", "stride_dqm", "Lq", "Lk"} <= aligned
    assert not aligned & {"H", "scale", "qk_scale", "stride_qd", "CAUSAL"}


@pytest.mark.parametrize("request_, error, message", [
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, causal="yes"), TypeError,
     "request causal must be True or False, got request causal='yes'"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, wide=1), TypeError,
     "request wide must be True or False, got request wide=1"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, shared_only="yes"), TypeError,
     "request shared_only must be True or False, got request shared_only='yes'"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64.0), TypeError,
     "request head_dim must be an int, got request head_dim=64.0"),
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, block=True), TypeError,
     "request block must be an int, got request block=True"),
    (dict(kernel=None, gpu="T4", dtype="float16", head_dim=64), TypeError,
     "request kernel must be one of"),
])
def test_request_settings_are_checked_in_the_parent(request_, error, message):
    # Before, causal="yes" reached the child process and was compiled as a true CAUSAL.
    with pytest.raises(error, match=message):
        compile_kernels([request_])


@pytest.mark.parametrize("workers, error", [(0, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_workers_is_checked(workers, error):
    with pytest.raises(error, match="workers"):
        compile_kernels([dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64)], workers)


# A stand-in for the child process: it writes far more to stderr than a pipe holds before it
# answers on stdout. Reading the child's stdout to the end before its stderr would wait forever.
CHATTY_CHILD = """import json, sys
sys.stderr.write("warning\\n" * 200_000)
answers = [dict(r, shared_bytes=1024, registers=32, spill_bytes=0, tensor_cores=True)
           for r in json.load(sys.stdin)]
json.dump(answers, sys.stdout)
"""


def _use_child(tmp_path, monkeypatch, source: str) -> None:
    """compile_kernels' children run `source` instead of the compiler."""
    (tmp_path / "child.py").write_text(source)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "child.py"}"\n')
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))


def test_a_child_that_writes_much_to_stderr_does_not_deadlock(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNBOOK_COMPILE_CACHE", raising=False)  # compile, and keep nothing
    _use_child(tmp_path, monkeypatch, CHATTY_CHILD)
    requests = [dict(kernel=k, gpu="A100", dtype="float16", head_dim=64, block=32)
                for k in KERNELS]
    done = []
    worker = threading.Thread(target=lambda: done.append(compile_kernels(requests, workers=2)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "compile_kernels is stuck reading its children's output"
    assert [(r.kernel, r.block, r.registers) for r in done[0]] == [(k, 32, 32) for k in KERNELS]


# A stand-in for the child process that counts its requests in a file beside it.
COUNTING_CHILD = """import json, pathlib, sys
requests = json.load(sys.stdin)
with open(pathlib.Path(__file__).with_name("count"), "a") as f:
    f.write("x" * len(requests))
measured = dict(registers=32, spill_bytes=0, tensor_cores=True)
json.dump([dict(r, shared_bytes=1024, **dict.fromkeys(measured) if r["shared_only"] else measured)
           for r in requests], sys.stdout)
"""


def test_reports_are_kept_where_attnbook_compile_cache_says(tmp_path, monkeypatch):
    _use_child(tmp_path, monkeypatch, COUNTING_CHILD)
    compiled = lambda: (tmp_path / "count").read_text().count("x")  # noqa: E731
    first = [dict(kernel=k, gpu="A100", dtype="float16", head_dim=64, block=32) for k in KERNELS]
    monkeypatch.delenv("ATTNBOOK_COMPILE_CACHE", raising=False)
    assert compile_kernels(first, workers=2) == compile_kernels(first, workers=2)
    assert compiled() == 6  # no folder: every call compiles
    monkeypatch.setenv("ATTNBOOK_COMPILE_CACHE", str(tmp_path / "reports"))
    reports = compile_kernels(first, workers=2)
    assert compile_kernels(first[::-1], workers=2) == reports[::-1]
    assert compiled() == 6 + 3  # read back the second time, in the order asked
    # the launcher's settings left out or named (the H100's at D = 64): one compilation
    launcher = dict(kernel="dq", gpu="H100", dtype="float16", head_dim=64)
    assert compile_kernels([launcher]) == compile_kernels(
        [dict(launcher, block=64, block_n=64, warps=4, stages=3)]) and compiled() == 10
    kept = {json.loads(path.read_text())["kernel"]: path
            for path in (tmp_path / "reports").iterdir() if "H100" not in path.read_text()}
    for path in kept.values():
        path.write_text("{")  # damaged: compiled again
    assert compile_kernels(first) == reports and compiled() == 13
    forward = json.loads(kept["forward"].read_text())
    kept["dkdv"].write_text(json.dumps(forward))  # another request's report: compiled again
    kept["dq"].write_text(json.dumps(dict(forward, kernel="dq", registers="32")))  # a str: again
    assert compile_kernels(first) == reports and compiled() == 15
    for bad in (dict(forward, registers=-5), dict(forward, head_dim=64.0),
                dict(forward, causal=1), dict(forward, tensor_cores="no")):
        kept["forward"].write_text(json.dumps(bad))  # equal in Python, not as JSON: again
        assert compile_kernels(first) == reports
    assert compiled() == 15 + 4
    monkeypatch.setenv("DISABLE_PTXAS_OPT", "1")  # a setting Triton's own cache is keyed on
    assert compile_kernels(first) == reports and compiled() == 22
    monkeypatch.setenv("PTXAS_OPTIONS", "-O0")  # one it leaves out, which ptxas reads
    assert compile_kernels(first) == reports and compiled() == 25
    monkeypatch.setenv("ATTNBOOK_COMPILE_CACHE", str(kept["forward"]))  # a file: refused by name
    with pytest.raises(ValueError, match="ATTNBOOK_COMPILE_CACHE=.* must name a folder"):
        compile_kernels(first)
    monkeypatch.setenv("ATTNBOOK_COMPILE_CACHE", str(tmp_path / "reports"))
    monkeypatch.setattr(os, "access", lambda *args: False)  # a folder this user cannot write
    with pytest.raises(ValueError, match="ATTNBOOK_COMPILE_CACHE=.* must name a folder"):
        compile_kernels(first)


def test_a_shared_only_report_is_never_read_back_as_a_full_one(tmp_path, monkeypatch):
    _use_child(tmp_path, monkeypatch, COUNTING_CHILD)
    monkeypatch.setenv("ATTNBOOK_COMPILE_CACHE", str(tmp_path / "reports"))
    compiled = lambda: (tmp_path / "count").read_text().count("x")  # noqa: E731
    full = dict(kernel="forward", gpu="T4", dtype="float16", head_dim=128, block=64)
    part = dict(full, shared_only=True)
    reports = compile_kernels([full, part])
    assert [r.shared_only for r in reports] == [False, True] and compiled() == 2
    assert (reports[1].registers, reports[1].spill_bytes, reports[1].tensor_cores) == (None,) * 3
    assert compile_kernels([part, full]) == reports[::-1] and compiled() == 2  # both kept
    paths = dict(zip(("full", "part"), compile_check._report_paths(
        [compile_check._checked(full), compile_check._checked(part)])))
    assert paths["full"] != paths["part"]
    kept = {name: json.loads(path.read_text()) for name, path in paths.items()}
    paths["full"].write_text(json.dumps(kept["part"]))  # a shared_only report where a full one
    assert compile_kernels([full]) == reports[:1] and compiled() == 3  # belongs: compiled again
    paths["part"].write_text(json.dumps(kept["full"]))  # and the other way round
    assert compile_kernels([part]) == reports[1:] and compiled() == 4
    for bad in (dict(kept["part"], registers=32), dict(kept["part"], shared_bytes=None),
                dict(kept["full"], tensor_cores=None), dict(kept["full"], spill_bytes=None)):
        paths["part" if bad["shared_only"] else "full"].write_text(json.dumps(bad))
        assert compile_kernels([part, full]) == reports[::-1]  # measured where unknown, or the
    assert compiled() == 4 + 4  # other way round: compiled again


# A child under a Triton that renamed one of the passes _shared_memory names (Triton's own
# stage still finds it): it counts its full compiles in a file beside it.
RENAMED_PASS_CHILD = """import pathlib, sys
import triton
from triton._C.libtriton import passes
inliner = passes.gluon.add_inliner
def renamed(manager):
    if sys._getframe(1).f_globals["__name__"] == "attnbook.compile_check":
        raise AttributeError("module 'passes.gluon' has no attribute 'add_inliner'")
    inliner(manager)
passes.gluon.add_inliner = renamed
full_compile = triton.compile
def counted(*args, **kwargs):
    with open(pathlib.Path(__file__).with_name("count"), "a") as f:
        f.write("x")
    return full_compile(*args, **kwargs)
triton.compile = counted
from attnbook.compile_check import _main
_main()
"""


def test_a_triton_without_the_early_passes_compiles_shared_only_requests_in_full(
        tmp_path, monkeypatch):
    # Before, the child raised AttributeError, and every test whose batch held a shared_only
    # request failed in the compiler fixture's setup.
    monkeypatch.delenv("ATTNBOOK_COMPILE_CACHE", raising=False)
    request = dict(kernel="forward", gpu="T4", dtype="float32", head_dim=16, shared_only=True)
    (early,) = compile_kernels([request])  # the early passes, as the locked Triton has them
    _use_child(tmp_path, monkeypatch, RENAMED_PASS_CHILD)
    assert compile_kernels([request]) == [early]
    assert (tmp_path / "count").read_text() == "x"  # one full compile
