"""Checkpointing strategies: how the layers of a container are grouped into checkpoints.

``"each"``: every layer its own; ``"group_N"``: runs of N consecutive layers; ``"contiguous"``: the whole
container one (peak memory near no checkpointing). A checkpoint whose layers span pipeline stages runs
without checkpointing (SMP splits it), so under pipelines prefer groups inside one stage.
"""

from __future__ import annotations

import re

from jmp.errors import ConfigError

STRATEGIES = ("each", "contiguous", "group_N")
_GROUP = re.compile(r"group_([1-9][0-9]*)")


def parse_strategy(value: object, where: str) -> str:
    """``value`` checked to be one of ``STRATEGIES`` (``group_N`` with a positive N)."""
    if value in ("each", "contiguous") or (isinstance(value, str) and _GROUP.fullmatch(value)):
        return value  # type: ignore[return-value]
    raise ConfigError(
        f"{where}: unknown checkpointing strategy {value!r}. Valid strategies: 'each' (every layer its own "
        "checkpoint), 'contiguous' (all layers of a pipeline stage in one), 'group_N' (N consecutive layers "
        "per checkpoint, e.g. 'group_2')."
    )


def groups(strategy: str, count: int) -> list[list[int]]:
    """The layer indices of each checkpoint, in order, for ``count`` layers."""
    if strategy == "each":
        size = 1
    elif strategy == "contiguous":
        size = max(count, 1)
    else:
        size = int(_GROUP.fullmatch(strategy).group(1))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]
