"""A fixed set of planning cases and what the search answered on them before it was made fast (issue 46).

    .venv/bin/python -m tests.plan_cases --write [OLD.json.gz]    # re-record tests/data/plans_before_speedup.json.gz
                                                                  # (minutes; OLD: take its profiles)

The cases are the ones people wait on: GPT-2 as the plan explorer replans it (8 devices, then 4, then a 3 GiB
budget), a tight 2-device budget, LLaMA-7B on 8 H100s at four budgets, a 16-stage-capable cluster that pipelines
and offloads, LLaMA-70B on 64 and 1,024 H100s, and Mixtral-8x7B's shape with expert parallelism on 64. The
profiles are stored beside the answers, so a change to the profiler cannot move them; a change to the cost model's
numbers can, and then the file is recorded again with the search of the commit before the change (the search must
answer as its exhaustive predecessor did, not as itself). Recorded at 9ed82b0, before the speed-up; recorded again
on 2026-12-05 after the cost model priced a sharded layer's gradient sync every micro-batch and ZeRO-2's fp32 shards
(acbc608, 10c335c: the executor changed), and again when it priced the trainer's all-reduce of the loss once a step
on more than one device (a collective's latency on these catalog clusters: 6 µs in a node, 25 µs across), and
when a sharded pipeline stage's whole gradients were priced (torch's stage reduces them once, after its last
micro-batch: tests/test_pipeline_memory.py), and on 2026-12-06 when the vocabulary-parallel loss under TP was priced
(three all-reduces a token: on these catalog clusters six latencies a micro-batch; no plan moved, four predictions
by 0.04-9 ms), by the search with its bounds switched off (``Solver.prune = False``:
every task solved in full, the exhaustive answer; the frontier's exactness is tests/test_frontier.py's). The test
then checks the bounds against that record, on every case.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile

DATA = Path(__file__).parent / "data" / "plans_before_speedup.json.gz"


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    """A key of :data:`PROFILES`."""
    devices: int
    per_node: int
    batch: int
    memory: str | None = None
    pp_degrees: tuple[int, ...] | None = None
    slow: bool = False
    """Takes more than a few seconds even after the speed-up."""

    def cluster(self) -> Cluster:
        return Cluster.from_catalog("H100", num_devices=self.devices, devices_per_node=self.per_node)


PROFILES = {"gpt2": ("gpt2", 1024), "llama-7b": ("llama-7b", 2048), "llama-70b": ("llama-70b", 4096),
            "mixtral-8x7b": ("mixtral", 4096)}
"""Profile key → (preset, or ``mixtral`` for transformers' default MixtralConfig on the meta device; length)."""

CASES = [
    Case("gpt2 on 8 (the explorer opens)", "gpt2", 8, 8, 32),
    Case("gpt2 on 4 (the explorer's first change)", "gpt2", 4, 4, 32),
    Case("gpt2 on 4 at 3 GiB (the explorer's second change)", "gpt2", 4, 4, 32, "3GiB"),
    Case("gpt2 on 2 at 2.5 GiB", "gpt2", 2, 2, 16, "2.5GiB"),
    Case("gpt2 on 2 at 2 GiB (nothing fits)", "gpt2", 2, 2, 16, "2GiB"),
    *[Case(f"llama-7b on 8 at {gib} GiB", "llama-7b", 8, 8, 64, f"{gib}GiB") for gib in (16, 24, 36, 48)],
    Case("llama-7b on 16 one a node at 12 GiB (pipeline and offload)", "llama-7b", 16, 1, 64, "12GiB"),
    Case("llama-7b on 8 one a node at 12 GiB, pp 2 or 4", "llama-7b", 8, 1, 32, "12GiB", pp_degrees=(2, 4)),
    Case("llama-70b on 64", "llama-70b", 64, 8, 512, "80GiB", slow=True),
    Case("llama-70b on 1024", "llama-70b", 1024, 8, 2048, slow=True),
    Case("mixtral-8x7b on 64 (expert parallelism)", "mixtral-8x7b", 64, 8, 128, slow=True),
]


def _profile_now(key: str) -> ModelProfile:
    import nbtrain

    name, seq = PROFILES[key]
    if name != "mixtral":
        return nbtrain.profile(name, batch_size=1, seq_len=seq)
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig())
    return nbtrain.profile(model, batch_size=1, seq_len=seq, name="mixtral-8x7b")


def recorded_from(path: Path = DATA) -> dict:
    """``{"profiles": {key: profile dict}, "answers": {case name: answer}}`` as written by :func:`write`."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def profiles(data: dict) -> dict[str, ModelProfile]:
    return {key: ModelProfile.from_dict(d) for key, d in data["profiles"].items()}


def _plan_row(plan) -> list:
    return [str(plan), plan.predicted.step_time_s, plan.predicted.memory_bytes]


def answer(case: Case, profile: ModelProfile, **search_kwargs) -> dict:
    """What the planner answers on ``case``: the search's top 3 and ``nbtrain.plan``'s recommendation, with its
    prediction, alternatives and notes."""
    from nbtrain.errors import NoFeasiblePlanError
    from nbtrain.planner.recommend import plan
    from nbtrain.planner.search import search
    from nbtrain.planner.search_space import SearchOptions
    from nbtrain.units import parse_bytes

    memory = parse_bytes(case.memory) if case.memory else None
    options = SearchOptions(pp_degrees=case.pp_degrees)
    kwargs = dict(global_batch=case.batch, seq_len=profile.seq_len, memory=memory, options=options)
    found = search(profile, case.cluster(), top=3, **kwargs, **search_kwargs)
    try:
        best = plan(profile, case.cluster(), **kwargs)
    except NoFeasiblePlanError as e:
        return {"search": [_plan_row(p) for p in found], "error": str(e)}
    return {"search": [_plan_row(p) for p in found], "plan": _plan_row(best),
            "alternatives": [_plan_row(p) for p in best.alternatives], "notes": list(best.notes)}


def write(reuse: Path | None = None) -> None:
    """Profile (or take the profiles of ``reuse``, a file written before) and answer every case."""
    data = {"profiles": recorded_from(reuse)["profiles"] if reuse else {}, "answers": {}}
    for key in PROFILES:
        if key in data["profiles"]:
            continue
        started = time.perf_counter()
        data["profiles"][key] = _profile_now(key).to_dict()
        print(f"profiled {key} in {time.perf_counter() - started:.1f} s", flush=True)
    _save(data)  # the profiles first: a run stopped below can take them (--write FILE)
    live = profiles(json.loads(json.dumps(data)))  # as the test reads them back
    for case in CASES:
        started = time.perf_counter()
        data["answers"][case.name] = answer(case, live[case.model])
        shown = data["answers"][case.name].get("plan", ["no plan"])[0]
        print(f"{case.name}: {shown} in {time.perf_counter() - started:.1f} s", flush=True)
    _save(data)


def _save(data: dict) -> None:
    DATA.parent.mkdir(exist_ok=True)
    with gzip.open(DATA, "wt") as f:
        json.dump(data, f)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"]:
        sys.exit(__doc__)
    write(Path(sys.argv[2]) if len(sys.argv) > 2 else None)
