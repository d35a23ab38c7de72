"""The optimizer update's time in a step: the device's own share, clipping, and the share offloaded to the CPU
(CoTrain's overlapped schedule or ZeRO-Offload's), as :class:`~nbtrain.planner.cost.CostModel` adds it per layer.

    >>> from nbtrain.profiler.hardware import Cluster
    >>> h100 = Cluster.from_catalog("H100", num_devices=8)
    >>> offload, update = update_seconds(h100, CostOptions(), h100.links, Strategy(dp_shard=8, offload=1.0), 1e9,
    ...                                  bwd=0.0, dtype_bytes=2, layers=34)
    >>> offload > 0, update
    (True, 0.0)
"""

from __future__ import annotations

from nbtrain.planner.cost_options import CostOptions
from nbtrain.planner.link_costs import clip_seconds
from nbtrain.planner.strategy import Strategy

CLIP_PASSES = 3  # clipping by the global norm reads every gradient for the norm, then reads and writes it to scale


def update_seconds(c, opt: CostOptions, links, s: Strategy, p: float, bwd: float, *, dtype_bytes: int,
                   layers: int) -> tuple[float, float]:
    """(the offloaded update's time not hidden under the layer's backward ``bwd``, the device's own update and
    clipping) of a layer of ``p`` parameters per TP rank under ``s`` on cluster ``c``; ``links``: what was measured
    of its communication, ``layers``: the model's (clipping's norm is one reduction for all of them)."""
    e = dtype_bytes
    offloaded = p / s.dp_shard * s.offload
    rate = c.cpu_optimizer_rate / c.devices_per_node
    cpu = offloaded / rate
    if c.device == "cpu":  # no PCIe: the update reads the gradients in place, and copies the new weights into
        cpu += offloaded * e / c.host_to_device_bandwidth  # the parameters (a memory copy) itself
        pcie, update = 0.0, p / s.dp_shard * (1 - s.offload) / rate  # the "device" updates the rest itself
        if opt.clip:  # at the copy rate: on the CPU, memory bandwidth is the device's
            update += CLIP_PASSES * p / s.dp_shard * opt.grad_reduce_bytes / c.host_to_device_bandwidth
    else:  # gradients down and weights up, both in the compute dtype (the fp32 master stays on the CPU); the
        pcie, update = offloaded * 2 * e / c.host_to_device_bandwidth, 0.0  # device's own step is not modelled
    if opt.clip:
        update += clip_seconds(links, c.num_devices, s, param_bytes=p * s.tp * e, layers=layers)
    # the update hides under backward only on cores the backward leaves free: not on a CPU whose worker
    # processes take every core
    spare = c.device != "cpu" or not c.host_cores or c.host_cores > c.devices_per_node
    offload = max(0.0, max(cpu, pcie) - bwd) if opt.offload_overlap and spare else cpu + pcie
    return offload, update
