"""Exercise 15.3 with a kernel of the reader's, run by tests/test_exercises_ch15.py in a child
process: its store masked (a right answer) or not (a store past the end of the output)."""
import json
import sys

from attnbook.triton_mode import use_triton_interpreter

use_triton_interpreter()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attnbook.exercises import check  # noqa: E402


@triton.jit
def lse_kernel(Q, K, OUT, sqb, sqh, sqm, sqd, skb, skh, skn, skd, H, Lq, Lk, scale,
               CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, MASKED: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols, d = tl.arange(0, BLOCK_N), tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :] * sqd,
                mask=rows[:, None] < Lq, other=0.0)
    k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + d[None, :] * skd,
                mask=cols[:, None] < Lk, other=0.0)
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BLOCK_M, BLOCK_N)
    ok = cols[None, :] < Lk
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + Lk - Lq)
    s = tl.where(ok, s, float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = m_safe + tl.log(tl.sum(tl.exp(s - m_safe[:, None]), axis=1))
    if MASKED:
        tl.store(OUT + bh * Lq + rows, lse, mask=rows < Lq)
    else:  # the mistake: rows past Lq are written past the end of OUT
        tl.store(OUT + bh * Lq + rows, lse)


def row_logsumexp(q, k, causal, masked=True):
    B, H, Lq, D = q.shape
    out = torch.empty(B, H, Lq, dtype=torch.float32)
    lse_kernel[(B * H, triton.cdiv(Lq, 16))](
        q, k, out, *q.stride(), *k.stride(), H, Lq, k.shape[2], D**-0.5, CAUSAL=causal,
        BLOCK_M=16, BLOCK_N=triton.next_power_of_2(k.shape[2]), D=D, MASKED=masked)
    return out


if __name__ == "__main__":
    masked = sys.argv[1] == "masked"
    result = check("15.3", lambda q, k, causal: row_logsumexp(q, k, causal, masked), show=False)
    print(json.dumps({"passed": result.passed, "case": result.case, "problem": result.problem,
                      "hint": result.hint}))
