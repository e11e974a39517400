"""Assembling a run from its config: data, plan, engine, restored state, checkpoints, trackers.

Everything that can fail on the user's input fails here, before the first step and before any
output exists: bad data or flags, a missing checkpoint, a run that fits under no plan, an
unwritable folder. :func:`build` returns a :class:`Run`, which :func:`~execution.training.loop.train`
steps through. What differs between pretraining and fine-tuning (the data, the evaluation, what
``--load`` takes) comes in :class:`RunInputs`; :func:`assemble` does the rest for both.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from config.loading import ConfigError, config_to_dict
from config.schema import PretrainingConfig
from config.validation import kv_heads_note
from data.loader import (
    PretrainingDataLoader,
    data_description,
    training_loader,
    validation_source,
)
from execution.checkpoint.files import read_trainer_state, write_atomic
from execution.checkpoint.files import resolve as resolve_checkpoint
from execution.checkpoint.load import load_checkpoint, load_hf_weights
from execution.checkpoint.ownership import (
    METRICS_FILE,
    OUTPUT_FLAG,
    SAVE_FLAG,
    FolderClaim,
    check_run_folder,
    checkpoint_run_id,
    claim_folder,
    claim_new_folder,
    new_run_id,
    record_owner,
)
from execution.checkpoint.save import Checkpointer
from execution.engine.engine import PhasedEngine
from execution.parallel.launch import LaunchInfo
from execution.parallel.mesh import MeshShape, ParallelLayout
from execution.planning.pipeline_figures import bubble_fraction
from execution.planning.planner import plan_for_process
from execution.planning.run_shape import RunShape
from execution.training.checkpoint_flags import check_resumed_sparsity
from execution.training.restart import Restart
from utils.tracking import NullTracker, Tracker, run_trackers

# Evaluates the current weights after a number of steps: the metrics to log. Collective.
Evaluation = Callable[[int], dict[str, float]]


@dataclass
class Run:
    """A run ready to train or evaluate: this rank's engine, data and outputs.

    Attributes:
        config: The run's configuration.
        engine: This rank's model state, under the planner's plan.
        loader: This rank's training batches (positioned after ``start_step`` steps).
        evaluate: Evaluates the weights (every rank calls it); None when the run evaluates
            nothing.
        tracker: Where metrics go (a no-op on every rank but the main one).
        checkpointer: Saves with ``--save``; None otherwise.
        start_step: Steps already done (by the checkpoint resumed from).
        claims: The run's folders, held by this process until :meth:`close` (main rank).
    """

    config: PretrainingConfig
    engine: PhasedEngine
    loader: Any  # PretrainingDataLoader, or data.finetuning_data.TaskDataLoader
    evaluate: Evaluation | None
    tracker: Tracker
    checkpointer: Checkpointer | None
    start_step: int
    claims: list[FolderClaim] = field(default_factory=list)

    def close(self) -> None:
        """Waits for the last update and checkpoint, closes the trackers and lets the folders
        go."""
        # Each runs even if one before it raises; the folders go last.
        with contextlib.ExitStack() as closing:
            for claim in self.claims:
                closing.callback(claim.release)
            if self.checkpointer is not None:
                closing.callback(self.checkpointer.close)
            closing.callback(self.tracker.close)
            self.engine.finish_update()


@dataclass
class RunInputs:
    """What a kind of run brings to :func:`assemble`.

    Attributes:
        loader: This rank's training batches.
        data: The start-up line's description of the data.
        evaluation: Given the engine and the output folder, the run's evaluation (None: it
            evaluates nothing).
        restore: Given the engine and the loader, loads ``--load`` or ``--hf_model``:
            (steps already done, a start-up line saying what was loaded, or "").
        continues: Whether ``--load``'s checkpoint (its trainer state) is this run's own,
            resumed, so that the run keeps its id and output folders.
    """

    loader: Any
    data: str
    evaluation: Callable[[PhasedEngine, Path], Evaluation] | None
    restore: Callable[[PhasedEngine, Any], tuple[int, str]]
    continues: Callable[[dict], bool] = lambda trainer: True


def build(
    config: PretrainingConfig,
    preset: str,
    layout: ParallelLayout,
    launch: LaunchInfo,
    restart: Restart | None = None,
) -> Run:
    """Builds this rank's pretraining run; every rank of the job calls it.

    Args:
        config: Validated configuration.
        preset: The preset's name (for the default output folder).
        layout: This rank's parallel geometry.
        launch: How the job was launched (reported at start-up).
        restart: How a restarted job goes on (execution.training.restart); None otherwise.

    Raises:
        ConfigError, DataError: the user's input cannot run (one line each).
    """
    loader = training_loader(config, layout.dp.rank, layout.dp.size)
    validation = validation_source(config, layout.dp.rank, layout.dp.size)

    def evaluation(engine: PhasedEngine, output_dir: Path) -> Evaluation:
        return lambda step: validation.scores(engine.evaluate)

    inputs = RunInputs(
        loader,
        data_description(config, loader),
        evaluation if validation is not None else None,
        lambda engine, loader: _restore(config, engine, loader),
    )
    return assemble(config, preset, layout, launch, inputs, restart)


def assemble(
    config: PretrainingConfig,
    preset: str,
    layout: ParallelLayout,
    launch: LaunchInfo,
    inputs: RunInputs,
    restart: Restart | None = None,
) -> Run:
    """Builds this rank's run from a kind of run's inputs (:func:`build`'s arguments)."""
    c = config.checkpoint
    run_id = restart.run_id if restart else new_run_id()  # a restart is the same run
    continues = False  # the run resumes --load's run: its id, folders and metrics go on
    if c.load:  # a missing checkpoint is reported before minutes of set-up, not after
        folder = resolve_checkpoint(c.load)
        trainer = read_trainer_state(folder)
        # An evaluation is a run of its own: it never writes into the evaluated run's folders.
        continues = inputs.continues(trainer) and not c.eval_only
        if continues:
            run_id = checkpoint_run_id(folder, trainer)
            check_resumed_sparsity(config, trainer, folder)
    elif c.hf_model and not Path(c.hf_model).is_dir():
        raise ConfigError(f"--hf_model {c.hf_model} is not a folder (a local HuggingFace GPT-2)")
    default_output = Path(f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{preset}")
    output_dir = Path(config.logging.output_dir) if config.logging.output_dir else default_output
    save = Path(c.save) if c.save and not c.eval_only else None
    claims: list[FolderClaim] = []
    if layout.is_main:  # another run's files are never written over (ownership module)
        check_run_folder(output_dir, run_id, OUTPUT_FLAG)
        if save is not None:
            check_run_folder(save, run_id, SAVE_FLAG)
        output_dir, claims = _claim_folders(config, output_dir, save, run_id)
    checkpointer = None
    try:
        # Before any output: a run that cannot fit says so, and the claims' folders go.
        run = RunShape.of(config)
        plan, budget = plan_for_process(run, layout)
        if layout.is_main:
            print(f"memory: {budget.describe()} for this process\n{plan.describe()}", flush=True)
            if note := kv_heads_note(config):
                print(note, flush=True)
        engine = PhasedEngine(run.engine_plan(plan), layout)
        start_step, restored = inputs.restore(engine, inputs.loader)
        if save is not None:
            checkpointer = Checkpointer(
                save,
                engine,
                config,
                c.keep_checkpoints,
                run_id=run_id,
                job=launch.job_id,
                output_dir=output_dir,
            )
        tracker: Tracker = NullTracker()
        if layout.is_main:
            total_steps = max(config.training.steps, start_step)
            # A restart logs the steps after its start again, as a resume does.
            resumed_at = start_step if continues or restart else None
            owner = (run_id, launch.job_id)
            tracker = _main_tracker(config, output_dir, total_steps, owner, resumed_at)
    except BaseException:
        if checkpointer is not None:
            checkpointer.close()
        for claim in claims:  # what the claims made goes: a refused run leaves nothing
            claim.release(undo=True)
        raise
    if layout.is_main:
        buffers = sum(engine.buffer_bytes().values()) / 2**30
        print(
            f"preset {preset}: {config.model.layers} layers x {config.model.hidden_size} hidden, "
            f"{config.world_size} process(es) ({launch.launcher}) on {layout.device}, "
            f"{config.training.precision}, gradient accumulation {config.gradient_accumulation}, "
            f"{buffers:.2f} GiB of buffers per process\n"
            f"data: {inputs.data}\n"
            f"{restored}{_pipeline_line(config, plan.passes)}output: {output_dir}/metrics.jsonl",
            flush=True,
        )
    evaluate = inputs.evaluation(engine, output_dir) if inputs.evaluation else None
    return Run(
        config=config,
        engine=engine,
        loader=inputs.loader,
        evaluate=evaluate,
        tracker=tracker,
        checkpointer=checkpointer,
        start_step=start_step,
        claims=claims,
    )


def _claim_folders(
    config: PretrainingConfig, output_dir: Path, save: Path | None, run_id: str
) -> tuple[Path, list[FolderClaim]]:
    """This process's claims of the run's folders (the main rank's): the output folder (a new
    one under runs/ unless given) and the ``--save`` folder, if any."""
    if config.logging.output_dir:
        claims = [claim_folder(output_dir, run_id, OUTPUT_FLAG)]
    else:
        output_dir, claim = claim_new_folder(output_dir, run_id)
        claims = [claim]
    if save is not None:
        try:
            claims.append(claim_folder(save, run_id, SAVE_FLAG))
        except BaseException:
            claims[0].release(undo=True)
            raise
    return output_dir, claims


def _restore(
    config: PretrainingConfig, engine: PhasedEngine, loader: PretrainingDataLoader
) -> tuple[int, str]:
    """Loads ``--load`` (weights, optimizer, loader position) or ``--hf_model`` (weights).

    Returns:
        (steps already done, a start-up line saying what was loaded, or "").
    """
    c = config.checkpoint
    if c.hf_model and not c.load:
        load_hf_weights(c.hf_model, engine)
        return 0, f"weights from the HuggingFace model {c.hf_model}\n"
    if not c.load:
        return 0, ""
    trainer = load_checkpoint(c.load, engine)
    start_step = trainer["step"]
    if not c.eval_only:
        loader.load_state_dict(trainer["loader"])
        if start_step >= config.training.steps:
            raise ConfigError(
                f"the checkpoint {trainer['folder']} is at step {start_step} and --steps is "
                f"{config.training.steps}: nothing to train; raise --steps"
            )
    mesh = saved_mesh(trainer)
    verb = "loaded" if c.eval_only else "resumed from"
    processes = f"{mesh.world_size} process{'es' * (mesh.world_size > 1)}"
    saved_by = f"saved by {mesh.describe()} ({processes}), {trainer['saved_placement']}"
    return start_step, f"{verb} {trainer['folder']} at step {start_step} ({saved_by})\n"


def saved_mesh(trainer: dict) -> MeshShape:
    """The mesh that saved a checkpoint. Checkpoints before the whole mesh was recorded hold
    dp, tp1 and tp2 (``saved_layout``), and their config the rest; a config without
    context_parallel (pipeline_parallel) was saved by code without that axis: size 1."""
    if "saved_mesh" in trainer:
        return MeshShape(**trainer["saved_mesh"])
    dp, tp1, tp2 = trainer["saved_layout"]
    execution = trainer["config"]["execution"]
    cp, pp = (execution.get(f"{axis}_parallel", 1) for axis in ("context", "pipeline"))
    return MeshShape(dp, tp1, tp2, cp, pp)


def _pipeline_line(config: PretrainingConfig, passes: int) -> str:
    """The start-up line of a pipeline: its stages and the share of a step they idle."""
    stages = config.execution.pipeline_parallel
    if stages == 1:
        return ""
    layers = ",".join(str(n) for n in config.stage_layers)
    bubble = bubble_fraction(stages, passes)
    return (
        f"pipeline: {stages} stages of {layers} layers, {passes} pass(es) as its chunks; "
        f"bubble (S - 1) / (P + S - 1) = {stages - 1}/{passes + stages - 1} = {bubble:.1%}\n"
    )


def _main_tracker(
    config: PretrainingConfig,
    output_dir: Path,
    total_steps: int,
    owner: tuple[str, str | None],
    resumed_at: int | None,
) -> Tracker:
    """The output folder with the run's ``config.yml`` and ``run.json`` (``owner``: the run's
    id and its launch's job), and the trackers that write into it (a resumed run appends to
    its own ``metrics.jsonl``, after the step it resumed from)."""
    run_config = config_to_dict(config)
    try:
        record_owner(output_dir, *owner)
        (output_dir / "config.yml").write_text(yaml.safe_dump(run_config))
        if resumed_at is not None:
            _drop_metrics_after(output_dir / METRICS_FILE, resumed_at)
    except OSError as err:
        raise ConfigError(f"cannot write to --output_dir {output_dir}: {err.strerror}") from None
    return run_trackers(config.logging, output_dir, total_steps, run_config)


def _drop_metrics_after(metrics: Path, step: int) -> None:
    """Drops the lines of steps after ``step`` from a resumed run's ``metrics.jsonl``.

    The run trains those steps again (an earlier attempt logged them before it stopped, or
    before the run rolled back to an earlier checkpoint), so each step keeps one line: the one
    of the history the checkpoints hold. A line cut short by a killed run goes too.
    """
    if not metrics.is_file():
        return
    lines = metrics.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) != len(lines):
        write_atomic(metrics, "".join(kept))


def _logged_step(line: str) -> float:
    """The step a metrics line was logged at: 0 for a line that names none (kept), infinity
    for a last line cut short (dropped)."""
    if not line.endswith("\n"):
        return math.inf
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return 0
    return step if isinstance(step, int | float) else 0
