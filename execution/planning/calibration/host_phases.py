"""The host's own time per phase: the engine's real phases on kernels that cost nothing, one of
the calibration's measurements (``host_phases``) and ``benchmarks/host_time.py``'s table.

A preset's model as its structure makes it (heads and key/value heads, norms, MLP, rotary
positions, dropout, tied or untied head), at widths where every kernel costs next to nothing:
heads :data:`HEAD_WIDTH` wide, an MLP four times the width, a vocabulary of
:data:`VOCABULARY`, one 8-token sequence per micro-batch, resident, one pass. What a phase
then takes is its host's time: Python, dispatch and launches, binding a layer's weights, the
compiled regions' wrappers, the masks' generators (and on a CPU, each kernel's own
microseconds and, with more than one thread, waking the others for it). Each phase is clocked
at its start (the engine's ``on_phase`` hook) on the wall clock; a step in which the
scheduler kept one of the process's threads waiting (another process took its core: its
``schedstat``, :mod:`utils.sample_clock`), or the hypervisor kept the machine's cores (its
steal), is taken again, up to three times as many. Two steps of 2 and 8 micro-batches (2
and 4 layers) in turn, each kind of phase fitted as ``per phase + micro-batches x per
micro-batch`` and the update as ``fixed + rows x per row``. The calibration measures each way
of running in passes apart in time until two agree (:func:`host_phase_rows`).

The calibration takes the measurement at its own model (:func:`host_phase_rows`) and writes it
into the device spec (``host_phase_us``), with the kernels the dry run counts for each kind,
so that the time model prices each phase's host time on the host calibrated.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from config.loading import parse_config
from execution.engine.engine import StepHooks
from execution.engine.phases.recompute import attention_kernel
from execution.engine.storage.buffers import DTYPES
from execution.parallel.mesh import ParallelLayout
from execution.planning.device_specs import DeviceSpec
from execution.planning.measure import meta_step
from execution.planning.op_costs import device_seconds
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape
from utils.sample_clock import EXTRA_SAMPLES, SPOILED_SHARE, run_delays, stolen_s

# Each head this wide: a CPU's kernels then cost microseconds; a GPU's attention kernels need
# a head of 8 at least (FlashAttention's alignment).
HEAD_WIDTH = {"cpu": 2, "cuda": 8}
VOCABULARY = 256
SEQUENCE = 8
# (layers, micro-batches) of the two steps each measurement takes in turn: micro-batches
# separate a phase's own time from its micro-batches', layers the update's rows.
SHAPES = ((2, 2), (4, 8))
WARM_UP = 2  # steps not timed: the first allocates, and compiles (--compile)
UPDATE = "optimizer"  # the window after the phases: norm, clipping, the update
LAYER_KINDS = ("layer_forward", "layer_backward")


def shrunk_flags(preset: str, device_type: str) -> list[str]:
    """The flags of ``preset``'s model at widths where each kernel costs next to nothing (its
    heads, key/value heads, norms, MLP, positions, dropout and head as the preset has them)."""
    model = parse_config(["--config", preset])[0].model
    width = HEAD_WIDTH[device_type]
    hidden = model.heads * width
    flags = ["--config", preset, "--hidden_size", str(hidden), "--head_dim", "0"]
    flags += ["--intermediate_size", str(4 * hidden), "--vocab_size", str(VOCABULARY)]
    flags += ["--sequence_length", str(SEQUENCE), "--max_positional_length", str(SEQUENCE)]
    return flags


def run_flags(flags: list[str], device_type: str, compiled: bool, recompute: str) -> list[str]:
    """``flags`` as one measured run: one micro-batch of one sequence, resident, one pass;
    float32 on a CPU (its 16-bit kernels are slow emulations), the preset's precision on a
    GPU."""
    out = [*flags, "--micro_batch_size", "1", "--placement", "resident", "--passes", "1"]
    out += ["--compile", "true" if compiled else "false", "--recompute", recompute]
    out += ["--device", device_type, "--eval_every", "0"]
    if device_type == "cpu":
        out += ["--precision", "float32"]
    return out


class PhaseClock:
    """Each phase's host time in one step (the engine's ``on_phase`` hook): (kind,
    micro-batches, seconds), and the update's after the last phase."""

    def __init__(self, clock):
        self.clock = clock
        self.phases: list[tuple[str, int, float]] = []
        self._open: tuple[str, int, float] | None = None

    def on_phase(self, phase) -> None:
        now = self.clock()
        if self._open is not None:
            kind, micro_batches, started = self._open
            self.phases.append((kind, micro_batches, now - started))
        self._open = None if phase is None else (phase.kind, len(phase.micro_batches), now)
        if phase is None:
            self._open = (UPDATE, 0, now)

    def close(self, rows: int) -> None:
        """After the step: the update's window, counted in ``rows`` (the rows it updated)."""
        kind, _, started = self._open
        self.phases.append((kind, rows, self.clock() - started))
        self._open = None


def _clocked_step(engine, tokens, step: int, device: torch.device):
    """One training step's phases (kind, units, seconds), and whether none of the process's
    threads waited for a core meanwhile, nor the machine for its hypervisor
    (:data:`SPOILED_SHARE` of the step at most)."""
    phases = PhaseClock(time.perf_counter)
    before, stolen, started = run_delays(), stolen_s(), time.perf_counter()
    engine.train_step(tokens, step=step, lr=1e-4, hooks=StepHooks(on_phase=phases.on_phase))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    phases.close(len(engine.state.part_rows()))
    wall, after = time.perf_counter() - started, run_delays()
    waited = sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9
    waited += stolen_s() - stolen
    return waited <= SPOILED_SHARE * wall, phases.phases


def _fit(points: dict[int, list[float]]) -> tuple[float, float]:
    """``a + b n`` through the medians of the samples at each ``n`` (least squares), neither
    below 0 (a time or a count cannot be): a fit that says so puts it all on the other."""
    ns = np.array(sorted(points), dtype=np.float64)
    medians = np.array([statistics.median(points[n]) for n in sorted(points)])
    if len(ns) == 1:
        return float(medians[0]), 0.0
    b, a = np.polyfit(ns, medians, 1)
    if a < 0:
        return 0.0, float(max(ns @ medians / (ns @ ns), 0.0))
    if b < 0:
        return float(medians.mean()), 0.0
    return float(a), float(b)


def _kernels(engine, device_type: str, spec: DeviceSpec | None):
    """The kernels of each phase the dry run counts for the engine's plan (eager, or the
    compiled parts' fused kernels), and their seconds on ``spec`` but for their launches (0
    without one), by kind and units (micro-batches, or the update's rows)."""
    plan = engine.plan
    kernel = attention_kernel(device_type, plan.model.dropout_prob, DTYPES[plan.precision])
    compiled = device_type if engine.compiled else None
    windows = meta_step(plan, ParallelLayout.shapes_only(1, 1, 1), kernel, compiled_on=compiled)
    counts, seconds = (defaultdict(lambda: defaultdict(list)) for _ in range(2))
    rows = len(engine.state.part_rows())
    for window in windows.windows:
        units = rows if window.kind == UPDATE else window.micro_batches
        counts[window.kind][units].append(window.costs.kernels)
        work = 0.0
        if spec is not None:
            unlaunched = dataclasses.replace(spec, launch_overhead_us=0.0)
            work = sum(device_seconds(window.costs, window.attention_flops, unlaunched).values())
        seconds[window.kind][units].append(work)
    return counts, seconds


def measure(
    flags: list[str],
    device: torch.device,
    steps: int,
    compiled: bool,
    recompute: str,
    spec: DeviceSpec | None = None,
):
    """The host's time of each kind of phase of the run ``flags`` describes (see
    :func:`run_flags`), and the kernels the dry run counts for it: per kind, ``per_phase_us``
    and ``per_unit_us`` (a unit: a micro-batch, or a row of the update), ``kernels_per_phase``
    and ``kernels_per_unit``, ``samples`` (the phases timed) and ``trusted`` (enough steps
    were clean of other processes). With ``spec`` (this machine's rates) on a CPU, whose
    cores run each kernel as they launch it, the kernels' own time as the spec prices it is
    taken out (``kernel_us_per_phase``, ``kernel_us_per_unit``): the time model adds it."""
    runs = []
    for layers, micro_batches in SHAPES:
        given = run_flags(flags, device.type, compiled, recompute)
        given += ["--layers", str(layers), "--global_batch_size", str(micro_batches)]
        config, _ = parse_config(given)
        engine = planned_engine(RunShape.of(config), ParallelLayout.single(device))
        plan = engine.plan
        row = plan.sequence_length + plan.model.label_columns
        shape = (plan.gradient_accumulation, plan.micro_batch_size, row)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCABULARY, shape, generator=generator).to(device)
        runs.append((engine, tokens))
    taken: dict[bool, list] = {True: [], False: []}  # the steps' phases, clean or not
    step = 0
    while len(taken[True]) < steps and step < WARM_UP + EXTRA_SAMPLES * steps:
        results = [_clocked_step(engine, tokens, step, device) for engine, tokens in runs]
        step += 1  # in turn: a drifting machine slows both alike
        if step > WARM_UP:
            taken[all(ok for ok, _ in results)].append([phases for _, phases in results])
    trusted = len(taken[True]) >= max(1, (steps + 1) // 2)  # else every step, spoiled or not
    times: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for both in taken[True] if trusted else taken[True] + taken[False]:
        for kind, units, seconds in (phase for phases in both for phase in phases):
            times[kind][units].append(seconds)
    counts, work = (defaultdict(lambda: defaultdict(list)) for _ in range(2))
    kernel_work = spec if device.type == "cpu" else None  # a GPU runs its kernels behind
    for engine, _ in runs:
        measured = _kernels(engine, device.type, kernel_work)
        for into, by_kind in zip((counts, work), measured, strict=True):
            for kind, by_units in by_kind.items():
                for units, values in by_units.items():
                    into[kind][units] += values
    out = {}
    for kind, by_units in times.items():
        per_phase, per_unit = _fit(by_units)
        kernels_per_phase, kernels_per_unit = _fit(counts[kind])
        kernel_phase, kernel_unit = _fit(work[kind])
        out[kind] = {
            "per_phase_us": max(per_phase - kernel_phase, 0.0) * 1e6,
            "per_unit_us": max(per_unit - kernel_unit, 0.0) * 1e6,
            "kernel_us_per_phase": kernel_phase * 1e6,
            "kernel_us_per_unit": kernel_unit * 1e6,
            "kernels_per_phase": kernels_per_phase,
            "kernels_per_unit": kernels_per_unit,
            "samples": sum(len(v) for v in by_units.values()),
            "trusted": trusted,
        }
    return out


# The model a calibration measures: GPT-3's structure (learned positions, layer norms, GELU,
# a tied head); its kernels' count carries the time to other structures (time_model.py).
CALIBRATED_WIDTH = "gpt3_1.3B"


# Two passes of one way agree when their totals (:func:`pass_total`) differ by at most this
# share of the smaller: two idle calibrations' passes differ by up to 10%, and one made under
# a slowdown its own threads' waits do not show (the hypervisor's, or one that had ended)
# priced the host 40% higher than the machine's runs then took.
AGREEMENT = 0.15
MAX_PASSES = 4
TOTAL_UNITS = 8  # micro-batches (the update: rows) of each phase a pass's total counts


def pass_total(kinds: dict) -> float:
    """One pass's host time of a step whose every kind of phase runs once, for
    :data:`TOTAL_UNITS` units, in microseconds: what two passes of a way are compared on."""
    return sum(m["per_phase_us"] + TOTAL_UNITS * m["per_unit_us"] for m in kinds.values())


def agreeing_passes(passes: list[dict]) -> tuple[list[dict], float]:
    """The two passes whose totals are closest, and how far apart (a share of the smaller)."""
    totals = [pass_total(p) for p in passes]
    spreads = [
        (abs(totals[i] - totals[j]) / max(min(totals[i], totals[j]), 1e-9), i, j)
        for i in range(len(passes))
        for j in range(i + 1, len(passes))
    ]
    spread, i, j = min(spreads)
    return [passes[i], passes[j]], spread


def mean_kinds(passes: list[dict]) -> dict:
    """Each kind's fields as the mean of ``passes``' (``trusted`` if every pass was)."""
    out = {}
    for kind, first in passes[0].items():
        each = [p[kind] for p in passes]
        fields = {key: statistics.fmean(m[key] for m in each) for key in first if key != "trusted"}
        out[kind] = fields | {"trusted": all(m["trusted"] for m in each)}
    return out


def host_phase_rows(device: torch.device, steps: int, runs, spec: DeviceSpec) -> dict:
    """The host's time per kind of phase of :data:`CALIBRATED_WIDTH`'s model, each way it can
    run among ``runs`` ((compiled, recompute, dropout probability)): ``rows`` for
    ``DeviceSpec.host_phase_us``, and ``runs``, the measurements by way. A compiled way is
    left out where ``torch.compile`` cannot run (``why`` says so). ``spec``: this machine's
    rates, by which a CPU's kernels' own time is taken out (:func:`measure`).

    Each way is measured in passes over all ways, so that a way's passes lie apart in time,
    until two of its passes agree (:data:`AGREEMENT`), :data:`MAX_PASSES` at most; its
    measurement is their mean. Where none agree, the closest two's, marked not to be trusted
    (the calibration's load warning counts it)."""
    from execution.engine.phases.compiled import compile_unavailable

    flags = shrunk_flags(CALIBRATED_WIDTH, device.type)
    why = None
    ways = []
    for compiled, recompute, dropout in runs:
        if compiled and (why := compile_unavailable(device.type)) is not None:
            continue
        ways.append((compiled, recompute, dropout))
    passes: dict[tuple, list[dict]] = {way: [] for way in ways}
    settled: dict[tuple, tuple[list[dict], float]] = {}
    for round_ in range(MAX_PASSES):
        for way in (w for w in ways if w not in settled):
            compiled, recompute, dropout = way
            given = [*flags, "--dropout_prob", str(dropout)]
            passes[way].append(measure(given, device, steps, compiled, recompute, spec))
            if round_ > 0:
                closest, spread = agreeing_passes(passes[way])
                if spread <= AGREEMENT or round_ == MAX_PASSES - 1:
                    settled[way] = closest, spread
        if len(settled) == len(ways):
            break
    rows, measured = [], []
    for way in ways:
        compiled, recompute, dropout = way
        closest, spread = settled[way]
        kinds = mean_kinds(closest)
        agreed = spread <= AGREEMENT and all(m["trusted"] for m in kinds.values())
        measured.append(
            {
                "compiled": compiled,
                "recompute": recompute,
                "dropout": dropout,
                "kinds": kinds,
                "pass_totals_us": [pass_total(p) for p in passes[way]],
                "timing": {"trusted": agreed, "spread": spread},
            }
        )
        for kind, m in kinds.items():
            times = (m["per_phase_us"], m["per_unit_us"])
            kernels = (m["kernels_per_phase"], m["kernels_per_unit"])
            rows.append([compiled, recompute, dropout > 0, kind, *times, *kernels])
    return {"rows": rows, "runs": measured, "why": why}
