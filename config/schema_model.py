"""The section of the configuration tree about the model's shape and architecture, and which
layouts split it evenly. Part of the tree of :mod:`config.schema`."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from config.errors import ConfigError, refuse_ignored_flags
from config.field_help import doc as _doc

# The architecture choices of modelling.gpt.GPTShapes, GPT-3's first.
POSITION_EMBEDDINGS = ("learned", "rotary")
NORMALIZATIONS = ("layer_norm", "rms_norm")
MLP_ACTIVATIONS = ("gelu", "swiglu")
# Rotary frequencies: plain, or Llama 3.1's scaled ones (HF's rope_type of the same name).
ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """Shape of the model: GPT-3's by default (pre-layer-norm decoder, learned positions, tied
    embedding); the architecture fields after ``init_std`` choose the Llama family's parts."""

    layers: int = field(default=12, metadata=_doc("Number of decoder layers."))
    hidden_size: int = field(default=768, metadata=_doc("Width of the residual stream."))
    heads: int = field(
        default=12,
        metadata=_doc("Attention heads; must divide hidden_size unless head_dim is set."),
    )
    sequence_length: int = field(default=2048, metadata=_doc("Tokens per training sequence."))
    vocab_size: int = field(default=50257, metadata=_doc("Vocabulary size (GPT-2 BPE: 50257)."))
    max_positional_length: int = field(
        default=2048, metadata=_doc("Rows of the learned position embedding.")
    )
    dropout_prob: float = field(
        default=0.1, metadata=_doc("Dropout on embeddings, attention probabilities and residuals.")
    )
    dropout_parity: bool = field(
        default=False,
        metadata=_doc(
            "Attention dropout drawn head by head from each head's global index, so every "
            "layout draws the single process's masks (for layout-parity tests); written-out "
            "attention with a [heads, seq, seq] tensor, not the fused kernel."
        ),
    )
    layer_norm_eps: float = field(default=1e-5, metadata=_doc("Layer-norm epsilon."))
    init_std: float = field(
        default=0.02,
        metadata=_doc(
            "Std of the truncated-normal weight init; residual projections use "
            "init_std / sqrt(2 * layers) as in GPT-2."
        ),
    )
    kv_heads: int = field(
        default=0,
        metadata=_doc(
            "Key/value heads (grouped-query attention); must divide heads. 0: as many as heads."
        ),
    )
    position_embedding: str = field(
        default="learned",
        metadata=_doc(
            "learned (a table of max_positional_length rows) or rotary (RoPE in attention).",
            choices=POSITION_EMBEDDINGS,
        ),
    )
    rope_theta: float = field(
        default=10000.0, metadata=_doc("Base of the rotary position frequencies.")
    )
    rope_type: str = field(
        default="default",
        metadata=_doc(
            "default (rotary frequencies from rope_theta alone) or llama3 (Llama 3.1's: a model "
            "pretrained at rope_original_max_positions reads longer contexts with its long "
            "wavelengths stretched by rope_factor).",
            choices=ROPE_TYPES,
        ),
    )
    rope_factor: float = field(
        default=8.0,
        metadata=_doc(
            "llama3 rope: the long wavelengths' frequencies are divided by this (HF's factor)."
        ),
    )
    rope_low_freq_factor: float = field(
        default=1.0,
        metadata=_doc(
            "llama3 rope: wavelengths over rope_original_max_positions / this are stretched "
            "by rope_factor (HF's low_freq_factor)."
        ),
    )
    rope_high_freq_factor: float = field(
        default=4.0,
        metadata=_doc(
            "llama3 rope: wavelengths under rope_original_max_positions / this are kept; "
            "those between the two bounds are interpolated smoothly (HF's high_freq_factor)."
        ),
    )
    rope_original_max_positions: int = field(
        default=8192,
        metadata=_doc(
            "llama3 rope: the context the model was pretrained at "
            "(HF's original_max_position_embeddings)."
        ),
    )
    head_dim: int = field(
        default=0,
        metadata=_doc(
            "Width of each attention head (q, k and v). 0: hidden_size / heads; another value "
            "(an explicit head_dim in a HF config) makes q and the attention output "
            "heads x head_dim wide."
        ),
    )
    normalization: str = field(
        default="layer_norm",
        metadata=_doc("layer_norm (with bias) or rms_norm (gain only).", choices=NORMALIZATIONS),
    )
    mlp_activation: str = field(
        default="gelu",
        metadata=_doc(
            "gelu (h -> intermediate -> h) or swiglu (down(silu(gate x) * up x)).",
            choices=MLP_ACTIVATIONS,
        ),
    )
    intermediate_size: int = field(
        default=0, metadata=_doc("Width of the MLP's intermediate layer. 0: 4 * hidden_size.")
    )
    linear_bias: bool = field(
        default=True, metadata=_doc("Biases on the attention and MLP projections.")
    )
    tied_head: bool = field(
        default=True,
        metadata=_doc("The output projection is the word embedding (false: a matrix of its own)."),
    )


# The flags only --rope_type llama3 reads.
LLAMA3_ROPE_FLAGS = (
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
)


def check_rope_scaling(model: ModelConfig, given: Collection[str] = ()) -> None:
    """Raises a one-line ConfigError naming the flag of Llama 3.1 rope settings that cannot
    compute (a factor under 1, bounds that leave no band to interpolate), or that plain
    rotary positions would ignore (among ``given``, the dotted paths of the flags on the
    command line)."""
    if model.rope_type == "default":
        unused = [f"--{name}" for name in LLAMA3_ROPE_FLAGS if f"model.{name}" in given]
        instead = "add --rope_type llama3 or leave {them} out"
        refuse_ignored_flags(unused, "--rope_type llama3", instead)
        return
    if model.position_embedding != "rotary":
        raise ConfigError(
            f"--rope_type {model.rope_type} scales rotary frequencies; add --position_embedding "
            "rotary"
        )
    factor, low, high = model.rope_factor, model.rope_low_freq_factor, model.rope_high_freq_factor
    if not (math.isfinite(factor) and factor >= 1):
        raise ConfigError(
            f"--rope_factor must be a finite number >= 1 (Llama 3.1's is 8), got {factor}"
        )
    if not (math.isfinite(low) and low > 0):
        raise ConfigError(
            f"--rope_low_freq_factor must be a finite number > 0 (Llama 3.1's is 1), got {low}"
        )
    if not (math.isfinite(high) and high > low):
        raise ConfigError(
            f"--rope_high_freq_factor must be a finite number above --rope_low_freq_factor {low} "
            f"(Llama 3.1's are 4 and 1), got {high}"
        )
    if model.rope_original_max_positions < 1:
        raise ConfigError(
            "--rope_original_max_positions must be at least 1 (Llama 3.1's is 8192), got "
            f"{model.rope_original_max_positions}"
        )


def uneven_splits(
    heads: int,
    hidden_size: int,
    sequence_length: int,
    tp1: int = 1,
    tp2: int = 1,
    cp: int = 1,
    kv_heads: int = 0,
    intermediate_size: int = 0,
) -> list[str]:
    """The splits of the model that a layout's tensor and context axes leave uneven, by name:
    ``heads`` and ``kv_heads`` (each tensor_parallel_1 rank holds whole query and key/value
    heads), ``intermediate`` (and an equal slice of the MLP's intermediate layer), ``hidden``
    (the hidden columns over tensor_parallel_2), ``sequence`` (each context rank an equal piece
    of every sequence), ``context_heads`` (and an equal share of its tensor_parallel_1 rank's
    heads, which attention's all-to-all hands it). ``kv_heads`` and ``intermediate_size`` 0:
    as many as ``heads``, 4 x ``hidden_size``. Empty: the layout splits the model evenly."""
    checks = {
        "heads": heads % tp1,
        "kv_heads": (kv_heads or heads) % tp1,
        "intermediate": (intermediate_size or 4 * hidden_size) % tp1,
        "hidden": hidden_size % tp2,
        "sequence": sequence_length % cp,
        "context_heads": (heads // tp1) % cp,
    }
    return [name for name, remainder in checks.items() if remainder]
