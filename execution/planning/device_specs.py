"""Data-sheet numbers of the accelerators the dry run and ``--plan_for`` estimate for.

Each number can be overridden by a flag of the same meaning (``--peak_tflops``,
``--device_memory_gb``, ``--host_memory_gb``, ``--host_link_gb_per_s``, ...). Bandwidths are
per device and per direction, as achieved rather than signalled where the two differ.

``--device_spec_file spec.json`` replaces data-sheet numbers by measured ones: the file
``benchmarks/calibrate.py`` writes on the machine at hand. Its ``device_spec`` object names any
subset of :class:`DeviceSpec`'s fields; the others keep the ``--device_spec`` entry's values, and
the override flags still apply on top.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import reprlib
from dataclasses import dataclass
from pathlib import Path

from config.loading import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and the node around it.

    Attributes:
        name: Key of the table.
        peak_tflops: Dense bf16/fp16 peak.
        memory_gb: Device memory a process can allocate, GiB.
        host_memory_gb: Host memory per device, GiB.
        host_link_gb_per_s: Host<->device copies (PCIe).
        intra_node_gb_per_s: Collectives between devices of a node (NVLink).
        inter_node_gb_per_s: Collectives between nodes (one NIC per device).
        devices_per_node: Devices a node holds.
        storage_gb_per_s: Checkpoint write bandwidth per device (each rank writes its own files).
        compute_efficiency: Fraction of the peak that large bf16 matmuls reach.
        attention_efficiency: Fraction of the peak that the fused attention kernel reaches,
            forward and backward, on the FLOPs it executes (a causal kernel half the square;
            0: as ``compute_efficiency``).
        The fields below are measured by ``benchmarks/calibrate.py`` (empty or 0 where only a
        data sheet is known).
        matmul_tflops: ``(m, n, k, TFLOPS)`` of the matmuls measured, in the run's 16-bit
            precision on a GPU (float32 on a CPU): ``(m, k) @ (k, n)``.
        device_memory_gb_per_s: Device memory bandwidth (HBM), bytes read + written per second.
        h2d_gb_per_s: Host-to-device copies from pinned memory.
        d2h_gb_per_s: Device-to-host copies into pinned memory.
        launch_overhead_us: Host time to launch one small kernel (what a phase of many small ops
            pays besides its FLOPs and bytes).
        host_memory_gb_per_s: Host memory bandwidth: what the host AdamW's bytes are priced at
            where ``host_adamw_elements_per_s`` is 0.
        phase_overhead_us: The engine's own host time per phase, beyond its ops' launches
            (Python: the schedule, the store's bookkeeping, hooks).
        collective_gb_per_s: ``(op, bytes, GB/s)`` of collectives measured between two ranks
            of one node, bytes of payload per second (empty: the link rates above).
        waited_collective_us: What a collective waited for where it is issued costs in a real
            step besides its payload at the op's bandwidth, per call: its latency, the peer's
            lateness (its share of the machine's jitter) and waking the communication thread
            (None: not measured; such a call costs what it does between idle ranks).
        copies_overlap: Whether host copies and asynchronous collectives run beside compute (a
            GPU's copy engines and NCCL's kernels); on a CPU the same cores do both, so they
            add to the phase's time.
        device_type: ``cuda`` or ``cpu``: which attention kernel a step runs
            (:func:`~execution.engine.phases.recompute.attention_kernel`).
        fresh_memory_gb_per_s: Rate at which a new block of ``fresh_memory_threshold`` bytes
            or more is first touched (a CPU's allocator maps such blocks anew each time and
            their pages fault in; 0: blocks are reused, as CUDA's caching allocator does).
        random_draw_ns: Time per random number a draw (dropout's mask: ``bernoulli_``) takes
            beyond its bytes' time at ``device_memory_gb_per_s``, in nanoseconds: a CPU's
            generator computes each number (a few nanoseconds each, ten or more times its
            bytes' time); a GPU's keeps up with its memory (0: not measured, or none).
        host_adamw_elements_per_s: Elements the engine's host AdamW updates per second, as one
            rank runs it (its thread pool over cache-sized chunks, the 16-bit weight copy
            refreshed on a GPU); 0: not measured, the update's bytes at
            ``host_memory_gb_per_s`` instead.
        host_phase_us: The host's own time per kind of phase, measured on the host calibrated
            with kernels that cost nothing (``execution/planning/calibration/host_phases.py``): rows of
            :data:`HOST_PHASE_COLUMNS`, eager and compiled, per recompute mode, with dropout
            and without. A unit is a micro-batch, or a row of the update (``optimizer``);
            the kernels are those the dry run counts for the phase measured. Empty: not
            measured; a phase's host time is then its kernels x ``launch_overhead_us`` plus
            ``phase_overhead_us`` (:meth:`host_row`).
        shared_memory_gb_per_s: A CPU's memory bandwidth with every core streaming at once
            (the host's, whatever the threads of the rank calibrated); 0: not measured.
        ranks_on_host: The run's ranks that share this host's memory (:meth:`memory_rate`).
        attention_kernel_seconds: ``(kernel, batch, heads, sequence, head_dim, dtype, dropout,
            seconds)`` of each fused attention kernel timed (forward and backward, causal; a
            kernel that could not run a case is left out of it): what the engine's choice of
            kernel follows (:meth:`attention_ranking`); empty: not measured.
    """

    name: str
    peak_tflops: float
    memory_gb: float
    host_memory_gb: float
    host_link_gb_per_s: float
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    devices_per_node: int
    compute_efficiency: float
    storage_gb_per_s: float
    matmul_tflops: tuple[tuple[int, int, int, float], ...] = ()
    device_memory_gb_per_s: float = 0.0
    h2d_gb_per_s: float = 0.0
    d2h_gb_per_s: float = 0.0
    launch_overhead_us: float = 0.0
    host_memory_gb_per_s: float = 0.0
    attention_efficiency: float = 0.0
    phase_overhead_us: float = 0.0
    collective_gb_per_s: tuple[tuple[str, int, float], ...] = ()
    waited_collective_us: float | None = None
    copies_overlap: bool = True
    device_type: str = "cuda"
    fresh_memory_gb_per_s: float = 0.0
    fresh_memory_threshold: int = 0
    random_draw_ns: float = 0.0
    host_adamw_elements_per_s: float = 0.0
    host_phase_us: tuple[tuple, ...] = ()
    attention_kernel_seconds: tuple[tuple[str, int, int, int, int, str, float, float], ...] = ()
    shared_memory_gb_per_s: float = 0.0
    ranks_on_host: int = 1

    @property
    def queues_kernels(self) -> bool:
        """Whether the host queues kernels ahead of the device (a CUDA stream), so that the
        host's time to launch them runs beside the kernels before them; on a CPU the same
        cores launch and run each op, one after the other."""
        return self.device_type == "cuda"

    def memory_rate(self, rate: float) -> float:
        """``rate`` (GB/s: device or host memory) as one rank streams it. On a CPU the ranks
        on a host share its memory: each gets at most the host's rate with every core
        streaming (``shared_memory_gb_per_s``) over them. Two one-thread ranks of this 2-core
        VM copy at 39 GB/s alone and 43-46 GB/s together; priced at 39 each, every two-rank
        row of the time model check came out under its step (0.80-1.00)."""
        if self.device_type != "cpu" or not self.shared_memory_gb_per_s:
            return rate
        return min(rate, self.shared_memory_gb_per_s / max(self.ranks_on_host, 1))

    def host_row(self, compiled: bool, recompute: str, dropout: bool, kind: str) -> tuple | None:
        """The measured host time of a phase of ``kind`` (:data:`HOST_PHASE_COLUMNS`' row) run
        as given: the row measured so, else with the other dropout setting, else with another
        recompute mode, compiled as asked; a head of its own (Llama's, a task's) as the tied
        one. None where nothing of that kind was measured (:attr:`host_phase_us` empty)."""
        kind = HOST_KIND.get(kind, kind)
        rows = [r for r in self.host_phase_us if r[0] == compiled and r[3] == kind]
        for wanted in ((recompute, dropout), (recompute, not dropout)):
            for row in rows:
                if (row[1], row[2]) == wanted:
                    return row
        return rows[0] if rows else None

    def collective_seconds(self, op: str, nbytes: int) -> float | None:
        """Seconds of ``op`` moving ``nbytes`` of payload between two ranks of a node, from the
        sizes measured for it: the time interpolated linearly in size between the two nearest
        (so a fixed latency stays in it), the smallest's time below them, the largest's rate
        above; None where ``op`` was not measured."""
        measured = sorted(
            (n, n / (rate * 1e9)) for name, n, rate in self.collective_gb_per_s if name == op
        )
        if not measured:
            return None
        if nbytes <= measured[0][0]:
            return measured[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(measured):
            if nbytes <= n1:
                return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
        n, t = measured[-1]
        return t * nbytes / n

    def collective_bandwidth(self, op: str) -> float | None:
        """Payload bytes per second of ``op`` once its latency no longer counts: the fastest
        rate measured for it (one size's can come out slow on a shared machine); None where
        ``op`` was not measured."""
        rates = [rate for name, _, rate in self.collective_gb_per_s if name == op]
        return max(rates) * 1e9 if rates else None

    def attention_ranking(
        self, dtype: str, dropout: float, batch_heads: int, sequence: int, head_dim: int
    ) -> tuple[str, ...]:
        """The fused attention kernels timed for ``dtype`` (a precision's name) and
        ``dropout``, fastest first, at the timed shape nearest to ``batch_heads`` (a call's
        sequences times heads), ``sequence`` and ``head_dim`` (distance: the sum of the log
        ratios, the sequences and heads counted together, as the kernels spread over them);
        empty where none was timed for that dtype and dropout."""
        rows = [
            r
            for r in self.attention_kernel_seconds
            if r[5] == dtype and math.isclose(r[6], dropout)
        ]
        if not rows:
            return ()
        wanted = (math.log(batch_heads), math.log(sequence), math.log(head_dim))

        def distance(row) -> float:
            timed = (math.log(row[1] * row[2]), math.log(row[3]), math.log(row[4]))
            return sum(abs(a - b) for a, b in zip(timed, wanted, strict=True))

        shape = min(rows, key=distance)[1:5]
        at = sorted((r for r in rows if r[1:5] == shape), key=lambda r: r[7])
        return tuple(dict.fromkeys(r[0] for r in at))

    def matmul_rate(self, m: int, n: int, k: int) -> float:
        """TFLOPS of ``(m, k) @ (k, n)``: from the measured shapes nearest in each dimension
        (distance: the sum of the log ratios; a thin or a vocabulary-wide matmul runs at its
        own rate), the four nearest weighted by inverse squared distance, or the data sheet's
        ``peak_tflops x compute_efficiency`` when nothing was measured."""
        if not self.matmul_tflops:
            return self.peak_tflops * self.compute_efficiency
        dims = (math.log(m), math.log(n), math.log(k))
        nearest = sorted(
            (sum(abs(math.log(e) - d) for e, d in zip(entry[:3], dims, strict=True)), entry[3])
            for entry in self.matmul_tflops
        )[:4]
        if nearest[0][0] < 1e-9:
            return nearest[0][1]
        weights = [1.0 / distance**2 for distance, _ in nearest]
        # Averaged as times per FLOP, so that one fast neighbour does not dominate.
        per_flop = sum(w / rate for w, (_, rate) in zip(weights, nearest, strict=True))
        return sum(weights) / per_flop


# A row of DeviceSpec.host_phase_us: how the phase ran, then its host's microseconds per phase
# and per unit (a micro-batch; the update's: a row), and its kernels per phase and per unit.
HOST_PHASE_COLUMNS = (
    "compiled",
    "recompute",
    "dropout",
    "kind",
    "per_phase_us",
    "per_unit_us",
    "kernels_per_phase",
    "kernels_per_unit",
)
# Kinds of phase priced with another's measured host time: a head is a head.
HOST_KIND = {"untied_head": "head", "task_head": "head"}
RECOMPUTE_MODES = ("full", "selective", "none")

# H100/H200 SXM: PCIe 5 x16 (~55 GB/s achieved), NVLink 4 (450 GB/s each way), 400 Gb/s NDR
# per GPU. A100 SXM 80 GB: PCIe 4 x16 (~25 GB/s), NVLink 3 (300 GB/s each way), 200 Gb/s HDR.
# Host memory: 128 GiB per device (a 1-2 TiB node of 8 GPUs). Storage: 2 GB/s per device, what
# a node's local NVMe array (8 drives, about 16 GB/s of writes) or a parallel file system's share
# gives 8 ranks writing at once; 1 GB/s for the older A100 nodes.
# Attention, forward and backward, on the FLOPs a causal kernel executes (half the square, as
# FlashAttention's benchmarks count them): SDPA's flash backend is FlashAttention-2. On an H100
# at head dim 128, causal, bf16, it runs 284 TFLOPS forward and 287 backward at sequence 8192
# (flash-attention PR #1791, hopper/benchmark_attn.py), 29% of the peak, and about 35% at best
# (the FlashAttention-3 paper, Shah et al. 2024); sequence 2048 and the in-kernel dropout draw
# cost more: 25%, which is 50% of the peak on torch's whole-square count. On an A100 it reaches
# 50-73% (the FlashAttention-2 paper, Dao 2023): 50%.
# Device memory bandwidth as a large copy achieves it, about 90% of the data sheet's (H100 SXM
# 3.35 TB/s, H200 4.8, A100 80 GB 2.04). Launch: eager PyTorch's host time per op on a recent
# x86 host (dispatcher and CUDA launch), about 5 us. Host memory: a node's DDR5 (about 300-400
# GB/s over two sockets) shared by its 8 GPUs. The engine's own time per phase has no data sheet:
# 0 until calibrate.py measures it. A lent GPU's calibration file replaces all of these.
H100_SXM = DeviceSpec(
    name="h100_sxm",
    peak_tflops=989.0,
    memory_gb=79.0,
    host_memory_gb=128.0,
    host_link_gb_per_s=55.0,
    intra_node_gb_per_s=450.0,
    inter_node_gb_per_s=50.0,
    devices_per_node=8,
    compute_efficiency=0.7,
    storage_gb_per_s=2.0,
    attention_efficiency=0.25,
    device_memory_gb_per_s=3000.0,
    launch_overhead_us=5.0,
    host_memory_gb_per_s=40.0,
)
SPECS = {
    "h100_sxm": H100_SXM,
    # The same chip and node with HBM3e: more memory, faster.
    "h200": dataclasses.replace(
        H100_SXM, name="h200", memory_gb=139.0, device_memory_gb_per_s=4300.0
    ),
    "a100_80gb": DeviceSpec(
        name="a100_80gb",
        peak_tflops=312.0,
        memory_gb=79.0,
        host_memory_gb=128.0,
        host_link_gb_per_s=25.0,
        intra_node_gb_per_s=300.0,
        inter_node_gb_per_s=25.0,
        devices_per_node=8,
        compute_efficiency=0.7,
        storage_gb_per_s=1.0,
        attention_efficiency=0.5,
        device_memory_gb_per_s=1800.0,
        launch_overhead_us=5.0,
        host_memory_gb_per_s=40.0,
    ),
}


def _finite(value) -> bool:
    """A JSON number (not a bool, which Python counts as one) other than NaN or infinity."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _finite(value) and value > 0


def _non_negative(value) -> bool:
    return _finite(value) and value >= 0


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _table(*columns):
    """A check of a list of rows whose entries pass ``columns``' checks, one each."""

    def check(value) -> bool:
        return isinstance(value, list | tuple) and all(
            isinstance(row, list | tuple)
            and len(row) == len(columns)
            and all(column(entry) for column, entry in zip(columns, row, strict=True))
            for row in value
        )

    return check


# What each field of a spec file may hold, and how an error says it. A rate or size the time
# model divides by must be above 0; a field whose 0 (or null) means "not measured" may be 0;
# an efficiency is a share of the peak.
RATE = (_positive, "a finite number > 0")
UNMEASURED_OK = (_non_negative, "a finite number >= 0 (0: not measured)")
FIELD_RULES = {
    "name": (lambda v: isinstance(v, str), "a string"),
    "peak_tflops": RATE,
    "memory_gb": RATE,
    "host_memory_gb": RATE,
    "host_link_gb_per_s": RATE,
    "intra_node_gb_per_s": RATE,
    "inter_node_gb_per_s": RATE,
    "devices_per_node": (_count, "an integer >= 1"),
    "compute_efficiency": (lambda v: _positive(v) and v <= 1, "a number in (0, 1]"),
    "storage_gb_per_s": RATE,
    "matmul_tflops": (
        _table(_count, _count, _count, _positive),
        "a list of [m, n, k, TFLOPS]: m, n, k integers >= 1, TFLOPS a finite number > 0",
    ),
    "device_memory_gb_per_s": RATE,
    "h2d_gb_per_s": UNMEASURED_OK,
    "d2h_gb_per_s": UNMEASURED_OK,
    "launch_overhead_us": (_non_negative, "a finite number >= 0"),
    "host_memory_gb_per_s": RATE,
    "attention_efficiency": (
        lambda v: _non_negative(v) and v <= 1,
        "a number in [0, 1] (0: as compute_efficiency)",
    ),
    "phase_overhead_us": (_non_negative, "a finite number >= 0"),
    "collective_gb_per_s": (
        _table(lambda op: isinstance(op, str), _count, _positive),
        "a list of [op, bytes, GB/s]: bytes an integer >= 1, GB/s a finite number > 0",
    ),
    "waited_collective_us": (
        lambda v: v is None or _non_negative(v),
        "null (not measured) or a finite number >= 0",
    ),
    "copies_overlap": (lambda v: isinstance(v, bool), "true or false"),
    "device_type": (lambda v: v in ("cuda", "cpu"), '"cuda" or "cpu"'),
    "fresh_memory_gb_per_s": UNMEASURED_OK,
    "shared_memory_gb_per_s": UNMEASURED_OK,
    "ranks_on_host": (_count, "an integer >= 1"),
    "fresh_memory_threshold": (lambda v: v == 0 or _count(v), "an integer >= 0"),
    "random_draw_ns": (_non_negative, "a finite number >= 0"),
    "host_adamw_elements_per_s": UNMEASURED_OK,
    "host_phase_us": (
        _table(
            lambda v: isinstance(v, bool),
            lambda v: v in RECOMPUTE_MODES,
            lambda v: isinstance(v, bool),
            lambda v: isinstance(v, str),
            *(_non_negative,) * 4,
        ),
        "a list of [compiled, recompute, dropout, kind, us per phase, us per unit, kernels per "
        "phase, kernels per unit]: two booleans around a recompute mode, a kind, then four "
        "finite numbers >= 0",
    ),
    "attention_kernel_seconds": (
        _table(
            lambda kernel: kernel in ("flash", "cudnn", "efficient"),
            *(_count,) * 4,
            lambda dtype: dtype in ("float32", "bfloat16", "float16"),
            lambda p: _non_negative(p) and p < 1,
            _positive,
        ),
        "a list of [kernel, batch, heads, sequence, head_dim, dtype, dropout, seconds]: kernel "
        "flash, cudnn or efficient, the sizes integers >= 1, dtype float32, bfloat16 or "
        "float16, dropout in [0, 1), seconds a finite number > 0",
    ),
}


def read_spec_file(path: str | Path, base: DeviceSpec) -> DeviceSpec:
    """``base`` with the fields a calibration file (``{"device_spec": {...}}``) gives.

    Raises:
        ConfigError: the file cannot be read, is not such an object, names unknown fields, or
            gives a field a value outside what it may hold (:data:`FIELD_RULES`: a 0 the time
            model would divide by, a NaN, an efficiency above 1).
    """
    try:
        given = json.loads(Path(path).read_text())["device_spec"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--device_spec_file {path}: not a calibration file ({err})") from err
    if not isinstance(given, dict):
        raise ConfigError(f"--device_spec_file {path}: device_spec must be an object")
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"--device_spec_file {path}: unknown fields {', '.join(unknown)}")
    for name, value in given.items():
        allowed, must_be = FIELD_RULES[name]
        if not allowed(value):
            shown = reprlib.repr(value)  # a table's first rows, not all of them
            raise ConfigError(f"--device_spec_file {path}: {name} is {shown}; it must be {must_be}")
    for name in (
        "matmul_tflops",
        "collective_gb_per_s",
        "host_phase_us",
        "attention_kernel_seconds",
    ):
        if name in given:
            given[name] = tuple(tuple(entry) for entry in given[name])
    return dataclasses.replace(base, **given)


def spec_file_dict(spec: DeviceSpec) -> dict:
    """The ``device_spec`` object of a calibration file that :func:`read_spec_file` reads back."""
    fields = dataclasses.asdict(spec)
    fields["matmul_tflops"] = [list(entry) for entry in spec.matmul_tflops]
    fields["collective_gb_per_s"] = [list(entry) for entry in spec.collective_gb_per_s]
    fields["host_phase_us"] = [list(entry) for entry in spec.host_phase_us]
    fields["attention_kernel_seconds"] = [list(entry) for entry in spec.attention_kernel_seconds]
    return fields
