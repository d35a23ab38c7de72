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
from dataclasses import dataclass
from pathlib import Path

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError
from nbtrain.profiler.catalog import (CATALOG, local_cpus, local_gpu_name, local_gpus, local_memory,  # noqa: F401
                                      lookup, match_gpu)  # (lookup: re-exported)
from nbtrain.profiler.collectives import Links, cached_links, remeasured
from nbtrain.table import Table
from nbtrain.units import format_bytes, format_rate, parse_bytes

_MEASURED = {"matmul": "peak_flops", "copy": "host_to_device_bandwidth", "cpu_adamw": "cpu_optimizer_rate",
             "allreduce": "intra_node_bandwidth",  # calibrate.Measurement.name → the field it sets
             "memory": "memory_bandwidth"}
_UNITS = {  # field → (unit for messages, is a byte count)
    "device_memory": ("bytes per device", True), "host_memory": ("bytes per node", True),
    "peak_flops": ("FLOP/s per device", False), "intra_node_bandwidth": ("bytes/s per device", False),
    "inter_node_bandwidth": ("bytes/s per device", False), "host_to_device_bandwidth": ("bytes/s per device", False),
    "cpu_optimizer_rate": ("AdamW params/s per node", False),
}


_CALIBRATED: dict = {}
"""This machine's CPU as :meth:`Cluster.this_machine` calibrated it, measured once per process."""


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
    memory_bandwidth: float = 0.0
    """Bytes/s of the device's own memory (HBM), datasheet; 0: unknown, and compute time is FLOPs over
    :attr:`sustained_flops` (a CPU, or an old saved cluster) instead of priced by kernel."""
    memory_efficiency: float = 0.0
    """Fraction of ``memory_bandwidth`` a memory-bound kernel (a norm, an activation, a copy) reaches."""
    attention_efficiency: float = 0.0
    """Fraction of ``peak_flops`` a fused attention kernel reaches on causal FLOPs; 0: ``flops_efficiency``."""
    kernel_latency_s: float = 0.0
    """Seconds no kernel takes less than (launch and eager dispatch): the floor of a tiny model's step."""
    collective_latency_s: float = 0.0
    """Seconds no collective inside a node takes less than (NCCL's small-message latency)."""
    inter_node_latency_s: float = 0.0
    """Seconds no collective across nodes takes less than."""
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
    host_cores: int = 0
    """CPU cores of a node, which its devices' processes share (0: as many as devices). On a CPU cluster with more
    worker processes than cores, each computes at ``host_cores / devices_per_node`` of a core."""
    links: Links = Links()
    """Communication measured on this machine, per operation and group size (:mod:`nbtrain.profiler.collectives`);
    empty: the cost model uses the bandwidths above."""
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
        for name in ("memory_bandwidth", "memory_efficiency", "attention_efficiency", "kernel_latency_s",
                     "collective_latency_s", "inter_node_latency_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf") \
                    or (name.endswith("efficiency") and value > 1):
                raise InvalidArgumentError(f"{name} must be a number ≥ 0{' and ≤ 1' if 'eff' in name else ''} "
                                           f"(0: unknown), got {value!r}")
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
            name, by_name = match_gpu(props.name, props.total_memory, (props.major, props.minor))
            count = torch.cuda.device_count()
            cluster = cls.from_catalog(name, num_devices=count, devices_per_node=count,
                                       device_memory=props.total_memory, host_memory=local_memory(),
                                       source="detected")
            if not by_name:  # a card the catalog only approximates: say which it is
                cluster = cluster.replace(device=props.name)
            if "pcie" in props.name.lower():  # PCIe cards without an NVLink bridge talk over PCIe
                cluster = cluster.replace(intra_node_bandwidth=cluster.host_to_device_bandwidth)
            device = "cuda"
        else:
            cluster = cls.from_catalog("cpu", num_devices=local_cpus(), host_cores=local_cpus(), source="detected")
            device = "cpu"
        if calibrate:
            cluster = cluster.with_measurements(bench.calibrate(device, allreduce=allreduce))
        return cluster

    @classmethod
    def this_machine(cls, processes: int = 2, *, progress=print, calibrate: bool = True) -> Cluster:
        """The machine a plan is made on when no cluster is described (``nbtrain plan``, ``%%autoparallel`` without
        ``--gpus``/``--gpu``): its GPUs, counted and named through NVML so that CUDA is not initialised here (a
        notebook forks its workers later), or else ``processes`` CPU worker processes with their compute, copy and
        update rates and their communication measured (once per machine, then cached). ``progress`` is told what
        is measured and about how long it takes, before it is; ``calibrate=False`` measures nothing (the catalog's
        generic CPU rates, and links only where a measurement is cached: predictions are then rough).

            >>> here = Cluster.this_machine(2)                    # on a machine without a GPU
            >>> here.device, here.num_devices, here.source
            ('cpu', 2, 'calibrated')
        """
        gpus = local_gpus()
        if gpus:
            found = local_gpu_name()
            if found is None:  # NVML not readable from Python: ask the runtime (this initialises CUDA here)
                return cls.detect(calibrate=False)
            name, memory = found
            entry, by_name = match_gpu(name, memory, (9, 0))
            cluster = cls.from_catalog(entry, num_devices=gpus, devices_per_node=gpus, device_memory=memory,
                                       host_memory=local_memory(), source="detected")
            return cluster if by_name else cluster.replace(device=name)
        if not calibrate:
            cluster = cls.detect(calibrate=False).replace(num_devices=processes, devices_per_node=processes)
            return cluster.with_links(processes, measure=False) if processes > 1 else cluster
        if "cpu" not in _CALIBRATED:  # once per process: the plan table and the launch price with the same rates
            if progress:
                progress("Measuring this machine's compute, copy and CPU AdamW rates, once per kernel (~5 s)")
            _CALIBRATED["cpu"] = cls.detect(calibrate=True)
        cluster = _CALIBRATED["cpu"].replace(num_devices=processes, devices_per_node=processes)
        return cluster.with_links(processes, progress=progress) if processes > 1 else cluster

    def with_measurements(self, measurements) -> Cluster:
        """A copy with measured rates put in (``source="calibrated"``): ``c.with_measurements(calibrate("cpu"))``.

        A GPU keeps its datasheet peak and gets ``flops_efficiency = measured / peak``; a CPU has no datasheet,
        so the measured rate becomes the peak, sustained at 1.0. ``memory`` (device memory, a GPU's
        :func:`~nbtrain.profiler.calibrate.memory_bandwidth`) sets ``memory_efficiency`` against the datasheet's
        bandwidth. ``copy`` sets host→device bandwidth,
        ``cpu_adamw`` the optimizer rate, ``allreduce`` (bus bandwidth) the intra-node bandwidth.
        """
        changes: dict = {"source": "calibrated"}
        for m in measurements:
            if m.name not in _MEASURED:
                raise InvalidArgumentError(f"unknown measurement {m.name!r}; expected one of {', '.join(_MEASURED)}")
            if m.name == "memory":  # the datasheet's bandwidth stays; what a kernel reaches of it is measured
                if self.memory_bandwidth and m.value < self.memory_bandwidth:
                    changes["memory_efficiency"] = m.value / self.memory_bandwidth
                else:
                    changes.update(memory_bandwidth=m.value, memory_efficiency=1.0)
            elif m.name != "matmul":
                changes[_MEASURED[m.name]] = m.value
            elif self.device == "cpu" or m.value >= self.peak_flops:  # no datasheet, or one we beat: trust it
                changes.update(peak_flops=m.value, flops_efficiency=1.0)
            else:
                changes["flops_efficiency"] = m.value / self.peak_flops
        return self.replace(**changes)

    def with_links(self, world_size: int, *, measure: bool = True, progress=print) -> Cluster:
        """A copy that knows this machine's communication among ``world_size`` processes: measured once (~10 s,
        spawned gloo workers) and cached (:func:`nbtrain.profiler.collectives.cached_links`). Only for a cluster
        that is this machine (detected or calibrated); ``measure=False`` takes only what is cached."""
        if self.source == "catalog":
            raise InvalidArgumentError("links are measured on this machine; a catalog cluster describes another "
                                       "one: use Cluster.detect(), or Cluster.load() a cluster measured there")
        fresh = remeasured(world_size)  # measured again after a run far from its prediction (run/prediction_check)
        if fresh is not None:
            return self.replace(links=self.links.merged(fresh))
        if self.links.find("all_reduce", world_size, world_size) is not None or world_size < 2:
            return self
        found = cached_links(world_size, measure=measure, progress=progress)
        return self if found is None else self.replace(links=self.links.merged(found))

    def replace(self, **changes) -> Cluster:
        """A copy with some fields changed and validated again: ``cluster.replace(num_devices=16)``."""
        _check_fields(changes, "replace")
        return dataclasses.replace(self, **changes)

    @property
    def core_share(self) -> float:
        """How many worker processes share one core on a CPU cluster (≥ 1): 4 processes on 2 cores, 2.0."""
        if self.device != "cpu" or not self.host_cores:
            return 1.0
        return max(1.0, self.devices_per_node / self.host_cores)

    def to_dict(self) -> dict:
        """Plain JSON-ready values; ``Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c``."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["links"] = self.links.to_list()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        """The inverse of :meth:`to_dict`; unknown keys are an error, not silently dropped."""
        _check_fields(data, "from_dict")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise InvalidArgumentError(f"a cluster description lacks {', '.join(missing)}")
        if isinstance(data.get("links"), dict):
            data = {**data, "links": Links.from_list(data["links"])}
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
        if self.memory_bandwidth:  # what compute_time prices a GPU's kernels by
            attention = self.attention_efficiency or self.flops_efficiency
            for key, value in (
                ("device memory", f"{format_rate(self.memory_bandwidth, 'B/s')} "
                                  f"({self.memory_efficiency:.0%} streaming)"),
                ("attention kernels", f"{format_rate(self.peak_flops * attention, 'FLOP/s')} "
                                      f"({attention:.0%} of peak)"),
                ("latency floors", f"{self.kernel_latency_s * 1e6:.0f} µs a kernel, "
                                   f"{self.collective_latency_s * 1e6:.0f} µs a collective in a node, "
                                   f"{self.inter_node_latency_s * 1e6:.0f} µs across"),
            ):
                table.add(key, value)
        return table

    def __str__(self) -> str:
        return str(self._table()) + (f"\n\n{self.links.table()}" if self.links.links else "")

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def _check_fields(keys, where: str, exclude: tuple[str, ...] = ()) -> None:
    valid = [f.name for f in dataclasses.fields(Cluster) if f.name not in exclude]
    unknown = [k for k in keys if k not in valid]
    if unknown:
        raise InvalidArgumentError(f"{where}() got unknown field{'s' if len(unknown) > 1 else ''} "
                                   f"{', '.join(map(repr, unknown))}; valid fields: {', '.join(valid)}")


def forget_rates(device: str = "cpu") -> None:
    """Drop this process's calibrated rates of ``device``, so that the next :meth:`Cluster.this_machine` measures
    them again (a run far from its prediction: :mod:`nbtrain.run.prediction_check`)."""
    _CALIBRATED.pop(device, None)
