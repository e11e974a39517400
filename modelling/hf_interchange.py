"""Our parameter names <-> HuggingFace GPT-2 (``GPT2LMHeadModel``) names, and its files.

GPT-3 is GPT-2's architecture, so the weights map one to one. HF's ``Conv1D`` stores weights
``[in, out]`` where ours are ``[out, in]`` like ``nn.Linear``: the four matrices of a block are
transposed. Both keep q, k and v as consecutive thirds of the qkv projection (rows here, columns
there). The LM head is tied to ``transformer.wte.weight``, as ours is to ``embedding.word``.

Reading uses ``safetensors`` (or ``torch.load`` for ``pytorch_model.bin``) tensor by tensor;
writing streams the safetensors file tensor by tensor (the ``safetensors`` package writes only
whole state dicts), and tests load it with ``from_pretrained``.

A Llama folder (``model_type`` llama) and a Llama-architecture model are
:mod:`modelling.hf_llama`'s: :func:`open_hf_weights` and :func:`export_hf` hand them over.
Either folder's ``config.json`` is checked field by field first (:mod:`modelling.hf_config`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from modelling.hf_config import GPT2_FIELDS, check_fields, read_config
from modelling.hf_llama import LlamaWeights, export_llama, is_llama
from modelling.task_heads import HF_TASK_NAMES, head_holding


class HFModelError(ValueError):
    """A ``--hf_model`` folder that cannot start the run: one line naming the flag, the file
    and what to change (the run's entry turns it into its one-line exit)."""


# Our name within a decoder layer -> (HF name within transformer.h.N, transposed).
LAYER_NAMES = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.out.weight": ("attn.c_proj.weight", True),
    "attn.out.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
OTHER_NAMES = {
    "embedding.word.weight": "transformer.wte.weight",
    "embedding.position.weight": "transformer.wpe.weight",
    "head.ln_f.weight": "transformer.ln_f.weight",
    "head.ln_f.bias": "transformer.ln_f.bias",
}
# The architecture fields (config/schema_model.py: ModelConfig) of a model GPT2LMHeadModel holds.
GPT2_ARCHITECTURE = {
    "position_embedding": "learned",
    "normalization": "layer_norm",
    "mlp_activation": "gelu",
    "linear_bias": True,
    "tied_head": True,
}
# HF activations that are GPT-2's tanh approximation of GELU (ours).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def hf_name(ours: str) -> tuple[str, bool]:
    """HF name of one of our logical parameter names, and whether it is transposed."""
    if ours in OTHER_NAMES:
        return OTHER_NAMES[ours], False
    if ours in HF_TASK_NAMES:
        return HF_TASK_NAMES[ours], False
    _, n, rest = ours.split(".", 2)  # layers.N.rest
    name, transpose = LAYER_NAMES[rest]
    return f"transformer.h.{n}.{name}", transpose


def hf_config(model: dict[str, Any]):
    """A ``transformers.GPT2Config`` for our model section (``config.yml``'s ``model``)."""
    import transformers  # imported here: only export needs it

    eot = 50256 if model["vocab_size"] > 50256 else None  # GPT-2's <|endoftext|>
    return transformers.GPT2Config(
        vocab_size=model["vocab_size"],
        n_positions=model["max_positional_length"],
        n_embd=model["hidden_size"],
        n_layer=model["layers"],
        n_head=model["heads"],
        activation_function="gelu_new",
        resid_pdrop=model["dropout_prob"],
        embd_pdrop=model["dropout_prob"],
        attn_pdrop=model["dropout_prob"],
        layer_norm_epsilon=model["layer_norm_eps"],
        initializer_range=model["init_std"],
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
    )


def export_hf(
    model: dict[str, Any], weights: Mapping[str, torch.Tensor], folder: str | Path
) -> int:
    """Writes ``config.json`` and ``model.safetensors`` for ``GPT2LMHeadModel.from_pretrained``,
    or, for a fine-tuned model (its weights hold a task head's projection), for the
    HuggingFace class its head names (``GPT2ForQuestionAnswering``,
    ``GPT2ForSequenceClassification``: :meth:`~modelling.task_heads.TaskHead.describe_hf`).

    The safetensors file is written one tensor at a time (its header needs only the shapes),
    so a lazily read ``weights`` (:class:`execution.checkpoint.load.SavedWeights`) is exported
    with memory for about one tensor, not the model.

    Args:
        model: The ``model`` section of the run's config (as a dict).
        weights: Our logical float32 weights, named as in :class:`modelling.gpt.GPT`; a
            ``shapes`` attribute (name -> shape), where present, saves reading them for the header.
        folder: Output folder (created).

    Returns:
        The number of parameters written.
    """
    folder = Path(folder)
    if is_llama(model):
        folder.mkdir(parents=True, exist_ok=True)
        return export_llama(model, weights, folder)
    if unlike_gpt2 := _unlike_gpt2(model):
        raise HFModelError(
            f"--hf_output: the model's --{', --'.join(unlike_gpt2)} are not GPT-2's, nor is it "
            "all Llama (rotary, rms_norm, swiglu, no biases); HuggingFace has no class for it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    shapes = getattr(weights, "shapes", None) or {n: t.shape for n, t in weights.items()}
    config = hf_config(model)
    if head := head_holding(shapes):
        head.describe_hf(config)
    config.to_json_file(folder / "config.json")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for ours, shape in shapes.items():
        name, transpose = hf_name(ours)
        shape = list(reversed(shape)) if transpose else list(shape)
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for ours in shapes:
            t = weights[ours].to(torch.float32)
            t = t.t() if hf_name(ours)[1] else t
            f.write(t.contiguous().numpy().tobytes())
    return offset // 4


def open_hf_weights(folder: str | Path) -> HFWeights | LlamaWeights:
    """The tensors of a local HuggingFace folder: GPT-2's (:class:`HFWeights`) or Llama's
    (:class:`modelling.hf_llama.LlamaWeights`), as its ``config.json`` says.

    Raises:
        HFModelError: missing or unreadable files, a field of ``config.json`` missing or of
            another type than transformers reads, or a model that is neither.
    """
    folder = Path(folder)
    config = read_config(folder, HFModelError)
    if config.get("model_type") == "llama":
        return LlamaWeights(folder, config, HFModelError)
    return HFWeights(folder, config)


def _unlike_gpt2(model: dict[str, Any]) -> list[str]:
    """The architecture flags of a ``model`` section that ``GPT2LMHeadModel`` cannot hold."""
    unlike = [flag for flag, gpt2 in GPT2_ARCHITECTURE.items() if model.get(flag, gpt2) != gpt2]
    if model.get("kv_heads") not in (None, 0, model["heads"]):
        unlike.append("kv_heads")
    if model.get("intermediate_size") not in (None, 0, 4 * model["hidden_size"]):
        unlike.append("intermediate_size")
    if model.get("head_dim") not in (None, 0, model["hidden_size"] // model["heads"]):
        unlike.append("head_dim")
    return unlike


def _flag_value(value: Any) -> str:
    """``value`` as it is written on the command line (booleans as true and false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


class HFWeights:
    """Tensors of a local HuggingFace GPT-2 folder, read one at a time.

    Args:
        folder: Holds ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``.
        config: Its parsed ``config.json`` (None: read here).

    Raises:
        HFModelError: missing or unreadable files, or a model that is not GPT-2.
    """

    def __init__(self, folder: str | Path, config: dict[str, Any] | None = None):
        self.folder = Path(folder)
        self.config = config if config is not None else read_config(self.folder, HFModelError)
        if self.config.get("model_type") != "gpt2":
            raise HFModelError(
                f"--hf_model: {self.folder / 'config.json'} describes a "
                f"{self.config.get('model_type')!r} model; only GPT-2 (model_type gpt2) and "
                "Llama (model_type llama) map onto this model"
            )
        check_fields(self.config, GPT2_FIELDS, self.folder / "config.json", HFModelError)
        safetensors_file = self.folder / "model.safetensors"
        bin_file = self.folder / "pytorch_model.bin"
        if safetensors_file.is_file():
            from safetensors import safe_open

            try:
                handle = safe_open(str(safetensors_file), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise HFModelError(f"--hf_model: {safetensors_file} is damaged: {err}") from None
            self._names = set(handle.keys())
            self._get = handle.get_tensor
        elif bin_file.is_file():
            try:
                state = torch.load(bin_file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                raise HFModelError(f"--hf_model: {bin_file} is damaged: {err}") from None
            self._names = set(state)
            self._get = state.__getitem__
        else:
            raise HFModelError(
                f"--hf_model: {self.folder} has neither model.safetensors nor pytorch_model.bin"
            )

    def check_shape(self, model) -> None:
        """Raises a one-line HFModelError when the HF model differs from ``model`` (the run's
        :class:`~modelling.gpt.GPTShapes`), naming the flag to change and both values."""
        for flag, gpt2 in GPT2_ARCHITECTURE.items():
            if (ours := getattr(model, flag)) != gpt2:
                raise HFModelError(
                    f"--hf_model {self.folder} is a GPT-2 model ({flag} {_flag_value(gpt2)}) "
                    f"but this run has --{flag} {_flag_value(ours)}; pass --{flag} "
                    f"{_flag_value(gpt2)} (a GPT-3 preset has GPT-2's architecture)"
                )
        if model.attention_width != model.hidden:  # an explicit head_dim of GPT-2's own passes
            raise HFModelError(
                f"--hf_model {self.folder} is a GPT-2 model, whose heads are n_embd / n_head wide "
                f"(--head_dim {model.hidden // model.heads}), but this run has --head_dim "
                f"{model.explicit_head_dim}; pass --head_dim 0"
            )
        c = self.config
        hidden, heads = c.get("n_embd"), c.get("n_head")
        four_hidden = 4 * hidden if isinstance(hidden, int) else None
        pairs = [  # (what the config says, its value, our flag, our value)
            ("n_layer", c.get("n_layer"), "layers", model.layers),
            ("n_embd", hidden, "hidden_size", model.hidden),
            ("n_head", heads, "heads", model.heads),
            ("n_head (GPT-2's key/value heads)", heads, "kv_heads", model.key_value_heads),
            ("n_inner (else 4 x n_embd)", c.get("n_inner") or four_hidden, "intermediate_size",
             model.ffn),
            ("vocab_size", c.get("vocab_size"), "vocab_size", model.vocab),
            ("n_positions", c.get("n_positions"), "max_positional_length", model.positions),
            ("layer_norm_epsilon", c.get("layer_norm_epsilon", 1e-5), "layer_norm_eps",
             model.layer_norm_eps),
        ]  # fmt: skip
        for key, theirs, flag, ours in pairs:
            if theirs != ours:
                raise HFModelError(
                    f"--hf_model {self.folder} has {key} {theirs} but this run has --{flag} "
                    f"{ours}; pass --{flag} {theirs}"
                )
        activation = c.get("activation_function", "gelu_new")
        if activation not in TANH_GELUS:
            raise HFModelError(
                f"--hf_model {self.folder} uses activation {activation!r}; this model computes "
                "the tanh approximation (gelu_new)"
            )
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("scale_attn_weights") is False:
            raise HFModelError(
                f"--hf_model {self.folder} scales attention differently from GPT-2/GPT-3"
            )

    def source_name(self, ours: str) -> str:
        """The HF tensor name of our ``ours``, for messages."""
        return hf_name(ours)[0]

    def has(self, ours: str) -> bool:
        """Whether the folder holds our logical tensor ``ours``."""
        name = hf_name(ours)[0]
        return name in self._names or name.removeprefix("transformer.") in self._names

    def get(self, ours: str) -> torch.Tensor:
        """Our logical float32 tensor ``ours`` (e.g. ``layers.0.attn.qkv.weight``)."""
        name, transpose = hf_name(ours)
        for candidate in (name, name.removeprefix("transformer.")):  # old files lack the prefix
            if candidate in self._names:
                t = self._get(candidate).float()
                return t.t().contiguous() if transpose else t.clone()
        raise HFModelError(f"--hf_model {self.folder} has no tensor {name}")
