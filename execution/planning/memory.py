"""The memory model: what one rank's buffers and transfers cost under a plan.

docs/design.md, "The memory model", draws it whole.

Three states are placed, each on the compute device or in host memory:

- ``weights``: float32 master weights with their two AdamW moments (16 bytes per parameter of
  this rank's RTS shard, reported as 4 of weights and 8 of optimizer state);
- ``grads``: float32 gradient accumulators (4 bytes per parameter of the shard);
- with weights on the host and a 16-bit compute dtype, ``weight_copies`` of the weights in that
  dtype beside the masters (2 bytes per parameter, placed with the weights), which the phases
  load instead of the masters;
- in a sparse run (RigL), ``masks``: one byte per weight of the decoder layers' matrices,
  placed with the weights;
- ``activations``: x at every layer boundary (sharded over tp1) and two rows of dx, for the
  micro-batches of one pass, in the compute dtype; a context-parallel rank holds its 1/cp
  piece of every sequence. With ``--recompute selective`` or ``none`` also what each layer
  keeps for its backward (measured: :mod:`execution.engine.phases.recompute`).

Byte counts come from the same functions the buffers are allocated by
(:mod:`execution.engine.storage.buffers`), so a plan can never disagree with what is allocated. The
transient working set is measured (:mod:`execution.planning.measure`); a quick formula of it
serves only the advice given for a misfit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from config.errors import ConfigError
from execution.engine.phases.recompute import KeptBytes, kept_bytes
from execution.engine.phases.schedule import Stage
from execution.engine.plan import GiB, MemoryPlan, Placement
from execution.engine.storage.buffers import (
    DTYPES,
    GRAD_STATES,
    WEIGHT_STATES,
    ActivationLayout,
    PartBuffers,
    flat_specs,
    rows_of,
    weight_copy_dtype,
)
from execution.engine.storage.gradient_store import needs_staging, staging_elements
from execution.engine.storage.masks import SPARSE_KIND, SPARSE_PART, SparseMasks
from execution.parallel.sharding import rts_sizes
from execution.planning.compiled_costs import compiled_kept_in_place
from execution.planning.device_reserve import device_reserve
from execution.planning.device_specs import DeviceSpec
from modelling.gpt import PARTS, GPTShapes
from modelling.lm_heads import logits_chunks

if TYPE_CHECKING:
    from execution.planning.run_shape import RunShape

# Host memory the planner leaves to the interpreter, torch and the data loader.
HOST_HEADROOM = 0.10
# Free device memory it leaves to the caching allocator's fragmentation and to what the CUDA
# context adds after the budget is measured (NCCL's communicator buffers, kernels loaded on
# first use). A rule of thumb, not derived: fragmentation depends on the order of the step's
# allocations, which the meta measurement does not replay through the allocator.
DEVICE_HEADROOM = 0.10


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes this process may use. ``device`` is None when the device is the CPU (one pool)."""

    device: int | None
    host: int

    def fits(self, plan: MemoryPlan) -> bool:
        device, host = plan.bytes_on("device")["total"], plan.bytes_on("host")["total"]
        if self.device is None:
            return device + host <= self.host
        return device <= self.device and host <= self.host

    def describe(self) -> str:
        host = f"{self.host / GiB:,.1f} GiB of host memory"
        if self.device is None:
            return f"{host} (the CPU is the device)"
        return f"{self.device / GiB:,.1f} GiB of device memory and {host}"


def plan_budget(
    run: RunShape,
    device_available: int | None,
    host_available: int,
    processes_per_node: int = 1,
    *,
    device_type: str,
) -> MemoryBudget:
    """The memory a process may plan with: the one rule of a real run, the dry run and
    ``--plan_for`` (a plan one accepts, the others accept too).

    Of the device (None: the CPU is the device), the process may use ``--device_memory_gb``,
    else what is available less ``DEVICE_HEADROOM`` (a ``--device_memory_cap_gb`` device at
    most: planned as that smaller device); on a GPU, less again what the run allocates
    outside its plan (:func:`device_reserve`: the cuBLAS and attention workspaces), so that
    no plan fills what they need. Of the host, shared by the node's processes,
    ``--host_memory_gb``, else its share less ``HOST_HEADROOM``.

    Args:
        device_available: Free device bytes (a real run measures them; a dry run takes the
            spec's memory, what a process can allocate on an idle device).
        host_available: Available host bytes of the node (a dry run: of one device's share).
        processes_per_node: Processes sharing ``host_available``.
        device_type: ``cuda`` or ``cpu``: whether the workspaces are reserved.
    """
    host = run.host_memory_gb * GiB
    host = host or host_available * (1 - HOST_HEADROOM) / processes_per_node
    device = None
    if device_available is not None:
        device = run.device_memory_gb * GiB or device_available * (1 - DEVICE_HEADROOM)
        device = min(device, run.device_memory_cap_gb * GiB * (1 - DEVICE_HEADROOM) or device)
        device = max(int(device) - device_reserve(run, device_type), 0)
    return MemoryBudget(device, int(host))


def measure_budget(run: RunShape, device: torch.device, processes_per_node: int):
    """:func:`plan_budget` of what this machine has free."""
    for flag in ("device_memory_gb", "device_memory_cap_gb"):
        if device.type == "cpu" and getattr(run, flag):
            # Not ignored in silence: on the CPU the device is the host, one pool.
            raise ConfigError(
                f"--{flag} {getattr(run, flag):g} does not apply to a run on the CPU, whose "
                "one memory pool --host_memory_gb sets; leave it out (it applies on a GPU, and "
                "to --dry_run and --plan_for)"
            )
    free = torch.cuda.mem_get_info(device)[0] if device.type != "cpu" else None
    host = _host_memory_available() or 0
    return plan_budget(run, free, host, processes_per_node, device_type=device.type)


def cap_device_memory(run: RunShape, device: torch.device) -> None:
    """``--device_memory_cap_gb`` as a limit of this process's allocator too: on a GPU it
    refuses to hold more than the cap (out of memory), as the smaller GPU would."""
    if device.type != "cuda" or not run.device_memory_cap_gb:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, run.device_memory_cap_gb * GiB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


def spec_budget(run: RunShape, spec: DeviceSpec) -> MemoryBudget:
    """:func:`plan_budget` of one idle device of ``spec`` and its share of host memory (the
    dry run and ``--plan_for``)."""
    device, host = int(spec.memory_gb * GiB), int(spec.host_memory_gb * GiB)
    return plan_budget(run, device, host, device_type=spec.device_type)


def _host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class RankShape:
    """What one rank's memory depends on: model shard sizes, batch and dtype."""

    shapes: GPTShapes
    dp: int
    micro_batch: int
    sequence: int  # tokens of a sequence this rank holds: its context-parallel piece
    gradient_accumulation: int
    dtype: torch.dtype
    cp: int = 1
    # The pipeline stage whose layers and parts the rank holds (None: the whole model).
    stage: Stage | None = None
    sparse: bool = False  # RigL keeps a mask byte per weight of the decoder layers' matrices
    # What a decoder layer of these shapes keeps and recomputes, measured on meta tensors: the
    # planning's (``Measurements.layers``), shared with the copies of this rank it makes.
    layer_memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, run: RunShape, stage: int = 0, layer_memo: dict | None = None) -> RankShape:
        """The shape of a rank of pipeline stage ``stage`` (without a pipeline, every rank);
        ``layer_memo``: the planning's layer measurements, to reuse and add to."""
        mesh = run.mesh
        pipeline = None
        if mesh.pp > 1:
            pipeline = Stage.of(run.stage_layers, stage, run.model.task_head is not None)
        return cls(
            shapes=run.shards(),
            dp=mesh.dp,
            micro_batch=run.micro_batch_size,
            sequence=run.sequence_length // mesh.cp,
            gradient_accumulation=run.gradient_accumulation,
            dtype=DTYPES[run.precision],
            cp=mesh.cp,
            stage=pipeline,
            sparse=run.sparsity is not None,
            layer_memo={} if layer_memo is None else layer_memo,
        )

    @property
    def layers(self) -> int:
        """Decoder layers this rank holds."""
        return self.stage.layers if self.stage else self.shapes.layers

    def rows(self, part: str) -> int:
        """Buffer rows of ``part`` this rank holds."""
        return self.stage.rows(part) if self.stage else rows_of(part, self.shapes.layers)

    def in_flight(self, passes: int) -> int:
        """Passes of activations held at once (one without a pipeline)."""
        return self.stage.in_flight(passes) if self.stage else 1

    @functools.cached_property
    def specs(self):
        s = self.shapes
        return flat_specs(s, rts_sizes(self.dp, s.tp1, s.tp2, self.cp))

    def kept(self, recompute: str, kernel: str, compiled: bool = False) -> KeptBytes:
        """What a decoder layer keeps per micro-batch for its backward (measured); with
        ``compiled``, what it keeps in place is the compiled forward's where the block is one
        graph (:func:`~execution.planning.compiled_costs.compiled_kept_in_place`)."""
        layer = dataclasses.replace(self.shapes, layers=1)  # one layer's, however many
        key = ("kept", layer, self.micro_batch, self.sequence, self.dtype, recompute, kernel)
        if key not in self.layer_memo:
            self.layer_memo[key] = kept_bytes(
                layer, self.micro_batch, self.sequence, self.dtype, recompute, kernel
            )
        kept = self.layer_memo[key]
        # Selective recompute breaks the block at its core, context parallelism at attention.
        if not compiled or recompute != "none" or self.cp > 1:
            return kept
        key = ("compiled kept", layer, self.sequence, self.dtype, kernel)
        if key not in self.layer_memo:
            self.layer_memo[key] = compiled_kept_in_place(layer, self.sequence, self.dtype, kernel)
        per_sequence = self.layer_memo[key]
        if per_sequence is None:
            return kept
        return dataclasses.replace(kept, in_place=per_sequence * self.micro_batch)

    def activation_layout(self, entries: int, kept: int = 0, in_flight: int = 1):
        shapes = dataclasses.replace(self.shapes, layers=self.layers)
        return ActivationLayout.of(
            shapes, entries, self.micro_batch, self.sequence, self.dtype, kept, in_flight
        )


def micro_batches_per_pass(gradient_accumulation: int, passes: int) -> int:
    return math.ceil(gradient_accumulation / passes)


def state_bytes(
    rank: RankShape, entries: int, placement: Placement, kept: int = 0, passes: int = 1
) -> dict[str, int]:
    """Bytes of each state's buffers on one rank, from the allocating classes' own formulas
    (``placement`` decides whether compute-dtype weight copies are kept; ``kept``: bytes a
    layer keeps per micro-batch for its backward; ``passes``: of a step, for the passes a
    pipeline stage holds at once)."""
    specs = rank.specs
    copy_dtype = weight_copy_dtype(placement.weights == "host", rank.dtype)

    def part_bytes(states) -> int:
        return sum(PartBuffers.planned_nbytes(specs[p], rank.rows(p), states) for p in PARTS)

    weights = part_bytes(WEIGHT_STATES[:1])
    masks = {}
    if rank.sparse:
        spec = specs[SPARSE_PART][SPARSE_KIND]
        masks["masks"] = SparseMasks.planned_nbytes(spec, rank.rows(SPARSE_PART))
    return {
        "weights": weights,
        "optimizer": part_bytes(WEIGHT_STATES) - weights,
        "grads": part_bytes(GRAD_STATES),
        "weight_copies": sum(
            PartBuffers.planned_copy_nbytes(specs[p], rank.rows(p), copy_dtype) for p in PARTS
        ),
        "activations": rank.activation_layout(
            entries, kept, rank.in_flight(passes)
        ).planned_nbytes(),
        # Two float32 staging buffers, where the host updates device-kept gradients.
        "staging": 2 * 4 * staging_elements(specs, {p: rank.rows(p) for p in PARTS})
        if needs_staging(placement.weights, placement.grads)
        else 0,
        **masks,
    }


def working_set_bytes(
    rank: RankShape,
    placement: Placement,
    flash_attention: bool,
    prefetch: bool,
    overlap: bool,
    fixed_buffers: bool = False,
) -> int:
    """A quick estimate of the transient device bytes of the largest phase.

    Used only to advise which flags would make a misfit fit (a measurement per candidate
    layout would take minutes); plans are chosen with :func:`measured_working_set`. With
    ``overlap`` a phase also holds the next phase's gathered weights and the last phase's
    gradients; otherwise, with ``prefetch`` and host weights, the next phase's weight shards.
    ``fixed_buffers`` (``--fixed_weight_buffers``) adds two layers' gathered weights held for
    the run, less the copy a phase of host weights would have held itself.
    """
    s, b = rank.shapes, rank.dtype.itemsize
    specs = rank.specs
    tokens = rank.micro_batch * rank.sequence
    h2, h1 = s.hidden // s.tp2, s.hidden // s.tp1

    def local(part: str) -> int:  # one row's tensor-parallel shard, in elements
        return sum(spec.padded for spec in specs[part].values())

    def shard(part: str) -> int:  # one row's RTS shard of it, in elements
        return sum(spec.shard for spec in specs[part].values())

    layer = local("layers") * (2 * b + 8)
    layer += tokens * (8 * h2 + 13 * h1) * b + tokens * h2 * 8  # saved tensors, fp32 LN stats
    if not flash_attention:  # a rank's heads / cp over the whole sequence (cp x its piece)
        layer += 16 * rank.micro_batch * (s.heads // s.tp1) * rank.cp * rank.sequence**2
    layer += 3 * tokens * h2 * b
    vocab = s.vocab_padded // s.tp1
    chunk = logits_chunks(tokens, s.vocab, vocab, h2)[0]  # the head's logits, a chunk at a time
    logits = (chunk.stop - chunk.start) * vocab * (3 * b + 4)
    head = logits + local("embedding") * (2 * b + 12) + 4 * tokens * h2 * b
    largest_row = max(spec.shard for part in PARTS for spec in specs[part].values())
    # Host weights are updated on the host; a device update holds a gradient and two temporaries.
    optimizer = 0 if placement.weights == "host" else 12 * largest_row
    ahead = 0
    if overlap:  # the next phase's gathered weights, and the last phase's gradients in flight
        ahead = b * max(local("layers"), local("head") + local("embedding")) + 4 * local("layers")
    elif prefetch and placement.weights == "host":
        ahead = b * max(shard("layers"), shard("head") + shard("embedding"))
    held = 0
    if fixed_buffers:
        held = b * local("layers") * (1 if placement.weights == "host" else 2)
    return max(layer + ahead, head + ahead, optimizer) + held


def host_traffic(
    rank: RankShape,
    placement: Placement,
    passes: int,
    entries: int,
    kept: KeptBytes | None = None,
) -> int:
    """Bytes a step moves between host and device under a placement (0 for all-device): the
    sum of :func:`host_traffic_by_phase`."""
    return sum(host_traffic_by_phase(rank, placement, passes, entries, kept).values())


def host_traffic_by_phase(
    rank: RankShape,
    placement: Placement,
    passes: int,
    entries: int,
    kept: KeptBytes | None = None,
) -> dict[str, int]:
    """Bytes a step moves between host and device, by the phases that move them: ``forward``
    (embedding and decoder forward), ``backward`` (the head, decoder and embedding backward)
    and ``optimizer``. A phase's copies hide behind its own compute only, so the planner
    weighs each kind apart (as the dry run's estimate does).

    Counts exactly what :class:`execution.engine.storage.state.StateStore` copies (a test holds the two
    together): per pass each part's weights are loaded for forward and backward (the word
    embedding a third time where the head is tied to it; from the compute-dtype copies of host
    weights where kept), gradients are stored and, after the first pass, read back to
    accumulate (a tied embedding's twice: the head's part and its own); host weights are
    updated on the host, in place, so only gradients kept on the device cross the link for the
    optimizer, while device weights read host gradients once; each micro-batch stores x at L + 1
    boundaries and reads it 2L + 1 times (L in the forward; L + 1 in the backward, or only
    the head's when layers keep their activations: the backward then does not read x),
    stores and reads dx at L + 1, and per layer stores and reads back what the layer keeps.
    """
    specs, layers = rank.specs, rank.layers
    kept = kept or KeptBytes()

    def fp32(part: str) -> int:  # bytes of one state of a part (all its rows)
        return PartBuffers.planned_nbytes(specs[part], rank.rows(part), ("weights",))

    total = sum(fp32(part) for part in PARTS)
    emb, lay, head = fp32("embedding"), fp32("layers"), fp32("head")
    tied = emb if rank.shapes.ties_word_embedding else 0  # the head's use of the embedding
    copies = state_bytes(rank, entries, placement)["weight_copies"]
    forward = backward = optimizer = 0
    if placement.weights == "host":
        # Loads read the compute-dtype copies where kept (refreshed on the host).
        scale = (rank.dtype.itemsize, 4) if copies else (1, 1)
        forward += passes * (lay + emb) * scale[0] // scale[1]
        backward += passes * (lay + emb + tied + head) * scale[0] // scale[1]
    if placement.grads == "host":
        backward += (2 * passes - 1) * (lay + head + emb) + 2 * passes * tied
    if placement.weights != placement.grads:  # the optimizer brings the gradients to the update
        optimizer += total
    if placement.activations == "host":
        layout = rank.activation_layout(entries)
        size, micro = rank.dtype.itemsize, rank.gradient_accumulation
        x_forward = (2 * layers + 1) * layout.x_shard * size + layers * kept.stored
        x_backward = (1 if kept.entry else layers + 1) * layout.x_shard * size
        dx = 2 * (layers + 1) * layout.entry_numel * size
        forward += x_forward * micro
        backward += (x_backward + dx + layers * kept.loaded) * micro
    return {"forward": forward, "backward": backward, "optimizer": optimizer}
