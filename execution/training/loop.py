"""The training loop: one :meth:`PhasedEngine.train_step` per step, plus the cadence around it
(learning rate, logging, evaluation, checkpoints)."""

from __future__ import annotations

import contextlib
import gc
import math
import time

import torch

from data.prefetch import PrefetchingLoader
from execution.checkpoint.files import step_folders
from execution.parallel.collective_errors import CollectiveError
from execution.training.build import Run
from execution.training.lr_schedule import learning_rate
from utils.metrics import device_peak_tflops, flops_per_token, throughput


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped training; the message is the one line a user needs (the last
    step done, the last complete checkpoint and how to resume)."""


class LastSaveFailed(Exception):
    """Training ended but its last save failed (a full disk): the steps since the newest
    intact checkpoint are lost. The message is the one line a user needs."""


def raised_by_a_stop(err: BaseException) -> bool:
    """Whether ``err`` is the KeyboardInterrupt a stop raises, or an error raised while it was
    being handled: one that lands inside a lock's wait (a checkpoint's future, say) can leave
    the lock released twice, and Python then raises RuntimeError over it."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__context__
    return False


def _interrupted_line(run: Run, done: int) -> str:
    where = f"interrupted at step {done}"
    if run.checkpointer is None:
        return f"{where}; nothing was saved (no --save)"
    steps = step_folders(run.checkpointer.directory)
    if not steps:
        return f"{where}; no checkpoint was completed in {run.checkpointer.directory}"
    step, folder = steps[-1]
    return (
        f"{where}; the last complete checkpoint is step {step} ({folder}); resume with the same "
        f"flags and --load {run.checkpointer.directory}"
    )


def _saves_made(run: Run) -> int:
    """How many saves the run makes: every ``--checkpoint_steps`` steps and at the end."""
    t, every = run.config.training, run.config.checkpoint.checkpoint_steps
    ends = range(run.start_step + 1, t.steps + 1)
    return sum(1 for step in ends if (every and step % every == 0) or step == t.steps)


def _report_saves(run: Run) -> None:
    """Once the run is closed: how many of its saves failed, one line from rank 0 (every rank
    counted the same); LastSaveFailed if the last one did."""
    checkpointer = run.checkpointer
    if checkpointer is None or not checkpointer.folder.failed_saves:
        return
    folder = checkpointer.folder
    failed = f"{folder.failed_saves} of {checkpointer.saves} saves failed"
    newest = (
        f"the newest intact checkpoint is {checkpointer.directory / folder.newest}"
        if folder.newest
        else f"no checkpoint was completed in {checkpointer.directory}"
    )
    if folder.last_failure is not None:
        resume = f" (resume with --load {checkpointer.directory})" if folder.newest else ""
        raise LastSaveFailed(
            f"{failed}, the last one too ({folder.last_failure}); {newest}{resume}"
        )
    if run.engine.layout.is_main:
        print(f"checkpoint: {failed}; {newest}", flush=True)


def _recompiled_line(step: int, graphs: int) -> str:
    return (
        f"warning: step {step} compiled {graphs} more graph(s) after the first step: a guard "
        "that fails every time, which costs a compile per call (TORCH_LOGS=recompiles says which)"
    )


def train(run: Run) -> list[dict]:
    """Runs steps ``run.start_step .. config.training.steps - 1`` and closes the run.

    The next step's batch is read (and pinned for a GPU) in a background thread while the
    current step runs (:class:`data.prefetch.PrefetchingLoader`). Evaluates every
    ``--eval_every`` steps and then at the end (a fine-tuning run always at the end), and saves every ``--checkpoint_steps`` steps and at
    the end; the last checkpoint is complete when this returns.

    Returns:
        The metrics logged for every training step.

    A save the disk refuses fails alone, in one line (:mod:`execution.checkpoint.commit`), and
    training goes on; the end says how many failed.

    Raises:
        Interrupted: on Ctrl-C (or SIGTERM, raised as KeyboardInterrupt by the entry point),
            once a checkpoint being written is complete.
        LastSaveFailed: the run's last save failed.
    """
    config, engine, tracker = run.config, run.engine, run.tracker
    t = config.training
    layout = engine.layout
    flops = flops_per_token(engine.shapes, config.model.sequence_length)
    peak = device_peak_tflops(layout.device, config.execution.peak_tflops)
    eval_every = config.data.eval_every if run.evaluate is not None else 0
    eval_at_end = run.evaluate is not None and (eval_every or config.EVALUATES_AT_END)
    every = config.checkpoint.checkpoint_steps
    loader = PrefetchingLoader(run.loader, pin_memory=layout.device.type == "cuda")
    windows_drawn = getattr(run.loader, "windows_drawn", None)
    history = []
    done = run.start_step
    hooks = run.checkpointer.hooks if run.checkpointer is not None else None
    if run.checkpointer is not None:
        run.checkpointer.check_room(_saves_made(run))
    where = ""  # what a collective that fails was part of (a save names its own step)
    failed = interrupted = False
    # What the run has built (torch's modules, the model, the data) leaves the collector's
    # scans while it trains: a full collection otherwise walks those hundreds of thousands of
    # objects, a third of a second each time the objects a step leaves behind (its graphs,
    # kept for the backward) add up to a quarter of them, every few steps of a host-bound run.
    gc.freeze()
    try:
        for step in range(run.start_step, t.steps):
            where = f"step {step + 1}"
            lr = learning_rate(step, t.optimizer, config.tokens_per_step, t.steps)
            waited = time.perf_counter()
            batch = loader.next_batch()  # read while the last step ran
            data_seconds = time.perf_counter() - waited
            _synchronize(layout.device)
            started = time.perf_counter()
            result = engine.train_step(batch, step, lr, hooks)
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
            if windows_drawn is not None:  # a blend: a function of the step, the same everywhere
                metrics.update(windows_drawn(step + 1))
            if engine.compiled:
                metrics["compiled_graphs"] = result.compiled_graphs
                if result.compiled_graphs and step > run.start_step and layout.is_main:
                    print(_recompiled_line(step + 1, result.compiled_graphs), flush=True)
            if engine.rigl is not None:  # collective: every rank measures its masks
                metrics.update(engine.rigl.measure())
                metrics.update(result.rigl or {})
            if config.data.skip_corrupt_records:  # same on every rank: the collective matches
                count = torch.tensor(float(loader.skipped_records), device=layout.device)
                metrics["skipped_records"] = int(layout.dp.all_reduce_(count).item())
            tracker.log(metrics)
            history.append(metrics)
            last = step + 1 == t.steps
            if (eval_every and (step + 1) % eval_every == 0) or (last and eval_at_end):
                where = f"the evaluation after step {step + 1}"
                tracker.log({"step": step + 1, **run.evaluate(step + 1)})
            done = step + 1
            if run.checkpointer is not None and ((every and (step + 1) % every == 0) or last):
                where = ""
                run.checkpointer.save(step + 1, loader.state_dict())
    except CollectiveError as err:
        failed = True
        if where:
            err.during(where)
        raise
    except BaseException as err:
        if not raised_by_a_stop(err):
            raise
        interrupted = True
    finally:
        gc.unfreeze()  # what the run built is garbage once it ends (tests train many runs)
        loader.close()
        if failed:  # the failure said is the first; a save in flight meets it again
            with contextlib.suppress(Exception):
                run.close()
        elif interrupted:
            # Every rank of the job was stopped: a save in flight loses the ranks that stopped
            # before joining it. That checkpoint is not complete, and the line names the last
            # one that is.
            with contextlib.suppress(CollectiveError):
                run.close()
        else:
            run.close()  # waits for the last checkpoint (one being written when interrupted too)
    if interrupted:
        raise Interrupted(_interrupted_line(run, done))
    _report_saves(run)
    return history


def evaluate_only(run: Run) -> float:
    """``--eval_only``: the validation loss of the loaded weights, reported and logged."""
    try:
        scores = run.evaluate(run.start_step)  # a blend's corpora add theirs
        loss = scores["eval_loss"]
        perplexity = math.exp(loss) if loss < 700 else math.inf
        metrics = {"step": run.start_step, **scores, "eval_perplexity": perplexity}
        run.tracker.log(metrics)
        if run.engine.layout.is_main:
            print(f"validation loss {loss:.4f}, perplexity {perplexity:.2f}", flush=True)
    finally:
        run.close()
    return loss


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
