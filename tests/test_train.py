"""attnbook.train (appendix "Training at scale"): one process and two, DDP and FSDP, give the same
weights; a resumed or restarted run ends where an uninterrupted one ends; bad options are refused.

The runs are real: `python -m attnbook.train` and torchrun with the gloo backend, on the CPU. They
start together (one fixture) so that the file takes well under a minute.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attnbook import train
from attnbook.gpt import GPT, GPTConfig

TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--context", "16",
        "--global-batch", "4", "--dropout", "0", "--dtype", "float64", "--seed", "3"]
STEPS = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}

CRASH = textwrap.dedent("""
    import os, sys
    from attnbook import train

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]

    def on_step(step):  # the first attempt's rank 1 dies after step 3
        if attempt == "0" and step == 3 and os.environ["RANK"] == "1":
            os._exit(1)

    options = train.parse_options(sys.argv[1:])
    options.out.mkdir(parents=True, exist_ok=True)
    with open(options.out / "attempts.txt", "a") as record:
        record.write(f"{attempt} {os.environ['RANK']}\\n")
    train.train(options, on_step=on_step)
""")


def command(out, *extra, processes=1, script=None, torchrun=()):
    args = ["gpt", *TINY, "--out", str(out), *extra]
    target = [str(script)] if script else ["-m", "attnbook.train"]
    if processes == 1 and not torchrun:
        return [sys.executable, *target, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={processes}", *torchrun, *target, *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run the tests compare, started at once; their output directories by name."""
    root = tmp_path_factory.mktemp("train")
    (root / "crash.py").write_text(CRASH)
    plans = {
        "one": [command(root / "one", "--steps", str(STEPS))],
        "fsdp": [command(root / "fsdp", "--steps", str(STEPS), "--strategy", "fsdp",
                         "--checkpoint-every", "2", processes=2)],
        "resumed": [command(root / "resumed", "--steps", "2", "--checkpoint-every", "1"),
                    command(root / "resumed", "--steps", str(STEPS), "--resume")],
        # DDP (the default strategy) on two processes, one of which dies and is restarted
        "restarted": [command(root / "restarted", "--steps", str(STEPS), "--checkpoint-every",
                              "2", "--resume", processes=2, script=root / "crash.py",
                              torchrun=("--max-restarts=1",))],
    }
    started = {name: iter(steps) for name, steps in plans.items()}
    running = {name: subprocess.Popen(next(steps), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=ENV)
               for name, steps in started.items()}
    while running:
        for name, process in list(running.items()):
            _, err = process.communicate(timeout=240)
            assert process.returncode == 0, (name, err[-3000:])
            step = next(started[name], None)
            if step is None:
                del running[name]
            else:
                running[name] = subprocess.Popen(step, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True, env=ENV)
    return {name: root / name for name in plans}


def weights(folder):
    return torch.load(folder / "model.pt")


def largest_gap(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def log(folder):
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["restarted", "fsdp"])  # DDP, and FSDP
def test_two_processes_end_with_the_weights_of_one(runs, name):
    one, two = weights(runs["one"]), weights(runs[name])
    assert largest_gap(one, two) < 1e-9
    start = GPT(GPTConfig(vocab_size=one["tok_emb.weight"].shape[0], context_length=16,
                          d_model=32, num_layers=2, num_heads=2)).state_dict()
    assert one.keys() == start.keys()  # the full, unsharded state_dict of a GPT
    assert largest_gap(one, start) > 1e-3  # and training moved it
    assert all(t.dtype == torch.float64 for t in two.values())


def test_log_has_one_line_per_step_and_the_same_losses(runs):
    one, ddp = log(runs["one"]), log(runs["restarted"])
    assert [e["step"] for e in one] == [e["step"] for e in ddp] == list(range(1, STEPS + 1))
    assert all(e.keys() == {"step", "loss", "tokens_per_second"} for e in one + ddp)
    assert all(e["tokens_per_second"] > 0 for e in one + ddp)
    for a, b in zip(one, ddp):  # DDP logs the mean over processes: the global batch's loss
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-9)


def test_checkpoints_are_complete_directories_of_the_right_steps(runs):
    found = sorted(p.name for p in (runs["fsdp"] / "checkpoints").iterdir())
    assert found == ["step-00000002", "step-00000004"]
    assert train.latest_checkpoint(runs["fsdp"]).name == "step-00000004"
    assert train.latest_checkpoint(runs["one"]) is None  # no checkpoint was asked for


def test_a_resumed_run_ends_where_an_uninterrupted_one_ends(runs):
    assert largest_gap(weights(runs["resumed"]), weights(runs["one"])) < 1e-9
    assert [e["step"] for e in log(runs["resumed"])] == list(range(1, STEPS + 1))


def test_a_killed_worker_is_restarted_and_loses_nothing(runs):
    attempts = sorted((runs["restarted"] / "attempts.txt").read_text().split("\n")[:-1])
    assert attempts == ["0 0", "0 1", "1 0", "1 1"]  # both workers, then both again
    assert largest_gap(weights(runs["restarted"]), weights(runs["one"])) < 1e-9
    assert [e["step"] for e in log(runs["restarted"])] == list(range(1, STEPS + 1))


def refusal(argv, monkeypatch, processes=1):
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    with contextlib.redirect_stderr(io.StringIO()) as said, pytest.raises(SystemExit) as exit:
        train.parse_options(argv)
    assert exit.value.code == 2
    return said.getvalue()


@pytest.mark.parametrize("option, value, message", [
    ("--steps", "0", "argument --steps: must be at least 1, got '0'"),
    ("--steps", "2.5", "argument --steps: must be an integer, got '2.5'"),
    ("--global-batch", "-1", "argument --global-batch: must be at least 1"),
    ("--dropout", "1.5", r"argument --dropout: must be in [0, 1], got '1.5'"),
    ("--dropout", "nan", "argument --dropout: must be in [0, 1], got 'nan'"),
    ("--lr", "0", "argument --lr: must be above 0, got '0'"),
    ("--lr", "inf", "argument --lr: must be above 0, got 'inf'"),
    ("--heads", "3", "argument --heads: 3 heads do not divide --d-model 64"),
    ("--dtype", "float16", "argument --dtype"),
    ("--strategy", "zero", "argument --strategy"),
    ("--checkpoint-every", "0", "argument --checkpoint-every: must be at least 1"),
])
def test_bad_options_are_refused_by_name(monkeypatch, option, value, message):
    assert message in refusal(["gpt", option, value, "--out", "x"], monkeypatch)


def test_a_global_batch_the_processes_cannot_share_is_refused(monkeypatch):
    said = refusal(["gpt", "--global-batch", "6", "--out", "x"], monkeypatch, processes=4)
    assert "argument --global-batch: 6 sequences cannot be shared equally by 4 processes" in said
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.parse_options(["gpt", "--global-batch", "6", "--out", "x"]).global_batch == 6


def test_other_models_and_a_missing_out_are_refused(monkeypatch):
    assert "model" in refusal(["bert", "--out", "x"], monkeypatch)
    assert "--out" in refusal(["gpt"], monkeypatch)


def test_batch_shares_are_disjoint_slices_of_one_global_batch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    options = train.parse_options(["gpt", "--global-batch", "8", "--context", "5", "--out", "x"])
    ids = torch.arange(1000)  # ids equal to positions: a window shows where it starts
    whole_x, whole_y = train.batch_share(ids, 7, options)
    assert whole_x.shape == whole_y.shape == (8, 5)
    assert torch.equal(whole_y, whole_x + 1)  # targets are the inputs shifted by one
    shares = [train.batch_share(ids, 7, options, rank, 4)[0] for rank in range(4)]
    assert all(s.shape == (2, 5) for s in shares) and torch.equal(torch.cat(shares), whole_x)
    assert not torch.equal(train.batch_share(ids, 8, options)[0], whole_x)  # another step
    reseeded = train.parse_options(["gpt", "--global-batch", "8", "--context", "5", "--seed",
                                    "1", "--out", "x"])
    assert not torch.equal(train.batch_share(ids, 7, reseeded)[0], whole_x)
    assert int(whole_x.max()) < 1000 - 1  # every window fits, with its target


def test_memory_per_process():
    config = GPTConfig(vocab_size=100, context_length=16, d_model=32, num_layers=3, num_heads=2)
    params = sum(p.numel() for p in GPT(config).parameters())
    assert train.memory_per_process(config, 8, "ddp") == 16 * params  # DDP: all of it, anywhere
    fsdp = [train.memory_per_process(config, w, "fsdp") for w in (1, 2, 4, 8)]
    assert fsdp == sorted(fsdp, reverse=True) and fsdp[-1] < 16 * params
    # what is sharded shrinks as 1/W; what is gathered (a root and blocks) does not
    assert fsdp[1] - fsdp[2] == pytest.approx(16 * params / 4, abs=1)


def test_corpus_is_chapter_8s_text():
    ids, vocab_size = train.corpus()
    assert ids.dtype == torch.int64 and ids.dim() == 1 and len(ids) > 400_000
    assert int(ids.min()) == 0 and int(ids.max()) == vocab_size - 1
