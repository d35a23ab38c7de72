"""Every notebook in notebooks/ runs under papermill in the nbtrain kernel, as CI and users run them, and shows
what it teaches; every mistake a user can make in a %%autoparallel cell ends that cell with one clear line and
leaves the kernel working (one fixture notebook per mistake, in tests/notebooks/).

    $ papermill notebooks/01_quickstart.ipynb out.ipynb -k nbtrain -p smoke True
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
FIXTURES = Path(__file__).resolve().parent / "notebooks"
SMOKE = {"01_quickstart": {}, "02_hybrid_parallel": {}, "03_lab_parallelism": {"reference_answers": True},
         "04_dynamic_switching": {}, "05_checkpoints_and_faults": {}, "06_your_own_model": {}, "07_fine_tuning": {},
         "08_sessions": {}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session", autouse=True)
def nbtrain_kernel():
    """The README's test command installs the kernelspec itself: papermill -k nbtrain needs it."""
    from tests.notebook_kernel import nbtrain_kernel_installed

    nbtrain_kernel_installed()


@pytest.fixture(autouse=True)
def noninteractive(monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")  # the kernels inherit it: no widgets, no live bars


def execute(path: Path, out_dir: Path, **parameters) -> nbformat.NotebookNode:
    import papermill

    out = out_dir / f"executed_{path.name}"
    papermill.execute_notebook(str(path), str(out), parameters=parameters, kernel_name="nbtrain",
                               cwd=str(out_dir), progress_bar=False, execution_timeout=600)
    return nbformat.read(str(out), as_version=4)


def text_of(cell) -> str:
    """Everything a cell printed or displayed, as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
    return "".join(parts)


def test_every_notebook_in_the_folder_is_run_here():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(SMOKE)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_notebooks_are_committed_clean_with_a_parameters_cell_and_the_nbtrain_kernel(name):
    nb = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)
    assert nb.metadata.kernelspec.name == "nbtrain"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip the outputs before committing"
    parameters = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(parameters) == 1 and "smoke" in parameters[0].source


def test_quickstart_plans_gpt2_and_trains_a_gpt_and_a_transformers_gpt2_here(tmp_path):
    nb = execute(NOTEBOOKS / "01_quickstart.ipynb", tmp_path, smoke=True)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "gpt2 on 64 devices" in everything and "time/µbatch" in everything  # the plan table
    assert "recommended:" in everything and "FSDP (ZeRO-3)" in everything  # summary and comparison
    assert everything.count("measured step time") == 2  # both launches: the GPT and transformers' GPT-2
    assert "the trained weights are in model" in everything and "the trained weights are in hf_model" in everything
    assert "tensor parallelism was not searched" not in everything  # GPT-2's fused q|k|v splits by heads now


def test_your_own_model_trains_a_mistral_and_a_vit_on_its_own_data_and_loss_and_exports_a_cluster_job(tmp_path):
    nb = execute(NOTEBOOKS / "06_your_own_model.ipynb", tmp_path, smoke=True)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    mistral, vit = (next(text_of(c) for c in nb.cells if c.cell_type == "code" and f"{kind}Config(" in c.source)
                    for kind in ("Mistral", "ViT"))
    assert "mistral on 8 devices" in mistral and "tensor parallelism was not searched" not in mistral  # its TP plan
    assert "ViTForImageClassification has no tensor-parallel plan" in vit  # and the table says why
    assert "the trained weights are in mistral" in everything and "the trained weights are in vit" in everything
    assert "tensors of the cell's Mistral hold trained weights" in everything
    assert "tensors of the cell's ViT hold trained weights" in everything
    # a Llama built on meta, started from a save_pretrained folder, written as one that from_pretrained loads
    assert "the trained model is in" in everything and "tuned-llama (from_pretrained loads it)" in everything
    assert "generated: [1, 2, 3, 4," in everything
    assert everything.count("measured step time") == 3
    # the Mistral cell exported as a job for 2 nodes × 8 GPUs (nothing trained here), and the folder's files printed
    assert "job folder mistral-job: 2 nodes × 8 GPUs" in everything
    files = next(text_of(c) for c in nb.cells if c.cell_type == "code" and 'Path("mistral-job")' in c.source)
    assert re.findall(r"^(\S+) +\d+ bytes$", files, re.M) == ["README.md", "job.sbatch", "launch.sh", "plan.json",
                                                               "train.py"]
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@120"):
        assert line in files, line
    train = (tmp_path / "mistral-job" / "train.py").read_text()
    assert "MistralForCausalLM(MistralConfig(" in train and "default=2000" in train and "default=200," in train


def test_fine_tuning_trains_lora_on_a_pretrained_model_evaluates_and_loads_the_adapters_back(tmp_path):
    nb = execute(NOTEBOOKS / "07_fine_tuning.ipynb", tmp_path, smoke=True)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "val loss" in everything and "frozen weights unchanged: True" in everything
    assert "'adapter_config.json', 'adapter_model.safetensors'" in everything
    loaded, reported = re.search(r"held-out loss of the loaded adapters: ([\d.]+); the run's last validation loss: "
                                 r"([\d.]+)", everything).groups()
    assert loaded == reported  # PeftModel.from_pretrained gives back the model the run evaluated


def test_sessions_train_on_across_cells_change_the_lr_replan_generate_save_and_close(tmp_path):
    nb = execute(NOTEBOOKS / "08_sessions.ipynb", tmp_path, smoke=True)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "session (open): dp_shard=2 on 2 processes, 4 steps" in everything
    assert "steps 5-8 in" in everything  # the second call trains on from step 5
    assert "session (open): tp=2 on 2 processes, 12 steps" in everything  # replanned, and on
    assert "generated: b'def " in everything and "session-ckpt/step-00000012" in everything
    assert "session (closed)" in everything
    # the magic keeps the plan it recommends for this machine (dp_shard, dp_replicate or a pipeline, by its measured
    # links: all of the plan's words, "pp=2 mb=2 ..." too) and the next cell trains that session on
    kept = next(text_of(c) for c in nb.cells if c.cell_type == "code" and "--keep kept" in "".join(c.source))
    plan = re.search(r"trained under: (.+)", kept).group(1).strip()
    assert "the session is in kept" in kept and f"session (open): {plan} on 2 processes, 4 steps" in kept
    assert f"session (open): {plan} on 2 processes, 8 steps" in everything
    assert (tmp_path / "session-model" / "config.json").exists()


def test_hybrid_parallel_tutorial_runs_and_every_plan_verifies(tmp_path):
    nb = execute(NOTEBOOKS / "02_hybrid_parallel.ipynb", tmp_path, smoke=True)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "nbtrain.plan chose:" in everything  # part 1: every strategy predicted at scale, and the search's pick
    assert "measured step time" in everything and "predicted" in everything  # part 2: trained here
    verdicts = everything.count("SAME TRAINING")  # part 3: nbtrain.verify on each plan trained here
    assert verdicts >= 4 and "DIFFERENT" not in everything and "train like one process:" in everything


def test_the_lab_with_reference_answers_passes_every_check(tmp_path):
    nb = execute(NOTEBOOKS / "03_lab_parallelism.ipynb", tmp_path, smoke=True, reference_answers=True)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "✓ right" in everything and "✗" not in everything


def test_dynamic_switching_tutorial_trains_the_wikipedia_mix_with_fit_and_beside_the_static_plan(tmp_path):
    nb = execute(NOTEBOOKS / "04_dynamic_switching.ipynb", tmp_path, smoke=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]  # papermill ran every cell
    everything = "\n".join(text_of(c) for c in code)
    # part 1: the Wikipedia histogram, scaled; its length plot; most tokens outside the longest bucket
    assert "1,000,000 Wikipedia documents" in everything and "scaled ÷ 32" in everything
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    shares = re.search(r"share of the tokens per bucket: (.*)", everything).group(1)
    longest = float(re.findall(r"(\d+)%", shares)[-1])
    assert longest < 50, shares
    # part 2: the plan table, one row per bucket, from 0 up to the largest bound (1K in smoke), and the choice
    rows = re.findall(r"^\((\w+), (\w+)\]\s+\d+\s+[\d,]+\s+\S", everything, re.M)
    assert rows and rows[0][0] == "0" and rows[-1][1] == "1K", everything
    assert "(home)" in everything and "static plan '" in everything
    assert "hot switching chosen" in everything or "switching does not pay here" in everything
    # part 3: both trained by fit, with the per-bucket table beside predicted, the same training, a speed-up line
    assert everything.count("per bucket (rank 0") == 2 and "predicted" in everything
    lines = re.findall(r"^(static|hot switching)\s+([\d,]+)\s+([\d.]+)$", everything, re.M)
    measured = {name: (float(rate.replace(",", "")), float(loss)) for name, rate, loss in lines}
    assert set(measured) == {"static", "hot switching"}, everything
    assert all(rate > 0 for rate, _ in measured.values())
    assert measured["static"][1] == pytest.approx(measured["hot switching"][1], rel=1e-3)
    assert re.search(r"measured speed-up [\d.]+×; predicted [\d.]+×", everything)


def test_checkpoints_tutorial_interrupts_a_launch_resumes_under_another_plan_and_survives_faults(tmp_path):
    nb = execute(NOTEBOOKS / "05_checkpoints_and_faults.ipynb", tmp_path, smoke=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]  # papermill ran every cell
    texts = [text_of(c) for c in code]
    everything = "\n".join(texts)
    # the interrupted launch ended with where the last checkpoint is, and the next cells ran
    assert re.search(r"^KeyboardInterrupt: training interrupted; the workers were stopped. The last complete "
                     r"checkpoint is \S+step-\d{8} \(step \d of 6\)", everything, re.M), everything
    assert "worker processes left: 0" in everything
    assert "listening sockets besides the kernel's own: none" in everything
    # resumed under tp=2 with the uninterrupted run's losses (the notebook asserts it; this is its last line)
    assert re.search(r"same training: resumed after step [1-9]\d*, under tp=2", everything), everything
    # a killed worker is named with its signal and the way to resume; a hung one is named too
    assert re.search(r"^WorkerError: rank 1 of 2 died with signal SIGKILL .* resume=True", everything, re.M)
    assert re.search(r"^LaunchTimeoutError: .* Rank 1 never reached the collective", everything, re.M), everything
    assert "a new launch after all that: 1" in texts[-2]
    # and the checkpoint folders it made (it printed the first one's path) are gone with its last cell
    made = re.findall(r"^removed the checkpoint folders: (\S+) (\S+)$", texts[-1], re.M)
    assert len(made) == 1 and re.search(rf"into {re.escape(made[0][0])}$", everything, re.M), texts[-1]
    assert not [folder for folder in made[0] if os.path.exists(folder)]


@pytest.mark.parametrize("fixture,message", [
    ("no_model", "UsageError: InvalidArgumentError: the cell made no torch.nn.Module"),
    ("two_models", "UsageError: InvalidArgumentError: the cell made several models: decoder (GPT), encoder (GPT); "
                   "choose one with --model NAME"),
    ("bad_flag", "UsageError: unrecognized arguments: --gpuz 4"),
    ("nothing_fits", "UsageError: NoFeasiblePlanError: no plan fits 1.00 MiB per device on 8 × H100"),
    ("worker_raises", "UsageError: WorkerError: rank 1 of 2 failed: ValueError: this loss fails on rank 1"),
])
def test_a_mistake_in_the_cell_is_one_message_and_the_next_cell_runs(tmp_path, fixture, message):
    nb = execute(FIXTURES / f"{fixture}.ipynb", tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    failed, after = code[1], code[2]
    shown = text_of(failed)
    errors = [line for line in shown.splitlines() if line.startswith("UsageError")]
    assert len(errors) == 1 and errors[0].startswith(message), shown
    assert "Traceback (most recent call last)" not in shown.split("Traceback of rank")[0]  # no traceback of ours
    assert "kernel alive: 2 child processes: 0" in text_of(after)  # the kernel works, no worker is left


def test_a_notebook_written_from_the_readme_alone_runs(tmp_path):
    nb = execute(FIXTURES / "readme_user.ipynb", tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    everything = "\n".join(text_of(c) for c in code)
    assert "recommended:" in everything and "/24.00 GiB" in everything  # --memory 24GiB, as docs/notebook.md writes it
    assert re.search(r"trained on 4 rows per step; losses \[[\d.]+, [\d.]+, [\d.]+\]", everything), everything
    assert "4 16 512.0 GiB" in text_of(code[-1])  # the cell with no model, and the line form, planned


def _export_a_tiny_gpt(shell, export: Path, flags: str) -> None:
    result = shell.run_cell(f"%%autoparallel -q --export {export} {flags}\nimport nbtrain\n"
                            "exported_model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, "
                            "n_head=4, n_embd=64, tie_embeddings=False))\n")
    assert result.success, result.error_in_exec


def test_an_exported_run_executes_as_is(tmp_path, shell):
    _export_a_tiny_gpt(shell, tmp_path / "run.ipynb", "--gpus 8 --batch 16 --steps 3")
    nb = execute(tmp_path / "run.ipynb", tmp_path, steps=2)
    assert "checks passed: 2 steps" in text_of(nb.cells[-1])


def test_an_exported_run_on_the_users_data_executes_as_is_and_trains_on_that_data(tmp_path, shell):
    shell.run_cell("import torch\ng = torch.Generator().manual_seed(0)\n"
                   "rows = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(2)]\n"
                   "user_batches = [(r[:, :-1], r[:, 1:]) for r in rows]\n")
    _export_a_tiny_gpt(shell, tmp_path / "run.ipynb", "--gpus 2 --batch 2 --steps 2 --data user_batches")
    nb = execute(tmp_path / "run.ipynb", tmp_path)
    everything = "\n".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "2 batches of (2, 16)" in everything and "checks passed: 2 steps" in everything
