"""The layout sentence and the mesh a checkpoint records: one MeshShape from the config's
execution section, described once, and read back from old and new checkpoints alike."""

from __future__ import annotations

from execution.parallel.mesh_shape import MeshShape
from execution.training.build import saved_mesh
from tests.distributed import small_config


def test_the_mesh_of_a_config_and_its_sentence_in_the_rank_formula_s_order():
    flags = [
        "--layers",
        "3",
        "--data_parallel",
        "2",
        "--pipeline_parallel",
        "3",
        "--context_parallel",
        "2",
    ]
    config = small_config(*flags, "--tensor_parallel_1", "2", "--tensor_parallel_2", "1")
    mesh = MeshShape.of(config.execution)
    assert (mesh.dp, mesh.pp, mesh.cp, mesh.tp1, mesh.tp2) == (2, 3, 2, 2, 1)
    assert mesh.world_size == config.world_size == 24
    assert mesh.describe() == "dp 2 x pp 3 x cp 2 x tp1 2 x tp2 1"


def test_a_checkpoint_s_mesh_whole_or_as_older_checkpoints_recorded_it():
    whole = {"saved_mesh": {"dp": 2, "tp1": 4, "tp2": 1, "cp": 2, "pp": 3}}
    assert saved_mesh(whole) == MeshShape(2, 4, 1, 2, 3)
    # dp, tp1 and tp2, with context and pipeline sizes in the saved config, where it has them.
    older = {"saved_layout": [2, 4, 1], "config": {"execution": {"pipeline_parallel": 3}}}
    assert saved_mesh(older) == MeshShape(2, 4, 1, 1, 3)
