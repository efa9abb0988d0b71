"""attnbook.notebook (appendix A): glue for the prose, at the precision a cell asserts."""

import math
import re
import sys
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from attnbook import notebook
from attnbook.notebook import glue, median_seconds, significant


@pytest.mark.parametrize("value, digits", [(0.017515176143916008, 4), (4.291691890436166, 3),
                                           (-8123456.0, 2), (2.5e-7, 1), (0.99996, 3), (7, 1)])
def test_significant_agrees_with_python_formatting(value, digits):
    assert significant(value, digits) == float(f"{value:.{digits}g}")


def test_significant_keeps_zero_and_non_finite_values():
    assert significant(0.0, 3) == 0.0
    assert math.isnan(significant(float("nan"), 3))
    assert significant(float("inf"), 2) == float("inf")


@pytest.mark.parametrize("digits, error", [(0, ValueError), (-1, ValueError), (2.0, TypeError),
                                           (True, TypeError), ("3", TypeError)])
def test_significant_names_a_bad_digits(digits, error):
    with pytest.raises(error, match="digits"):
        significant(1.5, digits)


def recorded(monkeypatch) -> list:
    calls = []
    myst_nb = pytest.importorskip("myst_nb")  # the book's toolchain, absent from a package run

    monkeypatch.setattr(myst_nb, "glue", lambda name, value, display: calls.append(
        (name, value, display)))
    return calls


def test_glue_records_through_myst_nb_rounded_when_asked(monkeypatch):
    calls = recorded(monkeypatch)
    glue("ratio", 0.017515176143916008, digits=3)
    glue("count", 79)
    assert calls == [("ratio", 0.0175, False), ("ratio__digits", 3, False), ("count", 79, False)]


def test_glue_records_nothing_without_myst_nb_and_returns_the_value(monkeypatch):
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # import myst_nb now raises ImportError
    assert glue("ratio", 0.5049, digits=2) == 0.5


def test_glue_returns_the_rounded_value_it_records(monkeypatch):
    calls = recorded(monkeypatch)
    assert glue("ratio", 0.5049, digits=2) == 0.5 == calls[0][1]


def test_glue_refuses_to_round_what_is_not_a_number():
    with pytest.raises(TypeError, match="ratio='high'"):
        glue("ratio", "high", digits=2)


def test_glue_checks_its_name_and_rounds_what_significant_rounds(monkeypatch):
    calls = recorded(monkeypatch)  # both were accepted on 47c9c8f: a record named None, a refusal
    for name in (None, 3.0):
        with pytest.raises(TypeError, match=r"^name must be"):
            glue(name, 0.5)
    assert glue("t", torch.tensor(0.5049), digits=2) == 0.5 == significant(torch.tensor(0.5049), 2)
    assert glue("a", np.array(0.5049), digits=2) == 0.5
    assert calls == [("t", 0.5, False), ("t__digits", 2, False), ("a", 0.5, False),
                     ("a__digits", 2, False)]


def test_glue_refuses_a_name_the_prose_cannot_refer_to_or_a_digits_record(monkeypatch):
    calls = recorded(monkeypatch)  # each was recorded on b5ed336; x__digits overwrote x's digits
    for name in ("", "a b", "x\x00", "1st", "share:.1%", "é"):
        with pytest.raises(ValueError, match=r"^name must be letters, digits and _"):
            glue(name, 1)
    glue("x", 0.5049, digits=2)
    with pytest.raises(ValueError, match=r"^name must not end in '__digits'"):
        glue("x__digits", 1)
    assert glue("_x2", 1) == 1  # a name the role can refer to
    assert calls == [("x", 0.5, False), ("x__digits", 2, False), ("_x2", 1, False)]


def test_median_seconds_warms_up_batches_and_times_every_call_in_turns():
    order, syncs = [], []
    calls = [lambda: order.append("a"), lambda: order.append("b")]
    times = median_seconds(*calls, repeats=3, batch_seconds=1e-4,
                           synchronize=lambda: syncs.append(1))
    assert len(times) == 2 and all(t > 0 for t in times)
    assert order[:2] == ["a", "b"]  # each warmed up once, then timed
    assert order.count("a") >= 1 + 1 + 3 and order.count("b") >= 1 + 1 + 3
    # in turns: every batch of one call is followed by a batch of the other
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs == ["a", "b"] * (len(runs) // 2)
    assert len(syncs) == 2 * (2 * 3 + 2 * 3)  # around 3 calibration calls and 3 batches, each


def test_one_preempted_calibration_call_does_not_make_a_batch_of_one():
    calls = []

    def call():
        calls.append(1)
        if len(calls) == 2:  # the first call after the warm-up, as if the machine preempted it
            time.sleep(0.05)

    median_seconds(call, repeats=1, batch_seconds=0.01)
    assert len(calls) > 1 + 3 + 1  # warm-up, three calibration calls, then a batch of many


@pytest.mark.skipif(sys.platform == "win32", reason="the default clock there is the wall clock")
def test_median_seconds_counts_the_threads_work_not_its_waiting():
    asleep, = median_seconds(lambda: time.sleep(0.002), repeats=1, batch_seconds=0.004)
    assert asleep < 0.001  # the default clock, the thread's CPU time, does not count a sleep
    awake, = median_seconds(lambda: time.sleep(0.002), repeats=1, batch_seconds=0.004,
                            clock=time.perf_counter)
    assert awake >= 0.002


def test_median_seconds_reads_the_clock_it_is_given():
    ticks = iter(range(1000))
    # a call longer than the batch runs alone, and this clock advances one "second" per reading
    times = median_seconds(lambda: time.sleep(0.002), repeats=3, batch_seconds=0.001,
                           clock=lambda: float(next(ticks)))
    assert times == [1.0]


@pytest.mark.parametrize("kwargs, error, text", [
    ({"repeats": 0}, ValueError, "repeats must be at least 1, got repeats=0"),
    ({"repeats": True}, TypeError, "repeats must be an int"),
    ({"batch_seconds": 0.0}, ValueError, "batch_seconds must be a finite number in"),
    ({"batch_seconds": math.nan}, ValueError, "batch_seconds=nan"),
    ({"clock": "wall"}, TypeError, "clock must be callable, got clock='wall'"),
])
def test_median_seconds_names_a_bad_setting(kwargs, error, text):
    with pytest.raises(error, match=text):
        median_seconds(lambda: None, **kwargs)
    with pytest.raises(TypeError, match="median_seconds times callables"):
        median_seconds("not a function")


@pytest.fixture(autouse=True)
def _no_transformers_offline(monkeypatch):
    # CI sets TRANSFORMERS_OFFLINE=1, which online() obeys too; tests that want it set it
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.mark.parametrize("hf_hub, transformers", [(None, "1"), ("0", "yes"), ("", "True")])
def test_online_obeys_transformers_offline_too(monkeypatch, hf_hub, transformers):
    # huggingface_hub falls back on TRANSFORMERS_OFFLINE; online() stays offline if either is true
    from huggingface_hub.constants import _is_true

    tried = []
    monkeypatch.setattr(notebook.socket, "create_connection", lambda *args, **kw: tried.append(1))
    for name, setting in (("HF_HUB_OFFLINE", hf_hub), ("TRANSFORMERS_OFFLINE", transformers)):
        monkeypatch.delenv(name, raising=False) if setting is None else monkeypatch.setenv(name, setting)
    assert notebook.online("example.org") is False and tried == []
    assert _is_true(transformers)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "ture")  # refused by name, as HF_HUB_OFFLINE is
    with pytest.raises(ValueError, match="^TRANSFORMERS_OFFLINE must be 1, true, .*'ture'"):
        notebook.online("example.org")


@pytest.mark.parametrize("setting, expected", [("1", False), ("true", False), ("0", True),
                                               ("false", True), (None, True)])
def test_online_obeys_hf_hub_offline(monkeypatch, setting, expected):
    tried = []

    class Connection:
        def close(self):
            pass

    def connect(address, timeout):
        tried.append(address)
        return Connection()

    monkeypatch.setattr(notebook.socket, "create_connection", connect)
    if setting is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", setting)
    assert notebook.online("example.org") is expected
    assert tried == ([("example.org", 443)] if expected else [])


def test_online_is_false_when_the_connection_fails_or_hangs(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def refuse(address, timeout):
        raise OSError("no route to host")

    monkeypatch.setattr(notebook.socket, "create_connection", refuse)
    assert notebook.online() is False

    def hang(address, timeout):
        time.sleep(3)
        raise OSError("timed out")

    monkeypatch.setattr(notebook.socket, "create_connection", hang)
    start = time.perf_counter()
    assert notebook.online(timeout=0.1) is False
    assert time.perf_counter() - start < 2  # gave up after timeout + 1 seconds, not 3


def test_runtime_follows_the_device_unless_told(monkeypatch):
    import torch

    from attnbook.notebook import Runtime, runtime

    monkeypatch.delenv("ATTNBOOK_PROFILE", raising=False)
    monkeypatch.delenv("ATTNBOOK_DEVICE", raising=False)
    cuda = torch.cuda.is_available()
    here = runtime()
    assert here == Runtime("cuda" if cuda else "cpu", "gpu" if cuda else "cpu")
    assert here.cuda == cuda and here.pick(cpu="small", gpu="large") == ("large" if cuda else "small")
    monkeypatch.setenv("ATTNBOOK_PROFILE", "gpu")
    monkeypatch.setenv("ATTNBOOK_DEVICE", "cpu")
    forced = runtime()
    assert forced == Runtime("cpu", "gpu") and not forced.cuda and forced.pick(1, 2) == 2
    assert "forced" in forced.describe()


@pytest.mark.parametrize("name, value", [("ATTNBOOK_PROFILE", "tpu"), ("ATTNBOOK_DEVICE", "mps"),
                                         ("ATTNBOOK_PROFILE", "GPU")])
def test_runtime_names_a_bad_setting(monkeypatch, name, value):
    from attnbook.notebook import runtime

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        runtime()


def test_runtime_refuses_cuda_without_a_gpu(monkeypatch):
    import torch

    from attnbook.notebook import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ATTNBOOK_DEVICE", "cuda")
    with pytest.raises(ValueError, match="ATTNBOOK_DEVICE"):
        runtime()


def test_glue_returns_what_it_records():
    assert glue("x", 0.6549, digits=2) == 0.65
    assert glue("x", 12345, digits=2) == 12000.0
    assert glue("x", "text") == "text" and glue("x", 7) == 7
    assert math.isnan(glue("x", float("nan"), digits=2))


def test_a_cell_ending_in_glue_displays_nothing():
    value = glue("x", 0.2549, digits=2)
    assert value == 0.25 and f"{value:.0%}" == "25%" and value * 2 == 0.5
    assert hasattr(value, "_ipython_display_") and value._ipython_display_() is None
    count = glue("n", 7)
    assert count == 7 and hasattr(count, "_ipython_display_")
    assert glue("flag", True) is True and glue("text", "a") == "a"  # not numbers: as they are


def test_significant_takes_0_d_arrays_and_tensors_and_median_seconds_synchronize_false():
    # both were refused by the first fix of bad input; each worked before it
    assert significant(np.array(0.0175151), 3) == significant(torch.tensor(0.0175151), 3) == 0.0175
    (seconds,) = median_seconds(lambda: None, repeats=1, batch_seconds=0.001, synchronize=False)
    assert seconds >= 0


@pytest.mark.parametrize("value", ["1.2345", True, None, 1j, np.array([1.5])])
def test_significant_refuses_what_is_not_a_real_number(value):
    with pytest.raises(TypeError, match="value must be a real number"):
        significant(value, 2)


def test_significant_names_a_value_that_rounds_past_the_largest_float():
    assert significant(1.2e308, 1) == 1e308
    with pytest.raises(ValueError, match="value=1.79.*overflows"):
        significant(sys.float_info.max, 1)  # 2e308


@pytest.mark.parametrize("value", [10**400, Fraction(10**400, 3), -(10**5000 // 7)],
                         ids=["10**400", "Fraction", "-10**5000//7"])
def test_significant_and_glue_name_a_number_beyond_a_float(monkeypatch, value):
    # float(10**400) raises OverflowError: it escaped significant and glue(digits=)
    with pytest.raises(ValueError, match="value must be within a float's range"):
        significant(value, 2)
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # no book build: glue still rounds
    with pytest.raises(ValueError, match="value must be within a float's range"):
        glue("big", value, digits=2)


@pytest.mark.parametrize("value, digits", [(0.09999999999999999, 16), (9.999999999999999e-05, 16),
                                           (999.9999999999999, 16), (0.0009995, 3)])
def test_significant_just_below_a_power_of_ten_agrees_with_python_formatting(value, digits):
    assert significant(value, digits) == float(f"{value:.{digits}g}")


@pytest.mark.parametrize("kwargs, error, text", [
    ({"synchronize": 1}, TypeError, "synchronize must be callable, got synchronize=1"),
    ({"synchronize": 0}, TypeError, "synchronize must be callable, got synchronize=0"),
    ({"clock": lambda: "t"}, TypeError, "clock\\(\\) must be a real number"),
])
def test_median_seconds_checks_synchronize_and_clock_before_calling(kwargs, error, text):
    calls = []
    with pytest.raises(error, match=text):
        median_seconds(lambda: calls.append(1), repeats=1, batch_seconds=0.001, **kwargs)
    assert calls == []


@pytest.mark.parametrize("fields, name, error", [(dict(profile="GPU"), "profile", ValueError),
                                                 (dict(device="cuda:0"), "device", ValueError),
                                                 (dict(device=1), "device", TypeError)])
def test_runtime_checks_its_fields_also_after_replace(fields, name, error):
    import dataclasses

    from attnbook.notebook import Runtime

    with pytest.raises(error, match=f"{name} must be one of"):
        dataclasses.replace(Runtime("cpu", "cpu"), **fields)
    with pytest.raises(error, match=f"{name} must be one of"):
        Runtime(**{"device": "cpu", "profile": "cpu", **fields})


@pytest.mark.parametrize("setting, offline", [("off", False), ("False ", False), ("", False),
                                              ("0", False), (" 1", True), ("YES", True),
                                              ("true", True), ("On", True)])
def test_online_reads_hf_hub_offline_with_env_flag(monkeypatch, setting, offline):
    # every value huggingface_hub reads as true is true here too (its words, any case)
    from huggingface_hub.constants import _is_true

    class Connection:
        def close(self):
            pass

    monkeypatch.setattr(notebook.socket, "create_connection", lambda address, timeout: Connection())
    monkeypatch.setenv("HF_HUB_OFFLINE", setting)
    assert notebook.online("example.org") is not offline
    assert offline or not _is_true(setting)


@pytest.mark.parametrize("name, call", [("HF_HUB_OFFLINE", lambda: notebook.online("example.org")),
                                        ("ATTNBOOK_NO_MINILM", notebook.minilm_path)])
@pytest.mark.parametrize("value", ["n", "2", "ture", "y"])
def test_a_flag_neither_true_nor_false_is_refused_by_name(monkeypatch, name, call, value):
    # huggingface_hub reads "n", "2" or "ture" as false without a word; so did the book
    monkeypatch.setattr(notebook.socket, "create_connection", lambda address, timeout: None)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name} must be 1, true, on, yes or 0, false, off, no "
                                         f".*, got {name}={value!r}"):
        call()


@pytest.mark.parametrize("value", ["off", "False ", "", "ON", "yes", "True", "1", " no"])
def test_attnbook_no_minilm_is_read_by_env_flag(monkeypatch, value):
    monkeypatch.delenv("ATTNBOOK_NO_MINILM", raising=False)
    found = notebook.minilm_path()
    if found is None:
        pytest.skip("the MiniLM package is not installed")
    monkeypatch.setenv("ATTNBOOK_NO_MINILM", value)
    assert notebook.minilm_path() == (None if value.strip().upper() in ("ON", "YES", "TRUE", "1")
                                      else found)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"timeout": "3"}, TypeError, "timeout"), ({"timeout": math.inf}, ValueError, "timeout"),
    ({"timeout": -1}, ValueError, "timeout"), ({"timeout": 0}, ValueError, "timeout"),
    ({"host": None}, TypeError, "host"), ({"host": b"example.org"}, TypeError, "host"),
    # these were taken: the probe thread printed a traceback and online() answered False
    ({"host": ""}, ValueError, "host"), ({"host": "a" * 300}, ValueError, "host"),
    ({"host": "a..b"}, ValueError, "host"), ({"host": "\ud800"}, ValueError, "host")])
def test_online_names_a_bad_host_or_timeout(monkeypatch, kwargs, error, name):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(error, match=f"{name} must"):
        notebook.online(**kwargs)


def test_an_empty_attnbook_device_or_profile_means_the_default(monkeypatch):
    from attnbook.notebook import runtime

    monkeypatch.delenv("ATTNBOOK_DEVICE", raising=False)
    monkeypatch.delenv("ATTNBOOK_PROFILE", raising=False)
    default = runtime()
    monkeypatch.setenv("ATTNBOOK_DEVICE", "")
    monkeypatch.setenv("ATTNBOOK_PROFILE", "")
    assert runtime() == default


@pytest.mark.parametrize("timeout", [1e300, 3601.0, float("inf"), float("nan"), 0.0, -1.0])
@pytest.mark.parametrize("offline", ["1", None])
def test_online_refuses_a_timeout_that_is_no_probe_by_name(monkeypatch, timeout, offline):
    # 1e300 overflowed threading's timer after the connection was tried: "OverflowError: timeout
    # value is too large", naming no argument; offline, it was accepted without a word
    monkeypatch.setattr(notebook.socket, "create_connection", lambda *a, **k: pytest.fail("tried"))
    if offline is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    with pytest.raises(ValueError, match=r"^timeout must be a finite number in \(0.0, 3600.0\], "
                                         rf"got timeout={re.escape(repr(timeout))}$"):
        notebook.online("example.org", timeout=timeout)


def test_online_takes_a_timeout_of_up_to_an_hour(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert notebook.online("example.org", timeout=3600) is False
    assert notebook.online("example.org", timeout=0.5) is False
