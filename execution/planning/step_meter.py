"""What a piece of code allocates and computes: the engine's own working-set and FLOP accounting.

A dispatch mode sees the output of every aten op; each new storage is counted until it is freed,
and matmuls and attention kernels add their FLOPs (torch's own flop formulas; a causal fused
attention kernel half of its formula, what it executes).
It works the same on real tensors (measure a CPU run) and on meta tensors (the dry run), so a
dry run's working set is what the same step allocates, not a formula. Buffers allocated before
the mode starts are not counted; what the caller keeps afterwards still counts as live.

On meta tensors an op's result depends only on its inputs' shapes, strides and dtypes and its
other arguments, and most of a dry run's time goes to torch's Python meta kernels working that
out again for every layer, pass and probe. So a functional op (no mutated argument, no result
aliasing an input) whose inputs and results are all meta is run once per distinct signature;
later calls get fresh tensors of the recorded results' layout and storage size, and the
recorded FLOPs (:class:`MetaResults`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from execution.planning.op_costs import OpCost, OpCosts, op_cost, result_tensors
from utils.torch_private import TorchDispatchMode


def _attention_kernels() -> frozenset:
    """The fused attention ops, forward and backward, of every backend this torch has."""
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_flash_attention_forward",
        "_flash_attention_backward",
        "_efficient_attention_forward",
        "_efficient_attention_backward",
    )
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


ATTENTION_KERNELS = _attention_kernels()


def _is_causal(func, args: tuple, kwargs: dict) -> bool:
    """Whether a fused attention op was called causal (its ``is_causal`` argument)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "is_causal":
            if argument.name in kwargs:
                return bool(kwargs[argument.name])
            return bool(args[index]) if index < len(args) else bool(argument.default_value)
    return False


class StepMeter(TorchDispatchMode):
    """Tracks live and peak bytes of storages created inside the ``with`` block, and FLOPs.

    Attributes:
        live: Bytes of counted storages still alive.
        peak: Largest ``live`` seen.
        flops: Floating-point operations of the matmuls and attention kernels that ran. A
            causal fused kernel counts half of torch's formula, which counts the whole
            ``[S, S]`` square: the kernel skips the blocks above the diagonal (as
            FlashAttention's benchmarks count it, whose rates ``DeviceSpec`` takes).
        attention_flops: The part of ``flops`` the fused attention kernels ran (they reach
            a lower share of the peak than matmuls; the written-out attention of
            ``--dropout_parity`` runs as matmuls and counts as such).
    """

    def __init__(
        self, meta_results: MetaResults | None = None, host_buffers: Iterable[torch.Tensor] = ()
    ):
        """``meta_results``: meta ops already run, to replay (kept by a planning across the
        steps it measures; a fresh set serves this meter alone). ``host_buffers``: tensors
        standing for host memory; a copy to or from one crosses the host link: its bytes are
        the link's (``OpCosts.link_bytes``), which a GPU's copy engines move beside its
        kernels and a CPU's cores move as any other memory-bound op."""
        super().__init__()
        self.meta_results = meta_results if meta_results is not None else MetaResults()
        self._host = {id(t.untyped_storage()) for t in host_buffers}
        self.live = 0
        self.peak = 0
        self.flops = 0
        self.attention_flops = 0
        self.costs = OpCosts()  # kernels, bytes and matmul shapes (execution.planning.op_costs)
        # id of each counted storage object (torch keeps one Python object per live storage,
        # and the finaliser drops the id when it dies, before the id can be reused).
        self._counted: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = self.meta_results.key(func, args, kwargs)
        recorded = self.meta_results.get(key)
        if recorded is not None:
            out, flops = recorded.replay()
            cost = recorded.cost
        else:
            out = func(*args, **kwargs)
            flops = 0
            count_flops = flop_registry.get(func._overloadpacket)
            if count_flops is not None:
                flops = count_flops(*args, **kwargs, out_val=out)
                if func._overloadpacket in ATTENTION_KERNELS and _is_causal(func, args, kwargs):
                    flops //= 2  # torch counts the whole square; the kernel skips the future
            cost = op_cost(func, args, kwargs, out, _tensors)
            self.meta_results.record(key, args, kwargs, out, flops, cost)
        self.flops += flops
        crosses = self._host and func._overloadpacket in _COPIES and cost.nbytes
        if crosses and not self._host.isdisjoint(_input_storages(args, kwargs)):
            cost = dataclasses.replace(cost, link=True)
        attention = func._overloadpacket in ATTENTION_KERNELS
        if flops and attention:
            self.attention_flops += flops
        self.costs.add(cost, attention)
        inputs = None
        for t in result_tensors(out, _tensors):
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._counted:
                continue  # a view, or an in-place op, of a tensor made in the block
            if inputs is None:
                inputs = _input_storages(args, kwargs)
            if key in inputs:
                continue  # a view or in-place op of a buffer made before the block
            nbytes = storage.nbytes()
            self.costs.allocated(nbytes)
            self._counted[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def disown(self, t: torch.Tensor) -> None:
        """Stops counting ``t``'s storage: from now on it stands for a buffer the plan
        counts (a layer's activations kept in place)."""
        self.live -= self._counted.pop(id(t.untyped_storage()), 0)

    def _free(self, key: int) -> None:
        self.live -= self._counted.pop(key, 0)


# The ops a buffer's load or store runs (Mover, the stores' closures).
_COPIES = frozenset({torch.ops.aten.copy_, torch.ops.aten._to_copy})


class _Result:
    """A functional meta op's results (layout and storage size of each), FLOPs and cost."""

    def __init__(self, out: Any, flops: int, cost: OpCost):
        self.cost = cost
        self.single = isinstance(out, torch.Tensor)
        results = (out,) if self.single else out
        self.layouts = [
            (t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
            for t in results
        ]
        self.flops = flops

    def replay(self) -> tuple[Any, int]:
        made = []
        for shape, stride, offset, dtype, nbytes in self.layouts:
            t = torch.empty(0, dtype=dtype, device="meta")
            t.set_(torch.UntypedStorage(nbytes, device="meta"), offset, shape, stride)
            made.append(t)
        return (made[0] if self.single else tuple(made)), self.flops


# Signatures kept at most (a step of one shape has a few thousand; each entry is small).
MAX_RECORDED = 200_000


class MetaResults:
    """Results of functional ops on meta tensors, by signature (see the module docstring)."""

    def __init__(self):
        self._results: dict[tuple, _Result | None] = {}
        self._functional: dict[Any, bool] = {}

    def _is_functional(self, func) -> bool:
        known = self._functional.get(func)
        if known is None:
            schema = func._schema
            known = (
                not schema.is_mutable
                and all(a.alias_info is None for a in schema.arguments)
                and all(
                    r.alias_info is None and isinstance(r.type, torch.TensorType)
                    for r in schema.returns
                )
                and len(schema.returns) > 0
            )
            self._functional[func] = known
        return known

    def key(self, func, args, kwargs) -> tuple | None:
        """The op's signature, or None where its results may depend on more (not functional,
        or some tensor not on the meta device)."""
        if not self._is_functional(func):
            return None
        try:
            signature = (func, _signature(args), _signature(tuple(kwargs.items())))
            hash(signature)
        except (_NotMeta, TypeError):
            return None
        return signature

    def get(self, key: tuple | None) -> _Result | None:
        return None if key is None else self._results.get(key)

    def record(self, key: tuple | None, args, kwargs, out: Any, flops: int, cost: OpCost) -> None:
        """Keeps ``out``'s layout for ``key``, unless a result is not a fresh meta tensor
        (``_unsafe_view``, say, declares no alias but returns a view of its input)."""
        if key is None or key in self._results:
            return
        if len(self._results) >= MAX_RECORDED:  # a long-lived process plans many shapes
            self._results.clear()
        results = (out,) if isinstance(out, torch.Tensor) else out
        fresh = isinstance(results, tuple) and all(
            isinstance(t, torch.Tensor) and t.device.type == "meta" for t in results
        )
        if fresh:
            storages = [id(t.untyped_storage()) for t in results]
            inputs = _input_storages(args, kwargs)
            fresh = len(set(storages)) == len(storages) and not inputs.intersection(storages)
        self._results[key] = _Result(out, flops, cost) if fresh else None


class _NotMeta(Exception):
    pass


def _signature(value) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            raise _NotMeta
        return (tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, torch.Generator):
        return "generator"  # draws nothing on meta
    return value


def _input_storages(args, kwargs) -> set[int]:
    """ids of the storages of an op's tensor arguments."""
    return {id(t.untyped_storage()) for t in _tensors((*args, *kwargs.values()))}


def _tensors(values) -> list[torch.Tensor]:
    """Tensors among aten arguments or results: flat, or in one level of lists (cheaper than a
    pytree walk, which would double the cost of a dry run)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out
