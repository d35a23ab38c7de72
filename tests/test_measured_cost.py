"""The cost model on a machine it has measured: communication fitted per operation and size, compute slowed by the
processes that share the cores, FSDP2, DDP and TP priced as measured, and a recommendation that follows what the
measurements say rather than datasheet habits.

    .venv/bin/pytest tests/test_measured_cost.py -q          # < 2 s: synthetic profiles and links, no processes
"""

from __future__ import annotations

import json
import time

import pytest

from nbtrain.errors import InvalidArgumentError
from nbtrain.planner.cost import CostModel
from nbtrain.planner.plan import Plan
from nbtrain.planner.recommend import plan as recommend
from nbtrain.planner.search import search
from nbtrain.planner.search_space import SearchOptions
from nbtrain.profiler.collectives import Link, Links, fit_line
from nbtrain.profiler.hardware import Cluster
from tests.planner_fixtures import layer, profile

MB = 1e6


def measured(ops: dict[str, tuple[float, float]], world: int = 2, slowdown: float = 1.0) -> Links:
    """Links for groups of 2 among ``world`` processes: op → (latency s, bandwidth B/s)."""
    return Links(tuple(Link(op, 2, world, lat, bw) for op, (lat, bw) in ops.items()), ((world, slowdown),))


def cpu(processes: int = 2, cores: int = 2, links: Links = Links()) -> Cluster:
    return Cluster.from_catalog("cpu", num_devices=processes, host_cores=cores, source="calibrated", links=links)


def toy(params: int = 1_000_000, blocks: int = 4):
    """An fp32 model of equal blocks, 1 MFLOP per token each, small activations: it fits anywhere."""
    layers = [layer("embed", "embedding", params=params, act=100, out=400, fwd=1e3, dtype_bytes=4)]
    layers += [layer(f"blocks.{i}", "block", params=params, act=2000, out=400, fwd=1e6, dtype_bytes=4)
               for i in range(blocks)]
    layers.append(layer("head", "head", params=params, act=100, out=400, fwd=1e6, dtype_bytes=4))
    return profile(layers, seq_len=64, dtype="float32")


# --- fitting what was measured ---------------------------------------------------------------------------------

def test_a_line_through_two_measured_sizes_is_their_latency_and_bandwidth():
    # 2 ms at 1 kB and 4 ms at 3 kB: 1 ms fixed, then 1 ms per kB, i.e. 1 MB/s
    assert fit_line([(1000, 0.002), (3000, 0.004)]) == (0.001, 1e6)


def test_noise_never_makes_a_latency_negative_or_a_larger_message_free():
    latency, bandwidth = fit_line([(1000, 0.003), (2000, 0.001)])  # the larger message measured faster
    assert latency >= 0 and 0 < bandwidth < float("inf")
    latency, bandwidth = fit_line([(1000, 0.0001), (2000, 0.0030)])  # a steep line crosses zero: through the origin
    assert latency == 0 and bandwidth > 0


def test_a_link_is_found_for_its_group_and_the_nearest_larger_world():
    links = Links((Link("all_reduce", 2, 2, 1e-3, 1e9), Link("all_reduce", 2, 4, 3e-3, 5e8)))
    assert links.find("all_reduce", 2, 2).world == 2
    assert links.find("all_reduce", 2, 3).world == 4  # more processes contend more: the safe side
    assert links.find("all_reduce", 1, 2) is None  # a group of one talks to nobody
    assert links.find("all_gather", 2, 2) is None
    with pytest.raises(InvalidArgumentError, match="measure_links"):
        links.seconds("all_gather", 2, 1000)


def test_a_cluster_measured_here_keeps_its_links_through_json(tmp_path):
    here = cpu(links=measured({"all_reduce": (1e-3, 1e9), "fsdp_forward": (2e-3, 5e8)}, slowdown=1.1))
    here.save(tmp_path / "here.json")
    assert Cluster.load(tmp_path / "here.json") == here
    assert json.loads((tmp_path / "here.json").read_text())["links"]["slowdowns"] == [[2, 1.1]]


def test_merging_measurements_of_another_process_count_keeps_both():
    two, four = measured({"all_reduce": (1e-3, 1e9)}, 2), measured({"all_reduce": (3e-3, 5e8)}, 4, slowdown=2.1)
    both = two.merged(four)
    assert {link.world for link in both.links} == {2, 4}
    assert both.slowdown(2) == 1.0 and both.slowdown(4) == 2.1


# --- compute on shared cores -----------------------------------------------------------------------------------

def test_more_worker_processes_than_cores_share_them_in_time():
    assert cpu(processes=4, cores=2).core_share == 2.0
    assert cpu(processes=2, cores=2).core_share == 1.0
    assert Cluster.from_catalog("H100", num_devices=8).core_share == 1.0  # a GPU computes on its own


def test_four_processes_on_two_cores_take_twice_the_compute_time_of_four_on_four():
    prof, plan = toy(), Plan.parse("dp_replicate=4", num_devices=4, num_layers=6, global_batch=8, seq_len=64)
    shared = CostModel(prof, cpu(4, 2), global_batch=8).estimate(plan).time.compute
    own = CostModel(prof, cpu(4, 4), global_batch=8).estimate(plan).time.compute
    assert shared == pytest.approx(2 * own)


def test_a_measured_slowdown_of_processes_computing_at_once_is_charged_but_never_below_the_core_share():
    prof, plan = toy(), Plan.parse("dp_replicate=2", num_devices=2, num_layers=6, global_batch=8, seq_len=64)
    alone = CostModel(prof, cpu(2, 2), global_batch=8).estimate(plan).time.compute
    slowed = CostModel(prof, cpu(2, 2, measured({}, 2, slowdown=1.25)), global_batch=8).estimate(plan).time.compute
    assert slowed == pytest.approx(1.25 * alone)
    plan4 = Plan.parse("dp_replicate=4", num_devices=4, num_layers=6, global_batch=8, seq_len=64)
    quarter = CostModel(prof, cpu(4, 4), global_batch=8).estimate(plan4).time.compute
    optimistic = CostModel(prof, cpu(4, 2, measured({}, 4, slowdown=1.2)), global_batch=8).estimate(plan4)
    assert optimistic.time.compute == pytest.approx(2 * quarter)  # 4 on 2 cores: at least twice, whatever was seen


# --- communication priced as measured ----------------------------------------------------------------------------

def test_ddp_pays_what_it_was_measured_to_add_for_the_model_s_gradient_bytes():
    prof = toy()
    grad_bytes = prof.params * 4
    links = measured({"ddp_backward": (0.002, 100 * MB)})
    plan = Plan.parse("dp_replicate=2", num_devices=2, num_layers=6, global_batch=8, seq_len=64)
    paid = CostModel(prof, cpu(links=links), global_batch=8).estimate(plan).time.dp_comm
    assert paid == pytest.approx(0.002 + grad_bytes / (100 * MB))  # the fixed part once a step, the bytes at the rate


def test_ddp_of_a_small_model_pays_what_was_measured_at_small_sizes_not_a_line_bent_by_the_large_ones():
    """DDP on 2 gloo processes here added 1.1 ms at 64 KiB of gradients, 1.8 at 256 KiB, 4.5 at 1 MiB, 7.7 at 4 MiB
    and 9.9 at 9 MiB (one measurement). The line through them has a 2.3 ms fixed part and 1.1 GB/s, so it put
    2.5 ms under 256 KiB (1.4x what was measured there) and 2.4 under 64 KiB (2.2x); for a model between two
    measured sizes, the segment joining them is what the measurements say."""
    points = ((65536, 0.00109), (262144, 0.00178), (1048576, 0.00447), (4194304, 0.00772), (9437184, 0.00994))
    latency, bandwidth = fit_line(points)
    links = Links((Link("ddp_backward", 2, 2, latency, bandwidth, points),), ((2, 1.0),))
    plan = Plan.parse("dp_replicate=2", num_devices=2, num_layers=6, global_batch=8, seq_len=64)

    def paid(params_per_layer: int) -> float:
        prof = toy(params=params_per_layer)
        return CostModel(prof, cpu(links=links), global_batch=8).estimate(plan).time.dp_comm

    def params(nbytes: int) -> int:  # per layer of the six, for ``nbytes`` of fp32 gradients in all
        return round(nbytes / 4 / 6)

    close = dict(rel=1e-3)  # the sizes above, to a few bytes
    assert paid(params(32768)) == pytest.approx(0.00109, **close)  # below 64 KiB: what 64 KiB took
    assert paid(params(262144)) == pytest.approx(0.00178, **close)
    assert paid(params(655360)) == pytest.approx((0.00178 + 0.00447) / 2, **close)  # halfway from 256 KiB to 1 MiB
    assert paid(params(16 * 2**20)) == pytest.approx(0.00994 + (16 * 2**20 - 9437184) / bandwidth, **close)
    assert latency + 262144 / bandwidth > 1.4 * 0.00178  # what the line alone said


def test_tensor_parallelism_pays_the_split_loss_as_measured_on_the_head_that_hands_it_split_logits():
    """Under TP nbtrain's own loss runs on logits split over the vocabulary (three all-reduces of a number a token,
    and on a CPU DTensor's work on each op): on 2 gloo processes here it added 4.8 ms to the forward of a
    transformers Qwen2's ``tp=2`` step, which nothing priced. The head pays the measured ``tp_loss`` at its
    micro-batch's tokens; a head whose logits are not split (a user's loss) pays none of it."""
    import dataclasses

    points = ((4 * 256, 0.003), (4 * 4096, 0.009))  # seconds by 4 bytes a token: 256 and 4,096 tokens
    links = Links((Link("tp_loss", 2, 2, *fit_line(points), points),), ((2, 1.0),))
    plan = Plan.parse("tp=2", num_devices=2, num_layers=6, global_batch=8, seq_len=64)
    base = toy()

    def head_tp_seconds(**arch) -> float:
        prof = dataclasses.replace(base, arch={**base.arch, **arch})
        return CostModel(prof, cpu(links=links), global_batch=8).layer(5, plan.layers[5], 1).time.tp_comm

    split = head_tp_seconds(tp_gathers_output=[5], vocab_parallel_loss=True)
    whole = head_tp_seconds(tp_gathers_output=[])
    tokens = 8 * 64  # the micro-batch: every row on each TP rank
    assert split - whole == pytest.approx(0.003 + 0.006 * (4 * tokens - 4 * 256) / (4 * 4096 - 4 * 256))
    assert head_tp_seconds(tp_gathers_output=[5], vocab_parallel_loss=False) == whole  # a user's loss: no split loss


def test_fsdp_pays_its_measured_gather_and_reduce_per_layer_and_per_parameter_byte():
    prof = toy()
    links = measured({"fsdp_forward": (0.001, 1000 * MB), "fsdp_backward": (0.002, 500 * MB),
                      "fsdp_backward_2": (0.0015, 800 * MB)})
    model = CostModel(prof, cpu(links=links), global_batch=8)
    zero3 = Plan.parse("dp_shard=2 zero=3", num_devices=2, num_layers=6, global_batch=8, seq_len=64)
    zero2 = Plan.parse("dp_shard=2 zero=2", num_devices=2, num_layers=6, global_batch=8, seq_len=64)
    layer_bytes = 1_000_000 * 4
    assert model.estimate(zero3).time.zero3_comm == pytest.approx(
        6 * (0.001 + layer_bytes / (1000 * MB) + 0.002 + layer_bytes / (500 * MB)))
    assert model.estimate(zero2).time.zero3_comm == pytest.approx(
        6 * (0.001 + layer_bytes / (1000 * MB) + 0.0015 + layer_bytes / (800 * MB)))


def test_a_small_block_under_fsdp_pays_what_the_smallest_measured_block_took_not_a_line_bent_by_the_large_one():
    """FSDP2's work per unit is mostly fixed on a CPU. One measurement here (2 gloo processes, nbtrain's GPT block
    at 0.8 MiB of parameters twice and at 3 MiB): forward 1.46, 2.53 and 3.99 ms, backward under ZeRO-3 3.24, 4.56
    and 12.76 ms. The lines through them put 2.4 ms under a transformers Qwen2 block of 150 KB that FSDP2 added
    4.9-5.6 ms a step to (training steps in a row, ``bench/RESULTS.md``); what the smallest block took says 5.9."""
    forward = ((793088, 0.00146), (793088, 0.00253), (3159040, 0.00399))
    backward = ((793088, 0.00324), (793088, 0.00456), (3159040, 0.01276))
    links = Links(tuple(Link(op, 2, 2, *fit_line(points), points) for op, points in
                        (("fsdp_block_forward", forward), ("fsdp_block_backward", backward))), ((2, 1.0),))
    plan = Plan.parse("dp_shard=2 zero=3", num_devices=2, num_layers=6, global_batch=8, seq_len=64)

    def per_block(params: int) -> float:  # a block's gathers and reduce-scatter, the four blocks' mean
        model = CostModel(toy(params=params), cpu(links=links), global_batch=8)
        return sum(model.layer(i, plan.layers[i], plan.microbatches).time.zero3_comm for i in range(1, 5)) / 4

    qwen2_block = 150_000 // 4  # parameters
    assert per_block(qwen2_block) == pytest.approx((0.00146 + 0.00253) / 2 + (0.00324 + 0.00456) / 2, rel=1e-3)
    line = sum(link.seconds(150_000) for link in links.links)
    assert line < 0.5 * per_block(qwen2_block)  # what the lines alone said
    between = (793088 + 3159040) // 2  # halfway: halfway between the two sizes' times
    assert per_block(between // 4) == pytest.approx((0.001995 + 0.00399) / 2 + (0.0039 + 0.01276) / 2, rel=1e-3)


def test_a_size_measured_twice_is_read_as_the_median_of_its_measurements():
    link = Link("fsdp_block_forward", 2, 2, 0.0, 1e9,
                points=((793088, 0.0015), (793088, 0.0025), (793088, 0.0020), (3159040, 0.004)))
    assert link.as_measured(793088) == pytest.approx(0.0020)
    assert link.as_measured((793088 + 3159040) / 2) == pytest.approx(0.0030)


def test_every_pipeline_stage_pays_the_measured_schedule_work_per_micro_batch_in_the_plan_and_the_search():
    prof = toy()
    per_microbatch = 0.0005  # torch.distributed.pipelining's own work, measured here (link_bench: pp_microbatch)
    links = measured({"pp_microbatch": (per_microbatch, 100 * MB), "p2p": (0.0, 1e12)})
    text = "pp=2 mb=4 | 0-2: dp_replicate=1; 3-5: dp_replicate=1"
    plan = Plan.parse(text, num_devices=2, num_layers=6, global_batch=8, seq_len=64)
    without = CostModel(prof, cpu(links=measured({"p2p": (0.0, 1e12)})), global_batch=8).estimate(plan)
    paid = CostModel(prof, cpu(links=links), global_batch=8).estimate(plan)
    # every stage per micro-batch: the step's 4 micro-batches of the slowest stage and the other stage's first one
    assert paid.step_time_s - without.step_time_s == pytest.approx((4 + 1) * per_microbatch)
    # the search weighs it too: free, more micro-batches shrink the bubble; dear, fewer of them pay it less often
    options = SearchOptions(pp_degrees=(2,), microbatches=(2, 8))
    free, = search(prof, cpu(links=measured({"p2p": (0.0, 1e12)})), global_batch=8, seq_len=64, options=options,
                   top=1)
    dear, = search(prof, cpu(links=measured({"pp_microbatch": (0.05, 100 * MB), "p2p": (0.0, 1e12)})),
                   global_batch=8, seq_len=64, options=options, top=1)
    assert (free.microbatches, dear.microbatches) == (8, 2)


def test_the_schedule_work_is_the_cheapest_measured_micro_batch_when_noise_makes_the_fit_all_bytes():
    """Measured on a slow 2-core machine (link_bench's pp_microbatch): 1.449, 1.031 and 9.710 ms per micro-batch at
    32, 128 and 512 KiB, the widest carrying two stages computing at once. A line through them has no fixed part,
    which would price the schedule's work at nothing; every point holds it, so the cheapest, less its two transfers
    (p2p measured at 92.6 µs + bytes / 1.763 GB/s): 1.031 − 2 · (0.0926 + 131072 / 1.763e6) ms = 0.697 ms."""
    from nbtrain.planner.link_costs import schedule_seconds
    from nbtrain.profiler.collectives import links_from

    points = [("pp_microbatch", 2, 32768, 1.449e-3), ("pp_microbatch", 2, 131072, 1.031e-3),
              ("pp_microbatch", 2, 524288, 9.710e-3), ("p2p", 2, 65536, 9.26e-5 + 65536 / 1.763e9),
              ("p2p", 2, 2097152, 9.26e-5 + 2097152 / 1.763e9)]
    links = links_from(points, world=2)
    assert links.find("pp_microbatch", 2, 2).latency_s == 0.0
    assert schedule_seconds(links, 2) == pytest.approx(1.031e-3 - 2 * (92.6e-6 + 131072 / 1.763e9), rel=1e-3)


@pytest.mark.parametrize("slow", ["fsdp", "ddp"])
def test_a_slow_measured_wrapper_stops_being_recommended_for_a_model_that_fits_either_way(slow):
    """FSDP or DDP, for a model whose states fit on one device many times over: whichever this machine was
    measured to run slower loses, whatever a datasheet would say."""
    fast, crawl = (0.0, 1e12), (0.05, 1 * MB)
    links = measured({
        "fsdp_forward": crawl if slow == "fsdp" else fast, "fsdp_backward": crawl if slow == "fsdp" else fast,
        "fsdp_backward_2": crawl if slow == "fsdp" else fast, "ddp_backward": crawl if slow == "ddp" else fast,
        "all_reduce": crawl if slow == "ddp" else fast,
        "tp_forward": crawl, "tp_backward": crawl, "tp_block_forward": crawl, "tp_block_backward": crawl,
        "p2p": crawl, "all_gather": crawl})
    best = recommend(toy(), cpu(links=links), global_batch=8, seq_len=64,
                     options=SearchOptions(offload_levels=(0.0,)))
    strategies = {(s.dp_replicate, s.dp_shard, s.tp) for s in best.layers}
    assert strategies == ({(2, 1, 1)} if slow == "fsdp" else {(1, 2, 1)})
    assert best.pp == 1


# --- measuring ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_measurement_that_runs_out_of_time_stops_every_process_it_started(monkeypatch):
    """The benchmark runs in its own session with the gloo workers it spawns: a timeout (or Ctrl-C) must not leave
    them behind, each holding a copy of torch and a share of the cores."""
    import os
    import subprocess

    import psutil

    from nbtrain.errors import CalibrationError
    from nbtrain.profiler import collectives

    started = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        child = real_popen(*args, **kwargs)
        started.append(child.pid)
        return child

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with pytest.raises(CalibrationError, match="was stopped"):
        collectives.measure_in_subprocess(2, timeout=8)  # ~8 s: the workers are up and measuring by then

    def alive_in_session(process) -> bool:
        try:  # a zombie has let go of everything: only its exit status waits for its (new) parent
            return os.getsid(process.pid) == started[0] and process.status() != psutil.STATUS_ZOMBIE
        except (OSError, psutil.Error):  # gone meanwhile
            return False

    deadline = time.monotonic() + 5  # SIGKILL is delivered, not awaited
    while (left := [p.pid for p in psutil.process_iter() if alive_in_session(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started and not left
