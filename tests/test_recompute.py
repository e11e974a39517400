"""--recompute full, selective and none compute the same step, keep exactly the bytes planned
for them, and the planner weighs what they recompute against what they keep."""

from __future__ import annotations

import shlex

import pytest

from execution.checkpoint.logical import full_state
from execution.engine.recompute import attention_kernel
from execution.parallel.mesh import ParallelLayout
from execution.planning.measure import recompute_flops
from execution.planning.memory import MemoryBudget, RankShape, host_traffic
from execution.planning.plan_ranking import step_seconds
from execution.planning.planner import candidate_plans, choose_plan
from execution.planning.step_meter import StepMeter
from tests.distributed import (
    CPU,
    assert_states_close,
    global_batches,
    planned_engine,
    replica_batch,
    small_config,
)

MODES = ("full", "selective", "none")
STEPS = 3
TOLERANCE = 1e-6
# float32, dropout 0.1 (the masks must agree), 2 passes of 2 micro-batches.
FLAGS = shlex.split(
    "--precision float32 --dropout_prob 0.1 --passes 2 --global_batch_size 8 --micro_batch_size 2"
)


def _train(config) -> dict:
    engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, STEPS)
    flops = []
    results = []
    for s in range(STEPS):
        engine.state.host_to_device = engine.state.device_to_host = 0
        with StepMeter() as meter:
            results.append(engine.train_step(replica_batch(config, batches[s], 0), s, 2e-3))
        flops.append(meter.flops)
    return {
        "engine": engine,
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "grads": full_state(engine, "grads"),
        "weights": full_state(engine, "weights"),
        "exp_avg_sq": full_state(engine, "exp_avg_sq"),
        "flops": flops[-1],
        "copied": engine.state.host_to_device + engine.state.device_to_host,
    }


@pytest.mark.parametrize("placement", ["resident", "remote"])
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_recompute_modes_agree_and_keep_exactly_what_was_planned(placement):
    """Over 3 steps, selective and none give full's losses, norms, gradients, weights and
    moments within 1e-6; each allocates the bytes planned, fills each layer's entry exactly
    (the measured bytes are the ones the kernels save), copies over the host link exactly the
    bytes the planner counted, and saves exactly the FLOPs the planner counted per mode."""
    runs = {}
    for mode in MODES:
        config = small_config(*FLAGS, "--placement", placement, "--recompute", mode)
        runs[mode] = run = _train(config)
        engine, plan = run["engine"], run["engine"].memory
        assert plan.recompute == mode
        assert engine.buffer_bytes() == plan.state_bytes
        if mode != "full":
            assert plan.kept > 0 and engine.kept.overflow == 0
            assert engine.kept.largest == plan.kept
        rank = RankShape.from_config(config)
        kept = rank.kept(mode, attention_kernel("cpu", 0.1))
        entries = plan.micro_batches_per_pass
        want = host_traffic(rank, plan.placement, plan.passes, entries, kept)
        assert run["copied"] == want, (mode, run["copied"], want)
    reference = runs["full"]
    for mode in ("selective", "none"):
        run = runs[mode]
        for key in ("losses", "norms"):
            for got, ref in zip(run[key], reference[key], strict=True):
                assert abs(got - ref) <= TOLERANCE * abs(ref), (mode, key, got, ref)
        for state in ("grads", "weights", "exp_avg_sq"):
            assert_states_close(run[state], reference[state], TOLERANCE, f"{mode} {state}")
    # The backward recomputes the layer (full), its attention core (selective) or nothing.
    rank = RankShape.from_config(small_config(*FLAGS, "--placement", placement))
    layers, micro_batches = rank.shapes.layers, rank.gradient_accumulation
    for mode in ("full", "selective"):
        extra = runs[mode]["flops"] - runs["none"]["flops"]
        assert extra == layers * micro_batches * recompute_flops(rank, mode, "math") > 0
    assert runs["full"]["flops"] > runs["selective"]["flops"] > runs["none"]["flops"]
    kept = {mode: runs[mode]["engine"].memory.kept for mode in MODES}
    assert kept["full"] == 0 < kept["selective"] < kept["none"]


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_auto_weighs_recompute_against_memory_and_the_host_link():
    """With room on a CPU device (no link), auto keeps everything (least compute); when the
    kept bytes would cross a GPU's host link, it recomputes in full (a tiny model's compute
    costs less than its activations' copies); and what it picks is the fastest plan that
    fits by the planner's own estimate."""
    roomy = MemoryBudget(device=None, host=1 << 50)
    assert choose_plan(small_config(*FLAGS), "cpu", roomy).recompute == "none"
    hosted = small_config(*FLAGS, "--activations_placement", "host")
    gpu = MemoryBudget(device=1 << 40, host=1 << 40)
    plan = choose_plan(hosted, "cuda", gpu)
    assert plan.recompute == "full"
    rank = RankShape.from_config(hosted)
    kernel = attention_kernel("cuda", 0.1)
    plans = candidate_plans(hosted, "cuda")
    assert {p.recompute for p in plans} == set(MODES)
    assert step_seconds(hosted, rank, kernel, plan) == min(
        step_seconds(hosted, rank, kernel, p) for p in plans
    )
    # Only the device memory to hold full recompute's activations: auto must still fit.
    full = next(p for p in plans if p.recompute == "full" and p.passes == 2)
    tight = MemoryBudget(device=full.bytes_on("device")["total"], host=1 << 40)
    assert tight.fits(choose_plan(hosted, "cuda", tight))
