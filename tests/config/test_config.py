"""Presets load and validate; flags override them; bad input gives one clear ConfigError."""

from __future__ import annotations

import shlex

import pytest
import torch

from config.loading import ConfigError, config_to_dict, load_presets, parse_config
from execution.parallel.launch import check_world_size, read_launch_environment, select_device
from modelling.gpt import GPTShapes
from modelling.sparsity import active_counts
from tests.entry_points import assert_refused, run_script

PRESETS = sorted(load_presets())

# GPT-3 paper, table 2.1: layers, hidden, heads, head dim, batch (tokens), peak lr.
PAPER = {
    "gpt3_125M": (12, 768, 12, 64, 0.5e6, 6.0e-4),
    "gpt3_350M": (24, 1024, 16, 64, 0.5e6, 3.0e-4),
    "gpt3_760M": (24, 1536, 16, 96, 0.5e6, 2.5e-4),
    # The paper prints 24 heads, but 24 x 128 != 2048: the preset keeps hidden and head width.
    "gpt3_1.3B": (24, 2048, 16, 128, 1e6, 2.0e-4),
    "gpt3_2.7B": (32, 2560, 32, 80, 1e6, 1.6e-4),
    "gpt3_6.7B": (32, 4096, 32, 128, 2e6, 1.2e-4),
    "gpt3_13B": (40, 5120, 40, 128, 2e6, 1.0e-4),
    "gpt3_175B": (96, 12288, 96, 128, 3.2e6, 0.6e-4),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_and_validates(preset):
    config, name = parse_config(["--config", preset])
    assert name == preset
    assert config.gradient_accumulation >= 1
    assert config_to_dict(config)["model"]["layers"] == config.model.layers


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_paper_sizes_and_recipe(preset):
    layers, hidden, heads, head_dim, batch_tokens, lr = PAPER[preset]
    config, _ = parse_config(["--config", preset])
    m, o = config.model, config.training.optimizer
    assert (m.layers, m.hidden_size, m.heads) == (layers, hidden, heads)
    assert m.hidden_size // m.heads == head_dim
    assert (m.sequence_length, m.vocab_size) == (2048, 50257)
    assert config.tokens_per_step == pytest.approx(batch_tokens, rel=0.05)
    assert o.learning_rate == pytest.approx(lr)
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.gradient_clipping) == (
        0.9,
        0.95,
        1e-8,
        0.1,
        1.0,
    )
    assert (o.warmup_tokens, o.min_learning_rate_ratio, o.lr_schedule) == (375e6, 0.1, "cosine")
    # 300B training tokens, as in the paper
    assert config.training.steps * config.tokens_per_step == pytest.approx(300e9, rel=1e-3)


def test_reference_layouts():
    pod256, _ = parse_config(["--config", "gpt3_175B_pod256"])
    ex = pod256.execution
    assert (ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2) == (4, 8, 8)
    assert (ex.micro_batch_size, pod256.training.global_batch_size) == (1, 128)
    assert pod256.gradient_accumulation == 32 and pod256.world_size == 256
    assert pod256.model.layers == 96  # inherited from gpt3_175B
    pod64, _ = parse_config(["--config", "gpt3_2.7B_pod64"])
    ex = pod64.execution
    assert (ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2) == (4, 4, 4)
    assert pod64.training.global_batch_size == 512 and pod64.model.hidden_size == 2560
    assert ex.micro_batch_size == 4  # not the reference's 1: the host would set its pace
    for layout in (pod256, pod64):  # the paper's 300B tokens, so the schedule decays fully
        assert layout.training.steps * layout.tokens_per_step == pytest.approx(300e9, rel=1e-3)
        assert layout.training.optimizer.decay_tokens == 260e9


@pytest.mark.parametrize(
    ("preset", "paper"), [("gpt3_1.3B_32k", "gpt3_1.3B"), ("gpt3_6.7B_32k", "gpt3_6.7B")]
)
def test_long_context_presets(preset, paper):
    """The paper model with a 32,768-token context and learned positions of that length, and
    the paper's tokens per step (32 and 64 sequences); every context split of a tp1 rank's
    heads validates."""
    config, _ = parse_config(["--config", preset])
    base, _ = parse_config(["--config", paper])
    m = config.model
    assert (m.layers, m.hidden_size, m.heads) == (
        base.model.layers,
        base.model.hidden_size,
        base.model.heads,
    )
    assert (m.sequence_length, m.max_positional_length) == (32768, 32768)
    assert config.tokens_per_step == base.tokens_per_step
    assert config.training.global_batch_size == {"gpt3_1.3B": 32, "gpt3_6.7B": 64}[paper]
    assert config.training.steps == base.training.steps  # the same 300B tokens
    for cp in (2, 4, 8, 16):
        parse_config(["--config", preset, "--context_parallel", str(cp)])


def test_flags_override_the_preset():
    flags = shlex.split(
        "--config tiny --layers 3 --learning_rate 1e-4 --wandb --input_files a/*.tfrecord "
        "b.tfrecord --skip_corrupt_records false --precision bfloat16"
    )
    config, _ = parse_config(flags)
    assert config.model.layers == 3
    assert config.training.optimizer.learning_rate == 1e-4
    assert config.logging.wandb is True
    assert config.data.input_files == ["a/*.tfrecord", "b.tfrecord"]
    assert config.data.skip_corrupt_records is False
    assert config.training.precision == "bfloat16"
    assert parse_config([])[1] == "tiny"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--layers 0", "--layers must be at least 1, got 0"),
        ("--nonsense 1", "unrecognized arguments: --nonsense 1"),
        ("--lay 3", "unrecognized arguments: --lay"),
        ("--layers two", "--layers must be an integer, got 'two'"),
        ("--config gpt4", "unknown preset 'gpt4'"),
        ("--heads 5", "--hidden_size 128 is not divisible by --heads 5"),
        (
            "--global_batch_size 10",
            "--global_batch_size 10 is not divisible by --micro_batch_size 4",
        ),
        ("--sequence_length 256", "exceeds --max_positional_length 128"),
        ("--tensor_parallel_1 3", "--heads 4 is not divisible by --tensor_parallel_1 3"),
        ("--tensor_parallel_2 3", "--hidden_size 128 is not divisible by --tensor_parallel_2 3"),
        ("--context_parallel 3", "--sequence_length 128 is not divisible by --context_parallel 3"),
        ("--context_parallel 0", "--context_parallel must be at least 1, got 0"),
        (
            "--context_parallel 4 --tensor_parallel_1 2",
            "2 heads per tensor_parallel_1 rank is not divisible by --context_parallel 4",
        ),
        ("--pipeline_parallel 0", "--pipeline_parallel must be at least 1, got 0"),
        ("--pipeline_parallel 3", "--pipeline_parallel 3 exceeds the 2 decoder layers"),
        (
            "--pipeline_parallel 2 --pipeline_layers 1,2",
            "--pipeline_layers 1,2 sums to 3 layers, but --layers is 2",
        ),
        (
            "--pipeline_parallel 2 --pipeline_layers 2",
            "--pipeline_layers 2 gives 1 stage(s), but --pipeline_parallel is 2",
        ),
        ("--pipeline_parallel 2 --pipeline_layers 1,x", "must be comma-separated layer counts"),
        ("--precision fp8", "invalid choice: 'fp8'"),
        ("--dropout_prob 1.5", "--dropout_prob must be in [0, 1)"),
        ("--learning_rate 0", "--learning_rate must be a finite number > 0"),
        ("--loss_scaling 1024", "only applies to --precision float16"),
        (
            "--validation_files v.tfrecord --validation_fraction 0.1 --eval_every 5",
            "either --validation_files or --validation_fraction",
        ),
        ("--validation_files v.tfrecord", "only used with --eval_every"),
        ("--layer_norm_eps nan", "--layer_norm_eps must be a finite number > 0"),
        ("--init_std inf", "--init_std must be a finite number > 0"),
        ("--collective_timeout 0", "--collective_timeout is in seconds, more than 0 and at most"),
        ("--collective_timeout inf", "at most 2592000, got inf"),
        ("--seed 20000000000000", "--seed must be in [0, 2^32)"),
        ("--vocab_size 1e30", "--vocab_size 1e30 does not fit a 64-bit integer"),
        ("--vocab_size 2147483648", "--vocab_size 2147483648 is too large (the limit is 2^31"),
    ],
)
def test_bad_flags_name_the_problem(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", "tiny", *shlex.split(flags)])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tiny:\n  model: {layerz: 2}\n", "unknown setting 'model.layerz'"),
        ("tiny:\n  modle: {layers: 2}\n", "unknown section 'modle'"),
        ("tiny:\n  model: {layers: two}\n", "model.layers must be an integer"),
        ("tiny:\n  training: {precision: fp8}\n", "training.precision must be one of float32"),
        (
            "tiny:\n  execution: {placement: host}\n",
            "placement must be one of auto, remote, resident",
        ),
        ("tiny:\n  model: [1, 2\n", "is not valid YAML"),
        ("tiny:\n  base: nowhere\n", "has base 'nowhere'"),
        ("tiny:\n  base: other\nother:\n  base: tiny\n", "inherits from itself"),
        ("- just a list\n", "must map preset names to settings"),
        # PyYAML alone keeps the second 'model:' and drops the first without a word.
        (
            "tiny:\n  model: {layers: 3}\n  model: {hidden_size: 64}\n",
            "key 'model' appears twice, at lines 2 and 3",
        ),
        ("tiny:\n  model: {layers: 2}\ntiny:\n  model: {layers: 3}\n", "key 'tiny' appears twice"),
        ("tiny:\n  model: 5\n", "'model' is a section and needs a mapping of its settings"),
    ],
)
def test_malformed_preset_files(tmp_path, text, message):
    path = tmp_path / "presets.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_config(["--config_file", str(path), "--config", "tiny"])
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # Searching every divisor of 10**12 never ended.
        (["--plan_for", str(10**12)], "--plan_for 1000000000000 is outside what any machine has"),
        (["--storage_gb_per_s", "1e-300"], "--storage_gb_per_s 1e-300 is outside"),
        (["--host_link_gb_per_s", "1e30"], "(0.001 to 100000)"),
        (["--device_memory_gb", "1e9"], "--device_memory_gb 1e+09 is outside"),
    ],
)
def test_sizes_and_rates_no_machine_has_are_one_line(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", "tiny", *flags])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_inheritance_merges_nested_sections(tmp_path):
    path = tmp_path / "presets.yml"
    big = "big:\n  model: {layers: 8, hidden_size: 256, heads: 8}\n"
    small = "small:\n  base: big\n  model: {layers: 2}\n"
    path.write_text(big + small)
    config, _ = parse_config(["--config_file", str(path), "--config", "small"])
    assert (config.model.layers, config.model.hidden_size, config.model.heads) == (2, 256, 8)


def test_world_size_must_match_the_layout():
    config, _ = parse_config(["--config", "gpt3_175B_pod256"])
    check_world_size(config, 256)
    with pytest.raises(ConfigError, match=r"= 256 processes, but the job has 8"):
        check_world_size(config, 8)
    config, _ = parse_config(["--config", "tiny", "--context_parallel", "2"])
    check_world_size(config, 2)
    with pytest.raises(
        ConfigError, match=r"--context_parallel 2 x .* = 2 processes, but the job has 4"
    ):
        check_world_size(config, 4)
    config, _ = parse_config(["--config", "tiny", "--pipeline_parallel", "2"])
    check_world_size(config, 2)
    with pytest.raises(
        ConfigError, match=r"--pipeline_parallel 2 x .* = 2 processes, but the job has 8"
    ):
        check_world_size(config, 8)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1, 0, 1, "single process")),
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
            (3, 8, 1, 4, "torchrun"),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "16",
                "OMPI_COMM_WORLD_LOCAL_RANK": "5",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
            },
            (5, 16, 5, 8, "mpiexec"),
        ),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, (2, 4, 2, 4, "mpiexec")),
        (
            {
                "SLURM_PROCID": "7",
                "SLURM_NTASKS": "64",
                "SLURM_LOCALID": "3",
                "SLURM_NTASKS_PER_NODE": "8",
            },
            (7, 64, 3, 8, "slurm"),
        ),
    ],
)
def test_launcher_environments(env, expected):
    info = read_launch_environment(env)
    got = (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher)
    assert got == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answers")
def test_device_selection_without_enough_gpus():
    assert select_device("auto", 0, 1) == torch.device("cpu")
    assert select_device("cpu", 3, 8) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"--device cuda needs a GPU for each of the 8"):
        select_device("cuda", 0, 8)


def test_recompute_other_than_full_with_context_parallel_is_one_line():
    with pytest.raises(ConfigError, match="--recompute none with --context_parallel 2"):
        parse_config(["--config", "tiny", "--context_parallel", "2", "--recompute", "none"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # A dense run has no connectivity to update: the schedule would be ignored.
        ("--rigl_every 20", "--rigl_every only applies to sparse training, and --sparsity is 0"),
        (
            "--sparsity 0 --sparsity_distribution uniform --rigl_end_fraction 0.5",
            "--sparsity_distribution and --rigl_end_fraction only apply to sparse training",
        ),
        # Every matrix of tiny's layers would keep round(density x size) = 0 weights.
        (
            "--sparsity 0.999999",
            "--sparsity 0.999999 leaves every sparse matrix without a single weight (erk "
            "densities at --hidden_size 128); the highest that keeps one in every matrix is "
            "0.9999796",
        ),
        ("--sparsity 0.99999 --sparsity_distribution uniform", "attn.out.weight without a single"),
    ],
)
def test_rigl_flags_a_run_would_ignore_or_that_empty_a_matrix_exit_2(flags, message):
    result = run_script("run_pretraining.py", "--config", "tiny", *shlex.split(flags))
    assert_refused(result, "run_pretraining.py", message)
    assert result.stdout == ""


@pytest.mark.parametrize("distribution", ["erk", "uniform"])
def test_the_highest_sparsity_named_keeps_a_weight_in_every_matrix(distribution):
    flags = ["--config", "tiny", "--sparsity_distribution", distribution, "--sparsity"]
    with pytest.raises(ConfigError) as err:
        parse_config([*flags, "0.9999999"])
    highest = str(err.value).split("the highest that keeps one in every matrix is ")[1]
    config, _ = parse_config([*flags, highest.split(":")[0]])
    shapes = GPTShapes.from_config(config.model)
    assert min(active_counts(shapes, config.rigl.sparsity, distribution).values()) == 1
