"""The planner's public face: recommend a plan, evaluate a typed one, compare with the baselines users know.

    >>> import nbtrain
    >>> prof = nbtrain.profile("llama-7b", seq_len=2048)
    >>> cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8, device_memory="24GiB")
    >>> best = nbtrain.plan(prof, cluster, global_batch=64, seq_len=2048)
    >>> print(best.summary())
    >>> print(best.table())
    >>> print(compare(best, prof, cluster))                 # against DDP, FSDP, Megatron TP, TP+PP, ZeRO-Offload
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.errors import InvalidArgumentError, NoFeasiblePlanError
from nbtrain.planner.cost import CostModel, CostOptions
from nbtrain.planner.search import SearchOptions, respects_ties, search
from nbtrain.planner.strategy import Plan, Strategy
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


def _power_of_two_divisors(n: int) -> list[int]:
    return [2**k for k in range(n.bit_length()) if n % 2**k == 0]


def baselines(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
              memory: float | None = None, cost_options: CostOptions = CostOptions()) -> list[Baseline]:
    """DDP, FSDP (ZeRO-3), Megatron TP inside a node, TP + PP, and ZeRO-Offload (update after backward)."""
    n, node = cluster.num_devices, cluster.devices_per_node
    heads = profile.arch.get("n_kv_head") or profile.arch.get("n_head") or n
    tp = max(t for t in _power_of_two_divisors(min(n, node)) if heads % t == 0)
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
        model = CostModel(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=memory,
                          options=options)
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
        out.append(Baseline(name, best, options=options))
    return out


def plan(profile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None, memory=None,
         strategy: str | None = None, top: int = 3, options: SearchOptions = SearchOptions(),
         cost_options: CostOptions = CostOptions()) -> Plan:
    """The fastest plan that fits ``memory`` per device (default: the device's), with its prediction and the
    next best ``top − 1`` alternatives. ``strategy`` evaluates a typed plan instead of searching.

    ``profile`` is a :class:`ModelProfile` or anything :func:`nbtrain.profile` takes (it is then profiled at
    ``seq_len``). Raises :class:`NoFeasiblePlanError` with the memory the leanest plan would need.
    """
    from nbtrain.units import parse_bytes

    if not isinstance(profile, ModelProfile):
        from nbtrain.profiler.model import profile as run_profile

        profile = run_profile(profile, batch_size=1, seq_len=seq_len)
    if not isinstance(global_batch, int) or global_batch < 1:
        raise InvalidArgumentError(f"the global batch must be a positive integer, got {global_batch!r}")
    budget = parse_bytes(memory) if memory is not None else None
    seq_len = seq_len or profile.seq_len
    if strategy is not None:
        typed = Plan.parse(strategy, num_devices=cluster.num_devices, num_layers=len(profile.layers),
                           global_batch=global_batch, seq_len=seq_len, model=profile.model)
        model = CostModel(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=budget,
                          options=cost_options)
        return typed.replace(predicted=model.estimate(typed))
    found = search(profile, cluster, global_batch=global_batch, seq_len=seq_len, memory=budget, top=top,
                   options=options, cost_options=cost_options)
    # the baselines are plans too: the recommendation is never slower than one that fits
    known = [b.plan for b in baselines(profile, cluster, global_batch=global_batch, seq_len=seq_len,
                                       memory=budget, cost_options=cost_options)
             if b.fits and b.options == cost_options and respects_ties(profile, b.plan)]
    ranked = sorted(found + [p for p in known if p not in found], key=lambda p: p.predicted.step_time_s)
    if not ranked:
        raise NoFeasiblePlanError(_no_fit_message(profile, cluster, global_batch, seq_len, budget, cost_options,
                                                  options))
    best, rest = ranked[0], tuple(ranked[1:top])
    notes = (f"tensor parallelism was not searched: {profile.arch['no_tensor_parallel']}",) \
        if profile.arch.get("no_tensor_parallel") else ()
    return best.replace(predicted=best.predicted, alternatives=rest, notes=notes)


def _no_fit_message(profile, cluster, global_batch, seq_len, budget, cost_options,
                    options: SearchOptions = SearchOptions()) -> str:
    """Say what the leanest plan the search was allowed would need, and what to change."""
    n = cluster.num_devices
    lean = []
    for pp in _power_of_two_divisors(n):
        if pp > len(profile.layers):
            continue
        m = global_batch
        d = n // pp
        dp = max(k for k in _power_of_two_divisors(d) if global_batch % (m * k) == 0) if global_batch % m == 0 else 1
        tp = d // dp
        layers = (Strategy(dp_shard=dp, tp=tp, ac=options.allow_ac, offload=max(options.offload_levels)),) * \
            len(profile.layers)
        try:
            candidate = Plan(num_devices=n, layers=layers, pp=pp, microbatches=m, global_batch=global_batch,
                             seq_len=seq_len, model=profile.model)
            model = CostModel(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=budget,
                              options=cost_options)
            lean.append((model.estimate(candidate).memory_bytes, candidate))
        except Exception:  # a lean shape this model cannot take (heads, batch): try the next
            continue
    budget_text = format_bytes(budget if budget is not None else cluster.device_memory)
    if not lean:  # no shape at all: the batch, the heads or the layers cannot be split over n devices
        heads = profile.arch.get("n_head")
        limits = [f"data-parallel degree × micro-batches must divide the global batch ({global_batch})",
                  f"a pipeline has at most {len(profile.layers)} stages (the layers)"]
        if heads:
            limits.append(f"tensor parallelism splits at most {heads} attention heads")
        if profile.layers[-1].tied:
            limits.append("the tied embedding and head stay in one stage without tensor parallelism, so those "
                          f"layers need data parallelism over all {n} devices")
        return (f"no plan splits this model over {n} devices with a global batch of {global_batch}: "
                f"{'; '.join(limits)}. Use a global batch that is a multiple of {n}, or fewer devices")
    need, leanest = min(lean, key=lambda x: x[0])
    offload = "" if max(options.offload_levels) > 0 else \
        ", or let the plan update on the CPU (SearchOptions(offload_levels=(0.0, 0.5, 1.0)); %%autoparallel --offload)"
    return (f"no plan fits {budget_text} per device on {n} × {cluster.device}: the leanest plan nbtrain knows, "
            f"'{leanest}', needs {format_bytes(need)} per device; use devices with at least that much memory, more "
            f"devices, or a smaller global batch or sequence length{offload}")
