"""A job of any size in one process, whose collectives only check shapes (dry runs, --plan_for).

This is the one place the project uses a private torch API. PyTorch registers a process-group
backend named ``fake`` that accepts every collective of any world size and returns at once,
but its store (``FakeStore``) ships only in ``torch.testing._internal.distributed.fake_pg``;
no public module exports it, and nothing public builds a 256-rank group in one process. Used
as torch's own tests use it. Checked on torch 2.13.0 (this project's CPU wheel); the module and
the backend name have been in torch since 2.1, so the 2.11 and 2.12 builds that the GPU
machines carry are expected to behave alike. If a release moves it, only this file changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_job(rank: int, world_size: int) -> Iterator[None]:
    """This process plays ``rank`` of a job whose collectives only check shapes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
