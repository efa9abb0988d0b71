"""The installed `attnbook-train` under a torchrun environment that torchrun did not set:
WORLD_SIZE=1 alone trains on one process, as without torchrun; WORLD_SIZE>1 without the variables
torchrun sets with it (RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is refused in one line, exit
status 1, naming what is missing, with nothing written; so is a variable torchrun would not set
(not a whole number, out of range, an empty MASTER_ADDR), at once, by every process; and
TORCHELASTIC_USE_AGENT_STORE=True, where no torchrun agent serves the store it names, is refused at
once instead of waiting for that store."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

COMMAND = Path(sys.executable).with_name("attnbook-train")
TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--context", "16",
        "--global-batch", "4", "--dropout", "0", "--dtype", "float64", "--seed", "3"]
TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")


FULL = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500"}  # what torchrun sets for one process


def installed(out: Path, *more: str, timeout: float = 240,
              **env: str) -> subprocess.CompletedProcess[str]:
    """`attnbook-train gpt` for 2 steps into `out` (options `more` last), with torchrun's
    variables replaced by `env`."""
    clean = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    return subprocess.run([str(COMMAND), "gpt", *TINY, "--steps", "2", "--out", str(out), *more],
                          capture_output=True, text=True, timeout=timeout,
                          env={**clean, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **env})


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def test_world_size_1_alone_trains_as_one_process(tmp_path):
    alone = installed(tmp_path / "alone", WORLD_SIZE="1")
    assert alone.returncode == 0, alone.stderr[-3000:]
    plain = installed(tmp_path / "plain")  # the reference: no torchrun variable at all
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert steps_logged(tmp_path / "alone") == steps_logged(tmp_path / "plain") == [1, 2]
    assert (tmp_path / "alone" / "model.pt").read_bytes() == (tmp_path / "plain" /
                                                             "model.pt").read_bytes()


@pytest.mark.parametrize(("env", "missing"), [
    ({"WORLD_SIZE": "2"}, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR, MASTER_PORT"),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "localhost"}, "LOCAL_RANK, MASTER_PORT"),
])
def test_a_partial_torchrun_environment_is_refused_in_one_line(tmp_path, env, missing):
    done = installed(tmp_path / "run", **env)
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stderr
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert said.startswith(f"attnbook-train: error: WORLD_SIZE={env['WORLD_SIZE']} ")
    assert f"not {missing}:" in said and "torchrun" in said
    assert not (tmp_path / "run" / "log.jsonl").exists()


def refused_in_one_line(done: subprocess.CompletedProcess[str], start: str) -> None:
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stderr
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert said.startswith(f"attnbook-train: error: {start}"), said


@pytest.mark.parametrize("rank", ["x", "", "1"])
def test_rank_without_world_size_is_ignored(tmp_path, rank):
    done = installed(tmp_path / "run", RANK=rank)
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps_logged(tmp_path / "run") == [1, 2]


def test_one_process_speaks_whatever_rank_says(tmp_path):
    assert installed(tmp_path / "run").returncode == 0
    again = installed(tmp_path / "run", RANK="1")  # a run is there: refused, and said
    refused_in_one_line(again, f"--out {tmp_path / 'run'} already holds a run")
    refused_in_one_line(installed(tmp_path / "other", WORLD_SIZE="1", RANK="1"), "WORLD_SIZE=1 ")


@pytest.mark.parametrize(("env", "start"), [
    ({"WORLD_SIZE": "x"}, "WORLD_SIZE='x' "), ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' "),
    ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2' "), ({"WORLD_SIZE": ""}, "WORLD_SIZE='' "),
    ({"WORLD_SIZE": "\u00b2"}, "WORLD_SIZE='\u00b2' "),
    ({**FULL, "RANK": "x"}, "RANK='x' "), ({**FULL, "RANK": ""}, "RANK='' "),
    ({**FULL, "RANK": "1"}, "RANK='1' "), ({**FULL, "RANK": "-1"}, "RANK='-1' "),
    ({**FULL, "LOCAL_RANK": "x"}, "LOCAL_RANK='x' "),
    ({**FULL, "MASTER_PORT": "x"}, "MASTER_PORT='x' "),
    ({**FULL, "MASTER_PORT": "-1"}, "MASTER_PORT='-1' "),
    ({**FULL, "MASTER_PORT": "99999"}, "MASTER_PORT='99999' "),
    ({**FULL, "MASTER_ADDR": ""}, "MASTER_ADDR='' "),
])
def test_a_value_torchrun_would_not_set_is_refused_at_once_by_name(tmp_path, env, start):
    refused_in_one_line(installed(tmp_path / "run", **env), start)  # no wait for the others
    assert not (tmp_path / "run").exists()


def test_world_size_is_read_once_as_a_whole_number(tmp_path):
    done = installed(tmp_path / "run", WORLD_SIZE="01")  # 1, alone: one process
    assert done.returncode == 0, done.stderr[-3000:]
    # partial before --global-batch: 3 sequences cannot be shared by 2 processes, but the
    # environment is what is wrong
    refused_in_one_line(installed(tmp_path / "two", "--global-batch", "3", WORLD_SIZE="2"),
                        "WORLD_SIZE=2 is set, as torchrun sets it, but not RANK, ")


def test_an_agent_store_that_no_agent_serves_is_refused_at_once(tmp_path):
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**FULL, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    done = installed(tmp_path / "run", timeout=90, **env)  # it used to wait for the store
    refused_in_one_line(done, "TORCHELASTIC_USE_AGENT_STORE=True ")
    assert "no store answers at MASTER_ADDR:MASTER_PORT" in done.stderr
    assert not (tmp_path / "run").exists()
