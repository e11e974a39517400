"""Device memory a run allocates outside its plan, which its budget leaves free: the cuBLAS
workspaces and a fused attention kernel's backward workspace. Neither is a tensor the meta step
sees, so the memory model (``memory.py``) takes them from here."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from execution.engine.phases.recompute import attention_kernel
from execution.engine.storage.buffers import DTYPES

if TYPE_CHECKING:
    from execution.planning.run_shape import RunShape

# cuBLAS's workspace: torch's default on Hopper (sm90) and later, 4096 * 8 * 1024 bytes = 32 MiB
# (parseChosenWorkspaceSize in aten/src/ATen/cuda/CublasHandlePool.cpp, "32MiB for Hopper",
# with CUBLAS_WORKSPACE_CONFIG unset; ":4096:2:16:8", 8.125 MiB, before Hopper). cuBLASLt
# reuses it (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default: the docstring of
# torch.backends.cuda.blas_workspace_size in torch 2.13).
CUBLAS_WORKSPACE = 4096 * 8 * 1024
# One per (handle, stream) that runs a matmul, and torch's pool gives each thread its own
# handle: a step's forward runs on the main thread, its backward on autograd's thread for the
# device, both on the compute stream (the side streams only copy and communicate).
CUBLAS_WORKSPACES = 2


def attention_workspace_bytes(kernel: str, batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Device bytes a fused attention kernel's backward allocates for itself, beyond the
    gradients the meta step counts, on ``batch`` x ``heads`` x ``seq`` x ``head_dim``; 0 for a
    CPU's kernels, whose temporaries are torch ops the meta step counts. Rounded-up sizes are
    written S128 (``seq`` to a multiple of 128), D32, D128.

    - ``flash`` (``mha_bwd``, torch's flash_api.cpp): ``dq_accum`` float32 [B, S128, H, D32]
      and ``softmax_d`` float32 [B, H, S128].
    - ``efficient`` (``_efficient_attention_backward``, attention_backward.cu; float32): the
      dQ accumulator its split keys add into, per batch and head a tile of floats and a
      16-byte header for each tile of at least 32 x 32 over at most S128 x D128
      (GradQTempStorage, kernel_backward.h); and ``delta`` float32 [B, H, S]. While delta is
      computed, its float32 product [B, S, H, D] (no larger than the accumulator), the sum and
      delta are live; then delta beside the accumulator: the accumulator and 2 S floats per
      batch and head bound both.
    """
    if kernel == "flash":
        rows = _round_up(seq, 128)
        return 4 * batch * heads * rows * (_round_up(head_dim, 32) + 1)
    if kernel == "efficient":
        tiles = math.ceil(seq / 32) * math.ceil(head_dim / 32)
        accumulator = _round_up(seq, 128) * _round_up(head_dim, 128) + 4 * tiles
        return 4 * batch * heads * (accumulator + 2 * seq)
    return 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def device_reserve(run: RunShape, device_type: str) -> int:
    """Device bytes a run allocates outside its plan, which its budget leaves free: the cuBLAS
    workspaces and one attention backward's workspace at this rank's shapes (one runs at a
    time; its heads are a tp1 shard's, over cp ranks' whole sequence). 0 on a CPU."""
    if device_type != "cuda":
        return 0
    model, mesh = run.model, run.mesh
    kernel = attention_kernel(device_type, model.dropout_prob, DTYPES[run.precision])
    heads = model.heads // mesh.tp1 // mesh.cp
    attention = attention_workspace_bytes(
        kernel, run.micro_batch_size, heads, run.sequence_length, model.head_dim
    )
    return CUBLAS_WORKSPACES * CUBLAS_WORKSPACE + attention
