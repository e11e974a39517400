"""A stop (Ctrl-C, a scheduler's or torchrun's SIGTERM) ends a run in one line and the shell's
128 + signal, with no traceback, whatever it lands in (execution/training/entry.py): a lock's
wait, a print, the lines that say how a run ended, or after the run is over; and the line it
says names the last complete checkpoint and a command that resumes from it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import time

import pytest

from config.loading import ConfigError
from execution.training.entry import run_entry_point
from execution.training.loop import raised_by_a_stop
from tests.checkpoint.test_checkpoint import RUN_FLAGS, entry_point, logged_steps


@pytest.mark.parametrize("ending", ["returns", "fails"])
def test_a_stop_after_the_run_has_ended_meets_the_handlers_from_before(ending):
    """A stop that comes once the run is over (torchrun's, to a rank exiting on its own error)
    must not meet the run's handler: that would raise it in whatever runs at exit, a
    finalizer among them, which prints a traceback (a flaky test_restart showed one)."""

    def main(job) -> None:
        if ending == "fails":
            raise ConfigError("a bad flag")

    before = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        run_entry_point(main, "run_pretraining.py")
    assert {stop: signal.getsignal(stop) for stop in before} == before


def test_a_stop_while_the_run_says_how_it_ended_is_not_raised(monkeypatch):
    """torchrun stops a rank that is already saying why it ends (a collective lost a rank):
    the stop must not raise there, over that line (a flaky test_restart showed a traceback
    from launcher_rank). Here the stop comes while a bad flag is said."""

    def main(job) -> None:
        raise ConfigError("a bad flag")

    def stopped_while_saying() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    monkeypatch.setattr("execution.training.entry.launcher_rank", stopped_while_saying)
    with contextlib.redirect_stderr(io.StringIO()) as said, pytest.raises(SystemExit) as ended:
        run_entry_point(main, "run_pretraining.py")
    assert ended.value.code == 2 and said.getvalue() == "run_pretraining.py: error: a bad flag\n"


def test_an_error_raised_over_a_stop_still_ends_as_the_stop():
    """A stop's KeyboardInterrupt that lands inside a lock's wait (the wait for a checkpoint
    being committed, a flaky test_restart showed) leaves the lock released twice, and Python
    raises RuntimeError over it: the run still ends in one line and the shell's 128 + signal,
    not a traceback and exit 1. Here main raises that error while the stop unwinds it."""

    def main(job) -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        finally:
            raise RuntimeError("cannot release un-acquired lock")

    before = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.redirect_stderr(io.StringIO()) as said, pytest.raises(SystemExit) as end:
            run_entry_point(main, "run_pretraining.py")
    finally:  # a stopped run leaves later stops ignored (entry.py): not this test process
        for stop, handler in before.items():
            signal.signal(stop, handler)
    assert end.value.code == 128 + signal.SIGTERM
    assert said.getvalue() == "\nrun_pretraining.py: interrupted\n"


def test_a_stop_inside_a_print_still_says_its_line_on_a_line_of_its_own():
    """A stop can land between a print's text and its newline (a run under load once printed
    "checkpoint: saving step 4 to <folder>run_pretraining.py: interrupted at step 4; ..."): the
    stop's line starts a line of its own, after what the run had printed."""

    def main(job) -> None:
        sys.stdout.write("checkpoint: saving step 4 to ckpt/step_4")  # the newline never comes
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    before = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    output = io.StringIO()  # stdout and stderr into one stream, as a log or a terminal has them
    try:
        with (
            contextlib.redirect_stdout(output),
            contextlib.redirect_stderr(output),
            pytest.raises(SystemExit),
        ):
            run_entry_point(main, "run_pretraining.py")
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)
    assert output.getvalue().splitlines() == [
        "checkpoint: saving step 4 to ckpt/step_4",
        "run_pretraining.py: interrupted",
    ]


def test_only_a_stop_or_what_was_raised_over_it_counts_as_one():
    try:
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("over it")
    except RuntimeError as err:
        over_a_stop = err
    try:
        try:
            raise ValueError("a bug")
        finally:
            raise RuntimeError("over it")
    except RuntimeError as err:
        over_a_bug = err
    assert raised_by_a_stop(KeyboardInterrupt()) and raised_by_a_stop(over_a_stop)
    assert not raised_by_a_stop(over_a_bug) and not raised_by_a_stop(RuntimeError())


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_says_where_it_stopped_in_one_line_and_resumes(tmp_path, stop):
    """Ctrl-C or SIGTERM: one line naming the last step, the last complete checkpoint and how to
    resume (exit 128 + signal, no traceback); the suggested command resumes into the same
    folders."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    flags = [*RUN_FLAGS, "--steps", "100000", "--checkpoint_steps", "2"]
    flags += ["--save", str(ckpt), "--output_dir", str(out)]
    run = entry_point(*flags, popen=True)
    for line in run.stdout:
        if "checkpoint: saved step 2 " in line:
            break
    run.send_signal(stop)
    rest, _ = run.communicate(timeout=120)
    assert run.returncode == 128 + stop, rest
    # By the line's start: the test's own folder (test_an_interrupted_...) is in other lines.
    said = [line for line in rest.splitlines() if line.startswith("run_pretraining.py: ")]
    assert len(said) == 1, rest  # on a miss, what the run printed instead
    match = re.fullmatch(
        r"run_pretraining.py: interrupted at step (\d+); the last complete checkpoint is step "
        r"(\d+) \((.*)\); resume with the same flags and --load (.*)",
        said[0],
    )
    assert match, rest
    assert "Traceback" not in rest
    done, saved = int(match[1]), int(match[2])
    assert saved >= 2 and done >= saved and match[3] == str(ckpt / f"step_{saved}")
    resumed = entry_point(*flags, "--load", match[4], "--steps", str(saved + 1))
    assert resumed.returncode == 0, resumed.stderr
    assert logged_steps(out) == list(range(1, saved + 2))  # the steps logged after it went
