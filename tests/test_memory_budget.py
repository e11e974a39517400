"""One memory budget: the dry run, ``--plan_for`` and a real run accept the same plans."""

from __future__ import annotations

import torch

from config.loading import parse_config
from execution.engine.plan import GiB, Placement
from execution.planning import memory
from execution.planning.device_specs import resolve_spec
from execution.planning.memory import MemoryBudget, measure_budget, spec_budget
from execution.planning.planner import candidate_plans, choose_or_least, choose_plan


def _h100(*flags: str):
    config, _ = parse_config(["--config", "gpt3_1.3B", "--device_spec", "h100_sxm", *flags])
    return config


def _real_run_budget(monkeypatch, config, free_gib: float, node_host_gib: float, processes: int):
    """What a real run on a GPU measures, with the free device and host memory mocked."""
    free, total = int(free_gib * GiB), int(80 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(memory, "_host_memory_available", lambda: int(node_host_gib * GiB))
    return measure_budget(config, torch.device("cuda", 0), processes)


def test_the_dry_run_budgets_as_a_real_run_on_an_idle_device(monkeypatch):
    """An H100 of the spec: 79 GiB a process can allocate, 128 GiB of host per device. A real
    run with 79 GiB free, on a node of 8 such devices and 8 processes, plans with 90% of each:
    71.1 GiB of device and 115.2 GiB of host memory; so does the dry run now."""
    config = _h100()
    dry = spec_budget(config, resolve_spec(config))
    real = _real_run_budget(monkeypatch, config, 79, 8 * 128, 8)
    assert dry == real == MemoryBudget(int(0.9 * 79 * GiB), int(0.9 * 128 * GiB))
    # The flags are budgets already: taken as given by both, with no headroom.
    flagged = _h100("--device_memory_gb", "40", "--host_memory_gb", "100")
    dry = spec_budget(flagged, resolve_spec(flagged))
    real = _real_run_budget(monkeypatch, flagged, 79, 8 * 128, 8)
    assert dry == real == MemoryBudget(40 * GiB, 100 * GiB)


def test_the_dry_run_and_a_real_run_accept_the_same_plans(monkeypatch):
    """gpt3_1.3B's plans: those the dry run used to accept with the spec's whole memory but a
    real run refuses (within 10% of the 79 GiB device or 128 GiB host, such as keeping every
    layer's activations in 128 passes, 75.0 GiB of device memory) are refused by both now,
    and both choose the same plan."""
    config = _h100()
    plans = candidate_plans(config, "cuda")  # with the working sets measured
    dry = spec_budget(config, resolve_spec(config))
    real = _real_run_budget(monkeypatch, config, 79, 8 * 128, 8)
    whole = MemoryBudget(79 * GiB, 128 * GiB)  # what the dry run used to allow
    refused = [p for p in plans if whole.fits(p) and not real.fits(p)]
    assert refused, "the example needs plans between the two budgets"
    for plan in refused:  # in the last 10% of the device or of the host
        device, host = plan.bytes_on("device")["total"], plan.bytes_on("host")["total"]
        assert device > 71.1 * GiB or host > 115.2 * GiB
    resident = Placement("device", "device", "device")
    everything = [p for p in refused if (p.placement, p.recompute) == (resident, "none")]
    assert everything[-1].passes == 128
    assert round(everything[-1].bytes_on("device")["total"] / GiB, 1) == 75.0
    assert [dry.fits(p) for p in plans] == [real.fits(p) for p in plans]
    assert choose_or_least(config, dry)[0] == choose_plan(config, "cuda", real)
