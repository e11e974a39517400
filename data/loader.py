"""Training and validation batches from TFRecord shards or token files, sharded by
data-parallel rank (a weighted blend of corpora: data/blend.py).

The data path is a pure function of (seed, step, rank, layout): epoch `e` visits the windows in
the order of a permutation drawn from `(seed, e)`; the global batch of step `k` is positions
`[k * GBS, (k + 1) * GBS)` of the concatenated epoch permutations; data-parallel rank `d` takes rows
`[d * GA * mbs, (d + 1) * GA * mbs)` of it. So the global batch of a step is the same set of
sequences whatever the number of replicas, each epoch is covered exactly once by the ranks
together, and resuming only needs the step number.

A bad record (corrupt, wrong length or feature, ids outside the vocabulary) raises `DataError`
naming the file and record. With `skip_corrupt_records` it is counted instead and the window at
the next position of the same epoch's permutation takes its place; the substitute depends only
on the global position, so every layout still computes the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from config.loading import ConfigError
from config.schema import PretrainingConfig
from data.blend import BlendedDataLoader, is_blend, parse_blend
from data.dataset import WindowSet, WindowTable, split_records
from data.errors import DataError
from data.window_order import WindowOrder, check_batch_layout, read_rows

__all__ = [
    "SAMPLE_DATA_GLOB",
    "SAMPLE_VALIDATION_GLOB",
    "DataError",
    "PretrainingDataLoader",
    "Validation",
    "data_description",
    "training_loader",
    "validation_batches",
    "validation_source",
]

_SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE_DATA_GLOB = str(_SAMPLE_DIR / "*.tfrecord")
"""The shipped sample training shards (Python documentation text, GPT-2 BPE, 2049-id records)."""
SAMPLE_VALIDATION_GLOB = str(_SAMPLE_DIR / "validation" / "*.tfrecord")
"""The shipped sample validation shard (different documents from the training shards)."""

STATE_FORMAT = 1


class PretrainingDataLoader:
    """Deterministic, resumable training batches for one data-parallel rank.

    Args:
        input_files: paths or glob patterns of TFRecord files (each with its `.index`) or token
            files (`.bin`, each with its `.idx`).
        sequence_length: the model's sequence length; windows hold `sequence_length + 1` ids.
        global_batch_size: sequences per optimizer step over all replicas.
        micro_batch_size: sequences per forward pass on one replica.
        data_parallel_rank: this replica's data-parallel index.
        data_parallel_size: number of data-parallel replicas.
        seed: shuffle seed (>= 0).
        vocab_size: the model's vocabulary size; every id must be below it.
        skip_corrupt_records: skip and count bad records instead of raising `DataError`.
        validation_fraction: fraction of records held out for validation (see
            `validation_batches`); 0 trains on every record.

    Raises:
        DataError: bad files or records (naming them), or a batch layout that does not divide.
    """

    def __init__(
        self,
        input_files: Sequence[str],
        sequence_length: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
        vocab_size: int,
        skip_corrupt_records: bool = False,
        validation_fraction: float = 0.0,
    ):
        self.gradient_accumulation = check_batch_layout(
            global_batch_size, micro_batch_size, data_parallel_rank, data_parallel_size, seed
        )
        self.sequence_length = sequence_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self._windows = WindowSet(input_files, sequence_length, vocab_size, skip_corrupt_records)
        train_records, _ = split_records(self._windows.num_records, validation_fraction)
        self._table = WindowTable(self._windows, train_records)
        self.samples_per_epoch = self._table.num_windows
        self._order = WindowOrder(self.samples_per_epoch, seed)
        self.step = 0
        self._skipped_before = 0  # skipped records counted before a resume

    @property
    def epoch(self) -> int:
        """The epoch of the first sequence of the next global batch."""
        return self.step * self.global_batch_size // self.samples_per_epoch

    @property
    def skipped_records(self) -> int:
        """Bad records skipped so far by this rank (only non-zero with `skip_corrupt_records`)."""
        return self._skipped_before + self._windows.skipped_records

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits the windows (a function of seed and epoch)."""
        return self._order.permutation(epoch)

    def batch_positions(self, step: int) -> np.ndarray:
        """Positions (in the concatenated epoch permutations) of this rank's rows of step `step`."""
        rows = self.gradient_accumulation * self.micro_batch_size
        first = step * self.global_batch_size + self.data_parallel_rank * rows
        return np.arange(first, first + rows, dtype=np.int64)

    def next_batch(self) -> torch.Tensor:
        """Token ids of this rank's share of the next optimizer step.

        Returns:
            int64 tensor [gradient_accumulation, micro_batch_size, sequence_length + 1];
            inputs are `[..., :-1]`, labels `[..., 1:]`.
        """
        rows = read_rows(self._table, self.batch_positions(self.step), self._order.window_at)
        self.step += 1
        shape = (self.gradient_accumulation, self.micro_batch_size, self.sequence_length + 1)
        return torch.from_numpy(rows).view(shape)

    def state_dict(self) -> dict:
        """The position in the data (JSON-serialisable), and what it is a position in."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "sequence_length": self.sequence_length,
            "samples_per_epoch": self.samples_per_epoch,
            "data_digest": self._windows.digest(),
            "skipped_records": self.skipped_records,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`, so the next batch is the one the saved run would have seen next.

        The data-parallel layout may differ from the saved run's: the global batches do not
        depend on it.

        Raises:
            DataError: the state belongs to other data, another seed or another batch shape.
        """
        if state.get("format") != STATE_FORMAT:
            raise DataError(
                f"data loader state has format {state.get('format')}, expected {STATE_FORMAT}"
            )
        if "blend" in state:
            raise DataError(
                "cannot resume the data loader: the checkpoint was trained on a --data_blend; "
                "give its --data_blend"
            )
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "sequence_length", "samples_per_epoch"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the data loader: the checkpoint has {key} {state.get(key)}, this "
                    f"run has {mine[key]}; resuming would change the batches (use the same data "
                    f"files, seed, global_batch_size and sequence_length)"
                )
        if state.get("data_digest") != mine["data_digest"]:  # two fingerprints tell no one why
            raise DataError(
                "cannot resume the data loader: this run's data files are not the ones the "
                "checkpoint was trained on (other file names or record counts); resuming would "
                "change the batches: give the saved run's --input_files"
            )
        self.step = int(state["step"])
        self._skipped_before = int(state["skipped_records"]) - self._windows.skipped_records


def validation_batches(
    input_files: Sequence[str],
    sequence_length: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    vocab_size: int,
    max_batches: int | None,
    validation_fraction: float = 0.0,
    skip_corrupt_records: bool = False,
) -> Iterator[torch.Tensor]:
    """This rank's share of the validation set, in a fixed order.

    With `validation_fraction == 0`, `input_files` are the validation shards and all their
    windows are used; otherwise `input_files` are the training shards and the records that
    `PretrainingDataLoader` holds out with the same fraction are used. Global validation batch
    `b` is windows `[b * mbs * dp, (b + 1) * mbs * dp)` in file order; rank `d` gets rows
    `[d * mbs, (d + 1) * mbs)`. Every rank yields the same number of batches (a last, partial
    global batch is dropped).

    Args:
        input_files: TFRecord or token file paths or glob patterns.
        sequence_length: the model's sequence length.
        micro_batch_size: sequences per batch on this rank.
        data_parallel_rank: this replica's data-parallel index.
        data_parallel_size: number of data-parallel replicas.
        vocab_size: the model's vocabulary size.
        max_batches: stop after this many batches (None: the whole set).
        validation_fraction: see above.
        skip_corrupt_records: skip and count bad records instead of raising `DataError`.

    Yields:
        int64 tensors [micro_batch_size, sequence_length + 1].

    Raises:
        DataError: bad files or records, or fewer windows than one batch on every rank.
    """
    if not 0 <= data_parallel_rank < data_parallel_size or micro_batch_size < 1:
        raise DataError(
            f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size}) or "
            f"micro_batch_size {micro_batch_size} < 1"
        )
    windows = WindowSet(input_files, sequence_length, vocab_size, skip_corrupt_records)
    if validation_fraction > 0:
        _, records = split_records(windows.num_records, validation_fraction)
    else:
        records = np.arange(windows.num_records)
    table = WindowTable(windows, records)
    per_batch = micro_batch_size * data_parallel_size
    num_batches = table.num_windows // per_batch
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    if table.num_windows < per_batch:
        raise DataError(
            f"the validation set has {table.num_windows} windows of {sequence_length + 1} ids, fewer "
            f"than one batch over all ranks (micro_batch_size {micro_batch_size} x data_parallel "
            f"{data_parallel_size}); add validation data or raise validation_fraction"
        )

    # A generator inside, so that the checks above run when this function is called, not at the
    # first batch.
    def batches() -> Iterator[torch.Tensor]:
        for batch in range(num_batches):
            first = batch * per_batch + data_parallel_rank * micro_batch_size
            positions = np.arange(first, first + micro_batch_size, dtype=np.int64)
            yield torch.from_numpy(read_rows(table, positions, lambda p: p))

    return batches()


def training_loader(
    config: PretrainingConfig, dp_rank: int, dp_size: int
) -> PretrainingDataLoader | BlendedDataLoader:
    """The training loader of data-parallel rank ``dp_rank`` of ``dp_size``, as the run's
    config describes it: ``--data_blend``'s corpora, else ``--input_files`` (the shipped sample
    when neither is given)."""
    d, ex = config.data, config.execution
    if d.data_blend:
        make, source = BlendedDataLoader, parse_blend(d.data_blend, "--data_blend")
    else:
        make, source = PretrainingDataLoader, d.input_files or [SAMPLE_DATA_GLOB]
    return make(
        source,
        config.model.sequence_length,
        config.training.global_batch_size,
        ex.micro_batch_size,
        dp_rank,
        dp_size,
        config.training.seed,
        config.model.vocab_size,
        skip_corrupt_records=d.skip_corrupt_records,
        validation_fraction=d.validation_fraction,
    )


def data_description(config: PretrainingConfig, loader) -> str:
    """The start-up line's words for the training data."""
    if config.data.data_blend:
        return loader.describe()
    files = config.data.input_files or [SAMPLE_DATA_GLOB]
    shipped = "" if config.data.input_files else "shipped sample "
    return f"{shipped}{', '.join(files)} ({loader.samples_per_epoch} sequences per epoch)"


@dataclass
class Validation:
    """The held-out data of a run: one set, or one per corpus of a blend.

    Attributes:
        sets: (weight, a function returning a fresh pass over this rank's batches) per set.
    """

    sets: list[tuple[float, Callable[[], Iterator[torch.Tensor]]]]

    def scores(self, evaluate: Callable[[Iterator[torch.Tensor]], float]) -> dict[str, float]:
        """``eval_loss``, and for a blend each corpus' loss (``eval_loss_0``, ...) with
        ``eval_loss`` their mean under the blend's weights. ``evaluate`` is collective, so every
        rank runs the sets in the same order."""
        losses = [evaluate(batches()) for _, batches in self.sets]
        if len(losses) == 1:
            return {"eval_loss": losses[0]}
        weights = [weight for weight, _ in self.sets]
        mean = sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)
        return {"eval_loss": mean, **{f"eval_loss_{i}": loss for i, loss in enumerate(losses)}}


def validation_source(config: PretrainingConfig, dp_rank: int, dp_size: int) -> Validation | None:
    """This rank's validation data, or None when the run evaluates nothing. The data is opened
    once here, so a bad file or too little data is reported at start-up rather than hours into
    training.

    Held-out records of the training data (``--validation_fraction``: of each corpus of a
    blend, weighted as the blend), else ``--validation_files`` (files, or a blend of them),
    else the shipped sample's validation shard when training on it.

    Raises:
        ConfigError: evaluation is asked for but no held-out data is named.
        DataError: the validation data holds fewer sequences than one batch of every replica.
    """
    d, c = config.data, config.checkpoint
    if not (d.eval_every or c.eval_only):
        return None
    on_sample = not (d.input_files or d.data_blend)
    if d.validation_fraction:
        fraction = d.validation_fraction
        if d.data_blend:
            sources = parse_blend(d.data_blend, "--data_blend")
        else:
            sources = [(1.0, d.input_files or [SAMPLE_DATA_GLOB])]
    elif d.validation_files or on_sample:
        files, fraction = d.validation_files or [SAMPLE_VALIDATION_GLOB], 0.0
        blended = is_blend(files)
        sources = parse_blend(files, "--validation_files") if blended else [(1.0, files)]
    else:
        flag = "--eval_only" if c.eval_only else "--eval_every"
        raise ConfigError(
            f"{flag} needs held-out data: give --validation_files or "
            "--validation_fraction (or --eval_every 0 to train without evaluation)"
        )
    micro_batch = config.execution.micro_batch_size

    def batches_of(files) -> Callable[[], Iterator[torch.Tensor]]:
        def validation() -> Iterator[torch.Tensor]:
            return validation_batches(
                [files] if isinstance(files, str) else files,
                config.model.sequence_length,
                micro_batch,
                dp_rank,
                dp_size,
                config.model.vocab_size,
                d.eval_batches or None,
                validation_fraction=fraction,
                skip_corrupt_records=d.skip_corrupt_records,
            )

        if next(iter(validation()), None) is None:
            names = files if isinstance(files, str) else ", ".join(files)
            raise ConfigError(
                f"the validation data {names} holds fewer than --micro_batch_size "
                f"{micro_batch} x --data_parallel {dp_size} sequences of "
                f"{config.model.sequence_length + 1} tokens; give more validation data"
            )
        return validation

    return Validation([(weight, batches_of(files)) for weight, files in sources])
