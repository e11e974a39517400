"""utils/sample_clock.py: a timing subtracts what the scheduler took from its own thread,
keeps samples a worker's wait spoiled apart, and a calibration says when other processes'
load leaves its timings untrusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils import sample_clock
from utils.sample_clock import Sample, doubtful_timings, load_warning, summarise

ROOT = Path(__file__).resolve().parents[2]

HAS_SCHEDSTAT = Path("/proc/thread-self/schedstat").exists()

# In a child pinned to one core beside a busy process pinned there too, a pure-Python loop
# is timed; the loop's own CPU time (the thread's CPU clock) is what an idle core would take.
SHARED_CORE = """
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from utils.sample_clock import take_sample
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                        preexec_fn=lambda: os.sched_setaffinity(0, {core}))
try:
    time.sleep(0.2)
    def loop():
        started = time.thread_time()
        total = 0
        for i in range(3_000_000):
            total += i
        loop.cpu_s = time.thread_time() - started
    sample = take_sample(loop, torch.device("cpu"))
finally:
    busy.kill()
    busy.wait()
print(json.dumps({"wall": sample.wall_s, "own": sample.own_wait_s, "cpu": loop.cpu_s}))
"""


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="needs Linux's per-thread schedstat")
def test_a_sample_subtracts_the_time_its_thread_waited_for_a_shared_core():
    done = subprocess.run(
        [sys.executable, "-c", SHARED_CORE, str(ROOT)],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(done.stdout)
    # Sharing one core with a busy process, the loop waited about half its wall time (the
    # scheduler's fair share); at least a quarter, whatever else the machine runs.
    assert out["own"] > 0.25 * out["wall"]
    # What is left is the loop's own CPU time: the thread ran, or waited on the run queue.
    # The two clocks are read microseconds apart around the loop: 5% covers them.
    assert out["wall"] - out["own"] == pytest.approx(out["cpu"], rel=0.05)


def test_the_median_clean_sample_counts_and_spoiled_ones_only_when_too_few_are_clean():
    clean = [Sample(0.012, 0.002, 0.0), Sample(0.011, 0.0, 0.0), Sample(0.013, 0.0, 0.0005)]
    # A worker waited 20% of the sample: spoiled, however fast it corrects to.
    spoiled = Sample(0.020, 0.015, 0.004)
    # The reading of the waits was preempted: its wait may lie outside the sample.
    preempted_reading = Sample(0.010, 0.005, 0.0, reading_s=0.004)
    timing = summarise([*clean, spoiled, preempted_reading], repeats=3)
    # Clean: 0.010 (0.012 less its own 0.002 wait), 0.011 and 0.013.
    assert timing.seconds == pytest.approx(0.011)
    assert (timing.samples, timing.spoiled, timing.trusted) == (5, 2, True)
    # Spread: the clean samples' interquartile range over their median, by hand.
    assert timing.spread == pytest.approx((0.0120 - 0.0105) / 0.011)
    # One clean sample of three asked for: the best of all, corrected (the least spoiled),
    # and not trusted.
    timing = summarise([clean[2], spoiled, preempted_reading], repeats=3)
    assert timing.seconds == pytest.approx(0.005) and not timing.trusted


def test_a_timing_samples_until_enough_are_clean(monkeypatch):
    samples = iter([Sample(1.0, 0.0, 0.5)] * 4 + [Sample(0.2, 0.0, 0.0)] * 10)
    monkeypatch.setattr(sample_clock, "take_sample", lambda fn, device: next(samples))
    timing = sample_clock.timed(lambda: None, None, repeats=2)
    assert (timing.samples, timing.spoiled, timing.seconds) == (6, 4, 0.2)
    # Never more than three times the repeats.
    samples = iter([Sample(1.0, 0.0, 0.5)] * 10)
    timing = sample_clock.timed(lambda: None, None, repeats=2)
    assert (timing.samples, timing.trusted) == (6, False)


def _measured(share: float, trusted: bool = True, spread: float = 0.1) -> dict:
    one = {"samples": 3, "spoiled": 0, "spread": spread, "trusted": trusted, "together": False}
    pair = one | {"together": True, "spread": 3.0}  # two ranks' calls spread widely anyway
    return {
        "matmul": {"shapes": [{"timing": one}, {"timing": one}], "others_share": share},
        "collectives": {"timings": [{"timing": pair}], "others_share": share},
    }


def test_a_calibration_on_an_idle_machine_warns_of_nothing():
    result = {"measurements": _measured(0.01)}
    result["doubtful_timings"] = doubtful_timings(result["measurements"])
    assert result["doubtful_timings"] == {} and load_warning(result) is None


def test_other_processes_load_makes_two_rank_timings_and_unclean_ones_doubtful():
    measured = _measured(0.45, trusted=False)
    result = {"measurements": measured, "doubtful_timings": doubtful_timings(measured)}
    assert result["doubtful_timings"] == {"matmul": (2, 2), "collectives": (1, 1)}
    warning = load_warning(result)
    assert warning.startswith("calibrate: warning: other processes used up to 45% of the cores")
    assert "3 of 3 timings of collectives, matmul" in warning and "\n" not in warning
    # One process's timings cleaned of the load are trusted; a wide spread is not.
    assert doubtful_timings(_measured(0.45)) == {"collectives": (1, 1)}
    assert doubtful_timings(_measured(0.0, spread=0.8)) == {"matmul": (2, 2)}


def test_two_rank_timings_of_a_prioritised_calibration_are_trusted_under_load():
    """Raised above the load, its ranks ran when they needed the cores: only one process's
    unclean or widely spread timings stay doubtful, and the warning does not ask for a user
    who may raise the priority."""
    assert doubtful_timings(_measured(0.45), prioritised=True) == {}
    measured = _measured(0.45, trusted=False)
    doubtful = doubtful_timings(measured, prioritised=True)
    assert doubtful == {"matmul": (2, 2)}
    result = {"measurements": measured, "doubtful_timings": doubtful, "raised_priority": True}
    assert "raise its priority" not in load_warning(result)
    result["raised_priority"] = False
    assert load_warning(result).endswith("or as a user who may raise its priority")


def test_a_calibration_raises_its_priority_where_it_may_and_lowers_it_after():
    """In a session of its own: inside, the thread's nice value and its session's group's are
    HIGH_PRIORITY where permitted (root here); afterwards both are as before."""
    code = (
        "import os\nfrom utils import sample_clock\n"
        "def now():\n"
        "    return os.getpriority(os.PRIO_PROCESS, 0), sample_clock._autogroup_nice()\n"
        "before = now()\n"
        "with sample_clock.raised_priority() as raised:\n"
        "    inside = now()\n"
        "print(raised, *before, *inside, *now())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
    )
    raised, *values = done.stdout.split()
    before, inside, after = values[0:2], values[2:4], values[4:6]
    assert after == before
    if raised == "True":
        high = str(sample_clock.HIGH_PRIORITY)
        assert inside[0] == high and inside[1] in (high, "None")
    else:
        assert inside == before
    if os.geteuid() == 0:
        assert raised == "True"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc/stat")
def test_the_machine_share_counts_another_process_busy_meanwhile():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # started
        share = sample_clock.MachineShare()
        time.sleep(0.5)  # this process idle
        others = share.others()
    finally:
        busy.kill()
        busy.wait()
    # One busy process is one core's worth; the clock ticks (10 ms) and other processes of
    # the machine move it, so at least two thirds of it.
    assert others >= (2 / 3) / (os.cpu_count() or 1)
    # A stretch of a few ticks tells nothing.
    assert sample_clock.MachineShare().others() is None
