"""The bytes a compiled step's collectives send, by kind, read from its HLO text.

Each device's share of a ring algorithm (NCCL's): an all-gather sends (n-1)/n of its result, a reduce-scatter n-1
times it, an all-reduce twice (n-1)/n of it, an all-to-all (n-1)/n, a collective permute all of it; a loop body's
collectives count as often as the loop runs (its known trip count).
"""

from __future__ import annotations

import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SENT = {  # the multiple of its result a device sends, over groups of n
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1,
}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}
_COLLECTIVE = re.compile(r"= (.*) (" + "|".join(KINDS) + r")(-start)?\((.*)$", re.M)  # -start: (inputs, outputs)


def _group(line: str, devices: int) -> int:
    """Devices in each group of a collective, from any of XLA's spellings of its replica groups."""
    if mesh := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh[2]))
    if iota := re.search(r"replica_groups=\[([\d,]+)\]<=", line):
        return int(iota[1].split(",")[-1])
    if explicit := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(explicit[1].split(","))
    return 2 if "source_target_pairs" in line else devices


def collective_bytes(hlo: str, devices: int, per_host: int = 8) -> dict[str, dict[str, float]]:
    """Bytes one device sends in a step, by collective kind, and of those over groups wider than a host."""
    blocks = {m[1]: b for b in re.split(r"\n(?=\S)", hlo) if (m := re.match(r"(?:ENTRY )?%([\w.\-]+) ", b))}
    runs: dict[str, int] = {}  # computation -> times it runs a step; a caller is written after what it calls
    for name, block in reversed(blocks.items()):
        times = runs.setdefault(name, 1)
        for line in block.splitlines():
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            for called in re.findall(r"(?:body|calls|to_apply|branch_computations)=\{?%([\w.\-]+)", line):
                loop = int(trips[1]) if trips and "body=%" + called in line else 1
                runs[called] = runs.get(called, 0) + times * loop
    sent = {kind: {"bytes": 0.0, "network_bytes": 0.0} for kind in KINDS}
    for name, block in blocks.items():
        times = runs[name]
        for result, kind, start, rest in _COLLECTIVE.findall(block):
            if start and kind != "all-reduce" and result.startswith("(("):  # the outputs
                result = result[result.index("), ") + 3 :]
            elif start and kind != "all-reduce" and result.startswith("("):
                result = result.split(", ", 1)[1]
            size = sum(math.prod(map(int, filter(None, d.split(",")))) * _BYTES.get(t, 1)
                       for t, d in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result))  # fmt: skip
            group = _group(rest, devices)
            sent[kind]["bytes"] += times * size * _SENT[kind](group)
            sent[kind]["network_bytes"] += times * size * _SENT[kind](group) * (group > per_host)
    return sent
