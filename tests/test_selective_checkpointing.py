"""Selective activation checkpointing: per-op (``ac=op``, matmul and attention outputs kept) and every k-th layer
(``ac=1/k``) are written, run, profiled and priced.

Plans train like one process (rel. 1e-4 over 5 AdamW steps in fp32, as tests/test_parallelize.py). The profiler's
count of what ``ac=op`` keeps is checked against the bytes a real block leaves alive after its forward on the CPU
with no checkpointing, full checkpointing and the executor's own ``ac=op`` policy.
"""

from __future__ import annotations

import copy
import functools
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import nbtrain
from nbtrain.errors import InvalidPlanError
from nbtrain.planner.cost import CostModel
from nbtrain.planner.selective_cost import NON_MATMUL_SHARE
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy
from nbtrain.profiler.result import ModelProfile
from nbtrain.run.parallel.parallelize import checkpoint_kwargs
from tests.distributed_fixtures import gpt, hf_llama, llama, losses_by_world
from tests.planner_fixtures import cluster, layer, per_token, profile

# ---- the grammar ------------------------------------------------------------------------------------------------


def test_ac_op_and_every_kth_layer_round_trip_through_the_compact_form():
    plan = Plan.parse("0-3: dp_shard=2 ac=1/2; 4-5: tp=2 ac=op", num_devices=2, num_layers=6)
    assert [s.ac for s in plan.layers] == [False, True, False, True, "op", "op"]
    assert str(plan) == "0: dp_shard=2; 1: dp_shard=2 ac; 2: dp_shard=2; 3: dp_shard=2 ac; 4-5: tp=2 ac=op"
    assert Plan.parse(str(plan), num_devices=2, num_layers=6) == plan
    assert [s.ac for s in Plan.parse("ac=1/3", num_devices=1, num_layers=6).layers] == [False, False, True] * 2
    assert Plan.parse("ac=1/1", num_devices=1, num_layers=3) == Plan.parse("ac", num_devices=1, num_layers=3)


def test_strategy_ac_takes_true_false_and_op_and_old_saved_plans_still_load():
    assert Strategy(ac=True).ac is True and Strategy().ac is False and Strategy(ac="op").ac == "op"
    assert Strategy(ac="full") == Strategy(ac=True) and str(Strategy(ac="op")) == "ac=op"
    assert Strategy.from_dict({"dp_shard": 2, "ac": True, "zero": 3, "tp": 1, "dp_replicate": 1, "offload": 0.0}).ac
    assert Strategy.from_dict(Strategy(dp_shard=2, ac="op").to_dict()) == Strategy(dp_shard=2, ac="op")
    with pytest.raises(InvalidPlanError, match=r"ac='sometimes' is not valid: .* 'op'"):
        Strategy(ac="sometimes")


@pytest.mark.parametrize("text, needle", [
    ("ac=foo", "'ac=foo': checkpointing is written 'ac' (full recomputation), 'ac=op'"),
    ("ac=1/0", "'ac=1/0': every k-th layer needs k ≥ 1"),
    ("ac=2/3", "'ac=2/3': checkpointing is written"),
    ("ac=op ac", "'ac' repeats 'ac' (already 'ac=op')"),
    ("dp_shard=2 sac", "unknown key 'sac' in 'sac'; did you mean ac=op (per-op selective checkpointing)"),
])
def test_bad_checkpointing_says_which_forms_there_are(text, needle):
    with pytest.raises(InvalidPlanError) as err:
        Plan.parse(text, num_devices=2, num_layers=4)
    assert needle in str(err.value)


# ---- the cost model ---------------------------------------------------------------------------------------------


def test_ac_op_prices_the_kept_bytes_and_the_recomputed_non_matmul_ops():
    # per token: 1000 bytes saved without checkpointing, 300 kept by ac=op, 500 written by what it recomputes
    block = layer("blocks.0", "block", params=10**6, act=1000, out=100, fwd=10**6,
                  scaling={"selective_bytes": per_token(300), "recompute_bytes": per_token(500)})
    embed = layer("embed", "embedding", params=10**3, act=10, out=100, fwd=0)
    prof = profile([embed, block], seq_len=100)
    cpu = cluster(num_devices=1, devices_per_node=1, device="cpu")  # its copy rate, 1 GB/s, is memory bandwidth
    model = CostModel(prof, cpu, global_batch=1)
    none, op, full = (model.layer(1, Strategy(ac=ac), 1) for ac in (False, "op", True))
    assert (none.activations, op.activations, full.activations) == (100_000, 30_000, 10_000)  # full: the input
    assert op.transient == 70_000 and full.transient == 100_000  # what is recomputed is back during backward
    fwd = 10**6 * 100 / 1e12
    assert op.time.compute - none.time.compute == pytest.approx(500 * 100 / 1e9)  # bytes written / bandwidth
    assert full.time.compute - none.time.compute == pytest.approx(fwd)
    gpu = CostModel(prof, cluster(num_devices=1, devices_per_node=1), global_batch=1)  # no memory bandwidth known
    extra = gpu.layer(1, Strategy(ac="op"), 1).time.compute - gpu.layer(1, Strategy(), 1).time.compute
    assert extra == pytest.approx(NON_MATMUL_SHARE * fwd)


def test_ac_op_prices_the_projection_matmuls_it_drops_at_the_layers_forward_rate():
    # per token: 10^6 forward FLOPs, of which ac=op recomputes 3·10^5 (the dropped projections) and 500 bytes
    block = layer("blocks.0", "block", params=10**6, act=1000, out=100, fwd=10**6,
                  scaling={"selective_bytes": per_token(300), "recompute_bytes": per_token(500),
                           "recompute_matmul_flops": per_token(3 * 10**5)})
    embed = layer("embed", "embedding", params=10**3, act=10, out=100, fwd=0)
    model = CostModel(profile([embed, block], seq_len=100), cluster(num_devices=1, devices_per_node=1, device="cpu"),
                      global_batch=1)
    none, op = (model.layer(1, Strategy(ac=ac), 1) for ac in (False, "op"))
    fwd = 10**6 * 100 / 1e12
    assert op.time.compute - none.time.compute == pytest.approx(500 * 100 / 1e9 + 0.3 * fwd)


def test_a_profile_saved_before_selective_bytes_loads_and_keeps_everything_under_ac_op():
    prof = nbtrain.profile(gpt(), batch_size=1, seq_len=8, dtype="fp32")
    old = prof.to_dict()
    for saved in old["layers"]:
        for q in ("selective_bytes", "recompute_bytes"):
            del saved[q], saved["scaling"][q]
    again = ModelProfile.from_dict(old)
    assert [x.selective_bytes for x in again.layers] == [x.activation_bytes for x in again.layers]
    assert again.at(2, 8).layers[1].selective_bytes == prof.at(2, 8).layers[1].activation_bytes


# ---- the profiler against torch ---------------------------------------------------------------------------------


class _Created(TorchDispatchMode):
    """Every storage an op creates while entered: a weak reference (does it outlive the forward?) and its bytes."""

    def __init__(self):
        super().__init__()
        self.storages: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        return out


def _kept_after_forward(block, x, **checkpointing) -> int:
    """Bytes a block's forward leaves alive besides its output and its weights (views of them: ``aten.t``), which is
    what it keeps for backward, plus its input, which every form of checkpointing keeps: measured on real tensors,
    each storage once."""
    created = _Created()
    with created:
        out = checkpoint(block, x, **checkpointing) if checkpointing else block(x)
    not_saved = {out.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in block.parameters()}
    gc.collect()
    alive = {ptr: nbytes for ref, ptr, nbytes in created.storages if not ref.expired() and ptr not in not_saved}
    del out
    return x.untyped_storage().nbytes() + sum(alive.values())


@pytest.mark.parametrize("build", [gpt, llama], ids=["gpt", "llama"])
def test_profiled_selective_bytes_of_a_block_lie_between_no_and_full_checkpointing_as_torch_keeps_them(build):
    b, s = 2, 16
    prof = nbtrain.profile(build(), batch_size=b, seq_len=s, dtype="fp32")
    torch.manual_seed(0)
    model = build()
    block = model.blocks[0]
    x = torch.randn(b, s, model.config.n_embd, requires_grad=True)
    none = _kept_after_forward(block, x)
    full = _kept_after_forward(block, x, use_reentrant=False)
    op = _kept_after_forward(block, x, **checkpoint_kwargs("op"))  # the executor's own policy
    profiled = prof.layers[1].selective_bytes
    assert full < profiled < none
    assert profiled == pytest.approx(op, rel=0.05), (none, op, full, profiled)


@pytest.mark.parametrize("build", [gpt, llama], ids=["gpt", "llama"])
def test_profiled_recomputed_matmul_flops_are_what_torchs_flop_counter_sees_backward_redo(build):
    """torch's own FLOP counter on a real block: backward under the executor's ac=op policy does the dropped
    projections' FLOPs more than backward without checkpointing."""
    from torch.utils.flop_counter import FlopCounterMode

    b, s = 2, 16
    prof = nbtrain.profile(build(), batch_size=b, seq_len=s, dtype="fp32")
    torch.manual_seed(0)
    model = build()
    block = model.blocks[0]
    backward = {}
    for name, kwargs in (("none", None), ("op", checkpoint_kwargs("op"))):
        x = torch.randn(b, s, model.config.n_embd, requires_grad=True)
        with FlopCounterMode(display=False):  # forward and backward dispatched alike (under a mode both)
            out = checkpoint(block, x, **kwargs) if kwargs else block(x)
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        backward[name] = counter.get_total_flops()
    dropped = prof.layers[1].scaling["recompute_matmul_flops"](b, s)
    assert dropped > 0
    assert backward["op"] - backward["none"] == dropped


# ---- the executor: plans train like one process -----------------------------------------------------------------

TWO = ["dp_shard=2 ac=op", "tp=2 ac=op", "dp_replicate=2 ac=op", "pp=2 mb=2 | ac=op", "dp_shard=2 ac=1/2",
       "0: dp_shard=2; 1: dp_shard=2 ac=op; 2: dp_shard=2 ac; 3: dp_shard=2 ac=op"]
FOUR = ["dp_shard=2 tp=2 ac=op"]


@pytest.fixture(scope="module", params=[gpt, hf_llama], ids=["gpt", "hf_llama"])
def runs(request):
    if request.param is hf_llama:
        pytest.importorskip("transformers")
    build = request.param
    return losses_by_world(build, {2: TWO, 4: FOUR})


@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(2, p) for p in TWO] + [(4, p) for p in FOUR])
def test_selective_checkpointing_trains_with_the_losses_of_one_process(runs, world, plan):
    reference, got = runs["reference"], runs[world][plan]
    assert got == pytest.approx(reference, rel=1e-4), f"{plan} on {world} processes"
    assert reference[-1] < reference[0]  # it did train


def test_a_model_that_is_one_layer_is_checkpointed_per_op_in_place_with_its_gradients_unchanged():
    from nbtrain.models.description import layer_slots
    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize
    from tests.distributed_fixtures import single_process_group

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    model = copy.deepcopy(reference)
    assert len(layer_slots(model)) == 1  # no blocks: the model is its one layer
    x = torch.randn(4, 8)
    with single_process_group():
        plan = Plan.parse("ac=op", num_devices=1, num_layers=1)
        model = parallelize(model, plan, PlanMeshes(plan))
        assert isinstance(model.forward, functools.partial)  # checkpointed in place: no parent holds a wrapper
        assert "context_fn" in model.forward.keywords  # per op
        model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=0)


def test_hot_switching_turns_a_layouts_wrappers_to_per_op_checkpointing_and_off():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize, set_checkpointing
    from tests.distributed_fixtures import single_process_group

    torch.manual_seed(0)
    reference = gpt()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 128, (2, 16))
    with single_process_group():
        plan = Plan.parse("ac", num_devices=1, num_layers=4)
        model = parallelize(model, plan, PlanMeshes(plan))
        wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
        assert len(wrappers) == 4
        set_checkpointing(model, "op")
        assert all("context_fn" in w.checkpoint_fn.keywords for w in wrappers)
        model(ids).float().square().mean().backward()
        set_checkpointing(model, False)
        assert not any(isinstance(w.checkpoint_fn, functools.partial) for w in wrappers)
    reference(ids).float().square().mean().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7)
