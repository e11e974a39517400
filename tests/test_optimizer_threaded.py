"""The chunked, thread-pooled host AdamW against the plain one: bitwise equal on CPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from config.schema import OptimizerConfig
from execution.engine.optimizer import adamw_, adamw_threaded_


@pytest.mark.parametrize(("n", "chunk"), [(1, 8), (1000, 64), (100_003, 4096), (70_000, 1 << 16)])
@pytest.mark.parametrize("decay", [True, False])
def test_threaded_adamw_is_bitwise_the_plain_one(n, chunk, decay):
    optim = OptimizerConfig(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(n)
    plain = [torch.randn(n, generator=g), None, torch.zeros(n), torch.zeros(n)]
    threaded = [t.clone() if t is not None else None for t in plain]
    with ThreadPoolExecutor(3) as pool:
        threading = dict(pool=pool, chunk_elements=chunk)
        for step in range(1, 4):
            grad = torch.randn(n, generator=g) * 8
            scale = 0.125 if step != 2 else 1.0
            hyper = dict(
                step=step, lr=1e-3 * step, optim=optim, weight_decay=decay, grad_scale=scale
            )
            adamw_(plain[0], grad, plain[2], plain[3], **hyper)
            adamw_threaded_(threaded[0], grad, threaded[2], threaded[3], **threading, **hyper)
            for a, b in zip(plain, threaded, strict=True):
                if a is not None:
                    assert torch.equal(a, b)


def test_errors_reach_the_caller():
    optim = OptimizerConfig()
    w, m, v = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    hyper = dict(lr=0.1, optim=optim, weight_decay=True, grad_scale=1.0)
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(AssertionError, match="flat shards"):
            adamw_threaded_(w, torch.zeros(9), m, v, pool=pool, step=1, **hyper)
        with pytest.raises(ZeroDivisionError):  # step 0: bias correction 1 - beta1**0 = 0
            adamw_threaded_(w, torch.zeros(10), m, v, pool=pool, chunk_elements=4, step=0, **hyper)
