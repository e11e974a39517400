"""Attention with dropout on the fused kernel: its mask is a pure function of the seed, drops
about p of the probabilities and scales the rest by 1 / (1 - p), leaves the global random
stream alone, and is what a recomputing backward draws again. The written-out per-head path
(``--dropout_parity``) is the one every layout draws alike.

References: a hand computation (uniform probabilities and one-hot values expose each mask
entry in the output), and the same engine recomputing in full.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from execution.checkpoint.logical import full_state
from execution.engine.engine import PhasedEngine
from execution.engine.phases import attention_kernels, compiled
from execution.engine.phases.attention_kernels import AttentionKernel
from execution.engine.phases.compiled import attention_op_mismatch
from execution.engine.phases.seeded_attention import seeded_attention_op
from execution.parallel.mesh import ParallelLayout
from execution.planning.device_specs import SPECS
from execution.planning.op_costs import device_seconds
from execution.planning.step_meter import StepMeter
from modelling.attention_kernel import HeadByHeadDropout, TorchSDPA
from modelling.dropout import (
    BlockSeeds,
    _attention_with_head_masks,
    fused_attention_with_dropout,
    mix_seed,
)
from modelling.gpt import LAYERS
from modelling.layers import Attention
from modelling.parallel import LOCAL
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.reference import small_config

P = 0.25


def _exposed_mask(seed: int, heads: int = 4, seq: int = 64) -> torch.Tensor:
    """The keep mask the fused kernel drew: with q = k = 0 every query attends uniformly to
    its causal prefix, and with v the identity, output[i, j] = keep[i, j] / ((1 - p)(i + 1))."""
    q = k = torch.zeros(1, heads, seq, seq)
    v = torch.eye(seq).expand(1, heads, seq, seq)
    out = fused_attention_with_dropout(q, k, v, P, seed)
    prefix = torch.arange(1, seq + 1, dtype=torch.float32).view(seq, 1)
    return out * prefix * (1 - P)


def test_fused_mask_is_inverted_dropout_on_the_probabilities_and_a_function_of_the_seed():
    state = torch.get_rng_state()
    keep = _exposed_mask(seed=7)
    assert torch.equal(torch.get_rng_state(), state), "the global random stream moved"
    causal = torch.ones(64, 64, dtype=torch.bool).tril().expand_as(keep)
    # Every kept probability is scaled by 1 / (1 - p), every other one is 0: no third value.
    assert torch.allclose(keep[causal], keep[causal].round(), atol=1e-5)
    assert set(keep[causal].round().unique().tolist()) == {0.0, 1.0}
    assert torch.all(keep[~causal].abs() < 1e-6), "a masked-out future position leaked"
    dropped = 1 - keep[causal].round().mean().item()
    assert abs(dropped - P) < 0.02, dropped  # 8320 draws: 4.7 standard deviations
    assert torch.equal(_exposed_mask(seed=7), keep)  # what a recompute draws
    assert not torch.equal(_exposed_mask(seed=8), keep)


def test_fused_dropout_backward_matches_the_same_masks_written_out():
    """The gradient through the fused kernel equals the gradient of softmax-dropout-matmul
    written out with the mask it drew (recovered as above)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    seed = mix_seed(3, 0)
    out = fused_attention_with_dropout(q, k, v, P, seed)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    keep = _exposed_mask(seed, heads=2, seq=16).round().to(torch.float64)
    scores = (q @ k.transpose(-2, -1)) / 8**0.5
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    written = (probs * keep / (1 - P)) @ v
    torch.testing.assert_close(out, written)
    expected = torch.autograd.grad(written.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_parity_path_draws_each_heads_mask_from_its_global_index():
    """Two shards of two heads each draw what one process drawing four heads draws; the fused
    kernel's shards do not (its mask follows the heads it is given)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 8, 4) for _ in "qkv")
    whole = _attention_with_head_masks(q, k, v, P, seed=5, first_head=0)
    halves = [
        _attention_with_head_masks(q[:, h : h + 2], k[:, h : h + 2], v[:, h : h + 2], P, 5, h)
        for h in (0, 2)
    ]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    fused = fused_attention_with_dropout(q, k, v, P, mix_seed(5, 0))
    fused_halves = [
        fused_attention_with_dropout(q[:, h : h + 2], k[:, h : h + 2], v[:, h : h + 2], P, 5)
        for h in (0, 2)
    ]
    assert not torch.equal(torch.cat(fused_halves, dim=1), fused)


def test_the_time_model_prices_fused_attention_at_its_own_rate():
    """Planning runs an attention module's core as the device's fused kernel (given to that
    module only); the step meter counts the kernel's FLOPs apart, forward and backward, at
    half of torch's formula when causal (the kernel skips the future), and the dry run prices
    them at the spec's attention rate: on an H100, 25% of the peak against 70% for matmuls."""
    b, h, s, d = 2, 4, 256, 64
    with torch.device("meta"):
        attention = Attention(h * d, h, d, P, LOCAL, LOCAL, kernel=AttentionKernel.on_meta("flash"))
        other = Attention(h * d, h, d, P, LOCAL, LOCAL)
    q, k, v = (torch.empty(b, h, s, d, device="meta", requires_grad=True) for _ in "qkv")
    sdpa = F.scaled_dot_product_attention
    with StepMeter() as meter:
        out = attention.core(q, k, v, BlockSeeds(1, 2, 3))
        torch.autograd.grad(out.sum(), (q, k, v))
    # Only the module built with it runs the kernel's op: no other module, and not F, the
    # whole process's.
    assert other.kernel == TorchSDPA() and F.scaled_dot_product_attention is sdpa
    # Forward 2 matmuls of b h s s d multiply-adds; backward 2.5 times that (torch's formulas
    # for the whole square), halved for the causal mask.
    forward = 2 * (2 * b * h * s * s * d)
    assert meter.attention_flops == meter.flops == (forward + 5 * forward // 2) // 2
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    with StepMeter() as whole:
        flash(q, k, v, 0.0, False)
    assert whole.attention_flops == forward  # not causal: the whole square
    # Priced at 25% of an H100's peak where the FLOPs take longer than the bytes (at these
    # small shapes the bytes would: a bandwidth without bound isolates the FLOPs' rate).
    spec = dataclasses.replace(SPECS["h100_sxm"], device_memory_gb_per_s=1e12)
    seconds = device_seconds(meter.costs, meter.attention_flops, spec)
    assert seconds["attention"] == pytest.approx(meter.flops / (989e12 * 0.25), rel=1e-12)
    assert seconds["matmul"] == 0 and meter.costs.attention_bytes > 0
    assert device_seconds(meter.costs, meter.attention_flops, SPECS["h100_sxm"])["attention"] == (
        pytest.approx(meter.costs.attention_bytes / 3000e9)
    )


def _train(*flags: str, steps: int = 2) -> tuple[PhasedEngine, list[float], dict]:
    config = small_config("--passes", "2", *flags)
    engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, steps)
    losses = [
        engine.train_step(replica_batch(config, batches[s], 0), s, 2e-3).loss for s in range(steps)
    ]
    return engine, losses, {**full_state(engine), **full_state(engine, "grads")}


def test_recompute_modes_draw_the_fused_masks_alike():
    """Without --dropout_parity the fused kernel draws attention dropout, and a layer
    recomputed in full, its attention core recomputed (selective) or nothing recomputed
    (none) give the same losses, weights and gradients, bit for bit, over 2 steps of 2
    passes: the recompute draws the forward's masks. Dropout is on (the losses differ from a
    dropout-free run's)."""
    runs = {}
    for mode in ("full", "selective", "none"):
        engine, losses, state = _train("--dropout_prob", "0.1", "--recompute", mode)
        assert engine.memory.recompute == mode
        assert not isinstance(engine.templates[LAYERS].attn.kernel, HeadByHeadDropout)
        runs[mode] = losses, state
    full_losses, full_state_ = runs["full"]
    for mode in ("selective", "none"):
        losses, state = runs[mode]
        assert losses == full_losses, mode
        for name, value in full_state_.items():
            assert torch.equal(state[name], value), (mode, name)
    assert _train("--dropout_prob", "0", steps=1)[1][0] != full_losses[0]


def test_dropout_parity_is_a_flag_that_reaches_the_attention():
    """``--dropout_parity true`` builds attention that draws each head's mask from its global
    index (the layout-parity path); the default is the fused kernel."""
    flags = ("--dropout_prob", "0.1", "--placement", "resident")
    for given, want in (((), False), (("--dropout_parity", "true"), True)):
        config = small_config(*flags, *given)
        assert config.model.dropout_parity is want
        engine = planned_engine(config, ParallelLayout.single(CPU))
        kernel = engine.templates[LAYERS].attn.kernel
        assert isinstance(kernel, HeadByHeadDropout) is want
        assert (kernel.kernel if want else kernel) == engine.attention


def test_attention_with_dropout_as_one_op_is_eagers_call():
    """What a compiled block calls (``phased::seeded_attention``) against eager's seeded call:
    the same output bit for bit, with grad and without, gradients within the engine's check's
    roundings (``attention_op_mismatch``, which a mask from another seed fails by a third of
    the largest gradient), called as it is and compiled, and the global random stream
    untouched."""
    for dtype in (torch.float32, torch.bfloat16):
        assert attention_op_mismatch(CPU, dtype, 4, 16, "math") is None, dtype
    if not compiled.compile_unavailable("cpu"):  # and inside a graph inductor compiled
        assert attention_op_mismatch(CPU, torch.float32, 4, 16, "math", compiled=True) is None
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 32, 16, generator=generator) for _ in range(3))
    state = torch.get_rng_state()
    out = seeded_attention_op(q, k, v, P, torch.tensor(7), 2, "math")
    assert torch.equal(torch.get_rng_state(), state), "the global random stream moved"
    assert torch.equal(out, fused_attention_with_dropout(q, k, v, P, mix_seed(7, 2)))
    assert not torch.equal(out, seeded_attention_op(q, k, v, P, torch.tensor(8), 2, "math"))


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_the_fused_kernels_op_calls_their_forward_and_backward_as_sdpa_does(kernel):
    """The CUDA kernels' ops on meta tensors (no CUDA here): the op passes each kernel's aten
    forward and backward the arguments their schemas take, and gets a gradient of each
    input's shape (their numbers are gpu_check.py's "attention's dropout as one op")."""
    shape = (2, 4, 32, 64)
    q, k, v = (torch.empty(shape, dtype=torch.bfloat16, device="meta") for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = seeded_attention_op(q, k, v, P, torch.tensor(7), 0, kernel)
    grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert out.shape == shape and [g.shape for g in grads] == [shape] * 3


def test_an_attention_op_unlike_eagers_breaks_the_graph_instead_and_says_so(monkeypatch, capsys):
    """The engine checks the op on its device before compiling; where it is not eager's, the
    block's attention runs between graphs as before, and the main rank says why in one line."""
    if compiled.compile_unavailable("cpu"):
        pytest.skip(f"torch.compile cannot run here: {compiled.compile_unavailable('cpu')}")
    monkeypatch.setattr(
        attention_kernels,
        "attention_op_mismatch",
        lambda *args, **kwargs: "its output is not eager's",
    )
    config = small_config("--dropout_prob", "0.1", "--compile", "true", "--dropout_parity", "false")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    attention = [m for m in engine.templates[LAYERS].modules() if isinstance(m, Attention)]
    assert engine.compiled and [m.kernel.dropout_op for m in attention] == [None]
    assert capsys.readouterr().out.strip().splitlines() == [
        "--compile: attention's dropout runs between graphs (its output is not eager's)"
    ]
