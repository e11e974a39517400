"""What a phase body may use: :class:`PhaseContext`, built once by the engine.

A body (:mod:`execution.engine.phases.bodies`, :mod:`execution.engine.phases.head`,
:mod:`execution.engine.phases.task_head`) reads the rank's buffers, templates and geometry through
this frozen record and through nothing else, so a reader of a body sees all it depends on,
and the bodies never import the engine that runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from execution.engine.phases.binding import WeightSlots
from execution.engine.phases.pipeline import Link
from execution.engine.phases.recompute import KeptLayers
from execution.engine.phases.schedule import Stage
from execution.engine.plan import EnginePlan
from execution.engine.storage.buffers import FlatSpec
from execution.engine.storage.state import StateStore
from execution.parallel.mesh import GroupAxis
from modelling.gpt import GPTShapes


@dataclass(frozen=True)
class PhaseContext:
    """One rank's view for its phase bodies: read, never changed, for the rank's life.

    Attributes:
        plan: How this rank executes (seeds, loss scaling, overlap).
        shapes: This rank's shard shapes of the model.
        state: The rank's buffers: weights, gradients, activations.
        templates: The stateless part modules, by part, bound to weights per phase.
        slots: Where each template holds its parameters, by part (binds a phase's weights).
        kept: What the layers keep for their backward; None when they recompute in full.
        link: The pipeline's boundary transfers of this stage.
        stage: This rank's pipeline stage (its layers).
        dtype: The compute dtype.
        device: The rank's device.
        specs: The flat layout of each part's tensors, by kind (the accumulators').
        rts: The replicated-tensor-sharding axis of each parameter kind.
        dp: The data-parallel axis (a micro-batch's global index, the gradient mean).
        cp: The context-parallel axis (the sequence pieces of a micro-batch's loss).
        dp_cp: The replicas that reduce a matrix's gradient.
        tied_across_stages: The word embedding's gradient is summed over the first and last
            pipeline stage (the language model's head is tied to it).
        compiled: The templates run compiled (``--compile``): dropout seeds go to them as
            tensors (:mod:`execution.engine.phases.compiled`).
        head_sinks: The head sums its vocabulary-wide weight's gradient where it makes it
            (:mod:`modelling.grad_sinks`; :func:`sinks_in_head`), and a dry run that prices
            the run meters its head so.
    """

    plan: EnginePlan
    shapes: GPTShapes
    state: StateStore
    templates: Mapping[str, nn.Module]
    slots: Mapping[str, WeightSlots]
    kept: KeptLayers | None
    link: Link
    stage: Stage
    dtype: torch.dtype
    device: torch.device
    specs: Mapping[str, Mapping[str, FlatSpec]]
    rts: Mapping[str, GroupAxis]
    dp: GroupAxis
    cp: GroupAxis
    dp_cp: GroupAxis
    tied_across_stages: bool
    compiled: bool = False
    head_sinks: bool = True


def sinks_in_head(compiled: bool, dtype: torch.dtype) -> bool:
    """Whether the head sums its projection's gradient where it makes it
    (:mod:`modelling.grad_sinks`): an eager head always; a compiled one where the sink
    multiplies into the float32 sum in the product's own kernel (float32 compute), since the
    sunk projection runs between the head's graphs. In 16 bits a sink makes the product and
    adds it, as autograd's gradient is added, and would only split the compiled head."""
    return not compiled or dtype == torch.float32
