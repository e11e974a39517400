"""Pretrain GPT-3 with phased execution.

    python run_pretraining.py --config tiny
    torchrun --nproc_per_node 8 run_pretraining.py --config tiny \
        --data_parallel 2 --tensor_parallel_1 2 --tensor_parallel_2 2

Every config field is a flag (``--help`` lists them); presets live in config/pretraining.yml.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import yaml

from config.loading import ConfigError, config_to_dict, parse_config
from data.errors import DataError
from data.loader import (
    SAMPLE_DATA_GLOB,
    SAMPLE_VALIDATION_GLOB,
    PretrainingDataLoader,
    validation_batches,
)
from data.prefetch import PrefetchingLoader
from execution.checkpoint import Checkpointer, load_checkpoint, load_hf_weights
from execution.checkpoint import resolve as resolve_checkpoint
from execution.layout import setup_layout, teardown
from execution.phases import PhasedEngine
from execution.planner import choose_plan, measure_budget
from execution.training import train
from utils.tracking import ConsoleTracker, JsonlTracker, MultiTracker, NullTracker, WandbTracker


def main(argv: list[str] | None = None) -> None:
    config, preset = parse_config(argv)
    if config.planning.dry_run or config.planning.plan_for:
        plan_without_launching(config, preset)
        return
    layout, launch = setup_layout(config)
    try:
        run(config, preset, layout, launch)
    finally:
        teardown()


def plan_without_launching(config, preset) -> None:
    """--dry_run and --plan_for: one CPU process, no data read, no weights drawn."""
    from execution.dry_run import check_input_files, dry_run
    from execution.plan_search import print_layouts

    if config.planning.plan_for:
        print_layouts(config, preset)
        return
    check_input_files(config.data.input_files or [SAMPLE_DATA_GLOB])
    output_dir = Path(
        config.logging.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{preset}-dry"
    )
    dry_run(config, output_dir)


def run(config, preset, layout, launch) -> None:
    d, m, ex, c = config.data, config.model, config.execution, config.checkpoint
    using_sample = not d.input_files
    train_files = d.input_files or [SAMPLE_DATA_GLOB]
    loader = PretrainingDataLoader(
        train_files, m.sequence_length, config.training.global_batch_size, ex.micro_batch_size,
        layout.dp.rank, layout.dp.size, config.training.seed, m.vocab_size,
        skip_corrupt_records=d.skip_corrupt_records, validation_fraction=d.validation_fraction,
    )  # fmt: skip
    validation = None
    if d.eval_every or c.eval_only:
        if d.validation_fraction:
            files, fraction = train_files, d.validation_fraction
        elif d.validation_files or using_sample:
            files, fraction = d.validation_files or [SAMPLE_VALIDATION_GLOB], 0.0
        else:
            flag = "--eval_only" if c.eval_only else "--eval_every"
            raise ConfigError(
                f"{flag} needs held-out data: give --validation_files or "
                "--validation_fraction (or --eval_every 0 to train without evaluation)"
            )

        def validation():
            return validation_batches(
                files, m.sequence_length, ex.micro_batch_size, layout.dp.rank, layout.dp.size,
                m.vocab_size, d.eval_batches or None, validation_fraction=fraction,
                skip_corrupt_records=d.skip_corrupt_records,
            )  # fmt: skip

        # Open the validation data now: a bad file must not surface hours into training.
        if next(iter(validation()), None) is None:
            raise ConfigError(
                f"the validation data {', '.join(files)} holds fewer than --micro_batch_size "
                f"{ex.micro_batch_size} x --data_parallel {layout.dp.size} sequences of "
                f"{m.sequence_length + 1} tokens; give more validation data"
            )

    output_dir = Path(
        config.logging.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{preset}"
    )
    if layout.is_main and (output_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"{output_dir} already holds the metrics.jsonl of another run; "
            "choose a new --output_dir (or leave it out for a fresh folder under runs/)"
        )
    if c.load:  # a missing checkpoint is reported before minutes of set-up, not after
        resolve_checkpoint(c.load)
    elif c.hf_model and not Path(c.hf_model).is_dir():
        raise ConfigError(f"--hf_model {c.hf_model} is not a folder (a local HuggingFace GPT-2)")
    # Planned before any output: a run that cannot fit says so and leaves nothing behind.
    budget = measure_budget(config, layout.device, layout.local_world_size)
    plan = choose_plan(config, layout.device.type, budget)
    if layout.is_main:
        print(f"memory: {budget.describe()} for this process\n{plan.describe()}", flush=True)
    engine = PhasedEngine(config, layout, plan)
    start_step, resumed = 0, ""
    if c.load:
        trainer = load_checkpoint(c.load, engine)
        start_step = trainer["step"]
        if not c.eval_only:
            loader.load_state_dict(trainer["loader"])
            if start_step >= config.training.steps:
                raise ConfigError(
                    f"the checkpoint {trainer['folder']} is at step {start_step} and --steps is "
                    f"{config.training.steps}: nothing to train; raise --steps"
                )
        dp, tp1, tp2 = trainer["saved_layout"]
        verb = "loaded" if c.eval_only else "resumed from"
        resumed = (f"{verb} {trainer['folder']} at step {start_step} (saved by "
                   f"{dp} x {tp1} x {tp2} processes, {trainer['saved_placement']})\n")  # fmt: skip
    elif c.hf_model:
        load_hf_weights(c.hf_model, engine)
        resumed = f"weights from the HuggingFace model {c.hf_model}\n"
    checkpointer = None
    if c.save and not c.eval_only:  # before any output: a bad --save must not leave a run behind
        # Test hook, read here only: seconds to wait before committing each checkpoint.
        delay = float(os.environ.get("GPT3_TEST_CHECKPOINT_COMMIT_DELAY", "0"))
        checkpointer = Checkpointer(c.save, engine, c.keep_checkpoints, commit_delay=delay)
    tracker = NullTracker()
    if layout.is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "config.yml").write_text(yaml.safe_dump(config_to_dict(config)))
        except OSError as err:
            raise ConfigError(
                f"cannot write to --output_dir {output_dir}: {err.strerror}"
            ) from None
        trackers = [JsonlTracker(output_dir / "metrics.jsonl"),
                    ConsoleTracker(max(config.training.steps, start_step), config.logging.log_every)]  # fmt: skip
        if config.logging.wandb:
            trackers.append(WandbTracker(config.logging.wandb_project, config.logging.wandb_mode,
                                         config_to_dict(config), output_dir))  # fmt: skip
        tracker = MultiTracker(trackers)
        print(
            f"preset {preset}: {m.layers} layers x {m.hidden_size} hidden, "
            f"{config.world_size} process(es) ({launch.launcher}) on {layout.device}, "
            f"{config.training.precision}, gradient accumulation {config.gradient_accumulation}, "
            f"{sum(engine.buffer_bytes().values()) / 2**30:.2f} GiB of buffers per process\n"
            f"data: {'shipped sample ' if using_sample else ''}{', '.join(train_files)} "
            f"({loader.samples_per_epoch} sequences per epoch)\n"
            f"{resumed}output: {output_dir}/metrics.jsonl",
            flush=True,
        )
    if c.eval_only:
        try:
            loss = engine.evaluate(validation())
            perplexity = math.exp(loss) if loss < 700 else math.inf
            tracker.log({"step": start_step, "eval_loss": loss, "eval_perplexity": perplexity})
            if layout.is_main:
                print(f"validation loss {loss:.4f}, perplexity {perplexity:.2f}", flush=True)
        finally:
            tracker.close()
        return
    # The next step's batch is read (and pinned for the GPU) while the current step runs.
    prefetcher = PrefetchingLoader(loader, pin_memory=layout.device.type == "cuda")
    try:
        train(config, engine, prefetcher, tracker, validation, start_step, checkpointer)
    finally:
        prefetcher.close()
        tracker.close()
        if checkpointer is not None:
            checkpointer.close()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as err:  # the user's input, not a bug: one line, exit 2
        print(f"run_pretraining.py: error: {err}", file=sys.stderr)
        sys.exit(2)
