# Do not edit: tools/tangle.py generates this file from chapters/13-tiling.md and chapters/14-traffic-and-roofline.md.
"""FlashAttention's algorithm in NumPy: the online softmax and attention computed tile by tile.

Built and explained in the book's chapters chapters/13-tiling.md and chapters/14-traffic-and-roofline.md.
"""

__all__ = [
    "online_softmax_update",
    "online_softmax",
    "block_schedule",
    "flash_attention_numpy",
    "attention_traffic",
    "attention_bytes",
    "schedule_flops",
    "GPUSpec",
    "GPUS",
    "kernel_query_rows",
    "find_gpu",
    "BOARDS",
    "roofline_seconds",
]

# chapters/13-tiling.md, "Softmax from a stream of blocks"
from collections.abc import Iterator
from dataclasses import dataclass  # noqa: F401 (GPUSpec, chapter 14)

import numpy as np
import numpy.typing as npt

from attnbook.attention import check_qkv, compute_dtype, divide_or_zero
from attnbook.checks import (  # noqa: F401 (check_choice, check_positive, check_real: ch. 14)
    check_array,
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_positive,
    check_real,
    check_scale,
)


def _running_state(m: npt.ArrayLike, l: npt.ArrayLike, block: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.dtype]:
    """online_softmax_update's m and l as arrays, one value per row of `block`, and the dtype to
    update in: the wider of the block's and theirs (Python numbers take the block's)."""
    given, (m, l) = (m, l), (check_array("m", m), check_array("l", l))
    for name, x in (("m", m), ("l", l)):
        if x.shape != block.shape[:-1]:
            raise ValueError(f"{name} must have shape {block.shape[:-1]}, block's rows, got "
                             f"shape {x.shape}")
    dtype = np.result_type(block, *(x for x, g in zip((m, l), given)
                                    if type(g) not in (int, float)))  # np.float64 stays
    return m, l, dtype


def _checked_tally(tally: dict[str, int] | None) -> dict[str, int]:
    """flash_attention_numpy's `tally` (chapter 14): a new dict, or the caller's of int counts."""
    tally = {} if tally is None else check_instance("tally", tally, dict)
    for key, count in tally.items():  # counts, added to
        check_int(f"tally[{key!r}]", count)
    return tally


# chapters/13-tiling.md, "Softmax from a stream of blocks"
def online_softmax_update(m: npt.ArrayLike, l: npt.ArrayLike, block: npt.ArrayLike
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Fold a block of scores (..., b) into the running max `m` and sum `l` (both (...,), starting
    at -inf and 0): then l = sum(exp(x - m)) over every score seen. float16 sums in float32;
    the state keeps the wider of its dtype and the block's (Python numbers take the block's)."""
    block = check_array("block", block, min_ndim=1)
    block = block.astype(compute_dtype(block.dtype), copy=False)
    m, l, dtype = _running_state(m, l, block)  # checked, with the dtype to update in
    return _fold(m.astype(dtype, copy=False), l.astype(dtype, copy=False),
                 block.astype(dtype, copy=False))


def _fold(m: np.ndarray, l: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """online_softmax_update's computation, on arguments already checked."""
    m_new, shift, alpha = _new_max(m, block)
    return m_new, alpha * l + np.exp(block - shift[..., None]).sum(axis=-1)


def _new_max(m: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The new running max, a shift that is 0 where that max is -inf, and exp(m_old - shift)."""
    m_new = np.maximum(m, block.max(axis=-1, initial=-np.inf))  # NaN, if any, propagates
    shift = np.where(np.isneginf(m_new), 0.0, m_new).astype(m_new.dtype)
    return m_new, shift, np.exp(m - shift)


# chapters/13-tiling.md, "Softmax from a stream of blocks"
def online_softmax(x: npt.ArrayLike, block_size: int = 64) -> np.ndarray:
    """Softmax along the last axis in two passes over blocks of `block_size`: the max and the
    normaliser together, then exp(x - m) / l. Equal to attention.softmax up to rounding."""
    x = check_array("x", x, min_ndim=1)
    block_size = check_int("block_size", block_size, minimum=1)
    work = compute_dtype(x.dtype)
    m = np.full(x.shape[:-1], -np.inf, work)  # (...,) running max
    l = np.zeros(x.shape[:-1], work)  # (...,) running sum of exp(x - m)
    for start in range(0, x.shape[-1], block_size):
        m, l = _fold(m, l, x[..., start:start + block_size].astype(work, copy=False))
    exps = np.exp(x.astype(work) - np.where(np.isneginf(m), 0.0, m)[..., None])  # (..., n)
    return divide_or_zero(exps, l[..., None]).astype(x.dtype, copy=False)


# chapters/13-tiling.md, "Attention in one pass over the keys"
def block_schedule(Lq: int, Lk: int, block_size: int = 64,
                   causal: bool = False) -> list[tuple[int, int, int, int, bool]]:
    """The tiles `flash_attention_numpy` computes, in order: (q0, q1, k0, k1, needs_mask), query
    rows q0..q1-1 against key columns k0..k1-1; with `causal`, none above the diagonal."""
    Lq, Lk = check_int("Lq", Lq, minimum=0), check_int("Lk", Lk, minimum=0)
    block_size, causal = check_int("block_size", block_size, 1), check_bool("causal", causal)
    return [(q0, min(q0 + block_size, Lq), *kb) for q0 in range(0, Lq, block_size)
            for kb in _key_blocks(q0, min(q0 + block_size, Lq), Lk, Lk - Lq, block_size, causal)]


def _key_blocks(q0: int, q1: int, lk: int, offset: int, block_size: int,
                causal: bool) -> Iterator[tuple[int, int, bool]]:
    """(k0, k1, needs_mask) for each key block that query rows q0..q1-1 must visit."""
    for k0 in range(0, lk, block_size):
        k1 = min(k0 + block_size, lk)
        if causal and k0 > q1 - 1 + offset:  # the last query may not see the first key:
            break  # this tile and every tile to its right are forbidden entirely
        yield k0, k1, causal and k1 - 1 > q0 + offset  # the first query may not see the last key


# chapters/13-tiling.md, "Attention in one pass over the keys"
def flash_attention_numpy(Q: npt.ArrayLike, K: npt.ArrayLike, V: npt.ArrayLike,
                          causal: bool = False, block_size: int = 64, scale: float | None = None,
                          *, tally: dict[str, int] | None = None) -> np.ndarray:
    """Tiled attention with the online softmax, in NumPy: the output of attention's
    scaled_dot_product_attention up to rounding, holding one tile of scores per entry of the
    batch dimensions at a time. With `causal`, query i sees key j iff j <= i + (Lk - Lq)
    (bottom-right). A dict `tally` gets the number of elements loaded from Q, K, V and stored
    to O added under those keys (chapter 14)."""
    Q, K, V = check_qkv(Q, K, V)
    block_size = check_int("block_size", block_size, minimum=1)
    causal, scale = check_bool("causal", causal), check_scale(scale, Q.shape[-1])
    tally = _checked_tally(tally)
    dtype = np.result_type(Q, K, V)
    batch = np.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    Q, K, V = (np.broadcast_to(x.astype(compute_dtype(dtype), copy=False), batch + x.shape[-2:])
               for x in (Q, K, V))
    lq, offset = Q.shape[-2], K.shape[-2] - Q.shape[-2]
    out = np.empty(batch + (lq, V.shape[-1]), dtype)  # (..., Lq, dv)
    for q0 in range(0, lq, block_size):
        q = _tallied(tally, "Q", Q[..., q0:q0 + block_size, :])  # (..., bq, d)
        out[..., q0:q0 + block_size, :] = _tallied(tally, "O", _attend_query_block(
            q, K, V, q0, offset, block_size, causal, scale, tally))  # stored once
    return out


def _tallied(tally: dict[str, int], name: str, tile: np.ndarray) -> np.ndarray:
    """`tile`, after adding its number of elements to tally[name]."""
    tally[name] = tally.get(name, 0) + tile.size
    return tile


# chapters/13-tiling.md, "Attention in one pass over the keys"
def _attend_query_block(q: np.ndarray, K: np.ndarray, V: np.ndarray, q0: int, offset: int,
                        block_size: int, causal: bool, scale: float,
                        tally: dict[str, int]) -> np.ndarray:
    """Outputs of the queries q (..., bq, d), rows q0.. of Q; causal: key j <= query i + offset."""
    bq, lk = q.shape[-2], K.shape[-2]
    m = np.full(q.shape[:-1], -np.inf, q.dtype)  # (..., bq) running max
    l = np.zeros(q.shape[:-1], q.dtype)  # (..., bq) running sum
    acc = np.zeros(q.shape[:-1] + V.shape[-1:], q.dtype)  # (..., bq, dv) unnormalised output
    for k0, k1, needs_mask in _key_blocks(q0, q0 + bq, lk, offset, block_size, causal):
        s = q @ np.swapaxes(_tallied(tally, "K", K[..., k0:k1, :]), -1, -2)  # (..., bq, bk)
        s *= scale
        if needs_mask:
            s[..., np.arange(k0, k1) > np.arange(q0, q0 + bq)[:, None] + offset] = -np.inf
        m, shift, alpha = _new_max(m, s)
        s -= shift[..., None]
        np.exp(s, out=s)  # the tile now holds the unnormalised weights exp(s - m)
        l *= alpha
        l += s.sum(axis=-1)
        acc *= alpha[..., None]
        acc += s @ _tallied(tally, "V", V[..., k0:k1, :])
        del s  # free this tile before the next one is made
    return divide_or_zero(acc, l[..., None])


# chapters/14-traffic-and-roofline.md, "Traffic: the bytes a GPU moves"
_FLOAT32 = ("lse", "delta")  # one float32 per query row in chapter 15's kernels


def attention_traffic(Lq: int, Lk: int, d: int, method: str = "tiled", causal: bool = False,
                      backward: bool = False, block_q: int = 64, block_k: int = 64,
                      itemsize: int = 2) -> dict[str, int]:
    """Bytes each tensor moves between a GPU's main memory and the chip, for one (batch, head)
    of attention with head size d: "naive" writes and reads S and P; "tiled" runs chapter 15's
    kernels on block_q x block_k tiles, loading K and V once per query tile that needs them."""
    Lq, Lk, d, method, causal, backward, block_q, block_k = _checked(
        Lq, Lk, d, method, causal, backward, block_q, block_k)
    itemsize = check_int("itemsize", itemsize, minimum=1)
    if method == "naive":
        elements = _naive_elements(Lq, Lk, d, backward)
    else:
        key_rows, query_rows, _ = _visits(Lq, Lk, block_q, block_k, causal)
        elements = _tiled_elements(Lq, Lk, d, key_rows, query_rows, backward)
    return {name: n * (4 if name in _FLOAT32 else itemsize) for name, n in elements.items()}


def attention_bytes(Lq: int, Lk: int, d: int, method: str = "tiled", causal: bool = False,
                    backward: bool = False, block_q: int = 64, block_k: int = 64,
                    itemsize: int = 2) -> int:
    """The total of attention_traffic: bytes moved for one (batch, head)."""
    return sum(attention_traffic(Lq, Lk, d, method, causal, backward, block_q, block_k,
                                 itemsize).values())


def _checked(Lq: int, Lk: int, d: int, method: str, causal: bool, backward: bool, block_q: int,
             block_k: int) -> tuple[int, int, int, str, bool, bool, int, int]:
    return (check_int("Lq", Lq, 1), check_int("Lk", Lk, 1), check_int("d", d, 1),
            check_choice("method", method, ("naive", "tiled")), check_bool("causal", causal),
            check_bool("backward", backward), check_int("block_q", block_q, 1),
            check_int("block_k", block_k, 1))


# chapters/14-traffic-and-roofline.md, "Traffic: the bytes a GPU moves"
def _visits(Lq: int, Lk: int, block_q: int, block_k: int, causal: bool) -> tuple[int, int, int]:
    """Over the (query tile, key tile) pairs chapter 15's kernels visit: the key rows loaded, the
    query rows loaded, and the scores computed."""
    key_rows = query_rows = scores = 0
    for q0 in range(0, Lq, block_q):
        rows = min(q0 + block_q, Lq) - q0
        hi = min(Lk, q0 + block_q + Lk - Lq) if causal else Lk  # keys from hi on: skipped
        tiles = max(0, -(-hi // block_k))  # key tiles 0 .. tiles - 1
        cols = min(tiles * block_k, Lk)
        key_rows, query_rows = key_rows + cols, query_rows + rows * tiles
        scores += rows * cols
    return key_rows, query_rows, scores


def _naive_elements(Lq: int, Lk: int, d: int, backward: bool) -> dict[str, int]:
    nn, q, k = Lq * Lk, Lq * d, Lk * d
    if not backward:  # S = scale Q K^T;  P = softmax(S);  O = P V
        return {"Q": q, "K": k, "V": k, "S": 2 * nn, "P": 2 * nn, "O": q}
    # chapter 16's backward pass written out: the matrices P, dP and dS read and written whole
    return {"P": 2 * nn, "dO": 2 * q, "V": k, "dP": 2 * nn, "dS": 3 * nn, "K": k, "Q": q,
            "dQ": q, "dK": k, "dV": k}


def _tiled_elements(Lq: int, Lk: int, d: int, key_rows: int, query_rows: int,
                    backward: bool) -> dict[str, int]:
    if not backward:  # Q once, K and V per visit, O and the logsumexp once
        return {"Q": Lq * d, "K": key_rows * d, "V": key_rows * d, "O": Lq * d, "lse": Lq}
    # chapter 16's three backward kernels ("The bytes of the backward pass" there)
    return {"O": Lq * d, "dO": (2 * Lq + query_rows) * d, "delta": 2 * Lq + query_rows,
            "Q": (query_rows + Lq) * d, "K": (Lk + key_rows) * d, "V": (Lk + key_rows) * d,
            "lse": query_rows + Lq, "dQ": Lq * d, "dK": Lk * d, "dV": Lk * d}


# chapters/14-traffic-and-roofline.md, "The roofline: which side binds"
def schedule_flops(Lq: int, Lk: int, d: int, method: str = "tiled", causal: bool = False,
                   backward: bool = False, block_q: int = 64, block_k: int = 64) -> int:
    """FLOPs of the matrix products in attention_traffic's schedule, for one (batch, head):
    2 * d per score and product; 2 products forward, 4 backward naive and 7 tiled."""
    Lq, Lk, d, method, causal, backward, block_q, block_k = _checked(
        Lq, Lk, d, method, causal, backward, block_q, block_k)
    scores = Lq * Lk if method == "naive" else _visits(Lq, Lk, block_q, block_k, causal)[2]
    products = {False: 2, True: 4 if method == "naive" else 7}[backward]
    return 2 * d * scores * products


# chapters/14-traffic-and-roofline.md, "The roofline: which side binds"
@dataclass(frozen=True)
class GPUSpec:
    """A GPU's published peaks (chapter 14): main-memory bandwidth in bytes/s, and dense FLOP/s
    of 16-bit products on tensor cores and of float32 ones without them."""
    name: str
    bandwidth: float
    fp16_flops: float
    fp32_flops: float
    source: str  # the datasheet: its key in the book's bibliography

    def __post_init__(self) -> None:  # a made or replaced spec: peaks above 0 (roofline divides)
        for field in ("name", "source"):
            check_instance(field, getattr(self, field), str)
        for field in ("bandwidth", "fp16_flops", "fp32_flops"):
            check_positive(field, getattr(self, field))

    def peak_flops(self, itemsize: int = 2) -> float:
        """FLOP/s for elements of `itemsize` bytes: 2 (float16, bfloat16) or 4 (float32)."""
        if check_int("itemsize", itemsize) not in (2, 4):
            raise ValueError(f"itemsize must be 2 or 4, got itemsize={itemsize!r}")
        return self.fp16_flops if itemsize == 2 else self.fp32_flops


GPUS = {
    "T4": GPUSpec("NVIDIA T4", 320e9, 65e12, 8.1e12, "nvidia2018t4"),
    "A100": GPUSpec("NVIDIA A100 SXM4 80GB", 2039e9, 312e12, 19.5e12, "nvidia2020a100"),
    "H100": GPUSpec("NVIDIA H100 SXM5", 3.35e12, 989.5e12, 67e12, "nvidia2022h100"),
    "H200": GPUSpec("NVIDIA H200 SXM", 4.8e12, 989.5e12, 67e12, "nvidia2023h200"),
}
# Chapter 15's launch table, its first candidate's query rows: head sizes up to 64, and to 128.
_KERNEL_QUERY_ROWS = {64: {"T4": 32, "A100": 64, "H100": 128, "H200": 128},
                      128: {"T4": 32, "A100": 128, "H100": 128, "H200": 128}}


def kernel_query_rows(gpu: str, d: int) -> int:
    """The query rows of the forward tile that chapter 15's kernel tries first on `gpu` (a key of
    GPUS) in 16-bit floats at head size `d` (16, 32, 64 or 128, those the kernel takes); from
    Lq * Lk = 2048**2 on, a GPU launch also times its other candidates and keeps the fastest."""
    gpu, d = check_choice("gpu", gpu, GPUS), check_int("d", d, 1)
    if d not in (16, 32, 64, 128):
        raise ValueError(f"d must be 16, 32, 64 or 128 (the head sizes of chapter 15's kernel), "
                         f"got d={d!r}")
    return _KERNEL_QUERY_ROWS[64 if d <= 64 else 128][gpu]


# chapters/14-traffic-and-roofline.md, "The roofline: which side binds"
def find_gpu(device_name: str) -> GPUSpec:
    """The entry of GPUS whose key is one of the words of `device_name`, such as
    find_gpu(torch.cuda.get_device_name()) on "NVIDIA A100-SXM4-80GB" or "Tesla T4"; a word
    that only contains a key, as "T400" contains "T4" and "A1000" "A100", is another GPU."""
    check_instance("device_name", device_name, str)
    words = "".join(c if c.isalnum() else " " for c in device_name.upper()).split()
    if "MIG" in words:  # a slice such as "MIG 1g.10gb" has a share of the board's peaks
        raise ValueError(f"device_name={device_name!r} is a MIG slice, which has a share of "
                         "the board's peaks, not GPUS' peaks: name the whole board")
    if len(named := [key for key in GPUS if key in words]) > 1:
        raise ValueError(f"device_name={device_name!r} names {' and '.join(named)}: name one GPU")
    for key, spec in GPUS.items():
        if key in words:
            other = [board for board in BOARDS if board in device_name.upper()
                     and board not in spec.name.upper()]  # another board: other peaks
            if other:
                raise ValueError(f"device_name={device_name!r} is a {other[0]} board, whose "
                                 f"peaks are not those of GPUS' {spec.name}")
            return spec
    raise ValueError(f"device_name must name one of {sorted(GPUS)}, got "
                     f"device_name={device_name!r}")


# Names that mark a board of the same chip with other peaks (memory, clocks) than GPUS' entry.
BOARDS = ("PCIE", "NVL", "40GB")


def roofline_seconds(flops: float, bytes_moved: float, gpu: "GPUSpec | str",
                     itemsize: int = 2) -> float:
    """The least time the roofline model allows: the longer of computing `flops` at the GPU's
    peak and moving `bytes_moved` at its bandwidth. `gpu`: a GPUSpec or a key of GPUS."""
    flops = check_real("flops", flops, 0.0)
    bytes_moved = check_real("bytes_moved", bytes_moved, 0.0)
    if isinstance(gpu, str):
        gpu = GPUS[check_choice("gpu", gpu, GPUS)]
    gpu = check_instance("gpu", gpu, GPUSpec)
    return max(flops / gpu.peak_flops(itemsize), bytes_moved / gpu.bandwidth)
