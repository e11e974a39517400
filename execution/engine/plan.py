"""The plan an engine runs by: passes per step and where each state lives.

The engine requires one; :mod:`execution.planning` makes it (the planner chooses the fastest
that fits, the dry run measures it). The byte figures a plan carries are the planner's, for
reporting: the engine allocates its buffers from its own formulas, which the planner reads.
"""

from __future__ import annotations

from dataclasses import dataclass

# The states a plan places, each on the compute device or in host memory.
PLACED_STATES = ("weights", "grads", "activations")
PLACES = ("device", "host")
GiB = 2**30
# Keys of state_bytes that live where the weights do.
WEIGHT_STATE_KEYS = ("optimizer", "weight_copies")


@dataclass(frozen=True)
class Placement:
    """Where each state lives: ``device`` or ``host``."""

    weights: str
    grads: str
    activations: str

    def describe(self) -> str:
        return ", ".join(f"{s} on {getattr(self, s)}" for s in PLACED_STATES)


@dataclass(frozen=True)
class MemoryPlan:
    """A schedule and placement with the bytes it needs on this rank.

    Attributes:
        passes: Passes per step, over groups of micro-batches whose sizes differ by at most
            one (at most ``micro_batches_per_pass``).
        micro_batches_per_pass: Activation entries held at once.
        placement: Where each state lives.
        state_bytes: Bytes per state: ``weights``, ``optimizer``, ``grads``,
            ``weight_copies``, ``activations``.
        working_set: Transient device bytes of the largest phase.
        traffic: Estimated bytes moved between host and device per step.
        shared_memory: The compute device is the CPU, so device and host are one pool.
        recompute: What a layer's backward recomputes: ``full``, ``selective`` or ``none``.
        kept: Bytes a decoder layer keeps per micro-batch for its backward (0 with ``full``),
            held with the activations.
    """

    passes: int
    micro_batches_per_pass: int
    placement: Placement
    state_bytes: dict[str, int]
    working_set: int
    traffic: int
    shared_memory: bool
    recompute: str = "full"
    kept: int = 0

    def _place_of(self, key: str) -> str:
        return getattr(self.placement, "weights" if key in WEIGHT_STATE_KEYS else key)

    def bytes_on(self, where: str) -> dict[str, int]:
        """Bytes per state held on ``device`` or ``host`` (with ``working_set`` and ``total``)."""
        out = {k: (v if self._place_of(k) == where else 0) for k, v in self.state_bytes.items()}
        out["working_set"] = self.working_set if where == "device" else 0
        out["total"] = sum(out.values())
        return out

    def describe(self) -> str:
        """The start-up lines: passes, places and bytes, and why it fits."""
        device, host = self.bytes_on("device"), self.bytes_on("host")
        rows = [
            f"plan: {self.passes} pass(es) of {self.micro_batches_per_pass} micro-batch(es); "
            f"{self.placement.describe()}; recompute {self.recompute}"
        ]
        keys = ["weights", "optimizer", "grads", "activations", "working_set"]
        if self.state_bytes["weight_copies"]:  # only shown where kept
            keys.insert(3, "weight_copies")
        for key in keys:
            rows.append(
                f"  {key:<12} device {device[key] / GiB:9.2f} GiB   host {host[key] / GiB:9.2f} GiB"
            )
        rows.append(
            f"  {'total':<12} device {device['total'] / GiB:9.2f} GiB   "
            f"host {host['total'] / GiB:9.2f} GiB   "
            f"(host<->device {self.traffic / GiB:.2f} GiB per step)"
        )
        return "\n".join(rows)
