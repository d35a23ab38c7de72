"""The planner's public face: recommend a plan, evaluate a typed one, compare with the baselines users know.

    >>> import nbtrain
    >>> prof = nbtrain.profile("llama-7b", seq_len=2048)
    >>> cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8, device_memory="24GiB")
    >>> best = nbtrain.plan(prof, cluster, global_batch=64, seq_len=2048)
    >>> print(best.summary())
    >>> print(best.table())
    >>> from nbtrain.planner.report import comparison_table
    >>> print(comparison_table(best, nbtrain.baselines(prof, cluster, global_batch=64)))  # DDP, FSDP, Megatron TP, ...
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from nbtrain.checks import positive_int, power_of_two_divisors
from nbtrain.errors import InvalidPlanError, NoFeasiblePlanError
from nbtrain.planner.anytime import PROVISIONAL, provisional_note
from nbtrain.planner.cost import CostModel, CostOptions
from nbtrain.planner.cost_tables import shared_cost_model
from nbtrain.planner.reserve import HEADROOM_PART, headroom_label
from nbtrain.planner.reach import cuts_stages, executor_problem, keeps_tie_whole
from nbtrain.planner.offload_note import best_without_offload, offload_note
from nbtrain.planner.search import leanest, search
from nbtrain.planner.search_space import SearchOptions
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile
from nbtrain.units import format_bytes


@dataclass(frozen=True)
class Baseline:
    """A uniform plan users know, at its best micro-batch count and checkpointing choice."""

    name: str
    plan: Plan | None
    """The fastest variant that fits, else the leanest variant (``fits`` False), or None when none applies."""
    note: str = ""
    options: CostOptions = CostOptions()
    """The cost options it was predicted with (ZeRO-Offload's update runs after backward, not overlapped)."""

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.predicted.fits


def baselines(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
              memory: float | None = None, cost_options: CostOptions = CostOptions()) -> list[Baseline]:
    """DDP, FSDP (ZeRO-3), Megatron TP inside a node, TP + PP, and ZeRO-Offload (update after backward)."""
    n, node = cluster.num_devices, cluster.devices_per_node
    heads = profile.arch.get("n_kv_head") or profile.arch.get("n_head") or n
    tp = max(t for t in power_of_two_divisors(min(n, node)) if heads % t == 0)
    tp_pp = tp if n // tp > 1 else max(tp // 2, 1)  # one node: split it between TP and a 2-stage pipeline
    families = [
        ("DDP", 1, Strategy(dp_replicate=n), cost_options),
        ("FSDP (ZeRO-3)", 1, Strategy(dp_shard=n), cost_options),
        (f"Megatron TP={tp}", 1, Strategy(dp_replicate=n // tp, tp=tp), cost_options),
        (f"TP={tp_pp} + PP={n // tp_pp}", n // tp_pp, Strategy(tp=tp_pp), cost_options),
        ("ZeRO-Offload", 1, Strategy(dp_shard=n, zero=2, offload=1.0),
         CostOptions(**{**cost_options.__dict__, "offload_overlap": False})),
    ]
    out = []
    for name, pp, strategy, options in families:
        if strategy.devices * pp != n or pp > len(profile.layers) or (name.startswith("TP=") and pp < 2):
            out.append(Baseline(name, None, "does not apply to this cluster"))
            continue
        if strategy.tp > 1 and profile.arch.get("no_tensor_parallel"):
            out.append(Baseline(name, None, profile.arch["no_tensor_parallel"]))
            continue
        unsplit = profile.arch.get("tp_unsplit_layers")
        if strategy.tp > 1 and unsplit:
            out.append(Baseline(name, None, f"the model's tensor-parallel plan splits none of layer {unsplit[0]}'s "
                                            "modules (they run with tp=1; a plan may give tp to the others)"))
            continue
        model = shared_cost_model(profile, cluster, global_batch=global_batch, seq_len=seq_len,
                                  budget_bytes=memory, options=options)
        variants = []
        for m in (2**k for k in range(global_batch.bit_length())):
            if m < pp or global_batch % (m * strategy.dp):
                continue
            for ac in (False, True):
                layers = (Strategy(**{**strategy.__dict__, "ac": ac}),) * len(profile.layers)
                candidate = Plan(num_devices=n, layers=layers, pp=pp, microbatches=m, global_batch=global_batch,
                                 seq_len=model.seq_len, model=profile.model)
                variants.append(candidate.replace(predicted=model.estimate(candidate)))
        if not variants:
            out.append(Baseline(name, None, f"the global batch {global_batch} is too small for dp={strategy.dp}"))
            continue
        fitting = [v for v in variants if v.predicted.fits]
        best = min(fitting, key=lambda v: v.predicted.step_time_s) if fitting else \
            min(variants, key=lambda v: v.predicted.memory_bytes)
        problem = executor_problem(profile, best)
        if problem:  # shown as such, not timed: a time beside the recommendation would read as an option
            out.append(Baseline(name, None, f"nbtrain's executor cannot run it on this model: {problem}"))
            continue
        out.append(Baseline(name, best, options=options))
    return out


def plan(profile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None, memory=None,
         strategy: str | None = None, top: int = 3, options: SearchOptions = SearchOptions(),
         cost_options: CostOptions = CostOptions(), search_seconds: float | None = None, progress=None) -> Plan:
    """The fastest plan that fits ``memory`` per device (default: the device's), with its prediction and the
    next best ``top − 1`` alternatives. ``strategy`` evaluates a typed plan instead of searching (with a note when
    the executor cannot run it).

    ``search_seconds``: once the search has run that long and found a plan, the best found so far is
    recommended, with a note that says so first (:func:`provisional`); ``progress`` is told where the search
    stands after each sub-problem (:class:`~nbtrain.planner.anytime.Progress`).

    ``memory`` is each device's whole memory: the reserve (the CUDA context and NCCL's buffers, 1 GiB per GPU of
    a multi-GPU cluster; :func:`nbtrain.planner.reserve.reserve_parts`) comes out of it before the model, and the
    table and ``to_dict()`` show it beside the model's own bytes. A small global batch on many devices gets
    tensor and pipeline parallelism, which need no sequence per device.

    ``profile`` is a :class:`ModelProfile` or anything :func:`nbtrain.profile` takes (it is then profiled at
    ``seq_len``). When nothing fits, raises :class:`NoFeasiblePlanError` naming the true cause: the reserve alone
    over the budget, or the memory the leanest plan would need (always more than the budget), or a global batch,
    heads or tied layers that no plan can split over the devices.
    """
    from nbtrain.units import parse_bytes

    if not isinstance(profile, ModelProfile):
        from nbtrain.profiler.model import profile as run_profile

        profile = run_profile(profile, batch_size=1, seq_len=seq_len)
    positive_int(global_batch, f"the global batch must be a positive integer, got {global_batch!r}")
    budget = parse_bytes(memory) if memory is not None else None
    seq_len = seq_len or profile.seq_len
    if strategy is not None:
        typed = Plan.parse(strategy, num_devices=cluster.num_devices, num_layers=len(profile.layers),
                           global_batch=global_batch, seq_len=seq_len, model=profile.model)
        model = shared_cost_model(profile, cluster, global_batch=global_batch, seq_len=seq_len,
                                  budget_bytes=budget, options=cost_options)
        problem = executor_problem(profile, typed)
        notes = (f"nbtrain's executor cannot run this plan yet: {problem}",) if problem else ()
        return typed.replace(predicted=model.estimate(typed), notes=notes)
    deadline = time.monotonic() + search_seconds if search_seconds is not None else None
    found = search(profile, cluster, global_batch=global_batch, seq_len=seq_len, memory=budget, top=top,
                   options=options, cost_options=cost_options, deadline=deadline, progress=progress)
    # the baselines are plans too: the recommendation is never slower than one that fits
    known = [b.plan for b in baselines(profile, cluster, global_batch=global_batch, seq_len=seq_len,
                                       memory=budget, cost_options=cost_options)
             if b.fits and b.options == cost_options and not executor_problem(profile, b.plan)]
    ranked = sorted(found + [p for p in known if p not in found], key=lambda p: p.predicted.step_time_s)
    notes = tuple(note for note in [provisional_note(found, search_seconds)] if note)
    notes += (f"tensor parallelism was not searched: {profile.arch['no_tensor_parallel']}",) \
        if profile.arch.get("no_tensor_parallel") else ()
    if not ranked:
        lean = leanest(profile, cluster, global_batch=global_batch, seq_len=seq_len, memory=budget,
                       options=options, cost_options=cost_options)
        if lean is not None and lean.predicted.fits:  # the search missed it (its merged frontier): take it
            return lean.replace(predicted=lean.predicted, notes=notes)
        raise NoFeasiblePlanError(_no_fit_message(profile, cluster, global_batch, lean, options))
    model = shared_cost_model(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=budget,
                              options=cost_options)
    ranked += [p for p in _uniform_variants(model, ranked[0]) + _without_sp(model, ranked[0])
               if p not in ranked and p.predicted.fits and not executor_problem(profile, p)]
    ranked.sort(key=lambda p: p.predicted.step_time_s)
    best = simplest_near(ranked)
    if any(s.offload for s in best.layers):  # only where it pays: against the best plan that keeps it all on device
        kwargs = dict(global_batch=global_batch, seq_len=seq_len, memory=budget, options=options,
                      cost_options=cost_options)
        without = best_without_offload(profile, cluster, **kwargs)
        if without is not None and without not in ranked:
            ranked = sorted(ranked + [without], key=lambda p: p.predicted.step_time_s)
            best = simplest_near(ranked)
        notes += tuple(n for n in [offload_note(best, without, profile, cluster, **kwargs)] if n)
    rest = tuple(p for p in ranked if p != best)[:top - 1]
    if best != ranked[0]:
        gain = best.predicted.step_time_s / ranked[0].predicted.step_time_s - 1
        why = "with room in memory" if at_edge(ranked[0]) and not at_edge(best) else "simplest"
        notes += (f"the {why} plan within {NEAR:.0%} of the fastest predicted step was chosen; the fastest, "
                  f"{ranked[0]}, is {gain:.2%} faster (alternative 1)" +
                  (f" but fills its memory to within {EDGE:.0%}" if why != "simplest" else ""),)
    return best.replace(predicted=best.predicted, alternatives=rest, notes=notes)


def provisional(plan: Plan) -> bool:
    """Whether ``plan`` is the best a search cut short by its time budget had found (its note says so)."""
    return any(note.startswith(PROVISIONAL) for note in plan.notes)


NEAR = 0.02
"""Plans within 2% of the fastest predicted step are equal to the recommendation: it takes the simplest of them
(a prediction is not that exact, and a uniform plan is easier to run, read and debug than a per-layer mix)."""


def simplicity(plan: Plan) -> tuple:
    """Smaller is simpler: no CPU update offload first (it takes host memory and the CPU's time from the user's
    other work: a plan offloads only where that makes the model fit or the step more than :data:`NEAR` faster),
    then fewer distinct strategies (uniform before a per-layer mix), no pipeline, no tensor parallelism, no
    sharding (DDP before FSDP), no checkpointing, no sequence parallelism (chosen only where it pays: it fits a
    plan that would not, or gains more than :data:`NEAR`)."""
    layers = plan.layers
    return (any(s.offload for s in layers), len(set(layers)), plan.pp > 1, any(s.tp > 1 for s in layers),
            any(s.dp_shard > 1 for s in layers), any(s.ac for s in layers), any(s.sp for s in layers))


EDGE = 0.03
"""A plan that leaves less than 3% of the memory it may fill (the budget less the reserve) unused is at the edge: a
prediction off by that much turns it into an out-of-memory error, so a plan with room within :data:`NEAR` of its
time is preferred to it."""


def at_edge(plan: Plan) -> bool:
    """Whether ``plan`` fills its usable memory (budget less the reserve) to within :data:`EDGE`."""
    pred = plan.predicted
    reserve = max((stage.memory.reserve for stage in pred.stages), default=0.0)
    usable = pred.budget_bytes - reserve
    return usable > 0 and pred.memory_bytes - reserve > (1 - EDGE) * usable


def simplest_near(ranked: list[Plan]) -> Plan:
    """Of the plans (fastest first) whose predicted step is within :data:`NEAR` of the fastest's, one with room
    (not :func:`at_edge`) before one at the edge, then the simplest, then the fastest."""
    limit = ranked[0].predicted.step_time_s * (1 + NEAR)
    near = [p for p in ranked if p.predicted.step_time_s <= limit]
    return min(near, key=lambda p: (at_edge(p), simplicity(p), p.predicted.step_time_s))


def _uniform_variants(model: CostModel, plan: Plan) -> list[Plan]:
    """Each strategy of ``plan`` on every layer, with its pipeline, micro-batches and schedule, predicted."""
    out = []
    for strategy in dict.fromkeys(plan.layers):
        if plan.layers == (strategy,) * plan.num_layers:
            continue
        try:
            uniform = plan.replace(layers=(strategy,) * plan.num_layers, predicted=None, alternatives=(), notes=())
        except InvalidPlanError:
            continue
        out.append(uniform.replace(predicted=model.estimate(uniform)))
    return out


def _without_sp(model: CostModel, plan: Plan) -> list[Plan]:
    """``plan`` with its sequence parallelism off, predicted (none when it has none): the simpler twin."""
    if not any(s.sp for s in plan.layers):
        return []
    plain = plan.replace(layers=tuple(replace(s, sp=False) for s in plan.layers), predicted=None,
                         alternatives=(), notes=())
    return [plain.replace(predicted=model.estimate(plain))]


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _largest_power_of_two_dividing(n: int, at_most: int) -> int:
    return max(k for k in power_of_two_divisors(n) if k <= at_most) if at_most >= 1 else 1


def _need(need: float, budget: float) -> str:
    """``need`` bytes rounded up (never shown as less than it is), told apart from the budget's figure."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if need >= size:
            text = f"{math.ceil(need / size * 100 - 1e-9) / 100:.2f} {unit}"
            break
    else:
        text = f"{math.ceil(need)} B"
    return text if text != format_bytes(budget) else f"{math.ceil(need):,} bytes"


def _at_its_own_budget(pred) -> tuple[float, float, tuple]:
    """(the budget per device at which the predicted plan just fits, its reserve there, the reserve's parts there):
    the allocator headroom is a share of the budget, so a plan needing ``need`` at a budget ``B`` with headroom
    ``h·B`` needs ``(need − h·B) / (1 − h)``, and the headroom grows with it."""
    need, budget, parts = pred.memory_bytes, pred.budget_bytes, tuple(pred.reserve_parts)
    share = sum(nbytes for what, nbytes in parts if what.startswith(HEADROOM_PART)) / budget if budget else 0
    if not share:
        return need, pred.stages[0].memory.reserve, parts
    enough = (need - share * budget) / (1 - share)
    parts = tuple((headroom_label(share, _need(enough, 0)), int(share * enough))
                  if what.startswith(HEADROOM_PART) else (what, nbytes) for what, nbytes in parts)
    return enough, sum(nbytes for _, nbytes in parts), parts


def _no_fit_message(profile, cluster, global_batch, lean: Plan | None,
                    options: SearchOptions = SearchOptions()) -> str:
    """Why no plan fits, with the numbers: the reserve, the leanest plan's memory (always more than the budget, or
    its host memory more than the host's), or what cannot be split."""
    n = cluster.num_devices
    if lean is None:
        return _no_split_message(profile, cluster, global_batch, options)
    pred = lean.predicted
    budget, reserve = pred.budget_bytes, pred.stages[0].memory.reserve
    need, reserve_there, parts_there = _at_its_own_budget(pred)
    where = f"no plan fits {format_bytes(budget)} per device on {n} × {cluster.device}"
    given = [what for what, _ in pred.reserve_parts] == ["CostOptions.reserve_bytes"]
    parts = "as CostOptions.reserve_bytes says" if given else \
        _and([f"{what} {format_bytes(nbytes)}" for what, nbytes in pred.reserve_parts])
    if reserve and reserve >= budget:
        source = "" if given else "; sources in nbtrain/planner/reserve.py"
        return (f"{where}: nbtrain reserves {format_bytes(reserve)} of each device before the model ({parts}"
                f"{source}), which alone does not fit; the leanest plan nbtrain knows, "
                f"'{lean}', needs {_need(need - reserve_there, 0)} beside it, {_need(need, budget)} per device in "
                "all. "
                f"Give at least {_need(need, budget)} per device, or set the reserve your runtime needs with "
                "CostOptions(reserve_bytes=...) and the allocator headroom with --headroom")
    host = max(stage.host_bytes for stage in pred.stages)
    if need <= budget and host > pred.host_budget_bytes:
        return (f"{where}: the leanest plan nbtrain knows, '{lean}', fits the device ({format_bytes(need)}) but "
                f"keeps {_need(host, pred.host_budget_bytes)} of optimizer state in host memory per device, more "
                f"than its {format_bytes(pred.host_budget_bytes)}; use hosts with more memory, more devices, or "
                "less offload (SearchOptions(offload_levels=(0.0, 0.5)))")
    parts = parts if given else _and([f"{what} {format_bytes(nbytes)}" for what, nbytes in parts_there])
    reserved = f" ({format_bytes(reserve_there)} of it reserved{',' if given else ':'} {parts})" if reserve else ""
    offload = "" if max(options.offload_levels) > 0 else \
        ", or let the plan update on the CPU (SearchOptions(offload_levels=(0.0, 0.5, 1.0)); %%autoparallel without " \
        "--no-offload)"
    return (f"{where}: the leanest plan nbtrain knows, '{lean}', needs {_need(need, budget)} per device"
            f"{reserved}; use devices with at least that much memory, more devices, or a smaller global batch or "
            f"sequence length{offload}")


def _at_most(devices: int) -> str:
    return "one device" if devices == 1 else f"at most {devices} devices"


def _no_split_message(profile, cluster, global_batch, options: SearchOptions) -> str:
    """No plan at all, whatever the memory: say which split fails, with the numbers."""
    n, node, layers = cluster.num_devices, cluster.devices_per_node, len(profile.layers)
    start = f"no plan splits this model over {n} devices with a global batch of {global_batch}"
    dp = _largest_power_of_two_dividing(global_batch, n)
    if keeps_tie_whole(profile):
        idle = n - global_batch if global_batch < n else None
        short = f"a global batch of {global_batch} leaves {idle} of them without a sequence" if idle else             f"{global_batch} sequences do not split {n} ways"
        return (f"{start}: its tied embedding and head share one weight, which the executor keeps in one pipeline "
                f"stage without tensor parallelism, so those layers are data-parallel over all {n} devices, and "
                f"{short}. Use a global batch that is a multiple of {n}, {_at_most(dp)}, or a model that does not "
                "tie them (nbtrain.GPTConfig(tie_embeddings=False); tie_word_embeddings=False in a Hugging Face "
                "config)")
    heads = profile.arch.get("n_kv_head") or profile.arch.get("n_head")
    cap = min(node, n, options.max_tp or n)
    if profile.arch.get("no_tensor_parallel"):
        tp, why_tp = 1, f"no tensor parallelism ({profile.arch['no_tensor_parallel']})"
    else:
        tp = max(t for t in power_of_two_divisors(cap) if not heads or heads % t == 0) if cap >= 1 else 1
        kv = profile.arch.get("n_kv_head") not in (None, profile.arch.get("n_head"))
        which = f"{heads} key/value heads" if kv else f"{heads} heads"
        why_tp = f"tp ≤ {tp} (inside a node of {node}" + (f", dividing the {which})" if heads else ")")
    pps = options.pp_degrees or ([1] if not cuts_stages(profile) else
                                 [p for p in power_of_two_divisors(n) if p <= layers])
    pp = max([p for p in pps if n % p == 0 and p <= layers] or [1])
    most = pp * tp * dp
    return (f"{start}: at most pp={pp} stages ({layers} layers) × {why_tp} × dp={dp} (every data-parallel rank "
            f"needs a sequence; {dp} is the largest power of two dividing {global_batch}) = {most} devices. Use a "
            f"global batch that is a multiple of {max(n // (pp * tp), 1)}, or {_at_most(most)}")
