"""What the planner must know of the executor's reach on a model, from its description, kept in its profile's
``arch`` (:func:`planner_facts`).

    >>> from nbtrain.models.description import describe
    >>> from tests.any_models import qwen3
    >>> planner_facts(describe(qwen3()))["tp_whole_params"]      # per layer: each block's norms stay whole
    [0, 80, 80, 32]
"""

from __future__ import annotations

import math

from torch import nn

from nbtrain.models.description import ModelDescription, slot_module
from nbtrain.models.tensor_parallel import HEAD_NORM, split_dimension


COMMUNICATING = ("rowwise", "rowwise_split_input", "embedding_rowwise", "colwise_gather_output")
"""Tensor-parallel styles whose forward ends in a collective (an all-reduce of partial sums, or a gather)."""


def planner_facts(description: ModelDescription) -> dict:
    """What the planner must know of the executor's reach on this model, kept in the profile's ``arch``:
    ``no_tensor_parallel`` / ``no_pipeline`` / ``no_sequence_parallel`` (why not, the latter naming the first block
    it fails on; empty: it can), ``cuts_stages``, ``traced_stages`` (its
    stages are traced graphs, which run without tensor parallelism), ``splits_tied``, and
    ``tp_pairs`` (per layer, the styles that sum or gather in forward: the collectives TP issues each way),
    ``tp_gathers_output`` (layers whose output is gathered whole: an LM head), and
    ``tp_unit``, a number every tensor-parallel degree must divide (the split features, the heads when they are
    split; 0: no limit), and ``tp_whole_params`` (per layer, the parameters its plan leaves whole on every TP rank:
    norms, a router, and the experts of a mixture whose plan splits only its attention, as transformers 5.25's
    Mixtral and Qwen3-MoE plans do), and ``tp_unsplit_layers`` (blocks its plan splits none of, beside blocks it
    splits: Jamba's Mamba layers, which run with tp=1)."""
    sizes = []
    for layer, entries in enumerate(description.tensor_parallel):
        for name, style in entries:
            if style in ("colwise", "rowwise", "packed_colwise"):
                sizes.append(split_dimension(description.module(name), style)[1])
        if 0 < layer < len(description.layers) - 1 and description.splits_heads(layer):
            sizes += [n for n in (description.family.n_head, description.family.n_kv_head) if n]
    no_sp = next((f"layer {i}: {why}" for i, why in enumerate(description.no_sequence_parallel) if why), "")
    return {"no_tensor_parallel": description.no_tensor_parallel, "no_pipeline": description.no_pipeline,
            "no_sequence_parallel": no_sp,
            "no_offload": description.no_offload,
            "cuts_stages": bool(description.stages), "traced_stages": description.stages == "traced",
            "splits_tied": description.splits_tied,
            "tp_unit": math.gcd(*sizes) if sizes else 0,
            "tp_pairs": [max(1, sum(style in COMMUNICATING for _, style in entries)) if entries else 0
                         for entries in description.tensor_parallel],
            "tp_gathers_output": [i for i, entries in enumerate(description.tensor_parallel)
                                  if any(style == "colwise_gather_output" for _, style in entries)],
            "tp_whole_params": [_whole_params(description, i) for i in range(len(description.layers))],
            "tp_unsplit_layers": sorted(description.unsplit_blocks)}


def _whole_params(description: ModelDescription, layer: int) -> int:
    """Parameters of ``layer`` that no splitting style of its tensor-parallel plan reaches (each rank holds them
    whole); a layer shared with another (a tied head) counts what it owns."""
    split = {id(p) for name, style in description.tensor_parallel[layer] if style != HEAD_NORM
             for p in description.module(name).parameters()}
    held = {id(p): p for parent, attr in description.layers[layer] for p in slot_module(parent, attr).parameters()}
    return sum(p.numel() for key, p in held.items() if key not in split)
