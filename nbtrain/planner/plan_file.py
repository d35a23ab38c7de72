"""A plan written to a file by ``nbtrain plan ... --json`` (the plan, with the baselines beside it), read back.

    >>> from nbtrain.planner.plan import Plan
    >>> _ = open("plan2.json", "w").write(Plan.parse("dp_shard=2", num_devices=2, num_layers=6).to_json())
    >>> read_plan("plan2.json").num_devices
    2
"""

from __future__ import annotations

import json
from pathlib import Path

from nbtrain.planner.plan import Plan


def read_plan(path) -> Plan:
    """The plan in ``path`` (the baselines ``nbtrain plan --json`` writes beside it are left out). Raises ``OSError``
    for a file that cannot be read and ``ValueError`` (a ``json.JSONDecodeError`` too) for one that holds no plan."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds {type(data).__name__}, not a plan (a JSON object)")
    data.pop("baselines", None)
    return Plan.from_dict(data)
