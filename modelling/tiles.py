"""Fixed tiles of the initial weights: each tile of a full tensor is drawn from a generator of
its own, seeded by (seed, part, layer, name, tile index), so a rank draws only the tiles its
shard touches and still holds exactly the numbers every other layout holds
(:func:`modelling.gpt.init_part_region` writes them into a shard).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelling.host_threads import one_core_pool

INIT_TILE = 256

NORMAL, ZEROS, ONES = "normal", "zeros", "ones"


@dataclass(frozen=True)
class ParamInit:
    """How one unsharded parameter starts: its shape, and ``normal`` (with ``std``) or a
    constant."""

    shape: tuple[int, ...]
    fill: str
    std: float = 0.0


def prefixed(prefix: str, inits: dict[str, ParamInit]) -> dict[str, ParamInit]:
    """A part's parameters named within its owner (``ln_1.weight`` for ``weight``)."""
    return {f"{prefix}.{name}": init for name, init in inits.items()}


def draw_into(
    region: torch.Tensor,
    init,
    key: tuple,
    tiles: tuple[tuple[int, torch.Tensor, torch.Tensor], ...],
) -> None:
    """Draws one tile and writes the part of it a region keeps (per dim: :func:`tile_groups`).

    Tiles write disjoint elements of the region (each position belongs to one tile per dim),
    so several threads may fill one region at once.
    """
    tile = _draw_tile(init, tuple(t for t, _, _ in tiles), key)
    region[_where(*(at for _, at, _ in tiles))] = tile[_where(*(offset for _, _, offset in tiles))]


def run_all(tasks: list[Callable[[], None]], workers: int) -> None:
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


def _draw_tile(init, tile: tuple[int, ...], key: tuple) -> torch.Tensor:
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
    return slices if all(s is not None for s in slices) else outer(*indices)


def outer(*indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
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
