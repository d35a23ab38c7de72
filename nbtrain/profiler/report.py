"""Render a :class:`~nbtrain.profiler.result.ModelProfile` as a table and a one-line summary.

Consecutive identical layers fold into one row (``blocks.0-79  ×80``) whose numbers are per layer; the totals row
counts every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbtrain.table import Table
from nbtrain.units import format_bytes, format_count, format_flops, format_seconds

if TYPE_CHECKING:  # the result module imports this one for its tables
    from nbtrain.profiler.result import LayerProfile, ModelProfile


def _fold(layers: tuple[LayerProfile, ...]) -> list[tuple[str, int, LayerProfile]]:
    """Runs of identical consecutive layers as ``(label, count, first layer)``."""
    runs: list[list[LayerProfile]] = []
    for layer in layers:
        if runs and runs[-1][0].same_shape(layer) and layer.time_fwd_s is None:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    out = []
    for run in runs:
        first, last = run[0].name, run[-1].name
        label = first if len(run) == 1 else f"{first}-{last.rsplit('.', 1)[-1]}"
        out.append((label, len(run), run[0]))
    return out


def profile_table(prof: ModelProfile) -> Table:
    measured = prof.measured_on is not None
    header = ["layer", "count", "params", "fwd FLOPs", "bwd FLOPs", "activations", "output"]
    if measured:
        header += [f"fwd ({prof.measured_on})", "bwd"]
    table = Table(header, align="lrrrrrr" + "rr" * measured)
    table.title = (f"{prof.model} · batch {prof.batch_size} × seq {prof.seq_len} · {prof.dtype} · "
                   f"{format_count(prof.params)} params{_active(prof)} · {format_flops(prof.flops_per_step)} per step")
    for label, count, layer in _fold(prof.layers):
        row = [label, f"×{count}", format_count(layer.params), format_flops(layer.flops_fwd),
               format_flops(layer.flops_bwd), format_bytes(layer.activation_bytes), format_bytes(layer.output_bytes)]
        if measured:
            row += [format_seconds(layer.time_fwd_s or 0.0), format_seconds(layer.time_bwd_s or 0.0)]
        table.add(*row)
    table.rule()
    totals = ["total", f"{len(prof.layers)}", format_count(prof.params), format_flops(prof.flops_fwd),
              format_flops(prof.flops_bwd), format_bytes(prof.activation_bytes), ""]
    if measured:
        totals += [format_seconds(sum(layer.time_fwd_s or 0.0 for layer in prof.layers)),
                   format_seconds(sum(layer.time_bwd_s or 0.0 for layer in prof.layers))]
    table.add(*totals)
    memory = prof.adam_training_bytes()
    table.footer.append(
        "plain Adam training on one device: "
        + " + ".join(f"{k} {format_bytes(v)}" for k, v in memory.items())
        + f" = {format_bytes(sum(memory.values()))}"
    )
    for layer in prof.layers:
        if layer.tied:
            table.footer.append(f"{layer.name} shares {', '.join(layer.tied)} with an earlier layer (counted there)")
    table.footer += [f"note: {note}" for note in prof.notes]
    return table


def _active(prof: ModelProfile) -> str:
    """`` (34.6 M active: 2 of 8 experts a token)`` for a mixture of experts, else nothing."""
    a = prof.arch
    if not a.get("experts"):
        return ""
    return f" ({format_count(prof.active_params)} active: {a['experts_per_token']} of {a['experts']} experts a token)"


def profile_summary(prof: ModelProfile) -> str:
    """``gpt2: 124.44 M params · 14 layers · 7.15 TFLOP/step · activations 3.49 GiB · Adam on one device ...``"""
    total = sum(prof.adam_training_bytes().values())
    return (f"{prof.model}: {format_count(prof.params)} params{_active(prof)} · {len(prof.layers)} layers · "
            f"{format_flops(prof.flops_per_step)}/step · activations {format_bytes(prof.activation_bytes)} · "
            f"Adam on one device {format_bytes(total)} (batch {prof.batch_size} × {prof.seq_len}, {prof.dtype})")
