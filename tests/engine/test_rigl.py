"""RigL: the engine's masks and weights against a plain single-process RigL
(``tests.engine.rigl_reference``), at 1 process and on layouts, with the Llama variants' matrices,
plus the pieces underneath (ERK, the collective selection, the flags).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import matplotlib.image
import pytest
import torch
from safetensors.torch import load_file

import run_generation
from config.loading import ConfigError, parse_config
from execution.checkpoint.load import load_checkpoint
from execution.checkpoint.logical import full_state
from execution.checkpoint.save import Checkpointer
from execution.parallel.mesh import ParallelLayout
from execution.parallel.selection import select_largest, sort_keys
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape
from modelling.gpt import LAYERS, GPTShapes, part_inits
from modelling.hf_interchange import hf_name
from modelling.sparsity import (
    SPARSE_WEIGHTS,
    densities,
)
from tests.checkpoints import export_hf, save_checkpoint
from tests.distributed import (
    CPU,
    engine_batch,
    global_batches,
    layout_flags,
    learning_rates,
    run_ranks,
    small_config,
    train_steps,
    world_layout,
)
from tests.engine.rigl_reference import (
    RIGL,
    STEPS,
    assert_matches,
    engine_run,
    expected,
    reference_rigl_masks_at_start,
)
from tests.entry_points import run_script
from tests.reference import LLAMA_VARIANTS
from utils.plot import plot_losses

ROOT = Path(__file__).resolve().parents[2]
# ------------------------------------------------------------------ engine against reference


def test_single_process_engine_matches_plain_rigl():
    config = small_config(*RIGL)
    got = engine_run(config, ParallelLayout.single(CPU))
    want = expected()
    # The masks did move: each update replaced some of every matrix's connections.
    some = "layers.0.mlp.fc.weight"
    config_dense = small_config(*RIGL)
    first = reference_rigl_masks_at_start(config_dense)[some]
    assert not torch.equal(want["masks"][some], first), "no connectivity update happened"
    assert_matches(got, want, "1 process")


LLAMA = (*LLAMA_VARIANTS, "--kv_heads", "2", "--intermediate_size", "44")


def test_llama_s_three_mlp_matrices_train_sparse_like_plain_rigl():
    """SwiGLU's gate and up (one matrix of ours) and down, and grouped-query attention's
    narrower qkv: ERK gives gate and up the density of down, their shape's transpose."""
    config = small_config(*RIGL, *LLAMA)
    density = densities(GPTShapes.from_config(config.model), 0.8, "erk")
    assert density["mlp.gate_up.weight"] == pytest.approx(density["mlp.down.weight"], rel=1e-12)
    got = engine_run(config, ParallelLayout.single(CPU))
    want = expected(*LLAMA)
    some = "layers.0.mlp.gate_up.weight"
    first = reference_rigl_masks_at_start(config)[some]
    assert not torch.equal(want["masks"][some], first), "no connectivity update happened"
    assert_matches(got, want, "llama, 1 process")


def _layout_rank(config) -> dict:
    out = engine_run(config, world_layout(config))
    return out if world_layout(config).is_main else {}


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_tp2_tp2_matches_plain_rigl(tmp_path):
    config = small_config(*RIGL, *layout_flags(2, 2, 2))
    results = run_ranks(_layout_rank, 8, tmp_path, config, timeout=300)
    assert_matches(results[0], expected(), "dp 2 x tp1 2 x tp2 2")


def _pipeline_rank(config) -> dict:
    layout = world_layout(config)
    engine = planned_engine(RunShape.of(config), layout)
    train_steps(engine, global_batches(config, STEPS), layout.dp.rank)
    masks = engine.rigl.logical_masks()
    return masks if layout.tp1.rank == layout.tp2.rank == layout.dp.rank == 0 else {}


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_masks_equal_single_process(tmp_path):
    config = small_config(*RIGL, "--pipeline_parallel", "2")
    results = run_ranks(_pipeline_rank, 2, tmp_path, config, timeout=300)
    masks = {k: v for result in results for k, v in result.items()}
    want = expected()["masks"]
    assert masks.keys() == want.keys()
    for key, mask in want.items():
        assert torch.equal(masks[key], mask), f"pp 2: mask {key} differs"


# ------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("sparsity", [0.5, 0.9, 0.99])
def test_erk_keeps_one_minus_sparsity_and_favours_narrow_matrices(sparsity):
    config, _ = parse_config(["--config", "gpt3_125M"])
    shapes = GPTShapes.from_config(config.model)
    sizes = {n: math.prod(part_inits(shapes, LAYERS)[n].shape) for n in SPARSE_WEIGHTS}
    density = densities(shapes, sparsity, "erk")
    total = sum(density[n] * sizes[n] for n in SPARSE_WEIGHTS) / sum(sizes.values())
    assert total == pytest.approx(1 - sparsity, rel=1e-12)
    # (rows + cols) / (rows x cols): the square out projection is densest, fc and proj least.
    assert density["attn.out.weight"] > density["attn.qkv.weight"] > density["mlp.fc.weight"]
    assert density["mlp.fc.weight"] == pytest.approx(density["mlp.proj.weight"])
    assert densities(shapes, sparsity, "uniform") == dict.fromkeys(SPARSE_WEIGHTS, 1 - sparsity)


def test_erk_overflow_makes_a_matrix_dense_and_keeps_the_total():
    # At sparsity 0.1, ERK's share for the out projection would exceed 1: it is made dense and
    # the others share the rest (google-research/rigl's rule).
    config, _ = parse_config(["--config", "gpt3_125M"])
    shapes = GPTShapes.from_config(config.model)
    h = shapes.hidden
    density = densities(shapes, 0.1, "erk")
    assert density["attn.out.weight"] == 1.0
    assert all(0 < d < 1 for n, d in density.items() if n != "attn.out.weight")
    kept = (
        density["attn.qkv.weight"] * 3
        + 1
        + 4 * (density["mlp.fc.weight"] + density["mlp.proj.weight"])
    )
    assert kept * h * h == pytest.approx(0.9 * 12 * h * h)


def test_selection_equals_a_stable_sort_with_ties():
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(1, 80, (1,), generator=generator))
        scores = torch.randn(n, generator=generator)
        if trial % 2:
            scores = scores.round()  # many equal scores
        matrix = torch.randint(-1, 3, (n,), generator=generator)
        index = torch.zeros(n, dtype=torch.int64)
        for m in range(3):
            at = torch.nonzero(matrix == m).squeeze(1)
            index[at] = torch.randperm(len(at), generator=generator)
        counts = torch.randint(0, 30, (3,), generator=generator)
        chosen = select_largest(sort_keys(scores, index), matrix, counts, [])
        assert not chosen[matrix < 0].any()
        for m in range(3):
            at = torch.nonzero(matrix == m).squeeze(1)
            order = sorted(at.tolist(), key=lambda e: (-scores[e].item(), index[e].item()))
            assert set(at[chosen[at]].tolist()) == set(order[: counts[m]]), (trial, m)


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--sparsity", "1", "--sparsity"),
        ("--sparsity", "-0.1", "--sparsity"),
        ("--rigl_drop_fraction", "0", "--rigl_drop_fraction"),
        ("--rigl_drop_fraction", "1.5", "--rigl_drop_fraction"),
        ("--rigl_every", "0", "--rigl_every"),
        ("--rigl_end_fraction", "0", "--rigl_end_fraction"),
        ("--sparsity_distribution", "random", "--sparsity_distribution"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(flag, value, named):
    with pytest.raises(ConfigError) as error:
        parse_config([flag, value])
    message = str(error.value)
    assert named in message and "\n" not in message


# ------------------------------------------------------------------ checkpoints and export

SAVED_AT = 3  # after the first update, before the second


def _train_range(engine, batches, start: int, stop: int, dp_rank: int) -> None:
    rates = learning_rates(len(batches))
    for step in range(start, stop):
        tokens = engine_batch(engine, batches[step], dp_rank)
        assert not engine.train_step(tokens, step, rates[step]).skipped


def _saved_run(config, folder) -> dict:
    """One process: trains SAVED_AT steps, saves, trains on; its final state."""
    engine = planned_engine(RunShape.of(config), ParallelLayout.single(CPU))
    batches = global_batches(config, STEPS)
    _train_range(engine, batches, 0, SAVED_AT, 0)
    checkpointer = Checkpointer(folder, engine, config)
    checkpointer.save(SAVED_AT, None)
    checkpointer.close()
    _train_range(engine, batches, SAVED_AT, STEPS, 0)
    return {"weights": full_state(engine, "weights"), "masks": engine.rigl.logical_masks()}


def _resumed_rank(config, folder) -> dict:
    return _resumed(config, folder, world_layout(config))


def _resumed(config, folder, layout: ParallelLayout) -> dict:
    engine = planned_engine(RunShape.of(config), layout)
    trainer = load_checkpoint(folder, engine)
    _train_range(engine, global_batches(config, STEPS), trainer["step"], STEPS, layout.dp.rank)
    out = {"weights": full_state(engine, "weights"), "masks": engine.rigl.logical_masks()}
    return out if layout.is_main else {}


def test_resume_is_bitwise_on_the_same_layout(tmp_path):
    config = small_config(*RIGL)
    uninterrupted = _saved_run(config, tmp_path / "ckpt")
    resumed = _resumed(config, tmp_path / "ckpt", ParallelLayout.single(CPU))
    for key, mask in uninterrupted["masks"].items():
        assert torch.equal(resumed["masks"][key], mask), key
    for key, weight in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], weight), key


@pytest.mark.distributed
def test_resume_on_another_layout_within_tolerance(tmp_path):
    config = small_config(*RIGL)
    uninterrupted = _saved_run(config, tmp_path / "ckpt")
    other = small_config(*RIGL, *layout_flags(1, 2, 1), "--placement", "remote")
    (result,) = run_ranks(_resumed_rank, 2, tmp_path / "job", other, tmp_path / "ckpt")[:1]
    assert_matches(result, uninterrupted, "resumed on tp1 2")


def test_dense_checkpoint_loads_into_a_sparse_run_pruned(tmp_path):
    dense = small_config("--steps", "8")
    engine = planned_engine(RunShape.of(dense), ParallelLayout.single(CPU))
    _train_range(engine, global_batches(dense, STEPS), 0, 1, 0)
    checkpointer = Checkpointer(tmp_path / "dense", engine, dense)
    checkpointer.save(1, None)
    checkpointer.close()
    sparse = planned_engine(RunShape.of(small_config(*RIGL)), ParallelLayout.single(CPU))
    load_checkpoint(tmp_path / "dense", sparse)
    weights, masks = full_state(sparse, "weights"), sparse.rigl.logical_masks()
    for key, mask in masks.items():
        assert torch.all(weights[key][~mask] == 0) and torch.all(weights[key][mask] != 0), key


def test_hf_export_writes_the_zeros_and_generation_runs(tmp_path, capsys):
    config = small_config(*RIGL, "--vocab_size", "50257", "--layers", "1")
    engine = planned_engine(RunShape.of(config), ParallelLayout.single(CPU))
    # An update after step 4; its grown weights start at zero and step 5 moves them.
    _train_range(engine, global_batches(config, STEPS), 0, 5, 0)
    masks = engine.rigl.logical_masks()
    save_checkpoint(tmp_path / "ckpt", engine, config, 5)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    for key, mask in masks.items():
        hf_key, transposed = hf_name(key)
        tensor = exported[hf_key].t() if transposed else exported[hf_key]
        assert torch.equal(tensor != 0, mask), f"{hf_key}: zeros other than the mask's"
    flags = ["--prompt", "Hello", "--temperature", "0", "--max_new_tokens", "4", "--device", "cpu"]
    run_generation.main(["--load", str(tmp_path / "ckpt"), *flags])
    assert "[4 tokens in " in capsys.readouterr().out


# ------------------------------------------------------------------ the entry point


def _run(*flags: str) -> subprocess.CompletedProcess:
    return run_script("run_pretraining.py", *flags, timeout=600)


def test_a_bad_flag_exits_2_with_one_line():
    result = _run("--sparsity", "1.5")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--sparsity" in result.stderr


@pytest.mark.slow
def test_tiny_at_90_percent_keeps_its_density_at_every_logged_step(tmp_path):
    flags = ["--config", "tiny", "--steps", "12", "--sparsity", "0.9", "--rigl_every", "3"]
    result = _run(*flags, "--wandb", "--wandb_mode", "offline", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    for m in metrics:
        assert abs(m["rigl/density"] - 0.1) <= 0.005, m
        assert m["rigl/outside_mask_nonzero"] == 0, m
    updates = {m["step"]: m for m in metrics if "rigl/dropped" in m}
    assert sorted(updates) == [3, 6]  # every 3 steps, until 3/4 of the 12
    for m in updates.values():
        assert m["rigl/dropped"] == m["rigl/grown"] > 0 and m["rigl/grown_grad_mean"] > 0
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0


@pytest.mark.parametrize("placement", ["resident", "remote"])
def test_the_plan_counts_the_mask_bytes_the_store_allocates(placement):
    config = small_config(*RIGL, "--placement", placement)
    engine = planned_engine(RunShape.of(config), ParallelLayout.single(CPU))
    planned = engine.memory.state_bytes["masks"]
    sparse = sum(
        math.prod(i.shape)
        for n, i in part_inits(engine.shapes, LAYERS).items()
        if n in SPARSE_WEIGHTS
    )
    assert planned == engine.buffer_bytes()["masks"] == sparse * config.model.layers
    where = "device" if placement == "resident" else "host"
    assert engine.memory.bytes_on(where)["masks"] == planned
    dense = planned_engine(RunShape.of(small_config()), ParallelLayout.single(CPU))
    assert "masks" not in dense.memory.state_bytes and dense.rigl is None


def test_loss_plot_of_several_runs(tmp_path):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "loss": scale * 10 / s} for s in range(1, 21)]
        rows.append({"step": 20, "eval_loss": scale})
        text = "\n".join(json.dumps(r) for r in rows)
        (tmp_path / name / "metrics.jsonl").write_text(text)
    output = plot_losses({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "loss.png")
    image = matplotlib.image.imread(output)
    assert image.shape[0] > 300 and image.std() > 0.05
