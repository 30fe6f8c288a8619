"""``smp.init``: the one mesh of a run, and the rank helpers.

One JAX process drives several devices (SMP had one process per GPU). The model-parallel sizes are the degrees,
as in SMP; the data helpers count processes: ``dp_size()`` / ``dp_rank()`` say how many shares of the data the
processes load and which one this process loads (a process passes its share and ``@smp.step`` splits it over
its devices). Processes holding different tensor-parallel slices load different data unless ``prescaled_batch``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from jmp.errors import ConfigError, JmpError
from jmp.runtime import compilation_cache as compilation
from jmp.runtime import (
    config_no_effect,
    host_memory,
    host_threads,
    process_groups,
    programs_in_flight,
    rank_zero_logging,
    sagemaker_config,
    step_boundary,
)
from jmp.runtime.config import ALIASES, Config, parse

AXES = ("pp", "dp", "fsdp", "ep", "tp")
CONTEXT_AXIS = "cp"  # in the mesh only when context_parallel_degree > 1 (before "tp"): a cp = 1 mesh is unchanged
DATA_AXES = ("dp", "fsdp", "ep")  # the batch is split over these (experts take tokens from all)
MODEL_AXES = ("pp", "ep", "tp")

logger = logging.getLogger("jmp")

_config: Config | None = None
_mesh: Mesh | None = None


def init(config: dict[str, Any] | None = None, *, devices: list | None = None) -> None:
    """Validate ``config``, start JAX's multi-process runtime if launched as one of several, build the mesh.

    Calling it again replaces config and mesh (models built under the old ones then refuse to run). ``config``:
    an smp config dict (``{}``: the defaults); None reads SageMaker's environment (``sagemaker_config``).
    ``devices`` (jmp's): the devices to run on (default all). Raises ``ConfigError`` for an unknown key, a bad
    value, or degrees whose product does not divide the number of devices.
    """
    global _config, _mesh
    rank_zero_logging.install()
    source = None
    if config is None:
        config, source = sagemaker_config.from_environment()
        if source is not None:
            logger.info("smp.init(): the config comes from %s: %s", source, config)
    parsed = parse(config, source)
    config_no_effect.log_once(ALIASES.get(key, key) for key in config or {})
    compilation.configure_cache(parsed.compilation_cache)
    host_threads.reserve()
    host_memory.one_heap()
    _mark_startup("connecting")
    _start_distributed_runtime()
    if jax.process_count() > 1:
        _exit_on_uncaught()  # from here on: an error in process_groups.start (its store's port taken) ends it too
        _exit_without_collecting()
    check_same_on_every_process("the smp config", repr(parsed))  # the first collective: gloo connects here on CPU
    _mark_startup("connected")
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if parsed.sharded_data_parallel_degree == 0:  # SMP v2's hybrid_shard_degree 0: all data-parallel devices
        others = (
            parsed.pipeline_parallel_degree
            * parsed.expert_parallel_degree
            * parsed.tensor_parallel_degree
            * parsed.context_parallel_degree
        )
        parsed = dataclasses.replace(parsed, sharded_data_parallel_degree=max(1, count // others))
    model = parsed.model_parallel_degree
    if count % model:
        raise ConfigError(
            f"pipeline_parallel_degree ({parsed.pipeline_parallel_degree}) x sharded_data_parallel_degree "
            f"({parsed.sharded_data_parallel_degree}) x expert_parallel_degree ({parsed.expert_parallel_degree}) "
            f"x tensor_parallel_degree ({parsed.tensor_parallel_degree}) x context_parallel_degree "
            f"({parsed.context_parallel_degree}) = {model} does not divide the {count} "
            "devices; choose degrees whose product divides the device count (data parallelism takes the rest)."
        )
    shape = {
        "pp": parsed.pipeline_parallel_degree,
        "dp": count // model,
        "fsdp": parsed.sharded_data_parallel_degree,
        "ep": parsed.expert_parallel_degree,
        "tp": parsed.tensor_parallel_degree,
    }
    if parsed.context_parallel_degree > 1:
        shape = {**{a: shape[a] for a in AXES[:-1]}, CONTEXT_AXIS: parsed.context_parallel_degree, "tp": shape["tp"]}
    mesh = _build_mesh(shape, devices, parsed.placement_strategy)
    if parsed.context_parallel_degree > 1:
        _check_sequences_within_processes(mesh, parsed.context_parallel_degree)
    _config, _mesh = parsed, mesh
    process_groups.start(_mesh, GROUP_AXES)
    if devices[0].platform == "cpu":
        host_memory.keep_freed_memory()
    queues_on_threads = devices[0].platform == "cpu" and count > 1  # XLA:CPU deadlocks on a long queue
    programs_in_flight.bound(programs_in_flight.cpu_limit() if queues_on_threads else 0)
    if jax.process_count() > 1:
        _exit_on_uncaught()  # again: torch.distributed's hook, installed by process_groups.start, wraps the first


@contextlib.contextmanager
def using(config: dict[str, Any], devices: list | None = None) -> Iterator[None]:
    """Inside, the run's config and mesh are ``config``'s (as ``init(config, devices=devices)`` makes them); then
    they are restored."""
    global _config, _mesh
    saved = _config, _mesh
    try:
        init(config, devices=devices)
        yield
    finally:
        _config, _mesh = saved
        if _mesh is not None:
            process_groups.start(_mesh, GROUP_AXES)  # the groups made before are kept: no new ones here
            compilation.configure_cache(_config.compilation_cache)


# SMP's placement letters: D (data parallelism; here dp, fsdp and ep, which split the batch), P, T.
_LETTER_AXES = {"D": ("dp", "fsdp", "ep"), "P": ("pp",), "T": (CONTEXT_AXIS, "tp")}
_NAMED_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}  # as SMP documents them


def _build_mesh(shape: dict[str, int], devices: list, placement: str) -> Mesh:
    """Lay devices out in ``placement``'s axis order, the last letter varying fastest (SMP's meaning).

    'cluster' ("DPT") makes a replica's pipeline and tensor devices neighbours, 'spread' ("TPD") data peers; in D,
    ``ep`` then ``fsdp`` vary fastest, and ``cp`` sits with ``tp`` in T (``tp`` fastest).
    """
    letters = _NAMED_PLACEMENTS.get(placement, placement)
    order = tuple(axis for letter in letters for axis in _LETTER_AXES[letter] if axis in shape)
    laid_out = jax.make_mesh(
        tuple(shape[a] for a in order), order, axis_types=(AxisType.Auto,) * len(order), devices=devices
    )
    axes = tuple(shape)
    grid = np.transpose(laid_out.devices, [order.index(a) for a in axes])
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


step_boundary.after_each_step(programs_in_flight.admit_update)


def _check_sequences_within_processes(mesh: Mesh, degree: int) -> None:
    """The devices a sequence is split over ("cp") must be one process's: each process passes whole sequences."""
    cp = mesh.axis_names.index(CONTEXT_AXIS)
    groups = np.moveaxis(mesh.devices, cp, -1).reshape(-1, degree)
    if any(len({device.process_index for device in group}) > 1 for group in groups):
        raise ConfigError(
            f"'context_parallel_degree' is {degree}, but the devices a sequence is split over belong to several "
            f"of the {jax.process_count()} processes ({jax.local_device_count()} devices each): each process "
            "passes whole sequences, split over its own devices. Keep context_parallel_degree x "
            "tensor_parallel_degree at most the devices per process with placement_strategy 'cluster', or run "
            "fewer processes"
        )


STARTUP_FILE = "JMP_STARTUP_FILE"  # set by python -m jmp.launch, which retries a start-up that failed


def _mark_startup(stage: str) -> None:
    """Tell ``python -m jmp.launch`` how far this process's start-up got: one that fails while "connecting" (JAX's
    coordinator or gloo timing out on a loaded machine) failed to start, and the launcher starts the run again."""
    if path := os.environ.get(STARTUP_FILE):
        with open(path, "w") as file:
            file.write(stage)


def _start_distributed_runtime() -> None:
    """Call ``jax.distributed.initialize`` when this process was launched as one of several.

    Reads JAX's, SLURM's, Open MPI's and torchrun's variables; ``JMP_INIT_TIMEOUT`` (120 s) and
    ``JMP_HEARTBEAT_TIMEOUT`` (60 s) bound a peer's joining and silence.
    """
    if jax.distributed.is_initialized():
        return
    env = os.environ
    timeouts = {
        "initialization_timeout": int(env.get("JMP_INIT_TIMEOUT", "120")),
        "heartbeat_timeout_seconds": int(env.get("JMP_HEARTBEAT_TIMEOUT", "60")),
    }
    if env.get("JAX_COORDINATOR_ADDRESS") and env.get("JAX_NUM_PROCESSES"):
        arguments = {
            "coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
            "num_processes": int(env["JAX_NUM_PROCESSES"]),
            "process_id": int(env.get("JAX_PROCESS_ID", "0")),
        }
    elif int(env.get("WORLD_SIZE", "1")) > 1 and env.get("MASTER_ADDR"):  # torchrun or jmp.launch, even in SLURM
        port = int(env.get("MASTER_PORT", "29500")) + 1  # the torch port may be taken by the launcher
        arguments = {
            "coordinator_address": f"{env['MASTER_ADDR']}:{port}",
            "num_processes": int(env["WORLD_SIZE"]),
            "process_id": int(env.get("RANK", "0")),
        }
    elif (
        env.get("JAX_COORDINATOR_ADDRESS")
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    ):
        arguments = {}  # JAX detects the cluster from the environment
    else:
        return
    # collectives between processes on CPU (tests, laptops) need an implementation; GPUs and TPUs bring theirs
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**arguments, **timeouts)
    except RuntimeError as error:
        if "before any JAX" in str(error) or "backend" in str(error).lower():
            raise ConfigError(
                "smp.init must start JAX's multi-process runtime before JAX is used: call smp.init() before "
                f"anything touches JAX devices or arrays ({error})"
            ) from error
        raise


def _exit_on_uncaught() -> None:
    """Make the excepthook report an uncaught error, then end the process at once.

    JAX's exit handler waits at a shutdown barrier for every process, so a failed process would hang its peers and
    hide the failure from the launcher. Installed once JAX is up and again once torch.distributed started, outside
    its hook (wrapped inside it, the exit lost the traceback); a hook of ours wrapped by another leaves the exit to it.
    """
    previous = sys.excepthook
    if getattr(previous, "jmp_exits", False):
        return

    def hook(kind: type, value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        outer = sys.excepthook
        if outer is not hook and getattr(outer, "jmp_exits", False):  # the outer one of ours exits
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    hook.jmp_exits = True
    sys.excepthook = hook


_exits_without_collecting = False


def _exit_without_collecting() -> None:
    """At exit, after the atexit handlers before it (JAX's barrier, Orbax's commits), ``gc.freeze()``.

    Python's final collections over torch's and JAX's millions of objects take seconds the peers wait for; frozen,
    they are freed by reference counts (cycles are not collected at exit).
    """
    global _exits_without_collecting
    if not _exits_without_collecting:
        atexit.register(gc.freeze)
        _exits_without_collecting = True


def check_same_on_every_process(what: str, description: str) -> None:
    """Raise on every process when ``description`` (of the config, a model) differs between processes, not hang."""
    if jax.process_count() == 1:
        return
    digest = np.uint32(zlib.crc32(description.encode()))
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    differing = [p for p, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise ConfigError(
            f"{what} differs between processes: processes {differing} have another than process 0; every "
            "process must run the same script with the same arguments and config"
        )


def put_replicated(tree: Any, sharding: Any) -> Any:
    """``jax.device_put(tree, sharding)`` of values every process holds alike, random keys included
    (``device_put`` refuses typed keys for a sharding spanning several processes; their raw data it takes)."""

    def put(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(leaf)), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return jax.device_put(leaf, sharding)

    return jax.tree.map(put, tree)


def is_initialized() -> bool:
    return _mesh is not None


def get_mesh() -> Mesh:
    """The run's mesh, axes ("pp", "dp", "fsdp", "ep", "tp"), with "cp" before "tp" when context_parallel_degree > 1."""
    if _mesh is None:
        raise JmpError("jmp is not initialized: call smp.init(config) first")
    return _mesh


def get_config() -> Config:
    if _config is None:
        raise JmpError("jmp is not initialized: call smp.init(config) first")
    return _config


def _process_group(axes: tuple[str, ...]) -> tuple[int, int]:
    """(rank, size) of this process among the processes that differ along ``axes``."""
    return _process_group_in(get_mesh(), axes)


@functools.lru_cache(maxsize=64)  # a step call asks for its data share each time; the mesh rarely changes
def _process_group_in(mesh: Mesh, axes: tuple[str, ...]) -> tuple[int, int]:
    index = [mesh.axis_names.index(a) for a in axes if a in mesh.axis_names]
    coordinates: dict[int, set] = {}
    for position, device in np.ndenumerate(mesh.devices):
        coordinates.setdefault(device.process_index, set()).add(tuple(position[i] for i in index))
    groups = sorted({frozenset(c) for c in coordinates.values()}, key=sorted)
    mine = frozenset(coordinates[jax.process_index()])
    return groups.index(mine), len(groups)


# SMP's process groups, by the mesh axes along which their members differ (they share the coordinates on the
# other axes): WORLD every process; DP the processes holding the same model part, MP those holding the same data.
GROUP_AXES = {
    "WORLD": AXES + (CONTEXT_AXIS,),
    "DP_GROUP": ("dp", "fsdp", "tp"),
    "RDP_GROUP": ("dp", "fsdp"),
    "MP_GROUP": MODEL_AXES,
    "PP_GROUP": ("pp",),
    "TP_GROUP": ("tp",),
}


def group_members(group: str) -> list[int]:
    """The process indices of this process's ``group`` (a ``GROUP_AXES`` name), sorted."""
    mesh = get_mesh()
    fixed = [i for i, axis in enumerate(mesh.axis_names) if axis not in GROUP_AXES[group]]
    coordinates: dict[int, set] = {}
    for position, device in np.ndenumerate(mesh.devices):
        coordinates.setdefault(device.process_index, set()).add(tuple(position[i] for i in fixed))
    mine = coordinates[jax.process_index()]
    return sorted(p for p, held in coordinates.items() if held == mine)


def rank() -> int:
    """This process's index among all processes (``jax.process_index()``)."""
    return jax.process_index()


def size() -> int:
    """The number of processes (``jax.process_count()``); a process may drive several devices (a rank is one)."""
    return jax.process_count()


def local_rank() -> int:
    """This process's index on its host: 0 with one process per host, else the launcher's LOCAL_RANK."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_size() -> int:
    """Processes on this host: 1 with one process per host, else the launcher's LOCAL_WORLD_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def dp_rank() -> int:
    """This process's rank among those holding its pipeline stage (SMP's data-parallel group, tp peers included)."""
    return _process_group(DATA_AXES + ("tp",))[0]


def dp_size() -> int:
    """How many processes hold the same pipeline stage (1 on one host: the step splits the batch over devices)."""
    return _process_group(DATA_AXES + ("tp",))[1]


def rdp_rank() -> int:
    """This process's rank among those holding the same model slice (pipeline stage and tensor-parallel slice)."""
    return _process_group(DATA_AXES)[0]


def rdp_size() -> int:
    """How many processes hold the same model slice (see rdp_rank)."""
    return _process_group(DATA_AXES)[1]


def feeding_axes() -> tuple[str, ...]:
    """The mesh axes along which processes pass different rows to a step: the data axes, and ``tp`` unless
    ``prescaled_batch`` (SMP's rule: without it each tensor-parallel rank loads its own batch)."""
    return DATA_AXES if get_config().prescaled_batch else DATA_AXES + ("tp",)


def feeding_share() -> tuple[int, int]:
    """(rank, count) of this process among the processes passing different rows to a step."""
    return _process_group(feeding_axes())


def tp_rank() -> int:
    """This process's rank among those holding different tensor-parallel slices (0 if one holds them all)."""
    return _process_group(("tp",))[0]


def tp_size() -> int:
    """The tensor-parallel degree, as in SMP (how many slices a split layer has)."""
    return get_mesh().shape["tp"]


def pp_rank() -> int:
    """This process's rank among those holding different pipeline stages (0 if one holds every stage)."""
    return _process_group(("pp",))[0]


def pp_size() -> int:
    """The pipeline-parallel degree, as in SMP (the number of stages: ``divmod(layers, smp.pp_size())``)."""
    return get_mesh().shape["pp"]


def mp_rank() -> int:
    """This process's rank among the processes of one model replica (pipeline, expert and tensor axes)."""
    return _process_group(MODEL_AXES)[0]


def mp_size() -> int:
    """The model-parallel degree, as in SMP: pipeline x expert x tensor-parallel degrees."""
    mesh = get_mesh()
    return int(np.prod([mesh.shape[a] for a in MODEL_AXES]))
