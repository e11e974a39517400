"""Our parameter names <-> HuggingFace Llama (``LlamaForCausalLM``) names, and its files.

Our Llama variants compute HF's math in HF's layout (RMSNorm, rotary positions in the
``rotate_half`` convention, SwiGLU), so weights map without permutation. Two of ours are HF's
matrices stacked by rows: ``attn.qkv`` is ``q_proj``, ``k_proj``, ``v_proj``, and
``mlp.gate_up`` is ``gate_proj``, ``up_proj`` (one matmul, one tp1 split each). An untied head
is ``lm_head``; a tied one (``tie_word_embeddings``) is the word embedding.

Reading takes ``model.safetensors`` or the shards a ``model.safetensors.index.json`` names,
tensor by tensor; writing streams one ``model.safetensors`` as
:func:`modelling.hf_interchange.export_hf` does.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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
        head_dim = model["hidden_size"] // heads
        kv = (model.get("kv_heads") or heads) * head_dim
        return [model["hidden_size"], kv, kv]
    if ours.endswith("mlp.gate_up.weight"):
        return [shape[0] // 2] * 2
    return [shape[0]]


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
        hidden_act="silu",
        max_position_embeddings=model["max_positional_length"],
        initializer_range=model["init_std"],
        rms_norm_eps=model["layer_norm_eps"],
        tie_word_embeddings=model.get("tied_head", True),
        rope_parameters={"rope_type": "default", "rope_theta": model["rope_theta"]},
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=eot,
        eos_token_id=eot,
    )


def export_llama(model: dict[str, Any], weights: Mapping[str, torch.Tensor], folder: Path) -> int:
    """Writes ``config.json`` and ``model.safetensors`` for ``LlamaForCausalLM`` or, for a
    fine-tuned model, the Llama class its head names (``LlamaForQuestionAnswering``,
    ``LlamaForSequenceClassification``), one tensor at a time (as
    :func:`modelling.hf_interchange.export_hf`); returns the parameters written."""
    shapes = getattr(weights, "shapes", None) or {n: t.shape for n, t in weights.items()}
    config, base_model = llama_config(model), BASE_MODEL
    if head := head_holding(shapes):
        head.describe_hf(config)
        base_model = head.HF_CLASSES[config.model_type].base_model
    config.to_json_file(folder / "config.json")
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
        c = self.config
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        heads = c.get("num_attention_heads")
        pairs = {
            "num_hidden_layers": ("layers", model.layers, c.get("num_hidden_layers")),
            "hidden_size": ("hidden_size", model.hidden, c.get("hidden_size")),
            "num_attention_heads": ("heads", model.heads, heads),
            "num_key_value_heads": (
                "kv_heads",
                model.key_value_heads,
                c.get("num_key_value_heads") or heads,
            ),
            "intermediate_size": ("intermediate_size", model.ffn, c.get("intermediate_size")),
            "vocab_size": ("vocab_size", model.vocab, c.get("vocab_size")),
            "rope_theta": ("rope_theta", model.rope_theta, theta),
            "rms_norm_eps": ("layer_norm_eps", model.layer_norm_eps, c.get("rms_norm_eps")),
            "tie_word_embeddings": (
                "tied_head",
                model.tied_head,
                bool(c.get("tie_word_embeddings", False)),
            ),
        }
        for key, (flag, ours, theirs) in pairs.items():
            if ours != theirs:
                raise self.error(
                    f"--hf_model {self.folder} has {key} {theirs} but this run has --{flag} "
                    f"{ours}; pass --{flag} {theirs}"
                )
        unsupported = {
            "hidden_act": c.get("hidden_act", "silu") != "silu",
            "attention_bias": bool(c.get("attention_bias")),
            "mlp_bias": bool(c.get("mlp_bias")),
            "rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
            "head_dim": c.get("head_dim", model.head_dim) != model.head_dim,
        }
        for key, differs in unsupported.items():
            if differs:
                raise self.error(
                    f"--hf_model {self.folder} has {key} {c.get(key, rope.get(key))!r}, which "
                    "this model does not compute (silu, no biases, plain rotary positions, "
                    "head_dim hidden_size / heads)"
                )

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
