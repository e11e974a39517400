"""The planner picks the fastest plan that fits, honours the flags, and explains a misfit."""

from __future__ import annotations

import shlex

import pytest

from config.loading import ConfigError, parse_config
from execution.engine.phases.recompute import attention_kernel
from execution.engine.plan import GiB, Placement
from execution.planning.measure import Measurements
from execution.planning.memory import MemoryBudget, RankShape, state_bytes
from execution.planning.micro_batch_limits import check_micro_batches, pass_counts
from execution.planning.pipeline_figures import deciding_stages
from execution.planning.plan_ranking import step_seconds
from execution.planning.planner import candidate_plans, choose, measured_plans, shortfall
from execution.planning.run_shape import RunShape
from tests.reference import LLAMA_VARIANTS, small_config

UNLIMITED = MemoryBudget(device=None, host=1 << 50)
ALL_DEVICE = Placement("device", "device", "device")


def preset(name: str, *flags: str):
    config, _ = parse_config(["--config", name, *flags])
    return config


def test_everything_on_the_device_in_one_pass_when_it_fits():
    plan = choose(RunShape.of(small_config()), UNLIMITED, device_type="cpu").plan
    assert plan.passes == 1
    assert plan.placement == Placement("device", "device", "device")
    assert plan.traffic == 0


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_tighter_device_memory_moves_state_off_the_device():
    """gpt3_1.3B on a GPU: with room, everything stays on the device in one pass; as device
    memory shrinks, each chosen plan fits, holds less on the device, moves more bytes over
    the host link, and no plan that fits is estimated faster, or as fast with fewer bytes
    moved. (Full recompute: what each layer keeps is a choice of its own, tested below.)"""
    run = RunShape.of(preset("gpt3_1.3B", "--recompute", "full"))
    rank = RankShape.of(run)
    one_pass = state_bytes(
        rank, rank.gradient_accumulation, Placement("device", "device", "device")
    )
    everything = sum(one_pass.values())
    roomy = choose(run, MemoryBudget(int(everything * 1.2), 1 << 45)).plan
    assert (roomy.passes, roomy.placement) == (1, Placement("device", "device", "device"))
    chosen, kernel = [], attention_kernel("cuda", run.model.dropout_prob, rank.dtype)
    for device_gib in (80, 40, 20, 12):
        budget = MemoryBudget(device_gib * GiB, 512 * GiB)
        plan = choose(run, budget).plan
        assert budget.fits(plan) and plan.bytes_on("device")["total"] <= device_gib * GiB
        fitting = [p for p in measured_plans(run, "cuda") if budget.fits(p)]
        time = {id(p): step_seconds(run, rank, kernel, p) for p in [plan, *fitting]}
        assert not any(time[id(p)] < time[id(plan)] for p in fitting)
        ties = [p for p in fitting if time[id(p)] == time[id(plan)]]
        assert not any(p.traffic < plan.traffic for p in ties)
        chosen.append(plan)
    device = [p.bytes_on("device")["total"] for p in chosen]
    traffic = [p.traffic for p in chosen]
    assert device == sorted(device, reverse=True) and traffic == sorted(traffic)
    assert chosen[-1].placement.weights == "host"  # 12 GiB cannot hold 1.3B with AdamW state


@pytest.mark.parametrize(
    "flags",
    [
        "--global_batch_size 8",
        pytest.param("--global_batch_size 8 --pipeline_parallel 2", marks=pytest.mark.slow),
    ],
)
def test_the_lazy_walk_chooses_what_measuring_every_mode_chooses(flags):
    """choose measures a recompute mode's working set only when the walk reaches one of its
    plans that may fit. At device budgets from below what the smallest plan needs to above
    what the largest needs (so the fastest modes stop fitting one by one), on every stage, it
    chooses what measuring every mode first chooses: the plans whose passes, placement and
    recompute fit on every stage that decides, in the first stage's order (its choice, then
    the others it draws); on a miss, the plan that needs the least device memory. With memory
    to spare it measures one mode."""
    run = RunShape.of(small_config(*shlex.split(flags)))
    stages = range(run.mesh.pp)
    deciding = {0, *deciding_stages(run.stage_layers)} if run.mesh.pp > 1 else set()
    known = Measurements()  # what both ways measure, measured once
    eager = {s: measured_plans(run, "cuda", s, known) for s in stages}
    needs = sorted({p.bytes_on("device")["total"] for plans in eager.values() for p in plans})
    assert len(needs) > 4
    chosen = set()
    for device in [needs[0] - 1, *needs[::3], needs[-1], needs[-1] + 1]:
        budget = MemoryBudget(device, 1 << 50)
        fitting = {
            s: {(p.passes, p.placement, p.recompute): p for p in eager[s] if budget.fits(p)}
            for s in stages
        }
        for stage in stages:
            first = eager[0 if deciding else stage]  # the first stage's order
            everywhere = [
                fitting[stage][c]
                for c in ((p.passes, p.placement, p.recompute) for p in first)
                if all(c in fitting[s] for s in {stage, *deciding})
            ]
            got = choose(run, budget, stage, on_miss="least", measurements=known)
            if everywhere:
                assert got.fits and [got.plan, *got.others] == everywhere, (device, stage)
            else:
                least = min(eager[stage], key=lambda p: (p.bytes_on("device")["total"], p.traffic))
                assert not got.fits and got.plan == least, (device, stage)
            chosen.add(got.plan.recompute if got.fits else None)
    assert {None, "none", "full"} <= chosen  # the walk went past unfitting modes
    measured = Measurements()
    choose(run, UNLIMITED, 0, measurements=measured)
    assert len(measured.working_sets) == 1


def test_a_miss_gives_what_on_miss_names():
    """Below what any plan needs before its working set: ``raise`` is one line, ``least`` the
    plan of least device memory with every mode measured, and ``nearest`` the plan of least
    shortfall with no mode measured (none could fit: its quick working sets stand)."""
    run = RunShape.of(small_config())
    budget = MemoryBudget(1 << 10, 1 << 10)
    with pytest.raises(ConfigError, match="this run needs at least"):
        choose(run, budget)
    quick, measured = candidate_plans(run, "cuda"), measured_plans(run, "cuda")
    assert quick != measured  # the formula's working sets are not the measured ones
    least = choose(run, budget, on_miss="least")
    assert not least.fits
    assert least.plan == min(measured, key=lambda p: (p.bytes_on("device")["total"], p.traffic))
    nothing = Measurements()
    nearest = choose(run, budget, on_miss="nearest", measurements=nothing)
    assert not nearest.fits and not nothing.working_sets
    assert nearest.plan == min(quick, key=lambda p: shortfall(p, budget))


def test_passes_shrink_activations_to_fit_a_cpu():
    """gpt3_350M (paper global batch 256, micro-batch 8) on 24 GiB: more than one pass."""
    run = RunShape.of(preset("gpt3_350M"))
    plan = choose(run, MemoryBudget(None, int(24 * GiB * 0.9)), device_type="cpu").plan
    assert plan.passes > 1
    assert plan.placement == Placement("device", "device", "device")
    rank = RankShape.of(run)
    per_entry = state_bytes(rank, 1, ALL_DEVICE)["activations"]
    assert plan.state_bytes["activations"] == per_entry * plan.micro_batches_per_pass


def test_flags_fix_what_the_planner_may_choose():
    config = small_config("--placement", "remote", "--passes", "2")
    plans = candidate_plans(RunShape.of(config), "cuda")
    assert {(p.passes, p.placement) for p in plans} == {(2, Placement("host", "host", "host"))}
    mixed = small_config("--placement", "remote", "--grads_placement", "device")
    assert {p.placement for p in candidate_plans(RunShape.of(mixed), "cuda")} == {
        Placement("host", "device", "host")
    }
    resident = small_config("--placement", "resident")
    assert {p.placement for p in candidate_plans(RunShape.of(resident), "cpu")} == {
        Placement("device", "device", "device")
    }


def test_host_traffic_grows_with_passes_only_when_weights_stream():
    config = small_config("--global_batch_size", "16", "--micro_batch_size", "1")
    plans = candidate_plans(RunShape.of(config), "cuda")
    by = {
        (p.placement.weights, p.placement.grads, p.placement.activations, p.passes): p.traffic
        for p in plans
    }
    assert by["device", "device", "device", 1] == by["device", "device", "device", 16] == 0
    assert by["host", "device", "device", 16] > by["host", "device", "device", 1] > 0


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_a_misfit_names_the_least_memory_and_the_flags_that_fit():
    config = preset("gpt3_6.7B")
    with pytest.raises(ConfigError) as err:
        choose(RunShape.of(config), MemoryBudget(None, 20 * GiB), device_type="cpu")
    message = str(err.value)
    assert "\n" not in message
    assert "needs at least" in message and "20.0 GiB of host memory" in message
    assert "--data_parallel 8 (8 processes)" in message or "--tensor_parallel_1" in message


def test_plan_description_lists_every_state():
    plan = choose(RunShape.of(small_config()), UNLIMITED, device_type="cpu").plan
    text = plan.describe()
    for key in ("plan: 1 pass(es)", "weights", "optimizer", "grads", "activations", "working_set"):
        assert key in text
    totals = plan.bytes_on("device")
    assert totals["total"] == sum(v for k, v in totals.items() if k != "total")


def test_passes_beyond_the_micro_batches_are_an_error():
    with pytest.raises(ConfigError, match="--passes 9 exceeds the 4 micro-batches"):
        small_config("--passes", "9")


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_a_misfit_first_suggests_letting_the_planner_choose_what_the_flags_fixed():
    """One pass of gpt3_350M's 32 micro-batches does not fit 21 GiB; the planner's own passes
    would, so that is the first suggestion (before any extra processes)."""
    budget = MemoryBudget(None, 21 * GiB)
    with pytest.raises(ConfigError) as err:
        choose(RunShape.of(preset("gpt3_350M", "--passes", "1")), budget, device_type="cpu")
    assert "it would fit without --passes 1 or with --" in str(err.value)
    assert choose(RunShape.of(preset("gpt3_350M")), budget, device_type="cpu").plan.passes > 1


@pytest.mark.slow
@pytest.mark.parametrize(("passes", "head"), [(1, ()), (3, ()), (3, LLAMA_VARIANTS)])
def test_host_traffic_is_what_the_engine_copies(passes, head):
    """For every placement, the planner's bytes per step equal the engine's own counters of
    one real step (on meta tensors, so nothing is allocated); with Llama's untied head too,
    whose phase neither loads the word embedding nor stores a gradient of it (the planner
    counted both, 1.5x the bytes of llama_tiny's gradients on the host)."""
    import itertools

    import torch

    from execution.engine.engine import PhasedEngine
    from execution.parallel.mesh import ParallelLayout

    run = shlex.split(
        "--global_batch_size 6 --micro_batch_size 2 --layers 3 --precision bfloat16 "
        f"--passes {passes} --tensor_parallel_1 2"
    )
    for where in itertools.product(("device", "host"), repeat=3):
        placement = []
        for state, place in zip(("weights", "grads", "activations"), where, strict=True):
            placement += [f"--{state}_placement", place]
        config = small_config(*run, *placement, *head)
        shape_of_run = RunShape.of(config)
        plan = candidate_plans(shape_of_run, "cuda")[0]  # traffic: no working set
        engine = PhasedEngine(shape_of_run.engine_plan(plan), ParallelLayout.shapes_only(1, 2, 1))
        shape = (3, 2, config.model.sequence_length + 1)
        tokens = torch.zeros(shape, dtype=torch.long, device="meta")
        engine.train_step(tokens, 0, 1e-3)
        moved = engine.state.host_to_device + engine.state.device_to_host
        assert plan.traffic == moved, (where, plan.traffic, moved)
        assert (moved == 0) == (where == ("device", "device", "device"))


@pytest.mark.parametrize("recompute", ["full", "none"])
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_the_planned_working_set_holds_however_many_micro_batches_share_a_pass(recompute):
    """The planner measures the working set at one micro-batch per pass. Real CPU steps of 8
    micro-batches in 1, 2, 4 and 8 passes allocate no more beyond their buffers than that, but
    for the step's loss scalars (a few bytes). Layers of 128-token sequences with dropout
    (attention probabilities materialised) and small weights: before a micro-batch's
    temporaries were dropped, the next micro-batch ran beside the last one's weight gradients,
    and a pass of two or more went 230 KB (9%) over the plan."""
    import torch

    from execution.parallel.mesh import ParallelLayout
    from execution.planning.measure import measured_working_set
    from execution.planning.step_meter import StepMeter
    from tests.distributed import global_batches, planned_engine, replica_batch

    flags = (
        "--hidden_size 64 --sequence_length 128 --max_positional_length 128 --layers 3 "
        "--global_batch_size 8 --micro_batch_size 1 --placement remote --dropout_prob 0.1 "
        f"--recompute {recompute}"
    )
    peaks = {}
    for passes in (1, 2, 4, 8):
        config = small_config(*shlex.split(flags), "--passes", str(passes))
        engine = planned_engine(config, ParallelLayout.single(torch.device("cpu")))
        batch = replica_batch(config, global_batches(config, 1)[0], 0)
        with StepMeter() as meter:
            engine.train_step(batch, 0, 1e-3)
        peaks[passes] = meter.peak
    planned = measured_working_set(RunShape.of(config), "cpu", recompute)
    assert max(peaks.values()) <= planned + 64, (planned, peaks)


@pytest.mark.parametrize(
    "micro_batches, passes",
    [
        (1, [1]),
        (12, [1, 2, 3, 4, 6, 12]),  # every count divides 12
        (7, [1, 2, 3, 4, 7]),  # 4 passes of 2, 2, 2 and 1; 5 or 6 passes hold 2 too
        (13, [1, 2, 3, 4, 5, 7, 13]),
        # Per pass 128, 64, 43, 32, 26, 22, 19, 16, 15, 13, 12, 11, 10, then 9 (15 passes),
        # 8, 7 (19), 6 (22), 5 (26), 4, 3 (43: gpt3_1.3B's plan), 2 and 1.
        (128, [*range(1, 14), 15, 16, 19, 22, 26, 32, 43, 64, 128]),
    ],
)
def test_pass_counts_are_the_fewest_passes_of_each_pass_size(micro_batches, passes):
    """The planner weighs, for each distinct number of micro-batches per pass, the fewest
    passes that hold it: the divisors, and the counts whose last pass runs short. Hand lists."""
    assert pass_counts(micro_batches) == passes


def test_pass_counts_include_every_divisor():
    """720720 has 240 divisors; the walk from count to count meets each of them."""
    micro_batches = 720720
    divisors = [n for n in range(1, micro_batches + 1) if micro_batches % n == 0]
    assert len(divisors) == 240
    assert set(divisors) <= set(pass_counts(micro_batches))


def test_a_step_of_too_many_micro_batches_is_refused_in_one_line():
    """tiny's micro-batches of 4 on one replica: 10^9 sequences are 250,000,000 micro-batches,
    and 16,384 x 4 = 65,536 sequences the most the planner takes (65,540 is refused)."""
    config = preset("tiny", "--global_batch_size", "1000000000")
    with pytest.raises(ConfigError) as err:
        candidate_plans(RunShape.of(config), "cuda")
    message = str(err.value)
    assert "\n" not in message
    assert "is 250,000,000 micro-batches per replica per step" in message
    assert "the planner takes 1 to 16,384" in message
    assert "use --global_batch_size at most 65,536" in message
    # 129 int64 tokens per sequence: 10^9 x 129 x 8 bytes.
    assert "1,032.0 GB here" in message
    check_micro_batches(RunShape.of(preset("tiny", "--global_batch_size", "65536")))
    with pytest.raises(ConfigError, match="at most 65,536"):
        check_micro_batches(RunShape.of(preset("tiny", "--global_batch_size", "65540")))


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_the_planned_working_set_holds_one_chunk_of_a_large_vocabulary_s_logits(head):
    """128,256 words and micro-batches of 32 x 16 tokens: the whole micro-batch's float32
    logits are 263 MB, and the head holds two such tensors at once when it runs them whole
    (the plan was 575 MB). On chunks of 64 tokens (the floor's 2^23 elements) a real CPU step
    allocates about 99 MB beyond its buffers, and the planner's meta step, which runs the same
    phases, plans no less than that and less than one copy of the logits."""
    import torch

    from execution.parallel.mesh import ParallelLayout
    from execution.planning.measure import measured_working_set
    from execution.planning.step_meter import StepMeter
    from tests.distributed import global_batches, planned_engine, replica_batch
    from tests.reference import LLAMA_VARIANTS

    flags = "--vocab_size 128256 --sequence_length 16 --global_batch_size 32 --placement remote"
    variant = LLAMA_VARIANTS if head == "untied" else []
    config = small_config(*shlex.split(flags), "--micro_batch_size", "32", *variant)
    engine = planned_engine(config, ParallelLayout.single(torch.device("cpu")))
    with StepMeter() as meter:
        engine.train_step(replica_batch(config, global_batches(config, 1)[0], 0), 0, 1e-3)
    planned = measured_working_set(RunShape.of(config), "cpu", config.execution.recompute)
    logits = 32 * 16 * engine.shapes.vocab_padded * 4
    assert meter.peak <= planned + 64, (planned, meter.peak)
    assert planned < logits, (planned, logits)


def test_a_16_bit_cross_entropy_holds_one_float32_copy_of_its_logits():
    """bfloat16 logits of 64 tokens x 4096 words: the cross-entropy's forward allocates one
    float32 tensor of their size (shifted in place, then exp and softmax in place), not a copy
    and a shifted copy beside it (2 MiB more), besides a few per-token vectors."""
    import torch

    from execution.planning.step_meter import StepMeter
    from modelling.lm_heads import vocab_parallel_cross_entropy
    from modelling.parallel import LOCAL

    logits = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta", requires_grad=True)
    labels = torch.zeros(64, dtype=torch.long, device="meta")
    with StepMeter() as meter:
        vocab_parallel_cross_entropy(logits, labels, LOCAL, 4096)
    float32_copy = 64 * 4096 * 4
    assert float32_copy <= meter.peak <= float32_copy + 64 * 64, meter.peak
