"""Pretrain GPT-3 with phased execution.

    python run_pretraining.py --config tiny
    torchrun --nproc_per_node 8 run_pretraining.py --config tiny \
        --data_parallel 2 --tensor_parallel_1 2 --tensor_parallel_2 2

Every config field is a flag (``--help`` lists them); presets live in config/pretraining.yml.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from config.loading import ConfigError, parse_config
from data.errors import DataError
from execution.parallel.launch import read_launch_environment, setup_layout, teardown
from execution.training.build import build
from execution.training.loop import Interrupted, evaluate_only, train


class _Job:
    """What the entry point knows of the job when something stops it."""

    joined = False  # the ranks have joined: an error may now be one rank's own


def main(argv: list[str] | None = None, job: _Job | None = None) -> None:
    job = job or _Job()
    config, preset = parse_config(argv)
    if config.planning.dry_run or config.planning.plan_for:
        plan_without_launching(config, preset)
        return
    layout, launch = setup_layout(config)
    job.joined = layout.world.size > 1
    try:
        run = build(config, preset, layout, launch)
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


def _rank() -> int:
    """This process's rank in its job, from any launcher's variables (0 alone)."""
    try:
        return read_launch_environment(os.environ).rank
    except ConfigError:  # inconsistent launcher variables: said by setup_layout already
        return 0


if __name__ == "__main__":
    # SIGTERM (a scheduler's or torchrun's stop) ends the run as Ctrl-C does.
    stopped_by = {"signal": signal.SIGINT}

    def _on_sigterm(signum, frame) -> None:
        stopped_by["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    job = _Job()
    try:
        main(job=job)
    except (ConfigError, DataError) as err:  # the user's input, not a bug: one line, exit 2
        # Before the ranks join (flags, world size) every rank finds the same error: rank 0
        # says it. After, an error may be one rank's own: it says which rank it is.
        rank = _rank()
        if rank == 0 or job.joined:
            where = f"rank {rank}: " if rank else ""
            print(f"run_pretraining.py: error: {where}{err}", file=sys.stderr)
        sys.exit(2)
    except (Interrupted, KeyboardInterrupt) as err:  # one line, and the shell's 128 + signal
        if _rank() == 0:  # every rank of a job gets the signal
            print(f"run_pretraining.py: {str(err) or 'interrupted'}", file=sys.stderr)
        sys.exit(128 + stopped_by["signal"])
