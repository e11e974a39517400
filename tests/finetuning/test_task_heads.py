"""The fine-tuning heads' math against HuggingFace's GPT2ForQuestionAnswering and
GPT2ForSequenceClassification: same weights, same batch, same loss and gradients."""

from __future__ import annotations

import pytest
import torch

from execution.parallel.sharding import shard_part
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, GPTShapes, init_full_part
from tasks.specs import task_spec
from tests.finetuning_reference import hf_loss, hf_task_model, initial_weights

SEED, STD = 7, 0.02
PAD = 306  # our prompts pad with <|endoftext|>; HF finds the last token by its pad id


def _shapes(task: str) -> GPTShapes:
    sizes = {"layers": 3, "hidden": 96, "heads": 3, "vocab": 307, "positions": 40}
    head = task_spec(task).head
    return GPTShapes(**sizes, dropout_prob=0.0, layer_norm_eps=1e-5, task_head=head)


def _ours(shapes: GPTShapes) -> GPT:
    model = GPT(shapes)
    for part, module in ((EMBEDDING, model.embedding), (HEAD, model.head)):
        full = init_full_part(shapes, part, 0, SEED, STD)
        module.load_state_dict(shard_part(part, full, shapes, 0, 0))
    for n, layer in enumerate(model.layers):
        full = init_full_part(shapes, LAYERS, n, SEED, STD)
        layer.load_state_dict(shard_part(LAYERS, full, shapes, 0, 0))
    return model


def _batch(task: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, PAD, (4, 24), generator=generator)
    if task == "squad":
        start = torch.randint(0, 24, (4,), generator=generator)
        end = torch.minimum(
            start + torch.randint(0, 4, (4,), generator=generator), torch.tensor(23)
        )
        return ids, torch.stack([start, end], 1)
    lengths = torch.tensor([24, 17, 9, 20])
    for row, length in enumerate(lengths):
        ids[row, length:] = PAD
    labels = torch.randint(0, 3, (4,), generator=generator)
    return ids, torch.stack([labels, lengths - 1], 1)


@pytest.mark.parametrize("task", ["squad", "mnli"])
def test_head_loss_and_gradients_match_huggingface(task):
    shapes = _shapes(task)
    ours = _ours(shapes)
    hf = hf_task_model(shapes, initial_weights(shapes, SEED, STD), pad_token_id=PAD)
    ids, targets = _batch(task, torch.Generator().manual_seed(3))
    loss = ours(ids, targets)
    reference = hf_loss(hf, ids, targets)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    loss.backward()
    reference.backward()
    projection = ours.head.qa.weight if task == "squad" else ours.head.score.weight
    hf_projection = hf.qa_outputs.weight if task == "squad" else hf.score.weight
    torch.testing.assert_close(projection.grad, hf_projection.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        ours.layers[0].attn.qkv.weight.grad,
        hf.transformer.h[0].attn.c_attn.weight.grad.t(),
        atol=1e-6,
        rtol=1e-4,
    )
    word = ours.embedding.word.weight.grad[: shapes.vocab]
    torch.testing.assert_close(word, hf.transformer.wte.weight.grad, atol=1e-6, rtol=1e-4)
