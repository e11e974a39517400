"""Every private torch API the project uses, in one place: what each is for, why no public one
serves, and where it was checked. If a release moves one, only this file changes.

Checked on torch 2.13.0 (this project's CPU wheel: the suite runs every one of them but
``cuda_sleep``) and read in torch 2.11's sources (the build the lent GPU machines carry).

- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the step meter sees every aten op of
  a meta step, with its arguments and outputs, to count FLOPs, bytes and allocations. It is the
  base class torch's own ``FlopCounterMode`` uses; nothing public exposes the dispatcher.
- ``FakeStore`` (``torch.testing._internal.distributed.fake_pg``): with the registered ``fake``
  backend, a job of any size in one process whose collectives only check shapes (dry runs,
  ``--plan_for``), as torch's own tests use it; no public module exports the store.
- The SDPA kernels' aten ops (``_scaled_dot_product_flash_attention`` and its CPU form,
  ``_scaled_dot_product_efficient_attention``, ``_scaled_dot_product_cudnn_attention``): on
  meta tensors the public function takes the math path, so a dry run calls the kernel a
  device would run, to see its outputs and saved tensors. With their backwards and the math path's op, the same ops make attention with
  dropout one op of a compiled graph (``execution/engine/phases/seeded_attention.py``): it
  seeds the generator and calls the kernel SDPA would call, which no public function lets it
  do, and its backward is the one SDPA's autograd calls (``derivatives.yaml``).
- ``dynamo_counters`` (``torch._dynamo.utils.counters``): how many graphs Dynamo compiled, so a
  compiled run (``--compile``) can say that a step after the first compiled again; the public
  ``torch.compiler`` offers logs of recompiles, not a count.
- ``eager_where_compiling_fails`` (``torch._dynamo.config.suppress_errors``, with the
  inductor front's ``force_non_lazy_backward_lowering`` below): where inductor fails on a
  graph of a compiled part, the run goes on without that graph, as ``--compile`` promises;
  ``torch.compile`` has no public option for it.
- ``forget_compiled`` (``torch._C._dynamo.eval_frame.reset_code``, there since torch 2.1): the
  engine's check of the seeded attention op compiles one small function per shape and kernel
  it checks, whose graphs would otherwise stay in the code object's cache, all of them counted
  against the recompile limit (eight), past which a ``fullgraph`` compile fails; the public
  ``torch.compiler.reset`` would drop every other compiled part of the process too.
- ``storage_id`` (``untyped_storage()._cdata``, the address of the storage's C++ object): which
  storage a tensor views, so that what a layer keeps for its backward is counted once per
  storage and known apart from the weights and the x buffer it views
  (``execution/engine/phases/recompute.py``), and a compiled graph's saved tensors are counted
  once per storage (``execution/planning/compiled_costs.py``), on the dry run's meta and fake
  tensors as on real ones. The public ``untyped_storage().data_ptr()`` is 0 for every meta or
  fake storage (an empty real one too); ``id(untyped_storage())`` names a storage only while
  torch keeps one Python object alive with each storage, no more a promise than ``_cdata``.
- ``cuda_sleep`` (``torch.cuda._sleep``): a GPU spin of a given number of cycles, queued on a
  side stream before its copy, so tests of the engine's stream order see late copies.
- Inductor's front and middle (``torch._dynamo.backends.common.aot_autograd``,
  ``torch._inductor.compile_fx``, ``.graph.GraphLowering``, ``.scheduler``, ``.virtualized.V``,
  ``torch._subclasses.FakeTensorMode``): the dry run prices a ``torch.compile``d block by the
  kernels inductor would generate for it. :func:`inductor_capture_backend` hands over the
  graphs inductor's inner compiler receives; :func:`inductor_schedule` lowers and fuses one
  of them as ``compile_fx_inner`` does, stopping before code generation, and reads the
  scheduler's own estimate of each kernel's bytes. Nothing public exposes a compiled graph's
  kernels before they are generated and compiled (that needs the device and, for CUDA,
  Triton). Its steps, config keys and two stand-ins for a GPU (below) are read in torch
  2.13's ``compile_fx.py`` (``codegen_and_compile``, ``_compile_fx_main``) and checked on it
  only: not in 2.11, whose AOT autograd may lack the ``pre_grad_passes`` hook.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "EXTERN",
    "GENERATED",
    "NOP",
    "ScheduledNode",
    "TorchDispatchMode",
    "cuda_sleep",
    "dynamo_counters",
    "eager_backward_compile",
    "eager_where_compiling_fails",
    "fake_store",
    "fake_tensors",
    "forget_compiled",
    "inductor_capture_backend",
    "inductor_schedule",
    "is_fake",
    "sdpa_backward_ops",
    "sdpa_kernel_ops",
    "sdpa_math_op",
    "storage_id",
]


def dynamo_counters():
    """Dynamo's counters by category (``["stats"]["unique_graphs"]``: graphs compiled)."""
    from torch._dynamo.utils import counters

    return counters


def fake_store():
    """A store for ``dist.init_process_group("fake", ...)``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def sdpa_kernel_ops() -> dict[str, Callable]:
    """The aten op of each SDPA kernel, by the names the engine plans them with."""
    aten = torch.ops.aten
    return {
        "flash": aten._scaled_dot_product_flash_attention,
        "efficient": aten._scaled_dot_product_efficient_attention,
        "cudnn": aten._scaled_dot_product_cudnn_attention,
        "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu,
    }


def sdpa_math_op() -> Callable:
    """SDPA's math path as an op: the output and the probabilities it multiplied ``v`` by."""
    return torch.ops.aten._scaled_dot_product_attention_math


def sdpa_backward_ops() -> dict[str, Callable]:
    """The aten op of each fused CUDA kernel's backward, called as SDPA's autograd calls it."""
    aten = torch.ops.aten
    return {
        "flash": aten._scaled_dot_product_flash_attention_backward,
        "efficient": aten._scaled_dot_product_efficient_attention_backward,
    }


@contextlib.contextmanager
def eager_where_compiling_fails() -> Iterator[None]:
    """Dynamo's settings while compiled parts run: a frame whose graph fails to compile
    (inductor or Triton raising) runs without it from then on instead of raising (the frames
    it calls compiled on their own, or eagerly), Dynamo logging why; its backward is compiled
    with its forward (:func:`eager_backward_compile`), so that a failure there is caught too,
    not raised at the first backward."""
    with torch._dynamo.config.patch(suppress_errors=True), eager_backward_compile():
        yield


def forget_compiled(function: Callable) -> None:
    """Drops what Dynamo compiled of ``function``'s code: its cache and recompile limit are
    the code object's, which every call of the function that made it shares."""
    torch._C._dynamo.eval_frame.reset_code(function.__code__)


def storage_id(tensor: torch.Tensor) -> int:
    """The storage ``tensor`` views, as a number: the same for every view of one storage,
    different for each storage alive beside it, on meta and fake tensors too."""
    return tensor.untyped_storage()._cdata


def cuda_sleep(cycles: int) -> None:
    """Queues a spin of ``cycles`` GPU clock cycles on the current stream."""
    torch.cuda._sleep(cycles)


def inductor_capture_backend(record: Callable[[torch.fx.GraphModule, list, str], None]):
    """A ``torch.compile`` backend that builds the graphs inductor would compile, in inductor's
    way (its pre-grad passes, its decomposition table, its joint-graph passes and min-cut
    rematerialisation partitioner, inference input mutations kept in the graph), and gives
    each to ``record(gm, example_inputs, kind)`` (kind: ``forward``, ``backward`` or
    ``inference``) instead of compiling it: the graph runs as it is, op by op."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import detect_fake_mode, get_inputs_devices
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import (
        _recursive_joint_graph_passes,
        partition_fn,
        run_pre_grad_passes,
    )
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    def recorder(kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            if kind == "inference":  # no partition, so no joint passes yet: inductor runs them here
                device = get_inputs_devices(example_inputs, gm)[0]
                gm = _recursive_joint_graph_passes(gm, input_device=device)
            record(gm, list(example_inputs), kind)
            return make_boxed_func(gm.forward)

        return compile_graph

    aot = aot_autograd(
        fw_compiler=recorder("forward"),
        bw_compiler=recorder("backward"),
        inference_compiler=recorder("inference"),
        decompositions=select_decomp_table(),
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
        pre_grad_passes=run_pre_grad_passes,
    )

    def backend(gm: torch.fx.GraphModule, example_inputs):
        with (
            V.set_fake_mode(detect_fake_mode(example_inputs)),
            functorch_config.patch(unlift_effect_tokens=True),
        ):
            return aot(gm, example_inputs)

    return backend


@contextlib.contextmanager
def fake_tensors(real_inputs: bool = False) -> Iterator[None]:
    """Tensors made inside are fake: a layout and no storage; ops on them compute layouts
    only. Unlike meta tensors they keep a device, which inductor's passes read (they take a
    meta result for a value nobody needs and drop the ops that compute it). ``real_inputs``:
    their ops take real tensors too (positions an eager part makes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=real_inputs):
        yield


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (:func:`fake_tensors`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


@contextlib.contextmanager
def eager_backward_compile() -> Iterator[None]:
    """AOT autograd compiles a graph's backward with its forward, not at the first backward."""
    from torch._functorch import config as functorch_config

    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


GENERATED, EXTERN, NOP = "generated", "extern", "nop"


@dataclass(frozen=True)
class ScheduledNode:
    """One node of inductor's schedule after fusion.

    Attributes:
        kind: ``generated`` (a kernel inductor writes: pointwise ops and reductions, fused),
            ``extern`` (a library or fallback kernel: matmuls, SDPA, any op inductor does not
            lower; a matmul template too) or ``nop`` (no kernel: an alias, a tuple's item).
        nbytes: The scheduler's estimate of the bytes the kernel reads and writes: each
            buffer once (``BaseSchedulerNode.get_read_write_buffers_sizes``), buffers that
            live only inside a fused kernel not at all.
        op: The aten op of an extern kernel (empty for the others).
    """

    kind: str
    nbytes: int
    op: str = ""


# Inductor settings that would benchmark on a device or write files; a schedule needs neither.
_SCHEDULE_ONLY = {
    "max_autotune": False,
    "max_autotune_gemm": False,
    "max_autotune_pointwise": False,
    "benchmark_fusion": False,
    "benchmark_epilogue_fusion": False,
    "benchmark_kernel": False,
    "cpp_wrapper": False,
    "trace.enabled": False,
}

# What inductor's CUDA lowering reads of the GPU (split reductions size themselves by its SMs):
# an H100's, the same as an H200's (SM 9.0, 132 SMs), the GPUs the project is lent.
_LENT_GPU = {
    "multi_processor_count": 132,
    "cc": 90,
    "major": 9,
    "regs_per_multiprocessor": 65536,
    "max_threads_per_multi_processor": 2048,
    "max_threads_per_block": 1024,
    "warp_size": 32,
}


def inductor_schedule(
    gm: torch.fx.GraphModule, example_inputs: list, device: torch.device, is_backward: bool
) -> list[ScheduledNode]:
    """The kernels inductor generates for ``gm`` on ``device`` (a CPU or ``cuda:0``), in order.

    ``gm`` is rewritten in place (view-to-reshape, post-grad passes): hand over a copy whose
    ops' device arguments name ``device``. ``example_inputs`` give only layouts: each tensor
    becomes a fake one of its shape, strides and dtype on ``device``, so meta, fake and real
    tensors of any size serve, and nothing is allocated or run.

    For CUDA the CUDA backend's (Triton's) lowering and fusion rules apply with neither a GPU
    nor Triton present, through two stand-ins, patched for the call only: the GPU's
    properties are :data:`_LENT_GPU`'s, and the scheduler's check that Triton is installed
    passes (it guards code generation, which never starts here).
    """
    from torch._dynamo.utils import counters
    from torch._inductor import config, ir, metrics
    from torch._inductor import scheduler as scheduler_module
    from torch._inductor.compile_fx import (
        _recursive_post_grad_passes,
        fake_tensor_prop,
        maybe_disable_comprehensive_padding,
        view_to_reshape,
    )
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime.hints import DeviceProperties
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        # A caller's dispatch mode (the step meter) must not see inductor's fake ops.
        stack.enter_context(_disable_current_modes())
        stack.enter_context(_kept_inductor_statistics(counters, metrics))
        stack.enter_context(config.patch(_SCHEDULE_ONLY))
        if device.type == "cuda":

            def lent_gpu(_device) -> DeviceProperties:
                return DeviceProperties(type="cuda", index=0, **_LENT_GPU)

            stack.enter_context(mock.patch.object(DeviceProperties, "create", lent_gpu))
            stack.enter_context(mock.patch.object(scheduler_module, "has_triton", lambda: True))
        fake_mode = FakeTensorMode()
        with fake_mode:
            inputs = [_fake_like(t, device) for t in example_inputs]
        view_to_reshape(gm)
        with torch.no_grad():
            fake_tensor_prop(gm, inputs)
        stack.enter_context(V.set_fake_mode(fake_mode))
        stack.enter_context(DebugContext())
        _recursive_post_grad_passes(gm, is_inference=False)
        stack.enter_context(maybe_disable_comprehensive_padding(inputs))
        graph = GraphLowering(gm, example_inputs=inputs, is_backward=is_backward)
        stack.enter_context(V.set_graph_handler(graph))
        graph.run(*inputs)
        graph._update_scheduler()
        return [_scheduled(node, scheduler_module, ir) for node in graph.scheduler.nodes]


def _fake_like(value, device: torch.device):
    """A tensor of ``value``'s layout on ``device`` (under a fake mode: no storage); other
    values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)


def _scheduled(node, scheduler_module, ir) -> ScheduledNode:
    ir_node = node.node
    if isinstance(node, scheduler_module.NopKernelSchedulerNode) or isinstance(
        ir_node, ir.MultiOutput
    ):
        return ScheduledNode(NOP, 0)
    nbytes = node.get_read_write_buffers_sizes()
    if not (node.is_extern() or node.is_template()):
        return ScheduledNode(GENERATED, nbytes)
    if ir_node is None:  # a template with its epilogue fused (max_autotune only)
        return ScheduledNode(EXTERN, nbytes, node.get_name())
    # The graph's op where the kernel has one (mm, not the mm.out it calls), else the op a
    # fallback kernel runs.
    origin = ir_node.get_origin_node()
    op = origin.target if origin is not None else getattr(ir_node, "op_overload", None)
    return ScheduledNode(EXTERN, nbytes, str(op or ir_node.get_name()))


@contextlib.contextmanager
def _kept_inductor_statistics(counters, metrics) -> Iterator[None]:
    """Restores inductor's process-wide counters (pattern matches, fusions, nodes) afterwards:
    a priced schedule is not a compilation."""
    kept_counters = {name: Counter(counts) for name, counts in counters.items()}
    kept_metrics = {
        name: (list(value) if isinstance(value, list) else value)
        for name, value in vars(metrics).items()
        if not name.startswith("_") and isinstance(value, (int, float, list))
    }
    try:
        yield
    finally:
        counters.clear()
        counters.update(kept_counters)
        for name, value in kept_metrics.items():
            if isinstance(value, list):
                getattr(metrics, name)[:] = value
            else:
                setattr(metrics, name, value)
