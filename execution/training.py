"""The training loop: one :meth:`PhasedEngine.train_step` per step, plus the cadence around it
(learning rate, logging, evaluation, checkpoints)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from config.schema import PretrainingConfig
from execution.optimizer import learning_rate
from execution.phases import PhasedEngine
from utils.metrics import device_peak_tflops, flops_per_token, throughput
from utils.tracking import Tracker


def train(
    config: PretrainingConfig,
    engine: PhasedEngine,
    loader,
    tracker: Tracker,
    validation: Callable[[], Iterable[torch.Tensor]] | None = None,
    start_step: int = 0,
    checkpointer=None,
) -> list[dict]:
    """Runs steps ``start_step .. config.training.steps - 1``.

    Args:
        config: The run's configuration.
        engine: Holds the model state of this rank.
        loader: Yields this rank's ``[GA, micro_batch, seq + 1]`` tokens via ``next_batch()``
            (a :class:`data.prefetch.PrefetchingLoader` reads them during the previous step).
        tracker: Receives each step's metrics (and evaluation results).
        validation: Returns a fresh iterable of validation batches; None disables evaluation.
        start_step: First step to run (resumption).
        checkpointer: A :class:`execution.checkpoint.Checkpointer` that saves every
            ``checkpoint_steps`` steps and at the end (None: no checkpoints).

    Returns:
        The metrics logged for every training step.
    """
    t = config.training
    layout = engine.layout
    flops = flops_per_token(engine.shapes, config.model.sequence_length)
    peak = device_peak_tflops(layout.device, config.execution.peak_tflops)
    eval_every = config.data.eval_every if validation is not None else 0
    history = []
    for step in range(start_step, t.steps):
        lr = learning_rate(step, t.optimizer, config.tokens_per_step, t.steps)
        waited = time.perf_counter()
        batch = loader.next_batch()  # with data.prefetch, read while the last step ran
        data_seconds = time.perf_counter() - waited
        _synchronize(layout.device)
        started = time.perf_counter()
        result = engine.train_step(batch, step, lr)
        _synchronize(layout.device)
        seconds = time.perf_counter() - started
        metrics = {
            "step": step + 1,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "skipped": result.skipped,
            "step_time": seconds,
            "data_time": data_seconds,  # waiting for the batch, not part of step_time
            **throughput(
                seconds,
                t.global_batch_size,
                config.model.sequence_length,
                flops,
                peak,
                config.world_size,
            ),
            "epoch": loader.epoch,
        }
        if config.data.skip_corrupt_records:  # same on every rank, so the collective matches
            count = torch.tensor(float(loader.skipped_records), device=layout.device)
            metrics["skipped_records"] = int(layout.dp.all_reduce_(count).item())
        tracker.log(metrics)
        history.append(metrics)
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == t.steps):
            tracker.log({"step": step + 1, "eval_loss": engine.evaluate(validation())})
        every = config.checkpoint.checkpoint_steps
        if checkpointer is not None and (
            (every and (step + 1) % every == 0) or step + 1 == t.steps
        ):
            checkpointer.save(step + 1, loader.state_dict())
    if checkpointer is not None:
        checkpointer.wait()  # the last checkpoint is complete before the run ends
    return history


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
