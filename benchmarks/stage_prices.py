"""The first run's stages priced before a GPU is lent, and the budget's plan of them.

A row's stage is priced as

    start + set-up + first step's compile + (warm-up + steps) x (dry run's step / est_over_meas)

with its set-up the host memory it holds (its plan's host state, at least its float32 weights,
which are drawn on the host, plus the process's own) at the committed rows' rate. Every
constant is read off the committed H200 results (:func:`committed_costs`), none is assumed:

- ``start_s``: a parity row's stage less its two steps (a process's start, CUDA, the data);
- ``compile_s``: a compiled row's first step less its median;
- ``setup_s_per_GiB``: an unprofiled row's stage less start, compile and steps, over its host
  memory (drawing the weights and registering the host pages, which the rows did not yet
  time apart; this run prints the two);
- ``est_over_meas``: the lowest of the dry run's estimates over the measured steps;
- ``fsdp2_over_ours``: FSDP2's step over ours on the same model and batch;
- the probe's, checks', parity's and calibration's stages as they took; the attention
  kernels' stage, which no committed run had, at :data:`ASSUMED_STAGE_S` until one records it.

The budget's plan takes the stages in order while their sum stays under the budget less
:data:`MARGIN`; a stage it leaves out runs only if the others leave it time.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path

from config.loading import parse_config
from execution.planning.dry_run import dry_run
from execution.planning.memory import HOST_HEADROOM
from execution.planning.run_shape import RunShape
from modelling.gpt import GPTShapes

GiB = 2**30
MARGIN = 0.10  # of the budget, left to what the prices miss (they take the worst committed rates)
LIMIT_FACTOR = 1.5  # a stage may take this much over its price before it is stopped
FIRST_RUN_STEPS = 3  # 1 warm-up + 2 timed: what the committed rows without each_step_s ran
# A stage no committed run had, priced until a run records it. The attention kernels' stage
# (calibrate_attention.py): a process that starts CUDA, as the probe's 4.7 s did, then 18
# cases of a warm-up call (cuDNN builds its plan, ~0.5 s assumed) and up to 30 calls of the
# committed 1.3B attention's ~2 ms (to 5 ms at 32 heads).
ASSUMED_STAGE_S = {"attention": 20.0}


@dataclass(frozen=True)
class Costs:
    """What a stage costs besides its steps, read off committed results (module docstring)."""

    start_s: float
    compile_s: float
    setup_s_per_GiB: float
    base_host_GiB: float  # a row process's own host memory (torch, CUDA), its plan aside
    est_over_meas: float
    fsdp2_over_ours: float
    stage_s: dict[str, float]

    def row_s(self, setup_GiB: float, compiled: bool, steps: int, step_s: float) -> float:
        first = self.compile_s if compiled else 0.0
        return self.start_s + setup_GiB * self.setup_s_per_GiB + first + steps * step_s


def committed_costs(results: list[dict]) -> Costs:
    """:class:`Costs` from first-run results files (their JSON)."""
    rows = [(r, run) for run in results for r in run["rows"] if "step_s" in r]
    seconds = {}
    for run in results:
        for name, stage in run["stages"].items():
            if "seconds" in stage:
                kind = name.split(":")[0]
                seconds[kind] = max(seconds.get(kind, 0.0), stage["seconds"])
    parity = [r for r, _ in rows if r["stage"].startswith("parity:")]
    start = max(_stage_s(r, results) - 2 * r["step_s"] for r in parity)
    compiles = [r["each_step_s"][0] - r["step_s"] for r, _ in rows if r.get("each_step_s")]
    compile_s = max(compiles)
    setups = []
    for r, _ in rows:
        unprofiled = r["stage"].startswith("row:") and r.get("h2d_GBps") is None
        if unprofiled and (r.get("host_rss_GiB") or 0) >= 8:
            steps = len(r.get("each_step_s") or ()) or FIRST_RUN_STEPS
            ours = "plan" in r  # ours compiled; the committed FSDP2 row ran eager
            rest = _stage_s(r, results) - start - compile_s * ours - steps * r["step_s"]
            setups.append(rest / r["host_rss_GiB"])
    ratios = [r["estimate"]["ratio"] for r, _ in rows if "estimate" in r and "row:" in r["stage"]]
    fsdp2 = []
    for r, run in rows:
        if r.get("key") == "fsdp2" and r["stage"].startswith("row:"):
            ours = [o for o in run["rows"] if o.get("key") == "streamed" and "step_s" in o]
            ours = [o for o in ours if o["flags"] == r["flags"]]
            fsdp2 += [r["step_s"] / o["step_s"] for o in ours]
    resident = [r["host_rss_GiB"] for r, _ in rows if r.get("key") == "resident"]
    return Costs(
        start_s=start,
        compile_s=compile_s,
        setup_s_per_GiB=max(setups),
        base_host_GiB=max(resident),
        est_over_meas=min(ratios),
        fsdp2_over_ours=max(fsdp2),
        stage_s=seconds,
    )


def _stage_s(row: dict, results: list[dict]) -> float:
    run = next(run for run in results if any(r is row for r in run["rows"]))
    return run["stages"][row["stage"]]["seconds"]


def dry_run_row(flags: list[str], spec_file: Path) -> dict:
    """The dry run's first rank for ``flags`` on the calibrated spec (its report muted)."""
    config, _ = parse_config([*flags, "--dry_run", "--device_spec_file", str(spec_file)])
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        rank = dry_run(RunShape.of(config), Path(tmp))["ranks"][0]
    return {
        "est_step_s": rank["step_time_s"],
        "mfu": rank["mfu"],
        "fits": rank["fits"],
        "why": rank["why"],
        "host_GiB": rank["host_bytes"]["total"] / GiB,
        "device_GiB": rank["device_bytes"]["total"] / GiB,
        "plan": rank["plan"],
        "tokens_per_step": config.tokens_per_step,
        "weights_GiB": 4 * GPTShapes.from_config(config.model).num_parameters / GiB,
        "compiles": config.execution.compile != "false",
    }


def choose_batch(flags: list[str], target: tuple[float, float], price) -> list[tuple[int, dict]]:
    """The batches of :data:`first_run_stages.BATCHES` priced in turn (``price(flags)``: the
    dry run, with ``predicted_step_s``) up to the smallest whose predicted step reaches
    ``target``'s low end, or the first that does not fit: the last is the choice, the others
    what the budget may take instead."""
    from benchmarks.first_run_stages import BATCHES

    tried = []
    for batch in BATCHES:
        priced = price([*flags, "--global_batch_size", str(batch)])
        tried.append((batch, priced))
        if not priced["fits"] or priced["predicted_step_s"] >= target[0]:
            break  # a larger batch only holds more, or takes longer still
    return tried


def batch_note(batch: int, priced: dict, target: tuple[float, float] | None) -> str:
    """What a row's batch gives: tokens and predicted step, against its target."""
    step = priced["predicted_step_s"]
    note = f"batch {batch} ({priced['tokens_per_step']:,} tokens a step): {step:.1f} s a step"
    if target:
        where = "in" if target[0] <= step <= target[1] else "outside"
        note += f", {where} the {target[0]:g}-{target[1]:g} s target"
    return note


def _priced_row(
    costs: Costs, batch: int | None, priced: dict, steps: int, target: tuple[float, float] | None
) -> dict:
    """A row's entry of the plan at ``batch``: its dry run's figures and its stage's price."""
    setup = max(priced["host_GiB"], priced["weights_GiB"]) + costs.base_host_GiB
    step = priced["predicted_step_s"]
    return {
        "batch": batch,
        **{k: priced[k] for k in ("est_step_s", "predicted_step_s", "mfu", "plan")},
        **{k: priced[k] for k in ("tokens_per_step", "device_GiB", "compiles")},
        "host_GiB": priced["host_GiB"] + costs.base_host_GiB,
        "est_s": costs.row_s(setup, priced["compiles"], steps, step),
        "note": batch_note(batch, priced, target) if batch else f"{step:.1f} s a step",
    }


def plan_budget(stages: list[dict], budget_s: float, margin: float = MARGIN) -> float:
    """Marks each stage ``planned`` in order while the planned prices sum to at most
    ``budget_s x (1 - margin)``. A stage that would pass it takes the largest of its
    ``smaller`` alternatives (a smaller batch) that fits, said in its note; one with none is
    left out (a later, cheaper one may still fit). Returns the planned sum."""
    room, total = budget_s * (1 - margin), 0.0
    for stage in stages:
        if total + stage["est_s"] > room:
            fitting = [a for a in stage.get("smaller", ()) if total + a["est_s"] <= room]
            if fitting:
                chosen = max(fitting, key=lambda a: a["batch"])
                was = stage["batch"]
                stage.update({k: v for k, v in chosen.items() if k != "note"})
                stage["note"] = f"{chosen['note']}; batch {was} would pass the budget"
        stage["planned"] = total + stage["est_s"] <= room
        total += stage["est_s"] if stage["planned"] else 0.0
    return total


def host_fits(host_GiB: float, available_GiB: float) -> bool:
    """Whether a plan's host memory fits what the planner would allow of ``available_GiB``."""
    return host_GiB <= available_GiB * (1 - HOST_HEADROOM)


def price_stages(results: list[dict], spec_file: Path, budget_s: float) -> dict:
    """Every stage of a real first run priced (rows by their dry runs on ``spec_file``, a
    targeted row's batch chosen), the budget's plan marked: what :data:`PLAN_FILE` holds."""
    from benchmarks.baselines import fsdp2_host_bytes
    from benchmarks.first_run_stages import row_by_name, stage_definitions

    costs = committed_costs(results)
    cache: dict[tuple[str, ...], dict] = {}

    def price(flags: list[str]) -> dict:
        if tuple(flags) not in cache:
            priced = dry_run_row(flags, spec_file)
            priced["predicted_step_s"] = priced["est_step_s"] / costs.est_over_meas
            cache[tuple(flags)] = priced
        return cache[tuple(flags)]

    stages, rows = [], {}
    for name, variant, flags, warmup, steps in stage_definitions():
        entry: dict = {"name": name, "flags": list(flags)}
        row = row_by_name(name)
        if row is None:  # the probe, checks, parity and calibration: as they took
            kind = name.split(":")[0]
            entry["est_s"] = costs.stage_s.get(kind) or ASSUMED_STAGE_S[kind]
        elif variant == "fsdp2":
            pair = rows[row.pairs_with]
            config, _ = parse_config(list(flags))
            host = fsdp2_host_bytes(config) / GiB + costs.base_host_GiB
            step = pair["predicted_step_s"] * costs.fsdp2_over_ours
            entry.update(
                batch=pair.get("batch"),
                predicted_step_s=step,
                tokens_per_step=pair["tokens_per_step"],
                host_GiB=host,
                est_s=costs.row_s(host, pair["compiles"], warmup + steps, step),
                note=f"its step priced at {costs.fsdp2_over_ours:.2f}x ours, as committed",
            )
        else:
            flags_list = list(flags)
            tried = choose_batch(flags_list, row.step_s, price) if row.step_s else []
            batch, priced = tried[-1] if tried else (None, price(flags_list))

            n = warmup + steps
            entry.update(_priced_row(costs, batch, priced, n, row.step_s))
            entry["smaller"] = [_priced_row(costs, b, p, n, row.step_s) for b, p in tried[:-1]]
            if not priced["fits"]:
                entry.update(est_s=0.0, skip=f"the dry run of its plan {priced['why']}")
            rows[name] = entry
        stages.append(entry)
    planned = plan_budget(stages, budget_s)
    for entry in stages:
        entry["limit_s"] = max(entry["est_s"] * LIMIT_FACTOR, entry["est_s"] + 30)
    return {
        "budget_s": budget_s,
        "margin": MARGIN,
        "planned_s": planned,
        "spec": spec_file.name,
        "costs": vars(costs),
        "stages": stages,
    }
