"""Hybrid parallelism of one model, as a plan gives it per layer (Galvatron-BMW: a strategy per layer).

``parallelize`` is the recipe, in torchtitan's order: tensor parallelism (DTensor, ``parallelize_module``), then
activation checkpointing, then FSDP2 (``fully_shard``: ZeRO-2/3, HSDP) or DDP; ``mesh`` builds the plan's device
meshes; ``relayout`` moves activations between layers whose (dp, tp) layouts differ; ``pipeline`` runs the stages
with ``torch.distributed.pipelining`` (GPipe, 1F1B: Narayanan et al. 2021), and ``traced_stages`` cuts models nbtrain
does not know by tracing them.
"""
