"""The host AdamW runs on one thread whose OpenMP team is the rank's share of the cores.

Torch's fused AdamW parallelises itself over the calling thread's OpenMP team, as large as
``torch.get_num_threads()`` unless the thread sets its own. The engine's update thread
(:func:`~modelling.host_threads.team_thread`) sets it to the cores the rank may use, whatever
the process's own count (torchrun gives each rank one): a plain thread would open a team of
the process's size.
Counted in a fresh process: the threads a process has are listed in /proc/self/task, and
OpenMP keeps a team's threads alive while the thread that opened it lives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from config.schema import OptimizerConfig
from execution.engine.update.optimizer import adamw_
from modelling.host_threads import team_thread

def threads():
    return len(os.listdir("/proc/self/task"))

team = int(sys.argv[1])
w, g, m, v = (torch.rand(1 << 20) for _ in range(4))
torch.ones(1 << 20).add_(1)  # the main thread's own team, before counting
before = threads()
with team_thread("host-adamw", team) if team else ThreadPoolExecutor(1) as host:
    hyper = dict(step=1, lr=1e-3, optim=OptimizerConfig(), weight_decay=True, grad_scale=1.0)
    host.submit(adamw_, w, g, m, v, **hyper).result()
    during = threads()
print(json.dumps({"added": during - before}))
"""


def _threads_added(*teams: int) -> list[int]:
    """Threads the update adds to a process of two intra-op threads, per team: on a team
    thread of ``team``, or (0) on a plain thread. Each count in a fresh process of its own,
    the processes side by side: a count is of the process's own threads, whatever runs
    beside it, and the suite runs one test at a time, so the second core is otherwise idle."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(team)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for team in teams
    ]
    added = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        added.append(json.loads(out.strip().splitlines()[-1])["added"])
    return added


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_the_host_update_s_thread_opens_a_team_of_the_rank_s_cores():
    # The thread itself, and its team's other threads; the count catches the bug: a plain
    # thread (0) opens a team of the process's two.
    assert _threads_added(1, 3, 0) == [1, 3, 2]
