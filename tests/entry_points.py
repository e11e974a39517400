"""An entry script run as ``python SCRIPT FLAGS...`` (or a module as ``python -m MODULE
FLAGS...``: ``run_script("-m", "benchmarks.bench_step", ...)``) would run it, in a forked child
of the test process.

A fresh interpreter spends 2 to 4 s importing torch (and torch._dynamo, which a dispatch mode
pulls in) before the script does anything; the suite runs the entry points some hundred times.
The child runs the script's own ``__main__`` block (``runpy``), so what is tested is the user's
path: flag parsing, ``run_entry_point``'s one-line errors and exit codes, SIGTERM handling, what
is written on stdout and stderr. What differs from a new interpreter is reset here: the working
folder, ``sys.path[0]``, ``sys.argv``, the standard streams (file descriptors 1 and 2, which pytest captures),
signal handlers, the warning filters (pytest records warnings; a new interpreter prints them)
and the end: non-daemon threads joined, then the script's exit handlers.

A test that needs the process while it runs (a signal sent mid-run, reading its output line by
line) or a launcher (torchrun) still starts a real one.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(
    script: str | Path,
    *flags: str,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``subprocess.run([python, script, *flags], cwd=cwd, capture_output=True, text=True)``
    with ``env`` added to the environment, in a forked child; raises ``TimeoutExpired`` as
    ``subprocess.run`` does. ``script`` ``"-m"`` runs the module named by the first flag."""
    argv = [str(script), *flags]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        sys.stdout.flush(), sys.stderr.flush()  # nothing buffered here is written twice
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest, whatever happens
            code = 70
            try:
                code = _child(argv, env or {}, cwd, out, err)
            finally:
                os._exit(code)
        code = _wait(pid, timeout, argv)
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


def assert_refused(result: subprocess.CompletedProcess, program: str, message: str = "") -> None:
    """The house rule for bad input: exit 2 and one line on stderr, ``{program}: error: ...``,
    holding ``message``."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert result.stderr.startswith(f"{program}: error: "), result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def _child(argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path) -> int:
    at_exit: list = []  # the script's own exit handlers; the parent's are not the child's to run
    try:
        _as_a_new_interpreter(argv, env, cwd, out, err)
        atexit.register = lambda func, *args, **kwargs: at_exit.append((func, args, kwargs))
        if argv[0] == "-m":  # sys.argv[0] becomes the module's file, as for `python -m`
            # A new interpreter has not imported it yet (runpy warns where it has).
            sys.modules.pop(argv[1], None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # as the interpreter does: the traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    # As the interpreter ends: non-daemon threads are joined, then the exit handlers run.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    for func, args, kwargs in reversed(at_exit):
        try:
            func(*args, **kwargs)
        except BaseException:
            traceback.print_exc()
    sys.stdout.flush(), sys.stderr.flush()
    return code


def _as_a_new_interpreter(
    argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path
) -> None:
    os.chdir(cwd)
    if argv[0] == "-m":  # as for `python -m MODULE`: the working folder first
        sys.path.insert(0, str(cwd))
        sys.argv = [argv[1], *argv[2:]]
    else:  # as for `python SCRIPT`: the script's folder first
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        sys.argv = list(argv)
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until _exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    warnings.resetwarnings()  # a new interpreter's defaults (python -W default not given)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning):
        warnings.simplefilter("ignore", category)
    warnings.simplefilter("ignore", ResourceWarning)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = _print_warning
    warnings._showwarnmsg_impl = _print_warning_message  # pytest's recorder, if one is set


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _print_warning_message(msg: warnings.WarningMessage) -> None:
    _print_warning(msg.message, msg.category, msg.filename, msg.lineno, line=msg.line)


def _wait(pid: int, timeout: float, argv: list[str]) -> int:
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(argv, timeout)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
