"""What the first run on a GPU runs, in order of value, and at what size (gpu_first_run.py).

The probe first, then the attention kernels timed at the rows' calls (the rows run with those
timings, so each engine runs the fastest kernel that passes its check). The rows
(:data:`ROWS`) are the issue's, most valuable first: ``llama3_8B`` at full depth,
streamed, on an H200 capped at an H100's memory and at 24 GiB; ``gpt3_6.7B`` at full depth,
streamed and capped; ``gpt3_1.3B`` resident, compiled at dropout 0 and 0.1 and eager; our
streamed row against FSDP2 with CPU offload on the same model, batch and recompute, both
compiled. Then the checks, parity and the calibration.

A row with a step target (``step_s``) has its global batch chosen by the dry run: the
smallest of :data:`BATCHES` whose step, as the committed H200 rows measured against their
estimates, lands in the target (``python -m benchmarks.estimate_rows --plan``, which also prices
every stage and writes :data:`PLAN_FILE`). A real run takes each stage's batch, time and host
memory from that file; a stage its budget leaves out still runs if time is left, and a row
whose plan fits no 128 GiB host is recorded as skipped with the dry run's numbers.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLAN_FILE = HERE / "first_run_plan.json"
DEFAULT_BUDGET_S = 450  # with the machine's start, one command of 9 minutes at most
# An H100 80GB as a process can allocate it on an idle device (the h100_sxm spec's memory):
# the cap under which a row would also run on an H100.
H100_GIB = 79.0
BATCHES = (16, 32, 48, 64, 96, 128, 192, 256)
QUICK = shlex.split(
    "--config tiny --hidden_size 32 --sequence_length 32 --max_positional_length 32 "
    "--global_batch_size 4 --micro_batch_size 2"
)
QUICK_LLAMA = shlex.split(
    "--config llama_tiny --layers 2 --global_batch_size 4 --micro_batch_size 2"
)
# Eager, the plain loop too (it follows --compile): parity is of the engine's numbers, and
# its minute would go to compiling; the rows compile.
PARITY_SIZE = shlex.split(
    "--config tiny --layers 2 --hidden_size 256 --heads 4 --sequence_length 256 "
    "--max_positional_length 256 --global_batch_size 8 --micro_batch_size 2 "
    "--dropout_prob 0 --precision float32 --compile false"
)


@dataclass(frozen=True)
class Stage:
    """One process of the run: ``need_s`` is what it must be left to start, ``limit_s`` the
    most it may take. ``planned``: inside the budget's plan (the stages after it keep their
    ``need_s``); otherwise it runs only if time is left. ``host_GiB``: the host memory its
    plan holds, checked against the probe's. ``skip``: why it does not run (from the plan)."""

    name: str
    need_s: float
    limit_s: float
    row: str = ""  # a bench_step.VARIANTS key, for the parity and measured rows
    flags: tuple[str, ...] = ()
    warmup: int = 1
    steps: int = 2
    profile: bool = False
    planned: bool = True
    host_GiB: float = 0.0
    skip: str = ""

    @property
    def kind(self) -> str:
        return self.name.split(":")[0]


@dataclass(frozen=True)
class Row:
    """A measured row: its stage's name, bench_step variant, flags (without the global batch
    where ``step_s`` asks the dry run to choose it), and its CPU-sized twin (``quick``)."""

    name: str
    variant: str
    flags: tuple[str, ...]
    quick: tuple[str, ...]
    step_s: tuple[float, float] | None = None  # the step the chosen batch should take
    warmup: int = 1
    steps: int = 1
    pairs_with: str = ""  # FSDP2: the row of ours on the same model and batch


def _flags(text: str) -> tuple[str, ...]:
    return tuple(shlex.split(text))


LLAMA = "--config llama3_8B --sequence_length 2048"
PROXY = "--config gpt3_6.7B --layers 8 --global_batch_size 64 --recompute none"
RESIDENT = "--config gpt3_1.3B --global_batch_size 64"
QUICK_STREAMED = (*QUICK, "--layers", "2")
ROWS = (
    Row(
        "row:llama3_8B-h100",
        "streamed",
        _flags(f"{LLAMA} --device_memory_cap_gb {H100_GIB:g}"),
        tuple(QUICK_LLAMA),
        step_s=(20.0, 40.0),
    ),
    Row(
        "row:llama3_8B-24GiB",
        "streamed",
        _flags(f"{LLAMA} --device_memory_cap_gb 24"),
        tuple(QUICK_LLAMA),
        step_s=(20.0, 40.0),
    ),
    Row(
        "row:gpt3_6.7B-h100",
        "streamed",
        _flags(f"--config gpt3_6.7B --device_memory_cap_gb {H100_GIB:g}"),
        QUICK_STREAMED,
        step_s=(10.0, 40.0),
    ),
    Row(
        "row:1.3B-dropout0",
        "resident",
        _flags(f"{RESIDENT} --dropout_prob 0"),
        (*QUICK, "--dropout_prob", "0"),
    ),
    Row("row:1.3B-dropout0.1", "resident", _flags(RESIDENT), tuple(QUICK)),
    Row(
        "row:1.3B-eager",
        "resident",
        _flags(f"{RESIDENT} --dropout_prob 0 --compile false"),
        (*QUICK, "--dropout_prob", "0", "--compile", "false"),
    ),
    Row("row:proxy-ours", "streamed", _flags(PROXY), (*QUICK_STREAMED, "--recompute", "none")),
    Row(
        "row:proxy-fsdp2",
        "fsdp2",
        _flags(PROXY),
        (*QUICK_STREAMED, "--recompute", "none"),
        pairs_with="row:proxy-ours",
    ),
)
PARITY_ROWS = ("ours", "plain", "fsdp2")  # on a CPU the plain loop checks parity alone


def quick_stages(device: str) -> list[Stage]:
    """Every stage at CPU size, each one planned."""
    on = ("--device", device)
    return [
        Stage("probe", 0, 60),
        Stage("attention", 5, 120),
        *(Stage(r.name, 5, 120, r.variant, (*r.quick, *on), 0, 1) for r in ROWS),
        Stage("checks", 10, 200),
        *(Stage(f"parity:{r}", 5, 120, r, (*QUICK, *on), 0, 1) for r in PARITY_ROWS),
        Stage("calibration", 10, 200),
    ]


def real_stages(device: str, plan: dict) -> list[Stage]:
    """The stages of a run on a GPU, sized by ``plan`` (:data:`PLAN_FILE`'s contents).

    Raises:
        ValueError: the plan is not of these stages (a row's flags changed since it was
            priced): ``python -m benchmarks.estimate_rows --plan --write`` prices them again.
    """
    priced = {s["name"]: s for s in plan["stages"]}
    on = ("--device", device)
    out = []
    for name, row, flags, warmup, steps in stage_definitions():
        entry = priced.get(name)
        if entry is None or entry["flags"] != list(flags):
            raise ValueError(f"{name} is not priced as it is defined")
        chosen = ("--global_batch_size", str(entry["batch"])) if entry.get("batch") else ()
        out.append(
            Stage(
                name,
                need_s=entry["est_s"],
                limit_s=entry["limit_s"],
                row=row,
                flags=(*flags, *chosen, *on) if row else (),
                warmup=warmup,
                steps=steps,
                planned=entry["planned"],
                host_GiB=entry.get("host_GiB", 0.0),
                skip=entry.get("skip", ""),
            )
        )
    return out


def stage_definitions() -> list[tuple[str, str, tuple[str, ...], int, int]]:
    """(name, row, flags, warm-up, steps) of every stage of a real run, in order."""
    stages = [("probe", "", (), 0, 0), ("attention", "", (), 0, 0)]
    stages += [(r.name, r.variant, r.flags, r.warmup, r.steps) for r in ROWS]
    stages.append(("checks", "", (), 0, 0))
    parity = tuple(PARITY_SIZE)
    stages += [(f"parity:{r}", r, parity, 0, 2) for r in PARITY_ROWS]
    stages.append(("calibration", "", (), 0, 0))
    return stages


def read_plan(path: Path | None = None) -> dict:
    """The priced plan (:data:`PLAN_FILE`); ValueError (one line) when missing or unreadable."""
    path = path or PLAN_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: no priced plan ({err})") from None


def row_by_name(name: str) -> Row | None:
    return next((r for r in ROWS if r.name == name), None)
