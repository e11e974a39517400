"""The plan an engine runs by: the model's shapes, the schedule's settings, passes per step and
where each state lives.

The engine requires one (:class:`EnginePlan`) and reads nothing else: no config.
:mod:`execution.planning` makes it (the planner chooses the passes and places that fit and run
fastest, the dry run measures them);
:meth:`~execution.planning.run_shape.RunShape.engine_plan` joins the run's settings to them. The
byte figures a :class:`MemoryPlan` carries are the planner's, for reporting: the engine
allocates its buffers from its own formulas, which the planner reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelling.gpt import GPTShapes
from modelling.sparsity import SparsitySchedule

if TYPE_CHECKING:  # the engine never sees the config, only the optimizer's settings
    from config.schema import OptimizerConfig

# The states a plan places, each on the compute device or in host memory.
PLACED_STATES = ("weights", "grads", "activations")
PLACES = ("device", "host")
GiB = 2**30
# Keys of state_bytes that live where the weights do.
WEIGHT_STATE_KEYS = ("optimizer", "weight_copies", "staging", "masks")


@dataclass(frozen=True)
class Placement:
    """Where each state lives: ``device`` or ``host``."""

    weights: str
    grads: str
    activations: str

    def describe(self) -> str:
        return ", ".join(f"{s} on {getattr(self, s)}" for s in PLACED_STATES)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """A schedule and placement with the bytes it needs on this rank.

    Attributes:
        passes: Passes per step, over groups of micro-batches whose sizes differ by at most
            one (at most ``micro_batches_per_pass``).
        micro_batches_per_pass: Activation entries held at once.
        placement: Where each state lives.
        state_bytes: Bytes per state: ``weights``, ``optimizer``, ``grads``,
            ``weight_copies``, ``activations`` and, in a sparse run, RigL's ``masks``.
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
        if self.state_bytes.get("staging"):
            keys.insert(-1, "staging")
        if self.state_bytes.get("masks"):  # a sparse run's (RigL)
            keys.insert(keys.index("grads"), "masks")
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


def compiles(choice: str, device_type: str) -> bool:
    """Whether ``--compile`` ``choice`` compiles on a device of ``device_type`` (auto: on a
    GPU, where the fused kernels pay for their compile; a CPU compiles slowly)."""
    return choice == "true" or (choice == "auto" and device_type == "cuda")


@dataclass(frozen=True, kw_only=True)
class EnginePlan:
    """How one rank executes a step: everything :class:`~execution.engine.engine.PhasedEngine`
    reads.

    Attributes:
        model: The whole model's shapes (``tp1 = tp2 = 1``; the engine shards them for its
            layout).
        sequence_length: Tokens per sequence.
        micro_batch_size: Sequences per micro-batch.
        gradient_accumulation: Micro-batches each data-parallel replica runs per step.
        stage_layers: Decoder layers of each pipeline stage (one entry without a pipeline).
        precision: Compute dtype name (``float32``, ``bfloat16``, ``float16``).
        prefetch: Load the next phase's weights while this phase computes.
        overlap_communication: Also start the next phase's all-gather and finish this phase's
            gradient reduction behind the next phase's compute.
        fixed_weight_buffers: Load the decoder layers' weights into two fixed device buffers
            in turn (:mod:`~execution.engine.storage.fixed_buffers`).
        seed: Seeds the weights and dropout.
        init_std: Std of the weight initialisation.
        loss_scaling: Factor the loss is multiplied by before the backward.
        optimizer: AdamW's hyper-parameters and the clipping norm.
        memory: Passes, placement and recompute (the planner's choice).
        sparsity: RigL's schedule of the decoder layers' matrices; None trains densely.
        overlap_update: Whether a step's host update runs behind the next: true, false or
            auto (on a GPU).
        compile: Whether each part runs compiled (``torch.compile``): true, false or auto
            (on a GPU).
        attention_kernels: The fused attention kernels the device spec timed at this run's
            shape, dtype and dropout, fastest first; the engine runs the first that passes
            its check (:mod:`~execution.engine.phases.attention_kernels`). Empty: none timed,
            the device's and dtype's kernel.
    """

    model: GPTShapes
    sequence_length: int
    micro_batch_size: int
    gradient_accumulation: int
    stage_layers: tuple[int, ...]
    precision: str
    prefetch: bool
    overlap_communication: bool
    seed: int
    init_std: float
    loss_scaling: float
    optimizer: OptimizerConfig
    memory: MemoryPlan
    sparsity: SparsitySchedule | None = None
    overlap_update: str = "auto"
    compile: str = "auto"
    attention_kernels: tuple[str, ...] = ()
    fixed_weight_buffers: bool = False

    def compiles_on(self, device_type: str) -> bool:
        """Whether the parts run compiled on a device of ``device_type`` (:func:`compiles`)."""
        return compiles(self.compile, device_type)

    def with_micro_batches(self, micro_batches: int, passes: int) -> EnginePlan:
        """The same layers and stages with fewer micro-batches and passes: a step to measure
        quickly."""
        return dataclasses.replace(
            self,
            gradient_accumulation=micro_batches,
            memory=dataclasses.replace(
                self.memory,
                passes=passes,
                micro_batches_per_pass=-(-micro_batches // passes),
            ),
        )

    def shrunk(self, layers: int, micro_batches: int, passes: int) -> EnginePlan:
        """The same shards and phases with fewer layers (one stage) and micro-batches, and
        fixed passes: a step to measure quickly."""
        return dataclasses.replace(
            self.with_micro_batches(micro_batches, passes),
            model=dataclasses.replace(self.model, layers=layers),
            stage_layers=(layers,),
        )
