"""The attention kernel by measurement: the calibration's timings rank the fused kernels at
a run's shape, dtype and dropout; the engine runs the fastest that passes its check on the
device, says in one line each one it passed over, and without timings runs the kernel it
ran before (flash in 16 bits, the memory-efficient kernel in float32).

The check itself runs here on the CPU's kernels, against float64 attention written out, and
is shown to fail a kernel whose mask, scale or dropout draw is wrong.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
import torch.nn.functional as F

from config.errors import ConfigError
from config.loading import parse_config
from execution.engine.phases import attention_kernels
from execution.engine.phases.attention_kernels import (
    AttentionKernel,
    choose_attention,
    kernel_mismatch,
)
from execution.engine.phases.recompute import SDPA_BACKENDS
from execution.parallel.mesh import ParallelLayout
from execution.planning.run_shape import RunShape

CPU = torch.device("cpu")
# gpt3_1.3B's call (4 sequences x 16 heads of 128 over 2048 tokens) and llama3_8B's (1 x 32).
TIMINGS = [
    ["cudnn", 4, 16, 2048, 128, "bfloat16", 0.0, 1.0e-3],
    ["flash", 4, 16, 2048, 128, "bfloat16", 0.0, 1.5e-3],
    ["efficient", 4, 16, 2048, 128, "bfloat16", 0.0, 3.0e-3],
    ["flash", 1, 32, 2048, 128, "bfloat16", 0.0, 0.6e-3],
    ["cudnn", 1, 32, 2048, 128, "bfloat16", 0.0, 0.7e-3],
    # cuDNN cannot draw dropout 0.1 (steps of 1/16): the calibration timed the other two.
    ["efficient", 4, 16, 2048, 128, "bfloat16", 0.1, 2.0e-3],
    ["flash", 4, 16, 2048, 128, "bfloat16", 0.1, 2.5e-3],
]
RUN = "--config gpt3_1.3B --layers 2 --global_batch_size 8 --device cpu --precision bfloat16"


def _run(tmp_path, flags: str, timings=TIMINGS) -> RunShape:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"device_spec": {"attention_kernel_seconds": timings}}))
    config, _ = parse_config(shlex.split(f"{RUN} {flags} --device_spec_file {spec}"))
    return RunShape.of(config)


def test_the_ranking_follows_the_calibration_s_timings(tmp_path):
    """Fastest first at the timed shape nearest the run's, of the run's dtype and dropout;
    none where the spec timed nothing for them. The engine's plan carries the ranking."""
    run = _run(tmp_path, "--micro_batch_size 4 --dropout_prob 0")
    assert run.attention_ranking() == ("cudnn", "flash", "efficient")
    assert run.engine_plan(None).attention_kernels == ("cudnn", "flash", "efficient")
    # One sequence over 32 heads of 128: the (1, 32) timing is the nearest (log distance 0).
    llama_like = "--micro_batch_size 1 --hidden_size 4096 --heads 32 --dropout_prob 0"
    assert _run(tmp_path, llama_like).attention_ranking() == ("flash", "cudnn")
    assert _run(tmp_path, "--micro_batch_size 4 --dropout_prob 0.1").attention_ranking() == (
        "efficient",
        "flash",
    )
    assert _run(tmp_path, "--micro_batch_size 4 --dropout_prob 0.05").attention_ranking() == ()
    flags = "--micro_batch_size 4 --dropout_prob 0 --precision float32"
    assert _run(tmp_path, flags).attention_ranking() == ()


def test_a_spec_without_timings_keeps_the_kernel_of_before(tmp_path):
    """No timings: no ranking, and the engine's choice is the device's and dtype's kernel,
    unchecked (flash in 16 bits, the memory-efficient kernel in float32); a CPU runs its own
    kernel unpinned."""
    run = _run(tmp_path, "--micro_batch_size 4", timings=[])
    assert run.attention_ranking() == ()

    def never(kernel):
        raise AssertionError(f"{kernel} checked without timings")

    for dtype, kernel in ((torch.bfloat16, "flash"), (torch.float32, "efficient")):
        for dropout in (0.0, 0.1):
            chosen = choose_attention("cuda", dtype, dropout, (), never)
            assert chosen == AttentionKernel(kernel, SDPA_BACKENDS[kernel], measured=False)
    assert choose_attention("cpu", torch.float32, 0.0, ("cudnn",), never).backend is None
    assert choose_attention("cpu", torch.float32, 0.1, ("cudnn",), never).kernel == "math"


def test_a_kernel_failing_its_check_is_passed_over_in_one_line():
    """The fastest timed kernel whose check passes runs; each faster one that failed is one
    line naming it and why; the slower ones are not checked. None passing: the kernel of
    before."""
    checked, said = [], []

    def check(kernel):
        checked.append(kernel)
        return "RuntimeError: cuDNN Frontend error" if kernel == "cudnn" else None

    chosen = choose_attention(
        "cuda", torch.bfloat16, 0.0, ("cudnn", "flash", "efficient"), check, said.append
    )
    assert chosen.kernel == "flash" and chosen.backend == SDPA_BACKENDS["flash"]
    assert chosen.measured and chosen.passed_over == (
        ("cudnn", "RuntimeError: cuDNN Frontend error"),
    )
    assert checked == ["cudnn", "flash"]
    assert said == [
        "attention: cudnn passed over, faster but its check failed: RuntimeError: cuDNN Frontend error"
    ]
    said.clear()
    failing = choose_attention(
        "cuda", torch.bfloat16, 0.0, ("cudnn", "efficient"), lambda k: "fails", said.append
    )
    assert failing.kernel == "flash" and not failing.measured and len(said) == 2


def test_the_engine_checks_its_own_calls_shape(monkeypatch, tmp_path):
    """The engine asks for the kernel with its plan's ranking and a check of one call of its
    own: a tensor-parallel rank's share of the heads, their width, the whole sequence and
    the run's dropout."""
    from tests.distributed import planned_engine

    asked = []

    def choose(device_type, dtype, dropout, ranked, check, say):
        asked.append((device_type, dtype, dropout, ranked, check.args, check.keywords))
        return AttentionKernel("math")

    monkeypatch.setattr(attention_kernels, "choose_attention", choose)
    config, _ = parse_config(
        shlex.split(
            "--config tiny --layers 1 --hidden_size 64 --heads 4 --sequence_length 16 "
            "--max_positional_length 16 --global_batch_size 2 --micro_batch_size 1 "
            "--tensor_parallel_1 2 "
            "--dropout_prob 0.1 --precision float32 --device cpu"
        )
    )
    engine = planned_engine(config, ParallelLayout.shapes_only(1, 2, 1, CPU))
    device_type, dtype, dropout, ranked, args, keywords = asked[-1]  # after planning's
    assert (device_type, dtype, dropout, ranked) == ("cpu", torch.float32, 0.1, ())
    assert args == (CPU, torch.float32, 2, 16, 16) and keywords == {"dropout": 0.1}
    assert engine.attention == AttentionKernel("math")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_passes_the_cpu_s_kernels(dtype):
    """Without dropout the CPU's fused kernel, with dropout its math path: within the
    reference's bound of float64 attention, and a mask that is the seed's alone."""
    assert kernel_mismatch(CPU, dtype, 2, 16, 64, "cpu_flash", 0.0) is None
    if dtype == torch.float32:  # the math path in 16 bits is slow on a CPU; its draw is alike
        assert kernel_mismatch(CPU, dtype, 2, 16, 64, "math", 0.1) is None


RIGHT = F.scaled_dot_product_attention


def _sdpa_as(monkeypatch, wrong):
    kernel_mismatch.cache_clear()
    monkeypatch.setattr(attention_kernels.F, "scaled_dot_product_attention", wrong(RIGHT))


def test_the_check_fails_a_wrong_kernel(monkeypatch):
    """A kernel that drops the causal mask, or scales the scores 10% off, is far outside the
    bound; one whose dropout mask is not drawn from the seed fails the redraw; one that
    raises fails with its error's first line."""
    cases = {
        "its output is": lambda right: (
            lambda q, k, v, dropout_p=0.0, is_causal=False: right(q, k, v, dropout_p=dropout_p)
        ),
        "of the largest": lambda right: (
            lambda q, k, v, dropout_p=0.0, is_causal=False: right(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=0.9 * q.shape[-1] ** -0.5
            )
        ),
    }
    for reason, wrong in cases.items():
        _sdpa_as(monkeypatch, wrong)
        assert reason in kernel_mismatch(CPU, torch.bfloat16, 2, 16, 64, "cpu_flash", 0.0)
    unseeded = torch.Generator().manual_seed(1)

    def fresh_mask(right):
        def attention(q, k, v, dropout_p=0.0, is_causal=False):
            out = right(q, k, v, is_causal=is_causal)
            if not dropout_p:
                return out
            keep = torch.rand(out.shape, generator=unseeded) >= dropout_p
            return out * keep / (1 - dropout_p)

        return attention

    _sdpa_as(monkeypatch, fresh_mask)
    reason = kernel_mismatch(CPU, torch.float32, 2, 16, 64, "math", 0.1)
    assert reason == "its dropout mask is not its seed's alone"

    def refuses(right):
        def attention(*args, **kwargs):
            raise RuntimeError("No available kernel. Aborting execution.\nmore")

        return attention

    _sdpa_as(monkeypatch, refuses)
    reason = kernel_mismatch(CPU, torch.float32, 2, 16, 64, "cudnn", 0.0)
    assert reason == "RuntimeError: No available kernel. Aborting execution."
    kernel_mismatch.cache_clear()


def test_a_spec_file_s_timings_are_checked(tmp_path):
    """A timing row that is not a kernel, a size or a probability is refused in one line."""
    bad = [["cudnn", 4, 16, 2048, 128, "bfloat16", 1.5, 1e-3]]
    with pytest.raises(ConfigError, match="attention_kernel_seconds"):
        _run(tmp_path, "", timings=bad)
