"""What a decoder layer keeps from its forward for its backward (``--recompute``).

- ``full``: nothing but its input x (already in the activation buffers); the backward phase
  runs the layer forward again under autograd (the least memory, the most compute).
- ``none``: the forward phase runs under autograd and keeps the graph; every tensor autograd
  saves is kept, and the backward phase only runs the backward. With activations on the host
  each is copied into the layer's ``kept`` entry of the activation buffers; on the device
  the layer keeps the tensors themselves (a copy there would move as many bytes as the
  block's own elementwise work).
- ``selective`` (Korthikanti et al. 2022): as ``none``, but attention's core (scores,
  softmax, dropout, the product with v) is checkpointed, so what it keeps is q, k and v, not
  the ``[heads, seq, seq]`` tensors; the backward recomputes only the core.

Weights are never kept: a saved tensor that lies in a gathered weight vector is recorded as
its place in that vector, and the backward phase reads it from the same weights gathered
again. Gradients reach the accumulators through :class:`_Bind`, and the graph is held by a
one-element :class:`_Handle` instead of the layer's output, so a kept graph holds no memory
but its ``kept`` entry, or the tensors it keeps in place. Dropout masks are drawn from the
same explicit seeds as in ``full`` (:mod:`modelling.layers`), so every mode computes the same
numbers.

The bytes of an entry are measured, not estimated: :func:`kept_bytes` runs the same packing
over one layer's forward on meta tensors, with attention as the kernel the device runs; the
buffers are allocated by that figure (or, in place, the storages the saved tensors lie in)
and the planner plans with it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from execution.engine.phases.binding import WeightSlots
from execution.engine.phases.selective import attention_for
from execution.engine.storage.buffers import FlatSpec, flat_specs
from execution.parallel.mesh import ParallelLayout
from execution.parallel.sharding import SHARD_KINDS
from modelling.attention_kernel import TorchSDPA
from modelling.components import Components
from modelling.dropout import BlockSeeds
from modelling.gpt import GPT, LAYERS, GPTShapes
from utils.torch_private import is_fake, sdpa_kernel_ops, storage_id

MODES = ("full", "selective", "none")
# Each kept tensor starts on this many bytes, so any dtype can view its region.
ALIGN = 16
META = torch.device("meta")


def attention_kernel(device_type: str, dropout_prob: float, dtype: torch.dtype) -> str:
    """The attention kernel ``scaled_dot_product_attention`` runs on a device in ``dtype``,
    which decides what it saves. On CUDA: ``flash`` in 16 bits, ``efficient`` (the
    memory-efficient kernel) in float32, which FlashAttention does not take; with dropout too,
    which both draw. The engine runs the calibration's fastest that passes its check, this one
    without timings (:mod:`~execution.engine.phases.attention_kernels`). On a CPU:
    ``cpu_flash`` without dropout, else ``math``. (``--dropout_parity`` writes attention with
    dropout out instead of calling it: matmuls and a [heads, seq, seq] tensor anywhere.)"""
    if device_type == "cuda":
        return "efficient" if dtype == torch.float32 else "flash"
    return "cpu_flash" if dropout_prob == 0.0 else "math"


# The SDPA backend each CUDA kernel is; a CPU's kernels are left to torch (its choice there is
# the one attention_kernel names, and pinning it would change nothing).
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def _with_bias_slot(kernel, q, k, v, dropout_p, is_causal):
    # The memory-efficient and cuDNN kernels take a bias, and a logsumexp only where a
    # backward will need it (should_compute_logsumexp in torch's attention.cpp).
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return sdpa_kernel_ops()[kernel](q, k, v, None, backward, dropout_p, is_causal)


def kernel_attention(kernel: str) -> Callable[..., torch.Tensor] | None:
    """``scaled_dot_product_attention`` as ``kernel`` runs it on meta and fake tensors (where
    torch takes the math path, whose bytes grow with the square of the sequence): its own op,
    whose outputs, saved tensors, FLOPs and bytes are the device kernel's; real tensors, or
    arguments it does not take, go to ``F.scaled_dot_product_attention``. None: ``math``."""
    biased = {name: functools.partial(_with_bias_slot, name) for name in ("efficient", "cudnn")}
    op = (sdpa_kernel_ops() | biased).get(kernel)
    if op is None:
        return None

    def attention(q, k, v, *args, dropout_p=0.0, is_causal=False, **kwargs):
        if not (q.is_meta or is_fake(q)) or args or kwargs:
            sdpa = F.scaled_dot_product_attention
            return sdpa(q, k, v, *args, dropout_p=dropout_p, is_causal=is_causal, **kwargs)
        return op(q, k, v, dropout_p, is_causal)[0]

    return attention


class _Bind(torch.autograd.Function):
    """Identity on a layer's input and weights, one node for them all; its backward hands
    their gradients to ``sink`` at once, chosen at backward time (the dx of the layer's input,
    and the weights' accumulators, which add a layer's dozen tensors in one op). One node per
    layer forward, not one per tensor: a node costs the host a few microseconds each way."""

    @staticmethod
    def forward(ctx, anchor, sink, names, x, *weights):
        ctx.sink, ctx.names = sink, names
        ctx.set_materialize_grads(False)
        return (x.view_as(x), *(w.view_as(w) for w in weights))

    @staticmethod
    def backward(ctx, dx, *grads):
        ctx.sink(dx, ctx.names, grads)
        return (None,) * (4 + len(grads))


class _Sink:
    """Where a kept graph's :class:`_Bind` hands its gradients: the dx of the layer's input
    (collected in ``dx``) and the weights' to ``grads``, set before each backward (no
    gradient of a weight that took no part is added)."""

    def __init__(self):
        self.grads = None
        self.dx: list[torch.Tensor] = []

    def __call__(self, dx, names, grads) -> None:
        self.dx.append(dx)
        if self.grads is not None:
            kept = [(n, g) for n, g in zip(names, grads, strict=True) if g is not None]
            self.grads.add([n for n, _ in kept], [g for _, g in kept])


class _Handle(torch.autograd.Function):
    """Stands for a layer's output in its kept graph: one element broadcast to the output's
    shape, so the graph does not hold the output itself (which went to the x buffer)."""

    @staticmethod
    def forward(ctx, y):
        return y.new_zeros(()).expand(y.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Packer:
    """The ``pack`` hook of one layer's forward: each tensor autograd saves goes to the next
    aligned region of ``entry`` (``store`` copies it there), once however often it is saved;
    weights become their place in a gathered vector of ``flats``.

    ``entry`` None measures only. A tensor that does not fit (the kernel saved more than was
    measured) stays where it is and is counted in ``overflow``. ``held`` counts the bytes of
    the storages the saved tensors lie in, but for those of ``buffers`` (the x buffer, whose
    view a layer norm saves): what keeping them ``in_place`` (activations on the device)
    holds, where each stays as it is and ``on_keep`` is told of each storage's first one. A
    tensor on the CPU while the layer runs elsewhere stays there too, uncounted: the
    memory-efficient kernel's philox seed and offset, which its backward reads on the host
    (Note [Seed and Offset Device] in torch's attention.cu), so a copy on the device would be
    read as a host address. The meta measurement cannot tell their place and counts them: 32
    bytes of the entry stay unused.
    """

    def __init__(
        self, entry, store, flats: dict[str, torch.Tensor], in_place=False, buffers=(), on_keep=None
    ):
        self.entry, self.store = entry, store
        self.in_place, self.buffers, self.on_keep = in_place, buffers, on_keep
        self._held: set[int] = set()
        self.device = next(iter(flats.values())).device if flats else None
        self.weights = {storage_id(flat): kind for kind, flat in flats.items()}
        self.offsets = {kind: flat.storage_offset() for kind, flat in flats.items()}
        self.used = self.copied = self.overflow = self.held = 0
        self._seen: dict[tuple, tuple] = {}
        # Packed tensors stay referenced until the forward ends: their storages' addresses key
        # _seen, and a storage freed meanwhile could lend its address to a new one.
        self._alive: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> tuple:
        storage = storage_id(t)
        kind = self.weights.get(storage)
        if kind is not None:
            return ("weight", kind, t.size(), t.stride(), t.storage_offset() - self.offsets[kind])
        if t.device.type == "cpu" and self.device is not None and t.device != self.device:
            return ("host", t)
        if storage not in self.buffers and storage not in self._held:
            self._held.add(storage)
            self.held += t.untyped_storage().nbytes()
            if self.in_place and self.on_keep is not None:
                self.on_keep(t)
        if self.in_place:
            return ("kept", t)
        key = (storage, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)
        if key in self._seen:
            return self._seen[key]
        nbytes = t.numel() * t.element_size()
        start, end = self.used, -(-(self.used + nbytes) // ALIGN) * ALIGN
        if self.entry is None:
            packed = ("measured", t)
        elif end > self.entry.numel():
            self.overflow += nbytes
            packed = ("kept", t)
        else:
            # In t's order of dimensions: a recompute then runs its ops on the layouts the
            # forward saw (a contiguous q turns q @ k^T into another kernel, rounded otherwise).
            region = self.entry[start : start + nbytes].view(t.dtype)
            region = region.as_strided(t.shape, _dense_strides(t))
            self.store(region, t)
            packed = ("region", region, t.stride())
        self.used, self.copied = end, self.copied + nbytes
        self._seen[key] = packed
        self._alive.append(t)
        return packed

    def close(self) -> None:
        self._seen.clear()
        self._alive.clear()
        self._held.clear()


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of ``t``'s shape with its dimensions in ``t``'s stride order
    (what ``torch.empty_like`` keeps)."""
    strides, step = [0] * t.dim(), 1
    for dim in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        strides[dim] = step
        step *= t.size(dim)
    return tuple(strides)


def _bound_forward(slots, views, x, seeds, packer, unpack, sink) -> tuple:
    """One layer forward of the block ``slots`` holds (:class:`WeightSlots`) on the weights
    ``views`` (by name) under autograd, with its saved tensors packed by ``packer``; returns
    the output and its graph's handle."""
    anchor = torch.empty(0, device=x.device, requires_grad=True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(packer.pack, unpack):
        names = tuple(views)
        x, *weights = _Bind.apply(anchor, sink, names, x, *views.values())
        with slots.bound(dict(zip(names, weights, strict=True))):
            y = slots.module(x, seeds)
        handle = _Handle.apply(y)
    packer.close()
    return y.detach(), handle


class KeptLayers:
    """The kept graphs of one step's layer forwards, until their backward (``none`` and
    ``selective``).

    Args:
        block: The stateless decoder-block template (built for the mode,
            :func:`~.selective.attention_for`).
        specs: How each kind's weights pack into a layer's gathered vectors.
        entries: ``kept`` activation buffer, ``[layers, entries, bytes]`` of uint8.
        store: Copies a tensor into a region of ``entries`` (counting host-link bytes).
        load: A region of ``entries`` on the compute device (a copy when on the host).
        exact_strides: Hand the backward each saved tensor with the strides it was saved
            with, not the region's dense ones (a compiled block's backward needs them).
        in_place: Keep the saved tensors themselves, not copies in ``entries`` (activations
            on the device), but those lying in ``buffers``' storages.
        buffers: Storages (:func:`~utils.torch_private.storage_id`) a layer's input is a
            view of.

    Attributes:
        on_keep: Told of each tensor kept in place (a dry run's meter counts them as the
            activations the plan holds, not as working set).
    """

    def __init__(
        self,
        block,
        specs: dict[str, FlatSpec],
        entries,
        store,
        load,
        exact_strides=False,
        in_place=False,
        buffers: frozenset[int] = frozenset(),
    ):
        self.slots, self.specs = WeightSlots(block), specs
        self.exact_strides = exact_strides
        self.entries, self.store, self.load = entries, store, load
        self.in_place, self.buffers = in_place, buffers
        self.on_keep: Callable[[torch.Tensor], None] | None = None
        self.overflow = 0  # bytes kept outside the buffer (0 when the measurement held)
        # Most bytes of an entry used (its size when the measurement held; in place, what the
        # storages held take)
        self.largest = 0
        self._graphs: dict[tuple[int, int], torch.Tensor] = {}
        self._sink = _Sink()
        self._flats: dict[str, torch.Tensor] = {}

    def _unpack(self, packed: tuple) -> torch.Tensor:
        if packed[0] == "weight":
            _, kind, size, stride, offset = packed
            flat = self._flats[kind]
            return flat.as_strided(size, stride, flat.storage_offset() + offset)
        if packed[0] == "region":
            region = self.load(packed[1])
            if not self.exact_strides or region.stride() == packed[2]:
                return region
            # A compiled backward reads its saved tensors with the strides it was compiled
            # for (a view of q out of qkv has gaps that the dense region closed).
            exact = torch.empty_strided(
                region.shape, packed[2], dtype=region.dtype, device=region.device
            )
            return exact.copy_(region)
        return packed[1]

    def views(self, flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A layer's weights by name, views into its gathered vectors ``flats``: taken once
        for a phase's micro-batches."""
        return {
            n: v for kind, flat in flats.items() for n, v in self.specs[kind].views(flat).items()
        }

    def forward(self, layer, entry, flats, views, x, seeds) -> torch.Tensor:
        """Layer ``layer``'s output for buffer entry ``entry``, its graph kept (``views``: the
        weights in ``flats`` by name, :meth:`views`)."""
        packer = _Packer(
            self.entries[layer, entry], self.store, flats, self.in_place, self.buffers, self.on_keep
        )
        args = (self.slots, views, x, seeds, packer, self._unpack, self._sink)
        y, self._graphs[layer, entry] = _bound_forward(*args)
        self.overflow += packer.overflow
        self.largest = max(self.largest, packer.held if self.in_place else packer.used)
        return y

    def backward(self, layer, entry, flats, dy, grads) -> torch.Tensor:
        """Backpropagates ``dy`` through the kept graph: adds the weights' gradients to
        ``grads`` (:class:`~execution.engine.phases.gradients.Accumulators`) and returns the gradient
        of the layer's input."""
        handle = self._graphs.pop((layer, entry))
        self._flats = flats
        self._sink.grads = grads
        try:
            torch.autograd.backward(handle, dy)
            return self._sink.dx.pop()
        finally:  # every kept graph's _Bind node holds this very sink
            self._flats = {}
            self._sink.grads = None
            self._sink.dx.clear()

    def drop(self) -> None:
        """Forgets graphs a step left behind (one that raised half-way)."""
        self._graphs.clear()


def meta_block(shapes: GPTShapes, kernel: str = "math", mode: str = "full") -> torch.nn.Module:
    """A decoder block of this shard's shapes on meta tensors, its collectives only shaping
    their outputs, its attention running as ``kernel`` would (:func:`kernel_attention`) and
    recomputing what ``mode`` recomputes (:func:`~.selective.attention_for`)."""
    layout = ParallelLayout.shapes_only(1, shapes.tp1, shapes.tp2)
    sdpa = kernel_attention(kernel) or F.scaled_dot_product_attention
    components = Components.of(shapes, TorchSDPA(sdpa=sdpa), attention_for(mode))
    with torch.device(META):
        model = GPT(
            dataclasses.replace(shapes, layers=1), layout.tp1, layout.tp2, components=components
        )
    return model.layers[0]


@dataclasses.dataclass(frozen=True)
class KeptBytes:
    """What one decoder layer keeps per micro-batch, measured (all 0 for ``full``).

    Attributes:
        entry: Bytes of its entry in the ``kept`` buffer (regions aligned).
        stored: Bytes copied into the entry by the forward.
        loaded: Bytes read back by the backward (a region saved twice is read twice).
        in_place: Bytes of the storages the saved tensors lie in, the layer's input's
            buffer aside: what it keeps where activations are on the device (no copies).
    """

    entry: int = 0
    stored: int = 0
    loaded: int = 0
    in_place: int = 0

    def bytes_for(self, activations: str) -> int:
        """Bytes an entry takes with activations placed on ``activations``."""
        return self.in_place if activations == "device" else self.entry


def kept_bytes(
    shapes: GPTShapes, micro_batch: int, sequence: int, dtype: torch.dtype, mode: str, kernel: str
) -> KeptBytes:
    """What one decoder layer keeps per micro-batch under ``mode`` (see
    :func:`kept_layer_on_meta`)."""
    if mode == "full":
        return KeptBytes()
    return kept_layer_on_meta(shapes, micro_batch, sequence, dtype, mode, kernel)


def kept_layer_on_meta(
    shapes: GPTShapes, micro_batch: int, sequence: int, dtype: torch.dtype, mode: str, kernel: str
) -> KeptBytes:
    """One decoder layer's forward, keeping what ``mode`` keeps (``selective`` or ``none``)
    through the engine's packing, and its backward, on meta tensors with attention running
    as ``kernel`` (:func:`attention_kernel`); returns the bytes kept, stored, loaded and held
    in place."""
    block = meta_block(shapes, kernel, mode)
    specs = flat_specs(shapes, dict.fromkeys(SHARD_KINDS, 1))[LAYERS]
    flats = {k: torch.empty(s.padded, dtype=dtype, device=META) for k, s in specs.items()}
    x = torch.empty(micro_batch, sequence, shapes.hidden // shapes.tp2, dtype=dtype, device=META)
    seeds = BlockSeeds(1, 2, 3) if shapes.dropout_prob else None
    # The engine's input is a view of the x buffer, unless tp1 gathered it anew.
    buffers = frozenset({storage_id(x)}) if shapes.tp1 == 1 else frozenset()
    packer = _Packer(None, None, flats, buffers=buffers)
    loaded = 0

    def unpack(packed: tuple) -> torch.Tensor:
        nonlocal loaded
        if packed[0] == "weight":
            _, kind, size, stride, offset = packed
            return flats[kind].as_strided(size, stride, offset)
        loaded += packed[1].numel() * packed[1].element_size()
        return packed[1]

    sink = _Sink()
    views = {n: v for k, flat in flats.items() for n, v in specs[k].views(flat).items()}
    _, handle = _bound_forward(WeightSlots(block), views, x, seeds, packer, unpack, sink)
    torch.autograd.backward(handle, torch.empty_like(x))
    return KeptBytes(packer.used, packer.copied, loaded, packer.held)
