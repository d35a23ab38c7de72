"""A training run's state in one layout every plan shares: the unwrapped model's names, AdamW's three tensors.

    >>> state = TrainingState(model, optimizer, mine)   # in every worker, after parallelize and the optimizer
    >>> tensors = state.to_save()                       # {"model.blocks.0.attn.q.weight": DTensor, ...,
    ...                                                 #  "optim.blocks.0.attn.q.weight.exp_avg": ..., ...}
    >>> templates = state.templates(set(tensors))       # those keys, tensors laid out as *this* plan holds them
    >>> dcp.load(templates, checkpoint_id=folder)       # DCP reshards from whatever layout saved them
    >>> state.apply(templates)                          # optimizer state in place (weights were loaded in place)

Names are those of the model as the user built it: DDP's ``module.`` and activation checkpointing's wrapper
disappear, FSDP2 and tensor parallelism keep names and turn tensors into DTensors, and a pipeline stage holds (and
saves) only the layers it trains. The optimizer's state is AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq`` per
parameter whatever optimizer holds it: torch's fused AdamW keeps them per parameter, the CPU update offload
(:class:`~nbtrain.run.offload.optimizer.OffloadedAdamW`) per local shard in pieces; both are written as tensors shaped like
the parameter (DTensors for sharded ones), so a run saved with offload resumes without it, and the reverse. A
DTensor whose shard is several blocks (GPT-2's fused q|k|v under TP) is written block by block
(:class:`StridedForDCP`), so its global view, the user's weight, is what any other plan reads back.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nbtrain.run.parallel.mesh import local_shard

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

    ddp, first_name, out = isinstance(model, DistributedDataParallel), {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = canonical_name(name, ddp)
        first = first_name.setdefault(id(tensor), name)  # a tied alias goes by the first name (the embedding's)
        if first in out or not name.startswith(trained):  # a tied alias saved already; another stage's layer
            continue
        out[first] = tensor  # the last pipeline stage's copy of a tied embedding: under the embedding's name
    return out


def for_dcp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as ``torch.distributed.checkpoint`` can write and read them in place: DTensors whose local shard
    is several blocks of the global tensor (``_StridedShard``: GPT-2's fused q|k|v, split per third) become
    :class:`StridedForDCP`, one chunk per block; everything else as it is."""
    return {k: StridedForDCP(v) if _is_strided(v) else v for k, v in tensors.items()}


def from_dcp(value: torch.Tensor) -> torch.Tensor:
    """The DTensor behind a :func:`for_dcp` stand-in (loaded in place), or ``value`` itself."""
    return value.dtensor if isinstance(value, StridedForDCP) else value


def _is_strided(t) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def local_indices(t: DTensor) -> list[torch.Tensor]:
    """For each dimension of ``t``, the global indices this rank's local shard holds, in local order: each
    placement's own split (what ``distribute_tensor`` does) applied to ``arange`` of that dimension."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate()
    out = []
    for dim, size in enumerate(t.shape):
        shape = [1] * t.ndim
        shape[dim] = size
        index = torch.arange(size, device="cpu").reshape(shape)  # metadata, read on the host
        for mesh_dim, placement in enumerate(t.placements):
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
                shards, _ = placement._split_tensor(index, mesh.size(mesh_dim), with_padding=False)
                index = shards[coordinate[mesh_dim]]
        out.append(index.reshape(-1))
    return out


def _runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(global start, length, local start)`` of each run of consecutive global indices."""
    runs, local = [], 0
    for value in indices.tolist():
        if runs and runs[-1][0] + runs[-1][1] == value:
            start, length, at = runs[-1]
            runs[-1] = (start, length + 1, at)
        else:
            runs.append((value, 1, local))
        local += 1
    return runs


class StridedForDCP(torch.Tensor):
    """A DTensor with a ``_StridedShard`` placement as ``torch.distributed.checkpoint`` sees it: the global shape,
    and one chunk per contiguous block of the global tensor that the local shard holds (DCP itself describes a
    DTensor's shard as one block, which for ``_StridedShard`` is wrong). Reads and writes go to views of the
    DTensor's local shard, so loading is in place. Only DCP's checkpoint protocol is implemented."""

    @staticmethod
    def __new__(cls, dtensor: DTensor):
        out = torch.Tensor._make_wrapper_subclass(cls, dtensor.shape, dtype=dtensor.dtype, device=dtensor.device)
        out.dtensor = dtensor
        return out

    def __init__(self, dtensor: DTensor):
        from itertools import product

        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        local = dtensor._local_tensor
        self.blocks = {}  # global offsets -> (chunk, local view)
        for runs in product(*[_runs(ix) for ix in local_indices(dtensor)]):
            offsets = torch.Size(start for start, _, _ in runs)
            sizes = torch.Size(length for _, length, _ in runs)
            view = local
            for dim, (_, length, at) in enumerate(runs):
                view = view.narrow(dim, at, length)
            self.blocks[offsets] = (ChunkStorageMetadata(offsets=offsets, sizes=sizes), view)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"StridedForDCP is only for torch.distributed.checkpoint (got {func})")

    def __create_write_items__(self, fqn: str, _):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk,
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.dtensor.size()))
                for offsets, (chunk, view) in self.blocks.items()]

    def __create_chunk_list__(self):
        return [chunk for chunk, _ in self.blocks.values()]

    def __get_tensor_shard__(self, index):
        return self.blocks[torch.Size(index.offset)][1]


class TrainingState:
    """The weights this process trains and their AdamW state, by canonical name (module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, trained: tuple[str, ...]):
        from nbtrain.run.offload.optimizer import OffloadedAdamW

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
        return for_dcp(out)

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
        return for_dcp(out)

    @torch.no_grad()
    def apply(self, loaded: dict[str, torch.Tensor]) -> None:
        """Hand loaded optimizer state to the optimizer (the weights were loaded in place already)."""
        if self.offloaded:
            self._apply_offloaded(loaded)
            return
        for name, param in self._parameters():
            if f"optim.{name}.exp_avg" in loaded:
                self.optimizer.state[param] = {key: from_dcp(loaded[f"optim.{name}.{key}"]) for key in ADAM_STATE}

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
            sd["state"][i] = {key: local_shard(from_dcp(loaded[f"optim.{name}.{key}"])) for key in ADAM_STATE}
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
