"""One memory budget: the dry run, ``--plan_for`` and a real run accept the same plans, a GPU's
leaves free what a run allocates outside its plan, and the gpt3_1.3B auto plan keeps its
weights on an H100 where they fit and streaming is not faster."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from config.loading import ConfigError, parse_config
from execution.engine.phases.recompute import attention_kernel
from execution.engine.plan import GiB, Placement
from execution.planning import memory
from execution.planning.memory import (
    MemoryBudget,
    RankShape,
    measure_budget,
    plan_budget,
    spec_budget,
)
from execution.planning.plan_ranking import step_seconds
from execution.planning.planner import advisory_plans, choose, measured_plans
from execution.planning.run_shape import RunShape

MiB = 1 << 20
# What gpt3_1.3B (bf16: the flash kernel; micro-batches of 4 x 2048 tokens, 16 heads of 128)
# allocates on an H100 outside its plan: two cuBLAS workspaces of 32 MiB (torch's default on
# Hopper), and the flash backward's dq_accum, 4 x 2048 x 16 x 128 float32 (64 MiB), and
# softmax_d, 4 x 16 x 2048 float32 (0.5 MiB).
RESERVE = 2 * 32 * MiB + 64 * MiB + MiB // 2


def _h100(*flags: str) -> RunShape:
    config, _ = parse_config(["--config", "gpt3_1.3B", "--device_spec", "h100_sxm", *flags])
    return RunShape.of(config)


def _real_run_budget(monkeypatch, run, free_gib: float, node_host_gib: float, processes: int):
    """What a real run on a GPU measures, with the free device and host memory mocked."""
    free, total = int(free_gib * GiB), int(80 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(memory, "_host_memory_available", lambda: int(node_host_gib * GiB))
    return measure_budget(run, torch.device("cuda", 0), processes)


def test_the_dry_run_budgets_as_a_real_run_on_an_idle_device(monkeypatch):
    """An H100 of the spec: 79 GiB a process can allocate, 128 GiB of host per device. A real
    run with 79 GiB free, on a node of 8 such devices and 8 processes, plans with 90% of each,
    less on the device the workspaces the run allocates outside its plan: 71.1 GiB - 128.5 MiB
    of device and 115.2 GiB of host memory; so does the dry run."""
    run = _h100()
    dry = spec_budget(run, run.spec)
    real = _real_run_budget(monkeypatch, run, 79, 8 * 128, 8)
    assert dry == real == MemoryBudget(int(0.9 * 79 * GiB) - RESERVE, int(0.9 * 128 * GiB))
    # The flags are budgets already: taken as given by both, with no headroom, but what the
    # run allocates outside its plan still comes out of the device's.
    flagged = _h100("--device_memory_gb", "40", "--host_memory_gb", "100")
    dry = spec_budget(flagged, flagged.spec)
    real = _real_run_budget(monkeypatch, flagged, 79, 8 * 128, 8)
    assert dry == real == MemoryBudget(40 * GiB - RESERVE, 100 * GiB)


def test_a_gpu_budget_leaves_the_workspaces_free():
    """The device budget is what is available, less the headroom, less what the run allocates
    outside its plan: the cuBLAS workspaces and one attention backward's, which follows the
    kernel and a rank's share of the heads. In float32 the memory-efficient kernel's: per
    micro-batch row and head its dQ accumulator (2048 x 128 floats and a 16-byte header per
    32 x 32 tile: 64 x 4 of them) and 2 x 2048 floats of delta. A CPU reserves nothing."""
    free, host = int(79 * GiB), int(128 * GiB)
    budget = plan_budget(_h100(), free, host, device_type="cuda")
    assert budget.device == int(0.9 * free) - RESERVE
    efficient = 4 * 16 * (2048 * 128 + 4 * 64 * 4 + 2 * 2048) * 4
    float32 = plan_budget(_h100("--precision", "float32"), free, host, device_type="cuda")
    assert float32.device == int(0.9 * free) - 2 * 32 * MiB - efficient
    halved = plan_budget(_h100("--tensor_parallel_1", "2"), free, host, device_type="cuda")
    assert halved.device == int(0.9 * free) - 2 * 32 * MiB - (RESERVE - 2 * 32 * MiB) // 2
    cpu = plan_budget(_h100(), free, host, device_type="cpu")
    assert cpu.device == int(0.9 * free) and cpu.host == budget.host


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_the_dry_run_and_a_real_run_accept_the_same_plans(monkeypatch):
    """gpt3_1.3B's plans: those that fit the spec's whole memory but not a real run's budget
    (within 10% and the workspaces of the 79 GiB device, or 10% of the 128 GiB host, such as
    everything on the device in 2 passes of 64 micro-batches with full recompute, 77.1 GiB of
    device memory) are refused by both the dry run and a real run, and both choose the same
    plan."""
    run = _h100()
    plans = measured_plans(run, "cuda")
    dry = spec_budget(run, run.spec)
    real = _real_run_budget(monkeypatch, run, 79, 8 * 128, 8)
    whole = MemoryBudget(79 * GiB, 128 * GiB)  # the spec's memory with no headroom
    refused = [p for p in plans if whole.fits(p) and not real.fits(p)]
    assert refused, "the example needs plans between the two budgets"
    for plan in refused:  # in the last 10% and the workspaces of the device, or 10% of the host
        device, host = plan.bytes_on("device")["total"], plan.bytes_on("host")["total"]
        assert device > 71.1 * GiB - RESERVE or host > 115.2 * GiB
    resident = Placement("device", "device", "device")
    everything = [p for p in refused if (p.placement, p.recompute) == (resident, "full")]
    assert everything[-1].passes == 2
    assert round(everything[-1].bytes_on("device")["total"] / GiB, 1) == 77.1
    assert [dry.fits(p) for p in plans] == [real.fits(p) for p in plans]
    assert choose(run, dry, on_miss="least").plan == choose(run, real).plan


def test_gpt3_1_3b_keeps_its_weights_on_an_h100():
    """With the budget a real run has (71.1 GiB less 128.5 MiB), everything resident in 128 passes of one
    micro-batch no longer fits. Streaming the weights in those passes would (60.3 GiB), and
    its copies (658 GiB a step) fit behind the step's compute as a whole, but not behind the
    forward's: it loads every layer's bf16 weights and the embedding's once per pass,
    128 x 2 x (24 (12 h^2 + 13 h) + (50304 + 2048) h) bytes = 336.8 GB, 6.12 s at 55 GB/s,
    against a third of the step's 6 N + 12 L h S FLOPs a token, 4.60 s at 70% of 989
    TFLOPS. The planner keeps the weights on the device and keeps what fits of the
    activations instead (selective recompute)."""
    run = _h100()
    budget = spec_budget(run, run.spec)
    choice = choose(run, budget, on_miss="least")
    plan, fits = choice.plan, choice.fits
    assert fits and plan.placement == Placement("device", "device", "device")
    assert plan.traffic == 0 and plan.bytes_on("device")["total"] <= budget.device

    h, layers, tokens = 2048, 24, 512 * 2048
    parameters = layers * (12 * h * h + 13 * h) + (50304 + 2048) * h + 2 * h
    forward_copies = 128 * 2 * (parameters - 2 * h) / 55e9
    forward_compute = (6 * parameters + 12 * layers * h * 2048) * tokens / 3 / (989e12 * 0.7)
    assert forward_copies == pytest.approx(6.12, abs=0.01)
    assert forward_compute == pytest.approx(4.60, abs=0.01)

    streamed = next(
        p
        for p in advisory_plans(run, "cuda")
        if p.placement == Placement("host", "device", "device")
        and (p.passes, p.recompute) == (128, "none")
    )
    assert budget.fits(streamed) and streamed.traffic / GiB == pytest.approx(657.8, abs=0.1)
    rank = RankShape.of(run)
    kernel = attention_kernel("cuda", 0.1, rank.dtype)
    # Forward: its copies; backward: its compute (twice the forward's; nothing recomputed),
    # behind which its own copies hide; the optimizer: the float32 gradients to the host.
    by_hand = forward_copies + 2 * forward_compute + 4 * parameters / 55e9
    streaming = step_seconds(run, rank, kernel, streamed)
    assert streaming == pytest.approx(by_hand, rel=1e-3)
    assert streaming > step_seconds(run, rank, kernel, plan)


def test_device_memory_flag_on_a_cpu_run_is_one_line_not_ignored():
    """On the CPU the device is the host: --device_memory_gb was silently ignored there."""
    with pytest.raises(ConfigError, match="--device_memory_gb 40 does not apply to a run on"):
        measure_budget(_h100("--device_memory_gb", "40"), torch.device("cpu"), 1)
    assert measure_budget(_h100(), torch.device("cpu"), 1).device is None


def _h200(*flags: str) -> RunShape:
    config, _ = parse_config(["--config", "gpt3_1.3B", "--device_spec", "h200", *flags])
    return RunShape.of(config)


def test_a_device_memory_cap_plans_as_the_smaller_device(monkeypatch):
    """--device_memory_cap_gb 79 on an H200 (139 GiB) budgets as the H100 spec (79 GiB): 90%
    of 79 GiB less the workspaces, in the dry run and in a real run with 139 GiB free. A cap
    above what is free changes nothing; with --device_memory_gb the lesser of the two."""
    h100 = spec_budget(_h100(), _h100().spec)
    capped = _h200("--device_memory_cap_gb", "79")
    assert h100.device == int(0.9 * 79 * GiB) - RESERVE
    assert spec_budget(capped, capped.spec).device == h100.device
    assert _real_run_budget(monkeypatch, capped, 139, 128, 1).device == h100.device
    loose = _h200("--device_memory_cap_gb", "200")
    assert spec_budget(loose, loose.spec) == spec_budget(_h200(), _h200().spec)
    both = _h200("--device_memory_cap_gb", "79", "--device_memory_gb", "40")
    assert spec_budget(both, both.spec).device == 40 * GiB - RESERVE


def test_a_device_memory_cap_changes_the_plan():
    """gpt3_1.3B keeps everything on an H200. Capped at 24 GiB it cannot: its float32 weights,
    gradients and two AdamW moments alone are 16 bytes x 1.32e9 parameters = 19.6 GiB of the
    24 x 0.9 GiB less the workspaces; the planner moves state to the host and the plan fits
    the cap."""
    free = _h200()
    chosen = choose(free, spec_budget(free, free.spec), on_miss="least")
    plan, fits = chosen.plan, chosen.fits
    assert fits and plan.placement == Placement("device", "device", "device")
    capped = _h200("--device_memory_cap_gb", "24")
    budget = spec_budget(capped, capped.spec)
    assert budget.device == int(0.9 * 24 * GiB) - RESERVE
    chosen = choose(capped, budget, on_miss="least")
    small, fits = chosen.plan, chosen.fits
    assert fits and "host" in dataclasses.astuple(small.placement)
    assert small.bytes_on("device")["total"] <= budget.device < plan.bytes_on("device")["total"]


def test_a_device_memory_cap_limits_the_allocator(monkeypatch):
    """A real run on a GPU makes the cap the caching allocator's limit (the fraction of the
    device's memory it may hold: 79 of 139 GiB); on a CPU the flag is one line, not ignored."""
    fractions = []
    props = type("Props", (), {"total_memory": 139 * GiB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f)
    )
    memory.cap_device_memory(_h200("--device_memory_cap_gb", "79"), torch.device("cuda", 0))
    memory.cap_device_memory(_h200(), torch.device("cuda", 0))  # no cap: the allocator's own
    assert fractions == [pytest.approx(79 / 139, rel=1e-12)]
    with pytest.raises(ConfigError, match="--device_memory_cap_gb 79 does not apply to a run"):
        measure_budget(_h200("--device_memory_cap_gb", "79"), torch.device("cpu"), 1)
