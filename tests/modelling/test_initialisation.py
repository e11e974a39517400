"""Shard-local initialisation: every layout starts from bit-identical weights.

Each rank draws only the tiles its shard touches (``init_part_shard``); these tests check that
this equals slicing the full part with the sharding rules, that the shards put back together
give the full part, and that the per-tile draws have the intended statistics.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from execution.parallel.sharding import init_part_shard, shard_part, unshard_part
from modelling.gpt import (
    EMBEDDING,
    HEAD,
    LAYERS,
    NORMAL,
    GPTShapes,
    init_full_part,
    part_inits,
)
from modelling.tiles import INIT_TILE

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4)]
SEED, STD = 7, 0.02

# Trunc-normal cut at +-2 std keeps 1 - 4 * pdf(2) / (cdf(2) - cdf(-2)) of the variance.
_PDF2 = math.exp(-2) / math.sqrt(2 * math.pi)
TRUNCATED_STD_FACTOR = math.sqrt(1 - 4 * _PDF2 / math.erf(2 / math.sqrt(2)))


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def shapes_for(tp1: int, tp2: int, vocab: int, hidden: int = 320, layers: int = 2) -> GPTShapes:
    """Tensors wider than one tile and not a multiple of it, so shards cut through tiles;
    301 positions and vocab 211 or 50257 need padding rows at every tp1 > 1."""
    sizes = dict(layers=layers, hidden=hidden, heads=20, vocab=vocab, positions=301)
    return GPTShapes(**sizes, dropout_prob=0.0, layer_norm_eps=1e-5, tp1=tp1, tp2=tp2)


# The decoder layer and head do not depend on the vocabulary, so the large vocabulary (padded to
# 50272 rows, shards cutting through tiles) is checked on the embedding alone, at a narrower
# hidden size to keep the test fast.
CASES = [(LAYERS, 211, 320), (HEAD, 211, 320), (EMBEDDING, 211, 320), (EMBEDDING, 50257, 160)]


@functools.cache
def full_part(part: str, vocab: int, hidden: int) -> dict[str, torch.Tensor]:
    """The full part, drawn once per case: it does not depend on the layout (tested below)."""
    return init_full_part(shapes_for(1, 1, vocab, hidden), part, 1, SEED, STD)


@pytest.mark.parametrize(("part", "vocab", "hidden"), CASES)
@pytest.mark.parametrize(("tp1", "tp2"), LAYOUTS)
def test_shards_equal_slices_of_the_full_part(
    tp1: int, tp2: int, part: str, vocab: int, hidden: int
) -> None:
    shapes = shapes_for(tp1, tp2, vocab, hidden)
    full = full_part(part, vocab, hidden)
    shards = {}
    for i in range(tp1):
        for j in range(tp2):
            want = shard_part(part, full, shapes, i, j)
            got = init_part_shard(shapes, part, 1, SEED, STD, i, j)
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert got[name].dtype == torch.float32
                assert got[name].shape == t.shape, (part, name, i, j)
                assert torch.equal(got[name], t), f"{part}.{name} shard ({i}, {j}) differs"
            shards[i, j] = got
    back = unshard_part(part, shards, shapes)
    for name, t in full.items():
        assert torch.equal(back[name], t), f"{part}.{name}: unsharded shards differ"


def test_statistics() -> None:
    shapes = shapes_for(1, 1, 211, hidden=1024, layers=4)
    full = init_full_part(shapes, LAYERS, 3, SEED, STD)
    residual = STD / math.sqrt(2 * shapes.layers)
    for name, std in (("mlp.fc.weight", STD), ("mlp.proj.weight", residual)):
        t = full[name]
        assert abs(t.std().item() / (std * TRUNCATED_STD_FACTOR) - 1) < 0.02, name
        assert abs(t.mean().item()) < 0.01 * std, name
        assert t.abs().max().item() <= 2 * std, f"{name} not truncated at 2 std"
    for name in ("ln_1.weight", "ln_2.weight"):
        assert torch.equal(full[name], torch.ones(shapes.hidden))
    for name in ("ln_1.bias", "attn.qkv.bias", "attn.out.bias", "mlp.fc.bias"):
        assert not full[name].any(), name


def test_every_tile_is_drawn_from_its_own_seed() -> None:
    """No tile repeats within a tensor, across tensors of a part, or across layers or parts."""
    shapes = shapes_for(1, 1, 211, hidden=512)
    fingerprints = []
    for part, layer in ((EMBEDDING, 0), (LAYERS, 0), (LAYERS, 1)):
        full = init_full_part(shapes, part, layer, SEED, STD)
        for name, init in part_inits(shapes, part).items():
            if init.fill != NORMAL:
                continue
            rows, cols = init.shape
            for r in range(0, rows, INIT_TILE):
                for c in range(0, cols, INIT_TILE):
                    fingerprints.append(tuple(full[name][r, c : c + 8].tolist()))
    assert len(fingerprints) > 40
    assert len(set(fingerprints)) == len(fingerprints)


def test_seed_changes_every_tensor() -> None:
    shapes = shapes_for(1, 1, 211)
    a = init_full_part(shapes, LAYERS, 0, SEED, STD)
    b = init_full_part(shapes, LAYERS, 0, SEED + 1, STD)
    for name, init in part_inits(shapes, LAYERS).items():
        if init.fill == NORMAL:
            assert not torch.equal(a[name], b[name]), name
