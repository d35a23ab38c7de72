"""What tests/test_documented_examples.py runs, and everything it changes or adds, in plain view.

The examples are read from the documents when the tests are collected (:func:`shell_examples`,
:func:`python_examples`, :func:`docstring_examples`), so a new or changed example is tested without editing a test.
Each is run as printed, except for the substitutions below, each of them listed here and named in the test id:

- ``VENV`` (in the test file): a README command that first makes a virtual environment runs only what follows the
  install, in the environment running the tests (its ``bin`` first on ``PATH``; ``.venv/bin/`` is dropped);
- ``SMALLER`` (in the test file): the smallest form of a long-running example that runs the same code path;
- ``SHELL_FILES`` / ``SHELL_BEFORE`` / ``SHELL_ENV``: files and commands a shell example takes for granted, and where
  it writes outside its temporary folder; ``SHELL_SHOWS`` / ``SHELL_WRITES``: what its output and folder must hold;
- ``SECTION_FIXTURES``: the names a document section's Python assumes (``batches``, ``MyModel``, ``fn``), keyed
  ``"document#section"``;
- ``DOCSTRING_SETUP``: the names a docstring assumes, per docstring (``SHARED``: profiles and runs several of them
  use, made once), and ``IN_WORKERS``: docstrings that run in launched workers ("in every worker");
- ``VARYING_NUMBERS``: docstrings whose shown output holds measurements of the machine: numbers match any number.

Nothing is skipped: an example the code cannot run fails its test.
"""

from __future__ import annotations

import ast
import doctest
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The README, the notebooks' README and every page under docs/ (a new page's examples are run without listing it).
DOCUMENTS = ("README.md", "notebooks/README.md",
             *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")))
# Sections whose examples another test runs: the error table in docs/errors.md (tests/test_error_table.py).
EXCLUDED_SECTIONS = {"docs/errors.md": ("When something is wrong",)}

# ---------------------------------------------------------------------------------------------------------------------
# Substitutions: the tables are at the top of tests/test_documented_examples.py (VENV, SMALLER); applied here.

def substitute(source: str, table: dict[str, str]) -> tuple[str, list[str]]:
    """``source`` with ``table`` applied (a key matches where it is not followed by a letter, digit or '.'), and
    the substitutions that applied, as ``"key->value"``."""
    applied = []
    for key, value in table.items():
        new = re.sub(re.escape(key) + r"(?![\w.])", lambda _: value, source)
        if new != source:
            applied.append(f"{key}->{value}")
            source = new
    return source, applied


# ---------------------------------------------------------------------------------------------------------------------
# The examples.

@dataclass
class Example:
    kind: str                       # "shell", "cell" (IPython) or "python"
    where: list[str]                # "README.md:27"; several when the same command is documented in several places
    printed: str                    # as the document prints it
    source: str                     # as it runs (substitutions applied)
    substitutions: list[str] = field(default_factory=list)
    section: str = ""               # python / cell: the document's "## " section (one namespace per section)
    document: str = ""

    @property
    def section_key(self) -> str:
        """``"document#section"``: what SECTION_FIXTURES is keyed by (two pages may have a section of one name)."""
        return f"{self.document}#{self.section}"

    @property
    def id(self) -> str:
        text = "+".join(self.where)
        if self.substitutions:
            text += " [" + "; ".join(self.substitutions) + "]"
        return text


def _markdown_blocks(document: str):
    """``(language, first line number, lines, section)`` of each fenced block of ``document``."""
    lines = (REPO / document).read_text().splitlines()
    section, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            language, start, body = line[3:].strip(), i + 2, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if section not in EXCLUDED_SECTIONS.get(document, ()):
                yield language, start, body, section
        i += 1


def _docstrings():
    """``(path relative to the repository, line of the docstring's first line, qualified name, raw docstring)``."""
    for path in sorted((REPO / "nbtrain").rglob("*.py")):
        tree = ast.parse(path.read_text())

        def visit(node, prefix):
            body = getattr(node, "body", [])
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                yield body[0].value.lineno, prefix or "<module>", body[0].value.value
            for child in body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    yield from visit(child, f"{prefix}.{child.name}" if prefix else child.name)

        rel = path.relative_to(REPO).as_posix()
        for lineno, name, text in visit(tree, ""):
            yield rel, lineno, name, text


def _command_key(command: str) -> str:
    return " ".join(re.sub(r"\s+#\s.*$", "", command).split())


def shell_examples(venv: dict[str, tuple[str, str]], smaller: dict[str, str]) -> list[Example]:
    """Each command of a ```bash block of the documents and each ``$ `` line of a docstring under nbtrain/.

    The same command (after the substitutions, comments dropped) documented in several places is run once, its id
    naming every place."""
    found: dict[str, Example] = {}
    raw = []
    for document in DOCUMENTS:
        for language, start, body, _ in _markdown_blocks(document):
            if language == "bash":
                raw += [(f"{document}:{start + k}", line.strip()) for k, line in enumerate(body) if line.strip()]
    for rel, lineno, _, text in _docstrings():
        for k, line in enumerate(text.splitlines()):
            m = re.match(r"\s*\$ (.+)$", line)
            if m:
                raw.append((f"{rel}:{lineno + k}", m.group(1).strip()))
    for where, printed in raw:
        source, substitutions = printed, []
        for label, (pattern, replacement) in venv.items():
            if re.search(pattern, source):
                source = re.sub(pattern, replacement, source)
                substitutions.append(f"VENV: {label}")
        source, small = substitute(source, smaller)
        substitutions += small
        key = _command_key(source)
        if key in found:
            found[key].where.append(where)
            for s in substitutions:
                if s not in found[key].substitutions:
                    found[key].substitutions.append(s)
        else:
            found[key] = Example("shell", [where], printed, source, substitutions, document=where.split(":")[0])
    return list(found.values())


def python_examples(smaller: dict[str, str]) -> list[Example]:
    """Each ```python block of the documents, in order; a section with a ``%`` magic line runs in IPython."""
    examples = []
    for document in DOCUMENTS:
        blocks = [(start, body, section) for language, start, body, section in _markdown_blocks(document)
                  if language == "python"]
        magic_sections = {section for _, body, section in blocks if any(line.startswith("%") for line in body)}
        for start, body, section in blocks:
            printed = "\n".join(body) + "\n"
            source, substitutions = substitute(printed, smaller)
            kind = "cell" if section in magic_sections else "python"
            examples.append(Example(kind, [f"{document}:{start}"], printed, source, substitutions, section, document))
    return examples


@dataclass
class DocstringExample:
    where: str                      # "nbtrain/data.py:10"
    module: str                     # "nbtrain.data"
    name: str                       # qualified name of the documented object ("<module>" for the module)
    examples: list                  # doctest.Example, substitutions applied
    substitutions: list[str]

    @property
    def key(self) -> str:
        """What the tables below are keyed by: ``module`` or ``module.qualname``."""
        return self.module if self.name == "<module>" else f"{self.module}.{self.name}"

    @property
    def id(self) -> str:
        text = f"{self.where} ({self.name})"
        if self.substitutions:
            text += " [" + "; ".join(self.substitutions) + "]"
        return text


def docstring_examples(smaller: dict[str, str]) -> list[DocstringExample]:
    """Each docstring under nbtrain/ that holds ``>>>`` examples: its examples, in order."""
    parser = doctest.DocTestParser()
    found = []
    for rel, lineno, name, text in _docstrings():
        if ">>>" not in text:
            continue
        substitutions = []
        examples = parser.get_examples(text)
        for example in examples:
            example.source, applied = substitute(example.source, smaller)
            substitutions += [s for s in applied if s not in substitutions]
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        found.append(DocstringExample(f"{rel}:{lineno + examples[0].lineno}", module, name, examples, substitutions))
    return found




# ---------------------------------------------------------------------------------------------------------------------
# Shell examples: the files they take for granted, commands that must run first, and where they write.

TRAIN_PY = '''\
"""train.py: the user's script that `nbtrain run train.py --plan plan.json -- --lr 3e-4` runs on every rank."""
import argparse

import torch

import nbtrain
from nbtrain.run.launch.script import current_plan
from nbtrain.run.launch.workers import rank_print
from nbtrain.run.parallel.mesh import PlanMeshes
from nbtrain.run.parallel.parallelize import parallelize
from nbtrain.run.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
plan = current_plan()                       # the plan of --plan plan.json
torch.manual_seed(0)
model = nbtrain.build_preset("gpt-tiny", device="cpu")
meshes = PlanMeshes(plan)
model = parallelize(model, plan, meshes)
trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters(), lr=args.lr))
window = torch.randint(0, 512, (plan.global_batch, plan.seq_len + 1), generator=torch.Generator().manual_seed(0))
for step in range(2):
    record = trainer.step(window[:, :-1], window[:, 1:])
    rank_print(f"train.py step {step + 1} loss {record.loss:.4f} under {plan}")
'''

MYPKG_MODELS_PY = '''\
"""mypkg/models.py: a model of the user's own, named on the command line as mypkg.models:build."""
import nbtrain


def build():
    return nbtrain.GPT(nbtrain.GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=2, n_embd=64))
'''

# Files written into the example's folder (which is on PYTHONPATH) before any shell example runs.
SHELL_FILES = {"train.py": TRAIN_PY, "mypkg/__init__.py": "", "mypkg/models.py": MYPKG_MODELS_PY}

# A command containing the key first runs the value (in the same folder): what the document made before.
SHELL_BEFORE = {
    "papermill run.ipynb": 'nbtrain export llama-tiny --strategy "dp_shard=2" --out run.ipynb',
}
# ``-k nbtrain`` needs the kernel "Python (nbtrain)": installed first when missing, as tests/test_notebooks.py does.
NEEDS_KERNEL = "-k nbtrain"

# Environment per command (by a part of it): ``--user`` installs into a Jupyter folder inside the example's folder,
# not the home directory of whoever runs the tests.
SHELL_ENV = {"kernel install --user": {"JUPYTER_DATA_DIR": "{folder}/jupyter-user"}}

# What each command's output must show (by a part of the command), beyond exit status 0 and some output: the table
# or line the text around it promises. A command may match several keys.
SHELL_SHOWS = {
    "nbtrain demo": ["recommended:", "measured step time", "predicted"],
    "nbtrain profile gpt2 --json": ['"flops_per_step"', '"layers"'],
    "nbtrain profile llama-tiny": ["plain Adam training on one device", "total"],
    "nbtrain profile mypkg.models:build --measure": ["plain Adam training on one device"],
    "nbtrain plan llama-7b --gpus 8 --memory 24GiB": ["recommended:", "fits", "/24.00 GiB"],
    '--strategy "dp_shard=8 ac"': ["your plan:", "dp_shard=8"],
    "nbtrain verify": ["SAME TRAINING"],
    "nbtrain cluster H100 --gpus 16": ["16 × H100", "host memory"],
    "nbtrain cluster --detect": ["host memory", "CPU optimizer"],
    "nbtrain kernel install": ["installed the kernel 'nbtrain'"],
    "nbtrain export ": ["wrote run.ipynb"],  # not export-job
    "nbtrain export-job": ["recommended:", "job folder job: 2 nodes × 8 GPUs"],
    "nbtrain run train.py": ["train.py step 2 loss"],
    "-m pytest": ["passed"],
}
# Files each command must leave in its folder.
SHELL_WRITES = {"> plan.json": ["plan.json"], "--out run.ipynb": ["run.ipynb"], " out.ipynb -k": ["out.ipynb"],
                " run-out.ipynb -k": ["run-out.ipynb"],
                "--out job": ["job/train.py", "job/plan.json", "job/launch.sh", "job/job.sbatch", "job/README.md"],
                "kernel install --user": ["jupyter-user/kernels/nbtrain/kernel.json"]}


# ---------------------------------------------------------------------------------------------------------------------
# The documents' Python: what each section's code assumes (run first, in the section's namespace), by
# "document#section".

MY_MODEL = '''\
import torch
import nbtrain


class MyModel(torch.nn.Module):          # "any nn.Module": a small language model written by hand
    def __init__(self, vocab=1000, width=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
'''

BATCHES = '''\
import torch
import nbtrain

_g = torch.Generator().manual_seed(0)
_windows = [torch.randint(0, 512, (4, 33), generator=_g) for _ in range(3)]
batches = [(w[:, :-1], w[:, 1:]) for w in _windows]   # "a list of (ids, targets) global batches": 4 rows × 32 tokens
'''

TINY_LLAMA = '''\
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # a tiny Llama
LlamaForCausalLM(config).save_pretrained("llama-1b")       # "llama-1b/": a folder save_pretrained wrote
'''

# "When the job has ended": the section's cell exported for this machine's CPUs (2 processes, 2 steps) and its
# train.py run to the end, as a node runs it: job/out/weights and job/out/result.json.
JOB_RAN = '''\
import subprocess, sys
import nbtrain
from nbtrain.models.description import layer_slots
cell = ("import nbtrain\\nmodel = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, "
        "n_embd=64))\\n")
built = {}
exec(cell, built)
plan = nbtrain.Plan.parse("dp_shard=2", num_devices=2, num_layers=len(layer_slots(built["model"])), global_batch=4,
                          seq_len=64)
nbtrain.export_job("job", cell, "model", plan, model=built["model"], cpu=True, steps=2)
subprocess.run([sys.executable, "job/train.py"], check=True, timeout=300)
'''

SECTION_FIXTURES = {
    "README.md#In a notebook": "",
    "docs/profile.md#Profile a model": MY_MODEL,
    "docs/profile.md#Describe the cluster": "import nbtrain\n",
    "docs/plans.md#Plan the parallelism": 'import nbtrain\nprof = nbtrain.profile("llama-7b", batch_size=1, '
                                          'seq_len=2048)   # "prof from nbtrain.profile(...)"\n',
    "docs/running.md#Run a plan": BATCHES + TINY_LLAMA + '''
import torch.distributed as dist

held_out = batches[-1:]                  # "held-out batches", as the training batches are held


def fn(a, b):                            # "any function on N ranks"
    return a + b + dist.get_rank()


args = (1, 2)
''',
    "docs/any-model.md#Any model": "",              # its block imports what it uses
    "docs/switching.md#Variable-length data and hot switching": "import nbtrain\n",
    "docs/cluster.md#From a planned cell to a job folder": "",   # its cell imports what it uses
    "docs/cluster.md#Back in the notebook": JOB_RAN,
}


# ---------------------------------------------------------------------------------------------------------------------
# Docstrings: what each assumes. Every docstring's namespace is its module's globals (as doctest gives them) plus
# DEFAULT_SETUP, then its entry here (keyed by module, or module.qualified_name for a function's or class's).

DEFAULT_SETUP = "import nbtrain\n"

# Built once per test process, on first use: shared("gpt2@1024") in a setup below.
SHARED = {
    "llama-7b@4096": 'nbtrain.profile("llama-7b", batch_size=1, seq_len=4096)',
    "llama-7b@2048": 'nbtrain.profile("llama-7b", batch_size=1, seq_len=2048)',
    "gpt2@1024": 'nbtrain.profile("gpt2", batch_size=1, seq_len=1024)',
    "fit dp_shard=2": 'nbtrain.fit(nbtrain.build_preset("gpt-tiny", device="cpu"), batches, plan="dp_shard=2", '
                      'steps=2, num_processes=2, cluster=nbtrain.Cluster.detect(), progress=False)',
    "fit tp=2": 'nbtrain.fit(nbtrain.build_preset("llama-tiny", device="cpu"), batches, plan="tp=2", '
                'steps=2, num_processes=2, cluster=nbtrain.Cluster.detect(), progress=False)',
}
_shared_cache: dict = {}


def shared(name: str):
    if name not in _shared_cache:
        import nbtrain

        namespace = {"nbtrain": nbtrain}
        exec(BATCHES, namespace)
        _shared_cache[name] = eval(SHARED[name], namespace)
    return _shared_cache[name]


STACK_DUMPS = '''\
from pathlib import Path

_site = "/home/ada/.venv/lib/python3.11/site-packages"
Path("rank0.stack").write_text(f"""Current thread 0x00007f298c686b80 (most recent call first):
  File "{_site}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{_site}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/ada/train.py", line 12 in step
  File "/home/ada/train.py", line 30 in <module>
""")
Path("rank1.stack").write_text("""Current thread 0x00007f298c686b80 (most recent call first):
  File "/home/ada/data.py", line 40 in load
  File "/home/ada/train.py", line 11 in step
  File "/home/ada/train.py", line 30 in <module>
""")
'''

LENGTH_MIX = '''\
from nbtrain.data import WIKIPEDIA, histogram_documents
from nbtrain.models import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=2048, block_size=1024, n_layer=2, n_head=2, n_embd=64, tie_embeddings=False))
docs = histogram_documents(WIKIPEDIA, 2000, scale=8, vocab_size=2048)
'''

DOCSTRING_SETUP = {
    "nbtrain.notebook.cell": '''\
namespace = {}                            # the notebook's variables
cell_source = ("import nbtrain\\n"
               "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=1024, n_layer=2, n_head=2, "
               "n_embd=64))\\n")
''',
    "nbtrain.notebook.export": 'plan = nbtrain.Plan.parse("dp_shard=2", num_devices=2, num_layers=6)\n',
    "nbtrain.notebook.export_job": '''\
from nbtrain.models.description import layer_slots
cell_source = "import nbtrain\\nmodel = nbtrain.build_preset('gpt-tiny', device='meta')\\n"   # the cell's code
plan = nbtrain.Plan.parse("dp_shard=16", num_devices=16, global_batch=64, seq_len=256,
                          num_layers=len(layer_slots(nbtrain.build_preset("gpt-tiny", device="meta"))))
''',
    "nbtrain.notebook.flags": '''\
from IPython.core.magic_arguments import parse_argstring
from nbtrain.notebook.magics import AutoparallelMagics
args = parse_argstring(AutoparallelMagics.autoparallel, "--gpus 64 --memory 24GiB --launch --processes 2")
''',
    "nbtrain.notebook.plots": BATCHES,
    "nbtrain.notebook.plots.memory_plot": '''\
prof = shared("gpt2@1024")
cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
best = nbtrain.plan(prof, cluster, global_batch=32, seq_len=1024)
''',
    "nbtrain.notebook.plots.step_time_plot": BATCHES + '''\
model = nbtrain.build_preset("gpt-tiny", device="cpu")
cluster = nbtrain.Cluster.detect()
a, b = shared("fit dp_shard=2"), shared("fit tp=2")        # runs under dp_shard=2 and tp=2
''',
    "nbtrain.notebook.plots.timeline_plot": 'result = shared("fit dp_shard=2")\n',
    "nbtrain.notebook.widgets.PlanExplorer": 'prof = shared("gpt2@1024")\n',
    "nbtrain.planner.switching.bucket_search": '''\
from nbtrain.planner.switching.buckets import BucketOptions
profile = shared("llama-7b@4096")
cluster = nbtrain.Cluster.from_catalog("A100", num_devices=8)
''',
    "nbtrain.planner.switching.buckets.plan_buckets": 'prof = shared("llama-7b@4096")\n',
    "nbtrain.planner.switching.buckets.price_buckets": '''\
from nbtrain.planner.strategy import Strategy
prof = nbtrain.profile(nbtrain.GPT(nbtrain.GPTConfig(vocab_size=2048, block_size=4096, n_layer=2, n_head=2,
                                                     n_embd=64, tie_embeddings=False)), batch_size=1, seq_len=4096)
cluster = nbtrain.Cluster.from_catalog("cpu", num_devices=2)
''',
    "nbtrain.run.switching.planned": LENGTH_MIX,
    "nbtrain.run.session.session": BATCHES + '''
from tests.any_models import llama
model = llama()                          # a transformers Llama of its default config, small
batches = [(ids % 128, targets % 128) for ids, targets in batches]
held_out = batches[-1:]
''',
    "nbtrain.run.state.adapter_folder": BATCHES + '''
from peft import PeftModel
from transformers import AutoModelForCausalLM
from tests.any_models import llama, lora_llama
lora_model = lora_llama()                # peft's LoRA on a transformers Llama of its default config, small
base = llama()                           # the same base, untouched, for PeftModel.from_pretrained
batches = [(ids % 128, targets % 128) for ids, targets in batches]
''',
    "nbtrain.run.switching.training": LENGTH_MIX + 'from nbtrain.run.launch.workers import launch\n',
    "nbtrain.run.fit_documents": LENGTH_MIX,
    "nbtrain.run.switching.planned.longest_bucket_needs": LENGTH_MIX,
    "nbtrain.planner.cost": '''\
profile = shared("llama-7b@2048")
cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
''',
    "nbtrain.planner.report": '''\
from nbtrain.planner.recommend import baselines
profile = shared("llama-7b@2048")
cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8, device_memory="16GiB")
best = nbtrain.plan(profile, cluster, global_batch=64, seq_len=2048)
''',
    "nbtrain.planner.offload_note": '''\
profile = shared("llama-7b@2048")
cluster = nbtrain.Cluster.from_catalog("H100", num_devices=1, device_memory="40GiB")
best = nbtrain.plan(profile, cluster, global_batch=64, seq_len=2048)
''',
    "nbtrain.planner.search": '''\
profile = shared("llama-7b@2048")
cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8, device_memory="24GiB")
''',
    "nbtrain.run.fit": BATCHES,
    "nbtrain.run.state.materialize": BATCHES + TINY_LLAMA,
    "nbtrain.run.state.pretrained": BATCHES + TINY_LLAMA,
    "nbtrain.run.state.hf_folder": BATCHES + TINY_LLAMA + "model = LlamaForCausalLM(config)\n",
    "nbtrain.run.fit_worker": BATCHES + '''\
from nbtrain.models.description import layer_slots
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss
from nbtrain.run.launch.workers import launch
model = nbtrain.build_preset("gpt-tiny", device="cpu")
plan = Plan.parse("dp_shard=2", num_devices=2, num_layers=len(layer_slots(model)), global_batch=4, seq_len=32)
get_batch = batches.__getitem__                           # step -> (ids, targets)
settings = RunSettings(steps=2, lr=3e-4, clip_norm=1.0, loss_fn=lm_loss, seed=0, progress=False, precision="fp32",
                       lr_schedule=None, save_dir=None)
''',
    "nbtrain.profiler.timed": 'model = nbtrain.build_preset("gpt-tiny", device="cpu")\n',
    "nbtrain.tensor_memory": 'import torch\n',

    "nbtrain.run.launch.script": '''\
import os
from pathlib import Path
Path("plan.json").write_text(nbtrain.Plan.parse("dp_shard=2", num_devices=2, num_layers=6, global_batch=8,
                                                seq_len=64).to_json())
os.environ["NBTRAIN_PLAN"] = "plan.json"        # what `nbtrain run --plan plan.json` sets (restored after the test)
''',
    "nbtrain.run.offload.optimizer": BATCHES + '''\
from nbtrain.notebook.plots import timeline_plot
from nbtrain.profiler.model import lm_loss
model = nbtrain.build_preset("gpt-tiny", device="cpu")
plan = nbtrain.Plan.parse("0-1: offload=0; 2-5: offload=1", num_devices=1, num_layers=6)
''',
    "nbtrain.run.launch.stacks": STACK_DUMPS,
    "nbtrain.run.launch.failures": '''\
import multiprocessing, tempfile
from types import SimpleNamespace
before = set(multiprocessing.process._children)    # the children before the launch forks its workers
workdir = tempfile.mkdtemp(dir=".")                  # the launch's folder, where workers leave their reports
# what torch's elastic agent raises when a worker ends badly: here rank 1, killed (SIGKILL) without a report
failure = SimpleNamespace(get_first_failure=lambda: (1, SimpleNamespace(exitcode=-9)))
''',
}

# Docstrings whose examples say "in every worker": run on ``processes`` launched ranks (nbtrain.launch), each in its
# own namespace after ``setup``; ``here_from``: the examples from that index on run afterwards in this process
# ("later, in one process"), after ``here_setup``.
WORKER_MODEL = '''\
import torch
import nbtrain
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss
from nbtrain.run.parallel.mesh import PlanMeshes
from nbtrain.run.parallel.parallelize import parallelize
from nbtrain.run.state.weights import trained_prefixes

torch.manual_seed(0)
plan = Plan.parse("dp_shard=2", num_devices=2, num_layers=6, global_batch=4, seq_len=32)
model = nbtrain.build_preset("gpt-tiny", device="cpu")
meshes = PlanMeshes(plan)
mine = trained_prefixes(model, plan, meshes.stage)   # the layers this rank's stage trains
model = parallelize(model, plan, meshes)
'''
WORKER_TRAINED = WORKER_MODEL + BATCHES + '''\
from nbtrain.run.trainer import Trainer
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
Trainer(model, plan, meshes, optimizer).step(*batches[0])     # one step: AdamW has state
'''


@dataclass
class Workers:
    processes: int
    setup: str
    here_from: int | None = None
    here_setup: str = ""


def llama_tiny_in_workers(plan: str) -> str:
    """A worker's setup: llama-tiny, ``plan`` for 2 processes and its meshes, and one batch of token ids."""
    return f'''\
from nbtrain.planner.plan import Plan
from nbtrain.run.parallel.mesh import PlanMeshes
from nbtrain.run.parallel.parallelize import parallelize
plan = Plan.parse("{plan}", num_devices=2, num_layers=6)
model = nbtrain.build_preset("llama-tiny", device="cpu")
meshes = PlanMeshes(plan)
ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
targets = ids.roll(-1, dims=1)
'''


IN_WORKERS = {
    "nbtrain.run.parallel.mesh": Workers(2, '''\
from nbtrain.planner.plan import Plan
plan = Plan.parse("0-4: dp_shard=2; 5: tp=2", num_devices=2, num_layers=6)
'''),
    "nbtrain.run.parallel.parallelize": Workers(2, '''\
plan = Plan.parse("0: dp_shard=2; 1-4: tp=2 ac; 5: dp_replicate=2", num_devices=2, num_layers=6)
model = nbtrain.build_preset("llama-tiny", device="cpu")
'''),
    "nbtrain.run.placement": Workers(2, llama_tiny_in_workers("0: dp_shard=2; 1-4: tp=2 ac; 5: dp_replicate=2")),
    "nbtrain.run.parallel.vocab_parallel": Workers(2, llama_tiny_in_workers("tp=2")),
    "nbtrain.expert_dispatch": Workers(2, '''\
from nbtrain.planner.plan import Plan
from nbtrain.run.parallel.mesh import PlanMeshes
from tests.any_models import mixtral
model = mixtral()                                           # transformers' Mixtral, 4 experts, 2 a token
plan = Plan.parse("dp_shard=2 ep=2", num_devices=2, num_layers=4)
meshes = PlanMeshes(plan)
s = plan.layers[1]
'''),
    "nbtrain.run.parallel.pipeline": Workers(2, '''\
from nbtrain.profiler.model import lm_loss
from nbtrain.run.parallel.parallelize import parallelize
plan = Plan.parse("pp=2 mb=2", num_devices=2, num_layers=6, global_batch=4, seq_len=32)
model = nbtrain.build_preset("llama-tiny", device="cpu")     # untied embeddings: they may sit in two stages
meshes = PlanMeshes(plan)
model = parallelize(model, plan, meshes)
loss_fn = lm_loss
window = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
local_ids, local_targets = window[:, :-1], window[:, 1:]   # one data-parallel slice: all of it at dp=1
'''),
    "nbtrain.run.parallel.traced_stages": Workers(2, '''\
from nbtrain.models.description import describe
from nbtrain.planner.plan import Plan
from nbtrain.run.parallel.mesh import PlanMeshes
from tests.any_models import cnn, image_batches
plan = Plan.parse("pp=2 mb=2", num_devices=2, num_layers=5, global_batch=4)   # stem, 3 blocks, head: 3 + 2
model = cnn()                                                                  # plain torch, a list of conv blocks
meshes = PlanMeshes(plan)
images, labels = image_batches(steps=1)[0]
'''),
    "nbtrain.models.conv1d": Workers(2, '''\
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
block = GPT2Block(GPT2Config(n_embd=32, n_head=4))       # a GPT-2 block of its default config, narrower
tp_mesh = init_device_mesh("cpu", (2,))
'''),
    "nbtrain.run.trainer": Workers(2, WORKER_MODEL + BATCHES),
    "nbtrain.run.state.weights": Workers(2, WORKER_TRAINED, here_from=2,
                                   here_setup='fresh_model = nbtrain.build_preset("gpt-tiny", device="cpu")\n'),
    "nbtrain.run.state.training_state": Workers(2, WORKER_TRAINED + '''\
import torch.distributed.checkpoint as dcp
from nbtrain.run.state.training_state import TrainingState
folder = "saved-state"                               # a checkpoint of this run, saved by every rank
dcp.save(TrainingState(model, optimizer, mine).to_save(), checkpoint_id=folder)
'''),
    "nbtrain.run.state.checkpoint": Workers(2, WORKER_TRAINED + '''\
from nbtrain.run.state.training_state import TrainingState
state = TrainingState(model, optimizer, mine)
progress = Progress(6, 6, **Progress.random_states())   # where the run stands: after 6 steps
'''),
    "nbtrain.run.offload.ddp": Workers(2, '''\
from torch.nn.parallel import DistributedDataParallel
from nbtrain.run.offload.optimizer import OffloadedAdamW
model = nbtrain.build_preset("gpt-tiny", device="cpu")
'''),
    "nbtrain.run.switching.reshard": Workers(2, '''\
from nbtrain.planner.plan import Plan
from nbtrain.run.parallel.mesh import PlanMeshes, local_shard
from nbtrain.run.parallel.parallelize import parallelize


def layout(text):                                    # gpt-tiny parallelized under a uniform plan
    plan = Plan.parse(text, num_devices=2, num_layers=6)
    return parallelize(nbtrain.build_preset("gpt-tiny", device="cpu"), plan, PlanMeshes(plan))


src_model, dst_model = layout("dp_replicate=2"), layout("dp_shard=2")     # DDP, FSDP2
src_params, dst_params = list(src_model.parameters()), list(dst_model.parameters())
'''),
    "nbtrain.run.switching.hot": Workers(2, '''\
from nbtrain.data import length_batches
from nbtrain.models import GPT, GPTConfig
config = GPTConfig(vocab_size=256, block_size=8192, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
_g = torch.Generator().manual_seed(0)
docs = [torch.randint(0, 256, (n,), generator=_g) for n in (100, 400, 1200, 2500)]   # 4,200 tokens, every bucket
'''),
}

# Docstrings whose shown output holds measurements of this machine: a number (with its unit's prefix) matches any.
VARYING_NUMBERS = {"nbtrain.profiler.calibrate"}


# ---------------------------------------------------------------------------------------------------------------------
# Running a docstring's examples.

class ScriptChecker(doctest.OutputChecker):
    """An example that shows no output runs as a script line (what it prints or returns is not compared); one
    that shows output is compared as doctest compares it, ``...`` matching anything and runs of whitespace equal.
    ``numbers_vary``: every number, with the prefix of its unit (``1.4 G`` params/s, ``69.3 m``s), matches any."""

    NUMBER = re.compile(r"\d+(?:[.,]\d+)*\s?(?:[kKMGTPµmn](?=[A-Za-z/]|\s))?")

    def __init__(self, numbers_vary: bool = False):
        self.numbers_vary = numbers_vary

    def check_output(self, want, got, optionflags):
        if not want:
            return True
        if self.numbers_vary:
            want, got = self.NUMBER.sub("<n>", want), self.NUMBER.sub("<n>", got)
        return super().check_output(want, got, optionflags)


FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.FAIL_FAST


def docstring_namespace(doc: DocstringExample, setup: str | None = None) -> dict:
    """The module's globals, DEFAULT_SETUP and the docstring's setup run in them."""
    import importlib

    globs = dict(vars(importlib.import_module(doc.module)))
    globs["shared"] = shared
    exec(DEFAULT_SETUP, globs)
    exec(DOCSTRING_SETUP.get(doc.key, "") if setup is None else setup, globs)
    return globs


def run_examples(doc: DocstringExample, examples: list, globs: dict) -> tuple[int, str]:
    """Run ``examples`` (of ``doc``) in order in ``globs``: ``(failures, doctest's report)``."""
    report: list[str] = []
    runner = doctest.DocTestRunner(checker=ScriptChecker(doc.module in VARYING_NUMBERS), optionflags=FLAGS)
    path, line = doc.where.rsplit(":", 1)
    test = doctest.DocTest(examples, globs, doc.id, path, int(line) - 1, None)
    result = runner.run(test, out=report.append, clear_globs=False)
    return result.failed, "".join(report)


def run_in_worker(doc: DocstringExample, examples: list, setup: str) -> list[tuple[int, int, str]]:
    """In every launched rank: the setup, then ``examples``; every rank's ``(rank, failures, report)``."""
    import torch.distributed as dist

    failed, report = run_examples(doc, examples, docstring_namespace(doc, setup))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), failed, report))
    return everyone
