"""A launch on one machine is reachable from this machine only: every socket it listens on is on loopback.

torch's TCPStore, the rendezvous every rank reads and writes, accepts any client without authentication; a store
listening on every interface lets another host on the network read, write or break the run's rendezvous. These
tests list the listening sockets of this process (the kernel) and of every process it started while a launch runs
(``psutil``), through each way nbtrain launches: ``launch``, ``%%autoparallel --launch``, ``verify``, a run that
switches layouts, and the spawned workers of the machine's measurements; connect to the store's port through a
non-loopback address of this machine, which must be refused; and launch where the hostname names the machine's
network address, where gloo listens unless told otherwise. Last, the other way in: a DCP checkpoint's metadata is a
pickle, so starting from one that another user owns warns first.
"""

from __future__ import annotations

import faulthandler
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import nbtrain
from nbtrain.profiler.calibrate import run_spawned
from nbtrain.run.launch.workers import launch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path; GPUs take nccl")
LIMIT = 120  # seconds any launch here may take
TINY = ("import nbtrain\n"
        "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, "
        "tie_embeddings=False))\n")


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(3 * LIMIT, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return (mapped or address).is_loopback


def listening(pid: int) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket listening in process ``pid`` and in the processes it started."""
    root = psutil.Process(pid)
    found = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # a process that ended while we looked
            continue
        found |= {(process.pid, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}
    return found


def outside_loopback(sockets) -> list:
    return sorted(s for s in sockets if not is_loopback(s[1]))


def non_loopback_ipv4() -> list[str]:
    return [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family == socket.AF_INET and not is_loopback(a.address)]


def connect(address: str, port: int) -> str:
    """'accepted', or the error connecting to ``address:port`` from ``address`` itself."""
    try:
        with socket.create_connection((address, port), timeout=5, source_address=(address, 0)):
            return "accepted"
    except OSError as error:
        return type(error).__name__


def listening_while_every_rank_runs(kernel: int, addresses: list[str]):
    """In each forked worker: once the group is formed and while every rank waits, rank 0 lists what the kernel and
    its workers listen on, and connects to the store's port through each address given and through 127.0.0.1."""
    dist.barrier()  # both ranks are in the group: gloo's pairs are connected, the store is in use
    found = None
    if dist.get_rank() == 0:
        port = int(os.environ["MASTER_PORT"])
        found = (port, listening(kernel), {a: connect(a, port) for a in [*addresses, "127.0.0.1"]})
    dist.barrier()  # rank 1 stays until rank 0 has looked
    return found


def spawned_listening(kernel: int) -> set:
    """In each spawned worker (run_spawned): what the kernel and its workers listen on, with the group formed."""
    dist.barrier()
    found = listening(kernel) if dist.get_rank() == 0 else None
    dist.barrier()
    return found


def one_rank_listening(kernel: int) -> set:
    """In a one-process launch (this process, a one-rank gloo group): what it listens on."""
    dist.all_reduce(torch.ones(1))
    return listening(kernel)


class Watch:
    """Samples, in a thread, the sockets this process and its children listen on, until the ``with`` ends."""

    def __enter__(self):
        self.seen, self.stop = set(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(0.05):
            self.seen |= listening(os.getpid())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def store_port(out: str) -> int:
    """The rendezvous port the launch printed: 'Launching 2 workers on CPU (gloo) at 127.0.0.1:PORT'."""
    found = re.findall(r"Launching 2 workers on CPU \(gloo\) at 127\.0\.0\.1:(\d+)", out)
    assert found, out
    return int(found[-1])


def assert_loopback_only(watch: Watch, port: int) -> None:
    assert any(p == port for _, _, p in watch.seen), f"the watch never saw the store's port {port}: {watch.seen}"
    bad = outside_loopback(watch.seen)
    assert bad == [], f"listening outside loopback during the launch: {bad} (pid, address, port)"


def test_a_launch_listens_on_loopback_only_in_the_kernel_and_in_every_worker():
    port, sockets, _ = launch(listening_while_every_rank_runs, os.getpid(), [], num_processes=2, timeout=LIMIT)
    store = {(ip, p) for _, ip, p in sockets if p == port}
    assert store == {("127.0.0.1", port)}, sockets  # the rendezvous store, on 127.0.0.1 only
    bad = outside_loopback(sockets)
    assert bad == [], f"the kernel or a worker listens outside loopback: {bad} (pid, address, port)"


def test_the_store_refuses_a_connection_through_this_machines_other_addresses():
    addresses = non_loopback_ipv4()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address (psutil.net_if_addrs) to connect through")
    _, _, answers = launch(listening_while_every_rank_runs, os.getpid(), addresses, num_processes=2, timeout=LIMIT)
    assert answers.pop("127.0.0.1") == "accepted"  # the store was there, for the workers
    assert answers == {a: "ConnectionRefusedError" for a in addresses}


@pytest.fixture
def shell_noninteractive(shell, monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    return shell


def test_autoparallel_launch_listens_on_loopback_only(shell_noninteractive, capsys):
    with Watch() as watch:
        result = shell_noninteractive.run_cell(
            f"%%autoparallel --gpus 2 --batch 4 -q --launch --processes 2 --steps 1 --timeout {LIMIT}\n{TINY}")
    assert result.success, result.error_in_exec
    assert_loopback_only(watch, store_port(capsys.readouterr().out))


def test_verify_listens_on_loopback_only(capsys):
    with Watch() as watch:
        report = nbtrain.verify("gpt-tiny", "dp_replicate=2", processes=2, steps=1, batch=2, seq=16, timeout=LIMIT)
    assert report.ok, str(report)
    assert_loopback_only(watch, store_port(capsys.readouterr().out))


def test_a_run_that_switches_layouts_listens_on_loopback_only(capsys):
    from nbtrain.data import WIKIPEDIA, histogram_documents
    from nbtrain.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=1, n_head=2, n_embd=32, tie_embeddings=False))
    docs = histogram_documents(WIKIPEDIA, 200, scale=64, vocab_size=256, seed=3)
    with Watch() as watch:
        result = nbtrain.fit(model, docs, plan={32: "dp_replicate=2", 128: "dp_shard=2"}, steps=1, num_processes=2,
                             tokens_per_step=640, progress=False, timeout=LIMIT)
    assert [s.what for s in result.details[-1].switches] == ["weights", "gradients"]  # it did switch
    assert_loopback_only(watch, store_port(capsys.readouterr().out))


def test_the_measurements_spawned_workers_listen_on_loopback_only():
    """The calibration's all-reduce and the link measurement (nbtrain.profiler.link_bench) spawn their workers
    through run_spawned."""
    sockets = run_spawned(spawned_listening, 2, os.getpid(), timeout=LIMIT, what="listening check")[0]
    assert sockets, "nothing listened while the spawned group was formed"
    bad = outside_loopback(sockets)
    assert bad == [], f"the kernel or a spawned worker listens outside loopback: {bad} (pid, address, port)"


HOSTNAMED = """
    import os
    from nbtrain.profiler.calibrate import run_spawned
    from nbtrain.run.launch.workers import launch
    from tests.test_loopback_only import (listening_while_every_rank_runs, one_rank_listening, outside_loopback,
                                          spawned_listening)

    _, forked, _ = launch(listening_while_every_rank_runs, os.getpid(), [], num_processes=2, timeout=60)
    spawned = run_spawned(spawned_listening, 2, os.getpid(), timeout=60, what="listening check")[0]
    one = launch(one_rank_listening, os.getpid(), num_processes=1)
    print("outside loopback:", outside_loopback(forked), outside_loopback(spawned), outside_loopback(one))
"""



def test_where_the_hostname_names_the_network_address_gloos_sockets_stay_on_loopback_too(tmp_path):
    """gloo listens on the address this machine's hostname resolves to (a laptop's or a login node's network
    address), not on the store's: forked workers, spawned measurement workers and a one-process launch alike. Here
    the hostname is made to name this machine's first non-loopback address, in a namespace of its own (``unshare``:
    its own hostname, and an /etc/hosts mounted over the real one)."""
    addresses = non_loopback_ipv4()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address (psutil.net_if_addrs) for the hostname to name")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{addresses[0]} nbtrain-test-host\n")
    setup = f"mount --bind {hosts} /etc/hosts && hostname nbtrain-test-host"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "-u", "sh", "-c", setup],
                                                         capture_output=True).returncode != 0:
        pytest.skip("cannot give a process its own hostname and /etc/hosts here (unshare -m -u needs root)")
    script = f"{setup} && getent hosts nbtrain-test-host && exec {sys.executable} -c '{textwrap.dedent(HOSTNAMED)}'"
    done = subprocess.run(["timeout", "-k", "5", str(LIMIT), "unshare", "-m", "-u", "sh", "-c", script],
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=LIMIT + 10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"{addresses[0]} "), done.stdout  # the hostname did name the network address
    assert "outside loopback: [] [] []" in done.stdout, done.stdout


# -- checkpoints you did not write -----------------------------------------------------------------------------------

AS_ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="gives a folder another owner (chown), which needs root")
NOBODY = 65534  # another user's uid: the folder is theirs, not this user's


def tiny_gpt():
    from nbtrain.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_embeddings=False))


def owned_by(uid: int, folder: Path) -> Path:
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, uid, uid)
    return folder


def dcp_checkpoint(folder: Path, model) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group
        dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(folder))
    return folder


@AS_ROOT
def test_a_dcp_checkpoint_someone_else_owns_warns_once_before_it_is_read(tmp_path):
    from nbtrain.run.state.pretrained import resolve_weights

    model = tiny_gpt()
    theirs = owned_by(NOBODY, dcp_checkpoint(tmp_path / "theirs", model))
    with pytest.warns(UserWarning, match=r"weights='.*/theirs' is a DCP checkpoint owned by .*, not you: reading it "
                                         r"unpickles its \.metadata \(torch's format\), which runs any code"):
        resolve_weights(str(theirs), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not again for the same folder, nor for one's own checkpoint
        assert resolve_weights(str(theirs), model).kind == "dcp"
        assert resolve_weights(str(dcp_checkpoint(tmp_path / "mine", model)), model).kind == "dcp"


@AS_ROOT
def test_a_hugging_face_folder_someone_else_owns_is_read_without_a_warning(tmp_path):
    """safetensors files hold tensors and a JSON header: reading them runs no one's code."""
    from safetensors.torch import save_file

    from nbtrain.run.state.pretrained import resolve_weights

    model = tiny_gpt()
    (tmp_path / "theirs").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "theirs" / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_weights(str(owned_by(NOBODY, tmp_path / "theirs")), model).kind == "safetensors"
