"""Every private torch API the project uses, in one place: what each is for, why no public one
serves, and where it was checked. If a release moves one, only this file changes.

Checked on torch 2.13.0 (this project's CPU wheel: the suite runs every one of them but
``cuda_sleep``) and read in torch 2.11's sources (the build the lent GPU machines carry).

- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the step meter sees every aten op of
  a meta step, with its arguments and outputs, to count FLOPs, bytes and allocations. It is the
  base class torch's own ``FlopCounterMode`` uses; nothing public exposes the dispatcher.
- ``FakeStore`` (``torch.testing._internal.distributed.fake_pg``): with the registered ``fake``
  backend, a job of any size in one process whose collectives only check shapes (dry runs,
  ``--plan_for``), as torch's own tests use it; no public module exports the store.
- The SDPA kernels' aten ops (``_scaled_dot_product_flash_attention`` and its CPU form,
  ``_scaled_dot_product_efficient_attention``): on meta tensors the public function takes the
  math path, so a dry run calls the kernel a device would run, to see its outputs and saved
  tensors.
- ``dynamo_counters`` (``torch._dynamo.utils.counters``): how many graphs Dynamo compiled, so a
  compiled run (``--compile``) can say that a step after the first compiled again; the public
  ``torch.compiler`` offers logs of recompiles, not a count.
- ``cuda_sleep`` (``torch.cuda._sleep``): a GPU spin of a given number of cycles, queued on a
  side stream before its copy, so tests of the engine's stream order see late copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode", "cuda_sleep", "dynamo_counters", "fake_store", "sdpa_kernel_ops"]


def dynamo_counters():
    """Dynamo's counters by category (``["stats"]["unique_graphs"]``: graphs compiled)."""
    from torch._dynamo.utils import counters

    return counters


def fake_store():
    """A store for ``dist.init_process_group("fake", ...)``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def sdpa_kernel_ops() -> dict[str, Callable]:
    """The aten op of each SDPA kernel, by the names the engine plans them with."""
    aten = torch.ops.aten
    return {
        "flash": aten._scaled_dot_product_flash_attention,
        "efficient": aten._scaled_dot_product_efficient_attention,
        "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu,
    }


def cuda_sleep(cycles: int) -> None:
    """Queues a spin of ``cycles`` GPU clock cycles on the current stream."""
    torch.cuda._sleep(cycles)
