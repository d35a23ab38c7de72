"""The cluster model: catalog numbers checked against their datasheets, lookup, validation, JSON, display, and the
micro-benchmarks that calibrate it on this machine.

    .venv/bin/pytest tests/test_cluster.py -q          # ~15 s on a 2-core CPU, the all-reduce included
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

import pytest
import torch

from nbtrain.errors import CalibrationError, InvalidArgumentError, NbtrainError, UnknownDeviceError
from nbtrain.profiler import calibrate as bench
from nbtrain.profiler.hardware import CATALOG, Cluster, lookup

GiB, GB, TFLOPS = 2**30, 1e9, 1e12
REQUIRED = ["V100", "A100-40GB", "A100-80GB", "H100", "H200", "L4", "RTX4090", "cpu"]
RATE_FIELDS = ["peak_flops", "intra_node_bandwidth", "inter_node_bandwidth", "host_to_device_bandwidth",
               "cpu_optimizer_rate"]


# --- the catalog -----------------------------------------------------------------------------------------------

def test_catalog_has_every_required_device_and_every_number_is_positive():
    assert set(REQUIRED) <= set(CATALOG)
    for name in REQUIRED:
        cluster = Cluster.from_catalog(name)
        for field in RATE_FIELDS + ["device_memory", "host_memory"]:
            assert getattr(cluster, field) > 0, (name, field)
        assert 0 < cluster.flops_efficiency <= 1
        assert cluster.source == "catalog"


def test_nvlink_is_counted_per_direction_as_half_the_datasheet_total():
    # Datasheets quote NVLink both directions together: V100 300, A100 600, H100/H200 900 GB/s.
    for name, bidirectional in [("V100", 300), ("A100-40GB", 600), ("A100-80GB", 600), ("H100", 900), ("H200", 900)]:
        assert Cluster.from_catalog(name).intra_node_bandwidth == pytest.approx(bidirectional * GB / 2)


def test_gpus_without_nvlink_talk_over_pcie_inside_a_node():
    for name in ["L4", "RTX4090"]:
        cluster = Cluster.from_catalog(name)
        assert cluster.intra_node_bandwidth == cluster.host_to_device_bandwidth == pytest.approx(25 * GB)  # Gen4


def test_host_links_follow_the_pcie_generation_and_infiniband_line_rate():
    # PCIe x16 per direction in practice: Gen3 ~12, Gen4 ~25, Gen5 ~50 GB/s (REFERENCE.md, physical limits).
    assert Cluster.from_catalog("V100").host_to_device_bandwidth == pytest.approx(12 * GB)
    assert Cluster.from_catalog("A100-80GB").host_to_device_bandwidth == pytest.approx(25 * GB)
    assert Cluster.from_catalog("H100").host_to_device_bandwidth == pytest.approx(50 * GB)
    # One InfiniBand NIC per GPU: HDR 200 Gb/s on DGX A100, NDR 400 Gb/s on DGX H100/H200.
    assert Cluster.from_catalog("A100-40GB").inter_node_bandwidth == pytest.approx(200e9 / 8)
    assert Cluster.from_catalog("H200").inter_node_bandwidth == pytest.approx(400e9 / 8)


def test_compute_rates_match_datasheets_and_the_measured_h200():
    assert Cluster.from_catalog("V100").peak_flops == pytest.approx(125 * TFLOPS)  # fp16 tensor: V100 has no bf16
    assert Cluster.from_catalog("A100-80GB").peak_flops == pytest.approx(312 * TFLOPS)  # bf16 dense
    # H100 datasheet: "1,979 teraFLOPS" bf16 with sparsity, rounded; dense is half (whitepaper: 989.4 / 1978.9).
    assert Cluster.from_catalog("H100").peak_flops == pytest.approx(1979 * TFLOPS / 2, rel=1e-3)
    # REFERENCE.md: ~790 TFLOP/s measured on an H200 here; the catalog's sustained rate should agree within 5%.
    assert Cluster.from_catalog("H200").sustained_flops == pytest.approx(790 * TFLOPS, rel=0.05)


def test_the_500w_h100_runs_its_compute_bound_kernels_at_what_one_published_run_implies():
    """catalog.py's arithmetic by hand: torchtitan's 8-GPU Llama 3.1 8B step takes 2 × 8192 / 5,762 = 2.843 s; the
    cost model prices 0.627 s of it outside matmuls and attention, and 1.390 s for them at the SXM part's rates;
    1.390 / (2.843 − 0.627) = 0.627, so 0.627 × 794.5 = 498 TFLOP/s of matmul and 0.627 × 0.35 of peak for
    attention. The SXM entry keeps its datasheet figures."""
    from nbtrain.profiler.catalog import H100_500W_CLOCK

    assert H100_500W_CLOCK == pytest.approx(1.390 / (2 * 8192 / 5762 - 0.627), rel=1e-12)
    assert H100_500W_CLOCK == pytest.approx(0.627, abs=5e-4)
    capped, sxm = Cluster.from_catalog("H100-500W", num_devices=8), Cluster.from_catalog("H100", num_devices=8)
    assert capped.sustained_flops == pytest.approx(498.3 * TFLOPS, rel=1e-3)
    assert capped.peak_flops * capped.attention_efficiency == pytest.approx(0.627 * 0.35 * 989.4 * TFLOPS, rel=1e-3)
    assert capped.memory_bandwidth == pytest.approx(2.4e12) and capped.device_memory == 96 * GB
    assert (sxm.peak_flops, sxm.sustained_flops, sxm.attention_efficiency, sxm.memory_bandwidth) == \
        pytest.approx((989.4 * TFLOPS, 794.5 * TFLOPS, 0.35, 3.35e12))
    assert lookup("H100-96GB-500W") == lookup("h100 500w") == "H100-500W"  # the entry's name before issue 45


@pytest.mark.slow
def test_the_500w_h100s_figures_are_what_the_cost_model_prices_of_torchtitans_8b_step():
    """The two numbers catalog.py reads off nbtrain's pricing of the run that sets the 500 W H100's rate (Llama 3.1
    8B, dp_shard=8 ac=op, 2 × 8192 tokens a GPU, 95 GiB as the runtime sees them), recomputed: at the SXM part's
    rates the step takes T(1), at half of them T(½); what scales with the rate is 1.390 s = T(½) − T(1), the rest
    0.627 s = 2·T(1) − T(½). ~20 s: it profiles the 8B shape on meta. A change to the cost model that moves them
    must derive the entry again (and bench/published.py then shows the rows on it)."""
    from nbtrain.models.gpt import GPT, GPTConfig
    from nbtrain.planner.cost import estimate
    from nbtrain.planner.plan import Plan
    from nbtrain.profiler.model import profile

    # Meta's Llama 3.1 8B (model card, params.json), as bench/published.py builds it
    config = GPTConfig(vocab_size=128256, block_size=8192, norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                       tie_embeddings=False, norm_eps=1e-5, rope_theta=500000.0, n_layer=32, n_head=32, n_kv_head=8,
                       n_embd=4096, ffn_hidden=14336)
    with torch.device("meta"):
        model = GPT(config)
    prof = profile(model, batch_size=1, seq_len=128)
    plan = Plan.parse("dp_shard=8 ac=op", num_devices=8, num_layers=len(prof.layers), global_batch=16, seq_len=8192)

    def step(rate: float) -> float:
        return estimate(plan, prof, Cluster.from_catalog("H100-500W", num_devices=8, device_memory=95 * GiB,
                                                         flops_efficiency=rate * 794.5 / 989.4,
                                                         attention_efficiency=rate * 0.35)).step_time_s

    at_sxm, at_half = step(1.0), step(0.5)
    assert at_half - at_sxm == pytest.approx(1.390, abs=0.002)
    assert 2 * at_sxm - at_half == pytest.approx(0.627, abs=0.002)
    published = estimate(plan, prof, Cluster.from_catalog("H100-500W", num_devices=8, device_memory=95 * GiB))
    assert published.tokens_per_s / 8 == pytest.approx(5762, rel=0.002)


def test_a_dgx_a100s_host_updates_adamw_as_fast_as_its_memory_allows_and_other_hosts_keep_one_thread_a_socket():
    """By hand (catalog.py's sources): nbtrain's executor gives each of a DGX A100's 8 ranks its 16 cores less one
    for the offloaded update, 120 threads, which at 1.4 G params/s a thread could update 168 G params/s; the
    host's memory sustains 2 × 148 GB/s (STREAM on one socket of a DGX A100's EPYC 7742s, doubled) and AdamW with
    an fp32 master moves 28 bytes a parameter: 296e9 / 28 = 10.57 G params/s a node. Hosts without a sourced
    bandwidth keep 1.4 G params/s a socket, 2.8 a two-socket node."""
    from nbtrain.profiler.catalog import host_adamw_rate

    assert Cluster.from_catalog("A100-80GB", 8).cpu_optimizer_rate == pytest.approx(296e9 / 28, rel=1e-12)
    assert Cluster.from_catalog("A100-40GB", 8).cpu_optimizer_rate == pytest.approx(10.571e9, rel=1e-4)
    assert host_adamw_rate(120, 296e9) == pytest.approx(296e9 / 28)       # the memory binds
    assert host_adamw_rate(2, 296e9) == pytest.approx(2.8e9)             # two threads: the threads bind
    for name in ("V100", "H100", "H100-500W", "H200"):
        assert Cluster.from_catalog(name, 8).cpu_optimizer_rate == pytest.approx(2 * 1.4e9)


def test_device_memory_is_what_the_runtime_sees():
    assert Cluster.from_catalog("H100").device_memory == 80 * GiB
    assert 139 * GiB <= Cluster.from_catalog("H200").device_memory <= 141 * GiB  # nvidia-smi: 143771 MiB
    assert Cluster.from_catalog("A100-40GB").device_memory < Cluster.from_catalog("A100-80GB").device_memory


# --- lookup ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alias, name", [
    ("h100", "H100"), ("H100-80GB", "H100"), ("NVIDIA H200", "H200"), ("a100", "A100-80GB"),
    ("A100 40GB", "A100-40GB"), ("a100_80gb", "A100-80GB"), ("4090", "RTX4090"), ("rtx-4090", "RTX4090"),
    ("l4", "L4"), ("Tesla V100", "V100"), ("CPU", "cpu"),
])
def test_lookup_ignores_case_and_spacing_and_knows_common_aliases(alias, name):
    assert lookup(alias) == name
    assert Cluster.from_catalog(alias).device == name


def test_an_unknown_device_is_an_error_that_lists_the_known_ones():
    with pytest.raises(UnknownDeviceError) as caught:
        Cluster.from_catalog("B300")
    assert isinstance(caught.value, (NbtrainError, LookupError))
    for name in REQUIRED:
        assert name in str(caught.value)


# --- construction and validation -------------------------------------------------------------------------------

def test_an_override_changes_exactly_that_field():
    plain = Cluster.from_catalog("H100", num_devices=8)
    tuned = Cluster.from_catalog("H100", num_devices=8, inter_node_bandwidth=25e9)
    assert tuned.inter_node_bandwidth == 25e9
    assert tuned.replace(inter_node_bandwidth=plain.inter_node_bandwidth) == plain
    assert plain.replace(device_memory="40GiB").device_memory == 40 * GiB  # sizes may be written as text


def test_devices_per_node_defaults_to_an_eight_gpu_server_and_one_cpu_host():
    assert Cluster.from_catalog("H100", num_devices=16).num_nodes == 2
    assert Cluster.from_catalog("H100", num_devices=4).num_nodes == 1
    cpu = Cluster.from_catalog("cpu", num_devices=4)
    assert cpu.num_nodes == 1
    assert cpu.device_memory == cpu.host_memory // 4  # the worker processes share the host's memory
    assert cpu.inter_node_bandwidth == pytest.approx(Cluster.from_catalog("cpu").inter_node_bandwidth / 4)


def test_an_unknown_override_is_an_error_that_names_the_valid_fields():
    with pytest.raises(InvalidArgumentError, match="valid fields: .*peak_flops.*cpu_optimizer_rate"):
        Cluster.from_catalog("H100", nvlink=900e9)
    with pytest.raises(InvalidArgumentError, match="'hbm'"):
        Cluster.from_catalog("H100").replace(hbm=1)


def test_zero_devices_is_an_error():
    with pytest.raises(InvalidArgumentError, match="num_devices must be a whole number ≥ 1, got 0"):
        Cluster.from_catalog("H100", num_devices=0)


def test_devices_that_do_not_fill_whole_nodes_are_an_error_that_shows_the_arithmetic():
    with pytest.raises(InvalidArgumentError,
                       match=r"12 = 1 × 8 \+ 4; use a multiple of 8 devices or 6 devices per node"):
        Cluster.from_catalog("H100", num_devices=12)
    assert Cluster.from_catalog("H100", num_devices=12, devices_per_node=6).num_nodes == 2


@pytest.mark.parametrize("field, value, words", [
    ("peak_flops", 0, "peak_flops must be a positive number of FLOP/s"),
    ("host_memory", -1, "host_memory must be a positive number of bytes"),
    ("inter_node_bandwidth", float("nan"), "inter_node_bandwidth must be a positive"),
    ("flops_efficiency", 1.5, r"must be in \(0, 1\]"),
    ("flops_efficiency", 0, r"must be in \(0, 1\]"),
])
def test_impossible_numbers_are_rejected_with_what_is_wrong(field, value, words):
    with pytest.raises(InvalidArgumentError, match=words):
        Cluster.from_catalog("A100-80GB", **{field: value})


# --- serialisation and display ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", REQUIRED)
def test_json_round_trip_is_exact(name):
    cluster = Cluster.from_catalog(name, num_devices=2, flops_efficiency=0.6123456789, source="calibrated")
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


def test_from_dict_rejects_unknown_and_missing_keys():
    data = Cluster.from_catalog("L4").to_dict()
    with pytest.raises(InvalidArgumentError, match="'colour'"):
        Cluster.from_dict({**data, "colour": "green"})
    del data["peak_flops"]
    with pytest.raises(InvalidArgumentError, match="lacks peak_flops"):
        Cluster.from_dict(data)


def test_the_table_names_the_device_and_shows_units():
    cluster = Cluster.from_catalog("H100", num_devices=16)
    text = str(cluster)
    assert "H100" in text and "80.00 GiB" in text and "2.00 TiB" in text
    assert "TFLOP/s" in text and "450.0 GB/s" in text and "G params/s" in text
    assert '<table class="nbtrain-table">' in cluster._repr_html_() and "H100" in cluster._repr_html_()


def test_the_summary_is_one_line_with_counts_memory_compute_and_links():
    assert Cluster.from_catalog("H100", num_devices=8).summary() == (
        "8 × H100 (1 node) · 80.00 GiB each · 989.4 TFLOP/s bf16 · NVLink 450.0 GB/s")
    assert "InfiniBand NDR 50.0 GB/s" in Cluster.from_catalog("H100", num_devices=16).summary()


def test_planning_code_can_import_the_cluster_model_without_torch():
    code = "import sys, nbtrain.profiler.hardware; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- calibration -----------------------------------------------------------------------------------------------

def test_measurements_fill_in_rates_a_gpu_keeps_its_datasheet_peak():
    found = [bench.Measurement("matmul", 700e12, "FLOP/s", 0.1, ""),
             bench.Measurement("copy", 40e9, "B/s", 0.1, ""),
             bench.Measurement("allreduce", 300e9, "B/s", 0.1, "")]
    cluster = Cluster.from_catalog("H100", num_devices=8).with_measurements(found)
    assert cluster.peak_flops == pytest.approx(989.4 * TFLOPS)
    assert cluster.sustained_flops == pytest.approx(700e12)
    assert (cluster.host_to_device_bandwidth, cluster.intra_node_bandwidth) == (40e9, 300e9)
    assert cluster.source == "calibrated"
    cpu = Cluster.from_catalog("cpu").with_measurements(found[:1])
    assert (cpu.peak_flops, cpu.flops_efficiency) == (700e12, 1.0)  # no datasheet: the measurement is the peak


@pytest.mark.skipif(torch.cuda.is_available(), reason="detect() describes the GPUs when CUDA is present")
def test_detect_on_this_machine_gives_calibrated_cpu_devices():
    threads = torch.get_num_threads()
    cluster = Cluster.detect()
    assert cluster.device == "cpu" and cluster.source == "calibrated"
    assert cluster.num_nodes == 1
    # Loose physical bounds: one core does 1 GFLOP/s .. 1 TFLOP/s fp32, memcpy 0.1 .. 200 GB/s, AdamW 10 M .. 20 G/s.
    assert 1e9 < cluster.peak_flops < 1e12
    assert 1e8 < cluster.host_to_device_bandwidth < 2e11
    assert 1e7 < cluster.cpu_optimizer_rate < 2e10
    assert torch.get_num_threads() == threads  # the benchmarks restore the caller's thread count


def test_a_measurement_prints_its_rate_with_a_unit():
    m = bench.cpu_adamw_rate(num_params=100_000, threads=1, repeats=2)
    assert m.name == "cpu_adamw" and m.unit == "params/s" and m.value > 0
    assert "params/s" in str(m) and "fused=True" in str(m)


@pytest.mark.slow
def test_allreduce_bandwidth_between_two_spawned_gloo_processes_is_positive():
    m = bench.allreduce_bandwidth(world_size=2, nbytes=4 * 2**20, timeout=60)  # a hang fails after 60 s
    assert m.unit == "B/s" and 1e6 < m.value < 1e12
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_an_allreduce_that_runs_out_of_time_stops_its_workers_and_says_so():
    with pytest.raises(CalibrationError, match="workers were stopped"):
        bench.allreduce_bandwidth(world_size=2, timeout=0.5)  # workers cannot even import torch in 0.5 s
    assert not multiprocessing.active_children()


def test_a_cluster_measured_once_is_saved_and_planned_for_again_without_measuring(tmp_path, capsys):
    from nbtrain.cli import main

    here = Cluster.detect(calibrate=False)           # this machine, as a GPU cluster's figures would be too
    here.save(tmp_path / "here.json")
    assert Cluster.load(tmp_path / "here.json") == here
    catalog = Cluster.from_catalog("H100", num_devices=16)
    catalog.save(tmp_path / "h100x16.json")
    assert main(["plan", "gpt-tiny", "--cluster", str(tmp_path / "h100x16.json"), "--batch", "32", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["plan", "gpt-tiny", "--gpus", "16", "--batch", "32", "--json"]) == 0
    assert from_file == json.loads(capsys.readouterr().out)  # the same plan as for the catalog's 16 × H100


def test_a_saved_cluster_that_cannot_be_read_says_how_to_write_one(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgumentError, match="not a cluster"):
        Cluster.load(tmp_path / "list.json")
    with pytest.raises(InvalidArgumentError, match="nbtrain cluster --detect --save FILE"):
        Cluster.load(tmp_path / "missing.json")
    (tmp_path / "partial.json").write_text('{"device": {"name": "H100"}}')
    with pytest.raises(InvalidArgumentError):
        Cluster.load(tmp_path / "partial.json")


def test_plan_for_a_saved_cluster_refuses_catalog_flags_beside_it(tmp_path, capsys):
    from nbtrain.cli import main

    Cluster.from_catalog("H100", num_devices=8).save(tmp_path / "c.json")
    assert main(["plan", "gpt-tiny", "--cluster", str(tmp_path / "c.json"), "--gpus", "4", "--batch", "8"]) == 2
    assert "--cluster FILE describes the devices" in capsys.readouterr().err


def test_a_gpu_is_named_from_nvidia_smi_without_initialising_cuda_when_pynvml_is_missing(tmp_path, monkeypatch):
    # the GPU machines this runs on may bring torch, accelerate and transformers only: no pynvml, but the driver's
    # nvidia-smi, whose --format=csv,noheader,nounits prints "name, MiB" (what it prints for an H200 here)
    from nbtrain.profiler.catalog import local_gpu_name

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # "import pynvml" fails
    assert local_gpu_name() == ("NVIDIA H200", 143771 * 2**20)
    assert not torch.cuda.is_initialized()
