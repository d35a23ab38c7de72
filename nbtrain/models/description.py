"""One description of a model that the profiler, the planner and the executor all read, derived from the model.

    >>> from tests.any_models import qwen2
    >>> d = describe(qwen2())
    >>> d.names[0], d.names[1], d.names[-1]
    (['model.embed_tokens'], ['model.layers.0'], ['model.norm', 'lm_head'])
    >>> d.tensor_parallel[1][:2]
    [('model.layers.0.self_attn.q_proj', 'colwise'), ('model.layers.0.self_attn.k_proj', 'colwise')]
    >>> d.no_tensor_parallel, d.stages
    ('', 'hf-decoder')

**Layers** are what the profiler times one by one: what runs before the repeated blocks, each block, what runs
after (:func:`layer_slots`). A model with no list of repeated blocks is one layer. **Tied** parameters are found by
identity between the first and the last layer (a head tied to the token embedding). **Tensor parallelism** comes
from a plan in Hugging Face's vocabulary (:mod:`nbtrain.models.tensor_parallel`): the user's (``tp_plan=``), else
the model's own (``config.base_model_tp_plan`` and the class's ``_tp_plan``), else nbtrain's table for its GPT and
for GPT-2 (transformers ships none for it); the embedding and the head split the vocabulary wherever the plan says
nothing of them. A model whose blocks no plan splits has none, and ``no_tensor_parallel`` says why. **Pipeline
stages** (``stages``) are cut at layer boundaries where the executor knows how to run a layer on the hidden state
alone; ``no_pipeline`` says why not elsewhere. **Sequence parallelism** (``sequence_parallel``) runs a block's
norms on the rank's part of the sequence, gathers it before the attention and the MLP, and reduce-scatters their
row-wise projections' output (:func:`sequence_roles`); a block where nbtrain cannot do that safely (no norm it
knows, active dropout, a module it does not know to run token by token) has a reason in
``no_sequence_parallel``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from nbtrain.errors import InvalidPlanError
from nbtrain.models.adapters import ModelFamily, detect_family, hf_inner
from nbtrain.models.lora import split_lora
from nbtrain.models.tensor_parallel import (HEAD_NORM, check_style, first_argument, matched_plan, tp_plan_example,
                                             unknown_styles, unknown_styles_reason)

Slot = tuple[nn.Module, str]
"""``(parent, attribute)``: where a module of a layer sits, so a wrapper can replace it."""

NBTRAIN_GPT_TP = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
                  "blocks.*.attn.o": "rowwise", "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.gate": "colwise",
                  "blocks.*.mlp.fc2": "rowwise"}
"""nbtrain's GPT, Megatron's split: q, k, v and the MLP's first layer(s) by output, the projections by input."""

GPT2_TP = {"h.*.attn.c_attn": "packed_colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
           "h.*.mlp.c_proj": "rowwise"}
"""Hugging Face GPT-2 (relative to ``model.transformer``): the same split of its ``Conv1D`` layers."""


def slot_module(parent: nn.Module, attr: str) -> nn.Module:
    return getattr(parent, attr)  # a ModuleList's items too ("0"), and a traced graph's (not indexable)


def set_slot_module(parent: nn.Module, attr: str, module: nn.Module) -> None:
    setattr(parent, attr, module)


def layer_slots(model: nn.Module, family: ModelFamily | None = None) -> list[list[Slot]]:
    """For each profiled layer (embeddings, every block, the head), the slots of the modules that hold it.

    The modules registered before the list of blocks, on the way down to it, are the first layer (nbtrain's GPT:
    ``embed``; GPT-2: ``wte``, ``wpe``); each block is a layer; those registered after it, innermost first, are the
    last (a final norm, then the head), as the profiler cuts the model. Modules without parameters are left out
    (nothing to shard or update). A model without a list of blocks is one layer: the model itself."""
    family = family or detect_family(model)
    if not family.blocks_path:
        return [[(WholeModel(model), "model")]]
    before, after, parent = [], [], model
    for part in family.blocks_path.split("."):
        names = list(parent._modules)
        i = names.index(part)
        before += [(parent, n) for n in names[:i] if parent._modules[n] is not None]
        after = [(parent, n) for n in names[i + 1:] if parent._modules[n] is not None] + after
        parent = parent._modules[part]

    seen: set[int] = set()

    def with_parameters(slots):  # each module once (T5's decoder holds the shared embedding a second time)
        kept = [(p, a) for p, a in slots if any(True for _ in slot_module(p, a).parameters())
                and id(slot_module(p, a)) not in seen]
        seen.update(id(slot_module(p, a)) for p, a in kept)
        return kept

    return [with_parameters(before)] + [[(parent, str(i))] for i in range(len(parent))] + [with_parameters(after)]


class WholeModel:
    """The slot of a model that is one layer: it has no parent to replace it in (a wrapper goes on its forward)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __getattr__(self, name):  # slot_module(root, "model")
        if name == "model":
            return self.__dict__["model"]
        raise AttributeError(name)


def tied_slots(layers: list[list[Slot]]) -> list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]]:
    """``((module, name) in the first layer, (module, name) in the last)`` for each parameter they share (a head
    tied to the token embedding), found by identity before any wrapping or sharding."""
    if len(layers) < 2:
        return []
    first = {}
    for parent, attr in layers[0]:
        for module in slot_module(parent, attr).modules():
            for name, p in module.named_parameters(recurse=False):
                first.setdefault(id(p), (module, name))
    pairs = []
    for parent, attr in layers[-1]:
        for module in slot_module(parent, attr).modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in first:
                    pairs.append((first[id(p)], (module, name)))
    return pairs


@dataclass(eq=False)
class ModelDescription:
    """What nbtrain knows about one model (module docstring)."""

    model: nn.Module
    family: ModelFamily
    layers: list[list[Slot]]
    names: list[list[str]]
    """The dotted name of each layer's modules in the model."""
    tensor_parallel: list[list[tuple[str, str]]]
    """Per layer, ``(module name, style)`` of each module tensor parallelism splits (empty: none)."""
    no_tensor_parallel: str = ""
    """Why the model's blocks cannot be split by tensor parallelism (empty: they can)."""
    stages: str = ""
    """How the executor runs a layer as a pipeline stage: ``layers`` (each layer takes and returns one tensor),
    ``hf-gpt2``, ``hf-decoder`` (a Hugging Face decoder, a stage run by the model's own forward:
    nbtrain.models.stages), ``traced`` (any other model with repeated blocks: its forward traced and cut,
    nbtrain.run.parallel.traced_stages); empty: none."""
    no_pipeline: str = ""
    """Why the model cannot be cut into pipeline stages (empty: it can)."""
    ties: list = field(default_factory=list)
    """:func:`tied_slots` of the layers."""
    no_offload: str = ""
    """Why the executor does not run the CPU update offload on this model (empty: it does)."""
    splits_tied: bool = False
    """Whether a tied embedding and head may be split: vocabulary-parallel under tensor parallelism (one DTensor
    for both, laid out alike: rows of the table, output features of the head) and across pipeline stages (a copy in
    the first and the last, their gradients summed). Hugging Face models, whose tie is the token table and the head
    the vocabulary split names; nbtrain's own GPT keeps its tie whole, in one stage."""
    sequence_parallel: list[list[tuple[str, str]]] = field(default_factory=list)
    """Per layer, ``(module name, role)`` of what sequence parallelism changes in a block (:func:`sequence_roles`;
    empty for the embedding and the head, which run on the whole sequence)."""
    no_sequence_parallel: list[str] = field(default_factory=list)
    """Per layer, why sequence parallelism cannot run there (empty: it can)."""
    unsplit_blocks: dict[int, str] = field(default_factory=dict)
    """Blocks the tensor-parallel plan splits none of, in a model where it splits others (Jamba's Mamba layers
    beside its attention layers), each with why: they run with tp=1."""

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def splits_heads(self, layer: int) -> bool:
        """Whether tensor parallelism gives each rank a part of this layer's heads (their count must divide by tp)."""
        return any(style in ("colwise", "packed_colwise") for _, style in self.tensor_parallel[layer])

    def local_heads(self, layer: int, tp: int) -> None:
        """After tensor parallelism split block ``layer``: attributes a block reads its head count from, made this
        rank's (GPT-2's attention splits ``c_attn``'s output by ``split_size`` and views it by ``num_heads``; the
        Llama-like ones view by ``-1`` and need nothing)."""
        if self.family.name == "hf-gpt2" and 0 < layer < len(self.layers) - 1:
            parent, attr = self.layers[layer][0]
            attn = slot_module(parent, attr).attn
            attn.split_size //= tp
            attn.num_heads //= tp

    def sequence_parallel_problem(self, layer: int) -> str:
        """Why layer ``layer`` cannot run with sequence parallelism (empty: it can)."""
        return self.no_sequence_parallel[layer] if layer < len(self.no_sequence_parallel) else ""

    def tensor_parallel_problem(self, layer: int, tp: int) -> str:
        """Why layer ``layer`` cannot be split ``tp`` ways (empty: it can)."""
        if tp <= 1:
            return ""
        if self.no_tensor_parallel and (0 < layer < len(self.layers) - 1 or len(self.layers) <= 2):
            return self.no_tensor_parallel
        if layer in self.unsplit_blocks:
            return self.unsplit_blocks[layer]
        for name, style in self.tensor_parallel[layer]:
            problem = check_style(name, self.module(name), style, tp)
            if problem:
                return problem
        return ""


def _hf_plan(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan, with names relative to ``model`` (a wrapper's, peft's, read from the
    Hugging Face model inside it)."""
    model, path = hf_inner(model)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = prefix if prefix and hasattr(model, prefix) and isinstance(getattr(model, prefix), nn.Module) else ""
    plan = {f"{path}{prefix}.{k}" if prefix else f"{path}{k}": v for k, v in base.items()}
    plan.update({f"{path}{k}": v for k, v in (getattr(model, "_tp_plan", None) or {}).items()})
    return plan


def _known_plan(model: nn.Module, family: ModelFamily) -> dict[str, str]:
    if family.name == "nbtrain-gpt":
        return dict(NBTRAIN_GPT_TP)
    if family.name == "hf-gpt2":
        return {f"transformer.{k}": v for k, v in GPT2_TP.items()} if hasattr(model, "transformer") else dict(GPT2_TP)
    return _hf_plan(model)


def _within(name: str, prefixes: list[str]) -> bool:
    """Whether the module ``name`` is one of ``prefixes`` or inside one (``""``: a layer's module without a name)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes if p)


def _vocabulary_split(model: nn.Module, layers: list[list[Slot]], names: list[list[str]],
                      found: dict[str, str]) -> None:
    """Where the plan says nothing of the first and last layers: the token table (the first layer's largest
    ``nn.Embedding``) splits the vocabulary, and the head (the last layer's last ``nn.Linear``) its output, gathered
    for the loss, as Megatron does (Shoeybi et al. 2019, §3)."""
    if len(layers) < 2:
        return
    for layer, kind, style in ((0, nn.Embedding, "embedding_rowwise"), (-1, nn.Linear, "colwise_gather_output")):
        if any(_within(n, names[layer]) for n in found):
            continue
        candidates = [(f"{name}.{n}" if n else name, m) for (parent, attr), name in zip(layers[layer], names[layer])
                      for n, m in slot_module(parent, attr).named_modules() if isinstance(m, kind)]
        if candidates and kind is nn.Embedding:
            found[max(candidates, key=lambda c: c[1].num_embeddings)[0]] = style
        elif candidates:
            found[candidates[-1][0]] = style


def _stages(model: nn.Module, family: ModelFamily, layers: list[list[Slot]]) -> tuple[str, str]:
    kind = type(model).__name__
    if len(layers) < 3:
        return "", f"{kind} has no list of repeated blocks to cut between"
    if family.name == "nbtrain-gpt":
        return "layers", ""
    if family.name == "hf-gpt2":
        return "hf-gpt2", ""
    return ("hf-decoder" if _runs_own_stages(model, family, layers) else "traced"), ""


def _runs_own_stages(model: nn.Module, family: ModelFamily, layers: list[list[Slot]]) -> bool:
    """Whether the model's own forward can run one pipeline stage's layers (models/stages.py: DecoderStage): a
    Hugging Face causal decoder whose first layer is its token embedding alone (its forward, given
    ``inputs_embeds``, then uses nothing of the first stage's) and whose forward takes ``inputs_embeds``."""
    model, _ = hf_inner(model)  # a wrapper's stages run the Hugging Face model's forward inside it
    config = getattr(model, "config", None)
    if not family.name.startswith("hf-") or getattr(config, "is_encoder_decoder", False) or \
            getattr(config, "is_decoder", True) is False:
        return False
    embeddings = getattr(model, "get_input_embeddings", None)
    try:
        table = embeddings() if callable(embeddings) else None
    except (NotImplementedError, AttributeError):
        return False
    first = [slot_module(parent, attr) for parent, attr in layers[0]]
    return table is not None and first == [table] and \
        "inputs_embeds" in inspect.signature(model.forward).parameters


def _first_split(split: list[list[tuple[str, str]]]) -> str:
    """The modules of the first block the plan splits, for a message (``model.layers.1.self_attn.q_proj, ...``)."""
    block = next(entries for entries in split[1:-1] if entries)
    return ", ".join(name for name, _ in block[:2]) + (", ..." if len(block) > 2 else "")


def describe(model: nn.Module, tp_plan: dict[str, str] | None = None) -> ModelDescription:
    """Describe ``model``; ``tp_plan`` (module-name patterns → styles, relative to ``model``) replaces the model's
    own tensor-parallel plan."""
    family = detect_family(model)
    layers = layer_slots(model, family)
    module_names = {id(m): n for n, m in model.named_modules()}
    names = [[module_names.get(id(slot_module(p, a)), "") for p, a in slots] for slots in layers]
    plan = dict(tp_plan) if tp_plan is not None else _known_plan(model, family)
    found = split_lora(model, matched_plan(model, plan, strict=tp_plan is not None)) if plan else {}
    _vocabulary_split(model, layers, names, found)
    split = [[(n, style) for n, style in found.items() if _within(n, layer_names)] for layer_names in names]
    kind = type(model).__name__
    why = ""
    source = "the plan given" if tp_plan is not None else \
        f"{type(getattr(model, 'config', None)).__name__}.base_model_tp_plan" if hasattr(model, "config") else \
        "nbtrain's tables"
    if len(layers) > 2 and not any(split[1:-1]):
        why = (f"{source} splits none of {kind}'s blocks' modules" if plan else
               f"{kind} has no tensor-parallel plan (transformers' config carries none, nbtrain knows none)") + \
            f"; give one{tp_plan_example(slot_module(*layers[1][0]), family.blocks_path)}"
    elif len(layers) <= 2:
        why = f"{kind} has no list of repeated blocks for tensor parallelism to split"
    if tp_plan is None and unknown_styles(plan) and len(layers) > 2:  # the model's own plan splits its blocks in a
        why = unknown_styles_reason(model, plan)  # way nbtrain does not run
    if family.name == "hf-gpt2" and getattr(model.config, "add_cross_attention", False):
        why = "GPT-2 blocks with cross-attention have no tensor-parallel split in nbtrain yet"
    unsplit = [] if why or len(layers) <= 2 else [
        f"{source} splits none of its modules ({type(slot_module(*layers[i][0])).__name__}; the plan splits "
        f"{_first_split(split)})" for i in range(1, len(layers) - 1) if not split[i]]
    unsplit_layers = [i for i in range(1, len(layers) - 1) if not why and len(layers) > 2 and not split[i]]
    stages, no_pipeline = _stages(model, family, layers)
    no_offload = ""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        # seen on T5: exact without clipping, but with clip_norm the weights part (8e-2 after 3 steps) from one
        # process's; until that is found, an encoder-decoder is not offloaded
        no_offload = (f"the CPU update offload of an encoder-decoder ({kind}) does not yet train like one process "
                      "with gradient clipping; plan without offload")
    ties = tied_slots(layers)
    vocabulary = {n for n, style in split[0] + split[-1] if style in ("embedding_rowwise", "colwise_gather_output")}
    splits_tied = family.splits_tied or family.name.startswith("hf-") and bool(ties) and all(
        module_names.get(id(a)) in vocabulary and module_names.get(id(b)) in vocabulary and a_name == b_name == "weight"
        for (a, a_name), (b, b_name) in ties)
    roles, no_sp = [], []
    for i, (slots, layer_names) in enumerate(zip(layers, names)):
        block = 0 < i < len(layers) - 1
        found_roles, problem = sequence_roles(slot_module(*slots[0]), layer_names[0], split[i]) if block else ([], "")
        roles.append(found_roles)
        no_sp.append(problem)
    return ModelDescription(model, family, layers, names, split, why, stages, no_pipeline, ties, no_offload,
                            splits_tied, roles, no_sp, dict(zip(unsplit_layers, unsplit)))


NORMS = (nn.LayerNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    """A norm torch's ``SequenceParallel`` runs on a part of the sequence: ``nn.LayerNorm``, ``nn.RMSNorm``, or a
    Python RMSNorm / LayerNorm without submodules (Hugging Face's ``LlamaRMSNorm``), which normalise each token."""
    return isinstance(module, NORMS) or (type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
                                         and not any(True for _ in module.children()))


def sequence_roles(block: nn.Module, name: str, split: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str]:
    """``([(module name, role)], problem)`` of sequence parallelism in ``block`` (named ``name``, split by TP as
    ``split`` says): its norms run on the rank's part of the sequence (``sequence_parallel``), each direct child
    that holds a row-wise projection (the attention, the MLP) gathers its hidden state (``gather_input:ARG``, ARG
    the name of its forward's first parameter), and the row-wise projections reduce-scatter
    (``rowwise_sequence_output``); what the block's own forward does between them (residual adds) is token by token.
    ``problem`` says why nbtrain cannot run it so (the roles are then empty):

        >>> from nbtrain.models import GPT, GPTConfig
        >>> d = describe(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)))
        >>> d.sequence_parallel[1][:2], d.no_sequence_parallel
        ([('blocks.0.ln_1', 'sequence_parallel'), ('blocks.0.attn', 'gather_input:x')], ['', '', ''])
    """
    kind = f"{name} ({type(block).__name__})"
    for n, module in block.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            return [], (f"{name}.{n} is dropout with p={module.p:g}: on its part of the sequence each rank would "
                        "draw its own mask, unlike one process; set the model's dropout to 0 (e.g. config "
                        "resid_pdrop=0.0)")
    odd = sorted({style for _, style in split} - {"colwise", "rowwise", HEAD_NORM})  # a head's norm runs between
    if odd:
        return [], (f"{kind} is split by the TP style(s) {', '.join(odd)}; nbtrain runs sequence parallelism on "
                    "blocks split colwise → rowwise only")
    rowwise = [n for n, style in split if style == "rowwise"]
    for n in rowwise:
        module = block.get_submodule(n[len(name) + 1:] if name else n)
        if type(module) is not nn.Linear:
            return [], (f"{n} is a {type(module).__name__}; nbtrain's sequence parallelism reduce-scatters the "
                        "output of nn.Linear row-wise projections only")
    roles, norms = [], 0
    for child_name, child in block.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if _is_norm(child):
            roles.append((full, "sequence_parallel"))
            norms += 1
        elif any(_within(n, [full]) and n != full for n in rowwise):
            roles.append((full, f"gather_input:{first_argument(child)}"))
        elif any(True for _ in child.parameters()):
            return [], (f"{full} ({type(child).__name__}) is neither a norm nor a module holding a row-wise "
                        "projection, so nbtrain does not know that it runs token by token on a part of the sequence")
    missing = [what for what, found in (("a norm nbtrain knows (LayerNorm, RMSNorm)", norms),
                                        ("a row-wise projection", rowwise)) if not found]
    if missing:
        return [], f"{kind} has no {' and no '.join(missing)} to run sequence-parallel"
    # a LoRA B beside a row-split base runs on the rank's part of the sequence (A's outputs reduce-scattered): its
    # weight, whole on every rank, sums its gradient over the ranks as a norm's does (nbtrain.models.lora)
    adapters = [(f"{n.rpartition('.lora_A.')[0]}.lora_B.{n.rpartition('.lora_A.')[2]}", "sequence_parallel_local")
                for n in rowwise if ".lora_A." in n]
    return roles + [(n, "rowwise_sequence_output") for n in rowwise] + adapters, ""


def described(model: nn.Module) -> ModelDescription:
    """The description ``parallelize`` made of ``model`` before it wrapped and sharded its layers (its block list may
    no longer look repeated: some blocks checkpointed, some not), or a new one."""
    return model.__dict__.get("_nbtrain_description") or describe(model)


def check_tensor_parallel_plan(model: nn.Module, tp_plan: dict[str, str]) -> None:
    """Refuse a user's plan that names no module or a style nbtrain does not run (one line, before any launch)."""
    if not isinstance(tp_plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()):
        raise InvalidPlanError(f"tp_plan must be a dict of module-name patterns to styles, e.g. "
                               f"{{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}}, got {tp_plan!r}")
    matched_plan(model, tp_plan)
