"""The dry run's price of compiled parts (``--compile``): each region's fused kernels against the
eager ops they replace (execution/planning/compiled_costs.py).

References: a hand count of the bytes a layer norm followed by GELU reads and writes, eager
(two kernels, the normalised tensor written and read back) and fused (one kernel); and the
eager step itself, whose FLOPs and matmuls compiling must leave as they are.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from execution.engine.engine import PhasedEngine
from execution.engine.phases import schedule
from execution.engine.phases.recompute import attention_kernel, meta_block
from execution.engine.plan import MemoryPlan, Placement
from execution.parallel.mesh import ParallelLayout
from execution.planning.compiled_costs import (
    CostChange,
    _PartPricer,
    apply_changes,
    phase_changes,
)
from execution.planning.estimate_checks import EstimateError
from execution.planning.measure import Measurements, Window, meta_step
from execution.planning.memory import RankShape
from execution.planning.op_costs import OpCosts
from execution.planning.run_shape import RunShape
from execution.planning.step_meter import StepMeter
from tests.distributed import small_config

ROWS, HIDDEN = 64, 32
FLOAT = 4  # bytes


class NormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(x))


def test_a_fused_norm_and_gelu_saves_what_the_eager_pair_writes_and_reads_back():
    """Eager: the layer norm reads x and its weight and bias and writes the normalised tensor
    and each row's mean and 1/std; GELU reads that tensor and writes the result. Fused: one
    kernel reads x, weight and bias and writes the result. The difference is the normalised
    tensor written and read, the statistics written, and one kernel."""
    x = torch.empty(ROWS, HIDDEN, device="meta")
    pricer = _PartPricer("math", "cpu", torch.float32, axes=())
    change = pricer(NormGelu(), x, inference=True).inference
    tensor, statistics, affine = ROWS * HIDDEN * FLOAT, 2 * ROWS * FLOAT, 2 * HIDDEN * FLOAT
    eager = (2, 4 * tensor + affine + statistics)  # x, w, b in; normed, stats out; GELU
    assert change == CostChange(*eager, compiled_kernels=1, compiled_bytes=2 * tensor + affine)
    assert (change.kernels, change.memory_bytes) == (-1, -(2 * tensor + statistics))


def test_a_dropout_free_block_is_priced_eager_as_the_eager_step_runs_it():
    """A block without dropout compiles to one graph, attention inside it. The eager side of
    its price must be what the eager step meters for the block: the same kernels and bytes,
    forward and backward, with attention as the device's fused kernel. (On meta tensors torch
    itself takes the math path, which writes the [heads, 512, 512] scores here, 22 times the
    block's other bytes: compiling seemed to save them, and dry runs printed negative
    memory-bound seconds and MFU above 100%.)"""
    sequence = 512
    flags = ("--sequence_length", str(sequence), "--max_positional_length", str(sequence))
    config = small_config(*flags, "--dropout_prob", "0", "--dropout_parity", "false")
    block = meta_block(RunShape.of(config).shards(), "flash").to(torch.bfloat16)
    x = torch.empty(2, sequence, block.attn.qkv.weight.shape[1], dtype=torch.bfloat16)
    x = x.to("meta").requires_grad_()
    change = _PartPricer("flash", "cuda", torch.bfloat16, axes=())(block, x, None)
    with StepMeter() as meter:
        y = block(x, None)
        forward = meter.costs.copy()
        torch.autograd.backward(y, torch.empty_like(y))
    backward = meter.costs - forward
    for side, metered in ((change.forward, forward), (change.backward, backward)):
        assert (side.eager_kernels, side.eager_bytes) == (metered.kernels, metered.memory_bytes)
    assert meter.attention_flops > 0  # the fused kernel ran, forward and backward


def test_compiling_removes_no_more_than_a_phase_ran():
    """A compiled call replaces its eager ops' kernels and bytes, once per micro-batch: a
    phase that ran fewer (the eager side priced ops the step never ran) is a bug, raised, not
    a negative figure; nor can a change count negative work."""
    window = Window("layer_forward", costs=OpCosts(kernels=20, memory_bytes=1000), micro_batches=2)
    apply_changes([window], {"layer_forward": CostChange(10, 500, 3, 200)})
    assert (window.costs.kernels, window.costs.memory_bytes) == (20 - 14, 1000 - 600)
    window = Window("layer_forward", costs=OpCosts(kernels=20, memory_bytes=999), micro_batches=2)
    with pytest.raises(EstimateError, match=r"'layer_forward'.*memory-bound bytes"):
        apply_changes([window], {"layer_forward": CostChange(10, 500, 3, 200)})
    with pytest.raises(EstimateError, match="compiled_bytes"):
        CostChange(1, 1, 1, -1)


def _engine(*flags: str) -> tuple[PhasedEngine, str]:
    config = small_config("--compile", "true", *flags)
    run = RunShape.of(config)
    rank = RankShape.of(run)
    kernel = attention_kernel("cpu", run.model.dropout_prob, rank.dtype)
    mesh = run.mesh
    layout = ParallelLayout.shapes_only(1, mesh.tp1, mesh.tp2, cp=mesh.cp)

    device = Placement("device", "device", "device")
    recompute = config.execution.recompute if config.execution.recompute != "auto" else "full"
    memory = MemoryPlan(
        passes=1,
        micro_batches_per_pass=2,
        placement=device,
        state_bytes={},
        working_set=0,
        traffic=0,
        shared_memory=False,
        recompute=recompute,
        kept=rank.kept(recompute, kernel).entry,
    )
    plan = run.engine_plan(memory).shrunk(2, micro_batches=2, passes=1)
    return PhasedEngine(plan, layout), kernel


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_compiling_changes_a_steps_memory_bound_work_not_its_flops(recompute):
    engine, kernel = _engine("--recompute", recompute, "--dropout_prob", "0.1")
    eager = meta_step(engine.plan, engine.layout, kernel, Measurements())
    compiled = meta_step(engine.plan, engine.layout, kernel, Measurements(), compiled_on="cpu")
    assert compiled.flops == eager.flops
    changed = {schedule.LAYER_FORWARD, schedule.LAYER_BACKWARD, schedule.HEAD_PHASE}
    total = {True: 0, False: 0}
    for before, after in zip(eager.windows, compiled.windows, strict=True):
        assert before.kind == after.kind
        assert after.costs.matmuls == before.costs.matmuls, before.kind
        assert after.costs.attention_bytes == before.costs.attention_bytes, before.kind
        if before.kind not in changed:  # the embedding and the update run eager
            assert after.costs == before.costs, before.kind
        for side, window in ((False, before), (True, after)):
            total[side] += window.costs.memory_bytes
    assert total[True] < total[False]


def test_a_block_split_over_tp1_with_dropout_is_priced_region_by_region():
    """Collectives and attention's seeded dropout break the block's graph: each region between
    them is priced, and together they fuse what eager runs op by op: fewer bytes both ways,
    fewer kernels forward, never more. (Backward, where a bias is its matmul's, the regions
    between the collectives are left as many kernels as eager runs, of fewer bytes.)"""
    engine, kernel = _engine("--tensor_parallel_1", "2", "--dropout_prob", "0.1")
    changes = phase_changes(engine, kernel, "cpu")
    for kind in (schedule.LAYER_FORWARD, schedule.LAYER_BACKWARD):
        assert changes[kind].memory_bytes < 0 and changes[kind].kernels <= 0, changes[kind]
    assert changes[schedule.LAYER_FORWARD].kernels < 0


def test_a_changed_window_counts_its_micro_batches():
    engine, kernel = _engine("--recompute", "full")
    changes = phase_changes(engine, kernel, "cpu")
    eager = meta_step(engine.plan, engine.layout, kernel, Measurements())
    compiled = meta_step(engine.plan, engine.layout, kernel, Measurements(), compiled_on="cpu")
    for before, after in zip(eager.windows, compiled.windows, strict=True):
        change = changes.get(before.kind, CostChange())
        expected = dataclasses.replace(
            before.costs,
            kernels=before.costs.kernels + before.micro_batches * change.kernels,
            memory_bytes=before.costs.memory_bytes + before.micro_batches * change.memory_bytes,
        )
        assert after.costs == expected, before.kind
        if before.kind in (schedule.LAYER_FORWARD, schedule.LAYER_BACKWARD):
            assert before.micro_batches == 2
