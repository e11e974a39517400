"""Pinned host memory: what a GPU machine pins for the buffers is exactly what the plan counts.

PyTorch's caching host allocator rounds every ``pin_memory=True`` request up to a power of two.
The CPU stand-in (:class:`RecordingHostMemory`) applies that rule, so these tests show the
waste that pinning tensor by tensor would have at gpt3_6.7B's sizes, and that the registered
allocation the buffers use has none. The registration itself runs against a stand-in of the CUDA
runtime: it checks the calls, their order and that the pages are still mapped when unpinned.
"""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from config.loading import parse_config
from execution.engine.plan import GiB, Placement
from execution.engine.storage.buffers import (
    ActivationBuffers,
    PartBuffers,
    Place,
    weight_copy_dtype,
)
from execution.engine.storage.gradient_store import (
    STAGING_ELEMENTS,
    needs_staging,
    staging_elements,
)
from execution.engine.storage.host_memory import (
    HostMemory,
    RecordingHostMemory,
    RegisteredHostMemory,
    caching_pinned_nbytes,
    exact_nbytes,
    host_memory_for,
)
from execution.planning.memory import RankShape, state_bytes
from execution.planning.run_shape import RunShape
from modelling.gpt import PARTS

PAGE = 4096  # x86-64 Linux; mmap hands out whole pages


def test_the_caching_allocator_rule_rounds_to_the_next_power_of_two():
    assert [caching_pinned_nbytes(n) for n in (0, 1, 3, 4, 5, 4096, 4097)] == [
        0,
        1,
        4,
        4,
        8,
        4096,
        8192,
    ]
    # 24 GiB (a [32, shard] float32 state of gpt3_6.7B, roughly) pins 32 GiB.
    assert caching_pinned_nbytes(24 * GiB + 1) == 32 * GiB


def _host_buffers(name: str, placement: Placement, rounding) -> tuple[RecordingHostMemory, dict]:
    """The buffers of one rank of preset ``name`` under ``placement``, their host tensors made
    on meta by a recording stand-in, and the planner's bytes for them."""
    config, _ = parse_config(["--config", name])
    rank = RankShape.of(RunShape.of(config))
    entries = 2
    memory = RecordingHostMemory(rounding, device="meta")
    host = Place(torch.device("cpu"), True, memory)
    device = Place(torch.device("meta"))
    places = {s: host if w == "host" else device for s, w in vars(placement).items()}
    by_state = {"weights": places["weights"], "exp_avg": places["weights"]}
    by_state.update(exp_avg_sq=places["weights"], grads=places["grads"])
    copy_dtype = weight_copy_dtype(placement.weights == "host", rank.dtype)
    for part in PARTS:
        PartBuffers(rank.specs[part], rank.rows(part), by_state, copy_dtype)
    ActivationBuffers(rank.activation_layout(entries), places["activations"])
    if needs_staging(placement.weights, placement.grads):  # the host reads device gradients
        size = staging_elements(rank.specs, {p: rank.rows(p) for p in PARTS})
        for _ in range(2):
            places["weights"].empty((size,), torch.float32)
    planned = state_bytes(rank, entries, placement)
    return memory, planned


def _host_total(planned: dict, placement: Placement) -> int:
    place = {"optimizer": "weights", "weight_copies": "weights", "staging": "weights"}
    return sum(n for s, n in planned.items() if getattr(placement, place.get(s, s)) == "host")


def test_gpt3_6_7b_host_weights_pin_what_the_plan_counts():
    """gpt3_6.7B on one GPU with its weights on the host (the dry run's plan): float32 masters
    and two AdamW moments (12 bytes a parameter) and bf16 copies (2 bytes), 86.8 GiB. Pinned
    one tensor at a time by the caching allocator, each [32, shard] state rounds from about
    24 GiB to 32 GiB: about 115 GiB, more than the 128 GiB host leaves a process."""
    placement = Placement("host", "device", "device")
    old, planned = _host_buffers("gpt3_6.7B", placement, caching_pinned_nbytes)
    assert max(old.requests) == 24 * GiB  # 32 x 12 h^2 x 4 bytes: the [layers, shard] matrices
    new, _ = _host_buffers("gpt3_6.7B", placement, exact_nbytes)
    plan = _host_total(planned, placement)
    # Hand count: 32 layers of 12 h^2 + 13 h parameters, the word (50304 x h) and position
    # (2048 x h) embeddings and the final LayerNorm (2 h), h = 4096; 14 bytes each; and two
    # float32 staging buffers of 4 Mi elements for the device's gradients.
    h = 4096
    parameters = 32 * (12 * h * h + 13 * h) + 50304 * h + 2048 * h + 2 * h
    assert planned["staging"] == 2 * 4 * STAGING_ELEMENTS == 32 * 2**20
    assert abs(plan - planned["staging"] - 14 * parameters) < 1e-4 * plan
    assert round(plan / GiB, 1) == 86.8
    assert new.requests == old.requests
    assert new.pinned_nbytes == sum(new.requests) == plan
    # Rounded: each of the three float32 states' 24 GiB of layer matrices pins 32 GiB and its
    # 0.8 GiB word embedding 1 GiB; the bf16 copies 16 and 0.5 GiB; the staging buffers (a
    # power of two already) their own; the vectors (MiBs) little.
    rounded = (3 * (32 + 1) + 16 + 0.5) * GiB + planned["staging"]
    assert abs(old.pinned_nbytes - rounded) < 0.05 * GiB


@pytest.mark.parametrize("where", ["host", "device"])
def test_every_host_state_pins_its_planned_bytes(where):
    """All three states on the host (gpt3_1.3B, two micro-batches a pass): the registered
    allocation pins exactly the plan's host bytes, and nothing when every state is on the
    device."""
    placement = Placement(where, where, where)
    memory, planned = _host_buffers("gpt3_1.3B", placement, exact_nbytes)
    assert memory.pinned_nbytes == _host_total(planned, placement)
    assert (memory.pinned_nbytes > 0) == (where == "host")


class FakeCudart:
    """The two CUDA runtime calls the registration makes, recorded with whether the pages at
    the address were still mapped (unpinning unmapped pages would leave them locked)."""

    def __init__(self, error: int = 0):
        self.calls: list[tuple] = []
        self.error = error

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags, _mapped(address)))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address, _mapped(address)))
        return 0

    def cudaGetErrorString(self, error: int) -> str:
        return f"error {error}"


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_registered_memory_locks_exactly_its_pages_and_unlocks_them_after_the_last_view():
    cudart = FakeCudart()
    synced = []
    memory = RegisteredHostMemory(cudart=cudart, synchronize=synced.append)
    buffer = memory.zeros((3, 5), torch.bfloat16)
    address = buffer.data_ptr()
    assert buffer.shape == (3, 5) and buffer.dtype == torch.bfloat16
    assert torch.equal(buffer, torch.zeros(3, 5, dtype=torch.bfloat16))
    assert address % PAGE == 0  # pages of its own: no registration shares a page
    assert cudart.calls == [("register", address, 30, 0, True)]
    row = buffer[1]
    del buffer
    gc.collect()
    assert len(cudart.calls) == 1  # a view still reads the pages
    row.fill_(2)  # the tensor is the registered memory, not a copy of it
    two = torch.tensor(2.0, dtype=torch.bfloat16).view(torch.int16).item()
    assert ctypes.c_uint16.from_address(address + 10).value == two
    del row
    gc.collect()
    assert cudart.calls[1:] == [("unregister", address, True)]
    assert synced == [None]  # queued copies finished before the pages were unlocked
    assert not _mapped(address)


def test_a_failed_registration_says_so_once_and_falls_back_to_torchs_pinned_memory(
    monkeypatch, capsys
):
    """A host that refuses to register pages (a sandboxed VM, a locked-memory limit): one note
    line naming the bytes and the error, then every buffer from torch's pinned allocator (here
    a stand-in: this machine has no CUDA to pin with), zeroed where asked, never unregistered."""
    cudart = FakeCudart(error=2)
    cudart.cudaGetLastError = lambda: cudart.calls.append(("clear",))
    memory = RegisteredHostMemory(cudart=cudart, synchronize=lambda d: None)
    pinned = []
    empty = torch.empty

    def pinned_empty(shape, dtype, pin_memory=False):
        pinned.append((tuple(shape), pin_memory))
        return empty(shape, dtype=dtype).fill_(7)  # torch's blocks come back used

    monkeypatch.setattr(torch, "empty", pinned_empty)
    first = memory.empty((1024,), torch.float32)
    second = memory.zeros((3, 5), torch.bfloat16)
    assert pinned == [((1024,), True), ((3, 5), True)]
    assert torch.equal(second, torch.zeros(3, 5, dtype=torch.bfloat16)) and first.shape == (1024,)
    assert [c[0] for c in cudart.calls] == ["register", "clear"]  # registered once, not again
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "cudaHostRegister of 4,096 bytes" in note[0] and "error 2" in note[0]
    gc.collect()
    assert all(c[0] != "unregister" for c in cudart.calls)


def test_host_buffers_are_pinned_on_a_gpu_only():
    """The choice is made once, from the compute device (nothing touches CUDA until then)."""
    cuda = Place.of("host", torch.device("cuda", 0))
    assert isinstance(cuda.memory, RegisteredHostMemory) and cuda.pin
    assert type(host_memory_for(torch.device("cpu"))) is HostMemory
    assert not Place.of("host", torch.device("cpu")).pin
    assert not Place.of("device", torch.device("cuda", 0)).pin
