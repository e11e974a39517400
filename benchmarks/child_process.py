"""A measurement in a process of its own, with a time limit that keeps what it printed.

A GPU measurement that faults leaves a sticky CUDA error in its process, and one that runs out
of time must not take the others with it, so each runs in a fresh interpreter. Its output goes
to a file as it is written (a pipe would lose it with the process), and on the time limit the
whole process group is killed: the ranks or workers it started too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TAIL_CHARS = 4000


@dataclass(frozen=True)
class ChildResult:
    """How a child process ended: ``returncode`` (None: killed at its time limit), the wall
    time it took and the end of what it printed (stdout and stderr together)."""

    returncode: int | None
    seconds: float
    output: str

    @property
    def tail(self) -> str:
        return self.output[-TAIL_CHARS:]

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def last_line(self, limit: int = 300) -> str:
        lines = self.output.strip().splitlines()
        return (lines[-1] if lines else "(no output)")[:limit]


def run_child(
    command: list[str], timeout: float | None, env: dict[str, str] | None = None
) -> ChildResult:
    """Runs ``command`` with ``env`` added to this environment, for at most ``timeout`` s."""
    with tempfile.TemporaryFile(mode="w+", prefix="child_output_") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own group: the time limit ends its children too
        )
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        seconds = time.perf_counter() - started
        log.seek(0)
        return ChildResult(code, seconds, log.read())


def append_json_line(path: Path, entry: dict) -> None:
    """One JSON line appended and closed at once: what a child leaves for its parent survives
    the child being killed at its limit."""
    with open(path, "a") as lines:
        lines.write(json.dumps(entry) + "\n")


def read_json_lines(path: Path) -> list[dict]:
    """What :func:`append_json_line` left in ``path`` (nothing if the child wrote none)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
