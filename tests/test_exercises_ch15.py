"""Exercise 15.3 (appendix G, chapter 15's cases): check passes a right answer and fails wrong ones
at the case whose hint names their mistake. The cases build with the package's Triton kernels, in
the interpreter (the root conftest chooses it before anything imports Triton)."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton (the triton extra) has wheels for Linux only")

from attnbook.exercises import EXERCISES, check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def scores(q, k, dtype=torch.float64):
    return (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])


def bottom_right(lq, lk, device):
    """Query i sees key j iff j <= i + lk - lq (chapter 6's causal mask)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


def right(q, k, causal):
    """An answer written apart from the kernels: float64 scores, torch.logsumexp."""
    s = scores(q, k)
    if causal:
        s = s.masked_fill(~bottom_right(q.shape[-2], k.shape[-2], q.device), -math.inf)
    return torch.logsumexp(s, -1).float()  # -inf for a row of -inf


def base_two(q, k, causal):
    """The kernel's m + log2(l), not divided by log2(e)."""
    return right(q, k, causal) / math.log(2)


def top_left(q, k, causal):
    """The causal mask aligned top-left: query i sees key j iff j <= i."""
    s = scores(q, k)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(0), -math.inf)
    return torch.logsumexp(s, -1).float()


def nan_for_no_key(q, k, causal):
    """The running maximum subtracted even where it is still -inf: NaN for a row with no key."""
    s = scores(q, k)
    if causal:
        s = s.masked_fill(~bottom_right(q.shape[-2], k.shape[-2], q.device), -math.inf)
    m = s.amax(-1, keepdim=True)
    return (m.squeeze(-1) + (s - m).exp().sum(-1).log()).float()


def no_running_maximum(q, k, causal):
    """exp of the scores themselves, in float32."""
    s = scores(q, k, torch.float32)
    if causal:
        s = s.masked_fill(~bottom_right(q.shape[-2], k.shape[-2], q.device), -math.inf)
    return s.exp().sum(-1).log()


def contiguous_strides(x):
    """The strides x would have if it were contiguous, (H L D, L D, D, 1)."""
    return torch.empty(x.shape).stride()


def k_read_as_contiguous(q, k, causal):
    """A kernel that passes k's strides as if k were contiguous: it reads the wrong numbers."""
    wrong = torch.as_strided(k, k.shape, contiguous_strides(k), k.storage_offset())
    return right(q, wrong, causal)


def test_a_right_answer_passes_every_case(capsys):
    result = check("15.3", right)
    assert result.passed and result.cases == len(EXERCISES["15.3"].cases) == 7
    assert capsys.readouterr().out == ("check 15.3 (the logsumexp of each query row, in Triton): "
                                       "passed all 7 cases.\n")


@pytest.mark.parametrize("candidate, case, words", [
    (base_two, "one query, one key", "divide m + log2(l) by log2(e)"),
    (top_left, "causal, 40 queries, 100 keys", "aligned bottom-right"),
    (nan_for_no_key, "causal, 100 queries, 40 keys", "-inf, not NaN"),
    (no_running_maximum, "scores in the thousands", "overflows float32"),
    (k_read_as_contiguous, "q and k strided along D", "read q and k through their own"),
], ids=lambda x: getattr(x, "__name__", None))
def test_a_wrong_answer_fails_at_the_case_that_names_its_mistake(candidate, case, words):
    result = check("15.3", candidate, show=False)
    assert not result.passed and result.case == case, (result.case, result.problem)
    assert words in result.hint, result.hint


def test_the_expected_answers_agree_with_torch():
    # The cases' expected answers come from the package's kernel: they must be the natural
    # logsumexp, -inf where a row sees no key, as an independent computation gives.
    from attnbook.kernels import INTERPRETED

    assert INTERPRETED
    for number, case in enumerate(EXERCISES["15.3"].cases):
        inputs, expected = case.build(np.random.default_rng(number))
        ours = right(*inputs.values())
        assert expected.dtype == torch.float32 and expected.shape == ours.shape, case.name
        assert torch.equal(expected.isneginf(), ours.isneginf()), case.name
        torch.testing.assert_close(expected, ours, rtol=1e-5, atol=1e-4)


# ---- a kernel that crashes the interpreter: each call runs in a child process -------------------

@pytest.mark.parametrize("store", ["masked", "unmasked"])
def test_a_kernel_that_crashes_the_interpreter_fails_its_case_and_the_caller_lives(tmp_path, store):
    # run in a subprocess: were check to call the kernel in its own process again, the store
    # past the output's end would kill that process (SIGABRT or SIGSEGV), not this test run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [ROOT / "code", *sys.path]))}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "reader_kernel_15_3.py"), store],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    if store == "masked":
        assert result["passed"], result
    else:
        assert not result["passed"] and result["case"] == "one query, one key", result
        assert re.search(r"its process crashed \(SIG[A-Z]+\) on this case", result["problem"])
        assert "mask every tl.load and tl.store" in result["hint"]


def test_a_child_process_keeps_the_time_limit_and_the_input_check():
    def slow(q, k, causal):
        time.sleep(60)
        return right(q, k, causal)

    def in_place(q, k, causal):
        q.mul_(2.0)  # the answer is then computed from the doubled q
        return right(q / 2.0, k, causal)

    started = time.perf_counter()
    stopped = check("15.3", slow, timeout=0.5, show=False)
    assert stopped.case == "one query, one key" and "its process was stopped" in stopped.problem
    assert time.perf_counter() - started < 30  # the child was stopped, not waited for
    changed = check("15.3", in_place, show=False)
    assert changed.cases_passed == 0 and "changed its input q in place" in changed.problem
