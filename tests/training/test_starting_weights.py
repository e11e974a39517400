"""``--load`` and ``--hf_model`` that do not fit the run are refused before it reads its data,
plans or builds its engine, in one line that says what differs and what to pass: another
model's sizes, a model flag that reads the same tensors as another model (every model flag is
classified in config/model_math.py, and each one that the weights fix is tried here, changed),
a fine-tuning checkpoint given to pretraining, a resumed run's data position in other batches,
a fine-tuning run resumed with other windows (``--doc_stride``). The flags that are free stay
free.

The checkpoints are written in this process by the engine's own Checkpointer, and every
command runs through the real entry point (forked: tests/entry_points.py), with the engine's
construction made to fail, so that a check that came after it would show as a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from config.loading import ConfigError, parse_config
from config.model_math import MODEL_FIELDS
from config.schema_model import LLAMA3_ROPE_FLAGS, ModelConfig
from data.loader import training_loader
from execution.checkpoint.files import MANIFEST_FILE, TRAINER_FILE, file_crc, resolve
from execution.checkpoint.save import Checkpointer
from execution.engine.engine import PhasedEngine
from execution.parallel.mesh import ParallelLayout
from execution.training.starting_weights import check_starting_weights
from tasks.specs import parse_finetuning_config
from tests.checkpoints import export_hf
from tests.distributed import planned_engine
from tests.entry_points import ROOT, assert_refused, run_script

SMALL = shlex.split(
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --vocab_size 300 "
    "--max_positional_length 96 --sequence_length 96 --global_batch_size 4 --micro_batch_size 2 "
    "--device cpu"
)
# The Llama variants at the same sizes (2 KV heads: as many as the heads).
# Llama 3.1's scaled frequencies, so that their settings are among the flags tried.
LLAMA = ["--config", "llama_tiny", *SMALL[2:], "--intermediate_size", "80", "--rope_type", "llama3"]
# The saved models whose every model flag is tried, changed.
MODELS = {"pretraining": SMALL, "llama": LLAMA}


def _saved(config, folder: Path, loader_state: dict | None = None) -> Path:
    engine = planned_engine(config, ParallelLayout.single(torch.device("cpu")))
    checkpointer = Checkpointer(folder, engine, config, log=lambda _: None)
    checkpointer.save(1, loader_state)
    checkpointer.close()
    return folder


def _loader_state(flags: list[str]) -> dict:
    """What the pretraining loader of ``flags`` saves, after one step. (The shipped sample's
    tokens need GPT-2's vocabulary; the state does not record it.)"""
    config, _ = parse_config([*flags, "--vocab_size", "50257"])
    loader = training_loader(config, 0, 1)
    loader.next_batch()
    return loader.state_dict()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A pretraining checkpoint of each of :data:`MODELS` and a SQuAD fine-tuning one
    (``--doc_stride 16``)."""
    folder = tmp_path_factory.mktemp("starting_weights")
    saved = {
        name: _saved(parse_config(flags)[0], folder / name, _loader_state(flags))
        for name, flags in MODELS.items()
    }
    squad, _ = parse_finetuning_config([*SMALL, "--task", "squad", "--doc_stride", "16"])
    return {**saved, "squad": _saved(squad, folder / "squad")}


@pytest.fixture(scope="module")
def hf_folders(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Each of :data:`MODELS` exported: a GPT-2 folder and a Llama one."""
    folder = tmp_path_factory.mktemp("hf")
    for name in MODELS:
        export_hf(checkpoints[name], folder / name)
    return {name: folder / name for name in MODELS}


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the starting weights were checked")

    monkeypatch.setattr(PhasedEngine, "__init__", refuse)


def _refused(program: str, *flags: str, tmp_path: Path) -> str:
    result = run_script(program, *flags, "--output_dir", str(tmp_path / "out"))
    assert_refused(result, program)
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    return result.stderr


def test_a_fine_tuning_checkpoint_given_to_pretraining_says_so(checkpoints, no_engine, tmp_path):
    load = str(checkpoints["squad"])
    stderr = _refused("run_pretraining.py", *SMALL, "--load", load, tmp_path=tmp_path)
    assert f"--load {load} is a checkpoint of a fine-tuning run (--task squad)" in stderr
    assert f"run_finetuning.py --task squad --load {load}" in stderr
    assert "--layers" not in stderr


@pytest.mark.parametrize(
    ("program", "start", "flag", "ours", "theirs"),
    [
        ("run_pretraining.py", "pretraining", "--hidden_size", "64", "32"),
        ("run_finetuning.py", "pretraining", "--layers", "2", "1"),  # its weights only
        ("run_finetuning.py", "squad", "--max_positional_length", "128", "96"),  # resumed
    ],
)
def test_another_models_checkpoint_names_the_flag(
    checkpoints, no_engine, tmp_path, program, start, flag, ours, theirs
):
    load = str(checkpoints[start])
    task = ["--task", "squad"] if program == "run_finetuning.py" else []
    stderr = _refused(program, *SMALL, *task, "--load", load, flag, ours, tmp_path=tmp_path)
    assert f"was saved by a model of {flag} {theirs}, this run has {flag} {ours}" in stderr
    assert f"pass {flag} {theirs}" in stderr


def test_a_fine_tuning_run_resumed_with_another_doc_stride_names_it(
    checkpoints, no_engine, tmp_path
):
    load = str(checkpoints["squad"])
    flags = [*SMALL, "--task", "squad", "--load", load]  # no --doc_stride: 96 // 3
    stderr = _refused("run_finetuning.py", *flags, tmp_path=tmp_path)
    assert "rows were cut with --doc_stride 16; this run has --doc_stride 32" in stderr
    assert "pass --doc_stride 16" in stderr and "digest" not in stderr


def test_an_hf_model_of_other_sizes_names_the_flag_before_the_engine(no_engine, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    sizes = {"n_layer": 3, "n_embd": 32, "n_head": 2, "vocab_size": 300, "n_positions": 96}
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", **sizes}))
    save_file({"wte.weight": torch.zeros(300, 32)}, folder / "model.safetensors")
    stderr = _refused("run_pretraining.py", *SMALL, "--hf_model", str(folder), tmp_path=tmp_path)
    assert "has n_layer 3 but this run has --layers 1; pass --layers 3" in stderr


# A value of each model flag other than the saved model's: the first of its candidates that
# differs. The sweeps below try every flag config/model_math.py classifies.
CHANGED = {
    "layers": ("2",),
    "hidden_size": ("64",),
    "heads": ("4",),
    "sequence_length": ("48",),
    "vocab_size": ("320",),
    "max_positional_length": ("128",),
    "dropout_prob": ("0.2",),
    "dropout_parity": ("true",),
    "layer_norm_eps": ("1e-6",),
    "init_std": ("0.01",),
    "kv_heads": ("1",),
    "position_embedding": ("rotary", "learned"),
    "rope_theta": ("500000",),
    "rope_type": ("default", "llama3"),
    "rope_factor": ("4",),
    "rope_low_freq_factor": ("2",),
    "rope_high_freq_factor": ("8",),
    "rope_original_max_positions": ("4096",),
    "head_dim": ("8",),
    "normalization": ("rms_norm", "layer_norm"),
    "mlp_activation": ("swiglu", "gelu"),
    "intermediate_size": ("96",),
    "linear_bias": ("false", "true"),
    "tied_head": ("false", "true"),
}


def _flag(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _changed(model: str, name: str) -> tuple[list[str], str, str]:
    """:data:`MODELS`' flags with ``--name`` changed, and its value in the saved model and in
    the changed one, as the math sees them (kv_heads 0: as many as heads)."""
    saved = _saved_model(model)
    value = next(v for v in CHANGED[name] if v != _flag(saved[name]))
    flags = [*MODELS[model], f"--{name}", value]
    ours = dataclasses.asdict(parse_config(flags)[0].model)
    seen = MODEL_FIELDS[name].value or (lambda m: m[name])
    return flags, _flag(seen(saved)), _flag(seen(ours))


def _fixed(model: str, name: str) -> bool:
    """Whether the saved model's weights fix ``name`` (the table's word, read here)."""
    rule = MODEL_FIELDS[name]
    return rule.fixed and (rule.applies is None or rule.applies(_saved_model(model)))


@functools.cache
def _saved_model(model: str) -> dict:
    """The model section :data:`MODELS` ``model`` saved its checkpoint with."""
    return dataclasses.asdict(parse_config(MODELS[model])[0].model)


def _settable(model: str, name: str) -> bool:
    """Whether the config takes ``name`` changed on ``model`` at all (without --load)."""
    try:
        _changed(model, name)
    except ConfigError:
        return False
    return True


ALL_CASES = [(model, name) for model in MODELS for name in MODEL_FIELDS]
# A flag only another architecture reads is refused by the config itself, checkpoint or not.
REFUSED_BY_THE_CONFIG = [case for case in ALL_CASES if not _settable(*case)]
CASES = [case for case in ALL_CASES if case not in REFUSED_BY_THE_CONFIG]
FIXED = [case for case in CASES if _fixed(*case)]
FREE = [case for case in CASES if not _fixed(*case)]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_every_model_field_is_classified_once_and_tried():
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(MODEL_FIELDS) == sorted(fields), "classify the new field in config/model_math.py"
    assert sorted(CHANGED) == sorted(fields), "give the sweep another value of the new field"
    # what no shape shows, and the reproduction, is among those refused
    assert {("pretraining", "heads"), ("llama", "rope_theta")} <= set(FIXED)
    assert {("pretraining", "rope_theta"), ("llama", "max_positional_length")} <= set(FREE)
    # learned positions take no rotary settings, and Llama 3.1's rope needs rotary positions
    rotary_only = [("pretraining", name) for name in ("rope_type", *LLAMA3_ROPE_FLAGS)]
    assert sorted(REFUSED_BY_THE_CONFIG) == sorted([*rotary_only, ("llama", "position_embedding")])


def test_docs_list_each_model_flag_as_the_table_classifies_it():
    verdicts = {}
    for line in (ROOT / "docs" / "checkpoints.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| `--") and len(cells) == 5:
            verdicts |= dict.fromkeys(re.findall(r"`--(\w+)`", cells[1]), cells[2].strip())
    assert sorted(verdicts) == sorted(MODEL_FIELDS)
    for name, rule in MODEL_FIELDS.items():
        word = "must match" if rule.fixed else "free"
        conditional = rule.fixed and rule.applies is not None
        assert verdicts[name].startswith(word + (" with" if conditional else "")), name


@pytest.mark.parametrize(("model", "name"), FIXED)
def test_a_model_flag_the_weights_fix_changed_on_load_is_refused_with_both_values(
    checkpoints, no_engine, tmp_path, model, name
):
    flags, theirs, ours = _changed(model, name)
    load, before = checkpoints[model], _files(checkpoints[model])
    save = ["--save", str(tmp_path / "save")]
    stderr = _refused("run_pretraining.py", *flags, "--load", str(load), *save, tmp_path=tmp_path)
    assert f"--load {load} was saved by a model of --{name} {theirs}, this run has " in stderr
    assert f"this run has --{name} {ours}: pass --{name} {theirs} (" in stderr
    assert _files(load) == before and not (tmp_path / "save").exists()


@pytest.mark.parametrize(("model", "name"), FREE)
def test_a_free_model_flag_changed_on_load_passes(checkpoints, model, name):
    flags, theirs, ours = _changed(model, name)
    assert theirs != ours
    config, _ = parse_config([*flags, "--load", str(checkpoints[model])])
    if name == "sequence_length":  # the weights take it; a resumed data position does not
        config.checkpoint.eval_only = True
    check_starting_weights(config)


@pytest.mark.parametrize(
    ("name", "ours"), [("sequence_length", "48"), ("global_batch_size", "8"), ("seed", "7")]
)
def test_a_resumed_data_position_in_other_batches_is_refused_but_not_an_evaluation(
    checkpoints, no_engine, tmp_path, name, ours
):
    load = str(checkpoints["llama"])  # rotary: its weights take any sequence length
    flags = [*LLAMA, "--load", load, f"--{name}", ours]
    stderr = _refused("run_pretraining.py", *flags, tmp_path=tmp_path)
    theirs = _loader_state(LLAMA)[name]
    assert f"the batches of --{name} {theirs}; this run has --{name} {ours}" in stderr
    assert f"pass --{name} {theirs}" in stderr
    check_starting_weights(parse_config([*flags, "--eval_only"])[0])


@pytest.mark.parametrize(
    ("load", "name"), [("pretraining", "heads"), ("llama", "rope_theta"), ("squad", "tied_head")]
)
def test_fine_tuning_refuses_a_model_flag_the_weights_fix(
    checkpoints, no_engine, tmp_path, load, name
):
    """From a pretraining checkpoint's weights, and resuming a fine-tuning run."""
    base = "llama" if load == "llama" else "pretraining"
    flags, theirs, ours = _changed(base, name)
    task = ["--task", "squad", "--doc_stride", "16"]
    folder = str(checkpoints[load])
    stderr = _refused("run_finetuning.py", *flags, *task, "--load", folder, tmp_path=tmp_path)
    assert f"was saved by a model of --{name} {theirs}, this run has --{name} {ours}" in stderr


def test_fine_tuning_from_pretrained_weights_takes_another_sequence_length(checkpoints):
    flags = [*LLAMA, "--task", "mnli", "--sequence_length", "48"]
    config, _ = parse_finetuning_config([*flags, "--load", str(checkpoints["llama"])])
    check_starting_weights(config)


@pytest.mark.parametrize(("model", "name"), CASES)
def test_a_flag_against_an_hf_model_is_refused_with_both_values_where_the_weights_fix_it(
    hf_folders, model, name
):
    """The HuggingFace folder's config.json decides the model as a checkpoint's does: GPT-2's
    and Llama's keys are compared with the flags the same table fixes."""
    flags, theirs, ours = _changed(model, name)
    config, _ = parse_config([*flags, "--hf_model", str(hf_folders[model])])
    if not _fixed(model, name):
        check_starting_weights(config)
        return
    with pytest.raises(ConfigError) as refused:
        check_starting_weights(config)
    message = str(refused.value).lower()  # Llama's check writes booleans as Python does
    assert f"--{name} {ours}" in message and f"--{name} {theirs}" in message
    assert "\n" not in message


def test_an_hf_model_contradicted_by_a_flag_stops_the_entry_point(hf_folders, no_engine, tmp_path):
    flags, _, _ = _changed("llama", "rope_theta")
    folder = str(hf_folders["llama"])
    stderr = _refused("run_pretraining.py", *flags, "--hf_model", folder, tmp_path=tmp_path)
    assert "has rope_theta 10000.0 but this run has --rope_theta 500000.0" in stderr


def _with_model(checkpoint: Path, copy: Path, edit) -> Path:
    """A copy of ``checkpoint`` whose saved model section ``edit`` changed in place, as another
    version of the program would have saved it: its manifest rewritten to match."""
    shutil.copytree(checkpoint, copy)
    folder = resolve(copy)
    trainer = json.loads((folder / TRAINER_FILE).read_text())
    edit(trainer["config"]["model"])
    (folder / TRAINER_FILE).write_text(json.dumps(trainer))
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest[TRAINER_FILE] = [
        (folder / TRAINER_FILE).stat().st_size,
        file_crc(folder / TRAINER_FILE),
    ]
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return folder


def test_a_checkpoint_saved_before_a_model_flag_existed_has_its_default(checkpoints, tmp_path):
    """Before grouped-query attention, every head had its own keys and values."""
    folder = _with_model(checkpoints["pretraining"], tmp_path / "ckpt", lambda m: m.pop("kv_heads"))
    check_starting_weights(parse_config([*SMALL, "--kv_heads", "2", "--load", str(folder)])[0])
    config, _ = parse_config([*SMALL, "--kv_heads", "1", "--load", str(folder)])
    with pytest.raises(ConfigError, match="of --kv_heads 2, this run has --kv_heads 1: pass"):
        check_starting_weights(config)


@pytest.mark.parametrize(
    ("program", "flags"),
    [
        ("run_generation.py", ["--prompt", "Hello"]),
        ("convert_checkpoint.py", ["--hf_output", "hf"]),
        ("run_pretraining.py", SMALL),
    ],
)
def test_a_model_flag_this_program_does_not_have_is_refused_in_one_line(
    checkpoints, tmp_path, program, flags
):
    def newer(model: dict) -> None:  # a field of Llama 3.1's rope scaling, say
        model["rope_scaling"] = 8.0

    folder = _with_model(checkpoints["pretraining"], tmp_path / "ckpt", newer)
    result = run_script(ROOT / program, *flags, "--load", str(folder), cwd=tmp_path)
    message = "was saved by a model with --rope_scaling 8.0, a model flag this program does not"
    assert_refused(result, program, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.slow
def test_a_resume_with_the_free_flags_changed_computes_the_saved_model(tmp_path):
    """Step 2's loss is computed from the weights after step 1, before its own update: resumed
    from step 1 with another learning rate, step count, initialisation scale, placement and
    (with learned positions) rope_theta, it is the uninterrupted run's."""
    flags = shlex.split(
        "--config tiny --layers 1 --hidden_size 32 --heads 2 --sequence_length 32 "
        "--global_batch_size 4 --micro_batch_size 2 --dropout_prob 0.1 --device cpu"
    )
    save = ["--save", str(tmp_path / "ckpt"), "--checkpoint_steps", "1"]
    first = run_script(
        "run_pretraining.py", *flags, "--steps", "2", *save, "--output_dir", str(tmp_path / "first")
    )
    assert first.returncode == 0, first.stderr
    free = shlex.split(
        "--steps 3 --learning_rate 1e-4 --init_std 0.05 --rope_theta 500 --placement remote"
    )
    load = ["--load", str(tmp_path / "ckpt" / "step_1"), "--output_dir", str(tmp_path / "resumed")]
    resumed = run_script("run_pretraining.py", *flags, *free, *load)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 1" in resumed.stdout

    def losses(folder: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
        return {row["step"]: row["loss"] for row in rows}

    expected, got = losses(tmp_path / "first"), losses(tmp_path / "resumed")
    assert sorted(got) == [2, 3]
    assert got[2] == expected[2]
