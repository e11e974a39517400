"""What each phase computes: functions of (step, phase), one per kind of
:data:`execution.engine.phases.schedule.PHASE_KINDS`, gathered in :data:`BODIES`.

A body loads its part's weights once and runs the part for every micro-batch of its pass; the
layers never know they are phased (one stateless template block is bound to each layer's
weights in turn, once per phase: :mod:`execution.engine.phases.binding`). Each micro-batch's temporaries (its input copy,
output, gradients) are dropped before the next micro-batch runs: a loop variable would hold
them through the next one's compute (a whole layer's weight gradients in the backward), and
the working set, which the planner measures at one micro-batch per pass, would grow once a
pass holds two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from execution.engine.phases import pipeline, schedule
from execution.engine.phases.head import head
from execution.engine.phases.schedule import Phase
from execution.engine.phases.step import Step
from execution.engine.phases.task_head import task_head
from modelling.gpt import EMBEDDING, LAYERS


@torch.no_grad()
def embedding_forward(step: Step, phase: Phase) -> None:
    context, batch = step.context, step.batch
    weights = context.state.load_weights(EMBEDDING, 0, context.dtype)
    embedding = context.templates[EMBEDDING]
    with context.slots[EMBEDDING].bound(weights):
        for m, e in step.entries(phase):
            y = embedding(batch.ids[m], step.embedding_seed(m))
            context.state.activations.store_x(0, e, y)
            del y  # not held through the next micro-batch (module docstring)


@torch.no_grad()
def layer_forward(step: Step, phase: Phase) -> None:
    context, n, state = step.context, phase.layer, step.context.state
    if step.batch.training and context.kept is not None:  # keep the graph for the backward
        vectors = state.load_weight_vectors(LAYERS, n, context.dtype)
        views = context.kept.views(vectors)
        for m, e in step.entries(phase):
            x, seeds = state.activations.fetch_x(n, e), step.layer_seeds(n, m)
            y = context.kept.forward(n, e, vectors, views, x, seeds)
            state.activations.store_x(n + 1, e, y)
            del x, y
        return
    block = context.templates[LAYERS]
    with context.slots[LAYERS].bound(state.load_weights(LAYERS, n, context.dtype)):
        for m, e in step.entries(phase):
            x = state.activations.fetch_x(n, e)
            y = block(x, step.layer_seeds(n, m))
            state.activations.store_x(n + 1, e, y)
            del x, y


def layer_backward(step: Step, phase: Phase) -> None:
    """Recompute layer n for each micro-batch (what ``--recompute`` did not keep),
    backpropagate, reduce its grads."""
    context, n, state = step.context, phase.layer, step.context.state
    acc = step.accumulators(LAYERS)
    if context.kept is not None:
        vectors = state.load_weight_vectors(LAYERS, n, context.dtype)
        for _, e in step.entries(phase):
            dx = context.kept.backward(n, e, vectors, state.activations.fetch_dx(n + 1, e), acc)
            state.activations.store_dx(n, e, dx)
            del dx
        step.finish_grads(acc, n, phase)
        return
    weights = state.load_weights(LAYERS, n, context.dtype)
    weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
    inputs, block = list(weights.values()), context.templates[LAYERS]
    with context.slots[LAYERS].bound(weights):
        for m, e in step.entries(phase):
            x = state.activations.fetch_x(n, e).requires_grad_()
            with torch.enable_grad():
                y = block(x, step.layer_seeds(n, m))
            dx, *grads = torch.autograd.grad(y, [x, *inputs], state.activations.fetch_dx(n + 1, e))
            state.activations.store_dx(n, e, dx)
            acc.add(weights, grads)
            del x, y, dx, grads
    step.finish_grads(acc, n, phase)


def embedding_backward(step: Step, phase: Phase) -> None:
    """Embedding grads, added to the tied grad the head phase left in the step's gradients."""
    context, batch = step.context, step.batch
    weights = context.state.load_weights(EMBEDDING, 0, context.dtype)
    weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
    acc = step.accumulators(EMBEDDING)
    inputs, embedding = list(weights.values()), context.templates[EMBEDDING]
    # The word table's gradient: its rows added as they are made (modelling.grad_sinks).
    sinks = {"word.weight": acc.sink("word.weight")}
    with context.slots[EMBEDDING].bound(weights):
        for m, e in step.entries(phase):
            with torch.enable_grad():
                y = embedding(batch.ids[m], step.embedding_seed(m), sinks)
            grads = torch.autograd.grad(y, inputs, context.state.activations.fetch_dx(0, e))
            acc.add(weights, grads)
            del y, grads
    # With a pipeline the last stage holds the head's tied part: the sum is complete, and
    # counted in the norm, only after the two are added (pipeline.sum_tied_gradient).
    step.finish_grads(acc, 0, phase, norm=not context.tied_across_stages)


def move(step: Step, phase: Phase) -> None:
    """A pipeline stage's boundary activations (or their gradients) in or out."""
    entries = [e for _, e in step.entries(phase)]
    context = step.context
    pipeline.move(context.link, context.state, phase, range(entries[0], entries[-1] + 1))


BODIES: dict[str, Callable[[Step, Phase], None]] = {
    schedule.EMBEDDING_FORWARD: embedding_forward,
    schedule.LAYER_FORWARD: layer_forward,
    schedule.HEAD_PHASE: head,
    schedule.UNTIED_HEAD: head,
    schedule.TASK_HEAD: task_head,
    schedule.LAYER_BACKWARD: layer_backward,
    schedule.EMBEDDING_BACKWARD: embedding_backward,
    **dict.fromkeys(schedule.MOVES, move),
}
assert BODIES.keys() == schedule.PHASE_KINDS.keys(), "a body for every kind of phase"
