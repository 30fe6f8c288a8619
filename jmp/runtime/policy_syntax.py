"""How a remat policy is written: a preset name, activation names after a colon (checked by the config)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jmp.errors import ConfigError

INPUT = "input"  # the activation name of a checkpointed module's tensor inputs

PRESETS = {
    "full": "recompute everything inside the module; keep only its inputs (the default)",
    "save_matmuls": "keep matmul outputs, recompute the rest",
    "save_names": "keep the named activations ('save_names:attn,mlp'), recompute the rest",
    "offload_names": "move the named activations to host memory ('offload_names:attn'), recompute the rest",
}
_TAKES_NAMES = ("save_names", "offload_names")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """A preset and, for the name presets, the activation names it keeps or offloads."""

    preset: str
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.preset + (":" + ",".join(self.names) if self.names else "")


Policy = RematPolicy | Callable[..., Any]  # a preset, or any jax.checkpoint_policies policy


def parse_policy(value: Any, where: str) -> Policy:
    """``value`` (a preset string, a ``RematPolicy``, or a jax policy function) checked; ``where`` names its origin."""
    if isinstance(value, RematPolicy):
        value = str(value)
    elif callable(value):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}: a remat policy is a preset name or a jax.checkpoint_policies policy, not {value!r}"
        )
    preset, _, listed = value.partition(":")
    preset = preset.strip()
    names = tuple(n.strip() for n in listed.split(",") if n.strip())
    if preset not in PRESETS:
        valid = "; ".join(f"'{name}': {meaning}" for name, meaning in PRESETS.items())
        raise ConfigError(f"{where}: unknown remat policy '{preset}'. Valid policies: {valid}.")
    if preset in _TAKES_NAMES and not names:
        raise ConfigError(f"{where}: policy '{preset}' needs activation names, e.g. '{preset}:attn,mlp'")
    if preset not in _TAKES_NAMES and names:
        raise ConfigError(f"{where}: policy '{preset}' takes no activation names; use 'save_names:...' for that")
    return RematPolicy(preset, names)
