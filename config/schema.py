"""The typed configuration tree of a pretraining run.

Precedence is dataclass defaults < preset (``config/pretraining.yml``) < command line. Every leaf
field is also a flat command-line flag named after the field (``--hidden_size``), so leaf names
are unique across the tree. The defaults are the GPT-3 paper's training recipe (Brown et al. 2020).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from config.field_help import doc as _doc
from config.schema_model import ModelConfig
from config.schema_run import CheckpointConfig, LoggingConfig, PlanningConfig
from config.schema_sparsity import RigLConfig

PRECISIONS = ("float32", "bfloat16", "float16")
PLACEMENTS = ("auto", "remote", "resident")
STATE_PLACEMENTS = ("auto", "device", "host")
DEVICES = ("auto", "cpu", "cuda")
SWITCHES = ("auto", "true", "false")
RECOMPUTE = ("auto", "full", "selective", "none")


def plannable_recompute(context_parallel: int) -> tuple[str, ...]:
    """The recompute modes a layout can run. What a layer keeps is measured on a
    whole-sequence block; with the sequence split around attention's all-to-all the kept
    tensors differ, so a context-parallel layout recomputes in full."""
    return ("full",) if context_parallel > 1 else RECOMPUTE[1:]


LR_SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class OptimizerConfig:
    """AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

    learning_rate: float = field(default=6e-4, metadata=_doc("Peak learning rate."))
    min_learning_rate_ratio: float = field(
        default=0.1, metadata=_doc("Final learning rate as a fraction of the peak.")
    )
    lr_schedule: str = field(
        default="cosine",
        metadata=_doc("Decay after warm-up: cosine, linear or constant.", choices=LR_SCHEDULES),
    )
    warmup_tokens: int = field(
        default=375_000_000, metadata=_doc("Tokens of linear learning-rate warm-up.")
    )
    decay_tokens: int = field(
        default=260_000_000_000,
        metadata=_doc(
            "Tokens (warm-up included) after which the learning rate stays at its minimum; "
            "0 decays over the whole run."
        ),
    )
    beta1: float = field(default=0.9, metadata=_doc("AdamW beta1."))
    beta2: float = field(default=0.95, metadata=_doc("AdamW beta2."))
    eps: float = field(default=1e-8, metadata=_doc("AdamW epsilon."))
    weight_decay: float = field(
        default=0.1,
        metadata=_doc("Decoupled weight decay on matrices and embeddings (never biases or norms)."),
    )
    gradient_clipping: float = field(
        default=1.0, metadata=_doc("Clip the global gradient norm to this value; 0 disables.")
    )


@dataclass
class TrainingConfig:
    """What one run trains for."""

    steps: int = field(default=100, metadata=_doc("Optimizer steps to run."))
    global_batch_size: int = field(
        default=256, metadata=_doc("Sequences per optimizer step over all replicas.")
    )
    seed: int = field(default=42, metadata=_doc("Seed for weights, data order and dropout."))
    precision: str = field(
        default="float32",
        metadata=_doc(
            "Compute dtype; master weights and AdamW moments stay float32.", choices=PRECISIONS
        ),
    )
    loss_scaling: float = field(
        default=1.0, metadata=_doc("Static loss scale (use e.g. 4096 with float16).")
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class DataConfig:
    """Where training and validation sequences come from."""

    input_files: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "TFRecord files or token files (prefix.bin beside prefix.idx, as write_into_tfrecord.py "
            "--output-format tokens or Megatron write them), or globs; empty uses the sample "
            "data shipped in data/sample."
        ),
    )
    data_blend: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "Train on a weighted blend of corpora instead of --input_files: \"0.7 'a/*.tfrecord' "
            "0.3 'b/*.bin'\" (pairs of WEIGHT GLOB; weights are normalised)."
        ),
    )
    validation_files: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "Held-out files or globs for evaluation, or a blend of them (WEIGHT GLOB pairs): "
            "then each corpus' loss is reported as well."
        ),
    )
    validation_fraction: float = field(
        default=0.0, metadata=_doc("Fraction of the training windows held out for evaluation.")
    )
    eval_every: int = field(default=0, metadata=_doc("Evaluate every N steps; 0 disables."))
    eval_batches: int = field(
        default=8, metadata=_doc("Micro-batches per replica in one evaluation; 0 means all.")
    )
    skip_corrupt_records: bool = field(
        default=False, metadata=_doc("Skip and count corrupt records instead of stopping.")
    )


@dataclass
class ExecutionConfig:
    """How the step is laid out over devices and memory."""

    micro_batch_size: int = field(default=1, metadata=_doc("Sequences per micro-batch."))
    data_parallel: int = field(default=1, metadata=_doc("Data-parallel replicas."))
    tensor_parallel_1: int = field(
        default=1, metadata=_doc("Tensor-parallel axis 1: heads, FFN columns, vocabulary.")
    )
    tensor_parallel_2: int = field(
        default=1, metadata=_doc("Tensor-parallel axis 2: the hidden dimension.")
    )
    context_parallel: int = field(
        default=1,
        metadata=_doc(
            "Context-parallel axis: each sequence is split into this many pieces, one per "
            "rank, outside attention; attention swaps the split for a head split "
            "(DeepSpeed-Ulysses all-to-all), so it must divide --sequence_length and the heads "
            "of a tensor_parallel_1 rank."
        ),
    )
    pipeline_parallel: int = field(
        default=1,
        metadata=_doc(
            "Pipeline stages: the decoder layers split into this many contiguous stages, one "
            "per rank of the pipeline axis (stage 0 also holds the embedding, the last the "
            "head); the passes of a step are the pipeline's chunks, run one forward, one "
            "backward."
        ),
    )
    pipeline_layers: str = field(
        default="",
        metadata=_doc(
            "Decoder layers of each pipeline stage, comma-separated (e.g. 10,12,12,10), "
            "summing to --layers; empty splits them as evenly as possible."
        ),
    )
    placement: str = field(
        default="auto",
        metadata=_doc(
            "Where state lives. auto: the planner picks passes and each state's place to fit "
            "the device and this process's share of host memory, fastest plan first; remote: "
            "weights, optimizer state, gradients and activations in host memory, streamed per "
            "phase; resident: all of it on the compute device. The per-state flags override it.",
            choices=PLACEMENTS,
        ),
    )
    weights_placement: str = field(
        default="auto",
        metadata=_doc(
            "Weights with their AdamW moments: device, host, or auto (follow --placement).",
            choices=STATE_PLACEMENTS,
        ),
    )
    grads_placement: str = field(
        default="auto",
        metadata=_doc(
            "float32 gradient accumulators: device, host, or auto (follow --placement).",
            choices=STATE_PLACEMENTS,
        ),
    )
    activations_placement: str = field(
        default="auto",
        metadata=_doc(
            "Activation buffers x and dx: device, host, or auto (follow --placement).",
            choices=STATE_PLACEMENTS,
        ),
    )
    passes: int = field(
        default=0,
        metadata=_doc(
            "Walk the model this many times per step, each over its share of the step's "
            "micro-batches (1: each layer loaded once per step, most activation memory; "
            "gradient accumulation: per-micro-batch streaming, least). 0: the planner chooses."
        ),
    )
    prefetch: bool = field(
        default=True,
        metadata=_doc(
            "Load the next phase's host-placed weights while the current phase computes (on a "
            "side CUDA stream; on a CPU the same copies, one phase early). The numbers are the "
            "same either way; false loads each phase's weights when it starts (unless "
            "--overlap_communication, whose all-gathers start from shards loaded ahead)."
        ),
    )
    overlap_communication: bool = field(
        default=True,
        metadata=_doc(
            "Run the data-parallel traffic behind compute: the next phase's weight all-gather "
            "starts before the current phase runs, and a layer's gradient reduce-scatter is "
            "waited for only after the next layer's backward (async collectives, issued in the "
            "same order on every rank). The numbers are the same either way; false waits for "
            "each collective where it is issued."
        ),
    )
    fixed_weight_buffers: bool = field(
        default=False,
        metadata=_doc(
            "Load every decoder layer's weights into one of two fixed device buffers, taken "
            "in turn, so that each layer phase computes at the same addresses, as a captured "
            "CUDA graph replays them. Costs a device copy of each layer's weights per layer "
            "phase; the numbers are the same either way."
        ),
    )
    overlap_update: str = field(
        default="auto",
        metadata=_doc(
            "Run a step's host AdamW (weights placed on the host) behind the next step: the "
            "rows update in the order the next step loads them, and a layer's first load "
            "waits for that layer's update alone. The numbers are the same either way. auto: "
            "on a GPU, whose host cores are idle while it computes; not on a CPU device, "
            "whose cores would do both.",
            choices=SWITCHES,
        ),
    )
    compile: str = field(
        default="auto",
        metadata=_doc(
            "Compile each part's computation (the decoder block, the embedding, the head) with "
            "torch.compile, as torchtitan compiles per block: one graph for every layer and "
            "micro-batch, its memory-bound ops fused; collectives run between graphs, "
            "attention's dropout is one op in them. auto: on a GPU; a CPU compiles slowly "
            "(tens of seconds) at start. "
            "Where inductor cannot run, or fails on a graph, one line says so and the run "
            "goes on eager.",
            choices=SWITCHES,
        ),
    )
    recompute: str = field(
        default="auto",
        metadata=_doc(
            "What a decoder layer's backward recomputes. full: the whole layer from its input "
            "(least memory); selective: only attention's core (scores, softmax, dropout), "
            "keeping the layer's other activations (Korthikanti et al. 2022); none: keeps "
            "everything. Kept activations live with the activation buffers. auto: the planner "
            "picks the fastest that fits, counting recompute FLOPs against host-link bytes.",
            choices=RECOMPUTE,
        ),
    )
    device_memory_gb: float = field(
        default=0.0,
        metadata=_doc(
            "Device memory the planner may use, in GiB; 0 measures the free memory (on a CPU "
            "device, host and device are the same memory)."
        ),
    )
    device_memory_cap_gb: float = field(
        default=0.0,
        metadata=_doc(
            "Caps the device memory this process may use, in GiB, as a smaller GPU would (an "
            "H100's 80 on an H200): the planner plans within the lesser of this and what "
            "--device_memory_gb or the device gives, and on a GPU the allocator refuses to "
            "hold more, so a run that needs more fails as it would on that GPU. 0: no cap."
        ),
    )
    host_memory_gb: float = field(
        default=0.0,
        metadata=_doc(
            "Host memory this process may use, in GiB; 0 takes its share of the available "
            "memory (available / processes on the node)."
        ),
    )
    device: str = field(
        default="auto", metadata=_doc("Compute device: auto, cpu or cuda.", choices=DEVICES)
    )
    peak_tflops: float = field(
        default=0.0,
        metadata=_doc(
            "Dense bf16/fp16 peak of one device in TFLOPS for MFU; 0 takes a known GPU's data "
            "sheet, and MFU is reported as null where the peak is unknown (e.g. on CPU)."
        ),
    )
    collective_timeout: float = field(
        default=1800.0,
        metadata=_doc(
            "Seconds a rank waits in a collective (or for the others to join) before it stops "
            "with one line naming the phase and the group, so that a rank that stalls or dies "
            "ends the job instead of holding it. 1800 (30 minutes) by default."
        ),
    )


@dataclass
class PretrainingConfig:
    """Root of the tree."""

    # The entry script whose command line this tree is, and what it does (for --help).
    PROGRAM: ClassVar[str] = "run_pretraining.py"
    DESCRIPTION: ClassVar[str] = "GPT-3 pretraining with phased execution."
    # Evaluates on --validation_files at the end of a run, not only every --eval_every steps.
    EVALUATES_AT_END: ClassVar[bool] = False

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rigl: RigLConfig = field(default_factory=RigLConfig)

    @property
    def gradient_accumulation(self) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        ex = self.execution
        return micro_batches_per_replica(
            self.training.global_batch_size, ex.micro_batch_size, ex.data_parallel
        )

    @property
    def world_size(self) -> int:
        """Processes the layout needs: data_parallel x pipeline_parallel x context_parallel x
        tensor_parallel_1 x tensor_parallel_2."""
        ex = self.execution
        sequence = ex.data_parallel * ex.pipeline_parallel * ex.context_parallel
        return sequence * ex.tensor_parallel_1 * ex.tensor_parallel_2

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage: ``--pipeline_layers`` as given, else
        :func:`even_stage_layers`. Validated by ``config.loading.validate``."""
        ex = self.execution
        if ex.pipeline_layers.strip():
            return tuple(int(n) for n in ex.pipeline_layers.split(","))
        return even_stage_layers(self.model.layers, ex.pipeline_parallel)

    @property
    def task(self) -> str:
        """The head's task: "" for pretraining's language model (a fine-tuning run's tree
        names its task)."""
        return ""

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch_size * self.model.sequence_length


def micro_batches_per_replica(
    global_batch_size: int, micro_batch_size: int, data_parallel: int
) -> int:
    """Micro-batches each data-parallel replica runs per optimizer step (its gradient
    accumulation): a run's, and that of every layout --plan_for weighs."""
    return global_batch_size // (micro_batch_size * data_parallel)


def even_stage_layers(layers: int, stages: int) -> tuple[int, ...]:
    """``layers`` split over ``stages`` as evenly as possible, the extra layers on the middle
    stages first (they hold neither the embedding nor the head), then on the first: a run's
    split without ``--pipeline_layers``, and every pipeline ``--plan_for`` weighs."""
    base, extra = divmod(layers, stages)
    order = [*range(1, stages - 1), 0, stages - 1][:stages] if stages > 1 else [0]
    sizes = [base] * stages
    for stage in order[:extra]:
        sizes[stage] += 1
    return tuple(sizes)


def leaf_fields(node: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """All leaves of a config tree as (dotted path, owning dataclass instance, Field)."""
    leaves = []
    for f in fields(node):
        value = getattr(node, f.name)
        path = f"{prefix}{f.name}"
        if is_dataclass(value):
            leaves.extend(leaf_fields(value, f"{path}."))
        else:
            leaves.append((path, node, f))
    return leaves
