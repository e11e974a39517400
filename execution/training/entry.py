"""What an entry script (run_pretraining.py, run_finetuning.py) does when something stops it:
the user's bad input is one line and exit 2, an interruption one line and the shell's 128 +
signal, from rank 0 only where every rank says the same; a collective that timed out or lost a
rank is one line from each rank (its own view of it) and exit 1; a run whose last save failed
(a full disk) is one line from rank 0 and exit 74 (``EX_IOERR`` of sysexits.h: an I/O error)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

from config.command_line import exit_for_bad_input
from config.errors import BadInput, ConfigError
from execution.parallel.collective_errors import CollectiveError
from execution.parallel.launch import read_launch_environment
from execution.training.loop import Interrupted, LastSaveFailed, raised_by_a_stop

# The exit status of a run whose last save failed: sysexits.h's EX_IOERR.
LAST_SAVE_FAILED_EXIT = 74


class Job:
    """What the entry point knows of the job when something stops it."""

    joined = False  # the ranks have joined: an error may now be one rank's own


def launcher_rank() -> int:
    """This process's rank in its job, from any launcher's variables (0 alone)."""
    try:
        return read_launch_environment(os.environ).rank
    except ConfigError:  # inconsistent launcher variables: said by setup_layout already
        return 0


def run_entry_point(main: Callable[..., None], program: str) -> None:
    """Runs ``main(job=...)`` and exits as the module docstring says."""
    # SIGTERM (a scheduler's or torchrun's stop) ends the run as Ctrl-C does. Only the first
    # stop interrupts: a job's ranks get it again (SLURM signals every process of the step,
    # then torchrun's agent signals its workers), and a second KeyboardInterrupt would land
    # wherever the run is winding down: in the wait for the checkpoint being committed (which
    # it would abandon), in a finalizer or in the handler printing the line (a traceback).
    stopped_by: dict[str, int] = {}
    # Once main has returned or raised, a stop interrupts nothing: raised while the run says
    # how it ended (or in a finalizer at exit) it would only print a traceback over that line.
    run_over = False

    def _on_stop(signum, frame) -> None:
        if stopped_by or run_over:
            return
        stopped_by["signal"] = signum
        # Ignored from now on, not only skipped here: the interpreter's shutdown puts a Python
        # handler back to the default (a later stop would then kill the process, exit -15)
        # but leaves an ignored signal ignored.
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, signal.SIG_IGN)
        raise KeyboardInterrupt

    before = {stop: signal.signal(stop, _on_stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    job = Job()
    try:
        try:
            main(job=job)
        finally:
            run_over = True
    except BadInput as err:  # the user's input, not a bug: one line, exit 2
        # Before the ranks join (flags, world size) every rank finds the same error: rank 0
        # says it. After, an error may be one rank's own: it says which rank it is.
        rank = launcher_rank()
        where = f"rank {rank}: " if rank else ""
        exit_for_bad_input(program, f"{where}{err}", say=rank == 0 or job.joined)
    except LastSaveFailed as err:  # every rank counted the same failed saves
        if launcher_rank() == 0:
            print(f"{program}: error: {err}", file=sys.stderr)
        sys.exit(LAST_SAVE_FAILED_EXIT)
    except CollectiveError as err:  # a rank stalled or died: every rank says where it was
        print(f"{program}: error: rank {launcher_rank()}: {err}", file=sys.stderr)
        sys.exit(1)
    except BaseException as err:  # a stop: one line, and the shell's 128 + signal
        if not (isinstance(err, Interrupted) or raised_by_a_stop(err)):
            raise
        if launcher_rank() == 0:  # every rank of a job gets the signal
            line = str(err) if isinstance(err, Interrupted) else ""
            # On a line of its own: the stop can land inside a print, between its text and
            # the newline (a run's output once read "...saving step 4 to <folder>run_..."),
            # and a terminal has echoed "^C" with none.
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to show
                sys.stdout.flush()
            print(f"\n{program}: {line or 'interrupted'}", file=sys.stderr, flush=True)
        sys.exit(128 + stopped_by.get("signal", signal.SIGINT))
    finally:
        # Hands back the handlers from before the run (a stop at exit then ends the process
        # as it would have), but where a stop came: then they stay ignored (above).
        if not stopped_by:
            for stop, handler in before.items():
                signal.signal(stop, handler)
