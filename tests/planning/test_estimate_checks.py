"""The invariants every step estimate holds (execution/planning/estimate_checks.py), against
hand computations and the planner's exact count of host traffic: a figure that breaks one is
raised as an internal error naming it, never printed."""

from __future__ import annotations

import dataclasses
import itertools
import shlex

import pytest

from execution.engine.storage.buffers import DTYPES
from execution.planning.device_specs import SPECS
from execution.planning.estimate_checks import (
    EstimateError,
    check_mfu,
    check_step,
    mfu_ceiling,
    placement_link_floor,
)
from execution.planning.planner import candidate_plans
from execution.planning.run_shape import RunShape
from execution.planning.time_model import PHASE_COSTS, estimate_step
from execution.training.entry import run_entry_point
from tests.distributed import small_config

H100 = SPECS["h100_sxm"]


def _costs(**values: float) -> tuple:
    return tuple(values.get(name, 0.0) for name in PHASE_COSTS)


def test_a_negative_cost_is_an_internal_error_naming_it():
    """A phase that gives back more time than it spends is a bug in what priced it."""
    phases = {"layer_forward": _costs(matmul_s=1.0, memory_bound_s=-0.5)}
    with pytest.raises(EstimateError, match=r"'layer_forward': memory_bound_s is -0\.5"):
        estimate_step(phases, 1, 1, H100)


def test_rounding_below_zero_is_zero_not_an_error():
    """A linear combination of probes leaves a cost that is 0 by construction a few ulps either
    side of it: set to 0 (-1e-15 s of a 1 s step is 1e-15 of it, far below 1e-9)."""
    phases = {"layer_forward": _costs(matmul_s=1.0, memory_bound_s=-1e-15)}
    estimate = estimate_step(phases, 1, 1, H100)
    assert estimate["memory_bound_s"] == 0.0
    assert estimate["step_time_s"] == 1.0


def test_a_step_shorter_than_its_compute_is_an_internal_error():
    figures = {"step_time_s": 1.0, "compute_s": 2.0, "by_kind": {"layer_forward": 1.0}}
    with pytest.raises(EstimateError, match="shorter than its compute"):
        check_step(figures)
    figures = {"step_time_s": 1.0, "compute_s": 0.5, "exposed_comm_s": -0.1, "by_kind": {}}
    with pytest.raises(EstimateError, match=r"exposed_comm_s is -0\.1"):
        check_step(figures)


def test_the_mfu_ceiling_is_the_faster_of_matmuls_and_attention_on_the_models_count():
    """H100 data sheet: matmuls at 0.7 of the peak, attention at 0.25 on the FLOPs a causal
    kernel executes, half of MFU's whole square, so 0.5 on MFU's count: the ceiling is 0.7. An
    A100's attention at 0.5 is 1.0 on MFU's count, above its matmuls' 0.7 (a 32k context
    spends most of its FLOPs there). A calibrated spec's fastest matmul sets its own: 693 of
    989 TFLOPS. Without fused attention, matmuls alone."""
    assert mfu_ceiling(H100, model_attention_flops=2.0, run_attention_flops=1.0) == 0.7
    assert mfu_ceiling(SPECS["a100_80gb"], 2.0, 1.0) == 1.0
    measured = dataclasses.replace(H100, matmul_tflops=((4096, 4096, 4096, 693.0), (8, 8, 8, 1.0)))
    assert mfu_ceiling(measured, 2.0, 1.0) == 693.0 / 989.0
    assert mfu_ceiling(H100, 2.0, 0.0) == 0.7
    check_mfu(0.7, 0.7)
    with pytest.raises(EstimateError, match=r"MFU 441\.6% exceeds the device's calibrated 70\.0%"):
        check_mfu(4.416, 0.7)


def test_the_link_floor_is_at_most_what_the_engine_copies():
    """For every placement the floor (weights once a pass in 16 bits, gradients once, x once
    per micro-batch and layer boundary) stays at or below the planner's exact count of what the
    engine copies (``plan.traffic``, which tests/planning/test_planner.py holds to the engine's own
    counters), and is 0 only with every state on the device."""
    flags = "--global_batch_size 6 --micro_batch_size 2 --layers 3 --precision bfloat16"
    floors = {}
    for where in itertools.product(("device", "host"), repeat=3):
        states = zip(("weights", "grads", "activations"), where, strict=True)
        places = " ".join(f"--{state}_placement {place}" for state, place in states)
        run = RunShape.of(small_config(*shlex.split(f"{flags} --passes 3 {places}")))
        plan = candidate_plans(run, "cuda")[0]
        itemsize = DTYPES[run.precision].itemsize
        x_bytes = 2 * run.sequence_length * run.model.hidden * itemsize
        floor = placement_link_floor(plan, itemsize, run.gradient_accumulation, 4, x_bytes)
        assert floor <= plan.traffic, (where, floor, plan.traffic)
        floors[where] = floor
    for where, floor in floors.items():  # nothing crosses the link only with nothing hosted
        assert (floor > 0) == ("host" in where), where


def test_an_estimate_error_is_not_turned_into_a_bad_input_exit():
    """The entry point answers the user's mistakes in one line with exit 2; a broken invariant
    is the program's, and leaves as the error it is."""

    def main(job) -> None:
        raise EstimateError("phase 'layer_forward': memory_bound_s is -635, below 0")

    with pytest.raises(EstimateError, match="memory_bound_s"):
        run_entry_point(main, "run_pretraining.py")
