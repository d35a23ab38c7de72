"""The ``nbtrain`` command: its JSON is what the API computes, and every user error is one line with status 2."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

import nbtrain
from nbtrain.cli import main
from nbtrain.errors import WorkerError


def run_cli(*args: str, timeout: float = 240) -> tuple[int, str, str, int]:
    """Run the command in a fresh process: ``(status, stdout, stderr, peak RSS bytes)``.

    The peak is the largest of this test process's finished children (``RUSAGE_CHILDREN``; KiB on Linux): an upper
    bound on this command's own peak.
    """
    proc = subprocess.run([sys.executable, "-m", "nbtrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return proc.returncode, proc.stdout, proc.stderr, peak


def test_profile_json_has_the_documented_fields_and_matches_the_api(capsys):
    assert main(["profile", "gpt-tiny", "--batch", "2", "--seq", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    prof = nbtrain.profile("gpt-tiny", batch_size=2, seq_len=64)
    assert data["model"] == "gpt-tiny" and data["params"] == prof.params
    assert data["flops_per_step"] == prof.flops_per_step
    assert [layer["name"] for layer in data["layers"]] == [layer.name for layer in prof.layers]
    for layer in data["layers"]:
        assert {"name", "params", "flops_fwd", "flops_bwd", "activation_bytes", "output_bytes"} <= layer.keys()


def test_profile_prints_a_table_by_default(capsys):
    assert main(["profile", "gpt-tiny", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0-3" in out and "plain Adam training on one device" in out


@pytest.mark.parametrize("args,message", [
    (["profile", "gpt5"], "unknown model 'gpt5'; known presets: gpt2"),
    (["profile", "no_such_module_xyz:model"], "cannot import 'no_such_module_xyz'"),
    (["profile", "json:decoder"], "is a module, not a torch.nn.Module"),
    (["profile", "os:sep"], "is a str, not a torch.nn.Module"),
    (["profile", "gpt2", "--seq", "2048"], "exceeds the model's context length 1024"),
    (["cluster", "TPUv9"], "unknown device 'TPUv9'"),
    (["cluster"], "name a device from the catalog"),
    (["profile", "gpt-tiny", "--seq", "32", "--measure", "tpu"], "cannot measure on 'tpu': name a torch device"),
    (["plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--memory", "40"], "'40' has no unit; write '40GiB'"),
    (["plan", "llama-tiny", "--gpus", "4", "--batch", "16", "--strategy", "tp=4"],
     "layer 1 (blocks.0) of llama-tiny: tp=4 does not divide the 2 key/value heads (4 query heads share them); "
     "use a tp that divides 2: 1 or 2"),
    (["verify", "torch.nn:Identity", "--strategy", "dp_shard=2", "--processes", "2"],
     "torch.nn:Identity gives Identity, which takes no token ids"),
    (["verify", "gpt-tiny", "--strategy", "dp_shard=2", "--processes", "2", "--seq", "4096"],
     "sequence length 4096 exceeds the model's block_size 256; give rows of at most 256 tokens"),
    (["export", "torch.nn:Linear", "--out", "run.ipynb"], "export writes a notebook that builds a preset"),
])
def test_user_errors_print_one_line_and_exit_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbtrain: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["profile", "gpt2", "--batch", "0"], "--batch: must be a positive integer, got 0"),
    (["profile", "gpt2", "--seq", "-5"], "--seq: must be a positive integer, got -5"),
    (["profile", "gpt2", "--batch", "many"], "--batch: 'many' is not an integer"),
    (["profile", "gpt2", "--seq", "x"], "argument --seq: 'x' is not an integer"),
    (["profile", "gpt2", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
])
def test_malformed_arguments_exit_2_with_the_usage_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cluster_from_the_catalog_prints_its_numbers(capsys):
    assert main(["cluster", "h100", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "H100" in out and "16 = 2 nodes × 8" in out


@pytest.mark.slow
def test_llama_70b_is_profiled_by_the_console_command_without_allocating_its_weights():
    status, out, err, peak = run_cli("profile", "llama-70b", "--batch", "1", "--seq", "4096", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["params"] == pytest.approx(68.98e9, rel=5e-3)
    # The bf16 weights alone are 138 GB; a process that stays under 3 GB has allocated none of them.
    assert 0 < peak < 3 * 2**30


def test_a_plan_file_for_more_devices_than_the_processes_asked_for_is_refused_before_launch(tmp_path, capsys):
    from nbtrain.planner.plan import Plan

    plan = tmp_path / "plan.json"
    plan.write_text(Plan.parse("dp_shard=8", num_devices=8, num_layers=6).to_json())
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('launched')\n")
    assert main(["run", str(script), "--plan", str(plan), "--processes", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"nbtrain: error: the plan in {plan} is for 8 devices but --processes asks for 2; leave out "
                   f"--processes to launch 8, or write the plan for 2 (nbtrain plan MODEL --gpus 2 ... --json > "
                   f"{plan})\n")


@pytest.mark.slow
def test_a_script_that_raises_in_a_worker_ends_with_one_line_under_the_ranks_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\n"
                      "if dist.get_rank() == 1:\n"
                      "    raise ValueError('bad input on rank 1')\n")
    status, _, err, _ = run_cli("run", str(script), "--processes", "2")
    assert status == 2
    *above, last = err.strip().splitlines()
    assert last.startswith("nbtrain: error: rank 1 of 2 failed: ValueError: bad input on rank 1")
    assert "Traceback" not in last
    assert f'File "{script}", line 3, in <module>' in "\n".join(above)


def test_a_worker_errors_line_is_its_message_without_the_traceback_and_keeps_what_follows_it():
    traceback = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad'
    error = WorkerError("rank 1 of 2 failed: ValueError: bad; the other workers were stopped. Traceback of rank 1:\n"
                        f"{traceback} The last complete checkpoint is ckpt/step-2.", 1, traceback)
    assert error.summary == ("rank 1 of 2 failed: ValueError: bad; the other workers were stopped. The last complete "
                             "checkpoint is ckpt/step-2.")
    assert WorkerError("rank 0 of 2 died with signal SIGKILL", 0).summary == "rank 0 of 2 died with signal SIGKILL"


def test_plan_without_a_described_cluster_is_for_this_machine_and_says_so(capsys):
    main(["plan", "gpt-tiny", "--batch", "8", "--seq", "64"])  # no --gpus, --gpu, --cluster: here, 2 CPU processes
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("recommended: ") and summary.endswith("· for this machine: 2 × cpu (calibrated)")
    main(["plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--seq", "64"])  # one flag: a described cluster
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("· for 2 × H100 (catalog)")
