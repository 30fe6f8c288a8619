"""Checkpointing strategies: how the layers of a container are grouped into checkpoints.

- ``"each"``: every layer is its own checkpoint; the backward pass keeps each layer's input and
  recomputes one layer at a time.
- ``"group_N"``: runs of N consecutive layers (the last run may be shorter) are one checkpoint each; only
  the input of each run is kept, and the backward pass recomputes N layers at a time.
- ``"contiguous"``: the whole container is one checkpoint: only its input is kept, and the backward pass
  recomputes all its layers at once (peak memory near that of no checkpointing; use it when layers are
  cheap to recompute and activations between them are what fills memory). SMP splits it into one run per
  pipeline stage; jmp does not: a checkpoint whose layers sit on more than one stage (``jmp.pipeline``)
  runs without checkpointing, with a warning (``remat/region.py``), so under pipeline parallelism prefer
  ``"each"`` or ``"group_N"`` with groups inside one stage.
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
