"""What the distributed schedule does besides computing the right numbers: how many collectives
it issues, where dropout masks must agree, and how RTS divides the host buffers by the
data-parallel degree (docs/design.md: "Sharding rules", "The phases of a step" and "Replicated
tensor sharding")."""

from __future__ import annotations

import shlex

import pytest
import torch
import torch.distributed as dist

from execution.parallel.mesh import GroupAxis, ParallelLayout
from execution.parallel.sharding import shard_part
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, GPTShapes, init_full_part
from tests.distributed import (
    CPU,
    coords,
    global_batches,
    layout_flags,
    planned_engine,
    replica_batch,
    run_ranks,
    single_process_run,
    small_config,
    world_layout,
)

pytestmark = pytest.mark.distributed


# ----------------------------------------------------------------- collectives of the model


def _model_counts_rank() -> dict:
    """Counts (and payload sizes of) the collectives of each part of a (1, 2, 2) model.

    Layer norms get their own counter on the same tp2 process group, so their statistic
    reductions are counted apart from the f/g collectives.
    """
    config = small_config()
    layout = ParallelLayout.build(1, 2, 2, CPU)
    tp1, tp2 = layout.tp1, layout.tp2
    shapes = GPTShapes.from_config(config.model, 2, 2)
    model = GPT(shapes, tp1, tp2)
    for part, module in ((EMBEDDING, model.embedding), (HEAD, model.head)):
        full = init_full_part(shapes, part, 0, 0, 0.02)
        module.load_state_dict(shard_part(part, full, shapes, tp1.rank, tp2.rank))
    block = model.layers[0]
    full = init_full_part(shapes, LAYERS, 0, 0, 0.02)
    block.load_state_dict(shard_part(LAYERS, full, shapes, tp1.rank, tp2.rank))
    norms = GroupAxis("tp2 layer-norm statistics", tp2.size, tp2.rank, tp2.group)
    for norm in (block.ln_1, block.ln_2, model.head.ln_f):
        norm.tp2 = norms
    axes = {"tp1": tp1, "tp2": tp2, "norms": norms}

    payloads: list[int] = []
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        payloads.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce  # this forked rank only

    counts: dict[str, dict[str, dict[str, int]]] = {}

    def counted(name: str, fn) -> torch.Tensor:
        for axis in axes.values():
            axis.calls.clear()
        payloads.clear()
        result = fn()
        counts[name] = {a: dict(axis.calls) for a, axis in axes.items()}
        counts[name]["max_payload"] = max(payloads, default=0)
        return result

    ids = torch.randint(0, shapes.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    x = counted("embedding forward", lambda: model.embedding(ids))
    counted("embedding backward", lambda: x.sum().backward())
    x = x.detach().requires_grad_()
    y = counted("layer forward", lambda: block(x))
    counted("layer backward", lambda: y.sum().backward())
    y = y.detach().requires_grad_()
    word = model.embedding.word.weight
    loss = counted("head forward", lambda: model.head(y, word, ids, shapes.vocab))
    counted("head backward", lambda: loss.backward())
    return counts


def test_collectives_per_part_match_the_design(tmp_path):
    """Per decoder layer: 4 g forward (qkv and fc over tp2, attention-out and proj over tp1)
    and 4 f backward (the mirror images), 8 all-reduces, plus 2 statistic reductions per
    layer norm each way. Embedding: 1 (g over tp1). Head: 5 (g over tp2 on the logits, max,
    target and sum-exp over tp1, f over tp1 backward), none of them carrying more than this
    rank's [tokens, V / tp1] logits."""
    sum_ = "all_reduce_sum"
    expected = {
        "layer forward": {"tp1": {sum_: 2}, "tp2": {sum_: 2}, "norms": {sum_: 4}},
        "layer backward": {"tp1": {sum_: 2}, "tp2": {sum_: 2}, "norms": {sum_: 4}},
        "embedding forward": {"tp1": {sum_: 1}, "tp2": {}, "norms": {}},
        "embedding backward": {"tp1": {}, "tp2": {}, "norms": {}},
        "head forward": {
            "tp1": {sum_: 2, "all_reduce_max": 1},
            "tp2": {sum_: 1},
            "norms": {sum_: 2},
        },
        "head backward": {"tp1": {sum_: 1}, "tp2": {}, "norms": {sum_: 2}},
    }
    shapes = GPTShapes.from_config(small_config().model, 2, 2)
    tokens = 2 * 8
    tensor_axes = ("tp1", "tp2")
    layer_phases = ("layer forward", "layer backward")
    head_phases = ("head forward", "head backward")
    for counts in run_ranks(_model_counts_rank, 4, tmp_path):
        for phase, want in expected.items():
            got = {axis: counts[phase][axis] for axis in want}
            assert got == want, phase
        per_layer = sum(counts[p][a].get(sum_, 0) for p in layer_phases for a in tensor_axes)
        assert per_layer == 8
        head = sum(sum(counts[p][a].values()) for p in head_phases for a in tensor_axes)
        assert head == 5
        # The largest head collective is the tp2 sum of the local logits, never full logits.
        assert counts["head forward"]["max_payload"] == tokens * shapes.vocab_padded // 2


# ----------------------------------------------------------------- collectives of the phases


def _phase_counts_rank(configs: list) -> list[dict[str, dict[str, int]]]:
    layout = world_layout(configs[0])
    out = []
    for config in configs:
        engine = planned_engine(config, layout)
        batch = replica_batch(config, global_batches(config, 1)[0], layout.dp.rank)
        for axis in layout.axes():
            axis.calls.clear()
        engine.train_step(batch, 0, 1e-3)
        out.append({axis.name: dict(axis.calls) for axis in layout.axes()})
    return out


def test_each_phase_loads_its_weights_once_whatever_the_accumulation(tmp_path):
    """Per step on (2, 2, 2), with 1 and with 2 micro-batches per replica: the RTS traffic
    (all-gathers, gradient reduce-scatters and all-reduces over dp) is the same, the tensor-
    parallel all-reduces grow with the micro-batches. With 2 passes over 2 micro-batches the
    RTS traffic doubles and the tensor-parallel traffic does not change. L layers, RTS groups:
    matrices over dp, tp2 vectors over dp x tp1, tp1 vectors over dp x tp2."""
    L = 2
    runs = [(1, 1), (2, 1), (2, 2)]  # (micro-batches per replica, passes)
    configs = []
    for ga, passes in runs:
        sizes = f"--global_batch_size {2 * ga} --micro_batch_size 1 --passes {passes}"
        # Full recompute: each layer's forward runs again in its backward (counted below).
        sizes += " --recompute full"
        configs.append(small_config(*layout_flags(2, 2, 2), *shlex.split(sizes)))

    def rts(passes: int) -> dict:
        # embedding fwd, L layers fwd, tied word embedding in the head, L layers bwd, embedding
        # bwd: once per pass
        return {
            "dp": {
                "all_gather": (2 * L + 3) * passes,
                "reduce_scatter": (L + 2) * passes,
                # vector grads of every layer (2 kinds) and of the head, plus the loss mean
                "all_reduce_sum": (2 * L + 1) * passes + 1,
            },
            "dp_tp1": {"all_gather": (2 * L + 1) * passes},  # layer norms, output biases, ln_f
            "dp_tp2": {"all_gather": 2 * L * passes},  # qkv and fc biases
            "world": {"all_reduce_sum": 1},  # the global gradient norm
        }

    # Per micro-batch, tp1: embedding g in its forward and its recompute (2); per layer 2 g
    # forward, 2 g recompute, 2 f backward; head max, target and sum-exp forward, 1 f backward.
    # x is stored sharded over tp1: each of the 2L + 1 fetches (L layers forward, the head,
    # L recomputes) gathers it.
    tp1_per_micro = {
        "all_reduce_sum": 2 + 6 * L + 2 + 1,
        "all_reduce_max": 1,
        "all_gather": 2 * L + 1,
    }
    # tp2: per layer (2 g + 4 norm statistics) forward, the same recomputed, (2 f + 4 norm
    # statistics) backward; head: ln_f 2 forward + 2 backward and the logits' g.
    tp2_per_micro = {"all_reduce_sum": 18 * L + 5}
    for counts in run_ranks(_phase_counts_rank, 8, tmp_path, configs):
        for (ga, passes), step in zip(runs, counts, strict=True):
            for axis, want in rts(passes).items():
                assert step[axis] == want, (ga, passes, axis)
            assert step["tp1"] == {k: ga * v for k, v in tp1_per_micro.items()}, (ga, passes)
            assert step["tp2"] == {k: ga * v for k, v in tp2_per_micro.items()}, (ga, passes)


# ----------------------------------------------------------------- dropout consistency


def _dropout_rank(config) -> dict:
    layout = world_layout(config)
    engine = planned_engine(config, layout)
    attention_outputs = []
    # The attention output before its projection is replicated over tp2 (whole heads).
    engine.templates[LAYERS].attn.out.register_forward_pre_hook(
        lambda module, args: attention_outputs.append(args[0].detach().clone())
    )
    batch = replica_batch(config, global_batches(config, 1)[0], layout.dp.rank)
    result = engine.train_step(batch, 0, 1e-3)
    entries = range(engine.memory.micro_batches_per_pass)
    boundaries = range(config.model.layers + 1)
    return {
        "loss": result.loss,
        # x as the layers see it (each tp1 rank stores a slice; fetching gathers them)
        "x": torch.stack(
            [
                torch.stack([engine.state.activations.fetch_x(n, e) for e in entries])
                for n in boundaries
            ]
        ),
        "dx": engine.state.activations.dx.clone(),
        "attention": torch.stack(attention_outputs),
    }


def test_dropout_masks_agree_where_tensors_are_replicated(tmp_path):
    """With dropout 0.1 on (2, 2, 2): the residual stream x and its gradient stay bitwise
    identical across tp1 (residual and embedding masks agree there), attention outputs stay
    identical across tp2 (attention-probability masks agree there), and different tp2 shards
    apply different blocks of the whole tensor's residual mask."""
    config = small_config(*layout_flags(2, 2, 2), "--dropout_prob", "0.1")
    results = run_ranks(_dropout_rank, 8, tmp_path, config)
    by_coords = {coords(r, 2, 2): result for r, result in enumerate(results)}
    for (d, i, j), result in by_coords.items():
        for key in ("x", "dx"):
            assert torch.equal(result[key], by_coords[d, 1 - i, j][key]), (d, i, j, key)
        assert torch.equal(result["attention"], by_coords[d, i, 1 - j]["attention"]), (d, i, j)
        # The embedding output (row 0 of x) is zero exactly where its mask dropped.
        dropped = result["x"][0] == 0
        assert 0.05 < dropped.float().mean() < 0.15
        assert not torch.equal(dropped, by_coords[d, i, 1 - j]["x"][0] == 0)
    without_dropout = single_process_run(small_config(), global_batches(config, 1))
    dropout_free = without_dropout["steps"][0]["loss"]
    assert all(r["loss"] == results[0]["loss"] for r in results)
    assert results[0]["loss"] != pytest.approx(dropout_free, rel=1e-4), "dropout had no effect"


# ----------------------------------------------------------------- RTS memory


def _buffer_bytes_rank(config) -> dict[str, int]:
    return planned_engine(config, world_layout(config)).buffer_bytes()


def memory_config(*flags: str):
    """Vocabulary 1024 needs no padding for tp1 1 or 2, and the flat buffers are large
    enough that padding them to a multiple of the RTS group is far below 1%."""
    base = "--hidden_size 64 --vocab_size 1024 --global_batch_size 8 --micro_batch_size 1"
    return small_config(*shlex.split(base), *flags)


@pytest.mark.parametrize("tp", [(1, 1), (2, 2)], ids=["no-tp", "tp2x2"])
def test_rts_divides_host_buffers_by_data_parallel(tmp_path, tp):
    """Per rank, weights, gradients, both AdamW moments and activations shrink by dp (within
    1%), and summed over all ranks the optimizer state is the single-process amount: no two
    replicas keep the same element."""
    single = planned_engine(memory_config(), ParallelLayout.single(CPU)).buffer_bytes()
    per_dp = {}
    for dp in (1, 2, 4) if tp == (1, 1) else (1, 2):
        config = memory_config(*layout_flags(dp, *tp))
        ranks = run_ranks(_buffer_bytes_rank, config.world_size, tmp_path / f"dp{dp}", config)
        assert all(r == ranks[0] for r in ranks), "ranks of one layout hold equal shares"
        per_dp[dp] = ranks[0]
        world = config.world_size
        for state in ("weights", "optimizer", "grads"):
            assert world * ranks[0][state] == pytest.approx(single[state], rel=0.01), state
    for dp, got in per_dp.items():
        for state, nbytes in got.items():
            assert nbytes == pytest.approx(per_dp[1][state] / dp, rel=0.01), (dp, state)
    assert sum(per_dp[2].values()) == pytest.approx(sum(per_dp[1].values()) / 2, rel=0.01)
