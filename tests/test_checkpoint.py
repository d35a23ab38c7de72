"""Checkpoints: a run saved under one plan goes on under another exactly as if it had never stopped; a worker killed
while training or while saving loses nothing but the steps after the last complete checkpoint.

The reference for every resumed run is the same run uninterrupted: its losses after the resume point, and its
final weights, must be those of the resumed run (fp32 tolerance, as `nbtrain verify` compares).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

import nbtrain
import nbtrain.run.state.checkpoint as checkpoint_module
from nbtrain.errors import CheckpointError, InvalidArgumentError, WorkerError
from nbtrain.run.state.checkpoint import CheckpointFolder
from nbtrain.run.verify import LOSS_RTOL, WEIGHT_RTOL

STEPS, SAVED_AT = 4, 2
BATCHES = None


def batches():
    """Four different batches: a run resumed at the wrong data position sees other batches and other losses."""
    global BATCHES
    if BATCHES is None:
        g = torch.Generator().manual_seed(7)
        ids = [torch.randint(0, 512, (4, 16), generator=g) for _ in range(STEPS)]
        BATCHES = [(x, torch.roll(x, -1, dims=1)) for x in ids]
    return BATCHES


def decaying(step: int) -> float:
    return 1.0 / (1.0 + step)


def train(plan: str, processes: int, steps: int = STEPS, data=None, **kwargs):
    torch.manual_seed(0)
    model = nbtrain.build_preset("llama-tiny", device="cpu")  # untied head: every plan below can take it
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    result = nbtrain.fit(model, data or batches(), plan=plan, steps=steps, num_processes=processes, lr=1e-2,
                         progress=False, timeout=180, **kwargs)
    return result, model, initial


def assert_same_training(resumed, resumed_model, reference, reference_model, initial):
    assert [r.step for r in resumed.records] == list(range(1, STEPS + 1))
    assert resumed.losses == pytest.approx(reference.losses, rel=LOSS_RTOL)
    apart = sum(float((v - reference_model.state_dict()[k]).square().sum())
                for k, v in resumed_model.state_dict().items())
    moved = sum(float((v - initial[k]).square().sum()) for k, v in reference_model.state_dict().items())
    assert apart ** 0.5 <= WEIGHT_RTOL * moved ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("saved,saved_processes,resumed,resumed_processes,options", [
    ("dp_replicate=2", 2, "tp=2", 2, {"lr_schedule": decaying}),       # DDP → Megatron TP, schedule half-way
    ("dp_shard=2 offload=1", 2, "ac", 1, {}),                          # FSDP2 + CPU-offloaded AdamW → one process
    ("pp=2 mb=2 | dp_shard=2", 4, "dp_shard=2 tp=1 ac", 2, {}),        # a 2-stage pipeline of FSDP2 → FSDP2
    ("0-2: tp=2; 3-5: dp_shard=2", 2, "dp_replicate=2 offload=1", 2, {}),  # mixed layouts → DDP with offload
])
def test_a_run_saved_under_one_plan_resumes_under_another_exactly(tmp_path, saved, saved_processes, resumed,
                                                                   resumed_processes, options):
    reference, reference_model, initial = train(saved, saved_processes, **options)
    first, _, _ = train(saved, saved_processes, steps=SAVED_AT, checkpoint_dir=tmp_path, checkpoint_every=1,
                        **options)
    assert first.checkpoint.endswith(f"step-{SAVED_AT:08d}")
    resumed_run, resumed_model, _ = train(resumed, resumed_processes, checkpoint_dir=tmp_path, resume=True, **options)
    assert resumed_run.resumed_at == SAVED_AT
    assert_same_training(resumed_run, resumed_model, reference, reference_model, initial)
    # two kept: the resumed run's save at its end, and the one it resumed from
    assert [c.step for c in CheckpointFolder(tmp_path).complete()] == [SAVED_AT, STEPS]


def killed_at(step: int):
    """The test's batches, but rank 1 dies by SIGKILL when it asks for batch ``step``."""
    def data(i):
        if i == step and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return batches()[i]
    return data


@pytest.mark.slow
def test_a_worker_killed_while_training_stops_the_run_which_resumes_from_the_last_checkpoint(tmp_path):
    reference, reference_model, initial = train("dp_shard=2", 2)
    with pytest.raises(WorkerError, match="rank 1 of 2 died with signal SIGKILL") as failure:
        train("dp_shard=2", 2, data=killed_at(3), checkpoint_dir=tmp_path, checkpoint_every=2)
    assert f"step-{2:08d} (step 2 of {STEPS})" in str(failure.value) and "resume=True" in str(failure.value)
    resumed, resumed_model, _ = train("dp_shard=2", 2, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_at == 2
    assert_same_training(resumed, resumed_model, reference, reference_model, initial)


@pytest.mark.slow
def test_a_worker_killed_while_saving_leaves_a_partial_checkpoint_that_is_never_read(tmp_path, monkeypatch):
    reference, reference_model, initial = train("dp_replicate=2", 2)
    real = checkpoint_module.write_shards

    def dies_during_the_third_save(tensors, folder):  # runs in the forked workers
        if folder.name.startswith(f"step-{3:08d}") and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0 has begun the save and waits for rank 1's part
        real(tensors, folder)

    monkeypatch.setattr(checkpoint_module, "write_shards", dies_during_the_third_save)
    with pytest.raises(WorkerError, match="rank 1 of 2 died with signal SIGKILL"):
        train("dp_replicate=2", 2, checkpoint_dir=tmp_path, checkpoint_every=1)
    monkeypatch.undo()
    folder = CheckpointFolder(tmp_path)
    assert [c.step for c in folder.complete()] == [1, 2]  # untouched; step 3 never completed
    assert [p.name for p in folder.partial()] == [f"step-{3:08d}.partial"]
    resumed, resumed_model, _ = train("dp_replicate=2", 2, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_at == 2
    assert_same_training(resumed, resumed_model, reference, reference_model, initial)
    assert [c.step for c in folder.complete()] == [2, 4] and folder.partial() == []  # stale partial removed


def test_a_folder_holding_another_runs_checkpoints_is_never_overwritten(tmp_path):
    train("ac", 1, steps=1, checkpoint_dir=tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="already holds checkpoints of a run .* pass resume=True"):
        train("ac", 1, steps=1, checkpoint_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_checkpoint_of_another_model_is_refused_before_launching(tmp_path):
    train("ac", 1, steps=1, checkpoint_dir=tmp_path)
    other = nbtrain.build_preset("gpt-tiny", device="cpu")  # another architecture, same vocabulary
    with pytest.raises(CheckpointError, match="was saved from another model"):
        nbtrain.fit(other, batches(), plan="ac", steps=2, num_processes=1, checkpoint_dir=tmp_path, resume=True,
                    progress=False)


def test_resume_without_a_checkpoint_yet_starts_afresh(tmp_path, capsys):
    result, _, _ = train("ac", 1, steps=1, checkpoint_dir=tmp_path / "new", resume=True)
    assert result.resumed_at == 0 and "training from step 0" in capsys.readouterr().out
    assert result.checkpoint.endswith(f"step-{1:08d}")
    assert result.records[-1].checkpoint_s > 0 and "checkpoints saved: 1" in str(result)  # its cost is shown


@pytest.mark.parametrize("kwargs,message", [
    ({"resume": True}, "resume=True needs checkpoint_dir"),
    ({"checkpoint_every": 2}, "checkpoint_every=2 needs checkpoint_dir"),
    ({"checkpoint_dir": "x", "checkpoint_every": 0}, "checkpoint_every must be a positive number of steps"),
])
def test_checkpoint_arguments_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        train("ac", 1, steps=1, **kwargs)


def test_only_complete_checkpoints_count(tmp_path):
    (tmp_path / "step-00000009.partial").mkdir()        # a save killed half-way
    (tmp_path / "step-00000008").mkdir()                 # shards without nbtrain.json: not complete either
    (tmp_path / "step-00000008" / ".metadata").write_bytes(b"")
    assert CheckpointFolder(tmp_path).latest() is None


def test_resuming_a_finished_run_trains_nothing_and_gives_back_its_weights(tmp_path):
    finished, trained, _ = train("ac", 1, steps=2, checkpoint_dir=tmp_path)
    again, model, _ = train("ac", 1, steps=2, checkpoint_dir=tmp_path, resume=True)  # a fresh model: same seed
    assert again.resumed_at == 2 and again.losses == finished.losses
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in model.state_dict().items())
