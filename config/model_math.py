"""Which model flags saved weights fix, and which are free to change when a run starts from them.

Every field of :class:`~config.schema_model.ModelConfig` is classified once, in
:data:`MODEL_FIELDS`; tests/training/test_starting_weights.py fails on a field that is not. A field is
*fixed* when the same weights give another model under another value: other tensor shapes
(``hidden_size``), or the same shapes read another way (``heads`` cuts the same q, k and v rows
into other heads; ``rope_theta`` rotates them at other frequencies). A fixed field given another
value than a checkpoint's (``--load``) or a HuggingFace folder's (``--hf_model``) is refused
before the run does any work; a free one may change on resume. docs/checkpoints.md lists both.

The comparison is over the values the math sees (``kv_heads`` 0 is as many as ``heads``), and
a field that matters only with some architecture (``rope_theta`` with rotary positions) is
compared only there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from config.errors import ConfigError
from config.schema_model import LLAMA3_ROPE_FLAGS, POSITION_EMBEDDINGS, ModelConfig

LEARNED, ROTARY = POSITION_EMBEDDINGS

Section = Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    """What one model field is to saved weights.

    Attributes:
        fixed: The weights fix it: another value computes another model, or cannot hold the
            saved tensors. False: free to change on resume.
        why: The reason, in a few words (docs/checkpoints.md's table says the same).
        applies: For a fixed field, the models it matters in (None: every model).
        value: The value the math sees, from the whole section (None: the field's own).
    """

    fixed: bool
    why: str
    applies: Callable[[Section], bool] | None = None
    value: Callable[[Section], Any] | None = None


def _learned(model: Section) -> bool:
    return model["position_embedding"] == LEARNED


def _rotary(model: Section) -> bool:
    return model["position_embedding"] == ROTARY


def _llama3_rope(model: Section) -> bool:
    return _rotary(model) and model["rope_type"] == "llama3"


MODEL_FIELDS: dict[str, Rule] = {
    "layers": Rule(True, "the number of decoder layers' tensors"),
    "hidden_size": Rule(True, "the width of every tensor"),
    "heads": Rule(True, "how attention cuts the q, k and v rows into heads"),
    "sequence_length": Rule(
        False,
        "no tensor has it (learned positions: a table of --max_positional_length rows; rotary: "
        "none); a resumed run's data position counts sequences of it (see below)",
    ),
    "vocab_size": Rule(
        True,
        "the rows of the word embedding and the head, saved unpadded (the padding to a "
        "multiple of --tensor_parallel_1 is the layout's)",
    ),
    "max_positional_length": Rule(
        True,
        "the rows of the learned position table; rotary positions have no table (free)",
        applies=_learned,
    ),
    "dropout_prob": Rule(False, "training noise, not part of the weights' math"),
    "dropout_parity": Rule(False, "which dropout masks are drawn, not the weights' math"),
    "layer_norm_eps": Rule(True, "the normalization's epsilon"),
    "init_std": Rule(False, "draws initial weights only: loaded ones replace them"),
    "kv_heads": Rule(
        True,
        "the rows of k and v (0: as many as --heads)",
        value=lambda m: m["kv_heads"] or m["heads"],
    ),
    "position_embedding": Rule(True, "a learned table or rotations in attention"),
    "rope_theta": Rule(
        True, "the rotary frequencies; unused with learned positions (free)", applies=_rotary
    ),
    "rope_type": Rule(
        True,
        "plain rotary frequencies or Llama 3.1's scaled ones; unused with learned positions (free)",
        applies=_rotary,
    ),
    **{
        name: Rule(
            True,
            "the scaled rotary frequencies; read only by --rope_type llama3",
            applies=_llama3_rope,
        )
        for name in LLAMA3_ROPE_FLAGS
    },
    "head_dim": Rule(
        True,
        "the width of q, k and v's heads (0: --hidden_size / --heads)",
        value=lambda m: m["head_dim"] or m["hidden_size"] // m["heads"],
    ),
    "normalization": Rule(True, "layer norm (with a bias) or RMS norm"),
    "mlp_activation": Rule(True, "the MLP's function and its matrices"),
    "intermediate_size": Rule(
        True,
        "the MLP's width (0: 4 x --hidden_size)",
        value=lambda m: m["intermediate_size"] or 4 * m["hidden_size"],
    ),
    "linear_bias": Rule(True, "whether the projections have biases"),
    "tied_head": Rule(True, "whether the head is the word embedding or a matrix of its own"),
}


def model_section(
    saved: Section, source: str, error: type[ConfigError] = ConfigError
) -> dict[str, Any]:
    """A saved ``model`` section (a checkpoint's ``trainer.json``) with every field of this
    program's: a field saved before it existed takes its default, the model it computed then.

    Raises:
        error: the section holds a field this program does not know (saved by a newer one):
            its model cannot be computed here. ``source`` starts the line.
    """
    defaults = dataclasses.asdict(ModelConfig())
    unknown = [name for name in saved if name not in defaults]
    if unknown:
        name = unknown[0]
        raise error(
            f"{source} was saved by a model with --{name} {_flag_value(saved[name])}, a model "
            "flag this program does not have; use the version of the program that saved it"
        )
    return {**defaults, **saved}


def fixed_differences(saved: Section, ours: Section) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, our value)`` of each field the saved weights fix whose value
    differs, as the math sees them. A field whose own values agree but whose derived ones do
    not (``kv_heads`` 0 under other ``heads``) is left to the field it derives from."""
    differences = []
    for name, rule in MODEL_FIELDS.items():
        if not rule.fixed or saved[name] == ours[name]:
            continue
        if rule.applies is not None and not (rule.applies(saved) and rule.applies(ours)):
            continue
        value = rule.value or (lambda m, name=name: m[name])
        if value(saved) != value(ours):
            differences.append((name, value(saved), value(ours)))
    return differences


def refuse_other_model(
    source: str, saved: Section, ours: ModelConfig, error: type[ConfigError] = ConfigError
) -> None:
    """Raises ``error``, one line, when ``ours`` differs from the ``saved`` model section in a
    field the weights fix: ``{source} was saved by a model of --heads 4, this run has --heads
    8: pass --heads 4 ...``, every such field named with both values."""
    saved = model_section(saved, source, error)
    differences = fixed_differences(saved, dataclasses.asdict(ours))
    if not differences:
        return
    theirs = " ".join(f"--{name} {_flag_value(value)}" for name, value, _ in differences)
    mine = " ".join(f"--{name} {_flag_value(value)}" for name, _, value in differences)
    raise error(
        f"{source} was saved by a model of {theirs}, this run has {mine}: pass {theirs} (the "
        "weights mean what they meant to the model that saved them; docs/checkpoints.md lists "
        "the model flags that must match)"
    )


def _flag_value(value: Any) -> str:
    """``value`` as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
