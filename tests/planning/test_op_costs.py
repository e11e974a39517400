"""What the step meter prices as device work: views, host-link copies and collectives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from execution.planning.device_specs import SPECS
from execution.planning.op_costs import device_seconds, op_cost
from execution.planning.step_meter import StepMeter
from modelling.dropout import dropout

META = torch.device("meta")


def test_a_view_that_declares_no_alias_moves_no_bytes():
    """``_unsafe_view`` (the reshape ``matmul`` ends with) is a view: the meter counts the
    multiplication's 24 floats read and 24 written, and one kernel."""
    x = torch.empty(4, 6, device=META)
    with StepMeter() as meter:
        torch.ops.aten._unsafe_view(x * 2.0, [24])
    assert (meter.costs.kernels, meter.costs.memory_bytes) == (1, 2 * 24 * 4)


def test_a_copy_over_the_host_link_is_the_links_on_a_gpu_and_memory_bound_on_a_cpu():
    """Loads from and stores to a host buffer are the host link's bytes, which a GPU's copy
    engines move beside its kernels (priced as copies) and a CPU's cores move as memory-bound
    work; a copy between two device tensors reads and writes its 1024 floats either way."""
    host = torch.empty(1024, device=META)
    device, other = (torch.empty(1024, device=META) for _ in range(2))
    with StepMeter(host_buffers=[host]) as meter:
        device.copy_(host)  # 8 KiB
        host[:512].copy_(device[:512])  # 4 KiB
        host.to(torch.bfloat16)  # 4 KiB read, 2 KiB written
        other.copy_(device)
    costs = meter.costs
    assert (costs.kernels, costs.memory_bytes, costs.link_bytes) == (4, 8192, 18432)
    gpu = SPECS["h100_sxm"]
    cpu = dataclasses.replace(gpu, copies_overlap=False)
    bandwidth = gpu.device_memory_gb_per_s * 1e9
    assert device_seconds(costs, 0, gpu)["memory_bound"] == pytest.approx(8192 / bandwidth)
    assert device_seconds(costs, 0, cpu)["memory_bound"] == pytest.approx(26624 / bandwidth)


def test_a_collective_is_a_launch_whose_bytes_the_time_model_prices_apart():
    """A c10d collective's bytes move at a link's rate (time_model.collective_seconds), not
    at device memory bandwidth."""
    cost = op_cost(torch.ops.c10d.allreduce_.default, (), {}, None, lambda values: [])
    assert cost.kernel and cost.nbytes == 0 and cost.matmul is None


def test_an_in_place_op_reads_what_it_updates_and_writes_it_back():
    """``a.add_(b)`` on 1024 floats reads a and b and writes a: 3 x 4 KiB. A copy and a fill
    write their target without reading it; an ``out=`` is written only."""
    a, b, c = (torch.empty(1024, device=META) for _ in range(3))
    sizes = []
    for op in (
        lambda: a.add_(b),
        lambda: a.exp_(),
        lambda: a.copy_(b),
        lambda: a.fill_(1.0),
        lambda: torch.add(a, b, out=c),
    ):
        with StepMeter() as meter:
            op()
        sizes.append(meter.costs.memory_bytes // 4096)
    assert sizes == [3, 2, 2, 1, 3]


def test_a_residual_dropout_on_meta_prices_the_draw_it_makes_on_a_device():
    """A device draws a residual dropout's mask (``bernoulli_``: writes 2 bytes an element in
    bfloat16), scales it in place (``div_``: reads and writes them) and multiplies x by it
    (reads both, writes the result): 3 kernels and 12 bytes an element. Planning on meta
    tensors once skipped the draw and the scaling, so a compiled block's eager side (which
    prices the draw) removed more bytes than the step had counted."""
    x = torch.empty(2, 8, 16, dtype=torch.bfloat16, device=META)
    with StepMeter() as meter:
        dropout(x, 0.1, seed=7)
    assert (meter.costs.kernels, meter.costs.memory_bytes) == (3, 12 * x.numel())
    assert meter.costs.random_elements == x.numel()  # the draw: one number an element


def test_a_draw_costs_its_numbers_beyond_its_bytes_where_the_device_computes_them_slowly():
    """A CPU's generator computes each number (``random_draw_ns`` of them beyond the bytes'
    time): dropout of 4,096 floats on such a spec (4 ns a number) adds 4096 x 4 ns to the
    memory-bound time of its 6 x 16 KiB (as above, in float32); ``add_`` (3 x 16 KiB) and
    ``exp_`` (2 x 16 KiB) draw nothing. The data sheet's GPU (0: it keeps up with memory)
    prices the same ops by their bytes alone. A draw that fills a tensor of its own
    (``rand``, ``native_dropout``) counts what it makes."""
    x = torch.empty(2, 32, 64, device=META)
    with StepMeter() as meter:
        dropout(x, 0.1, seed=7)
        x.add_(x).exp_()
    gpu = SPECS["h100_sxm"]
    cpu = dataclasses.replace(gpu, random_draw_ns=4.0)
    bandwidth = gpu.device_memory_gb_per_s * 1e9
    by_bytes = (6 + 3 + 2) * 4 * 4096 / bandwidth
    assert device_seconds(meter.costs, 0, gpu)["memory_bound"] == pytest.approx(by_bytes)
    assert device_seconds(meter.costs, 0, cpu)["memory_bound"] == pytest.approx(
        by_bytes + 4096 * 4e-9
    )
    with StepMeter() as meter:
        torch.rand(3, 5, device=META)
        torch.ops.aten.native_dropout(x, 0.1, True)
    assert meter.costs.random_elements == 15 + 4096


def test_an_indexed_update_moves_the_rows_it_selects_not_the_whole_tensor():
    """Summing a lookup's gradient rows into a 50,000 x 8 float32 table (``index_add_`` of 6
    rows) reads the 6 ids and the 6 x 8 source floats and reads and writes 6 x 8 of the
    table's: 48 + 192 + 2 x 192 bytes, not the table's 1.6 MB twice. The cross-entropy's
    ``scatter_add_`` of one element per row of 4 x 1000 logits: the 4 ids, the 4 values, and
    4 elements read and written."""
    table = torch.empty(50_000, 8, device=META)
    ids, rows = torch.zeros(6, dtype=torch.long, device=META), torch.empty(6, 8, device=META)
    logits = torch.empty(4, 1000, device=META)
    labels, ones = torch.zeros(4, 1, dtype=torch.long, device=META), torch.empty(4, 1, device=META)
    with StepMeter() as meter:
        table.index_add_(0, ids, rows)
    assert (meter.costs.kernels, meter.costs.memory_bytes) == (1, 6 * 8 + 192 + 2 * 192)
    with StepMeter() as meter:
        logits.scatter_add_(-1, labels, ones)
    assert meter.costs.memory_bytes == 4 * 8 + 4 * 4 + 2 * 4 * 4


def test_a_lookup_moves_the_rows_it_selects_not_the_whole_table():
    """An embedding lookup of 6 ids in a 50,000 x 8 float32 table reads the 6 ids and 6 rows
    and writes the 6 x 8 result: 48 + 2 x 192 bytes, not the table's 1.6 MB (a micro-batch of
    one short sequence had its lookup priced at eight times what the phase took). The
    cross-entropy's ``gather`` of one logit per row of 4 x 1000: 4 ids, 4 floats read and
    written."""
    table, ids = torch.empty(50_000, 8, device=META), torch.zeros(6, dtype=torch.long, device=META)
    logits = torch.empty(4, 1000, device=META)
    labels = torch.zeros(4, 1, dtype=torch.long, device=META)
    with StepMeter() as meter:
        torch.nn.functional.embedding(ids, table)
    assert (meter.costs.kernels, meter.costs.memory_bytes) == (1, 6 * 8 + 2 * 192)
    with StepMeter() as meter:
        logits.gather(-1, labels)
    assert meter.costs.memory_bytes == 4 * 8 + 2 * 4 * 4
    with StepMeter() as meter:
        table.index_select(0, ids)
    assert meter.costs.memory_bytes == 6 * 8 + 2 * 192
