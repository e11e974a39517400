"""A damaged HuggingFace ``config.json`` given to ``--hf_model`` (issue 54 item 5) is one line
naming the field, exit 2, before the engine is built and before anything is written: a file
that is a list or null, a field of another JSON type than ``transformers`` reads (a string
``rope_theta``, a string ``rope_scaling``, a fractional head count), a size that is missing.

Every command runs through the real entry point (forked: tests/entry_points.py) with the
engine's construction made to fail, so that a check after it would show as a traceback. The
undamaged config beside them passes the same checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from config.loading import parse_config
from execution.engine.engine import PhasedEngine
from modelling.hf_interchange import open_hf_weights
from tasks.specs import run_shapes
from tests.entry_points import assert_refused, run_script

LLAMA_TINY = ["--config", "llama_tiny", "--device", "cpu"]
# The llama_tiny preset's model as transformers 5 writes its config.json.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 344,
    "vocab_size": 50257,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 50257}
GPT2 |= {"n_positions": 128, "activation_function": "gelu_new"}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}


def _folder(tmp_path: Path, config) -> Path:
    """An HF folder of ``config`` beside a (tiny) safetensors file."""
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(128)}, folder / "model.safetensors")
    return folder


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the HF config was checked")

    monkeypatch.setattr(PhasedEngine, "__init__", refuse)


def test_the_undamaged_configs_pass_the_checks(tmp_path):
    for name, config, flags in (("llama", LLAMA, LLAMA_TINY), ("gpt2", GPT2, ["--config", "tiny"])):
        folder = _folder(tmp_path / name, config)
        run, _ = parse_config([*flags, "--device", "cpu"])
        open_hf_weights(folder).check_shape(run_shapes(run))


@pytest.mark.parametrize(
    ("base", "damage", "message"),
    [
        (LLAMA, lambda c: [c], "config.json holds a list, not an object of a model's settings"),
        (LLAMA, lambda c: None, "config.json holds null, not an object of a model's settings"),
        (LLAMA, {"rope_scaling": "linear"}, 'has rope_scaling the string "linear", where'),
        (LLAMA, {"rope_parameters": None, "rope_theta": "10000"}, 'rope_theta the string "1000'),
        (
            LLAMA,
            {"rope_parameters": {"rope_theta": "10000"}},
            'has rope_parameters.rope_theta the string "10000", where transformers reads a finite',
        ),
        (LLAMA, {"hidden_size": "128"}, 'has hidden_size the string "128", where'),
        (LLAMA, {"num_key_value_heads": 2.0}, "has num_key_value_heads the number 2.0, where"),
        (LLAMA, {"head_dim": -32}, "has head_dim the number -32, where"),
        (LLAMA, {"tie_word_embeddings": "false"}, 'has tie_word_embeddings the string "false"'),
        (LLAMA, {"rms_norm_eps": float("nan")}, "has rms_norm_eps the number NaN, where"),
        (LLAMA, {"architectures": "LlamaForCausalLM"}, 'has architectures the string "Llama'),
        (LLAMA, {"model_type": ["llama"]}, "has model_type a list, where transformers reads a st"),
        (LLAMA, {"num_hidden_layers": None}, "has no num_hidden_layers, which the model needs"),
        (
            LLAMA,
            {"rope_scaling": {**LLAMA31_ROPE, "high_freq_factor": "4"}},
            'has rope_scaling.high_freq_factor the string "4", where',
        ),
        (
            LLAMA,
            {"rope_scaling": LLAMA31_ROPE},
            "has rope_scaling.rope_type llama3 but no rope_scaling.high_freq_factor",
        ),
        (GPT2, {"n_head": "4"}, 'has n_head the string "4", where transformers reads a positive'),
        (GPT2, {"scale_attn_weights": "yes"}, 'has scale_attn_weights the string "yes", where'),
    ],
)
def test_a_damaged_config_is_one_line_naming_the_field(no_engine, tmp_path, base, damage, message):
    config = damage(dict(base)) if callable(damage) else {**base, **damage}
    folder = _folder(tmp_path, config)
    flags = LLAMA_TINY if base is LLAMA else ["--config", "tiny", "--device", "cpu"]
    out = tmp_path / "out"
    result = run_script(
        "run_pretraining.py", *flags, "--hf_model", str(folder), "--output_dir", str(out)
    )
    assert_refused(result, "run_pretraining.py", message)
    assert "Traceback" not in result.stderr and not out.exists()
