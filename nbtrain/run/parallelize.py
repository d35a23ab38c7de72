"""Apply a plan's per-layer strategies to a model: tensor parallel, then checkpointing, then FSDP2.

    >>> meshes = PlanMeshes(plan)                      # inside a launched worker
    >>> model = parallelize(model, plan, meshes)      # in place; returns the model

The order is torchtitan's, for the same reasons: TP first, because it replaces parameters by DTensors sharded
over the ``tp`` axis; checkpointing next, wrapping the TP'd block so the recomputed forward issues the same
collectives; FSDP2 last, because ``fully_shard`` must see the final modules and parameters (it shards the TP
DTensors a second time, over the data-parallel axes). Data parallel without sharding (``dp_replicate``) is FSDP2's
hybrid mode over the 2-D ``(dp_replicate, dp_shard)`` mesh: replicated across ``dp_replicate``, sharded across
``dp_shard`` (size 1: plain DDP semantics, gradients all-reduced).

ZeRO levels map to ``reshard_after_forward``: ZeRO-3 frees the gathered parameters after forward and gathers
again in backward; ZeRO-2 keeps them until backward (Zhao et al. 2023, PyTorch FSDP, §3.2).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nbtrain.errors import InvalidPlanError
from nbtrain.models.adapters import detect_family
from nbtrain.planner.strategy import Plan, Strategy
from nbtrain.run.mesh import PlanMeshes
from nbtrain.run.relayout import Relayout

# Megatron-LM's split of a transformer block (Shoeybi et al. 2019, §3): q, k, v and the MLP's first layer(s) by
# output features (each rank holds whole heads / hidden units), the output projections by input features, so a
# block needs one all-reduce after attention and one after the MLP.
BLOCK_TP = {
    "nbtrain-gpt": {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row",
                    "mlp.fc1": "col", "mlp.gate": "col", "mlp.fc2": "row"},
    "hf-llama": {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
                 "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"},
}


def layer_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(parent, attribute)`` of the module holding each profiled layer: embeddings, every block, the head."""
    family = detect_family(model)
    if family.name != "nbtrain-gpt":
        raise InvalidPlanError(f"the executor runs nbtrain's GPT for now; {type(model).__name__} "
                               f"({family.name}) is not supported yet")
    return [(model, "embed")] + [(model.blocks, str(i)) for i in range(len(model.blocks))] + [(model, "head")]


def _tp_style(kind: str):
    return ColwiseParallel() if kind == "col" else RowwiseParallel()


def _tensor_parallel(module: nn.Module, kind: str, family: str, mesh) -> None:
    if kind == "block":
        plan = {name: _tp_style(style) for name, style in BLOCK_TP[family].items() if _has(module, name)}
    elif kind == "embedding":
        # vocabulary-parallel embedding: each rank looks up its slice of the table, the partial rows are summed
        plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    else:
        plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}  # logits gathered for the loss
    parallelize_module(module, mesh["tp"], plan)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def parallelize(model: nn.Module, plan: Plan, meshes: PlanMeshes,
                mixed_precision: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Apply ``plan`` to the layers of ``model`` that this process's pipeline stage runs (all when pp = 1)."""
    family = detect_family(model).name
    slots = layer_modules(model)
    if len(slots) != plan.num_layers:
        raise InvalidPlanError(f"the plan has {plan.num_layers} layers but the model has {len(slots)}")
    tied = getattr(model, "config", None) is not None and getattr(model.config, "tie_embeddings", False)
    if tied and plan.layers[0].tp > 1:
        raise InvalidPlanError("tensor parallelism of tied embeddings is not supported yet: use tp=1, or a model "
                               "with tie_embeddings=False")
    kinds = ["embedding"] + ["block"] * (len(slots) - 2) + ["head"]
    start, end = plan.stage_ranges()[meshes.stage]
    policy = mixed_precision or MixedPrecisionPolicy()
    for i in range(start, end):
        s: Strategy = plan.layers[i]
        parent, attr = slots[i]
        module = getattr(parent, attr) if not attr.isdigit() else parent[int(attr)]
        mesh = meshes.for_strategy(s)
        if s.tp > 1:
            _tensor_parallel(module, kinds[i], family, mesh)
        if s.ac:
            module = checkpoint_wrapper(module)
            _set(parent, attr, module)
        if s.dp > 1:
            fully_shard(module, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=s.zero == 3,
                        mp_policy=policy)
        if i > 0 and plan.layers[i - 1].layout != s.layout:  # at a stage's start too: it receives i − 1's layout
            _set(parent, attr, Relayout(module, plan.layers[i - 1].layout, s.layout, meshes.stage_group))
    uniform = len({s.layout for s in plan.layers}) == 1
    s = plan.layers[start]
    if s.dp > 1 and plan.pp == 1 and uniform:  # the root gathers what no layer holds (nothing, for the GPT)
        fully_shard(model, mesh=meshes.for_strategy(s)["dp_replicate", "dp_shard"], mp_policy=policy)
    return model


def _set(parent: nn.Module, attr: str, module: nn.Module) -> None:
    if attr.isdigit():
        parent[int(attr)] = module
    else:
        setattr(parent, attr, module)
