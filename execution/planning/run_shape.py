"""What planning reads of a run, built once from its config: :class:`RunShape`.

The planner, the dry run and ``--plan_for`` weigh layouts, not configs: a layout is a mesh and
a micro-batch size over the same model, batch and flags, so ``--plan_for`` makes each of its
candidates with :meth:`RunShape.with_layout` rather than by editing a copy of the config tree.
:meth:`RunShape.of` is the one place under :mod:`execution.planning` that reads the tree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from config.schema import (
    ExecutionConfig,
    OptimizerConfig,
    PretrainingConfig,
    even_stage_layers,
    micro_batches_per_replica,
)
from config.schema_model import uneven_splits
from config.schema_run import PlanningConfig
from execution.engine.plan import EnginePlan, MemoryPlan
from execution.parallel.mesh_shape import MeshShape
from execution.planning.device_specs import SPECS, DeviceSpec, read_spec_file
from modelling.gpt import GPTShapes
from modelling.sparsity import SparsitySchedule
from modelling.task_heads import reads_whole_sequences
from tasks.specs import run_shapes

# The most micro-batches a replica may run per step: every count of passes such a step splits
# into (about 2 sqrt(N)) is costed under each placement and recompute mode, on every stage
# that decides a pipeline's plan, which keeps a dry run of 96 layers in 8 stages under half a
# minute. Ten times GPT-3's largest batch (1536 sequences) at one sequence per micro-batch.
MOST_MICRO_BATCHES = 1 << 14
# What ``--placement`` fixes for each state that its own flag leaves to ``auto``.
PLACEMENT_SHORTHAND = {"remote": "host", "resident": "device", "auto": None}


@dataclass(frozen=True)
class PlanRequest:
    """What the flags fix of a plan (``auto`` and 0: the planner chooses)."""

    placement: str = "auto"
    weights_placement: str = "auto"
    grads_placement: str = "auto"
    activations_placement: str = "auto"
    passes: int = 0
    recompute: str = "auto"

    def fixed_places(self) -> dict[str, str | None]:
        """Each state's place as the flags fix it (None: the planner chooses)."""
        shorthand = PLACEMENT_SHORTHAND[self.placement]
        flags = {
            "weights": self.weights_placement,
            "grads": self.grads_placement,
            "activations": self.activations_placement,
        }
        return {s: (v if v != "auto" else shorthand) for s, v in flags.items()}

    def placement_flags(self) -> dict[str, str]:
        """The placement flags given, by name (``--weights_placement host``: theirs alone)."""
        names = ("placement", "weights_placement", "grads_placement", "activations_placement")
        return {n: getattr(self, n) for n in names if getattr(self, n) != "auto"}


@dataclass(frozen=True)
class EngineSettings:
    """What an engine takes of a run that planning neither reads nor changes."""

    seed: int
    init_std: float
    loss_scaling: float
    optimizer: OptimizerConfig


@dataclass(frozen=True)
class RunShape:
    """A run as planning sees it: the model, the layout and batch, what the flags ask of the
    plan, the device it is planned for, and the settings an engine takes unchanged.

    Attributes:
        model: The whole model's shapes with its head (``tp1 = tp2 = 1``).
        mesh: The (dp, pp, cp, tp1, tp2) layout.
        stage_layers: Decoder layers of each pipeline stage.
        request: The passes, placements and recompute the flags fix.
        device_memory_gb, host_memory_gb: The memory a process may plan with (0: measured).
        device_memory_cap_gb: The most device memory it may plan with and hold (0: no cap).
        spec: The device it is planned for (``--device_spec`` and its overrides).
        sparsity: RigL's schedule (None: dense), whose masks the plan holds.
        engine: What the engine takes besides the plan (:meth:`engine_plan`).
    """

    model: GPTShapes
    mesh: MeshShape
    micro_batch_size: int
    global_batch_size: int
    sequence_length: int
    stage_layers: tuple[int, ...]
    precision: str
    request: PlanRequest
    prefetch: bool
    overlap_communication: bool
    overlap_update: str
    fixed_weight_buffers: bool
    compile: str
    device_memory_gb: float
    host_memory_gb: float
    spec: DeviceSpec
    sparsity: SparsitySchedule | None
    engine: EngineSettings
    device_memory_cap_gb: float = 0.0

    @classmethod
    def of(cls, config: PretrainingConfig) -> RunShape:
        """The run shape of a config (a fine-tuning run's too, whose task's spec gives the
        head)."""
        ex, training = config.execution, config.training
        return cls(
            model=run_shapes(config),
            mesh=MeshShape.of(ex),
            micro_batch_size=ex.micro_batch_size,
            global_batch_size=training.global_batch_size,
            sequence_length=config.model.sequence_length,
            stage_layers=tuple(config.stage_layers),
            precision=training.precision,
            request=PlanRequest(
                placement=ex.placement,
                weights_placement=ex.weights_placement,
                grads_placement=ex.grads_placement,
                activations_placement=ex.activations_placement,
                passes=ex.passes,
                recompute=ex.recompute,
            ),
            prefetch=ex.prefetch,
            overlap_communication=ex.overlap_communication,
            overlap_update=ex.overlap_update,
            fixed_weight_buffers=ex.fixed_weight_buffers,
            compile=ex.compile,
            device_memory_gb=ex.device_memory_gb,
            host_memory_gb=ex.host_memory_gb,
            device_memory_cap_gb=ex.device_memory_cap_gb,
            spec=sharing(resolve_spec(config.planning, ex), MeshShape.of(ex)),
            sparsity=SparsitySchedule.of(config.rigl, training.steps),
            engine=EngineSettings(
                seed=training.seed,
                init_std=config.model.init_std,
                loss_scaling=training.loss_scaling,
                optimizer=training.optimizer,
            ),
        )

    @property
    def gradient_accumulation(self) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        return micro_batches_per_replica(
            self.global_batch_size, self.micro_batch_size, self.mesh.dp
        )

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.sequence_length

    def shards(self) -> GPTShapes:
        """The model's shapes on one rank of the tensor axes."""
        return dataclasses.replace(self.model, tp1=self.mesh.tp1, tp2=self.mesh.tp2)

    def describe(self) -> str:
        """The layout sentence with its micro-batch: ``dp 2 x pp 1 x ..., micro-batch 4``."""
        return f"{self.mesh.describe()}, micro-batch {self.micro_batch_size}"

    def splits_evenly(self, tp1: int = 1, tp2: int = 1, cp: int = 1) -> bool:
        """Whether tensor and context axes of these sizes split this model evenly
        (:func:`config.schema_model.uneven_splits`, by which the config's validation names the
        flag that does not)."""
        model = self.model
        return not uneven_splits(
            model.heads,
            model.hidden,
            self.sequence_length,
            tp1,
            tp2,
            cp,
            model.key_value_heads,
            model.ffn,
        )

    def allows(self, mesh: MeshShape, micro_batch_size: int) -> bool:
        """Whether this model and batch split evenly over ``mesh`` (:meth:`splits_evenly`, a
        layer or more per stage) in micro-batches of ``micro_batch_size``, no more of them per
        replica and step than the planner takes (:data:`MOST_MICRO_BATCHES`); and no context
        axis under a head that reads whole sequences."""
        per_step = micro_batch_size * mesh.dp
        micro_batches = micro_batches_per_replica(self.global_batch_size, micro_batch_size, mesh.dp)
        return (
            self.splits_evenly(mesh.tp1, mesh.tp2, mesh.cp)
            and not (mesh.cp > 1 and reads_whole_sequences(self.model.task_head))
            and mesh.pp <= self.model.layers
            and self.global_batch_size % per_step == 0
            and micro_batches <= MOST_MICRO_BATCHES
        )

    def with_layout(
        self, mesh: MeshShape, micro_batch_size: int, even_stages: bool = False
    ) -> RunShape:
        """The same run on ``mesh`` in micro-batches of ``micro_batch_size``, its passes left to
        the planner where the fixed count no longer fits the step. A new pipeline size (or
        ``even_stages``) splits the layers evenly (:func:`config.schema.even_stage_layers`)."""
        stage_layers = self.stage_layers
        if even_stages or mesh.pp != self.mesh.pp:
            stage_layers = even_stage_layers(self.model.layers, mesh.pp)
        moved = dataclasses.replace(
            self,
            mesh=mesh,
            micro_batch_size=micro_batch_size,
            stage_layers=stage_layers,
            spec=sharing(self.spec, mesh),
        )
        if moved.request.passes > moved.gradient_accumulation:
            moved = moved.with_request(passes=0)
        return moved

    def with_request(self, **changes) -> RunShape:
        """The same run with some of its plan flags changed (:class:`PlanRequest`)."""
        return dataclasses.replace(self, request=dataclasses.replace(self.request, **changes))

    def engine_plan(self, memory: MemoryPlan) -> EnginePlan:
        """The plan an engine runs by: this run's settings joined to the planner's passes and
        placement."""
        return EnginePlan(
            model=self.model,
            sequence_length=self.sequence_length,
            micro_batch_size=self.micro_batch_size,
            gradient_accumulation=self.gradient_accumulation,
            stage_layers=self.stage_layers,
            precision=self.precision,
            prefetch=self.prefetch,
            overlap_communication=self.overlap_communication,
            fixed_weight_buffers=self.fixed_weight_buffers,
            seed=self.engine.seed,
            init_std=self.engine.init_std,
            loss_scaling=self.engine.loss_scaling,
            optimizer=self.engine.optimizer,
            memory=memory,
            sparsity=self.sparsity,
            overlap_update=self.overlap_update,
            compile=self.compile,
            attention_kernels=self.attention_ranking(),
        )

    def attention_ranking(self) -> tuple[str, ...]:
        """The fused attention kernels the spec timed at this run's shape, dtype and dropout,
        fastest first: one call is a micro-batch's sequences, whole (context parallelism
        hands a rank heads instead of pieces), over this rank's heads."""
        model, mesh = self.model, self.mesh
        batch_heads = self.micro_batch_size * max(1, model.heads // (mesh.tp1 * mesh.cp))
        return self.spec.attention_ranking(
            self.precision, model.dropout_prob, batch_heads, self.sequence_length, model.head_dim
        )


def resolve_spec(planning: PlanningConfig, execution: ExecutionConfig) -> DeviceSpec:
    """The ``--device_spec`` entry, measured numbers of ``--device_spec_file`` on top, then every
    non-zero override flag (of the planning section, and the execution section's memory and
    peak)."""
    p, ex = planning, execution
    base = SPECS[p.device_spec]
    if p.device_spec_file:
        base = read_spec_file(p.device_spec_file, base)
    overrides = {
        "peak_tflops": ex.peak_tflops,
        "memory_gb": ex.device_memory_gb,
        "host_memory_gb": ex.host_memory_gb,
        "host_link_gb_per_s": p.host_link_gb_per_s,
        "intra_node_gb_per_s": p.intra_node_gb_per_s,
        "inter_node_gb_per_s": p.inter_node_gb_per_s,
        "devices_per_node": p.devices_per_node,
        "compute_efficiency": p.compute_efficiency,
        "storage_gb_per_s": p.storage_gb_per_s,
    }
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v})


def sharing(spec: DeviceSpec, mesh: MeshShape) -> DeviceSpec:
    """``spec`` for a rank of ``mesh``: with the ranks that share a host's memory (as many as
    a node holds, at most the run's: :meth:`DeviceSpec.memory_rate`)."""
    return dataclasses.replace(spec, ranks_on_host=min(mesh.world_size, spec.devices_per_node))
