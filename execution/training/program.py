"""What both entry scripts (run_pretraining.py, run_finetuning.py) do, once: parse the flags;
plan without launching (``--dry_run``, ``--plan_for``); or join the job, resume a restarted
one, build the run, train or evaluate it, and leave the job. An entry script brings only what
is its own (:class:`Program`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from execution.parallel.launch import setup_layout, teardown
from execution.training.entry import Job
from execution.training.loop import train
from execution.training.restart import resume_restarted_job
from execution.training.starting_weights import check_starting_weights


@dataclass(frozen=True)
class Program:
    """What an entry script brings of its own.

    Attributes:
        parse: The flags to ``(config, preset)``.
        build: ``(config, preset, layout, launch, restart)`` to the run.
        evaluate_only: ``--eval_only``'s evaluation of a built run.
        dry_run_name: A dry run's default folder name under runs/, after its time stamp.
        check_inputs: What a dry run checks of the inputs before it plans (None: nothing).
    """

    parse: Callable[[list[str] | None], tuple[Any, str]]
    build: Callable[..., Any]
    evaluate_only: Callable[[Any], None]
    dry_run_name: Callable[[Any, str], str]
    check_inputs: Callable[[Any], None] | None = None


def run_program(program: Program, argv: list[str] | None = None, job: Job | None = None) -> None:
    job = job or Job()
    config, preset = program.parse(argv)
    if config.planning.dry_run or config.planning.plan_for:
        plan_without_launching(program, config, preset)
        return
    check_starting_weights(config)  # a mismatch is said before the set-up, not after it
    layout, launch = setup_layout(config)
    job.joined = layout.world.size > 1
    try:
        config, restart = resume_restarted_job(config, layout, launch)
        run = program.build(config, preset, layout, launch, restart)
        if config.checkpoint.eval_only:
            program.evaluate_only(run)
        else:
            train(run)
    finally:
        teardown()


def plan_without_launching(program: Program, config, preset: str) -> None:
    """--dry_run and --plan_for: one CPU process, no data read, no weights drawn."""
    from config.size_limits import refuse_unholdable
    from execution.planning.dry_run import dry_run
    from execution.planning.plan_table import print_layouts
    from execution.planning.run_shape import RunShape

    planning = config.planning
    run = RunShape.of(config)
    spec = run.spec
    refuse_unholdable(config, spec.name, spec.memory_gb, spec.host_memory_gb)  # before planning
    if planning.plan_for:
        print_layouts(
            run,
            preset,
            planning.plan_for,
            planning.plan_across_nodes,
            planning.plan_workers,
        )
        return
    if program.check_inputs is not None:
        program.check_inputs(config)
    default = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{program.dry_run_name(config, preset)}"
    dry_run(run, Path(config.logging.output_dir or default))
