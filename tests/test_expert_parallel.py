"""Expert parallelism (``ep``): a mixture of experts' experts spread over data-parallel ranks, each rank holding
``E/ep`` of each layer's, every token sent to its experts' ranks and back by all-to-all. It trains exactly like one
process for transformers' Mixtral and Qwen3-MoE and for a plain-torch MoE that holds its experts as transformers
does (one module, 3-D weights, called with the router's choices), alone, with FSDP over the remaining ranks, with
checkpointing, clipping, offload and pipelines; a MoE whose own loop calls a ``ModuleList`` of experts is told why
it cannot be spread; and the planner prices ``ep`` (the experts' states on ``1/ep`` of the ranks, the dispatch, the
most loaded rank) and picks it where it pays."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain
from nbtrain.errors import InvalidPlanError
from nbtrain.planner.cost import CostModel, estimate
from nbtrain.planner.expert_cost import expected_max_normal, imbalance
from nbtrain.planner.plan import Plan
from nbtrain.planner.search_space import SearchOptions
from nbtrain.planner.strategy import Strategy
from nbtrain.profiler.model import lm_loss
from tests.distributed_fixtures import (BATCH, assert_trains_like_one_process, batches, distributed_losses,
                                        gloo_worker, reference_losses, spawn_group)
from tests.test_mixture_of_experts import PlainMoE, mixtral, qwen3_moe


class StackedExperts(nn.Module):
    """Every expert's two projections in one 3-D tensor each, called with the router's choices."""

    def __init__(self, d, h, n):
        super().__init__()
        self.num_experts = n
        self.up = nn.Parameter(torch.randn(n, d, h) * d**-0.5)
        self.down = nn.Parameter(torch.randn(n, h, d) * h**-0.5)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(top_k_index == e)
            out.index_add_(0, rows, F.gelu(x[rows] @ self.up[e]) @ self.down[e] * top_k_weights[rows, slot, None])
        return out


class StackedMoE(nn.Module):
    def __init__(self, d, h, n_experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = StackedExperts(d, h, n_experts)
        self.top_k = top_k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        return self.experts(flat, chosen, weights).reshape(x.shape)


def plain_stacked_moe():
    """tests.test_mixture_of_experts.PlainMoE with its experts held as one module."""
    model = PlainMoE()
    for block in model.blocks:
        block.moe = StackedMoE(32, 64)
    return model


# ---- train -----------------------------------------------------------------------------------------------------

SPREAD = ["ep=2", "dp_shard=2 ep=2 ac", "dp_shard=2 zero=2 ep=2 ac=op"]


@pytest.mark.parametrize("build, plans", [
    (mixtral, SPREAD), (qwen3_moe, SPREAD),
    # and without ep, as tests/test_mixture_of_experts.py trains the transformers models
    (plain_stacked_moe, SPREAD + ["dp_shard=2", "dp_replicate=2", "dp_shard=2 ac"]),
], ids=["mixtral", "qwen3-moe", "plain-torch"])
def test_experts_spread_over_two_ranks_train_like_one_process(build, plans):
    reference = assert_trains_like_one_process(build, plans, world=2)
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("build, plans", [
    (mixtral, ["dp_shard=4 ep=2", "dp_replicate=2 dp_shard=2 ep=2", "pp=2 mb=2 dp_shard=2 ep=2"]),
    (qwen3_moe, ["dp_shard=4 ep=2", "dp_shard=4 ep=4"]),
    (plain_stacked_moe, ["dp_shard=4 ep=2"]),
], ids=["mixtral", "qwen3-moe", "plain-torch"])
def test_experts_spread_with_fsdp_over_the_other_ranks_on_four_processes_train_like_one_process(build, plans):
    assert_trains_like_one_process(build, plans, world=4)


def test_clipping_counts_each_spread_expert_once():
    """The global norm over every rank's own experts and the sharded rest is one process's norm (clip_norm well
    below it, so every step clips)."""
    plans = ["ep=2", "dp_shard=2 ep=2"]
    reference = reference_losses(mixtral, clip_norm=0.05)
    got = distributed_losses(mixtral, plans, world=2, clip_norm=0.05)
    for plan in plans:
        assert got[plan] == pytest.approx(reference, rel=1e-4), plan


def test_the_trained_weights_of_spread_experts_with_their_update_offloaded_are_one_process_weights():
    from nbtrain.run.verify import verify

    report = verify("tests.any_models:mixtral", "dp_shard=2 ep=2 offload=1", processes=2, steps=5, batch=4, seq=16,
                    timeout=180)
    assert report.ok, str(report)


def test_a_plain_torch_mixture_that_computes_with_its_picked_tokens_without_branching_on_them_is_pipelined():
    """torch.export gives the count of an expert's tokens a symbol, so a forward that only computes with them traces
    into pipeline stages (the profile offers pipelines), and trains like one process; the ModuleList MoE's ``if
    rows.numel():`` does not (tests/test_mixture_of_experts.py: the profile says why)."""
    from nbtrain.run.verify import verify

    assert not nbtrain.profile(plain_stacked_moe(), batch_size=2, seq_len=16).arch["no_pipeline"]
    report = verify("tests.test_expert_parallel:plain_stacked_moe", "pp=2 mb=2", processes=2, steps=5, batch=4,
                    seq=16, timeout=180)
    assert report.ok, str(report)


def _held_experts(rank, world, port, plan_text, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.run.parallel.mesh import PlanMeshes
        from nbtrain.run.parallel.parallelize import parallelize

        torch.manual_seed(0)
        model = mixtral()
        whole = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
        plan = Plan.parse(plan_text, num_devices=world, num_layers=4)
        parallelize(model, plan, PlanMeshes(plan))
        experts = model.model.layers[0].mlp.experts
        local = experts.gate_up_proj.to_local()
        report({"local": tuple(local.shape), "num_experts": experts.num_experts,
                 "mine": torch.equal(local, whole[rank * 2:(rank + 1) * 2])})


@pytest.mark.parametrize("plan", ["ep=2", "dp_shard=2 ep=2"])
def test_each_rank_holds_its_own_half_of_the_experts(plan):
    held = spawn_group(_held_experts, 2, plan)  # rank 0's answer
    assert held["local"][0] == 2 and held["num_experts"] == 2 and held["mine"]


# ---- refuse ----------------------------------------------------------------------------------------------------

def test_a_mixture_whose_own_loop_calls_its_experts_is_told_why_they_cannot_be_spread():
    prof = nbtrain.profile(PlainMoE(), batch_size=2, seq_len=16)
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=2)
    with pytest.raises(InvalidPlanError, match="called one by one by its own loop"):
        estimate(Plan.parse("ep=2", num_devices=2, num_layers=len(prof.layers), global_batch=4), prof, cluster)
    best = nbtrain.plan(prof, nbtrain.Cluster.from_catalog("H100", num_devices=8), global_batch=16, seq_len=16)
    assert all(s.ep == 1 for s in best.layers)


@pytest.mark.parametrize("text, message", [
    ("dp_shard=2 ep=4", "use an ep that divides 2"),
    ("tp=2 ep=2", "not yet with tensor parallelism"),
])
def test_an_ep_the_layer_cannot_take_is_refused_with_what_to_use(text, message):
    with pytest.raises(InvalidPlanError, match=message):
        Plan.parse(text, num_devices=2, num_layers=4)


def test_an_ep_that_does_not_divide_the_experts_is_refused():
    prof = nbtrain.profile(mixtral(), batch_size=2, seq_len=16)  # 4 experts
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    with pytest.raises(InvalidPlanError, match="does not divide its 4 experts"):
        estimate(Plan.parse("ep=8", num_devices=8, num_layers=4, global_batch=8), prof, cluster)


# ---- plan --------------------------------------------------------------------------------------------------------

def test_spread_experts_keep_one_ep_th_of_their_model_states_per_rank():
    """ZeRO's arithmetic (bf16 weights and gradients, 12 bytes of fp32 Adam state a parameter): replicas that
    spread the experts over 8 ranks hold 1/8 of the experts' states and all of the rest."""
    prof = nbtrain.profile(mixtral(), batch_size=2, seq_len=16)
    model = CostModel(prof, nbtrain.Cluster.from_catalog("H100", num_devices=8), global_batch=8, seq_len=16)
    experts, total = prof.arch["layer_expert_params"][1], prof.layers[1].params
    replicated = model.layer(1, Strategy(dp_replicate=8), 1).memory
    spread = model.layer(1, Strategy(dp_replicate=8, ep=4), 1).memory
    assert replicated.params + replicated.grads + replicated.optimizer == pytest.approx(16 * total)
    assert spread.params + spread.grads + spread.optimizer == pytest.approx(16 * (total - experts + experts / 4))
    assert spread.params + spread.grads + spread.optimizer < replicated.params + replicated.grads + replicated.optimizer


def test_the_expected_most_loaded_rank_is_an_order_statistic_of_a_random_router():
    # closed forms: E[max of 2 standard normals] = 1/sqrt(pi), of 3 = 3/(2 sqrt(pi))
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-4)
    # against a simulated router: every rank's 512 pairs sent to one of 8 ranks at random
    rng, ep, pairs = random.Random(0), 8, 512
    trials = [max(_loads(rng, ep, pairs)) / pairs for _ in range(300)]
    assert imbalance(ep, pairs) == pytest.approx(sum(trials) / len(trials), rel=0.02)


def _loads(rng, ep, pairs):
    loads = [0] * ep
    for _ in range(ep * pairs):
        loads[rng.randrange(ep)] += 1
    return loads


def test_the_planner_spreads_the_experts_of_a_mixtral_wide_model_on_many_gpus_and_they_fit():
    """A Mixtral-8x7B-wide model (4 of its 32 blocks) on 64 H100s: spreading its experts spares their gathers and
    gradient syncs, and the plan fits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(num_hidden_layers=4))
    prof = nbtrain.profile(model, batch_size=1, seq_len=4096)
    assert prof.active_params < prof.params
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=64)
    best = nbtrain.plan(prof, cluster, global_batch=128, seq_len=4096)
    assert any(s.ep > 1 for s in best.layers[1:-1])
    assert best.predicted.memory_bytes <= cluster.device_memory
    without = nbtrain.plan(prof, cluster, global_batch=128, seq_len=4096,
                           options=SearchOptions(allow_ep=False))
    assert best.predicted.step_time_s < without.predicted.step_time_s


def _gradients(rank, world, port, plans, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from torch.distributed.tensor import DTensor

        from nbtrain.profiler.model import lm_loss
        from nbtrain.run.parallel.mesh import PlanMeshes
        from nbtrain.run.parallel.parallelize import parallelize

        ids, targets = next(batches())
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this data-parallel rank's sequences
        found = {}
        for text in plans:
            torch.manual_seed(0)
            model = mixtral()
            plan = Plan.parse(text, num_devices=world, num_layers=4)
            trained = parallelize(model, plan, PlanMeshes(plan))
            lm_loss(trained(ids[rows]), targets[rows]).backward()
            found[text] = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                           for name, p in model.named_parameters() if ".experts." in name}
        report(found)


def test_the_experts_gradients_are_one_process_gradients():
    """Each expert's owner receives the gradients of every rank's tokens: scaled to the mean over all ranks, they
    are the gradients of one process on the whole batch (checked directly: Adam's update is blind to a gradient's
    scale, so the losses alone would not show a wrong one)."""
    torch.manual_seed(0)
    model = mixtral()
    ids, targets = next(batches())
    lm_loss(model(ids), targets).backward()
    reference = {name: p.grad for name, p in model.named_parameters() if ".experts." in name}
    plans = ["ep=2", "dp_shard=2 ep=2"]
    got = spawn_group(_gradients, 2, plans)
    for plan in plans:
        assert set(got[plan]) == set(reference)
        for name, grad in reference.items():
            assert torch.allclose(got[plan][name], grad, rtol=1e-4, atol=1e-7), (plan, name)
