"""What PyTorch FSDP's arguments ask of jmp's layout, and the run's config changed to give it.

FSDP's arguments are config keys here: the sharding strategy chooses ``sharded_data_parallel_degree`` and
``reshard_after_forward``, ``MixedPrecision(param_dtype=...)`` chooses ``bf16`` / ``fp16`` (float32 master
parameters, as FSDP keeps its sharded parameters). When the run's config asks for something else, ``smp.init``
runs again with these keys changed and every other key kept, which says so once. After ``torch.sagemaker.init``
(``jmp.tsm``), SMP v2's rule holds: a ``hybrid_shard_degree`` of 2 or more is the shard degree whatever the
strategy; 0 leaves it to the strategy, ``HYBRID_SHARD`` then sharding within one host, as SMP v2 documents.

A process group or a ``DeviceMesh`` counts processes; jmp's degrees count devices: a group of ``n`` processes
spans ``n`` times the data-parallel devices each process drives (1 under torchrun's one process per GPU).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import torch
import torch.distributed as dist

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.fsdp.options import HYBRID, KEEP_GATHERED, MixedPrecision, ShardingStrategy
from jmp.runtime import mesh_state as state
from jmp.runtime import notices, process_groups
from jmp.runtime.config import Config
from jmp.tsm import initialization as v2_initialization

_HALVES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def log_once(message: str, *args: Any, level: int = logging.INFO) -> None:
    """Log ``message % args`` once per process."""
    text = message % args if args else message
    notices.log_once(f"fsdp:{text}", level, "%s", text)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one FSDP wrapper asks of the run's config (``where``: the call, for messages)."""

    strategy: ShardingStrategy
    shard_degree: int
    reshard_after_forward: bool | None  # None: leave the config's (nothing is split, nothing to reshard)
    half: torch.dtype | None  # the compute dtype of floating parameters; None: the module's own
    tp_degree: int | None = None  # a PyTorch TP plan's degree (jmp.fsdp.tensor_parallel_plans); None: the config's

    def config_keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = {
            "sharded_data_parallel_degree": self.shard_degree,
            "bf16": self.half is torch.bfloat16,
            "fp16": self.half is torch.float16,
            "fp16_params": False,
        }
        if self.reshard_after_forward is not None:
            keys["reshard_after_forward"] = self.reshard_after_forward
        if self.tp_degree is not None:
            keys["tensor_parallel_degree"] = self.tp_degree
        return keys


def request(
    strategy: ShardingStrategy | None,
    process_group: Any,
    device_mesh: Any,
    mixed_precision: MixedPrecision | None,
    where: str,
    tp_degree: int | None = None,
) -> Request:
    """The layout and precision ``FullyShardedDataParallel``'s arguments ask for, on the run's mesh (with
    ``tp_degree``: that tensor-parallel degree); an ``ArgumentTypeError`` for an argument of the wrong type, a
    ``ConfigError`` when the strategy's degree does not divide the data-parallel devices.
    """
    strategy = ShardingStrategy.FULL_SHARD if strategy is None else strategy
    if not isinstance(strategy, ShardingStrategy):
        raise ArgumentTypeError(f"{where}: sharding_strategy takes a ShardingStrategy, not {strategy!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ArgumentTypeError(f"{where}: mixed_precision takes a MixedPrecision, not {mixed_precision!r}")
    mesh = state.get_mesh()
    data_devices = mesh.shape["dp"] * mesh.shape["fsdp"]
    if tp_degree is not None:  # the devices left for data parallelism (smp.init checks the whole)
        data_devices = data_devices * mesh.shape["tp"] // tp_degree
    run = v2_initialization.current_run()
    v2_degree = None if run is None else run.hybrid_shard_degree  # 0: the sharding strategy decides
    if v2_degree is not None and v2_degree >= 2:  # SMP v2: its degree, under HYBRID_SHARD, whatever the script says
        if strategy not in HYBRID:
            log_once(
                "%s: torch.sagemaker's hybrid_shard_degree %d makes sharding_strategy=%s HYBRID_SHARD, as SMP v2 does",
                where,
                v2_degree,
                strategy.name,
            )
            strategy = ShardingStrategy.HYBRID_SHARD
        degree = v2_degree
    elif strategy is ShardingStrategy.NO_SHARD:
        degree = 1
    elif strategy in HYBRID:
        configured = mesh.shape["fsdp"] if v2_degree is None and mesh.shape["fsdp"] > 1 else None
        degree = _hybrid_degree(process_group, device_mesh, mesh, configured, where)
    else:
        group_size = _group_size(process_group, device_mesh)
        degree = data_devices if group_size is None else group_size * _devices_per_process(mesh, device_mesh)
    if degree < 1 or data_devices % degree:
        raise ConfigError(
            f"{where}: sharding over {degree} devices, but the {data_devices} data-parallel devices of the mesh "
            f"{dict(mesh.shape)} do not divide into groups of {degree}; choose a hybrid_shard_degree (or process "
            "groups) that divides them"
        )
    reshard = None if strategy is ShardingStrategy.NO_SHARD else strategy not in KEEP_GATHERED
    return Request(strategy, degree, reshard, _compute_dtype(mixed_precision, where), tp_degree)


def apply(wanted: Request, where: str) -> None:
    """Make the run's config what ``wanted`` asks: ``smp.init`` again with those keys changed, said once."""
    config = state.get_config()
    keys = wanted.config_keys()
    changed = {key: value for key, value in keys.items() if getattr(config, key) != value}
    if not changed:
        return
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    kept = {name: getattr(config, name) for name in defaults if getattr(config, name) != defaults[name]}
    new = {name: value for name, value in (kept | keys).items() if value != defaults[name]}
    mesh = state.get_mesh()
    devices = None if set(mesh.devices.flat) == set(jax.devices()) else sorted(mesh.devices.flat, key=lambda d: d.id)
    state.init(new, devices=devices)
    log_once(
        "%s: jmp re-initialised with %s (every other config key kept); the mesh is now %s",
        where,
        ", ".join(f"{key}={value!r} (was {getattr(config, key)!r})" for key, value in changed.items()),
        dict(state.get_mesh().shape),
    )


def shard_group(strategy: ShardingStrategy) -> dist.ProcessGroup:
    """FSDP's ``process_group`` for ``strategy``: the processes one parameter is split over (hybrid strategies),
    else all the data-parallel processes, as a ``torch.distributed`` group."""
    axes = ("fsdp",) if strategy in HYBRID else ("dp", "fsdp")
    return group_of(axes)


def group_of(axes: tuple[str, ...]) -> dist.ProcessGroup:
    """This process's group of the processes whose devices differ only along ``axes`` of the run's mesh."""
    return group_in(process_groups.partition_of(state.get_mesh(), axes))


def group_in(partition: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup:
    """This process's group of ``partition`` (each group made at the first call, in the same order everywhere, as
    ``dist.new_group`` requires)."""
    for members in partition:
        if members not in _groups:
            world = len(members) == dist.get_world_size()
            _groups[members] = dist.group.WORLD if world else dist.new_group(list(members))
    return _groups[next(m for m in partition if jax.process_index() in m)]


def _hybrid_degree(process_group: Any, device_mesh: Any, mesh: Any, configured: int | None, where: str) -> int:
    """The shard degree of a hybrid strategy: the shard group's (a ``(shard, replicate)`` group pair or a 2-D
    ``DeviceMesh``), else the ``hybrid_shard_degree`` the config gave (``configured``), else one host's devices
    (torch's default, and SMP v2's with ``hybrid_shard_degree`` 0: shard within a node, replicate across nodes)."""
    if isinstance(process_group, tuple):
        if len(process_group) != 2:
            raise ArgumentTypeError(f"{where}: hybrid sharding takes a (shard_group, replicate_group) group pair")
        return dist.get_world_size(process_group[0]) * _devices_per_process(mesh)
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise ArgumentTypeError(f"{where}: hybrid sharding takes a 2-D device_mesh (replicate, shard)")
        return device_mesh.size(1) * _devices_per_process(mesh, device_mesh)
    if configured is not None:
        return configured
    return min(_devices_per_process(mesh) * state.local_size(), mesh.shape["dp"] * mesh.shape["fsdp"])


def _group_size(process_group: Any, device_mesh: Any) -> int | None:
    """Processes in the one group a non-hybrid strategy shards over (None: every process, torch's default)."""
    if device_mesh is not None:
        return device_mesh.size()
    if process_group is None:
        return None
    if isinstance(process_group, tuple):
        raise ArgumentTypeError("a (shard_group, replicate_group) process_group pair is for hybrid sharding strategies")
    return dist.get_world_size(process_group)


def _devices_per_process(mesh: Any, device_mesh: Any = None) -> int:
    """The data-parallel devices one process drives (its devices of the mesh over its model-parallel degrees); 1
    for jmp's own ``DeviceMesh`` (``jmp.fsdp.device_mesh``), whose sizes count devices."""
    if getattr(device_mesh, "counts_devices", False):
        return 1
    mine = sum(device.process_index == jax.process_index() for device in mesh.devices.flat)
    others = mesh.shape["pp"] * mesh.shape["ep"] * mesh.shape["tp"]
    return max(1, mine // others)


def _compute_dtype(mixed_precision: MixedPrecision | None, where: str) -> torch.dtype | None:
    if mixed_precision is None or mixed_precision.param_dtype in (None, torch.float32):
        return None
    if mixed_precision.param_dtype not in _HALVES:
        raise ConfigError(
            f"{where}: MixedPrecision(param_dtype={mixed_precision.param_dtype}) is not a compute dtype jmp has; "
            "use torch.bfloat16, torch.float16 or torch.float32"
        )
    half = mixed_precision.param_dtype
    reduce = mixed_precision.reduce_dtype
    if reduce is not None and reduce != half:
        log_once(
            "%s: MixedPrecision(reduce_dtype=%s) is accepted: jmp reduces and keeps gradients in the compute dtype "
            "(%s) and the optimizer unscales them into float32 for the update",
            where,
            reduce,
            half,
        )
    if mixed_precision.buffer_dtype not in (None, torch.float32):
        log_once(
            "%s: MixedPrecision(buffer_dtype=%s) is accepted: buffers keep their own dtype, and the ops that use "
            "them run under the autocast lists (norms, softmax and rotary tables in float32)",
            where,
            mixed_precision.buffer_dtype,
        )
    return half
