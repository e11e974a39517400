"""Initial weights drawn by a pool of threads are bitwise those drawn by one thread, and the
baselines' model, built on the ``meta`` device and loaded, holds the engine's initial weights.

Each tile has its own generator (:func:`modelling.gpt.init_part_region`), so neither the number
of threads nor the order in which they finish may change a single bit.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import baselines
from execution.checkpoint.logical import full_state
from execution.engine.engine import PhasedEngine
from execution.engine.plan import MemoryPlan, Placement
from execution.parallel.mesh import ParallelLayout
from execution.parallel.sharding import init_part_shard
from execution.planning.run_shape import RunShape
from modelling.gpt import LAYERS, PARTS, GPTShapes, init_full_part
from modelling.host_threads import one_core_pool, openmp_team_setter
from modelling.tiles import INIT_TILE
from tests.reference import small_config, unpadded

SEED, STD = 11, 0.02
WORKERS = 3  # more threads than this machine's cores: finishing order is up to the OS

# Widths that are not a multiple of a tile (300 = 256 + 44, fc's 1200 = 4 tiles + 176) and a
# vocabulary and positions that tp1 = 2 pads, so shards cut through tiles and hold padding.
SHAPES = GPTShapes(
    layers=2,
    hidden=300,
    heads=12,
    vocab=263,
    positions=301,
    dropout_prob=0.0,
    layer_norm_eps=1e-5,
    tp1=2,
    tp2=2,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_the_sizes_span_several_tiles_and_padding():
    assert SHAPES.hidden % INIT_TILE and SHAPES.ffn > 4 * INIT_TILE
    assert SHAPES.vocab_padded > SHAPES.vocab and SHAPES.positions_padded > SHAPES.positions


@pytest.mark.parametrize("part", PARTS)
def test_a_pool_draws_every_full_part_bitwise_as_one_thread(part):
    layer = 1 if part == LAYERS else 0
    one_thread = init_full_part(SHAPES, part, layer, SEED, STD)
    assert_bitwise_equal(init_full_part(SHAPES, part, layer, SEED, STD, WORKERS), one_thread)


@pytest.mark.parametrize("part", PARTS)
def test_a_pool_draws_every_padded_shard_bitwise_as_one_thread(part):
    # Rank (1, 1) holds the last vocabulary and position rows: the padding.
    one_thread = init_part_shard(SHAPES, part, 0, SEED, STD, 1, 1)
    assert_bitwise_equal(init_part_shard(SHAPES, part, 0, SEED, STD, 1, 1, WORKERS), one_thread)


@pytest.mark.skipif(openmp_team_setter() is None, reason="torch without OpenMP")
def test_the_pool_threads_run_torch_on_one_core_even_after_set_num_threads():
    # Torch sets a thread's team size on its first parallel op from set_num_threads' count,
    # which would undo a size set before it.
    torch.set_num_threads(2)  # the module's fixture sets it back

    def team_after_a_parallel_op() -> int:
        torch.rand(1 << 17).erfinv_()
        return torch.get_num_threads()

    with one_core_pool(2, "test") as pool:
        assert pool.submit(team_after_a_parallel_op).result() == 1
    assert torch.get_num_threads() == 2  # the calling thread keeps its team


def test_the_baselines_meta_built_model_holds_the_engines_initial_weights():
    # A vocabulary of 307 pads to 320 rows; 272 columns span two tiles.
    config = small_config("--hidden_size", "272", "--heads", "4")
    # Everything on the device, in one pass: the weights do not depend on the plan, and a
    # plan written out skips the planner's measurements.
    memory = MemoryPlan(
        passes=1,
        micro_batches_per_pass=config.gradient_accumulation,
        placement=Placement("device", "device", "device"),
        state_bytes={},
        working_set=0,
        traffic=0,
        shared_memory=True,
    )
    engine = PhasedEngine(
        RunShape.of(config).engine_plan(memory), ParallelLayout.single(torch.device("cpu"))
    )
    model = baselines.initial_model(config)
    ours = full_state(engine)
    theirs = model.state_dict()
    # Checkpointed layers are named layers.N.block.*: the loop's wrapper, not another weight.
    theirs = {name.replace(".block.", "."): tensor for name, tensor in theirs.items()}
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert not tensor.is_meta, name
        kept = unpadded(name, tensor, config)
        assert torch.equal(kept, ours[name]), name
        assert not tensor[len(kept) :].any(), name  # padding rows stay zero
