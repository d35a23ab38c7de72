"""What nbtrain's executor can run on a model, as the search must know it: where a tied embedding and head must sit,
whether pipeline stages can be cut, and why a plan would be refused (the search never returns such a plan; the
executor checks the same before a launch, ``nbtrain.run.parallel.parallelize.check_plan``).

    >>> from nbtrain.profiler.model import profile
    >>> tied = profile("gpt-tiny", batch_size=1, seq_len=32)        # its head shares the token embedding's weight
    >>> executor_problem(tied, Plan.parse("dp_shard=2", num_devices=2, num_layers=len(tied.layers)))
    ''
    >>> executor_problem(tied, Plan.parse("pp=2 mb=2", num_devices=2, num_layers=len(tied.layers)))
    'the embedding and the head share their weight, which the executor keeps in one pipeline stage, unsplit by tensor parallelism and with one strategy (pp=1, tp=1 on the first and last layers)'
"""

from __future__ import annotations

from nbtrain.planner.plan import Plan
from nbtrain.profiler.result import ModelProfile


def is_tied(profile: ModelProfile) -> bool:
    """Whether the model's first and last layers share a parameter (a head tied to the token embedding)."""
    return len(profile.layers) > 1 and bool(profile.layers[-1].tied)


def keeps_tie_whole(profile: ModelProfile) -> bool:
    """Whether the executor keeps this model's tied embedding and head unsplit by tensor parallelism, with one
    strategy (``splits_tied`` of its family is false), and in one pipeline stage unless its stages are traced
    (:func:`tie_crosses_stages`); a family that splits them only needs one strategy for both."""
    return is_tied(profile) and not profile.arch.get("splits_tied")


def tie_crosses_stages(profile: ModelProfile) -> bool:
    """Whether a tied embedding and head may sit in different pipeline stages: a family that splits them, or a
    model whose stages are traced graphs (each end stage holds a copy; their gradients are summed)."""
    return bool(profile.arch.get("splits_tied") or profile.arch.get("traced_stages"))


def cuts_stages(profile: ModelProfile) -> bool:
    """Whether the executor can cut this model into pipeline stages (a profile made before it said so: yes)."""
    return bool(profile.arch.get("cuts_stages", True))


def respects_ties(profile: ModelProfile, plan: Plan) -> bool:
    """Whether a plan gives a tied embedding and head one strategy, and, where the executor keeps the tie whole
    (:func:`keeps_tie_whole`), one stage and no TP."""
    if not is_tied(profile):
        return True
    first, last = plan.layers[0], plan.layers[-1]
    if not keeps_tie_whole(profile):
        return first == last
    return (plan.pp == 1 or tie_crosses_stages(profile)) and first == last and first.tp == 1


def executor_problem(profile: ModelProfile, plan: Plan) -> str:
    """Why nbtrain's executor cannot run ``plan`` (which the cost model can still predict), or ``""``; the search
    never returns such a plan. Checked by ``nbtrain.run.parallel.parallelize.check_plan`` and PyTorch before a launch."""
    if not respects_ties(profile, plan) and not keeps_tie_whole(profile):
        return "the embedding and the head share their weight, so they need one strategy (the same on both)"
    if not respects_ties(profile, plan):
        return ("the embedding and the head share their weight, which the executor keeps in one pipeline stage, "
                "unsplit by tensor parallelism and with one strategy (pp=1, tp=1 on the first and last layers)")
    if plan.pp > 1 and not cuts_stages(profile):
        return profile.arch.get("no_pipeline") or f"the executor does not cut {profile.model} into pipeline stages"
    if plan.pp > 1 and profile.arch.get("traced_stages") and any(s.tp > 1 for s in plan.layers):
        return "the executor's traced pipeline stages of this model run without tensor parallelism (tp=1 with pp)"
    unit = profile.arch.get("tp_unit")
    uneven = next((s.tp for s in plan.layers if s.tp > 1 and unit and unit % s.tp), None)
    if uneven:
        return f"tp={uneven} does not divide the layers' split features and heads ({unit} is their common divisor)"
    if plan.pp > 1 and plan.schedule == "1f1b" and plan.microbatches < plan.pp:
        return (f"1F1B needs at least as many micro-batches as stages (mb={plan.microbatches} < pp={plan.pp}); "
                f"use mb={plan.pp} or more, or schedule=gpipe")
    offloaded = any(s.offload for s in plan.layers)
    if offloaded and profile.arch.get("no_offload"):
        return profile.arch["no_offload"]
    return ""
