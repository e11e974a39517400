"""HuggingFace interchange: export a checkpoint, load it with ``transformers`` alone; import a
folder that ``transformers`` saved. The reference is HF's own ``GPT2LMHeadModel``. Nothing is
downloaded: HF models are built from a ``GPT2Config`` with random weights."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from config.loading import ConfigError
from execution.checkpoint.load import load_hf_weights, read_weights, saved_model_shapes
from execution.checkpoint.logical import full_state
from execution.parallel.mesh import ParallelLayout
from modelling.generation import build_model, forward_logits
from modelling.gpt import GPTShapes
from tests.checkpoints import export_hf, save_checkpoint
from tests.distributed import CPU, global_batches, planned_engine, replica_batch, small_config
from tests.entry_points import run_script
from tests.reference import relative_error

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 10), generator=torch.Generator().manual_seed(5))


def test_export_loads_in_transformers_alone_with_our_logits(tmp_path):
    config = small_config()
    engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, 2)
    for step in range(2):  # trained: biases and norms are no longer 0 and 1
        engine.train_step(replica_batch(config, batches[step], 0), step, 1e-2)
    save_checkpoint(tmp_path / "ckpt", engine, config, 2)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")

    # transformers alone reads the folder: no code of ours is registered with it.
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = _tokens(config.model.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    model, weights = read_weights(tmp_path / "ckpt")
    ours_model = build_model(saved_model_shapes(model), weights)
    with torch.no_grad():
        ours = forward_logits(ours_model, tokens)
    assert theirs.shape == ours.shape == (3, 10, 1000)
    assert relative_error(ours, theirs) <= TOLERANCE


def _hf_model(
    vocab: int,
    positions: int,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    n_inner: int | None = None,
):
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_inner=n_inner,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a mis-mapped one cannot hide
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "ln" in name and "weight" in name else 0.0, 0.1)
    return hf


@pytest.mark.parametrize("file", ["model.safetensors", "pytorch_model.bin"])
def test_import_a_folder_transformers_saved_gives_its_logits(tmp_path, file):
    hf = _hf_model(vocab=1000, positions=10)
    hf.save_pretrained(tmp_path / "hf")
    if file == "pytorch_model.bin":  # the older format of the same folder
        (tmp_path / "hf" / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "hf" / file)
    config = small_config()  # 2 layers, hidden 32, 4 heads, vocab 1000, 10 positions
    engine = planned_engine(config, ParallelLayout.single(CPU))
    load_hf_weights(tmp_path / "hf", engine)
    ours_model = build_model(GPTShapes.from_config(config.model), full_state(engine))
    tokens = _tokens(1000)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = forward_logits(ours_model, tokens)
    assert relative_error(ours, theirs) <= TOLERANCE
    # and the engine's own loss (the training path) equals HF's
    batch = tokens[:2, :9]  # [micro_batch 2, sequence_length 8 + 1]
    eval_loss = engine.evaluate([batch])
    with torch.no_grad():
        hf_loss = hf(input_ids=batch, labels=batch).loss.item()
    assert abs(eval_loss - hf_loss) <= TOLERANCE * hf_loss


def test_a_gpt2_of_another_mlp_width_imports_with_its_flag_and_gives_its_logits(tmp_path):
    hf = _hf_model(vocab=1000, positions=10, n_inner=48)
    hf.save_pretrained(tmp_path / "hf")
    engine = planned_engine(small_config(), ParallelLayout.single(CPU))
    with pytest.raises(ConfigError, match=r"else 4 x n_embd\) 48 but this run has "):
        load_hf_weights(tmp_path / "hf", engine)
    config = small_config("--intermediate_size", "48")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    load_hf_weights(tmp_path / "hf", engine)
    ours_model = build_model(GPTShapes.from_config(config.model), full_state(engine))
    tokens = _tokens(1000)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = forward_logits(ours_model, tokens)
    assert relative_error(ours, theirs) <= TOLERANCE


def test_import_checks_the_shape(tmp_path):
    _hf_model(vocab=1000, positions=10, hidden=64).save_pretrained(tmp_path / "hf")
    engine = planned_engine(small_config(), ParallelLayout.single(CPU))
    with pytest.raises(ConfigError, match="has n_embd 64 but this run has --hidden_size 32"):
        load_hf_weights(tmp_path / "hf", engine)
    with pytest.raises(ConfigError, match=r"nothing/config\.json"):
        load_hf_weights(tmp_path / "nothing", engine)


@pytest.mark.slow
def test_hf_model_flag_evaluates_the_hf_weights_like_transformers(tmp_path):
    """The entry point with --hf_model --eval_only reports HF's own loss on the same batch."""
    from data.loader import SAMPLE_VALIDATION_GLOB, validation_batches

    hf = _hf_model(vocab=50257, positions=128, layers=1)
    hf.save_pretrained(tmp_path / "hf")
    flags = shlex.split(
        "--config tiny --layers 1 --hidden_size 32 --heads 4 --sequence_length 16 --device cpu "
        "--eval_only --eval_batches 1"
    )
    paths = ["--hf_model", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "out")]
    result = run_script("run_pretraining.py", *flags, *paths)
    assert result.returncode == 0, result.stderr
    assert f"weights from the HuggingFace model {tmp_path / 'hf'}" in result.stdout
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    (batch,) = validation_batches([SAMPLE_VALIDATION_GLOB], 16, 4, 0, 1, 50257, 1)
    with torch.no_grad():
        expected = hf(input_ids=batch, labels=batch).loss.item()
    assert abs(row["eval_loss"] - expected) <= TOLERANCE * expected
