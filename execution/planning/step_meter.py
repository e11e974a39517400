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
        # id of each counted storage object (torch keeps one Python object per live storage,
        # and the finaliser drops the id when it dies, before the id can be reused).
        self._counted: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count_flops = flop_registry.get(func._overloadpacket)
        if count_flops is not None:
            self.flops += count_flops(*args, **kwargs, out_val=out)
        inputs = None
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._counted:
                continue  # a view, or an in-place op, of a tensor made in the block
            if inputs is None:
                inputs = {id(i.untyped_storage()) for i in _tensors((*args, *kwargs.values()))}
            if key in inputs:
                continue  # a view or in-place op of a buffer made before the block
            nbytes = storage.nbytes()
            self._counted[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._counted.pop(key)


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
