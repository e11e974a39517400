"""Host-device synchronisations, counted on the CPU by the GPU's rules.

On CUDA, reading a value on the host (``.item()``, ``.tolist()``, ``bool()`` of a tensor,
``nonzero`` and other ops whose output size depends on the data), a blocking copy to the host,
or a tensor made from host data on the device waits for the device to finish its queue: a
stall per call that the CPU never shows. :class:`SyncCounter` is a torch function mode that
counts these calls as a GPU would pay them, and which of them ran inside a training step's
phase loop (between the engine's first ``on_phase`` and its ``on_phase(None)``).
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

# Reading data on the host, or ops whose output shape depends on the data.
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.unique,
    torch.unique,
    torch.masked_select,
    torch.Tensor.masked_select,
}


def _is_sync(func, args, kwargs) -> bool:
    if func in _READS:
        return True
    if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
        return True  # host data copied to the device, from pageable memory: blocking
    if func is torch.Tensor.to:  # a blocking copy to the host
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return str(target).startswith("cpu") and not kwargs.get("non_blocking", False)
    return False


class SyncCounter(TorchFunctionMode):
    """Counts syncs by call name; ``in_loop`` holds those inside a phase loop."""

    def __init__(self):
        super().__init__()
        self.total: collections.Counter = collections.Counter()
        self.in_loop: collections.Counter = collections.Counter()
        self._inside = False

    def on_phase(self, phase) -> None:
        self._inside = phase is not None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            name = getattr(func, "__name__", str(func))
            self.total[name] += 1
            if self._inside:
                self.in_loop[name] += 1
        return func(*args, **kwargs)
