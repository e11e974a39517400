"""What the step meter prices as device work: views, host-link copies and collectives."""

from __future__ import annotations

import torch

from execution.planning.op_costs import op_cost
from execution.planning.step_meter import StepMeter

META = torch.device("meta")


def test_a_view_that_declares_no_alias_moves_no_bytes():
    """``_unsafe_view`` (the reshape ``matmul`` ends with) is a view: the meter counts the
    multiplication's 24 floats read and 24 written, and one kernel."""
    x = torch.empty(4, 6, device=META)
    with StepMeter() as meter:
        torch.ops.aten._unsafe_view(x * 2.0, [24])
    assert (meter.costs.kernels, meter.costs.memory_bytes) == (1, 2 * 24 * 4)


def test_a_copy_over_the_host_link_is_a_launch_not_device_bytes():
    """Loads from and stores to a host buffer (the engine counts their bytes as the host
    link's, and the time model prices them as copies) move no device bytes; a copy between
    two device tensors reads and writes its 1024 floats."""
    host = torch.empty(1024, device=META)
    device, other = (torch.empty(1024, device=META) for _ in range(2))
    with StepMeter(host_buffers=[host]) as meter:
        device.copy_(host)
        host[:512].copy_(device[:512])
        host.to(torch.bfloat16)
        other.copy_(device)
    assert (meter.costs.kernels, meter.costs.memory_bytes) == (4, 2 * 1024 * 4)


def test_a_collective_is_a_launch_whose_bytes_the_time_model_prices_apart():
    """A c10d collective's bytes move at a link's rate (time_model.collective_seconds), not
    at device memory bandwidth."""
    cost = op_cost(torch.ops.c10d.allreduce_.default, (), {}, None, lambda values: [])
    assert cost.kernel and cost.nbytes == 0 and cost.matmul is None
