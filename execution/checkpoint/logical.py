"""Logical-state I/O: an engine's sharded rows <-> the unsharded, unpadded tensors of the model.

A logical tensor is what a single-process model holds (``layers.3.attn.qkv.weight``). Writing
one takes this rank's tensor-parallel shard of it (:func:`~execution.parallel.sharding.shard_part`)
and stores the RTS slice of that; reading gathers the RTS slices and the tensor-parallel shards
back (collective over every rank) and unshards them. Checkpoints, HuggingFace import and export,
and the tests' comparisons with a single-process model all go through here.
"""

from __future__ import annotations

import torch

from execution.engine.engine import PhasedEngine
from execution.parallel.sharding import shard_part, unshard_part
from modelling.gpt import qualified_name


def tensor_key(state: str, part: str, row: int, name: str) -> str:
    """Checkpoint key of one logical tensor: ``{state}/{name as in GPT}``."""
    return f"{state}/{qualified_name(part, row, name)}"


def write_part_state(
    engine: PhasedEngine, part: str, row: int, state: str, full: dict[str, torch.Tensor]
) -> None:
    """Stores this rank's share (TP shard, then RTS slice) of a part's logical tensors.

    Args:
        engine: This rank's engine.
        part, row: Which part (``row`` is the layer for ``layers``, else 0).
        state: ``weights``, ``exp_avg`` or ``exp_avg_sq``.
        full: Unsharded, unpadded float32 tensors named within the part (as in :class:`GPT`).
    """
    layout = engine.layout
    local = shard_part(part, full, engine.shapes, layout.tp1.rank, layout.tp2.rank)
    engine.state.write_shard(part, row, state, local)


def read_part_state(
    engine: PhasedEngine, part: str, row: int, state: str = "weights"
) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded float32 tensors of one part, named within the part.

    Collective over all ranks. ``state`` is ``weights``, ``grads`` (the last step's mean
    gradients, loss scale included), ``exp_avg`` or ``exp_avg_sq``.
    """
    tp1, tp2 = engine.layout.tp1, engine.layout.tp2
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for kind, spec in engine.specs[part].items():
        stored = getattr(engine.state.parts[part], state)[kind][row].to(engine.device)
        packed = tp1.all_gather(tp2.all_gather(engine.rts[kind].all_gather(stored)))
        for index, flat in enumerate(packed.view(-1, spec.padded).cpu()):
            shards.setdefault(divmod(index, tp2.size), {}).update(spec.views(flat))
    return {name: t.clone() for name, t in unshard_part(part, shards, engine.shapes).items()}


def full_state(engine: PhasedEngine, state: str = "weights") -> dict[str, torch.Tensor]:
    """Unsharded, unpadded float32 tensors of every parameter, named as in :class:`GPT`.

    Collective over all ranks. ``state`` is ``weights``, ``grads`` (the last step's mean
    gradients, loss scale removed), ``exp_avg`` or ``exp_avg_sq``. A pipeline stage gives the
    parameters it holds (the first and the last stage both the word embedding).
    """
    out = {}
    for part, row in engine.state.part_rows():
        layer = engine.state.logical_row(part, row)
        for name, t in read_part_state(engine, part, row, state).items():
            out[qualified_name(part, layer, name)] = t
    if state == "grads":
        out = {k: v / engine.plan.loss_scaling for k, v in out.items()}
    return out
