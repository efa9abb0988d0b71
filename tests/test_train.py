"""attnbook.train (appendix "Training at scale"): one process and two, DDP and FSDP, give the same
weights; a resumed or restarted run ends where an uninterrupted one ends; bad options are refused;
a run's folder is never silently overwritten, resumed with other options or past --steps, and
its log survives a kill; nothing in a checkpoint or model.pt is loaded as code, and a damaged one is refused by
name; progress is printed, Ctrl-C stops cleanly, and a trained model samples.

The runs are real: `python -m attnbook.train` and torchrun with the gloo backend, on the CPU. The
subprocess runs start together (one fixture); the rest train a tiny model for 1 to 4 steps in
this process, so that the file takes well under a minute.
"""

import argparse
import contextlib
import hashlib
import importlib.metadata
import io
import json
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
import torch

from attnbook import train, train_command
from attnbook.gpt import GPT, GPTConfig

TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--context", "16",
        "--global-batch", "4", "--dropout", "0", "--dtype", "float64", "--seed", "3"]
STEPS = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
ROOT = Path(__file__).resolve().parents[1]

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

# killed during the first step of a resumed run, before it has written a line of its own
KILLED_IN_FIRST_STEP = textwrap.dedent("""
    import os, sys
    from attnbook import train

    def dying(*args, **kwargs):
        os._exit(3)

    train.batch_share = dying
    train.train(train.parse_options(sys.argv[1:]))
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
    """Every subprocess run the tests compare, started at once; their folders by name, and
    the stderr of each one's last command."""
    root = tmp_path_factory.mktemp("train")
    (root / "crash.py").write_text(CRASH)
    (root / "killed.py").write_text(KILLED_IN_FIRST_STEP)
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
        "killed": [command(root / "killed", "--steps", "2", "--checkpoint-every", "1"),
                   command(root / "killed", "--steps", str(STEPS), "--resume",
                           script=root / "killed.py")],
    }
    returns = {"killed": [0, 3]}  # the second command of "killed" dies, with status 3
    started = {name: iter(enumerate(steps)) for name, steps in plans.items()}
    said = {}

    def start(name):
        index, step = next(started[name], (None, None))
        if step is None:
            return None
        return index, subprocess.Popen(step, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=ENV)

    running = {name: start(name) for name in plans}
    while running:
        for name, (index, process) in list(running.items()):
            _, err = process.communicate(timeout=240)
            expected = returns.get(name, [0] * len(plans[name]))[index]
            assert process.returncode == expected, (name, err[-3000:])
            said[name] = err
            following = start(name)
            if following is None:
                del running[name]
            else:
                running[name] = following
    return {name: root / name for name in plans}, said


def weights(folder):
    return torch.load(folder / "model.pt", weights_only=True)["model"]


def largest_gap(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def log(folder):
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["restarted", "fsdp"])  # DDP, and FSDP
def test_two_processes_end_with_the_weights_of_one(runs, name):
    folders, _ = runs
    one, two = weights(folders["one"]), weights(folders[name])
    assert largest_gap(one, two) < 1e-9
    start = GPT(GPTConfig(vocab_size=one["tok_emb.weight"].shape[0], context_length=16,
                          d_model=32, num_layers=2, num_heads=2)).state_dict()
    assert one.keys() == start.keys()  # the full, unsharded state_dict of a GPT
    assert largest_gap(one, start) > 1e-3  # and training moved it
    assert all(t.dtype == torch.float64 for t in two.values())


def test_log_has_one_line_per_step_and_the_same_losses(runs):
    folders, _ = runs
    one, ddp = log(folders["one"]), log(folders["restarted"])
    assert [e["step"] for e in one] == [e["step"] for e in ddp] == list(range(1, STEPS + 1))
    last = {"step", "loss", "grad_norm", "lr", "tokens_per_second", "held_out_loss"}  # at the end
    assert all(e.keys() == last - {"held_out_loss"} for e in one[:-1] + ddp[:-1])
    assert one[-1].keys() == ddp[-1].keys() == last
    assert all(e["tokens_per_second"] > 0 for e in one + ddp)
    for a, b in zip(one, ddp):  # DDP logs the mean over processes: the global batch's loss
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-9) and a["lr"] == b["lr"]
    assert one[-1]["held_out_loss"] == pytest.approx(ddp[-1]["held_out_loss"], abs=1e-9)


def test_checkpoints_are_complete_directories_of_the_right_steps(runs):
    folders, _ = runs
    found = sorted(p.name for p in (folders["fsdp"] / "checkpoints").iterdir())
    assert found == ["step-00000002", "step-00000004"]
    last = train.latest_checkpoint(folders["fsdp"])
    assert last.name == "step-00000004"
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp",
                                                       "__1_0.distcp", "manifest.json"]
    manifest = train.read_manifest(last)
    assert manifest["step"] == 4 and manifest["processes"] == 2
    assert manifest["options"]["seed"] == 3 and manifest["options"]["d_model"] == 32
    for name, digest in manifest["files"].items():  # the hashes are the files' own
        assert hashlib.sha256((last / name).read_bytes()).hexdigest() == digest
    assert train.latest_checkpoint(folders["one"]) is None  # no checkpoint was asked for


def test_a_resumed_run_ends_where_an_uninterrupted_one_ends(runs):
    folders, _ = runs
    assert largest_gap(weights(folders["resumed"]), weights(folders["one"])) < 1e-9
    assert [e["step"] for e in log(folders["resumed"])] == list(range(1, STEPS + 1))


def test_a_killed_worker_is_restarted_and_loses_nothing(runs):
    folders, _ = runs
    attempts = sorted((folders["restarted"] / "attempts.txt").read_text().split("\n")[:-1])
    assert attempts == ["0 0", "0 1", "1 0", "1 1"]  # both workers, then both again
    assert largest_gap(weights(folders["restarted"]), weights(folders["one"])) < 1e-9
    assert [e["step"] for e in log(folders["restarted"])] == list(range(1, STEPS + 1))


def test_a_resumed_run_killed_in_its_first_step_keeps_the_log(runs):
    """The kept lines are on disk before the first step (they were only in a buffer)."""
    folders, _ = runs
    assert [e["step"] for e in log(folders["killed"])] == [1, 2]


def test_progress_is_printed_without_tqdm(runs):
    _, said = runs
    lines = said["one"].strip().splitlines()
    losses = [e["loss"] for e in log(runs[0]["one"])]
    assert lines[0].startswith(f"step 1/{STEPS}: loss {losses[0]:.4f}, ")
    assert lines[-2].startswith(f"step {STEPS}/{STEPS}: loss {losses[-1]:.4f}, ")
    assert lines[0].endswith(" tokens/s") and len(lines) in (3, 4, 5)  # first, last, summary
    assert lines[-1].startswith(f"trained steps 1 to {STEPS} in ")
    assert f"final loss {losses[-1]:.4f}" in lines[-1] and "model.pt" in lines[-1]
    assert "step 3/4" in said["resumed"] and "trained steps 3 to 4" in said["resumed"]
    assert said["fsdp"].count("step 1/") == 1  # rank 0 alone speaks


def test_model_pt_rebuilds_the_model_and_sample_continues_a_prompt(runs, capsys):
    folders, _ = runs
    saved = torch.load(folders["one"] / "model.pt", weights_only=True)  # data, no code
    assert saved["config"]["d_model"] == 32 and saved["step"] == STEPS
    vocabulary = saved["vocabulary"]
    assert len(vocabulary) == saved["config"]["vocab_size"] == train.corpus()[1]
    model = GPT(GPTConfig(**saved["config"])).double().eval()
    model.load_state_dict(saved["model"])
    ids = [vocabulary.index(ch) for ch in "for "]
    with torch.no_grad():  # greedy decoding by hand: the whole sequence each time, no cache
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    expected = "".join(vocabulary[i] for i in ids)
    train.main(["sample", "--run", str(folders["one"]), "--prompt", "for ", "--tokens", "12",
                "--temperature", "0"])
    assert capsys.readouterr().out == expected + "\n"  # what the command prints
    assert train.sample(folders["one"], "for ", 12, temperature=0) == expected
    drawn = [train.sample(folders["one"], "for ", 30, seed=s) for s in (5, 5, 6)]  # 0.8, top 10
    assert drawn[0] == drawn[1] != drawn[2] and drawn[0].startswith("for ")
    train.main(["sample", "--run", str(folders["one"]), "--prompt", "for ", "--tokens", "30",
                "--seed", "5"])
    assert capsys.readouterr().out == drawn[0] + "\n"  # the command's defaults are sample's


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the crafted file's, on purpose
def test_sample_refuses_what_is_not_a_model(runs, tmp_path):
    folders, _ = runs
    with pytest.raises(ValueError, match="holds no model.pt"):
        train.sample(tmp_path, "a", 3)
    old = tmp_path / "old"
    old.mkdir()
    torch.save(weights(folders["one"]), old / "model.pt")  # weights only, as before
    with pytest.raises(ValueError, match="cannot be read as a model"):
        train.load_model(old)
    marker = tmp_path / "pwned"
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match="cannot be read as a model"):
        train.load_model(tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(ValueError, match="prompt holds characters"):
        train.sample(folders["one"], "\u2603", 3)
    with pytest.raises(ValueError, match="len.prompt."):
        train.sample(folders["one"], "", 3)
    with pytest.raises(ValueError, match="tokens"):
        train.sample(folders["one"], "a", -1)


def test_the_installed_command_trains_by_chapter_10s_recipe(tmp_path):
    """The installed attnbook-train, against chapter 10's recipe written out with PyTorch's own
    AdamW, LambdaLR and clipping on the same batches: the same loss at every step, the same
    held-out losses, in float64."""
    steps, warmup, lr = 24, 5, 8e-3
    script = Path(sys.executable).with_name("attnbook-train")
    done = subprocess.run([str(script), "gpt", *TINY, "--steps", str(steps), "--warmup",
                           str(warmup), "--lr", str(lr), "--eval-every", "10", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, env=ENV,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = log(tmp_path / "run")
    assert [line["step"] for line in logged if "held_out_loss" in line] == [10, 20, 24]

    ids, vocab_size = train.corpus()
    blocks = ids.split(4096)  # chapter 10's split: every tenth block held out
    train_ids = torch.cat([b for i, b in enumerate(blocks) if i % 10 != 9])
    held_ids = torch.cat([b for i, b in enumerate(blocks) if i % 10 == 9])

    def windows(source, step, size, seed=3, context=16):  # TINY's seed and context
        g = torch.Generator().manual_seed(seed * 2**20 + step)
        starts = torch.randint(len(source) - context, (size,), generator=g).tolist()
        w = torch.stack([source[s:s + context + 1] for s in starts])
        return w[:, :-1], w[:, 1:]

    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=vocab_size, context_length=16, d_model=32, num_layers=2,
                          num_heads=2, dropout=0.0)).double()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": others, "weight_decay": 0.0}], lr=lr,
                                  betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup
                                                 else 0.1 + 0.45 * (1 + math.cos(math.pi * (
                                                     s - warmup) / (steps - warmup))))
    held_x, held_y = windows(held_ids, 0, 64, seed=0)  # fixed windows, as chapter 10's
    norms = []
    for line in logged:
        x, y = windows(train_ids, line["step"], 4)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        assert line["lr"] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        schedule.step()
        assert line["loss"] == pytest.approx(loss.item(), rel=1e-9)
        if "held_out_loss" in line:
            model.eval()
            with torch.no_grad():
                held = torch.nn.functional.cross_entropy(model(held_x).flatten(0, 1),
                                                         held_y.flatten())
            model.train()
            assert line["held_out_loss"] == pytest.approx(held.item(), rel=1e-9)
    assert f"held-out loss {logged[-1]['held_out_loss']:.4f}" in done.stderr.splitlines()[-1]
    assert max(norms) > 1.0 > min(norms)  # clipping acted on some steps and not on others


def test_the_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["attnbook-train"].split(":")
    assert module == "attnbook.train_command" and getattr(train_command, function) is train.main


# In-process runs: a tiny model, 1 to 4 steps.

class Payload:
    """Unpickling it calls os.system, which creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def run(out, *extra, steps=STEPS):
    train.train(train.parse_options(["gpt", *TINY, "--steps", str(steps), "--out", str(out),
                                     *extra]))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A one-process run of 4 steps with checkpoints at steps 2 and 4."""
    os.environ.pop("WORLD_SIZE", None)
    out = tmp_path_factory.mktemp("base") / "run"  # an empty folder is no run
    with contextlib.redirect_stderr(io.StringIO()):
        run(out, "--checkpoint-every", "2")
    return out


@pytest.fixture
def copy(base, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # the runs' progress
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


def files(folder):
    """A run's files and their bytes; the lock file, which each run takes, aside."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != ".lock"}


def test_a_fresh_run_into_a_folder_holding_a_run_is_refused(copy):
    before = files(copy)
    with pytest.raises(ValueError, match=r"already holds a run \(model.pt, log.jsonl, "
                                         r"checkpoints, run.json\): give --resume .* --overwrite"):
        run(copy)
    assert files(copy) == before  # nothing written, nothing deleted


def test_overwrite_deletes_the_old_run_and_its_checkpoints(copy):
    run(copy, "--overwrite", "--checkpoint-every", "1", steps=1)
    assert [p.name for p in (copy / "checkpoints").iterdir()] == ["step-00000001"]
    assert [e["step"] for e in log(copy)] == [1]
    run(copy, "--resume", "--checkpoint-every", "1", steps=2)  # from the new run's step 1
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-00000001",
                                                                         "step-00000002"]
    assert [e["step"] for e in log(copy)] == [1, 2]


def test_resume_of_a_finished_run_without_checkpoints_is_refused(copy):
    shutil.rmtree(copy / "checkpoints")
    with pytest.raises(ValueError, match="finished run .* no checkpoint"):
        run(copy, "--resume", steps=6)


def test_a_torn_last_log_line_is_dropped_on_resume(copy):
    shutil.rmtree(copy / "checkpoints" / "step-00000004")  # killed after step 4's log line
    (copy / "model.pt").unlink()
    with open(copy / "log.jsonl", "a") as file:
        file.write('{"step": 5, "lo')  # a process killed while writing it
    run(copy, "--resume")
    assert [e["step"] for e in log(copy)] == [1, 2, 3, 4]


@pytest.mark.parametrize("cut", ["deleted", "steps 3 and 4 cut"])
def test_a_resume_says_when_the_log_lacks_steps_of_its_checkpoint(copy, cut, capsys):
    # a log deleted or cut by hand: the run resumed silently and its log began at step 5
    log_file = copy / "log.jsonl"
    lines = log_file.read_text().splitlines(keepends=True)
    if cut == "deleted":
        log_file.unlink()
    else:
        log_file.write_text("".join(lines[:2]))
    run(copy, "--resume", steps=6)
    kept = 0 if cut == "deleted" else 2
    assert f"log.jsonl holds {kept} of the checkpoint's 4 steps" in capsys.readouterr().err
    assert [e["step"] for e in log(copy)] == [*range(1, kept + 1), 5, 6]


def test_a_garbled_log_line_is_named(copy):
    lines = (copy / "log.jsonl").read_text().splitlines(keepends=True)
    (copy / "log.jsonl").write_text("".join([lines[0], "garbage\n", *lines[1:]]))
    with pytest.raises(ValueError, match=r"log.jsonl, line 2, is not a line"):
        run(copy, "--resume", steps=6)


def test_a_resume_with_a_checkpoint_beyond_steps_is_refused(copy):
    (copy / "model.pt").unlink()  # stopped after its checkpoint of step 4
    before = files(copy)
    with pytest.raises(ValueError, match=r"step-00000004, is at step 4, beyond --steps 2"):
        run(copy, "--resume", steps=2)
    assert files(copy) == before  # no 4-step model written for a 2-step run


@pytest.mark.parametrize("state", ["finished", "unfinished", "finished, then resumed further"])
def test_following_a_resume_refusals_advice_is_accepted(copy, state):
    """A finished run (model.pt at step 4) given --steps 2 was told '--steps 4 or more', and
    then refused at --steps 4 ('above 4'); a run finished at 4 and resumed to a checkpoint at 8
    (model.pt still at 4) was called finished and told 'above 4', then refused at 5: the advice
    printed must be one that is accepted."""
    if state == "unfinished":
        (copy / "model.pt").unlink()
    elif state != "finished":
        stale = (copy / "model.pt").read_bytes()
        run(copy, "--resume", steps=8)
        (copy / "model.pt").write_bytes(stale)  # as if killed after its checkpoint of step 8
    with pytest.raises(ValueError) as refused:
        run(copy, "--resume", steps=2)
    advice = re.search(r"give --steps (above )?(\d+)", str(refused.value))
    assert advice, refused.value
    steps = int(advice[2]) + (advice[1] is not None)
    assert steps == {"finished": 5, "unfinished": 4}.get(state, 8)
    run(copy, "--resume", steps=steps)
    assert torch.load(copy / "model.pt", weights_only=True)["step"] == steps


def reseal_options(path, **changes):
    """Rewrite a manifest.json or run.json with `changes` to its options, sealed anew."""
    fields = json.loads(path.read_text())
    del fields["sha256"]
    fields.update(changes) if "options" not in fields else fields["options"].update(changes)
    train._write_sealed(path, fields)


def test_a_run_recorded_with_an_unsound_steps_resumes_with_a_sound_one(copy):
    """The old bound let a run record --steps 1048576 (2**20); a resume that gives a sound
    --steps must replace it, not be told to start afresh."""
    (copy / "model.pt").unlink()
    reseal_options(train.latest_checkpoint(copy) / "manifest.json", steps=2**20)
    reseal_options(copy / "run.json", steps=2**20)
    with pytest.raises(ValueError, match=r"records no sound --steps .*: give --steps anew"):
        train.train(train.parse_options(["gpt", "--resume", "--out", str(copy)]))
    run(copy, "--resume", steps=6)
    assert torch.load(copy / "model.pt", weights_only=True)["step"] == 6


def test_a_resume_refusal_names_the_file_that_records_the_unsound_option(copy):
    """run.json's unsound --strategy was blamed on the checkpoint, whose manifest records "ddp"."""
    (copy / "model.pt").unlink()
    latest, resume = train.latest_checkpoint(copy), ["gpt", "--resume", "--out", str(copy)]
    reseal_options(copy / "run.json", strategy="zero")
    with pytest.raises(ValueError, match=rf"^--resume: {re.escape(str(copy / 'run.json'))} "
                                         r"records no sound --strategy \(.*give --strategy anew$"):
        train.train(train.parse_options(resume))
    reseal_options(latest / "manifest.json", clip=-1.0)  # and one of the checkpoint's, unsound
    with pytest.raises(ValueError, match=rf"^--resume: {re.escape(str(latest))} records no "
                                         rf"sound --clip; {re.escape(str(copy / 'run.json'))} "
                                         r"records no sound --strategy \(.*another --out$"):
        train.train(train.parse_options(resume))


def test_a_damaged_run_json_beside_a_sound_checkpoint_is_moved_away_not_the_run(copy):
    """The refusal told the user to start afresh, throwing away sound checkpoints, where moving
    run.json away resumes with what the checkpoint records."""
    (copy / "model.pt").unlink()
    (copy / "run.json").write_text("garbage")
    latest, resume = train.latest_checkpoint(copy), ["gpt", "--resume", "--out", str(copy)]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(copy / 'run.json'))} cannot be read "
                                         rf".*: move it away to resume with the options "
                                         rf"{re.escape(str(latest))} records$"):
        train.train(train.parse_options(resume))
    (copy / "run.json").rename(copy / "run.json.damaged")  # the advice, followed
    run(copy, "--resume", steps=6)
    assert torch.load(copy / "model.pt", weights_only=True)["step"] == 6


def test_a_damaged_model_pt_names_itself_and_the_checkpoint_to_resume_from(copy):
    """A model.pt cut short stopped every resume with PyTorch's words alone, though the
    checkpoint was intact; the advice, followed, resumes from it."""
    (copy / "model.pt").write_bytes((copy / "model.pt").read_bytes()[:100])
    latest = train.latest_checkpoint(copy)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(copy / 'model.pt'))} cannot be read: "
                                         rf".*; move it away and --resume from the checkpoint "
                                         rf"{re.escape(str(latest))}, or give another --out$"):
        run(copy, "--resume", steps=10)
    (copy / "model.pt").rename(copy / "model.pt.damaged")
    run(copy, "--resume", steps=6)
    assert torch.load(copy / "model.pt", weights_only=True)["step"] == 6


FRONTS = {"python -m attnbook.train_command": [sys.executable, "-m", "attnbook.train_command"],
          "python -m attnbook.train": [sys.executable, "-m", "attnbook.train"],
          "attnbook-train": [str(Path(sys.executable).with_name("attnbook-train"))]}


@pytest.mark.parametrize("front", FRONTS)
def test_every_way_to_start_the_command_checks_a_recorded_steps(copy, front):
    """`python -m attnbook.train_command` runs that module as __main__, a second copy of it: its
    parser filled the copy's table of rules, and check_run_options (attnbook.train imports the
    other copy) found an empty one, so a run recorded with --steps 1048576 resumed towards it."""
    (copy / "model.pt").unlink()
    reseal_options(train.latest_checkpoint(copy) / "manifest.json", steps=2**20)
    reseal_options(copy / "run.json", steps=2**20)
    before = files(copy)
    try:
        done = subprocess.run([*FRONTS[front], "gpt", "--resume", "--out", str(copy)],
                              capture_output=True, text=True, env=ENV, timeout=180)
    except subprocess.TimeoutExpired as timeout:  # the old code trained on, towards 2**20 steps
        pytest.fail(f"not refused in {timeout.timeout} s: it trained; it said {timeout.stderr!r}")
    assert done.returncode == 1 and "records no sound --steps" in done.stderr, done
    assert files(copy) == before


def test_check_run_options_needs_no_parser_built_before_it():
    """Its rules were those a parser, once built in the process, had left in the module."""
    script = ("from attnbook.train_command import DEFAULTS, check_run_options\n"
              "print(check_run_options({**DEFAULTS, 'model': 'gpt', 'steps': 2**20, 'seed': -1}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "['seed', 'steps']\n", done


@pytest.mark.parametrize("resumes", [(4,), (4, 8)])
def test_no_note_of_a_new_schedule_where_none_is_followed(tmp_path, monkeypatch, resumes):
    """A run of 8 steps stopped at its checkpoint of step 4: resumed with --steps 4 (the advice
    for fewer), no step is trained; then with --steps 8, its own length, its log is the
    uninterrupted run's. Neither gets the note that the result is that of neither run."""
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    run(out, "--checkpoint-every", "2", steps=8)
    whole = [(e["step"], e["loss"], e["lr"]) for e in log(out)]
    (out / "model.pt").unlink()
    for step in (6, 8):
        shutil.rmtree(out / "checkpoints" / f"step-{step:08d}")
    for steps in resumes:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            run(out, "--resume", steps=steps)
    assert "note:" not in said.getvalue()  # the last resume's
    assert [(e["step"], e["loss"], e["lr"]) for e in log(out)] == whole[:steps]


@pytest.mark.parametrize("option, value, recorded", [
    ("--seed", "4", "3"), ("--global-batch", "8", "4"), ("--dtype", "float32", "float64"),
    ("--dropout", "0.1", "0.0"), ("--d-model", "64", "32"), ("--lr", "0.001", "0.006"),
    ("--context", "8", "16"), ("--warmup", "3", "30"), ("--clip", "0.0", "1.0"),
])
def test_a_resume_with_other_options_is_refused_by_name(copy, option, value, recorded):
    with pytest.raises(ValueError, match=rf"{option} {value} \(the run's: {recorded}\)"):
        run(copy, "--resume", option, value, steps=6)


def test_a_resume_names_every_option_that_differs_at_once(copy):
    with pytest.raises(ValueError) as refused:
        run(copy, "--resume", "--seed", "4", "--d-model", "64", "--lr", "0.001", steps=6)
    said = str(refused.value)
    assert all(f in said for f in ("--seed 4 (the run's: 3)", "--d-model 64 (the run's: 32)",
                                   "--lr 0.001 (the run's: 0.006)"))


def test_a_resume_takes_the_options_it_is_not_given_from_the_run(copy):
    before = torch.load(copy / "model.pt", weights_only=True)["options"]
    with contextlib.redirect_stderr(io.StringIO()) as said:
        train.train(train.parse_options(["gpt", "--resume", "--steps", "6", "--out", str(copy)]))
    saved = torch.load(copy / "model.pt", weights_only=True)
    assert saved["step"] == 6 and [e["step"] for e in log(copy)] == [1, 2, 3, 4, 5, 6]
    assert saved["options"] == {**before, "steps": 6}  # TINY's sizes, seed and dtype, not defaults
    assert saved["config"]["d_model"] == 32 and before["checkpoint_every"] == 2
    assert f"resuming {copy} from its checkpoint step-00000004 (step 4)\n" in said.getvalue()


def test_a_resume_with_the_same_options_continues(copy):
    run(copy, "--resume", steps=5)
    assert [e["step"] for e in log(copy)] == [1, 2, 3, 4, 5]


def forge_manifest(checkpoint):
    """Rewrite the manifest's hashes to match the folder, as a forger would."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in checkpoint.iterdir() if p.name != "manifest.json"}
    del manifest["sha256"]
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "sha256": digest}))


@pytest.mark.parametrize("forged", [False, True])
def test_a_crafted_metadata_pickle_runs_no_code(copy, tmp_path, forged):
    checkpoint = train.latest_checkpoint(copy)
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    if forged:
        forge_manifest(checkpoint)
    match = "names posix.system|names nt.system" if forged else "does not match the SHA-256"
    with pytest.raises(ValueError, match=match) as refused:
        run(copy, "--resume", steps=6)
    assert str(checkpoint) in str(refused.value)
    assert not marker.exists()


def test_a_crafted_value_pickle_runs_no_code(copy, tmp_path):
    """A checkpoint that DCP itself wrote, with the step stored as a pickle that calls
    os.system: its .metadata is made of admitted types, but the value is refused."""
    checkpoint = train.latest_checkpoint(copy)
    model = GPT(GPTConfig(vocab_size=train.corpus()[1], context_length=16,
                          d_model=32, num_layers=2, num_heads=2, dropout=0.0)).double()
    optimizer = torch.optim.AdamW(model.parameters())
    state = train._checkpoint_state(model, optimizer, 4)
    marker = tmp_path / "pwned"
    state["step"] = Payload(marker)
    manifest = (checkpoint / "manifest.json").read_text()
    shutil.rmtree(checkpoint)
    with train._dcp_call():
        torch.distributed.checkpoint.save(state, checkpoint_id=checkpoint, no_dist=True)
    (checkpoint / "manifest.json").write_text(manifest)
    forge_manifest(checkpoint)
    with pytest.raises(ValueError, match="stores step as a pickle"):
        run(copy, "--resume", steps=6)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "truncated, manifest forged", "garbled metadata",
                                    "no manifest", "manifest garbled", "file added"])
def test_a_damaged_checkpoint_is_refused_by_name(copy, damage):
    checkpoint = train.latest_checkpoint(copy)
    data = checkpoint / "__0_0.distcp"
    if damage.startswith("truncated"):
        data.write_bytes(data.read_bytes()[: len(data.read_bytes()) // 2])
    elif damage == "garbled metadata":
        (checkpoint / ".metadata").write_bytes(b"\x80\x04garbage")
    elif damage == "no manifest":
        (checkpoint / "manifest.json").unlink()
    elif damage == "manifest garbled":
        (checkpoint / "manifest.json").write_text('{"files": ')
    else:
        (checkpoint / "__1_0.distcp").write_bytes(b"")
    if "forged" in damage or damage == "garbled metadata":
        forge_manifest(checkpoint)
    with pytest.raises(ValueError) as refused:  # not a CheckpointException, a BaseException
        run(copy, "--resume", steps=6)
    assert f"checkpoint {checkpoint}" in str(refused.value)


def test_the_command_turns_a_refusal_into_one_line_and_status_1(base, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit:
        train.main(["gpt", *TINY, "--steps", "4", "--out", str(base)])
    assert exit.value.code == 1
    said = capsys.readouterr().err
    assert said.startswith("attnbook-train: error: --out ") and said.count("\n") == 1


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a process is POSIX")
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    args = ["gpt", *TINY, "--steps", "100000", "--checkpoint-every", "1", "--print-every", "0",
            "--out", str(out)]
    # Ctrl-C as at a terminal: a shell that starts a job in the background (nohup, `&`) leaves
    # SIGINT ignored in it, and an ignored SIGINT is inherited; the test must not hang on that
    process = subprocess.Popen([sys.executable, "-m", "attnbook.train", *args],
                               stderr=subprocess.PIPE, text=True, env=ENV,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in process.stderr:  # every step is printed: wait for the third
            if line.startswith("step 3/"):
                break
        deadline = time.monotonic() + 60
        while train.latest_checkpoint(out) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        said = process.stderr.read()
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, said
    assert "Traceback" not in said and "stopped by Ctrl-C: the last checkpoint is " in said
    last = train.latest_checkpoint(out)
    assert f"the last checkpoint is {last} (step {int(last.name[5:])})" in said
    resume = said.split("To resume:\n")[1].strip()
    assert shlex.split(resume) == ["attnbook-train", "gpt", "--resume", "--out", str(out)]


def under_torchrun(monkeypatch, processes):
    """The variables torchrun sets, as for rank 0 of `processes` (nothing connects to them)."""
    for name, value in {"WORLD_SIZE": processes, "RANK": 0, "LOCAL_RANK": 0,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))


def refusal(argv, monkeypatch, processes=1):
    under_torchrun(monkeypatch, processes)
    with contextlib.redirect_stderr(io.StringIO()) as said, pytest.raises(SystemExit) as exit:
        train.parse_options(argv)
    assert exit.value.code == 2
    return said.getvalue()


@pytest.mark.parametrize("option, value, message", [
    ("--steps", "0", f"argument --steps: must be in [1, {2**20 - 1}], got '0'"),
    ("--steps", "2.5", "argument --steps: must be an integer, got '2.5'"),
    ("--global-batch", "-1", "argument --global-batch: must be at least 1"),
    ("--context", "0", "argument --context: must be at least 1, got '0'"),
    ("--d-model", "0", "argument --d-model: must be at least 1, got '0'"),
    ("--layers", "1.5", "argument --layers: must be an integer, got '1.5'"),
    ("--weight-decay", "-0.1", "argument --weight-decay: must be at least 0, got '-0.1'"),
    ("--eval-every", "0", "argument --eval-every: must be at least 1, got '0'"),
    ("--dropout", "1.5", r"argument --dropout: must be in [0, 1], got '1.5'"),
    ("--dropout", "nan", "argument --dropout: must be in [0, 1], got 'nan'"),
    ("--lr", "0", "argument --lr: must be above 0, got '0'"),
    ("--lr", "inf", "argument --lr: must be above 0, got 'inf'"),
    ("--heads", "3", "argument --heads: 3 heads do not divide --d-model 128"),
    ("--dtype", "float16", "argument --dtype"),
    ("--strategy", "zero", "argument --strategy"),
    ("--checkpoint-every", "-1", "argument --checkpoint-every: must be at least 0"),
    ("--keep-checkpoints", "0", "argument --keep-checkpoints: must be at least 1"),
    ("--clip", "-1", "argument --clip: must be at least 0"),
    ("--warmup", "1.5", "argument --warmup: must be an integer"),
    ("--min-lr-ratio", "2", "argument --min-lr-ratio: must be in [0, 1]"),
    ("--print-every", "-1", "argument --print-every: must be at least 0"),
])
def test_bad_options_are_refused_by_name(monkeypatch, option, value, message):
    assert message in refusal(["gpt", option, value, "--out", "x"], monkeypatch)


def test_a_seed_or_steps_beyond_the_batch_streams_is_refused_before_torch_or_a_file(tmp_path):
    """recipe.batch keeps 12 bits for the seed and 20 for the step (chapter 10): the parser
    refuses what it would refuse, naming the option, before PyTorch loads or --out is touched
    (a finished run in --out survives an --overwrite with a bad --seed)."""
    (out := tmp_path / "run").mkdir()
    (out / "model.pt").write_bytes(b"a finished run")
    script = textwrap.dedent(f"""
        import sys
        from attnbook import train_command
        for option, value in (("--seed", "4096"), ("--seed", "-1"), ("--steps", str(2**20))):
            try:
                train_command.main(["gpt", option, value, "--overwrite", "--out", {str(out)!r}])
            except SystemExit as exit:
                assert exit.code == 2, exit.code
        print("torch loaded:", "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV,
                          timeout=120)  # an accepted --steps would train, for hours
    assert done.returncode == 0 and done.stdout.strip().endswith("torch loaded: False"), done
    for said in ("argument --seed: must be in [0, 4095], got '4096'",
                 "argument --seed: must be in [0, 4095], got '-1'",
                 f"argument --steps: must be in [1, {2**20 - 1}], got '{2**20}'"):
        assert said in done.stderr, done.stderr
    assert [p.name for p in out.iterdir()] == ["model.pt"]


def test_the_commands_seed_and_steps_bounds_are_recipe_batchs(monkeypatch):
    """The loop trains steps 1 to --steps, step s on batch_share(..., s, ...): the largest --steps
    accepted has its last batch, and one more is refused (2**20 was accepted, and its run failed
    at its last step without writing model.pt)."""
    ids = torch.arange(1000)
    options = train.parse_options(["gpt", "--seed", "4095", "--steps", str(2**20 - 1), "--out", "x"])
    x, _ = train.batch_share(ids, options.steps, options)  # the last step's batch exists
    assert x.shape == (options.global_batch, options.context)
    with pytest.raises(ValueError, match="seed"):
        train.batch_share(ids, 1, argparse.Namespace(**{**vars(options), "seed": 4096}))
    with pytest.raises(ValueError, match="step"):
        train.batch_share(ids, options.steps + 1, options)
    assert "--steps: must be in" in refusal(["gpt", "--steps", str(options.steps + 1), "--out",
                                             "x"], monkeypatch)


@pytest.mark.parametrize("name, value", [("seed", 4096), ("seed", -1), ("steps", 2**20)])
def test_a_recorded_seed_or_steps_beyond_the_bounds_is_refused_at_resume(name, value):
    recorded = {**train_command.DEFAULTS, "model": "gpt"}
    assert train_command.check_run_options(recorded) == []
    assert train_command.check_run_options({**recorded, name: value}) == [name]


def test_recorded_heads_that_do_not_divide_d_model_are_refused_as_the_command_line_does():
    recorded = {**train_command.DEFAULTS, "model": "gpt"}  # d_model 128
    assert train_command.check_run_options({**recorded, "heads": 3}) == ["heads"]
    assert train_command.check_run_options({**recorded, "heads": 3, "d_model": "128"}) == [
        "d_model"]  # a value of the wrong type is named, not divided


@pytest.mark.parametrize("recorded", [None, [], "steps"])
def test_check_run_options_refuses_what_is_not_a_dict_by_name(recorded):
    with pytest.raises(TypeError, match="^recorded must be an instance of dict"):
        train_command.check_run_options(recorded)


def test_bad_sample_options_are_refused_by_name(monkeypatch):
    sample = ["sample", "--run", "x", "--prompt"]
    assert "argument --prompt: must not be empty" in refusal([*sample, ""], monkeypatch)
    assert "argument --tokens: must be at least 0" in refusal([*sample, "a", "--tokens", "-1"],
                                                              monkeypatch)
    assert "argument --temperature" in refusal([*sample, "a", "--temperature", "nan"],
                                               monkeypatch)
    assert "--run" in refusal(["sample", "--prompt", "a"], monkeypatch)


def test_resume_and_overwrite_exclude_each_other(monkeypatch):
    said = refusal(["gpt", "--resume", "--overwrite", "--out", "x"], monkeypatch)
    assert "argument --overwrite: not allowed with argument --resume" in said


def test_a_global_batch_the_processes_cannot_share_is_refused(monkeypatch):
    said = refusal(["gpt", "--global-batch", "6", "--out", "x"], monkeypatch, processes=4)
    assert "argument --global-batch: 6 sequences cannot be shared equally by 4 processes" in said
    under_torchrun(monkeypatch, 3)
    assert train.parse_options(["gpt", "--global-batch", "6", "--out", "x"]).global_batch == 6


def test_other_commands_and_a_missing_out_are_refused(monkeypatch):
    said = refusal(["bert", "--out", "x"], monkeypatch)
    assert "invalid choice: 'bert'" in said and "gpt" in said and "sample" in said
    assert "--out" in refusal(["gpt"], monkeypatch)


def test_the_help_says_what_is_trusted(monkeypatch):
    with contextlib.redirect_stdout(io.StringIO()) as said, pytest.raises(SystemExit):
        train.parse_options(["--help"])
    text = " ".join(said.getvalue().split())
    assert "What is trusted" in text and "weights_only=True" in text and "SHA-256" in text
    assert "nothing in --out or --run is run as code, as far as two loaders are sound" in text


def test_batch_shares_are_disjoint_slices_of_one_global_batch(monkeypatch):
    under_torchrun(monkeypatch, 4)
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
    # what is gathered does not depend on W: the same bytes over the 1/W share at every W
    gathered = {b - math.ceil(16 * params / w) for b, w in zip(fsdp, (1, 2, 4, 8))}
    assert len(gathered) == 1 and 0 < gathered.pop() < 16 * params
    # A restatement of appendix B's count, which is not measured (FSDP2's behaviour is its
    # design's): it guards the sum against an edit that the appendix's text does not follow.
    # Gathered: the root's (embeddings, final norm) weights and gradient, in float32, and three
    # blocks' weights or gradients (the one computing: both; the next: its weights).
    block = sum(p.numel() for p in GPT(config).blocks[0].parameters())
    root = params - config.num_layers * block
    assert fsdp[-1] == math.ceil(16 * params / 8) + 4 * (2 * root + 3 * block)


@pytest.mark.parametrize("processes, strategy, error", [
    (0, "fsdp", ValueError), (-2, "fsdp", ValueError), (0, "ddp", ValueError),
    (2.5, "fsdp", TypeError), (True, "fsdp", TypeError), ("2", "ddp", TypeError),
    (2, "FSDP", ValueError), (2, "zero", ValueError), (2, None, TypeError)])
def test_memory_per_process_refuses_bad_arguments(processes, strategy, error):
    config = GPTConfig(vocab_size=100, context_length=16, d_model=32, num_layers=3, num_heads=2)
    name = "strategy" if processes == 2 and type(processes) is int else "processes"
    with pytest.raises(error, match=rf"^{name} must"):
        train.memory_per_process(config, processes, strategy)


def test_corpus_is_chapter_8s_text():
    ids, vocab_size = train.corpus()
    assert ids.dtype == torch.int64 and ids.dim() == 1 and len(ids) > 400_000
    assert int(ids.min()) == 0 and int(ids.max()) == vocab_size - 1


def test_sample_on_an_unfinished_run_says_how_to_finish_it(copy):
    (copy / "model.pt").unlink()  # stopped after its last checkpoint, before model.pt
    with pytest.raises(ValueError, match=rf"gpt --resume --out {re.escape(str(copy))}$"):
        train.sample(copy, "a", 3)
    train.main(["gpt", "--resume", "--out", str(copy)])  # the advice, as given
    assert train.sample(copy, "a", 3, temperature=0).startswith("a")
    with pytest.raises(ValueError, match=r"train one first: attnbook-train gpt --out"):
        train.sample(copy / "nothing", "a", 3)


def test_only_the_latest_checkpoints_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run(tmp_path / "three", "--checkpoint-every", "1", steps=5)  # the default: 3
    run(tmp_path / "one", "--checkpoint-every", "2", "--keep-checkpoints", "1", steps=5)
    assert [p.name for p in sorted((tmp_path / "three" / "checkpoints").iterdir())] == [
        "step-00000003", "step-00000004", "step-00000005"]
    assert [p.name for p in (tmp_path / "one" / "checkpoints").iterdir()] == ["step-00000004"]


def test_a_step_with_a_nan_loss_stops_the_run_before_saving_it(tmp_path, monkeypatch, capsys):
    """Step 2 goes wrong (a weight becomes NaN): the run stops with status 1 and one line that
    names the step and the last checkpoint, which it keeps; it saves nothing of step 2 on."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    steps = []

    def poisoned(model, *args, _step=train.train_step, **kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == 2:
            with torch.no_grad():
                next(model.parameters()).fill_(math.nan)
        return _step(model, *args, **kwargs)

    monkeypatch.setattr(train, "train_step", poisoned)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit:
        train.main(["gpt", *TINY, "--steps", "3", "--checkpoint-every", "1",
                    "--keep-checkpoints", "1", "--out", str(out)])
    assert exit.value.code == 1 and steps == [1, 2]
    said = capsys.readouterr().err.splitlines()[-1]
    first = out / "checkpoints" / "step-00000001"
    assert said.startswith("attnbook-train: error: step 2: the loss is nan")
    assert said.endswith(f"the last checkpoint is {first} (step 1)")
    assert [p.name for p in (out / "checkpoints").iterdir()] == [first.name]
    assert not (out / "model.pt").exists()
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1]


# The installed command, run as a user runs it.

COMMAND = Path(sys.executable).with_name("attnbook-train")


def installed(*args):
    return subprocess.run([str(COMMAND), *args], capture_output=True, text=True, env=ENV,
                          timeout=240)


def help_of(*args):
    """The help of `attnbook-train *args --help` on one line, and {option: its help}."""
    done = installed(*args, "--help")
    assert done.returncode == 0, done.stderr
    entries = re.split(r"\n  (?=-)", done.stdout.split("options:")[1])[1:]  # one per option
    options = {}
    for entry in entries:
        flag, _, rest = " ".join(entry.split()).partition(" ")
        options[flag.rstrip(",")] = re.sub(r"^([A-Z_]+|\{[a-z0-9,]+\}) ", "", rest)
    return " ".join(done.stdout.split()), options


def refused_without_torch(*args):
    """What `attnbook-train *args` says on stderr, run in a fresh process (the command's main, as
    the console script calls it), once it has exited with status 1 before PyTorch loaded."""
    script = textwrap.dedent(f"""
        import sys
        from attnbook import train_command
        try:
            train_command.main({list(args)!r})
        except SystemExit as exit:
            print("status", exit.code, "torch loaded:", "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV,
                          timeout=240)
    assert done.stdout.strip() == "status 1 torch loaded: False", (done.stdout, done.stderr)
    return done.stderr


def test_version_and_help_answer_without_loading_torch():
    script = textwrap.dedent("""
        import sys
        from attnbook import train_command
        for argv in (["--version"], ["--help"], ["gpt", "--help"], ["sample", "--help"]):
            try:
                train_command.main(argv)
            except SystemExit as exit:
                assert exit.code == 0, exit.code
        print("torch loaded:", "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV)
    assert done.returncode == 0 and done.stdout.strip().endswith("torch loaded: False")
    version = installed("--version")
    assert version.stdout == f"attnbook-train {importlib.metadata.version('attnbook')}\n"


def test_the_help_names_the_program_and_states_every_default():
    text, options = help_of("gpt")
    assert text.startswith("usage: attnbook-train gpt ")
    for name, default in train_command.DEFAULTS.items():
        assert options["--" + name.replace("_", "-")].endswith(f"(default {default})"), name
    sample_text, options = help_of("sample")
    assert options["--tokens"].endswith("(default 200)") and "(default 0.8)" in options[
        "--temperature"] and options["--top-k"].endswith("(default 10)")
    top, _ = help_of()
    assert top.count("What is trusted") == 1 and "What is trusted" not in text + sample_text


def test_a_second_run_into_a_folder_in_use_is_refused_by_its_holder(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([str(COMMAND), "gpt", *TINY, "--steps", "100000", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out / "log.jsonl").exists():  # the lock is taken before the log is begun
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        second = refused_without_torch("gpt", *TINY, "--steps", "2", "--overwrite", "--out",
                                       str(out))
        assert second == (
            f"attnbook-train: error: --out {out} is in use by another run (process {first.pid}):"
            f" wait for it to end, or give another --out\n")
        assert (out / "log.jsonl").exists() and not (out / "model.pt").exists()  # untouched
    finally:
        first.kill()  # a crash: the lock goes with the process
        first.communicate()
    again = installed("gpt", *TINY, "--steps", "2", "--overwrite", "--out", str(out))
    assert again.returncode == 0, again.stderr


@pytest.mark.skipif(os.name != "posix", reason="the lock needs fcntl")
def test_one_process_trains_under_the_lock_its_command_took_before_torch(tmp_path, monkeypatch):
    """No moment when --out is free between the command's refusals and its training: main locks
    it once, and the run trains under that lock (a second taker is refused at every step)."""
    import fcntl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out, taken, lock_out, train_as = tmp_path / "run", [], train_command.lock_out, train.train
    counted = lambda folder: taken.append(folder) or lock_out(folder)  # noqa: E731
    monkeypatch.setattr(train_command, "lock_out", counted)
    monkeypatch.setattr(train, "lock_out", counted)
    free = []

    def probe(step):
        with open(out / ".lock") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free.append(step)
            except BlockingIOError:
                pass

    monkeypatch.setattr(train, "train", lambda options: train_as(options, on_step=probe))
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    train.main(["gpt", *TINY, "--steps", "2", "--out", str(out)])
    assert taken == [out] and free == [] and (out / "model.pt").exists()


def test_resuming_a_finished_run_with_no_more_steps_leaves_it_alone(tmp_path):
    out = tmp_path / "run"
    done = installed("gpt", *TINY, "--steps", "5", "--checkpoint-every", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    before = files(out)
    for steps in ("4", "5"):  # checkpoints at 2 and 4, model.pt at 5
        again = installed("gpt", "--resume", "--steps", steps, "--out", str(out))
        assert again.returncode == 1 and again.stderr == (
            f"attnbook-train: error: --resume: the run in {out} has finished, at step 5: give "
            f"--steps above 5 to train it further, or another --out\n")
        assert files(out) == before


@pytest.mark.parametrize("kind", ["a file", "impossible"])
def test_an_unusable_out_is_one_line_naming_it(tmp_path, kind):
    out = tmp_path / "notes.txt" if kind == "a file" else Path("/proc/attnbook/run")
    if kind == "a file":
        out.write_text("mine")
    elif not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    said = refused_without_torch("gpt", *TINY, "--steps", "1", "--out", str(out))
    lines = said.splitlines()
    assert len(lines) == 1 and f"--out {out}" in lines[0], said
    assert lines[0].startswith("attnbook-train: error: ")
    if kind == "a file":
        assert out.read_text() == "mine"


def started_and_stopped(out, monkeypatch):
    """A 3-step run of TINY into `out`, stopped by Ctrl-C in its first step (no checkpoint)."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def stop(step):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train.train(train.parse_options(["gpt", *TINY, "--steps", "3", "--out", str(out)]),
                    on_step=stop)


def test_a_resume_before_the_first_checkpoint_takes_the_runs_options(tmp_path, monkeypatch):
    out = tmp_path / "run"
    started_and_stopped(out, monkeypatch)
    train.train(train.parse_options(["gpt", "--resume", "--out", str(out)]))
    saved = torch.load(out / "model.pt", weights_only=True)
    assert saved["step"] == 3 and saved["config"]["d_model"] == 32  # TINY's, not the defaults
    run(tmp_path / "whole", steps=3)
    assert largest_gap(weights(out), weights(tmp_path / "whole")) == 0


def test_a_context_longer_than_the_text_is_refused_before_anything_is_deleted(copy):
    before = files(copy)
    with pytest.raises(ValueError, match=r"--context 60000 is not shorter than the held-out text"):
        run(copy, "--overwrite", "--context", "60000", steps=1)
    assert files(copy) == before


@pytest.mark.parametrize("change", ["a flipped digit", "an unsound value"])
def test_a_manifest_that_does_not_check_out_is_refused(copy, change):
    checkpoint = train.latest_checkpoint(copy)
    path = checkpoint / "manifest.json"
    if change == "a flipped digit":  # damage: the options no longer match the manifest's digest
        path.write_text(path.read_text().replace('"lr": 0.006', '"lr": 0.004'))
        match = "does not match its own SHA-256"
    else:  # sound digest, unsound option: as a forger, or an older version, would leave it
        manifest = json.loads(path.read_text())
        manifest["options"]["global_batch"] = 0
        path.write_text(json.dumps(manifest))
        forge_manifest(checkpoint)
        match = "records no sound --global-batch"
    with pytest.raises(ValueError, match=match):
        run(copy, "--resume", steps=6)


def test_a_changed_steps_on_resume_is_said(copy):
    with contextlib.redirect_stderr(io.StringIO()) as said:
        run(copy, "--resume", steps=6)
    assert "note: --steps 6, where the run had 4" in said.getvalue()


@pytest.mark.parametrize("argv", [["gpt", "--out", ""], ["sample", "--run", "", "--prompt", "a"]])
def test_an_empty_folder_name_is_refused(monkeypatch, argv):
    assert "must name a folder" in refusal(argv, monkeypatch)


def test_a_resume_keeps_what_the_last_resume_changed_before_its_next_checkpoint(copy):
    def stop(step):
        if step == 5:  # after the step-4 checkpoint, before the next (every 2: step 6)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train.train(train.parse_options(["gpt", "--resume", "--steps", "9", "--out", str(copy)]),
                    on_step=stop)
    train.train(train.parse_options(["gpt", "--resume", "--out", str(copy)]))
    assert torch.load(copy / "model.pt", weights_only=True)["step"] == 9  # not the checkpoint's 4


def test_an_edited_run_json_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    started_and_stopped(out, monkeypatch)
    (out / "run.json").write_text((out / "run.json").read_text().replace('"lr": 0.006',
                                                                        '"lr": 5.0'))
    with pytest.raises(ValueError, match=r"run.json is damaged.*own SHA-256"):
        train.train(train.parse_options(["gpt", "--resume", "--out", str(out)]))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a GPU's random state needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_restores_the_random_state_dropout_draws_from(tmp_path, device):
    # on a GPU, dropout draws from the GPU's generator, which checkpoints once left out: a
    # resumed run then dropped other units than an unbroken one
    model = GPT(GPTConfig(vocab_size=8, context_length=4, d_model=8, num_layers=1, num_heads=2,
                          dropout=0.5)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(1)
    path = train.save_checkpoint(tmp_path, 1, model, optimizer)
    unbroken = torch.rand(16, device=device)  # what the next dropout would draw
    torch.manual_seed(2)  # the generators move on, as in another process
    assert train.load_checkpoint(path, model, optimizer) == 1
    torch.testing.assert_close(torch.rand(16, device=device), unbroken, rtol=0, atol=0)


def test_save_checkpoint_keeps_the_one_it_writes_and_checks_keep_before_writing(tmp_path,
                                                                              monkeypatch):
    # R-N55: saving step 3 beside steps 5 and 6 with 2 kept deleted step 3 at once and returned
    # its path; keep_checkpoints=-1 deleted every checkpoint; 2.5 raised after writing
    model = GPT(GPTConfig(vocab_size=8, context_length=4, d_model=8, num_layers=1, num_heads=2))
    optimizer = torch.optim.AdamW(model.parameters())
    kept = lambda: sorted(p.name for p in (tmp_path / "checkpoints").iterdir())  # noqa: E731
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    options = train.parse_options(["gpt", *TINY, "--out", str(tmp_path)])
    for step in (5, 6):
        train.save_checkpoint(tmp_path, step, model, optimizer)  # no options: none deleted
    options.keep_checkpoints = 2
    assert train.save_checkpoint(tmp_path, 3, model, optimizer, options).exists()
    assert kept() == ["step-00000003", "step-00000006"]
    options.keep_checkpoints = 1
    train.save_checkpoint(tmp_path, 7, model, optimizer, options)
    assert kept() == ["step-00000007"]
    with pytest.raises(ValueError, match="^step must be at least 0"):  # R-ME55: all deleted
        train.save_checkpoint(tmp_path, -1, model, optimizer, options)
    for bad in (-1, 0, 2.5, None):
        options.keep_checkpoints = bad
        with pytest.raises((ValueError, TypeError), match="options.keep_checkpoints"):
            train.save_checkpoint(tmp_path, 8, model, optimizer, options)
    assert kept() == ["step-00000007"]  # nothing written, nothing deleted


def test_a_step_of_the_command_reads_the_device_twice(tmp_path, monkeypatch):
    """The command's loop reads its step's loss and gradient norm in one transfer from the
    device; the model's check of its token ids reads once more. Counted from outside, as every
    read of a tensor's value into Python from any file but PyTorch's own (AdamW reads its step
    count, a tensor it keeps on the CPU even for a model on a GPU)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    reads, steps, TORCH = [], [], Path(torch.__file__).parent
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename)
            if TORCH not in caller.parents:
                reads.append((len(steps), caller.name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    train.train(train.parse_options(["gpt", *TINY, "--steps", "4", "--eval-every", "100",
                                     "--out", str(tmp_path / "run")]),
                on_step=lambda step: steps.append(step))
    per_step = [sorted(f for done, f in reads if done == step) for step in range(1, 3)]
    # steps 2 and 3 (no held-out loss): the model's id check, the batch's start positions
    # (drawn on the CPU, before the batch moves to the device) and the loop's read
    assert per_step == [["checks.py", "recipe.py", "train.py"]] * 2


def test_read_step_refuses_a_number_by_name():
    with pytest.raises(TypeError, match="norm"):
        train._read_step(torch.tensor(1.0), 2.0)


def test_sample_of_a_run_that_cannot_be_read_names_run(capsys):
    """load_model's is_dir lets an OSError through (pathlib ignores only ENOENT, ENOTDIR, EBADF
    and ELOOP): a name too long is one line naming --run, not Python's own words."""
    run = "/tmp/" + "x" * 300
    options = train.parse_options(["sample", "--run", run, "--prompt", "hi"])
    assert train.run(options, []) == 1
    said = capsys.readouterr().err
    assert said == f"attnbook-train: error: cannot read --run {run}: File name too long ({run})\n"


def reseal(checkpoint, **listed):
    """Rewrite the manifest with `listed` files added to its list, and its own SHA-256 to match."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["sha256"]
    manifest["files"].update(listed)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "sha256": digest}))


def refuses_in_time(call, seconds=30):
    """The ValueError `call()` raises, failing (not hanging) if it blocks for `seconds`."""
    def stop(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        with pytest.raises(ValueError) as refused:
            call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return str(refused.value)


@pytest.mark.skipif(os.name != "posix", reason="a named pipe and SIGALRM need POSIX")
@pytest.mark.parametrize("stray", ["a folder", "a named pipe", "a listed file, missing, of hash null"])
def test_a_checkpoint_is_compared_by_names_before_any_file_is_hashed(copy, stray):
    """A stray folder or pipe is refused by name, not opened (a pipe blocked the run forever,
    holding its lock); a resealed manifest listing a missing file with a null hash is refused."""
    checkpoint = train.latest_checkpoint(copy)
    if stray == "a folder":
        (checkpoint / "notes").mkdir()
    elif stray == "a named pipe":
        os.mkfifo(checkpoint / "notes")
    else:
        reseal(checkpoint, notes=None)
    said = refuses_in_time(lambda: train.read_manifest(checkpoint))
    assert said == (f"checkpoint {checkpoint} is damaged: notes (added, missing or changed) does "
                    f"not match the SHA-256 in its manifest.json")
    said = refuses_in_time(lambda: run(copy, "--resume", steps=6))
    assert said.startswith(f"checkpoint {checkpoint} is damaged: notes ")


AFRESH = ": start afresh with another --out"


@pytest.mark.parametrize("text, why", [
    (None, "cannot be read (No such file or directory)"),
    ("[1]", "is damaged, or not attnbook.train's (it does not match its own SHA-256)"),
    ("{}", "is damaged, or not attnbook.train's (it does not match its own SHA-256)"),
    ('{"files": ', "cannot be read (Expecting value: line 1 column 11 (char 10))")])
def test_a_manifest_that_cannot_be_read_or_is_not_sealed_is_said_so(copy, text, why):
    """In words, not Python's: a folder with no manifest is not called damaged."""
    checkpoint = train.latest_checkpoint(copy)
    if text is None:
        (checkpoint / "manifest.json").unlink()
    else:
        (checkpoint / "manifest.json").write_text(text)
    with pytest.raises(ValueError) as refused:
        run(copy, "--resume", steps=6)
    assert str(refused.value) == f"checkpoint {checkpoint}: its manifest.json {why}{AFRESH}"


def test_a_damaged_run_json_says_what_to_do(tmp_path, monkeypatch):
    """A run killed while it wrote run.json leaves it empty: the refusal says what to do next."""
    out = tmp_path / "run"
    started_and_stopped(out, monkeypatch)
    (out / "run.json").write_text("")
    with pytest.raises(ValueError) as refused:
        train.train(train.parse_options(["gpt", "--resume", "--out", str(out)]))
    assert str(refused.value) == (f"{out / 'run.json'} cannot be read (Expecting value: line 1 "
                                  f"column 1 (char 0)){AFRESH}")


@pytest.mark.skipif(os.name != "posix", reason="the lock needs fcntl")
def test_lock_out_takes_a_path_and_refuses_anything_else_by_name(tmp_path):
    lock = train_command.lock_out(tmp_path / "run")
    try:
        assert (tmp_path / "run" / ".lock").read_text() == f"{os.getpid()}\n"
        assert (tmp_path / "run" / ".lock").stat().st_mode & 0o111 == 0  # not executable
    finally:
        lock.close()
    for wrong in (str(tmp_path / "run"), 3):
        with pytest.raises(TypeError, match="^out must be an instance of Path"):
            train_command.lock_out(wrong)


@pytest.mark.skipif(os.name != "posix", reason="the lock needs fcntl")
@pytest.mark.parametrize("kind", ["a symlink", "a hard link", "a folder", "a dangling symlink"])
def test_a_lock_that_is_not_a_file_of_its_own_is_refused_and_nothing_written(tmp_path, kind):
    """With --out/.lock a link to someone's file, a run once replaced that file with its id."""
    out, notes = tmp_path / "run", tmp_path / "notes.txt"
    out.mkdir()
    notes.write_text("my notes")
    if kind == "a symlink":
        (out / ".lock").symlink_to(notes)
    elif kind == "a hard link":
        os.link(notes, out / ".lock")
    elif kind == "a folder":
        (out / ".lock").mkdir()
    else:
        (out / ".lock").symlink_to(tmp_path / "made.txt")
    said = refused_without_torch("gpt", *TINY, "--steps", "1", "--out", str(out))
    assert said == (f"attnbook-train: error: --out {out}: its .lock is a link or not a file: "
                    f"remove it\n")
    assert notes.read_text() == "my notes" and not (tmp_path / "made.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
