"""What a piece of code allocates and computes: the engine's own working-set and FLOP accounting.

A dispatch mode sees the output of every aten op; each new storage is counted until it is freed,
and matmuls and attention kernels add their FLOPs (torch's own flop formulas).
It works the same on real tensors (measure a CPU run) and on meta tensors (the dry run), so a
dry run's working set is what the same step allocates, not a formula. Buffers allocated before
the mode starts are not counted; what the caller keeps afterwards still counts as live.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class StepMeter(TorchDispatchMode):
    """Tracks live and peak bytes of storages created inside the ``with`` block, and FLOPs.

    Attributes:
        live: Bytes of counted storages still alive.
        peak: Largest ``live`` seen.
        flops: Floating-point operations of the matmuls and attention kernels that ran.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.flops = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((*args, *kwargs.values())):
            if t.untyped_storage() not in self._seen:
                # Made before the block (a buffer): an in-place op writing it allocates nothing.
                self._seen.add(t.untyped_storage())
        out = func(*args, **kwargs)
        count_flops = flop_registry.get(func._overloadpacket)
        if count_flops is not None:
            self.flops += count_flops(*args, **kwargs, out_val=out)
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        if storage in self._seen:
            return  # a view, or an in-place op's own output
        self._seen.add(storage)
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _tensors(values) -> list[torch.Tensor]:
    """Tensors among aten arguments or results: flat, or in one level of lists (cheaper than a
    pytree walk, which would double the cost of a dry run)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out
