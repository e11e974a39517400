"""A compiled graph's fused kernels and their bytes (execution/planning/fused_bytes.py) against
hand counts and against the eager step meter's per-op bytes, on the CPU's and CUDA's fusion
rules; the captured graphs against eager results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from execution.planning.fused_bytes import capture_compiled_graphs, fused_cost
from execution.planning.step_meter import StepMeter
from modelling.gpt import GPT, GPTShapes

DEVICE_TYPES = ("cpu", "cuda")


def _pointwise(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1).relu()


def _layer_norm_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.layer_norm(x, x.shape[-1:], weight, bias), approximate="tanh")


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_a_pointwise_chain_is_one_kernel_reading_and_writing_each_element_once(device_type):
    """Three eager kernels (mul, add, relu) become one that reads x and writes y: 4 bytes
    each way per float32 element."""
    x = torch.randn(1000)
    graphs, result = capture_compiled_graphs(_pointwise, x)
    assert [g.kind for g in graphs] == ["inference"]
    assert torch.equal(result, _pointwise(x))
    cost = fused_cost(graphs[0].gm, graphs[0].example_inputs, device_type)
    assert (cost.kernels, cost.memory_bytes, cost.extern_ops) == (1, 1000 * 4 + 1000 * 4, ())


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_layer_norm_then_gelu_fuses_to_its_inputs_and_output_below_the_eager_ops(device_type):
    """Eagerly layer norm writes its output (and its mean and rstd) and GELU reads it back;
    fused, one kernel reads x, the weight and the bias and writes the result, nothing else."""
    rows, hidden = 64, 256
    x, weight, bias = torch.randn(rows, hidden), torch.randn(hidden), torch.randn(hidden)
    graphs, result = capture_compiled_graphs(_layer_norm_gelu, x, weight, bias)
    torch.testing.assert_close(result, _layer_norm_gelu(x, weight, bias))
    with StepMeter() as meter:
        _layer_norm_gelu(x, weight, bias)
    cost = fused_cost(graphs[0].gm, graphs[0].example_inputs, device_type)
    assert cost.kernels == 1
    assert cost.memory_bytes == (2 * rows * hidden + 2 * hidden) * 4
    assert cost.memory_bytes < meter.costs.memory_bytes


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_a_large_meta_input_costs_the_same_bytes_per_element_as_a_small_real_one(device_type):
    """At a full model's shape ([2048, 12288] bf16, 25M elements) on the meta device nothing
    is allocated: the cost is the small real input's bytes per element, exactly; and layer
    norm with GELU is its hand count there too."""
    small = torch.randn(16, 96).to(torch.bfloat16)
    large = torch.empty(2048, 12288, dtype=torch.bfloat16, device="meta")
    costs = []
    for x in (small, large):
        graphs, _ = capture_compiled_graphs(_pointwise, x)
        costs.append(fused_cost(graphs[0].gm, graphs[0].example_inputs, device_type))
    assert costs[0].kernels == costs[1].kernels == 1
    assert costs[1].memory_bytes * small.numel() == costs[0].memory_bytes * large.numel()

    weight = torch.empty(12288, dtype=torch.bfloat16, device="meta")
    graphs, _ = capture_compiled_graphs(_layer_norm_gelu, large, weight, weight)
    cost = fused_cost(graphs[0].gm, graphs[0].example_inputs, device_type)
    assert cost.memory_bytes == (2 * large.numel() + 2 * 12288) * 2


def _block_and_weights():
    shapes = GPTShapes(
        layers=1, hidden=256, heads=4, vocab=512, positions=128, dropout_prob=0.0,
        layer_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    block = GPT(shapes).layers[0]
    # Drawn: the model allocates its matrices uninitialised (its initialisation is the
    # engine's), and whatever memory they get may hold NaNs.
    return block, {
        name: (torch.randn_like(p) * 0.02).requires_grad_() for name, p in block.named_parameters()
    }


def _run_block(block):
    def run(weights, x):
        out = torch.func.functional_call(block, weights, (x, None))
        return out[0] if isinstance(out, tuple) else out

    return run


def test_a_decoder_block_runs_its_captured_graphs_as_eager_does():
    """The recorded forward and backward graphs are the ones that run: the block's output and
    gradients through them match eager's."""
    block, weights = _block_and_weights()
    x = torch.randn(2, 128, 256, requires_grad=True)
    graphs, out = capture_compiled_graphs(_run_block(block), weights, x)
    assert [g.kind for g in graphs] == ["forward", "backward"]
    out.square().sum().backward()

    eager_weights = {name: w.detach().requires_grad_() for name, w in weights.items()}
    eager_x = x.detach().requires_grad_()
    eager_out = _run_block(block)(eager_weights, eager_x)
    eager_out.square().sum().backward()
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(x.grad, eager_x.grad)
    for name, w in weights.items():
        torch.testing.assert_close(w.grad, eager_weights[name].grad, msg=name)


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_a_decoder_blocks_fused_kernels_leave_its_matmuls_and_attention_out(device_type):
    """Forward and backward each fuse into kernels, whose bytes under Triton's rules are below
    the eager step's memory-bound bytes (the step meter's, which leave matmuls and attention
    out too; inductor's C++ rules for this block come out within 0.1% of eager's), and every
    matmul eager runs is an extern kernel, not counted."""
    block, weights = _block_and_weights()
    x = torch.randn(2, 128, 256, requires_grad=True)
    graphs, _ = capture_compiled_graphs(_run_block(block), weights, x)
    costs = [fused_cost(g.gm, g.example_inputs, device_type) for g in graphs]

    with StepMeter() as meter:
        _run_block(block)(weights, x).sum().backward()
    assert all(cost.kernels > 0 for cost in costs)
    if device_type == "cuda":
        assert sum(cost.memory_bytes for cost in costs) < meter.costs.memory_bytes
    extern = [op for cost in costs for op in cost.extern_ops]
    matmuls = [op for op in extern if op in ("aten.mm.default", "aten.addmm.default")]
    assert len(matmuls) == sum(meter.costs.matmuls.values()) == 12
    assert any("scaled_dot_product" in op for op in costs[0].extern_ops)
    assert any("scaled_dot_product" in op and "backward" in op for op in costs[1].extern_ops)


def test_pricing_a_graph_leaves_it_and_inductors_state_as_they_were():
    """Inside a step meter (the dry run's dispatch mode) the meter sees none of inductor's
    ops; afterwards the graph, inductor's config and statistics, its graph handler and the
    CUDA stand-ins are as before."""
    from torch._dynamo.utils import counters
    from torch._inductor import config, metrics
    from torch._inductor import scheduler as scheduler_module
    from torch._inductor.runtime.hints import DeviceProperties
    from torch._inductor.virtualized import V

    graphs, _ = capture_compiled_graphs(_layer_norm_gelu, torch.randn(8, 8), *torch.randn(2, 8))
    gm = graphs[0].gm
    code = gm.code
    saved_config = config.save_config()
    saved_counters = {name: dict(c) for name, c in counters.items()}
    saved_pre_fusion = metrics.ir_nodes_pre_fusion
    create, has_triton = DeviceProperties.create, scheduler_module.has_triton
    for device_type in DEVICE_TYPES:
        with StepMeter() as meter:
            fused_cost(gm, graphs[0].example_inputs, device_type)
        assert meter.costs.kernels == 0
    assert gm.code == code
    assert config.save_config() == saved_config
    assert {name: dict(c) for name, c in counters.items()} == saved_counters
    assert metrics.ir_nodes_pre_fusion == saved_pre_fusion
    assert (DeviceProperties.create, scheduler_module.has_triton) == (create, has_triton)
    assert not hasattr(V.graph, "scheduler")  # the null handler, not a graph


def test_one_function_is_captured_again_and_again():
    """Past dynamo's limit of compiled versions of one function (8): each capture compiles
    its own, so none runs eagerly unrecorded, or fails."""
    for _ in range(10):
        graphs, _ = capture_compiled_graphs(_pointwise, torch.randn(4))
        assert [g.kind for g in graphs] == ["inference"]


def test_an_unknown_device_type_is_refused():
    graphs, _ = capture_compiled_graphs(_pointwise, torch.randn(4))
    with pytest.raises(ValueError, match="device_type"):
        fused_cost(graphs[0].gm, graphs[0].example_inputs, "xpu")
