"""Host AdamW runs on its pool's threads only: no OpenMP team inside each pool thread.

A chunk above torch's grain size makes the elementwise ops of the update open an OpenMP team
in the pool thread that calls them, so a pool of T threads on C cores would run up to T x C
threads. The engine's pool (:func:`~modelling.host_threads.one_core_pool`) sets each of its
threads' team size to one.
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

from execution.engine.optimizer import HOST_CHUNK_ELEMENTS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from config.schema import OptimizerConfig
from execution.engine.optimizer import adamw_threaded_
from modelling.host_threads import one_core_pool

def threads():
    return len(os.listdir("/proc/self/task"))

chunk, pool_size, engine_pool = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
w, g, m, v = (torch.rand(1 << 20) for _ in range(4))
torch.ones(1 << 20).add_(1)  # the main thread's own team, before counting
before = threads()
with one_core_pool(pool_size, 'host-adamw') if engine_pool else ThreadPoolExecutor(pool_size) as pool:
    hyper = dict(step=1, lr=1e-3, optim=OptimizerConfig(), weight_decay=True, grad_scale=1.0)
    adamw_threaded_(w, g, m, v, pool=pool, chunk_elements=chunk, **hyper)
    during = threads()
print(json.dumps({"added": during - before}))
"""


def _threads_added(chunk: int, pool: int, engine_pool: bool) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(chunk), str(pool), str(int(engine_pool))],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["added"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_host_adamw_adds_no_threads_beyond_its_pool():
    assert _threads_added(HOST_CHUNK_ELEMENTS, pool=2, engine_pool=True) <= 2
    # The count catches the bug: a plain pool opens a team in each of its threads.
    assert _threads_added(HOST_CHUNK_ELEMENTS, pool=2, engine_pool=False) > 2
