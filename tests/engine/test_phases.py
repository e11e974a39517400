"""The engine's phases alone, in one process: each phase body (execution/engine/phases/bodies.py,
head.py) run over a pass of several micro-batches on activations written into the buffers by
hand, against the same part as an ordinary module holding the same weights, run micro-batch
by micro-batch with autograd (``.backward()`` accumulating into ``.grad``). What a phase adds
to the part's math is under test: its weights loaded from the buffers and bound to the one
template, the activation buffers' entries, what a layer keeps for its backward (or its
recompute), the per-phase accumulators, their store into the gradient buffers and the
step's sum of squares for the norm; the whole step against an autograd loop is
test_phased_equivalence.py's.

Tolerance: both sides run the same float32 ops on the same numbers, so the forward and a
fully recomputed backward agree to the bit. A layer that keeps its activations runs its
backward from what it kept, through the engine's own autograd function where attention's core
is recomputed (``selective``): bitwise too on the machines measured, but another code path,
whose kernels may group a sum another way on another CPU, so it is held to
``KEPT_TOLERANCE`` (1e-5 of the tensor's scale): a gradient here sums 4 micro-batches of 32
tokens, whose regrouping moves it by at most ~128 units of 2**-24 of that scale (8e-6). The
word embedding's gradient is the head's tied part plus the embedding's own: the engine adds
them once per phase, autograd once per micro-batch, the same 8 terms in another order
(measured 9.5e-8), held to the same bound. A wrong micro-batch, entry, weight or scale moves
a result by its own size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from execution.engine.phases.bodies import BODIES
from execution.engine.phases.schedule import (
    EMBEDDING_BACKWARD,
    EMBEDDING_FORWARD,
    HEAD_PHASE,
    LAYER_BACKWARD,
    LAYER_FORWARD,
    training_phases,
)
from execution.engine.phases.step import Batch, Step, sum_of_squares
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS
from tests.distributed import planned_engine
from tests.reference import relative_error, small_config

CPU = torch.device("cpu")
KEPT_TOLERANCE = 1e-5


def engine_of(*flags: str):
    """One process's engine over the small config, one pass over its 4 micro-batches."""
    config = small_config("--passes", "1", "--placement", "remote", *flags)
    engine = planned_engine(config, ParallelLayout.single(CPU))
    assert engine.memory.micro_batches_per_pass == config.gradient_accumulation == 4
    return engine, config


def buffer_tensors(engine, part: str, row: int, state: str) -> dict[str, torch.Tensor]:
    """One row of a part's buffers, as the part's named tensors (one process: no shards)."""
    named = {}
    for kind, spec in engine.specs[part].items():
        named.update(spec.views(getattr(engine.state.parts[part], state)[kind][row]))
    return {name: t.clone() for name, t in named.items()}


def reference_modules(engine) -> GPT:
    """A one-layer GPT of the engine's shapes holding its embedding's and head's weights, and
    as its layer the engine's last decoder layer."""
    model = GPT(dataclasses.replace(engine.shapes, layers=1))
    last = engine.shapes.layers - 1
    for module, part, row in (
        (model.embedding, EMBEDDING, 0),
        (model.layers[0], LAYERS, last),
        (model.head, HEAD, 0),
    ):
        module.load_state_dict(buffer_tensors(engine, part, row, "weights"), strict=True)
    return model


def random_like_x(engine, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` residual streams of one micro-batch, of the scale a layer sees."""
    shape = (*engine.state.activations.layout.tokens, engine.shapes.hidden)
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


def step_of(engine, config, seed: int = 0) -> Step:
    """A training step over random tokens (its index seeds no dropout: the config has none)."""
    ex, seq = config.execution, config.model.sequence_length
    shape = (config.gradient_accumulation, ex.micro_batch_size, seq + 1)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=generator)
    return Step(engine.context, Batch.of(tokens, 0, engine.layout.cp))


def run(step: Step, kind: str, layer: int = 0) -> None:
    """One phase of the step's schedule (one pass over its micro-batches), by its kind and
    layer: its body, then its gradients where they live."""
    context = step.context
    phases = training_phases(context.stage, step.batch.micro_batches, context.plan.memory.passes)
    (phase,) = [p for p in phases if (p.kind, p.layer) == (kind, layer)]
    assert phase.micro_batches == range(step.batch.micro_batches)
    BODIES[kind](step, phase)
    step.in_flight.finish()
    step.context.state.grads.settle()


def assert_agree(actual: torch.Tensor, expected: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(actual, expected), f"{what}: not bitwise"
    else:
        error = relative_error(actual, expected)
        assert error <= KEPT_TOLERANCE, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_a_layer_s_forward_and_backward_phases_are_the_layer_run_with_autograd(recompute):
    """The last layer's forward then backward phase over 4 micro-batches: each micro-batch's
    output and input gradient, and the layer's weight gradients summed over the micro-batches,
    against the layer as a module, micro-batch after micro-batch."""
    engine, config = engine_of("--recompute", recompute)
    layer = engine.shapes.layers - 1
    step, entries = step_of(engine, config), range(config.gradient_accumulation)
    activations = engine.state.activations
    xs, dys = random_like_x(engine, 4, seed=1), random_like_x(engine, 4, seed=2)
    for m in entries:  # one pass: entry m holds micro-batch m
        activations.store_x(layer, m, xs[m])
    run(step, LAYER_FORWARD, layer)
    ys = [activations.fetch_x(layer + 1, m).clone() for m in entries]
    for m in entries:
        activations.store_dx(layer + 1, m, dys[m])
    run(step, LAYER_BACKWARD, layer)
    dxs = [activations.fetch_dx(layer, m).clone() for m in entries]
    grads = buffer_tensors(engine, LAYERS, layer, "grads")

    block = reference_modules(engine).layers[0]
    for m in entries:
        x = xs[m].clone().requires_grad_()
        y = block(x, None)
        y.backward(dys[m])
        assert torch.equal(ys[m], y.detach()), f"micro-batch {m}: output not bitwise"
        assert_agree(dxs[m], x.grad, recompute == "full", f"micro-batch {m} dx")
    expected = {name: p.grad for name, p in block.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        assert_agree(grads[name], grad, recompute == "full", f"gradient of {name}")


def test_the_embedding_and_head_phases_are_the_model_s_with_autograd():
    """The embedding forward, the head (loss and backward, tied to the word embedding) and
    the embedding backward over 4 micro-batches: the boundary activations, the losses, the
    head's dx, the embedding's and head's gradients (the word embedding's from the head and
    from its own backward) and the step's sum of squares for the norm, against the embedding
    and head modules with autograd, each micro-batch's loss weighted 1/4 as in a step."""
    engine, config = engine_of("--recompute", "full")
    last, micro_batches = engine.shapes.layers, config.gradient_accumulation
    step, entries = step_of(engine, config, seed=3), range(micro_batches)
    activations, batch = engine.state.activations, step.batch
    run(step, EMBEDDING_FORWARD)
    x0 = [activations.fetch_x(0, m).clone() for m in entries]
    xs, dx0 = random_like_x(engine, 4, seed=4), random_like_x(engine, 4, seed=5)
    for m in entries:  # the last layer's output, as the head reads it
        activations.store_x(last, m, xs[m])
    run(step, HEAD_PHASE)
    dxs = [activations.fetch_dx(last, m).clone() for m in entries]
    for m in entries:  # the first layer's input gradient, as the embedding reads it
        activations.store_dx(0, m, dx0[m])
    run(step, EMBEDDING_BACKWARD)

    model = reference_modules(engine)
    losses = []
    for m in entries:
        ids, labels = batch.ids[m], batch.labels[m]
        x0_reference = model.embedding(ids, None)
        assert torch.equal(x0[m], x0_reference.detach()), f"micro-batch {m}: embedding"
        x = xs[m].clone().requires_grad_()
        loss = model.head(x, *model.head_inputs(labels))
        (loss / micro_batches).backward()
        x0_reference.backward(dx0[m])
        losses.append(loss.detach())
        assert torch.equal(dxs[m], x.grad), f"micro-batch {m}: the head's dx"
    assert torch.equal(torch.stack(batch.losses), torch.stack(losses))
    expected = {
        EMBEDDING: dict(model.embedding.named_parameters()),
        HEAD: dict(model.head.named_parameters()),
    }
    for part, params in expected.items():
        grads = buffer_tensors(engine, part, 0, "grads")
        assert grads.keys() == params.keys()
        for name, param in params.items():  # the tied sum adds in another order
            assert_agree(grads[name], param.grad, False, f"{part} gradient of {name}")
    # The norm counts each of the parts' gradients once, after its last addition.
    squares = sum(sum_of_squares(p.grad) for ps in expected.values() for p in ps.values())
    assert step.grad_sumsq.item() == pytest.approx(squares.item(), rel=KEPT_TOLERANCE)
