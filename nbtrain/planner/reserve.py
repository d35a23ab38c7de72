"""What each device holds before the model has a byte: the CUDA context, NCCL's buffers and the headroom kept free
for the caching allocator, each with its source.

    >>> from nbtrain.profiler.hardware import Cluster
    >>> sum(nbytes for _, nbytes in reserve_parts(Cluster.from_catalog("H100", num_devices=8))) / 2**30
    9.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbtrain.profiler.hardware import Cluster
from nbtrain.units import format_bytes

if TYPE_CHECKING:
    from nbtrain.planner.cost import CostOptions

MiB = 2**20

# The reserve, per GPU (reserve_parts). Sources:
# - CUDA context: PyTorch loads CUDA kernels lazily since 1.13 (CUDA_MODULE_LOADING=LAZY, pytorch/pytorch#86509,
#   which measured the context at 287 MB lazy against 667 MB eager); NVIDIA's engineers put it at ~300-400 MB
#   with CUDA >= 11.7 (pytorch/pytorch#107667, #109888). A training step then loads its kernels (cuBLAS and its
#   workspace, attention, NCCL's own), so nbtrain takes 512 MiB.
# - NCCL: each communicator keeps per-channel buffers (NCCL_BUFFSIZE, 4 MiB for the Simple protocol, plus LL and
#   LL128), linear in the channels (NVIDIA/nccl#986), and NVLink on H100 runs up to 32 channels
#   (NVIDIA/nccl#1685). A plan uses a communicator per process group it reduces over (data parallel, and TP or the
#   pipeline's). 512 MiB: with the context, 1 GiB per device, as measured on 8 x H100 before NCCL's all-to-all
#   (1.06 GB outside PyTorch's allocator, NVIDIA/nccl#1685). Only with more than one device.
# - Allocator headroom: PyTorch's caching allocator cannot always hand out memory it holds (a free block split
#   into pieces smaller than the next request). GMLake (Guo et al., ASPLOS 2024) measured this fragmentation on
#   eight LLMs trained on A100-80GB with recomputation, ZeRO and offload at 15% of the memory on average, up to
#   33%. nbtrain's GPU workers run with ``expandable_segments`` (PyTorch's remedy, which grows one mapping instead
#   of caching fixed segments), as torchtitan's do, so nbtrain keeps 10% of each device free: its own allowance
#   between "none" and GMLake's average, not a measurement; ``CostOptions.headroom`` (``--headroom``) sets it.
#   None on the CPU, where a worker's memory is the host's and no caching allocator sits between.
CUDA_CONTEXT_BYTES = 512 * MiB
NCCL_BUFFER_BYTES = 512 * MiB
HEADROOM = 0.10
HEADROOM_PART = "allocator headroom"
"""The name the headroom's reserve part starts with (:func:`headroom_label`)."""


def headroom_label(fraction: float, budget: str) -> str:
    """The headroom's reserve part as the table and the messages name it: ``allocator headroom (10% of 80.00 GiB)``."""
    return f"{HEADROOM_PART} ({fraction:.0%} of {budget})"


def reserve_parts(cluster: Cluster, options: "CostOptions | None" = None, budget: float | None = None
                  ) -> tuple[tuple[str, int], ...]:
    """What the reserve per device is made of, as (what, bytes) pairs, and so its sum: the CUDA context
    (512 MiB), with more than one device NCCL's buffers (512 MiB), and the allocator's headroom (10% of the
    ``budget``, by default the device's memory) on a GPU; nothing on the CPU; or the figures ``CostOptions.reserve_bytes`` and
    ``CostOptions.headroom`` give. Sources in the comment above.

        >>> [what for what, _ in reserve_parts(Cluster.from_catalog("H100", num_devices=8))]
        ['CUDA context and kernels', 'NCCL buffers', 'allocator headroom (10% of 80.00 GiB)']
    """
    headroom = headroom_part(cluster, options, budget)
    if options is not None and options.reserve_bytes is not None:
        given = (("CostOptions.reserve_bytes", int(options.reserve_bytes)),) if options.reserve_bytes else ()
        return given + headroom
    if cluster.device == "cpu":
        return headroom
    parts = [("CUDA context and kernels", CUDA_CONTEXT_BYTES)]
    if cluster.num_devices > 1:
        parts.append(("NCCL buffers", NCCL_BUFFER_BYTES))
    return tuple(parts) + headroom


def headroom_part(cluster: Cluster, options: "CostOptions | None" = None, budget: float | None = None
                  ) -> tuple[tuple[str, int], ...]:
    """The allocator's headroom as a reserve part: ``CostOptions.headroom`` of the memory budget per device (the
    device's memory unless ``--memory`` says less; default 10% on a GPU, none on the CPU), or nothing when 0."""
    fraction = options.headroom if options is not None and options.headroom is not None else \
        (0.0 if cluster.device == "cpu" else HEADROOM)
    if not fraction:
        return ()
    budget = cluster.device_memory if budget is None else budget
    return ((headroom_label(fraction, format_bytes(budget)), int(fraction * budget)),)
