"""The Llama variants train in every layout as in one process (issue 40 item 1), with an
explicit head width and Llama 3.1's rotary scaling (issue 54 item 6): tp1 splits
the query and the KV heads and the gate/up pair, tp2 the hidden size, the untied head is split
as the word embedding, dp and RTS replicate; cp splits the KV heads where it divides them and
repeats them where it does not; a pipeline puts the untied head on the last stage alone.

Each test forks gloo ranks, trains 3 float32 steps without dropout with the real phased engine
and compares with one process fed the same global batches: every rank's loss and gradient norm
of every step and a validation loss within 1e-6, and the unsharded weights and last gradients
of every stage within :data:`tests.distributed.FLOAT32_TOLERANCE`.
"""

from __future__ import annotations

import functools
import shlex

import pytest
import torch

from config.loading import parse_config
from execution.checkpoint.logical import full_state
from tests.distributed import (
    FLOAT32_TOLERANCE,
    assert_curves_close,
    assert_states_close,
    global_batches,
    layout_flags,
    planned_engine,
    run_ranks,
    single_process_run,
    small_config,
    train_steps,
    with_execution,
    world_layout,
)
from tests.reference import LLAMA_VARIANTS

pytestmark = pytest.mark.distributed

STEPS = 3
TOLERANCE = 1e-6
# Hidden 32 beside 4 query heads of an explicit 12 (HF's head_dim) sharing 2 KV heads; an
# intermediate size of 44; Llama 3.1's rotary scaling, whose three bands the 6 frequencies
# cross (wavelengths 6.3 kept, 17.7 interpolated, the rest stretched).
LLAMA = [
    *LLAMA_VARIANTS,
    *shlex.split("--kv_heads 2 --intermediate_size 44 --rope_theta 500 --global_batch_size 4"),
    *shlex.split("--micro_batch_size 1 --passes 2 --head_dim 12 --rope_type llama3"),
    *shlex.split("--rope_original_max_positions 32"),
]


def _validation(config, dp_rank: int = 0, dp_size: int = 1) -> list[torch.Tensor]:
    """Replica ``dp_rank``'s share of 2 held-out micro-batches ``[micro_batch, seq + 1]``."""
    micro = config.execution.micro_batch_size
    ids = global_batches(config, 1, seed=7)[0, : 2 * micro].view(2, micro, -1)
    share = len(ids) // dp_size
    return list(ids[dp_rank * share : (dp_rank + 1) * share])


@functools.cache
def _single_process() -> dict:
    config = small_config(*LLAMA)
    result = single_process_run(config, global_batches(config, STEPS))
    result["eval_loss"] = result.pop("engine").evaluate(_validation(config))
    return result


def _train_rank(config, batches: torch.Tensor) -> dict:
    """One rank: train, gather its stage's unsharded weights and gradients (collective), and
    evaluate; the first rank of each stage returns the states."""
    layout = world_layout(config)
    engine = planned_engine(config, layout)
    steps = train_steps(engine, batches, layout.dp.rank)
    states = {state: full_state(engine, state) for state in ("weights", "grads")}
    eval_loss = engine.evaluate(_validation(config, layout.dp.rank, layout.dp.size))
    first = layout.dp.rank == layout.cp.rank == layout.tp1.rank == layout.tp2.rank == 0
    return {"steps": steps, "eval_loss": eval_loss, **(states if first else {})}


@pytest.mark.parametrize(
    "layout",
    [
        ("--pipeline_parallel", "1", *layout_flags(2, 2, 2)),
        ("--pipeline_parallel", "1", *layout_flags(1, 1, 1, cp=2)),  # a KV head per cp rank
        ("--pipeline_parallel", "1", *layout_flags(1, 2, 1, cp=2)),  # 1 KV head, repeated
        ("--pipeline_parallel", "2", *layout_flags(1, 1, 1)),
    ],
    ids=["dp2-tp1_2-tp2_2", "cp2", "tp1_2-cp2", "pp2"],
)
def test_llama_layout_trains_like_one_process(tmp_path, layout):
    config = small_config(*LLAMA, *layout)
    assert with_execution(config, pipeline_parallel=1).model == small_config(*LLAMA).model
    results = run_ranks(
        _train_rank, config.world_size, tmp_path, config, global_batches(config, STEPS)
    )
    expected = _single_process()
    assert_curves_close(results, expected, TOLERANCE)
    for state in ("weights", "grads"):
        merged = {name: t for r in results if state in r for name, t in r[state].items()}
        assert_states_close(merged, expected[state], FLOAT32_TOLERANCE, state)


def test_the_llama_tiny_preset_trains_at_dp2_tp1_2_tp2_2_like_one_process(tmp_path):
    """The preset itself (GPT-2's vocabulary, padded over tp1; 128 wide, sequences of 128)
    for 2 steps, with AdamW epsilon 1e-2 as tests.distributed.small_config explains."""
    preset = ["--config", "llama_tiny", "--device", "cpu", "--eps", "1e-2", "--steps", "2"]
    single, _ = parse_config(preset)
    batches = global_batches(single, 2)
    expected = single_process_run(single, batches)
    expected["eval_loss"] = expected.pop("engine").evaluate(_validation(single))
    config, _ = parse_config([*preset, *layout_flags(2, 2, 2)])
    results = run_ranks(_train_rank, config.world_size, tmp_path, config, batches)
    assert_curves_close(results, expected, TOLERANCE)
    for state in ("weights", "grads"):
        merged = {name: t for r in results if state in r for name, t in r[state].items()}
        assert_states_close(merged, expected[state], FLOAT32_TOLERANCE, state)


def test_llama_dropout_draws_the_single_process_s_masks(tmp_path):
    """Dropout 0.1 (attention probabilities head by head, --dropout_parity, and residuals) at
    tp1 2 x cp 2: each query head draws its global index's mask with its KV head repeated."""
    flags = [*LLAMA, "--dropout_prob", "0.1"]
    single = small_config(*flags)
    batches = global_batches(single, STEPS)
    expected = single_process_run(single, batches)
    expected["eval_loss"] = expected.pop("engine").evaluate(_validation(single))
    config = small_config(*flags, *layout_flags(1, 2, 1, cp=2))
    results = run_ranks(_train_rank, config.world_size, tmp_path, config, batches)
    assert_curves_close(results, expected, TOLERANCE)
    assert_states_close(results[0]["weights"], expected["weights"], FLOAT32_TOLERANCE, "weights")
