"""SMP's process groups as ``torch.distributed`` groups, and the rank lists of each.

SMP initialises ``torch.distributed`` and scripts use it outside the step:
``torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())``. ``smp.init`` does the same here:
it starts torch's gloo backend over the job's processes (the launcher's ``MASTER_ADDR`` / ``MASTER_PORT``,
else an address process 0 announces through JAX's runtime) unless the script started ``torch.distributed``
itself, and makes one ``torch.distributed`` group per SMP group. Ranks are process indices
(``smp.rank()`` is ``torch.distributed.get_rank()``). Inside ``@smp.step`` arrays travel through XLA's
collectives instead; these groups are for the host-side tensors scripts hold between steps.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket

import jax
import numpy as np
import torch.distributed as dist
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jmp.errors import ConfigError, JmpError

_ADDRESS_BYTES = 256
_groups: dict[str, dist.ProcessGroup] = {}
_members: dict[str, tuple[int, ...]] = {}
_made: dict[tuple[int, ...], dist.ProcessGroup] = {}


def start(mesh: Mesh, group_axes: dict[str, tuple[str, ...]]) -> None:
    """Start ``torch.distributed`` if needed and make ``mesh``'s SMP groups, each named in ``group_axes`` by the
    mesh axes along which its members differ (every process calls this, in ``smp.init``: making a group is
    collective)."""
    _start_torch_distributed()
    world = jax.process_count()
    if dist.get_world_size() != world or dist.get_rank() != jax.process_index():
        raise ConfigError(
            f"torch.distributed was started with rank {dist.get_rank()} of {dist.get_world_size()}, but this is "
            f"process {jax.process_index()} of {world} of JAX's runtime; start both from the same launcher "
            "variables, or let smp.init() start torch.distributed"
        )
    me = jax.process_index()
    _groups.clear()
    _members.clear()
    for name, axes in group_axes.items():
        partition = partition_of(mesh, axes)
        for members in partition:  # in the same order on every process, as dist.new_group requires
            if members not in _made:
                _made[members] = dist.group.WORLD if len(members) == world else dist.new_group(list(members))
        mine = next((m for m in partition if me in m), None)
        if mine is not None:  # else this process holds no device of the mesh (smp.init(devices=...))
            _members[name], _groups[name] = mine, _made[mine]


def partition_of(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The processes grouped by their devices' coordinates off ``axes`` (members differ only along ``axes``),
    as sorted rank tuples in a fixed order."""
    fixed = [i for i, axis in enumerate(mesh.axis_names) if axis not in axes]
    held: dict[int, set] = {}
    for position, device in np.ndenumerate(mesh.devices):
        held.setdefault(device.process_index, set()).add(tuple(position[i] for i in fixed))
    together: dict[frozenset, list[int]] = {}
    for process, coordinates in sorted(held.items()):
        together.setdefault(frozenset(coordinates), []).append(process)
    return tuple(sorted(tuple(members) for members in together.values()))


def process_group(group: str) -> dist.ProcessGroup:
    """This process's ``group`` (a name given to ``start``) as a ``torch.distributed.ProcessGroup``."""
    _check(group)
    return _groups[group]


def members(group: str) -> list[int]:
    """The ranks (process indices) of this process's ``group``, sorted."""
    _check(group)
    return list(_members[group])


def _check(group: str) -> None:
    if group not in _groups:
        raise JmpError(
            f"smp's {group} process group does not exist: call smp.init() first (on every process, with devices "
            "of this process in the mesh)"
        )


# SMP's API: each group (jmp.runtime.comm.CommGroup says which processes it holds) as a torch.distributed
# ProcessGroup (torch.distributed.group.WORLD for every process) ...
get_world_process_group = functools.partial(process_group, "WORLD")
get_dp_process_group = functools.partial(process_group, "DP_GROUP")
get_rdp_process_group = functools.partial(process_group, "RDP_GROUP")
get_mp_process_group = functools.partial(process_group, "MP_GROUP")
get_pp_process_group = functools.partial(process_group, "PP_GROUP")
get_tp_process_group = functools.partial(process_group, "TP_GROUP")
# ... and as the list of its ranks (``0 in smp.get_tp_group()``: is rank 0 a tensor-parallel peer?)
get_dp_group = functools.partial(members, "DP_GROUP")
get_rdp_group = functools.partial(members, "RDP_GROUP")
get_mp_group = functools.partial(members, "MP_GROUP")
get_pp_group = functools.partial(members, "PP_GROUP")
get_tp_group = functools.partial(members, "TP_GROUP")


def _start_torch_distributed() -> None:
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=int(os.environ.get("JMP_INIT_TIMEOUT", "120")))
    if jax.process_count() == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    env = os.environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        # env:// also joins torchrun's own store when torchrun launched the process
        env.setdefault("RANK", str(jax.process_index()))
        env.setdefault("WORLD_SIZE", str(jax.process_count()))
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        return
    address = _announced_address()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}",
        rank=jax.process_index(),
        world_size=jax.process_count(),
        timeout=timeout,
    )


def _announced_address() -> str:
    """``host:port`` for torch's store, chosen by process 0 and sent to all through JAX's runtime (launchers
    such as SLURM or mpirun set no ``MASTER_ADDR``)."""
    text = b""
    if jax.process_index() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            text = f"{socket.gethostname()}:{probe.getsockname()[1]}".encode()
    buffer = np.zeros(_ADDRESS_BYTES, np.uint8)
    buffer[: len(text)] = np.frombuffer(text, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return received.astype(np.uint8).tobytes().rstrip(b"\0").decode()
