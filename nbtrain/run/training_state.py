"""A training run's state in one layout every plan shares: the unwrapped model's names, AdamW's three tensors.

    >>> state = TrainingState(model, optimizer, mine)   # in every worker, after parallelize and the optimizer
    >>> tensors = state.to_save()                       # {"model.blocks.0.attn.qkv.weight": DTensor, ...,
    ...                                                 #  "optim.blocks.0.attn.qkv.weight.exp_avg": ..., ...}
    >>> templates = state.templates()                   # the same keys, tensors laid out as *this* plan holds them
    >>> dcp.load(templates, checkpoint_id=folder)       # DCP reshards from whatever layout saved them
    >>> state.apply(templates)                          # optimizer state in place (weights were loaded in place)

Names are those of the model as the user built it: DDP's ``module.`` and activation checkpointing's wrapper
disappear, FSDP2 and tensor parallelism keep names and turn tensors into DTensors, and a pipeline stage holds (and
saves) only the layers it trains. The optimizer's state is AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq`` per
parameter whatever optimizer holds it: torch's fused AdamW keeps them per parameter, the CPU update offload
(:class:`~nbtrain.run.offload.OffloadedAdamW`) per local shard in pieces; both are written as tensors shaped like
the parameter (DTensors for sharded ones), so a run saved with offload resumes without it, and the reverse.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nbtrain.run.mesh import local_shard

ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_WRAPPERS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str, wrapped_in_ddp: bool) -> str:
    """A parameter's name in the model as built: ``module.blocks.0._checkpoint_wrapped_module.attn.w`` →
    ``blocks.0.attn.w``."""
    if wrapped_in_ddp and name.startswith("module."):
        name = name[len("module."):]
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def trained_tensors(model: nn.Module, trained: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers a run saves, by canonical name: those under the ``trained`` prefixes
    (a pipeline stage's layers), each tensor once (a tied head is saved under the embedding's name)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp, seen, out = isinstance(model, DistributedDataParallel), set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = canonical_name(name, ddp)
        if id(tensor) in seen or not name.startswith(trained):  # a tied alias; another stage's layer
            continue
        seen.add(id(tensor))
        out[name] = tensor
    return out


class TrainingState:
    """The weights this process trains and their AdamW state, by canonical name (module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, trained: tuple[str, ...]):
        from nbtrain.run.offload import OffloadedAdamW

        self.model, self.optimizer = model, optimizer
        self.offloaded = isinstance(optimizer, OffloadedAdamW)
        self.tensors = trained_tensors(model, trained)  # name -> the parameter or persistent buffer itself
        self.names = {id(t): name for name, t in self.tensors.items()}

    def to_save(self) -> dict[str, torch.Tensor]:
        """Every tensor to write, by key: ``model.<name>`` and ``optim.<name>.<step|exp_avg|exp_avg_sq>``."""
        out = {f"model.{name}": t.detach() for name, t in self.tensors.items()}
        for name, param, entry in self._optimizer_entries():
            for key in ADAM_STATE:
                value = entry[key]
                if key != "step" and isinstance(param, DTensor) and not isinstance(value, DTensor):
                    value = _like(param, value)  # the offload keeps a local shard; write it as the DTensor's
                out[f"optim.{name}.{key}"] = value.detach()
        return out

    def templates(self, saved_keys: set[str]) -> dict[str, torch.Tensor]:
        """What to load in place: the weights themselves, and zero optimizer state laid out as this plan holds the
        parameters — only for the keys in ``saved_keys`` (a parameter without saved state gets none)."""
        out = {f"model.{name}": t.detach() for name, t in self.tensors.items() if f"model.{name}" in saved_keys}
        for name, param in self._parameters():
            if f"optim.{name}.exp_avg" not in saved_keys:
                continue
            out[f"optim.{name}.step"] = torch.zeros((), dtype=torch.float32, device=self._step_device(param))
            out[f"optim.{name}.exp_avg"] = torch.zeros_like(param.detach())
            out[f"optim.{name}.exp_avg_sq"] = torch.zeros_like(param.detach())
        return out

    @torch.no_grad()
    def apply(self, loaded: dict[str, torch.Tensor]) -> None:
        """Hand loaded optimizer state to the optimizer (the weights were loaded in place already)."""
        if self.offloaded:
            self._apply_offloaded(loaded)
            return
        for name, param in self._parameters():
            if f"optim.{name}.exp_avg" in loaded:
                self.optimizer.state[param] = {key: loaded[f"optim.{name}.{key}"] for key in ADAM_STATE}

    def _apply_offloaded(self, loaded: dict[str, torch.Tensor]) -> None:
        """The offload's own state-dict layout (offload_state.save_state): per index, local shards; no ``master``,
        so the masters come from the weights just loaded."""
        opt = self.optimizer
        sd = opt.state_dict()
        for i, param in enumerate(opt._params):
            name = self.names.get(id(param))
            if name is None or f"optim.{name}.exp_avg" not in loaded:
                sd["state"][i] = {}
                continue
            sd["state"][i] = {key: local_shard(loaded[f"optim.{name}.{key}"]) for key in ADAM_STATE}
        opt.load_state_dict(sd)

    def _parameters(self):
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) in self.names:
                    yield self.names[id(param)], param

    def _optimizer_entries(self):
        """``(name, parameter, {step, exp_avg, exp_avg_sq})`` for each parameter of this process with state."""
        if self.offloaded:
            state = self.optimizer.state_dict()["state"]
            for i, param in enumerate(self.optimizer._params):
                if id(param) in self.names and i in state:
                    yield self.names[id(param)], param, state[i]
            return
        for name, param in self._parameters():
            entry = self.optimizer.state.get(param)
            if entry and "exp_avg" in entry:
                yield name, param, entry

    def _step_device(self, param: torch.Tensor) -> torch.device | str:
        group = next(g for g in self.optimizer.param_groups if any(p is param for p in g["params"]))
        # torch's AdamW keeps ``step`` beside the parameter when fused or capturable, else on the CPU
        return param.device if group.get("fused") or group.get("capturable") else "cpu"


def _like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor laid out as ``param`` whose local shard is ``local`` (shaped like ``param``'s)."""
    out = torch.zeros_like(param.detach())
    out.to_local().copy_(local.reshape(out.to_local().shape))
    return out
