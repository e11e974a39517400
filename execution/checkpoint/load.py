"""Loading checkpoints into an engine of any layout, and reading their weights in one process.

A checkpoint holds chunks of logical tensors (DCP's index says which), so a rank of any layout
reads only the saved chunks that overlap its own (:mod:`execution.checkpoint.dcp_plans`), and a
single process reads one logical tensor at a time (:class:`SavedWeights`). Checkpoints written
before chunked saves (one chunk per tensor) load the same way. HuggingFace GPT-2 folders load
one part row at a time (weights only).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from config.loading import ConfigError, one_line
from config.model_math import model_section
from config.schema_model import ModelConfig
from execution.checkpoint.files import (
    MASKS,
    CheckpointError,
    check_shapes,
    dcp_load,
    newest_intact,
    read_trainer_state,
    resolve,
    single_process_quiet,
    stored_shapes,
    verify,
)
from execution.checkpoint.logical import write_part_state
from execution.engine.engine import PhasedEngine
from modelling.gpt import (
    HEAD,
    GPTShapes,
    init_full_part,
    logical_shapes,
    part_inits,
    qualified_name,
)
from modelling.hf_interchange import HFModelError, open_hf_weights
from modelling.task_heads import HF_TASK_NAMES


def load_checkpoint(path: str | Path, engine: PhasedEngine) -> dict[str, Any]:
    """Loads weights, AdamW moments, optimizer step and RNG into ``engine`` (any layout).

    Collective (checks are agreed between ranks). Each rank reads only the saved chunks that
    overlap what it holds, straight into its buffers: no rank assembles a logical tensor.

    Returns:
        The checkpoint's trainer state (``step``, ``loader``, ...).

    Raises:
        CheckpointError: missing, incomplete or damaged files, or another model shape.
    """
    layout = engine.layout
    folder = _verified(path, layout)
    trainer = read_trainer_state(folder)
    check_shapes(folder, engine.shapes)
    _read_held_chunks(engine, folder)
    engine.optimizer_steps = int(trainer["optimizer_steps"])
    rng = _rng_state(folder)
    if "rng/cpu" in rng:
        torch.set_rng_state(rng["rng/cpu"])
    if "rng/cuda" in rng and layout.device.type == "cuda":
        torch.cuda.set_rng_state(rng["rng/cuda"], layout.device)
    trainer["folder"] = str(folder)
    return trainer


def load_pretrained_weights(path: str | Path, engine: PhasedEngine) -> dict[str, Any]:
    """Loads a pretraining checkpoint's weights into a fine-tuning ``engine`` (any layout).

    Only the weights: AdamW moments, the optimizer step, the RNG and the data position are the
    pretraining run's, not this one's. The task's projection, which the checkpoint does not
    have, keeps its initialisation. Collective, as :func:`load_checkpoint`.

    Returns:
        The checkpoint's trainer state.

    Raises:
        CheckpointError: missing, incomplete or damaged files, or another model's shape.
    """
    folder = _verified(path, engine.layout)
    trainer = read_trainer_state(folder)
    language_model = dataclasses.replace(engine.shapes, task_head=None)
    check_shapes(folder, language_model, states=("weights",))
    saved = {f"weights/{name}" for name in logical_shapes(language_model)}
    _read_held_chunks(engine, folder, lambda item: item.key in saved)
    trainer["folder"] = str(folder)
    return trainer


def _verified(path: str | Path, layout) -> Path:
    """The checkpoint folder ``path`` means, its files checked (collective: every rank stops
    on a problem any rank found)."""
    problem = None
    try:
        folder = resolve(path)
        problem = verify(folder, layout.world.rank, layout.world.size)
    except CheckpointError as err:
        folder, problem = None, str(err)
    problem = _agreed(problem, layout)
    if problem:
        # Every rank checks the same earlier checkpoints, each its share of their files.
        def other_problem(other: Path) -> str | None:
            return _agreed(verify(other, layout.world.rank, layout.world.size), layout)

        raise CheckpointError(problem + newest_intact(path, other_problem))
    assert folder is not None
    return folder


def _agreed(problem: str | None, layout) -> str | None:
    """The first rank's problem, on every rank (collective when there are several)."""
    if layout.world.size > 1:
        problems: list[str | None] = [None] * layout.world.size
        dist.all_gather_object(problems, problem, group=layout.world.group)
        problem = next((p for p in problems if p), None)
    return problem


def _read_held_chunks(
    engine: PhasedEngine, folder: Path, wanted: Callable[[Any], bool] | None = None
) -> None:
    """Reads the saved chunks that overlap this rank's own (those ``wanted`` takes, or all)
    into its buffers, in place.

    Not collective: each rank plans its reads from DCP's index alone. The extra memory is
    one saved chunk at a time (as read from the file, and as a tensor), whatever the layout
    that wrote it.
    """
    import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

    from execution.checkpoint.dcp_plans import ChunkLoadPlanner, held_items

    buffers, masks = engine.state.parts, engine.state.masks
    items = [item for item in held_items(engine) if wanted is None or wanted(item)]
    # RigL's masks are read as float32 0/1 into a staging copy; a checkpoint without them (a
    # dense run's) keeps the masks this run drew, and its weights are pruned to them.
    saved_masks = any(key.startswith(f"{MASKS}/") for key in stored_shapes(folder))
    if not saved_masks:
        items = [item for item in items if item.state != MASKS]
    staged = None if masks is None else torch.zeros(masks.rows.shape)

    def row_of(item) -> torch.Tensor:
        if item.state == MASKS:
            return staged[item.row]
        return getattr(buffers[item.part], item.state)[item.chunk.kind][item.row]

    planner = ChunkLoadPlanner(items, row_of)
    reader = dcp.FileSystemReader(folder)
    try:
        with single_process_quiet():
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    except Exception as err:  # a file that passed its CRC but still fails to read
        message = one_line(err, limit=300)
        raise CheckpointError(f"cannot read checkpoint {folder}: {message}") from None
    if masks is not None and saved_masks:
        masks.rows.copy_(staged > 0.5)
    engine.state.weights_written()
    if engine.rigl is not None:
        engine.rigl.apply()


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


class SavedWeights(Mapping[str, torch.Tensor]):
    """The logical weights of a checkpoint, named as in :class:`GPT`, each read when asked for.

    Reading one tensor reads only the saved chunks of it, so a consumer that takes one tensor
    at a time (building a model, exporting) needs memory for about one tensor beside its own.

    Attributes:
        shapes: Logical shape of every weight, from DCP's index (no data read).
    """

    def __init__(self, folder: Path):
        import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

        class _IndexedOnce(dcp.FileSystemReader):
            """DCP reads the index at every load; it is the same for every tensor."""

            @functools.cache  # noqa: B019 - one reader per SavedWeights, kept with it
            def read_metadata(self, *args, **kwargs):
                return super().read_metadata(*args, **kwargs)

        self.folder = folder
        self.shapes = {
            k.removeprefix("weights/"): shape
            for k, shape in stored_shapes(folder).items()
            if k.startswith("weights/")
        }
        self._reader = _IndexedOnce(folder)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        state = {f"weights/{name}": torch.empty(self.shapes[name])}
        dcp_load(state, self.folder, self._reader)
        return state[f"weights/{name}"]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def read_weights(path: str | Path) -> tuple[dict[str, Any], SavedWeights]:
    """The saved run's config and its logical weights, read one at a time (generation, export).

    Returns:
        (the saved run's ``model`` config section as a dict, every field present, the
        weights by name).

    Raises:
        CheckpointError: a missing or damaged checkpoint, or a model this program cannot
            compute (a model flag it does not have).
    """
    try:
        folder = resolve(path)
        problem = verify(folder)
    except CheckpointError as err:
        problem = str(err)
    if problem:
        raise CheckpointError(problem + newest_intact(path, verify))
    trainer = read_trainer_state(folder)
    # Every value of the model is the checkpoint's: no flag of the reader can change its math.
    model = model_section(trainer["config"]["model"], f"checkpoint {folder}", CheckpointError)
    return model, SavedWeights(folder)


def saved_model_shapes(model: dict[str, Any]) -> GPTShapes:
    """The single-device sizes of a saved run's ``model`` section (:func:`read_weights`); a
    section saved before a field existed takes that field's default."""
    model = model_section(model, "the checkpoint", CheckpointError)
    return GPTShapes.from_config(ModelConfig(**model))


@contextmanager
def hf_model_mistakes() -> Iterator[None]:
    """Says an unusable ``--hf_model`` folder (:class:`HFModelError`) as the run's other
    configuration mistakes are said: a ConfigError, one line and exit 2."""
    try:
        yield
    except HFModelError as err:
        raise ConfigError(str(err)) from None


def load_hf_weights(folder: str | Path, engine: PhasedEngine) -> None:
    """Starts ``engine`` from a local HuggingFace GPT-2 or Llama folder (weights; moments stay
    zero).

    Not collective: every rank reads each tensor and keeps its shard, one part row at a time.

    Raises:
        ConfigError: unreadable files, or a model shape that differs from the run's flags.
    """
    with hf_model_mistakes():
        hf = open_hf_weights(folder)
        hf.check_shape(engine.plan.model)
        drawn_head: dict[str, torch.Tensor] = {}  # the run's own initial head, drawn at most once
        for part, row in engine.state.part_rows():
            full = {}
            for name, init in part_inits(engine.shapes, part).items():
                ours = qualified_name(part, engine.state.logical_row(part, row), name)
                if ours in HF_TASK_NAMES and not hf.has(ours):  # a GPT2LMHeadModel: no projection
                    if not drawn_head:
                        plan = engine.plan
                        drawn_head = init_full_part(
                            engine.shapes, HEAD, 0, plan.seed, plan.init_std
                        )
                    full[name] = drawn_head[name]
                    continue
                t = hf.get(ours)
                if tuple(t.shape) != init.shape:
                    raise ConfigError(
                        f"--hf_model {folder}: tensor {hf.source_name(ours)} gives {ours} the shape "
                        f"{list(t.shape)}, this model needs {list(init.shape)}"
                    )
                full[name] = t
            write_part_state(engine, part, row, "weights", full)
    if engine.rigl is not None:  # dense weights pruned to this run's initial masks
        engine.rigl.apply()
