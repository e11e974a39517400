"""The task head phase: a fine-tuning head (:mod:`modelling.task_heads`) in place of the
language model's.

It is :mod:`execution.engine.phases.head`'s phase without the tie: the head's projection is its own
(sharded over tp2, RTS-split over dp x tp1 like the layer norms beside it), so only the head's
weights are loaded and no gradient is handed to the embedding. Evaluating with
``Batch.keep_outputs`` (:meth:`~execution.engine.engine.PhasedEngine.predict`) keeps the head's
logits of each micro-batch instead of its loss.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from execution.engine.phases.schedule import Phase
from execution.engine.phases.step import Step
from modelling.gpt import HEAD


def task_head(step: Step, phase: Phase) -> None:
    """Loss (or logits) per micro-batch; when training, dx at the last boundary and the
    head's grads."""
    context, batch = step.context, step.batch
    state, backward = context.state, batch.training
    last = context.stage.layers
    weights = state.load_weights(HEAD, 0, context.dtype)
    template = context.templates[HEAD]
    if backward:
        weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
        acc = step.accumulators(HEAD)
        # Every micro-batch's loss is 1/GA of the step's, whatever the passes. Filled on the
        # device: a tensor of host data would be a blocking copy (a sync).
        scale = torch.full(
            (), context.plan.loss_scaling / batch.micro_batches, device=context.device
        )
    for m, e in step.entries(phase):
        x = state.activations.fetch_x(last, e)
        if batch.keep_outputs:
            with torch.no_grad():
                logits = functional_call(template, weights, (x, batch.labels[m], True))
            batch.outputs.append(logits.float())
            del x, logits
            continue
        with torch.set_grad_enabled(backward):
            x.requires_grad_(backward)
            loss = functional_call(template, weights, (x, batch.labels[m]))
        batch.losses.append(loss.detach())
        if backward:
            dx, *grads = torch.autograd.grad(loss, [x, *weights.values()], scale)
            state.activations.store_dx(last, e, dx)
            acc.add(weights, grads)
            del dx, grads
        del x, loss
    if backward:
        step.finish_grads(acc, 0, phase)
