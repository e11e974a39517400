"""Pretrain GPT-3 with phased execution.

    python run_pretraining.py --config tiny
    torchrun --nproc_per_node 8 run_pretraining.py --config tiny \
        --data_parallel 2 --tensor_parallel_1 2 --tensor_parallel_2 2

Every config field is a flag (``--help`` lists them); presets live in config/pretraining.yml.
"""

from __future__ import annotations

import time
from pathlib import Path

from config.loading import parse_config
from execution.parallel.launch import setup_layout, teardown
from execution.training.build import build
from execution.training.entry import Job, run_entry_point
from execution.training.loop import evaluate_only, train
from execution.training.restart import resume_restarted_job
from execution.training.starting_weights import check_starting_weights


def main(argv: list[str] | None = None, job: Job | None = None) -> None:
    job = job or Job()
    config, preset = parse_config(argv)
    if config.planning.dry_run or config.planning.plan_for:
        plan_without_launching(config, preset)
        return
    check_starting_weights(config)  # a mismatch is said before the set-up, not after it
    layout, launch = setup_layout(config)
    job.joined = layout.world.size > 1
    try:
        config, restart = resume_restarted_job(config, layout, launch)
        run = build(config, preset, layout, launch, restart)
        if config.checkpoint.eval_only:
            evaluate_only(run)
        else:
            train(run)
    finally:
        teardown()


def plan_without_launching(config, preset: str) -> None:
    """--dry_run and --plan_for: one CPU process, no data read, no weights drawn."""
    from execution.planning.dry_run import check_input_files, dry_run
    from execution.planning.plan_table import print_layouts

    if config.planning.plan_for:
        print_layouts(config, preset)
        return
    check_input_files(config.data.input_files)
    default = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{preset}-dry"
    dry_run(config, Path(config.logging.output_dir or default))


if __name__ == "__main__":
    run_entry_point(main, "run_pretraining.py")
