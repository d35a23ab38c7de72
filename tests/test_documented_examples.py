"""Every example the documents show runs: the shell commands, ``%%autoparallel`` cells and Python of README.md,
notebooks/README.md and the pages under docs/, and every ``$ `` command and ``>>>`` example of a docstring under
nbtrain/.

The examples are read from the documents at collection time (tests/documented_fixtures.py), one test per example,
named ``document:line``. They run as printed, except for the substitutions in the two tables just below (each one
that applies is named in the test id) and the names and files that the text around an example takes for granted,
which tests/documented_fixtures.py supplies in plain view. The error table ("When something is wrong", in
docs/errors.md) is tested by tests/test_error_table.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import documented_fixtures as fx

# A README command that sets up a virtual environment runs the part after the install, in the environment that runs
# these tests: label -> (pattern, replacement). `.venv/bin/nbtrain demo` runs this environment's `nbtrain demo`.
VENV = {
    "after the install": (r"^python3 -m venv \.venv && \.venv/bin/pip install .*? && ", ""),
    "this environment's bin": (r"\.venv/bin/", ""),
}

# Long-running examples in their smallest form that runs the same code path (a key matches as a whole word).
SMALLER = {
    # shell (README, notebooks/README, docs/, `$ ` lines of docstrings)
    "-m pytest -q": "-m pytest -q tests/test_plan_format.py",  # the whole suite is CI itself; one quick file of it
    # a preset on fake tensors either way, 10 s → 3 s (llama-tiny's context is 256 tokens)
    "nbtrain profile llama-70b --batch 1 --seq 4096": "nbtrain profile llama-tiny --batch 1 --seq 256",
    "--steps 20": "--steps 2",
    "--processes 4 --steps 5": "--processes 4 --steps 2",
    "-p steps 20": "-p steps 2",
    # Python (the documents' blocks and docstrings)
    "steps=100": "steps=2",
    "steps=50": "steps=2",
    "steps=20": "steps=2",
    "steps=10": "steps=2",
    "steps=5": "steps=2",
    "steps=1000, num_processes=2": "steps=2, num_processes=2",  # the run that the resume below goes on from
    "steps=1000, num_processes=4": "steps=3, num_processes=4",  # resumed after step 2: one more, under another plan
    "checkpoint_every=100": "checkpoint_every=1",
    "tokens_per_step=16384": "tokens_per_step=4096",  # hot switching: one pass over the setup's 4 documents a step
}

SHELL = fx.shell_examples(VENV, SMALLER)
PYTHON = fx.python_examples(SMALLER)
DOCSTRINGS = fx.docstring_examples(SMALLER)

# Examples that start worker processes (marked slow, as the other tests that launch are).
MULTIPROCESS = re.compile(r"--processes|processes=|nbtrain (demo|verify|run)\b|papermill|--launch|launch\(|"
                          r"allreduce_bandwidth|verify\(|train_here|fit\(|shared\(\"fit")


def _slow_if(multiprocess: bool):
    return [pytest.mark.slow] if multiprocess else []


@pytest.fixture(autouse=True)
def noninteractive(monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")  # no widgets, no live progress bars (what CI and papermill set)


# ---------------------------------------------------------------------------------------------------------------------
# The extractor finds every example.

def _fences(document: str, language: str) -> int:
    """Fenced blocks of ``language`` in ``document`` outside the excluded sections, counted from the raw text."""
    count, section = 0, ""
    for line in (fx.REPO / document).read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if line.strip() == f"```{language}" and section not in fx.EXCLUDED_SECTIONS.get(document, ()):
            count += 1
    return count


def test_every_block_and_docstring_example_is_extracted():
    python = {d: [e for e in PYTHON if e.document == d] for d in fx.DOCUMENTS}
    for document in fx.DOCUMENTS:
        assert len(python[document]) == _fences(document, "python"), document
        bash_lines = sum(1 for e in SHELL for w in e.where if w.startswith(document + ":"))
        assert bash_lines >= _fences(document, "bash"), document  # at least one command per block
    # none vanished: as many as the documents held when the README's reference moved into docs/ (10 shell commands
    # in ```bash blocks, 10 ```python blocks), and the README keeps its two commands and its first notebook cell
    documented_shell = [w for e in SHELL for w in e.where if w.split(":")[0] in fx.DOCUMENTS]
    assert len(documented_shell) >= 10 and len(PYTHON) >= 10, (documented_shell, [e.id for e in PYTHON])
    readme_shell = [w for e in SHELL for w in e.where if w.startswith("README.md:")]
    assert len(readme_shell) >= 2 and len(python["README.md"]) >= 2, (readme_shell, python["README.md"])
    cells = [e for e in PYTHON if e.kind == "cell"]
    assert any(e.source.startswith("%%autoparallel") for e in cells) and len(cells) >= 2
    assert len([w for e in SHELL for w in e.where if w.startswith("nbtrain/")]) >= 15
    assert len(DOCSTRINGS) >= 60 and sum(len(d.examples) for d in DOCSTRINGS) >= 200
    raw = sum(text.count(">>> ") for _, _, _, text in fx._docstrings())
    assert sum(1 for d in DOCSTRINGS for e in d.examples) == raw  # every `>>> ` line is an example
    # every table entry still names an example that exists (a renamed module would silently drop its setup)
    keys = {d.key for d in DOCSTRINGS}
    assert set(fx.DOCSTRING_SETUP) <= keys and set(fx.IN_WORKERS) <= keys and fx.VARYING_NUMBERS <= keys
    # every section with Python has its fixture, and every fixture a section (a renamed heading would drop it)
    assert set(fx.SECTION_FIXTURES) == {e.section_key for e in PYTHON}


# ---------------------------------------------------------------------------------------------------------------------
# Shell commands.

def _venv_bin() -> str:
    return str(Path(sys.executable).parent)


def _run_shell(command: str, folder: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("example", [pytest.param(e, id=e.id, marks=_slow_if(bool(MULTIPROCESS.search(e.source))))
                                     for e in SHELL])
def test_shell_example(example, tmp_path):
    folder = tmp_path
    for name, text in fx.SHELL_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    for name in ("notebooks", "tests", "pyproject.toml"):  # what the commands name relative to the repository
        (folder / name).symlink_to(fx.REPO / name)
    env = {**os.environ, "PATH": _venv_bin() + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join([str(folder), str(fx.REPO)])}
    for part, extra in fx.SHELL_ENV.items():
        if part in example.source:
            env.update({k: v.format(folder=folder) for k, v in extra.items()})
    if fx.NEEDS_KERNEL in example.source:
        from tests.notebook_kernel import nbtrain_kernel_installed

        nbtrain_kernel_installed()
    for part, before in fx.SHELL_BEFORE.items():
        if part in example.source:
            done = _run_shell(before, folder, env)
            assert done.returncode == 0, f"{before}\n{done.stdout}\n{done.stderr}"
    print(f"$ {example.source}" + (f"    (printed: {example.printed})" if example.source != example.printed else ""))
    done = _run_shell(example.source, folder, env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"exit status {done.returncode}\n{out[-6000:]}"
    assert out.strip(), "the command printed nothing"
    for part, shows in fx.SHELL_SHOWS.items():
        if part in example.source:
            for text in shows:
                assert text in out, f"{text!r} not in the output of {example.source}:\n{out[-6000:]}"
    for part, files in fx.SHELL_WRITES.items():
        if part in example.source:
            for name in files:
                assert (folder / name).is_file(), f"{example.source} wrote no {name}"
    if "--json" in example.source and ">" not in example.source:
        json.loads(done.stdout)  # what --json prints is JSON


# ---------------------------------------------------------------------------------------------------------------------
# The documents' Python and %%autoparallel cells: one namespace (or IPython shell) per section, blocks in order.

_SECTIONS: dict[str, dict] = {}


def _section_blocks(example) -> list:
    return [e for e in PYTHON if e.document == example.document and e.section == example.section]


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbtrain")
    return ip


def _run_block(example, state: dict) -> None:
    print(f"--- {example.id}\n{example.source}")
    if example.kind == "cell":
        result = state["shell"].run_cell(example.source)
        assert result.success, f"{example.id}: {result.error_before_exec or result.error_in_exec!r}"
    else:
        exec(compile(example.source, example.id, "exec"), state["namespace"])


@pytest.mark.parametrize("example", [pytest.param(e, id=e.id, marks=_slow_if(bool(MULTIPROCESS.search(e.source))))
                                     for e in PYTHON])
def test_readme_python(example, tmp_path_factory, monkeypatch):
    key = example.section_key
    blocks = _section_blocks(example)
    state = _SECTIONS.get(key)
    if state is None or state["failed"]:
        state = _SECTIONS[key] = {"folder": tmp_path_factory.mktemp("section"), "done": -1, "failed": False}
        monkeypatch.chdir(state["folder"])
        if example.kind == "cell":
            shell = state["shell"] = _shell()
            # the notebook starts without another test's variables (%reset would also empty the __main__ module,
            # which multiprocessing's spawn then cannot read)
            for name in [n for n in shell.user_ns if n not in shell.user_ns_hidden and not n.startswith("_")]:
                del shell.user_ns[name]
            shell.run_cell(fx.SECTION_FIXTURES[key])
        else:
            state["namespace"] = {"__name__": "__main__"}
            exec(fx.SECTION_FIXTURES[key], state["namespace"])
    monkeypatch.chdir(state["folder"])
    index = blocks.index(example)
    try:
        for earlier in blocks[state["done"] + 1:index]:  # run alone (-k): the section's earlier blocks first
            _run_block(earlier, state)
        _run_block(example, state)
    except BaseException:
        state["failed"] = True
        raise
    state["done"] = index


# ---------------------------------------------------------------------------------------------------------------------
# Docstrings' >>> examples: in order, in one namespace per docstring; shown outputs are compared.

def _docstring_params():
    for d in DOCSTRINGS:
        multiprocess = (d.key in fx.IN_WORKERS or MULTIPROCESS.search(fx.DOCSTRING_SETUP.get(d.key, "")) is not None
                        or any(MULTIPROCESS.search(e.source) for e in d.examples))
        yield pytest.param(d, id=d.id, marks=_slow_if(multiprocess))


@pytest.mark.parametrize("doc", list(_docstring_params()))
def test_docstring_examples(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved_env = dict(os.environ)
    threads = set(threading.enumerate())
    try:
        workers = fx.IN_WORKERS.get(doc.key)
        if workers is None:
            failed, report = fx.run_examples(doc, doc.examples, fx.docstring_namespace(doc))
            assert not failed, report
            return
        from nbtrain.run.launch.workers import launch

        there = doc.examples[:workers.here_from]
        ranks = launch(fx.run_in_worker, doc, there, workers.setup, num_processes=workers.processes, timeout=300)
        for rank, failed, report in ranks:
            assert not failed, f"rank {rank}:\n{report}"
        if workers.here_from is not None:
            here = doc.examples[workers.here_from:]
            failed, report = fx.run_examples(doc, here, fx.docstring_namespace(doc, workers.here_setup))
            assert not failed, report
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    # an example a user copies must not leave work running behind it (it did: an open CPU-offload worker, a child
    # watcher that held the next launches' workers and their pipes)
    left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not left, f"the example left threads running: {left}"
