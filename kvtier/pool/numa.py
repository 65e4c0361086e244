"""Where a GPU sits on the host: its NUMA node and that node's CPUs, read from sysfs.

A process bound to one GPU pins its host memory best on the GPU's own node: the CPU
affinity is set to the node's CPUs before the pool is allocated, so the pages are first
touched there. The node of a PCI device is `<pci root>/<bus id>/numa_node` (-1 where the
machine shows no NUMA); a node's CPUs are `<node root>/node<N>/cpulist` (`0-15,32-47`).
Every reader returns None where the machine does not say, and binding then does nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

PCI_ROOT = Path("/sys/bus/pci/devices")
NODE_ROOT = Path("/sys/devices/system/node")

log = logging.getLogger(__name__)


def pci_bus_id(device: torch.device) -> str | None:
    """`device`'s PCI address as sysfs names it (`0000:1b:00.0`); None for a device that is not CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def node_of(bus_id: str | None, pci_root: Path = PCI_ROOT) -> int | None:
    """The NUMA node of the PCI device `bus_id`; None where sysfs has no node for it (or says -1)."""
    if bus_id is None:
        return None
    try:
        node = int((pci_root / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, node_root: Path = NODE_ROOT) -> frozenset[int]:
    """The CPUs of NUMA node `node` (its `cpulist`); empty where sysfs does not list them."""
    try:
        text = (node_root / f"node{node}" / "cpulist").read_text().strip()
    except OSError:
        return frozenset()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def bind_to_node(device: torch.device) -> int | None:
    """Pin this process's CPU affinity to `device`'s NUMA node; the node, or None where there is none.

    The affinity becomes the node's CPUs that this process may already use; where none of
    them is allowed (or the platform has no affinity call) it is left as it is.
    """
    node = node_of(pci_bus_id(device))
    if node is None or not hasattr(os, "sched_setaffinity"):
        return node
    cpus = node_cpus(node) & os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
        log.info("%s: NUMA node %d, %d CPUs", device, node, len(cpus))
    return node
