"""A plain single-process RigL, the reference the engine's RigL is held to (tests/engine/test_rigl.py,
tests/modelling/test_llama_variants.py).

It runs on the dense autograd GPT of ``tests.reference`` with ``torch.optim.AdamW``: masks as
bool tensors beside the parameters, the gradient masked before clipping and the update, the
weights masked after it, and every ``rigl_every`` steps a drop of the smallest |w| and a growth
of the largest |dense gradient|, chosen with a stable sort (ties to the lower index). It shares
with the engine only the model, the initial weights, the initial mask scores and the per-matrix
counts (``modelling.sparsity``): the selection, the masking and the optimizer are its own.
"""

from __future__ import annotations

import functools
import math

import torch

from execution.checkpoint.logical import full_state
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import LAYERS, GPTShapes, part_inits
from modelling.sparsity import (
    SparsitySchedule,
    active_counts,
    mask_scores,
    sparse_weights,
)
from tests.distributed import (
    global_batches,
    learning_rates,
    planned_engine,
    relative_error,
    small_config,
    train_steps,
)
from tests.reference import reference_model, reference_optimizer

STEPS = 8  # connectivity updates after steps 2, 4 and 6
RIGL = ("--sparsity", "0.8", "--rigl_every", "2", "--rigl_end_fraction", "1", "--steps", "8")
# The tests' tolerance on weights, relative to each tensor's largest element.
WEIGHT_TOLERANCE = 1e-6


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest of a flat tensor, ties to the lower index (a stable descending sort)."""
    order = torch.argsort(scores, descending=True, stable=True)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen[order[:k]] = True
    return chosen


def reference_rigl(config, batches: torch.Tensor) -> dict:
    """Plain RigL on one process: the final weights and masks, named as in the GPT."""
    model = reference_model(config)
    optimizer = reference_optimizer(model, config)
    shapes = GPTShapes.from_config(config.model)
    r = config.rigl
    schedule = SparsitySchedule.of(r, config.training.steps)
    counts = active_counts(shapes, r.sparsity, r.sparsity_distribution)
    params = dict(model.named_parameters())
    whole = {
        n: tuple(torch.arange(s) for s in i.shape) for n, i in part_inits(shapes, LAYERS).items()
    }
    masks = {}
    for layer in range(shapes.layers):
        scores = mask_scores(shapes, layer, config.training.seed, whole)
        for name in sparse_weights(shapes):
            key = f"layers.{layer}.{name}"
            masks[key] = top_k(scores[name].flatten(), counts[name]).view(scores[name].shape)
            params[key].data.mul_(masks[key])
    accumulation = config.gradient_accumulation
    for step, lr in enumerate(learning_rates(len(batches))):
        tokens = batches[step].view(accumulation, -1, batches.shape[-1])
        optimizer.zero_grad()
        for m in range(accumulation):
            loss = model(tokens[m, :, :-1], tokens[m, :, 1:])
            (loss / accumulation).backward()
        dense = {key: params[key].grad.clone() for key in masks}
        for key, mask in masks.items():
            params[key].grad.mul_(mask)
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), config.training.optimizer.gradient_clipping
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        with torch.no_grad():
            for key, mask in masks.items():
                params[key].mul_(mask)
        if schedule.updates_at(step + 1):
            fraction = schedule.drop_fraction_at(step + 1)
            for key, old in masks.items():
                p, flat_old = params[key], old.flatten()
                active = int(flat_old.sum())
                drop = math.floor(active * fraction)
                keep = top_k(torch.where(flat_old, p.detach().abs().flatten(), -1.0), active - drop)
                grow = top_k(torch.where(keep, -1.0, dense[key].abs().flatten()), drop)
                new = (keep | grow).view(old.shape)
                grown = new & ~old
                with torch.no_grad():
                    p.masked_fill_(~new, 0.0)
                state = optimizer.state[p]
                state["exp_avg"].masked_fill_(grown, 0.0)
                state["exp_avg_sq"].masked_fill_(grown, 0.0)
                masks[key] = new
    weights = {n: p.detach().clone() for n, p in params.items()}
    return {"weights": weights, "masks": masks}


@functools.cache
def expected(*flags: str) -> dict:
    config = small_config(*RIGL, *flags)
    return reference_rigl(config, global_batches(config, STEPS))


def engine_run(config, layout: ParallelLayout) -> dict:
    """Trains the engine on ``layout``; the unsharded weights and masks (collective)."""
    engine = planned_engine(config, layout)
    train_steps(engine, global_batches(config, STEPS), layout.dp.rank)
    return {"weights": full_state(engine, "weights"), "masks": engine.rigl.logical_masks()}


def assert_matches(got: dict, want: dict, what: str) -> None:
    for key, mask in got["masks"].items():
        assert torch.equal(mask, want["masks"][key]), f"{what}: mask {key} differs"
        weight = got["weights"][key]
        assert torch.all(weight[~mask] == 0), f"{what}: {key} has weights outside its mask"
    for key, weight in got["weights"].items():
        reference = want["weights"][key]
        if key.startswith(("embedding.word", "embedding.position", "head.output")):
            reference = reference[: weight.shape[0]]  # the reference pads these
        error = relative_error(weight, reference)
        assert error <= WEIGHT_TOLERANCE, f"{what}: {key} relative error {error:.2e}"


def reference_rigl_masks_at_start(config) -> dict[str, torch.Tensor]:
    return reference_rigl(config, global_batches(config, STEPS)[:0])["masks"]
