"""attnbook.kernels (chapters 15 and 16): the Triton FlashAttention kernels against PyTorch.

Without a GPU every kernel runs in Triton's interpreter on CPU tensors, which is slow, so the
shapes below are a covering subset (every length, head size, dtype and mask appears; not every
combination) with B x H = 1 x 2.
"""

import contextlib
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton (the triton extra) has wheels for Linux only")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attnbook.kernels import INTERPRETED, _program, flash_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cpu" if INTERPRETED else "cuda"


def causal_mask(lq, lk, device=DEVICE):
    """Bottom-right aligned: query i may see key j iff j <= i + lk - lq."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


def reference(q, k, v, causal=False, scale=None):
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def inside_nan(x, layout):
    """x as a strided view into a larger NaN-filled buffer: any read outside x gives NaN."""
    b, h, n, d = x.shape
    if layout == "transposed":  # stride 1 along the rows, not along the head dimension
        buffer = torch.full((b, h, d + 5, n + 7), math.nan, dtype=x.dtype, device=x.device)
        view = buffer[:, :, 2:2 + d, 3:3 + n].transpose(-1, -2)
    else:
        buffer = torch.full((b, h + 1, n + 7, d + 8), math.nan, dtype=x.dtype, device=x.device)
        view = buffer[:, 1:, 3:3 + n, 4:4 + d]
    view.copy_(x)
    assert not view.is_contiguous()
    return view


def errors(fn, q, k, v, do, causal, exact, scale=None):
    """Max |error| of the output and of dq, dk, dv against the float64 results `exact`."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal=causal, scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert not any(t.isnan().any() for t in (out, *grads))
    return [(a.double() - b).abs().max().item() for a, b in zip((out, *grads), exact)]


def check_against_torch(lq, lk, d, causal, dtype, seed=0, layout="padded", scale=None, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (spread * torch.randn(1, 2, n, d, generator=gen) for n in (lq, lk, lk))
    do = torch.randn(1, 2, lq, d, generator=gen)
    q, k, v, do = (inside_nan(t.to(DEVICE, dtype), layout) for t in (q, k, v, do))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64 = reference(q64, k64, v64, causal, scale)
    exact = (out64, *torch.autograd.grad(out64, (q64, k64, v64), do.double()))
    ours = errors(flash_attention, q, k, v, do, causal, exact, scale)
    # PyTorch's own error with the same low-precision inputs is the yardstick.
    theirs = errors(lambda *a, causal, scale: reference(*a, causal, scale), q, k, v, do,
                    causal, exact, scale)
    eps = 1e-5 if dtype == torch.float32 else 1e-3
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        size = e.abs().max().item()
        assert a <= 4 * b + eps * max(1.0, size), f"{name}: ours {a:.2e}, torch {b:.2e}"


LENGTHS = [1, 17, 100, 127, 128, 129, 257]


def covering_cases():
    """Every (dtype, D, mask) with two (Lq, Lk) pairs that rotate through all the lengths."""
    cases = []
    combos = [(dtype, d, causal) for dtype in (torch.float32, torch.float16)
              for d in (16, 32, 64, 128) for causal in (False, True)]
    for i, (dtype, d, causal) in enumerate(combos):
        for lq, lk in [(LENGTHS[i % 7], LENGTHS[(3 * i + 2) % 7]),
                       (LENGTHS[(i + 4) % 7], LENGTHS[(5 * i + 1) % 7])]:
            cases.append((lq, lk, d, causal, dtype))
    return cases


CASES = covering_cases()


def case_id(case):
    lq, lk, d, causal, dtype = case
    return f"Lq{lq}-Lk{lk}-D{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_values_and_gradients_match_torch(case):
    check_against_torch(*case)


@pytest.mark.parametrize("tiles", [(64, 32), (32, 64), (16, 64)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("lq, lk", [(100, 100), (70, 129), (129, 70)])
def test_rectangular_tiles_split_the_causal_loops_correctly(tiles, lq, lk, monkeypatch):
    # The interpreter runs TILE_ROWS' square tiles; a GPU runs LAUNCH's, such as 128 x 64. The
    # masked and unmasked loops must meet where they should with BLOCK_M != BLOCK_N too.
    from attnbook import kernels

    monkeypatch.setattr(kernels, "_launch_settings", lambda *args: [(*tiles, 4, 2)])
    check_against_torch(lq, lk, 32, True, torch.float32, seed=5)  # patched launch_settings once,
    # which the launcher does not call: the square tiles ran


def test_launch_settings_returns_a_copy_of_the_tables():
    # AT52-K F6: launch_settings returned LAUNCH's and WIDE_LAUNCH's own lists
    from attnbook.kernels import launch_settings

    for wide in (False, True):
        before = launch_settings("forward", 2, 128, 80, wide=wide)
        launch_settings("forward", 2, 128, 80, wide=wide).append((1, 1, 1, 1))
        launch_settings("forward", 2, 128, 80, wide=wide).clear()
        assert launch_settings("forward", 2, 128, 80, wide=wide) == before != []


def test_launch_settings_choose_by_gpu_and_dtype():
    from attnbook.kernels import (
        LAUNCH,
        NUM_STAGES,
        NUM_WARPS,
        TILE_ROWS,
        WIDE_LAUNCH,
        launch_settings,
    )

    for (capability, kernel), by_dim in LAUNCH.items():
        assert set(by_dim) == {64, 128} and all(len(c) >= 1 for c in by_dim.values())
        for d in (16, 32, 64, 128):
            assert launch_settings(kernel, 2, d, capability) == by_dim[64 if d <= 64 else 128]
    # a WIDE launch: WIDE_LAUNCH's where it has them, else LAUNCH's
    for (capability, kernel), by_dim in LAUNCH.items():
        for d in (64, 128):
            own = WIDE_LAUNCH.get((capability, kernel), {}).get(d)
            assert launch_settings(kernel, 2, d, capability, wide=True) == (own or by_dim[d])
    assert launch_settings("dkdv", 2, 64, 80, True)[0] == (32, 32, 4, 3)  # 64 x 64 spilled
    # sm_86 and sm_89 (RTX 30 and 40, L4) take the A100's settings, sm_75 the T4's
    assert launch_settings("dq", 2, 64, 86) == LAUNCH[80, "dq"][64]
    assert launch_settings("dq", 2, 64, 75) == LAUNCH[75, "dq"][64]
    # float32 everywhere, GPUs the table does not know, and the interpreter: TILE_ROWS
    for capability in (None, 70, 90, 100, 120):
        tile = TILE_ROWS["dkdv", 4][128]
        assert launch_settings("dkdv", 4, 128, capability) == [(tile, tile, NUM_WARPS, NUM_STAGES)]
    for capability in (None, 70, 100, 120):
        tile = TILE_ROWS["forward", 2][64]
        assert launch_settings("forward", 2, 64, capability) == [(tile, tile, NUM_WARPS, NUM_STAGES)]


@pytest.mark.parametrize("layout", ["padded", "transposed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_strides(layout, causal):
    check_against_torch(65, 70, 32, causal, torch.float32, seed=1, layout=layout)


# Launch hazards that the interpreter hides: offsets past 2**31 elements,
# CUDA's grid limits, the device the kernels launch on, and inputs strided along D.

LARGE_OFFSETS = """
import resource, sys, torch, torch.nn.functional as F
from attnbook.triton_mode import use_triton_interpreter
use_triton_interpreter()
from attnbook.kernels import INTERPRETED, flash_attention
device = "cpu" if INTERPRETED else "cuda"
L, H, D, STRIDE = 20, 2, 16, 2**27  # row 16 of each tensor starts past element 2**31
# q, k, v and dO side by side in each row, like a packed QKV, rows STRIDE elements apart; the
# buffer (5 GB of float16) is reserved, but only the pages of its 20 rows are ever touched.
buffer = torch.empty(STRIDE * (L - 1) + 4 * H * D, dtype=torch.float16, device=device)
gen = torch.Generator().manual_seed(0)
views = []
for i in range(4):
    view = buffer.as_strided((1, H, L, D), (STRIDE * L, D, STRIDE, 1), storage_offset=i * H * D)
    view.copy_(torch.randn(1, H, L, D, generator=gen))
    views.append(view)
q, k, v, do = views
assert (L - 1) * STRIDE > 2**31 and not q.is_contiguous()
for causal in (False, True):
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*inputs, causal=causal)
    grads = torch.autograd.grad(out, inputs, do)
    exact = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, exact, do.double().cpu())
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        error = (ours.double().cpu() - theirs).abs().max().item()
        assert error < 1e-2, f"causal={causal} {name}: max error {error:.2e}"
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
print(f"large offsets: forward and backward match SDPA; peak RSS {rss:.2f} GiB")
"""


def test_row_offsets_past_2_31_elements_are_formed_in_64_bits():
    # 32-bit offsets wrap at row 16: a segmentation fault in the interpreter, wrong memory on a
    # GPU. In a child process, so that a crash fails this test rather than the test run.
    result = run_python(LARGE_OFFSETS, timeout=600)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-3000:])
    peak = float(result.stdout.split("peak RSS ")[1].split()[0])
    assert peak < 2.0, result.stdout  # the 5 GB buffer stays mostly untouched


class Launches:
    """Stands in for the kernels of attnbook.kernels: records each launch's kernel, grid (as
    CUDA would get it), tensor arguments and the device the guard made current, then runs it
    (unless run=False)."""

    CUDA_GRID_LIMITS = (2**31 - 1, 65_535, 65_535)

    def __init__(self, monkeypatch, run=True):
        from attnbook import kernels

        self.records, self.current = [], None
        self.constants = []  # each launch's keyword arguments (TILES_FIRST, BLOCK_M, ...)
        for name in ("_forward_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel"):
            monkeypatch.setattr(kernels, name, self._stand_in(name, getattr(kernels, name), run))

        @contextlib.contextmanager
        def guard(device):
            self.current = device
            yield
            self.current = None

        monkeypatch.setattr(kernels, "_device_guard", guard, raising=False)

    def _stand_in(self, name, kernel, run):
        launches = self

        class StandIn:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    shape = tuple(grid(kwargs) if callable(grid) else grid)
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    launches.records.append((name, shape, tensors, launches.current))
                    launches.constants.append(kwargs)
                    if run:
                        kernel[grid](*args, **kwargs)
                return launch

        return StandIn()


def test_every_launch_stays_within_cudas_grid_limits(monkeypatch):
    # B * H = 70,000 (large-batch inference): a grid of (tiles, B * H) has 70,000 programs on its
    # second axis, where CUDA allows 65,535. The launches are recorded, not run (the
    # interpreter would take minutes over 70,000 programs); test_batch_and_heads runs them.
    launches = Launches(monkeypatch, run=False)
    q = torch.zeros(7_000, 10, 3, 16, device=DEVICE, requires_grad=True)
    out = flash_attention(q, q, q, causal=True)
    out.backward(torch.zeros_like(out))
    names = [name for name, *_ in launches.records]
    assert sorted(names) == ["_delta_kernel", "_dkdv_kernel", "_dq_kernel", "_forward_kernel"]
    for name, grid, *_ in launches.records:
        assert 1 <= len(grid) <= 3, (name, grid)
        assert all(1 <= n <= limit for n, limit in zip(grid, Launches.CUDA_GRID_LIMITS)), (name, grid)
        assert math.prod(grid) >= 70_000, (name, grid)  # every (batch, head) has its programs


def test_the_grid_puts_the_tile_count_first_only_when_it_must():
    # Before, a length of more than 65,535 tiles was refused whatever B * H was, though the old
    # (tiles, B * H) grid had launched it.
    from attnbook.kernels import _check_tiles, _grid

    assert _grid(100, 16, 70_000) == ((70_000, 7), False)  # (B * H, tiles), as before
    assert _grid(65_535 * 16, 16, 70_000) == ((70_000, 65_535), False)
    assert _grid(65_535 * 16 + 1, 16, 3) == ((65_536, 3), True)  # too many tiles for axis 1
    assert _grid(65_535 * 16 + 1, 16, 65_535) == ((65_536, 65_535), True)
    with pytest.raises(ValueError, match="q has Lq = 1048561 rows, too many for the forward "
                                         "kernel at B \\* H = 65536: its tiles of 16 rows number "
                                         "65536; both pass the 65,535 programs"):
        _check_tiles("forward", "q", 65_535 * 16 + 1, 16, 65_536)  # neither order fits: _grid's
        # callers refuse it by name (before, _grid refused it too, naming no argument)


def test_a_length_past_65535_tiles_launches_with_its_tiles_on_the_first_axis(monkeypatch):
    # float16, D = 16: the forward's tiles of 64 rows number 32,768 (the (B * H, tiles) grid),
    # the delta kernel's of 32 rows 65,536 (the (tiles, B * H) grid). Refused before. Recorded,
    # not run: the inputs are expanded views that hold no memory.
    launches = Launches(monkeypatch, run=False)
    n = 65_535 * 32 + 1
    q = torch.zeros(1, 1, 1, 16, device=DEVICE, dtype=torch.float16).expand(1, 3, n, 16)
    q.requires_grad_()
    out = flash_attention(q, q, q, causal=True)
    out.backward(torch.zeros_like(out))
    grids = {name: (grid, kwargs["TILES_FIRST"])
             for (name, grid, *_), kwargs in zip(launches.records, launches.constants)}
    assert grids["_forward_kernel"] == ((3, 32_768), False)
    assert grids["_delta_kernel"] == ((65_536, 3), True)
    for name, (grid, _) in grids.items():
        assert all(1 <= s <= limit for s, limit in zip(grid, Launches.CUDA_GRID_LIMITS)), name


@triton.jit
def _first_row_probe(OUT, H, BLOCK: tl.constexpr, WIDE: tl.constexpr, TILES_FIRST: tl.constexpr):
    # Stores the first row that _program gives the program that runs it.
    bh, b, h, start = _program(H, BLOCK, WIDE, TILES_FIRST)
    tl.store(OUT, start.to(tl.int64))


@pytest.mark.skipif(not INTERPRETED, reason="launches one program of a huge grid in the interpreter")
def test_the_first_row_of_a_wide_launch_counts_past_2_to_the_31(monkeypatch):
    # Program 2**25 of a (tiles, B * H) grid with tiles of 64 rows (a length of 2**31 + 64) starts
    # at row 2**31. Before, program_id * BLOCK was multiplied in int32 and wrapped to -2**31.
    from triton.runtime import interpreter

    from attnbook import kernels

    program = 2**31 // 64
    assert kernels._grid(2**31 + 64, 64, 1) == ((program + 1, 1), True)
    builder = interpreter.interpreter_builder  # run only program (2**25, 0) of the grid
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_dim", lambda x, y, z: set_dim(program + 1, y, z))
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_idx(x + program, y, z))
    out = torch.zeros(1, dtype=torch.int64)
    _first_row_probe[(1, 1)](out, 1, BLOCK=64, WIDE=True, TILES_FIRST=True)
    assert out.item() == program * 64 == 2**31


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_tiles_first_grid_computes_the_same_attention(monkeypatch, causal):
    # The (tiles, B * H) order forced on a small problem (a private threshold of 1 tile): every
    # kernel must read its tile and its (batch, head) from the swapped axes.
    from attnbook import kernels

    monkeypatch.setattr(kernels, "_TILES_FIRST_FROM", 1)
    launches = Launches(monkeypatch)
    check_against_torch(100, 70, 32, causal, torch.float32, seed=8)
    assert len(launches.records) == 4  # the forward, delta, dK and dV, dQ
    for (name, grid, *_), kwargs in zip(launches.records, launches.constants):
        assert kwargs["TILES_FIRST"] and grid[1] == 2, (name, grid)  # B * H = 2 on axis 1


def test_every_launch_runs_under_the_guard_of_the_inputs_device(monkeypatch):
    launches = Launches(monkeypatch)
    q = torch.randn(1, 2, 40, 16, device=DEVICE, requires_grad=True)
    flash_attention(q, q, q).sum().backward()
    assert len(launches.records) == 4
    for name, _, _, current in launches.records:
        assert current == q.device, name  # the guard (on a GPU, torch.cuda.device) was entered


def test_inputs_strided_along_d_are_copied_once_and_give_the_same_answer(monkeypatch):
    # A last dimension that is not contiguous compiles to a kernel without vector loads: the
    # launcher copies such inputs, so every tensor it launches has stride 1 along D.
    launches = Launches(monkeypatch)
    torch.manual_seed(6)
    q, k, v, do = (inside_nan(torch.randn(1, 2, 40, 16).to(DEVICE), "transposed") for _ in range(4))
    assert q.stride(-1) != 1
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*inputs, causal=True)
    grads = torch.autograd.grad(out, inputs, do)
    assert len(launches.records) == 4
    for name, _, tensors, _ in launches.records:
        assert all(t.stride(-1) == 1 for t in tensors), (name, [t.stride() for t in tensors])
    # the copy changes nothing: the same answer, bit for bit, as from contiguous inputs
    same = [t.contiguous().requires_grad_() for t in (q, k, v)]
    out_contiguous = flash_attention(*same, causal=True)
    assert torch.equal(out, out_contiguous)
    for ours, theirs in zip(grads, torch.autograd.grad(out_contiguous, same, do.contiguous())):
        assert torch.equal(ours, theirs)


def test_the_device_guard_makes_a_cuda_device_current_and_is_nothing_on_the_cpu():
    from attnbook.kernels import _device_guard

    assert isinstance(_device_guard(torch.device("cpu")), contextlib.nullcontext)
    guard = _device_guard(torch.device("cuda:1"))  # made, not entered: no GPU needed
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_autotuning_times_once_per_power_of_two_bucket_and_can_be_turned_off(monkeypatch):
    # Keyed on the exact (Lq, Lk), every new pair of lengths was timed again, and
    # timing noise could pick other tiles in another process. The interpreter has one candidate
    # and no GPU to time on: two candidates and a stand-in timer (the second one "faster").
    from attnbook import kernels

    candidates = [(32, 32, 4, 2), (16, 16, 4, 2)]
    monkeypatch.setattr(kernels, "_launch_settings", lambda *args: candidates)
    monkeypatch.setattr(kernels, "AUTOTUNE_FROM", 1)
    monkeypatch.setattr(kernels, "_FASTEST", {}, raising=False)
    timed = []

    def seconds(run):
        timed.append(run.args[0])
        run()
        return 1.0 if run.args[0] == candidates[0] else 0.5

    monkeypatch.setattr(kernels, "_seconds", seconds, raising=False)
    launches = Launches(monkeypatch)

    def forward(length):
        q = torch.randn(1, 2, length, 16, device=DEVICE)
        out = flash_attention(q, q, q, causal=True)
        torch.testing.assert_close(out, reference(q, q, q, causal=True), rtol=1e-5, atol=1e-5)
        return launches.records[-1][1]  # the grid of the last launch

    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", "1")
    assert forward(70) == (2, math.ceil(70 / 16))  # timed both, launched the faster
    assert timed == candidates
    assert forward(100) == (2, math.ceil(100 / 16)) and len(timed) == 2  # 70, 100: bucket 128
    forward(130)  # another bucket (256): timed again
    assert len(timed) == 4
    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", "0")  # never timed: the first candidate, always
    assert forward(300) == (2, math.ceil(300 / 32)) and len(timed) == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_a_second_gpu_run_there():
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 3, 300, 64, device="cuda:1", dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    with torch.cuda.device(0):
        out = flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert torch.cuda.current_device() == 0  # the guard restored the current device
    expected = reference(q, k, v, causal=True)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
    for ours, theirs in zip(grads, torch.autograd.grad(expected, (q, k, v), torch.ones_like(out))):
        assert ours.device == q.device
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_custom_scale_and_large_scores(scale):
    # spread 4 and scale 3: scores of several hundred, where a naive exp would overflow
    check_against_torch(100, 100, 64, True, torch.float32, seed=2, scale=scale, spread=4.0)


@pytest.mark.parametrize("scale", [1e37, -1e37, 2e-38, 0.0])
def test_extreme_finite_scales_give_the_right_answer(scale):
    # Near float32's limits the weights are a hard maximum (or minimum), or uniform; the kernels
    # keep them finite. The largest scale is float32's max / log2(e): beyond it, ValueError.
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for n in (20, 37, 37))
    out = flash_attention(q, k, v, causal=True, scale=scale)
    expected = reference(q.double(), k.double(), v.double(), causal=True, scale=scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_input_propagates_as_in_torch(tensor, bad):
    # A NaN or inf in the input is never turned into a finite answer: the outputs it reaches are
    # NaN or inf, exactly where PyTorch's are (no mask: PyTorch's NaN also crosses a mask).
    torch.manual_seed(4)
    qkv = {name: torch.randn(1, 2, 40, 16, device=DEVICE) for name in "qkv"}
    qkv[tensor][0, 1, 7, 3] = bad
    out = flash_attention(**qkv, causal=False)
    expected = reference(*qkv.values())
    finite = expected.isfinite()
    assert not finite.all() and torch.equal(out.isfinite(), finite)
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("lq, lk", [(100, 100), (70, 100), (100, 70)])
def test_every_row_that_may_see_a_masked_nan_is_nan(tensor, lq, lk):
    # Under a causal mask, a NaN in key j reaches the rows that may see it on every backend
    # (ours, PyTorch's); the rows it is hidden from may be NaN or not, by tile and backend.
    torch.manual_seed(5)
    qkv = {"q": torch.randn(1, 1, lq, 16, device=DEVICE)}
    qkv.update({name: torch.randn(1, 1, lk, 16, device=DEVICE) for name in "kv"})
    j = lk - 1  # the last key: only the rows i with j <= i + lk - lq may see it
    qkv[tensor][0, 0, j] = math.nan
    sees = torch.arange(lq, device=DEVICE) + (lk - lq) >= j
    for out in (flash_attention(**qkv, causal=True), reference(*qkv.values(), causal=True)):
        assert out[0, 0, sees].isnan().all()


@pytest.mark.parametrize("seed", range(3))
def test_batch_and_heads(seed):
    torch.manual_seed(seed)
    q = torch.randn(2, 3, 40, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 3, 70, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    out = flash_attention(q, k, v, causal=bool(seed % 2))
    expected = reference(q, k, v, causal=bool(seed % 2))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    do = torch.randn_like(out)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), do),
                            torch.autograd.grad(expected, (q, k, v), do)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_rows_without_keys_give_zeros_and_zero_gradients():
    # Lq > Lk under the bottom-right causal mask: the first Lq - Lk queries see no key.
    q = torch.randn(1, 2, 90, 32, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 32, device=DEVICE, requires_grad=True) for _ in range(2))
    out = flash_attention(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert (out[:, :, :70] == 0).all() and (dq[:, :, :70] == 0).all()
    assert not any(t.isnan().any() for t in (out, dq, dk, dv))
    torch.testing.assert_close(out, reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_shared_tensor_and_stride_zero_heads():
    # q = k = v (gradients add up) and one key/value head expanded over four query heads
    x = torch.randn(1, 4, 50, 16, device=DEVICE, requires_grad=True)
    kv = torch.randn(1, 1, 50, 16, device=DEVICE, requires_grad=True)
    out = flash_attention(x, kv.expand(1, 4, 50, 16), x, causal=True)
    expected = reference(x, kv.repeat(1, 4, 1, 1), x, causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(torch.autograd.grad(out.sum(), (x, kv)),
                            torch.autograd.grad(expected.sum(), (x, kv))):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_output_properties_and_no_grad():
    q = torch.randn(1, 2, 30, 16, device=DEVICE, dtype=torch.float16)
    with torch.no_grad():
        out = flash_attention(q, q, q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.is_contiguous() and out.grad_fn is None
    torch.testing.assert_close(out, flash_attention(q, q, q, scale=16 ** -0.5))


@pytest.mark.skipif(not INTERPRETED, reason="bfloat16 is refused only in the interpreter")
def test_bfloat16_is_refused_by_the_interpreter():
    x = torch.randn(1, 1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        flash_attention(x, x, x)


@pytest.mark.skipif(INTERPRETED or torch.cuda.get_device_capability() < (8, 0),
                    reason="bfloat16 needs the compiled kernels on a GPU of capability >= 8.0")
def test_bfloat16_on_gpu():
    check_against_torch(129, 100, 64, True, torch.bfloat16)


def t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(*shape, dtype=dtype, device=device)


GOOD = t(1, 2, 8, 16)
BAD_INPUTS = {
    "q-not-a-tensor": (dict(q=GOOD.tolist()), TypeError, "q must be a torch.Tensor"),
    "k-3d": (dict(k=t(2, 8, 16)), ValueError, r"k must have 4 dimensions.*\(2, 8, 16\)"),
    "v-5d": (dict(v=t(1, 1, 2, 8, 16)), ValueError, "v must have 4 dimensions"),
    "q-float64": (dict(q=t(1, 2, 8, 16, dtype=torch.float64)), TypeError,
                  "q has dtype torch.float64"),
    "k-int64": (dict(k=t(1, 2, 8, 16, dtype=torch.int64)), TypeError,
                "k must be a floating-point tensor, got dtype torch.int64"),
    "v-bool": (dict(v=t(1, 2, 8, 16, dtype=torch.bool)), TypeError,
               "v must be a floating-point tensor, got dtype torch.bool"),
    "mixed-dtypes": (dict(k=t(1, 2, 8, 16, dtype=torch.float16)), TypeError,
                     "k must be a torch.float32 tensor, got dtype torch.float16"),
    "head-dim-48": (dict(q=t(1, 2, 8, 48), k=t(1, 2, 8, 48), v=t(1, 2, 8, 48)), ValueError,
                    "head_dim.*got 48"),
    "head-dim-256": (dict(q=t(1, 2, 8, 256), k=t(1, 2, 8, 256), v=t(1, 2, 8, 256)),
                     ValueError, "head_dim.*got 256"),
    "head-dim-8": (dict(q=t(1, 2, 8, 8), k=t(1, 2, 8, 8), v=t(1, 2, 8, 8)), ValueError,
                   "head_dim.*got 8"),
    "k-head-dim": (dict(k=t(1, 2, 8, 32)), ValueError, r"k must have shape.*\(1, 2, 8, 32\)"),
    "k-batch": (dict(k=t(2, 2, 8, 16), v=t(2, 2, 8, 16)), ValueError,
                r"k must have shape.*\(2, 2, 8, 16\)"),
    "k-heads": (dict(k=t(1, 1, 8, 16), v=t(1, 1, 8, 16)), ValueError,
                r"k must have shape.*\(1, 1, 8, 16\)"),
    "v-length": (dict(v=t(1, 2, 9, 16)), ValueError,
                 r"v must have shape \(1, 2, 8, 16\), got shape \(1, 2, 9, 16\)"),
    "q-empty": (dict(q=t(1, 2, 0, 16)), ValueError, r"q must not be empty.*\(1, 2, 0, 16\)"),
    "k-empty": (dict(k=t(1, 2, 0, 16), v=t(1, 2, 0, 16)), ValueError, "k must not be empty"),
    "batch-empty": (dict(q=t(0, 2, 8, 16)), ValueError, "q must not be empty"),
    "causal-int": (dict(causal=1), TypeError, "causal must be True or False, got causal=1"),
    "causal-str": (dict(causal="yes"), TypeError,
                   "causal must be True or False, got causal='yes'"),
    "scale-str": (dict(scale="0.5"), TypeError, "scale must be a real number, got scale='0.5'"),
    "scale-bool": (dict(scale=True), TypeError, "scale must be a real number, got scale=True"),
    "scale-nan": (dict(scale=math.nan), ValueError, "scale must be a finite number.*got scale=nan"),
    "scale-inf": (dict(scale=math.inf), ValueError, "scale must be a finite number.*got scale=inf"),
    # scale * log2(e) would overflow float32 inside the kernels: every output was NaN
    "scale-3e38": (dict(scale=3e38), ValueError, r"scale must be a finite number in "
                   r"\[-2\.358\d*e\+38, 2\.358\d*e\+38\], got scale=3e\+38"),
    "scale-minus-3e38": (dict(scale=-3e38), ValueError,
                         r"scale must be a finite number in \[-2\.358.*got scale=-3e\+38"),
}
# Before, the interpreter raised a raw NotImplementedError (it copies tensors to the CPU).
BAD_INPUTS["meta-device"] = (dict(q=t(1, 2, 8, 16, device="meta"), k=t(1, 2, 8, 16, device="meta"),
                              v=t(1, 2, 8, 16, device="meta")), ValueError, "q is on device meta")
if torch.cuda.is_available():
    BAD_INPUTS["mixed-devices"] = (dict(k=t(1, 2, 8, 16, device="cpu")), ValueError,
                                   "k must be on device cuda")


@pytest.mark.parametrize("kwargs, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_refused(kwargs, error, message):
    args = {"q": GOOD, "k": GOOD, "v": GOOD, **kwargs}
    with pytest.raises(error, match=message):
        flash_attention(**args)


def run_python(code, timeout=120, **env_changes):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_importing_the_package_does_not_import_triton():
    result = run_python("import sys, attnbook; assert 'triton' not in sys.modules, 'eager'; "
                        "print(attnbook.__all__)")
    assert result.returncode == 0, result.stderr
    assert "kernels" in result.stdout


CHOOSE = "from attnbook.triton_mode import use_triton_interpreter as choose; "


def test_importing_the_kernels_changes_no_environment_variable():
    code = ("import os; before = dict(os.environ); import attnbook.kernels as K; "
            "assert dict(os.environ) == before, 'changed'; print(K.INTERPRETED)")
    result = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]  # nobody asked for the interpreter


def test_without_a_gpu_use_triton_interpreter_chooses_the_interpreter():
    code = (CHOOSE + "import os, torch; print(choose()); import attnbook.kernels as K; "
            "print(os.environ['TRITON_INTERPRET'], K.INTERPRETED); "
            "x = torch.randn(1, 1, 20, 16); "
            "torch.testing.assert_close(K.flash_attention(x, x, x), "
            "torch.nn.functional.scaled_dot_product_attention(x, x, x))")
    result = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "1", "True"]


def test_an_explicit_choice_is_kept_and_cpu_tensors_get_a_clear_error():
    code = (CHOOSE + "import os, torch; print(choose()); import attnbook.kernels as K; "
            "print(os.environ['TRITON_INTERPRET'], K.INTERPRETED); "
            "x = torch.randn(1, 1, 20, 16); K.flash_attention(x, x, x)")
    result = run_python(code, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    assert result.stdout.split() == ["False", "0", "False"]
    assert result.returncode != 0
    assert "ValueError: q is on device cpu" in result.stderr
    assert "use_triton_interpreter()" in result.stderr and "TRITON_INTERPRET=1" in result.stderr


def test_setting_the_variable_after_triton_was_imported_compiled_gives_a_clear_error():
    # Before, use_triton_interpreter() returned True and flash_attention raised later.
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton; "
            "os.environ['TRITON_INTERPRET'] = '1'; " + CHOOSE + "choose()")
    result = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert result.returncode != 0
    assert "RuntimeError: triton was imported in compiled mode" in result.stderr


def test_choosing_after_triton_was_imported_compiled_gives_a_clear_error():
    # torch.utils.flop_counter imports triton; without TRITON_INTERPRET its library is compiled.
    code = "import torch.utils.flop_counter; " + CHOOSE + "choose()"
    result = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert result.returncode != 0
    assert "RuntimeError: triton was imported in compiled mode" in result.stderr
    assert "before anything imports triton" in result.stderr


def test_the_import_order_of_the_kernels_does_not_matter():
    # chosen first, the interpreter works whatever imports triton before the kernels
    code = (CHOOSE + "choose(); import torch, torch.utils.flop_counter; "
            "import attnbook.gpt; import attnbook.kernels as K; x = torch.randn(1, 1, 4, 16); "
            "torch.testing.assert_close(K.flash_attention(x, x, x), "
            "torch.nn.functional.scaled_dot_product_attention(x, x, x)); print(K.INTERPRETED)")
    result = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


def test_interpreted_kernels_with_a_compiled_library_give_a_clear_error():
    # the variable set by hand after triton's first import: kernels interpreted, tl.sum compiled
    code = ("import os, torch, torch.utils.flop_counter; os.environ['TRITON_INTERPRET'] = '1'; "
            "import attnbook.kernels as K; x = torch.randn(1, 1, 4, 16); K.flash_attention(x, x, x)")
    result = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert result.returncode != 0
    assert "RuntimeError: triton was imported in compiled mode before TRITON_INTERPRET" in \
        result.stderr


def test_benchmark_small_mode_writes_csv_and_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "flash_attention.py"), "--small",
         "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr
    with (tmp_path / "flash_attention.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["provider", "mode", "dtype", "device", "batch", "heads",
                                 "seqlen", "head_dim", "causal", "ms", "tflops",
                                 "peak_mem_mb", "status"]
    providers = ["ours", "sdpa-flash", "sdpa-efficient", "sdpa-math", "sdpa-cudnn", "naive"]
    # 6 providers x 2 modes x 2 lengths x 2 masks
    assert len(rows) == len(providers) * 2 * 2 * 2
    assert {r["provider"] for r in rows} == set(providers)
    assert {(r["seqlen"], r["causal"], r["mode"]) for r in rows} == {
        (n, c, m) for n in ("64", "128") for c in ("False", "True") for m in ("fwd", "fwd+bwd")}
    for r in rows:
        assert r["status"] in ("ok", "unavailable")
        if r["provider"] in ("ours", "sdpa-math", "naive"):
            assert r["status"] == "ok" and float(r["tflops"]) > 0 and float(r["ms"]) > 0
    if importlib.util.find_spec("matplotlib"):  # without it, the CSV alone (the test below)
        assert (tmp_path / "flash_attention.png").stat().st_size > 1000
    else:
        assert "matplotlib" in result.stdout + result.stderr


def test_benchmark_writes_its_csv_without_matplotlib(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import flash_attention as benchmark
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert benchmark.plot([], ROOT / "never-written.png") is False


def _benchmark_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import flash_attention as benchmark
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return benchmark


def _run_benchmark(benchmark, monkeypatch, tmp_path, dtypes):
    """benchmarks/flash_attention.py's main on one tiny size per dtype, ours and naive only."""
    def configs(small):
        for dtype in dtypes:
            yield {"device": DEVICE, "dtype": dtype, "head_dim": 16, "causal": False,
                   "seqlen": 64, "batch": 1, "heads": 2}

    monkeypatch.setattr(benchmark, "configs", configs)
    monkeypatch.setattr(benchmark, "providers", lambda: {
        "ours": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
        "naive": benchmark.naive_attention})
    monkeypatch.setattr(benchmark, "plot", lambda rows, path: False)
    argv = ["--small", "--repeats", "1"] if INTERPRETED else []
    return benchmark.main([*argv, "--out", str(tmp_path)])


def test_benchmark_skips_a_refused_dtype_and_keeps_the_others(monkeypatch, tmp_path):
    # a T4's refusal of bfloat16, as attnbook.kernels words it (the interpreter refuses it too)
    benchmark = _benchmark_module()
    if not INTERPRETED:
        check = benchmark.check_ours

        def refuse_bfloat16(device, dtype, head_dim, causal):
            if dtype == torch.bfloat16:
                raise TypeError("q has dtype torch.bfloat16; flash_attention takes float16, ...")
            return check(device, dtype, head_dim, causal)

        monkeypatch.setattr(benchmark, "check_ours", refuse_bfloat16)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    assert _run_benchmark(benchmark, monkeypatch, tmp_path, dtypes) == 0
    with (tmp_path / "flash_attention.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["dtype"], r["provider"], r["mode"], r["status"]) for r in rows] == [
        *((dtype, name, mode, "ok") for dtype in ("float16",) for name in ("ours", "naive")
          for mode in ("fwd", "fwd+bwd")),
        ("bfloat16", "ours", "", "unsupported"),  # named, not measured, not a crash
        *(("float32", name, mode, "ok") for name in ("ours", "naive")
          for mode in ("fwd", "fwd+bwd"))]
    refused = rows[len(rows) // 2]  # one row for every size of bfloat16: it names none
    assert [refused[key] for key in ("batch", "heads", "seqlen", "head_dim", "causal")] == [""] * 5


def test_benchmark_stops_on_a_type_error_that_is_not_the_dtype_refusal(monkeypatch, tmp_path):
    benchmark = _benchmark_module()

    def broken(device, dtype, head_dim, causal):
        raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")

    monkeypatch.setattr(benchmark, "check_ours", broken)
    with pytest.raises(TypeError, match="unsupported operand"):  # a bug, not an "unsupported" row
        _run_benchmark(benchmark, monkeypatch, tmp_path, (torch.float32,))


def test_benchmark_keeps_the_rows_measured_before_an_error(monkeypatch, tmp_path):
    benchmark = _benchmark_module()
    measure, calls = benchmark.measure, []

    def fail_on_the_third(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt  # an error that no part of the benchmark catches
        return measure(*args)

    monkeypatch.setattr(benchmark, "measure", fail_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        _run_benchmark(benchmark, monkeypatch, tmp_path, (torch.float32,))
    with (tmp_path / "flash_attention.csv.partial").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["provider"], r["mode"], r["status"]) for r in rows] == [
        ("ours", "fwd", "ok"), ("ours", "fwd+bwd", "ok")]
    assert not (tmp_path / "flash_attention.csv").exists()  # only a completed run writes it


def test_an_interrupted_benchmark_rerun_keeps_the_earlier_results(monkeypatch, tmp_path):
    benchmark = _benchmark_module()
    assert _run_benchmark(benchmark, monkeypatch, tmp_path, (torch.float32,)) == 0
    first = (tmp_path / "flash_attention.csv").read_bytes()
    assert first.count(b"\n") == 5  # the header and four rows

    def interrupted(*args):
        raise KeyboardInterrupt  # at the rerun's first measurement

    monkeypatch.setattr(benchmark, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run_benchmark(benchmark, monkeypatch, tmp_path, (torch.float32,))
    assert (tmp_path / "flash_attention.csv").read_bytes() == first


def test_chapters_become_plain_scripts_without_the_setup_cell(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_chapters
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cells = [{"cell_type": "code", "source": ["# Setup. On Google Colab this installs\n",
                                              "print(version('attnbook'))"]},
             {"cell_type": "markdown", "source": ["# Title"]},
             {"cell_type": "code", "source": ["%matplotlib inline\n", "x = 2\n", "!ls"]},
             {"cell_type": "code", "source": ["assert x == 2"]}]
    notebook = tmp_path / "99-test.ipynb"
    notebook.write_text(json.dumps({"cells": cells}))
    script = run_chapters.script(notebook)
    assert script == "# %matplotlib inline\nx = 2\n# !ls\n\nassert x == 2\n"
    real = run_chapters.script(ROOT / "notebooks" / "01-queries-keys-values.ipynb")
    assert "version('attnbook')" not in real and "# Setup." not in real  # the setup cell: gone


def test_gpu_session_script_is_valid_bash():
    script = ROOT / "benchmarks" / "gpu_session.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(script, os.X_OK)


SPELLINGS = ["1", "true", "TRUE", "True", "on", "ON", "yes", "YES", "Yes", "y", "Y",
             "0", "false", "off", "no", "n", "", " 1", "1 ", "2", "t", "enable"]


@pytest.mark.parametrize("value", SPELLINGS)
def test_use_triton_interpreter_reads_the_variable_as_triton_does(value, monkeypatch):
    """TRITON_INTERPRET=yes made Triton interpret while use_triton_interpreter()
    said False. The reference is the installed Triton's own reader of boolean variables."""
    from triton._C.libtriton import getenv_bool

    from attnbook.triton_mode import use_triton_interpreter

    monkeypatch.setenv("TRITON_INTERPRET", value)
    if getenv_bool("TRITON_INTERPRET", False) and not INTERPRETED:  # triton imported compiled
        with pytest.raises(RuntimeError, match="triton was imported in compiled mode"):
            use_triton_interpreter()
    else:
        assert use_triton_interpreter() == getenv_bool("TRITON_INTERPRET", False)
    assert os.environ["TRITON_INTERPRET"] == value  # a choice already made is kept


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(kernel="backward"), ValueError, r"kernel must be one of \['dkdv', 'dq', 'forward'\], "
                                          r"got kernel='backward'"),
    (dict(element_size=8), ValueError, r"element_size must be one of \[2, 4\], got element_size=8"),
    (dict(element_size=1, capability=80), ValueError, "element_size=1"),
    (dict(head_dim=96), ValueError, r"head_dim must be one of \[16, 32, 64, 128\], got head_dim=96"),
    (dict(head_dim=8, capability=80), ValueError, "head_dim=8"),  # was the d <= 64 entry
    (dict(head_dim=256, capability=90), ValueError, "head_dim=256"),  # was the 128 entry
    (dict(head_dim=64.0), TypeError, "head_dim"),
    (dict(capability=-1), ValueError, "capability"),
    (dict(capability="80"), TypeError, "capability"),
])
def test_launch_settings_name_what_they_have_no_entry_for(kwargs, error, match):
    """A bare KeyError (or, on a GPU, another head size's settings) before."""
    from attnbook.kernels import launch_settings

    args = dict(kernel="forward", element_size=2, head_dim=64, capability=None) | kwargs
    with pytest.raises(error, match=match):
        launch_settings(**args)


class _Recorded:
    """A stand-in kernel: records each launch's BLOCK_M and runs nothing; a BLOCK_M in `fail`
    raises Triton's OutOfResources, as a compilation that needs too much shared memory does."""

    def __init__(self, fail=()):
        self.blocks, self.fail = [], fail

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, **kwargs):
            if BLOCK_M in self.fail:
                from attnbook.kernels import triton

                raise triton.runtime.OutOfResources(300_000, 232_448, "shared memory")
            self.blocks.append(BLOCK_M)
        return launch


def test_a_wide_launch_takes_its_own_settings(monkeypatch):
    """On a GPU, a tensor spanning 2**31 elements makes a WIDE launch (64-bit rows), which takes
    WIDE_LAUNCH's settings where LAUNCH's spill. Before, the A100's dK, dV kernel at D = 64 took
    LAUNCH's 64 x 64 tiles, which spill 8 B compiled WIDE (appendix D). Meta tensors, a
    stand-in kernel and capability 80: no GPU, no memory."""
    from attnbook import kernels

    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(kernels, "_capability", lambda device: 80)
    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", "0")
    small = torch.empty(1, 2, 100, 64, dtype=torch.float16, device="meta")
    huge = torch.empty(2**32, dtype=torch.float16, device="meta").as_strided(
        (1, 2, 100, 64), (0, 64, 2**25, 1))  # rows 2**25 elements apart
    blocks = {}
    for q, wide in ((small, False), (huge, True)):
        kernel = _Recorded()
        kernels._launch(kernel, "dkdv", q, q, False, q)
        blocks[wide] = kernel.blocks
    assert blocks == {False: [64], True: [32]}  # the rows of a tile of keys
    assert [kernels.LAUNCH[80, "dkdv"][64][0][1], kernels.WIDE_LAUNCH[80, "dkdv"][64][0][1]] \
        == [64, 32]


def test_autotuning_skips_candidates_that_do_not_fit_or_run_out_of_resources(monkeypatch):
    # One candidate's refusal (too many tiles) or compile failure failed the whole call, though
    # another candidate fits (the outside findings, F3). Stand-in candidates, kernel and timer.
    from attnbook import kernels

    candidates = [(16, 16, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2)]
    monkeypatch.setattr(kernels, "_launch_settings", lambda *args: candidates)
    monkeypatch.setattr(kernels, "AUTOTUNE_FROM", 1)
    monkeypatch.setattr(kernels, "_FASTEST", {}, raising=False)
    monkeypatch.setattr(kernels, "_seconds", lambda run: (run(), 1.0 / run.args[0][0])[1])
    # no memory; B * H = 70,000 leaves the tiles only grid axis 1, which takes 65,535
    q = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(70_000, 1, 65_535 * 16 + 1, 16)
    for flag in ("1", "0"):
        monkeypatch.setenv("ATTNBOOK_AUTOTUNE", flag)
        kernels._FASTEST.clear()
        kernel = _Recorded(fail=(64,))  # 16 rows: 65,536 tiles, never launched; 64 fails
        kernels._launch(kernel, "forward", q, q, False)
        assert kernel.blocks[-1] == 32 and 16 not in kernel.blocks, (flag, kernel.blocks)
    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", "1")
    kernels._FASTEST.clear()
    with pytest.raises(ValueError, match=r"no launch setting of the forward kernel fits"):
        kernels._launch(_Recorded(fail=(32, 64)), "forward", q, q, False)
    long = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(70_000, 1, 65_535 * 64 + 1, 16)
    with pytest.raises(ValueError, match=r"q has Lq = 4194241 rows, too many for the forward"):
        kernels._launch(_Recorded(), "forward", long, long, False)


def test_a_setting_timed_at_a_small_b_times_h_is_not_reused_where_it_does_not_fit(monkeypatch):
    # The fastest setting is kept per bucket of lengths, whose key has no B * H: timed at
    # B * H = 1, 16-row tiles were launched at B * H = 70,000 too, on a grid past CUDA's limits.
    from attnbook import kernels

    candidates = [(16, 16, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2)]
    monkeypatch.setattr(kernels, "_launch_settings", lambda *args: candidates)
    monkeypatch.setattr(kernels, "AUTOTUNE_FROM", 1)
    monkeypatch.setattr(kernels, "_FASTEST", {}, raising=False)
    monkeypatch.setattr(kernels, "_seconds", lambda run: (run(), float(run.args[0][0]))[1])
    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", "1")
    length = 65_535 * 16 + 1  # 65,536 tiles of 16 rows: with B * H > 65,535 they fit no order
    for pairs, fastest_that_fits in ((1, 16), (70_000, 32)):
        q = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(pairs, 1, length, 16)  # no memory
        kernel = _Recorded()
        kernels._launch(kernel, "forward", q, q, False)
        assert kernel.blocks[-1] == fastest_that_fits, (pairs, kernel.blocks)


def test_a_refusal_names_the_grid_limit_actually_passed():
    # Before, B * H = 2**31 with Lq = 1 blamed "Lq = 1 rows" and advised "B * H <= 65,535", and
    # _grid returned a first axis of 2**31 programs, past CUDA's 2**31 - 1 (the outside K2).
    from attnbook import kernels

    q = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(2**31, 1, 1, 16)  # holds no memory
    with pytest.raises(ValueError, match=r"^q has B \* H = 2147483648 \(batch, head\) pairs, too "
                                         r"many .*B \* H passes the 2\*\*31 - 1 programs"):
        kernels._check_backward_lengths(q, q)
    with pytest.raises(ValueError, match=r"Lq = 68719476736 rows.*tile count passes the "
                                         r"2\*\*31 - 1 programs.*\(Lq <= 68719476704\)$"):
        kernels._check_tiles("forward", "q", 2**31 * 32, 32, 1)


def test_the_checked_operators_backward_refuses_a_delta_grid_by_name(monkeypatch):
    # torch.ops.attnbook.flash_attention checks the forward's lengths only, so its backward met
    # the delta kernel's grid unchecked: _grid refused it naming neither q nor the kernel.
    # CUDA's limits made small: a grid fits with at most one tile (the forward's 64 rows do).
    from attnbook import kernels

    monkeypatch.setattr(kernels, "_fits", lambda tiles, pairs: tiles <= 1)
    q = torch.randn(1, 1, 64, 16, device=DEVICE, requires_grad=True)
    out, _ = torch.ops.attnbook.flash_attention(q, q, q, False, 0.25)
    with pytest.raises(ValueError, match=r"^q has Lq = 64 rows, too many for the backward's "
                                         r"delta kernel at B \* H = 1: its tiles of 32 rows "
                                         r"number 2"):
        out.sum().backward()


@pytest.mark.parametrize("value", ["0", " 0", "0 ", "false", "False", "OFF", "no", " No "])
def test_autotuning_is_off_for_every_spelling_of_false(monkeypatch, value):
    from attnbook.kernels import _autotuning

    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", value)
    assert _autotuning() is False


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes", ""])
def test_autotuning_is_on_for_every_spelling_of_true_and_when_unset(monkeypatch, value):
    from attnbook.kernels import _autotuning

    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", value)
    assert _autotuning() is True
    monkeypatch.delenv("ATTNBOOK_AUTOTUNE")
    assert _autotuning() is True


@pytest.mark.parametrize("value", ["00", "2", "fals", "yes please"])
def test_an_unknown_autotune_setting_is_refused_by_name(monkeypatch, value):
    from attnbook.kernels import _autotuning

    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", value)
    with pytest.raises(ValueError, match=f"ATTNBOOK_AUTOTUNE={value!r}"):
        _autotuning()


@pytest.mark.parametrize("long", ["q", "k"])
def test_a_length_the_backward_cannot_launch_is_refused_before_the_forward(monkeypatch, long):
    # The forward took it, and loss.backward() failed after the forward's work, with a message
    # naming neither argument nor kernel (F2, F6). Kernels recorded, not run: no memory, no time.
    # float32, D = 16: the backward's tiles of 32 rows number 65,536, and B * H = 70,000, so
    # neither grid order fits (the forward's 64-row tiles would, as (B * H, tiles)).
    launches = Launches(monkeypatch, run=False)
    n, pairs = 65_535 * 32 + 1, 70_000
    short = torch.zeros(pairs, 1, 4, 16, device=DEVICE, requires_grad=True)
    big = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(pairs, 1, n, 16)  # holds no memory
    q, k = (big, short) if long == "q" else (short, big)
    kernel = "delta" if long == "q" else "dK, dV"
    with pytest.raises(ValueError, match=rf"{long} has L{long} = {n} rows, too many for the "
                                         rf"backward's {kernel} kernel at B \* H = 70000.*"
                                         rf"L{long} <= 2097120, or B \* H <= 65,535"):
        flash_attention(q, k, k)
    assert not launches.records  # refused before the forward launched
