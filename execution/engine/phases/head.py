"""The head phase: the loss of each micro-batch and, when training, its backward.

The head's output projection is tied to the word embedding, so this phase loads both; the
word embedding's gradient from the head starts the embedding's accumulation, completed by the
embedding backward phase (with a pipeline, on another stage: ``pipeline.sum_tied_gradient``).
An untied head (``UNTIED_HEAD``, Llama's) projects with its own weights: it loads the head
alone and hands the embedding nothing.
A task head other than the language model's goes beside this one, with its own kind in
:data:`execution.engine.phases.schedule.PHASE_KINDS`.

A large vocabulary's head runs on chunks of a micro-batch's tokens
(:func:`modelling.lm_heads.logits_chunks`): each chunk's forward, then its backward, before the
next chunk's, so only one chunk's logits exist at a time. A chunk's loss is its tokens' mean, so it counts by its share of the tokens,
in the loss and in the gradient's scale. Chunking here rather than inside the head keeps the
head one module, compiled once for every chunk (``--compile``), and its cross-entropy the
vocabulary-parallel one, whose backward applies the loss scale before the logits' gradient is
rounded to the compute dtype (what float16's loss scaling needs). A micro-batch of one chunk
runs as before chunking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from execution.engine.phases.schedule import HEAD_PHASE, Phase
from execution.engine.phases.step import Step
from modelling.gpt import EMBEDDING, HEAD
from modelling.lm_heads import logits_chunks


def head(step: Step, phase: Phase) -> None:
    """Loss per micro-batch; when training, dx at the last boundary and the head's grads."""
    context, batch = step.context, step.batch
    state, backward = context.state, batch.training
    last, shapes = context.stage.layers, context.shapes
    weights = state.load_weights(HEAD, 0, context.dtype)
    tied = phase.kind == HEAD_PHASE
    # The tied word embedding, or none: it is the first of what the head is differentiated by.
    word = [state.load_weights(EMBEDDING, 0, context.dtype)["word.weight"]] if tied else []
    scale = add_grads = None
    sinks = {}
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
        # The vocabulary-wide weight's gradient summed as it is made (modelling.grad_sinks;
        # a compiled head runs the sunk projection between its graphs).
        if context.head_sinks:
            if tied:
                sinks["word.weight"] = tied_acc.sink("word.weight")
            elif "output.weight" in weights:
                sinks["output.weight"] = head_acc.sink("output.weight")

        def add_grads(grads: list[torch.Tensor]) -> None:
            if tied:
                tied_acc.add_one("word.weight", grads.pop(0))
            head_acc.add(weights, grads)

    template = context.templates[HEAD]
    given = {"grad_sinks": sinks} if sinks else {}  # a compiled head's call as before

    def call(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return template(x, *word, labels, shapes.vocab, **given)

    params = [*word, *weights.values()]
    local_vocab, local_hidden = shapes.vocab_padded // shapes.tp1, shapes.hidden // shapes.tp2
    with context.slots[HEAD].bound(weights):  # once for the phase (phases/binding.py)
        for m, e in step.entries(phase):
            x, labels = state.activations.fetch_x(last, e), batch.labels[m]
            chunks = logits_chunks(labels.numel(), shapes.vocab, local_vocab, local_hidden)
            loss, dx = head_on_chunks(call, params, x, labels, chunks, scale, add_grads)
            batch.losses.append(loss)
            if backward:
                state.activations.store_dx(last, e, dx)
            del x, loss, dx
    if backward:
        step.finish_grads(head_acc, 0, phase)
        if tied:
            # Not the last word on the embedding's grads (its backward phase adds its own),
            # so not counted in the norm yet.
            step.finish_grads(tied_acc, 0, phase, norm=False)


def head_on_chunks(
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    x: torch.Tensor,
    labels: torch.Tensor,
    chunks: list[slice],
    scale: torch.Tensor | None = None,
    add_grads: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch's loss (the mean over its tokens) and, with ``scale``, dx, from the
    head ``call(x, labels)`` (a mean loss) run on ``chunks`` of the tokens, each chunk's
    forward and backward before the next chunk's.

    Args:
        call: The head on a micro-batch's (B, S, h) x and (B, S) labels, or on a chunk's (1,
            tokens, h) and (1, tokens): the mean loss over their tokens.
        params: What the head's gradients are taken of, besides x.
        x: The micro-batch's final residual stream (B, S, h), contiguous.
        labels: Its next-token ids (B, S).
        chunks: Slices of the flattened tokens (:func:`modelling.lm_heads.logits_chunks`);
            one chunk runs the micro-batch whole.
        scale: The loss's gradient (loss scaling over the micro-batches); None: no backward.
        add_grads: Takes each chunk's gradients of ``params`` (a list, in their order).

    Returns:
        The loss (detached) and dx (B, S, h), or None without ``scale``.
    """
    backward, tokens = scale is not None, labels.numel()
    if len(chunks) == 1:  # whole: as before chunking
        with torch.set_grad_enabled(backward):
            x.requires_grad_(backward)
            loss = call(x, labels)
        if not backward:
            return loss.detach(), None
        dx, *grads = torch.autograd.grad(loss, [x, *params], scale)
        add_grads(grads)
        return loss.detach(), dx
    # (1, tokens, ...): a view of x; the labels (a strided view of the batch) are copied.
    flat_x, labels = x.view(1, tokens, -1), labels.reshape(1, tokens)
    dx = torch.empty_like(flat_x) if backward else None
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for rows in chunks:
        # A chunk's loss counts by its share of the tokens: in the loss and in its gradient.
        share = (rows.stop - rows.start) / tokens
        piece = flat_x[:, rows].detach()  # a leaf of its own
        with torch.set_grad_enabled(backward):
            piece.requires_grad_(backward)
            loss = call(piece, labels[:, rows])
        total.add_(loss.detach(), alpha=share)
        if backward:
            dpiece, *grads = torch.autograd.grad(loss, [piece, *params], scale * share)
            dx[:, rows] = dpiece
            add_grads(grads)
            del dpiece, grads
        del piece, loss
    return total, None if dx is None else dx.view(x.shape)
