"""--recompute full, selective and none compute the same step, keep exactly the bytes planned
for them, and the planner weighs what they recompute against what they keep."""

from __future__ import annotations

import shlex

import pytest
import torch

from execution.checkpoint.logical import full_state
from execution.engine.phases.attention_kernels import AttentionKernel
from execution.engine.phases.recompute import (
    ALIGN,
    SDPA_BACKENDS,
    _Packer,
    attention_kernel,
    kept_bytes,
)
from execution.parallel.mesh import ParallelLayout
from execution.planning.measure import recompute_flops
from execution.planning.memory import MemoryBudget, RankShape, host_traffic
from execution.planning.plan_ranking import step_seconds
from execution.planning.planner import choose, measured_plans
from execution.planning.run_shape import RunShape
from execution.planning.step_meter import StepMeter
from modelling.components import Components
from modelling.dropout import BlockSeeds
from modelling.gpt import GPT, GPTShapes
from tests.distributed import (
    CPU,
    assert_states_close,
    global_batches,
    planned_engine,
    replica_batch,
    small_config,
)

MODES = ("full", "selective", "none")
STEPS = 3
TOLERANCE = 1e-6
# float32, dropout 0.1 (the masks must agree), 2 passes of 2 micro-batches.
FLAGS = shlex.split(
    "--precision float32 --dropout_prob 0.1 --passes 2 --global_batch_size 8 --micro_batch_size 2"
)


def _train(config) -> dict:
    engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, STEPS)
    flops = []
    results = []
    for s in range(STEPS):
        engine.state.host_to_device = engine.state.device_to_host = 0
        with StepMeter() as meter:
            results.append(engine.train_step(replica_batch(config, batches[s], 0), s, 2e-3))
        flops.append(meter.flops)
    return {
        "engine": engine,
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "grads": full_state(engine, "grads"),
        "weights": full_state(engine, "weights"),
        "exp_avg_sq": full_state(engine, "exp_avg_sq"),
        "flops": flops[-1],
        "copied": engine.state.host_to_device + engine.state.device_to_host,
    }


@pytest.mark.parametrize("placement", ["resident", "remote"])
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_recompute_modes_agree_and_keep_exactly_what_was_planned(placement):
    """Over 3 steps, selective and none give full's losses, norms, gradients, weights and
    moments within 1e-6; each allocates the bytes planned, fills each layer's entry exactly
    (the measured bytes are the ones the kernels save), copies over the host link exactly the
    bytes the planner counted, and saves exactly the FLOPs the planner counted per mode."""
    runs = {}
    for mode in MODES:
        config = small_config(*FLAGS, "--placement", placement, "--recompute", mode)
        runs[mode] = run = _train(config)
        engine, plan = run["engine"], run["engine"].memory
        assert plan.recompute == mode
        assert engine.buffer_bytes() == plan.state_bytes
        if mode != "full":
            assert plan.kept > 0 and engine.kept.overflow == 0
            assert engine.kept.largest == plan.kept
            # On the device a layer keeps its saved tensors themselves: no buffer, no copies.
            layout = engine.state.activations.layout
            copies = 0 if placement == "resident" else layout.layers * layout.held * plan.kept
            assert engine.state.activations.kept.numel() == copies
            assert engine.kept.in_place == (placement == "resident")
        rank = RankShape.of(RunShape.of(config))
        kept = rank.kept(mode, attention_kernel("cpu", 0.1, torch.float32))
        entries = plan.micro_batches_per_pass
        want = host_traffic(rank, plan.placement, plan.passes, entries, kept)
        assert run["copied"] == want, (mode, run["copied"], want)
    reference = runs["full"]
    for mode in ("selective", "none"):
        run = runs[mode]
        for key in ("losses", "norms"):
            for got, ref in zip(run[key], reference[key], strict=True):
                assert abs(got - ref) <= TOLERANCE * abs(ref), (mode, key, got, ref)
        for state in ("grads", "weights", "exp_avg_sq"):
            assert_states_close(run[state], reference[state], TOLERANCE, f"{mode} {state}")
    # The backward recomputes the layer (full), its attention core (selective) or nothing.
    rank = RankShape.of(RunShape.of(small_config(*FLAGS, "--placement", placement)))
    layers, micro_batches = rank.shapes.layers, rank.gradient_accumulation
    for mode in ("full", "selective"):
        extra = runs[mode]["flops"] - runs["none"]["flops"]
        assert extra == layers * micro_batches * recompute_flops(rank, mode, "math") > 0
    assert runs["full"]["flops"] > runs["selective"]["flops"] > runs["none"]["flops"]
    kept = {mode: runs[mode]["engine"].memory.kept for mode in MODES}
    assert kept["full"] == 0 < kept["selective"] < kept["none"]


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_auto_weighs_recompute_against_memory_and_the_host_link():
    """With room on a CPU device (no link), auto keeps everything (least compute); when the
    kept bytes would cross a GPU's host link, it recomputes in full (a tiny model's compute
    costs less than its activations' copies); and what it picks is the fastest plan that
    fits by the planner's own estimate."""
    roomy = MemoryBudget(device=None, host=1 << 50)
    small = RunShape.of(small_config(*FLAGS))
    assert choose(small, roomy, device_type="cpu").plan.recompute == "none"
    hosted = RunShape.of(small_config(*FLAGS, "--activations_placement", "host"))
    gpu = MemoryBudget(device=1 << 40, host=1 << 40)
    plan = choose(hosted, gpu).plan
    assert plan.recompute == "full"
    rank = RankShape.of(hosted)
    kernel = attention_kernel("cuda", 0.1, rank.dtype)
    plans = measured_plans(hosted, "cuda")
    assert {p.recompute for p in plans} == set(MODES)
    assert step_seconds(hosted, rank, kernel, plan) == min(
        step_seconds(hosted, rank, kernel, p) for p in plans
    )
    # Only the device memory to hold full recompute's activations: auto must still fit.
    full = next(p for p in plans if p.recompute == "full" and p.passes == 2)
    tight = MemoryBudget(device=full.bytes_on("device")["total"], host=1 << 40)
    assert tight.fits(choose(hosted, tight).plan)


def test_the_attention_kernel_follows_the_device_and_the_precision():
    """FlashAttention takes 16 bits only: float32 on CUDA runs the memory-efficient kernel. A
    CPU runs its flash kernel without dropout and the math path with it, in any precision."""
    for p in (0.0, 0.1):
        assert attention_kernel("cuda", p, torch.bfloat16) == "flash"
        assert attention_kernel("cuda", p, torch.float16) == "flash"
        assert attention_kernel("cuda", p, torch.float32) == "efficient"
        for dtype in (torch.float32, torch.bfloat16):
            assert attention_kernel("cpu", p, dtype) == ("math" if p else "cpu_flash")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_layer_keeps_what_the_fused_kernel_saves(dropout):
    """Keeping everything (``none``) against checkpointing the attention core (``selective``,
    which keeps the core's q, k and v, as the kernel does) differs by what the kernel alone
    saves for its backward (torch's attention.cu and derivatives.yaml), each in its own
    16-byte-aligned region, at 2 x 4 heads x 20 tokens x 16 dims:

    - memory-efficient (float32): the output, the logsumexp over the sequence padded to a
      multiple of 32 (kAlignLSE) in float32, and the philox seed and offset (int64 scalars);
    - flash (bfloat16): the output, the logsumexp in float32, and its rng state (two uint64)
      and an unused uint64 scalar.
    """
    batch, heads, seq, head_dim = 2, 4, 20, 16
    shapes = GPTShapes(1, heads * head_dim, heads, 128, seq, dropout, 1e-5)
    out = batch * heads * seq * head_dim
    lse = {"efficient": batch * heads * 32 * 4, "flash": batch * heads * seq * 4}
    saved = {
        "efficient": (_aligned(4 * out), _aligned(lse["efficient"]), _aligned(8), _aligned(8)),
        "flash": (_aligned(2 * out), _aligned(lse["flash"]), _aligned(16), _aligned(8)),
    }
    for kernel, dtype in (("efficient", torch.float32), ("flash", torch.bfloat16)):
        kept = {m: kept_bytes(shapes, batch, seq, dtype, m, kernel) for m in ("none", "selective")}
        assert kept["none"].entry - kept["selective"].entry == sum(saved[kernel]), kernel


def test_pinned_attention_runs_only_its_kernel():
    """On CUDA the engine builds its blocks with the kernel it chose, pinned, so torch cannot
    take another (cuDNN's on Hopper, the math path where the kernel cannot run): inside the
    module's SDPA call only that backend is enabled, with dropout or without, and every
    backend is again afterwards. A CPU kernel pins nothing."""
    shapes = GPTShapes(2, 32, 4, 64, 16, 0.1, 1e-5)
    assert AttentionKernel("cpu_flash").backend is None
    enabled = []

    def sdpa(q, k, v, dropout_p=0.0, is_causal=False):
        cuda = torch.backends.cuda
        flags = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
        enabled.append((*flags, cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled()))
        return q

    q = torch.zeros(1, 4, 16, 8)
    for kernel in ("efficient", "cudnn", "flash"):
        chosen = AttentionKernel(kernel, SDPA_BACKENDS[kernel], sdpa=sdpa)
        components = Components.of(shapes, chosen)
        with torch.device("meta"):
            block = GPT(shapes, components=components).layers[0]
        assert block.attn.kernel is chosen
        for seeds in (None, BlockSeeds(1, 2, 3)):
            block.attn.core(q, q, q, seeds)
    only = {"flash": (True, False, False), "efficient": (False, True, False)}
    only["cudnn"] = (False, False, True)
    wanted = [(*only[kernel], False) for kernel in ("efficient", "cudnn", "flash") for _ in "ab"]
    assert enabled == wanted
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_a_host_scalar_a_kernel_saves_stays_on_the_host():
    """The memory-efficient kernel's philox seed and offset are CPU scalars its backward reads
    on the host: a layer computing elsewhere keeps them where they are, outside its entry."""
    flats = {"layers": torch.empty(8, device="meta")}
    entry = torch.empty(64, dtype=torch.uint8, device="meta")
    packer = _Packer(entry, lambda region, t: None, flats)
    seed = torch.tensor(7)
    assert packer.pack(seed) == ("host", seed) and packer.used == packer.copied == 0
    packer.pack(torch.empty(3, device="meta"))
    assert packer.used == ALIGN and packer.copied == 12
