"""Why a recommended plan moves optimizer updates to the CPU: which layers, and what it buys over the best plan
that keeps every update on the devices (the model fits only with it, or its step is faster).

    >>> without = best_without_offload(profile, cluster, global_batch=64, seq_len=2048)
    >>> best.layers[20].offload > 0, without is None
    (True, True)
    >>> offload_note(best, without, profile, cluster, global_batch=64, seq_len=2048).split(":")[0]
    'CPU update offload on layers 0-33 (offload=1)'

(``best``: LLaMA-7B planned for one 40 GiB H100; the leanest plan without offload needs 106 GiB there.)
"""

from __future__ import annotations

from dataclasses import replace

from nbtrain.planner.cost import CostOptions
from nbtrain.planner.grammar import layer_spans
from nbtrain.planner.plan import Plan
from nbtrain.planner.search import leanest, search
from nbtrain.planner.search_space import SearchOptions
from nbtrain.units import format_bytes, format_seconds


def best_without_offload(profile, cluster, *, global_batch: int, seq_len: int, memory: float | None = None,
                         options: SearchOptions = SearchOptions(),
                         cost_options: CostOptions = CostOptions()) -> Plan | None:
    """The fastest plan that fits with every update on the devices (None: none fits), predicted."""
    found = search(profile, cluster, global_batch=global_batch, seq_len=seq_len, memory=memory, top=1,
                   options=replace(options, offload_levels=(0.0,)), cost_options=cost_options)
    return found[0] if found else None


def offload_note(best: Plan, without: Plan | None, profile, cluster, *, global_batch: int, seq_len: int,
                 memory: float | None = None, options: SearchOptions = SearchOptions(),
                 cost_options: CostOptions = CostOptions()) -> str:
    """A sentence for the notes of ``best`` when it offloads ("" when it does not): on which layers, and either
    that nothing fits without it (with what the leanest plan without it needs) or how much faster its step is than
    ``without``'s, the best plan without offload."""
    offloaded = [i for i, s in enumerate(best.layers) if s.offload]
    if not offloaded:
        return ""
    fractions = sorted({f"{best.layers[i].offload:g}" for i in offloaded})
    where = f"CPU update offload on {layer_spans(offloaded)} (offload={', '.join(fractions)})"
    if without is None:
        lean = leanest(profile, cluster, global_batch=global_batch, seq_len=seq_len, memory=memory,
                       options=replace(options, offload_levels=(0.0,)), cost_options=cost_options)
        need = f" (the leanest plan without it needs {format_bytes(lean.predicted.memory_bytes)})" if lean else ""
        return (f"{where}: without it nothing fits {format_bytes(best.predicted.budget_bytes)} per device{need}; "
                "--no-offload turns it off")
    gain = without.predicted.step_time_s / best.predicted.step_time_s - 1
    return (f"{where}: the step is {gain:.0%} faster than the best plan without it, '{without}' "
            f"({format_seconds(without.predicted.step_time_s)}); --no-offload turns it off")

