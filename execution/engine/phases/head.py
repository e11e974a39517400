"""The head phase: the loss of each micro-batch and, when training, its backward.

The head's output projection is tied to the word embedding, so this phase loads both; the
word embedding's gradient from the head starts the embedding's accumulation, completed by the
embedding backward phase (with a pipeline, on another stage: ``pipeline.sum_tied_gradient``).
A task head other than the language model's goes beside this one, with its own kind in
:data:`execution.engine.phases.schedule.PHASE_KINDS`.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from execution.engine.phases.schedule import Phase
from execution.engine.phases.step import Step
from modelling.gpt import EMBEDDING, HEAD


def head(step: Step, phase: Phase) -> None:
    """Loss per micro-batch; when training, dx at the last boundary and the head's grads."""
    context, batch = step.context, step.batch
    state, backward = context.state, batch.training
    last = context.stage.layers
    weights = state.load_weights(HEAD, 0, context.dtype)
    word = state.load_weights(EMBEDDING, 0, context.dtype)["word.weight"]  # tied
    if backward:
        weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
        word = word.detach().requires_grad_()
        head_acc, tied_acc = step.accumulators(HEAD), step.accumulators(EMBEDDING)
        # Every micro-batch's loss is 1/GA of the step's (whatever the passes), and each
        # sequence piece's mean loss 1/cp of its micro-batch's.
        pieces = batch.micro_batches * context.cp.size
        # Filled on the device: a tensor of host data would be a blocking copy (a sync).
        scale = torch.full((), context.plan.loss_scaling / pieces, device=context.device)
    for m, e in step.entries(phase):
        x = state.activations.fetch_x(last, e)
        with torch.set_grad_enabled(backward):
            x.requires_grad_(backward)
            loss = functional_call(
                context.templates[HEAD], weights, (x, word, batch.labels[m], context.shapes.vocab)
            )
        batch.losses.append(loss.detach())
        if backward:
            dx, dword, *grads = torch.autograd.grad(loss, [x, word, *weights.values()], scale)
            state.activations.store_dx(last, e, dx)
            tied_acc.add_one("word.weight", dword)
            head_acc.add(weights, grads)
            del dx, dword, grads
        del x, loss
    if backward:
        step.finish_grads(head_acc, 0, phase)
        # Not the last word on the embedding's grads (its backward phase adds its own), so
        # not counted in the norm yet.
        step.finish_grads(tied_acc, 0, phase, norm=False)
