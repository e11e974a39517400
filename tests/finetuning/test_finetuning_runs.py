"""run_finetuning.py end to end on the shipped samples (a small model): an interrupted and
resumed run is bitwise the uninterrupted one, ``--load`` of a pretraining checkpoint takes its
weights only, and a checkpoint of another size is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

import run_finetuning
import run_pretraining
from execution.checkpoint.files import CheckpointError
from execution.checkpoint.load import SavedWeights, read_weights
from execution.checkpoint.logical import full_state
from execution.parallel.mesh import ParallelLayout
from execution.planning.run_shape import RunShape
from execution.training.finetuning import build_finetuning
from modelling.gpt import HEAD, init_full_part
from tasks.specs import parse_finetuning_config, task_spec, training_files

SMALL = (
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --max_positional_length 96 "
    "--global_batch_size 4 --micro_batch_size 2 --device cpu --log_every 100"
)


def _finetune(*flags: str) -> None:
    run_finetuning.main([*shlex.split(SMALL), *flags])


def _losses(folder: Path) -> list[float]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line]


@pytest.mark.slow
def test_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path):
    # 4 steps straight, saving after step 2; then a run resumed from that step 2. Dropout on:
    # its masks, like the data order and the learning rate, must go on where they stopped.
    common = ["--task", "squad", "--doc_stride", "16", "--steps", "4", "--dropout_prob", "0.1"]
    common += ["--warmup_tokens", "512"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    save = ["--save", str(whole / "ckpt"), "--checkpoint_steps", "2"]
    _finetune(*common, "--output_dir", str(whole), *save)
    load = ["--load", str(whole / "ckpt" / "step_2"), "--save", str(resumed / "ckpt")]
    _finetune(*common, "--output_dir", str(resumed), *load)
    assert _losses(resumed) == _losses(whole)[2:] and len(_losses(whole)) == 4
    assert (resumed / "eval.json").read_text() == (whole / "eval.json").read_text()
    assert (resumed / "predictions.json").read_text() == (whole / "predictions.json").read_text()
    _, saved = read_weights(resumed / "ckpt")
    _, reference = read_weights(whole / "ckpt")
    for name in reference:
        assert torch.equal(saved[name], reference[name]), name


@pytest.mark.slow
def test_load_takes_a_pretraining_checkpoints_weights_only(tmp_path):
    pretrained = tmp_path / "pretrained"
    pretraining = [*shlex.split(SMALL), "--sequence_length", "96"]
    out = ["--output_dir", str(tmp_path / "pretraining")]
    run_pretraining.main([*pretraining, "--steps", "2", "--save", str(pretrained), *out])
    flags = [*shlex.split(SMALL), "--task", "mnli", "--load", str(pretrained)]
    config, preset = parse_finetuning_config([*flags, "--output_dir", str(tmp_path / "ft")])
    layout = ParallelLayout.single(torch.device("cpu"))
    run = build_finetuning(config, preset, layout, launch=_single_launch())
    try:
        assert run.start_step == 0 and run.engine.optimizer_steps == 0
        loaded = full_state(run.engine)
        saved = SavedWeights(next(pretrained.glob("step_*")))
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
        fresh = init_full_part(run.engine.shapes, HEAD, 0, 42, config.model.init_std)
        assert torch.equal(loaded["head.score.weight"], fresh["score.weight"])
        assert all(m.abs().sum() == 0 for m in full_state(run.engine, "exp_avg").values())
    finally:
        run.close()
    other = [*flags, "--hidden_size", "64", "--output_dir", str(tmp_path / "other")]
    with pytest.raises(CheckpointError, match="pass --hidden_size 32") as err:
        run_finetuning.main(other)
    assert "\n" not in str(err.value)


LLAMA = (
    "--config llama_tiny --layers 1 --hidden_size 32 --heads 2 --kv_heads 1 "
    "--intermediate_size 64 --max_positional_length 96 --global_batch_size 4 "
    "--micro_batch_size 2 --device cpu --log_every 100"
)


def test_a_llama_model_fine_tunes_from_its_pretrained_final_norm(tmp_path):
    """Both tasks train a Llama model (RMSNorm, untied head) from a pretraining checkpoint to
    their evaluation; the task head's final norm is the pretrained one (the untied output
    projection is left behind)."""
    pretrained = tmp_path / "pretrained"
    out = ["--output_dir", str(tmp_path / "pretraining")]
    pretraining = [*shlex.split(LLAMA), "--sequence_length", "96", "--steps", "2"]
    run_pretraining.main([*pretraining, "--save", str(pretrained), *out])
    saved = SavedWeights(next(pretrained.glob("step_*")))
    assert not torch.equal(saved["head.ln_f.weight"], torch.ones(32))  # trained, not its init
    for task, own in (("squad", ["--doc_stride", "16"]), ("mnli", [])):
        folder = tmp_path / task
        flags = [*shlex.split(LLAMA), "--task", task, *own, "--load", str(pretrained)]
        built = ["--output_dir", str(tmp_path / f"built_{task}")]
        config, preset = parse_finetuning_config([*flags, *built])
        layout = ParallelLayout.single(torch.device("cpu"))
        run = build_finetuning(config, preset, layout, launch=_single_launch())
        try:
            loaded = full_state(run.engine)
        finally:
            run.close()
        assert "head.ln_f.bias" not in loaded and "head.output.weight" not in loaded
        for name, tensor in loaded.items():
            if name in saved:
                assert torch.equal(tensor, saved[name]), name
        assert torch.equal(loaded["head.ln_f.weight"], saved["head.ln_f.weight"])
        run_finetuning.main([*flags, "--steps", "3", "--output_dir", str(folder)])
        assert len(_losses(folder)) == 3 and (folder / "eval.json").is_file()


def _single_launch():
    from execution.parallel.launch import read_launch_environment

    return read_launch_environment({})


@pytest.mark.parametrize("with_projection", [True, False])
def test_hf_model_gives_the_transformer_and_a_task_models_projection(with_projection, tmp_path):
    """A GPT2ForQuestionAnswering folder gives every weight; a GPT2LMHeadModel folder all but
    the projection, which keeps its initialisation."""
    import transformers

    from execution.checkpoint.load import load_hf_weights
    from execution.planning.planner import planned_engine
    from modelling.hf_interchange import hf_name

    flags = [*shlex.split(SMALL), "--task", "squad", "--vocab_size", "300", "--layers", "2"]
    config, _ = parse_finetuning_config(flags)
    m = config.model
    hf_config = transformers.GPT2Config(
        vocab_size=m.vocab_size,
        n_positions=m.max_positional_length,
        n_embd=m.hidden_size,
        n_layer=m.layers,
        n_head=m.heads,
        bos_token_id=None,
        eos_token_id=None,
    )
    kind = (
        transformers.GPT2ForQuestionAnswering if with_projection else transformers.GPT2LMHeadModel
    )
    torch.manual_seed(0)
    kind(hf_config).save_pretrained(tmp_path)
    hf_state = kind.from_pretrained(tmp_path).state_dict()
    engine = planned_engine(RunShape.of(config), ParallelLayout.single(torch.device("cpu")))
    fresh = full_state(engine)
    load_hf_weights(tmp_path, engine)
    for name, tensor in full_state(engine).items():
        hf, transposed = hf_name(name)
        if hf in hf_state:
            expected = hf_state[hf].t() if transposed else hf_state[hf]
        else:
            assert not with_projection and name.startswith("head.qa"), name
            expected = fresh[name]
        assert torch.equal(tensor, expected), name


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("task", ["squad", "mnli"])
def test_a_fine_tuned_model_exports_as_huggingfaces_task_model(task, family, tmp_path):
    """convert_checkpoint.py's export of a fine-tuned model loads as HF's task model of its
    family, every weight found, whose logits on the task's rows are the engine's."""
    import transformers

    from config.loading import config_to_dict
    from data.tokenizer import TokenizerSpec, load_tokenizer
    from execution.planning.planner import planned_engine
    from modelling.hf_interchange import export_hf

    small = {"gpt2": SMALL, "llama": LLAMA}[family]
    config, _ = parse_finetuning_config([*shlex.split(small), "--task", task])
    engine = planned_engine(RunShape.of(config), ParallelLayout.single(torch.device("cpu")))
    export_hf(config_to_dict(config)["model"], full_state(engine), tmp_path)
    kinds = {
        ("gpt2", "squad"): transformers.GPT2ForQuestionAnswering,
        ("gpt2", "mnli"): transformers.GPT2ForSequenceClassification,
        ("llama", "squad"): transformers.LlamaForQuestionAnswering,
        ("llama", "mnli"): transformers.LlamaForSequenceClassification,
    }
    hf, info = kinds[family, task].from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    tokenizer = load_tokenizer(TokenizerSpec())[0]
    path = training_files(config)[0]
    options = dataclasses.replace(config.finetuning, doc_stride=16)
    rows = task_spec(task).read(path, tokenizer, config.model.sequence_length, options).rows[:4]
    ours = torch.cat(engine.predict(list(rows.view(2, 2, -1))))
    with torch.no_grad():
        out = hf(input_ids=rows[:, :-2])
    theirs = torch.stack([out.start_logits, out.end_logits], -1) if task == "squad" else out.logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("with_projection", [True, False])
def test_hf_model_gives_a_llama_task_model_its_weights(with_projection, tmp_path):
    """A LlamaForQuestionAnswering folder (base model under ``transformer``) gives every
    weight; a LlamaForCausalLM folder all but the projection, which keeps its initialisation."""
    from config.loading import config_to_dict, parse_config
    from execution.checkpoint.load import load_hf_weights
    from execution.planning.planner import planned_engine
    from modelling.hf_interchange import export_hf

    cpu = ParallelLayout.single(torch.device("cpu"))
    config, _ = parse_finetuning_config([*shlex.split(LLAMA), "--task", "squad"])
    other_seed = [*shlex.split(LLAMA), "--seed", "7"]  # other numbers than the run's own
    if with_projection:
        source_config, _ = parse_finetuning_config([*other_seed, "--task", "squad"])
    else:
        source_config, _ = parse_config([*other_seed, "--sequence_length", "96"])
    source = full_state(planned_engine(RunShape.of(source_config), cpu))
    export_hf(config_to_dict(source_config)["model"], source, tmp_path)
    engine = planned_engine(RunShape.of(config), cpu)
    fresh = full_state(engine)
    load_hf_weights(tmp_path, engine)
    for name, tensor in full_state(engine).items():
        assert name in source or (not with_projection and name.startswith("head.qa")), name
        assert torch.equal(tensor, source.get(name, fresh[name])), name
