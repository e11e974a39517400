"""AdamW, clipping and the schedule against torch and hand computations; FLOPs accounting."""

from __future__ import annotations

import math

import pytest
import torch

from config.schema import OptimizerConfig
from execution.engine.phases import step as engine_step
from execution.engine.update.optimizer import adamw_, clip_coefficient
from execution.training.lr_schedule import learning_rate
from modelling.gpt import GPTShapes
from utils.metrics import flops_per_token, throughput


def test_adamw_matches_torch_over_several_steps():
    optim = OptimizerConfig(beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, generator=g)
    reference = torch.nn.Parameter(weight.clone())
    torch_adamw = torch.optim.AdamW(
        [reference], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, foreach=False
    )
    m, v = torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 4):
        grad = torch.randn(1000, generator=g)
        reference.grad = grad.clone()
        torch_adamw.step()
        # grad_scale folds in a loss scale of 4 that the stored gradient still carries
        hyper = dict(step=step, lr=0.01, optim=optim, weight_decay=True, grad_scale=0.25)
        adamw_(weight, grad * 4, m, v, **hyper)
        torch.testing.assert_close(weight, reference.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
def test_a_kept_scratch_changes_no_bit_and_leaves_the_gradient(masked):
    """The scaled gradient in a kept buffer (the driver's, larger than this shard and holding
    an earlier shard's values) against a new tensor: the same products, so the same update
    to the bit; the step's gradient is left as it was either way."""
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(1000, generator=g)
    mask = torch.rand(1000, generator=g) > 0.5 if masked else None
    scratch = torch.randn(4096, generator=g)
    states = [[torch.randn(1000, generator=g), torch.randn(1000, generator=g)]]
    states[0].append(torch.rand(1000, generator=g))  # a second moment is positive
    states.append([t.clone() for t in states[0]])
    hyper = dict(step=3, lr=0.01, optim=OptimizerConfig(), weight_decay=True, grad_scale=0.3)
    for (weight, m, v), kept in zip(states, (None, scratch), strict=True):
        before = grad.clone()
        adamw_(weight, grad, m, v, mask=mask, scratch=kept, **hyper)
        assert torch.equal(grad, before)
    for new, kept in zip(*states, strict=True):
        assert torch.equal(new, kept)


def test_no_weight_decay_leaves_zero_gradient_weights_alone():
    optim = OptimizerConfig(weight_decay=0.5)
    weight, zero_grad, m, v = torch.ones(4), torch.zeros(4), torch.zeros(4), torch.zeros(4)
    hyper = dict(step=1, lr=0.1, optim=optim, weight_decay=False, grad_scale=1.0)
    adamw_(weight, zero_grad, m, v, **hyper)
    assert torch.equal(weight, torch.ones(4))


def test_clip_coefficient_equals_clip_grad_norm():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = torch.nn.utils.clip_grad_norm_([p], 1.0).item()
    assert norm == 5.0
    assert clip_coefficient(norm, 1.0) == pytest.approx(p.grad[0].item() / 3.0, rel=1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(5.0, 0.0) == 1.0  # clipping disabled


@pytest.mark.parametrize("chunk", [1000, 1 << 20])
def test_the_norm_s_chunked_sum_of_squares_is_the_exact_sum(monkeypatch, chunk):
    """Over several chunks and a partial last one: each float32 square is exact in float64,
    so math.fsum of them is the exact sum rounded once; a float64 sum of n positive terms is
    within (n - 1) units of 2**-53 of the exact sum, relative, and fsum's rounding adds one."""
    monkeypatch.setattr(engine_step, "NORM_CHUNK", chunk)
    shape = (7, 500) if chunk == 1000 else (3, 699051)  # 3.5 chunks; 2 and one element
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    n = x.numel()
    got = engine_step.sum_of_squares(x)
    assert got.dtype == torch.float64
    exact = math.fsum(v * v for v in x.double().reshape(-1).tolist())
    assert abs(got.item() - exact) <= n * 2**-53 * exact
    assert engine_step.sum_of_squares(torch.empty(0)).item() == 0.0
    wide = x.double()
    engine_step.sum_of_squares(wide)
    assert torch.equal(wide, x.double()), "a float64 input is left as it was"


def test_learning_rate_schedule_by_hand():
    optim = OptimizerConfig(
        learning_rate=1.0,
        min_learning_rate_ratio=0.1,
        warmup_tokens=400,
        decay_tokens=1400,
        lr_schedule="cosine",
    )
    tokens_per_step = 100

    def lr(step):
        return learning_rate(step, optim, tokens_per_step, total_steps=50)

    assert lr(0) == pytest.approx(0.25)  # 100 of 400 warm-up tokens
    assert lr(3) == pytest.approx(1.0)  # end of warm-up
    assert lr(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # half-way
    assert lr(13) == pytest.approx(0.1)  # decay done
    assert lr(40) == pytest.approx(0.1)  # and stays at the floor
    optim.lr_schedule = "linear"
    assert lr(8) == pytest.approx(1.0 - 0.9 * 0.5)
    optim.lr_schedule = "constant"
    assert lr(8) == 1.0
    optim.lr_schedule, optim.decay_tokens = "cosine", 0  # decay over the whole run: 50 steps
    assert learning_rate(49, optim, tokens_per_step, total_steps=50) == pytest.approx(0.1)


def test_parameter_count_matches_huggingface_gpt2():
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Config(
        vocab_size=50257, n_positions=2048, n_embd=768, n_layer=12, n_head=12
    )
    with torch.device("meta"):
        expected = transformers.GPT2LMHeadModel(hf).num_parameters()  # tied embedding once
    shapes = GPTShapes(12, 768, 12, 50257, 2048, 0.0, 1e-5)
    assert shapes.num_parameters == expected


def test_flops_per_token_and_mfu_by_hand():
    shapes = GPTShapes(2, 64, 4, 100, 16, 0.0, 1e-5)
    n = (100 + 16) * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert flops_per_token(shapes, 16) == 6 * n + 12 * 2 * 64 * 16
    rates = throughput(
        2.0, sequences=8, sequence_length=16, flops_token=1000, peak_tflops=1e-9, devices=2
    )
    assert rates["samples_per_sec"] == 4.0 and rates["tokens_per_sec"] == 64.0
    assert rates["tflops"] == pytest.approx(64e3 / 1e12)
    assert rates["mfu"] == pytest.approx(64e3 / 1e12 / 2e-9)
    assert throughput(1.0, 1, 1, 1, None, 1)["mfu"] is None
