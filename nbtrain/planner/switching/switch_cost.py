"""What a hot switch costs (HotSPa): the bytes the slowest rank receives to go from one layout to another, and the
seconds they take.

    >>> from nbtrain.profiler.hardware import Cluster
    >>> a100 = Cluster.from_catalog("A100", num_devices=8)
    >>> switch_cost("weights", Strategy(dp_shard=2, tp=4), Strategy(dp_replicate=8), params=6.74e9,
    ...             bytes_per_param=2, cluster=a100).bytes
    11795000000.0
    >>> pipelined = BucketStrategy(Strategy(tp=4), pp=2)          # HotSPa's (1, 4, 2)
    >>> switch_cost("weights", Strategy(dp_replicate=8), pipelined, params=4.0, bytes_per_param=2, cluster=a100,
    ...             layer_params=[1.0, 1.0, 1.0, 1.0]).bytes      # each rank already holds all of its stage's layers
    0.0

The model, stated so that the executor's measurement (:class:`nbtrain.run.switching.reshard.Resharding` counts the
bytes each rank receives) can stand beside it:

* Under a strategy ``S`` a rank holds ``1 / (S.dp_shard × S.tp)`` of every parameter (replicated over
  ``dp_replicate``): FSDP2 and TP each cut a tensor into equal contiguous chunks. Under a pipeline (``pp``
  stages, cut evenly by layer count, stage ``i`` on ranks ``[i·N/pp, (i+1)·N/pp)``) it holds that much of its
  stage's layers and nothing of the others'; a tied embedding's copy sits in the first and the last stage.
* A rank keeps what it already holds when its chunk under one layout lies inside its chunk under the other (and
  both layouts put that layer on it): then it reuses ``min(held_A, held_B)``. Otherwise nothing is counted as
  reused (a conservative bound).
* On the mesh ``dp_replicate × dp_shard × tp`` (tp innermost, as :mod:`nbtrain.run.parallel.mesh` lays it out) a
  rank's chunk index along its split is ``rank mod (dp_shard × tp)``, so chunks nest *for every rank* only when both
  layouts split the same way, or when one of them holds the whole tensor. Chunks of different sizes never do: rank 1
  holds ``[1/2, 1)`` of a tensor under ``dp_shard=2`` and ``[1/4, 1/2)`` under ``dp_shard=4``. A switch is as slow
  as its slowest rank, so the bytes counted are that rank's (with pipelines: over every group of ranks that share a
  stage in both layouts).
* Bytes received per rank = Σ over the layers it holds afterwards, params × bytes per element × (held_B − reused);
  seconds = bytes / the link bandwidth of the ``D`` devices (intra-node when they share a node, else inter-node),
  point to point, not overlapped. Gradients go home into the first stage's copy of a tied weight only (the two
  copies' gradients are summed after the step), so the last stage receives none of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.planner.strategy import Strategy, even_split
from nbtrain.planner.switching.bucket_strategy import BucketStrategy, layers_of, pp_of
from nbtrain.profiler.hardware import Cluster
from nbtrain.units import format_bytes, format_seconds


def held_fraction(s) -> float:
    """The fraction of every parameter of its stage one rank holds under ``s``: ``1 / (dp_shard × tp)``."""
    s = layers_of(s)
    return 1.0 / (s.dp_shard * s.tp)


def reused_fraction(a, b) -> float:
    """The fraction of every parameter that every rank holds under both ``a`` and ``b``, of the layers both put on
    it (module docstring)."""
    a, b = layers_of(a), layers_of(b)
    if (a.dp_shard, a.tp) == (b.dp_shard, b.tp):  # the same chunks on the same ranks (ac or ZeRO level aside)
        return held_fraction(a)
    if held_fraction(a) == 1.0 or held_fraction(b) == 1.0:  # a whole tensor contains any chunk of it
        return min(held_fraction(a), held_fraction(b))
    return 0.0


def received_fraction(a, b) -> float:
    """The fraction of every parameter (of a layer both layouts put on the rank) a rank must receive to go from
    layout ``a`` to layout ``b``."""
    return held_fraction(b) - reused_fraction(a, b)


def link_bandwidth(cluster: Cluster) -> float:
    """Bytes/s per device of the links a switch over all the cluster's devices uses."""
    if cluster.num_devices <= cluster.devices_per_node:
        return cluster.intra_node_bandwidth
    return cluster.inter_node_bandwidth


def stage_layers(s, num_layers: int) -> list[range]:
    """The layers of each stage of ``s`` (one stage without a pipeline), cut as the executor cuts them."""
    edges = [0]
    for count in even_split(num_layers, pp_of(s)):
        edges.append(edges[-1] + count)
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def received_parameters(source, target, layer_params: list[float], tied: float = 0.0,
                        tied_copy: bool = True) -> float:
    """Parameters the slowest rank receives going from layout ``source`` to ``target`` (module docstring), layer
    ``i`` holding ``layer_params[i]``; ``tied``: the parameters of a weight the first layer shares with the last,
    whose second copy a pipelined layout's last stage holds (``tied_copy``: it receives one, as weights do)."""
    groups = max(pp_of(source), pp_of(target))
    a_stages = stage_layers(source, len(layer_params))
    b_stages = stage_layers(target, len(layer_params))
    held, reused = held_fraction(target), reused_fraction(source, target)
    worst = 0.0
    for g in range(groups):  # ranks [g·N/groups, (g+1)·N/groups) share a stage in both layouts
        sa, sb = g * pp_of(source) // groups, g * pp_of(target) // groups
        there, here = a_stages[sa], b_stages[sb]
        total = sum(layer_params[i] * (held - (reused if i in there else 0.0)) for i in here)
        if tied and tied_copy and pp_of(target) > 1 and sb == pp_of(target) - 1:  # the last stage's copy
            had = sa == 0 or (pp_of(source) > 1 and sa == pp_of(source) - 1)
            total += tied * (held - (reused if had else 0.0))
        worst = max(worst, total)
    return worst


@dataclass(frozen=True)
class PredictedSwitch:
    """One re-layout per step, as the planner predicts it."""

    what: str
    """``"weights"`` (the compute copy, home → strategy) or ``"gradients"`` (accumulated, strategy → home)."""
    source: Strategy | BucketStrategy
    target: Strategy | BucketStrategy
    bytes: float
    """Bytes the slowest rank receives."""
    seconds: float

    def __str__(self) -> str:
        return (f"{self.what} '{self.source}' → '{self.target}': {format_bytes(self.bytes)} per device, "
                f"{format_seconds(self.seconds)}")


def switch_cost(what: str, source, target, *, params: float, bytes_per_param: float, cluster: Cluster,
                layer_params: list[float] | None = None, tied: float = 0.0) -> PredictedSwitch:
    """The predicted switch of ``params`` parameters of ``bytes_per_param`` bytes from ``source`` to ``target``;
    ``layer_params``: the parameters per layer, where a layout is pipelined (its stages hold their layers only);
    ``tied``: a tied embedding's parameters (:func:`received_parameters`)."""
    if layer_params is None or (pp_of(source) == 1 and pp_of(target) == 1):
        moved = params * received_fraction(source, target)
    else:
        moved = received_parameters(source, target, layer_params, tied, tied_copy=what == "weights")
    nbytes = moved * bytes_per_param
    return PredictedSwitch(what, source, target, nbytes, nbytes / link_bandwidth(cluster))
