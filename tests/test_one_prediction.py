"""One plan, one prediction: a plan made for this machine's processes shows the same predicted step in the plan
table, in the comparison, and beside the measured step of its launch (issue 28, point 4) — calibrated once per kernel
and profiled with the layers timed here at the plan's micro-batch, the way the launch prices it."""

from __future__ import annotations

import re

import pytest

CELL = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, "
        "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, "
        "use_cache=False))\n")


LAUNCHED = re.compile(r"measured step time \(median after the first\): [0-9.]+ [µm]?s · predicted: ([0-9.]+ [µm]?s)")
"""The launch's step table: its predicted step."""


@pytest.fixture(autouse=True)
def noninteractive(monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")


@pytest.mark.parametrize("strategy", [None, "pp=2 mb=4"])
def test_the_plan_table_and_the_launch_print_the_same_predicted_step(shell, capsys, strategy):
    typed = f' --strategy "{strategy}"' if strategy else ""
    result = shell.run_cell(f"%%autoparallel --processes 2 --batch 8 --seq 32 --steps 3 --launch -o got{typed}\n"
                            f"{CELL}")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    planned = re.search(r"^predicted: ([0-9.]+ [µm]?s) per step", out, re.M)
    launched = LAUNCHED.search(out)
    assert planned and launched, out
    assert planned.group(1) == launched.group(1), out
    label = "your plan" if strategy else "recommended"
    row = re.search(rf"^{label}\s+\S.*?\s([0-9.]+ [µm]?s)\s", out, re.M)
    assert row and row.group(1) == planned.group(1), out  # the comparison's row is the same number


QWEN_WITH_BATCHES = (
    "import torch\n"
    "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
    "g = torch.Generator().manual_seed(0)\n"
    "batches = [torch.randint(0, 256, (6, 25), generator=g) for _ in range(3)]   # token ids, as a dataset gives them\n"
    "model = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
    "num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False))\n")


@pytest.mark.parametrize("strategy", [None, "pp=2 mb=1 schedule=gpipe"])
def test_with_data_the_table_plans_the_batches_the_launch_trains_on(shell, capsys, strategy):
    """Issue 45: with --data and no --batch/--seq, the table planned 4 rows a process at the profile's length while
    the launch trained the data's rows, so the launch predicted another plan's step (the table's mb=2 alternative).
    A GPipe plan with fewer micro-batches than stages, which this machine's calibration sometimes recommends, is
    launched as planned (CI once saw the table at mb=1 and the launch at mb=2)."""
    typed = f' --strategy "{strategy}"' if strategy else ""
    result = shell.run_cell(f"%%autoparallel --processes 2 --data batches --steps 3 --launch -o got{typed}\n"
                            f"{QWEN_WITH_BATCHES}")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    planned = re.search(r"^predicted: ([0-9.]+ [µm]?s) per step .* memory ([0-9.]+ [KMG]?i?B) of", out, re.M)
    launched = LAUNCHED.search(out)
    memory = re.search(r"predicted per device: ([0-9.]+ [KMG]?i?B)", out)
    assert planned and launched and memory, out
    assert planned.group(1) == launched.group(1), out
    assert planned.group(2) == memory.group(1), out
    got = shell.user_ns["got"]
    if strategy:
        assert f"trained under: {strategy} | dp_replicate=1" in out, out
    assert got.global_batch == 6 and got.seq_len == 24  # the data's rows; 25 ids give 24 next tokens
