"""Every (dp, tp1, tp2) layout trains exactly like one process on the same global batches.

Each test forks ``dp x tp1 x tp2`` gloo ranks, trains 3 float32 steps with the real phased
engine and compares, with the single-process engine fed each whole global batch: the loss and
gradient norm of every step on every rank, the last step's unsharded gradients and the final
unsharded weights (``full_state``, gathered over all three axes), and a validation loss.
Equal gradient norms also show that each element is counted once: a vector replicated over
tp1 or tp2 would otherwise be counted tp1 or tp2 times.

(AdamW epsilon is 1e-2 for the reason ``tests.distributed.small_config`` gives.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import torch

from execution.checkpoint.logical import full_state
from execution.engine.engine import PhasedEngine
from modelling import lm_heads
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
    world_layout,
)
from tests.reference import LLAMA_VARIANTS, chunk_every_head

pytestmark = pytest.mark.distributed

STEPS = 3
# Each axis alone at 2 (and tp1, tp2 at 4), the two tensor axes together, and all three at 2;
# dp x tp1 x tp2 ranks each.
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2), (1, 4, 1), (1, 1, 4)]
VALIDATION_SEQUENCES = 8


def validation_micro_batches(config) -> torch.Tensor:
    """``[n, mbs, seq + 1]``: the same 8 held-out sequences whatever the micro-batch size."""
    shape = (VALIDATION_SEQUENCES, config.model.sequence_length + 1)
    generator = torch.Generator().manual_seed(123)
    ids = torch.randint(0, config.model.vocab_size, shape, generator=generator)
    return ids.view(-1, config.execution.micro_batch_size, shape[-1])


@functools.cache
def reference(*flags: str) -> dict:
    """Single-process training and validation loss of ``small_config(*flags)``."""
    config = small_config(*flags)
    batches = global_batches(config, STEPS)
    out = single_process_run(config, batches)
    out["eval_loss"] = _evaluate(out.pop("engine"), config, dp_rank=0, dp_size=1)
    return out


def _evaluate(engine: PhasedEngine, config, dp_rank: int, dp_size: int) -> float:
    """Validation loss; replica ``dp_rank`` evaluates its contiguous share of the sequences."""
    batches = validation_micro_batches(config)
    share = len(batches) // dp_size
    return engine.evaluate(list(batches[dp_rank * share : (dp_rank + 1) * share]))


def _train_rank(config, batches: torch.Tensor) -> dict:
    """One rank: train, then gather the full state (collective) and evaluate."""
    layout = world_layout(config)
    engine = planned_engine(config, layout)
    steps = train_steps(engine, batches, layout.dp.rank)
    grads, weights = full_state(engine, "grads"), full_state(engine, "weights")
    eval_loss = _evaluate(engine, config, layout.dp.rank, layout.dp.size)
    out = {"steps": steps, "eval_loss": eval_loss}
    if layout.is_main:  # every rank gathered the same tensors; one copy is enough
        out.update(grads=grads, weights=weights)
    return out


def assert_layout_matches(
    tmp_path,
    layout: tuple[int, int, int],
    model_flags: Sequence[str] = (),
    layout_only_flags: Sequence[str] = (),
    tolerance: float = FLOAT32_TOLERANCE,
) -> None:
    """Runs ``layout`` and checks it against the single-process run of the same model."""
    expected = reference(*model_flags)
    config = small_config(*model_flags, *layout_flags(*layout), *layout_only_flags)
    batches = global_batches(config, STEPS)
    results = run_ranks(_train_rank, config.world_size, tmp_path, config, batches)
    assert_curves_close(results, expected, tolerance)
    assert_states_close(results[0]["grads"], expected["grads"], tolerance, "last step's grads")
    assert_states_close(results[0]["weights"], expected["weights"], tolerance, "weights")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "dp{}-tp1_{}-tp2_{}".format(*t))
def test_layout_matches_single_process(tmp_path, layout):
    """Vocabulary 1000 is padded (1008 / 1024 rows) and 10 positions become 12 at tp1 4.

    Replicas with dp 1 use micro-batches of 4 (2 accumulation steps), the reference and dp 2
    micro-batches of 2, so the global batch, not its split, is what must match.
    """
    micro_batch = "2" if layout[0] > 1 else "4"
    assert_layout_matches(tmp_path, layout, layout_only_flags=["--micro_batch_size", micro_batch])


def test_resident_placement_matches_single_process(tmp_path):
    """Buffers on the compute device run the same schedule as host (remote) buffers."""
    assert_layout_matches(tmp_path, (2, 2, 2), layout_only_flags=["--placement", "resident"])


def test_real_vocabulary_with_four_vocab_shards(tmp_path):
    """GPT-2's 50257 tokens over tp1 4: shards of 12576 rows, the last one 63 rows of padding."""
    assert_layout_matches(tmp_path, (1, 4, 1), model_flags=["--vocab_size", "50257"])


def test_real_vocabulary_with_eight_vocab_shards(tmp_path):
    """50257 tokens over tp1 8 (shards of 6288 rows) with 8 heads of width 4."""
    model_flags = ["--vocab_size", "50257", "--heads", "8"]
    assert_layout_matches(tmp_path, (1, 8, 1), model_flags=model_flags)


@pytest.mark.parametrize(
    "model_flags", [(), (*LLAMA_VARIANTS, "--kv_heads", "2")], ids=["tied", "untied"]
)
def test_a_head_on_chunks_of_tokens_matches_single_process(tmp_path, monkeypatch, model_flags):
    """With every head on chunks, tp1 2 x tp2 2 runs each micro-batch's head (4 x 8 tokens) on 4
    chunks of 8 (half its weight shard's 16 columns), the vocabulary-parallel cross-entropy's
    all-reduces and the tied word gradient once per chunk; the single process runs its
    micro-batches (2 x 8 tokens) whole."""
    chunk_every_head(monkeypatch)
    assert len(lm_heads.logits_chunks(32, 1000, 1024 // 2, 32 // 2)) == 4
    assert len(lm_heads.logits_chunks(16, 1000, 1008, 32)) == 1
    flags = ["--micro_batch_size", "4"]
    assert_layout_matches(tmp_path, (1, 2, 2), model_flags, layout_only_flags=flags)


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 2), (2, 2, 2)], ids=["dp2", "tp2x2", "2x2x2"])
def test_dropout_matches_single_process(tmp_path, layout):
    """With dropout on, every rank draws its part of the masks the single process draws:
    seeds follow the global micro-batch index, not the data-parallel rank; residual masks are
    cut from the whole tensor's by the tp2 block; attention masks are seeded per global head,
    so a tp1 shard draws its heads' masks."""
    assert_layout_matches(tmp_path, layout, model_flags=["--dropout_prob", "0.1"])


def _placements_rank(configs: dict, batches: torch.Tensor) -> dict:
    """Trains one engine per placement on the same layout; returns each one's results."""
    layout = world_layout(next(iter(configs.values())))
    out = {}
    for placement, config in configs.items():
        engine = planned_engine(config, layout)
        steps = train_steps(engine, batches, layout.dp.rank)
        weights, grads = full_state(engine, "weights"), full_state(engine, "grads")
        out[placement] = {"steps": steps, "weights": weights, "grads": grads}
    return out


# Unit roundoff: 2^-8 (bfloat16), 2^-11 (float16). The tolerance is ~12 units: a float32
# single-process run and a low-precision one already differ by ~5 units after three steps,
# while a layout bug is an O(1) error.
LOW_PRECISION_TOLERANCE = {"bfloat16": 12 * 2**-8, "float16": 12 * 2**-11}


@pytest.mark.parametrize("precision", sorted(LOW_PRECISION_TOLERANCE))
def test_low_precision_in_both_placements(tmp_path, precision):
    """(2, 2, 2) in bfloat16, and float16 with a loss scale: host (remote) and device-resident
    buffers give bitwise the same run, and it stays within a few units of roundoff of the
    float32 single-process run (master weights and AdamW state are float32 in both)."""
    flags = ["--precision", precision, *layout_flags(2, 2, 2)]
    if precision == "float16":
        flags += ["--loss_scaling", "1024"]
    configs = {p: small_config(*flags, "--placement", p) for p in ("remote", "resident")}
    batches = global_batches(configs["remote"], STEPS)
    results = run_ranks(_placements_rank, 8, tmp_path, configs, batches)
    expected = reference()
    tolerance = LOW_PRECISION_TOLERANCE[precision]
    for result in results:
        remote, resident = result["remote"], result["resident"]
        assert remote["steps"] == resident["steps"]
        for state in ("weights", "grads"):
            assert all(torch.equal(remote[state][n], t) for n, t in resident[state].items())
        for got, want in zip(remote["steps"], expected["steps"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=tolerance / 10)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=tolerance)
    first = results[0]["remote"]
    assert_states_close(first["grads"], expected["grads"], tolerance, "grads")
    assert_states_close(first["weights"], expected["weights"], tolerance, "weights")
