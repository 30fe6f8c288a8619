"""The smp-style configuration: keys, defaults, aliases and validation.

Keys follow SageMaker model parallelism (v1 plus the v2 keys), with SMP's
meaning; the fields of ``Config`` are the keys jmp accepts, with their defaults,
and ``ALIASES`` SMP's other names for some of them. A bad key or value raises
``ConfigError`` naming the key and what to do.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from jmp.errors import ConfigError
from jmp.remat_policy import parse_policy

ALIASES = {"partitions": "pipeline_parallel_degree", "hybrid_shard_degree": "sharded_data_parallel_degree"}


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated configuration. Degrees not given are 1; the data-parallel degree is what remains."""

    pipeline_parallel_degree: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    auto_partition: bool = True
    default_partition: int | None = None
    tensor_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_capacity_factor: float | None = None  # jmp: None sends every token to its experts (none dropped)
    sharded_data_parallel_degree: int = 1
    ddp: bool = False
    placement_strategy: str = "cluster"
    optimize: str = "speed"
    memory_weight: float = 0.8
    fp16: bool = False
    bf16: bool = False
    shard_optimizer_state: bool = False
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    activation_checkpointing_policy: str = "full"  # jmp: the remat policy of checkpointed modules (see jmp.remat)
    delayed_parameter_initialization: bool = False
    prescaled_batch: bool = False
    random_seed: int = 0x12345678

    @property
    def model_parallel_degree(self) -> int:
        """Devices one model replica needs: pipeline x sharded-data x expert x tensor."""
        return (
            self.pipeline_parallel_degree
            * self.sharded_data_parallel_degree
            * self.expert_parallel_degree
            * self.tensor_parallel_degree
        )


KEYS = tuple(field.name for field in dataclasses.fields(Config))
_POSITIVE_INTS = (
    "pipeline_parallel_degree",
    "microbatches",
    "tensor_parallel_degree",
    "expert_parallel_degree",
    "sharded_data_parallel_degree",
    "activation_loading_horizon",
)
_BOOLS = (
    "auto_partition",
    "ddp",
    "fp16",
    "bf16",
    "shard_optimizer_state",
    "offload_activations",
    "delayed_parameter_initialization",
    "prescaled_batch",
)
_CHOICES = {
    "pipeline": ("interleaved", "simple"),
    "optimize": ("speed", "memory"),
    "placement_strategy": ("cluster", "spread"),
}


def parse(config: dict[str, Any] | None) -> Config:
    """Validate an smp config dict (None or {} gives the defaults)."""
    if config is None:
        return Config()
    if not isinstance(config, dict):
        raise ConfigError(f"the config must be a dict of smp keys, not a {type(config).__name__}")
    values: dict[str, Any] = {}
    for key, value in config.items():
        name = ALIASES.get(key, key)
        if name not in KEYS:
            raise ConfigError(_unknown_key_message(key))
        if name in values:
            raise ConfigError(f"config key '{name}' is given twice (once through its alias '{key}')")
        values[name] = value
    for name, value in values.items():
        _check_value(name, value)
    parsed = Config(**values)
    if parsed.fp16 and parsed.bf16:
        raise ConfigError("config keys 'fp16' and 'bf16' are both True; choose one mixed-precision type")
    if not parsed.auto_partition and parsed.default_partition is None:
        raise ConfigError("'auto_partition': False needs 'default_partition' (the stage for unplaced modules)")
    if parsed.default_partition is not None and not 0 <= parsed.default_partition < parsed.pipeline_parallel_degree:
        raise ConfigError(
            f"'default_partition' is {parsed.default_partition}, but stages are numbered 0.."
            f"{parsed.pipeline_parallel_degree - 1} (pipeline_parallel_degree={parsed.pipeline_parallel_degree})"
        )
    return parsed


def _unknown_key_message(key: str) -> str:
    candidates = list(KEYS) + list(ALIASES)
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'.{hint} Valid keys: {', '.join(sorted(candidates))}."


def _check_value(name: str, value: Any) -> None:
    if name in _POSITIVE_INTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config key '{name}' must be a positive integer, not {value!r}")
    elif name in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{name}' must be True or False, not {value!r}")
    elif name in _CHOICES:
        if value not in _CHOICES[name]:
            raise ConfigError(f"config key '{name}' must be one of {_CHOICES[name]}, not {value!r}")
    elif name == "default_partition":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"config key 'default_partition' must be a stage number, not {value!r}")
    elif name == "memory_weight":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"config key 'memory_weight' must be a number in [0, 1], not {value!r}")
    elif name == "expert_capacity_factor":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"config key 'expert_capacity_factor' must be a positive number or None, not {value!r}")
    elif name == "activation_checkpointing_policy":
        parse_policy(value, "config key 'activation_checkpointing_policy'")
    elif name == "random_seed":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config key 'random_seed' must be a non-negative integer, not {value!r}")
