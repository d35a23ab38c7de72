"""Every tensor a worker computes on is on that worker's device, under every kind of plan.

The workers run with ``NBTRAIN_STRICT_DEVICE=1``: torch's default device is ``meta`` inside them, so a tensor that
nbtrain makes without naming its device (a loss accumulator, a receive buffer, a zero gradient) has no values, and
the run fails or the check below sees it; on this CPU-only machine that is how a forgotten ``device=`` shows, as a
CPU tensor would on a GPU. A forward pre-hook on every module of the model, registered before ``fit`` as a user's
hook would be, records in each worker whether the module's own parameters (each rank's local shard) and every tensor
passed to it are on ``nbtrain.run.placement.rank_device()``, the device the worker took for its rank.

The model is a transformers GPT-2 of its default config apart from the sizes (dropout on, the head tied to the token
embedding, fused Conv1D projections); traced pipeline stages are a BERT's, with dict batches.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

import nbtrain
from nbtrain.data import WIKIPEDIA, histogram_documents
from tests import any_models as zoo

pytestmark = pytest.mark.slow

VOCAB = 128


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4))


def _check_device(folder: str, name: str, module, args, kwargs) -> None:
    """In a worker, before ``module`` runs: are its inputs and its own parameters on this rank's device?"""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nbtrain.run.placement import rank_device

    if not dist.is_initialized():  # the notebook's own forward (fit checks pipeline stages against it): no worker
        return
    device = rank_device()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in module.parameters(recurse=False)]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    wrong = sorted({str(t.device) for t in local + inputs if t.device != device})
    with open(Path(folder) / f"rank{dist.get_rank()}.txt", "a") as f:
        f.write(f"{name}\t{','.join(wrong) or 'ok'}\t{device}\n")


def _watched(model, folder: Path):
    for name, module in model.named_modules():
        module.register_forward_pre_hook(functools.partial(_check_device, str(folder), name or "<model>"),
                                          with_kwargs=True)
    return model


def _seen(folder: Path) -> dict[str, set[str]]:
    """Module name → what its calls saw on any rank: 'ok', or the devices that were wrong."""
    seen: dict[str, set[str]] = {}
    for path in folder.glob("rank*.txt"):
        for line in path.read_text().splitlines():
            name, verdict, device = line.split("\t")
            assert device == "cpu", f"a worker took {device} as its device on a machine without a GPU"
            seen.setdefault(name, set()).add(verdict)
    return seen


def _assert_on_device(model, folder: Path, expected_prefix: str = "") -> None:
    seen = _seen(folder)
    assert seen, "no module ran in any worker"
    wrong = {name: verdicts - {"ok"} for name, verdicts in seen.items() if verdicts - {"ok"}}
    assert not wrong, f"modules that computed on tensors off their worker's device: {wrong}"
    layers = [name for name, m in model.named_modules() if name.startswith(expected_prefix) and
              any(True for _ in m.parameters(recurse=False))]
    assert set(layers) <= set(seen), f"modules with parameters that never ran: {sorted(set(layers) - set(seen))}"


@pytest.fixture
def strict(monkeypatch, tmp_path):
    monkeypatch.setenv("NBTRAIN_STRICT_DEVICE", "1")
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    return tmp_path


PLANS = {
    "DDP": "dp_replicate=2",
    "FSDP2": "dp_shard=2 zero=3",
    "TP": "tp=2",
    "PP": "pp=2 mb=2",
    "per-layer mix": "0: dp_shard=2; 1: tp=2 ac; 2: dp_replicate=2; 3: dp_shard=2",
    "offload": "dp_shard=2 offload=1",
}


@pytest.mark.parametrize("kind", PLANS)
def test_each_plan_kind_computes_every_micro_batch_on_the_workers_device(strict, kind):
    model = gpt2()
    result = nbtrain.fit(_watched(model, strict), zoo.lm_batches(steps=2, vocab=VOCAB), plan=PLANS[kind], steps=2,
                         num_processes=2, timeout=240, progress=False)
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in result.records)
    _assert_on_device(model, strict, "transformer.h")
    # the trained weights come back to the notebook's model, in host memory
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_traced_pipeline_stages_train_with_every_tensor_nbtrain_makes_on_the_workers_device(strict):
    # a traced stage is a graph: the model's own modules (and hooks) no longer run in it, so the strict placement
    # is the check here (a receive buffer or accumulator made without its device would be on meta and fail)
    model = zoo.bert_mlm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = nbtrain.fit(model, zoo.mlm_batches(steps=2), plan="pp=2 mb=2", steps=2, num_processes=2,
                         loss_fn=zoo.mlm_loss, timeout=240, progress=False)
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in result.records)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("bert.encoder.layer.0") for k in changed) and \
        any(k.startswith("bert.encoder.layer.1") for k in changed), "both stages' trained weights came back"


def test_hot_switching_computes_every_bucket_on_the_workers_device(strict):
    model = gpt2()
    docs = histogram_documents(WIKIPEDIA, 200, scale=64, vocab_size=VOCAB, seed=3)
    nbtrain.fit(_watched(model, strict), docs, plan={32: "dp_replicate=2", 64: "dp_shard=2"}, steps=2,
                num_processes=2, tokens_per_step=256, timeout=240, progress=False)
    _assert_on_device(model, strict, "transformer.h")


def test_a_tensor_the_executor_makes_without_its_device_fails_the_run_under_strict_placement(strict, monkeypatch):
    # what this file relies on: the trainer's loss accumulator made as `torch.zeros(())`, with no device (on a GPU
    # machine, a CPU tensor beside CUDA ones), must not go unnoticed on this CPU-only machine
    import types

    import nbtrain.run.trainer as trainer_module
    from nbtrain.errors import WorkerError

    accumulate = trainer_module.Trainer._accumulate

    def forgets_the_device(self, ids, targets):
        return torch.zeros(()) + accumulate(self, ids, targets)

    # defined as if in nbtrain/run/trainer.py: strict placement looks at the module that makes the tensor
    made_in_the_trainer = types.FunctionType(forgets_the_device.__code__, vars(trainer_module), "_accumulate",
                                             closure=forgets_the_device.__closure__)
    monkeypatch.setattr(trainer_module.Trainer, "_accumulate", made_in_the_trainer)
    with pytest.raises(WorkerError, match="meta"):
        nbtrain.fit(gpt2(), zoo.lm_batches(steps=1, vocab=VOCAB), plan="dp_shard=2", steps=1, num_processes=2,
                    timeout=240, progress=False)
    monkeypatch.delenv("NBTRAIN_STRICT_DEVICE")
    nbtrain.fit(gpt2(), zoo.lm_batches(steps=1, vocab=VOCAB), plan="dp_shard=2", steps=1, num_processes=2,
                timeout=240, progress=False)  # on the CPU, without the check, the same code runs
