"""The GPT-3 model: an embedding, an indexable stack of identical decoder blocks and a tied head.

The three named parts (``embedding``, ``layers``, ``head``) are the units the phase engine
streams; the model never knows it is phased. :func:`init_full_part` creates the *unsharded*
weights of one part from (seed, part, layer) alone, so every parallel layout slices the same
numbers and no process ever holds the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from modelling.layers import BlockSeeds, DecoderBlock, Embedding, LMHead
from modelling.parallel import LOCAL, Axis

# Rows of a tp1 vocabulary shard are a multiple of this (as in the reference) so that the
# shards of the padded table are equal and matmul-friendly.
VOCAB_SHARD_MULTIPLE = 16

EMBEDDING, LAYERS, HEAD = "embedding", "layers", "head"
PARTS = (EMBEDDING, LAYERS, HEAD)


def padded_vocab_size(vocab_size: int, tp1: int) -> int:
    """Vocabulary rows after padding each of the tp1 shards to a multiple of 16."""
    shard = math.ceil(math.ceil(vocab_size / tp1) / VOCAB_SHARD_MULTIPLE) * VOCAB_SHARD_MULTIPLE
    return shard * tp1


@dataclass(frozen=True)
class GPTShapes:
    """Full and per-shard sizes of the model for a (tp1, tp2) layout."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    positions: int
    dropout_prob: float
    layer_norm_eps: float
    tp1: int = 1
    tp2: int = 1

    @classmethod
    def from_config(cls, model, tp1: int = 1, tp2: int = 1) -> GPTShapes:
        """From a :class:`config.schema.ModelConfig` and the tensor-parallel sizes."""
        return cls(
            layers=model.layers,
            hidden=model.hidden_size,
            heads=model.heads,
            vocab=model.vocab_size,
            positions=model.max_positional_length,
            dropout_prob=model.dropout_prob,
            layer_norm_eps=model.layer_norm_eps,
            tp1=tp1,
            tp2=tp2,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    @property
    def vocab_padded(self) -> int:
        return padded_vocab_size(self.vocab, self.tp1)

    @property
    def positions_padded(self) -> int:
        return math.ceil(self.positions / self.tp1) * self.tp1

    @property
    def num_parameters(self) -> int:
        """Trainable parameters of the unpadded model (the tied embedding counted once)."""
        h = self.hidden
        per_layer = 12 * h * h + 13 * h  # qkv, out, fc, proj weights + biases + 2 layer norms
        return (self.vocab + self.positions) * h + self.layers * per_layer + 2 * h


class GPT(nn.Module):
    """GPT-3 language model for one (tp1, tp2) shard; ``LOCAL`` axes give the whole model."""

    def __init__(self, shapes: GPTShapes, tp1: Axis = LOCAL, tp2: Axis = LOCAL):
        super().__init__()
        assert (tp1.size, tp2.size) == (shapes.tp1, shapes.tp2), "axes do not match the shapes"
        s = shapes
        local_hidden = s.hidden // s.tp2
        self.shapes = s
        self.embedding = Embedding(
            s.vocab_padded // s.tp1, s.positions_padded // s.tp1, local_hidden, s.dropout_prob, tp1
        )
        self.layers = nn.ModuleList(
            DecoderBlock(
                local_hidden,
                s.heads // s.tp1,
                s.head_dim,
                s.ffn // s.tp1,
                s.dropout_prob,
                s.layer_norm_eps,
                tp1,
                tp2,
            )
            for _ in range(s.layers)
        )
        self.head = LMHead(local_hidden, s.layer_norm_eps, tp1, tp2)

    def forward(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        embedding_seed: int | None = None,
        layer_seeds: list[BlockSeeds] | None = None,
    ) -> torch.Tensor:
        """Mean next-token loss of a (B, S) batch; seeds enable dropout (None: no dropout)."""
        x = self.embedding(ids, embedding_seed)
        for n, layer in enumerate(self.layers):
            x = layer(x, layer_seeds[n] if layer_seeds else None)
        return self.head(x, self.embedding.word.weight, labels, self.shapes.vocab)


def init_full_part(shapes: GPTShapes, part: str, layer: int, seed: int, init_std: float):
    """Unsharded, unpadded initial weights of one part, named as in :class:`GPT`'s part.

    Linear and embedding weights are truncated normal (std ``init_std``, cut at 2 std); the
    residual projections ``attn.out`` and ``mlp.proj`` use ``init_std / sqrt(2 * layers)`` as
    in GPT-2; biases are zero and layer-norm gains one. The generator is seeded from
    (seed, part, layer) so the numbers do not depend on the layout or the order of creation.

    Returns:
        dict of parameter name (within the part) -> float32 tensor.
    """
    part_id = PARTS.index(part)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + part_id * 100_003 + layer)

    def normal(*size: int, std: float = init_std) -> torch.Tensor:
        t = torch.empty(size)
        return nn.init.trunc_normal_(t, 0.0, std, -2 * std, 2 * std, generator=generator)

    h = shapes.hidden
    if part == EMBEDDING:
        return {
            "word.weight": normal(shapes.vocab, h),
            "position.weight": normal(shapes.positions, h),
        }
    if part == HEAD:
        return {"ln_f.weight": torch.ones(h), "ln_f.bias": torch.zeros(h)}
    residual_std = init_std / math.sqrt(2 * shapes.layers)
    return {
        "ln_1.weight": torch.ones(h),
        "ln_1.bias": torch.zeros(h),
        "attn.qkv.weight": normal(3 * h, h),
        "attn.qkv.bias": torch.zeros(3 * h),
        "attn.out.weight": normal(h, h, std=residual_std),
        "attn.out.bias": torch.zeros(h),
        "ln_2.weight": torch.ones(h),
        "ln_2.bias": torch.zeros(h),
        "mlp.fc.weight": normal(4 * h, h),
        "mlp.fc.bias": torch.zeros(4 * h),
        "mlp.proj.weight": normal(h, 4 * h, std=residual_std),
        "mlp.proj.bias": torch.zeros(h),
    }
