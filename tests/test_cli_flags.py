"""Every flag of every ``nbtrain`` command, with the values people type (the same ones tests/test_magic_flags.py
gives the magic): a flag changes what the command prints, and a value it cannot read is one line with status 2.

Most tests call ``nbtrain.cli.main`` with the argument list a shell would pass; the ones about shell quoting run the
console script under ``bash -c``, as typed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from nbtrain.cli import main

GiB = 2**30
NBTRAIN = str(Path(sys.executable).with_name("nbtrain"))


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def error_line(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


# nbtrain plan ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("typed, expected_bytes", [
    ("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("24GB", 24 * 10**9), ("24gb", 24 * 10**9), ("24g", 24 * GiB),
    ("0.5TiB", 512 * GiB), ("25769803776", 25769803776),
])
def test_plan_memory_is_read_in_the_units_people_write(capsys, typed, expected_bytes):
    plan = run_json(capsys, "plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--memory", typed)
    assert plan["predicted"]["budget_bytes"] == expected_bytes


@pytest.mark.parametrize("typed, message", [
    ("lots", "nbtrain: error: cannot read 'lots' as a size; write it like '40GiB', '512MiB' or '80GB'"),
    ("40", "nbtrain: error: '40' has no unit; write '40GiB' (or MiB, GB, ...; '40B' for bytes)"),
    ("0GiB", "nbtrain: error: '0GiB' is no memory at all; give a size above 0, e.g. '24GiB'"),
])
def test_plan_memory_it_cannot_read_is_one_line(capsys, typed, message):
    assert error_line(capsys, "plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--memory", typed) == message


def test_plan_decimal_memory_says_how_it_was_read(capsys):
    assert main(["plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--memory", "24GB"]) == 0
    assert "note: --memory 24GB is 24,000,000,000 bytes = 22.35 GiB" in capsys.readouterr().out


def test_plan_for_gpus_batch_and_seq_is_for_those(capsys):
    plan = run_json(capsys, "plan", "gpt-tiny", "--gpus", "4", "--batch", "8", "--seq", "64")
    assert (plan["num_devices"], plan["global_batch"], plan["seq_len"]) == (4, 8, 64)


def test_plan_offloads_where_the_model_fits_no_other_way_and_no_offload_turns_it_off(capsys):
    # LLaMA-7B with AdamW: 16 bytes per parameter of model states, 100 GiB, on one 40 GiB device
    plan = run_json(capsys, "plan", "llama-7b", "--gpus", "1", "--memory", "40GiB", "--batch", "8", "--seq", "512")
    assert plan["predicted"]["fits"] and any(layer["offload"] > 0 for layer in plan["layers"])
    assert any("without it nothing fits 40.00 GiB per device" in note for note in plan["notes"])
    assert error_line(capsys, "plan", "llama-7b", "--gpus", "1", "--memory", "40GiB", "--batch", "8", "--seq", "512",
                      "--no-offload").startswith("nbtrain: error: no plan fits 40.00 GiB per device")


def test_plan_gpu_sets_the_default_budget_to_that_devices_memory(capsys):
    assert run_json(capsys, "plan", "gpt-tiny", "--gpus", "2", "--batch", "8",
                    "--gpu", "A100-40GB")["predicted"]["budget_bytes"] == 40 * GiB


def test_plan_gpus_per_node_makes_a_tensor_parallel_group_across_nodes_slower(capsys):
    args = ("plan", "gpt-tiny", "--gpus", "16", "--batch", "32", "--strategy", "tp=4")
    one_node = run_json(capsys, *args)["predicted"]["step_time_s"]
    two_per_node = run_json(capsys, *args, "--gpus-per-node", "2")["predicted"]["step_time_s"]
    assert two_per_node > one_node


def test_plan_dtype_fp32_doubles_the_parameter_bytes(capsys):
    args = ("plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--strategy", "dp_replicate=2")
    half = run_json(capsys, *args, "--dtype", "bf16")["predicted"]["stages"][0]["memory"]["params"]
    full = run_json(capsys, *args, "--dtype", "fp32")["predicted"]["stages"][0]["memory"]["params"]
    assert full == pytest.approx(2 * half)


def test_plan_top_keeps_that_many_plans(capsys):
    assert len(run_json(capsys, "plan", "gpt-tiny", "--gpus", "8", "--batch", "32", "--top", "1")["alternatives"]) == 0
    assert len(run_json(capsys, "plan", "gpt-tiny", "--gpus", "8", "--batch", "32", "--top", "3")["alternatives"]) == 2


@pytest.mark.parametrize("typed, normal", [
    ("--strategy dp_shard=2", "dp_shard=2"),
    ('--strategy "dp_shard=2 ac"', "dp_shard=2 ac"),
    ("--strategy 'pp=2 mb=2 | dp_replicate=1'", "pp=2 mb=2 schedule=1f1b | dp_replicate=1"),
    ('--memory "24 GiB" --strategy="0: dp_shard=2; 1-5: tp=2 ac"', "0: dp_shard=2; 1-5: tp=2 ac"),
])
def test_plan_strategy_typed_in_a_shell_quoted_or_not_is_the_plan_evaluated(typed, normal):
    shown = subprocess.run(["bash", "-c", f"{NBTRAIN} plan gpt-tiny --gpus 2 --batch 8 {typed}"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == f"gpt-tiny on 2 devices: {normal}"
    assert shown.stdout.strip().splitlines()[-1].startswith("your plan: ")


def test_a_typed_plan_is_called_yours_never_recommended_and_says_when_it_does_not_fit(capsys):
    # plain data parallelism of a 7B model: every H100 holds 16 bytes per parameter, 112 GB of 80
    main(["plan", "llama-7b", "--gpus", "8", "--batch", "8", "--seq", "1024", "--strategy", "dp_replicate=8"])
    out = capsys.readouterr().out
    assert "recommended" not in out
    assert out.strip().splitlines()[-1].startswith("your plan: ") and "DOES NOT FIT" in out.splitlines()[-1]
    first_row = next(line for line in out.splitlines() if line.startswith("your plan "))
    assert first_row.endswith(" no")  # it does not fit, and so has no time ratio, not even 1.00× to itself
    assert "× your plan's time" in out


# nbtrain profile ---------------------------------------------------------------------------------------------------

def test_profile_batch_seq_and_dtype_are_the_profiled_shape(capsys):
    prof = run_json(capsys, "profile", "gpt-tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32")
    assert (prof["batch_size"], prof["seq_len"], prof["dtype"]) == (2, 32, "float32")


def test_profile_measure_on_the_cpu_times_each_layer(capsys):
    prof = run_json(capsys, "profile", "gpt-tiny", "--seq", "32", "--measure", "cpu")
    assert prof["measured_on"] == "cpu"


def test_profile_measure_on_an_unknown_device_is_one_line(capsys):
    assert "cannot measure on 'tpu': name a torch device" in error_line(capsys, "profile", "gpt-tiny", "--measure",
                                                                         "tpu")


# nbtrain cluster ---------------------------------------------------------------------------------------------------

def test_cluster_from_the_catalog_with_gpus_and_gpus_per_node(capsys):
    cluster = run_json(capsys, "cluster", "h100", "--gpus", "16", "--gpus-per-node", "4")
    assert (cluster["device"], cluster["num_devices"], cluster["devices_per_node"]) == ("H100", 16, 4)


@pytest.mark.parametrize("argv", [["cluster", "H100", "--detect"], ["cluster", "--detect", "--gpus", "8"]])
def test_cluster_detect_with_a_catalog_device_or_count_is_refused_not_ignored(capsys, argv):
    assert "--detect measures this machine" in error_line(capsys, *argv)


@pytest.mark.slow
def test_cluster_detect_measures_this_machine(capsys):
    assert run_json(capsys, "cluster", "--detect")["source"] != "catalog"


# nbtrain export ----------------------------------------------------------------------------------------------------

def test_export_writes_the_plan_for_the_devices_and_steps_given(tmp_path, capsys):
    out = tmp_path / "run.ipynb"
    assert main(["export", "gpt-tiny", "--out", str(out), "--strategy", "dp_shard=2 ac", "--gpus", "2",
                 "--gpu", "A100-80GB", "--batch", "4", "--seq", "32", "--processes", "2", "--steps", "3"]) == 0
    code = "\n".join(c.source for c in nbformat.read(str(out), as_version=4).cells if c.cell_type == "code")
    assert "steps = 3" in code and "num_processes = 2" in code and '"seq_len": 32' in code
    assert f"papermill {out} {tmp_path / 'run-out.ipynb'} -k nbtrain -p steps 3" in capsys.readouterr().out


def test_export_to_a_home_path_expands_the_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["export", "gpt-tiny", "--out", "~/x.ipynb", "--gpus", "2", "--batch", "4"]) == 0
    assert (tmp_path / "x.ipynb").is_file() and not (tmp_path / "~").exists()


def test_export_for_processes_the_plan_cannot_scale_to_writes_nothing(tmp_path, capsys):
    line = error_line(capsys, "export", "gpt-tiny", "--out", str(tmp_path / "run.ipynb"), "--gpus", "8",
                      "--processes", "3")
    assert "scales to a power-of-two multiple or fraction of it, not to 3; launch 2 processes" in line
    assert not (tmp_path / "run.ipynb").exists()


# nbtrain kernel ----------------------------------------------------------------------------------------------------

def test_kernel_install_user_writes_under_the_users_jupyter_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("JUPYTER_DATA_DIR", raising=False)
    assert main(["kernel", "install", "--user"]) == 0
    spec = json.loads(next(tmp_path.rglob("kernels/nbtrain/kernel.json")).read_text())
    assert spec["display_name"] == "Python (nbtrain)"


# nbtrain run, nbtrain demo ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_launches_the_plans_devices_and_passes_the_script_its_arguments(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(subprocess.run([NBTRAIN, "plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--seq", "32",
                                    "--json"], capture_output=True, text=True, check=True, timeout=120).stdout)
    script = tmp_path / "train.py"
    script.write_text("import pathlib, sys, torch.distributed as dist\nfrom nbtrain.run.launch.script import current_plan\n"
                      f"pathlib.Path({str(tmp_path)!r}, f'rank{{dist.get_rank()}}.txt').write_text("
                      "f'of {dist.get_world_size()} {current_plan().num_devices} {sys.argv[1:]}')\n")
    shown = subprocess.run([NBTRAIN, "run", str(script), "--plan", str(plan), "--", "--lr", "3e-4"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert shown.returncode == 0, shown.stderr
    for rank in (0, 1):  # one file per rank: their prints interleave
        assert (tmp_path / f"rank{rank}.txt").read_text() == "of 2 2 ['--lr', '3e-4']"


@pytest.mark.slow
def test_run_timeout_stops_a_script_whose_rank_hangs_and_names_where_each_rank_was(tmp_path, capsys):
    script = tmp_path / "hangs.py"
    script.write_text("import time, torch, torch.distributed as dist\n"
                      "if dist.get_rank() == 1:\n    time.sleep(600)\n"
                      "dist.all_reduce(torch.ones(1))\n")
    line = error_line(capsys, "run", str(script), "--processes", "2", "--timeout", "5")
    assert line.startswith("nbtrain: error: the 2 workers ran past timeout=5 s and were killed.")
    assert "Rank 1 never reached the collective the others wait in" in line


def test_run_timeout_that_is_not_a_positive_number_exits_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "x.py", "--timeout", "0"])
    assert stop.value.code == 2 and "argument --timeout: must be a positive number, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_with_every_flag_plans_the_described_cluster_and_trains_here(tmp_path):
    shown = subprocess.run([NBTRAIN, "demo", "--gpus", "16", "--gpu", "A100-80GB", "--memory", "40GiB",
                            "--processes", "2", "--steps", "2"], capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "16 × A100-80GB" in shown.stdout and "/40.00 GiB" in shown.stdout
    assert "measured step time" in shown.stdout
