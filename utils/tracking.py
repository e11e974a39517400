"""Where step metrics go: a JSON-lines file, the console and, optionally, Weights & Biases.

Only the main rank builds real trackers; the others get :class:`NullTracker`, so training code
calls ``tracker.log`` unconditionally and tests never need wandb.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Protocol, TextIO

from config.schema import LoggingConfig


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _finite_or_none(value: Any) -> Any:
    """NaN and inf floats become None (JSON has no spelling for them); anything else is kept."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlTracker:
    """Appends one JSON object per call to ``path`` (flushed, so a crash loses nothing)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def log(self, metrics: dict[str, Any]) -> None:
        clean = {key: _finite_or_none(value) for key, value in metrics.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleTracker:
    """A human-readable line per logged training step (every ``every`` steps) and evaluation."""

    def __init__(self, total_steps: int, every: int, stream: TextIO | None = None):
        # None: the sys.stdout of the moment each line is written (not of the import), so a
        # redirect_stdout around a run catches its lines.
        self.total_steps, self.every, self.stream = total_steps, every, stream

    def log(self, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        if "loss" not in metrics:  # an evaluation: every score it gives
            scores = (f"{key} {value:.4f}" for key, value in metrics.items() if key != "step")
            line = " | ".join([f"step {step:>6}/{self.total_steps}", *scores])
        elif step % self.every and step != self.total_steps and step != 1:
            return
        else:
            line = self._step_line(metrics)
        print(line, file=self.stream or sys.stdout, flush=True)

    def _step_line(self, metrics: dict[str, Any]) -> str:
        mfu = metrics.get("mfu")
        parts = [
            f"step {metrics['step']:>6}/{self.total_steps}",
            f"loss {metrics['loss']:.4f}",
            f"lr {metrics['lr']:.3e}",
            f"grad_norm {metrics['grad_norm']:.3f}",
            f"{metrics['tokens_per_sec']:,.0f} tok/s",
            f"{metrics['tflops']:.3f} TFLOPS",
            f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}",
            f"{metrics['step_time']:.2f} s",
        ]
        if (data_time := metrics.get("data_time")) is not None:
            parts.append(f"data {data_time:.3f} s")
        drawn = [value for key, value in metrics.items() if key.startswith("windows_drawn_")]
        if drawn:  # a blend: the windows each corpus has given so far
            parts.append("drawn " + "/".join(f"{n:,}" for n in drawn))
        if metrics.get("skipped"):
            parts.append("SKIPPED (non-finite grads)")
        if skipped_records := metrics.get("skipped_records"):
            parts.append(f"{skipped_records} corrupt records skipped")
        return " | ".join(parts)

    def close(self) -> None:
        pass


class WandbTracker:
    """Logs the same keys to Weights & Biases (``mode='offline'`` needs no network)."""

    def __init__(self, project: str, mode: str, config: dict[str, Any], directory: Path):
        import wandb  # imported here: wandb is optional and slow to import

        self._run = wandb.init(project=project, mode=mode, config=config, dir=str(directory))

    def log(self, metrics: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in metrics.items() if v is not None}, step=metrics["step"])

    def close(self) -> None:
        self._run.finish()


class MultiTracker:
    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, metrics: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log(metrics)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def run_trackers(
    logging: LoggingConfig, output_dir: Path, total_steps: int, run_config: dict[str, Any]
) -> Tracker:
    """The main rank's trackers for a run's ``logging`` section: ``metrics.jsonl`` in
    ``output_dir``, the console and, with ``--wandb``, Weights & Biases (given the whole run's
    config as a dict to record)."""
    trackers: list[Tracker] = [
        JsonlTracker(output_dir / "metrics.jsonl"),
        ConsoleTracker(total_steps, logging.log_every),
    ]
    if logging.wandb:
        trackers.append(
            WandbTracker(logging.wandb_project, logging.wandb_mode, run_config, output_dir)
        )
    return MultiTracker(trackers)
