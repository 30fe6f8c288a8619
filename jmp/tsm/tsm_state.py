"""``tsm.state``: SMP v2's state object, under SMP v2's attribute names, read live from the run's config and mesh.

Ranks count processes, as ``smp.tp_rank()`` does (one device per process under ``jmp.launch``: SMP v2's ranks);
sizes are the degrees, which may be assigned (``initialization``); ``ranker``'s replication is across ``dp``.
"""

from __future__ import annotations

from typing import Any

import jax
import torch.distributed as dist

from jmp.errors import JmpError
from jmp.runtime import mesh_state, process_groups
from jmp.tsm import initialization, rng_state_tracker
from jmp.tsm.rng_state_tracker import RngStatesTracker

_CONTEXT_AXIS = "cp"  # the mesh axis context parallelism will add; absent, the degree is 1


def _initialized_mesh(what: str):
    if not mesh_state.is_initialized():
        raise JmpError(f"tsm.state.{what} needs the run's mesh: call tsm.init() first")
    return mesh_state.get_mesh()


def _group_along(axis: str, asked: str) -> tuple[int, ...]:
    """The processes that differ from this one only along ``axis`` (this one alone without the axis)."""
    mesh = _initialized_mesh(asked)
    me = jax.process_index()
    if axis not in mesh.axis_names:
        return (me,)
    return tuple(next((g for g in process_groups.partition_of(mesh, (axis,)) if me in g), (me,)))


def _rank_along(axis: str) -> int:
    """This process's rank among the processes that differ from it only along ``axis`` (0 without the axis)."""
    return _group_along(axis, f"{axis}_rank").index(jax.process_index())


class Ranker:
    """SMP v2's ``tsm.state.ranker``: the replication groups, the processes holding the same shard."""

    def get_rep_groups(self) -> list[list[int]]:
        """Every replication group (data-parallel replicas of the same shard), as sorted rank lists."""
        mesh = _initialized_mesh("ranker")
        return [list(group) for group in process_groups.partition_of(mesh, ("dp",))]

    def get_rep_rank(self, rank: int | None = None) -> int:
        """``rank``'s index in its replication group (default: this process's); 0 writes sharded checkpoints."""
        rank = jax.process_index() if rank is None else rank
        for group in self.get_rep_groups():
            if rank in group:
                return group.index(rank)
        raise JmpError(f"tsm.state.ranker.get_rep_rank: rank {rank} holds no device of the mesh")


def _degree(key: str, axis: str) -> property:
    """An assignable degree (``jmp.tsm.initialization``): the mesh's ``axis`` size, 1 without the axis."""

    def get(self) -> int:
        if not mesh_state.is_initialized():
            return initialization.pending_value(key)
        return dict(mesh_state.get_mesh().shape).get(axis, 1)

    return property(get, lambda self, value: initialization.assign_degree(key, value))


def _from_config(key: str, field: str | None = None) -> property:
    """The config's ``field`` (``key`` itself by default), SMP v2's ``key``."""

    def get(self) -> Any:
        if not mesh_state.is_initialized():
            return initialization.pending_value(key)
        return getattr(mesh_state.get_config(), field or key)

    return property(get)


def _from_run(key: str, field: str, doc: str | None = None) -> property:
    """What ``tsm.init`` made of ``key``; after a plain ``jmp.init``, the config's ``field``."""

    def get(self) -> Any:
        if not mesh_state.is_initialized():
            return initialization.pending_value(key)
        run = initialization.current_run()
        return getattr(run, key) if run is not None else getattr(mesh_state.get_config(), field)

    return property(get, doc=doc)


class State:
    """SMP v2's ``torch.sagemaker.state``."""

    def __init__(self):
        object.__setattr__(self, "ranker", Ranker())

    tensor_parallel_degree = _degree("tensor_parallel_degree", "tp")
    expert_parallel_degree = _degree("expert_parallel_degree", "ep")
    context_parallel_degree = _degree("context_parallel_degree", _CONTEXT_AXIS)
    hybrid_shard_degree = _from_run(
        "hybrid_shard_degree",
        "sharded_data_parallel_degree",
        "0: PyTorch FSDP's ``sharding_strategy`` decides the sharding; else the mesh's ``fsdp`` degree.",
    )
    activation_loading_horizon = _from_run("activation_loading_horizon", "activation_loading_horizon")
    sm_activation_offloading = _from_config("sm_activation_offloading", "offload_activations")
    fsdp_cache_flush_warnings = _from_config("fsdp_cache_flush_warnings")
    allow_empty_shards = _from_config("allow_empty_shards")
    random_seed = _from_config("random_seed")

    @property
    def tp_rank(self) -> int:
        _initialized_mesh("tp_rank")
        return mesh_state.tp_rank()

    @property
    def tp_size(self) -> int:
        return _initialized_mesh("tp_size").shape["tp"]

    @property
    def ep_rank(self) -> int:
        return _rank_along("ep")

    @property
    def cp_rank(self) -> int:
        return _rank_along(_CONTEXT_AXIS)

    @property
    def cp_size(self) -> int:
        """How many pieces scripts cut each sequence into (``get_batch_for_cp_rank``): 1, as jmp splits over ``cp``."""
        return len(_group_along(_CONTEXT_AXIS, "cp_size"))

    @property
    def world_process_group(self) -> dist.ProcessGroup:
        """Every process, as a ``torch.distributed`` group."""
        _initialized_mesh("world_process_group")
        return process_groups.get_world_process_group()

    @property
    def tp_process_group(self) -> dist.ProcessGroup:
        """The processes holding the tensor-parallel slices of the same layers, as a ``torch.distributed`` group."""
        _initialized_mesh("tp_process_group")
        return process_groups.get_tp_process_group()

    def get_rng_state_tracker(self) -> RngStatesTracker:
        """Transformer Engine's RNG-states tracker (``jmp.tsm.rng_state_tracker``), one per process."""
        return rng_state_tracker.TRACKER

    def __setattr__(self, name: str, value: Any) -> None:
        if name in initialization.DEGREES:
            object.__setattr__(self, name, value)  # the property's setter
            return
        raise AttributeError(
            f"tsm.state.{name} cannot be assigned: give it to tsm.init (only {', '.join(initialization.DEGREES)} "
            "are assignable)"
        )


state = State()
