"""A folder of training checkpoints: written sharded by every rank, complete or ignored, resumable by another plan.

    >>> folder = CheckpointFolder("runs/gpt")
    >>> folder.save(state, progress)      # in every worker: step-00000006/ appears only once it is whole
    >>> found = folder.latest()           # the newest complete checkpoint (a Checkpoint), or None
    >>> progress = found.load(state)      # in every worker, under any plan: weights, AdamW state, progress

Each checkpoint is a folder ``step-NNNNNNNN`` holding ``torch.distributed.checkpoint`` files (every rank writes the
shards it holds; :mod:`nbtrain.run.state.training_state` names them plan-independently) and ``nbtrain.json``: the step,
the data position, the learning-rate schedule's position, the RNG state and the loss history. A save writes into
``step-NNNNNNNN.partial`` and rank 0 renames it once every rank has written and ``nbtrain.json`` is on disk: a
worker killed while saving leaves a ``.partial`` folder, which is never read, and the previous checkpoint stays
untouched. Only after the rename are checkpoints older than the last ``keep`` removed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nbtrain.checks import positive_int
from nbtrain.errors import CheckpointError, InvalidArgumentError
from nbtrain.run.trainer import StepRecord

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})$")
META = "nbtrain.json"


@dataclass
class Progress:
    """Where a run stands after ``step`` steps: what a resumed run needs besides the tensors."""

    step: int
    """Steps done (skipped ones included): the next batch is the data source's ``step``."""
    schedule_epoch: int = 0
    """Steps of the learning-rate schedule taken (skipped steps take none)."""
    rng_state: torch.Tensor | None = None
    """Rank 0's torch CPU RNG state after the step (every rank of a run is seeded alike)."""
    cuda_rng_state: torch.Tensor | None = None
    """Rank 0's CUDA RNG state (its device's), on GPUs."""
    records: list[StepRecord] = field(default_factory=list)
    plan: str = ""
    num_processes: int = 0

    def to_json(self) -> dict:
        return {"format": FORMAT, "step": self.step, "data_position": self.step,
                "schedule_epoch": self.schedule_epoch, "rng_state": _encode(self.rng_state),
                "cuda_rng_state": _encode(self.cuda_rng_state), "plan": self.plan,
                "num_processes": self.num_processes, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                "records": [asdict(r) for r in self.records]}

    @classmethod
    def from_json(cls, data: dict) -> Progress:
        return cls(data["step"], data.get("schedule_epoch", 0), _decode(data.get("rng_state")),
                   _decode(data.get("cuda_rng_state")), [StepRecord(**r) for r in data.get("records", [])],
                   data.get("plan", ""), data.get("num_processes", 0))

    @staticmethod
    def random_states() -> dict:
        """This process's RNG states, as ``Progress(rng_state=..., cuda_rng_state=...)`` takes them."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return {"rng_state": torch.get_rng_state(), "cuda_rng_state": cuda}


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint on disk."""

    path: Path
    step: int

    def progress(self) -> Progress:
        return Progress.from_json(json.loads((self.path / META).read_text()))

    def saved_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every saved tensor's key and global shape (DCP's metadata: no tensor is read)."""
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(self.path)).read_metadata().state_dict_metadata
        return {key: tuple(m.size) for key, m in meta.items() if hasattr(m, "size")}

    def load(self, state) -> Progress:
        """In every worker: load the weights and optimizer state into ``state`` (a TrainingState of this plan) and
        set the RNG; returns the run's progress."""
        import torch.distributed.checkpoint as dcp

        templates = state.templates(set(self.saved_shapes()))
        dcp.load(templates, checkpoint_id=str(self.path))
        state.apply(templates)
        progress = self.progress()
        if progress.rng_state is not None:
            torch.set_rng_state(progress.rng_state)
        if progress.cuda_rng_state is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(progress.cuda_rng_state)
        return progress


class CheckpointFolder:
    """The checkpoints of one run (module docstring); ``keep`` complete ones stay."""

    def __init__(self, path, keep: int = 2):
        self.path, self.keep = Path(path), keep

    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first (``.partial`` folders and folders without ``nbtrain.json`` are not)."""
        if not self.path.is_dir():
            return []
        found = []
        for child in self.path.iterdir():
            if _NAME.match(child.name) and (child / META).is_file() and (child / ".metadata").is_file():
                found.append(Checkpoint(child, _step_of(child)))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def partial(self) -> list[Path]:
        """Folders of saves that never completed (a worker killed while saving)."""
        return sorted(self.path.glob("step-*.partial")) if self.path.is_dir() else []

    def save(self, state, progress: Progress) -> Checkpoint:
        """In every worker of the run (collective): write ``state`` and ``progress`` as ``step-NNNNNNNN``."""
        final = self.path / f"step-{progress.step:08d}"
        partial = final.with_name(final.name + ".partial")
        rank0 = dist.get_rank() == 0
        if rank0:
            if final.exists():
                raise CheckpointError(f"{final} exists already; nothing was overwritten. Resume from it, or save "
                                      "this run into another checkpoint_dir")
            shutil.rmtree(partial, ignore_errors=True)  # an earlier attempt at this step, killed while writing
            partial.mkdir(parents=True)
        dist.barrier()
        write_shards(state.to_save(), partial)
        if rank0:
            _write_atomically(partial / META, json.dumps(progress.to_json(), indent=1))
            os.replace(partial, final)
            _sync_dir(self.path)
            self._prune(progress.step)
        dist.barrier()  # no rank goes on (and may die) before the checkpoint is whole
        return Checkpoint(final, progress.step)

    def _prune(self, newest: int) -> None:
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)
        for stale in self.partial():
            if _step_of(stale) < newest:
                shutil.rmtree(stale, ignore_errors=True)


def write_shards(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every rank writes its shards of ``tensors`` into ``folder`` (DCP; the coordinator writes ``.metadata``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=str(folder))


def check_same_model(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """Refuse, before launching, a checkpoint of another model: every weight must be saved with this shape."""
    from nbtrain.run.state.training_state import trained_tensors
    from nbtrain.run.state.weights import layer_prefixes

    saved = {k[len("model."):]: shape for k, shape in checkpoint.saved_shapes().items() if k.startswith("model.")}
    here = {name: tuple(t.shape) for name, t in trained_tensors(model, layer_prefixes(model)).items()}
    where = f"{checkpoint.path} was saved from another model"
    missing = sorted(set(here) - set(saved))
    if missing:
        raise CheckpointError(f"{where}: it lacks {_some(missing)}; resume with the model that saved it, or start "
                              "afresh in another checkpoint_dir")
    extra = sorted(set(saved) - set(here))
    if extra:
        raise CheckpointError(f"{where}: it holds {_some(extra)}, which this model does not have; resume with the "
                              "model that saved it, or start afresh in another checkpoint_dir")
    for name, shape in here.items():
        if saved[name] != shape:
            raise CheckpointError(f"{where}: {name} has shape {saved[name]} there and {shape} here; resume with the "
                                  "model that saved it, or start afresh in another checkpoint_dir")


def _encode(state: torch.Tensor | None) -> str | None:
    return None if state is None else base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str | None) -> torch.Tensor | None:
    return None if text is None else torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def folder_for_run(model: torch.nn.Module, checkpoint_dir, every, resume: bool, steps: int | None = None):
    """``fit``'s checkpoint folder and the checkpoint to start from (None: afresh), checked before launching.
    Resuming a run already at ``steps`` or beyond trains nothing: a note says so."""
    if every is not None:
        positive_int(every, f"checkpoint_every must be a positive number of steps, got {every!r}")
    if checkpoint_dir is None:
        if every is not None or resume:
            flag = "resume=True" if resume else f"checkpoint_every={every}"
            raise InvalidArgumentError(f"{flag} needs checkpoint_dir: the folder the run's checkpoints go in")
        return None, None
    folder = CheckpointFolder(Path(checkpoint_dir).resolve())
    latest = folder.latest()
    if latest is not None and not resume:
        raise CheckpointError(f"{folder.path} already holds checkpoints of a run (the newest after step "
                              f"{latest.step}); pass resume=True to go on from it, or give another checkpoint_dir "
                              "(nothing there was changed)")
    if latest is None:
        if resume:
            _say(f"no complete checkpoint in {folder.path} yet: training from step 0")
        return folder, None
    check_same_model(latest, model)
    for stale in folder.partial():
        if _step_of(stale) > latest.step:
            _say(f"note: {stale.name} was never completed (a worker stopped while saving it); it is not used")
    saved = latest.progress()
    _say(f"resuming from {latest.path}: step {latest.step}, saved under '{saved.plan}' in {saved.num_processes} "
         "process(es)")
    if steps is not None and latest.step >= steps:
        _say(f"note: the run in {folder.path} is already at step {latest.step} of steps={steps}: nothing to train; "
             "pass a larger steps to go on")
    return folder, latest


def _say(text: str) -> None:
    """Print ``text`` once per run: in the launching process, or on rank 0 of torchrun's / accelerate's ranks (each
    of which calls ``fit``)."""
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)


def with_resume_hint(error: BaseException, folder, steps: int) -> BaseException:
    """``error`` with where the last complete checkpoint is and how to go on from it."""
    latest = folder.latest()
    if latest is None:
        hint = f"No checkpoint in {folder.path} was completed before it stopped."
    else:
        hint = (f"The last complete checkpoint is {latest.path} (step {latest.step} of {steps}); go on from it under "
                f"any plan and process count with fit(..., checkpoint_dir={str(folder.path)!r}, resume=True) or "
                f"%%autoparallel --launch --resume {folder.path}")
    if isinstance(error, KeyboardInterrupt):
        return KeyboardInterrupt(f"training interrupted; the workers were stopped. {hint}")
    error.args = (f"{error.args[0]} {hint}", *error.args[1:])
    return error


def _step_of(folder: Path) -> int:
    """The step of ``step-NNNNNNNN`` or ``step-NNNNNNNN.partial``."""
    return int(folder.name[len("step-"):len("step-") + 8])


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
