"""The GPT-3 model: an embedding, an indexable stack of identical decoder blocks and a tied head.

The three named parts (``embedding``, ``layers``, ``head``) are the units the phase engine
streams; the model never knows it is phased. :func:`init_full_part` creates the *unsharded*
weights of one part and :func:`init_part_region` any product of per-dim positions of them
(a rank's shard), both from the same fixed tiles seeded by (seed, part, layer, name, tile), so
every parallel layout holds the same numbers and no process ever draws the whole model.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelling.host_threads import one_core_pool
from modelling.layers import BlockSeeds, DecoderBlock, Embedding, LMHead
from modelling.parallel import LOCAL, Axis
from modelling.task_heads import TaskHead

# Rows of a tp1 vocabulary shard are a multiple of this (as in the reference) so that the
# shards of the padded table are equal and matmul-friendly.
VOCAB_SHARD_MULTIPLE = 16

EMBEDDING, LAYERS, HEAD = "embedding", "layers", "head"
PARTS = (EMBEDDING, LAYERS, HEAD)


def padded_vocab_size(vocab_size: int, tp1: int) -> int:
    """Vocabulary rows after padding each of the tp1 shards to a multiple of 16."""
    shard = math.ceil(math.ceil(vocab_size / tp1) / VOCAB_SHARD_MULTIPLE) * VOCAB_SHARD_MULTIPLE
    return shard * tp1


@dataclass(frozen=True)
class GPTShapes:
    """Full and per-shard sizes of the model for a (tp1, tp2) layout."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    positions: int
    dropout_prob: float
    layer_norm_eps: float
    tp1: int = 1
    tp2: int = 1
    # Attention dropout per head from its global index (ModelConfig.dropout_parity).
    dropout_parity: bool = False
    # The head: None for the language model's (tied to the word embedding), else the class of
    # a fine-tuning task's (modelling.task_heads; the task's spec names it), which replaces it.
    task_head: type[TaskHead] | None = None

    @classmethod
    def from_config(
        cls, model, tp1: int = 1, tp2: int = 1, task_head: type[TaskHead] | None = None
    ) -> GPTShapes:
        """From a :class:`config.schema.ModelConfig`, the tensor-parallel sizes and the head."""
        return cls(
            layers=model.layers,
            hidden=model.hidden_size,
            heads=model.heads,
            vocab=model.vocab_size,
            positions=model.max_positional_length,
            dropout_prob=model.dropout_prob,
            layer_norm_eps=model.layer_norm_eps,
            tp1=tp1,
            tp2=tp2,
            dropout_parity=model.dropout_parity,
            task_head=task_head,
        )

    @property
    def label_columns(self) -> int:
        """Columns a batch row carries past its ids: 1 for the language model (the row is
        ``seq + 1`` tokens, labels shifted by one), a task's targets otherwise."""
        return self.task_head.TARGET_WIDTH if self.task_head else 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    @property
    def vocab_padded(self) -> int:
        return padded_vocab_size(self.vocab, self.tp1)

    @property
    def positions_padded(self) -> int:
        return math.ceil(self.positions / self.tp1) * self.tp1

    @property
    def task_head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Unsharded shapes of the task head's projection (none for the language model's)."""
        return self.task_head.parameter_shapes(self.hidden) if self.task_head else {}

    @property
    def num_parameters(self) -> int:
        """Trainable parameters of the unpadded model (the tied embedding counted once)."""
        h = self.hidden
        per_layer = 12 * h * h + 13 * h  # qkv, out, fc, proj weights + biases + 2 layer norms
        task = sum(math.prod(s) for s in self.task_head_shapes.values())
        return (self.vocab + self.positions) * h + self.layers * per_layer + 2 * h + task


class GPT(nn.Module):
    """GPT-3 language model for one (tp1, tp2) shard; ``LOCAL`` axes give the whole model.

    With a context axis ``cp`` it runs on piece ``cp.rank`` of each sequence (weights are the
    same on every piece) and its loss is the mean over that piece's tokens.
    """

    def __init__(self, shapes: GPTShapes, tp1: Axis = LOCAL, tp2: Axis = LOCAL, cp: Axis = LOCAL):
        super().__init__()
        assert (tp1.size, tp2.size) == (shapes.tp1, shapes.tp2), "axes do not match the shapes"
        s = shapes
        local_hidden = s.hidden // s.tp2
        self.shapes = s
        self.embedding = Embedding(
            s.vocab_padded // s.tp1,
            s.positions_padded // s.tp1,
            local_hidden,
            s.dropout_prob,
            tp1,
            tp2,
            cp,
        )
        self.layers = nn.ModuleList(
            DecoderBlock(
                local_hidden,
                s.heads // s.tp1,
                s.head_dim,
                s.ffn // s.tp1,
                s.dropout_prob,
                s.layer_norm_eps,
                tp1,
                tp2,
                cp,
                dropout_parity=s.dropout_parity,
            )
            for _ in range(s.layers)
        )
        if s.task_head:
            self.head = s.task_head(local_hidden, s.layer_norm_eps, tp2)
        else:
            self.head = LMHead(local_hidden, s.layer_norm_eps, tp1, tp2)

    def forward(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        embedding_seed: int | None = None,
        layer_seeds: list[BlockSeeds] | None = None,
    ) -> torch.Tensor:
        """Mean loss of a (B, S) batch; seeds enable dropout (None: no dropout).

        ``labels``: next-token ids (B, S) for the language model's head, a task's targets
        (B, 2) for a task's head (:mod:`modelling.task_heads`).
        """
        x = self.embedding(ids, embedding_seed)
        for n, layer in enumerate(self.layers):
            x = layer(x, layer_seeds[n] if layer_seeds else None)
        if self.shapes.task_head:
            return self.head(x, labels)
        return self.head(x, self.embedding.word.weight, labels, self.shapes.vocab)


# Initial weights are drawn per fixed tile of each full tensor: a tile's numbers depend only on
# (seed, part, layer, name, tile index), never on the layout, so a rank can draw just the tiles
# its shard touches and still hold exactly the numbers every other layout holds.
INIT_TILE = 256

NORMAL, ZEROS, ONES = "normal", "zeros", "ones"


@dataclass(frozen=True)
class ParamInit:
    """How one unsharded parameter starts: its shape, and ``normal`` (with ``std``) or a constant."""

    shape: tuple[int, ...]
    fill: str
    std: float = 0.0


def part_inits(shapes: GPTShapes, part: str, init_std: float = 1.0) -> dict[str, ParamInit]:
    """Unpadded shape and initialisation of every parameter of a part, named as in :class:`GPT`.

    Linear and embedding weights are truncated normal (std ``init_std``, cut at 2 std); the
    residual projections ``attn.out`` and ``mlp.proj`` use ``init_std / sqrt(2 * layers)`` as
    in GPT-2; biases are zero and layer-norm gains one.
    """
    h = shapes.hidden
    if part == EMBEDDING:
        return {
            "word.weight": ParamInit((shapes.vocab, h), NORMAL, init_std),
            "position.weight": ParamInit((shapes.positions, h), NORMAL, init_std),
        }
    if part == HEAD:
        # A task's projection after ln_f: weights like other linear layers, biases zero.
        task = {
            name: ParamInit(shape, NORMAL if len(shape) == 2 else ZEROS, init_std)
            for name, shape in shapes.task_head_shapes.items()
        }
        return {"ln_f.weight": ParamInit((h,), ONES), "ln_f.bias": ParamInit((h,), ZEROS), **task}
    residual_std = init_std / math.sqrt(2 * shapes.layers)
    return {
        "ln_1.weight": ParamInit((h,), ONES),
        "ln_1.bias": ParamInit((h,), ZEROS),
        "attn.qkv.weight": ParamInit((3 * h, h), NORMAL, init_std),
        "attn.qkv.bias": ParamInit((3 * h,), ZEROS),
        "attn.out.weight": ParamInit((h, h), NORMAL, residual_std),
        "attn.out.bias": ParamInit((h,), ZEROS),
        "ln_2.weight": ParamInit((h,), ONES),
        "ln_2.bias": ParamInit((h,), ZEROS),
        "mlp.fc.weight": ParamInit((4 * h, h), NORMAL, init_std),
        "mlp.fc.bias": ParamInit((4 * h,), ZEROS),
        "mlp.proj.weight": ParamInit((h, 4 * h), NORMAL, residual_std),
        "mlp.proj.bias": ParamInit((h,), ZEROS),
    }


def qualified_name(part: str, row: int, name: str) -> str:
    """A parameter's name in the whole :class:`GPT` (``layers.3.attn.qkv.weight``) from its
    part, row (the layer, for ``layers``) and name within the part."""
    return f"{part}.{row}.{name}" if part == LAYERS else f"{part}.{name}"


def logical_shapes(shapes: GPTShapes) -> dict[str, tuple[int, ...]]:
    """Unsharded, unpadded shape of every parameter of the model, named as in :class:`GPT`."""
    return {
        qualified_name(part, row, name): init.shape
        for part in PARTS
        for row in range(shapes.layers if part == LAYERS else 1)
        for name, init in part_inits(shapes, part).items()
    }


def init_full_part(
    shapes: GPTShapes, part: str, layer: int, seed: int, init_std: float, workers: int = 1
) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded initial weights of one part (see :func:`part_inits` for the rules).

    Assembled from the same per-tile draws as :func:`init_part_region`, so slicing this result
    and drawing a region directly give bit-identical numbers, whatever ``workers`` is.

    Returns:
        dict of parameter name (within the part) -> float32 tensor.
    """
    whole = {
        name: tuple(torch.arange(n) for n in p.shape)
        for name, p in part_inits(shapes, part, init_std).items()
    }
    return init_part_region(shapes, part, layer, seed, init_std, whole, workers)


def init_part_region(
    shapes: GPTShapes,
    part: str,
    layer: int,
    seed: int,
    init_std: float,
    positions: dict[str, tuple[torch.Tensor, ...]],
    workers: int = 1,
) -> dict[str, torch.Tensor]:
    """Initial values of a part's parameters at given positions, drawing only the tiles needed.

    The result for ``name`` is ``full[positions[0]][:, positions[1]]...`` of the unsharded
    tensor, where a position of -1 is padding and gives zero. Each tile of ``INIT_TILE`` along
    every dim is drawn from its own generator and written straight into the result, so beyond
    the result each worker holds one tile at a time, and the numbers do not depend on how many
    workers draw them or in which order.

    Args:
        shapes, part, layer, seed, init_std: As for :func:`init_full_part`.
        positions: Parameter name -> one int64 tensor of full-tensor indices per dim.
        workers: Threads drawing tiles at once, each on one core (torch releases the GIL
            inside its ops; :func:`modelling.host_threads.one_core_pool`); 1 draws them in
            this thread, one after another.

    Returns:
        dict of parameter name -> float32 tensor of shape ``[len(p) for p in positions[name]]``.
    """
    inits = part_inits(shapes, part, init_std)
    out, draws = {}, []
    for name, index in positions.items():
        init = inits[name]
        assert len(index) == len(init.shape), f"{name}: {len(index)} index dims for {init.shape}"
        region = torch.zeros([len(p) for p in index])
        if init.fill == ONES:
            region[_outer(*(p >= 0 for p in index))] = 1.0
        elif init.fill == NORMAL:
            key = (seed, part, layer, name)
            draws += [
                functools.partial(_draw_into, region, init, key, tiles)
                for tiles in itertools.product(*(tile_groups(p) for p in index))
            ]
        out[name] = region
    _run_all(draws, workers)
    return out


def _draw_into(
    region: torch.Tensor,
    init: ParamInit,
    key: tuple,
    tiles: tuple[tuple[int, torch.Tensor, torch.Tensor], ...],
) -> None:
    """Draws one tile and writes the part of it a region keeps (per dim: :func:`tile_groups`).

    Tiles write disjoint elements of the region (each position belongs to one tile per dim),
    so several threads may fill one region at once.
    """
    tile = _draw_tile(init, tuple(t for t, _, _ in tiles), key)
    region[_where(*(at for _, at, _ in tiles))] = tile[_where(*(offset for _, _, offset in tiles))]


def _run_all(tasks: list[Callable[[], None]], workers: int) -> None:
    """Runs every task: in order in this thread for one worker, else spread over a pool."""
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    with one_core_pool(min(workers, len(tasks)), "init-tile") as pool:
        futures = [pool.submit(task) for task in tasks]
        try:
            for future in futures:
                future.result()  # re-raises a worker's error here
        except BaseException:
            pool.shutdown(cancel_futures=True)  # out of memory or ^C: draw no more tiles
            raise


def tile_groups(index: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each tile an index touches: (tile number, positions in the index, offsets in it)."""
    real = index >= 0
    tile_of = torch.where(real, index // INIT_TILE, -1)
    groups = []
    for tile in torch.unique(tile_of[real]).tolist():
        at = torch.nonzero(tile_of == tile).squeeze(1)
        groups.append((tile, at, index[at] - tile * INIT_TILE))
    return groups


def _draw_tile(init: ParamInit, tile: tuple[int, ...], key: tuple) -> torch.Tensor:
    """One whole tile of a truncated normal tensor, from a generator of its own.

    The tile is always drawn whole and contiguous, so its numbers do not depend on which of
    its elements a caller keeps.
    """
    size = [min(INIT_TILE, n - t * INIT_TILE) for n, t in zip(init.shape, tile, strict=True)]
    generator = torch.Generator().manual_seed(tile_seed(*key, *tile))
    std = init.std
    return nn.init.trunc_normal_(
        torch.empty(size), 0.0, std, -2 * std, 2 * std, generator=generator
    )


def tile_seed(*key: int | str) -> int:
    """A stable 63-bit seed from ints and strings (Python's ``hash`` is salted per process)."""
    text = "/".join(f"{type(k).__name__}:{k}" for k in key)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _where(*indices: torch.Tensor) -> tuple:
    """Index of the product of per-dim positions: slices where contiguous (a view), else outer."""
    slices = tuple(_as_slice(p) for p in indices)
    return slices if all(s is not None for s in slices) else _outer(*indices)


def _outer(*indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-dim index or mask tensors reshaped to broadcast into their outer product."""
    indices = tuple(torch.nonzero(p).squeeze(1) if p.dtype == torch.bool else p for p in indices)
    n = len(indices)
    return tuple(p.view([-1 if d == k else 1 for k in range(n)]) for d, p in enumerate(indices))


def _as_slice(index: torch.Tensor) -> slice | None:
    """``slice(a, b)`` when ``index`` is ``a, a + 1, ..., b - 1``; otherwise None."""
    if len(index) == 0:
        return slice(0, 0)
    start, stop = int(index[0]), int(index[-1]) + 1
    if stop - start == len(index) and torch.equal(index, torch.arange(start, stop)):
        return slice(start, stop)
    return None
