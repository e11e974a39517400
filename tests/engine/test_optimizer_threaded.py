"""The host AdamW is torch's fused AdamW: bitwise ``torch.optim.AdamW(fused=True)``, and the same
on the host update's thread at any OpenMP team size as on the calling thread."""

from __future__ import annotations

import pytest
import torch

from config.schema import OptimizerConfig
from execution.engine.update.optimizer import adamw_
from modelling.host_threads import team_thread

OPTIM = OptimizerConfig(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("decay", [True, False])
def test_adamw_is_torch_s_fused_adamw_bitwise(decay):
    """The reference is the library's optimizer fed the scaled gradient: the engine folds loss
    scale and clipping into ``grad_scale``, and skips decay for biases and norms."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(10_007, generator=g)
    reference = torch.nn.Parameter(weight.clone())
    rate = OPTIM.weight_decay if decay else 0.0
    library = torch.optim.AdamW(
        [reference], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=rate, fused=True
    )
    m, v = torch.zeros_like(weight), torch.zeros_like(weight)
    for step in range(1, 5):
        grad = torch.randn(weight.shape, generator=g) * 8
        scale = 0.125 if step != 2 else 1.0
        lr = 1e-3 * step
        library.param_groups[0]["lr"] = lr
        reference.grad = grad * scale
        library.step()
        hyper = dict(step=step, lr=lr, optim=OPTIM, weight_decay=decay, grad_scale=scale)
        adamw_(weight, grad, m, v, **hyper)
        assert torch.equal(weight, reference.detach())
        assert torch.equal(m, library.state[reference]["exp_avg"])
        assert torch.equal(v, library.state[reference]["exp_avg_sq"])


@pytest.mark.parametrize("n", [1, 1000, 100_003, 1 << 18])
@pytest.mark.parametrize("team", [1, 2, 3])
def test_the_host_thread_s_update_is_bitwise_the_calling_thread_s(n, team):
    g = torch.Generator().manual_seed(n)
    here = [torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)]
    there = [t.clone() for t in here]
    with team_thread("host-adamw", team) as host:
        for step in range(1, 4):
            grad = torch.randn(n, generator=g)
            hyper = dict(step=step, lr=1e-2, optim=OPTIM, weight_decay=True, grad_scale=0.5)
            adamw_(here[0], grad, here[1], here[2], **hyper)
            host.submit(adamw_, there[0], grad, there[1], there[2], **hyper).result()
            for a, b in zip(here, there, strict=True):
                assert torch.equal(a, b)


def test_errors_reach_the_caller():
    w, m, v = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    hyper = dict(step=1, lr=0.1, optim=OPTIM, weight_decay=True, grad_scale=1.0)
    # The fused kernel itself would read ten elements of the nine.
    with team_thread("host-adamw", 2) as host, pytest.raises(ValueError, match="one shape"):
        host.submit(adamw_, w, torch.zeros(9), m, v, **hyper).result()
