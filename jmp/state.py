"""``smp.init``: the one mesh of a run, and the rank helpers.

jmp is single-controller: one JAX process drives all of its host's devices and
a multi-host run has one process per host (``jax.distributed``). SMP's ranks
counted processes, each owning one GPU; here a rank helper counts *processes*
along its parallelism axes, so the seed scripts' data sharding
(``if smp.dp_size() > 1: dataset = shard(smp.dp_rank())``) stays right: one
process loads the global batch and ``@smp.step`` splits it over the devices.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jmp import config_no_effect, sagemaker_config
from jmp.config import ALIASES, Config, parse
from jmp.errors import ConfigError, JmpError

AXES = ("pp", "dp", "fsdp", "ep", "tp")
DATA_AXES = ("dp", "fsdp", "ep")  # the batch is split over these (experts take tokens from all)
MODEL_AXES = ("pp", "ep", "tp")

logger = logging.getLogger("jmp")

_config: Config | None = None
_mesh: Mesh | None = None


def init(config: dict[str, Any] | None = None, *, devices: list | None = None) -> None:
    """Validate ``config``, start JAX's multi-process runtime if launched as one of several, build the mesh.

    Call it once, before building models. Calling it again replaces the configuration and mesh; a
    ``DistributedModel`` built under another config or mesh then refuses to run.

    Args:
        config: an smp config dict (SMP v1 and v2 keys, see ``jmp.config``), used as is: ``{}`` gives the
            defaults. None (or no argument) reads what SageMaker passes the process, as SMP does: the JSON
            in ``SM_HP_MP_PARAMETERS`` (see ``jmp.sagemaker_config``), else the defaults.
        devices: a jmp extension: the devices to run on (default: all of ``jax.devices()``).

    Raises:
        ConfigError: an unknown key or a bad value (naming the environment variable when the config came
            from one), or model-parallel degrees whose product does not divide the number of devices.
    """
    global _config, _mesh
    source = None
    if config is None:
        config, source = sagemaker_config.from_environment()
        if source is not None:
            logger.info("smp.init(): the config comes from %s: %s", source, config)
    parsed = parse(config, source)
    config_no_effect.log_once(ALIASES.get(key, key) for key in config or {})
    _start_distributed_runtime()
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if parsed.sharded_data_parallel_degree == 0:  # SMP v2's hybrid_shard_degree 0: all data-parallel devices
        others = parsed.pipeline_parallel_degree * parsed.expert_parallel_degree * parsed.tensor_parallel_degree
        parsed = dataclasses.replace(parsed, sharded_data_parallel_degree=max(1, count // others))
    model = parsed.model_parallel_degree
    if count % model:
        raise ConfigError(
            f"pipeline_parallel_degree ({parsed.pipeline_parallel_degree}) x sharded_data_parallel_degree "
            f"({parsed.sharded_data_parallel_degree}) x expert_parallel_degree ({parsed.expert_parallel_degree}) "
            f"x tensor_parallel_degree ({parsed.tensor_parallel_degree}) = {model} does not divide the {count} "
            "devices; choose degrees whose product divides the device count (data parallelism takes the rest)."
        )
    shape = {
        "pp": parsed.pipeline_parallel_degree,
        "dp": count // model,
        "fsdp": parsed.sharded_data_parallel_degree,
        "ep": parsed.expert_parallel_degree,
        "tp": parsed.tensor_parallel_degree,
    }
    _config, _mesh = parsed, _build_mesh(shape, devices, parsed.placement_strategy)


# SMP's placement letters: D (data parallelism; here dp, fsdp and ep, which split the batch), P, T.
_LETTER_AXES = {"D": ("dp", "fsdp", "ep"), "P": ("pp",), "T": ("tp",)}
_NAMED_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}  # as SMP documents them


def _build_mesh(shape: dict[str, int], devices: list, placement: str) -> Mesh:
    """Lay devices out in ``placement``'s axis order, the last letter varying fastest (SMP's meaning).

    'cluster' ("DPT"): a model replica's pipeline and tensor-parallel devices are neighbours;
    'spread' ("TPD"): data-parallel peers are. Within D, ``ep`` then ``fsdp`` vary fastest (their
    collectives are the heaviest of the data axes).
    """
    letters = _NAMED_PLACEMENTS.get(placement, placement)
    order = tuple(axis for letter in letters for axis in _LETTER_AXES[letter])
    laid_out = jax.make_mesh(
        tuple(shape[a] for a in order), order, axis_types=(AxisType.Auto,) * len(order), devices=devices
    )
    grid = np.transpose(laid_out.devices, [order.index(a) for a in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _start_distributed_runtime() -> None:
    """Call ``jax.distributed.initialize`` when this process was launched as one of several."""
    if jax.distributed.is_initialized():
        return
    env = os.environ
    if (
        env.get("JAX_COORDINATOR_ADDRESS")
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    ):
        jax.distributed.initialize()  # JAX detects the cluster from the environment
    elif int(env.get("WORLD_SIZE", "1")) > 1 and env.get("MASTER_ADDR"):  # torchrun-style launch
        port = int(env.get("MASTER_PORT", "29500")) + 1  # the torch port may be taken by the launcher
        jax.distributed.initialize(
            coordinator_address=f"{env['MASTER_ADDR']}:{port}",
            num_processes=int(env["WORLD_SIZE"]),
            process_id=int(env.get("RANK", "0")),
        )


def is_initialized() -> bool:
    return _mesh is not None


def get_mesh() -> Mesh:
    """The run's mesh, axes ("pp", "dp", "fsdp", "ep", "tp")."""
    if _mesh is None:
        raise JmpError("jmp is not initialized: call smp.init(config) first")
    return _mesh


def get_config() -> Config:
    if _config is None:
        raise JmpError("jmp is not initialized: call smp.init(config) first")
    return _config


def _process_group(axes: tuple[str, ...]) -> tuple[int, int]:
    """(rank, size) of this process among the processes that differ along ``axes``.

    Two processes share a rank when their devices hold the same coordinates on
    ``axes`` (they are each other's peers on the other axes).
    """
    mesh = get_mesh()
    index = [AXES.index(a) for a in axes]
    coordinates: dict[int, set] = {}
    for position, device in np.ndenumerate(mesh.devices):
        coordinates.setdefault(device.process_index, set()).add(tuple(position[i] for i in index))
    groups = sorted({frozenset(c) for c in coordinates.values()}, key=sorted)
    mine = frozenset(coordinates[jax.process_index()])
    return groups.index(mine), len(groups)


def rank() -> int:
    """This process's index among all processes (``jax.process_index()``)."""
    return jax.process_index()


def size() -> int:
    """The number of processes (``jax.process_count()``); each drives all devices of its host."""
    return jax.process_count()


def local_rank() -> int:
    """This process's index on its host: 0 with one process per host, else the launcher's LOCAL_RANK."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_size() -> int:
    """Processes on this host: 1 with one process per host, else the launcher's LOCAL_WORLD_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def dp_rank() -> int:
    """Which data shard this process loads: its rank among processes holding different batch slices."""
    return _process_group(DATA_AXES)[0]


def dp_size() -> int:
    """How many data shards the processes load (1 on one host: the step splits the batch over devices)."""
    return _process_group(DATA_AXES)[1]


def rdp_rank() -> int:
    """The reduced-data-parallel rank. Tensor parallelism does not split the batch here, so it equals dp_rank."""
    return dp_rank()


def rdp_size() -> int:
    """The reduced-data-parallel size; equals dp_size (see rdp_rank)."""
    return dp_size()


def tp_rank() -> int:
    """This process's rank among processes holding different tensor-parallel slices."""
    return _process_group(("tp",))[0]


def tp_size() -> int:
    return _process_group(("tp",))[1]


def pp_rank() -> int:
    """This process's rank among processes holding different pipeline stages."""
    return _process_group(("pp",))[0]


def pp_size() -> int:
    return _process_group(("pp",))[1]


def mp_rank() -> int:
    """This process's rank among the processes of one model replica (pipeline, expert and tensor axes)."""
    return _process_group(MODEL_AXES)[0]


def mp_size() -> int:
    return _process_group(MODEL_AXES)[1]
