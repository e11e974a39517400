"""The one schedule, drawn as a reader would draw it, and an engine built from a plan alone,
keeping each fact of its rank in one place (its PhaseContext)."""

from __future__ import annotations

import dataclasses

import torch

from config.schema import OptimizerConfig, PretrainingConfig
from execution.engine.engine import PhasedEngine
from execution.engine.phases import schedule
from execution.engine.phases.phase_context import PhaseContext
from execution.engine.phases.schedule import Stage, evaluation_phases, training_phases
from execution.engine.plan import EnginePlan, MemoryPlan, Placement
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import plan_for_process
from execution.planning.run_shape import RunShape
from modelling.gpt import GPTShapes
from tests.distributed import CPU, engine_batch, global_batches, planned_engine
from tests.reference import small_config

NAMES = {
    schedule.EMBEDDING_FORWARD: "emb",
    schedule.LAYER_FORWARD: "f{layer}",
    schedule.HEAD_PHASE: "head",
    schedule.LAYER_BACKWARD: "b{layer}",
    schedule.EMBEDDING_BACKWARD: "emb'",
    schedule.RECEIVE_X: "<x",
    schedule.SEND_X: "x>",
    schedule.RECEIVE_DX: "<dx",
    schedule.SEND_DX: "dx>",
}


def draw(phases: list[schedule.Phase]) -> str:
    """One line per run of phases of the same pass: ``p<pass>  <phase> ...``."""
    lines: list[tuple[int, list[str]]] = []
    for phase in phases:
        name = NAMES[phase.kind].format(layer=phase.layer)
        if not lines or lines[-1][0] != phase.pass_index:
            lines.append((phase.pass_index, []))
        lines[-1][1].append(name)
    return "\n".join(f"p{index}  {' '.join(names)}" for index, names in lines)


def test_one_stage_walks_each_pass_forward_then_back():
    stage = Stage.of((2,), 0)
    assert draw(training_phases(stage, micro_batches=4, passes=2)) == (
        "p0  emb f0 f1 head b1 b0 emb'\np1  emb f0 f1 head b1 b0 emb'"
    )
    phases = training_phases(stage, micro_batches=5, passes=2)
    assert [p.micro_batches for p in phases if p.kind == schedule.HEAD_PHASE] == [
        range(0, 3),
        range(3, 5),
    ]
    # The head's tied gradient starts the embedding's sum: its backward never starts one.
    embedding = [p for p in phases if p.kind == schedule.EMBEDDING_BACKWARD]
    assert [(p.first_pass, p.last_pass) for p in embedding] == [(False, False), (False, True)]


def test_pipeline_stages_run_one_forward_one_backward():
    """Two stages, three passes: the first stage runs one forward ahead of its backwards (its
    warm-up), the last none; the moves stand where the neighbour needs them."""
    first = training_phases(Stage.of((2, 1), 0), micro_batches=3, passes=3)
    assert draw(first) == "\n".join(
        [
            "p0  emb f0 f1 x>",
            "p1  emb f0 f1 x>",
            "p0  <dx b1 b0 emb'",
            "p2  emb f0 f1 x>",
            "p1  <dx b1 b0 emb'",
            "p2  <dx b1 b0 emb'",
        ]
    )
    last = training_phases(Stage.of((2, 1), 1), micro_batches=3, passes=3)
    assert draw(last) == "\n".join(
        [
            "p0  <x f0 head b0 dx>",
            "p1  <x f0 head b0 dx>",
            "p2  <x f0 head b0 dx>",
        ]
    )
    middle = training_phases(Stage.of((1, 1, 1), 1), micro_batches=2, passes=2)
    assert draw(middle) == "\n".join(
        ["p0  <x f0 x>", "p1  <x f0 x>", "p0  <dx b0 dx>", "p1  <dx b0 dx>"]
    )


def test_evaluation_runs_the_forward_and_the_loss_only():
    assert draw(evaluation_phases(Stage.of((2,), 0), range(2), 0)) == "p0  emb f0 f1 head"
    assert draw(evaluation_phases(Stage.of((1, 1), 0), range(2), 1)) == "p1  emb f0 x>"


def test_every_kind_is_in_the_one_table():
    kinds = {p.kind for s in range(3) for p in training_phases(Stage.of((1, 1, 1), s), 2, 2)}
    task = {p.kind for p in training_phases(Stage.of((1,), 0, task_head=True), 2, 2)}
    untied = {p.kind for p in training_phases(Stage.of((1,), 0, tied_head=False), 2, 2)}
    everything = kinds | task | untied | {schedule.EMBEDDING_FORWARD}
    assert everything == set(schedule.PHASE_KINDS)
    assert schedule.weights_loaded(schedule.Phase(schedule.HEAD_PHASE, 0, range(1))) == [
        ("head", 0),
        ("embedding", 0),
    ]
    untied_head = schedule.Phase(schedule.UNTIED_HEAD, 0, range(1))
    assert schedule.weights_loaded(untied_head) == [("head", 0)]
    assert schedule.weights_loaded(schedule.Phase(schedule.LAYER_BACKWARD, 3, range(1))) == [
        ("layers", 3)
    ]
    assert schedule.weights_loaded(schedule.Phase(schedule.SEND_DX, 0, range(1))) == []


def test_an_engine_built_from_a_plan_alone_runs_the_config_s_step():
    """A plan written out by hand, with no config anywhere, gives the engine the config's
    run: the same losses and weights, bit for bit. The engine keeps no config."""
    config = small_config("--layers", "2", "--precision", "float32", "--passes", "2")
    planned, _ = plan_for_process(RunShape.of(config), ParallelLayout.single(CPU))
    by_hand = EnginePlan(
        model=GPTShapes(
            layers=2,
            hidden=config.model.hidden_size,
            heads=config.model.heads,
            vocab=config.model.vocab_size,
            positions=config.model.max_positional_length,
            dropout_prob=config.model.dropout_prob,
            layer_norm_eps=config.model.layer_norm_eps,
            dropout_parity=config.model.dropout_parity,
        ),
        sequence_length=config.model.sequence_length,
        micro_batch_size=config.execution.micro_batch_size,
        gradient_accumulation=config.gradient_accumulation,
        stage_layers=(2,),
        precision="float32",
        prefetch=config.execution.prefetch,
        overlap_communication=config.execution.overlap_communication,
        seed=config.training.seed,
        init_std=config.model.init_std,
        loss_scaling=config.training.loss_scaling,
        optimizer=OptimizerConfig(**vars(config.training.optimizer)),
        memory=MemoryPlan(
            passes=2,
            micro_batches_per_pass=planned.micro_batches_per_pass,
            placement=Placement("device", "device", "device"),
            state_bytes={},
            working_set=0,
            traffic=0,
            shared_memory=True,
            recompute=planned.recompute,
            kept=planned.kept,
        ),
        compile=config.execution.compile,
    )
    memory = dataclasses.replace(planned, passes=2, placement=by_hand.memory.placement)
    from_run = RunShape.of(config).engine_plan(memory)
    assert from_run == dataclasses.replace(by_hand, memory=memory)
    engines = [PhasedEngine(plan, ParallelLayout.single(CPU)) for plan in (by_hand, from_run)]
    batches = global_batches(config, 2)
    losses = [
        [e.train_step(engine_batch(e, batches[s], 0), s, 1e-3).loss for s in range(2)]
        for e in engines
    ]
    assert losses[0] == losses[1]
    for a, b in zip(*(e.state.parts["layers"].weights.values() for e in engines), strict=True):
        assert torch.equal(a, b)
    held = [v for e in engines for v in vars(e).values()]
    assert not any(isinstance(v, PretrainingConfig) for v in held)


def test_each_fact_of_the_rank_has_one_home_its_phase_context():
    """The engine keeps its PhaseContext and none of the context's fields beside it: what the
    engine and its callers read by the engine's name (``engine.state``, ``engine.plan``) is the
    context's own object, so no fact can be changed in one place and read stale in another."""
    engine = planned_engine(small_config("--layers", "1"), ParallelLayout.single(CPU))
    fields = {field.name for field in dataclasses.fields(PhaseContext)}
    assert not fields & set(vars(engine)), "held by the engine and its context both"
    read = fields & set(dir(engine))
    assert {"plan", "state", "shapes", "templates", "stage", "specs", "rts"} <= read
    for name in read:
        assert getattr(engine, name) is getattr(engine.context, name), name
