"""Our parameter names <-> HuggingFace Llama (``LlamaForCausalLM``) names, and its files.

Our Llama variants compute HF's math in HF's layout (RMSNorm, rotary positions in the
``rotate_half`` convention, SwiGLU), so weights map without permutation. Two of ours are HF's
matrices stacked by rows: ``attn.qkv`` is ``q_proj``, ``k_proj``, ``v_proj``, and
``mlp.gate_up`` is ``gate_proj``, ``up_proj`` (one matmul, one tp1 split each). An untied head
is ``lm_head``; a tied one (``tie_word_embeddings``) is the word embedding.

Reading takes ``model.safetensors`` or the shards a ``model.safetensors.index.json`` names,
tensor by tensor, after :mod:`modelling.hf_config` has checked every field of ``config.json``
it reads; writing streams one ``model.safetensors`` as
:func:`modelling.hf_interchange.export_hf` does. Rotary settings (plain, or Llama 3.1's
``llama3`` scaling) and an explicit ``head_dim`` go both ways; ``config.json`` carries the
rotary settings as transformers 5 writes them and as transformers 4 reads them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from modelling.hf_config import LLAMA_FIELDS, check_fields, llama_rope
from modelling.task_heads import HEADS, HF_TASK_NAMES, head_holding

# The attribute of LlamaForCausalLM holding its base model; a task class may name its own.
BASE_MODEL = "model"

# Our name within a decoder layer -> the HF names within model.layers.N, stacked by rows.
LAYER_NAMES = {
    "ln_1.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.out.weight": ("self_attn.o_proj.weight",),
    "ln_2.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
OTHER_NAMES = {
    "embedding.word.weight": ("model.embed_tokens.weight",),
    "head.ln_f.weight": ("model.norm.weight",),
    "head.output.weight": ("lm_head.weight",),
}


def is_llama(model: Mapping[str, Any]) -> bool:
    """Whether a ``model`` config section (as a dict) is the Llama architecture."""
    return (
        model.get("position_embedding") == "rotary"
        and model.get("normalization") == "rms_norm"
        and model.get("mlp_activation") == "swiglu"
        and not model.get("linear_bias", True)
    )


def hf_names(ours: str, base_model: str = BASE_MODEL) -> tuple[str, ...]:
    """The HF tensors that make up our logical parameter ``ours``, stacked by rows, in a class
    whose base model is the attribute ``base_model``."""
    if ours in HF_TASK_NAMES:
        return (HF_TASK_NAMES[ours],)
    if ours in OTHER_NAMES:
        names = OTHER_NAMES[ours]
    else:
        _, n, rest = ours.split(".", 2)  # layers.N.rest
        names = tuple(f"model.layers.{n}.{name}" for name in LAYER_NAMES[rest])
    prefix = f"{BASE_MODEL}."
    return tuple(
        f"{base_model}.{name.removeprefix(prefix)}" if name.startswith(prefix) else name
        for name in names
    )


def row_split(ours: str, shape: tuple[int, ...], model: Mapping[str, Any]) -> list[int]:
    """The rows of each HF tensor in our ``ours`` of ``shape`` (q, k, v; gate, up; or one)."""
    if ours.endswith("attn.qkv.weight"):
        heads = model["heads"]
        head_dim = _head_dim(model)
        kv = (model.get("kv_heads") or heads) * head_dim
        return [heads * head_dim, kv, kv]
    if ours.endswith("mlp.gate_up.weight"):
        return [shape[0] // 2] * 2
    return [shape[0]]


def _head_dim(model: Mapping[str, Any]) -> int:
    return model.get("head_dim") or model["hidden_size"] // model["heads"]


def rope_parameters(model: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of our model section: the type and base and, for
    Llama 3.1's scaling, its factors and original context (a section saved before these
    fields existed has plain rotary positions)."""
    rope: dict[str, Any] = {"rope_type": model.get("rope_type", "default")}
    if rope["rope_type"] == "llama3":
        rope |= {
            "factor": model["rope_factor"],
            "low_freq_factor": model["rope_low_freq_factor"],
            "high_freq_factor": model["rope_high_freq_factor"],
            "original_max_position_embeddings": model["rope_original_max_positions"],
        }
    return {**rope, "rope_theta": model["rope_theta"]}


def llama_config(model: Mapping[str, Any]):
    """A ``transformers.LlamaConfig`` for our model section (``config.yml``'s ``model``)."""
    import transformers  # imported here: only export needs it

    eot = 50256 if model["vocab_size"] > 50256 else None  # GPT-2's <|endoftext|>, our tokenizer's
    return transformers.LlamaConfig(
        vocab_size=model["vocab_size"],
        hidden_size=model["hidden_size"],
        intermediate_size=model.get("intermediate_size") or 4 * model["hidden_size"],
        num_hidden_layers=model["layers"],
        num_attention_heads=model["heads"],
        num_key_value_heads=model.get("kv_heads") or model["heads"],
        head_dim=_head_dim(model),
        hidden_act="silu",
        max_position_embeddings=model["max_positional_length"],
        initializer_range=model["init_std"],
        rms_norm_eps=model["layer_norm_eps"],
        tie_word_embeddings=model.get("tied_head", True),
        rope_parameters=rope_parameters(model),
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=eot,
        eos_token_id=eot,
    )


def write_llama_config(config, model: Mapping[str, Any], path: Path) -> None:
    """Writes ``config`` (a ``LlamaConfig``) as the installed transformers does, with the
    rotary settings also as transformers 4 writes and reads them: ``rope_theta`` at the top
    and the scaling alone as ``rope_scaling`` (null for plain rotary positions). Without them
    a transformers 4 reader would take the default base of 10000 and no scaling; transformers
    5 reads ``rope_scaling`` first and takes the top-level base into it, the same settings."""
    settings = json.loads(config.to_json_string())
    rope = rope_parameters(model)
    theta = rope.pop("rope_theta")
    settings |= {"rope_theta": theta, "rope_scaling": rope if len(rope) > 1 else None}
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def export_llama(model: dict[str, Any], weights: Mapping[str, torch.Tensor], folder: Path) -> int:
    """Writes ``config.json`` (:func:`write_llama_config`) and ``model.safetensors`` for
    ``LlamaForCausalLM`` or, for a fine-tuned model, the Llama class its head names
    (``LlamaForQuestionAnswering``, ``LlamaForSequenceClassification``), one tensor at a time
    (as :func:`modelling.hf_interchange.export_hf`); returns the parameters written."""
    shapes = getattr(weights, "shapes", None) or {n: t.shape for n, t in weights.items()}
    config, base_model = llama_config(model), BASE_MODEL
    if head := head_holding(shapes):
        head.describe_hf(config)
        base_model = head.HF_CLASSES[config.model_type].base_model
    write_llama_config(config, model, folder / "config.json")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for ours, shape in shapes.items():
        names = hf_names(ours, base_model)
        for name, rows in zip(names, row_split(ours, shape, model), strict=True):
            size = math.prod((rows, *shape[1:])) * 4
            header[name] = {
                "dtype": "F32",
                "shape": [rows, *shape[1:]],
                "data_offsets": [offset, offset + size],
            }
            offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for ours, shape in shapes.items():
            t = weights[ours].to(torch.float32)
            for piece in t.split(row_split(ours, shape, model)):
                f.write(piece.contiguous().numpy().tobytes())
    return offset // 4


class LlamaWeights:
    """Tensors of a local HuggingFace Llama folder, read one at a time.

    Args:
        folder: Holds ``config.json`` and ``model.safetensors`` or the shards that
            ``model.safetensors.index.json`` names.
        config: Its parsed ``config.json``.
        error: The exception type of a one-line refusal (the run's ``HFModelError``).
    """

    def __init__(self, folder: Path, config: dict[str, Any], error: type[Exception]):
        from safetensors import safe_open

        self.folder, self.config, self.error = folder, config, error
        check_fields(config, LLAMA_FIELDS, folder / "config.json", error)
        self.rope = llama_rope(config, folder / "config.json", error)
        architectures = config.get("architectures") or []
        task_classes = (c for head in HEADS for c in head.HF_CLASSES.values())
        self.base_model = next(
            (c.base_model for c in task_classes if c.name in architectures), BASE_MODEL
        )
        index_file = folder / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (ValueError, KeyError):
                raise error(f"--hf_model: {index_file} has no weight_map") from None
        elif (folder / "model.safetensors").is_file():
            weight_map = None
        else:
            raise error(
                f"--hf_model: {folder} has neither model.safetensors nor "
                "model.safetensors.index.json"
            )
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {}
        for file in files:
            try:
                self._handles[file] = safe_open(str(folder / file), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise error(f"--hf_model: {folder / file} is missing or damaged: {err}") from None
        if weight_map is None:
            weight_map = dict.fromkeys(
                self._handles["model.safetensors"].keys(), "model.safetensors"
            )
        self._files = weight_map

    def check_shape(self, model) -> None:
        """Raises a one-line refusal when the HF model differs from ``model`` (the run's
        :class:`~modelling.gpt.GPTShapes`), naming the flag to change."""
        architecture = {
            "position_embedding": (model.position_embedding, "rotary"),
            "normalization": (model.normalization, "rms_norm"),
            "mlp_activation": (model.mlp_activation, "swiglu"),
            "linear_bias": (model.linear_bias, False),
        }
        for flag, (ours, theirs) in architecture.items():
            if ours != theirs:
                raise self.error(
                    f"--hf_model {self.folder} is a Llama model but this run has --{flag} "
                    f"{ours}; pass --config llama_tiny (or --{flag} {theirs})"
                )
        c, rope = self.config, self.rope
        heads = c["num_attention_heads"]
        pairs = {
            "num_hidden_layers": ("layers", model.layers, c["num_hidden_layers"]),
            "hidden_size": ("hidden_size", model.hidden, c["hidden_size"]),
            "num_attention_heads": ("heads", model.heads, heads),
            "num_key_value_heads": (
                "kv_heads",
                model.key_value_heads,
                c.get("num_key_value_heads") or heads,
            ),
            "head_dim": (
                "head_dim",
                model.head_dim,
                c.get("head_dim") or c["hidden_size"] // heads,
            ),
            "intermediate_size": ("intermediate_size", model.ffn, c["intermediate_size"]),
            "vocab_size": ("vocab_size", model.vocab, c["vocab_size"]),
            "rms_norm_eps": ("layer_norm_eps", model.layer_norm_eps, c.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": (
                "tied_head",
                model.tied_head,
                bool(c.get("tie_word_embeddings", False)),
            ),
        }
        prefix = f"{rope.key}." if rope.key else ""
        unsupported = {  # key -> (the folder's value, whether this model cannot compute it)
            "hidden_act": (c.get("hidden_act", "silu"), c.get("hidden_act", "silu") != "silu"),
            "attention_bias": (c.get("attention_bias"), bool(c.get("attention_bias"))),
            "mlp_bias": (c.get("mlp_bias"), bool(c.get("mlp_bias"))),
            f"{prefix}rope_type": (rope.rope_type, rope.rope_type not in ("default", "llama3")),
            "partial_rotary_factor": (rope.partial_rotary_factor, rope.partial_rotary_factor != 1),
        }
        for key, (value, differs) in unsupported.items():
            if differs:
                raise self.error(
                    f"--hf_model {self.folder} has {key} {value!r}, which this model does not "
                    "compute (silu, no biases, rotary positions of rope_type default or llama3 "
                    "over whole heads)"
                )
        pairs |= self._rope_pairs(model)
        for key, (flag, ours, theirs) in pairs.items():
            if ours != theirs:
                raise self.error(
                    f"--hf_model {self.folder} has {key} {theirs} but this run has --{flag} "
                    f"{ours}; pass --{flag} {theirs}"
                )

    def _rope_pairs(self, model) -> dict[str, tuple[str, Any, Any]]:
        """The rotary settings of the folder beside the run's (:meth:`check_shape`): the key
        in config.json -> (flag, the run's value, the folder's)."""
        rope, scaling = self.rope, model.rope_scaling
        prefix = f"{rope.key}." if rope.key else ""
        ours_type = "default" if scaling is None else "llama3"
        pairs = {
            "rope_theta": ("rope_theta", model.rope_theta, rope.theta),
            f"{prefix}rope_type": ("rope_type", ours_type, rope.rope_type),
        }
        if scaling is None or rope.rope_type != "llama3":
            return pairs
        flags = {
            "factor": ("rope_factor", scaling.factor),
            "low_freq_factor": ("rope_low_freq_factor", scaling.low_freq_factor),
            "high_freq_factor": ("rope_high_freq_factor", scaling.high_freq_factor),
            "original_max_position_embeddings": (
                "rope_original_max_positions",
                scaling.original_max_positions,
            ),
        }
        for name, (flag, ours) in flags.items():
            pairs[f"{prefix}{name}"] = (flag, ours, rope.scaling[name])
        return pairs

    def source_name(self, ours: str) -> str:
        """The HF tensor names of our ``ours``, for messages."""
        return " + ".join(self._tied(hf_names(ours, self.base_model)))

    def _tied(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """A tied model's folder has no ``lm_head.weight``: the word embedding is it."""
        if names == ("lm_head.weight",) and "lm_head.weight" not in self._files:
            return (f"{self.base_model}.embed_tokens.weight",)
        return names

    def has(self, ours: str) -> bool:
        """Whether the folder holds every HF tensor of our ``ours``."""
        return all(name in self._files for name in self._tied(hf_names(ours, self.base_model)))

    def get(self, ours: str) -> torch.Tensor:
        """Our logical float32 tensor ``ours`` (e.g. ``layers.0.attn.qkv.weight``)."""
        pieces = []
        for name in self._tied(hf_names(ours, self.base_model)):
            if name not in self._files:
                raise self.error(f"--hf_model {self.folder} has no tensor {name}")
            pieces.append(self._handles[self._files[name]].get_tensor(name).float())
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
