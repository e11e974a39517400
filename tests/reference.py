"""Independent references for the tests: an ordinary autograd GPT trained with torch.optim.AdamW.

The reference shares only the model definition and the initial weights with the phased engine;
its step is the textbook loop (forward/backward per micro-batch, clip_grad_norm_, AdamW.step).
"""

from __future__ import annotations

import shlex

import torch

from config.loading import parse_config
from config.schema import PretrainingConfig
from execution.parallel.sharding import shard_part
from modelling import lm_heads
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, GPTShapes, init_full_part


def chunk_every_head(monkeypatch) -> None:
    """Makes the engine run every language model head on chunks of tokens, as it runs a large
    vocabulary's (:func:`modelling.lm_heads.logits_chunks`, without its vocabulary threshold
    and floor): each chunk's logits then hold half the weight shard's elements, so a test's
    small model takes the chunked path. Forked ranks inherit it."""
    monkeypatch.setattr(lm_heads, "CHUNKED_VOCABULARY", 0)
    monkeypatch.setattr(lm_heads, "LOGITS_CHUNK_FLOOR", 0)


# The flags of the Llama variants (the llama presets' architecture; sizes are each test's).
LLAMA_VARIANTS = shlex.split(
    "--position_embedding rotary --normalization rms_norm --mlp_activation swiglu "
    "--linear_bias false --tied_head false"
)


def small_config(*flags: str) -> PretrainingConfig:
    """A small float32, dropout-free config on top of the ``tiny`` preset, plus ``flags``.

    Its parts run eager and are priced eager, even in a dry run on a GPU's data sheet (where
    ``--compile`` is on by default): a compiled part's price takes seconds of inductor's
    scheduling per shape, which the planning tests would pay for every layout they weigh.
    ``--compile true`` among ``flags`` turns it on (the compiled tests' own).

    AdamW epsilon is 1e-6 (the PopXL reference's value), not the paper's 1e-8: the gradient of
    the attention *key* bias is exactly zero in exact arithmetic (softmax ignores a constant per
    query), so its computed value is rounding noise, and with eps 1e-8 Adam turns that noise
    into updates that differ between any two correct implementations.
    """
    base = shlex.split(
        "--config tiny --vocab_size 307 --layers 2 --hidden_size 32 --heads 4 --sequence_length 16 "
        "--max_positional_length 20 --global_batch_size 8 --micro_batch_size 2 --dropout_prob 0 "
        "--weight_decay 0.1 --eps 1e-6 --device cpu --compile false"
    )
    config, _ = parse_config([*base, *flags])
    return config


def reference_model(config: PretrainingConfig) -> GPT:
    """A single-device GPT holding the same initial weights as the phased engine."""
    shapes = GPTShapes.from_config(config.model)
    model = GPT(shapes)
    seed, std = config.training.seed, config.model.init_std
    for part, module in ((EMBEDDING, model.embedding), (HEAD, model.head)):
        full = init_full_part(shapes, part, 0, seed, std)
        module.load_state_dict(shard_part(part, full, shapes, 0, 0))
    for n, layer in enumerate(model.layers):
        full = init_full_part(shapes, LAYERS, n, seed, std)
        layer.load_state_dict(shard_part(LAYERS, full, shapes, 0, 0))
    return model


def reference_optimizer(model: GPT, config: PretrainingConfig) -> torch.optim.AdamW:
    """AdamW decaying weight matrices and embeddings (2-D tensors), never biases or norms."""
    decayed = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    o = config.training.optimizer
    groups = [
        {"params": decayed, "weight_decay": o.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False
    )


def reference_step(
    model: GPT,
    optimizer: torch.optim.AdamW,
    tokens: torch.Tensor,
    lr: float,
    clip: float,
    seeds=None,
) -> tuple[float, dict[str, torch.Tensor], float]:
    """One step with gradient accumulation over ``tokens[m]`` micro-batches.

    Args:
        seeds: Optional function ``m -> (embedding_seed, [BlockSeeds per layer])`` for dropout.

    Returns:
        Mean loss, the (unclipped) gradients by name, and the global gradient norm.
    """
    optimizer.zero_grad()
    accumulation = tokens.shape[0]
    losses = []
    for m in range(accumulation):
        kwargs = {}
        if seeds is not None:
            kwargs["embedding_seed"], kwargs["layer_seeds"] = seeds(m)
        loss = model(tokens[m, :, :-1], tokens[m, :, 1:], **kwargs)
        (loss / accumulation).backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return sum(losses) / accumulation, grads, norm.item()


def unpadded(name: str, tensor: torch.Tensor, config: PretrainingConfig) -> torch.Tensor:
    """Drops the zero rows the single-device model pads its embeddings (and an untied head's
    projection) with."""
    if name in ("embedding.word.weight", "head.output.weight"):
        return tensor[: config.model.vocab_size]
    if name == "embedding.position.weight":
        return tensor[: config.model.max_positional_length]
    return tensor


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (the scale of the tensor, so near-zero elements do not dominate)."""
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)
