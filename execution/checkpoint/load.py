"""Loading checkpoints into an engine of any layout, and reading their weights in one process.

A checkpoint holds logical tensors, so each rank reads one part row at a time and keeps its own
shard of it (:func:`~execution.checkpoint.logical.write_part_state`): no rank holds the whole
model. HuggingFace GPT-2 folders load the same way (weights only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from config.loading import ConfigError
from execution.checkpoint.files import (
    SAVED_STATES,
    CheckpointError,
    check_shapes,
    dcp_load,
    read_trainer_state,
    resolve,
    stored_shapes,
    verify,
)
from execution.checkpoint.logical import tensor_key, write_part_state
from execution.engine.phases import PhasedEngine
from modelling.gpt import part_inits, qualified_name
from modelling.hf_interchange import HFWeights, hf_name


def load_checkpoint(path: str | Path, engine: PhasedEngine) -> dict[str, Any]:
    """Loads weights, AdamW moments, optimizer step and RNG into ``engine`` (any layout).

    Collective (checks are agreed between ranks). Each rank reads one part row at a time and
    keeps its own shard, so no rank holds the whole model.

    Returns:
        The checkpoint's trainer state (``step``, ``loader``, ...).

    Raises:
        CheckpointError: missing, incomplete or damaged files, or another model shape.
    """
    layout = engine.layout
    problem = None
    try:
        folder = resolve(path)
        problem = verify(folder, layout.world.rank, layout.world.size)
    except CheckpointError as err:
        folder, problem = None, str(err)
    if layout.world.size > 1:  # every rank stops on a problem any rank found
        problems: list[str | None] = [None] * layout.world.size
        dist.all_gather_object(problems, problem, group=layout.world.group)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)
    assert folder is not None
    trainer = read_trainer_state(folder)
    check_shapes(folder, engine.shapes)
    for part, row in engine.state.part_rows():  # one part row in memory at a time
        inits = part_inits(engine.shapes, part)
        keys = {(s, n): tensor_key(s, part, row, n) for s in SAVED_STATES for n in inits}
        state = {key: torch.empty(inits[n].shape) for (_, n), key in keys.items()}
        dcp_load(state, folder)
        for s in SAVED_STATES:
            full = {n: state[keys[s, n]] for n in inits}
            write_part_state(engine, part, row, s, full)
    engine.optimizer_steps = int(trainer["optimizer_steps"])
    rng = _rng_state(folder)
    if "rng/cpu" in rng:
        torch.set_rng_state(rng["rng/cpu"])
    if "rng/cuda" in rng and layout.device.type == "cuda":
        torch.cuda.set_rng_state(rng["rng/cuda"], layout.device)
    trainer["folder"] = str(folder)
    return trainer


def _rng_state(folder: Path) -> dict[str, torch.Tensor]:
    stored = stored_shapes(folder)
    state = {
        k: torch.empty(shape, dtype=torch.uint8)
        for k, shape in stored.items()
        if k.startswith("rng/")
    }
    if state:
        dcp_load(state, folder)
    return state


def read_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The saved run's config and every logical weight, in one process (generation, export).

    Returns:
        (the saved run's ``model`` config section as a dict, weights named as in :class:`GPT`).
    """
    folder = resolve(path)
    problem = verify(folder)
    if problem:
        raise CheckpointError(problem)
    trainer = read_trainer_state(folder)
    stored = stored_shapes(folder)
    state = {k: torch.empty(shape) for k, shape in stored.items() if k.startswith("weights/")}
    dcp_load(state, folder)
    return trainer["config"]["model"], {k.removeprefix("weights/"): t for k, t in state.items()}


def load_hf_weights(folder: str | Path, engine: PhasedEngine) -> None:
    """Starts ``engine`` from a local HuggingFace GPT-2 folder (weights; moments stay zero).

    Not collective: every rank reads each tensor and keeps its shard, one part row at a time.

    Raises:
        ConfigError: unreadable files, or a model shape that differs from the run's flags.
    """
    hf = HFWeights(folder)
    hf.check_shape(engine.config.model)
    for part, row in engine.state.part_rows():
        full = {}
        for name, init in part_inits(engine.shapes, part).items():
            ours = qualified_name(part, row, name)
            t = hf.get(ours)
            if tuple(t.shape) != init.shape:
                raise ConfigError(
                    f"--hf_model {folder}: tensor {hf_name(ours)[0]} gives {ours} the shape "
                    f"{list(t.shape)}, this model needs {list(init.shape)}"
                )
            full[name] = t
        write_part_state(engine, part, row, "weights", full)
