"""Mixture-of-experts layers as nbtrain reads them: how many experts, how many each token goes to, and which
parameters are the experts' (so that the profile can tell total parameters from active ones).

    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> facts = expert_facts(MixtralForCausalLM(MixtralConfig(num_hidden_layers=2, hidden_size=64,
    ...                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)))
    >>> facts.experts, facts.per_token, facts.params > 0
    (8, 2, True)

Read from the model's config where transformers keeps them (``num_local_experts`` for Mixtral, ``num_experts`` for
Qwen-MoE and OLMoE, ``n_routed_experts`` for DeepSeek; ``num_experts_per_tok`` for all of them), else from the
modules: a module called ``experts`` (a ``ModuleList`` of experts, or one module holding every expert's weights in
3-D tensors) whose parent says how many experts a token takes (``top_k`` or ``num_experts_per_tok``). A shared
expert (Qwen2-MoE, DeepSeek) runs on every token, so it is not among the experts' parameters here.

Whether the experts can be spread over ranks (expert parallelism, :mod:`nbtrain.expert_dispatch`) is
a fact of how the model holds and calls them: :func:`expert_parallel_problem`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_PER_TOKEN = ("num_experts_per_tok", "top_k", "moe_top_k", "num_experts_per_token")


@dataclass(frozen=True)
class ExpertFacts:
    experts: int
    """Experts in each mixture-of-experts layer (E)."""
    per_token: int
    """Experts each token is routed to (k)."""
    params: int
    """Parameters of all experts of all MoE layers, each counted once (``ModelProfile.active_params`` takes
    ``1 − k/E`` of them off the total)."""


def _first(obj, names) -> int:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each module that holds a layer's routed experts, outermost only."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if (leaf == "experts" or type(module).__name__.endswith("Experts")) and \
                not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return found


def expert_facts(model: nn.Module) -> ExpertFacts | None:
    """The model's mixture-of-experts facts, or None for a model without routed experts."""
    modules = expert_modules(model)
    if not modules:
        return None
    config = getattr(model, "config", None)
    experts, per_token = _first(config, _EXPERT_COUNTS), _first(config, _PER_TOKEN)
    name, first = modules[0]
    if not experts:
        if isinstance(first, nn.ModuleList):
            experts = len(first)
        else:
            stacked = [p for p in first.parameters(recurse=False) if p.dim() == 3]
            experts = stacked[0].shape[0] if stacked else 0
    if not per_token:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        router = getattr(parent, "gate", None) or getattr(parent, "router", None)
        per_token = _first(parent, _PER_TOKEN) or _first(router, _PER_TOKEN)
    if not experts or not per_token:
        return None
    seen = {id(p): p.numel() for _, module in modules for p in module.parameters()}
    return ExpertFacts(experts, per_token, sum(seen.values()))


def expert_parallel_problem(model: nn.Module, ep: int) -> str:
    """Why ``model``'s experts cannot be spread over ``ep`` ranks, or ``""`` when they can (or it has none)."""
    for name, module in expert_modules(model):
        stacked = dict(module.named_parameters(recurse=False))
        if isinstance(module, nn.ModuleList) or not stacked or any(p.dim() != 3 for p in stacked.values()):
            return (f"its experts ('{name}', a {type(module).__name__}) are modules called one by one by its own "
                    "loop; nbtrain spreads experts held as one module with 3-D weights (expert first), called "
                    "with the router's choices, as transformers' MoE models hold them")
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or any(p.shape[0] != experts for p in stacked.values()):
            return f"its experts ('{name}') do not say how many they are (num_experts)"
        if experts % ep:
            return f"ep={ep} does not divide the {experts} experts of '{name}'; use an ep that divides {experts}"
    return ""


def expert_params_by_layer(layers: list[list[nn.Module]]) -> list[int]:
    """Parameters of the routed experts inside each layer's modules (0 for a layer without experts), each counted
    once: what expert parallelism spreads over the ``ep`` ranks."""
    out = []
    for modules in layers:
        seen = {id(p): p.numel() for module in modules for _, experts in expert_modules(module)
                for p in experts.parameters()}
        out.append(sum(seen.values()))
    return out
