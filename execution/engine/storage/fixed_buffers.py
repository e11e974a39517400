"""Two fixed device buffers that the decoder layers' weights are loaded into in turn
(``--fixed_weight_buffers``).

A loaded layer's weights are otherwise wherever the load left them: the buffer row itself
for weights kept on the device, a fresh tensor for a copy from the host or a gather. A
captured CUDA graph replays its kernels on the addresses it was captured with, so a layer
phase that replays one graph for every layer needs each layer's weights at the same
addresses. Here every load of a decoder layer's weights is copied into one of two buffers of
the gathered, compute-dtype vectors, taken in turn: the phase running reads one while the
next phase's load fills the other, as the engine prefetches one phase ahead.

What it costs is one device copy of a layer's weights per layer phase (bytes the step meter
counts and the dry run prices); the values, and so every number of a run, are the same.
"""

from __future__ import annotations

import torch

SLOTS = 2  # the running phase's and the next one's


class FixedLayerBuffers:
    """The decoder layers' weights, per kind, in :data:`SLOTS` buffers allocated on first
    use and kept for the run.

    Args:
        device: Where the buffers live (the compute device).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: list[dict[str, torch.Tensor]] = [{} for _ in range(SLOTS)]
        self.loads = 0  # loads so far: the next one fills slot ``loads % SLOTS``

    def hold(self, vectors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies a layer's gathered weight vectors (per kind) into the next buffer and returns
        the buffer's tensors: the vectors at the fixed addresses."""
        slot = self.slots[self.loads % SLOTS]
        self.loads += 1
        held = {}
        for kind, vector in vectors.items():
            buffer = slot.get(kind)
            if buffer is None or buffer.shape != vector.shape or buffer.dtype != vector.dtype:
                buffer = slot[kind] = torch.empty_like(vector, device=self.device)
            buffer.copy_(vector)
            held[kind] = buffer
        return held

    def addresses(self) -> list[dict[str, int]]:
        """Each buffer's address per kind."""
        return [{kind: t.data_ptr() for kind, t in slot.items()} for slot in self.slots]
