"""The planning flags ``nbtrain plan`` and ``%%autoparallel`` share are one definition (nbtrain/plan_flags.py).

Every flag both faces have is a shared one; each face shows it with the same help (``nbtrain plan --help``,
``%%autoparallel?``), reads a typed value as the same value, and refuses the same mistake in the same words. Where
the faces genuinely differ (``plan_flags.Face``), the help says each face's own default, and each face does what its
help says.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from nbtrain.cli import _parser, main
from nbtrain.notebook.magics import AutoparallelMagics
from nbtrain.plan_flags import AUTOPARALLEL, NBTRAIN_PLAN, planning_flags

MAGIC = AutoparallelMagics.autoparallel
SHARED = [flag.names[0] for flag in planning_flags(NBTRAIN_PLAN)]
DESTS = sorted({flag.options.get("dest", flag.names[0].lstrip("-").replace("-", "_"))
                for flag in planning_flags(NBTRAIN_PLAN)})
TINY = ("import nbtrain\n"
        "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))\n")

# Where the faces differ, and only there: what `nbtrain plan --help` says -> what `%%autoparallel?` says instead.
FACE_WORDS = {
    "--gpus": ("default 1 with --gpu", "default 8 with --gpu"),
    "--gpu": ("or 2 CPU worker processes", "or --processes CPU processes"),
    "--batch": ("sequences per step", "sequences per step (default 4 per device)"),
}


def shown_help(text: str) -> dict[str, str]:
    """Each option of a help text with what it says: ``{'--gpus': 'devices of a described cluster ...'}``."""
    shown, option = {}, None
    for line in text.splitlines():
        if re.match(r"  -", line):  # "  --gpus GPUS    devices of ...", or the help alone on the next lines
            invocation, _, words = line.strip().partition("  ")
            option = invocation.split()[0].rstrip(",")
            shown[option] = words.strip()
        elif option and line.startswith("   ") and line.strip():
            shown[option] = f"{shown[option]} {line.strip()}".strip()
        else:
            option = None
    return shown


@pytest.fixture
def cli_help(capsys, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("COLUMNS", "2000")  # one line per option: help as written, not as wrapped
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    assert stop.value.code == 0
    return shown_help(capsys.readouterr().out)


@pytest.fixture
def magic_help(monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("COLUMNS", "2000")
    return shown_help(MAGIC.parser.format_help())  # what %%autoparallel? prints, at this width


def cli_reads(line: str) -> dict:
    args = _parser().parse_args(["plan", "gpt-tiny", *line.split()])
    return {dest: getattr(args, dest) for dest in DESTS}


def magic_reads(line: str) -> dict:
    args = parse_argstring(MAGIC, line)
    return {dest: getattr(args, dest) for dest in DESTS}


def test_every_flag_both_faces_have_is_defined_once_for_both(cli_help, magic_help):
    assert set(cli_help) & set(magic_help) == set(SHARED)
    assert all(flag in MAGIC.__doc__ for flag in SHARED)  # the text %%autoparallel? shows


@pytest.mark.parametrize("flag", SHARED)
def test_each_shared_flag_shows_the_same_help_on_both_faces(cli_help, magic_help, flag):
    says = cli_help[flag]
    if flag in FACE_WORDS:
        command_words, cell_words = FACE_WORDS[flag]
        assert command_words in says, says
        says = says.replace(command_words, cell_words)
    assert says == magic_help[flag]


@pytest.mark.parametrize("typed", [
    "", "--gpus 16", "--gpus 16 --gpus-per-node 4", "--gpu A100-80GB", "--memory 24GiB", "--memory 24GB",
    "--headroom 5%", "--batch 64", "--seq 2048", "--dtype fp32", "--dtype fp16", "--strategy dp_shard=8",
    "--no-offload", "--offload", "--no-offload --offload", "--top 1",
])
def test_both_faces_read_a_typed_value_as_the_same_value(typed):
    line = typed if "--batch" in typed else f"{typed} --batch 8"
    assert cli_reads(line) == magic_reads(line)


def test_the_values_read_are_the_ones_typed_and_the_defaults_are_the_documented_ones():
    assert cli_reads("--gpus 16 --memory 24GiB --no-offload --dtype fp32 --batch 64") == {
        "batch": 64, "dtype": "fp32", "gpu": None, "gpus": 16, "gpus_per_node": None, "headroom": None,
        "memory": "24GiB", "offload": False, "seq": None, "strategy": None, "top": 3}


@pytest.mark.parametrize("typed, message", [
    ("--gpus 0", "--gpus 0: must be a positive integer"),
    ("--gpus eight", "--gpus eight: must be a positive integer"),
    ("--gpus 2.5", "--gpus 2.5: must be a positive integer"),
    ("--gpus-per-node 0", "--gpus-per-node 0: must be a positive integer"),
    ("--batch 0", "--batch 0: must be a positive integer"),
    ("--seq -4", "--seq -4: must be a positive integer"),
    ("--top 0", "--top 0: must be a positive integer"),
    ("--dtype fp8", "--dtype fp8: use bf16, fp16 or fp32"),
])
def test_both_faces_refuse_the_same_mistake_in_the_same_words(capsys, typed, message):
    with pytest.raises(SystemExit) as stop:
        main(["plan", "gpt-tiny", "--batch", "8", *typed.split()])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"nbtrain plan: error: {message}"
    with pytest.raises(UsageError) as refused:
        parse_argstring(MAGIC, f"--batch 8 {typed}")
    assert str(refused.value) == message


def test_a_quoted_value_in_a_cell_is_read_as_the_value_inside_the_quotes():
    # IPython splits a magic's line without removing quotes
    assert magic_reads('--dtype "fp32" --gpus "16" --batch 8') == magic_reads("--dtype fp32 --gpus 16 --batch 8")


# Where the faces differ, each does what its help says ------------------------------------------------------------

def test_gpu_without_gpus_plans_the_devices_each_face_says(shell, capsys, monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    assert main(["plan", "gpt-tiny", "--gpu", "A100-80GB", "--batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_devices"] == NBTRAIN_PLAN.gpus_with_gpu == 1
    result = shell.run_cell(f"%%autoparallel --gpu A100-80GB --batch 16 -q -o on_gpu\n{TINY}")
    assert result.success, result.error_in_exec
    assert shell.user_ns["on_gpu"].num_devices == AUTOPARALLEL.gpus_with_gpu == 8


def test_batch_is_asked_for_by_the_command_and_four_per_device_in_a_cell(shell, capsys, monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    with pytest.raises(SystemExit) as stop:
        main(["plan", "gpt-tiny", "--gpus", "2"])
    assert stop.value.code == 2
    assert "the following arguments are required: --batch" in capsys.readouterr().err
    result = shell.run_cell(f"%%autoparallel --gpus 2 -q -o unbatched\n{TINY}")
    assert result.success, result.error_in_exec
    assert shell.user_ns["unbatched"].global_batch == 4 * 2


def test_the_command_line_reads_its_flags_without_importing_ipython():
    code = "import sys, nbtrain.cli; nbtrain.cli._parser(); print('IPython' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip() == "False", shown.stderr
