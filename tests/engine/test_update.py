"""The engine's update alone, in one process (execution/engine/update/optimizer.py): the
AdamW driver's step of every row a rank holds, weights and moments where the plan put them
(on the device, or on the host, where the host's cores update them, reading gradients kept
on the device in staged pieces), against ``torch.optim.AdamW``'s single-tensor loop over the
same tensors as parameters, matrices decayed and vectors not; and the global-norm clip the
engine folds into the update's gradient scale, against ``torch.nn.utils.clip_grad_norm_``.
A single step of AdamW itself against torch's is test_optimizer_and_metrics.py's and
test_optimizer_threaded.py's; what is new here is the driver: every row, kind and piece
updated once, with its own moments, its decay and the step's count.

Tolerance: the two sides get the same gradients and do the same arithmetic grouped
differently (torch's fused kernel in the driver, its ``foreach=False`` loop in the
reference): each of AdamW's ~10 float32 operations per element rounds once on either side,
and every one is well conditioned (the moments are convex combinations, the update a
quotient of them), so each step moves an element's weight and moments apart by at most ~16
units of 2**-24 of the tensor's scale: ``STEPS * 16 * 2**-24`` (2.9e-6) after ``STEPS``.
(Measured: 2.8e-7.) A row updated twice, not at all, with another's moments or the wrong
decay is off by the update's own size, a share of ``lr`` that is orders of magnitude above it.
"""

from __future__ import annotations

import math

import pytest
import torch

from execution.engine.phases.step import sum_of_squares
from execution.engine.storage import gradient_store
from execution.engine.update.optimizer import clip_coefficient
from execution.parallel.mesh import ParallelLayout
from tests.distributed import planned_engine
from tests.reference import relative_error, small_config

CPU = torch.device("cpu")
STEPS = 3
TOLERANCE = STEPS * 16 * 2**-24
# The largest rows are 12,288 floats: 1000-float staging buffers cut them into 13 pieces.
STAGING = 1000


def engine_of(monkeypatch, weights: str, grads: str):
    monkeypatch.setattr(gradient_store, "STAGING_ELEMENTS", STAGING)
    flags = ["--weights_placement", weights, "--grads_placement", grads]
    return planned_engine(small_config(*flags), ParallelLayout.single(CPU))


def named_rows(engine, state: str) -> dict[tuple, torch.Tensor]:
    """Every tensor of every row the rank holds, by (part, row, name): views of ``state``'s
    buffers."""
    named = {}
    for part, row in engine.state.part_rows():
        for kind, spec in engine.specs[part].items():
            flat = getattr(engine.state.parts[part], state)[kind][row]
            named.update({(part, row, name): v for name, v in spec.views(flat).items()})
    return named


def reference_adamw(engine) -> tuple[dict[tuple, torch.nn.Parameter], torch.optim.AdamW]:
    """torch's AdamW over copies of the engine's weights, 2-D tensors decayed."""
    params = {
        key: torch.nn.Parameter(w.clone()) for key, w in named_rows(engine, "weights").items()
    }
    o = engine.plan.optimizer
    groups = [
        {"params": [p for p in params.values() if p.dim() == 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params.values() if p.dim() != 2], "weight_decay": 0.0},
    ]
    betas = (o.beta1, o.beta2)
    return params, torch.optim.AdamW(groups, betas=betas, eps=o.eps, foreach=False)


def write_gradients(engine, seed: int, scale: float = 1.0) -> dict[tuple, torch.Tensor]:
    """Random gradients of every row into the gradient buffers (times ``scale``, a loss
    scale they still carry); returns them unscaled, by (part, row, name)."""
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for key, stored in named_rows(engine, "grads").items():
        grads[key] = torch.randn(stored.shape, generator=generator)
        stored.copy_(grads[key] * scale)
    return grads


def assert_states_agree(engine, params, adamw) -> None:
    moments = ("exp_avg", "exp_avg_sq")  # the driver's buffers and torch's state alike
    ours = {s: named_rows(engine, s) for s in ("weights", *moments)}
    for key, param in params.items():
        error = relative_error(ours["weights"][key], param.detach())
        assert error <= TOLERANCE, f"{key} weights: relative error {error:.2e}"
        for state in moments:
            error = relative_error(ours[state][key], adamw.state[param][state])
            assert error <= TOLERANCE, f"{key} {state}: relative error {error:.2e}"


PLACEMENTS = {
    "device": ("device", "device"),
    "host": ("host", "host"),
    "host, device gradients": ("host", "device"),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_driver_s_steps_are_torch_s_adamw_on_every_row(monkeypatch, placement):
    """Three steps of the driver at three learning rates and gradient scales: the weights and
    both moments of every row of every part, against torch's AdamW given each step's
    gradients times its scale."""
    engine = engine_of(monkeypatch, *PLACEMENTS[placement])
    params, adamw = reference_adamw(engine)
    for step in range(STEPS):
        lr, grad_scale = 1e-2 * (step + 1), (0.5, 1.0, 0.25)[step]
        grads = write_gradients(engine, seed=step)
        engine.optimizer.update(lr, grad_scale)
        for key, param in params.items():
            param.grad = grads[key] * grad_scale
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        assert engine.optimizer.steps == step + 1
        assert_states_agree(engine, params, adamw)


@pytest.mark.parametrize("max_norm", [1.0, 0.0, 1e9], ids=["clips", "off", "below"])
def test_the_clip_folded_into_the_update_is_clip_grad_norm_(monkeypatch, max_norm):
    """The engine's clip: the global norm from the sum of every row's squares
    (:func:`sum_of_squares`, float64), its coefficient (:func:`clip_coefficient`) and the
    update given gradients that still carry a loss scale of 8, with ``coefficient / 8`` as
    their scale; against ``clip_grad_norm_`` on the unscaled gradients (in float64, so its
    norm is exact to ~1e-12 as the engine's float64 sum of exact squares is) and AdamW."""
    engine = engine_of(monkeypatch, "host", "device")
    params, adamw = reference_adamw(engine)
    loss_scale = 8.0  # a power of two: the scaled gradients are exact
    for step in range(STEPS):
        lr = 1e-2
        grads = write_gradients(engine, seed=10 + step, scale=loss_scale)
        sumsq = sum(sum_of_squares(g) for g in named_rows(engine, "grads").values())
        norm = math.sqrt(sumsq.item()) / loss_scale
        engine.optimizer.update(lr, grad_scale=clip_coefficient(norm, max_norm) / loss_scale)

        wide = {
            key: torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float64))
            for key, g in grads.items()
        }
        for key, p in wide.items():
            p.grad = grads[key].double()
        clip = max_norm if max_norm > 0 else math.inf
        reference_norm = torch.nn.utils.clip_grad_norm_(list(wide.values()), clip).item()
        assert norm == pytest.approx(reference_norm, rel=1e-9)
        for key, param in params.items():
            param.grad = wide[key].grad.float()
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        assert_states_agree(engine, params, adamw)
    if max_norm == 1.0:  # the gradients' norm is ~120: every step clipped
        assert norm > 100 * max_norm
