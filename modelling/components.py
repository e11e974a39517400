"""The components a model is built from (not its streamed parts, the embedding, layers and
head), each chosen once from the shapes' architecture fields, as torchtitan's model args pick
its modules: the normalization, the MLP, where positions enter, and attention with the kernel
that runs its core.

This is the one place that picks a component by a variant's name (:data:`NORMS`,
:data:`MLPS`, :data:`POSITIONS`); :class:`modelling.gpt.GPT`, :func:`modelling.gpt.part_inits`
and generation ask the components, never the name. Each declares its parameters' unsharded
shapes and initialisation (its ``inits``), so a new variant is a class and an entry here
(docs/design.md, "Layout of the code": where a new variant goes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from modelling.attention_kernel import SDPAKernel
from modelling.layers import Attention, Embedding, FeedForward, LayerNorm, WordEmbedding
from modelling.variants import RMSNorm, Rotary, SwiGLU

# The architecture choices (GPTShapes' fields): GPT-3's first, then the Llama family's.
LEARNED, ROTARY = "learned", "rotary"
LAYER_NORM, RMS_NORM = "layer_norm", "rms_norm"
GELU, SWIGLU = "gelu", "swiglu"


class LearnedPositions:
    """GPT-3's positions: a learned table added in the embedding; attention rotates nothing."""

    embedding: type[WordEmbedding] = Embedding

    @staticmethod
    def rotary(s) -> nn.Module | None:
        return None


class RotaryPositions:
    """The Llama family's: the word embedding alone, and q and k rotated in attention."""

    embedding: type[WordEmbedding] = WordEmbedding

    @staticmethod
    def rotary(s) -> nn.Module | None:
        return Rotary(s.head_dim, s.rope_theta, s.rope_scaling)


NORMS: dict[str, type[nn.Module]] = {LAYER_NORM: LayerNorm, RMS_NORM: RMSNorm}
MLPS: dict[str, type[nn.Module]] = {GELU: FeedForward, SWIGLU: SwiGLU}
POSITIONS: dict[str, type] = {LEARNED: LearnedPositions, ROTARY: RotaryPositions}


@dataclass(frozen=True)
class Components:
    """What a :class:`modelling.gpt.GPT` is built from.

    Attributes:
        norm: Each norm's class: ``(local_hidden, tp2, eps)``, with ``inits(hidden)``.
        mlp: The MLP's class: ``(local_hidden, local_ffn, tp1, tp2, bias)``, with
            ``inits(hidden, ffn, std, residual_std)`` and ``ROWS_PER_FEATURE``.
        positions: Where positions enter: the embedding's class and attention's rotation.
        attention: Attention's class (:class:`~modelling.layers.Attention`, or a subclass
            that runs its core otherwise: the engine's selective recompute).
        kernel: What runs attention's core (None: torch's choice,
            :class:`~modelling.attention_kernel.TorchSDPA`), chosen by whoever builds the model.
    """

    norm: type[nn.Module]
    mlp: type[nn.Module]
    positions: type
    attention: type[Attention] = Attention
    kernel: SDPAKernel | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls, shapes, kernel: SDPAKernel | None = None, attention: type[Attention] = Attention
    ) -> Components:
        """The components ``shapes`` (:class:`modelling.gpt.GPTShapes`) name, attention run by
        ``kernel`` as ``attention``."""
        return cls(
            NORMS[shapes.normalization],
            MLPS[shapes.mlp_activation],
            POSITIONS[shapes.position_embedding],
            attention,
            kernel,
        )
