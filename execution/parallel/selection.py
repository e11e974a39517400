"""The k largest of a score spread over ranks, chosen exactly as one process would choose them.

RigL drops the smallest |w| and grows the largest |gradient| of each matrix, and a matrix is
split over tensor-parallel ranks and, within them, over its RTS replicas. Gathering the shards
(or each shard's own top k) would cost memory in proportion to the matrix; instead the k-th
largest key is found digit by digit (a radix select): each round every rank counts its
candidates per value of the next 8 bits, one all-reduce of ``[matrices, 256]`` counts sums
them over the ranks holding the matrix, and every rank narrows its candidates to the same
bucket. Eight rounds settle a 64-bit key.

Keys are unique: the score's float32 bits (in an order-preserving integer form) in the high
half and the element's index within its logical matrix in the low half, ordered so that of
equal scores the lower index ranks higher. So the selection is a function of the logical
matrix alone, whatever the layout, and ties cannot make two layouts choose differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelling.parallel import Axis

DIGIT_BITS = 8
BUCKETS = 1 << DIGIT_BITS
_LOW_HALF = (1 << 32) - 1


def sort_keys(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys ordered like ``scores`` (float32), ties broken towards lower ``index``
    (an element's index within its logical matrix, below 2^32)."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0
    # Negative floats order backwards as integers: flip their magnitude bits.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * (1 << 32) + (_LOW_HALF - index)


def select_largest(
    keys: torch.Tensor, matrix: torch.Tensor, counts: torch.Tensor, axes: Sequence[Axis]
) -> torch.Tensor:
    """Which local elements are among the ``counts[m]`` largest keys of their matrix ``m``.

    Args:
        keys: int64 unique keys (:func:`sort_keys`) of this rank's elements.
        matrix: Which matrix each element belongs to, in ``[0, len(counts))``; -1 excludes it.
        counts: How many elements to choose per matrix, over all ranks (clamped to what exists).
        axes: The mesh axes whose product holds every element of the matrices exactly once.
            Every rank of that product must call with the same ``counts``.

    Returns:
        bool tensor like ``keys``.
    """
    num_matrices = len(counts)
    need = counts.to(device=keys.device, dtype=torch.int64).clone()
    chosen = torch.zeros_like(keys, dtype=torch.bool)
    candidate = matrix >= 0
    rows = matrix.clamp(min=0)
    for shift in range(64 - DIGIT_BITS, -1, -DIGIT_BITS):
        digit = (keys >> shift) & (BUCKETS - 1)
        if shift == 64 - DIGIT_BITS:
            digit = digit ^ (BUCKETS >> 1)  # the sign bit: negative keys rank lowest
        bucket = rows * BUCKETS + digit
        histogram = torch.bincount(bucket[candidate], minlength=num_matrices * BUCKETS)
        histogram = histogram.view(num_matrices, BUCKETS)
        for axis in axes:
            if axis.size > 1:
                axis.all_reduce_(histogram)
        # Candidates at or above each bucket; the k-th largest lies in the highest bucket
        # that has at least `need` at or above it (256: none needed, nothing more chosen).
        at_or_above = histogram.flip(-1).cumsum(-1).flip(-1)
        threshold = (at_or_above >= need.unsqueeze(-1)).sum(-1) - 1
        threshold = torch.where(need > 0, threshold, BUCKETS)
        above = torch.where(
            threshold < BUCKETS - 1,
            at_or_above.gather(-1, (threshold + 1).clamp(max=BUCKETS - 1).unsqueeze(-1))[:, 0],
            0,
        )
        need = need - torch.where(need > 0, above, 0)
        mine = threshold[rows]
        chosen |= candidate & (digit > mine)
        candidate &= digit == mine
    # Keys are unique: a candidate left matches the k-th key exactly, and is chosen if needed.
    return chosen | (candidate & (need[rows] > 0))
