"""One bucket of a hot-switching step priced under every strategy of the space and every micro-batch size, with a
pipeline or without, by the cost model (:mod:`nbtrain.planner.cost`).

    >>> from nbtrain.planner.switching.bucket_search import SwitchingCostModel
    >>> from nbtrain.planner.switching.buckets import BucketOptions
    >>> costs = SwitchingCostModel(nbtrain.profile("llama-tiny", batch_size=1, seq_len=256),
    ...                            nbtrain.Cluster.from_catalog("A100", num_devices=4), None, BucketOptions())
    >>> b = costs.bucket(256, 6)                    # BucketCost: [micro-batch choice, strategy] arrays
    >>> b.passes.shape == (len(MICRO_ROWS), len(costs.space))
    True

**Without a pipeline** a bucket runs each rank's rows in ``m`` micro-batches of ``r`` rows: the cost model at
``global_batch = dp × m × r, seq_len = bound`` and ``m`` micro-batches, Σ over layers of ``compute + tp_comm +
zero3_comm`` (its ``passes``; FSDP2's gathers once per micro-batch) and of ``dp_comm`` (its ``sync``, paid once per
layout: :mod:`nbtrain.planner.switching.bucket_search`); memory: one micro-batch's activations and the largest
transient of its layers.

**With a pipeline** (``pp`` stages) the bucket is the cost model's whole plan,
``CostModel.estimate`` of the uniform plan in ``m`` micro-batches: each stage's layers, the bubble
(``Σᵢ Tᵢ + (m − 1) · maxᵢ Tᵢ``: stage imbalance included), the activations and gradients sent between stages and the
schedule's own work, its gradient sync (the executor's pipeline syncs at each schedule's end, so per bucket: no
separate ``sync``). Its optimizer update is the home's business, paid once a step: the prediction's ``update`` and
``offload`` are left out of the bucket's time. Memory per stage: the activations of the micro-batches in flight
(1F1B: ``pp − i`` on stage ``i``; GPipe all) and the largest transient, on the stage's ranks, at the step that
fills the bucket most (:func:`peak_rows`: the same micro-batch rows, more micro-batches) where the time is the
mean step's.

**The update** (``update``): the home's optimizer step when this bucket is the home's, with its CPU offload's excess
over that bucket's backward (CoTrain's overlap: the cost model's ``Time.offload`` at the bucket's micro-batches).

Memory is kept per *group of ranks*: ``G`` groups (the largest pipeline degree of the space), group ``g`` holding
ranks ``[g·N/G, (g+1)·N/G)``, which sit in stage ``g·pp/G`` of a strategy with ``pp`` stages; without a pipeline every
group holds the same. A bucket's memory is its worst group's, the home layout's states added group by group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.cost import CostModel
from nbtrain.planner.switching.bucket_strategy import bucket_plan, pp_of, with_layers

MICRO_ROWS = (None, 1, 2, 4, 8, 16, 32, 64)
"""Rows per micro-batch a bucket may run in on each rank: None, all at once; ``r``, micro-batches of ``r`` rows
(the gradients accumulated), the rank's rows padded with empty ones to a multiple of ``r`` (computed, as full
ones). The fastest that fits is taken (:func:`best_fit`)."""


def padded_rows(rows: int, dp: int) -> int:
    """Rows a bucket runs under ``dp`` data-parallel ranks: ``rows`` padded with empty ones to a multiple of ``dp``
    (as :mod:`nbtrain.run.switching.layouts` pads them), each computed like a full row: ``padded_rows(55, 8) == 56``."""
    return -(-rows // dp) * dp


def micro_rows_for(choice: int | None, rows: int) -> int:
    """Rows per micro-batch for a choice of :data:`MICRO_ROWS` on a rank holding ``rows``: all of them when the
    choice is None or holds them (``micro_rows_for(4, 33) == 4``, ``micro_rows_for(64, 33) == 33``)."""
    return rows if choice is None or choice >= rows else choice


def best_fit(fits: np.ndarray, seconds: np.ndarray, microbatches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the fastest choice that fits, whether any does) along the first axis, ``seconds`` and
    ``microbatches`` broadcast to ``fits``; of choices equally fast (to rounding), the fewest micro-batches."""
    seconds = np.where(fits, np.broadcast_to(seconds, fits.shape), np.inf)
    near = seconds <= seconds.min(axis=0) * (1 + 1e-9)
    return np.argmin(np.where(near, np.broadcast_to(microbatches, fits.shape), np.iinfo(int).max), axis=0), \
        fits.any(axis=0)


@dataclass(frozen=True)
class BucketCost:
    """One bucket under every strategy of the space (columns indexed like it) and every choice of
    :data:`MICRO_ROWS` (rows), each priced at its rows padded with empty ones to a multiple of the strategy's dp
    (:func:`padded_rows`) and then of the micro-batch's rows."""

    bound: int
    rows: int
    """The bucket's own rows (its tokens are ``bound × rows``); the padded ones are priced, not counted."""
    micro_rows: np.ndarray
    """[choice, strategy]: rows per micro-batch on each rank (:func:`micro_rows_for`)."""
    microbatches: np.ndarray
    """[choice, strategy]: micro-batches per rank."""
    passes: np.ndarray
    """[choice, strategy]: forward and backward seconds of all the micro-batches (module docstring)."""
    sync: np.ndarray
    """[choice, strategy]: gradient-sync seconds left over after overlapping the last micro-batch's backward, paid
    once per layout (0 for a pipeline, which syncs within its ``passes``)."""
    update: np.ndarray
    """[choice, strategy]: the home's update when this bucket is the home's (module docstring)."""
    activations: np.ndarray
    """[choice, strategy, group]: the activations a rank of each group holds (micro-batches in flight)."""
    transient: np.ndarray
    """[choice, strategy, group]: the largest transient of the layers on that rank."""


class KindCostModel(CostModel):
    """The cost model, each kind of layer priced once per (strategy, micro-batches, pp): layers of one kind cost the
    same under every strategy (:func:`nbtrain.planner.search.layer_kinds`), so a pipeline's stages are summed from
    a few layers' prices."""

    def __init__(self, *args, representative: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self._representative, self._priced = representative, {}

    def layer(self, index: int, s, microbatches: int, pp: int = 1):
        key = (self._representative[index], s, microbatches, pp)
        found = self._priced.get(key)
        if found is None:
            found = self._priced[key] = super().layer(self._representative[index], s, microbatches, pp)
        return found


def group_stages(s, groups: int) -> np.ndarray:
    """Per group of ranks, the stage of ``s`` it is in (module docstring)."""
    return np.arange(groups) * pp_of(s) // groups


def price_bucket(costs, bound: int, rows: int) -> BucketCost:
    """The :class:`BucketCost` of ``rows`` rows of ``bound`` tokens over ``costs.space`` (``costs``: a
    :class:`~nbtrain.planner.switching.bucket_search.SwitchingCostModel`)."""
    size, count, groups = len(costs.space), len(MICRO_ROWS), costs.groups
    micro, counts = np.ones((count, size), dtype=int), np.ones((count, size), dtype=int)
    passes, sync, update = np.zeros((count, size)), np.zeros((count, size)), np.zeros((count, size))
    act, transient = np.zeros((count, size, groups)), np.zeros((count, size, groups))
    base = {}  # a strategy's pass costs are its layout-and-checkpointing's: offload changes only the update
    most = peak_rows(costs, bound, rows)  # a pipeline's memory is its fullest step's
    for j, s in enumerate(costs.space):
        # the executor pads the bucket with empty rows to a multiple of dp, and computes them: priced as full
        per_rank = padded_rows(rows, s.dp) // s.dp
        key = with_layers(s, offload=0.0)
        for c, choice in enumerate(MICRO_ROWS):
            r = micro_rows_for(choice, per_rank)
            m = -(-per_rank // r)
            model = costs.model(s.dp * m * r, bound)  # each rank's rows padded to m micro-batches of r
            micro[c, j], counts[c, j] = r, m
            if pp_of(s) == 1:
                priced = [(model.layer(i, s, m), n) for i, n in costs.kinds]  # per micro-batch
                # once a step (the update, the offload's excess), spread over the m micro-batches: m × per micro-batch
                update[c, j] = m * sum(n * (x.time.update + x.time.offload) for x, n in priced)
                if (c, key) in base:
                    passes[c, j], sync[c, j], act[c, j], transient[c, j] = base[c, key]
                    continue
                passes[c, j] = m * sum(n * (x.time.compute + x.time.tp_comm + x.time.zero3_comm) for x, n in priced)
                sync[c, j] = m * sum(n * x.time.dp_comm for x, n in priced)  # per micro-batch: a share of the step's
                act[c, j] = sum(n * x.memory.activations for x, n in priced)
                transient[c, j] = max(x.transient for x, _ in priced)
            else:
                found = pipeline_prediction(costs, s, bound, rows, choice)
                if found is None:
                    passes[c, j] = update[c, j] = np.inf
                    continue
                once = found.time.update + found.time.offload
                update[c, j] = once
                if (c, key) in base:
                    passes[c, j], sync[c, j], act[c, j], transient[c, j] = base[c, key]
                    continue
                passes[c, j] = found.step_time_s - once
                # memory at the step that fills the bucket most: the same micro-batch rows, more of them in flight
                held = found if most == rows else pipeline_prediction(costs, s, bound, most, int(micro[c, j])) or found
                where = group_stages(s, groups)
                act[c, j] = [held.stages[k].memory.activations for k in where]
                transient[c, j] = [held.stages[k].memory.transient for k in where]
            base[c, key] = passes[c, j], sync[c, j], act[c, j].copy(), transient[c, j].copy()
    return BucketCost(bound, rows, micro, counts, passes, sync, update, act, transient)


def peak_rows(costs, bound: int, rows: int) -> int:
    """The most rows of ``bound`` tokens a step may put in the bucket: every token of the step
    (``costs.step_tokens``) in it, ``peak_rows(costs, 4096, 1) == 4`` at 16,384 tokens a step; its ``rows`` (the
    mean the time is priced at) when the step's tokens are not known. A bucket's time is its mean step's, its memory
    its fullest step's: a pipelined bucket runs the step's rows in more micro-batches of the same rows, and 1F1B
    keeps up to ``pp − i`` of them in flight on stage ``i`` (measured, issue 47: a step with four 4K rows held 2.3×
    the memory priced at the mean's one)."""
    step = costs.step_tokens
    return max(rows, -(-step // bound)) if step else rows


def pipeline_prediction(costs, s, bound: int, rows: int, choice: int | None):
    """The cost model's prediction of a pipelined bucket (``s`` with ``pp > 1``) in the micro-batches of
    ``choice`` (:data:`MICRO_ROWS`), or None where the cost model refuses the plan."""
    per_rank = padded_rows(rows, s.dp) // s.dp
    r = micro_rows_for(choice, per_rank)
    m = -(-per_rank // r)
    model = costs.model(s.dp * m * r, bound)
    try:
        return model.estimate(bucket_plan(s, costs.cluster.num_devices, len(costs.profile.layers), microbatches=m,
                                          global_batch=s.dp * m * r, seq_len=bound))
    except InvalidPlanError:
        return None


def stage_states(model: CostModel, s, num_devices: int, num_layers: int, groups: int):
    """Per group of ranks, (params + grads + optimizer, params + grads) of ``s``'s stage on it: what the home
    layout holds all step, and what a layout away from home holds while its buckets run."""
    plan = bucket_plan(s, num_devices, num_layers)
    per_stage = [model.stage(plan, i, a, b)[0].memory for i, (a, b) in enumerate(plan.stage_ranges())]
    where = group_stages(s, groups)
    held = np.array([per_stage[k].params + per_stage[k].grads + per_stage[k].optimizer for k in where])
    copy = np.array([per_stage[k].params + per_stage[k].grads for k in where])
    return held, copy, [per_stage[k] for k in where]

