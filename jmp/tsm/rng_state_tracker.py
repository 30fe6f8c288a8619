"""``tsm.state.get_rng_state_tracker()``: Transformer Engine's RNG-states tracker, as SMP v2 hands it to TE's
``checkpoint`` (AWS's v2 scripts do with ``--fp8 1``).

On GPUs, TE forks a named CUDA RNG state around tensor-parallel regions, and its checkpoint restores that state
when it recomputes a forward, so the recomputed dropout masks are the first forward's. jmp draws every random
number from the compiled step's JAX key, and recomputes (``jax.checkpoint``) with the same keys, so the masks are
equal without a tracker. This one keeps TE's interface and bookkeeping: named seeds are added once, ``fork`` needs a
known name, and ``get_states`` / ``set_states`` round-trip them; it changes no random number.
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
