"""The device catalog: datasheet figures per GPU (and the host CPU), the names they go by, and this machine's counts.

    >>> CATALOG[lookup("a100")].device_memory / 2**30
    80.0

Every figure carries its source in a comment beside it; :class:`nbtrain.profiler.hardware.Cluster` builds on them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from nbtrain.errors import UnknownDeviceError

GiB, MiB, GB, TFLOPS = 2**30, 2**20, 1e9, 1e12
# Practical x16 rates per direction (REFERENCE.md "Physical limits"): Gen3 ~12, Gen4 ~25, Gen5 ~50 GB/s.
PCIE_GEN3, PCIE_GEN4, PCIE_GEN5 = 12 * GB, 25 * GB, 50 * GB
# InfiniBand line rates in bytes/s: EDR 100, HDR 200, NDR 400 Gb/s (one NIC per GPU on DGX A100/H100/H200).
IB_EDR, IB_HDR, IB_NDR = 100e9 / 8, 200e9 / 8, 400e9 / 8
# STACK.md: AdamW(fused=True) updates ~1.4 G params/s on ONE thread (100–200 M params). Where no source gives a
# host's sustained memory bandwidth we count that per socket: conservative, since more threads scale it until memory
# bandwidth bounds it.
ADAMW_PER_THREAD = ADAMW_PER_SOCKET = 1.4e9
# AdamW with an fp32 master reads a parameter, its fp32 gradient and two moments and writes back three: 28 bytes a
# parameter (REFERENCE.md), what a fused AdamW step moves and what Cluster.detect()'s cpu_adamw measures. Given the
# threads, a host updates no faster than its sustained memory bandwidth over 28 bytes.
ADAMW_BYTES = 28


def host_adamw_rate(threads: int, sustained_bandwidth: float) -> float:
    """AdamW parameters a node updates a second when the update runs on ``threads`` threads of a host whose memory
    sustains ``sustained_bandwidth`` bytes/s: no faster than the threads (STACK.md's 1.4 G params/s each) nor than
    the memory (28 bytes a parameter).

        >>> round(host_adamw_rate(120, 2 * 148e9) / 1e9, 2)     # a DGX A100, below: memory-bound
        10.57
    """
    return min(threads * ADAMW_PER_THREAD, sustained_bandwidth / ADAMW_BYTES)


# The host of a DGX A100 (issue 45): two AMD EPYC 7742 of 64 cores each and 1 TB of DDR4 (NVIDIA's DGX A100
# datasheet; Microway's "DGX A100 review": "Dual 64-core AMD EPYC 7742 CPUs", "1TB DDR4 system memory (upgradeable
# to 2TB)"), eight channels of DDR4-3200 a socket (AMD's EPYC 7742 page: 204.8 GB/s a socket). Sustained: STREAM on a
# DGX A100's CPU reaches 148 GB/s on 32 cores of one socket (a public measurement,
# gist.github.com/v0dro/0559e1d9b205ca9ac0ad1a29fe10377b, GOMP_CPU_AFFINITY=0-63:2; 72% of the socket's 204.8), so
# 2 x 148 GB/s a node. nbtrain's executor gives a rank's offloaded update the rank's cores less one
# (run/offload/threads.py: 8 ranks on 128 cores, 15 threads each, 120 a node, 60 a socket where STREAM used 32;
# with SMT on, 31 each).
# 120 threads could update 168 G params/s; the memory allows 2 x 148 GB/s / 28 B = 10.6 G params/s a node. Not in
# the rate, as not in what detect() measures: the executor's other host traffic around the step (the bf16 gradient
# widened to fp32, 6 bytes a parameter; the fp32 weights read for the upload, 4; with clipping, the state copied
# before a speculative update, 24), and NUMA: the executor pins neither threads nor memory (DGX A100 runs NPS4).
# The other hosts (DGX-1, DGX H100/H200, Grand Teton, the PCIe boxes) keep the one-thread-a-socket figure: no
# sustained-bandwidth figure for them was found (DGX H100's 32 DIMMs on 16 channels run at 2 a channel, below the
# 8480C's DDR5-4800 rating, by how much not found).
DGX_A100_ADAMW = host_adamw_rate(8 * (128 // 8 - 1), 2 * 148 * GB)


def local_memory() -> int:
    """Physical memory of this machine, or of its container when a cgroup caps it lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): assume a laptop
        return 16 * GiB
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


def local_gpus() -> int:
    """GPUs visible, counted through NVML so that CUDA is not initialised in this process (a notebook that forks
    workers later must not have it: "Cannot re-initialize CUDA in forked subprocess")."""
    import torch
    from accelerate.utils import is_cuda_available

    return torch.cuda.device_count() if is_cuda_available() else 0


def local_gpu_name() -> tuple[str, int] | None:
    """The first GPU's name and memory in bytes from NVML (``pynvml``, or the driver's ``nvidia-smi`` where pynvml
    is not installed), without initialising CUDA; None when neither can be read here."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        return (name.decode() if isinstance(name, bytes) else name), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # no pynvml, no driver, no device: ask nvidia-smi, which ships with the driver
        pass
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.strip().splitlines()[0].rsplit(",", 1)
        return name.strip(), int(float(mib)) * 2**20
    except Exception:  # no nvidia-smi either: the caller falls back
        return None


def local_cpus() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class DeviceSpec:
    """One catalog entry: the per-device numbers of a :class:`Cluster` (same units), plus labels for display."""

    device_memory: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    host_memory: int
    host_to_device_bandwidth: float
    cpu_optimizer_rate: float
    flops_efficiency: float = 0.8  # REFERENCE.md: ~790 of 990 TFLOP/s measured on an H200
    memory_bandwidth: float = 0.0
    memory_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    kernel_latency_s: float = 0.0
    collective_latency_s: float = 0.0
    inter_node_latency_s: float = 0.0
    dtype: str = "bf16"
    intra_link: str = "NVLink"
    inter_link: str = "InfiniBand"


TB = 1e12
# Compute time by kernel (nbtrain.planner.compute_time), for GPUs. Sources, as found with the figures:
# - Achievable bf16 matmul rate (flops_efficiency): Stas Bekman, "Machine Learning Engineering", chapter
#   compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table" (mamf-finder.py, found with
#   search): A100 SXM 271.2 of 312 TFLOP/s (torch 2.6; 267.9 in an earlier edition), H100 SXM 794.5 of 989 (torch
#   2.7); H200 keeps 0.8, REFERENCE.md's ~790 of 990 measured on one. No figure for the others: they keep 0.8
#   (V100, RTX 4090, RTX A6000) and 0.7 (L4, power-capped).
# - Attention (attention_efficiency, of peak, on causal FLOPs): FlashAttention-2 (Dao 2023, abstract) reaches
#   50-73% of peak on A100, forward; backward is slower (its §4), so the low end, 0.5. FlashAttention-3 (Shah et
#   al. 2024, abstract): "FlashAttention-2 achieving only 35% utilization on the H100 GPU": 0.35 on Hopper, which is
#   what PyTorch's SDPA flash backend (FA2) runs. Unknown elsewhere: the matmul rate.
# - Memory-bound ops (memory_bandwidth × memory_efficiency): datasheets' HBM bandwidth (A100-80GB 2.04 TB/s,
#   A100-40GB 1.555, H100 SXM 3.35, H200 4.8, V100 0.9, L4 0.3, RTX 4090 1.008, RTX A6000 0.768); a streaming
#   kernel reaches ~0.9 of it (H100 80GB HBM3: 3.02-3.09 TB/s D2D copy and STREAM triad, a published benchmark
#   log found with search; BabelStream's A100 figures, ~1.8 of 2.04 TB/s, remembered).
# - Launch floor (kernel_latency_s): eager PyTorch spends ~5-25 us of CPU per op before its kernel runs (dispatch
#   ~1-2 us, autograd ~1-3 us, cudaLaunchKernel ~1-3 us: jiahuanglin.xyz "From PyTorch op to kernel launch"); a
#   kernel cannot take less than the low end, 5 us, when the CPU feeds the GPU one op at a time.
# - Collective floor: NCCL all-reduce of a few hundred bytes inside an HGX 8 x H100 node takes ~6 us with two
#   GPUs, more with more (NVIDIA/nccl#1259, nccl-tests with CUDA graphs); NCCL's own tuning model prices 128 bytes
#   across H100 nodes at ~25 us (NVIDIA/nccl#1453, "128 Bytes -> Algo 0 proto 0 time 25.2"). 6 us inside a node,
#   25 us across, for every NVLink/PCIe GPU (not found per GPU).
_KERNEL_FLOORS = dict(memory_efficiency=0.9, kernel_latency_s=5e-6, collective_latency_s=6e-6,
                      inter_node_latency_s=25e-6)

# The 500 W H100's compute rate (issue 45), derived from ONE published run and from no other: torchtitan's
# benchmarks/llama3_h100_202412_torchtitan.md, Table 1, "FSDP" row: Llama 3.1 8B on 8 of these GPUs, FSDP 8, local
# batch 2 x 8192, per-op selective checkpointing, eager (no compile, no Float8): 5,762 tokens/s a GPU, so one step
# takes 2 x 8192 / 5,762 = 2.843 s. nbtrain's profile of that step (bench/published.py: dp_shard=8 ac=op on this
# entry) computes on each GPU 8.21e14 matmul FLOPs (7.38e14, and 0.84e14 that ac=op recomputes) and 1.23e14 causal
# attention FLOPs (the model's 6N + 12LHQT = 5.79e10 FLOPs a token is 9.49e14 a step: at 5,762 tokens/s that is
# 334 TFLOP/s, torchtitan's 33% MFU, the rate of the whole step and not of any kernel), and prices 0.627 s of the
# step outside them, at this card's own 2.4 TB/s: the memory-bound ops (1.20e12 bytes at 0.9 of it, 0.557 s),
# those ac=op recomputes (0.061 s) and FSDP's exposed communication (0.009 s). That leaves 2.843 - 0.627 = 2.216 s
# for the matmuls and attention, which the SXM part's rates (794.5 and 0.35 x 989.4 TFLOP/s) run in 1.034 + 0.356
# = 1.390 s: this card runs its compute-bound kernels at 1.390 / 2.216 = 0.627 of the SXM part's rates (a 500 W cap
# lowers the clock both ride on): 498 TFLOP/s of matmul. The figure carries whatever of that run nbtrain does not
# model, and bench/published.py marks that row as the one that set it: it is not a prediction there.
# tests/test_cluster.py recomputes each number from the profile.
_TITAN_8B_STEP_S = 2 * 8192 / 5762          # s a step on each GPU, Table 1's FSDP row
_TITAN_8B_OTHER_S = 0.627                   # s of it nbtrain prices outside matmuls and attention
_TITAN_8B_AT_SXM_S = 1.034 + 0.356          # s its matmuls and attention take at the SXM part's rates
H100_500W_CLOCK = _TITAN_8B_AT_SXM_S / (_TITAN_8B_STEP_S - _TITAN_8B_OTHER_S)
"""The 500 W H100's compute-bound kernels' rate as a fraction of the SXM part's: 0.627 (derived above)."""

CATALOG: dict[str, DeviceSpec] = {
    # Tesla V100 SXM2 32GB datasheet: 125 TFLOP/s fp16 tensor (no bf16 before A100), NVLink2 300 GB/s both ways,
    # PCIe Gen3. DGX-1V: 4× EDR for 8 GPUs (half a NIC each), 512 GB RAM, 2 sockets.
    "V100": DeviceSpec(32 * GiB, 125 * TFLOPS, 300 * GB / 2, IB_EDR / 2, 512 * GiB, PCIE_GEN3,
                       2 * ADAMW_PER_SOCKET, memory_bandwidth=0.9 * TB, **_KERNEL_FLOORS, dtype="fp16",
                       inter_link="InfiniBand EDR"),
    # A100 SXM4 datasheet: 312 TFLOP/s bf16 dense, NVLink3 600 GB/s both ways, PCIe Gen4.
    # DGX A100: 8× HDR (one per GPU), 2 sockets; 1 TB RAM with 40 GB GPUs, 2 TB with 80 GB GPUs; the host's AdamW
    # rate is bounded by its memory (DGX_A100_ADAMW above).
    "A100-40GB": DeviceSpec(40 * GiB, 312 * TFLOPS, 600 * GB / 2, IB_HDR, 1024 * GiB, PCIE_GEN4,
                            DGX_A100_ADAMW, flops_efficiency=271.2 / 312, memory_bandwidth=1.555 * TB,
                            attention_efficiency=0.5, **_KERNEL_FLOORS, inter_link="InfiniBand HDR"),
    "A100-80GB": DeviceSpec(80 * GiB, 312 * TFLOPS, 600 * GB / 2, IB_HDR, 2048 * GiB, PCIE_GEN4,
                            DGX_A100_ADAMW, flops_efficiency=271.2 / 312, memory_bandwidth=2.039 * TB,
                            attention_efficiency=0.5, **_KERNEL_FLOORS, inter_link="InfiniBand HDR"),
    # H100 SXM5 datasheet: 1,979 TFLOP/s bf16 with sparsity, 989.4 dense (Hopper whitepaper), NVLink4 900 GB/s
    # both ways, PCIe Gen5.
    # DGX H100: 8× ConnectX-7 NDR (one per GPU), 2 TB RAM, 2 sockets. Memory: 80 GiB HBM3; the runtime reports
    # ~0.5% less (81559 MiB), which the planner's memory reserve covers.
    "H100": DeviceSpec(80 * GiB, 989.4 * TFLOPS, 900 * GB / 2, IB_NDR, 2048 * GiB, PCIE_GEN5,
                       2 * ADAMW_PER_SOCKET, flops_efficiency=794.5 / 989.4, memory_bandwidth=3.35 * TB,
                       attention_efficiency=0.35, **_KERNEL_FLOORS, inter_link="InfiniBand NDR"),
    # Meta's Grand Teton H100 (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"): "96GB HBM2e
    # with 2.4 TB/sec peak memory bandwidth", "the default 500W power limit" (the SXM part is rated 700 W);
    # 400 Gb/s RDMA per GPU. Its peak "is between SXM and NVL, and we don't know its exact value" (the same file,
    # note 2), and no datasheet gives it: its compute rate is what ONE of torchtitan's runs on it implies
    # (H100_500W_CLOCK below). peak_flops stays the SXM part's 989.4, the denominator torchtitan's MFU divides by.
    "H100-500W": DeviceSpec(96 * GB, 989.4 * TFLOPS, 900 * GB / 2, IB_NDR, 2048 * GiB, PCIE_GEN5,
                            2 * ADAMW_PER_SOCKET, flops_efficiency=H100_500W_CLOCK * 794.5 / 989.4,
                            memory_bandwidth=2.4 * TB, attention_efficiency=H100_500W_CLOCK * 0.35,
                            **_KERNEL_FLOORS, inter_link="RDMA 400 Gb/s"),
    # H200 SXM datasheet: "141 GB" HBM3e (the runtime sees ~140 GiB: 143771 MiB), same compute and NVLink as H100.
    # DGX H200: 8× NDR, 2 TB RAM, 2 sockets.
    "H200": DeviceSpec(140 * GiB, 989.4 * TFLOPS, 900 * GB / 2, IB_NDR, 2048 * GiB, PCIE_GEN5,
                       2 * ADAMW_PER_SOCKET, memory_bandwidth=4.8 * TB, attention_efficiency=0.35,
                       **_KERNEL_FLOORS, inter_link="InfiniBand NDR"),
    # L4 datasheet: 24 GB GDDR6 (23034 MiB visible with ECC, the default), 242 TFLOP/s bf16 with sparsity = 121
    # dense, PCIe Gen4 x16, no NVLink, 72 W: it throttles under sustained matmuls, hence 0.7 of peak.
    # Host: a 1-socket, 128 GiB box; network: 100 Gb/s Ethernet shared by 8 GPUs (cloud VMs). Override both.
    "L4": DeviceSpec(23034 * MiB, 121 * TFLOPS, PCIE_GEN4, 100e9 / 8 / 8, 128 * GiB, PCIE_GEN4,
                     ADAMW_PER_SOCKET, flops_efficiency=0.7, memory_bandwidth=0.3 * TB, **_KERNEL_FLOORS,
                     intra_link="PCIe Gen4", inter_link="Ethernet"),
    # Ada whitepaper (RTX 4090): 165.2 TFLOP/s bf16 with fp32 accumulate (what PyTorch uses), 24 GB GDDR6X,
    # PCIe Gen4 x16, no NVLink; GeForce has no peer-to-peer, so device-to-device traffic crosses host memory at
    # no more than PCIe rate. Host and network as for L4.
    "RTX4090": DeviceSpec(24 * GiB, 165.2 * TFLOPS, PCIE_GEN4, 100e9 / 8 / 8, 128 * GiB, PCIE_GEN4,
                          ADAMW_PER_SOCKET, memory_bandwidth=1.008 * TB, **_KERNEL_FLOORS,
                          intra_link="PCIe Gen4", inter_link="Ethernet"),
    # RTX A6000 (Ampere GA102, a workstation card): NVIDIA's spec table (as servethehome.com reproduced it): "48 GB
    # GDDR6 with ECC", 768 GB/s, 336 third-generation Tensor Cores, PCIe 4.0 x16, 300 W, an NVLink bridge for two
    # cards only (112.5 GB/s both ways); "Tensor performance 309.7 TFLOPS" is with sparsity: 154.8 dense bf16/fp16
    # (336 Tensor Cores x 256 FLOPs a clock x 1.8 GHz boost; the professional card accumulates in fp32 at full
    # rate). nvidia-smi reports 49140 MiB with ECC off (public logs of the card). More than two cards talk over
    # PCIe. Host and network as for L4.
    "A6000": DeviceSpec(49140 * MiB, 154.8 * TFLOPS, PCIE_GEN4, 100e9 / 8 / 8, 128 * GiB, PCIE_GEN4,
                        ADAMW_PER_SOCKET, memory_bandwidth=0.768 * TB, **_KERNEL_FLOORS,
                        intra_link="PCIe Gen4", inter_link="Ethernet"),
    # The host itself, one "device" per core (one worker process, one thread each). No datasheet: conservative
    # guesses that Cluster.detect() replaces with measurements — one core's fp32 matmul (~50 GFLOP/s for AVX2;
    # 120+ measured with AVX-512), gloo all-reduce over loopback (~0.7 GB/s measured on 2 cores), one-thread
    # memcpy (~5 GB/s), fused AdamW on one thread (0.9–1.4 G params/s, STACK.md), 10 Gb/s Ethernet between hosts.
    # Memory and network are the whole machine's; from_catalog divides them among the devices of a node.
    "cpu": DeviceSpec(local_memory(), 50e9, 0.5 * GB, 10e9 / 8, local_memory(), 5 * GB, 1e9,
                      dtype="fp32", intra_link="gloo", inter_link="Ethernet"),
}

_ALIASES = {  # normalised (lower-case letters and digits only) → catalog name
    "v100": "V100", "v10032gb": "V100", "teslav100": "V100", "v100sxm2": "V100", "v100sxm232gb": "V100",
    "a100": "A100-80GB", "a10080gb": "A100-80GB", "a10080g": "A100-80GB", "a10080": "A100-80GB",
    "a10040gb": "A100-40GB", "a10040g": "A100-40GB", "a10040": "A100-40GB",
    "h100": "H100", "h10080gb": "H100", "h100sxm": "H100", "h100sxm5": "H100",
    "h100500w": "H100-500W", "h10096gb500w": "H100-500W", "h10096gb": "H100-500W", "h100hbm2e": "H100-500W",
    "h200": "H200", "h200141gb": "H200", "h200sxm": "H200", "l4": "L4",
    "rtx4090": "RTX4090", "4090": "RTX4090", "geforcertx4090": "RTX4090", "a6000": "A6000", "rtxa6000": "A6000",
    "cpu": "cpu", "host": "cpu",
}


def lookup(name: str) -> str:
    """The catalog name for ``name``, ignoring case, spaces, dashes and an ``NVIDIA`` prefix: ``lookup("a100")``."""
    key = re.sub(r"[^a-z0-9]", "", str(name).lower()).removeprefix("nvidia")
    if key not in _ALIASES:
        raise UnknownDeviceError(str(name), list(CATALOG))
    return _ALIASES[key]


def match_gpu(runtime_name: str, memory: int, capability: tuple[int, int]) -> tuple[str, bool]:
    """The catalog entry closest to a CUDA device, and whether its name matched ("NVIDIA H100 80GB HBM3")."""
    name = runtime_name.lower()
    for key, entry in (("h200", "H200"), ("h100", "H100"), ("v100", "V100"), ("4090", "RTX4090"),
                       ("a6000", "A6000"), ("a100", "A100-80GB" if memory > 60 * GiB else "A100-40GB")):
        if key in name:
            return entry, True
    if re.search(r"\bl4\b", name):  # not "L40S"
        return "L4", True
    # Unknown card: the catalog GPU of its generation (sm70 Volta, sm80 Ampere, sm86/89 consumer, sm90+ Hopper).
    major, minor = capability
    return {7: "V100", 8: "A100-80GB" if minor == 0 else "L4"}.get(major, "H100" if major >= 9 else "V100"), False
