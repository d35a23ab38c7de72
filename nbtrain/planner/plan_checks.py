"""Whether a plan can be priced for a model on a cluster: the checks the cost model runs before it predicts, each
refusal saying what to change.

    >>> profile = nbtrain.profile("gpt-tiny", batch_size=1, seq_len=64)
    >>> plan = Plan.parse("dp_shard=2", num_devices=2, num_layers=len(profile.layers))
    >>> try:
    ...     check_against(plan, profile, Cluster.from_catalog("H100", num_devices=2), global_batch=3)
    ... except InvalidPlanError as error:
    ...     print(error)
    layer 0: global batch 3 is not divisible by microbatches × dp = 1 × 2 = 2
"""

from __future__ import annotations

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import head_split_problem
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile


def check_against(plan: Plan, profile: ModelProfile, cluster: Cluster, global_batch: int) -> None:
    """Reject ``plan`` where ``profile``'s model or ``cluster`` cannot take it (devices, layers, tensor and sequence
    parallelism the executor cannot run on the model, experts it cannot spread, heads TP does not divide, a batch dp
    does not divide)."""
    if plan.num_devices != cluster.num_devices:
        raise InvalidPlanError(f"the plan is for {plan.num_devices} devices but the cluster has "
                               f"{cluster.num_devices}; write the plan for {cluster.num_devices}")
    if plan.num_layers != len(profile.layers):
        raise InvalidPlanError(f"the plan has {plan.num_layers} layers but {profile.model} has "
                               f"{len(profile.layers)} (embeddings, blocks, head)")
    arch = profile.arch
    cannot = arch.get("no_tensor_parallel")
    for i, s in enumerate(plan.layers):
        if s.tp > 1 and cannot:
            raise InvalidPlanError(f"layer {i}: tp={s.tp}, but {cannot}; use tp=1")
        if s.tp > 1 and i in arch.get("tp_unsplit_layers", ()):
            raise InvalidPlanError(f"layer {i} ({profile.layers[i].name}) of {profile.model}: tp={s.tp}, but the "
                                   "model's tensor-parallel plan splits none of its modules; use tp=1 there")
        if s.sp and arch.get("no_sequence_parallel") and profile.layers[i].kind == "block":
            raise InvalidPlanError(f"layer {i}: sp, but {arch['no_sequence_parallel']}; leave out 'sp'")
        layer = profile.layers[i]
        problem = head_split_problem(s.tp, arch.get("n_head"), arch.get("n_kv_head")) \
            if layer.kind == "block" else ""  # the embedding and the head split the vocabulary, not heads
        if problem:
            raise InvalidPlanError(f"layer {i} ({layer.name}) of {profile.model}: {problem}")
        if s.ep > 1 and (arch.get("layer_expert_params") or [0] * (i + 1))[i]:
            if arch.get("no_expert_parallel"):
                raise InvalidPlanError(f"layer {i}: ep={s.ep}, but {arch['no_expert_parallel']}; use ep=1")
            if arch["experts"] % s.ep:
                raise InvalidPlanError(f"layer {i}: ep={s.ep} does not divide its {arch['experts']} experts; use an "
                                       f"ep that divides {arch['experts']}")
        if global_batch % (plan.microbatches * s.dp):
            raise InvalidPlanError(
                f"layer {i}: global batch {global_batch} is not divisible by microbatches × dp = "
                f"{plan.microbatches} × {s.dp} = {plan.microbatches * s.dp}")
