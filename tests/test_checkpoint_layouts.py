"""A checkpoint saved by one layout resumes on any other (forked gloo ranks on CPU).

Saved at (dp, tp1, tp2) = (2, 2, 1), everything on the host, 1 pass, after two steps; resumed at
(1, 1, 2) with 2 passes, at (1, 1, 1) resident with 4 passes and with the sequence over 2
context-parallel ranks, each runs the third step. The reference is an uninterrupted single-process
run of the same three steps: the third loss and every weight after it must agree within 1e-5.
"""

from __future__ import annotations

import pytest

from execution.checkpoint.load import load_checkpoint
from execution.checkpoint.logical import full_state
from execution.checkpoint.save import Checkpointer
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import planned_engine
from tests.distributed import (
    CPU,
    FLOAT32_TOLERANCE,
    assert_states_close,
    global_batches,
    layout_flags,
    learning_rates,
    replica_batch,
    run_ranks,
    single_process_run,
    small_config,
    train_steps,
    world_layout,
)

pytestmark = pytest.mark.distributed
STEPS = 3


def _save(config, batches, folder):
    engine = planned_engine(config, world_layout(config))
    steps = train_steps(engine, batches[: STEPS - 1], engine.layout.dp.rank)
    checkpointer = Checkpointer(folder, engine, log=lambda _: None)
    checkpointer.save(STEPS - 1, None)
    checkpointer.close()
    return steps


def _resume(config, batches, folder, layout=None):
    engine = planned_engine(config, layout or world_layout(config))
    trainer = load_checkpoint(folder, engine)
    step = trainer["step"]
    batch = replica_batch(config, batches[step], engine.layout.dp.rank)
    result = engine.train_step(batch, step, learning_rates(STEPS)[step])
    return {"step": step, "loss": result.loss, "weights": full_state(engine, "weights")}


def test_save_on_one_layout_resume_on_others(tmp_path):
    saved_config = small_config(*layout_flags(2, 2, 1), "--placement", "remote", "--passes", "1")
    batches = global_batches(saved_config, STEPS)
    reference = single_process_run(saved_config, batches)
    folder = tmp_path / "ckpt"

    saved = run_ranks(_save, 4, tmp_path / "save", saved_config, batches, folder)
    for got, want in zip(saved[0], reference["steps"], strict=False):
        assert abs(got["loss"] - want["loss"]) <= FLOAT32_TOLERANCE * want["loss"]

    config_112 = small_config(*layout_flags(1, 1, 2), "--placement", "remote", "--passes", "2")
    resident_111 = small_config("--placement", "resident", "--passes", "4")
    resumes = {
        "(1, 1, 2) remote, 2 passes": run_ranks(
            _resume, 2, tmp_path / "r112", config_112, batches, folder
        )[0],
        "(1, 1, 1) resident, 4 passes": _resume(
            resident_111, batches, folder, ParallelLayout.single(CPU)
        ),
        "sequence over 2 context ranks": run_ranks(
            _resume, 2, tmp_path / "cp2", small_config(*layout_flags(1, 1, 1, 2)), batches, folder
        )[0],
    }
    expected_loss = reference["steps"][STEPS - 1]["loss"]
    for name, got in resumes.items():
        assert got["step"] == STEPS - 1, name
        assert abs(got["loss"] - expected_loss) <= FLOAT32_TOLERANCE * expected_loss, (
            name,
            got["loss"],
            expected_loss,
        )
        assert_states_close(got["weights"], reference["weights"], FLOAT32_TOLERANCE, name)
