"""``--compile``: each part runs through ``torch.compile``, and the numbers are eager's.

The reference is the same engine run eager. A compiled step differs from it by rounding only:
inductor's fused kernels sum in another order, and nothing else changes (dropout draws
eager's masks from the same seeds: modelling/dropout.py). The tolerance is the layout tests'
(tests/distributed.py ``FLOAT32_TOLERANCE``, derived in ``small_config``): with AdamW's eps
1e-2 a reordered sum keeps every weight within 1e-6 of the reference, while a wrong mask, a
missing recompute or a stale saved tensor moves them by orders of magnitude more.

Inductor compiles slowly on two cores (seconds per graph), so the compiled engines are few
and each serves several checks.
"""

from __future__ import annotations

import shlex

import pytest
import torch

from config.loading import parse_config
from execution.checkpoint.logical import full_state
from execution.engine.phases import compiled
from execution.engine.phases.recompute import attention_kernel
from execution.parallel.mesh import ParallelLayout
from execution.planning.memory import RankShape
from execution.planning.run_shape import RunShape
from modelling import lm_heads
from tests.distributed import (
    CPU,
    FLOAT32_TOLERANCE,
    assert_states_close,
    engine_batch,
    global_batches,
    learning_rates,
    planned_engine,
    small_config,
)
from tests.reference import chunk_every_head
from utils.torch_private import dynamo_counters

STEPS = 3


def _run(mode: str, compile_parts: str, *flags: str) -> dict:
    """Losses, graphs compiled per step, the evaluation loss and the final weights of
    ``STEPS`` steps with dropout, ``--recompute mode``."""
    config = small_config(
        "--dropout_prob", "0.1", "--recompute", mode, "--compile", compile_parts, *flags
    )
    dynamo_counters()["graph_break"].clear()
    watch = compiled.CompileWatch()
    engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, STEPS + 1)
    losses, graphs = [], []
    for step, lr in enumerate(learning_rates(STEPS)):
        result = engine.train_step(engine_batch(engine, batches[step], 0), step, lr)
        losses.append(result.loss)
        graphs.append(result.compiled_graphs)
    evaluation = engine.evaluate(list(engine_batch(engine, batches[STEPS], 0)))
    return {
        "compiled": engine.compiled,
        "losses": losses,
        "graphs": graphs,
        "eval": evaluation,
        "weights": full_state(engine, "weights"),
        "breaks": " ".join(dynamo_counters()["graph_break"]),
        "failed": watch.failed_since_last(),  # frames Dynamo could not compile
    }


@pytest.mark.parametrize(
    "mode, flags",
    [
        ("full", ("--dropout_parity", "false")),  # attention's dropout: one op of the graph
        # Kept tensors go through the host's entries; the head runs on 2 chunks of 16 tokens.
        ("none", ("--placement", "remote", "--micro_batch_size", "4")),
        ("selective", ("--dropout_parity", "false")),  # the fused kernel's dropout
    ],
)
def test_compiled_parts_give_eager_numbers(monkeypatch, mode, flags):
    """Each mode's engine against eager's; with every head on chunks, micro-batches of 4 x 8
    tokens run the compiled head on 2 chunks of 16 (half its 32 columns), one graph for both."""
    if compiled.compile_unavailable("cpu"):
        pytest.skip(f"torch.compile cannot run here: {compiled.compile_unavailable('cpu')}")
    chunk_every_head(monkeypatch)
    assert len(lm_heads.logits_chunks(4 * 8, 1000, 1008, 32)) == 2
    eager, built = _run(mode, "false", *flags), _run(mode, "true", *flags)
    assert not eager["compiled"] and built["compiled"]
    # The first step compiles each part's variants (unless an engine before compiled the same
    # shapes: Dynamo's cache is the process's); no later step compiles again.
    assert built["graphs"][1:] == [0] * (STEPS - 1), built["graphs"]
    assert built["failed"] == 0  # else eager's numbers would prove nothing of the graphs
    if "--dropout_parity" in flags:  # the fused kernel's dropout: no break where it runs
        assert "seeded_attention" not in built["breaks"], built["breaks"]
    for step, (got, want) in enumerate(zip(built["losses"], eager["losses"], strict=True)):
        assert abs(got - want) / want <= FLOAT32_TOLERANCE, f"step {step}: {got} vs {want}"
    assert abs(built["eval"] - eager["eval"]) / eager["eval"] <= FLOAT32_TOLERANCE
    assert_states_close(built["weights"], eager["weights"], FLOAT32_TOLERANCE, "weights")


def test_a_tool_chain_that_cannot_compile_runs_eager_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(
        "execution.engine.engine.compile_unavailable", lambda device_type: "no C++ compiler"
    )
    config = small_config("--compile", "true")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    assert not engine.compiled
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["--compile: torch.compile cannot run here (no C++ compiler); running eager"]
    batch = engine_batch(engine, global_batches(config, 1)[0], 0)
    assert engine.train_step(batch, 0, 1e-3).compiled_graphs == 0


def test_a_graph_that_fails_to_compile_runs_eager_and_says_so(monkeypatch, capsys):
    """Inductor failing on a part's graph (here: raising for every graph) leaves that part
    uncompiled: the run goes on with eager's numbers (within the tolerance above: the two
    engines hand their kernels other strides, which rounds otherwise on some CPUs' kernels),
    and the main rank says so in one line each time graphs fail: the first step's, and the
    evaluation's, whose head without a gradient sink is a frame the step did not run. (Where
    only one graph fails, Dynamo compiles the frames inside it instead.)"""
    if compiled.compile_unavailable("cpu"):
        pytest.skip(f"torch.compile cannot run here: {compiled.compile_unavailable('cpu')}")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    flags = ("--dropout_prob", "0.1", "--dropout_parity", "false", "--layers", "1")
    eager = _run("full", "false", *flags)
    torch._dynamo.reset()  # nothing compiled before may stand in for the broken compiler
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    try:
        capsys.readouterr()
        built = _run("full", "true", *flags)
        lines = capsys.readouterr().out.strip().splitlines()
    finally:
        torch._dynamo.reset()  # Dynamo skips a code it failed on: not in the next tests
    for step, (got, want) in enumerate(zip(built["losses"], eager["losses"], strict=True)):
        assert abs(got - want) / want <= FLOAT32_TOLERANCE, f"step {step}: {got} vs {want}"
    assert abs(built["eval"] - eager["eval"]) / eager["eval"] <= FLOAT32_TOLERANCE
    assert built["failed"] and len(lines) == 2, lines
    for line in lines:
        assert line.startswith("--compile: "), line
        assert line.endswith("could not compile (Dynamo's warning says why); going on")


def test_the_watch_counts_the_graphs_compiled():
    watch = compiled.CompileWatch()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    double(torch.ones(3))
    assert watch.since_last() == 1
    double(torch.ones(3))  # cached: nothing compiles
    assert watch.since_last() == 0
    double(torch.ones(3, dtype=torch.float64))  # a guard fails: one more graph
    assert watch.since_last() == 1


@pytest.mark.slow
def test_a_compiled_layer_keeps_in_place_what_its_plan_says():
    """Without dropout the block is one graph, which keeps what inductor's partitioner chose
    to save: a Llama block's forward recomputes its cheap ops (norms, SwiGLU's product)
    rather than save them, a quarter less than eager here. The plan takes its figure from
    the forward graph the dry run captures, and a real step keeps exactly that."""
    if compiled.compile_unavailable("cpu"):
        pytest.skip(f"torch.compile cannot run here: {compiled.compile_unavailable('cpu')}")
    flags = (
        "--config llama_tiny --layers 2 --hidden_size 32 --heads 4 --intermediate_size 88 "
        "--sequence_length 16 --max_positional_length 16 --global_batch_size 2 "
        "--micro_batch_size 1 --dropout_prob 0 --recompute none --compile true "
        "--placement resident --precision float32 --device cpu"
    )
    config, _ = parse_config(shlex.split(flags))
    engine = planned_engine(config, ParallelLayout.single(CPU))
    rank = RankShape.of(RunShape.of(config))
    kernel = attention_kernel("cpu", 0.0, torch.float32)
    eager = rank.kept("none", kernel).in_place
    assert engine.memory.kept == rank.kept("none", kernel, compiled=True).in_place < eager
    tokens = torch.randint(0, 1000, (2, 1, 17))
    engine.train_step(tokens, 0, 1e-3)
    assert engine.compiled and engine.kept.in_place
    assert engine.kept.largest == engine.memory.kept
