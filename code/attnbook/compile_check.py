# Do not edit: tools/tangle.py generates this file from chapters/a4-compiling.md.
"""Compile the kernels of chapters 15 and 16 for a GPU that need not be present, and read what they
use.

Built and explained in the book's chapter chapters/a4-compiling.md.
"""

__all__ = [
    "GPUS",
    "SHARED_MEMORY",
    "SPILLS_IGNORED",
    "KERNELS",
    "DTYPES",
    "Compiled",
    "parameter_kinds",
    "compile_kernels",
    "choose_tiles",
    "largest_tiles",
]

# chapters/a4-compiling.md, "Appendix D: Compiling for GPUs the machine does not have"
import contextlib
import hashlib
import inspect
import io
import json
import os  # noqa: F811 (notebook)
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnbook.checks import (  # noqa: F811 (notebook)
    check_bool,
    check_choice,
    check_instance,
    check_int,
)

# By GPU: the compute capability Triton compiles for, the most shared memory a program may use.
GPUS = {"T4": 75, "A100": 80, "H100": 90}
SHARED_MEMORY = {"T4": 64 * 1024, "A100": 163 * 1024, "H100": 227 * 1024}
SPILLS_IGNORED = frozenset({"T4"})  # choose_tiles's rule: only shared memory decides there
KERNELS = ("forward", "dkdv", "dq")
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class Compiled:
    """What one kernel, compiled for one GPU, asks of it: all of it, or with shared_only the
    shared memory alone (registers, spill_bytes and tensor_cores None, since neither LLVM, PTX
    nor ptxas ran)."""

    kernel: str  # "forward", "dkdv" or "dq"
    gpu: str  # a key of GPUS
    dtype: str  # a key of DTYPES
    head_dim: int
    causal: bool
    block: int  # rows per query tile, BLOCK_M
    block_n: int  # rows per key tile, BLOCK_N
    warps: int  # num_warps: threads per program / 32
    stages: int  # num_stages: tiles loaded ahead
    shared_bytes: int  # shared memory per program
    registers: int | None  # 32-bit registers per thread
    spill_bytes: int | None  # registers that did not fit, stored to slow local memory
    tensor_cores: bool | None  # whether the machine code has matrix-multiply (mma/wgmma) steps
    wide: bool = False  # compiled as a WIDE launch (64-bit rows), else with 32-bit rows
    shared_only: bool = False  # compiled only as far as Triton's layout of the shared memory

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY[self.gpu]


# chapters/a4-compiling.md, "Appendix D: Compiling for GPUs the machine does not have"
def parameter_kinds(kernel: str) -> dict[str, str]:
    """`kernel`'s parameters, in order, typed as Triton's launcher specialises a typical launch
    (contiguous (B, H, 1024, D) tensors): ``*T`` points to the inputs' dtype, ``*fp32`` to
    float32 rows (the logsumexp, delta), ``i32/16`` is a multiple of 16, ``1`` an integer equal
    to 1 (the stride along D), which becomes a constant, and ``constexpr`` a compile-time
    constant."""
    from attnbook import kernels

    def kind(name: str, annotation: object) -> str:
        if "constexpr" in str(annotation):
            return "constexpr"
        if name in ("LSE", "DELTA"):
            return "*fp32"
        if name.isupper() and name != "H":  # Q, K, V, O and their gradients
            return "*T"
        if name.startswith("stride_"):
            return "1" if name.endswith("d") else "i32/16"
        scalars = {"H": "i32", "Lq": "i32/16", "Lk": "i32/16", "qk_scale": "fp32", "scale": "fp32"}
        if name not in scalars:
            raise ValueError(f"kernel {kernel!r} has a parameter {name!r} that no rule types")
        return scalars[name]

    function = kernels.TRITON_KERNELS[check_choice("kernel", kernel, KERNELS)].fn  # the Python
    return {name: kind(name, p.annotation)  # function, compiled or interpreted alike
            for name, p in inspect.signature(function).parameters.items()}


def _signature(kernel: str, dtype: str) -> tuple[dict[str, str], dict[str, object],
                                                 dict[tuple[int], list[list[object]]]]:
    # Triton's signature, constants and attributes of `kernel` for the typical call above.
    signature: dict[str, str] = {}
    constants: dict[str, object] = {}  # _compile_here adds booleans and sizes
    attrs: dict[tuple[int], list[list[object]]] = {}
    for index, (name, kind) in enumerate(parameter_kinds(kernel).items()):
        signature[name] = {"*T": "*" + DTYPES[dtype], "1": "constexpr"}.get(kind,
                                                                           kind.removesuffix("/16"))
        if kind == "1":
            constants[name] = 1
        elif kind.startswith("*") or kind.endswith("/16"):  # PyTorch allocates 16-byte aligned
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


# chapters/a4-compiling.md, "Appendix D: Compiling for GPUs the machine does not have"
def _ptxas_usage(log: str) -> tuple[int, int]:
    # Registers per thread and bytes spilled, from the report of ptxas (NVIDIA's assembler).
    registers = re.search(r"Used (\d+) registers", log)
    if registers is None:
        raise RuntimeError(f"no ptxas report in Triton's output:\n{log[-2000:]}")
    spills = re.search(r"(\d+) bytes spill stores", log)
    return int(registers.group(1)), int(spills.group(1)) if spills else 0


def _compile_here(kernel: str, gpu: str, dtype: str, head_dim: int, causal: bool, block: int,
                  block_n: int, warps: int, stages: int, wide: bool, shared_only: bool
                  ) -> Compiled:
    # Compile in this process, which must have imported the kernels in compiled mode.
    import triton

    from attnbook import kernels

    if kernels.INTERPRETED:
        raise RuntimeError("the kernels were imported in interpreted mode: use compile_kernels")
    signature, constants, attrs = _signature(kernel, dtype)
    # WIDE False: 32-bit rows, every tensor under 2**31 elements; TILES_FIRST False: the
    # (B * H, tiles) grid that every length under 65,536 tiles launches on
    constants.update(CAUSAL=causal, BLOCK_M=block, BLOCK_N=block_n, HEAD_DIM=head_dim,
                     WIDE=wide, TILES_FIRST=False)
    source = triton.compiler.ASTSource(kernels.TRITON_KERNELS[kernel], signature, constants,
                                       attrs)
    target = triton.backends.compiler.GPUTarget("cuda", GPUS[gpu], 32)
    options = {"num_warps": warps, "num_stages": stages}
    request = (kernel, gpu, dtype, head_dim, causal, block, block_n, warps, stages)
    if shared_only:
        try:
            shared = _shared_memory(source, target, options)
        except (AttributeError, ImportError, KeyError, TypeError):  # another Triton's passes
            # (or names): compile in full, and read the same number off it
            with contextlib.redirect_stdout(io.StringIO()):  # ptxas's log, kept off stdout
                shared = triton.compile(source, target=target, options=options).metadata.shared
        return Compiled(*request, shared, None, None, None, wide, shared_only=True)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(source, target=target, options=options)
    registers, spills = _ptxas_usage(log.getvalue())
    tensor_cores = re.search(r"\b(wgmma\.mma_async|mma\.sync)", compiled.asm["ptx"]) is not None
    return Compiled(*request, compiled.metadata.shared, registers, spills, tensor_cores, wide)


def _shared_memory(source: Any, target: Any, options: dict[str, int]) -> int:
    # The shared memory of one program, as triton.compile lays it out: its first two stages
    # (Triton IR, then TritonGPU IR, where the tiles get their layouts), then the passes with
    # which its third stage (make_llir) begins, up to the shared memory's allocation. The pass
    # list is Triton 3.7's: under a Triton that renames one, _compile_here compiles in full.
    import triton
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    backend = triton.compiler.make_backend(target)
    parsed = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, parsed, backend.get_codegen_implementation(parsed),
                            backend.get_module_map(), context)
    stages: dict[str, Any] = {}
    backend.add_stages(stages, parsed, source.language)
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, {})
    manager = ir.pass_manager(context)
    passes.ttgpuir.add_combine_tensor_select_and_if(manager)
    passes.ttgpuir.add_allocate_warp_groups(manager)
    passes.convert.add_scf_to_cf(manager)
    passes.gluon.add_inliner(manager)
    # make_llir's own arguments. The capability does not move these kernels' numbers (tried
    # from 75 to 120), so the tests' comparison with full compiles guards the target of the
    # first two stages, not this argument.
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(
        manager, backend._parse_arch(parsed.arch),
        get_ptx_version_from_options(parsed, target.arch))
    manager.run(module, "shared_only")
    return int(module.get_int_attr("ttg.shared"))


# chapters/a4-compiling.md, "Appendix D: Compiling for GPUs the machine does not have"
def compile_kernels(requests: Sequence[dict[str, object]], workers: int | None = None
                    ) -> list[Compiled]:
    """Compile the kernels of chapters 15 and 16 for GPUs that need not be present, in up to
    `workers` (at most 4) fresh processes, and report their resources. Each request names kernel, gpu, dtype (in
    KERNELS, GPUS, DTYPES), head_dim, and optionally causal (True), block and block_n (rows
    of the query and key tiles), warps and stages (all the launcher's, or block alone: square
    tiles, NUM_WARPS and NUM_STAGES), wide (False: 32-bit rows; True: the launch of a
    tensor spanning 2**31 elements or more) and shared_only (False; True: the shared memory
    alone, without LLVM, PTX and ptxas). With $ATTNBOOK_COMPILE_CACHE set, reports are
    kept in the folder it names and read back rather than compiled again (see below)."""
    requests = [_checked(r) for r in check_instance("requests", requests, (list, tuple))]
    workers = (os.cpu_count() or 1) if workers is None else check_int("workers", workers, 1)
    env = {**os.environ, **_COMPILED_MODE}
    paths = _report_paths(requests)
    reports = [_read_report(path, r) for path, r in zip(paths, requests)]
    todo = [i for i, report in enumerate(reports) if report is None]
    n = min(workers, len(todo), 4)  # processes, each compiling every n-th request

    def compile_in_child(chunk: list[int]) -> None:
        child = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                               input=json.dumps([requests[i] for i in chunk]),
                               text=True)  # reads stdout and stderr at once
        if child.returncode != 0:
            raise RuntimeError(f"compiling the kernels failed:\n{child.stderr[-3000:]}")
        for i, result in zip(chunk, json.loads(child.stdout)):
            report = reports[i] = Compiled(**result)
            _write_report(paths[i], report)

    with ThreadPoolExecutor(max(n, 1)) as pool:
        list(pool.map(compile_in_child, (todo[j::n] for j in range(n))))
    return [report for report in reports if report is not None]  # every one, by now


# Compiled mode; compile even what Triton has cached, so that ptxas runs and reports.
_COMPILED_MODE = {"TRITON_INTERPRET": "0", "TRITON_ALWAYS_COMPILE": "1",
                  "TRITON_DUMP_PTXAS_LOG": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
_CHILD = "from attnbook.compile_check import _main; _main()"
_SIZES = (16, 32, 64, 128)  # of a head, or of a tile's rows
_ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}  # bytes, by dtype
# A request's keys and the values each may take: the first four are required; the launcher's
# four settings (_LAUNCHER) may be None, their default, and the others default to _DEFAULTS.
_KEYS: dict[str, tuple[Any, ...]] = {
    "kernel": KERNELS, "gpu": tuple(GPUS), "dtype": tuple(DTYPES), "head_dim": _SIZES,
    "causal": (True, False), "block": _SIZES, "block_n": _SIZES, "warps": (1, 2, 4, 8, 16),
    "stages": (1, 2, 3, 4, 5, 6), "wide": (True, False), "shared_only": (True, False)}
_LAUNCHER = ("block", "block_n", "warps", "stages")
_DEFAULTS = {"causal": True, "wide": False, "shared_only": False, **dict.fromkeys(_LAUNCHER)}


def _checked(request: dict[str, object]) -> dict[str, object]:
    # The request checked, with its defaults, since the child process takes it as it is.
    if not isinstance(request, dict) or not set(list(_KEYS)[:4]) <= set(request):
        raise ValueError(f"a request must be a dict with kernel, gpu, dtype, head_dim: {request!r}")
    for key in request:
        check_choice("request key", key, _KEYS)
    r: dict[str, Any] = {**_DEFAULTS, **request}
    for key, allowed in _KEYS.items():  # in _KEYS' order; a launcher's None stays None
        if r[key] is not None or key not in _LAUNCHER:
            r[key] = _check_one_of(f"request {key}", r[key], allowed)
    from attnbook import kernels

    # block None: the launcher's settings on this GPU; a block alone: square, 4 warps, 2 stages
    default = (kernels.launch_settings(r["kernel"], _ELEMENT_SIZE[r["dtype"]], r["head_dim"],
                                       GPUS[r["gpu"]], r["wide"])[0] if r["block"] is None
               else (r["block"], r["block"], kernels.NUM_WARPS, kernels.NUM_STAGES))
    r.update({key: r[key] or d for key, d in zip(_LAUNCHER, default)})
    return {key: r[key] for key in _KEYS}


def _check_one_of(name: str, value: object, allowed: tuple[Any, ...]) -> Any:
    # `value`, one of `allowed`: strings (appendix H's check_choice), True or False, or ints
    if isinstance(allowed[0], str):
        return check_choice(name, value, allowed)
    value = check_bool(name, value) if isinstance(allowed[0], bool) else check_int(name, value)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {name}={value!r}")
    return value


def _main() -> None:
    # Child process: JSON requests on stdin, JSON results on stdout.
    json.dump([asdict(_compile_here(**r)) for r in json.load(sys.stdin)], sys.stdout)


# chapters/a4-compiling.md, "Appendix D: Compiling for GPUs the machine does not have"
def _report_paths(requests: Sequence[dict[str, object]]) -> list[Path | None]:
    # Where $ATTNBOOK_COMPILE_CACHE keeps each request's report; None where it is unset or empty,
    # or where this Triton does not say what its cache is keyed on.
    folder = os.environ.get("ATTNBOOK_COMPILE_CACHE")
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.backends.nvidia.compiler import get_ptxas_version
        from triton.runtime.cache import triton_key
    except ImportError:
        folder = None
    if not folder:
        return [None] * len(requests)
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as error:
        raise ValueError(f"ATTNBOOK_COMPILE_CACHE={folder!r} must name a folder that can be "
                         f"written: {error}") from None
    from attnbook import compile_check, kernels

    sources = "".join(inspect.getsource(module) for module in (kernels, compile_check))
    settings = {k: v for k, v in os.environ.items() if k.startswith(_COMPILER_VARIABLES)}
    settings.update(get_cache_invalidating_env_vars())  # this process's: the child's, but for
    for name in _COMPILED_MODE:  # these, which compile_kernels sets
        settings.pop(name, None)
    salt = json.dumps([hashlib.sha256(sources.encode()).hexdigest(), triton_key(),
                       get_ptxas_version(), sys.version, sorted(settings.items())])
    return [Path(folder) / (hashlib.sha256((salt + json.dumps(r, sort_keys=True)).encode())
                            .hexdigest() + ".json") for r in requests]


# Variables that Triton (3.7) or ptxas read but Triton's list of cache-invalidating variables
# leaves out, such as PTXAS_OPTIONS: a report is kept under all of them.
_COMPILER_VARIABLES = ("TRITON", "PTXAS", "DISABLE_", "LLVM", "MLIR", "NVPTX", "AMDGCN", "CUDA")


def _read_report(path: Path | None, request: dict[str, object]) -> Compiled | None:
    # The report kept for `request`, if it is one: None (compile it) for anything else.
    try:
        report = asdict(Compiled(**json.loads(path.read_text()))) if path else None
    except (OSError, ValueError, TypeError):
        return None
    if (report is None or json.dumps({k: report[k] for k in request}, sort_keys=True)
            != json.dumps(request, sort_keys=True)):  # as JSON: 1 is not true, 64.0 not 64
        return None  # another request's report: a shared-only one is never taken for a full one
    measured = [report[k] for k in ("registers", "spill_bytes", "tensor_cores")]
    if report["shared_only"]:  # what ptxas would report: unknown
        valid = measured == [None, None, None]
    else:
        valid = all(type(n) is int and n >= 0 for n in measured[:2]) and type(measured[2]) is bool
    shared = report["shared_bytes"]
    return Compiled(**report) if valid and type(shared) is int and shared >= 0 else None


def _write_report(path: Path | None, report: Compiled) -> None:
    if path is not None:
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
        with contextlib.suppress(OSError):  # a report not kept is compiled again next time
            partial.write_text(json.dumps(asdict(report)))
            partial.replace(path)  # at once: a run beside this one never reads half a report


# chapters/a4-compiling.md, "Appendix D: Compiling for GPUs the machine does not have"
def choose_tiles(compiled: Sequence[Compiled]) -> dict[tuple[str, int], int]:
    """{(kernel, head_dim): rows}: the largest of 64 and 32 rows that fits the shared memory of
    every GPU compiled for and spills no register on those outside SPILLS_IGNORED (the A100 and
    the H100), else 16. `compiled` holds square tiles (block_n == block) of one dtype, on GPUS;
    those of SPILLS_IGNORED (the T4) may be shared_only, since only their shared memory counts."""
    ok: dict[tuple[str, int, int], bool] = {}  # (kernel, head_dim, rows): fits everywhere
    for c in check_instance("compiled", compiled, (list, tuple)):
        check_choice("compiled gpu", check_instance("compiled item", c, Compiled).gpu, GPUS)
        if c.block_n != c.block or c.dtype != compiled[0].dtype:
            raise ValueError(f"compiled must hold square tiles of one dtype, got {c.block}x"
                             f"{c.block_n} rows of {c.dtype} beside {compiled[0].dtype}")
        if c.shared_only and c.gpu not in SPILLS_IGNORED:
            raise ValueError(f"compiled holds a shared_only report for the {c.gpu}, whose "
                             "spills choose_tiles reads")
        if not c.shared_only and c.spill_bytes is None:
            raise ValueError(f"compiled holds a full report for the {c.gpu} with spill_bytes "
                             "None: a full report has ptxas's numbers")
        key = (c.kernel, c.head_dim, c.block)
        ok[key] = ok.get(key, True) and c.fits and (c.gpu in SPILLS_IGNORED or c.spill_bytes == 0)
    return {(k, d): next((b for b in (64, 32) if ok.get((k, d, b))), 16) for k, d, _ in ok}


def largest_tiles(dtype: str, head_dims: Sequence[int] = (16, 32, 64, 128),
                  kernels: Sequence[str] = KERNELS, workers: int | None = None
                  ) -> dict[tuple[str, int], int]:
    """choose_tiles over 64- and 32-row tiles of `kernels` and `head_dims`, on all of GPUS."""
    check_instance("head_dims", head_dims, (tuple, list))
    check_instance("kernels", kernels, (tuple, list))  # a str would be iterated letter by letter
    candidates: list[dict[str, object]] = [
        dict(kernel=k, dtype=dtype, head_dim=d, block=b, gpu=g, shared_only=g in SPILLS_IGNORED)
        for k in kernels for d in head_dims for b in (64, 32) for g in GPUS]
    return choose_tiles(compile_kernels(candidates, workers))
