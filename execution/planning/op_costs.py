"""What each op of a metered step costs, and its seconds on a device: the per-op roofline.

An op that launches a kernel (anything but a view or a metadata change) costs the larger of its
FLOPs over the matmul rate of its shape and its bytes (read and written) over memory bandwidth,
plus the host's time to launch it. Matmuls are kept by shape, since the rate depends on it;
fused attention kernels by FLOPs, since they reach their own share of the peak; every other
kernel (layer norm, GELU, softmax, dropout, residual adds, the loss, copies on the device) by
its bytes alone: it is memory-bound. A random draw also counts its elements: a CPU's generator
computes each number, which takes longer than moving its bytes (``random_draw_ns``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from execution.planning.device_specs import DeviceSpec

aten = torch.ops.aten
# Matmuls whose (m, n, k) the rate is looked up for; a batched one counts its batch into m.
MATMULS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})


@dataclass(frozen=True)
class OpCost:
    """One op: whether it runs a kernel, its bytes, its matmul shape if it is one, whether it
    is a copy across the host link (``link``), and the random numbers it draws."""

    kernel: bool
    nbytes: int = 0
    matmul: tuple[int, int, int] | None = None
    link: bool = False
    random_elements: int = 0


VIEW = OpCost(kernel=False)
# A collective's kernel: its launch; its bytes move at the link's rate, priced apart.
COLLECTIVE = OpCost(kernel=True)
_COLLECTIVES = frozenset({"c10d", "_c10d_functional"})


def op_cost(func, args: tuple, kwargs: dict, out, tensors) -> OpCost:
    """The cost of ``func(*args, **kwargs) -> out`` (``tensors``: flattens arguments)."""
    schema = func._schema
    if schema.returns and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    ):
        return VIEW  # a view of an input: no kernel, no bytes
    packet = func._overloadpacket
    if packet in _METADATA:
        return VIEW
    if func.namespace in _COLLECTIVES:  # priced as a collective (time_model), by its bytes
        return COLLECTIVE
    if packet in _LOOKUPS:
        # The rows or elements its index selects (read, then written out), and the index:
        # an embedding lookup of a few tokens reads a few rows of its table, not all of it.
        indices = [t for t in tensors((*args[1:], *kwargs.values())) if not t.is_floating_point()]
        return OpCost(
            kernel=True, nbytes=sum(map(_nbytes, indices)) + 2 * _result_bytes(out, tensors)
        )
    if packet in _INDEXED_UPDATES:
        # Only the elements its index selects: as many as the index or source has, read and
        # written, besides the index and source themselves.
        target, others = args[0], list(tensors((*args[1:], *kwargs.values())))
        touched = max((t.numel() for t in others), default=0) * target.element_size()
        return OpCost(kernel=True, nbytes=sum(map(_nbytes, others)) + 2 * touched)
    nbytes = sum(_nbytes(t) for t in tensors((*args, *kwargs.values())))
    if all(r.alias_info is None for r in schema.returns):  # a new tensor: written too
        nbytes += _result_bytes(out, tensors)
    elif packet not in _OVERWRITES:  # in place: what it updates is read, then written
        nbytes += sum(_nbytes(t) for t in tensors(_updated(schema, args, kwargs)))
    if packet in _RANDOM_DRAWS:  # one number per element of what it fills
        drawn = result_tensors(out, tensors)[0].numel()
        return OpCost(kernel=True, nbytes=nbytes, random_elements=drawn)
    if packet not in MATMULS:
        return OpCost(kernel=True, nbytes=nbytes)
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    return OpCost(
        kernel=True, nbytes=nbytes, matmul=(batch * a.shape[-2], b.shape[-1], a.shape[-1])
    )


def _updated(schema, args: tuple, kwargs: dict) -> list:
    """The arguments an op writes that it also reads (``add_``'s self, not an ``out=``)."""
    updated = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write or argument.is_out:
            continue
        if argument.name in kwargs:
            updated.append(kwargs[argument.name])
        elif index < len(args):
            updated.append(args[index])
    return updated


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def result_tensors(out, tensors) -> list[torch.Tensor]:
    """The tensors an op returned (one tensor, or several)."""
    return tensors(out if isinstance(out, (tuple, list)) else (out,))


def _result_bytes(out, tensors) -> int:
    """Bytes of what an op returned (one tensor, or several)."""
    return sum(map(_nbytes, result_tensors(out, tensors)))


# In-place ops that write their tensor without reading it (the rest read what they update).
_OVERWRITES = frozenset(
    getattr(aten, name)
    for name in (
        "copy_",
        "_foreach_copy_",
        "fill_",
        "zero_",
        "normal_",
        "uniform_",
        "bernoulli_",
        "random_",
    )
    if hasattr(aten, name)
)

# Ops that draw a random number for each element of their (first) result: dropout's masks.
_RANDOM_DRAWS = frozenset(
    getattr(aten, name)
    for name in (
        "bernoulli",
        "bernoulli_",
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "native_dropout",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
    )
    if hasattr(aten, name)
)

# In-place ops that update only the elements an index selects (a lookup's gradient rows
# summed into a table, the cross-entropy's target logits), not the whole tensor.
_INDEXED_UPDATES = frozenset(
    getattr(aten, name)
    for name in ("index_add_", "index_put_", "scatter_add_", "scatter_", "index_copy_")
    if hasattr(aten, name)
)

# Ops that read only what an index selects: an embedding's rows, the cross-entropy's target
# logits (``gather``).
_LOOKUPS = frozenset(
    getattr(aten, name) for name in ("embedding", "index_select", "gather") if hasattr(aten, name)
)

# Ops that allocate or describe a tensor without touching its elements; ``_unsafe_view``
# declares no alias (autograd's reasons) but is a view: the reshape ``matmul`` ends with.
_METADATA = frozenset(
    getattr(aten, name)
    for name in (
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "_unsafe_view",
    )
    if hasattr(aten, name)
)


@dataclass
class OpCosts:
    """The sums over the ops of a step or a phase (see the module docstring).

    Attributes:
        kernels: Ops that launched a kernel.
        memory_bytes: Bytes read and written by the kernels that are neither matmuls nor fused
            attention, nor copies across the host link.
        link_bytes: Bytes of the copies across the host link: the link's on a GPU (priced
            as copies, beside the kernels), memory-bound work on a CPU, whose cores copy.
        attention_bytes: The same of the fused attention kernels.
        matmuls: Count of each matmul by ``(m, n, k, bytes)``.
        allocations: Bytes of new storages by size class (the power of two at or below),
            for devices whose allocator hands large blocks out fresh (a CPU's, whose pages
            fault in on first touch; CUDA's caching allocator reuses them).
        random_elements: Random numbers drawn (their kernels' bytes are in ``memory_bytes``).
    """

    kernels: int = 0
    memory_bytes: int = 0
    attention_bytes: int = 0
    link_bytes: int = 0
    matmuls: Counter = field(default_factory=Counter)
    allocations: Counter = field(default_factory=Counter)
    random_elements: int = 0

    def allocated(self, nbytes: int) -> None:
        if nbytes:
            self.allocations[1 << (nbytes.bit_length() - 1)] += nbytes

    def add(self, cost: OpCost, attention: bool) -> None:
        if not cost.kernel:
            return
        self.kernels += 1
        if cost.link:
            self.link_bytes += cost.nbytes
        elif cost.matmul is not None:
            self.matmuls[(*cost.matmul, cost.nbytes)] += 1
        elif attention:
            self.attention_bytes += cost.nbytes
        else:
            self.memory_bytes += cost.nbytes
        self.random_elements += cost.random_elements

    def copy(self) -> OpCosts:
        return OpCosts(
            self.kernels,
            self.memory_bytes,
            self.attention_bytes,
            self.link_bytes,
            Counter(self.matmuls),
            Counter(self.allocations),
            self.random_elements,
        )

    def __sub__(self, earlier: OpCosts) -> OpCosts:
        return OpCosts(
            self.kernels - earlier.kernels,
            self.memory_bytes - earlier.memory_bytes,
            self.attention_bytes - earlier.attention_bytes,
            self.link_bytes - earlier.link_bytes,
            self.matmuls - earlier.matmuls,
            self.allocations - earlier.allocations,
            self.random_elements - earlier.random_elements,
        )

    def __iadd__(self, other: OpCosts) -> OpCosts:
        self.kernels += other.kernels
        self.memory_bytes += other.memory_bytes
        self.attention_bytes += other.attention_bytes
        self.link_bytes += other.link_bytes
        self.matmuls.update(other.matmuls)
        self.allocations.update(other.allocations)
        self.random_elements += other.random_elements
        return self


def device_seconds(costs: OpCosts, attention_flops: float, spec: DeviceSpec) -> dict[str, float]:
    """Seconds of the ops in ``costs`` on ``spec``, by kind: ``matmul`` (each at the rate of its
    shape, or its bytes' time where that is longer), ``attention`` (fused kernels at the
    attention share of the peak, or their bytes' time), ``memory_bound``, ``launch`` and
    ``fresh_memory`` (first touch of large new blocks, where the allocator does not keep them);
    random draws are memory-bound, plus their numbers' time beyond their bytes'."""
    bandwidth = spec.memory_rate(spec.device_memory_gb_per_s) * 1e9
    matmul = 0.0
    for (m, n, k, nbytes), count in costs.matmuls.items():
        flops_time = 2.0 * m * n * k / (spec.matmul_rate(m, n, k) * 1e12)
        matmul += count * max(flops_time, nbytes / bandwidth)
    link = 0 if spec.copies_overlap else costs.link_bytes  # a CPU's cores copy
    peak = spec.peak_tflops * 1e12
    attention_rate = peak * (spec.attention_efficiency or spec.compute_efficiency)
    return {
        "matmul": matmul,
        "attention": max(attention_flops / attention_rate, costs.attention_bytes / bandwidth),
        "memory_bound": (costs.memory_bytes + link) / bandwidth
        + costs.random_elements * spec.random_draw_ns * 1e-9,
        "launch": costs.kernels * spec.launch_overhead_us * 1e-6,
        "fresh_memory": _fresh_seconds(costs, spec),
    }


def _fresh_seconds(costs: OpCosts, spec: DeviceSpec) -> float:
    if not spec.fresh_memory_gb_per_s:
        return 0.0
    fresh = sum(n for size, n in costs.allocations.items() if size >= spec.fresh_memory_threshold)
    return fresh / (spec.fresh_memory_gb_per_s * 1e9)
