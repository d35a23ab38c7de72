"""Micro-benchmarks that measure this machine: matmul rate, copy bandwidth, CPU AdamW rate, all-reduce bandwidth.

    >>> from nbtrain.profiler.calibrate import calibrate
    >>> for m in calibrate("cpu"):
    ...     print(m)
    matmul        144.0 GFLOP/s  n=1024 float32, 1 thread, median of 5 (103.1 ms)
    copy               5.7 GB/s  64.00 MiB memory → memory, 1 thread, median of 5 (129.1 ms)
    cpu_adamw  680.4 M params/s  AdamW(fused=True), 4.00 M params, 1 thread, median of 5 (1.45 s)

Each benchmark but the all-reduce takes well under a second on a 2-core CPU (the first AdamW in a process also
imports ``torch._dynamo``, ~1.3 s, counted in ``seconds_spent``); ``Cluster.detect()`` turns the
measurements into a calibrated ``Cluster``. Every timing is the median of a few repeats after a warm-up: the first
call pays for allocation, the thread pool and (on CUDA) kernel selection, and a busy CI machine throws outliers.

Process groups on this machine are reachable from this machine only (:func:`loopback_store`,
:func:`loopback_only_env`): the measurements' spawned workers here and the executor's forked workers
(:mod:`nbtrain.run.launch.workers`) both rendezvous through them.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import socket
import statistics
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from nbtrain.errors import CalibrationError, InvalidArgumentError
from nbtrain.units import format_bytes, format_count, format_rate, format_seconds


@dataclass(frozen=True)
class Measurement:
    """One measured rate of this machine, with how it was measured."""

    name: str
    """What was measured: ``"matmul"``, ``"memory"`` (a GPU's own), ``"copy"``, ``"cpu_adamw"`` or
    ``"allreduce"``."""
    value: float
    """The measured rate, in ``unit``."""
    unit: str
    """``"FLOP/s"``, ``"B/s"`` (bytes per second) or ``"params/s"`` (parameters updated per second)."""
    seconds_spent: float
    """Wall-clock seconds the benchmark took, set-up included."""
    detail: str
    """Sizes, dtype, threads and repeats: what to judge the number by."""

    def __str__(self) -> str:
        rate = format_rate(self.value, " params/s" if self.unit == "params/s" else self.unit)
        return f"{self.name:<10} {rate:>16}  {self.detail} ({format_seconds(self.seconds_spent)})"


def _median_seconds(step: Callable[[], object], repeats: int, sync: Callable[[], object]) -> float:
    step()  # warm-up: allocation, thread pool start, cuBLAS heuristics, gloo connections
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()  # CUDA work is asynchronous: stop the clock only when the device is done
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> Callable[[], object]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """Run with ``threads`` intra-op threads, then restore the caller's count (``None``: leave it alone)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(before)


def _threads_label(threads: int | None) -> str:
    n = torch.get_num_threads() if threads is None else threads
    return f"{n} thread{'s' if n != 1 else ''}"


def _compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype training computes in: fp32 on CPU, bf16 on GPUs that have it, fp16 on V100 (no bf16 before sm80)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def matmul_rate(device: str = "cpu", dtype: torch.dtype | None = None, n: int | None = None, *,
                threads: int | None = None, repeats: int = 5) -> Measurement:
    """FLOP/s of square ``n × n`` matmuls: ``matmul_rate("cuda")`` (bf16, n=8192) or ``matmul_rate("cpu", threads=1)``.

    ``dtype=None`` picks the training compute dtype of the device (fp32 on CPU, bf16 on GPUs, fp16 on V100).
    """
    start = time.perf_counter()
    dev = torch.device(device)
    dtype = dtype or _compute_dtype(dev)
    # Large enough to run at the sustained rate, small enough to take milliseconds: 2·8192³ = 1.1 TFLOP on a GPU,
    # 2·1024³ = 2.1 GFLOP on a CPU core (~20 ms at 100 GFLOP/s).
    n = n or (8192 if dev.type == "cuda" else 1024)
    inner = 10 if dev.type == "cuda" else 1  # several kernels per timing so launch latency does not count
    with intra_op_threads(threads):
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        out = torch.empty_like(a)

        def step():
            for _ in range(inner):
                torch.mm(a, b, out=out)

        seconds = _median_seconds(step, repeats, _sync(dev))
        label = _threads_label(threads) if dev.type == "cpu" else str(dev)
    flops = 2 * n**3 * inner  # n³ multiply-adds, two FLOPs each
    return Measurement("matmul", flops / seconds, "FLOP/s", time.perf_counter() - start,
                       f"n={n} {str(dtype).removeprefix('torch.')}, {label}, median of {repeats}")


def copy_bandwidth(device: str = "cpu", nbytes: int | None = None, *, threads: int | None = None,
                   repeats: int = 5) -> Measurement:
    """Bytes/s of one large copy: between pinned host memory and the GPU on CUDA, each way, the slower of the two
    (``copy_bandwidth("cuda")``: the offload sends gradients down and weights up, so the slower way bounds it);
    memory → memory on CPU.

    On a CPU "device" the offloaded optimizer's traffic is exactly such a memcpy between two host buffers.
    """
    start = time.perf_counter()
    dev = torch.device(device)
    nbytes = nbytes or (256 if dev.type == "cuda" else 64) * 2**20
    with intra_op_threads(threads):
        if dev.type == "cuda":
            # Pinned (page-locked) memory lets the copy engine DMA directly; pageable memory goes through a
            # staging buffer at roughly half the rate, and offload always pins.
            host = torch.ones(nbytes, dtype=torch.uint8, device="cpu").pin_memory()
            gpu = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
            up = _median_seconds(lambda: gpu.copy_(host, non_blocking=True), repeats, _sync(dev))
            down = _median_seconds(lambda: host.copy_(gpu, non_blocking=True), repeats, _sync(dev))
            return Measurement("copy", nbytes / max(up, down), "B/s", time.perf_counter() - start,
                               f"{format_bytes(nbytes)} pinned host → device {format_rate(nbytes / up, 'B/s')}, "
                               f"device → host {format_rate(nbytes / down, 'B/s')}: the slower, median of {repeats}")
        src = torch.ones(nbytes, dtype=torch.uint8)  # ones, not empty: untouched pages read as the zero page
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        seconds = _median_seconds(lambda: dst.copy_(src, non_blocking=True), repeats, _sync(dev))
    return Measurement("copy", nbytes / seconds, "B/s", time.perf_counter() - start,
                       f"{format_bytes(nbytes)} memory → memory, {_threads_label(threads)}, median of {repeats}")


def cpu_adamw_rate(num_params: int = 4_000_000, threads: int | None = 1, *, repeats: int = 5) -> Measurement:
    """Parameters/s that ``torch.optim.AdamW(fused=True)`` updates on CPU tensors: ``cpu_adamw_rate(threads=1)``.

    STACK.md: the fused kernel is the fast path on CPU (5–7× ``foreach``), ~1.4 G params/s on one thread at
    100–200 M params; a few million parameters already show the rate within a factor of about two.
    """
    start = time.perf_counter()
    with intra_op_threads(threads):
        param = torch.nn.Parameter(torch.randn(num_params))
        param.grad = torch.randn(num_params)
        optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
        seconds = _median_seconds(optimizer.step, repeats, lambda: None)  # warm-up step allocates the moments
        label = _threads_label(threads)
    return Measurement("cpu_adamw", num_params / seconds, "params/s", time.perf_counter() - start,
                       f"AdamW(fused=True), {format_count(num_params)} params, {label}, median of {repeats}")


def loopback_store(port: int = 0, timeout: timedelta = timedelta(minutes=30)) -> "torch.distributed.TCPStore":
    """A rendezvous store for processes of this machine: a TCPStore server listening on ``127.0.0.1:port`` alone
    (``port=0``: a free one, ``store.port``). Clients reach it as ``TCPStore("127.0.0.1", store.port)``, or by handing
    it over: a ``multi_tenant=True`` TCPStore made in this process on the same port (as torch elastic's static
    rendezvous makes its own) uses this server rather than binding another. The server closes when every store
    object on it is gone. Raises ``OSError`` (``EADDRINUSE``) when ``port`` is taken.

    Why nbtrain binds the socket: torch's TCPStore server listens on every interface whatever host it is given (it
    binds ``::``, measured with torch 2.13, libuv and classic servers alike) and serves any client without
    authentication, so another host could read and write the run's keys and break or take over its rendezvous.
    Given a socket already bound (``master_listen_fd``), the server listens on that socket as it is: on loopback,
    nothing outside this machine can connect. (A ``FileStore`` would need no socket, but torch elastic's agent, which
    forks the executor's workers, rendezvous through a TCPStore only.)"""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is no conflict
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    fd = sock.detach()  # the server owns the descriptor from here and closes it with itself
    try:
        return dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False, multi_tenant=True,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def loopback_only_env() -> dict[str, str]:
    """The environment under which gloo and NCCL open their own sockets (gloo's pairs, NCCL's bootstrap) on the
    loopback interface only, for process groups that never leave this machine.

    Left alone, gloo listens on the address this machine's hostname resolves to (its network address on most
    laptops and login nodes: on this machine, with the hostname made to name its eth0 address, the workers' gloo
    pairs listened on it), NCCL on the first network interface it finds."""
    names = [name for _, name in socket.if_nameindex()]
    loopback = "lo0" if "lo0" in names else "lo"  # macOS, Linux
    for name in names:  # Linux marks it IFF_LOOPBACK (0x8) whatever it is called
        try:
            if int(open(f"/sys/class/net/{name}/flags").read(), 16) & 0x8:
                loopback = name
                break
        except (OSError, ValueError):
            continue
    return {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": f"={loopback}"}  # NCCL: '=' names it exactly


def _spawned_worker(rank: int, world_size: int, port: int, backend: str, target, args, results) -> None:
    # First line, before any op: STACK.md — workers with several OpenMP threads each oversubscribe the cores and
    # can stall; one intra-op thread per process is what the executor's workers use too.
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=60)
        # A client of the parent's loopback store: with init_method="tcp://...", rank 0 would serve the store on
        # every interface (loopback_store says why).
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        value = target(*args)
        if backend == "gloo":
            dist.barrier()  # STACK.md: ranks that leave while a peer still talks abort at shutdown
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, KeyboardInterrupt included, so the parent never waits blind
        results.put((rank, False, traceback.format_exc()))


def run_spawned(target: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0,
                what: str = "benchmark") -> list:
    """``target(*args)`` in each of ``world_size`` fresh processes joined in a process group; every rank's result,
    by rank. ``target`` must be importable (a module-level function): the processes are spawned, not forked, so a
    notebook's threads and CUDA context do not leak into them; each pays for ``import torch`` (~4 s here). On
    ``timeout`` the workers are killed and ``CalibrationError`` says so."""
    started = time.perf_counter()
    store = loopback_store(timeout=timedelta(seconds=timeout))  # held here until the workers are done
    port = store.port
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    workers = [ctx.Process(target=_spawned_worker, daemon=True,
                           args=(rank, world_size, port, backend, target, args, results))
               for rank in range(world_size)]
    # c10d's shutdown notes about awaited async work are noise here; gloo's and NCCL's sockets stay on loopback
    child_env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **loopback_only_env()}
    saved = {key: os.environ.get(key) for key in child_env}
    os.environ.update(child_env)
    try:
        for worker in workers:
            worker.start()  # a spawned child takes the environment as it is now
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    found: dict[int, object] = {}
    try:
        while len(found) < world_size:
            if time.perf_counter() - started > timeout:
                raise CalibrationError(
                    f"the {what} did not finish in {timeout:.0f} s ({len(found)} of {world_size} workers "
                    f"reported, port {port}); its workers were stopped. On a busy machine pass a larger timeout")
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:  # killed before it could report (out of memory, a signal)
                    raise CalibrationError(f"a {what} worker died with exit code {dead[0].exitcode} before "
                                           "reporting; run it alone to see its output")
                continue
            if not ok:
                raise CalibrationError(f"{what} worker {rank} failed:\n{payload}")
            found[rank] = payload
    finally:
        for worker in workers:
            worker.join(timeout=10 if len(found) == world_size else 0.1)
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        del store  # the port closes now, not while a raised CalibrationError (its frames) is kept
    return [found[rank] for rank in range(world_size)]


def _allreduce_seconds(nbytes: int, repeats: int) -> float:
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return _median_seconds(lambda: dist.all_reduce(x), repeats, _sync(device))


def allreduce_bandwidth(world_size: int = 2, nbytes: int = 16 * 2**20, backend: str = "gloo", *,
                        repeats: int = 5, timeout: float = 120.0) -> Measurement:
    """Bus bandwidth (bytes/s) of ``all_reduce`` among ``world_size`` fresh processes on this machine.

        >>> allreduce_bandwidth(world_size=2).value > 0      # gloo on CPU; backend="nccl" uses cuda:0..n-1
        True

    Spawned (:func:`run_spawned`); on ``timeout`` the workers are killed and ``CalibrationError`` says so.
    """
    if world_size < 2:
        raise InvalidArgumentError(f"an all-reduce needs world_size ≥ 2 processes, got {world_size}")
    start = time.perf_counter()
    seconds = run_spawned(_allreduce_seconds, world_size, nbytes, repeats, backend=backend, timeout=timeout,
                          what="all-reduce benchmark")
    # NCCL-tests (doc/PERFORMANCE.md): a ring all-reduce moves 2(n−1)/n of the buffer through each rank's link,
    # so busbw = algbw · 2(n−1)/n is comparable with the link's own bandwidth, whatever n is.
    slowest = max(seconds)  # the collective ends when its slowest rank does
    busbw = 2 * (world_size - 1) / world_size * nbytes / slowest
    return Measurement("allreduce", busbw, "B/s", time.perf_counter() - start,
                       f"bus bandwidth, {world_size} processes, {backend}, {format_bytes(nbytes)}, "
                       f"median of {repeats}")


def memory_bandwidth(device: str = "cuda", nbytes: int = 2**30, *, repeats: int = 5) -> Measurement:
    """Bytes/s a GPU's own memory streams at: one device-to-device copy of ``nbytes``, read plus written
    (``memory_bandwidth("cuda")``: ~0.9 of the datasheet's HBM bandwidth on an H100). GPU only: what the planner
    prices memory-bound kernels by (:mod:`nbtrain.planner.compute_time`); a CPU "device" is timed by layer."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise InvalidArgumentError(f"memory_bandwidth measures a GPU's memory; got device {device!r}")
    start = time.perf_counter()
    # 1 GiB each way: far past the L2 cache (50 MiB on H100), a few hundred microseconds at HBM rates
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    inner = 4  # several copies per timing so launch latency does not count
    seconds = _median_seconds(lambda: [dst.copy_(src) for _ in range(inner)], repeats, _sync(dev)) / inner
    return Measurement("memory", 2 * nbytes / seconds, "B/s", time.perf_counter() - start,
                       f"{format_bytes(nbytes)} device → device copy, read + written, {dev}, median of {repeats}")


def calibrate(device: str = "cpu", allreduce: bool = False) -> list[Measurement]:
    """Run the benchmarks that describe ``device`` (``"cpu"`` or ``"cuda"``): ``calibrate("cpu")``.

    On CPU each core is one nbtrain "device" whose worker runs one thread, so compute, copy and AdamW are measured
    on one thread. On CUDA the matmul, the device memory's bandwidth and the copy run on GPU 0, AdamW on all the
    host threads torch uses (the node's update rate), and the all-reduce uses NCCL across the node's GPUs (skipped
    with fewer than two).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        found = [matmul_rate("cpu", threads=1), copy_bandwidth("cpu", threads=1), cpu_adamw_rate(threads=1)]
        if allreduce:
            found.append(allreduce_bandwidth(world_size=2, backend="gloo"))
        return found
    if dev.type != "cuda":
        raise InvalidArgumentError(f"cannot calibrate device {device!r}; use 'cpu' or 'cuda'")
    found = [matmul_rate(dev), memory_bandwidth(dev), copy_bandwidth(dev),
             cpu_adamw_rate(num_params=32_000_000, threads=torch.get_num_threads())]
    if allreduce and torch.cuda.device_count() >= 2:
        found.append(allreduce_bandwidth(world_size=torch.cuda.device_count(), backend="nccl"))
    return found
