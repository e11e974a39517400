"""Host memory for the buffers, allocated by one object so that what is pinned is what is planned.

On a GPU, host buffers must be page-locked for their copies to run asynchronously. Allocating
them with ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator,
which rounds every request up to a power of two so that freed blocks can be reused by size
class (``roundSize = c10::llvm::PowerOf2Ceil(size)`` in ``ATen/core/CachingHostAllocator.h``,
also with ``pinned_use_cuda_host_register``). The buffers are few and large and live for the
whole run, so the rounding is pure waste: gpt3_6.7B's ``[layers, shard]`` buffers would pin
about 115 GiB where the plan counts 86.8 GiB, on a 128 GiB host.

:class:`RegisteredHostMemory` maps exactly the pages asked for and page-locks them with
``cudaHostRegister``, so the bytes pinned are the bytes the planner counts. The caching
allocator does not know these pages, which costs nothing here: ``is_pinned()`` asks the driver,
and copies with ``non_blocking=True`` from or to them are asynchronous because the driver
sees page-locked memory. The buffers take a :class:`HostMemory` through their
:class:`~execution.engine.storage.buffers.Place`; :class:`RecordingHostMemory` is the CPU stand-in the
tests use: it records every request and the bytes a GPU machine would pin for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import sys
from collections.abc import Callable

import torch


def caching_pinned_nbytes(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator pins for a request of ``nbytes``: the next power
    of two (what ``pin_memory=True`` allocations cost)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def exact_nbytes(nbytes: int) -> int:
    """Bytes :class:`RegisteredHostMemory` pins for a request of ``nbytes``."""
    return nbytes


class HostMemory:
    """Ordinary (pageable) host memory: for a CPU compute device, where nothing is pinned."""

    pinned = False

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()


class RegistrationError(RuntimeError):
    """``cudaHostRegister`` refused the pages."""


class RegisteredHostMemory(HostMemory):
    """Page-locked host memory of exactly the bytes asked for (see the module docstring).

    Each tensor gets fresh anonymous pages of its own (so no registration shares a page with
    other memory), registered with ``cudaHostRegister`` and unregistered when the last tensor
    viewing them is freed, before the pages are unmapped.

    Args:
        device: The CUDA device whose work may still be copying from or to the pages when they
            are freed (it is synchronised first).
        cudart: The CUDA runtime bindings (``torch.cuda.cudart()``; tests pass a stand-in).
        synchronize: Waits for that work (``torch.cuda.synchronize``; tests pass a stand-in).
    """

    pinned = True

    def __init__(
        self,
        device: torch.device | None = None,
        cudart=None,
        synchronize: Callable[[torch.device | None], None] | None = None,
    ):
        self.device = device
        self._cudart = cudart
        self._synchronize = synchronize or torch.cuda.synchronize
        self.registration_failed = False

    @property
    def cudart(self):
        if self._cudart is None:  # looked up at first use: building the object needs no GPU
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:  # nothing to copy from; mmap refuses an empty mapping
            return torch.empty(shape, dtype=dtype)
        if not self.registration_failed:
            try:
                pages = _LockedPages.of(nbytes, self)
            except RegistrationError as err:
                # A host (a sandboxed VM, a locked-memory limit) that refuses to register
                # pages still pins through torch's own allocator, at its rounding: the run
                # goes on, slower to plan against, and says so once.
                self.registration_failed = True
                print(
                    f"note: {err}; host buffers fall back to pin_memory=True, which pins up "
                    "to twice the bytes the plan counts",
                    file=sys.stderr,
                )
            else:
                # frombuffer keeps ``pages`` alive for as long as the tensor's storage (and
                # every view of it) lives, so its finaliser runs only when no tensor can reach
                # the pages.
                flat = torch.frombuffer(pages, dtype=torch.uint8)
                return flat.view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.registration_failed:  # torch's pinned blocks are reused, not fresh
            return self.empty(shape, dtype).zero_()
        # Fresh anonymous pages read as zeros: writing them again would only cost a pass over
        # the memory.
        return self.empty(shape, dtype)

    def release(self, address: int) -> None:
        """Unregisters the pages at ``address`` once no queued copy can still use them."""
        self._synchronize(self.device)
        self.cudart.cudaHostUnregister(address)


class _LockedPages:
    """Anonymous pages registered with CUDA, as a ctypes array (a buffer torch can wrap)."""

    @staticmethod
    def of(nbytes: int, owner: RegisteredHostMemory) -> ctypes.Array:
        # MAP_PRIVATE: a forked process (a data-loader worker) copies on write instead of
        # sharing the pages.
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # A subclass per size (ctypes arrays have a fixed length), whose finaliser runs before
        # the base's deallocation drops the mapping: unregister, then unmap.
        array_type = type("LockedPages", (ctypes.c_uint8 * nbytes,), {"__del__": _unregister})
        pages = array_type.from_buffer(mapping)
        address = ctypes.addressof(pages)
        error = owner.cudart.cudaHostRegister(address, nbytes, 0)
        if int(error) != 0:  # cudaSuccess (a pybind enum: equal only to itself, hence int)
            with contextlib.suppress(Exception):
                owner.cudart.cudaGetLastError()  # the refusal is handled: clear it
            pages.owner = None  # nothing to unregister when the pages go
            raise RegistrationError(
                f"cudaHostRegister of {nbytes:,} bytes of host memory failed: "
                f"{owner.cudart.cudaGetErrorString(error)}"
            )
        pages.owner, pages.address = owner, address
        return pages


def _unregister(pages) -> None:
    # At interpreter exit CUDA may be torn down first; the OS then frees the pages anyway.
    owner = getattr(pages, "owner", None)
    if owner is not None:
        with contextlib.suppress(Exception):
            owner.release(pages.address)


class RecordingHostMemory(HostMemory):
    """CPU stand-in for a GPU machine's pinned host memory: records each request and the bytes
    it would pin under ``rounding`` (:func:`exact_nbytes` for :class:`RegisteredHostMemory`,
    :func:`caching_pinned_nbytes` for ``pin_memory=True``).

    Args:
        rounding: Bytes pinned for a request of n bytes.
        device: Where the tensors are made: ``cpu`` to run with them, ``meta`` to size a
            full preset without memory.
    """

    pinned = True

    def __init__(self, rounding: Callable[[int], int] = exact_nbytes, device: str = "cpu"):
        self.rounding = rounding
        self.device = torch.device(device)
        self.requests: list[int] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.requests.append(math.prod(shape) * dtype.itemsize)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    @property
    def pinned_nbytes(self) -> int:
        """Bytes pinned for every request so far."""
        return sum(self.rounding(n) for n in self.requests)


def host_memory_for(compute: torch.device) -> HostMemory:
    """How host buffers are allocated for a run computing on ``compute``: page-locked on CUDA
    (for asynchronous copies), ordinary memory otherwise."""
    if compute.type == "cuda":
        return RegisteredHostMemory(compute)
    return HostMemory()
