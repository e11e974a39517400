"""A HuggingFace ``config.json`` as ``--hf_model`` reads it: an object whose every field the
import reads has its JSON type (a damaged file is one line naming the field, not a traceback
deep in a comparison), and a Llama model's rotary settings read as ``transformers`` reads them.

The sizes a model cannot do without are required; the other fields take ``transformers``'
defaults when absent or null, as ``from_pretrained`` gives them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POSITIVE_INTEGER, NUMBER, BOOLEAN = "a positive integer", "a finite number", "true or false"
STRING, STRINGS, OBJECT = "a string", "a list of strings", "an object"
KINDS: dict[str, Callable[[Any], bool]] = {
    POSITIVE_INTEGER: lambda v: type(v) is int and v > 0,
    NUMBER: lambda v: type(v) in (int, float) and math.isfinite(v),
    BOOLEAN: lambda v: type(v) is bool,
    STRING: lambda v: type(v) is str,
    STRINGS: lambda v: type(v) is list and all(type(s) is str for s in v),
    OBJECT: lambda v: type(v) is dict,
}

# Every field of a config.json the import reads, its kind, and whether it is required.
COMMON_FIELDS = {"model_type": (STRING, False), "architectures": (STRINGS, False)}
GPT2_FIELDS = {
    **COMMON_FIELDS,
    **{
        name: (POSITIVE_INTEGER, True)
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
    },
    "n_inner": (POSITIVE_INTEGER, False),
    "layer_norm_epsilon": (NUMBER, False),
    "activation_function": (STRING, False),
    "scale_attn_by_inverse_layer_idx": (BOOLEAN, False),
    "scale_attn_weights": (BOOLEAN, False),
}
LLAMA_FIELDS = {
    **COMMON_FIELDS,
    **{
        name: (POSITIVE_INTEGER, True)
        for name in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
    },
    "num_key_value_heads": (POSITIVE_INTEGER, False),
    "head_dim": (POSITIVE_INTEGER, False),
    "max_position_embeddings": (POSITIVE_INTEGER, False),
    "rms_norm_eps": (NUMBER, False),
    "rope_theta": (NUMBER, False),
    "partial_rotary_factor": (NUMBER, False),
    "tie_word_embeddings": (BOOLEAN, False),
    "attention_bias": (BOOLEAN, False),
    "mlp_bias": (BOOLEAN, False),
    "hidden_act": (STRING, False),
    # transformers 4 writes rotary scaling as rope_scaling beside rope_theta, 5 as
    # rope_parameters holding both.
    "rope_scaling": (OBJECT, False),
    "rope_parameters": (OBJECT, False),
}
ROPE_FIELDS = {
    "rope_type": (STRING, False),
    "type": (STRING, False),  # what transformers before 4.45 called rope_type
    "rope_theta": (NUMBER, False),
    "partial_rotary_factor": (NUMBER, False),
    "factor": (NUMBER, False),
    "low_freq_factor": (NUMBER, False),
    "high_freq_factor": (NUMBER, False),
    "original_max_position_embeddings": (POSITIVE_INTEGER, False),
}
# What transformers' llama3 rope reads besides the base; the original context defaults to
# max_position_embeddings.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
DEFAULT_THETA = 10000.0  # transformers' default rope_theta


def read_config(folder: Path, error: type[Exception]) -> dict[str, Any]:
    """The parsed ``config.json`` of ``folder``: a JSON object with a string ``model_type``.

    Raises:
        error: an unreadable file, invalid JSON, or anything but an object of settings.
    """
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except OSError as err:
        raise error(f"--hf_model: cannot read {config_file}: {err.strerror}") from None
    except ValueError:
        raise error(f"--hf_model: {config_file} is not valid JSON") from None
    if type(config) is not dict:
        raise error(
            f"--hf_model: {config_file} holds {_described(config)}, not an object of a model's "
            "settings; the file is damaged, or not a HuggingFace model's config.json"
        )
    check_fields(config, COMMON_FIELDS, config_file, error)
    return config


def check_fields(
    config: Mapping[str, Any],
    fields: Mapping[str, tuple[str, bool]],
    config_file: Path,
    error: type[Exception],
    within: str = "",
) -> None:
    """Raises ``error`` naming the first of ``fields`` (name -> kind, required) that
    ``config`` lacks or holds with another JSON type; ``within`` prefixes the names (a nested
    object's key). A null is an absent field, as ``transformers`` takes it."""
    for name, (kind, required) in fields.items():
        value = config.get(name)
        if value is None and required:
            raise error(
                f"--hf_model: {config_file} has no {within}{name}, which the model needs; the "
                "file is damaged, or not the config.json of this kind of model"
            )
        if value is not None and not KINDS[kind](value):
            raise error(
                f"--hf_model: {config_file} has {within}{name} {_described(value)}, where "
                f"transformers reads {kind}; correct it in the file"
            )


@dataclass(frozen=True)
class LlamaRope:
    """A Llama config's rotary settings: where it keeps them (``rope_scaling``,
    ``rope_parameters`` or neither: ``""``), the type, the base and, for llama3, the scaling
    (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``)."""

    key: str
    rope_type: str
    theta: float
    partial_rotary_factor: float
    scaling: dict[str, float] = field(default_factory=dict)


def llama_rope(config: Mapping[str, Any], config_file: Path, error: type[Exception]) -> LlamaRope:
    """The rotary settings of a Llama ``config`` whose fields :data:`LLAMA_FIELDS` checked,
    read as ``transformers`` 5 reads them: ``rope_scaling`` (transformers 4's key) before
    ``rope_parameters``; a base inside it before a top-level ``rope_theta``; ``type`` where
    ``rope_type`` is absent; llama3's original context defaulting to
    ``max_position_embeddings``."""
    key = next((k for k in ("rope_scaling", "rope_parameters") if config.get(k)), "")
    rope = config.get(key) or {}
    check_fields(rope, ROPE_FIELDS, config_file, error, within=f"{key}.")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = _first(rope.get("rope_theta"), config.get("rope_theta"), DEFAULT_THETA)
    partial = _first(rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"), 1.0)
    scaling = {}
    if rope_type == "llama3":
        for name in LLAMA3_KEYS:
            if rope.get(name) is None:
                raise error(
                    f"--hf_model: {config_file} has {key}.rope_type llama3 but no {key}.{name}; "
                    "Llama 3.1 configs give factor, low_freq_factor and high_freq_factor"
                )
            scaling[name] = rope[name]
        original = rope.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or _max_positions(
            config, config_file, error, key
        )
    return LlamaRope(key, rope_type, theta, partial, scaling)


def _max_positions(
    config: Mapping[str, Any], config_file: Path, error: type[Exception], key: str
) -> int:
    if config.get("max_position_embeddings") is None:
        raise error(
            f"--hf_model: {config_file} has {key}.rope_type llama3 but neither "
            f"{key}.original_max_position_embeddings nor max_position_embeddings"
        )
    return config["max_position_embeddings"]


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _described(value: Any) -> str:
    """A JSON value with its type, for messages: ``the string "10000"``, ``a list``."""
    if value is None:
        return "null"
    if type(value) is bool:
        return json.dumps(value)
    if type(value) in (int, float):
        return f"the number {json.dumps(value)}"
    if type(value) is str:
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {json.dumps(shown)}"
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
