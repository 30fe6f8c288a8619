"""SMP's helpers for picklable host objects: barrier, broadcast / recv_from, send, allgather.

The transport is the key-value store and barriers of ``jax.distributed``'s coordination service (peers of one
job trust each other's pickles). Every message has its own key, counted per group or per pair of processes, so
every process must make its calls in the same order (as with SMP); a receiver deletes what it read. With one
process a barrier returns at once, ``allgather`` gives ``[obj]`` and ``send`` to oneself queues.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import operator
import os
import pickle
from typing import Any

import jax

# JAX has no public API for its coordination service's key-value store and barriers; the client that
# jax.distributed.initialize() creates lives here (multihost_utils and Orbax reach it the same way).
from jax._src import distributed as _distributed

from jmp.errors import ArgumentTypeError, CommError, ConfigError
from jmp.runtime import mesh_state as state

DEFAULT_TIMEOUT_SECONDS = 300


class CommGroup(enum.Enum):
    """SMP's process groups: the processes a barrier, broadcast or allgather involves."""

    WORLD = "WORLD"  # every process
    DP_GROUP = "DP_GROUP"  # the processes holding the same pipeline stage (data-parallel and tensor-parallel peers)
    MP_GROUP = "MP_GROUP"  # the processes holding one model replica together
    PP_GROUP = "PP_GROUP"  # the processes holding the stages of the same model slice
    TP_GROUP = "TP_GROUP"  # the processes holding the tensor-parallel slices of the same layers
    RDP_GROUP = "RDP_GROUP"  # reduced data parallelism: the processes holding the same model slice


class RankType(enum.Enum):
    """In which group a rank given to ``send`` / ``recv_from`` counts (SMP's ``smp.RankType``)."""

    WORLD_RANK = CommGroup.WORLD
    DP_RANK = CommGroup.DP_GROUP
    MP_RANK = CommGroup.MP_GROUP
    PP_RANK = CommGroup.PP_GROUP
    TP_RANK = CommGroup.TP_GROUP
    RDP_RANK = CommGroup.RDP_GROUP


# SMP's shorthands: smp.WORLD is smp.CommGroup.WORLD, ...
WORLD = CommGroup.WORLD
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP

_PREFIX = "jmp/comm"
_collective_calls: collections.defaultdict[tuple, itertools.count] = collections.defaultdict(itertools.count)
_pair_messages: collections.defaultdict[tuple[int, int], itertools.count] = collections.defaultdict(itertools.count)
_own_queue: collections.deque = collections.deque()  # messages a process sends itself
_unread_by_peers: dict[tuple, str] = {}  # group -> this process's last allgather key, deleted once peers read it


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every process of this process's ``group`` has called ``barrier(group)``."""
    members = _members(_group(group))
    if len(members) == 1:
        return
    key = _collective_key(group, members, "barrier")
    with _failures(f"smp.barrier({group.name})", f"the other processes of {_describe(group, members)} to arrive"):
        _client().wait_at_barrier(key, _timeout_ms(), process_ids=members)
    _read_by_peers(group, members)


# SMP's per-group barriers: smp.dp_barrier() is smp.barrier(smp.DP_GROUP), ...
dp_barrier = functools.partial(barrier, CommGroup.DP_GROUP)
mp_barrier = functools.partial(barrier, CommGroup.MP_GROUP)
pp_barrier = functools.partial(barrier, CommGroup.PP_GROUP)
tp_barrier = functools.partial(barrier, CommGroup.TP_GROUP)
rdp_barrier = functools.partial(barrier, CommGroup.RDP_GROUP)


def broadcast(obj: Any, group: CommGroup) -> Any:
    """Send ``obj`` to the rest of ``group`` (each calls ``recv_from``); returns ``obj`` without waiting (SMP waits)."""
    members = _members(_group(group))
    me = jax.process_index()
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    for member in members:
        if member != me:
            _post(payload, me, member, f"smp.broadcast(obj, {group.name})")
    return obj


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send ``obj`` to ``dest_rank`` of ``rank_type``'s group (it calls ``recv_from``); returns without waiting."""
    destination = _process_of(dest_rank, rank_type, "dest_rank")
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    _post(payload, jax.process_index(), destination, f"smp.send(obj, {dest_rank}, {rank_type.name})")


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """The next object process ``src_rank`` of ``rank_type``'s group sent (waits up to ``JMP_COMM_TIMEOUT`` s)."""
    source = _process_of(src_rank, rank_type, "src_rank")
    me = jax.process_index()
    call = f"smp.recv_from({src_rank}, {rank_type.name})"
    if source == me:
        if not _own_queue:
            raise CommError(f"{call}: this process is rank {src_rank} and has sent itself nothing to receive")
        return pickle.loads(_own_queue.popleft())
    key = f"{_PREFIX}/p2p/{source}-{me}/{next(_pair_messages[source, me])}"
    group = _describe(rank_type.value, _members(rank_type.value))
    with _failures(call, f"process {source} (rank {src_rank} of {group}) to send or broadcast an object"):
        payload = _client().blocking_key_value_get_bytes(key, _timeout_ms())
    _client().key_value_delete(key)
    return pickle.loads(payload)


def allgather(obj: Any, group: CommGroup) -> list:
    """Every process of this process's ``group`` passes an object; each gets the list, ordered by group rank."""
    members = _members(_group(group))
    if len(members) == 1:
        return [obj]
    me = jax.process_index()
    prefix = _collective_key(group, members, "allgather")
    client = _client()
    client.key_value_set_bytes(f"{prefix}/{me}", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    gathered = []
    for member in members:
        if member == me:
            gathered.append(obj)
            continue
        awaited = f"process {member} of {_describe(group, members)} to pass its object"
        with _failures(f"smp.allgather(obj, {group.name})", awaited):
            gathered.append(pickle.loads(client.blocking_key_value_get_bytes(f"{prefix}/{member}", _timeout_ms())))
    _read_by_peers(group, members)
    _unread_by_peers[group, tuple(members)] = f"{prefix}/{me}"
    return gathered


def _group(group: Any) -> CommGroup:
    if isinstance(group, CommGroup):
        return group
    raise ArgumentTypeError(
        f"expected an smp.CommGroup ({', '.join(f'smp.{g.name}' for g in CommGroup)}), got {group!r}"
        + (f"; the group of {group.name} is smp.{group.value.name}" if isinstance(group, RankType) else "")
    )


def _members(group: CommGroup) -> list[int]:
    """The process indices of this process's ``group``, in group-rank order (after ``smp.init``)."""
    return state.group_members(group.name)


def _process_of(rank: int, rank_type: Any, argument: str) -> int:
    """The process index of the process with rank ``rank`` in ``rank_type``'s group."""
    if not isinstance(rank_type, RankType):
        raise ArgumentTypeError(
            f"expected an smp.RankType ({', '.join(f'smp.RankType.{r.name}' for r in RankType)}), got {rank_type!r}"
        )
    members = _members(rank_type.value)
    try:
        index = operator.index(rank)
    except TypeError:
        index = -1
    if not 0 <= index < len(members):
        raise ArgumentTypeError(
            f"{argument}={rank!r} is not a {rank_type.name} of this process's {_describe(rank_type.value, members)}: "
            f"give an int from 0 to {len(members) - 1}"
        )
    return members[index]


def _describe(group: CommGroup, members: list[int]) -> str:
    return f"{group.name} (processes {members})"


def _collective_key(group: CommGroup, members: list[int], what: str) -> str:
    # the members name the group: two different tensor-parallel groups of a run are both TP_GROUP
    number = next(_collective_calls[group, tuple(members)])
    return f"{_PREFIX}/{group.name}/{'-'.join(map(str, members))}/{number}/{what}"


def _read_by_peers(group: CommGroup, members: list[int]) -> None:
    """Every member has finished the group's previous collective: delete this process's earlier allgather key."""
    key = _unread_by_peers.pop((group, tuple(members)), None)
    if key is not None:
        _client().key_value_delete(key)


def _post(payload: bytes, source: int, destination: int, call: str) -> None:
    if source == destination:
        _own_queue.append(payload)
        return
    key = f"{_PREFIX}/p2p/{source}-{destination}/{next(_pair_messages[source, destination])}"
    with _failures(call, f"the coordination service to store the object for process {destination}"):
        _client().key_value_set_bytes(key, payload)


def _client():
    client = _distributed.global_state.client
    if client is None:
        raise CommError(
            f"this process runs alone (jax.process_count() == {jax.process_count()}) but a communication call "
            "names another process: start the processes with a launcher (python -m jmp.launch -n N script.py, "
            "torchrun, SLURM, mpirun) and call smp.init() in each"
        )
    return client


def _timeout_ms() -> int:
    value = os.environ.get("JMP_COMM_TIMEOUT", str(DEFAULT_TIMEOUT_SECONDS))
    try:
        return int(float(value) * 1000)
    except ValueError:
        raise ConfigError(f"JMP_COMM_TIMEOUT must be a number of seconds, got {value!r}") from None


@contextlib.contextmanager
def _failures(call: str, awaited: str):
    """Turn the runtime's errors inside a communication call into a ``CommError`` saying what was waited for."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if "DEADLINE_EXCEEDED" in str(error):
            reason = (
                f"waited {_timeout_ms() / 1000:g} s (JMP_COMM_TIMEOUT) for {awaited}. Every process must make the "
                "same communication calls in the same order (a recv_from for each send or broadcast); a peer that "
                "takes longer on purpose needs a larger JMP_COMM_TIMEOUT"
            )
        else:
            reason = f"the distributed runtime failed while waiting for {awaited}; a process may have died"
        raise CommError(f"{call} on process {jax.process_index()}: {reason}. JAX said: {error}") from error
