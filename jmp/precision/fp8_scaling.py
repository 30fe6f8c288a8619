"""FP8 delayed scaling as Transformer Engine's ``DelayedScaling`` recipe defines it: the recipe and its arithmetic.

Each fp8 tensor (a Linear's input, weight, output gradient) has a per-tensor ``scale`` and an amax history (most
recent first). A use quantises with the current scale (``x * scale``, saturated to the format's largest value,
cast), records the tensor's amax at the front of the history, and the next scale is
``(fp8_max / amax) / 2**margin``, where amax is the history's maximum (``amax_compute_algo="max"``) or its newest
entry (``"most_recent"``); a zero or non-finite amax keeps the old scale. The scale a step uses was computed from
the amaxes of earlier steps, as in Transformer Engine (``nvte_delayed_scaling_recipe_amax_and_scale_update``).
Formats: ``"hybrid"`` (TE's ``Format.HYBRID``: E4M3 forward, E5M2 gradients) and ``"e4m3"`` (E4M3 for both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """TE's ``DelayedScaling`` recipe (its defaults: HYBRID, history 1024, "max", margin 0)."""

    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    @property
    def forward_dtype(self) -> Any:
        return jnp.float8_e4m3fn

    @property
    def gradient_dtype(self) -> Any:
        return jnp.float8_e5m2 if self.fp8_format == "hybrid" else jnp.float8_e4m3fn

    @classmethod
    def from_config(cls, config: Any) -> DelayedScaling | None:
        """The recipe a validated ``Config`` asks for, or None when ``fp8`` is off."""
        if not config.fp8:
            return None
        return cls(config.fp8_format, config.fp8_amax_history_len, config.fp8_amax_compute_algo, config.fp8_margin)


def fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def quantise(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` in float32, saturated to the format's range (XLA's cast would give NaN), cast to ``dtype``."""
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of ``x``, as float32 (over the whole global array: sharded, XLA all-reduces it)."""
    return jnp.max(jnp.abs(jax.lax.stop_gradient(x))).astype(jnp.float32)


def updated(recipe: DelayedScaling, dtype: Any, scale: jax.Array, history: jax.Array, new_amax: jax.Array):
    """(next scale, history) once ``new_amax`` is recorded: the history shifted by one, ``new_amax`` first."""
    history = jnp.concatenate([new_amax[None].astype(history.dtype), history[:-1]])
    current = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    candidate = (fp8_max(dtype) / current) / (2.0**recipe.margin)
    usable = (current > 0.0) & jnp.isfinite(current)
    return jnp.where(usable, candidate, scale).astype(scale.dtype), history
