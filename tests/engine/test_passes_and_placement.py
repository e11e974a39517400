"""Passes and placements change how often layers load and where state lives, never the numbers;
the buffers allocated are exactly the bytes the planner predicted."""

from __future__ import annotations

import itertools
import math
import shlex
import typing

import pytest
import torch

from execution.checkpoint.logical import full_state, read_part_state, write_part_state
from execution.engine.phases.schedule import pass_groups
from execution.engine.storage.streams import CudaStream
from execution.parallel.mesh import ParallelLayout
from execution.planning.memory import RankShape, state_bytes
from execution.planning.run_shape import RunShape
from tests.distributed import (
    assert_states_close,
    global_batches,
    layout_flags,
    planned_engine,
    replica_batch,
    run_ranks,
    small_config,
    world_layout,
)

CPU = torch.device("cpu")
# Passes change only the order in which float32 gradients are summed. The configs use AdamW eps
# 1e-3 (see tests/distributed.py): with a tiny eps Adam magnifies that rounding in elements whose
# gradient is ~0 (the key bias) past any tolerance, for any two correct summation orders.
TOLERANCE = 1e-6
STEPS = 3


def train(config, layout: ParallelLayout | None = None, steps: int = STEPS) -> dict:
    """``steps`` steps on the same global batches; losses, norms, final weights and moments."""
    layout = layout or ParallelLayout.single(CPU)
    engine = planned_engine(config, layout)
    batches = global_batches(config, steps)
    results = [
        engine.train_step(replica_batch(config, batches[s], layout.dp.rank), s, 2e-3 * (s + 1))
        for s in range(steps)
    ]
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "grads": full_state(engine, "grads"),
        "weights": full_state(engine, "weights"),
        "exp_avg_sq": full_state(engine, "exp_avg_sq"),
        "plan": (engine.memory.passes, engine.memory.placement),
    }


def assert_runs_close(run: dict, reference: dict, tolerance: float, what: str) -> None:
    for key in ("losses", "norms"):
        for got, want in zip(run[key], reference[key], strict=True):
            assert abs(got - want) <= tolerance * abs(want), (what, key, got, want)
    for state in ("grads", "weights", "exp_avg_sq"):
        assert_states_close(run[state], reference[state], tolerance, f"{what} {state}")


@pytest.mark.parametrize("dropout", ["0", "0.1"], ids=["no-dropout", "dropout"])
def test_passes_give_the_same_steps(dropout):
    """P = 1, 2 and GA (4 micro-batches): same losses, norms, gradients and updated weights
    over 3 float32 steps. Dropout masks follow the global micro-batch, so they agree too."""
    flags = ["--dropout_prob", dropout, "--global_batch_size", "8", "--micro_batch_size", "2"]
    one = train(small_config(*flags, "--passes", "1"))
    assert one["plan"][0] == 1
    for passes in (2, 4):
        other = train(small_config(*flags, "--passes", str(passes)))
        assert other["plan"][0] == passes
        assert_runs_close(other, one, TOLERANCE, f"passes {passes}")


def test_uneven_passes_cover_every_micro_batch():
    """3 passes over 4 micro-batches: groups of 2, 1 and 1, exactly as asked."""
    flags = ["--global_batch_size", "8", "--micro_batch_size", "2"]
    one = train(small_config(*flags, "--passes", "1"), steps=1)
    uneven = train(small_config(*flags, "--passes", "3"), steps=1)
    assert uneven["plan"][0] == 3
    assert_runs_close(uneven, one, TOLERANCE, "3 passes")
    assert [list(g) for g in pass_groups(4, 3)] == [[0, 1], [2], [3]]
    assert [len(g) for g in pass_groups(10, 4)] == [3, 3, 2, 2]


PLACEMENTS = list(itertools.product(("device", "host"), repeat=3))


def placement_flags(weights: str, grads: str, activations: str) -> list[str]:
    flags = []
    for state, where in (("weights", weights), ("grads", grads), ("activations", activations)):
        flags += [f"--{state}_placement", where]
    return flags


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_every_placement_equals_all_remote():
    """Each of the 8 combinations of device and host for weights (with optimizer state),
    gradients and activations, with 2 passes and dropout, is bitwise equal to all-remote."""
    flags = ["--dropout_prob", "0.1", "--passes", "2"]
    remote = train(small_config(*flags, "--placement", "remote"))
    assert remote["plan"][1].weights == "host"
    for combo in PLACEMENTS:
        run = train(small_config(*flags, *placement_flags(*combo)), steps=STEPS)
        assert tuple(vars(run["plan"][1]).values()) == combo
        assert run["losses"] == remote["losses"], combo
        for state in ("grads", "weights", "exp_avg_sq"):
            for name, t in remote[state].items():
                assert torch.equal(run[state][name], t), (combo, state, name)


def test_bfloat16_weight_copies_equal_casting_the_masters():
    """bfloat16 with weights on the host (loaded from bfloat16 copies, refreshed after each
    update) is bitwise equal to weights on the device (cast from the float32 masters at each
    load) over 3 steps: losses, gradients, weights and moments; and the copies hold exactly
    the masters cast. Loads from host carry half the float32 bytes."""
    flags = ["--precision", "bfloat16", "--dropout_prob", "0.1", "--passes", "2"]
    runs, engines = {}, {}
    for weights in ("device", "host"):
        config = small_config(*flags, *placement_flags(weights, "host", "host"))
        engines[weights] = engine = planned_engine(config, ParallelLayout.single(CPU))
        batches = global_batches(config, STEPS)
        results = [
            engine.train_step(replica_batch(config, batches[s], 0), s, 2e-3 * (s + 1))
            for s in range(STEPS)
        ]
        states = {s: full_state(engine, s) for s in ("grads", "weights", "exp_avg_sq")}
        runs[weights] = {"losses": [r.loss for r in results], **states}
    assert runs["host"]["losses"] == runs["device"]["losses"]
    for state in ("grads", "weights", "exp_avg_sq"):
        for name, t in runs["device"][state].items():
            assert torch.equal(runs["host"][state][name], t), (state, name)
    host = engines["host"].state
    assert host.copy_dtype == torch.bfloat16 and engines["device"].state.copy_dtype is None
    for buffers in host.parts.values():
        for kind, master in buffers.weights.items():
            assert torch.equal(buffers.weight_copies[kind], master.to(torch.bfloat16)), kind
    masters = sum(b.weights[k].numel() * 4 for b in host.parts.values() for k in b.weights)
    host.host_to_device = 0
    host.load_weights("layers", 0, torch.bfloat16)
    assert host.host_to_device * 2 * host.parts["layers"].rows < masters


def test_weight_copies_follow_written_weights():
    """Initial weights and write_part_state (checkpoint loading) refresh the copies."""
    config = small_config("--precision", "bfloat16", "--weights_placement", "host")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    buffers = engine.state.parts["head"]
    assert torch.equal(
        buffers.weight_copies["tp2_vector"], buffers.weights["tp2_vector"].bfloat16()
    )
    full = {k: v + 0.5 for k, v in read_part_state(engine, "head", 0).items()}
    write_part_state(engine, "head", 0, "weights", full)
    assert torch.equal(
        buffers.weight_copies["tp2_vector"], buffers.weights["tp2_vector"].bfloat16()
    )
    loaded = engine.state.load_weights("head", 0, torch.bfloat16)["ln_f.weight"]
    assert torch.equal(loaded, full["ln_f.weight"].bfloat16())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_prefetch_changes_no_number_and_no_load(precision):
    """--prefetch true and false, all remote with 2 passes and dropout: bitwise equal steps,
    the same bytes over the host link (each prefetch replaces a load, none is wasted), and
    prefetch serves the loads after the first phase. (Overlapped communication would load
    ahead whatever --prefetch says: its all-gathers start from the loaded shards.)"""
    flags = shlex.split(
        f"--precision {precision} --dropout_prob 0.1 --passes 2 --placement remote "
        "--overlap_communication false"
    )
    runs = {}
    for prefetch in ("true", "false"):
        config = small_config(*flags, "--prefetch", prefetch)
        engine = planned_engine(config, ParallelLayout.single(CPU))
        batches = global_batches(config, STEPS)
        losses = [
            engine.train_step(replica_batch(config, batches[s], 0), s, 2e-3).loss
            for s in range(STEPS)
        ]
        runs[prefetch] = {
            "losses": losses,
            "weights": full_state(engine),
            "exp_avg_sq": full_state(engine, "exp_avg_sq"),
            "loaded": engine.state.host_to_device,
            "prefetched": engine.state.prefetch_hits,
        }
    on, off = runs["true"], runs["false"]
    assert on["losses"] == off["losses"] and on["loaded"] == off["loaded"]
    for name, t in off["weights"].items():
        assert torch.equal(on["weights"][name], t), name
        assert torch.equal(on["exp_avg_sq"][name], off["exp_avg_sq"][name]), name
    assert off["prefetched"] == 0
    # Per pass 2L + 4 loads (the head's phase loads the tied embedding too), all prefetched
    # but the step's first phase's and the second pass's embedding forward, which follows the
    # first pass's embedding backward (the same part, not loaded twice).
    layers = config.model.layers
    assert on["prefetched"] == STEPS * (2 * (2 * layers + 4) - 2)


# ----------------------------------------------------------------- the same at (2, 2, 2)


def _passes_rank(configs: dict) -> dict:
    return {name: train(config, world_layout(config)) for name, config in configs.items()}


@pytest.mark.slow
def test_passes_and_placements_at_2x2x2(tmp_path):
    """On (dp, tp1, tp2) = (2, 2, 2) with 4 micro-batches per replica and dropout: 1 pass all
    remote, 2 passes with mixed placements and 4 passes resident agree to 1e-6."""
    batch = shlex.split("--global_batch_size 8 --micro_batch_size 1 --dropout_prob 0.1")
    flags = [*layout_flags(2, 2, 2), *batch]
    configs = {
        "1 pass, remote": small_config(*flags, "--passes", "1", "--placement", "remote"),
        "2 passes, mixed": small_config(
            *flags, "--passes", "2", *placement_flags("host", "device", "host")
        ),
        "4 passes, resident": small_config(*flags, "--passes", "4", "--placement", "resident"),
    }
    ranks = run_ranks(_passes_rank, 8, tmp_path, configs, timeout=240)
    for rank, runs in enumerate(ranks):
        reference = runs["1 pass, remote"]
        for name, run in runs.items():
            assert_runs_close(run, reference, TOLERANCE, f"rank {rank}, {name}")
    assert all(r["1 pass, remote"]["losses"] == ranks[0]["1 pass, remote"]["losses"] for r in ranks)


# ----------------------------------------------------------------- bytes


def hand_activation_bytes(layers, entries, micro_batch, sequence, hidden, tp1, tp2, itemsize):
    """x: layers + 1 boundaries, each entry's tp1 slice (padded up); dx: two boundaries."""
    entry = micro_batch * sequence * hidden // tp2
    return ((layers + 1) * entries * math.ceil(entry / tp1) + 2 * entries * entry) * itemsize


@pytest.mark.parametrize("dp,tp1,tp2", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 3, 1), (1, 2, 2)])
@pytest.mark.parametrize("passes", [1, 2, 4])
@pytest.mark.parametrize("weights", ["device", "host"])
def test_allocated_bytes_equal_the_plan(dp, tp1, tp2, passes, weights):
    """Every state's allocated bytes equal the planner's prediction exactly, and activation
    bytes shrink with tp1 and with the passes as the hand formula says. Host weights keep
    bfloat16 copies: half the bytes of the float32 masters. The same for each --recompute:
    x and dx, plus what each layer keeps per micro-batch (nothing with full recompute)."""
    run = shlex.split(
        f"--global_batch_size {8 * dp} --micro_batch_size 2 --heads 6 --hidden_size 36 "
        f"--precision bfloat16 --passes {passes} --weights_placement {weights}"
    )
    for recompute in ("full", "selective", "none"):
        flags = [*run, *layout_flags(dp, tp1, tp2), "--recompute", recompute]
        config = small_config(*flags)
        engine = planned_engine(config, ParallelLayout.shapes_only(dp, tp1, tp2, CPU))
        assert engine.memory.recompute == recompute
        allocated = engine.buffer_bytes()
        rank = RankShape.of(RunShape.of(config))
        plan = engine.memory
        predicted = state_bytes(rank, plan.micro_batches_per_pass, plan.placement, plan.kept)
        assert allocated == predicted == plan.state_bytes
        want_copies = allocated["weights"] // 2 if weights == "host" else 0
        assert allocated["weight_copies"] == want_copies
        entries = 4 // passes  # 4 micro-batches per replica
        seq = config.model.sequence_length
        x_dx = hand_activation_bytes(2, entries, 2, seq, 36, tp1, tp2, 2)
        assert allocated["activations"] == x_dx + 2 * entries * plan.kept
        assert (plan.kept == 0) == (recompute == "full")


def test_engine_allocates_where_the_plan_says(monkeypatch):
    """Host-placed states are 'remote' (copied per phase); device-placed ones are used in place."""
    config = small_config(*placement_flags("host", "device", "host"))
    engine = planned_engine(config, ParallelLayout.single(CPU))
    places = engine.state.places
    assert places["weights"].remote and places["activations"].remote
    assert not places["grads"].remote
    loaded = engine.state.load_weights("head", 0, torch.float32)["ln_f.weight"]
    stored = engine.state.parts["head"].weights["tp2_vector"][0]
    assert loaded.data_ptr() != stored.data_ptr()  # a real copy from the host
    resident = planned_engine(small_config("--placement", "resident"), ParallelLayout.single(CPU))
    loaded = resident.state.load_weights("head", 0, torch.float32)["ln_f.weight"]
    stored = resident.state.parts["head"].weights["tp2_vector"][0]
    assert loaded.data_ptr() == stored.data_ptr()  # used in place


# ----------------------------------------------------------------- stream protocol, on a CPU


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event: _Event) -> None:
        assert event.stream is not None, "waited for an event never recorded"
        self.log.append((self.name, "wait_event", event.stream))


class _Event:
    log: typing.ClassVar[list] = []  # the test points it at its own log

    def __init__(self):
        self.stream = None

    def record(self, stream: _Stream) -> None:
        self.stream = stream.name

    def synchronize(self) -> None:
        assert self.stream is not None, "synchronized with an event never recorded"
        self.log.append(("host", "synchronize", self.stream))


def _cuda_side_stream(stand_in: _Stream) -> CudaStream:
    """The engine's CUDA side stream around a stand-in stream (no GPU needed)."""
    side = CudaStream.__new__(CudaStream)
    side.device, side.stream, side.delay_cycles = CPU, stand_in, 0
    return side


def test_cuda_stream_protocol_with_stand_in_streams(monkeypatch):
    """The CUDA bookkeeping of prefetch and activation stores, run on a CPU with stand-in
    streams and events (copies then happen at once, so the numbers must not change): weight
    loads issued ahead run on the copy stream after it waited for the compute stream, the
    compute stream waits for their event before using them, activation stores run on the
    store stream, and every entry is read back only after waiting for its store."""
    flags = ["--precision", "bfloat16", "--passes", "2", "--placement", "remote"]
    flags += ["--recompute", "full"]  # kept tensors take the store stream too (late streams)
    config = small_config(*flags)
    batch = replica_batch(config, global_batches(config, 1)[0], 0)
    plain = planned_engine(config, ParallelLayout.single(CPU))
    plain_loss = plain.train_step(batch, 0, 2e-3).loss

    log: typing.ClassVar[list] = []  # the test points it at its own log
    engine = planned_engine(config, ParallelLayout.single(CPU))
    state = engine.state
    compute = _Stream("compute", log)
    state.loads, state.stores = (_cuda_side_stream(_Stream(n, log)) for n in ("copy", "store"))
    state.activations.stores = state.grads.stores = state.stores
    monkeypatch.setattr(_Event, "log", log)
    current = [compute]

    class _Use:  # torch.cuda.stream(s): makes s current inside the block
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", _Use)
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    def record_stream(tensor, stream):
        log.append((stream.name, "record_stream"))

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    for side, label in ((state.loads, "load"), (state.stores, "store")):

        def logged(work, outputs=(), inputs=(), submit=side.submit, label=label):
            def run() -> None:  # logs the stream current while the copy runs
                log.append((current[-1].name, label, len(outputs), outputs[0].dtype))
                work()

            return submit(run, outputs, inputs)

        side.submit = logged
    assert engine.train_step(batch, 0, 2e-3).loss == plain_loss
    for name, t in full_state(plain).items():
        assert torch.equal(full_state(engine)[name], t), name

    # Each prefetch: the copy stream waits for the compute stream, then copies its part.
    prefetches = [i for i, e in enumerate(log) if e == ("copy", "wait_stream", "compute")]
    assert len(prefetches) == state.prefetch_hits > 0
    assert all(log[i + 1][:2] == ("copy", "load") for i in prefetches)
    # Every shard copied ahead is marked as used on the compute stream.
    shards = sum(e[2] for e in log if e[:2] == ("copy", "load"))
    assert log.count(("compute", "record_stream")) == shards > 0
    waits = [e for e in log if e[1] == "wait_event"]
    assert all(e[0] == "compute" for e in waits)
    assert sum(e[2] == "copy" for e in waits) == state.prefetch_hits
    # x: L + 1 boundaries per pass, dx: L + 1 stored per pass; all read back after a wait
    layers, entries = config.model.layers, engine.memory.micro_batches_per_pass
    stores = 2 * 2 * (layers + 1) * entries
    assert log.count(("store", "store", 1, torch.bfloat16)) == stores
    # Gradients on the host: each phase's float32 rows per kind, in each of the 2 passes
    # (the head phase also starts the tied embedding's).
    kinds = {part: len(engine.specs[part]) for part in ("embedding", "layers", "head")}
    grads = 2 * (kinds["head"] + 2 * kinds["embedding"] + layers * kinds["layers"])
    assert log.count(("store", "store", 1, torch.float32)) == grads
    # Every store is waited for: by the compute stream before its entry (or the next
    # pass's gradient row) is read, or by the host once the phases are done.
    host_waits = [e for e in log if e[:2] == ("host", "synchronize")]
    assert all(e[2] == "store" for e in host_waits)
    assert sum(e[2] == "store" for e in waits) + len(host_waits) == stores + grads
    assert log.count(("store", "record_stream")) == stores + grads
