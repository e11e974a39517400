"""The PyTorch baselines bench_step.py measures our engine against: a plain loop and FSDP2.

Both train the single-device :class:`modelling.gpt.GPT` from our engine's initial weights, on
the same batches, with the same AdamW hyper-parameters, weight-decay groups, clipping and
learning-rate schedule, so their losses can be compared with ours (tests/benchmarks/test_bench_step.py).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from config.schema import PretrainingConfig
from execution.engine.phases.compiled import INDUCTOR_OPTIONS
from execution.engine.plan import compiles
from execution.engine.storage.buffers import DTYPES
from execution.parallel.launch import usable_cores
from execution.parallel.sharding import init_model_shard
from execution.training.lr_schedule import learning_rate
from modelling.dropout import BlockSeeds, mix_seed
from modelling.gpt import GPT, GPTShapes

StepFn = Callable[[int], float]  # runs step i on batch i, returns its mean loss
# Called before micro-batch m of a step's n: where a baseline switches per-micro-batch modes.
MicroBatchHook = Callable[[int, int], None]


def plain_loop_label(config: PretrainingConfig) -> str:
    """The plain loop recomputes what our ``--recompute`` does: every layer unless ``none``."""
    if config.execution.recompute == "none":
        return "pytorch loop (AdamW)"
    return "pytorch loop (ckpt, AdamW)"


FSDP2_OFFLOAD = "pytorch FSDP2 + CPU offload"


class Held(nn.Module):
    """A decoder block behind a module of its own: what is hooked onto this one (FSDP2's
    gathers) runs outside the block's compiled graph, as torchtitan compiles then shards."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None = None) -> torch.Tensor:
        return self.block(x, seeds)


class Checkpointed(Held):
    """A decoder block whose activations are recomputed in backward (torch.utils.checkpoint)."""

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None = None) -> torch.Tensor:
        return checkpoint(self.block, x, seeds, use_reentrant=False)


def initial_model(config: PretrainingConfig, held: bool = False) -> GPT:
    """The single-device GPT with our engine's initial weights, each layer checkpointed unless
    ``--recompute none`` (then :class:`Held` if ``held``). The weights are drawn once, on every
    core this process may use, into a model built without storage: one built on the host would
    first allocate weights of its own and fill its embeddings with torch's random numbers, only
    to have them replaced."""
    shapes = GPTShapes.from_config(config.model)
    with torch.device("meta"):
        model = GPT(shapes)
    seed, std = config.training.seed, config.model.init_std
    weights = init_model_shard(shapes, seed, std, workers=usable_cores())
    model.load_state_dict(weights, assign=True)
    if config.execution.recompute != "none":
        model.layers = nn.ModuleList(Checkpointed(layer) for layer in model.layers)
    elif held:
        model.layers = nn.ModuleList(Held(layer) for layer in model.layers)
    return model


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The project's grouping: decay matrices and embeddings (2-D), never biases or norms."""
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() == 2]
    others = [p for p in params if p.dim() != 2]
    return [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": others, "weight_decay": 0.0},
    ]


def _dropout_seeds(config: PretrainingConfig, step: int, micro: int, compiled: bool = False):
    """Dropout seeds per (step, micro-batch): the same dropout work as ours, not its masks;
    a compiled block's as tensors, as ours are given (modelling/dropout.py)."""
    if config.model.dropout_prob == 0.0:
        return {}
    base = (config.training.seed, step, micro)
    layers = [
        BlockSeeds(*(mix_seed(*base, n, k) for k in range(3))) for n in range(config.model.layers)
    ]
    if compiled:
        layers = [seeds.as_tensors() for seeds in layers]
    return {"embedding_seed": mix_seed(*base, -1), "layer_seeds": layers}


def compile_blocks(model: GPT) -> None:
    """Compiles each decoder block and the head in place, as torchtitan compiles per block
    and as ``--compile`` compiles our parts (execution/engine/phases/compiled.py)."""
    for layer in model.layers:
        block = layer.block if isinstance(layer, Held) else layer
        block.compile(options=INDUCTOR_OPTIONS)
    model.head.compile(options=INDUCTOR_OPTIONS)


def pytorch_loop(
    config: PretrainingConfig,
    device: torch.device,
    batches,
    model: nn.Module | None = None,
    autocast: bool = True,
    fused: bool | None = None,
    before_micro_batch: MicroBatchHook | None = None,
    compiled: bool | None = None,
) -> StepFn:
    """The textbook loop on ``model`` (default: :func:`initial_model` moved to ``device``).

    ``autocast`` runs the forward under ``torch.autocast`` in the run's 16-bit precision (off
    where the model casts its parameters itself, as FSDP2's mixed precision does). ``fused``
    picks torch's fused AdamW; by default on CUDA only, so that on a CPU the baseline's update
    is the textbook single-tensor one. The loop's own model compiles its blocks where
    ``--compile`` would compile ours (:func:`compile_blocks`); ``compiled`` says whether a
    given model's blocks are compiled (their dropout seeds are then tensors).
    """
    if model is None:
        compiled = compiles(config.execution.compile, device.type)
        model = initial_model(config).to(device)
        if compiled:
            compile_blocks(model)
    t, o = config.training, config.training.optimizer
    if fused is None:
        fused = device.type == "cuda"
    groups = _param_groups(model, o.weight_decay)
    fused_only = {"fused": True} if fused else {}  # leaves torch's own default otherwise
    optimizer = torch.optim.AdamW(
        groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps, **fused_only
    )
    dtype, scale = DTYPES[t.precision], t.loss_scaling
    autocast = autocast and dtype != torch.float32
    clip = o.gradient_clipping if o.gradient_clipping > 0 else math.inf

    def step(i: int) -> float:
        tokens = batches[i].to(device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(i, o, config.tokens_per_step, t.steps)
        optimizer.zero_grad(set_to_none=True)
        accumulation, total = tokens.shape[0], torch.zeros((), device=device)
        for m in range(accumulation):
            if before_micro_batch is not None:
                before_micro_batch(m, accumulation)
            with torch.autocast(device.type, dtype, enabled=autocast):
                seeds = _dropout_seeds(config, i, m, bool(compiled))
                loss = model(tokens[m, :, :-1], tokens[m, :, 1:], **seeds)
            (loss * (scale / accumulation)).backward()
            total += loss.detach().float()
        if scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return total.item() / accumulation

    # Each parameter, its gradient and AdamW's two moments, all in the parameters' dtype.
    step.state_bytes_per_param = 4 * next(model.parameters()).element_size()
    return step


def fsdp2_offload(config: PretrainingConfig, device: torch.device, batches) -> StepFn:
    """FSDP2 on a world of one: each layer and the root sharded, parameters offloaded to host.

    Parameters, gradients and AdamW state live in (pinned) host memory and the optimizer steps
    on the CPU (fused AdamW), as FSDP2's ``CPUOffloadPolicy`` prescribes; with 16-bit precision
    the layers compute in that dtype (``MixedPrecisionPolicy``), gradients are reduced in
    float32.

    Its blocks recompute what ours do (``--recompute``: none keeps every activation) and
    compile where ours do (``--compile``; :func:`compile_blocks` on each block inside the
    module FSDP2 shards). Configured as fairly as FSDP2 allows, to move what our engine moves:
    each parameter once to the device per step and each gradient once back. Parameters stay
    gathered from the first
    forward of a step to its last backward (``reshard_after_forward=False``, and
    ``set_reshard_after_backward(False)`` on all but the last micro-batch), and gradients
    accumulate on the device without a reduction or an offload per micro-batch
    (``set_requires_gradient_sync(False)``). Both methods exist in torch 2.4 and later.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="bench_step_"), "store")  # a fresh file
        # Gloo for the host: with offload the gradients are host tensors, and clipping reduces
        # their norm across the (one-rank) mesh.
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"file://{store}",
            rank=0,
            world_size=1,
            device_id=device,
        )
    dtype = DTYPES[config.training.precision]
    policy = {"offload_policy": CPUOffloadPolicy(), "reshard_after_forward": False}
    if dtype != torch.float32:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    compiled = compiles(config.execution.compile, device.type)
    model = initial_model(config, held=compiled)
    if compiled:
        compile_blocks(model)
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)

    def last_only(m: int, micro_batches: int) -> None:
        last = m == micro_batches - 1
        model.set_requires_gradient_sync(last, recurse=True)
        model.set_reshard_after_backward(last, recurse=True)

    # The update runs on the host copies; torch's fused CPU AdamW is the fastest it offers.
    return pytorch_loop(
        config,
        device,
        batches,
        model,
        autocast=False,
        fused=True,
        before_micro_batch=last_only,
        compiled=compiled,
    )


def fsdp2_host_bytes(config: PretrainingConfig) -> int:
    """Host bytes FSDP2 with CPU offload holds for ``config``'s model: float32 parameters and
    gradients in pinned memory (which PyTorch's host allocator rounds up to a power of two per
    tensor) and two float32 AdamW moments per parameter in ordinary memory."""
    with torch.device("meta"):
        model = GPT(GPTShapes.from_config(config.model))
    total = 0
    for p in model.parameters():
        pinned = 1 << max(0, (4 * p.numel() - 1).bit_length())  # next power of two
        total += 2 * pinned + 8 * p.numel()
    return total
