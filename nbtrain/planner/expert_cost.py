"""What expert parallelism (``ep``) changes in a layer's cost: its experts' model states on ``1/ep`` of the ranks, the
all-to-alls that carry tokens to their experts and back, and the wait for the most loaded rank.

    >>> round(imbalance(ep=8, pairs=4096), 3)      # 8 ranks, 4096 token-expert pairs a rank
    1.021
    >>> round(expected_max_normal(2), 4)           # 1/sqrt(pi)
    0.5642

Pure Python: no torch here. The executor's side is :mod:`nbtrain.expert_dispatch`.

* **Model states**: the layer's own (attention, router, norms) under its strategy; its experts' ``1/ep`` under the
  experts' data parallelism (:attr:`~nbtrain.planner.strategy.Strategy.expert_degrees`), as the executor shards them.
* **Dispatch**: each token goes to ``k`` experts: ``k`` hidden states a token leave each rank for the experts' ranks
  and come back, an all-to-all each way in forward and again in backward (and in the recomputed forward under
  checkpointing), as measured where it was (``link_bench``'s ``all_to_all``), else as the all-gather that moves as
  many bytes (every rank sends and receives ``(ep − 1)/ep`` of them); plus an all-to-all of ``E`` counts before
  each forward's dispatch.
* **Load imbalance**: the expected routing is balanced, but a step's is not: a rank's load of the ``ep · n``
  token–expert pairs of its group is binomial (``n`` pairs expected, variance ``n (1 − 1/ep)``), and every rank
  waits, at the combining all-to-all, for the most loaded one. Its expected excess is ``σ`` times the expected
  maximum of ``ep`` standard normals (order statistics, computed here by quadrature). This is a router choosing at
  random, as an untrained or well-balanced one (auxiliary loss) does; a skewed router loads ranks worse, which
  nothing here can know from the profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from nbtrain.planner.strategy import Strategy


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals]: ``∫ x · n φ(x) Φ(x)^(n−1) dx`` (trapezoid on [−9, 9])."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 3600, -9.0, 9.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += (0.5 if i in (0, steps) else 1.0) * x * n * phi * cdf ** (n - 1)
    return total * h


def imbalance(ep: int, pairs: float) -> float:
    """The most loaded of ``ep`` ranks' load over the mean, expected, when each of ``ep · pairs`` token–expert pairs
    goes to a rank at random (1 for ``ep`` = 1)."""
    if ep <= 1 or pairs <= 0:
        return 1.0
    return 1.0 + expected_max_normal(ep) * math.sqrt((1 - 1 / ep) / pairs)


@dataclass(frozen=True)
class SpreadExperts:
    """The experts of one layer under a strategy with ``ep > 1``."""

    params: float
    """The layer's expert parameters, all ``E`` experts (on one TP rank: ep runs with tp = 1)."""
    strategy: Strategy
    """The experts' data parallelism over the ``dp / ep`` ranks that hold the same experts."""
    share: float
    """Fraction of the layer's forward FLOPs spent in its experts (``2 · k · params / E`` a token)."""
    factor: float
    """Expected load of the most loaded rank over the mean (:func:`imbalance`)."""
    experts: int
    """Experts in the layer (E)."""
    per_token: int
    """Experts each token goes to (k)."""


def spread_experts(arch: dict, index: int, s: Strategy, tokens: float, flops_fwd: float) -> SpreadExperts | None:
    """How layer ``index`` (``arch``: its profile's) spreads its experts under ``s`` on ``tokens`` tokens a rank
    and micro-batch, or None when it does not (``ep = 1``, or no experts in the layer)."""
    per_layer = arch.get("layer_expert_params") or ()
    params = per_layer[index] if s.ep > 1 and index < len(per_layer) else 0
    if not params:
        return None
    experts, k = arch["experts"], arch["experts_per_token"]
    replicate, shard = s.expert_degrees
    return SpreadExperts(params, Strategy(dp_replicate=replicate, dp_shard=shard, zero=s.zero),
                         experts_flops_share(arch, params, tokens, flops_fwd), imbalance(s.ep, tokens * k), experts, k)


def experts_flops_share(arch: dict, params: float, tokens: float, flops_fwd: float) -> float:
    """The share of a layer's forward FLOPs (``flops_fwd`` on ``tokens`` tokens) its experts (``params`` of them in
    all) compute: ``2 · k · params / E`` a token, each token through ``k`` of the ``E`` experts."""
    if not flops_fwd:
        return 0.0
    return min(1.0, 2 * arch["experts_per_token"] * params / arch["experts"] * tokens / flops_fwd)


def whole_under_tp(arch: dict, index: int, params: float, tokens: float, flops_fwd: float) -> tuple[float, float]:
    """``(parameters, share of the forward FLOPs)`` of layer ``index`` (``params`` in all, ``flops_fwd`` on
    ``tokens`` tokens) that its tensor-parallel plan leaves whole on every TP rank (``arch["tp_whole_params"]``): its
    norms and router, and, where the plan splits only the attention (transformers 5.25's Mixtral and Qwen3-MoE), its
    experts, with all of their FLOPs (``2 · k · params / E`` a token); norms and routers compute next to nothing."""
    per_layer = arch.get("tp_whole_params") or ()
    whole = min(float(per_layer[index]), params) if index < len(per_layer) else 0.0
    experts = (arch.get("layer_expert_params") or ())
    expert_params = experts[index] if index < len(experts) else 0
    if not expert_params or whole < expert_params:
        return whole, 0.0
    return whole, experts_flops_share(arch, expert_params, tokens, flops_fwd)


def dispatch_seconds(links, world: int, gather, ep: int, hidden_bytes: float, k: int, experts: int, factor: float,
                     passes: int) -> float:
    """Seconds a layer's dispatch costs a micro-batch on ``world`` devices, ``k`` hidden states a token sent
    (``hidden_bytes``: the layer's input on this rank), in ``passes`` (2; 3 with checkpointing: the forward again).

    Where the whole dispatch was measured on this machine (``links``: ``link_bench``'s ``ep_forward`` and
    ``ep_backward``, which carry the sort, the exchanges and the waits as the executor runs them), as measured.
    Else the two all-to-alls each way of the most loaded rank's share (``factor``), and one exchange of the ``E``
    counts per forward: as the ``all_to_all`` measured here, else as the all-gather that moves as many bytes in and
    out of each device (``gather(group, nbytes)``, the cost model's)."""
    sent = k * hidden_bytes
    forward, backward = (links.find(op, ep, world) for op in ("ep_forward", "ep_backward"))
    if forward is not None and backward is not None:
        return (passes - 1) * forward.seconds(sent) + backward.seconds(sent)
    measured = links.find("all_to_all", ep, world)

    def all_to_all(nbytes: float) -> float:
        return measured.seconds(nbytes) if measured is not None else gather(ep, nbytes)
    return passes * 2 * all_to_all(sent * factor) + (passes - 1) * all_to_all(8 * experts)
