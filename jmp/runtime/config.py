"""The smp-style configuration: keys, defaults, aliases and validation.

Every SMP v1 and v2 key is accepted with SMP's meaning: ``Config``'s fields are the keys with their defaults,
``ALIASES`` SMP's other names. An unknown key or a bad value raises ``ConfigError`` naming the key; keys with
no effect in jmp are logged once (``config_no_effect``). A default that differs from SMP's says so beside its field.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections.abc import Callable
from typing import Any

from jmp.errors import ConfigError
from jmp.runtime.policy_syntax import parse_policy

ALIASES = {
    "partitions": "pipeline_parallel_degree",
    "hybrid_shard_degree": "sharded_data_parallel_degree",  # v2
    "sm_activation_offloading": "offload_activations",  # v2
}
PLACEMENTS = ("cluster", "spread") + tuple("".join(p) for p in itertools.permutations("DPT"))


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated configuration. Degrees not given are 1; the data-parallel degree is what remains."""

    # parallelism
    pipeline_parallel_degree: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    auto_partition: bool = True
    default_partition: int | None = None
    active_microbatches: int | None = None  # caps the pipeline's in-flight microbatches (jmp.pipeline.schedule)
    pipeline_recompute: bool = False  # jmp: a stage's backward reruns its forward instead of keeping residuals
    tensor_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_capacity_factor: float | None = None  # jmp: None sends every token to its experts (none dropped)
    context_parallel_degree: int = 1  # v2: the mesh's "cp" axis splits each sequence (jmp.compiled_step.microbatches)
    sharded_data_parallel_degree: int = 1  # SMP v2: 0, all data-parallel devices (resolved by smp.init)
    ddp: bool = False
    placement_strategy: str = "cluster"  # or a permutation of "DPT" (last letter varies fastest)
    optimize: str = "speed"
    memory_weight: float = 0.8
    prescaled_batch: bool = False
    # sharded data parallelism
    sdp_param_persistence_threshold: int = 1024  # elements (SMP: 1_000_000): every weight matrix is split
    sdp_gradient_clipping: float | None = None  # SMP: 1.0; given, DistributedOptimizer.step clips to it under fsdp
    sdp_reduce_bucket_size: int = 500_000_000
    sdp_max_live_parameters: int = 1_000_000_000
    sdp_hierarchical_allgather: bool = True
    reshard_after_forward: bool = True  # jmp (PyTorch FSDP's name): a layer's gathered weights are freed after it
    shard_optimizer_state: bool = False
    allow_empty_shards: bool = False  # v2
    fsdp_cache_flush_warnings: bool = True  # v2
    # precision, memory, initialisation
    fp16: bool = False
    fp16_params: bool = False  # trains as fp16 does (float32 masters either way)
    bf16: bool = False
    # FP8 Linear matmuls with Transformer Engine's DelayedScaling recipe and its defaults (jmp.precision.fp8_scaling)
    fp8: bool = False
    fp8_format: str = "hybrid"  # TE's Format.HYBRID: E4M3 forward, E5M2 gradients; "e4m3": E4M3 for both
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"  # or "most_recent"
    fp8_margin: int = 0
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    activation_checkpointing_policy: str = "full"  # jmp: the remat policy of checkpointed modules (see jmp.remat)
    delayed_parameter_initialization: bool = False
    random_seed: int = 0x12345678
    compilation_cache: bool = True  # jmp: JAX's persistent compilation cache (see jmp.runtime.compilation_cache)
    scan_layers: bool = True  # jmp: repeated identical layers compile once, as one scan (see jmp.stacks)
    # jmp: the update as Pallas kernels (jmp.optim.kernels) if True (interpreted off a GPU); None / False: XLA's fusion
    # of the optax update, as fast on an H100 without the kernels' minute of Triton compiling (jmp.optim.fused_path)
    fused_optimizer: bool | None = None
    # runtime details of SMP's own engine (no effect here)
    horovod: bool = False
    ddp_port: int | None = None
    ddp_dist_backend: str = "auto"
    contiguous: bool = True
    deterministic_server: bool = False
    skip_tracing: bool = False
    static_mode: bool = False
    fast_mode: bool = False
    predefined_hooks: bool = True
    load_partition: bool = False

    @property
    def model_parallel_degree(self) -> int:
        """Devices one model replica needs: pipeline x sharded-data x expert x tensor x context."""
        return (
            self.context_parallel_degree
            * self.pipeline_parallel_degree
            * self.sharded_data_parallel_degree
            * self.expert_parallel_degree
            * self.tensor_parallel_degree
        )


KEYS = tuple(field.name for field in dataclasses.fields(Config))


def parse(config: dict[str, Any] | None, source: str | None = None) -> Config:
    """Validate an smp config dict (None or {} gives the defaults); ``source`` names where it came from."""
    try:
        return _parse(config)
    except ConfigError as error:
        if source is None:
            raise
        raise ConfigError(f"{error} (the config came from {source})") from None


def _parse(config: dict[str, Any] | None) -> Config:
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
        values[name] = _CHECKS[name](key, value) if name in _CHECKS else value
    if values.get("fp16_params"):
        values["fp16"] = True  # SMP v1: fp16 parameters for fp16 training; masters stay float32 here
    parsed = Config(**values)
    _check_combination(parsed)
    return parsed


def _check_combination(parsed: Config) -> None:
    if parsed.fp16 and parsed.bf16:
        raise ConfigError("config keys 'fp16' (or 'fp16_params') and 'bf16' are both True; choose one")
    if not parsed.auto_partition and parsed.default_partition is None:
        raise ConfigError("'auto_partition': False needs 'default_partition' (the stage for unplaced modules)")
    if parsed.default_partition is not None and not 0 <= parsed.default_partition < parsed.pipeline_parallel_degree:
        raise ConfigError(
            f"'default_partition' is {parsed.default_partition}, but stages are numbered 0.."
            f"{parsed.pipeline_parallel_degree - 1} (pipeline_parallel_degree={parsed.pipeline_parallel_degree})"
        )
    if parsed.fp8 and parsed.pipeline_parallel_degree > 1:
        raise ConfigError(
            "'fp8' is True with 'pipeline_parallel_degree' > 1: jmp's fp8 does not run inside a pipeline yet; "
            "train in fp8 without pipeline parallelism, or use 'bf16' with it"
        )


def _unknown_key_message(key: str) -> str:
    candidates = list(KEYS) + list(ALIASES)
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'.{hint} Valid keys: {', '.join(sorted(candidates))}."


# Value checks, one per key: each takes (key as given, value) and returns the value to store.


def _integer(low: int, what: str) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        # SMP's documented sizes are written 5e8 / 1e6: an integral float is an integer here
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"config key '{key}' must be {what}, not {value!r}")
        return value

    return check


def _number(low: float, high: float, what: str) -> Callable[[str, Any], float]:
    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ConfigError(f"config key '{key}' must be {what}, not {value!r}")
        return value

    return check


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda key, value: None if value is None else check(key, value)


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' must be True or False, not {value!r}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in options:
            raise ConfigError(f"config key '{key}' must be one of {options}, not {value!r}")
        return value

    return check


def _policy(key: str, value: Any) -> Any:
    parse_policy(value, f"config key '{key}'")
    return value


_POSITIVE = _integer(1, "a positive integer")
_COUNT = _integer(0, "a non-negative integer")
_BOOLEANS = (
    "auto_partition ddp prescaled_batch sdp_hierarchical_allgather shard_optimizer_state allow_empty_shards "
    "fsdp_cache_flush_warnings fp16 fp16_params bf16 offload_activations delayed_parameter_initialization horovod "
    "contiguous deterministic_server skip_tracing static_mode fast_mode predefined_hooks load_partition "
    "compilation_cache reshard_after_forward pipeline_recompute fp8 scan_layers"
).split()
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(_BOOLEANS, _boolean),
    **dict.fromkeys(
        "pipeline_parallel_degree microbatches tensor_parallel_degree expert_parallel_degree context_parallel_degree "
        "activation_loading_horizon sdp_reduce_bucket_size sdp_max_live_parameters fp8_amax_history_len".split(),
        _POSITIVE,
    ),
    "fp8_margin": _COUNT,
    "fp8_format": _choice(("hybrid", "e4m3")),
    "fp8_amax_compute_algo": _choice(("max", "most_recent")),
    "sharded_data_parallel_degree": _integer(0, "a positive integer, or 0 for all data-parallel devices"),
    "sdp_param_persistence_threshold": _COUNT,
    "random_seed": _COUNT,
    "fused_optimizer": _optional(_boolean),
    "active_microbatches": _optional(_POSITIVE),
    "ddp_port": _optional(_integer(1, "a port number")),
    "default_partition": _optional(_integer(-(2**31), "a stage number")),
    "memory_weight": _number(0.0, 1.0, "a number in [0, 1]"),
    "sdp_gradient_clipping": _optional(_number(0.0, float("inf"), "a non-negative number (0: no clipping)")),
    "expert_capacity_factor": _optional(_number(1e-9, float("inf"), "a positive number or None")),
    "pipeline": _choice(("interleaved", "simple")),
    "optimize": _choice(("speed", "memory")),
    "placement_strategy": _choice(PLACEMENTS),
    "ddp_dist_backend": _choice(("auto", "nccl", "gloo")),
    "activation_checkpointing_policy": _policy,
}
assert set(_CHECKS) == set(KEYS), set(KEYS) ^ set(_CHECKS)
