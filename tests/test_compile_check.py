"""attnbook.compile_check (chapter 12): the kernels compiled ahead of time for GPUs we lack.

Triton compiles for a T4, an A100 and an H100 on the CPU, and ptxas reports the machine code's
registers and spills. These tests hold the launcher's tile table to the rule the chapter states,
so a change to a kernel that makes it spill, or no longer fit a T4, fails here without a GPU.
Compiling is slow (about a second per kernel and GPU), so each test compiles one batch.
"""

import pytest

from attnbook import kernels
from attnbook.compile_check import (
    GPUS,
    KERNELS,
    SHARED_MEMORY,
    compile_kernels,
    largest_tiles,
)

HEAD_DIMS = (16, 32, 64, 128)


@pytest.mark.parametrize("dtype, element_size", [("float16", 2), ("float32", 4)])
def test_tile_table_is_the_largest_tile_that_compiles_cleanly(dtype, element_size):
    expected = {(kernel, d): kernels._tile_rows(kernel, d, element_size)
                for kernel in KERNELS for d in HEAD_DIMS}
    assert largest_tiles(dtype) == expected


def test_bfloat16_compiles_as_cleanly_as_float16_on_gpus_that_have_it():
    requests = [dict(kernel=kernel, gpu=gpu, dtype="bfloat16", head_dim=d)
                for kernel in KERNELS for d in HEAD_DIMS for gpu in ("A100", "H100")]
    for r in compile_kernels(requests):
        assert r.fits and r.spill_bytes == 0, r
        assert r.tensor_cores, r
        assert r.block == kernels._tile_rows(r.kernel, r.head_dim, 2)


def test_report_describes_the_compiled_kernel():
    small, large = compile_kernels([
        dict(kernel="forward", gpu="H100", dtype="float16", head_dim=64, causal=False, block=32),
        dict(kernel="forward", gpu="H100", dtype="float16", head_dim=64, causal=False, block=64),
    ])
    assert (small.kernel, small.gpu, small.dtype, small.head_dim, small.causal, small.block) == (
        "forward", "H100", "float16", 64, False, 32)
    # A larger tile needs more shared memory for its K and V tiles, and more registers.
    assert 0 < small.shared_bytes < large.shared_bytes <= SHARED_MEMORY["H100"]
    assert 0 < small.registers <= large.registers <= 255
    assert small.tensor_cores and large.tensor_cores


def test_float32_products_do_not_use_tensor_cores():
    # input_precision="ieee" asks for true float32 products: no TF32 tensor-core instructions.
    (r,) = compile_kernels([dict(kernel="dq", gpu="A100", dtype="float32", head_dim=16,
                                 block=None)])  # None: the launcher's tile
    assert not r.tensor_cores
    assert r.block == kernels._tile_rows("dq", 16, 4)


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
    (dict(kernel="dq", gpu="T4", dtype="float16", head_dim=64, warps=8), "unknown request keys"),
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
        _compile_here("forward", "T4", "float16", 64, True, None)
