"""Tensor parallelism with sequence parallelism (``sp``): the grammar, the refusals, the cost model, and plans that
train exactly like one process (nbtrain's GPT in both shapes, a transformers Llama) on 2 and 4 gloo processes.

The reference for every loss is a one-process run (tests/distributed_fixtures.py); the reference for the cost
model is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), §4.2.2: with
tensor and sequence parallelism a layer's activations are ``34sbh/t + 5as²b/t``, i.e. the layer's without any
parallelism divided by ``t``, and a checkpointed layer keeps its input's ``sbh/t`` slice.
"""

from __future__ import annotations

import functools

import pytest
import torch

import nbtrain
from nbtrain.planner.search_space import SearchOptions
from nbtrain.errors import InvalidPlanError
from nbtrain.models import GPT, GPTConfig
from nbtrain.models.description import describe
from nbtrain.planner.cost import CostModel, estimate
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.run.parallel.parallelize import check_plan
from tests.distributed_fixtures import BATCH, SEQ, distributed_losses, gpt, hf_gpt2, hf_llama, llama, \
    reference_losses

TOL = 1e-4
LAYERS = 4  # embedding, 2 blocks, head

TWO = ["tp=2 sp", "0: tp=2; 1-2: tp=2 sp; 3: tp=2", "0: tp=2; 1: tp=2 sp; 2: tp=2; 3: tp=2 sp",
       "0: dp_replicate=2; 1-2: tp=2 sp; 3: dp_shard=2"]
"""Every layer sp; sp blocks between plain TP ends (the hidden state sliced after the embedding, gathered before
the head); sp and plain TP blocks alternating; sp blocks between data-parallel ends (the batch and the sequence
re-laid-out together)."""
FOUR = ["dp_shard=2 tp=2 sp", "pp=2 mb=2 | tp=2 sp ac"]
"""FSDP2 over TP+SP (torchtitan's 2-D layout), and a pipeline whose stages hand on the whole sequence, checkpointed."""


def _close(losses, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


# -- training like one process ------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [llama, gpt, hf_llama], ids=["gpt-llama-shape", "gpt-gpt2-shape", "hf-llama"])
def test_sequence_parallel_plans_on_two_processes_match_single_process_losses(build):
    reference = reference_losses(build)
    losses = distributed_losses(build, TWO, world=2)
    for plan in TWO:
        assert _close(losses[plan], reference) <= TOL, (plan, losses[plan], reference)


@pytest.mark.parametrize("build", [llama, hf_llama], ids=["gpt-llama-shape", "hf-llama"])
def test_sequence_parallel_with_fsdp_and_pipeline_on_four_processes_matches_single_process_losses(build):
    reference = reference_losses(build)
    losses = distributed_losses(build, FOUR, world=4)
    for plan in FOUR:
        assert _close(losses[plan], reference) <= TOL, (plan, losses[plan], reference)


@pytest.mark.parametrize("model", ["qwen2", "mistral"])
def test_sequence_parallel_on_other_llama_like_transformers_decoders_matches_single_process_losses(model):
    from nbtrain.run.verify import verify

    report = verify(f"tests.any_models:{model}", "tp=2 sp", processes=2, steps=5, batch=4, seq=16, timeout=180)
    assert report.ok and max(report.loss_differences) <= TOL, str(report)


# -- the grammar ---------------------------------------------------------------------------------------------------

def test_sp_round_trips_through_the_compact_form():
    for text in ("tp=2 sp", "0: tp=2; 1-2: tp=2 sp; 3: tp=2", "dp_shard=2 tp=2 sp ac", "pp=2 mb=2 | tp=2 sp"):
        plan = Plan.parse(text, num_devices=4, num_layers=LAYERS)
        assert Plan.parse(str(plan), num_devices=4, num_layers=LAYERS) == plan
        assert Plan.from_dict(plan.to_dict()) == plan
    mixed = Plan.parse("0: tp=2; 1-2: tp=2 sp; 3: tp=2", num_devices=2, num_layers=LAYERS)
    assert str(mixed) == "0: tp=2; 1-2: tp=2 sp; 3: tp=2"
    assert [s.layout for s in mixed.layers] == [(1, 2, False), (1, 2, True), (1, 2, True), (1, 2, False)]
    assert Strategy.from_dict(Strategy(tp=2, sp=True).to_dict()) == Strategy(tp=2, sp=True)


@pytest.mark.parametrize("text, says", [("sp", "needs tp > 1"), ("dp_shard=2 sp", "needs tp > 1"),
                                        ("tp=2 sp=1", "sp is a flag"), ("tp=2 sp sp", "repeats 'sp'"),
                                        ("tp=2 sequence_parallel", "did you mean sp")])
def test_sp_mistakes_are_refused_with_what_to_write(text, says):
    with pytest.raises(InvalidPlanError, match=says):
        Plan.parse(text, num_devices=2, num_layers=LAYERS)


def test_strategy_refuses_sp_without_tp():
    with pytest.raises(InvalidPlanError, match="needs tp > 1"):
        Strategy(dp_shard=2, sp=True)


def test_strategy_space_offers_sp_beside_plain_tp():
    space = strategy_space(4, devices_per_node=8, allow_ac=False, zero_levels=(3,))
    assert [str(s) for s in space] == ["dp_replicate=4", "dp_replicate=2 dp_shard=2", "dp_shard=4",
                                       "dp_replicate=2 tp=2", "dp_replicate=2 tp=2 sp", "dp_shard=2 tp=2",
                                       "dp_shard=2 tp=2 sp", "tp=4", "tp=4 sp"]
    assert not any(s.sp for s in strategy_space(4, devices_per_node=8, allow_sp=False))


# -- refusals: where nbtrain cannot run sp ------------------------------------------------------------------------

def test_sp_on_a_block_with_active_dropout_is_refused_naming_the_dropout():
    model = hf_gpt2()
    model.transformer.h[0].attn.resid_dropout.p = 0.1
    plan = Plan.parse("0: dp_replicate=2; 1-2: tp=2 sp; 3: dp_replicate=2", num_devices=2, num_layers=LAYERS)
    with pytest.raises(InvalidPlanError, match=r"layer 1 .*transformer\.h\.0\.attn\.resid_dropout is dropout with "
                                               r"p=0\.1.*leave out 'sp'"):
        check_plan(model, plan)


def test_sp_on_blocks_nbtrain_cannot_run_it_on_is_refused_and_not_offered():
    model = hf_gpt2()  # a fused Conv1D attention, split packed_colwise
    plan = Plan.parse("0: dp_replicate=2; 1-2: tp=2 sp; 3: dp_replicate=2", num_devices=2, num_layers=LAYERS)
    with pytest.raises(InvalidPlanError, match="packed_colwise.*leave out 'sp'"):
        check_plan(model, plan)
    check_plan(model, Plan.parse("0: dp_replicate=2; 1-2: tp=2; 3: dp_replicate=2", num_devices=2,
                                 num_layers=LAYERS))  # the same without sp runs
    from tests.any_models import plain_lm
    lm = plain_lm()  # its blocks' linears are the block's own children: no module to gather the input at
    d = describe(lm, {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"})
    assert "blocks.0.up (Linear) is neither a norm" in d.sequence_parallel_problem(1)
    prof = nbtrain.profile(model, batch_size=1, seq_len=SEQ)
    assert "packed_colwise" in prof.arch["no_sequence_parallel"]
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=2)
    best = nbtrain.plan(prof, cluster, global_batch=BATCH, seq_len=SEQ)
    assert not any(s.sp for s in best.layers)
    with pytest.raises(InvalidPlanError, match="sp, but"):
        estimate(Plan.parse("0: dp_replicate=2; 1-2: tp=2 sp; 3: dp_replicate=2", num_devices=2,
                            num_layers=LAYERS), prof, cluster, global_batch=BATCH, seq_len=SEQ)


def test_nbtrain_gpt_and_transformers_llama_offer_sp_on_every_block():
    for model in (llama(), gpt(), hf_llama()):
        d = describe(model)
        assert d.no_sequence_parallel == [""] * LAYERS
        roles = dict(d.sequence_parallel[1])
        assert sorted(roles.values()).count("sequence_parallel") == 2  # the two norms
        assert sorted(roles.values()).count("rowwise_sequence_output") == 2  # attention out, MLP down


# -- the cost model -------------------------------------------------------------------------------------------------

LLAMA3_70B = GPTConfig(vocab_size=128256, block_size=8192, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                       ffn_hidden=28672, norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                       tie_embeddings=False, rope_theta=500000.0)
"""Llama 3 70B (Meta's model card and params.json: dim 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672, vocabulary
128256, context 8192)."""


@functools.lru_cache(maxsize=None)
def _llama3_70b_profile():
    with torch.device("meta"):  # shapes only: ~20 s on this machine for 82 layers
        model = GPT(LLAMA3_70B)
    return nbtrain.profile(model, batch_size=1, seq_len=8192)


def _block_activations(tp: int, **strategy) -> float:
    """Saved bytes per device of a Llama-3-70B block on one sequence of 8192 tokens, on ``tp`` H100s."""
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=tp)
    model = CostModel(_llama3_70b_profile(), cluster, global_batch=1, seq_len=8192)
    return model.layer(1, Strategy(tp=tp, **strategy), 1).activations


def test_sp_divides_a_blocks_activations_by_tp_as_korthikanti_derives():
    alone = _block_activations(1)
    for tp in (2, 4, 8):
        # (34sbh + 5as²b)/t: the whole layer's activations over t (Korthikanti et al. 2022, §4.2.2)
        assert _block_activations(tp, sp=True) == pytest.approx(alone / tp, rel=1e-9)
        # without sp the two norms' inputs and outputs (four hidden states of s·b·h bf16 elements; Korthikanti's
        # 10sbh counts two dropout masks besides) stay whole on every rank instead of 1/t of them
        whole = 4 * 8192 * 8192 * 2
        assert _block_activations(tp) - _block_activations(tp, sp=True) == pytest.approx(whole * (1 - 1 / tp))
    # checkpointed: the kept input is the rank's slice of the sequence, s·b·h/t elements of 2 bytes (bf16)
    kept = _block_activations(8, sp=True, ac=True)
    assert kept == pytest.approx(8192 * 1 * 8192 * 2 / 8, rel=1e-9)
    assert _block_activations(8, ac=True) == pytest.approx(8 * kept, rel=1e-9)


def test_sp_lets_llama3_70b_fit_at_8192_tokens_where_tp_alone_does_not():
    prof = _llama3_70b_profile()
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=64)  # 80 GiB each
    predictions = {}
    for text in ("dp_shard=8 tp=8", "dp_shard=8 tp=8 sp"):
        plan = Plan.parse(text, num_devices=64, num_layers=len(prof.layers), global_batch=8, seq_len=8192)
        predictions[text] = estimate(plan, prof, cluster)
    plain, sp = predictions["dp_shard=8 tp=8"], predictions["dp_shard=8 tp=8 sp"]
    print(f"llama-3-70b, 64 x H100, batch 8 x 8192: tp=8 {plain.memory_bytes / 2**30:.1f} GiB "
          f"({plain.stages[0].memory.activations / 2**30:.1f} activations), tp=8 sp {sp.memory_bytes / 2**30:.1f} GiB "
          f"({sp.stages[0].memory.activations / 2**30:.1f}); step {plain.step_time_s:.3f} s / {sp.step_time_s:.3f} s")
    assert not plain.fits and sp.fits
    typed = nbtrain.plan(prof, cluster, global_batch=8, seq_len=8192, strategy="dp_shard=8 tp=8 sp")
    assert "tp=8 · sp on 82/82 · ac on 0/82" in typed.summary()
    # the same bytes through the collectives (Korthikanti et al. 2022, §4.2.2): about the same step
    assert sp.step_time_s == pytest.approx(plain.step_time_s, rel=0.05)


def test_an_sp_boundary_costs_one_all_gather_of_the_hidden_state():
    prof = _llama3_70b_profile()
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    model = CostModel(prof, cluster, global_batch=1, seq_len=8192)
    plain, sp = Strategy(tp=8), Strategy(tp=8, sp=True)
    hidden = 8192 * 8192 * 2  # s·b·h of bf16 entering block 2
    ring = 7 / 8 * hidden / cluster.intra_node_bandwidth  # one ring all-gather (Thakur et al. 2005)
    assert model.relayout(2, sp, plain, 1) == pytest.approx(ring, rel=1e-9)
    assert model.relayout(2, plain, sp, 1) == pytest.approx(ring, rel=1e-9)
    assert model.relayout(2, sp, sp, 1) == 0.0


def test_sp_collectives_cost_the_all_reduces_bytes_plus_what_splitting_them_costs_where_measured():
    from nbtrain.planner.link_costs import tp_seconds
    from nbtrain.profiler.collectives import Link, Links

    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    model = CostModel(_llama3_70b_profile(), cluster, global_batch=1, seq_len=8192)
    # datasheet: a ring all-reduce is a reduce-scatter then an all-gather (Korthikanti et al. 2022, §4.2.2)
    assert model.layer(1, Strategy(tp=8, sp=True), 1).time.tp_comm == \
        pytest.approx(model.layer(1, Strategy(tp=8), 1).time.tp_comm, rel=1e-12)
    # measured: the TP block as measured, plus (all-gather + reduce-scatter − all-reduce) per all-reduce and pass
    links = Links((Link("tp_block_forward", 2, 2, 1e-3, 1e9), Link("tp_block_backward", 2, 2, 2e-3, 1e9),
                   Link("all_gather", 2, 2, 3e-4, 2e9), Link("reduce_scatter", 2, 2, 3e-4, 2e9),
                   Link("all_reduce", 2, 2, 4e-4, 1e9)))
    args = dict(hidden=1e6, output=0.0, pairs=2, gathers_output=False, passes=2)
    plain = tp_seconds(links, 2, Strategy(tp=2), "block", **args)
    sp = tp_seconds(links, 2, Strategy(tp=2, sp=True), "block", sequence_parallel=True, **args)
    split = 2 * (3e-4 + 1e6 / 2e9) - (4e-4 + 1e6 / 1e9)  # 0.2 ms more per all-reduce
    assert sp - plain == pytest.approx(2 * 2 * split)


def test_the_planner_chooses_sp_where_it_pays_and_plain_tp_where_it_only_ties():
    tiny = nbtrain.profile("llama-tiny", batch_size=1, seq_len=32)  # untied: TP may split its embedding and head
    # one sequence on two devices and no pipeline: only TP splits it; memory to spare, the same bytes through the
    # collectives: the simpler plan, TP without sp
    best = nbtrain.plan(tiny, nbtrain.Cluster.from_catalog("H100", num_devices=2), global_batch=1, seq_len=32,
                        options=SearchOptions(pp_degrees=(1,)))
    assert any(s.tp > 1 for s in best.layers) and not any(s.sp for s in best.layers), str(best)
    best = nbtrain.plan(_llama3_70b_profile(), nbtrain.Cluster.from_catalog("H100", num_devices=64), global_batch=64,
                        seq_len=8192)
    # 80 GiB is tight at 8192 tokens: sp on the blocks lets fewer of them recompute whole (ac; ac=op keeps
    # projections); the block next to the head (which runs on the whole sequence) may go either way, since there one
    # all-gather of the hidden state is paid with sp or without
    blocks = best.layers[1:-1]
    assert all(s.sp for s in blocks[:-1]) and sum(s.ac is True for s in blocks) < len(blocks), str(best)


def _backward_collectives_worker(rank, world, port, queue):
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.distributed_fixtures import gloo_worker

    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.models.description import layer_slots
        from nbtrain.profiler.model import lm_loss
        from nbtrain.run.parallel.mesh import PlanMeshes
        from nbtrain.run.parallel.parallelize import parallelize

        counts = {}
        for text in ("tp=2", "tp=2 sp"):
            torch.manual_seed(0)
            model = hf_llama()
            plan = Plan.parse(text, num_devices=world, num_layers=len(layer_slots(model)), global_batch=BATCH,
                              seq_len=SEQ)
            model = parallelize(model, plan, PlanMeshes(plan))
            ids = torch.randint(0, 64, (BATCH, SEQ))
            loss = lm_loss(model(ids, use_cache=False), ids)
            with CommDebugMode() as seen:
                loss.backward()
            counts[text] = {str(op).split(".")[-1]: n for op, n in seen.get_comm_counts().items()}
        report(counts)


def test_a_tensor_parallel_block_reduces_its_input_gradient_once_at_the_attention_and_once_at_the_mlp():
    """Megatron's split costs a block two all-reduces of the hidden state in backward (Shoeybi et al. 2019, §3:
    the ``f`` operator before the attention and before the MLP), and the planner prices two. The executor handed
    each column-parallel projection of a transformers Llama the plain hidden state, so each all-reduced its own
    input gradient: q, k, v, gate and up, five a block (11 in this 2-block model's backward where 5 do); under
    ``sp`` each still all-reduced, then sliced, where one reduce-scatter at the attention and one at the MLP do."""
    from tests.distributed_fixtures import spawn_group

    counts = spawn_group(_backward_collectives_worker, 2)
    blocks = 2
    # 2 a block, and the head's own: its colwise_gather_output projection takes the final norm's output whole
    assert counts["tp=2"] == {"all_reduce": 2 * blocks + 1}
    assert counts["tp=2 sp"]["reduce_scatter_tensor"] == 2 * blocks
    assert counts["tp=2 sp"]["all_reduce"] == 1
