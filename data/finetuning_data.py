"""A fine-tuning task's data as the engine reads it: rows of token ids with their targets.

Every training or evaluation item (a SQuAD window, an MNLI pair) is one int64 row of
``sequence_length + 2``: the ids, then the two targets of :mod:`modelling.task_heads`, as the
task's reader (its spec's, ``tasks/specs.py``) cuts them from its file. Rows
travel through the engine, the prefetching loader and checkpoints exactly as pretraining's
token windows do.

:class:`TaskDataLoader` orders the training rows as :class:`data.loader.PretrainingDataLoader`
orders windows: epoch ``e`` visits them in a permutation drawn from ``(seed, e)``, step ``k``
takes positions ``[k * GBS, (k + 1) * GBS)`` of the concatenated permutations, and replica ``d``
its contiguous share of them. So a step's global batch does not depend on the layout, and
resuming needs only the step number (and the same rows, which the state checks by digest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.errors import DataError

STATE_FORMAT = 1


@dataclass
class TaskSet:
    """The items of one task file.

    Attributes:
        name: The file's name without its suffix (``dev-v1.1``, ``dev_matched``): the key
            its scores are written under.
        rows: int64 ``[items, sequence_length + 2]``.
        examples: The file's examples (several SQuAD windows may belong to one).
        windows: What the task's scorer needs besides the examples to map rows back to them
            (SQuAD's windows), or None.
    """

    name: str
    rows: torch.Tensor
    examples: Sequence[Any]
    windows: Any = None

    @classmethod
    def of(
        cls, path: str, ids: torch.Tensor, targets: torch.Tensor, examples, windows=None
    ) -> TaskSet:
        """The set of file ``path``: each row its ids, then its targets."""
        return cls(Path(path).stem, torch.cat([ids, targets], 1), examples, windows)


class TaskDataLoader:
    """Deterministic, resumable training batches of task rows for one data-parallel rank.

    Args:
        rows: int64 ``[items, sequence_length + 2]``, every training item.
        global_batch_size, micro_batch_size: Rows per step over all replicas, and per
            micro-batch.
        data_parallel_rank, data_parallel_size: This replica, of how many.
        seed: Shuffle seed.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
    ):
        self.rows = rows.numpy()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.gradient_accumulation = global_batch_size // (micro_batch_size * data_parallel_size)
        self.seed = seed
        self.samples_per_epoch = len(rows)
        self.skipped_records = 0  # rows are checked when read, none is ever skipped
        self.step = 0
        self._digest = hashlib.blake2b(self.rows.tobytes(), digest_size=16).hexdigest()

    @property
    def epoch(self) -> int:
        """The epoch of the first row of the next global batch."""
        return self.step * self.global_batch_size // self.samples_per_epoch

    def _rows_at(self, positions: np.ndarray) -> np.ndarray:
        n = self.samples_per_epoch
        epochs = positions // n
        picked = np.empty_like(positions)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(n)
            mask = epochs == epoch
            picked[mask] = order[positions[mask] % n]
        return self.rows[picked]

    def next_batch(self) -> torch.Tensor:
        """This rank's rows of the next step: ``[gradient_accumulation, micro_batch, seq + 2]``."""
        count = self.gradient_accumulation * self.micro_batch_size
        first = self.step * self.global_batch_size + self.data_parallel_rank * count
        rows = self._rows_at(np.arange(first, first + count, dtype=np.int64))
        self.step += 1
        shape = (self.gradient_accumulation, self.micro_batch_size, self.rows.shape[1])
        return torch.from_numpy(rows).view(shape)

    def state_dict(self) -> dict:
        """The position in the rows (JSON-serialisable), and which rows it is a position in."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "rows_digest": self._digest,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (any data-parallel layout).

        Raises:
            DataError: the state belongs to other rows, another seed or batch size.
        """
        mine = self.state_dict()
        for key in ("format", "seed", "global_batch_size"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the fine-tuning data: the checkpoint has {key} "
                    f"{state.get(key)}, this run has {mine[key]}; use the same task files, "
                    "sequence length, seed and global_batch_size"
                )
        if state.get("rows_digest") != mine["rows_digest"]:  # two fingerprints tell no one why
            raise DataError(
                "cannot resume the fine-tuning data: this run's rows are not the ones the "
                "checkpoint was trained on (other task files or contents, --sequence_length or "
                "--doc_stride); use the saved run's files and flags"
            )
        self.step = int(state["step"])


def evaluation_chunks(rows: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int):
    """This replica's micro-batches of ``rows``, every replica running as many.

    The rows are padded (with copies of the last) to a multiple of ``micro_batch_size x
    dp_size``; replica ``d`` takes every ``dp_size``-th micro-batch from ``d``, so gathering
    the replicas' outputs micro-batch by micro-batch gives the rows back in order.

    Returns:
        (list of ``[micro_batch, seq + 2]`` tensors, the number of real rows).
    """
    per_round = micro_batch_size * dp_size
    padded = -(-len(rows) // per_round) * per_round
    filled = torch.cat([rows, rows[-1:].expand(padded - len(rows), -1)])
    batches = filled.view(-1, micro_batch_size, rows.shape[1])
    return list(batches[dp_rank::dp_size]), len(rows)
