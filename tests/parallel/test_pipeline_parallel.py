"""Pipeline parallelism: training with the decoder layers split over 2 or 4 stages (alone and
beside dp, tp1 and tp2, evenly and by hand) equals one process; the tied word embedding's
gradient is whole on both stages that hold it; checkpoints move between pipeline sizes.

The reference is the single-process engine fed each whole global batch, with the same passes.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex

import pytest
import torch

from execution.checkpoint.logical import full_state
from execution.engine.phases.schedule import Stage, training_phases
from execution.parallel.mesh import MeshShape
from execution.planning.pipeline_figures import bubble_fraction
from execution.planning.run_shape import RunShape
from tests.distributed import (
    FLOAT32_TOLERANCE,
    assert_curves_close,
    global_batches,
    planned_engine,
    real_step_traffic,
    relative_error,
    run_ranks,
    single_process_run,
    small_config,
    train_steps,
    with_execution,
    world_layout,
)
from tests.parallel.nccl_order import OrderError, P2POp, check_pairing, recording

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-6
STEPS = 3
STATES = ("weights", "grads", "exp_avg", "exp_avg_sq")
# 4 layers (one per stage at pp 4), 4 sequences of one micro-batch each, dropout 0.1.
MODEL = shlex.split(
    "--layers 4 --global_batch_size 4 --micro_batch_size 1 --dropout_prob 0.1 --precision float32"
)


def _flags(dp: int, pp: int, tp1: int, tp2: int, passes: int, stages: str = "") -> list[str]:
    sizes = {
        "--data_parallel": dp,
        "--pipeline_parallel": pp,
        "--tensor_parallel_1": tp1,
        "--tensor_parallel_2": tp2,
        "--passes": passes,
    }
    flags = [text for flag, size in sizes.items() for text in (flag, str(size))]
    return [*flags, "--pipeline_layers", stages] if stages else flags


def _train_rank(config, batches: torch.Tensor, one_group: bool = False) -> dict:
    """One rank: train, then gather the unsharded states its stage holds (collective within
    the stage); the first rank of each stage returns them. Every point-to-point op is logged
    (``p2p``) for :func:`check_pairing`. ``one_group``: both directions of the stages'
    transfers on the pipeline group itself, the layout whose NCCL pairing would hang."""
    with recording() as p2p:
        layout = world_layout(config)
        if one_group:
            layout.pp.upward_group = layout.pp.downward_group = None
        engine = planned_engine(config, layout)
        steps = train_steps(engine, batches, layout.dp.rank)
        states = {state: full_state(engine, state) for state in STATES}
        first_of_stage = layout.dp.rank == layout.tp1.rank == layout.tp2.rank == 0
        eval_loss = engine.evaluate(_validation(config, layout.dp.rank, layout.dp.size))
    out = {"steps": steps, "stage": layout.pp.rank, "eval_loss": eval_loss}
    out["p2p"] = (layout.rank, p2p)
    return {**out, **(states if first_of_stage else {})}


def _validation(config, dp_rank: int = 0, dp_size: int = 1) -> list[torch.Tensor]:
    """Replica ``dp_rank``'s share of 4 held-out sequences, as ``[1, seq + 1]`` micro-batches
    (evaluated 2 at a time with 2 passes: a pipeline's chunks)."""
    ids = global_batches(config, 1, seed=7)[0, :4]
    share = len(ids) // dp_size
    return list(ids[dp_rank * share : (dp_rank + 1) * share].unsqueeze(1))


@functools.cache
def _single_process(passes: int, dropout: str = "0.1") -> dict:
    config = small_config(*MODEL, "--passes", str(passes), "--dropout_prob", dropout)
    result = single_process_run(config, global_batches(config, STEPS))
    engine = result.pop("engine")
    result["eval_loss"] = engine.evaluate(_validation(config))
    result["exp_avg"] = full_state(engine, "exp_avg")
    result["exp_avg_sq"] = full_state(engine, "exp_avg_sq")
    return result


def _run(tmp_path, *flags: str) -> list[dict]:
    """Every rank's results of training ``flags``' layout, whose point-to-point ops pair off
    as NCCL pairs them (checked)."""
    config = small_config(*MODEL, *flags)
    batches = global_batches(config, STEPS)
    results = run_ranks(_train_rank, config.world_size, tmp_path, config, batches)
    pairs = check_pairing(dict(r["p2p"] for r in results))
    assert (pairs > 0) == (config.execution.pipeline_parallel > 1)
    return results


def _by_stage(results: list[dict], state: str) -> list[dict[str, torch.Tensor]]:
    return [r[state] for r in sorted(results, key=lambda r: r["stage"]) if state in r]


def _assert_matches(
    results: list[dict], expected: dict, state_tolerance: float = TOLERANCE
) -> None:
    """Every rank's losses and norms, and every stage's states, equal the expected run's;
    the two copies of the word embedding are identical."""
    assert_curves_close(results, expected, TOLERANCE)
    for state in STATES:
        stages = _by_stage(results, state)
        merged = {name: t for stage in stages for name, t in stage.items()}
        assert merged.keys() == expected[state].keys(), state
        worst = {n: relative_error(merged[n], t) for n, t in expected[state].items()}
        bad = {n: f"{e:.2e}" for n, e in worst.items() if not e <= state_tolerance}
        assert not bad, f"{state}: relative error above {state_tolerance:g}: {bad}"
        word = "embedding.word.weight"
        assert torch.equal(stages[0][word], stages[-1][word]), f"{state}: embedding copies differ"


@pytest.mark.parametrize(
    ("dp", "pp", "tp1", "tp2", "passes", "stages"),
    [
        (1, 2, 1, 1, 1, ""),
        (1, 2, 1, 1, 2, ""),
        (1, 2, 1, 1, 4, "1,3"),
        (1, 4, 1, 1, 1, ""),
        (1, 4, 1, 1, 2, ""),
        (1, 4, 1, 1, 4, ""),
        (2, 2, 1, 1, 1, ""),
        (2, 2, 1, 1, 2, "3,1"),
    ],
    ids=[
        "pp2-p1",
        "pp2-p2",
        "pp2-p4-uneven",
        "pp4-p1",
        "pp4-p2",
        "pp4-p4",
        "dp2-pp2-p1",
        "dp2-pp2-p2-uneven",
    ],
)
def test_pipeline_trains_like_one_process(tmp_path, dp, pp, tp1, tp2, passes, stages):
    """3 float32 steps with dropout 0.1: every rank's loss, gradient norm and a validation
    loss after them, and every weight, last gradient and Adam moment equal the single
    process's (same passes)."""
    results = _run(tmp_path, *_flags(dp, pp, tp1, tp2, passes, stages))
    _assert_matches(results, _single_process(passes))


def test_pipeline_beside_both_tensor_axes(tmp_path):
    """(dp, pp, tp1, tp2) = (1, 2, 2, 2), 2 passes, 8 ranks, dropout 0.1: every tensor shard
    draws its part of the single process's masks.

    Against the single process: losses and norms within 1e-6, and every element of every
    weight, last gradient and Adam moment within 1e-6 (``|a - e| <= 1e-6 + 1e-6 |e|``,
    ``torch.testing.assert_close``'s rule; measured: at most 6.7e-8 apart, over 9 seeds).
    The other tests' stricter rule, error relative to the tensor's largest element, sits at
    float32's noise here: a tensor-parallel sum rounds differently from one process's, and
    over 9 seeds the layout without a pipeline, (1, 1, 2, 2), lands 6e-7 to 1.3e-6 away from
    one process on small tensors (fresh output biases, second moments near 3e-4). So that rule
    holds the pipeline to the layout without it within 1e-6 (the pipeline adds ~1e-8), and to
    one process within the distributed tests' float32 tolerance (a layout bug is above 1e-3).
    """
    results = _run(tmp_path / "pipeline", *_flags(1, 2, 2, 2, 2))
    single = _single_process(2)
    _assert_matches(results, single, FLOAT32_TOLERANCE)
    for state in STATES:
        merged = {name: t for stage in _by_stage(results, state) for name, t in stage.items()}
        for name, want in single[state].items():
            where = f"{state} {name}"
            torch.testing.assert_close(
                merged[name],
                want,
                atol=TOLERANCE,
                rtol=TOLERANCE,
                msg=lambda m, at=where: f"{at}: {m}",
            )
    tensor_only = _run(tmp_path / "tensor-only", *_flags(1, 1, 2, 2, 2))
    _assert_matches(results, tensor_only[0])


def test_tied_embedding_gradient_is_whole_on_both_stages(tmp_path):
    """Embedding on stage 0, head on stage 1: the word embedding's last gradient on each equals
    the single process's, which adds the lookups' and the head's parts."""
    results = _run(tmp_path, *_flags(1, 2, 1, 1, 2))
    want = _single_process(2)["grads"]["embedding.word.weight"]
    first, last = _by_stage(results, "grads")
    for got in (first["embedding.word.weight"], last["embedding.word.weight"]):
        assert relative_error(got, want) <= TOLERANCE
    assert "head.ln_f.weight" not in first and "embedding.position.weight" in first
    assert "head.ln_f.weight" in last


def test_stages_sharing_one_group_each_way_would_hang_under_nccl(tmp_path):
    """The checker catches the deadlock it exists for: with x and dx on the pipeline group
    itself (the stages' transfers before they had a group each way), gloo trains, matching by
    tag, but under NCCL's issue order stage 0's first op with stage 1 is its dx receive, posted
    a pass ahead, and stage 1's is its x receive: receive against receive."""
    config = small_config(*MODEL, *_flags(1, 2, 1, 1, 2))
    batches = global_batches(config, 1)
    results = run_ranks(_train_rank, 2, tmp_path, config, batches, True)
    with pytest.raises(OrderError, match=r"recv <- 1 .* \| rank 1 recv <- 0"):
        check_pairing(dict(r["p2p"] for r in results))


def test_nccl_order_checker_by_hand():
    """Heads pair send against receive of equal size and dtype, in issue order; the ops of one
    batch in any order; a receive against a receive, a size mismatch or an op left over fail."""

    def op(rank, peer, kind, numel=4, group="pp"):
        return P2POp(group, rank, peer, kind, numel, "torch.float32")

    send, recv = (op(0, 1, "send"),), (op(1, 0, "recv"),)
    assert check_pairing({0: [send, send], 1: [recv, recv]}) == 2
    # Each direction on a group of its own: x up on one, dx down on another.
    up_down = {
        0: [(op(0, 1, "recv", group="down"),), (op(0, 1, "send", group="up"),)],
        1: [(op(1, 0, "recv", group="up"),), (op(1, 0, "send", group="down"),)],
    }
    assert check_pairing(up_down) == 2
    # The same on one group: receive against receive.
    one = {r: [(dataclasses.replace(o, group="pp"),) for (o,) in e] for r, e in up_down.items()}
    with pytest.raises(OrderError, match="heads do not pair"):
        check_pairing(one)
    # One batch on each side (batch_isend_irecv) pairs in any order.
    batched = {0: [tuple(reversed([o for (o,) in one[0]]))], 1: [tuple(o for (o,) in one[1])]}
    assert check_pairing(batched) == 2
    with pytest.raises(OrderError, match="heads do not pair"):
        check_pairing({0: [send], 1: [(op(1, 0, "recv", numel=5),)]})
    with pytest.raises(OrderError, match="no partner"):
        check_pairing({0: [send, send], 1: [recv]})
    # Other pairs and other groups are separate queues.
    other = (op(2, 3, "send", group="pp2"),), (op(3, 2, "recv", group="pp2"),)
    assert check_pairing({0: [send], 1: [recv], 2: [other[0]], 3: [other[1]]}) == 2


def test_one_forward_one_backward_holds_at_most_s_passes():
    """Stage s starts S - 1 - s forwards before its first backward; every pass's forward comes
    before its backward; the bubble is (S - 1) / (P + S - 1)."""
    for stages, passes in ((2, 1), (4, 2), (4, 8)):
        for index in range(stages):
            stage = Stage.of((1,) * stages, index)
            started, finished, most = set(), set(), 0
            for phase in training_phases(stage, passes * 2, passes):
                if phase.kind == "layer_forward":
                    started.add(phase.pass_index)
                if phase.kind == "layer_backward":
                    assert phase.pass_index in started
                    finished.add(phase.pass_index)
                most = max(most, len(started - finished))
            assert most == min(stages - index, passes), (stages, passes, index, most)
    assert bubble_fraction(4, 8) == 3 / 11


def test_rank_formula_puts_the_pipeline_between_data_and_context():
    mesh = MeshShape(dp=2, tp1=2, tp2=2, cp=1, pp=3)
    assert mesh.rank(1, 2, 0, 1, 0) == ((1 * 3 + 2) * 1 + 0) * 4 + 1 * 2
    assert mesh.members("pp", 5) == (1, 5, 9)
    assert mesh.members("embedding", 1) == (1, 9)
    assert mesh.members("embedding", 5) == (5,)  # a middle stage holds no embedding
    assert mesh.members("dp", 5) == (5, 17)


# ----------------------------------------------------------------- checkpoints

CHECKPOINT_MODEL = [*MODEL, "--dropout_prob", "0"]


def _save_rank(config, batches, folder) -> None:
    from execution.checkpoint.save import Checkpointer

    layout = world_layout(config)
    engine = planned_engine(config, layout)
    train_steps(engine, batches, layout.dp.rank)
    saver = Checkpointer(str(folder), engine, config, 0)
    saver.save(len(batches), None)
    saver.close()


def _resume_rank(config, folder) -> dict:
    from execution.checkpoint.load import load_checkpoint

    layout = world_layout(config)
    engine = planned_engine(config, layout)
    load_checkpoint(str(folder), engine)
    first = layout.tp1.rank == 0 and layout.tp2.rank == 0 and layout.dp.rank == 0
    states = {state: full_state(engine, state) for state in ("weights", "exp_avg_sq")}
    return {"stage": layout.pp.rank, **(states if first else {})}


@pytest.mark.parametrize("pp", [1, 4])
def test_checkpoint_saved_at_pp2_resumes_at_pp1_and_pp4(tmp_path, pp):
    """Weights and moments saved by 2 stages load into 1 and into 4 (logical tensors)."""
    config = small_config(*CHECKPOINT_MODEL, *_flags(1, 2, 1, 1, 2))
    batches = global_batches(config, 2)
    folder = tmp_path / "checkpoint"
    run_ranks(_save_rank, 2, tmp_path / "save", config, batches, folder)
    single = with_execution(config, pipeline_parallel=1)
    single.execution.pipeline_layers = ""
    reference = single_process_run(single, batches)["engine"]
    resumed = with_execution(config, pipeline_parallel=pp)
    results = run_ranks(_resume_rank, pp, tmp_path / "resume", resumed, folder)
    for state in ("weights", "exp_avg_sq"):
        want = full_state(reference, state)
        merged = {n: t for stage in _by_stage(results, state) for n, t in stage.items()}
        assert merged.keys() == want.keys()
        for name, t in want.items():
            assert relative_error(merged[name], t) <= 1e-5, (state, name)


# ----------------------------------------------------------------- dry run


def _recorded_traffic(config) -> dict:
    """:func:`real_step_traffic` with the rank's point-to-point ops logged."""
    with recording() as p2p:
        out = real_step_traffic(config)
    return {**out, "p2p": (torch.distributed.get_rank(), p2p)}


def test_dry_run_pipeline_equals_a_real_gloo_step(tmp_path):
    """(dp, pp, tp1, tp2) = (1, 2, 2, 1), 2 passes of 2 micro-batches: every stage's buffers
    (each its layers and parts, stage 0 two passes of activations in flight) and the bytes each
    group sends, the point-to-point moves included, equal a real gloo step's exactly; the moves
    by hand."""
    from execution.planning.dry_run import measure_rank

    flags = shlex.split("--layers 3 --global_batch_size 4 --micro_batch_size 1 --recompute full")
    config = small_config(*flags, *_flags(1, 2, 2, 1, 2))
    real = run_ranks(_recorded_traffic, config.world_size, tmp_path, config)
    assert check_pairing(dict(r["p2p"] for r in real)) > 0
    run = RunShape.of(config)
    spec = run.spec
    m, micro_batches = config.model, config.gradient_accumulation
    entry = config.execution.micro_batch_size * m.sequence_length * m.hidden_size * 4
    for rank in (0, 2):  # the first rank of each stage
        dry = measure_rank(run, rank, spec)
        assert dry.buffer_bytes == real[rank]["buffers"], rank
        dry_sent = {k: v for k, v in dry.comm_bytes.items() if k != "host_link"}
        assert dry_sent == real[rank]["sent"], rank
        # Stage 0 sends its tp1 half of x, stage 1 the whole dx, once per micro-batch; and
        # the loss with its count (two float64) is summed over the pipeline.
        moves = micro_batches * (entry // 2 if rank == 0 else entry)
        assert dry_sent["pp"] == moves + 2 * 8
    first, last = (measure_rank(run, r, spec).buffer_bytes for r in (0, 2))
    assert first["weights"] != last["weights"]  # 2 layers and the embedding vs 1, both, head
