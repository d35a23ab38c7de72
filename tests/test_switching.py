"""A step with hot switching trains exactly as one process on all the buckets at once.

Each step's global batch is three buckets of rows (8, 16 and 32 tokens, some targets ignored as padding and
document ends are); every bucket runs under a different layout in real gloo processes, with the weights switched
from the home layout (the longest bucket's) before and the gradients switched back after. The reference is one
process, one model, plain ``torch.optim.AdamW``, the token-level mean cross-entropy over every bucket of the step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from nbtrain.models import GPT
from tests.distributed_fixtures import GPT_TINY, gloo_worker, hf_llama, spawn_group

STEPS, LR = 4, 1e-2
ROWS = {8: 6, 16: 4, 32: 2}  # rows per bucket: 6 rows do not split into 4 data-parallel slices (padded)


@dataclass
class Rows:
    bound: int
    ids: torch.Tensor
    targets: torch.Tensor


def step_batches(step: int) -> list[Rows]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for bound, rows in ROWS.items():
        ids = torch.randint(0, GPT_TINY.vocab_size, (rows, bound), generator=g)
        targets = torch.randint(0, GPT_TINY.vocab_size, (rows, bound), generator=g)
        targets[torch.rand(rows, bound, generator=g) < 0.2] = -100
        out.append(Rows(bound, ids, targets))
    return out


def gpt():
    return GPT(GPT_TINY)


def logits(output):
    return getattr(output, "logits", output)  # a transformers model's output, or nbtrain's logits


def reference(build=gpt):
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        buckets = step_batches(step)
        tokens = sum(int((b.targets != -100).sum()) for b in buckets)
        loss = sum(F.cross_entropy(logits(model(b.ids)).reshape(-1, GPT_TINY.vocab_size), b.targets.reshape(-1),
                                   ignore_index=-100, reduction="sum") for b in buckets) / tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _worker(rank, world, port, strategies, offload, build, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.run.state.weights import gather_trained, trained_prefixes
        from nbtrain.run.switching.hot import HotSwitching

        switching = HotSwitching(build, strategies, lr=LR, offload=offload)
        records = [switching.step(step_batches(step)) for step in range(STEPS)]
        home = switching.home  # a pipelined home: each stage's weights, gathered to rank 0
        state = gather_trained(home.wrapped, home.plan, trained_prefixes(home.model, home.plan, home.meshes.stage))
        weights = io.BytesIO()
        torch.save(state, weights)
        offloaded = getattr(switching.optimizer, "last_overlapped", None)  # CPU updates queued during backward
        report(([r.loss for r in records], weights.getvalue(), records[-1], offloaded))


def assert_trains_as_one_process(result, build=gpt):
    losses, weights, last = result[:3]
    want_losses, want_state = reference(build)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    state = torch.load(io.BytesIO(weights))
    for name, want in want_state.items():
        if name.endswith(("attn.k.bias", "rotary_emb.inv_freq")):  # zero gradient in exact arithmetic: Adam moves rounding noise (test_fit)
            continue
        assert (state[name] - want).norm() <= 1e-4 * want.norm(), name
    # two layouts away from home, each switched there (weights) and back (gradients) in the step
    assert [s.what for s in last.switches] == ["weights", "gradients"] * 2
    assert set(last.bucket_seconds) == set(ROWS)


@pytest.mark.slow
def test_switching_between_ddp_fsdp_and_tensor_parallel_on_two_processes():
    assert_trains_as_one_process(spawn_group(
        _worker, 2, {8: "dp_replicate=2", 16: "dp_shard=2", 32: "tp=2"}, None, gpt))


@pytest.mark.slow
def test_switching_between_dp4_dp2_tp2_and_tp4_on_four_processes():
    assert_trains_as_one_process(spawn_group(
        _worker, 4, {8: "dp_replicate=4", 16: "dp_replicate=2 tp=2", 32: "tp=4"}, None, gpt))


@pytest.mark.slow
def test_switching_with_the_home_update_offloaded_to_the_cpu():
    """The home layout's update on the CPU (overlapped, landing at the next forward): the next step's switch reads
    the new weights, not the old ones."""
    assert_trains_as_one_process(spawn_group(
        _worker, 2, {8: "dp_replicate=2", 16: "tp=2", 32: "dp_shard=2"}, [0.0, 0.5, 1.0, 1.0], gpt))


def _checkpointing_worker(rank, world, port, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.run.switching.hot import HotSwitching

        switching = HotSwitching(lambda: GPT(GPT_TINY), {8: "dp_shard=2", 16: "dp_shard=2 ac", 32: "tp=2"}, lr=LR)
        shared = switching.layouts[next(k for k in switching.layouts if k.tp == 1)]
        calls = []
        shared.model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
        records = [switching.step(step_batches(step)) for step in range(STEPS)]
        report(([r.loss for r in records], len(switching.layouts), [s.what for s in records[-1].switches],
                len(calls)))


@pytest.mark.slow
def test_strategies_differing_only_in_checkpointing_share_one_layout_and_switch_it_per_bucket():
    losses, layouts, switches, calls = spawn_group(_checkpointing_worker, 2)
    assert losses == pytest.approx(reference()[0], rel=1e-4)
    assert layouts == 2 and switches == ["weights", "gradients"]  # one layout away from home, switched once
    # per step, block 0's attention runs once for the 8-token bucket and twice for the 16-token one (forward, then
    # recomputed in backward): checkpointing was on for the one bucket only
    assert calls == STEPS * 3


def _micro_batch_worker(rank, world, port, strategies, micro_rows, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.run.switching.hot import HotSwitching
        from nbtrain.tensor_memory import state_bytes

        switching = HotSwitching(lambda: GPT(GPT_TINY), strategies, lr=LR, micro_rows=micro_rows)
        away = [layout for layout in switching.layouts.values() if layout is not switching.home]
        records, resident = [], []
        for step in range(STEPS):
            records.append(switching.step(step_batches(step)))
            resident.append([state_bytes(layout.model) for layout in away])  # after the step: given back
        param_bytes = [sum(p.numel() * p.element_size() for p in layout.params) for layout in away]
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in switching.home.model.state_dict().items()}
        weights = io.BytesIO()
        torch.save(state, weights)
        report(([r.loss for r in records], weights.getvalue(), records[-1], resident, param_bytes))


@pytest.mark.slow
def test_buckets_in_micro_batches_accumulate_to_the_step_of_one_process_and_a_layout_left_holds_no_memory():
    """Each rank's 3 rows of 8 tokens in micro-batches of 2 (the last one padded with an empty row), the 16-token
    rows one at a time: the same step. After each step the layouts away from home hold no weight and no gradient
    (their storage given back), and while their bucket ran they held their weights beside the home's."""
    strategies = {8: "dp_replicate=2", 16: "dp_shard=2", 32: "tp=2"}
    losses, weights, last, resident, param_bytes = spawn_group(_micro_batch_worker, 2, strategies,
                                                               {8: 2, 16: 1, 32: 1})
    assert_trains_as_one_process((losses, weights, last))
    assert all(step == [0, 0] for step in resident), resident  # both away layouts given back, every step
    home_bytes = last.bucket_tensor_bytes[32]
    # measured during the short buckets: the home's states plus that layout's own weights (and gradients)
    assert last.bucket_tensor_bytes[8] >= param_bytes[0] and last.bucket_tensor_bytes[16] >= param_bytes[1]
    assert home_bytes > 0 and set(last.bucket_tensor_bytes) == set(ROWS)


PIPELINED = {8: "dp_replicate=4", 16: "pp=2 schedule=gpipe dp_replicate=2", 32: "pp=2 tp=2"}
"""HotSPa's shape on 4 processes: (dp, tp, pp) = (4,1,1) for the short rows, (2,1,2) in between (GPipe), (1,2,2)
for the longest (1F1B, the home: its two stages hold the master weights and the optimizer)."""


@pytest.mark.slow
@pytest.mark.parametrize("build", [gpt, hf_llama], ids=["nbtrain-gpt", "transformers-llama"])
def test_pipelined_buckets_between_data_parallel_ones_train_as_one_process_on_four_processes(build):
    """Each pipelined bucket runs its own micro-batches through the static pipeline's runner; the switch moves each
    stage's slices (a rank holds none of another stage's layers) and the gradients come home before the update."""
    result = spawn_group(_worker, 4, PIPELINED, None, build)
    assert_trains_as_one_process(result, build)
    assert {s.strategy for s in result[2].switches} == {PIPELINED[8], PIPELINED[16]}


@pytest.mark.slow
def test_an_offloaded_pipelined_home_takes_the_switched_gradients_into_its_cpu_update():
    """The home's update half on the CPU in each stage (overlapped with its last bucket's backward, landing at the
    next forward): the gradients switched home are in ``.grad`` before that backward hands them over, and the next
    step's switch reads the new weights."""
    strategies = {**PIPELINED, 32: "pp=2 tp=2 offload=0.5"}
    result = spawn_group(_worker, 4, strategies, None, gpt)
    assert_trains_as_one_process(result)
    assert result[3] > 0  # rank 0's stage queued CPU updates during its last backward, not after it


def planned_pipeline():
    """What the planner chooses for these buckets on 4 devices whose links are slow (1 MB/s) and memory tight
    (100 kB): pipelines, checkpointing per bucket inside one, and the home's update on the CPU."""
    import nbtrain
    from nbtrain.planner.cost import CostOptions
    from nbtrain.planner.switching.buckets import BucketOptions, plan_buckets
    from tests.planner_fixtures import cluster

    slow = cluster(4, 4, intra_node_bandwidth=1e6, inter_node_bandwidth=1e6)
    return plan_buckets(nbtrain.profile(gpt(), batch_size=1, seq_len=32), slow, list(ROWS.items()), memory=1e5,
                        options=BucketOptions(cost=CostOptions(headroom=0, reserve_bytes=0), merge=False))


@pytest.mark.slow
def test_a_plan_the_planner_makes_with_pipelined_buckets_and_an_offloaded_home_trains_as_one_process():
    hot = planned_pipeline()
    strategies = {bound: str(s) for bound, s in hot.strategies().items()}
    assert any(s.pp > 1 for s in hot.strategies().values()) and hot.home.offload > 0, strategies  # what it is about
    losses, weights, overlapped = spawn_group(_planned_worker, 4, strategies, hot.micro_rows())
    want_losses, want_state = reference()
    assert losses == pytest.approx(want_losses, rel=1e-4)
    state = torch.load(io.BytesIO(weights))
    for name, want in want_state.items():
        if not name.endswith("attn.k.bias"):  # zero gradient in exact arithmetic (as above)
            assert (state[name] - want).norm() <= 1e-4 * want.norm(), name
    assert overlapped > 0  # the home's CPU update ran during its last backward


def _planned_worker(rank, world, port, strategies, micro_rows, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.run.state.weights import gather_trained, trained_prefixes
        from nbtrain.run.switching.hot import HotSwitching

        switching = HotSwitching(gpt, strategies, lr=LR, micro_rows=micro_rows)  # offload: the home strategy's
        losses = [switching.step(step_batches(step)).loss for step in range(STEPS)]
        home = switching.home
        state = gather_trained(home.wrapped, home.plan, trained_prefixes(home.model, home.plan, home.meshes.stage))
        weights = io.BytesIO()
        torch.save(state, weights)
        report((losses, weights.getvalue(), getattr(switching.optimizer, "last_overlapped", 0)))
