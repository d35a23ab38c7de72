"""One prediction per plan on this machine: what ``fit`` prints beside the measured step and what the plan table
shows for a plan made here come from this one function, with the same profile (timed here at the plan's per-device
micro-batch, cached) and the same cluster (calibrated once per machine, cached).

    >>> import nbtrain
    >>> from nbtrain.planner.plan import Plan
    >>> model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=32))
    >>> plan = Plan.parse("dp_shard=2", num_devices=2, num_layers=4, global_batch=8, seq_len=64)
    >>> described = Cluster.from_catalog("cpu", num_devices=2)    # Cluster.this_machine(2): timed here
    >>> pred = predict_here(model, plan, described, num_processes=2, seq_len=64)
    >>> pred.step_time_s == nbtrain.estimate(plan, nbtrain.profile(model, batch_size=1, seq_len=64, dtype="fp32"),
    ...                                      described).step_time_s
    True
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nbtrain.planner.cost import CostOptions, estimate
from nbtrain.planner.plan import Plan
from nbtrain.planner.prediction import Prediction
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.model import profile
from nbtrain.profiler.timed import timed_profile
from nbtrain.run.state.materialize import has_meta


def per_device_batch(plan: Plan) -> int:
    """Sequences one device computes per micro-batch under the plan's widest data parallelism (at least one)."""
    return max(1, plan.global_batch // (plan.microbatches * max(s.dp for s in plan.layers)))


def narrowed(cluster: Cluster, num_processes: int) -> Cluster:
    """``cluster`` as the run uses it: a one-node cluster narrowed to ``num_processes`` devices (``Cluster.detect()``
    counts every core or GPU of this machine), with this machine's links measured for that many CPU processes
    (a calibrated cluster's; one left uncalibrated, ``--no-calibrate``, takes only what is cached)."""
    if cluster.num_devices != num_processes and cluster.num_nodes == 1:
        cluster = cluster.replace(num_devices=num_processes, devices_per_node=num_processes)
    if cluster.source != "catalog" and cluster.device == "cpu" and num_processes > 1:
        cluster = cluster.with_links(num_processes, measure=cluster.source == "calibrated")
    return cluster


def predict_here(model: nn.Module, plan: Plan, cluster: Cluster, *, num_processes: int, seq_len: int | None,
                 inputs: Callable | None = None, loss_fn: Callable | None = None, tp_plan: dict | None = None,
                 precision: str = "fp32", in_this_process: bool = False,
                 options: CostOptions = CostOptions()) -> Prediction:
    """The predicted step of ``plan`` for ``model`` on ``cluster`` run by ``num_processes`` processes: on this
    machine's CPU, each layer timed here at the plan's per-device micro-batch (as the workers will compute it); on
    this machine's GPU when the run is in this process, timed there with CUDA events (a forked launch cannot: CUDA
    must not be initialised in the process that forks, so it is priced from the datasheet and the calibration);
    else, and for a model on the meta device (no weights to time), from FLOPs."""
    cluster = narrowed(cluster, num_processes)
    workload = dict(seq_len=seq_len, inputs=inputs, loss_fn=None if inputs is None else loss_fn, tp_plan=tp_plan)
    timed = cluster.source != "catalog" and not has_meta(model)
    dtype = "bf16" if precision == "bf16" else "fp32"  # what the workers compute in, and hold their copies in
    if timed and cluster.device == "cpu":
        prof = timed_profile(model, batch_size=per_device_batch(plan), dtype=dtype, **workload)
    elif timed and in_this_process and torch.cuda.is_available():
        prof = timed_profile(model, batch_size=per_device_batch(plan), device="cuda", dtype=dtype, **workload)
    else:
        prof = profile(model, batch_size=1, dtype=dtype, **workload)
    return estimate(plan, prof, cluster, options=options)
