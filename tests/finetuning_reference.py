"""HuggingFace's task models as independent references for the fine-tuning heads and engine.

``GPT2ForQuestionAnswering`` and ``GPT2ForSequenceClassification`` (their Llama classes for a
Llama model) are built from a config with our initial weights copied in (through the same name
map as ``--hf_model``), and trained by
``torch.optim.AdamW``: they share nothing with our engine but the numbers they start from.
"""

from __future__ import annotations

import torch

from modelling.gpt import LAYERS, PARTS, GPTShapes, init_full_part, qualified_name
from modelling.hf_interchange import hf_name
from modelling.hf_llama import hf_names, llama_config, row_split


def initial_weights(shapes: GPTShapes, seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """Every logical initial weight of the model, named as in :class:`~modelling.gpt.GPT`."""
    out = {}
    for part in PARTS:
        for row in range(shapes.layers if part == LAYERS else 1):
            for name, t in init_full_part(shapes, part, row, seed, init_std).items():
                out[qualified_name(part, row, name)] = t
    return out


def hf_task_model(
    shapes: GPTShapes, weights: dict[str, torch.Tensor], pad_token_id: int | None = None
) -> torch.nn.Module:
    """HF's model for ``shapes.task_head`` (the class the head names) in float32, without
    dropout, holding ``weights``."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=shapes.vocab,
        n_positions=shapes.positions,
        n_embd=shapes.hidden,
        n_layer=shapes.layers,
        n_head=shapes.heads,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=shapes.layer_norm_eps,
        num_labels=3,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = getattr(transformers, shapes.task_head.HF_CLASSES["gpt2"].name)(config).float()
    state = {}
    for ours, t in weights.items():
        name, transpose = hf_name(ours)
        state[name] = t.t() if transpose else t
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(".attn.bias" in m or "masked_bias" in m for m in missing), missing
    return model.train()


def hf_llama_task_model(
    model_section: dict, shapes: GPTShapes, weights: dict[str, torch.Tensor], pad_token_id: int
) -> torch.nn.Module:
    """HF's Llama model for ``shapes.task_head`` (``LlamaForQuestionAnswering``,
    ``LlamaForSequenceClassification``) of our ``model_section`` (``config.yml``'s ``model``)
    in float32, holding ``weights`` through the same name map as ``--hf_model``."""
    import transformers

    config = llama_config(model_section)
    shapes.task_head.describe_hf(config)
    config.pad_token_id = pad_token_id
    hf_class = shapes.task_head.HF_CLASSES[config.model_type]
    model = getattr(transformers, hf_class.name)(config).float()
    state = {}
    for ours, t in weights.items():
        names = hf_names(ours, hf_class.base_model)
        state |= dict(zip(names, t.split(row_split(ours, t.shape, model_section)), strict=True))
    model.load_state_dict(state, strict=True)
    return model.train()


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """HF's loss of one micro-batch, given our targets (``[B, 2]``, modelling.task_heads)."""
    if hasattr(model, "qa_outputs"):
        return model(input_ids=ids, start_positions=targets[:, 0], end_positions=targets[:, 1]).loss
    return model(input_ids=ids, labels=targets[:, 0]).loss


def hf_optimizer(model: torch.nn.Module, optimizer_config) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` decaying 2-D weights (matrices, embeddings, the task projection),
    never biases or layer norms: the groups our engine decays."""
    decayed = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    o = optimizer_config
    groups = [
        {"params": decayed, "weight_decay": o.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False
    )
