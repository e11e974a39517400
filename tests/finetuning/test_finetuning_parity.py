"""Fine-tuning on the phased engine against HuggingFace: from the same initial weights, a few
steps of GPT2ForQuestionAnswering / GPT2ForSequenceClassification trained by torch.optim.AdamW
(same clipping, same learning-rate schedule) give the same losses, at one process, at
data_parallel 2 x tensor_parallel_1 2 and at tensor_parallel_1 2 x tensor_parallel_2 2 (forked
gloo ranks). A Llama model against LlamaForQuestionAnswering / LlamaForSequenceClassification
likewise, and at tp1 2 x tp2 2 and dp 2 x tp1 2 within 1e-6 of its single process.

Odd sizes (3 layers, hidden 96, 3 heads, vocabulary 307) so that no shard is a power of two.
"""

from __future__ import annotations

import shlex

import pytest
import torch

from config.finetuning import FinetuningRunConfig
from config.loading import config_to_dict
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape
from execution.training.lr_schedule import learning_rate
from tasks.specs import parse_finetuning_config, run_shapes
from tests.distributed import CPU, engine_batch, run_ranks, world_layout
from tests.finetuning_reference import (
    hf_llama_task_model,
    hf_loss,
    hf_optimizer,
    hf_task_model,
    initial_weights,
)
from tests.reference import LLAMA_VARIANTS

STEPS = 3
PAD = 306  # rows pad with this id, which no real token uses: HF finds the last token by it
FLAGS = (
    "--config tiny --layers 3 --hidden_size 96 --heads 3 --vocab_size 307 "
    "--max_positional_length 40 --sequence_length 24 --global_batch_size 8 --micro_batch_size 2 "
    "--dropout_prob 0 --learning_rate 2e-3 --warmup_tokens 200 --decay_tokens 0 "
    "--weight_decay 0.1 --eps 1e-6 --gradient_clipping 1.0 --device cpu --steps 3"
)
TOLERANCE = 1e-5


def _config(task: str, *flags: str) -> FinetuningRunConfig:
    config, _ = parse_finetuning_config([*shlex.split(FLAGS), "--task", task, *flags])
    return config


def _rows(config: FinetuningRunConfig) -> torch.Tensor:
    """``[steps, global_batch, seq + 2]`` rows of ids and targets, as the task's data gives."""
    generator = torch.Generator().manual_seed(11)
    count, seq = STEPS * config.training.global_batch_size, config.model.sequence_length
    ids = torch.randint(0, PAD, (count, seq), generator=generator)
    if config.task == "squad":
        start = torch.randint(0, seq, (count,), generator=generator)
        end = (start + torch.randint(0, 5, (count,), generator=generator)).clamp(max=seq - 1)
        targets = torch.stack([start, end], 1)
    else:
        lengths = torch.randint(seq // 3, seq + 1, (count,), generator=generator)
        ids[torch.arange(seq) >= lengths[:, None]] = PAD
        labels = torch.randint(0, 3, (count,), generator=generator)
        targets = torch.stack([labels, lengths - 1], 1)
    return torch.cat([ids, targets], 1).view(STEPS, config.training.global_batch_size, -1)


def _learning_rates(config: FinetuningRunConfig) -> list[float]:
    t = config.training
    return [learning_rate(s, t.optimizer, config.tokens_per_step, t.steps) for s in range(STEPS)]


def _huggingface_losses(config: FinetuningRunConfig, rows: torch.Tensor) -> list[tuple]:
    """The textbook loop: accumulate micro-batches, clip_grad_norm_, AdamW.step.

    Returns:
        (loss, gradient norm) of each step.
    """
    shapes = run_shapes(config)
    weights = initial_weights(shapes, config.training.seed, config.model.init_std)
    if shapes.normalization == "rms_norm":
        model_section = config_to_dict(config)["model"]
        model = hf_llama_task_model(model_section, shapes, weights, pad_token_id=PAD)
    else:
        model = hf_task_model(shapes, weights, pad_token_id=PAD)
    optimizer = hf_optimizer(model, config.training.optimizer)
    micro, losses = config.execution.micro_batch_size, []
    for step, lr in enumerate(_learning_rates(config)):
        optimizer.zero_grad()
        batches = rows[step].split(micro)
        total = 0.0
        for batch in batches:
            loss = hf_loss(model, batch[:, :-2], batch[:, -2:])
            (loss / len(batches)).backward()
            total += loss.item()
        clip = config.training.optimizer.gradient_clipping
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append((total / len(batches), norm))
    return losses


def _engine_losses(config: FinetuningRunConfig, rows: torch.Tensor, layout=None) -> list[tuple]:
    layout = layout or ParallelLayout.single(CPU)
    engine = planned_engine(RunShape.of(config), layout)
    losses = []
    for step, lr in enumerate(_learning_rates(config)):
        result = engine.train_step(engine_batch(engine, rows[step], layout.dp.rank), step, lr)
        assert not result.skipped
        losses.append((result.loss, result.grad_norm))
    return losses


@pytest.mark.parametrize(
    ("task", "flags"),
    [("squad", ()), ("mnli", ("--passes", "2", "--recompute", "full", "--placement", "remote"))],
)
def test_one_process_matches_huggingface(task, flags):
    """The planner's plan for SQuAD; for "mnli" two passes per step, full recompute and every
    state in host memory, streamed phase by phase."""
    config = _config(task, *flags)
    rows = _rows(config)
    expected = _huggingface_losses(config, rows)
    _assert_close(_engine_losses(config, rows), expected)


@pytest.mark.parametrize("task", ["squad", "mnli"])
def test_a_llama_model_matches_huggingfaces_llama_task_model(task):
    """RMSNorm before the projection, rotary positions, SwiGLU, 3 query heads sharing one KV
    head, no biases but the span head's."""
    config = _config(task, *LLAMA_VARIANTS, "--kv_heads", "1", "--intermediate_size", "200")
    rows = _rows(config)
    _assert_close(_engine_losses(config, rows), _huggingface_losses(config, rows))


def _assert_close(got: list[tuple], expected: list[tuple], tolerance: float = TOLERANCE) -> None:
    """Losses within ``tolerance``; gradient norms (which decide the clipping) within
    ``tolerance`` of theirs, relatively."""
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, expected, strict=True)):
        assert loss == pytest.approx(want_loss, abs=tolerance), (step, got, expected)
        assert norm == pytest.approx(want_norm, rel=tolerance), (step, got, expected)


def _rank_losses(config: FinetuningRunConfig, rows: torch.Tensor) -> list[tuple]:
    return _engine_losses(config, rows, world_layout(config))


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("task", "layout"),
    [("squad", (2, 2, 1, 1)), ("mnli", (1, 2, 2, 1)), ("squad", (1, 1, 1, 2))],
)
def test_parallel_layouts_match_huggingface(task, layout, tmp_path):
    """dp 2 x tp1 2, tp1 2 x tp2 2 (the projection split over tp2) and a pipeline of 2
    stages (the head on the last, untied: the first alone holds the embedding). Whole heads
    per tp1 shard need an even head count: 6 heads of 16 here.

    (SQuAD's bias cannot show in a loss: a constant added to every position's logit leaves
    the softmax over positions as it is, so its gradient is zero.)"""
    dp, tp1, tp2, pp = layout
    sizes = {"--data_parallel": dp, "--tensor_parallel_1": tp1, "--tensor_parallel_2": tp2}
    sizes["--pipeline_parallel"] = pp
    flags = [text for flag, size in sizes.items() for text in (flag, str(size))]
    config = _config(task, "--heads", "6", *flags)
    rows = _rows(config)
    expected = _huggingface_losses(config, rows)
    for got in run_ranks(_rank_losses, config.world_size, tmp_path, config, rows):
        _assert_close(got, expected)


@pytest.mark.distributed
@pytest.mark.parametrize(("task", "layout"), [("squad", (1, 2, 2, 1)), ("mnli", (2, 2, 1, 1))])
def test_a_llama_model_on_parallel_layouts_is_the_single_process(task, layout, tmp_path):
    """tp1 2 x tp2 2 (KV heads and the intermediate layer over tp1, RMSNorm's statistics and
    the projection over tp2) and dp 2 x tp1 2 give the single process's losses."""
    dp, tp1, tp2, pp = layout
    sizes = {"--data_parallel": dp, "--tensor_parallel_1": tp1, "--tensor_parallel_2": tp2}
    sizes["--pipeline_parallel"] = pp
    flags = [text for flag, size in sizes.items() for text in (flag, str(size))]
    llama = [*LLAMA_VARIANTS, "--heads", "6", "--kv_heads", "2", "--intermediate_size", "200"]
    one = _config(task, *llama)
    rows = _rows(one)
    expected = _engine_losses(one, rows)
    config = _config(task, *llama, *flags)
    for got in run_ranks(_rank_losses, config.world_size, tmp_path, config, rows):
        _assert_close(got, expected, tolerance=1e-6)
