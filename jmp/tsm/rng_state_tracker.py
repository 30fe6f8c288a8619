"""``tsm.state.get_rng_state_tracker()``: Transformer Engine's RNG-states tracker interface, changing no random number.

jmp's recomputation replays the step's JAX keys, so dropout masks match without a tracker; this keeps TE's
bookkeeping (named seeds added once, ``fork`` of a known name, ``get_states`` / ``set_states``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jmp.errors import JmpError

MODEL_PARALLEL_RNG = "model-parallel-rng"  # TE's default state name


class RngStatesTracker:
    """TE's ``CudaRNGStatesTracker`` interface over jmp's keyed random numbers."""

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        self._seeds.clear()

    def get_states(self) -> dict[str, int]:
        return dict(self._seeds)

    def set_states(self, states: dict[str, int]) -> None:
        self._seeds = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self._seeds:
            raise JmpError(f"RNG state {name!r} already exists (TE's tracker adds a name once)")
        self._seeds[name] = int(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """TE forks the named state for a region; jmp's draws inside it come from the step's key as elsewhere."""
        if name not in self._seeds:
            raise JmpError(f"RNG state {name!r} was never added (add(name, seed) first, as with TE's tracker)")
        yield


TRACKER = RngStatesTracker()
