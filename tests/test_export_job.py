"""A cell's training exported as a job (``%%autoparallel --export-job DIR``, ``nbtrain.export_job``, ``nbtrain
export-job``), and that job run where it was planned for: ``torchrun`` on two "nodes" of this machine (launch.sh),
and Slurm (job.sbatch under ``sbatch``; then signalled as before its time limit, requeued, resumed). Each run ends
with the weights ``fit`` gave the notebook for the same cell, bit for bit, and the same losses.

The Slurm tests need a controller: CI starts a one-node cluster (``.ci/slurm-up.sh``: munged, slurmctld and slurmd
on localhost, 2 CPUs, no cgroups). Without one they are skipped, saying why, except where ``CI`` is set: there they
fail. Every job runs where IPython, ipykernel, nbformat, papermill and ipywidgets cannot be imported (a folder first
on ``PYTHONPATH`` whose packages raise ``ModuleNotFoundError``), as on nodes with only torch and nbtrain installed.

Costs here (2 cores): the notebook's cell (export and ``--launch``) ~15 s, the torchrun run ~20 s, the Slurm run
~20 s, the requeued one ~45 s (Slurm holds a requeued job ~10 s before it starts again).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError

import nbtrain

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 240  # seconds a job here may take
STEPS, EVERY = 12, 3
CELL = f"""import time

import torch

import nbtrain

torch.manual_seed(0)
model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
windows = torch.randint(0, 64, ({STEPS}, 4, 17), generator=torch.Generator().manual_seed(1))


def batch(step):
    time.sleep(0.25)  # as a loader that reads from disk: the requeue test signals the job between checkpoints
    return windows[step, :, :-1], windows[step, :, 1:]
"""
TINY = ("import nbtrain\n"
        "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, "
        "tie_embeddings=False))\n")
PLANNED = '--gpus 2 --gpu cpu --batch 4 --seq 16 --strategy "dp_shard=2" -q --no-calibrate'
NOT_ON_NODES = ("IPython", "ipykernel", "nbformat", "papermill", "ipywidgets", "jupyter_client")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the jobs on CPUs (gloo)")


@pytest.fixture(autouse=True)
def noninteractive(monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def notebook(shell, tmp_path_factory):
    """One notebook cell: planned for 2 CPU devices, exported as a job, and trained here with ``--launch`` (what
    ``fit`` gives the notebook): the folder, and the notebook's model and result after it."""
    folder = tmp_path_factory.mktemp("notebook") / "job"
    line = (f"{PLANNED} -o planned --export-job {folder} --data batch --steps {STEPS} --checkpoint-every {EVERY} "
            "--launch --processes 2")
    ran = shell.run_cell(f"%%autoparallel {line}\n{CELL}")
    assert ran.success, ran.error_in_exec
    return {"folder": folder, "model": shell.user_ns["model"], "result": shell.user_ns["planned_result"],
            "plan": shell.user_ns["planned"]}


@pytest.fixture(scope="module")
def job_environment(tmp_path_factory) -> dict[str, str]:
    """What a job runs with: this environment's torch and nbtrain, one thread a process, and no notebook packages."""
    blocked = tmp_path_factory.mktemp("nodes-have-no-notebook")
    for name in NOT_ON_NODES:
        (blocked / name).mkdir()
        (blocked / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('No module named {name!r} (the nodes have torch and nbtrain only)')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(blocked),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def copy_of(notebook, tmp_path: Path) -> Path:
    """The exported folder, copied as a user copies it to a cluster."""
    return Path(shutil.copytree(notebook["folder"], tmp_path / "job"))


def assert_ends_with_the_notebooks_weights(job: Path, notebook) -> dict:
    """The job's weights (out/weights, read with load_saved) and losses are the notebook's ``fit``'s, bit for bit."""
    from nbtrain.run.state.weights import load_saved

    result = json.loads((job / "out" / "result.json").read_text())
    assert result["steps"] == list(range(1, STEPS + 1)) and result["plan"] == "dp_shard=2"
    assert result["losses"] == notebook["result"].losses
    cell: dict = {}
    exec(CELL, cell)  # the model as the cell builds it: its first weights
    initial = {k: v.clone() for k, v in cell["model"].state_dict().items()}
    trained = load_saved(cell["model"], job / "out" / "weights").state_dict()
    expected = notebook["model"].state_dict()
    assert trained.keys() == expected.keys() and not all(torch.equal(trained[k], initial[k]) for k in initial)
    for name, tensor in expected.items():
        assert torch.equal(trained[name], tensor), (name, (trained[name] - tensor).abs().max())
    return result


# -- the folder --------------------------------------------------------------------------------------------------

def test_the_cell_exports_a_folder_with_its_code_data_plan_launchers_and_readme(notebook, capsys):
    folder = notebook["folder"]
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "job.sbatch", "launch.sh", "plan.json",
                                                        "train.py"]
    from nbtrain.planner.plan_file import read_plan

    assert read_plan(folder / "plan.json") == notebook["plan"]  # the plan the cell showed, as it trained here
    train = (folder / "train.py").read_text()
    assert CELL.strip() in train and "run_job(model, batch)" in train  # the cell's code and the data it names
    assert f"default={STEPS}" in train and f"default={EVERY}" in train and "resume=True" in train
    assert "import IPython" not in train and "from IPython" not in train and "get_ipython" not in train
    compile(train, "train.py", "exec")
    sbatch = (folder / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", "trap requeue USR1", "scontrol requeue \"$SLURM_JOB_ID\"",
                 "srun --kill-on-bad-exit=1 torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node 2",
                 "--rdzv-backend c10d --rdzv-endpoint \"$head:$port\""):
        assert line in sbatch, line
    assert "--rdzv-backend c10d" in (folder / "launch.sh").read_text()
    assert os.access(folder / "launch.sh", os.X_OK) and os.access(folder / "job.sbatch", os.X_OK)
    readme = (folder / "README.md").read_text()
    assert "sbatch job.sbatch" in readme and "squeue" in readme and "load_saved(model" in readme


def test_a_plan_for_a_gpu_cluster_asks_slurm_for_its_nodes_and_gpus(shell, tmp_path, capsys):
    ran = shell.run_cell(f"%%autoparallel --gpus 16 --gpus-per-node 8 --batch 32 -q --export-job {tmp_path}/job\n"
                         f"{TINY}")
    assert ran.success, ran.error_in_exec
    printed = capsys.readouterr().out
    assert f"job folder {tmp_path}/job: 2 nodes × 8 GPUs" in printed and "train.py" in printed
    sbatch = (tmp_path / "job" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch and "--nproc-per-node 8" in sbatch
    assert "cpus-per-task" not in sbatch
    plan = json.loads((tmp_path / "job" / "plan.json").read_text())
    assert plan["num_devices"] == 16 and plan["global_batch"] == 32
    assert "data.pt" not in os.listdir(tmp_path / "job")  # no --data: standard-library text, made on the nodes


def test_data_and_loss_from_earlier_cells_travel_as_saved_batches_and_source(shell, tmp_path):
    before = ("import torch\n"
              "import torch.nn.functional as F\n"
              "rows = [torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(i)) for i in range(2)]\n"
              "held = [(r[:, :-1], r[:, 1:]) for r in rows]\n"
              "def mean_loss(output, targets):\n"
              "    return F.cross_entropy(output.flatten(0, 1), targets.flatten())\n")
    assert shell.run_cell(before).success
    ran = shell.run_cell(f"%%autoparallel --gpus 2 --batch 8 -q --export-job {tmp_path}/job --data held "
                         f"--loss mean_loss\n{TINY}")
    assert ran.success, ran.error_in_exec
    saved = torch.load(tmp_path / "job" / "data.pt", weights_only=True)
    assert all(torch.equal(a, b) for pair, mine in zip(saved, shell.user_ns["held"]) for a, b in zip(pair, mine))
    train = (tmp_path / "job" / "train.py").read_text()
    assert "import torch.nn.functional as F\ndef mean_loss(output, targets):" in train
    assert 'run_job(model, FOLDER / "data.pt", loss_fn=mean_loss)' in train
    compile(train, "train.py", "exec")


def test_what_cannot_travel_is_one_line_naming_it_and_nothing_is_written(shell, tmp_path):
    def refused(line: str, body: str = TINY) -> str:
        result = shell.run_cell(f"%%autoparallel --gpus 2 --batch 8 -q --export-job {tmp_path}/job {line}\n{body}")
        assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
        assert not (tmp_path / "job").exists()
        return str(result.error_in_exec)

    assert shell.run_cell("stream = (b for b in [])\nwidth = 64\nby_step = lambda step: None\n" + TINY.replace(
        "model =", "built =")).success
    assert "the cell uses built from earlier cells, which train.py would not have" in refused("", "model = built\n")
    assert "cannot export --data stream: it comes from an earlier cell and is a generator" in refused("--data stream")
    assert "is a lambda, which lives only in the notebook" in refused("--data by_step")
    assert "the cell uses width from earlier cells, which train.py would not have" in refused(
        "", TINY.replace("n_embd=64", "n_embd=width"))
    assert "the cell's line 2, '%time x = 1', is not Python" in refused("", "import nbtrain\n%time x = 1\n" + TINY)
    assert "the cell binds JOB, which train.py keeps for itself" in refused("", TINY + "JOB = 1\n")
    assert "the job --export-job writes runs on the plan's devices" in refused("--processes 2")


def test_a_folder_that_holds_something_else_is_refused_before_the_cell_runs(shell, tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "notes.txt").write_text("mine")
    shell.user_ns.pop("ran", None)
    result = shell.run_cell(f"%%autoparallel --gpus 2 --batch 8 -q --export-job {tmp_path}/job\nran = True\n{TINY}")
    assert isinstance(result.error_in_exec, UsageError)
    assert "the folder holds notes.txt, which an exported job does not" in str(result.error_in_exec)
    assert "ran" not in shell.user_ns and os.listdir(tmp_path / "job") == ["notes.txt"]


def test_an_export_again_rewrites_its_own_folder_but_not_one_whose_job_has_checkpoints(shell, tmp_path):
    cell = f"%%autoparallel --gpus 2 --batch 8 -q --export-job {tmp_path}/job --steps 5\n{TINY}"
    assert shell.run_cell(cell).success and shell.run_cell(cell.replace("--steps 5", "--steps 7")).success
    assert "default=7" in (tmp_path / "job" / "train.py").read_text()
    (tmp_path / "job" / "checkpoints" / "step-00000002").mkdir(parents=True)
    result = shell.run_cell(cell)
    assert "its job has checkpoints" in str(result.error_in_exec)


def test_the_export_job_command_writes_a_folder_for_a_preset_on_meta(tmp_path, capsys):
    from nbtrain.cli import main

    assert main(["export-job", "llama-tiny", "--gpus", "4", "--gpus-per-node", "2", "--batch", "8", "--seq", "32",
                 "--strategy", "dp_shard=4", "--steps", "50", "--out", str(tmp_path / "job")]) == 0
    printed = capsys.readouterr().out
    assert "your plan: " in printed and "2 nodes × 2 GPUs" in printed
    train = (tmp_path / "job" / "train.py").read_text()
    assert "model = nbtrain.build_preset('llama-tiny', device='meta')" in train and "default=5," in train
    assert "#SBATCH --nodes=2" in (tmp_path / "job" / "job.sbatch").read_text()


def test_nbtrain_export_job_is_the_python_face_of_the_same_export(tmp_path):
    from nbtrain.models.description import layer_slots

    namespace: dict = {}
    exec(CELL, namespace)
    plan = nbtrain.Plan.parse("dp_shard=2", num_devices=2, num_layers=len(layer_slots(namespace["model"])),
                              global_batch=4, seq_len=16)
    job = nbtrain.export_job(tmp_path / "job", CELL, "model", plan, model=namespace["model"], cpu=True,
                             devices_per_node=1, steps=STEPS, namespace=namespace, data=namespace["batch"],
                             data_name="batch")
    assert (job.nodes, job.per_node, job.cpu) == (2, 1, True)
    assert str(job).startswith(f"job folder {tmp_path}/job: 2 nodes × 1 CPU processes (gloo)")
    with pytest.raises(nbtrain.errors.InvalidArgumentError, match="the plan's 2 devices do not fill nodes of 4"):
        nbtrain.export_job(tmp_path / "other", CELL, "model", plan, devices_per_node=4)


# -- the job, run ------------------------------------------------------------------------------------------------

def test_train_py_refuses_to_train_a_model_other_than_the_notebooks(notebook, job_environment, tmp_path):
    job = copy_of(notebook, tmp_path)
    train = job / "train.py"
    train.write_text(train.read_text().replace("n_embd=32", "n_embd=48"))  # the cell's code edited on the cluster
    done = subprocess.run([sys.executable, str(train), "--steps", "1"], env=job_environment, capture_output=True,
                          text=True, timeout=LIMIT)
    assert done.returncode != 0
    assert ("the cell's code built a GPT whose parameters (names, shapes, dtypes) are not those of the notebook's "
            "model") in done.stderr
    assert not (job / "checkpoints").exists() and not (job / "out").exists()  # refused before anything trained


@pytest.mark.slow
def test_launch_sh_on_two_nodes_of_one_process_ends_with_the_notebooks_weights(notebook, job_environment, tmp_path):
    job = copy_of(notebook, tmp_path)
    env = dict(job_environment, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    nodes = [subprocess.Popen(["timeout", "-k", "10", str(LIMIT), str(job / "launch.sh")], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate()[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert_ends_with_the_notebooks_weights(job, notebook)
    assert "no complete checkpoint in" in "".join(outputs)  # a first run: resume=True started afresh
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["step-00000009", "step-00000012"]


# -- Slurm -------------------------------------------------------------------------------------------------------

def slurm_missing() -> str | None:
    """Why no Slurm job can run here, or None."""
    start = "start a one-node cluster with .ci/slurm-up.sh (as root)"
    if shutil.which("sbatch") is None:
        return f"Slurm is not installed (no sbatch on PATH); {start}"
    try:
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return f"no Slurm controller answers (sinfo took 20 s); {start}"
    if nodes.returncode != 0:
        said = (nodes.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Slurm controller answers (sinfo: {said}); {start}"
    if not any(state.rstrip("*~#").startswith(("idle", "mix", "alloc", "comp")) for state in nodes.stdout.split()):
        return f"no Slurm node is up (sinfo: {nodes.stdout.strip() or 'no nodes'}); {start}"
    return None


@pytest.fixture(scope="module")
def slurm():
    missing = slurm_missing()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI runs the Slurm tests (.ci/run starts the cluster): {missing}")
    if missing:
        pytest.skip(missing)


def submit(job: Path, env: dict[str, str]) -> str:
    done = subprocess.run(["sbatch", "--parsable", "job.sbatch"], cwd=job, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_state(job_id: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for(condition, what: str, job: Path, job_id: str, limit: float = LIMIT):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    log = job / f"slurm-{job_id}.out"
    pytest.fail(f"job {job_id}: {what} within {limit} s; {job_state(job_id)}\n"
                f"{log.read_text()[-4000:] if log.exists() else 'no log'}")


def ended(job_id: str) -> dict | None:
    state = job_state(job_id)
    return state if state.get("JobState") in ENDED else None


@pytest.fixture
def cancelled_at_the_end():
    """Jobs a failed test leaves queued or running are cancelled."""
    jobs: list[str] = []
    yield jobs
    for job_id in jobs:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


@pytest.mark.slow
def test_sbatch_of_the_exported_job_ends_with_the_notebooks_weights(slurm, notebook, job_environment, tmp_path,
                                                                   cancelled_at_the_end):
    job = copy_of(notebook, tmp_path)
    job_id = submit(job, job_environment)
    cancelled_at_the_end.append(job_id)
    state = wait_for(lambda: ended(job_id), "the job did not end", job, job_id)
    log = (job / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert f"job {job_id} (restart 0) on localhost: rendezvous at localhost:" in log
    assert "training ended with status 0" in log
    assert_ends_with_the_notebooks_weights(job, notebook)


@pytest.mark.slow
def test_a_job_signalled_before_its_time_limit_is_requeued_and_resumes_to_the_same_weights(
        slurm, notebook, job_environment, tmp_path, cancelled_at_the_end):
    job = copy_of(notebook, tmp_path)
    job_id = submit(job, job_environment)
    cancelled_at_the_end.append(job_id)
    first = job / "checkpoints" / f"step-{EVERY:08d}"  # complete: renamed from .partial once every rank wrote
    wait_for(first.is_dir, "no first checkpoint", job, job_id)
    # what Slurm sends SIGNAL_MARGIN_S before the time limit (--signal=B:USR1@120): to the batch shell only
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    state = wait_for(lambda: ended(job_id), "the requeued job did not end", job, job_id)
    log = (job / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log[-4000:]
    assert f"job {job_id}: USR1: stopping the training and requeueing" in log
    assert f"job {job_id} (restart 1) on localhost" in log
    result = assert_ends_with_the_notebooks_weights(job, notebook)
    assert EVERY <= result["resumed_at"] < STEPS, result  # it went on from a checkpoint taken before the signal
    assert f"resuming from {job}/checkpoints/step-{result['resumed_at']:08d}" in log
