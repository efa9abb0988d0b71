# Do not edit: tools/tangle.py generates this file from chapters/15-flash-attention-triton.md and chapters/16-flash-attention-backward.md.
"""FlashAttention in Triton: the forward and backward kernels, and flash_attention for PyTorch
tensors.

Built and explained in the book's chapters chapters/15-flash-attention-triton.md and chapters/16-flash-attention-backward.md.
"""

__all__ = [
    "INTERPRETED",
    "TILE_ROWS",
    "LAUNCH",
    "WIDE_LAUNCH",
    "AUTOTUNE_FROM",
    "launch_settings",
    "TRITON_KERNELS",
    "flash_attention",
]

# chapters/15-flash-attention-triton.md, "The Triton programming model"
import contextlib
import functools
from collections.abc import Callable
from typing import Any, cast  # noqa: F401 (cast: chapter 16)

import torch
import triton  # compiled, or interpreted after use_triton_interpreter() without a GPU
import triton.language as tl

# flash_attention's checks (chapter 16)
from attnbook.checks import (  # noqa: F401
    check_bool,
    check_choice,
    check_int,
    check_real,
    check_scale,
    check_tensor,
    env_flag,
)


# chapters/15-flash-attention-triton.md, "The Triton programming model"
@triton.jit
def _load_rows(base, rows, n_rows, stride_row, stride_d, HEAD_DIM: tl.constexpr):
    # A (len(rows), HEAD_DIM) tile. Rows at or past n_rows are not read; they come back as 0.
    d = tl.arange(0, HEAD_DIM)  # rows: int64 when the launch is WIDE (see _program)
    ptrs = base + rows[:, None] * stride_row + d[None, :] * stride_d
    return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)


@triton.jit
def _store_rows(base, tile, rows, n_rows, stride_row, stride_d, HEAD_DIM: tl.constexpr):
    # Write a (len(rows), HEAD_DIM) tile in the tensor's dtype, skipping rows past n_rows.
    d = tl.arange(0, HEAD_DIM)
    ptrs = base + rows[:, None] * stride_row + d[None, :] * stride_d
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=rows[:, None] < n_rows)


# True when the kernels of this module run in Triton's CPU interpreter, False when compiled.
INTERPRETED = type(_load_rows).__name__ == "InterpretedFunction"

# tl.sum and Triton's other helpers were decorated when triton was first imported: if that was
# in compiled mode, they cannot be called by interpreted kernels (flash_attention says so).
_MIXED = INTERPRETED and type(tl.standard.sum).__name__ != "InterpretedFunction"


# chapters/15-flash-attention-triton.md, "The Triton programming model"
@triton.jit
def _delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_od,
                  stride_dob, stride_doh, stride_dom, stride_dod, H, L,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, WIDE: tl.constexpr,
                  TILES_FIRST: tl.constexpr):
    # Program (bh, i): delta = rowsum(O * dO) for rows i*BLOCK_M ... of (batch, head) bh.
    bh, b, h, start_m = _program(H, BLOCK_M, WIDE, TILES_FIRST)
    rows = start_m + tl.arange(0, BLOCK_M)
    o = _load_rows(O + b * stride_ob + h * stride_oh, rows, L, stride_om, stride_od, HEAD_DIM)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, rows, L, stride_dom, stride_dod, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BLOCK_M,)
    tl.store(DELTA + bh * L + rows, delta, mask=rows < L)


@triton.jit
def _program(H, BLOCK: tl.constexpr, WIDE: tl.constexpr, TILES_FIRST: tl.constexpr):
    # Program (bh, i) of _grid: its (batch, head) pair bh, batch b and head h (int64), and its
    # first row i * BLOCK, int64 when WIDE so that the rows built from it are too. The grid is
    # (tiles, B * H) when TILES_FIRST, else (B * H, tiles).
    bh = tl.program_id(1 if TILES_FIRST else 0)
    tile = tl.program_id(0 if TILES_FIRST else 1)
    if WIDE:  # some tensor spans 2**31 elements or more: widen before the multiply, which
        tile = tile.to(tl.int64)  # passes 2**31 from tile 2**31 / BLOCK on (TILES_FIRST)
    start = tile * BLOCK
    return bh.to(tl.int64), (bh // H).to(tl.int64), (bh % H).to(tl.int64), start


def _grid(length: int, block: int, pairs: int) -> tuple[tuple[int, int], bool]:
    # The grid of tiles of `block` rows of `length` for B * H pairs, and TILES_FIRST: CUDA
    # allows 2**31 - 1 programs on the first axis and 65,535 on the second, so (B * H, tiles)
    # unless the tiles need the first axis and B * H fits the second. One order fits: the
    # callers have checked it (_check_tiles, below, refuses the rest by name).
    tiles = triton.cdiv(length, block)
    if tiles >= _TILES_FIRST_FROM and pairs <= 65_535:
        return (tiles, pairs), True
    return (pairs, tiles), False


_TILES_FIRST_FROM = 65_536  # tiles from which they take the first axis (the tests lower it)


def _fits(tiles: int, pairs: int) -> bool:
    # Whether one of the two orders fits CUDA's limits: one count on the second axis.
    return min(tiles, pairs) <= 65_535 and max(tiles, pairs) <= 2**31 - 1


def _limit_passed(tiles: int, pairs: int) -> str:
    # Which of CUDA's grid limits a grid of `tiles` and B * H = `pairs` passes (_fits is False).
    if max(tiles, pairs) > 2**31 - 1:
        what = "the tile count" if tiles > pairs else "B * H"
        return f"{what} passes the 2**31 - 1 programs of a grid's first axis"
    return "both pass the 65,535 programs of a grid's second axis"


def _wide(*tensors: torch.Tensor) -> bool:
    # True when an offset into one of the tensors may pass 2**31 - 1 (the int32 limit).
    return any(sum((n - 1) * s for n, s in zip(t.shape, t.stride())) >= 2**31 - 1
               for t in tensors)


# chapters/15-flash-attention-triton.md, "The forward kernel"
@triton.jit
def _forward_kernel(Q, K, V, O, LSE, stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
                    stride_vd, stride_ob, stride_oh, stride_om, stride_od, H, Lq, Lk, qk_scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, WIDE: tl.constexpr, TILES_FIRST: tl.constexpr):
    # Program (bh, i): output rows i*BLOCK_M ... of (batch, head) bh, and their logsumexp.
    bh, b, h, start_m = _program(H, BLOCK_M, WIDE, TILES_FIRST)
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, Lq, stride_qm, stride_qd, HEAD_DIM)
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # (BLOCK_M,) largest score so far
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # (BLOCK_M,) sum of exponentials so far
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # (BLOCK_M, D) unnormalised output
    mid, hi = _key_range(start_m, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, mid, BLOCK_N):  # key tiles every row may see: no mask
        acc, m, l = _forward_step(acc, m, l, q, K, V, rows, start_n, stride_kn, stride_kd,
                                  stride_vn, stride_vd, Lq, Lk, qk_scale, CAUSAL, False,
                                  BLOCK_N, HEAD_DIM)
    for start_n in range(mid, hi, BLOCK_N):  # the diagonal and the last, partial tile: masked
        acc, m, l = _forward_step(acc, m, l, q, K, V, rows, start_n, stride_kn, stride_kd,
                                  stride_vn, stride_vd, Lq, Lk, qk_scale, CAUSAL, True,
                                  BLOCK_N, HEAD_DIM)
    l_safe = tl.where(l == 0.0, 1.0, l)  # l == 0: the row may see no key at all
    O += b * stride_ob + h * stride_oh
    _store_rows(O, acc / l_safe[:, None], rows, Lq, stride_om, stride_od, HEAD_DIM)
    lse = tl.where(l == 0.0, float("inf"), m + tl.log2(l_safe))  # (BLOCK_M,)
    tl.store(LSE + bh * Lq + rows, lse, mask=rows < Lq)


@triton.jit
def _forward_step(acc, m, l, q, K, V, rows, start_n, stride_kn, stride_kd, stride_vn, stride_vd,
                  Lq, Lk, qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # One key tile of the online softmax: acc, m and l updated with keys start_n ... .
    k, v, s, ok = _key_tile(q, K, V, rows, start_n, stride_kn, stride_kd, stride_vn, stride_vd,
                            Lq, Lk, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM)
    if MASKED:
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l


@triton.jit
def _key_tile(q, K, V, rows, start_n, stride_kn, stride_kd, stride_vn, stride_vd, Lq, Lk,
              qk_scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # The K and V tiles of keys start_n ..., their scores against q and where they are allowed.
    cols = start_n + tl.arange(0, BLOCK_N).to(rows.dtype)  # int64 if rows are
    k = _load_rows(K, cols, Lk, stride_kn, stride_kd, HEAD_DIM)  # (BLOCK_N, D)
    v = _load_rows(V, cols, Lk, stride_vn, stride_vd, HEAD_DIM)  # (BLOCK_N, D)
    s, ok = _scores(q, k, rows, cols, Lq, Lk, qk_scale, CAUSAL)  # (BLOCK_M, BLOCK_N)
    return k, v, s, ok


@triton.jit
def _key_range(start_m, Lq, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    # Key tiles [0, mid) are whole and seen by every row of the query tile start_m ...: no
    # mask. Tiles [mid, hi) need one; under CAUSAL no row sees a key at or past hi.
    if CAUSAL:  # query i sees key j iff j <= i + Lk - Lq
        hi = tl.minimum(Lk, start_m + BLOCK_M + Lk - Lq)
        mid = tl.maximum(tl.minimum(start_m + 1 + Lk - Lq, Lk), 0) // BLOCK_N * BLOCK_N
    else:
        hi = Lk
        mid = Lk // BLOCK_N * BLOCK_N
    return mid, hi


@triton.jit
def _scores(q, k, rows, cols, Lq, Lk, qk_scale, CAUSAL: tl.constexpr):
    # Base-2 scores (len(rows), len(cols)) in float32, and where they are allowed: the caller
    # masks them (the forward before its maximum, the backward kernels inside exp2).
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    ok = cols[None, :] < Lk
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + (Lk - Lq))
    return s, ok


# chapters/15-flash-attention-triton.md, "What a GPU does with one program"
# Rows per tile (BLOCK_M = BLOCK_N) by kernel, element size and head dimension: see above.
TILE_ROWS = {
    ("forward", 2): {16: 64, 32: 64, 64: 64, 128: 64},
    ("forward", 4): {16: 64, 32: 64, 64: 32, 128: 16},
    ("dkdv", 2): {16: 64, 32: 64, 64: 64, 128: 32},
    ("dkdv", 4): {16: 32, 32: 32, 64: 16, 128: 16},
    ("dq", 2): {16: 64, 32: 64, 64: 64, 128: 32},
    ("dq", 4): {16: 64, 32: 32, 64: 32, 128: 32},
}
NUM_WARPS, NUM_STAGES = 4, 2  # threads per program / 32, and tiles loaded ahead
_LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e))


# chapters/15-flash-attention-triton.md, "What a GPU does with one program"
# 2-byte dtypes on a GPU: candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) by compute
# capability and kernel, for head dims up to 64 and for 128; the first is the default. Each is
# clean in compile_check's report (appendix D, "Chapter 15's launch tables").
LAUNCH = {
    (75, "forward"): {64: [(32, 32, 4, 2)], 128: [(32, 32, 8, 2)]},
    (75, "dkdv"): {64: [(32, 32, 8, 2)], 128: [(32, 32, 8, 2)]},
    (75, "dq"): {64: [(32, 32, 8, 2)], 128: [(16, 16, 8, 2)]},
    (80, "forward"): {64: [(64, 64, 4, 3)], 128: [(128, 64, 8, 3), (64, 64, 4, 3)]},
    (80, "dkdv"): {64: [(64, 64, 4, 3)], 128: [(32, 64, 8, 2), (32, 32, 4, 3)]},
    (80, "dq"): {64: [(64, 64, 4, 3)], 128: [(64, 64, 8, 2), (32, 32, 4, 3)]},
    (90, "forward"): {64: [(128, 64, 4, 3), (64, 64, 4, 3)],
                      128: [(128, 64, 8, 3), (64, 64, 4, 3)]},
    (90, "dkdv"): {64: [(64, 64, 4, 3)], 128: [(32, 64, 8, 2), (32, 32, 4, 3)]},
    (90, "dq"): {64: [(64, 64, 4, 3)], 128: [(64, 64, 8, 2), (32, 32, 4, 3)]},
}
# WIDE launches (64-bit rows): where LAUNCH's settings spill with them, these (appendix D).
WIDE_LAUNCH = {(80, "forward"): {128: [(64, 64, 4, 3)]}, (80, "dkdv"): {64: [(32, 32, 4, 3)]}}
AUTOTUNE_FROM = 2048 * 2048  # Lq * Lk from which a GPU launch times its candidates


def launch_settings(kernel: str, element_size: int, head_dim: int,
                    capability: int | None = None,
                    wide: bool = False) -> list[tuple[int, int, int, int]]:
    """Chapter 15's candidate launch settings (BLOCK_M, BLOCK_N, num_warps, num_stages) of
    `kernel`, the default first: LAUNCH's (WIDE_LAUNCH's where it has them for a wide launch)
    for 2-byte dtypes on a GPU of compute capability 7.5 to 9.0 (given as 75 to 90); else, and
    in the interpreter (None), TILE_ROWS' square tile."""
    check_choice("kernel", kernel, ("forward", "dkdv", "dq"))
    for name, value, known in (("element_size", element_size, (2, 4)),
                               ("head_dim", head_dim, (16, 32, 64, 128))):
        if check_int(name, value) not in known:
            raise ValueError(f"{name} must be one of {list(known)}, got {name}={value!r}")
    capability = None if capability is None else check_int("capability", capability, 0)
    # a copy: a caller's edit must not change the tables
    return list(_launch_settings(kernel, element_size, head_dim, capability,
                                 check_bool("wide", wide)))


def _launch_settings(kernel: str, element_size: int, head_dim: int, capability: int | None,
                     wide: bool = False) -> list[tuple[int, int, int, int]]:
    # launch_settings' choice, for arguments already checked (by it, or by flash_attention)
    if capability is not None and element_size == 2 and 75 <= capability <= 90:
        generation = 90 if capability == 90 else 80 if capability >= 80 else 75
        width = 64 if head_dim <= 64 else 128
        own = WIDE_LAUNCH.get((generation, kernel), {}) if wide else {}
        return own.get(width) or LAUNCH[generation, kernel][width]
    block = TILE_ROWS[kernel, element_size][head_dim]
    return [(block, block, NUM_WARPS, NUM_STAGES)]


# chapters/15-flash-attention-triton.md, "Launching the kernels"
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # O (B, H, Lq, D) and the base-2 logsumexp of each row's scores (B, H, Lq), float32.
    q, k, v = _unit_stride_d(q, k, v)
    B, H, Lq, D = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    with _device_guard(q.device):
        _launch(_forward_kernel, "forward", q, k, causal,
                q, k, v, o, lse, *_strides(q, k, v, o), H, Lq, k.shape[2], scale * _LOG2E)
    return o, lse


def _unit_stride_d(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # Each tensor, copied once if its last dimension is not contiguous (stride along D not 1).
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


_Outputs = tuple[torch.Tensor, ...]  # an operator's: O and the logsumexp, or dQ, dK and dV


def _vmap_rule(op: Callable[..., _Outputs], refuse: Callable[..., None]
               ) -> Callable[..., tuple[_Outputs, tuple[int, int]]]:
    # vmap's dimension (N, or none: shared) joins the batch's
    def rule(info: Any, dims: tuple[int | None, ...], q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, causal: bool, scale: float) -> tuple[_Outputs, tuple[int, int]]:
        n, moved = info.batch_size, (t.movedim(at, 0) if at is not None else t.expand(
            info.batch_size, *t.shape) for t, at in zip((q, k, v), dims))  # each (N, B, H, L, D)
        qkv = [t.flatten(0, 1) for t in moved]  # each (N * B, H, L, D), unwrapped: grad's or
        refuse(*qkv)  # jvp's around vmap, which chapter 16's _refuse_transforms refuses
        out = op(*qkv, causal, scale)
        return tuple(torch.unflatten(t, 0, (n, -1)) for t in out), (0, 0)
    return rule


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object) -> _Outputs:
    # The operators' outputs without a kernel; one device for all, since the dispatcher sends
    # CPU arguments with a meta one here, not to the checked body.
    for name, t in zip(("k", "v", "o", "lse", "do"), (k, v, *rest[:-2])):
        check_tensor(name, t, device=q.device)
    if len(rest) == 2:  # the forward's: O and the logsumexp
        return q.new_empty(q.shape), q.new_empty(q.shape[:3]).float()
    return tuple(t.new_empty(t.shape) for t in (q, k, v))  # the backward's: dQ, dK, dV


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current CUDA device: make it the inputs' one (on the CPU, nothing).
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_mode(device: torch.device) -> None:
    """Refuse a device the kernels cannot run on, in the mode Triton was imported in."""
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(f"q is on device {device}, but the kernels were compiled for the GPU: "
                         "use 'cuda', or call attnbook.triton_mode.use_triton_interpreter() "
                         "(or set TRITON_INTERPRET=1) before anything imports triton")
    if device.type == "meta":  # shapes without data: the interpreter has nothing to read
        raise ValueError(f"q is on device {device}, which holds no data: use 'cpu' in the "
                         "interpreter")
    if _MIXED:
        raise RuntimeError("triton was imported in compiled mode before TRITON_INTERPRET=1 was "
                           "set, so the interpreted kernels cannot call its library: call "
                           "attnbook.triton_mode.use_triton_interpreter() before anything "
                           "imports triton")


def _launch(kernel: Any, name: str, q: torch.Tensor, k: torch.Tensor, causal: bool,
            *args: object) -> None:  # kernel: a @triton.jit function (Triton has no types)
    # One program per tile of rows (of keys for dK, dV, else of queries), for every (batch,
    # head), on _grid's grid, with a setting of launch_settings that fits the grid: the
    # first, or on a GPU and a large problem the fastest that compiles for its length bucket,
    # unless ATTNBOOK_AUTOTUNE is off.
    capability = None if INTERPRETED else _capability(q.device)
    wide = _wide(*(a for a in args if isinstance(a, torch.Tensor)))
    settings = _fitting(name, q, k, wide)
    length = k.shape[2] if name == "dkdv" else q.shape[2]
    pairs = q.shape[0] * q.shape[1]

    def run(setting: tuple[int, int, int, int]) -> None:
        block_m, block_n, warps, stages = setting
        grid, tiles_first = _grid(length, block_n if name == "dkdv" else block_m, pairs)
        kernel[grid](*args, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                     HEAD_DIM=q.shape[-1], WIDE=wide, TILES_FIRST=tiles_first,
                     num_warps=warps, num_stages=stages)

    setting = settings[0]
    if len(settings) > 1 and q.shape[2] * k.shape[2] >= AUTOTUNE_FROM and _autotuning():
        key = (name, _bucket(q.shape[2]), _bucket(k.shape[2]), q.shape[-1], causal, q.dtype,
               capability, wide, tuple(settings))  # settings: those that fit this B * H
        if key not in _FASTEST:  # timed once per key and process: each run overwrites the same
            _FASTEST[key] = _fastest(name, settings, run)
        setting = _FASTEST[key]
    run(setting)


def _fitting(name: str, q: torch.Tensor, k: torch.Tensor, wide: bool
             ) -> list[tuple[int, int, int, int]]:
    # launch_settings' candidates for `name` whose tiles and B * H fit one of _grid's orders,
    # the default first; a ValueError naming the tensor, its length and B * H if none does.
    capability = None if INTERPRETED else _capability(q.device)
    settings = _launch_settings(name, q.element_size(), q.shape[-1], capability, wide)
    arg, length = ("k", k.shape[2]) if name == "dkdv" else ("q", q.shape[2])
    pairs = q.shape[0] * q.shape[1]
    rows = [s[1] if name == "dkdv" else s[0] for s in settings]  # rows of a tile
    _check_tiles(name, arg, length, max(rows), pairs)
    return [s for s, r in zip(settings, rows) if _fits(triton.cdiv(length, r), pairs)]


_KERNEL_NAMES = {"forward": "forward", "delta": "backward's delta", "dkdv": "backward's dK, dV",
                 "dq": "backward's dQ"}


def _check_tiles(kernel: str, arg: str, length: int, rows: int, pairs: int) -> None:
    # Refuse a length of `arg` whose tiles of `rows` rows fit neither of _grid's orders with
    # B * H pairs, naming the argument, its length, B * H and the kernel.
    tiles = triton.cdiv(length, rows)
    if _fits(tiles, pairs):
        return
    if pairs > 2**31 - 1:  # B * H is to blame, not the length
        raise ValueError(f"q has B * H = {pairs} (batch, head) pairs, too many for the "
                         f"{_KERNEL_NAMES[kernel]} kernel with {tiles} tiles of {rows} rows: "
                         f"{_limit_passed(tiles, pairs)}")
    fix = (f"L{arg} <= {(2**31 - 1) * rows}" if tiles > 2**31 - 1
           else f"L{arg} <= {65_535 * rows}, or B * H <= 65,535")
    raise ValueError(f"{arg} has L{arg} = {length} rows, too many for the "
                     f"{_KERNEL_NAMES[kernel]} kernel at B * H = {pairs}: its tiles of "
                     f"{rows} rows number {tiles}; {_limit_passed(tiles, pairs)} ({fix})")


def _fastest(name: str, settings: list[tuple[int, int, int, int]],
             run: Callable[[tuple[int, int, int, int]], None]) -> tuple[int, int, int, int]:
    # The setting whose timed run is the fastest, skipping one that runs out of the GPU's
    # resources (shared memory, registers) when it compiles; a ValueError if every one does.
    seconds: dict[tuple[int, int, int, int], float] = {}
    for setting in settings:
        try:
            seconds[setting] = _seconds(functools.partial(run, setting))
        except triton.runtime.OutOfResources:
            continue
    if not seconds:
        raise ValueError(f"no launch setting of the {_KERNEL_NAMES[name]} kernel fits this GPU's "
                         f"resources: tried {settings}")
    return min(seconds, key=seconds.__getitem__)


# (kernel, Lq, Lk buckets, D, causal, dtype, capability, wide) -> its setting
_FASTEST: dict[tuple[object, ...], tuple[int, int, int, int]] = {}


def _bucket(length: int) -> int:
    # The power of two at or above `length`: lengths 1025 ... 2048 share one timing.
    return 1 << (length - 1).bit_length()


def _autotuning() -> bool:
    # ATTNBOOK_AUTOTUNE off (0, false, off or no, in any case): always the first setting that
    # fits, the same in every process (reproducible). Unset, empty, 1, true, on or yes: timed.
    return env_flag("ATTNBOOK_AUTOTUNE", True)


def _seconds(run: Callable[[], None]) -> float:
    from triton.testing import do_bench  # on a GPU only: it times with CUDA events

    return float(do_bench(run, return_mode="median"))  # milliseconds, a median of many runs


@functools.cache
def _capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor  # 75 for a T4, 80 for an A100, 90 for an H100


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


# chapters/16-flash-attention-backward.md, "The backward pass"
@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
                 stride_vd, stride_dob, stride_doh, stride_dom, stride_dod, H, Lq, Lk, qk_scale,
                 scale, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, WIDE: tl.constexpr, TILES_FIRST: tl.constexpr):
    # Program (bh, j): dK and dV (with dK's strides) of key rows j*BLOCK_N ... of (batch, head) bh.
    bh, b, h, start_n = _program(H, BLOCK_N, WIDE, TILES_FIRST)
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + h * stride_kh, cols, Lk, stride_kn, stride_kd, HEAD_DIM)
    v = _load_rows(V + b * stride_vb + h * stride_vh, cols, Lk, stride_vn, stride_vd, HEAD_DIM)
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)  # (BLOCK_N, D)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)  # (BLOCK_N, D)
    lo, mid = _query_range(start_n, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    for start_m in range(lo, mid, BLOCK_M):  # query tiles that see part of this key tile
        dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE + bh * Lq, DELTA + bh * Lq, cols, start_m,
                            stride_qm, stride_qd, stride_dom, stride_dod, Lq, Lk, qk_scale,
                            CAUSAL, True, BLOCK_M, HEAD_DIM)
    for start_m in range(mid, Lq, BLOCK_M):  # query tiles that see all of it: no mask
        dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE + bh * Lq, DELTA + bh * Lq, cols, start_m,
                            stride_qm, stride_qd, stride_dom, stride_dod, Lq, Lk, qk_scale,
                            CAUSAL, False, BLOCK_M, HEAD_DIM)
    offset = b * stride_dkb + h * stride_dkh
    _store_rows(DK + offset, dk * scale, cols, Lk, stride_dkn, stride_dkd, HEAD_DIM)
    _store_rows(DV + offset, dv, cols, Lk, stride_dkn, stride_dkd, HEAD_DIM)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, cols, start_m, stride_qm, stride_qd, stride_dom,
               stride_dod, Lq, Lk, qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    # One query tile's share of dK and dV. Rows past Lq load as 0: with dO = delta = 0 they add 0.
    rows = start_m + tl.arange(0, BLOCK_M).to(cols.dtype)  # int64 if cols are
    q = _load_rows(Q, rows, Lq, stride_qm, stride_qd, HEAD_DIM)  # (BLOCK_M, D)
    do = _load_rows(DO, rows, Lq, stride_dom, stride_dod, HEAD_DIM)  # (BLOCK_M, D)
    lse = tl.load(LSE + rows, mask=rows < Lq, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + rows, mask=rows < Lq, other=0.0)  # (BLOCK_M,)
    s, ok = _scores(q, k, rows, cols, Lq, Lk, qk_scale, CAUSAL)  # (BLOCK_M, BLOCK_N)
    if MASKED:
        p = tl.exp2(tl.where(ok, s - lse[:, None], float("-inf")))  # the forward's weights
    else:
        p = tl.exp2(s - lse[:, None])
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")  # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    return dk, dv


@triton.jit
def _query_range(start_n, Lq, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    # Query tiles [lo, mid) see part of the key tile start_n ...: masked; tiles [mid, Lq) see
    # all of it. The last, partial key tile is masked for every query tile.
    if CAUSAL:  # the first query that sees key j is j - (Lk - Lq)
        lo = tl.maximum(start_n - (Lk - Lq), 0) // BLOCK_M * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - (Lk - Lq), 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    return lo, tl.where(start_n + BLOCK_N > Lk, Lq, tl.minimum(mid, Lq))


# chapters/16-flash-attention-backward.md, "The backward pass"
@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qm, stride_qd,
               stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
               stride_vd, stride_dob, stride_doh, stride_dom, stride_dod, H, Lq, Lk, qk_scale,
               scale, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
               CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, WIDE: tl.constexpr, TILES_FIRST: tl.constexpr):
    # Program (bh, i): dQ of query rows i*BLOCK_M ... of (batch, head) bh, a sum over key tiles.
    bh, b, h, start_m = _program(H, BLOCK_M, WIDE, TILES_FIRST)
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, Lq, stride_qm, stride_qd, HEAD_DIM)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, rows, Lq, stride_dom, stride_dod,
                    HEAD_DIM)  # (BLOCK_M, D), like q
    lse = tl.load(LSE + bh * Lq + rows, mask=rows < Lq, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + bh * Lq + rows, mask=rows < Lq, other=0.0)  # (BLOCK_M,)
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # (BLOCK_M, D)
    mid, hi = _key_range(start_m, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)  # as in the forward
    for start_n in range(0, mid, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, rows, start_n, stride_kn, stride_kd,
                      stride_vn, stride_vd, Lq, Lk, qk_scale, CAUSAL, False, BLOCK_N, HEAD_DIM)
    for start_n in range(mid, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, rows, start_n, stride_kn, stride_kd,
                      stride_vn, stride_vd, Lq, Lk, qk_scale, CAUSAL, True, BLOCK_N, HEAD_DIM)
    DQ += b * stride_dqb + h * stride_dqh
    _store_rows(DQ, dq * scale, rows, Lq, stride_dqm, stride_dqd, HEAD_DIM)


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, rows, start_n, stride_kn, stride_kd, stride_vn,
             stride_vd, Lq, Lk, qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # One key tile's share of dQ: dS K_j, with P rebuilt from the logsumexp.
    k, v, s, ok = _key_tile(q, K, V, rows, start_n, stride_kn, stride_kd, stride_vn, stride_vd,
                            Lq, Lk, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM)
    if MASKED:
        p = tl.exp2(tl.where(ok, s - lse[:, None], float("-inf")))
    else:
        p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision="ieee")


# chapters/16-flash-attention-backward.md, "The backward pass"
# The kernels whose tiles TILE_ROWS holds, by name: what attnbook.compile_check compiles.
TRITON_KERNELS = {"forward": _forward_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, do: torch.Tensor, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # dQ, dK, dV (contiguous, in the inputs' dtype) from the forward's O and logsumexp.
    (q, k, v, do), lse = _unit_stride_d(q, k, v, do), lse.contiguous()  # lse: read at bh * Lq + row
    B, H, Lq, D = q.shape
    _check_tiles("delta", "q", Lq, 32, B * H)  # again: the operator's and vmap's forward skip it
    delta, dq, dk, dv = (t.new_empty(t.shape) for t in (lse, q, k, v))  # delta: float32 (B,H,Lq)
    inputs = (q, k, v, do, lse, delta, *_strides(q, k, v, do), H, Lq, k.shape[2],
              scale * _LOG2E, scale)
    with _device_guard(q.device):
        grid, tiles_first = _grid(Lq, 32, B * H)
        _delta_kernel[grid](o, do, delta, *_strides(o, do), H, Lq, BLOCK_M=32, HEAD_DIM=D,
                            WIDE=_wide(o, do, delta), TILES_FIRST=tiles_first)
        _launch(_dkdv_kernel, "dkdv", q, k, causal, *inputs, dk, dv, *dk.stride())
        _launch(_dq_kernel, "dq", q, k, causal, *inputs, dq, *dq.stride())
    return dq, dk, dv


# chapters/16-flash-attention-backward.md, "A checked, differentiable function"
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Exact, differentiable attention softmax(scale * q k^T) v by tiled Triton kernels: q is
    (B, H, Lq, D), k and v (B, H, Lk, D), D in {16, 32, 64, 128}, any strides (a last dimension
    that is not contiguous is copied first). causal=True lets query i see key j iff
    j <= i + Lk - Lq; a query that sees no key gets zero output. Differentiable once."""
    return _attention(q, k, v, *_check_arguments(q, k, v, causal, scale))


def _check_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float | None) -> tuple[bool, float]:  # the operator's too
    _check_inputs(q, k, v)
    if scale is None:  # 1/sqrt(D), in range: symbolic under torch.compile(dynamic=True)
        return check_bool("causal", causal), check_scale(None, q.shape[-1])
    return check_bool("causal", causal), check_real("scale", scale, -_LARGEST_SCALE, _LARGEST_SCALE)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float) -> torch.Tensor:
    """flash_attention on checked arguments (chapter 3's Triton backend): only q's device is."""
    _check_mode(q.device)
    return _attention(q, k, v, causal, scale)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> torch.Tensor:  # checked arguments, run by the unchecked twin
    q, k, v = _unit_stride_d(q, k, v)  # copied once if strided along D, not again for dQ...
    _refuse_transforms(q, k, v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _check_backward_lengths(q, k)
    return cast(torch.Tensor, torch.ops.attnbook._flash_attention(q, k, v, causal, scale)[0])


def _refuse_transforms(*tensors: torch.Tensor) -> None:  # backward kernels: by loss.backward() only
    functorch = torch._C._functorch  # vmap's tensors pass: its rule checks them unwrapped
    if not torch.compiler.is_compiling() and any(  # the compiler's tensors are neither
            not functorch.is_batchedtensor(t) and (functorch.is_functorch_wrapped_tensor(t)
            or torch.autograd.forward_ad.unpack_dual(t).tangent is not None) for t in tensors):
        raise RuntimeError("flash_attention supports first-order gradients by loss.backward() "
                           "only: not forward-mode AD (jvp, forward_ad) nor torch.func's "
                           "transforms other than vmap")


def _checked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # O, logsumexp
    return _forward(q, k, v, *_check_arguments(q, k, v, causal, scale))


def _save(ctx: Any, inputs: tuple[object, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.save_for_backward(*inputs[:3], *output)  # q, k, v, O, logsumexp: a float a row, no matrix
    ctx.causal, ctx.scale = inputs[3:]
    ctx.mark_non_differentiable(output[1])  # the logsumexp: a loss using it gets an error


def _gradients(ctx: Any, do: torch.Tensor, _dlse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    if torch.is_grad_enabled():  # create_graph=True: a gradient of the gradient
        raise RuntimeError("flash_attention supports first-order gradients only, not create_graph")
    return (*torch.ops.attnbook._flash_attention_backward(*ctx.saved_tensors, do, ctx.causal,
                                                          ctx.scale), None, None)  # dQ, dK, dV


def _checked_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, do: torch.Tensor, causal: bool, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # called directly
    causal, scale = _check_arguments(q, k, v, causal, scale)
    for name, t, dtype, shape in (("o", o, q.dtype, q.shape), ("do", do, q.dtype, q.shape),
                                  ("lse", lse, torch.float32, q.shape[:3])):
        check_tensor(name, t, dtype=dtype, device=q.device, shape=tuple(shape))
    _check_backward_lengths(q, k)
    return _backward(q, k, v, o, lse, do, causal, scale)


if not hasattr(torch.ops.attnbook, "flash_attention"):  # once a process: see below
    for name, body in (("flash_attention", _checked_forward), ("_flash_attention", _forward)):
        op = torch.library.custom_op(f"attnbook::{name}", body, mutates_args=())
        op.register_fake(_fake)
        op.register_autograd(_gradients, setup_context=_save)
        op.register_vmap(_vmap_rule(op, _refuse_transforms))
    for twin, backward in (("", _checked_backward), ("_", _backward)):  # as the forward's: checked
        torch.library.custom_op(f"attnbook::{twin}flash_attention_backward", backward,
                                mutates_args=()).register_fake(_fake)


def _check_backward_lengths(q: torch.Tensor, k: torch.Tensor) -> None:  # before the forward
    _check_tiles("delta", "q", q.shape[2], 32, q.shape[0] * q.shape[1])  # _backward: again
    for name in ("dkdv", "dq"):
        _fitting(name, q, k, _wide(q, k))


# chapters/16-flash-attention-backward.md, "A checked, differentiable function"
_LARGEST_SCALE = torch.finfo(torch.float32).max / _LOG2E  # scale * log2(e) is a float32


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in zip("qkv", (q, k, v)):
        check_tensor(name, t, ndim=4)
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    _check_mode(q.device)
    dtypes = [torch.float16, torch.float32]
    if not INTERPRETED and torch.cuda.get_device_capability(q.device) >= (8, 0):
        dtypes.append(torch.bfloat16)  # the interpreter's tl.dot multiplies its bits as integers
    if q.dtype not in dtypes:
        raise TypeError(f"q has dtype {q.dtype}; flash_attention takes float16, float32 and, on "
                        "a GPU of compute capability 8.0 or newer, bfloat16")
    B, H, _, D = q.shape
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head_dim = q.shape[-1] must be 16, 32, 64 or 128, got {D}")
    check_tensor("k", k, dtype=q.dtype, device=q.device, shape=(B, H, None, D))
    check_tensor("v", v, dtype=q.dtype, device=q.device, shape=tuple(k.shape))
