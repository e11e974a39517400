"""The phased training step (DESIGN.md section 6).

One step walks the model part by part. Each phase loads one part's weights (a single copy and
all-gather of its flat shards), runs it for *every* micro-batch, streaming activations through the
x/dx buffers, and stores what it produced:

1. embedding forward        -> x[0][m]
2. decoder n forward        x[n][m] -> x[n+1][m]                 (n = 0 .. L-1)
3. head forward + backward  x[L][m] -> loss, dx[L][m]; tied word-embedding grad parked
4. decoder n backward       recompute from x[n][m], dx[n+1][m] -> dx[n][m]; grads reduced
5. embedding backward       dx[0][m] + parked tied grad; global grad norm complete
6. optimizer, every part    clip by the global norm, AdamW on this rank's shards

Weights of a part are loaded once per phase whatever the gradient accumulation; the layers never
know they are phased (one template block is bound to each layer's weights in turn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from config.loading import ConfigError
from config.schema import PretrainingConfig
from execution.buffers import ActivationBuffers, PartBuffers, flat_specs, part_rows, rts_axes
from execution.layout import ParallelLayout
from execution.optimizer import adamw_, clip_coefficient
from execution.sharding import DECAYED_KINDS, MATRIX, init_part_shard, shard_part, unshard_part
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, PARTS, GPTShapes
from modelling.layers import BlockSeeds

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 finaliser over the sequence)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 1


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    skipped: bool  # the gradients were not finite, so no weight changed


def check_buffers_fit(needed: int, device: torch.device, processes_per_node: int) -> None:
    """Raises a one-line ConfigError when the buffers cannot fit, before allocating anything.

    A model that does not fit would otherwise be killed by the kernel mid-allocation, or fail
    deep inside torch with an out-of-memory error. Host memory is shared by the node's
    processes, so their buffers are counted together.
    """
    if device.type == "cuda":
        available, where = torch.cuda.mem_get_info(device)[0], f"are free on {device}"
        total = needed
    else:
        available, where = _host_memory_available(), "of host memory are available"
        total = needed * processes_per_node
    if available is not None and total > available:
        node = f" x {processes_per_node} processes on this node" if total != needed else ""
        raise ConfigError(
            f"the buffers need {needed / 2**30:,.1f} GiB per process{node} (float32 weights, grads and "
            f"two AdamW moments, plus activations) but only {available / 2**30:,.1f} GiB {where}; "
            "add data-parallel replicas (RTS shards this state) or tensor parallelism, use "
            "--placement remote on a GPU, or choose a smaller model"
        )


def _host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PhasedEngine:
    """Owns the buffers of one rank and runs training and evaluation steps phase by phase.

    Args:
        config: Validated run configuration.
        layout: This rank's parallel geometry (``ParallelLayout.single`` for one process).
    """

    def __init__(self, config: PretrainingConfig, layout: ParallelLayout):
        self.config = config
        self.layout = layout
        self.device = layout.device
        self.shapes = GPTShapes.from_config(config.model, layout.tp1.size, layout.tp2.size)
        self.dtype = DTYPES[config.training.precision]
        self.remote = config.execution.placement == "remote"
        self.gradient_accumulation = config.training.global_batch_size // (
            config.execution.micro_batch_size * layout.dp.size
        )
        with torch.device("meta"):
            template = GPT(self.shapes, layout.tp1, layout.tp2)
        # Stateless templates: weights are bound per call with functional_call.
        self.templates = {EMBEDDING: template.embedding, LAYERS: template.layers[0],
                          HEAD: template.head}  # fmt: skip
        local_shapes = {
            part: {name: p.shape for name, p in module.named_parameters()}
            for part, module in self.templates.items()
        }
        self.specs = flat_specs(local_shapes, layout)
        self.rts = rts_axes(layout)

        buffer_device = torch.device("cpu") if self.remote else self.device
        pin = self.remote and self.device.type == "cuda"
        layers = self.shapes.layers
        activation_layout = (
            layers,
            self.gradient_accumulation,
            (config.execution.micro_batch_size, config.model.sequence_length,
             self.shapes.hidden // self.shapes.tp2),
            self.dtype,
        )  # fmt: skip
        planned = ActivationBuffers.planned_nbytes(*activation_layout) + sum(
            PartBuffers.planned_nbytes(self.specs[part], part_rows(part, layers)) for part in PARTS
        )
        check_buffers_fit(planned, buffer_device, layout.local_world_size)
        self.parts = {
            part: PartBuffers(self.specs[part], part_rows(part, layers), buffer_device, pin)
            for part in PARTS
        }
        self.activations = ActivationBuffers(*activation_layout, buffer_device, pin)
        self.optimizer_steps = 0
        self._initialise_weights(config.training.seed, config.model.init_std)

    # ----------------------------------------------------------------- weights in and out

    def _initialise_weights(self, seed: int, init_std: float) -> None:
        """Draws only this rank's tensor-parallel shard of each part, keeps its RTS slice.

        The shard holds the same numbers as a slice of the full part (per-tile seeds), so every
        layout starts identically while no rank draws or holds a whole part.
        """
        i, j = self.layout.tp1.rank, self.layout.tp2.rank
        for part, row in self.part_rows():
            local = init_part_shard(self.shapes, part, row, seed, init_std, i, j)
            self._write_local_part_state(part, row, "weights", local)

    def part_rows(self) -> list[tuple[str, int]]:
        """Every (part, row) of the model in order: the embedding, each decoder layer, the head."""
        return [(part, row) for part in PARTS for row in range(part_rows(part, self.shapes.layers))]

    def write_part_state(
        self, part: str, row: int, state: str, full: dict[str, torch.Tensor]
    ) -> None:
        """Stores this rank's share (TP shard, then RTS slice) of a part's logical tensors.

        Args:
            part, row: Which part (``row`` is the layer for ``layers``, else 0).
            state: ``weights``, ``exp_avg`` or ``exp_avg_sq``.
            full: Unsharded, unpadded float32 tensors named within the part (as in :class:`GPT`).
        """
        local = shard_part(part, full, self.shapes, self.layout.tp1.rank, self.layout.tp2.rank)
        self._write_local_part_state(part, row, state, local)

    def _write_local_part_state(
        self, part: str, row: int, state: str, local: dict[str, torch.Tensor]
    ) -> None:
        """As :meth:`write_part_state`, from this rank's tensor-parallel shards (padded)."""
        for kind, spec in self.specs[part].items():
            flat = spec.pack(local).view(spec.rts_size, spec.shard)[self.rts[kind].rank]
            getattr(self.parts[part], state)[kind][row].copy_(flat)

    def read_part_state(
        self, part: str, row: int, state: str = "weights"
    ) -> dict[str, torch.Tensor]:
        """Unsharded, unpadded float32 tensors of one part, named within the part.

        Collective over all ranks. ``state`` is ``weights``, ``grads`` (the last step's mean
        gradients, loss scale included), ``exp_avg`` or ``exp_avg_sq``.
        """
        tp1, tp2 = self.layout.tp1, self.layout.tp2
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for kind, spec in self.specs[part].items():
            stored = getattr(self.parts[part], state)[kind][row].to(self.device)
            packed = tp1.all_gather(tp2.all_gather(self.rts[kind].all_gather(stored)))
            for index, flat in enumerate(packed.view(-1, spec.padded).cpu()):
                shards.setdefault(divmod(index, tp2.size), {}).update(spec.views(flat))
        return {name: t.clone() for name, t in unshard_part(part, shards, self.shapes).items()}

    def full_state(self, state: str = "weights") -> dict[str, torch.Tensor]:
        """Unsharded, unpadded float32 tensors of every parameter, named as in :class:`GPT`.

        Collective over all ranks. ``state`` is ``weights``, ``grads`` (the last step's mean
        gradients, loss scale removed), ``exp_avg`` or ``exp_avg_sq``.
        """
        out = {}
        for part, row in self.part_rows():
            prefix = f"{part}.{row}." if part == LAYERS else f"{part}."
            for name, t in self.read_part_state(part, row, state).items():
                out[prefix + name] = t
        if state == "grads":
            out = {k: v / self.config.training.loss_scaling for k, v in out.items()}
        return out

    def _load_weights(self, part: str, row: int) -> dict[str, torch.Tensor]:
        """Brings a part's weights to the device in compute dtype and gathers the RTS shards."""
        weights = {}
        for kind, spec in self.specs[part].items():
            shard = self._to_device(self.parts[part].weights[kind][row], self.dtype)
            weights.update(spec.views(self.rts[kind].all_gather(shard)))
        return weights

    def _to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A load from a remote buffer is a real copy; a resident buffer is used in place."""
        return t.to(self.device, dtype, non_blocking=True, copy=self.remote)

    # ----------------------------------------------------------------- gradients

    def _accumulators(self, part: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Zeroed float32 gradient accumulators per kind, and named views into them."""
        flats, views = {}, {}
        for kind, spec in self.specs[part].items():
            flats[kind] = torch.zeros(spec.padded, dtype=torch.float32, device=self.device)
            views.update(spec.views(flats[kind]))
        return flats, views

    def _reduce_over_replicas(self, acc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean over data-parallel replicas, leaving this rank's RTS slice of each kind."""
        dp = self.layout.dp
        shards = {}
        for kind, flat in acc.items():
            rts = self.rts[kind]
            if rts.size == dp.size:  # the same replicas (tp1 or tp2 is 1): one reduce-scatter
                shard = dp.reduce_scatter(flat)
            else:  # RTS group larger than dp: all-reduce over dp, then keep our slice.
                shard = dp.all_reduce_(flat).view(rts.size, -1)[rts.rank]
            shards[kind] = shard / dp.size if dp.size > 1 else shard
        return shards

    def _store_grads(self, part: str, row: int, shards: dict[str, torch.Tensor]) -> None:
        for kind, shard in shards.items():
            self._grad_sumsq += shard.double().square().sum()
            self.parts[part].grads[kind][row].copy_(shard, non_blocking=True)

    # ----------------------------------------------------------------- phases

    def _seeds(self, step: int | None, layer: int, micro: int) -> BlockSeeds | None:
        """Dropout seeds of (step, layer, global micro-batch); None disables dropout.

        Attention-probability masks must agree across tp2 (those ranks hold the same heads), so
        they depend on the tp1 rank only; residual masks depend on the tp2 rank only.
        """
        if step is None or self.config.model.dropout_prob == 0.0:
            return None
        base = (self.config.training.seed, step, layer,
                self.layout.dp.rank * self.gradient_accumulation + micro)  # fmt: skip
        i, j = self.layout.tp1.rank, self.layout.tp2.rank
        return BlockSeeds(mix_seed(*base, 0, i), mix_seed(*base, 1, j), mix_seed(*base, 2, j))

    def _embedding_seed(self, step: int | None, micro: int) -> int | None:
        seeds = self._seeds(step, -1, micro)
        return seeds and seeds.attention_residual

    def _fetch(self, buffer: torch.Tensor, row: int, micro: int) -> torch.Tensor:
        return self._to_device(buffer[row, micro]).detach()

    @torch.no_grad()
    def _forward_phases(self, ids: torch.Tensor, step: int | None) -> None:
        """Phases 1-2: embedding and every decoder layer, all micro-batches each; fills x."""
        x = self.activations.x
        weights = self._load_weights(EMBEDDING, 0)
        for m in range(ids.shape[0]):
            y = functional_call(
                self.templates[EMBEDDING], weights, (ids[m], self._embedding_seed(step, m))
            )
            x[0, m].copy_(y, non_blocking=True)
        for n in range(self.shapes.layers):
            weights = self._load_weights(LAYERS, n)
            for m in range(ids.shape[0]):
                y = functional_call(
                    self.templates[LAYERS], weights, (self._fetch(x, n, m), self._seeds(step, n, m))
                )
                x[n + 1, m].copy_(y, non_blocking=True)

    def _head_phase(self, labels: torch.Tensor, backward: bool) -> list[torch.Tensor]:
        """Phase 3: loss per micro-batch; with ``backward``, dx[L] and the head's grads."""
        L = self.shapes.layers
        head = self._load_weights(HEAD, 0)
        word = self._load_weights(EMBEDDING, 0)["word.weight"]  # tied with the embedding
        if backward:
            head = {k: v.detach().requires_grad_() for k, v in head.items()}
            word = word.detach().requires_grad_()
            head_acc, head_views = self._accumulators(HEAD)
            tied_acc, tied_views = self._accumulators(EMBEDDING)
            scale = torch.tensor(self.config.training.loss_scaling / labels.shape[0],
                                 device=self.device)  # fmt: skip
        losses = []
        for m in range(labels.shape[0]):
            x = self._fetch(self.activations.x, L, m)
            with torch.set_grad_enabled(backward):
                x.requires_grad_(backward)
                loss = functional_call(
                    self.templates[HEAD], head, (x, word, labels[m], self.shapes.vocab)
                )
            losses.append(loss.detach())
            if not backward:
                continue
            dx, dword, *grads = torch.autograd.grad(loss, [x, word, *head.values()], scale)
            self.activations.dx[L, m].copy_(dx, non_blocking=True)
            tied_views["word.weight"].add_(dword)
            for name, g in zip(head, grads, strict=True):
                head_views[name].add_(g)
        if backward:
            self._store_grads(HEAD, 0, self._reduce_over_replicas(head_acc))
            # Parked in the embedding's grad buffer; phase 5 adds its own and counts the norm.
            for kind, shard in self._reduce_over_replicas(tied_acc).items():
                self.parts[EMBEDDING].grads[kind][0].copy_(shard, non_blocking=True)
        return losses

    def _layer_backward_phase(self, n: int, step: int) -> None:
        """Phase 4 for layer n: recompute, backpropagate every micro-batch, reduce grads."""
        acts = self.activations
        weights = {k: v.detach().requires_grad_() for k, v in self._load_weights(LAYERS, n).items()}
        acc, views = self._accumulators(LAYERS)
        for m in range(self.gradient_accumulation):
            x = self._fetch(acts.x, n, m).requires_grad_()
            with torch.enable_grad():
                y = functional_call(self.templates[LAYERS], weights, (x, self._seeds(step, n, m)))
            dx, *grads = torch.autograd.grad(
                y, [x, *weights.values()], self._fetch(acts.dx, n + 1, m)
            )
            acts.dx[n, m].copy_(dx, non_blocking=True)
            for name, g in zip(weights, grads, strict=True):
                views[name].add_(g)
        self._store_grads(LAYERS, n, self._reduce_over_replicas(acc))

    def _embedding_backward_phase(self, ids: torch.Tensor, step: int) -> None:
        """Phase 5: embedding grads plus the parked tied grad from the head."""
        weights = {
            k: v.detach().requires_grad_() for k, v in self._load_weights(EMBEDDING, 0).items()
        }
        acc, views = self._accumulators(EMBEDDING)
        for m in range(ids.shape[0]):
            with torch.enable_grad():
                y = functional_call(
                    self.templates[EMBEDDING], weights, (ids[m], self._embedding_seed(step, m))
                )
            grads = torch.autograd.grad(
                y, list(weights.values()), self._fetch(self.activations.dx, 0, m)
            )
            for name, g in zip(weights, grads, strict=True):
                views[name].add_(g)
        shards = self._reduce_over_replicas(acc)
        shards[MATRIX] += self._to_device(self.parts[EMBEDDING].grads[MATRIX][0])
        self._store_grads(EMBEDDING, 0, shards)

    def _optimizer_phases(self, lr: float, grad_scale: float) -> None:
        """Phase 6: AdamW on every part's shards, loaded and stored back one row at a time."""
        optim = self.config.training.optimizer
        for part in PARTS:
            buffers = self.parts[part]
            for row in range(buffers.rows):
                for kind in self.specs[part]:
                    stored = [getattr(buffers, s)[kind][row] for s in PartBuffers.STATES]
                    w, g, m, v = (self._to_device(t) for t in stored)
                    adamw_(w, g, m, v, step=self.optimizer_steps, lr=lr, optim=optim,
                           weight_decay=kind in DECAYED_KINDS, grad_scale=grad_scale)  # fmt: skip
                    if self.remote:  # gradients are read-only here; store the rest back
                        for target, value in ((stored[0], w), (stored[2], m), (stored[3], v)):
                            target.copy_(value, non_blocking=True)

    # ----------------------------------------------------------------- steps

    def train_step(self, tokens: torch.Tensor, step: int, lr: float) -> StepResult:
        """One optimizer step on this rank's micro-batches.

        Args:
            tokens: int64 ``[gradient_accumulation, micro_batch, sequence_length + 1]``.
            step: 0-based step index (seeds dropout).
            lr: Learning rate for this step.
        """
        expected = (self.gradient_accumulation, self.config.execution.micro_batch_size,
                    self.config.model.sequence_length + 1)  # fmt: skip
        assert tuple(tokens.shape) == expected, f"batch {tuple(tokens.shape)} != {expected}"
        tokens = tokens.to(self.device, non_blocking=True)
        ids, labels = tokens[..., :-1], tokens[..., 1:]
        self._grad_sumsq = torch.zeros((), dtype=torch.float64, device=self.device)

        self._forward_phases(ids, step)
        losses = self._head_phase(labels, backward=True)
        for n in reversed(range(self.shapes.layers)):
            self._layer_backward_phase(n, step)
        self._embedding_backward_phase(ids, step)

        world = self.layout.world
        scale = self.config.training.loss_scaling
        grad_norm = math.sqrt(world.all_reduce_(self._grad_sumsq).item()) / scale
        loss = self._mean_over_replicas(torch.stack(losses).float().sum(), len(losses))
        if not math.isfinite(grad_norm):
            return StepResult(loss, grad_norm, skipped=True)
        self.optimizer_steps += 1
        clip = clip_coefficient(grad_norm, self.config.training.optimizer.gradient_clipping)
        self._optimizer_phases(lr, grad_scale=clip / scale)
        return StepResult(loss, grad_norm, skipped=False)

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss (no dropout, no update) over batches of ``[micro_batch, seq + 1]``.

        Runs the same forward phases, ``gradient_accumulation`` micro-batches at a time.
        Collective: every rank must call it. Replicas use as many batches as the one with
        the fewest, since each phase's weight all-gather needs every replica.
        """
        batches = list(batches)
        count_tensor = torch.tensor(len(batches), device=self.device)
        batches = batches[: int(self.layout.dp.all_reduce_(count_tensor, op="min"))]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        chunk: list[torch.Tensor] = []
        for batch in [*batches, None]:
            if batch is not None:
                chunk.append(batch)
            if chunk and (batch is None or len(chunk) == self.gradient_accumulation):
                tokens = torch.stack(chunk).to(self.device)
                self._forward_phases(tokens[..., :-1], step=None)
                total += torch.stack(self._head_phase(tokens[..., 1:], backward=False)).sum()
                count += len(chunk)
                chunk = []
        return self._mean_over_replicas(total, count)

    def _mean_over_replicas(self, total: torch.Tensor, count: int) -> float:
        both = torch.stack(
            [total.double(), torch.tensor(float(count), device=self.device).double()]
        )
        total_all, count_all = self.layout.dp.all_reduce_(both).tolist()
        return total_all / count_all if count_all else float("nan")

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of host or device buffers held by this rank, by kind of state."""
        out = {"activations": self.activations.nbytes()}
        for buffers in self.parts.values():
            for state, n in buffers.nbytes().items():
                out[state] = out.get(state, 0) + n
        return out
