"""The memory planner: how many passes a step takes and where each state lives (DESIGN.md s. 9).

Three states are placed, each on the compute device or in host memory:

- ``weights``: float32 master weights with their two AdamW moments (16 bytes per parameter of
  this rank's RTS shard, reported as 4 of weights and 8 of optimizer state);
- ``grads``: float32 gradient accumulators (4 bytes per parameter of the shard);
- with weights on the host and a 16-bit compute dtype, ``weight_copies`` of the weights in that
  dtype beside the masters (2 bytes per parameter, placed with the weights), which the phases
  load instead of the masters;
- ``activations``: x at every layer boundary (sharded over tp1) and two rows of dx, for the
  micro-batches of one pass, in the compute dtype.

Byte counts come from the same functions the buffers are allocated by (:mod:`execution.buffers`).
The device must also hold a transient working set (one layer's gathered weights, its gradient,
the autograd state of one micro-batch, the logits of the head). Plans are ranked by the bytes
they move between host and device per step; the first that fits is taken.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

import torch

from config.loading import ConfigError
from config.schema import PretrainingConfig
from execution.buffers import (
    GRAD_STATES,
    WEIGHT_STATES,
    ActivationLayout,
    PartBuffers,
    flat_specs,
    part_rows,
    rts_sizes,
    weight_copy_dtype,
)
from modelling.gpt import PARTS, GPTShapes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATES = ("weights", "grads", "activations")
PLACES = ("device", "host")
GiB = 2**30
# Keys of state_bytes that live where the weights do.
WEIGHT_STATE_KEYS = ("optimizer", "weight_copies")
# Host memory the planner leaves to the interpreter, torch and the data loader.
HOST_HEADROOM = 0.10
# Free device memory it leaves to the CUDA context and the caching allocator's fragmentation.
DEVICE_HEADROOM = 0.10


@dataclass(frozen=True)
class Placement:
    """Where each state lives: ``device`` or ``host``."""

    weights: str
    grads: str
    activations: str

    def describe(self) -> str:
        return ", ".join(f"{s} on {getattr(self, s)}" for s in STATES)


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
    """

    passes: int
    micro_batches_per_pass: int
    placement: Placement
    state_bytes: dict[str, int]
    working_set: int
    traffic: int
    shared_memory: bool

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
            f"{self.placement.describe()}"
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


def measure_budget(config: PretrainingConfig, device: torch.device, processes_per_node: int):
    """The memory this process may plan with: flags first, else what the machine has free.

    Host memory is shared by the node's processes, so each gets its share of what is available.
    """
    ex = config.execution
    host = ex.host_memory_gb * GiB
    if not host:
        host = (_host_memory_available() or 0) * (1 - HOST_HEADROOM) / processes_per_node
    gpu = None
    if device.type != "cpu":
        gpu = ex.device_memory_gb * GiB
        gpu = gpu or torch.cuda.mem_get_info(device)[0] * (1 - DEVICE_HEADROOM)
    return MemoryBudget(None if gpu is None else int(gpu), int(host))


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
    sequence: int
    gradient_accumulation: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: PretrainingConfig) -> RankShape:
        ex = config.execution
        return cls(
            GPTShapes.from_config(config.model, ex.tensor_parallel_1, ex.tensor_parallel_2),
            ex.data_parallel,
            ex.micro_batch_size,
            config.model.sequence_length,
            config.gradient_accumulation,
            DTYPES[config.training.precision],
        )

    @functools.cached_property
    def specs(self):
        s = self.shapes
        return flat_specs(s, rts_sizes(self.dp, s.tp1, s.tp2))

    def activation_layout(self, entries: int) -> ActivationLayout:
        s = self.shapes
        return ActivationLayout(s.layers, entries, (self.micro_batch, self.sequence),
                                s.hidden // s.tp2, s.tp1, self.dtype)  # fmt: skip


def micro_batches_per_pass(gradient_accumulation: int, passes: int) -> int:
    return math.ceil(gradient_accumulation / passes)


def state_bytes(rank: RankShape, entries: int, placement: Placement) -> dict[str, int]:
    """Bytes of each state's buffers on one rank, from the allocating classes' own formulas
    (``placement`` decides whether compute-dtype weight copies are kept)."""
    specs, layers = rank.specs, rank.shapes.layers
    copy_dtype = weight_copy_dtype(placement.weights == "host", rank.dtype)

    def part_bytes(states) -> int:
        return sum(
            PartBuffers.planned_nbytes(specs[p], part_rows(p, layers), states) for p in PARTS
        )

    weights = part_bytes(WEIGHT_STATES[:1])
    return {
        "weights": weights,
        "optimizer": part_bytes(WEIGHT_STATES) - weights,
        "grads": part_bytes(GRAD_STATES),
        "weight_copies": sum(
            PartBuffers.planned_copy_nbytes(specs[p], part_rows(p, layers), copy_dtype)
            for p in PARTS
        ),
        "activations": rank.activation_layout(entries).planned_nbytes(),
    }


def working_set_bytes(
    rank: RankShape, placement: Placement, flash_attention: bool, prefetch: bool
) -> int:
    """A quick estimate of the transient device bytes of the largest phase.

    Used only to advise which flags would make a misfit fit (a measurement per candidate
    layout would take minutes); plans are chosen with :func:`measured_working_set`. With
    ``prefetch`` and host weights, a phase also holds the next phase's weight shards.
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
    if not flash_attention:
        layer += 16 * rank.micro_batch * (s.heads // s.tp1) * rank.sequence**2
    layer += 3 * tokens * h2 * b
    vocab = s.vocab_padded // s.tp1
    head = tokens * vocab * (3 * b + 4) + local("embedding") * (2 * b + 12) + 4 * tokens * h2 * b
    largest_row = max(spec.shard for part in PARTS for spec in specs[part].values())
    optimizer = (28 if placement.weights == "host" else 12) * largest_row
    ahead = 0
    if prefetch and placement.weights == "host":
        ahead = b * max(shard("layers"), shard("head") + shard("embedding"))
    return max(layer + ahead, head + ahead, optimizer)


def shrunk_config(config: PretrainingConfig, layers: int, micro_batches: int,
                  passes: int) -> PretrainingConfig:  # fmt: skip
    """``config`` with fewer layers and micro-batches per replica, and fixed passes: the same
    shards and phases, for measuring a step quickly."""
    out = copy.deepcopy(config)
    out.model.layers = layers
    ex = out.execution
    out.training.global_batch_size = micro_batches * ex.micro_batch_size * ex.data_parallel
    ex.passes = passes
    return out


_MEASURED: dict[tuple, int] = {}


def measured_working_set(config: PretrainingConfig, device_type: str) -> int:
    """Peak bytes one step allocates beyond the buffers, measured, for this rank's shapes.

    Runs one decoder layer and one micro-batch of the real engine on meta tensors (collectives
    only shape their outputs), with every state on the host: loads from the host are copies,
    so this bounds every placement. Attention runs as the kernel the device would use (flash
    on a GPU, and on a CPU without dropout). The result does not depend on the number of
    layers or micro-batches, which only repeat the same phases.
    """
    from execution.layout import ParallelLayout
    from execution.phases import PhasedEngine
    from execution.step_meter import FlashAttentionOnMeta, StepMeter

    ex = config.execution
    flash = device_type == "cuda" or config.model.dropout_prob == 0.0
    small = shrunk_config(config, layers=1, micro_batches=1, passes=1)
    # Keyed by what is measured: configs that differ only in layers or micro-batches share it.
    key = (RankShape.from_config(small), flash, config.model.dropout_prob, ex.prefetch)
    if key in _MEASURED:
        return _MEASURED[key]
    host = Placement("host", "host", "host")
    plan = MemoryPlan(1, 1, host, {}, 0, 0, shared_memory=False)
    layout = ParallelLayout.shapes_only(ex.data_parallel, ex.tensor_parallel_1,
                                        ex.tensor_parallel_2)  # fmt: skip
    engine = PhasedEngine(small, layout, plan)
    tokens = torch.zeros((1, ex.micro_batch_size, config.model.sequence_length + 1),
                         dtype=torch.long, device="meta")  # fmt: skip
    with FlashAttentionOnMeta() if flash else contextlib.nullcontext(), StepMeter() as meter:
        engine.train_step(tokens, step=0, lr=config.training.optimizer.learning_rate)
    _MEASURED[key] = meter.peak
    return meter.peak


def host_traffic(rank: RankShape, placement: Placement, passes: int, entries: int) -> int:
    """Bytes a step moves between host and device under a placement (0 for all-device).

    Counts exactly what :class:`execution.state.StateStore` copies (a test holds the two
    together): per pass each part's weights are loaded for forward and backward (the word
    embedding a third time, tied in the head), gradients are stored and, after the first pass,
    read back to accumulate (the embedding's twice: the head's tied part and its own); the
    optimizer reads gradients, weights and moments once and writes weights and moments back
    (and the compute-dtype copies of host weights, which the loads then read instead);
    each micro-batch stores x at L + 1 boundaries and reads it 2L + 1 times, and stores and
    reads dx at L + 1.
    """
    specs, layers = rank.specs, rank.shapes.layers

    def fp32(part: str) -> int:  # bytes of one state of a part (all its rows)
        return PartBuffers.planned_nbytes(specs[part], part_rows(part, layers), ("weights",))

    total = sum(fp32(part) for part in PARTS)
    emb, lay, head = fp32("embedding"), fp32("layers"), fp32("head")
    copies = state_bytes(rank, entries, placement)["weight_copies"]
    traffic = 0
    if placement.weights == "host":
        loads = passes * (2 * lay + 3 * emb + head)
        if copies:  # loads read the compute-dtype copies; the optimizer refreshes them
            loads = loads * rank.dtype.itemsize // 4 + copies
        traffic += loads + 6 * total
    if placement.grads == "host":
        traffic += (2 * passes - 1) * (lay + head) + (4 * passes - 1) * emb + total
    if placement.activations == "host":
        layout = rank.activation_layout(entries)
        per_micro = (3 * layers + 2) * layout.x_shard + 2 * (layers + 1) * layout.entry_numel
        traffic += per_micro * rank.gradient_accumulation * rank.dtype.itemsize
    return traffic


def requested_placement(config: PretrainingConfig) -> dict[str, str | None]:
    """Each state's place as the flags fix it (None: the planner chooses)."""
    ex = config.execution
    shorthand = {"remote": "host", "resident": "device", "auto": None}[ex.placement]
    flags = {
        "weights": ex.weights_placement,
        "grads": ex.grads_placement,
        "activations": ex.activations_placement,
    }
    return {s: (v if v != "auto" else shorthand) for s, v in flags.items()}


def candidate_plans(config: PretrainingConfig, device_type: str, most_passes_only: bool = False,
                    estimate_working_set: bool = False) -> list[MemoryPlan]:  # fmt: skip
    """Every plan the flags allow, fastest first (least host traffic, then fewest passes).

    ``most_passes_only`` keeps, per placement, the plan of least memory (the most passes);
    ``estimate_working_set`` uses the quick formula instead of a measured step (for advice).
    """
    rank = RankShape.from_config(config)
    fixed = requested_placement(config)
    ga = rank.gradient_accumulation
    if config.execution.passes:
        pass_options = [config.execution.passes]
    elif most_passes_only:
        pass_options = [ga]
    else:  # each distinct number of micro-batches per pass, once
        pass_options = sorted(
            {math.ceil(ga / micro_batches_per_pass(ga, p)) for p in range(1, ga + 1)}
        )
    places = [[fixed[s]] if fixed[s] else list(PLACES) for s in STATES]
    shared = device_type == "cpu"
    plans = []
    for where in itertools.product(*places):
        placement = Placement(*where)
        if estimate_working_set:
            flash = device_type == "cuda" or config.model.dropout_prob == 0.0
            working = working_set_bytes(
                rank, placement, flash_attention=flash, prefetch=config.execution.prefetch
            )
        else:
            working = measured_working_set(config, device_type)
        for passes in pass_options:
            entries = micro_batches_per_pass(ga, passes)
            traffic = 0 if shared else host_traffic(rank, placement, passes, entries)
            plans.append(MemoryPlan(passes, entries, placement,
                                    state_bytes(rank, entries, placement), working, traffic,
                                    shared))  # fmt: skip

    # On a CPU device a host placement only adds copies: prefer the device, then fewer passes.
    def hosted(plan: MemoryPlan) -> int:
        return sum(getattr(plan.placement, s) == "host" for s in STATES)

    return sorted(plans, key=lambda p: (p.traffic, hosted(p), p.passes))


def fastest_fitting(plans: list[MemoryPlan], budget: MemoryBudget) -> MemoryPlan | None:
    """The first plan of ``plans`` (ranked fastest first) that fits ``budget``."""
    return next((plan for plan in plans if budget.fits(plan)), None)


def choose_plan(config: PretrainingConfig, device_type: str, budget: MemoryBudget) -> MemoryPlan:
    """The fastest plan that fits ``budget``; a one-line ConfigError when none does."""
    plans = candidate_plans(config, device_type)
    plan = fastest_fitting(plans, budget)
    if plan is not None:
        return plan
    least = min(plans, key=lambda p: _shortfall(p, budget))
    need = least.bytes_on("device")["total"], least.bytes_on("host")["total"]
    if budget.device is None:
        needed = f"{sum(need) / GiB:,.1f} GiB"
    else:
        needed = f"{need[0] / GiB:,.1f} GiB of device and {need[1] / GiB:,.1f} GiB of host memory"
    raise ConfigError(
        f"this run needs at least {needed} per process (with {least.passes} pass(es), "
        f"{least.placement.describe()}), but it may use {budget.describe()}; "
        f"{_suggestions(config, device_type, budget)}"
    )


def _shortfall(plan: MemoryPlan, budget: MemoryBudget) -> float:
    device, host = plan.bytes_on("device")["total"], plan.bytes_on("host")["total"]
    if budget.device is None:
        return device + host - budget.host
    return max(device - budget.device, 0) + max(host - budget.host, 0)


def _suggestions(config: PretrainingConfig, device_type: str, budget: MemoryBudget) -> str:
    """Flags that would make the run fit, tried one change at a time: first letting the planner
    choose what the flags fixed, then smaller micro-batches, then more processes."""
    ex = config.execution
    changes: list[tuple[str, object, str]] = []
    if ex.passes:
        changes.append(("passes", 0, f"without --passes {ex.passes}"))
    fixed = [n for n in ("placement", "weights_placement", "grads_placement",
                         "activations_placement") if getattr(ex, n) != "auto"]  # fmt: skip
    if fixed:
        flags = " ".join(f"--{n} {getattr(ex, n)}" for n in fixed)
        changes.append(("placements", None, f"without {flags}"))
    micro = ex.micro_batch_size // 2
    while micro >= 1:
        changes.append(("micro_batch_size", micro, f"--micro_batch_size {micro}"))
        micro //= 2
    for factor in (2, 4, 8, 16, 32, 64):
        for name in ("data_parallel", "tensor_parallel_1", "tensor_parallel_2"):
            changes.append((name, getattr(ex, name) * factor, ""))
    found: dict[str, str] = {}
    for name, value, text in changes:
        if name in found:
            continue
        if name == "placements":
            changed = _with_execution(config, **{n: "auto" for n in fixed})
        elif not _valid_change(config, name, value):
            continue
        else:
            changed = _with_execution(config, **{name: value})
        plans = candidate_plans(changed, device_type, most_passes_only=True,
                                estimate_working_set=True)  # fmt: skip
        if any(budget.fits(p) for p in plans):
            found[name] = text or f"--{name} {value} ({changed.world_size} processes)"
    if not found:
        return "no single change of passes, placement, micro-batch size or parallelism makes it fit"
    return "it would fit " + " or ".join(
        t if t.startswith("without") else f"with {t}" for t in found.values()
    )


def _valid_change(config: PretrainingConfig, name: str, value: int) -> bool:
    m, ex = config.model, dataclasses.replace(config.execution, **{name: value})
    per_step = ex.micro_batch_size * ex.data_parallel
    return (
        config.training.global_batch_size % per_step == 0
        and m.heads % ex.tensor_parallel_1 == 0
        and m.hidden_size % ex.tensor_parallel_2 == 0
    )


def _with_execution(config: PretrainingConfig, **changes) -> PretrainingConfig:
    ex = dataclasses.replace(config.execution, **changes)
    if ex.passes > (config.training.global_batch_size // (ex.micro_batch_size * ex.data_parallel)):
        ex = dataclasses.replace(ex, passes=0)
    return dataclasses.replace(config, execution=ex)
