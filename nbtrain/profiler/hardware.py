"""The cluster a plan is made for: devices, their memory and compute rate, the links between them, the host.

    >>> from nbtrain.profiler.hardware import Cluster
    >>> print(Cluster.from_catalog("h100", num_devices=16).summary())
    16 × H100 (2 nodes) · 80.00 GiB each · 989.4 TFLOP/s bf16 · NVLink 450.0 GB/s · InfiniBand NDR 50.0 GB/s
    >>> Cluster.from_catalog("a100", num_devices=8, device_memory="40GiB").device_memory
    42949672960
    >>> Cluster.detect()          # this machine, measured by nbtrain.profiler.calibrate in a few seconds

Every bandwidth is **per device, per direction**. NVIDIA quotes NVLink as both directions together, so the
catalog halves it; a node's network cards are shared by its devices, so inter-node bandwidth is the node's
line rate over its device count (DGX nodes have one NIC per GPU). No torch import here: planning is pure Python.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, UnknownDeviceError
from nbtrain.table import Table
from nbtrain.units import format_bytes, format_rate, parse_bytes

GiB, MiB, GB, TFLOPS = 2**30, 2**20, 1e9, 1e12
# Practical x16 rates per direction (REFERENCE.md "Physical limits"): Gen3 ~12, Gen4 ~25, Gen5 ~50 GB/s.
PCIE_GEN3, PCIE_GEN4, PCIE_GEN5 = 12 * GB, 25 * GB, 50 * GB
# InfiniBand line rates in bytes/s: EDR 100, HDR 200, NDR 400 Gb/s (one NIC per GPU on DGX A100/H100/H200).
IB_EDR, IB_HDR, IB_NDR = 100e9 / 8, 200e9 / 8, 400e9 / 8
# STACK.md: AdamW(fused=True) updates ~1.4 G params/s on ONE thread (100–200 M params). We count that per
# socket: conservative, since more threads scale it until memory bandwidth (~28 B/param, REFERENCE.md) bounds it.
ADAMW_PER_SOCKET = 1.4e9


def _local_memory() -> int:
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


def _local_cpus() -> int:
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
    dtype: str = "bf16"
    intra_link: str = "NVLink"
    inter_link: str = "InfiniBand"


CATALOG: dict[str, DeviceSpec] = {
    # Tesla V100 SXM2 32GB datasheet: 125 TFLOP/s fp16 tensor (no bf16 before A100), NVLink2 300 GB/s both ways,
    # PCIe Gen3. DGX-1V: 4× EDR for 8 GPUs (half a NIC each), 512 GB RAM, 2 sockets.
    "V100": DeviceSpec(32 * GiB, 125 * TFLOPS, 300 * GB / 2, IB_EDR / 2, 512 * GiB, PCIE_GEN3,
                       2 * ADAMW_PER_SOCKET, dtype="fp16", inter_link="InfiniBand EDR"),
    # A100 SXM4 datasheet: 312 TFLOP/s bf16 dense, NVLink3 600 GB/s both ways, PCIe Gen4.
    # DGX A100: 8× HDR (one per GPU), 2 sockets; 1 TB RAM with 40 GB GPUs, 2 TB with 80 GB GPUs.
    "A100-40GB": DeviceSpec(40 * GiB, 312 * TFLOPS, 600 * GB / 2, IB_HDR, 1024 * GiB, PCIE_GEN4,
                            2 * ADAMW_PER_SOCKET, inter_link="InfiniBand HDR"),
    "A100-80GB": DeviceSpec(80 * GiB, 312 * TFLOPS, 600 * GB / 2, IB_HDR, 2048 * GiB, PCIE_GEN4,
                            2 * ADAMW_PER_SOCKET, inter_link="InfiniBand HDR"),
    # H100 SXM5 datasheet: 1,979 TFLOP/s bf16 with sparsity, 989.4 dense (Hopper whitepaper), NVLink4 900 GB/s
    # both ways, PCIe Gen5.
    # DGX H100: 8× ConnectX-7 NDR (one per GPU), 2 TB RAM, 2 sockets. Memory: 80 GiB HBM3; the runtime reports
    # ~0.5% less (81559 MiB), which the planner's memory reserve covers.
    "H100": DeviceSpec(80 * GiB, 989.4 * TFLOPS, 900 * GB / 2, IB_NDR, 2048 * GiB, PCIE_GEN5,
                       2 * ADAMW_PER_SOCKET, inter_link="InfiniBand NDR"),
    # H200 SXM datasheet: "141 GB" HBM3e (the runtime sees ~140 GiB: 143771 MiB), same compute and NVLink as H100.
    # DGX H200: 8× NDR, 2 TB RAM, 2 sockets.
    "H200": DeviceSpec(140 * GiB, 989.4 * TFLOPS, 900 * GB / 2, IB_NDR, 2048 * GiB, PCIE_GEN5,
                       2 * ADAMW_PER_SOCKET, inter_link="InfiniBand NDR"),
    # L4 datasheet: 24 GB GDDR6 (23034 MiB visible with ECC, the default), 242 TFLOP/s bf16 with sparsity = 121
    # dense, PCIe Gen4 x16, no NVLink, 72 W: it throttles under sustained matmuls, hence 0.7 of peak.
    # Host: a 1-socket, 128 GiB box; network: 100 Gb/s Ethernet shared by 8 GPUs (cloud VMs). Override both.
    "L4": DeviceSpec(23034 * MiB, 121 * TFLOPS, PCIE_GEN4, 100e9 / 8 / 8, 128 * GiB, PCIE_GEN4,
                     ADAMW_PER_SOCKET, flops_efficiency=0.7, intra_link="PCIe Gen4", inter_link="Ethernet"),
    # Ada whitepaper (RTX 4090): 165.2 TFLOP/s bf16 with fp32 accumulate (what PyTorch uses), 24 GB GDDR6X,
    # PCIe Gen4 x16, no NVLink; GeForce has no peer-to-peer, so device-to-device traffic crosses host memory at
    # no more than PCIe rate. Host and network as for L4.
    "RTX4090": DeviceSpec(24 * GiB, 165.2 * TFLOPS, PCIE_GEN4, 100e9 / 8 / 8, 128 * GiB, PCIE_GEN4,
                          ADAMW_PER_SOCKET, intra_link="PCIe Gen4", inter_link="Ethernet"),
    # The host itself, one "device" per core (one worker process, one thread each). No datasheet: conservative
    # guesses that Cluster.detect() replaces with measurements — one core's fp32 matmul (~50 GFLOP/s for AVX2;
    # 120+ measured with AVX-512), gloo all-reduce over loopback (~0.7 GB/s measured on 2 cores), one-thread
    # memcpy (~5 GB/s), fused AdamW on one thread (0.9–1.4 G params/s, STACK.md), 10 Gb/s Ethernet between hosts.
    # Memory and network are the whole machine's; from_catalog divides them among the devices of a node.
    "cpu": DeviceSpec(_local_memory(), 50e9, 0.5 * GB, 10e9 / 8, _local_memory(), 5 * GB, 1e9,
                      dtype="fp32", intra_link="gloo", inter_link="Ethernet"),
}

_ALIASES = {  # normalised (lower-case letters and digits only) → catalog name
    "v100": "V100", "v10032gb": "V100", "teslav100": "V100", "v100sxm2": "V100", "v100sxm232gb": "V100",
    "a100": "A100-80GB", "a10080gb": "A100-80GB", "a10080g": "A100-80GB", "a10080": "A100-80GB",
    "a10040gb": "A100-40GB", "a10040g": "A100-40GB", "a10040": "A100-40GB",
    "h100": "H100", "h10080gb": "H100", "h100sxm": "H100", "h100sxm5": "H100",
    "h200": "H200", "h200141gb": "H200", "h200sxm": "H200", "l4": "L4",
    "rtx4090": "RTX4090", "4090": "RTX4090", "geforcertx4090": "RTX4090", "cpu": "cpu", "host": "cpu",
}


def lookup(name: str) -> str:
    """The catalog name for ``name``, ignoring case, spaces, dashes and an ``NVIDIA`` prefix: ``lookup("a100")``."""
    key = re.sub(r"[^a-z0-9]", "", str(name).lower()).removeprefix("nvidia")
    if key not in _ALIASES:
        raise UnknownDeviceError(str(name), list(CATALOG))
    return _ALIASES[key]


def _match_gpu(runtime_name: str, memory: int, capability: tuple[int, int]) -> tuple[str, bool]:
    """The catalog entry closest to a CUDA device, and whether its name matched ("NVIDIA H100 80GB HBM3")."""
    name = runtime_name.lower()
    for key, entry in (("h200", "H200"), ("h100", "H100"), ("v100", "V100"), ("4090", "RTX4090"),
                       ("a100", "A100-80GB" if memory > 60 * GiB else "A100-40GB")):
        if key in name:
            return entry, True
    if re.search(r"\bl4\b", name):  # not "L40S"
        return "L4", True
    # Unknown card: the catalog GPU of its generation (sm70 Volta, sm80 Ampere, sm86/89 consumer, sm90+ Hopper).
    major, minor = capability
    return {7: "V100", 8: "A100-80GB" if minor == 0 else "L4"}.get(major, "H100" if major >= 9 else "V100"), False


_MEASURED = {"matmul": "peak_flops", "copy": "host_to_device_bandwidth", "cpu_adamw": "cpu_optimizer_rate",
             "allreduce": "intra_node_bandwidth"}  # calibrate.Measurement.name → the field it sets
_UNITS = {  # field → (unit for messages, is a byte count)
    "device_memory": ("bytes per device", True), "host_memory": ("bytes per node", True),
    "peak_flops": ("FLOP/s per device", False), "intra_node_bandwidth": ("bytes/s per device", False),
    "inter_node_bandwidth": ("bytes/s per device", False), "host_to_device_bandwidth": ("bytes/s per device", False),
    "cpu_optimizer_rate": ("AdamW params/s per node", False),
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a plan runs on. Build one with :meth:`from_catalog` or :meth:`detect`; all fields are SI."""

    device: str
    """Catalog name (``"H100"``, ``"cpu"``), or the runtime's name for a GPU the catalog does not know."""
    num_devices: int
    """Devices in the whole cluster (GPUs, or worker processes on CPU)."""
    devices_per_node: int
    """Devices in one node; ``num_devices`` must be a multiple of it."""
    device_memory: int
    """Bytes of memory per device (as the runtime sees it); a string like ``"40GiB"`` is parsed."""
    peak_flops: float
    """Dense matmul FLOP/s per device in the training compute dtype (bf16 on GPUs; fp16 on V100; fp32 on CPU)."""
    flops_efficiency: float = 0.8
    """Fraction of ``peak_flops`` that large matmuls sustain, in (0, 1] (~790 of 990 TFLOP/s measured on H200)."""
    intra_node_bandwidth: float
    """Bytes/s per device, one direction, device to device inside a node (NVLink, else PCIe, or gloo on CPU)."""
    inter_node_bandwidth: float
    """Bytes/s per device, one direction, across nodes (the node's network rate over its devices)."""
    host_memory: int
    """Bytes of host (CPU) memory per node, for offloaded optimizer state; a string like ``"1TiB"`` is parsed."""
    host_to_device_bandwidth: float
    """Bytes/s per device, one direction, between host memory and the device (PCIe; a memcpy on CPU)."""
    cpu_optimizer_rate: float
    """AdamW parameter updates per second per node on the host CPU."""
    source: str = "catalog"
    """How the numbers came about: ``"catalog"`` (datasheets), ``"detected"`` (counts and memory of this
    machine, rates from the catalog) or ``"calibrated"`` (rates measured by micro-benchmarks)."""

    def __post_init__(self) -> None:
        for name in ("num_devices", "devices_per_node"):
            value = getattr(self, name)
            positive_int(value, f"{name} must be a whole number ≥ 1, got {value!r} (count GPUs, or worker processes "
                                "on CPU)")
        for name, (unit, is_bytes) in _UNITS.items():
            value = getattr(self, name)
            if is_bytes and isinstance(value, str):
                object.__setattr__(self, name, value := parse_bytes(value))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidArgumentError(
                    f"{name} must be a positive number of {unit}, got {value!r}; "
                    f"pass a datasheet or measured value, e.g. Cluster.from_catalog(..., {name}=...)")
        eff = self.flops_efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise InvalidArgumentError(
                f"flops_efficiency is the fraction of peak that large matmuls sustain and must be in (0, 1], "
                f"got {self.flops_efficiency!r}; to raise the rate itself, change peak_flops")
        self.num_nodes  # noqa: B018 — validates that the devices fill whole nodes

    @property
    def num_nodes(self) -> int:
        """Nodes in the cluster: ``num_devices / devices_per_node``, which must divide evenly."""
        nodes, rest = divmod(self.num_devices, self.devices_per_node)
        if rest:
            fits = max(d for d in range(1, self.devices_per_node + 1) if self.num_devices % d == 0)
            raise InvalidArgumentError(
                f"{self.num_devices} devices do not fill nodes of {self.devices_per_node}: {self.num_devices} = "
                f"{nodes} × {self.devices_per_node} + {rest}; use a multiple of {self.devices_per_node} devices "
                f"or {fits} devices per node")
        return nodes

    @property
    def sustained_flops(self) -> float:
        """FLOP/s per device that large matmuls reach in practice: ``peak_flops × flops_efficiency``."""
        return self.peak_flops * self.flops_efficiency

    @classmethod
    def from_catalog(cls, name: str, num_devices: int = 1, devices_per_node: int | None = None,
                     **overrides) -> Cluster:
        """``num_devices`` of catalog device ``name``: ``Cluster.from_catalog("H100", 16, cpu_optimizer_rate=4e9)``.

        ``devices_per_node`` defaults to ``min(num_devices, 8)`` for GPUs (an 8-GPU server) and to all devices for
        ``"cpu"`` (one host); on ``"cpu"`` each device gets an equal share of the host's memory and network.
        Any field can be overridden by keyword.
        """
        canonical = lookup(name)
        _check_fields(overrides, "from_catalog", exclude=("num_devices", "devices_per_node"))
        spec = dataclasses.asdict(CATALOG[canonical])
        for label in ("dtype", "intra_link", "inter_link"):  # display only, not cluster fields
            spec.pop(label)
        if devices_per_node is None:
            devices_per_node = num_devices if canonical == "cpu" else min(num_devices, 8)
        if canonical == "cpu":
            host = parse_bytes(overrides.get("host_memory", spec["host_memory"]))
            shares = devices_per_node if isinstance(devices_per_node, int) and devices_per_node > 0 else 1
            spec["device_memory"] = host // shares  # the workers share the host's memory and its network card
            spec["inter_node_bandwidth"] /= shares
        fields = {"device": canonical, "num_devices": num_devices, "devices_per_node": devices_per_node, **spec}
        return cls(**{**fields, **overrides})

    @classmethod
    def detect(cls, calibrate: bool = True, allreduce: bool = False) -> Cluster:
        """This machine: its CUDA GPUs if torch sees any, else its CPU cores. ``Cluster.detect(calibrate=False)``.

        Counts and memory come from the runtime. With ``calibrate`` the micro-benchmarks of
        :mod:`nbtrain.profiler.calibrate` measure compute, copy and CPU AdamW rates (a few seconds);
        ``allreduce=True`` also spawns processes to measure the intra-node all-reduce bandwidth.
        """
        import torch  # here, not at module level: planning must not pay for torch

        from nbtrain.profiler import calibrate as bench

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            name, by_name = _match_gpu(props.name, props.total_memory, (props.major, props.minor))
            count = torch.cuda.device_count()
            cluster = cls.from_catalog(name, num_devices=count, devices_per_node=count,
                                       device_memory=props.total_memory, host_memory=_local_memory(),
                                       source="detected")
            if not by_name:  # a card the catalog only approximates: say which it is
                cluster = cluster.replace(device=props.name)
            if "pcie" in props.name.lower():  # PCIe cards without an NVLink bridge talk over PCIe
                cluster = cluster.replace(intra_node_bandwidth=cluster.host_to_device_bandwidth)
            device = "cuda"
        else:
            cluster = cls.from_catalog("cpu", num_devices=_local_cpus(), source="detected")
            device = "cpu"
        if calibrate:
            cluster = cluster.with_measurements(bench.calibrate(device, allreduce=allreduce))
        return cluster

    def with_measurements(self, measurements) -> Cluster:
        """A copy with measured rates put in (``source="calibrated"``): ``c.with_measurements(calibrate("cpu"))``.

        A GPU keeps its datasheet peak and gets ``flops_efficiency = measured / peak``; a CPU has no datasheet,
        so the measured rate becomes the peak, sustained at 1.0. ``copy`` sets host→device bandwidth,
        ``cpu_adamw`` the optimizer rate, ``allreduce`` (bus bandwidth) the intra-node bandwidth.
        """
        changes: dict = {"source": "calibrated"}
        for m in measurements:
            if m.name not in _MEASURED:
                raise InvalidArgumentError(f"unknown measurement {m.name!r}; expected one of {', '.join(_MEASURED)}")
            if m.name != "matmul":
                changes[_MEASURED[m.name]] = m.value
            elif self.device == "cpu" or m.value >= self.peak_flops:  # no datasheet, or one we beat: trust it
                changes.update(peak_flops=m.value, flops_efficiency=1.0)
            else:
                changes["flops_efficiency"] = m.value / self.peak_flops
        return self.replace(**changes)

    def replace(self, **changes) -> Cluster:
        """A copy with some fields changed and validated again: ``cluster.replace(num_devices=16)``."""
        _check_fields(changes, "replace")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-ready values; ``Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        """The inverse of :meth:`to_dict`; unknown keys are an error, not silently dropped."""
        _check_fields(data, "from_dict")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise InvalidArgumentError(f"a cluster description lacks {', '.join(missing)}")
        return cls(**data)

    def save(self, path) -> None:
        """Write this description as JSON, so a cluster measured once (``Cluster.detect()``, or a GPU cluster's
        figures) is planned for again without measuring: ``Cluster.load(path)``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path) -> Cluster:
        """The cluster :meth:`save` (or ``nbtrain cluster ... --save``) wrote to ``path``.

            >>> Cluster.from_catalog("H100", num_devices=16).save("h100x16.json")
            >>> Cluster.load("h100x16.json").num_devices
            16
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(f"cannot read a cluster from {path}: {error}; write one with "
                                       "'nbtrain cluster --detect --save FILE' or Cluster.save(FILE)") from None
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{path} holds {type(data).__name__}, not a cluster (a JSON object)")
        return cls.from_dict(data)

    def summary(self) -> str:
        """One line: ``8 × H100 (1 node) · 80.00 GiB each · 989.4 TFLOP/s bf16 · NVLink 450.0 GB/s``."""
        spec = CATALOG.get(self.device)  # link names and dtype for display; unknown GPUs get generic ones
        dtype, intra, inter = (spec.dtype, spec.intra_link, spec.inter_link) if spec else ("", "link", "network")
        nodes = self.num_nodes
        parts = [f"{self.num_devices} × {self.device} ({nodes} node{'s' if nodes > 1 else ''})",
                 f"{format_bytes(self.device_memory)} each",
                 f"{format_rate(self.peak_flops, 'FLOP/s')} {dtype}".strip(),
                 f"{intra} {format_rate(self.intra_node_bandwidth, 'B/s')}"]
        if nodes > 1:
            parts.append(f"{inter} {format_rate(self.inter_node_bandwidth, 'B/s')}")
        if self.source != "catalog":
            parts.append(self.source)
        return " · ".join(parts)

    def _table(self) -> Table:
        nodes = self.num_nodes
        table = Table(["quantity", "value"], title=self.summary())
        for key, value in (
            ("device", f"{self.device} ({self.source})"),
            ("devices", f"{self.num_devices} = {nodes} node{'s' if nodes > 1 else ''} × {self.devices_per_node}"),
            ("memory per device", format_bytes(self.device_memory)),
            ("peak compute", f"{format_rate(self.peak_flops, 'FLOP/s')} per device"),
            ("sustained compute", f"{format_rate(self.sustained_flops, 'FLOP/s')} "
                                  f"({self.flops_efficiency:.0%} of peak)"),
            ("intra-node link", f"{format_rate(self.intra_node_bandwidth, 'B/s')} per device, each way"),
            ("inter-node link", f"{format_rate(self.inter_node_bandwidth, 'B/s')} per device, each way"),
            ("host memory", f"{format_bytes(self.host_memory)} per node"),
            ("host → device", f"{format_rate(self.host_to_device_bandwidth, 'B/s')} per device, each way"),
            ("CPU optimizer", f"{format_rate(self.cpu_optimizer_rate, ' params/s')} per node (AdamW)"),
        ):
            table.add(key, value)
        return table

    def __str__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def _check_fields(keys, where: str, exclude: tuple[str, ...] = ()) -> None:
    valid = [f.name for f in dataclasses.fields(Cluster) if f.name not in exclude]
    unknown = [k for k in keys if k not in valid]
    if unknown:
        raise InvalidArgumentError(f"{where}() got unknown field{'s' if len(unknown) > 1 else ''} "
                                   f"{', '.join(map(repr, unknown))}; valid fields: {', '.join(valid)}")
