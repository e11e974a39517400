"""A job of any size in one process, whose collectives only check shapes (dry runs, --plan_for).

PyTorch registers a process-group backend named ``fake`` that accepts every collective of any
world size and returns at once; its store is private (utils/torch_private.py says why and
where it was checked).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from utils.torch_private import fake_store


@contextmanager
def fake_job(rank: int, world_size: int) -> Iterator[None]:
    """This process plays ``rank`` of a job whose collectives only check shapes."""
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
