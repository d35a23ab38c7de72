"""A run's measured step beside its prediction, and what happens when they part: the measurement is taken again.

    >>> import torch
    >>> from types import SimpleNamespace
    >>> run = SimpleNamespace(predicted_step_s=0.100, measured_step_s=0.300)     # a FitResult's two step times
    >>> print(check_prediction(run, nbtrain.Cluster.from_catalog("H100", num_devices=2), num_processes=2,
    ...                        model=torch.nn.Linear(2, 2)))                      # fit does, after each run
    the step measured 300.0 ms where 100.0 ms was predicted (3.00×, outside 0.8–1.25); the cluster is described ...

None within the band; outside it, what was off and what was measured again for the next prediction.

A prediction on this machine rests on what was measured of it: its communication among the run's processes (cached
once per machine, :mod:`nbtrain.profiler.collectives`), the compute slowdown of processes sharing its cores, and the
model's layers timed here (cached per model in the kernel). A measurement taken in a busy minute would mislead every
later prediction. So after every run whose step time is outside 0.8–1.25 of its prediction, this says so, measures
the communication again — keeping, for each operation, the faster of the new and the cached measurement: a busy
minute only ever slows one down, so the faster is the less disturbed; after a run slower than predicted, both
pooled, since a measurement taken in a quiet minute can price a machine that then runs slower, which keeping the
faster could never correct (:meth:`~nbtrain.profiler.collectives.Links.pooled`) — and drops the kernel's timing of
this model and its calibrated rates, so that the next prediction times them afresh. It does so once per kernel and
process count: a second miss after that is the cost model's, and the note says so. A described cluster (the
catalog's figures, or a saved one), a GPU's datasheet rates and an uncalibrated cluster are not measurements to take
again: the note says what would measure them instead. ``NBTRAIN_REMEASURE=0`` keeps the note and measures nothing
again (a CI job's runs, whose timings only the job's own load moves).
"""

from __future__ import annotations

import os

from torch import nn

BAND = (0.8, 1.25)
"""Measured / predicted step time within which a prediction stands."""


def check_prediction(result, cluster, *, num_processes: int, model: nn.Module, progress=print) -> str | None:
    """The note a run's table gets when its measured step is outside :data:`BAND` of the prediction (None inside it,
    or without both), after measuring again what the prediction used (module docstring)."""
    predicted, measured = result.predicted_step_s, result.measured_step_s
    if not predicted or not measured or measured != measured:
        return None
    ratio = measured / predicted
    if BAND[0] <= ratio <= BAND[1]:
        return None
    from nbtrain.units import format_seconds

    off = (f"the step measured {format_seconds(measured)} where {format_seconds(predicted)} was predicted "
           f"({ratio:.2f}×, outside {BAND[0]:g}–{BAND[1]:g})")
    if cluster is None or cluster.source == "catalog":
        return off + ("; the cluster is described (its figures are the catalog's or yours), not measured here: "
                      "give it this machine's measurements (nbtrain.Cluster.this_machine()) for predictions that "
                      "follow it")
    if cluster.device != "cpu":
        return off + ("; this GPU's rates are its datasheet's and the catalog's efficiencies: "
                      "cluster.with_measurements(nbtrain.profiler.calibrate.calibrate('cuda')) measures them")
    if cluster.source != "calibrated":
        return off + ("; the cluster's rates are generic (not calibrated): nbtrain.Cluster.this_machine() measures "
                      "this machine's")
    from nbtrain.profiler import hardware, timed
    from nbtrain.profiler.collectives import remeasure_links, remeasured

    if os.environ.get("NBTRAIN_REMEASURE", "1") == "0":
        return off + ("; measuring this machine again is off (NBTRAIN_REMEASURE=0): "
                      "nbtrain.profiler.collectives.remeasure_links(num_processes) measures its communication again")
    if remeasured(num_processes) is not None:  # once a kernel: a second miss is the cost model's, not a busy minute
        return off + ("; this machine was measured again after an earlier run in this kernel, so the gap is the cost "
                      "model's (please report it with the plan and the model)")
    slower = ratio > BAND[1]
    if num_processes > 1:
        try:
            remeasure_links(num_processes, slower=slower, progress=progress)
        except Exception as error:  # noqa: BLE001 — a note, never a failed run
            return off + f"; measuring this machine's communication again failed ({type(error).__name__}: {error})"
    timed.forget(model)
    hardware.forget_rates("cpu")
    kept = "that and the cached measurement pooled" if slower else \
        "the faster of that and the cached measurement kept"
    return off + (f"; this machine's communication was measured again ({kept}, per operation), and its compute and "
                  "this model's layers will be timed again: the next prediction uses them")

