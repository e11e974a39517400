"""Each collective of the 2D tensor-parallel model and of RTS, forward and backward, on gloo ranks.

Every rank draws its inputs from seeds the parent can reproduce, runs the sharded computation
and returns its outputs and gradients; the parent runs the same computation unsharded on one
device with autograd and compares each rank's piece with the matching slice.
"""

from __future__ import annotations

import shlex

import pytest
import torch
import torch.nn.functional as F

from execution.engine.phases.gradients import start_reduction
from execution.parallel.mesh import ParallelLayout
from execution.parallel.sharding import MATRIX, SHARD_KINDS, TP1_VECTOR, TP2_VECTOR, shard_part
from modelling.gpt import EMBEDDING, PARTS, GPTShapes, init_full_part
from modelling.layers import Embedding, LayerNorm
from modelling.lm_heads import vocab_parallel_cross_entropy
from modelling.parallel import all_reduce_sum, copy_to, reduce_from
from tests.distributed import (
    CPU,
    coords,
    planned_engine,
    relative_error,
    run_ranks,
    small_config,
    world_layout,
)

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-6  # one float32 operation away from the single-device result
AXES = ("tp1", "tp2", "world")


def members(axis: str, rank: int, dp: int, tp1: int, tp2: int) -> list[int]:
    """Global ranks of ``rank``'s group on ``axis``, in group order (computed independently)."""
    d, i, j = coords(rank, tp1, tp2)
    world = range(dp * tp1 * tp2)
    same = {
        "dp": lambda r: coords(r, tp1, tp2)[1:] == (i, j),
        "cp": lambda r: r == rank,  # no context axis in these layouts: a group of one
        "tp1": lambda r: (coords(r, tp1, tp2)[0], coords(r, tp1, tp2)[2]) == (d, j),
        "tp2": lambda r: coords(r, tp1, tp2)[:2] == (d, i),
        "dp_tp1": lambda r: coords(r, tp1, tp2)[2] == j,
        "dp_tp2": lambda r: coords(r, tp1, tp2)[1] == i,
        "world": lambda r: True,
    }[axis]
    return [r for r in world if same(r)]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------- rank order and groups


def _group_members_rank() -> dict[str, list[int]]:
    layout = ParallelLayout.build(2, 2, 2, CPU)
    me = torch.tensor([float(layout.rank)])
    return {a.name: [int(v) for v in a.all_gather(me)] for a in layout.axes()}


def test_groups_follow_the_rank_order_of_the_design(tmp_path):
    """Gathering the global rank over each axis lists the group's members in group order."""
    for rank, groups in enumerate(run_ranks(_group_members_rank, 8, tmp_path)):
        for axis, got in groups.items():
            assert got == members(axis, rank, 2, 2, 2), (rank, axis)


# ----------------------------------------------------------------- f, g and their sum

SHAPE = (3, 5)


def _conjugates_rank() -> dict:
    """f, g and all_reduce_sum over tp1, tp2 and the world of a (1, 2, 2) layout."""
    layout = ParallelLayout.build(1, 2, 2, CPU)
    r = layout.rank
    out = {}
    for name in AXES:
        axis = getattr(layout, name)
        # f: every member holds the same x (seeded by the group), each consumes it differently.
        x = randn(*SHAPE, seed=members(name, r, 1, 2, 2)[0]).requires_grad_()
        y = copy_to(x, axis)
        (y * randn(*SHAPE, seed=100 + r)).sum().backward()
        out[f"f/{name}"] = (y.detach(), x.grad)
        # g: members hold partial sums; the consumer of the sum is replicated (same weights).
        x = randn(*SHAPE, seed=200 + r).requires_grad_()
        y = reduce_from(x, axis)
        (y * randn(*SHAPE, seed=300)).sum().backward()
        out[f"g/{name}"] = (y.detach(), x.grad)
        # Sum in both directions: every member's output depends on every member's input.
        x = randn(*SHAPE, seed=400 + r).requires_grad_()
        y = all_reduce_sum(x, axis)
        (y * randn(*SHAPE, seed=500 + r)).sum().backward()
        out[f"sum/{name}"] = (y.detach(), x.grad)
    return out


def test_conjugate_collectives_forward_and_backward(tmp_path):
    results = run_ranks(_conjugates_rank, 4, tmp_path)
    for rank, result in enumerate(results):
        for name in AXES:
            group = members(name, rank, 1, 2, 2)
            # Single device: the group's computation with every member's term.
            x = randn(*SHAPE, seed=group[0]).requires_grad_()
            sum((x * randn(*SHAPE, seed=100 + k)).sum() for k in group).backward()
            expect = {"f": (x.detach(), x.grad)}
            xs = [randn(*SHAPE, seed=200 + k).requires_grad_() for k in group]
            y = torch.stack(xs).sum(0)
            (y * randn(*SHAPE, seed=300)).sum().backward()
            expect["g"] = (y.detach(), xs[group.index(rank)].grad)
            xs = [randn(*SHAPE, seed=400 + k).requires_grad_() for k in group]
            y = torch.stack(xs).sum(0)
            sum((y * randn(*SHAPE, seed=500 + k)).sum() for k in group).backward()
            expect["sum"] = (y.detach(), xs[group.index(rank)].grad)
            for fn, (want_y, want_grad) in expect.items():
                got_y, got_grad = result[f"{fn}/{name}"]
                assert relative_error(got_y, want_y) <= TOLERANCE, (rank, fn, name, "forward")
                assert relative_error(got_grad, want_grad) <= TOLERANCE, (rank, fn, name)


# ----------------------------------------------------------------- sharded layer norm

HIDDEN = 32


def _layer_norm_inputs() -> tuple[torch.Tensor, ...]:
    # An offset of 50 would ruin a one-pass E[x^2] - E[x]^2 variance in float32.
    x = randn(2, 3, HIDDEN, seed=1) + 50.0
    return x, randn(HIDDEN, seed=2), randn(HIDDEN, seed=3), randn(2, 3, HIDDEN, seed=4)


def _layer_norm_rank() -> dict:
    layout = ParallelLayout.build(1, 1, 4, CPU)
    j, parts = layout.tp2.rank, layout.tp2.size
    x, weight, bias, upstream = (t.chunk(parts, -1)[j] for t in _layer_norm_inputs())
    norm = LayerNorm(HIDDEN // parts, layout.tp2, eps=1e-5)
    norm.load_state_dict({"weight": weight, "bias": bias})
    x = x.clone().requires_grad_()
    y = norm(x)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dweight": norm.weight.grad, "dbias": norm.bias.grad}


def test_layer_norm_over_tp2_forward_and_backward(tmp_path):
    x, weight, bias, upstream = _layer_norm_inputs()
    x, weight, bias = (t.clone().requires_grad_() for t in (x, weight, bias))
    y = F.layer_norm(x, (HIDDEN,), weight, bias, eps=1e-5)
    (y * upstream).sum().backward()
    full = {"y": y.detach(), "dx": x.grad, "dweight": weight.grad, "dbias": bias.grad}
    for j, result in enumerate(run_ranks(_layer_norm_rank, 4, tmp_path)):
        for name, t in full.items():
            err = relative_error(result[name], t.chunk(4, -1)[j])
            assert err <= 1e-5, f"tp2 rank {j} {name}: relative error {err:.2e}"


# ----------------------------------------------------------------- vocab-sharded cross-entropy

TOKENS = 12


def _cross_entropy_inputs(vocab: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = randn(TOKENS, padded, seed=vocab)
    logits[:, vocab:] = 30.0  # padding columns must be ignored however large
    labels = torch.randint(0, vocab, (TOKENS,), generator=torch.Generator().manual_seed(7))
    labels[:2] = torch.tensor([0, vocab - 1])  # first and last real token
    return logits, labels


def _cross_entropy_rank(cases: list[tuple[int, int]]) -> dict:
    layout = ParallelLayout.build(1, 4, 1, CPU)
    out = {}
    for vocab, padded in cases:
        logits, labels = _cross_entropy_inputs(vocab, padded)
        local = logits.chunk(4, -1)[layout.tp1.rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, layout.tp1, vocab)
        loss.backward()
        out[vocab] = (loss.detach(), local.grad)
    return out


def test_vocab_sharded_cross_entropy_forward_and_backward(tmp_path):
    """Vocab 1000 (shards of 256 with 24 padding rows at the end) and 20, whose last two
    shards of 16 rows are all padding."""
    cases = [(1000, GPTShapes(1, 4, 1, 1000, 1, 0, 1e-5, tp1=4).vocab_padded), (20, 64)]
    assert cases[0][1] == 1024
    results = run_ranks(_cross_entropy_rank, 4, tmp_path, cases)
    for vocab, padded in cases:
        logits, labels = _cross_entropy_inputs(vocab, padded)
        logits.requires_grad_()
        loss = F.cross_entropy(logits[:, :vocab], labels)
        loss.backward()
        for i, result in enumerate(results):
            got_loss, got_grad = result[vocab]
            assert relative_error(got_loss, loss.detach()) <= TOLERANCE, (vocab, i)
            want = logits.grad.chunk(4, -1)[i]  # zero on padding columns
            assert relative_error(got_grad, want) <= TOLERANCE, (vocab, i)


# ----------------------------------------------------------------- sharded embeddings


def _embedding_shapes() -> GPTShapes:
    sizes = dict(layers=1, hidden=HIDDEN, heads=4, vocab=1000, positions=10)
    return GPTShapes(**sizes, dropout_prob=0.0, layer_norm_eps=1e-5, tp1=2, tp2=2)


def _embedding_inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    full = init_full_part(_embedding_shapes(), EMBEDDING, 0, seed=3, init_std=0.02)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(5))
    ids[0, :3] = torch.tensor([0, 503, 999])  # both shards' ends
    return full, ids, randn(2, 9, HIDDEN, seed=6)


def _embedding_rank() -> dict:
    layout = ParallelLayout.build(1, 2, 2, CPU)
    s = _embedding_shapes()
    full, ids, upstream = _embedding_inputs()
    i, j = layout.tp1.rank, layout.tp2.rank
    module = Embedding(s.vocab_padded // 2, s.positions_padded // 2, HIDDEN // 2, 0.0, layout.tp1)
    module.load_state_dict(shard_part(EMBEDDING, full, s, i, j))
    y = module(ids)
    (y * upstream.chunk(2, -1)[j]).sum().backward()
    return {"y": y.detach(), "grads": {n: p.grad for n, p in module.named_parameters()}}


def test_vocab_and_position_sharded_embedding_forward_and_backward(tmp_path):
    """Rows over tp1 (out-of-shard ids give zeros, then g over tp1), columns over tp2."""
    s = _embedding_shapes()
    full, ids, upstream = _embedding_inputs()
    word = full["word.weight"].clone().requires_grad_()
    position = full["position.weight"].clone().requires_grad_()
    y = F.embedding(ids, word) + F.embedding(torch.arange(9).expand_as(ids), position)
    (y * upstream).sum().backward()
    grads = {"word.weight": word.grad, "position.weight": position.grad}
    for rank, result in enumerate(run_ranks(_embedding_rank, 4, tmp_path)):
        _, i, j = coords(rank, 2, 2)
        assert relative_error(result["y"], y.detach().chunk(2, -1)[j]) <= TOLERANCE, rank
        want = shard_part(EMBEDDING, grads, s, i, j)  # padding rows get zero gradient
        for name, t in want.items():
            assert relative_error(result["grads"][name], t) <= TOLERANCE, (rank, name)


# ----------------------------------------------------------------- RTS gather and reduction

RTS_LAYOUT = (2, 2, 2)


def _gradient_seed(rank: int, kind: str) -> int:
    """Seed of ``rank``'s accumulated gradient of ``kind``; the parent redraws it from this."""
    return 1000 * rank + SHARD_KINDS.index(kind)


def _rts_rank() -> dict:
    """Loads (all-gather) and gradient reductions (reduce-scatter or all-reduce + slice)."""
    layout_flags = shlex.split("--data_parallel 2 --tensor_parallel_1 2 --tensor_parallel_2 2")
    config = small_config(*layout_flags)
    layout = world_layout(config)
    engine = planned_engine(config, layout)
    loaded = {part: engine.state.load_weights(part, 0, engine.dtype) for part in PARTS}
    reduced = {}
    for part in PARTS:
        acc = {
            kind: randn(spec.padded, seed=_gradient_seed(layout.rank, kind))
            for kind, spec in engine.specs[part].items()
        }
        # Started as the overlapped schedule starts them, then waited for.
        reduced[part] = {
            kind: wait()
            for kind, wait in start_reduction(
                acc, engine.rts, layout.dp_cp, layout.dp.size, True
            ).items()
        }
    primitives = {}
    for axis in layout.axes():
        x = randn(6, seed=layout.rank)
        primitives[axis.name] = {
            "all_gather": axis.all_gather(x),
            "reduce_scatter": axis.reduce_scatter(randn(6 * axis.size, seed=layout.rank)),
            "sum": axis.all_reduce_(x.clone()),
            "max": axis.all_reduce_(x.clone(), op="max"),
            "min": axis.all_reduce_(x.clone(), op="min"),
        }
    padded = {part: {k: s.padded for k, s in engine.specs[part].items()} for part in PARTS}
    return {"loaded": loaded, "reduced": reduced, "primitives": primitives, "padded": padded}


def test_rts_gather_and_gradient_reduction(tmp_path):
    """Forward: a phase's load all-gathers the RTS shards into this rank's tp shard.
    Backward: gradients are averaged over dp and each rank keeps its RTS slice: a
    reduce-scatter for matrices (RTS over dp), all-reduce over dp then a slice over dp x tp1
    (tp2 vectors) or dp x tp2 (tp1 vectors)."""
    dp, tp1, tp2 = RTS_LAYOUT
    config = small_config()
    shapes = GPTShapes.from_config(config.model, tp1, tp2)
    rts_axis = {MATRIX: "dp", TP2_VECTOR: "dp_tp1", TP1_VECTOR: "dp_tp2"}
    results = run_ranks(_rts_rank, dp * tp1 * tp2, tmp_path)
    for rank, result in enumerate(results):
        _, i, j = coords(rank, tp1, tp2)
        for part in PARTS:
            full = init_full_part(shapes, part, 0, config.training.seed, config.model.init_std)
            for name, t in shard_part(part, full, shapes, i, j).items():
                assert torch.equal(result["loaded"][part][name], t), (rank, part, name)
            for kind, shard in result["reduced"][part].items():
                group = members(rts_axis[kind], rank, dp, tp1, tp2)
                replicas = members("dp", rank, dp, tp1, tp2)
                padded = result["padded"][part][kind]
                mean = sum(randn(padded, seed=_gradient_seed(r, kind)) for r in replicas)
                want = (mean / dp).view(len(group), -1)[group.index(rank)]
                assert relative_error(shard, want) <= TOLERANCE, (rank, part, kind)
        for axis, got in result["primitives"].items():
            group = members(axis, rank, dp, tp1, tp2)
            xs = torch.stack([randn(6, seed=r) for r in group])
            full = torch.stack([randn(6 * len(group), seed=r) for r in group]).sum(0)
            want = {
                "all_gather": xs.reshape(-1),
                "reduce_scatter": full.view(len(group), -1)[group.index(rank)],
                "sum": xs.sum(0),
                "max": xs.amax(0),
                "min": xs.amin(0),
            }
            for op, t in want.items():
                assert relative_error(got[op], t) <= TOLERANCE, (rank, axis, op)
