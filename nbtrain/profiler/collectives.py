"""Communication measured on this machine as the executor issues it: latency and bandwidth per operation and group.

    >>> links = cached_links(2)        # measured once per machine (~15 s on 2 cores: 2 gloo processes), then read
    >>> links.seconds("all_reduce", 2, 4 * 2**20) > links.seconds("all_reduce", 2, 64 * 2**10)
    True

Each operation is timed at a few sizes in fresh processes with one intra-op thread each (as the executor's workers
run), every group of the size at once (4 processes measure their two pairs together, as a 2-D plan's groups run),
and fitted to ``time = latency + bytes / bandwidth`` (Hockney's model; Thakur et al. 2005 use it for MPI's
collectives). The operations:

==================  ===========================================================================================
``all_reduce``      ``dist.all_reduce`` of ``bytes`` (DDP's bucketed gradient sync)
``all_gather``      ``all_gather_into_tensor`` producing ``bytes`` (a relayout between layers)
``reduce_scatter``  ``reduce_scatter_tensor`` of ``bytes``
``p2p``             ``send`` / ``recv`` of ``bytes`` between neighbours (a pipeline's activations)
``fsdp_forward``    what FSDP2 adds to a layer's forward when it holds ``bytes`` of parameters: the all-gather,
                    its copies and hooks (measured on Linear layers, sharded minus plain)
``fsdp_backward``   the same in backward under ZeRO-3 (gather again, reduce-scatter the gradients)
``fsdp_backward_2`` the same under ZeRO-2 (parameters kept from forward: reduce-scatter only)
``tp_forward``      what DTensor tensor parallelism adds to a colwise → rowwise pair (Megatron's MLP) whose
                    hidden state is ``bytes``, beyond its split compute (TP minus plain ÷ group)
``tp_backward``     the same in backward
``tp_block_forward``  what tensor parallelism adds to a whole transformer block's forward (nbtrain's GPT block:
                    five split linears, norms, attention on the local heads) whose hidden state is ``bytes``
``tp_block_backward`` the same in backward
``tp_loss``         what the cross-entropy on logits split over the vocabulary adds (forward and backward, under
                    torch's ``loss_parallel``; beyond a rank's share of the plain loss) by ``bytes`` = 4 × tokens:
                    three all-reduces of a number a token, and DTensor's work on each op of the loss
``fsdp_block_*``    the same three for a whole transformer block as one FSDP2 unit (nbtrain's GPT block)
``tp_clip``         seconds to clip a TP-split transformer block's gradients (``bytes`` of parameters) by their
                    global norm, as the trainer does (:func:`nbtrain.gradients.clip_grad_norm`)
``fsdp_clip``       the same for a block sharded by FSDP2
``ddp_backward``    what ``DistributedDataParallel`` adds to training steps (nbtrain's GPT of 2 blocks) whose
                    gradients are ``bytes``: its bucketed all-reduces, less what hid under the compute
``pp_microbatch``  what one more micro-batch costs a stage of a 2-stage ``torch.distributed.pipelining`` 1F1B
                    schedule beyond its compute, by the ``bytes`` of hidden state the stages exchange: the
                    schedule's own work per micro-batch and the send and receive each way
``all_to_all``      ``all_to_all_single`` of ``bytes`` a rank (expert parallelism's dispatch; gloo has it)
``ep_forward``      what spreading a mixture of experts over the group adds to its forward
                    (:mod:`nbtrain.expert_dispatch`: sort, counts, all-to-alls, the wait for the most loaded
                    rank) when ``bytes`` of hidden states are dispatched (2 of 8 experts a token)
``ep_backward``     the same in backward
==================  ===========================================================================================

``overlap`` is the fraction of an asynchronous all-reduce that hides under a matmul loop running beside it (gloo
on CPU: its thread competes with the compute for the same cores, so little). The planner reads all of it through
``Cluster.links`` (:mod:`nbtrain.planner.cost`); ``nbtrain cluster --detect`` prints it.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from nbtrain.errors import InvalidArgumentError
from nbtrain.files import write_whole

_TYPICAL = 2**20
"""Bytes at which two measurements of one operation are compared (a layer's gradients or hidden state on a CPU)."""

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "fsdp_forward", "fsdp_backward", "fsdp_backward_2",
       "tp_forward", "tp_backward")


@dataclass(frozen=True)
class Link:
    """One operation over groups of ``group`` processes out of ``world``: ``seconds = latency_s + bytes / bandwidth``."""

    op: str
    group: int
    world: int
    latency_s: float
    bandwidth: float
    """Bytes per second of the operation's size (not a bus bandwidth: a ring's (k − 1)/k is in it)."""
    points: tuple[tuple[int, float], ...] = ()
    """The measured (bytes, seconds) the line was fitted to."""

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def pooled(self, later: "Link") -> "Link":
        """This measurement and a ``later`` one of the same operation as one (:meth:`Links.pooled`): the last
        :data:`POOLED_READINGS` readings of each size, in the order taken, and the line through them; the slower
        of the two where they do not hold two sizes between them to fit a line."""
        readings: dict[int, list[float]] = {}
        for size, seconds in self.points + later.points:
            readings.setdefault(size, []).append(seconds)
        points = tuple((size, seconds) for size, kept in readings.items() for seconds in kept[-POOLED_READINGS:])
        if len(readings) < 2:
            return max(self, later, key=lambda link: link.seconds(_TYPICAL))
        latency, bandwidth = fit_line(points)
        return Link(self.op, self.group, self.world, latency, bandwidth, points)

    def as_measured(self, nbytes: float) -> float:
        """Seconds for ``nbytes`` read off the measured points themselves, where a line through them would bend
        small sizes toward the large ones: between two points, on the segment joining them; below the smallest,
        the smallest's seconds (what does not shrink with bytes: hooks, a collective's round trips); above the
        largest, that point's seconds plus the extra bytes at the fitted bandwidth. Without two points, the line.

            >>> Link("ddp_backward", 2, 2, 0.0, 1e9, points=((2**16, 0.002), (2**20, 0.003))).as_measured(2**18)
            0.0022
        """
        by_size: dict[int, list[float]] = {}
        for size, seconds in self.points:  # a size measured twice (two shapes of as many bytes): their median
            by_size.setdefault(size, []).append(seconds)
        points = sorted((size, statistics.median(times)) for size, times in by_size.items())
        if len(points) < 2:
            return self.seconds(nbytes)
        if nbytes <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if nbytes <= x1:
                return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
        last_bytes, last_seconds = points[-1]
        return last_seconds + (nbytes - last_bytes) / self.bandwidth


@dataclass(frozen=True)
class Links:
    """Every measured :class:`Link` of a machine, and the measured overlap of communication with compute."""

    links: tuple[Link, ...] = ()
    slowdowns: tuple[tuple[int, float], ...] = ()
    """(processes, factor): how much slower one process computes when that many compute at once than alone
    (shared cores, caches, memory bandwidth); 2.0 or more when processes outnumber cores."""

    def overlap(self, group: int, world: int, nbytes: float = 4 * 2**20) -> float | None:
        """The fraction of ``nbytes`` of all-reduce that DDP hid under backward compute, as measured (0: none)."""
        ddp, reduce = self.find("ddp_backward", group, world), self.find("all_reduce", group, world)
        if ddp is None or reduce is None:
            return None
        return min(1.0, max(0.0, 1 - ddp.seconds(nbytes) / reduce.seconds(nbytes)))

    def slowdown(self, world: int) -> float | None:
        """The measured compute slowdown with ``world`` processes, or None when not measured."""
        return next((factor for n, factor in self.slowdowns if n == world), None)

    def find(self, op: str, group: int, world: int) -> Link | None:
        """The link measured for ``op`` over groups of ``group`` among ``world`` processes, or among the nearest
        world measured at or above ``world`` (more processes contend more: the safe side)."""
        if group <= 1:
            return None
        candidates = [link for link in self.links if link.op == op and link.group == group]
        at_least = [link for link in candidates if link.world >= world]
        pool = at_least or candidates
        return min(pool, key=lambda link: abs(link.world - world)) if pool else None

    def seconds(self, op: str, group: int, nbytes: float, world: int | None = None) -> float:
        link = self.find(op, group, world or group)
        if link is None:
            raise InvalidArgumentError(f"no measurement of {op} over {group} processes; measure with "
                                       f"measure_links(world_size={group})")
        return link.seconds(nbytes)

    def table(self):
        """The measurements as a table: per operation and group, latency, bandwidth and two example sizes."""
        from nbtrain.table import Table
        from nbtrain.units import format_rate, format_seconds

        t = Table(["operation", "group / processes", "latency", "bandwidth", "256 KiB", "4 MiB"], align="lrrrrr")
        t.title = "communication measured on this machine (time = latency + bytes / bandwidth)"
        for link in self.links:
            t.add(link.op, f"{link.group} / {link.world}", format_seconds(link.latency_s),
                  format_rate(link.bandwidth, "B/s"), format_seconds(link.seconds(256 * 2**10)),
                  format_seconds(link.seconds(4 * 2**20)))
        for n, factor in self.slowdowns:
            hidden = self.overlap(2, n)
            t.footer.append(f"{n} processes: computing at once, each {factor:.2f}× slower than alone"
                            + (f"; DDP hides {hidden:.0%} of a 4 MiB all-reduce under backward" if hidden is not None
                               else ""))
        return t

    def merged(self, other: "Links") -> "Links":
        keys = {(link.op, link.group, link.world) for link in other.links}
        kept = tuple(link for link in self.links if (link.op, link.group, link.world) not in keys)
        worlds = {n for n, _ in other.slowdowns}
        slowdowns = tuple(x for x in self.slowdowns if x[0] not in worlds) + other.slowdowns
        return Links(kept + other.links, tuple(sorted(slowdowns)))

    def least_disturbed(self, other: "Links") -> "Links":
        """Of two measurements of the same machine, each operation's faster one, and the smaller compute slowdown:
        a busy minute (another program on the cores) only ever slows a measurement down, so the faster of two is the
        less disturbed. Operations only one of them measured are kept as they are."""
        mine = {(link.op, link.group, link.world): link for link in self.links}
        for link in other.links:
            key = (link.op, link.group, link.world)
            if key not in mine or link.seconds(_TYPICAL) < mine[key].seconds(_TYPICAL):
                mine[key] = link
        slowdowns = dict(self.slowdowns)
        for n, factor in other.slowdowns:
            slowdowns[n] = min(factor, slowdowns.get(n, factor))
        return Links(tuple(mine.values()), tuple(sorted(slowdowns.items())))

    def pooled(self, other: "Links") -> "Links":
        """Two measurements of the same machine as one: each operation's readings of both (a size read in both is
        the median of its readings, :meth:`Link.as_measured`; the last :data:`POOLED_READINGS` of each size are
        kept) with its line fitted through them, and the mean compute slowdown. What a run slower than its
        prediction keeps, where :meth:`least_disturbed` could never correct a measurement taken in a quiet minute on
        a machine that then runs slower (a fresh measurement here read 20% under the one before it, and the
        launches after it ran 15% slower); both, not the slower of the two, because every operation was measured
        again and the run used only some of them."""
        mine = {(link.op, link.group, link.world): link for link in self.links}
        for link in other.links:
            key = (link.op, link.group, link.world)
            mine[key] = link if key not in mine else mine[key].pooled(link)
        slowdowns = dict(self.slowdowns)
        for n, factor in other.slowdowns:
            slowdowns[n] = (factor + slowdowns.get(n, factor)) / 2
        return Links(tuple(mine.values()), tuple(sorted(slowdowns.items())))

    def to_list(self) -> dict:
        return {"slowdowns": [list(x) for x in self.slowdowns],
                "links": [[link.op, link.group, link.world, link.latency_s, link.bandwidth, list(map(list, link.points))]
                          for link in self.links]}

    @classmethod
    def from_list(cls, data: dict) -> "Links":
        try:
            links = tuple(Link(str(op), int(group), int(world), float(latency), float(bandwidth),
                               tuple((int(n), float(s)) for n, s in points))
                          for op, group, world, latency, bandwidth, points in data.get("links", ()))
            slowdowns = tuple((int(n), float(f)) for n, f in data.get("slowdowns", ()))
            return cls(links, slowdowns)
        except (TypeError, ValueError, AttributeError) as error:
            raise InvalidArgumentError(f"a cluster's measured links are malformed ({error}); measure them again "
                                       "with 'nbtrain cluster --detect --save FILE'") from None


def fit_line(points) -> tuple[float, float]:
    """Least-squares ``seconds = latency + bytes / bandwidth`` through ``(bytes, seconds)`` points; the latency is
    kept ≥ 0 and the slope > 0 (a noisy point cannot make a larger message free).

        >>> fit_line([(1000, 0.002), (3000, 0.004)])
        (0.001, 1000000.0)
    """
    xs, ys = [float(n) for n, _ in points], [float(s) for _, s in points]
    if len(xs) < 2:
        raise InvalidArgumentError("a line needs at least two measured sizes")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:  # flat or inverted by noise: all latency, plus the slowest point's rate for the bytes
        slope = max(y / x for x, y in zip(xs, ys) if x) * 1e-3
    latency = my - slope * mx
    if latency < 0:  # through the origin instead
        latency, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return round(latency, 9), round(1 / slope, 3)


def links_from(points, world: int, slowdown: float = 1.0) -> Links:
    """Fit a :class:`Link` per (op, group) through the measured (op, group, bytes, seconds) points."""
    by_key: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for op, group, nbytes, seconds in points:
        by_key.setdefault((op, group), []).append((nbytes, seconds))
    links = []
    for (op, group), pts in sorted(by_key.items()):
        latency, bandwidth = fit_line(pts)
        links.append(Link(op, group, world, latency, bandwidth, tuple(sorted(pts))))
    return Links(tuple(links), ((world, slowdown),))


CACHE_VERSION = 14

POOLED_READINGS = 3
"""Readings of one size :meth:`Link.pooled` keeps: the cache stays the same size however many runs pool into it."""


def cache_file(world_size: int):
    """Where this machine's measured links for ``world_size`` processes are kept: ``$NBTRAIN_CACHE_DIR`` (else
    ``~/.cache/nbtrain``), one file per host, core count, torch version and process count."""

    root = Path(os.environ.get("NBTRAIN_CACHE_DIR") or Path.home() / ".cache" / "nbtrain")
    key = f"{platform.node() or 'host'}-{os.cpu_count()}cpu-torch{version('torch')}-v{CACHE_VERSION}"
    return root / f"links-{key}-{world_size}proc.json"


def measure_in_subprocess(world_size: int, *, timeout: float = 300.0) -> Links:
    """:func:`nbtrain.profiler.link_bench.measure_links` in a fresh ``python -m`` process (its output kept out of
    the caller's, its errors raised as ``CalibrationError`` with their last lines)."""
    import subprocess
    import sys
    import tempfile

    from nbtrain.errors import CalibrationError

    with tempfile.TemporaryDirectory(prefix="nbtrain-links-") as folder:
        out = Path(folder) / "links.json"
        # its own session, so that on a timeout (or Ctrl-C) the benchmark and the workers it spawned go together
        child = subprocess.Popen([sys.executable, "-m", "nbtrain.profiler.link_bench", str(world_size), str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = child.communicate(timeout=timeout)
        except BaseException as error:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise CalibrationError(f"measuring communication among {world_size} processes took over "
                                       f"{timeout:.0f} s and was stopped; on a busy machine try again later") from None
            raise
        done = subprocess.CompletedProcess(child.args, child.returncode, "", stderr)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            raise CalibrationError(f"measuring communication among {world_size} processes failed (exit code "
                                   f"{done.returncode}):\n{tail}")
        return Links.from_list(json.loads(out.read_text()))


def cached_links(world_size: int, *, measure: bool = True, progress=print) -> Links | None:
    """This machine's links for ``world_size`` processes: read from :func:`cache_file`, else measured once (saying
    so through ``progress``) and kept there; ``None`` when not cached and ``measure=False``."""
    path = cache_file(world_size)
    cached = _read(path)
    if cached is not None or not measure:
        return cached
    if progress:
        progress(f"Measuring this machine's communication among {world_size} processes, once per machine "
                 f"(~{10 * world_size} s; kept in {path}; --no-calibrate or a described cluster skips it)")
    return _keep(path, measure_in_subprocess(world_size))


def _read(path: Path) -> Links | None:
    """The links kept in ``path``; None when there are none or they cannot be read."""
    try:
        return Links.from_list(json.loads(path.read_text()))
    except (OSError, ValueError, InvalidArgumentError):
        return None


def _keep(path: Path, links: Links) -> Links:
    """``links`` written to ``path`` (a read-only home: measured again next time, nothing lost), and returned. Whole
    or not at all: another process (a second notebook, a test worker) reading it meanwhile never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(links.to_list()) + "\n")
    except OSError:
        pass
    return links


_REMEASURED: dict[int, Links] = {}
"""What :func:`remeasure_links` measured in this process, by process count: a cluster taken before (the notebook's
``Cluster.this_machine(2)`` in a variable) takes it in :meth:`~nbtrain.profiler.hardware.Cluster.with_links`."""


def remeasured(world_size: int) -> Links | None:
    """The links :func:`remeasure_links` kept for ``world_size`` processes in this process, if it ran."""
    return _REMEASURED.get(world_size)


def remeasure_links(world_size: int, *, slower: bool = False, progress=print) -> Links:
    """Measure this machine's links among ``world_size`` processes again and keep, per operation, the less disturbed
    of the new and the cached measurement (:meth:`Links.least_disturbed`), or both pooled after a run slower than
    predicted (``slower``, :meth:`Links.pooled`): what a run whose step was far from its prediction does, so that a
    measurement taken in a busy minute (or a quiet one, on a machine that then ran slower) does not stay for good."""
    path = cache_file(world_size)
    cached = _read(path)
    cached = Links() if cached is None else cached
    if progress:
        progress(f"Measuring this machine's communication among {world_size} processes again (~{10 * world_size} s; "
                 f"{'both' if slower else 'the faster'} of this and the cached measurement kept in {path})")
    fresh = measure_in_subprocess(world_size)
    links = cached.pooled(fresh) if slower else cached.least_disturbed(fresh)
    _REMEASURED[world_size] = links
    return _keep(path, links)
