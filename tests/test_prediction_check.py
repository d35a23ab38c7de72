"""A calibration taken in a busy minute is not kept for good (issue 45): a run whose measured step is outside
0.8–1.25 of its prediction says so in its step table and measures this machine's communication again, keeping the
less disturbed of the two (after a run slower than predicted, both pooled), so that the next prediction follows the
machine."""

import dataclasses
import json
import math

import pytest
import torch

import nbtrain
from nbtrain.profiler import collectives
from nbtrain.profiler.collectives import Links, cache_file, cached_links

MIB = 2**20


def slowed(links: Links, factor: float) -> Links:
    """``links`` as a measurement taken while another program held the cores: every operation and the compute
    slowdown of processes sharing them ``factor`` times slower."""
    ops = tuple(dataclasses.replace(link, latency_s=link.latency_s * factor, bandwidth=link.bandwidth / factor,
                                    points=tuple((b, s * factor) for b, s in link.points)) for link in links.links)
    return Links(ops, tuple((n, f * factor) for n, f in links.slowdowns))


def every_op_s(links: Links) -> float:
    """Seconds of every measured operation at 1 MiB, summed (one operation's measurement moves up to 2x from one
    minute to the next on this machine; their sum does not)."""
    return sum(link.seconds(MIB) for link in links.links)


@pytest.mark.alone  # its runs' measured steps against their predictions: no other test slowing them
def test_a_calibration_taken_under_load_is_corrected_by_the_next_run_which_says_so(tmp_path, monkeypatch):
    honest = cached_links(2)  # this machine's, measured once per test session
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(collectives, "_REMEASURED", {})
    monkeypatch.setenv("NBTRAIN_REMEASURE", "1")  # the suite turns it off (conftest.py)
    # twice too slow, as the issue plants it: the first run then measured 0.52-0.60 of its prediction here (0.74 with
    # two busy loops on the cores), and the run after it 0.89-1.08
    planted = slowed(honest, 2.0)
    cache_file(2).parent.mkdir(parents=True, exist_ok=True)
    cache_file(2).write_text(json.dumps(planted.to_list()))

    torch.manual_seed(0)
    model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))
    g = torch.Generator().manual_seed(0)
    batches = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 256, (8, 64), generator=g) for _ in range(6))]

    first = nbtrain.fit(model, batches, plan="dp_replicate=2", steps=6, num_processes=2, progress=False,
                        cluster=nbtrain.Cluster.this_machine(2, progress=None))
    assert first.measured_step_s / first.predicted_step_s < 0.8
    assert "measured again" in first.prediction_note
    assert "note: the step measured" in str(first)  # in the step table, under the measured / predicted line

    kept = Links.from_list(json.loads(cache_file(2).read_text()))
    assert every_op_s(kept) < 0.8 * every_op_s(planted)  # the planted measurement is no longer the one used
    assert dict(kept.slowdowns)[2] < dict(planted.slowdowns)[2]

    again = nbtrain.fit(model, batches, plan="dp_replicate=2", steps=6, num_processes=2, progress=False,
                        cluster=nbtrain.Cluster.this_machine(2, progress=None))
    # the next run's prediction is nearer what its step measures than the planted one was to the first run's (on a
    # quiet machine within the 0.8-1.25 band; other programs on the cores move the measured step, not the direction)
    off = [abs(math.log(r.measured_step_s / r.predicted_step_s)) for r in (first, again)]
    assert off[1] < off[0], off


def test_a_run_faster_than_predicted_keeps_the_faster_measurement_and_a_slower_one_pools_both(tmp_path,
                                                                                              monkeypatch):
    """Keeping the faster of two measurements corrects one taken in a busy minute, but never one taken in a quiet
    minute on a machine that then runs slower (here a fresh link measurement once read 20% under the one before it,
    and the launches after it ran 15% slower: every plan measured 1.2-1.7× its prediction). So after a run faster
    than predicted each operation keeps the faster of the cached and the new measurement; after one slower, both are
    pooled (every operation was measured again, and the run used only some of them); the note says which."""
    from nbtrain.profiler import hardware, timed
    from nbtrain.profiler.collectives import Link, fit_line
    from nbtrain.run.prediction_check import check_prediction

    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NBTRAIN_REMEASURE", "1")
    monkeypatch.setattr(timed, "forget", lambda model: None)  # the rest of the suite keeps its timings
    monkeypatch.setattr(hardware, "forget_rates", lambda device: None)
    def link(op: str, seconds: float) -> Link:  # as measured: the same seconds at 1 and at 4 MiB
        points = ((MIB, seconds), (4 * MIB, seconds))
        return Link(op, 2, 2, *fit_line(points), points)

    cached = Links((link("all_reduce", 0.001), link("p2p", 0.003)), ((2, 1.0),))
    fresh = Links((link("all_reduce", 0.002), link("p2p", 0.002)), ((2, 1.2),))
    monkeypatch.setattr(collectives, "measure_in_subprocess", lambda world: fresh)
    here = nbtrain.Cluster.detect(calibrate=False).replace(source="calibrated")

    def kept_after(measured_s: float) -> tuple[dict, float, str]:
        monkeypatch.setattr(collectives, "_REMEASURED", {})
        cache_file(2).parent.mkdir(parents=True, exist_ok=True)
        cache_file(2).write_text(json.dumps(cached.to_list()))
        run = type("Result", (), {"predicted_step_s": 0.100, "measured_step_s": measured_s})()
        note = check_prediction(run, here, num_processes=2, model=torch.nn.Linear(2, 2), progress=None)
        kept = Links.from_list(json.loads(cache_file(2).read_text()))
        return {link.op: round(link.as_measured(2 * MIB), 6) for link in kept.links}, dict(kept.slowdowns)[2], note

    ops, slowdown, note = kept_after(0.050)  # faster than predicted: the less disturbed of the two
    assert ops == {"all_reduce": 0.001, "p2p": 0.002} and slowdown == 1.0
    assert "the faster of that and the cached measurement kept" in note
    ops, slowdown, note = kept_after(0.150)  # slower than predicted: each operation the mean of its two readings
    assert ops == {"all_reduce": 0.0015, "p2p": 0.0025} and slowdown == 1.1
    assert "that and the cached measurement pooled" in note


def test_measurements_pooled_run_after_run_keep_the_last_three_readings_of_each_size():
    """The cache stays the size of one measurement however many slow runs pool into it, and follows the latest."""
    from nbtrain.profiler.collectives import Link, fit_line

    def measured(seconds: float) -> Links:
        points = ((MIB, seconds), (4 * MIB, 2 * seconds))
        return Links((Link("p2p", 2, 2, *fit_line(points), points),), ((2, 1.0),))

    pooled = measured(0.001)
    for seconds in (0.002, 0.003, 0.004, 0.005):
        pooled = pooled.pooled(measured(seconds))
    assert sorted(pooled.links[0].points) == [(MIB, 0.003), (MIB, 0.004), (MIB, 0.005),
                                              (4 * MIB, 0.006), (4 * MIB, 0.008), (4 * MIB, 0.010)]
    assert pooled.links[0].as_measured(MIB) == 0.004  # the median of the three


def test_a_run_within_its_prediction_measures_nothing_again(monkeypatch):
    from nbtrain.run import prediction_check

    called = []
    monkeypatch.setattr(collectives, "remeasure_links", lambda *a, **k: called.append(a))
    result = type("Result", (), {"predicted_step_s": 0.100, "measured_step_s": 0.110})()
    here = nbtrain.Cluster.detect(calibrate=False).replace(source="calibrated")
    assert prediction_check.check_prediction(result, here, num_processes=2, model=torch.nn.Linear(2, 2)) is None
    assert called == []


def test_a_described_cluster_far_from_its_prediction_is_not_measured_here():
    from nbtrain.run.prediction_check import check_prediction

    result = type("Result", (), {"predicted_step_s": 0.100, "measured_step_s": 0.300})()
    catalog = nbtrain.Cluster.from_catalog("H100", num_devices=2)
    note = check_prediction(result, catalog, num_processes=2, model=torch.nn.Linear(2, 2))
    assert "3.00×" in note and "not measured here" in note


def test_with_measuring_again_turned_off_a_miss_is_said_and_nothing_is_measured(monkeypatch):
    from nbtrain.run import prediction_check

    called = []
    monkeypatch.setattr(collectives, "remeasure_links", lambda *a, **k: called.append(a))
    monkeypatch.setenv("NBTRAIN_REMEASURE", "0")
    result = type("Result", (), {"predicted_step_s": 0.100, "measured_step_s": 0.200})()
    here = nbtrain.Cluster.detect(calibrate=False).replace(source="calibrated")
    note = prediction_check.check_prediction(result, here, num_processes=2, model=torch.nn.Linear(2, 2))
    assert "2.00×" in note and "NBTRAIN_REMEASURE=0" in note
    assert called == []


def test_the_cached_measurement_is_replaced_whole_so_a_reader_meanwhile_sees_the_old_one_or_the_new(tmp_path,
                                                                                                  monkeypatch):
    """Two notebooks (or the test suite's two workers) on one machine share the cache: a measurement written while
    another process reads it must not be seen half written (it would read as no measurement and measure again)."""
    from nbtrain.profiler.collectives import Link, fit_line

    def measured(seconds: float) -> Links:
        points = ((MIB, seconds), (4 * MIB, 2 * seconds))
        return Links((Link("p2p", 2, 2, *fit_line(points), points),), ((2, 1.0),))

    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(collectives, "measure_in_subprocess", lambda world: measured(0.002))
    cache_file(2).write_text(json.dumps(measured(0.001).to_list()))
    with cache_file(2).open() as reading:  # another process that opened it a moment before the write
        collectives.remeasure_links(2, slower=True, progress=None)
        assert Links.from_list(json.loads(reading.read())) == measured(0.001)  # what it opened, whole
    assert Links.from_list(json.loads(cache_file(2).read_text())) == measured(0.001).pooled(measured(0.002))
    assert [p.name for p in tmp_path.iterdir()] == [cache_file(2).name]  # no partial file left behind
