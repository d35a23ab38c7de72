"""Hot switching, planned: one strategy per sequence-length bucket, the switches between them, merging buckets.

    .venv/bin/pytest tests/test_bucket_plan.py -q          # a few seconds, pure Python

The models are runs of identical blocks with round numbers (:func:`blocks`): ``P`` parameters per block, ``act``
saved bytes and ``out`` output bytes per token, ``fwd + attn·s`` forward FLOPs per token of a row of ``s`` tokens
(attention grows with the row), backward twice the forward. Clusters are the fixtures' (1 TFLOP/s sustained, 1 GB/s
links unless a test says otherwise), with no memory reserve. Expected bytes are derived by hand from the models in
the docstrings of :mod:`nbtrain.planner.switching.buckets` and :mod:`nbtrain.planner.switching.bucket_search`; where a test checks a
choice, a comment gives the arithmetic that makes it the right one, and one test compares the search with trying
every merging and every strategy per bucket through ``CostModel.estimate``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import pytest

from nbtrain.errors import InvalidArgumentError, NoFeasiblePlanError
from nbtrain.planner.switching.switch_cost import received_fraction, switch_cost
from nbtrain.planner.switching.bucket_strategy import BucketStrategy
from nbtrain.planner.switching.buckets import BucketOptions, merged_rows, plan_buckets, price_buckets
from nbtrain.planner.cost import CostModel, CostOptions
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.profiler.result import Scaling

from tests.planner_fixtures import cluster, layer, profile

S = Strategy
NO_RESERVE = CostOptions(headroom=0, reserve_bytes=0)
EXACT = 1e-9
P = 1_000_000


def blocks(n: int = 4, *, act: float = 4000, out: float = 1000, fwd: float = 1e6, attn: float = 100, n_head: int = 8,
           tied: bool = False):
    """``n`` identical blocks of ``P`` parameters (``tied``: an embedding and a head sharing a weight around them)."""
    flops = {"flops_fwd": Scaling((fwd, attn, 0, 0, 0, 0)), "flops_bwd": Scaling((2 * fwd, 2 * attn, 0, 0, 0, 0))}
    layers = [layer(f"blocks.{i}", "block", params=P, act=act, out=out, fwd=fwd, scaling=flops) for i in range(n)]
    if tied:
        layers = [layer("embed", "embedding", params=P, act=8, out=out, fwd=0)] + layers + \
            [layer("head", "head", params=0, act=act, out=out, fwd=fwd)]
        layers[-1] = dataclasses.replace(layers[-1], tied=("embed.weight",))
    return profile(layers, n_head=n_head)


def options(**changes) -> BucketOptions:
    """The space the hand-derived tests below price: no pipeline and no offload (the tests of those say so)."""
    return BucketOptions(**{"cost": NO_RESERVE, "max_pp": 1, "offload_levels": (0.0,), **changes})


# --- the switch cost model --------------------------------------------------------------------------------------

def test_switching_to_a_replicated_layout_receives_all_but_the_held_chunk_and_sends_no_gradient_back():
    c = cluster(8)
    home, short = S(dp_shard=2, tp=4), S(dp_replicate=8)
    weights = switch_cost("weights", home, short, params=4 * P, bytes_per_param=2, cluster=c)
    grads = switch_cost("gradients", short, home, params=4 * P, bytes_per_param=4, cluster=c)
    # a rank holds 1/(2·4) of every weight at home and needs all of it: 7/8 · 4M params · 2 B = 7 MB, at 1 GB/s 7 ms
    assert (weights.bytes, weights.seconds) == pytest.approx((7_000_000, 7e-3), rel=EXACT)
    # the replicated gradients contain every chunk the home layout holds: nothing to receive
    assert grads.bytes == 0 and grads.seconds == 0


def test_layouts_that_split_a_tensor_differently_reuse_nothing_and_equal_layouts_move_nothing():
    c = cluster(8)
    # FSDP chunks of 1/8 → TP-and-FSDP chunks of 1/8: not nested, the whole new chunk: 1/8 · 4M · 2 B = 1 MB
    assert switch_cost("weights", S(dp_shard=8), S(dp_shard=2, tp=4), params=4 * P, bytes_per_param=2,
                       cluster=c).bytes == pytest.approx(1_000_000, rel=EXACT)
    # FSDP over 2 → over 4: rank 1 holds [1/2, 1) and needs [1/4, 1/2): 1/4 · 4M · 4 B = 4 MB of gradients
    assert switch_cost("gradients", S(dp_replicate=4, dp_shard=2), S(dp_replicate=2, dp_shard=4), params=4 * P,
                       bytes_per_param=4, cluster=c).bytes == pytest.approx(4_000_000, rel=EXACT)
    # checkpointing and the ZeRO level do not move a parameter
    assert switch_cost("weights", S(dp_shard=2, tp=4, ac=True), S(dp_shard=2, zero=2, tp=4), params=4 * P,
                       bytes_per_param=2, cluster=c).bytes == 0


def _chunk(rank: int, n: int) -> tuple[Fraction, Fraction]:
    """The contiguous chunk of a tensor a rank holds when the innermost mesh axis that splits it has size ``n``."""
    i = rank % n
    return Fraction(i, n), Fraction(i + 1, n)


@pytest.mark.parametrize("axis", ["dp_shard", "tp"])
def test_reuse_is_what_the_worst_rank_already_holds_of_its_new_chunk_on_the_mesh(axis):
    # Independent of the rule in bucket_search: place every rank's chunk on the mesh (the splitting axis innermost,
    # chunk index = rank mod its size) and take the rank that must receive most.
    devices = 8
    for a, b in itertools.product([1, 2, 4, 8], repeat=2):
        source, target = (S(dp_replicate=devices // n, **{axis: n}) for n in (a, b))
        worst = Fraction(0)
        for rank in range(devices):
            (a0, a1), (b0, b1) = _chunk(rank, a), _chunk(rank, b)
            overlap = max(Fraction(0), min(a1, b1) - max(a0, b0))
            worst = max(worst, (b1 - b0) - overlap)
        assert received_fraction(source, target) == pytest.approx(float(worst), rel=EXACT), (axis, a, b)


def test_a_switch_across_nodes_runs_at_the_inter_node_bandwidth():
    c = cluster(16, 8, intra_node_bandwidth=100e9, inter_node_bandwidth=1e8)
    weights = switch_cost("weights", S(dp_shard=2, tp=8), S(dp_shard=16), params=4 * P, bytes_per_param=2, cluster=c)
    # 1/16 · 4M · 2 B = 0.5 MB over 0.1 GB/s: 5 ms (the 100 GB/s inside a node does not apply to 16 devices)
    assert (weights.bytes, weights.seconds) == pytest.approx((500_000, 5e-3), rel=EXACT)


# --- one bucket, and the static plan ----------------------------------------------------------------------------

def test_a_single_bucket_is_the_best_uniform_plan_the_cost_model_knows():
    prof, c, budget = blocks(), cluster(8), 60e6
    hot = plan_buckets(prof, c, [(1024, 16)], memory=budget, options=options())
    # every uniform one-micro-batch plan of the strategy space, through CostModel.estimate: the fastest that fits
    model = CostModel(prof, c, global_batch=16, seq_len=1024, budget_bytes=budget, options=NO_RESERVE)
    preds = [(model.estimate(Plan(num_devices=8, layers=(s,) * 4, global_batch=16, seq_len=1024)), s)
             for s in strategy_space(8, devices_per_node=8)]  # 16 rows: every dp divides them, no padding
    best, strategy = min(((p, s) for p, s in preds if p.fits), key=lambda x: x[0].step_time_s)
    assert hot.step_time_s == pytest.approx(best.step_time_s, rel=EXACT)
    assert hot.static.step_time_s == pytest.approx(best.step_time_s, rel=EXACT) and hot.speedup == pytest.approx(1)
    assert hot.switches == () and [b.strategy for b in hot.buckets] == [strategy]
    assert hot.buckets[0].memory.total == pytest.approx(best.memory_bytes, rel=EXACT)
    assert hot.tokens == 16 * 1024 and hot.tokens_per_s == pytest.approx(16 * 1024 / best.step_time_s, rel=EXACT)


def test_a_bucket_dp_does_not_divide_is_priced_at_its_padded_rows_and_can_take_data_parallelism():
    prof, c = blocks(), cluster(2, 2)
    hot = plan_buckets(prof, c, [(1024, 3)], options=options())
    (bucket,) = hot.buckets
    # 3 rows on 2 devices: under dp=2 the executor pads them to 4, and a device computes 2 whole rows, 3 · 1.1 MFLOP
    # · 2048 tokens · 4 blocks / 1 TFLOP/s = 27 ms; under tp=2 it computes 1.5 rows (20 ms) but its TP collectives
    # take 4 · 2 passes · 4 blocks · ½ · 3.07 MB / 1 GB/s = 49 ms
    assert bucket.strategy.dp == 2 and bucket.strategy.tp == 1
    # priced as 4 rows under the same strategy, through CostModel directly; its tokens are its own 3 rows
    four = CostModel(prof, c, global_batch=4, seq_len=1024, options=NO_RESERVE).estimate(
        Plan(num_devices=2, layers=(bucket.strategy,) * 4, global_batch=4, seq_len=1024))
    assert hot.step_time_s == pytest.approx(four.step_time_s, rel=EXACT)
    assert bucket.memory.total == pytest.approx(four.memory_bytes, rel=EXACT)
    assert bucket.rows == 3 and hot.tokens == 3 * 1024


def test_merged_rows_pack_the_shorter_rows_into_rows_of_the_longer_bound_rounded_up():
    assert merged_rows([(4096, 6), (16384, 2)]) == 4  # 6 · 4096 / 16384 = 1.5 → 2, plus 2
    assert merged_rows([(256, 16), (1024, 2)]) == 6  # 16 · 256 / 1024 = 4, plus 2
    assert merged_rows([(1000, 1), (1500, 1), (2000, 1)]) == 3  # 1000 + 1500 + 2000 = 4500 tokens: 2.25 → 3 rows


# --- what it chooses, and why -----------------------------------------------------------------------------------

def test_short_buckets_get_data_parallelism_while_the_long_ones_rows_force_tp_and_memory_checkpointing():
    # blocks saving 17000 B/token (Korthikanti's 34·sbh for 2-byte values and a 1000 B/token hidden state), of which
    # the norms' inputs and outputs (four hidden states, 4000 B) are whole on every TP rank and the rest split by tp
    hot = plan_buckets(blocks(act=17_000), cluster(8), [(1024, 16), (16384, 2)], memory=200e6, options=options())
    short, long = hot.buckets
    # long: one row of 16384 tokens per data-parallel group at the least. Without checkpointing, under tp=4:
    # 4 blocks · 16384 · (4000 + 13000 / 4) B = 475 MB, over the 200 MB budget. Checkpointed, under tp=2 the block
    # recomputed in backward holds 16384 · (4000 + 6500) B = 172 MB beside 3 kept inputs of 16.4 MB: over it; under
    # tp=4, 119 MB + 49 MB + ~9 MB of model states fit: tp ≥ 4 and checkpointing
    assert long.strategy.tp >= 4 and long.strategy.ac
    # short: under tp=2 (dp=4, 4 rows of 1024 tokens each) its TP collectives alone take 4 per block per pass ·
    # 2 passes · 4 blocks · ½ · 4.1 MB / 1 GB/s = 65.5 ms, more than its whole pass under dp=8 (3 · 1.1 MFLOP ·
    # 2048 tokens · 4 blocks / 1 TFLOP/s = 27 ms, collectives hidden) plus both switches (≤ 1 MB + 4 MB: 5 ms);
    # a device's 2 rows (2048 tokens · 4 blocks · 17000 B = 139 MB) fit beside the home's states (~9 MB) and its own
    # sharded copy without ac
    assert (short.strategy.dp, short.strategy.tp, short.strategy.ac) == (8, 1, False)
    assert [s.what for s in hot.switches] == ["weights", "gradients"]
    assert hot.speedup > 1


def test_a_bucket_away_from_home_holds_the_home_states_beside_its_own_weights_gradients_and_activations():
    hot = plan_buckets(blocks(act=1000, n_head=2, attn=3000), cluster(4, 2, inter_node_bandwidth=100e9),
                       [(256, 16), (1024, 2)], memory=30e6, options=options(allow_ac=False, zero_levels=(3,)))
    short, long = hot.buckets
    # attention heavy enough that the long rows want TP: under dp_shard=4 its 2 rows are padded to 4 and a device
    # computes a whole row, 3 · (1 + 0.003 · 1024) MFLOP · 1024 tokens · 4 blocks / 1 TFLOP/s = 50 ms; under
    # dp_shard=2 tp=2 half a row, 25 ms, plus its TP collectives 4 · 2 passes · 4 blocks · ½ · 1.02 MB / 1 GB/s
    # = 16.4 ms: 41.4 ms. The short rows attend less: a device's 4 rows take 21.7 ms under dp_shard=4 against
    # 10.9 ms + 32.8 ms of collectives under tp=2 (the next test), and the switch costs 0.06 ms
    assert long.strategy == S(dp_shard=2, tp=2) and short.strategy == S(dp_shard=4)
    # home dp_shard=2 tp=2, ZeRO-3: (2 + 2 + 12) B · P / 4 per block, 4 blocks = 16 MB, all step long;
    # the short bucket's own copy under dp_shard=4: (2 + 2) B · P / 4 · 4 blocks = 4 MB;
    # its activations: 16 rows / 4 ranks · 256 tokens · 1000 B · 4 blocks = 4.096 MB;
    # the transient of a block's backward under ZeRO-3: gathered weights 2P + unsharded gradients 2P = 4 MB
    assert short.memory.total == pytest.approx(16e6 + 4e6 + 4.096e6 + 4e6, rel=EXACT)
    # the long bucket at home: 16 MB + 2 rows / 2 · 1024 tokens · 1000 B · 4 blocks (these toy blocks' activations are
    # hidden states, 1000 B per token: whole on each TP rank without sequence parallelism) + transient (2P + 2P)/2
    assert long.memory.total == pytest.approx(16e6 + 4.096e6 + 2e6, rel=EXACT)


@pytest.mark.parametrize("inter_node, attn", [(100e9, 3000), (0.1e9, 100)])
def test_a_short_bucket_is_merged_into_the_long_one_only_when_keeping_it_apart_costs_more_than_it_saves(
        inter_node, attn):
    # 4 devices in 2 nodes, 2 heads: tp ≤ 2; the memory (31 MB) forces ZeRO-3 at home (replicated states alone,
    # 16 B · 4M / tp 2 = 32 MB, do not fit). Merged, the buckets are 6 rows of 1024 tokens; under dp_shard=2 tp=2 a
    # device's 3 rows hold 3 · 1024 · 1000 B · 4 blocks = 12.3 MB (the toy's activations are hidden states, whole on
    # each TP rank) beside 16 MB of states and a 2 MB transient: 30.3 MB, in one micro-batch
    hot = plan_buckets(blocks(act=1000, n_head=2, attn=attn), cluster(4, 2, inter_node_bandwidth=inter_node),
                       [(256, 16), (1024, 2)], memory=31e6, options=options(allow_ac=False, zero_levels=(3,)))
    if inter_node == 100e9:
        # The long bucket's rows attend enough (attn 3000) that it runs dp_shard=2 × tp=2 at home: 41.4 ms against
        # 50 ms with its 2 rows padded to 4 under dp_shard=4 (the test above). Apart, the short bucket escapes TP:
        # its collectives under tp=2 (8 rows of 256 tokens per rank) take 4 · 2 passes · 4 blocks · ½ · 2.05 MB /
        # 1 GB/s = 32.8 ms inside the nodes, more than its whole pass under dp_shard=4 (21.7 ms), while its switches
        # to dp_shard=4 move 1/4 · 4M · 2 B + 1/4 · 4M · 4 B = 6 MB across them: 0.06 ms at 100 GB/s. dp_shard=4 is
        # the one layout without TP that fits beside the home's 16 MB (28.1 MB, see the test above; a replicated
        # copy adds ≥ 8 MB). Apart: 41.4 + 21.7 = 63 ms. Merged, the 6 rows of 1024 tokens take ≥ 100 ms: under
        # dp=2 × tp=2 a device computes 1.5 rows (75 ms) plus 49 ms of collectives; under dp_shard=4, 8 padded rows,
        # 2 per device (100 ms).
        assert [(b.bound, b.rows, b.strategy.tp) for b in hot.buckets] == [(256, 16, 1), (1024, 2, 2)]
        assert [s.bytes for s in hot.switches] == pytest.approx([2e6, 4e6], rel=EXACT)
    else:
        # At 0.1 GB/s across nodes any switch of the short bucket costs ≥ 60 ms (6 MB; the replicated layouts even
        # more, and their gradient sync crosses nodes too), more than the 32.8 ms of TP it would save: it runs in
        # the home layout. Apart it would then pay its own pass's ZeRO-3 gathers across nodes (2 · ½ · 1 MB / 0.1
        # GB/s · 1.3 = 13 ms per block against 3 ms of compute: ~40 ms), while merged the 6 rows of 1024 tokens pay
        # them once and only ~1 ms more attention (the short tokens attend over rows of 1024 instead of 256).
        assert [(b.bound, b.rows, b.merged) for b in hot.buckets] == [(1024, 6, 2)]
        assert hot.switches == ()
        # a static system packs every document into rows of the longest bound too: the same plan, no faster than
        # keeping the buckets apart under one strategy
        assert hot.static.bounds == (1024,) and hot.speedup == pytest.approx(1, rel=EXACT)


@pytest.mark.parametrize("budget", [130e6, 150e6, 200e6, 300e6, 1e9])  # the least it needs: 122.8 MB (below)
def test_no_bucket_ever_exceeds_the_memory_budget(budget):
    hot = plan_buckets(blocks(), cluster(8), [(1024, 16), (4096, 4), (16384, 2)], memory=budget, options=options())
    assert all(b.memory.total <= budget for b in hot.buckets)
    assert hot.memory_bytes <= budget and hot.budget_bytes == budget
    assert hot.static is None or hot.static.memory_bytes <= budget
    # the static plan is one of the plans searched (the buckets as given, or all in one, every one at home)
    assert hot.static is None or hot.step_time_s <= hot.static.step_time_s


def test_more_than_six_buckets_are_merged_greedily_first_and_never_end_slower_than_the_static_plan():
    given = [(128 * 2**k, 2 ** (9 - k)) for k in range(8)]  # 128 × 512 ... 16384 × 4: 65536 tokens each
    hot = plan_buckets(blocks(), cluster(8), given, options=options())
    assert hot.notes and "merged greedily" in hot.notes[0]
    assert hot.tokens == 8 * 65536 and hot.step_time_s <= hot.static.step_time_s
    assert [b.lower for b in hot.buckets] == [0] + [b.bound for b in hot.buckets[:-1]]
    assert sum(b.merged for b in hot.buckets) == 8


def test_a_tied_embedding_rules_out_tensor_parallelism_so_two_long_rows_are_padded_to_one_per_device_on_8():
    buckets = [(1024, 16), (16384, 2)]
    untied = plan_buckets(blocks(act=17_000), cluster(8), buckets, memory=200e6, options=options())
    # 200 MB: a row of 16384 tokens under dp, checkpointed, recomputes one block of 16384 · 17000 B = 278.5 MB in
    # backward, whatever the data-parallel split. TP splits all but its four hidden states: under tp=4 the
    # recomputed block holds 16384 · (4000 + 13000 / 4) B = 119 MB, beside 3 kept inputs of 16.4 MB: it fits.
    assert untied.buckets[-1].strategy.tp >= 4
    # the tied weight stays unsplit by TP (the planner's rule), so every layout is dp = 8 and each device runs one
    # whole row of 16384 tokens (the 2 rows padded to 8): even checkpointed, the 278.5 MB of the block it recomputes
    # exceed the budget
    with pytest.raises(NoFeasiblePlanError, match=r"2 rows of 16384 tokens\) needs .* under its leanest strategy "
                                                  r"'dp_shard=8 .*\(tensor parallelism is ruled out: a tied embed"):
        plan_buckets(blocks(act=17_000, tied=True), cluster(8), buckets, memory=200e6, options=options())
    # with the device's memory it runs, dp = 8 for every bucket; one row per device costs the same whether 2 or 8
    # rows came, but the tokens are the bucket's own
    tied = [plan_buckets(blocks(tied=True), cluster(8), [(1024, 16), (16384, rows)], options=options(merge=False))
            for rows in (2, 8)]
    assert all(b.strategy.tp == 1 and b.strategy.dp == 8 for plan in tied for b in plan.buckets)
    assert [b.strategy for b in tied[0].buckets] == [b.strategy for b in tied[1].buckets]
    assert tied[0].step_time_s == pytest.approx(tied[1].step_time_s, rel=EXACT)
    assert tied[0].buckets[-1].rows == 2 and tied[0].tokens == 16 * 1024 + 2 * 16384


# --- the search is exact ----------------------------------------------------------------------------------------

def _mergings(n: int):
    """Every way to cut n buckets into runs of adjacent ones: (start, end) pairs."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        edges = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        yield list(zip(edges, edges[1:]))


def brute_force(prof, c, given, budget, opts) -> float:
    """The least step time over every merging and every strategy per bucket, each bucket priced by
    CostModel.estimate of its uniform plan and the step added up as the buckets module's docstring says."""
    heads = prof.arch["n_head"]
    space = [s for s in strategy_space(c.num_devices, devices_per_node=c.devices_per_node, allow_ac=opts.allow_ac,
                                       zero_levels=opts.zero_levels) if heads % s.tp == 0]
    params = sum(x.params for x in prof.layers)
    best = math.inf
    for runs in _mergings(len(given)):
        buckets = [(given[b - 1][0], math.ceil(sum(x * r for x, r in given[a:b]) / given[b - 1][0])) for a, b in runs]
        preds = []
        for bound, rows in buckets:
            pred = {}
            for s in space:  # the bucket padded with empty rows to a multiple of dp, priced as full ones
                padded = math.ceil(rows / s.dp) * s.dp
                # all the rows at once, or micro-batches of 1, 2, 4, ... rows, each rank's rows padded to whole ones
                per_rank = padded // s.dp
                pred[s] = []
                for r in sorted({per_rank} | {r for r in (1, 2, 4, 8, 16, 32, 64) if r < per_rank}):
                    m = math.ceil(per_rank / r)
                    model = CostModel(prof, c, global_batch=s.dp * m * r, seq_len=bound, budget_bytes=budget,
                                      options=opts.cost)
                    pred[s].append(model.estimate(Plan(num_devices=c.num_devices, layers=(s,) * len(prof.layers),
                                                       global_batch=s.dp * m * r, seq_len=bound, microbatches=m)))
            preds.append(pred)
        for chosen in itertools.product(space, repeat=len(buckets)):
            home = chosen[-1]
            if any(s not in p for s, p in zip(chosen, preds)):
                continue
            states = preds[-1][home][0].stages[0].memory  # model states do not depend on the micro-batches
            step = preds[-1][home][0].time.update
            layouts = [dataclasses.replace(s, ac=False) for s in chosen]  # checkpointing is toggled in one model
            for k, (s, p) in enumerate(zip(chosen, preds)):
                def need(x):
                    m = x.stages[0].memory
                    return m.total if layouts[k] == layouts[-1] else (
                        states.params + states.grads + states.optimizer + m.params + m.grads + m.activations
                        + m.transient + m.reserve)
                fitting = [x for x in p[s] if need(x) <= budget]
                if not fitting:
                    break
                t = min(fitting, key=lambda x: x.time.compute + x.time.tp_comm + x.time.zero3_comm
                        + x.time.dp_comm).time  # the fastest micro-batches that fit, counting the sync
                step += t.compute + t.tp_comm + t.zero3_comm
                if k == max(i for i, x in enumerate(layouts) if x == layouts[k]):  # one sync per layout, at its end
                    step += t.dp_comm
            else:
                for s in {x for x, lay in zip(chosen, layouts) if lay != layouts[-1]}:
                    if any(x != s and dataclasses.replace(x, ac=False) == dataclasses.replace(s, ac=False)
                           for x in chosen[:chosen.index(s)]):
                        continue  # its layout's switches are counted already
                    step += switch_cost("weights", home, s, params=params, bytes_per_param=prof.dtype_bytes,
                                        cluster=c).seconds
                    step += switch_cost("gradients", s, home, params=params, bytes_per_param=4, cluster=c).seconds
                best = min(best, step)
    return best


@pytest.mark.parametrize("attn, intra_node, inter_node, budget", [
    (300, 10e9, 10e9, 20e6),    # the middle bucket alone away from home, the shortest at home
    (3000, 10e9, 10e9, 25e6),   # the two short buckets share a strategy away from home
    (300, 10e9, 10e9, 25e6),    # the two longer buckets merged, all at home
    (100, 1e9, 1e9, 20e6),      # merged, checkpointing for memory
    (3000, 100e9, 1e9, 1e9),    # one strategy for all
    (300, 10e9, 1e9, 1e9),      # a gradient sync across nodes that the shortest bucket's backward cannot hide
])
def test_the_search_finds_the_step_time_of_trying_every_merging_and_every_strategy_per_bucket(
        attn, intra_node, inter_node, budget):
    prof = blocks(n=2, n_head=2, attn=attn)
    c = cluster(4, 2, intra_node_bandwidth=intra_node, inter_node_bandwidth=inter_node)
    given = [(256, 16), (512, 4), (1024, 2)]
    hot = plan_buckets(prof, c, given, memory=budget, options=options())
    assert hot.step_time_s == pytest.approx(brute_force(prof, c, given, budget, options()), rel=EXACT)
    parts = sum(b.time_s for b in hot.buckets) + sum(s.seconds for s in hot.switches) + hot.update_s
    assert hot.step_time_s == pytest.approx(parts, rel=EXACT)


# --- how it shows itself, and its errors ------------------------------------------------------------------------

def test_the_table_has_one_row_per_bucket_the_switches_the_static_plan_and_the_speedup():
    hot = plan_buckets(blocks(act=17_000), cluster(8), [(1024, 16), (16384, 2)], memory=200e6, options=options())
    text = str(hot)
    assert len(hot.table().rows) == 2
    assert "(0, 1K]" in text and "(1K, 16K]" in text and "16,384" in text and "(home)" in text
    assert text.count("switch ") == 2 and f"speed-up {hot.speedup:.2f}×" in text
    assert f"static plan '{hot.static.strategy}'" in text
    line = hot.summary()
    assert "\n" not in line and line.startswith("hot switching: 2 buckets") and f"{hot.speedup:.2f}×" in line
    assert hot.strategies() == {1024: hot.buckets[0].strategy, 16384: hot.buckets[1].strategy}
    assert '<table class="nbtrain-table">' in hot._repr_html_()


@pytest.mark.parametrize("buckets, message", [
    ([], r"no buckets: give at least one \(bound, rows\) pair"),
    ([(16384, 2), (4096, 48)], r"bounds must increase, shortest first, but bound 16384 then 4096: sort"),
    ([(4096, 8), (4096, 8)], r"two buckets have bound 4096 then 4096: .*add up the rows"),
    ([(4096, 0)], r"bucket \(4096, 0\) is not \(bound, rows\) with positive whole numbers"),
    ([(4096, 8, 1)], r"bucket \(4096, 8, 1\) is not \(bound, rows\)"),
    (4096, r"buckets must be \(bound, rows\) pairs"),
    ([(2**k, 1) for k in range(13)], r"13 buckets are more than the search takes \(12\); use coarser bounds"),
])
def test_buckets_it_cannot_read_are_refused_with_what_to_do(buckets, message):
    with pytest.raises(InvalidArgumentError, match=message):
        plan_buckets(blocks(), cluster(8), buckets)


def test_when_nothing_fits_the_error_says_what_the_longest_bucket_needs_at_the_least():
    # The leanest layout of 2 rows of 16384 tokens on 8 devices is tp=8 with checkpointing (ZeRO-3 would add its
    # gathered weights), in micro-batches of one row: model states (2 + 2 + 12) B · 4M / 8 = 8 MB; kept inputs,
    # token ids 8 B and then 3 blocks' 1000 B per token, of 16384 tokens, whole on every TP rank: 131 KB + 49.2 MB;
    # one block recomputed in backward, 4000 B per token (the toy block's activations are four hidden states of
    # 1000 B: none is split without sequence parallelism): 65.5 MB. 122.8 MB = 117.13 MiB, over 5 MB (4.77 MiB).
    with pytest.raises(NoFeasiblePlanError, match=r"fits 4.77 MiB per device on 8 × H100: the longest bucket "
                                                 r"\(2 rows of 16384 tokens\) needs 117.13 MiB under its leanest "
                                                 r"strategy 'tp=8 ac'; use devices with more memory"):
        plan_buckets(blocks(), cluster(8), [(1024, 16), (16384, 2)], memory=5e6, options=options())


# --- pipelines and the home's offload (issue 47) ----------------------------------------------------------------

def test_a_pipelined_layout_holds_whole_layers_of_its_stage_so_a_switch_moves_only_those():
    c = cluster(8)
    home, piped = S(dp_replicate=2, tp=4), BucketStrategy(S(dp_replicate=4), pp=2)  # 4 layers: 2 per stage
    layers = [P, P, P, P]
    weights = switch_cost("weights", home, piped, params=4 * P, bytes_per_param=2, cluster=c, layer_params=layers)
    grads = switch_cost("gradients", piped, home, params=4 * P, bytes_per_param=4, cluster=c, layer_params=layers)
    # a stage's rank needs its 2 layers whole and holds a tp chunk of 1/4 of each: 3/4 · 2M params · 2 B = 3 MB
    assert weights.bytes == pytest.approx(3_000_000, rel=EXACT)
    # back home a rank needs 1/4 of all 4 layers: its own stage's 2 it held whole, the other stage's 2 it receives,
    # 1/4 · 2M params · 4 B = 2 MB
    assert grads.bytes == pytest.approx(2_000_000, rel=EXACT)


SLOW_LINKS = dict(intra_node_bandwidth=1e8, inter_node_bandwidth=1e8)
"""0.1 GB/s: the gradient all-reduce of 8 data-parallel ranks costs more than a pipeline's bubble (below)."""


def test_with_pipelines_allowed_a_single_bucket_is_the_best_uniform_plan_of_any_pp_and_micro_batches():
    prof, c = blocks(8), cluster(8, **SLOW_LINKS)
    hot = plan_buckets(prof, c, [(1024, 16)], options=options(max_pp=None))
    # every uniform plan, pp from 1 to 8, every strategy of a stage's devices and every micro-batch size dividing
    # each rank's 16 / dp rows, through CostModel.estimate (1F1B; GPipe where there are fewer micro-batches than
    # stages, where the two orders are the same)
    model = CostModel(prof, c, global_batch=16, seq_len=1024, options=NO_RESERVE)
    times = {}
    for pp in (1, 2, 4, 8):
        for s in strategy_space(8 // pp, devices_per_node=8, allow_sp=False):
            per_rank = 16 // s.dp
            for m in (k for k in (1, 2, 4, 8, 16) if per_rank % k == 0):
                plan = Plan(num_devices=8, layers=(s,) * 8, pp=pp, microbatches=m, global_batch=16, seq_len=1024,
                            schedule="1f1b" if m >= pp else "gpipe")
                found = model.estimate(plan)
                if found.fits:
                    times[pp, s, m] = found.step_time_s
    (pp, s, m), best = min(times.items(), key=lambda kv: kv[1])
    assert pp > 1  # the slow links make a pipeline the fastest: what this test is about
    assert hot.step_time_s == pytest.approx(best, rel=1e-6)
    assert hot.buckets[0].strategy.pp > 1


def test_the_plan_says_why_each_pipelined_bucket_runs_in_a_pipeline_beside_the_best_without_one():
    prof, c = blocks(8), cluster(8, **SLOW_LINKS)
    piped = plan_buckets(prof, c, [(1024, 16)], options=options(max_pp=None))
    flat = plan_buckets(prof, c, [(1024, 16)], options=options())
    assert flat.why == () and all(getattr(b.strategy, "pp", 1) == 1 for b in flat.buckets)
    (why,) = piped.why
    # it names the bucket, its pipeline's bubble, and the fastest strategy without a pipeline, which is the plan the
    # search finds when pipelines are ruled out
    assert why.startswith(f"(0, 1K] '{piped.buckets[0].strategy}'") and "bubble" in why
    assert f"'{flat.buckets[0].strategy}'" in why
    assert f"why a pipeline: {why}" in str(piped)


def test_a_pipelined_bucket_holds_the_micro_batches_of_its_fullest_step_and_takes_the_time_of_its_mean_one():
    # 128 × 32 + 1024 = 5,120 tokens a step hold one 1K row on average, but a step of long documents puts five
    # there: five 1-row micro-batches, of which 1F1B keeps pp − 0 = 2 in flight on the first stage, twice what the
    # mean step's one holds (measured, issue 47: a step of four 4K rows held 2.3× the memory priced at its one)
    prof, c = blocks(8), cluster(8)
    given = price_buckets(prof, c, [(128, 32), (1024, 1)], {128: "dp_replicate=8", 1024: "pp=2 tp=4"},
                          options=options())
    long = given.buckets[-1]
    one = CostModel(prof, c, global_batch=1, seq_len=1024, options=NO_RESERVE).estimate(
        Plan(num_devices=8, layers=(S(tp=4),) * 8, pp=2, microbatches=1, schedule="gpipe", global_batch=1,
             seq_len=1024))
    assert long.memory.activations == pytest.approx(2 * one.stages[0].memory.activations, rel=EXACT)
    assert (long.microbatches, long.micro_rows) == (1, 1)  # its time: the mean step's one micro-batch
    assert long.time_s == pytest.approx(one.step_time_s - one.time.update - one.time.offload, rel=1e-6)


def test_only_the_home_offloads_and_it_does_when_its_optimizer_state_fits_no_other_way():
    prof, c = blocks(4, act=100, out=100), cluster(8)
    buckets = [(128, 64), (1024, 8)]
    # the budget: the smallest of a halving sequence under which no plan without offload fits
    budget = 256e6
    while True:
        try:
            plan_buckets(prof, c, buckets, memory=budget, options=options(offload_levels=(0.0,), merge=False))
        except NoFeasiblePlanError:
            break
        budget /= 2
    hot = plan_buckets(prof, c, buckets, memory=budget, options=options(offload_levels=(0.0, 0.5, 1.0), merge=False))
    assert hot.home.offload > 0 and all(b.strategy.offload == 0 for b in hot.buckets[:-1])
    assert hot.memory_bytes <= budget
    # an offloaded fraction f keeps (1 - f) of the optimizer state on the device
    plain = plan_buckets(prof, c, buckets, memory=2 * budget, options=options(merge=False))
    assert plain.home == dataclasses.replace(hot.home, offload=0.0)  # the same home, without offload
    assert hot.buckets[-1].memory.optimizer == pytest.approx(
        (1 - hot.home.offload) * plain.buckets[-1].memory.optimizer, rel=1e-6)


def test_a_given_pipelined_strategy_is_priced_and_one_the_executor_cannot_run_is_refused():
    prof, c = blocks(8), cluster(8)
    given = price_buckets(prof, c, [(128, 32), (1024, 4)], {128: "dp_replicate=8", 1024: "pp=2 tp=4"},
                          options=options())
    assert str(given.home) == "pp=2 tp=4" and given.buckets[-1].strategy.pp == 2
    traced = dataclasses.replace(prof, arch={**prof.arch, "traced_stages": True})
    with pytest.raises(InvalidArgumentError, match="traced graphs"):
        price_buckets(traced, c, [(128, 32), (1024, 4)], {128: "dp_replicate=8", 1024: "pp=2 tp=4"})
    hot = plan_buckets(traced, cluster(8, **SLOW_LINKS), [(1024, 16)], options=options(max_pp=None))
    assert all(getattr(b.strategy, "pp", 1) == 1 for b in hot.buckets)
