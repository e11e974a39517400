"""Data-sheet numbers of the accelerators the dry run and ``--plan_for`` estimate for.

Each number can be overridden by a flag of the same meaning (``--peak_tflops``,
``--device_memory_gb``, ``--host_memory_gb``, ``--host_link_gb_per_s``, ...). Bandwidths are
per device and per direction, as achieved rather than signalled where the two differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from config.schema import PretrainingConfig


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


# H100/H200 SXM: PCIe 5 x16 (~55 GB/s achieved), NVLink 4 (450 GB/s each way), 400 Gb/s NDR
# per GPU. A100 SXM 80 GB: PCIe 4 x16 (~25 GB/s), NVLink 3 (300 GB/s each way), 200 Gb/s HDR.
# Host memory: 128 GiB per device (a 1-2 TiB node of 8 GPUs). Storage: 2 GB/s per device, what
# a node's local NVMe array (8 drives, about 16 GB/s of writes) or a parallel file system's share
# gives 8 ranks writing at once; 1 GB/s for the older A100 nodes.
SPECS = {
    "h100_sxm": DeviceSpec("h100_sxm", 989.0, 79.0, 128.0, 55.0, 450.0, 50.0, 8, 0.7, 2.0),
    "h200": DeviceSpec("h200", 989.0, 139.0, 128.0, 55.0, 450.0, 50.0, 8, 0.7, 2.0),
    "a100_80gb": DeviceSpec("a100_80gb", 312.0, 79.0, 128.0, 25.0, 300.0, 25.0, 8, 0.7, 1.0),
}


def resolve_spec(config: PretrainingConfig) -> DeviceSpec:
    """The ``--device_spec`` entry with every non-zero override flag applied."""
    p, ex = config.planning, config.execution
    overrides = {
        "peak_tflops": ex.peak_tflops,
        "memory_gb": ex.device_memory_gb,
        "host_memory_gb": ex.host_memory_gb,
        "host_link_gb_per_s": p.host_link_gb_per_s,
        "intra_node_gb_per_s": p.intra_node_gb_per_s,
        "inter_node_gb_per_s": p.inter_node_gb_per_s,
        "devices_per_node": p.devices_per_node,
        "compute_efficiency": p.compute_efficiency,
        "storage_gb_per_s": p.storage_gb_per_s,
    }
    return dataclasses.replace(SPECS[p.device_spec], **{k: v for k, v in overrides.items() if v})
