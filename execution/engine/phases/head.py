"""The head phase: the loss of each micro-batch and, when training, its backward.

The head's output projection is tied to the word embedding, so this phase loads both; the
word embedding's gradient from the head starts the embedding's accumulation, completed by the
embedding backward phase (with a pipeline, on another stage: ``pipeline.sum_tied_gradient``).
An untied head (``UNTIED_HEAD``, Llama's) projects with its own weights: it loads the head
alone and hands the embedding nothing.
A task head other than the language model's goes beside this one, with its own kind in
:data:`execution.engine.phases.schedule.PHASE_KINDS`.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from execution.engine.phases.schedule import HEAD_PHASE, Phase
from execution.engine.phases.step import Step
from modelling.gpt import EMBEDDING, HEAD


def head(step: Step, phase: Phase) -> None:
    """Loss per micro-batch; when training, dx at the last boundary and the head's grads."""
    context, batch = step.context, step.batch
    state, backward = context.state, batch.training
    last = context.stage.layers
    weights = state.load_weights(HEAD, 0, context.dtype)
    tied = phase.kind == HEAD_PHASE
    # The tied word embedding, or none: it is the first of what the head is differentiated by.
    word = [state.load_weights(EMBEDDING, 0, context.dtype)["word.weight"]] if tied else []
    if backward:
        weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
        word = [w.detach().requires_grad_() for w in word]
        head_acc = step.accumulators(HEAD)
        tied_acc = step.accumulators(EMBEDDING) if tied else None
        # Every micro-batch's loss is 1/GA of the step's (whatever the passes), and each
        # sequence piece's mean loss 1/cp of its micro-batch's.
        pieces = batch.micro_batches * context.cp.size
        # Filled on the device: a tensor of host data would be a blocking copy (a sync).
        scale = torch.full((), context.plan.loss_scaling / pieces, device=context.device)
    for m, e in step.entries(phase):
        x = state.activations.fetch_x(last, e)
        with torch.set_grad_enabled(backward):
            x.requires_grad_(backward)
            inputs = (x, *word, batch.labels[m], context.shapes.vocab)
            loss = functional_call(context.templates[HEAD], weights, inputs)
        batch.losses.append(loss.detach())
        if backward:
            dx, *grads = torch.autograd.grad(loss, [x, *word, *weights.values()], scale)
            state.activations.store_dx(last, e, dx)
            if tied:
                tied_acc.add_one("word.weight", grads.pop(0))
            head_acc.add(weights, grads)
            del dx, grads
        del x, loss
    if backward:
        step.finish_grads(head_acc, 0, phase)
        if tied:
            # Not the last word on the embedding's grads (its backward phase adds its own),
            # so not counted in the norm yet.
            step.finish_grads(tied_acc, 0, phase, norm=False)
