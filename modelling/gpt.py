"""The GPT-3 model: an embedding, an indexable stack of identical decoder blocks and a tied head;
or, with the Llama family's variants in :class:`GPTShapes`, a Llama model on the same frame.

The three named parts (``embedding``, ``layers``, ``head``) are the units the phase engine
streams; the model never knows it is phased. :func:`init_full_part` creates the *unsharded*
weights of one part and :func:`init_part_region` any product of per-dim positions of them
(a rank's shard), both from the same fixed tiles seeded by (seed, part, layer, name, tile), so
every parallel layout holds the same numbers and no process ever draws the whole model.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelling.components import GELU, LAYER_NORM, LEARNED, Components
from modelling.layers import BlockSeeds, DecoderBlock
from modelling.lm_heads import LMHead, UntiedLMHead
from modelling.parallel import LOCAL, Axis
from modelling.task_heads import TaskHead
from modelling.tiles import (
    NORMAL,
    ONES,
    ZEROS,
    ParamInit,
    draw_into,
    outer,
    prefixed,
    run_all,
    tile_groups,
)
from modelling.variants import Llama3Scaling

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
    # Attention dropout per head from its global index (ModelConfig.dropout_parity).
    dropout_parity: bool = False
    # The head: None for the language model's (tied to the word embedding), else the class of
    # a fine-tuning task's (modelling.task_heads; the task's spec names it), which replaces it.
    task_head: type[TaskHead] | None = None
    # The architecture (modelling/variants.py); the defaults are GPT-3's. 0 for kv_heads,
    # intermediate_size and explicit_head_dim (ModelConfig.head_dim): as many as heads,
    # 4 * hidden, hidden / heads. rope_scaling None: plain rotary frequencies.
    kv_heads: int = 0
    position_embedding: str = LEARNED
    rope_theta: float = 10000.0
    rope_scaling: Llama3Scaling | None = None
    explicit_head_dim: int = 0
    normalization: str = LAYER_NORM
    mlp_activation: str = GELU
    intermediate_size: int = 0
    linear_bias: bool = True
    tied_head: bool = True

    @classmethod
    def from_config(
        cls, model, tp1: int = 1, tp2: int = 1, task_head: type[TaskHead] | None = None
    ) -> GPTShapes:
        """From a :class:`config.schema_model.ModelConfig`, the tensor-parallel sizes and the head."""
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
            dropout_parity=model.dropout_parity,
            task_head=task_head,
            kv_heads=model.kv_heads,
            position_embedding=model.position_embedding,
            rope_theta=model.rope_theta,
            rope_scaling=Llama3Scaling.of(model),
            explicit_head_dim=model.head_dim,
            normalization=model.normalization,
            mlp_activation=model.mlp_activation,
            intermediate_size=model.intermediate_size,
            linear_bias=model.linear_bias,
            tied_head=model.tied_head,
        )

    @property
    def components(self) -> Components:
        """The components its architecture fields name (:mod:`modelling.components`),
        attention run by torch's choice of kernel."""
        return Components.of(self)

    @property
    def label_columns(self) -> int:
        """Columns a batch row carries past its ids: 1 for the language model (the row is
        ``seq + 1`` tokens, labels shifted by one), a task's targets otherwise."""
        return self.task_head.TARGET_WIDTH if self.task_head else 1

    @property
    def head_dim(self) -> int:
        """Width of each q, k and v head."""
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """Width of the query heads together, and of the attention output: the hidden size
        unless an explicit head width says otherwise."""
        return self.heads * self.head_dim

    @property
    def key_value_heads(self) -> int:
        """Heads of k and v: fewer than the query heads with grouped-query attention."""
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        """Width of the MLP's intermediate layer."""
        return self.intermediate_size or 4 * self.hidden

    @property
    def ties_word_embedding(self) -> bool:
        """The head projects with the word embedding (GPT-3's language model head)."""
        return self.task_head is None and self.tied_head

    @property
    def vocab_padded(self) -> int:
        return padded_vocab_size(self.vocab, self.tp1)

    @property
    def positions_padded(self) -> int:
        return math.ceil(self.positions / self.tp1) * self.tp1

    @property
    def task_head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Unsharded shapes of the task head's projection (none for the language model's)."""
        return self.task_head.parameter_shapes(self.hidden) if self.task_head else {}

    @property
    def num_parameters(self) -> int:
        """Trainable parameters of the unpadded model (a tied embedding counted once)."""
        return sum(
            math.prod(init.shape) * (self.layers if part == LAYERS else 1)
            for part in PARTS
            for init in part_inits(self, part).values()
        )


class GPT(nn.Module):
    """GPT-3 language model for one (tp1, tp2) shard; ``LOCAL`` axes give the whole model.

    With a context axis ``cp`` it runs on piece ``cp.rank`` of each sequence (weights are the
    same on every piece) and its loss is the mean over that piece's tokens. The shapes'
    architecture fields choose each part's modules here, once: GPT-3's, or the Llama family's
    (:mod:`modelling.variants`, :class:`modelling.lm_heads.UntiedLMHead`).
    """

    def __init__(
        self,
        shapes: GPTShapes,
        tp1: Axis = LOCAL,
        tp2: Axis = LOCAL,
        cp: Axis = LOCAL,
        components: Components | None = None,
    ):
        super().__init__()
        assert (tp1.size, tp2.size) == (shapes.tp1, shapes.tp2), "axes do not match the shapes"
        s = shapes
        components = components or s.components
        local_hidden = s.hidden // s.tp2
        self.shapes = s
        norm = functools.partial(components.norm, local_hidden, tp2, s.layer_norm_eps)
        self.embedding = components.positions.embedding.of(s, tp1, tp2, cp)
        self.layers = nn.ModuleList(
            DecoderBlock(
                components.attention.of(
                    s, tp1, tp2, cp, components.positions.rotary(s), components.kernel
                ),
                components.mlp(local_hidden, s.ffn // s.tp1, tp1, tp2, bias=s.linear_bias),
                norm,
                s.dropout_prob,
                tp2,
                cp,
            )
            for _ in range(s.layers)
        )
        # What the head takes besides x: the targets, and for a language model's head the
        # vocabulary size, after the word embedding where the head is tied to it.
        self.head_inputs: Callable[[torch.Tensor], tuple] = self._task_head_inputs
        if s.task_head:
            self.head = s.task_head(norm(), local_hidden, tp2)
        elif s.tied_head:
            self.head = LMHead(norm(), tp1, tp2)
            self.head_inputs = self._tied_head_inputs
        else:
            self.head = UntiedLMHead(norm(), s.vocab_padded // s.tp1, local_hidden, tp1, tp2)
            self.head_inputs = self._untied_head_inputs

    def _task_head_inputs(self, labels: torch.Tensor) -> tuple:
        return (labels,)

    def _tied_head_inputs(self, labels: torch.Tensor) -> tuple:
        return (self.embedding.word.weight, labels, self.shapes.vocab)

    def _untied_head_inputs(self, labels: torch.Tensor) -> tuple:
        return (labels, self.shapes.vocab)

    def forward(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        embedding_seed: int | None = None,
        layer_seeds: list[BlockSeeds] | None = None,
    ) -> torch.Tensor:
        """Mean loss of a (B, S) batch; seeds enable dropout (None: no dropout).

        ``labels``: next-token ids (B, S) for the language model's head, a task's targets
        (B, 2) for a task's head (:mod:`modelling.task_heads`).
        """
        x = self.embedding(ids, embedding_seed)
        for n, layer in enumerate(self.layers):
            x = layer(x, layer_seeds[n] if layer_seeds else None)
        return self.head(x, *self.head_inputs(labels))


# Initial weights are drawn per fixed tile of each full tensor (modelling/tiles.py): a tile's
# numbers depend only on (seed, part, layer, name, tile index), never on the layout, so a rank
# can draw just the tiles its shard touches and still hold exactly the numbers every other
# layout holds.


def part_inits(shapes: GPTShapes, part: str, init_std: float = 1.0) -> dict[str, ParamInit]:
    """Unpadded shape and initialisation of every parameter of a part, named as in :class:`GPT`.

    Linear and embedding weights are truncated normal (std ``init_std``, cut at 2 std); the
    residual projections ``attn.out`` and ``mlp.proj`` (``mlp.down``) use ``init_std /
    sqrt(2 * layers)`` as in GPT-2; biases are zero and norm gains one. The Llama variants
    drop what they lack (the position table with rotary positions, norm biases with RMSNorm,
    every bias without linear biases) and an untied head adds ``output.weight``.
    """
    h, components = shapes.hidden, shapes.components
    if part == EMBEDDING:
        return components.positions.embedding.inits(shapes, init_std)
    if part == HEAD:
        # A task's projection after ln_f: weights like other linear layers, biases zero.
        task = {
            name: ParamInit(shape, NORMAL if len(shape) == 2 else ZEROS, init_std)
            for name, shape in shapes.task_head_shapes.items()
        }
        if shapes.task_head is None and not shapes.tied_head:
            task["output.weight"] = ParamInit((shapes.vocab, h), NORMAL, init_std)
        return {**prefixed("ln_f", components.norm.inits(h)), **task}
    residual_std = init_std / math.sqrt(2 * shapes.layers)
    inits = {
        **prefixed("ln_1", components.norm.inits(h)),
        **prefixed("attn", components.attention.inits(shapes, init_std, residual_std)),
        **prefixed("ln_2", components.norm.inits(h)),
        **prefixed("mlp", components.mlp.inits(h, shapes.ffn, init_std, residual_std)),
    }
    if shapes.linear_bias:
        return inits
    return {
        name: init for name, init in inits.items() if name.startswith("ln_") or len(init.shape) == 2
    }


def qualified_name(part: str, row: int, name: str) -> str:
    """A parameter's name in the whole :class:`GPT` (``layers.3.attn.qkv.weight``) from its
    part, row (the layer, for ``layers``) and name within the part."""
    return f"{part}.{row}.{name}" if part == LAYERS else f"{part}.{name}"


def logical_shapes(shapes: GPTShapes) -> dict[str, tuple[int, ...]]:
    """Unsharded, unpadded shape of every parameter of the model, named as in :class:`GPT`."""
    return {
        qualified_name(part, row, name): init.shape
        for part in PARTS
        for row in range(shapes.layers if part == LAYERS else 1)
        for name, init in part_inits(shapes, part).items()
    }


def init_full_part(
    shapes: GPTShapes, part: str, layer: int, seed: int, init_std: float, workers: int = 1
) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded initial weights of one part (see :func:`part_inits` for the rules).

    Assembled from the same per-tile draws as :func:`init_part_region`, so slicing this result
    and drawing a region directly give bit-identical numbers, whatever ``workers`` is.

    Returns:
        dict of parameter name (within the part) -> float32 tensor.
    """
    whole = {
        name: tuple(torch.arange(n) for n in p.shape)
        for name, p in part_inits(shapes, part, init_std).items()
    }
    return init_part_region(shapes, part, layer, seed, init_std, whole, workers)


def init_part_region(
    shapes: GPTShapes,
    part: str,
    layer: int,
    seed: int,
    init_std: float,
    positions: dict[str, tuple[torch.Tensor, ...]],
    workers: int = 1,
) -> dict[str, torch.Tensor]:
    """Initial values of a part's parameters at given positions, drawing only the tiles needed.

    The result for ``name`` is ``full[positions[0]][:, positions[1]]...`` of the unsharded
    tensor, where a position of -1 is padding and gives zero. Each tile of ``INIT_TILE`` along
    every dim is drawn from its own generator and written straight into the result, so beyond
    the result each worker holds one tile at a time, and the numbers do not depend on how many
    workers draw them or in which order.

    Args:
        shapes, part, layer, seed, init_std: As for :func:`init_full_part`.
        positions: Parameter name -> one int64 tensor of full-tensor indices per dim.
        workers: Threads drawing tiles at once, each on one core (torch releases the GIL
            inside its ops; :func:`modelling.host_threads.one_core_pool`); 1 draws them in
            this thread, one after another.

    Returns:
        dict of parameter name -> float32 tensor of shape ``[len(p) for p in positions[name]]``.
    """
    inits = part_inits(shapes, part, init_std)
    out, draws = {}, []
    for name, index in positions.items():
        init = inits[name]
        assert len(index) == len(init.shape), f"{name}: {len(index)} index dims for {init.shape}"
        region = torch.zeros([len(p) for p in index])
        if init.fill == ONES:
            region[outer(*(p >= 0 for p in index))] = 1.0
        elif init.fill == NORMAL:
            key = (seed, part, layer, name)
            draws += [
                functools.partial(draw_into, region, init, key, tiles)
                for tiles in itertools.product(*(tile_groups(p) for p in index))
            ]
        out[name] = region
    run_all(draws, workers)
    return out
