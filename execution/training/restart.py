"""A restarted job goes on from its own newest checkpoint, with the same flags.

``torchrun --max-restarts N`` and a SLURM job with ``--requeue`` start the same command again
after a rank died (or the node went away). Such a restart (rank 0's
:class:`~execution.parallel.launch.LaunchInfo` says so) resumes from the newest complete
checkpoint in its ``--save`` folder that this job saved (each checkpoint records its job), so
no ``--load`` is needed; a ``--load`` given is where the first attempt started, which the job
has gone past. It is the same run: it keeps the run's id, so the run's folders are its own and
its lock on them is taken again (the dead attempt's processes, and their locks, are gone); and
it logs into the output folder the checkpoint names when no ``--output_dir`` is given, where
its steps replace the lines the dead attempt logged after that checkpoint. A restart before
the job's first checkpoint starts as the first attempt did (from ``--load``, ``--hf_model`` or
scratch) as the run that attempt recorded in its folders' ``run.json``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from config.schema import PretrainingConfig
from execution.checkpoint.files import CheckpointError, read_trainer_state, step_folders
from execution.checkpoint.ownership import checkpoint_run_id, owner_record
from execution.parallel.collective_errors import CollectiveError
from execution.parallel.launch import LaunchInfo
from execution.parallel.mesh import ParallelLayout

Config = TypeVar("Config", bound=PretrainingConfig)


@dataclass(frozen=True)
class Restart:
    """How a restarted job goes on.

    Attributes:
        run_id: The run its earlier attempts were.
        checkpoint: The newest checkpoint the job saved; None before its first.
        output_dir: The output folder that checkpoint's run logged into.
    """

    run_id: str
    checkpoint: str | None = None
    output_dir: str | None = None


def resume_restarted_job(
    config: Config, layout: ParallelLayout, launch: LaunchInfo
) -> tuple[Config, Restart | None]:
    """The config a restart runs (``--load`` its own newest checkpoint, its output folder),
    and how it goes on; ``(config, None)`` for a job's first attempt. Every rank calls it after
    joining: rank 0 decides, and the others take its decision."""
    restart = _own_restart(config, launch) if layout.is_main else None
    if layout.world.size > 1:
        decided = [restart]
        try:
            with layout.world.failures():
                dist.broadcast_object_list(decided, src=0, group=layout.world.group)
        except CollectiveError as err:
            err.during("joining the job")
            raise
        restart = decided[0]
    if restart is None:
        return config, None
    config = copy.deepcopy(config)
    if restart.checkpoint:
        # The checkpoint holds the weights --hf_model started from, and --load takes one.
        config.checkpoint.load, config.checkpoint.hf_model = restart.checkpoint, ""
        if restart.output_dir and not config.logging.output_dir:
            config.logging.output_dir = restart.output_dir
    if layout.is_main:
        goes_on = (
            f"from its newest checkpoint, {restart.checkpoint}"
            if restart.checkpoint
            else "from the start (it saved no checkpoint yet)"
        )
        print(f"restart of {launch.job_id}: the run goes on {goes_on}", flush=True)
    return config, restart


def _own_restart(config: PretrainingConfig, launch: LaunchInfo) -> Restart | None:
    """Rank 0's decision (module docstring); None where this is no restart of a known job."""
    c = config.checkpoint
    if not launch.restarted or launch.job_id is None or c.eval_only:
        return None
    if c.save:
        for _, folder in reversed(step_folders(Path(c.save))):
            try:
                trainer = read_trainer_state(folder)
            except CheckpointError:  # another run's, or damaged: not one to go on from
                continue
            if trainer.get("job") == launch.job_id:
                run_id = checkpoint_run_id(folder, trainer)
                return Restart(run_id, str(folder), trainer.get("output_dir"))
    for folder in (config.logging.output_dir, c.save):
        record = owner_record(Path(folder)) if folder else None
        if record is not None and record.get("job") == launch.job_id:
            return Restart(str(record["run_id"]))
    return None
