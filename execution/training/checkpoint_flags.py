"""The check of the checkpoint flags that needs more than the flags themselves: a resumed
checkpoint's sparsity. :func:`~execution.training.build.assemble` runs it before anything is
planned or written, so a refused run changes nothing on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config.loading import ConfigError
from config.schema import PretrainingConfig


def check_resumed_sparsity(
    config: PretrainingConfig, trainer: dict[str, Any], folder: Path
) -> None:
    """Raises a one-line ConfigError if a run resuming the checkpoint ``folder`` (its trainer
    state ``trainer``) would not train the sparsity it was saved with.

    A sparse checkpoint holds its masks: resumed dense, they would be dropped; resumed at
    another sparsity or distribution, they would be kept while the run records the new value.
    A dense checkpoint may be resumed sparse: its weights are pruned to the run's drawn masks,
    as docs/rigl.md says, and the run records the sparsity it trains.
    """
    saved = trainer["config"].get("rigl", {})
    sparsity = saved.get("sparsity", 0.0)
    distribution = saved.get("sparsity_distribution", "erk")
    if not sparsity:
        return
    r = config.rigl
    if (r.sparsity, r.sparsity_distribution) == (sparsity, distribution):
        return
    ours = f"--sparsity {r.sparsity}" + (
        f" --sparsity_distribution {r.sparsity_distribution}" if r.sparsity else ""
    )
    raise ConfigError(
        f"checkpoint {folder} was trained with --sparsity {sparsity} --sparsity_distribution "
        f"{distribution} and holds those masks, but this run has {ours}; resume it with "
        f"--sparsity {sparsity} --sparsity_distribution {distribution}"
    )
