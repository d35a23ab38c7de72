"""The compact plan form: what users type in a notebook cell and what ``str(plan)`` prints back.

    >>> from nbtrain.planner.plan import Plan
    >>> plan = Plan.parse("pp=2 mb=8 | 0-11: tp=2 ac; 12-23: dp_shard=2", num_devices=8, num_layers=24)
    >>> str(plan.layers[0]), str(plan.layers[23])
    ('dp_replicate=2 tp=2 ac', 'dp_replicate=2 dp_shard=2')
    >>> Plan.parse(str(plan), num_devices=8, num_layers=24) == plan
    True

Grammar (tokens are separated by whitespace, with no spaces around ``=``; keys in any order, each at most once)::

    plan      := pipeline "|" layers  |  pipeline  |  layers
    pipeline  := [pp=P] [mb=M] [schedule=1f1b|gpipe] [stages=a+b+...]
    layers    := strategy  |  range ":" strategy (";" range ":" strategy)* [";"]
    range     := span ("," span)*          span := i | i-j      (0-based, inclusive)
    strategy  := [dp_replicate=a] [dp_shard=b] [zero=2|3] [tp=c] [sp] [ep=e] [ac | ac=op | ac=1/k] [offload=f]

- Omitted keys mean 1 / off / ``schedule=1f1b`` / the even stage split, except ``dp_replicate``, which takes the
  devices left over: num_devices // (pp × dp_shard × tp). So ``dp_shard=4`` on 16 devices is HSDP with
  dp_replicate=4, and ``pp=2 mb=4`` alone on 8 devices gives dp_replicate=4 on every layer.
- ``stages`` without ``pp`` sets pp to the number of stages. ``offload`` is a fraction (``0.25``) or a percentage
  (``25%``). ``zero`` needs ``dp_shard`` > 1 (it is the level of that sharding). ``sp`` (sequence parallelism,
  a flag like ``ac``) needs ``tp`` > 1: ``0: tp=2; 1-12: tp=2 sp; 13: tp=2``.
- ``ep`` (expert parallelism) spreads a mixture-of-experts layer's experts over ``ep`` of its data-parallel ranks;
  it divides dp_replicate × dp_shard and uses no devices of its own: ``dp_shard=4 ep=2`` on 4 devices. Layers
  without experts ignore it, so ``ep=2`` may be written for the whole model.
- Checkpointing: ``ac`` recomputes the whole layer in backward (keeping its input); ``ac=op`` is per-op selective
  checkpointing (torchtitan's "op" SAC): the outputs of attention and of every other projection
  matmul are kept, the rest recomputed;
  ``ac=1/k`` is full checkpointing on every k-th layer of its range (the k-th, 2k-th, ..., as torchtitan's
  "selective layer" option counts them), expanded to per-layer strategies: ``0-3: ac=1/2`` prints back as
  ``0: dp_replicate=1; 1: ac; 2: dp_replicate=1; 3: ac``.
- Without layer ranges the ``|`` may be left out: ``pp=2 mb=4 tp=2`` is ``pp=2 mb=4 | tp=2``.
- The ranges must cover every layer exactly once.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import TYPE_CHECKING

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.strategy import SCHEDULES, Strategy, even_split, plan_int

if TYPE_CHECKING:  # the plan module imports this one: plans are read and written here, built there
    from nbtrain.planner.plan import Plan

PIPELINE_KEYS = ("pp", "mb", "schedule", "stages")
LAYER_KEYS = ("dp_replicate", "dp_shard", "zero", "tp", "sp", "ep", "ac", "offload")
FLAGS = {"sp": "sequence parallelism (with tp > 1)"}
"""Keys written alone, without a value (on when present)."""
_EXAMPLE = {"pp": "pp=2", "mb": "mb=8", "schedule": "schedule=1f1b' or 'schedule=gpipe", "stages": "stages=12+12",
            "dp_replicate": "dp_replicate=2", "dp_shard": "dp_shard=4", "zero": "zero=2' or 'zero=3", "tp": "tp=2",
            "ac": "ac' or 'ac=op' or 'ac=1/2", "sp": "tp=2 sp", "ep": "ep=2", "offload": "offload=0.25"}
_HINTS = {"dp": "dp_replicate (DDP) or dp_shard (FSDP)", "ddp": "dp_replicate", "fsdp": "dp_shard",
          "hsdp": "dp_replicate and dp_shard together", "microbatches": "mb", "micro_batches": "mb",
          "checkpoint": "ac", "activation_checkpointing": "ac", "pipeline": "pp",
          "sac": "ac=op (per-op selective checkpointing) or ac=1/2 (every 2nd layer)",
          "sequence_parallel": "sp", "sequence_parallelism": "sp", "expert_parallel": "ep",
          "expert_parallelism": "ep", "moe": "ep (expert parallelism)"}
_FORM = "'pp=2 mb=8 | dp_shard=4 tp=2 ac' or '0-11: tp=2 ac; 12-23: dp_shard=2'"


def format_plan(plan: Plan) -> str:
    """The compact form of ``plan``: the pipeline part only when pp > 1 or mb > 1, the layer part as one strategy
    when all layers agree, else as runs of equal consecutive layers (``0-11: tp=2 ac; 12-23: dp_shard=2``)."""
    parts = []
    if plan.pp > 1 or plan.microbatches > 1:
        pipe = [f"pp={plan.pp}", f"mb={plan.microbatches}"] + ([f"schedule={plan.schedule}"] if plan.pp > 1 else [])
        if plan.stages != even_split(plan.num_layers, plan.pp):
            pipe.append("stages=" + "+".join(map(str, plan.stages)))
        parts.append(" ".join(pipe))
    runs: list[list] = []  # [first, last, strategy]
    for i, s in enumerate(plan.layers):
        if runs and runs[-1][2] == s:
            runs[-1][1] = i
        else:
            runs.append([i, i, s])
    if len(runs) == 1:
        parts.append(str(runs[0][2]))
    else:
        parts.append("; ".join(f"{a}-{b}: {s}" if b > a else f"{a}: {s}" for a, b, s in runs))
    return " | ".join(parts)


def parse_plan(text: str, *, num_devices: int, num_layers: int) -> dict:
    """``text`` → the fields ``pp``, ``microbatches``, ``schedule``, ``stages``, ``layers`` of a :class:`Plan`.
    Every mistake raises InvalidPlanError with one line that quotes the offending token and the expected form."""
    if not isinstance(text, str):
        raise InvalidPlanError(f"a plan is a string like {_FORM}, not a {type(text).__name__}")
    num_devices = plan_int(num_devices, "num_devices", "the plan needs at least one device")
    num_layers = plan_int(num_layers, "num_layers", "the model has at least one layer")
    sections = text.split("|")
    if len(sections) > 2:
        raise InvalidPlanError(f"{text!r} has {len(sections) - 1} '|'; use one, between the pipeline part and the "
                               f"layer part: {_FORM}")
    if not text.strip() or all(not s.strip() for s in sections):
        raise InvalidPlanError(f"the plan string is empty; write e.g. {_FORM}")
    if len(sections) == 2:
        pipe = _read(sections[0].split(), PIPELINE_KEYS, "it belongs after '|' (the layer part)")
        layer_text = sections[1]
    elif ":" in text or ";" in text:
        pipe, layer_text = {}, text
    else:  # no ranges: pipeline and layer keys may share the one part
        tokens = text.split()
        pipe = _read([t for t in tokens if _key(t) in PIPELINE_KEYS], PIPELINE_KEYS, "")
        layer_text = " ".join(t for t in tokens if _key(t) not in PIPELINE_KEYS)

    stages = pipe.get("stages", ())
    pp = pipe.get("pp", len(stages) or 1)
    if stages and len(stages) != pp:
        raise InvalidPlanError(f"'stages={'+'.join(map(str, stages))}' has {len(stages)} stages, but 'pp={pp}'; "
                               "give one layer count per stage")
    if num_devices % pp:
        raise InvalidPlanError(f"'pp={pp}' does not divide the {num_devices} devices; choose a pipeline degree "
                               f"that divides {num_devices}")
    # without mb, a pipeline runs as many micro-batches as stages: the fewest its default schedule (1F1B) runs
    fields = {"pp": pp, "microbatches": pipe.get("mb", pp), "schedule": pipe.get("schedule", "1f1b"),
              "stages": stages}

    segments = [s.strip() for s in layer_text.split(";") if s.strip()]
    if not any(":" in s for s in segments):
        if len(segments) > 1:
            raise InvalidPlanError(f"{layer_text.strip()!r} has {len(segments)} strategies but no layer ranges; "
                                   "give each a range: '0-11: tp=2 ac; 12-23: dp_shard=2'")
        body = segments[0] if segments else ""
        strategy, every = _strategy(body, repr(body), pp, num_devices)
        layers = [strategy] * num_layers
        if every > 1:
            _every_kth(strategy, every, list(range(num_layers)), layers)
        fields["layers"] = tuple(layers)
        return fields

    layers: list[Strategy | None] = [None] * num_layers
    given = [0] * num_layers
    for seg in segments:
        if ":" not in seg:
            problem = "has no ':' after its layer range" if seg[0].isdigit() else "has no layer range"
            raise InvalidPlanError(f"{seg!r} {problem}; with ranges, every part is 'range: strategy', e.g. "
                                   "'0-11: tp=2 ac; 12-23: dp_shard=2'")
        where, body = seg.split(":", 1)
        strategy, every = _strategy(body.strip(), repr(seg), pp, num_devices)
        indices = _indices(where.strip(), num_layers)
        for i in indices:
            layers[i] = strategy
            given[i] += 1
        if every > 1:
            _every_kth(strategy, every, indices, layers)
    missing = [i for i, n in enumerate(given) if n == 0]
    twice = [i for i, n in enumerate(given) if n > 1]
    if missing or twice:
        problems = ([f"{_spans(missing)} missing"] if missing else []) + (
            [f"{_spans(twice)} given more than once"] if twice else [])
        raise InvalidPlanError(f"the layer ranges must cover each of the {num_layers} layers (0-{num_layers - 1}) "
                               f"exactly once: {'; '.join(problems)}")
    fields["layers"] = tuple(layers)
    return fields


def _key(token: str) -> str:
    return token.split("=", 1)[0]


def _read(tokens: list[str], allowed: tuple[str, ...], misplaced: str) -> dict:
    """Tokens → {key: value}, each value checked; ``misplaced`` says where a key of the other part belongs."""
    out: dict = {}
    seen: dict[str, str] = {}
    for token in tokens:
        key, has_value, value = token.partition("=")
        if key in allowed:
            pass
        elif key in PIPELINE_KEYS + LAYER_KEYS:
            where = misplaced or "it belongs before '|' (the pipeline part)"
            raise InvalidPlanError(f"{token!r} is a {'pipeline' if key in PIPELINE_KEYS else 'per-layer'} key, "
                                   f"{where}: {_FORM}")
        elif re.fullmatch(r"[0-9,\-]+:?", token):
            raise InvalidPlanError(f"{token!r} looks like a layer range; end each range's strategy with ';' and "
                                   "put ':' right after the range: '0-11: tp=2 ac; 12-23: dp_shard=2'")
        else:
            close = _HINTS.get(key.lower()) or " or ".join(
                repr(k) for k in difflib.get_close_matches(key, PIPELINE_KEYS + LAYER_KEYS, n=2))
            hint = f"did you mean {close}? " if close else ""
            raise InvalidPlanError(f"unknown key {key!r} in {token!r}; {hint}the keys are "
                                   f"{', '.join(PIPELINE_KEYS)} (before '|') and {', '.join(LAYER_KEYS)}, "
                                   f"e.g. {_FORM}")
        if key in seen:
            raise InvalidPlanError(f"{token!r} repeats {key!r} (already {seen[key]!r}); give each key once")
        seen[key] = token
        if key == "ac":
            out[key] = _ac(value, token) if has_value else True
            continue
        if key in FLAGS:
            if has_value:
                raise InvalidPlanError(f"{token!r}: {key} is a flag; write '{key}' for {FLAGS[key]}, or "
                                       "leave it out for none")
            out[key] = True
            continue
        if not value:
            raise InvalidPlanError(f"{token!r} has no value; write it as '{_EXAMPLE[key]}' (no spaces around '=')")
        out[key] = _value(key, value, token)
    return out


def _value(key: str, value: str, token: str):
    if key in ("pp", "mb", "dp_replicate", "dp_shard", "tp", "ep"):
        if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise InvalidPlanError(f"{token!r}: {key} takes a positive integer, e.g. '{_EXAMPLE[key]}'")
        return int(value)
    if key == "zero":
        if value not in ("2", "3"):
            raise InvalidPlanError(f"{token!r}: write 'zero=2' (shard gradients and optimizer state) or 'zero=3' "
                                   "(also shard parameters)")
        return int(value)
    if key == "schedule":
        if value.lower() not in SCHEDULES:
            raise InvalidPlanError(f"{token!r}: the schedule is '1f1b' or 'gpipe', e.g. 'schedule=1f1b'")
        return value.lower()
    if key == "stages":
        if not re.fullmatch(r"[0-9]+(\+[0-9]+)*", value) or any(int(k) < 1 for k in value.split("+")):
            raise InvalidPlanError(f"{token!r}: stages are layer counts joined by '+', each at least 1, "
                                   "e.g. 'stages=13+11'")
        return tuple(int(k) for k in value.split("+"))
    # offload: a fraction, or a percentage
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)(%?)", value)
    fraction = float(match.group(1)) / (100 if match.group(2) else 1) if match else -1.0
    if not 0.0 <= fraction <= 1.0:
        raise InvalidPlanError(f"{token!r}: offload is the fraction of the update done on the CPU, from 0 to 1, "
                               "e.g. 'offload=0.25' or 'offload=25%'")
    return fraction


_AC_FORMS = "'ac' (full recomputation), 'ac=op' (save attention and every other projection's outputs, recompute " \
            "the rest) or " \
            "'ac=1/2' (full recomputation on every 2nd layer)"


def _ac(value: str, token: str) -> bool | str | int:
    """The value of ``ac=...``: ``"op"``, or for ``1/k`` the int ``k`` (every k-th layer, expanded by the caller)."""
    if value == "op":
        return "op"
    match = re.fullmatch(r"1/([0-9]+)", value)
    if not match:
        raise InvalidPlanError(f"{token!r}: checkpointing is written {_AC_FORMS}")
    every = int(match.group(1))
    if every < 1:
        raise InvalidPlanError(f"{token!r}: every k-th layer needs k ≥ 1; write e.g. 'ac=1/2' (every 2nd layer), "
                               "or 'ac' for every layer")
    return every


def _every_kth(strategy: Strategy, every: int, indices: list[int], layers: list) -> None:
    """``ac=1/k`` on a range: full checkpointing on its k-th, 2k-th, ... layer (torchtitan's "selective layer"
    checkpointing counts the blocks it wraps from 1 and checkpoints those divisible by k), none on the others."""
    on, off = dataclasses.replace(strategy, ac=True), dataclasses.replace(strategy, ac=False)
    for position, i in enumerate(indices, start=1):
        layers[i] = on if position % every == 0 else off


def _strategy(body: str, where: str, pp: int, num_devices: int) -> tuple[Strategy, int]:
    """One strategy's tokens → (Strategy, k), filling dp_replicate with the devices left over when it is omitted;
    ``k`` is 1 unless the strategy says ``ac=1/k``, which the caller expands over the layers of its range."""
    keys = _read(body.split(), LAYER_KEYS, "")
    every = 1
    if type(keys.get("ac")) is int:  # ac=1/k: full checkpointing, on every k-th layer (k = 1: on all)
        every, keys["ac"] = keys["ac"], True
    dp_shard, tp = keys.get("dp_shard", 1), keys.get("tp", 1)
    if "zero" in keys and dp_shard == 1:
        raise InvalidPlanError(f"{where}: zero is the level of sharded data parallelism and needs dp_shard > 1; "
                               "add it, e.g. 'dp_shard=8 zero=2'")
    if keys.get("sp") and tp == 1:
        raise InvalidPlanError(f"{where}: sp (sequence parallelism) splits the sequence over the tensor-parallel "
                               "ranks, so it needs tp > 1; write e.g. 'tp=2 sp', or leave out 'sp'")
    if "dp_replicate" in keys:
        product = keys["dp_replicate"] * dp_shard * tp * pp
        if product != num_devices:
            raise InvalidPlanError(
                f"{where}: dp_replicate × dp_shard × tp × pp = {keys['dp_replicate']} × {dp_shard} × {tp} × {pp} = "
                f"{product}, but the plan is for {num_devices} devices; choose degrees whose product is "
                f"{num_devices} (or leave out dp_replicate to use the devices left over)")
    elif num_devices % (pp * dp_shard * tp):
        raise InvalidPlanError(
            f"{where}: pp × dp_shard × tp = {pp} × {dp_shard} × {tp} = {pp * dp_shard * tp} does not divide the "
            f"{num_devices} devices, so dp_replicate cannot take the rest; choose degrees whose product divides "
            f"{num_devices}")
    keys.setdefault("dp_replicate", num_devices // (pp * dp_shard * tp))
    return Strategy(**keys), every


def _indices(where: str, num_layers: int) -> list[int]:
    """``'0-3,7'`` → [0, 1, 2, 3, 7], each checked against the model's layers."""
    out = []
    for span in where.split(","):
        match = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", span)
        if not match:
            raise InvalidPlanError(f"{span.strip()!r} is not a layer range; write 'first-last' (inclusive, from 0) "
                                   "or one index before ':', e.g. '0-11: tp=2' or '5: ac'")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last >= num_layers:
            raise InvalidPlanError(f"{span.strip()!r} is out of range: the model has {num_layers} layers, "
                                   f"0-{num_layers - 1}")
        if last < first:
            raise InvalidPlanError(f"{span.strip()!r} runs backwards; write the lower index first, "
                                   f"e.g. '{last}-{first}'")
        out += range(first, last + 1)
    return out


def layer_spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] → 'layers 0-2, 5'; [3] → 'layer 3' (sorted indices, runs as ranges)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return f"layer {text}" if len(indices) == 1 else f"layers {text}"


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] → 'layers 0-2, 5 are' (the subject of the sentence that says what is wrong with them)."""
    return f"{layer_spans(indices)} {'is' if len(indices) == 1 else 'are'}"
