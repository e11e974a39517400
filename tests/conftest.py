"""Settings of the test process, before any test module imports torch.

One intra-op thread per process, and per subprocess the tests start (torchrun ranks, entry
points): the suite's tensors are small, so an OpenMP team only adds wake-ups, and on a shared
2-core machine its threads spin against the forked ranks and each other; one step of the small
test model took ten times longer with two threads under load than with one. Tests check
numbers, never timing; a test that needs more threads sets them itself
(``test_host_adamw_threads.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # after the variable, which OpenMP reads once

torch.set_num_threads(1)
