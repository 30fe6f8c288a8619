"""A script that ``tests/multiprocess/test_launch_and_comm.py`` starts as several processes.

``python -m jmp.launch -n 2 --cpu-devices 4 tests/multiprocess/comm_script.py MODE``, MODE one of:

- ``check``: for each of a few configs, ``smp.init`` it and print one JSON line of this process's ranks, group
  members and what barrier, broadcast / recv_from, send and allgather gave it; then a mismatched pair of
  ``recv_from`` calls, whose ``CommError`` messages are printed too.
- ``exit CODE`` / ``sigkill`` (no JAX): rank 1 exits with CODE / kills itself; the others wait.
- ``sleep`` (no JAX): print the pid and wait.
- ``runtime-sigkill``: after ``smp.init``, rank 1 kills itself; the others wait in ``recv_from(1)``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

CONFIGS = [
    {},  # every process holds a different data shard
    {"tensor_parallel_degree": 2, "placement_strategy": "spread"},  # process i holds tensor slice i
    {"pipeline_parallel_degree": 2, "placement_strategy": "spread"},  # process i holds stage i
]
GROUP_RANKS = {  # each group's rank function, as SMP names them
    "WORLD": "rank",
    "DP_GROUP": "dp_rank",
    "RDP_GROUP": "rdp_rank",
    "MP_GROUP": "mp_rank",
    "PP_GROUP": "pp_rank",
    "TP_GROUP": "tp_rank",
}


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def environment() -> dict:
    names = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"]
    return {name: os.environ.get(name) for name in [*names, "XLA_FLAGS", "JAX_PLATFORMS"]}


def check(config: dict) -> dict:
    import jax

    import jmp as smp
    from jmp.runtime import mesh_state as state

    smp.init(config)
    me = smp.rank()
    report = {
        "config": config,
        "rank": me,
        "devices": [jax.local_device_count(), jax.device_count()],
        "ranks": {group: getattr(smp, name)() for group, name in GROUP_RANKS.items()},
        "sizes": {group: getattr(smp, name.replace("rank", "size"))() for group, name in GROUP_RANKS.items()},
        "local": [smp.local_rank(), smp.local_size()],
        "members": {group: state.group_members(group) for group in GROUP_RANKS},
    }
    smp.barrier()
    smp.dp_barrier(), smp.mp_barrier(), smp.pp_barrier(), smp.tp_barrier(), smp.rdp_barrier()
    for group in smp.CommGroup:
        smp.barrier(group)
    # broadcast from each group's first and last rank; the others receive with recv_from
    received = {}
    for group in smp.CommGroup:
        rank_type = smp.RankType(group)  # the rank type that numbers this group
        group_rank, group_size = getattr(smp, GROUP_RANKS[group.name])(), len(state.group_members(group.name))
        for sender in sorted({0, group_size - 1}):
            if group_rank == sender:
                out = smp.broadcast({"from": me, "group": group.name}, group)
                assert out == {"from": me, "group": group.name}
            else:
                received.setdefault(group.name, []).append(smp.recv_from(sender, rank_type))
    report["received"] = received
    # a ring: every process sends first and receives after (sends do not wait for the receiver)
    size = smp.size()
    smp.send(["ring", me], (me + 1) % size, smp.RankType.WORLD_RANK)
    report["ring"] = smp.recv_from((me - 1) % size, smp.RankType.WORLD_RANK)
    smp.send({"to": "self"}, me, smp.RankType.WORLD_RANK)
    report["self"] = smp.recv_from(me, smp.RankType.WORLD_RANK)
    report["allgather"] = {g.name: smp.allgather({"rank": me, "group": g.name}, g) for g in smp.CommGroup}
    report["allgather_twice"] = smp.allgather(me * 10, smp.WORLD)  # a second call on the same group
    return report


def mismatched_receives() -> dict:
    """Every process waits for the next one to send: each times out with a CommError."""
    import jmp as smp

    os.environ["JMP_COMM_TIMEOUT"] = "2"
    try:
        smp.recv_from((smp.rank() + 1) % smp.size(), smp.RankType.WORLD_RANK)
        message = None
    except smp.CommError as error:
        message = str(error)
    os.environ["JMP_COMM_TIMEOUT"] = "60"
    smp.barrier()
    return {"rank": smp.rank(), "timeout_error": message}


def main(mode: str, *args: str) -> None:
    rank = int(os.environ["RANK"])
    if mode == "check":
        for config in CONFIGS:
            report = check(config)
            emit(report | {"env": environment()} if not config else report)
        emit(mismatched_receives())
    elif mode in ("exit", "sigkill", "sleep"):
        emit({"rank": rank, "pid": os.getpid()})
        if mode == "exit" and rank == 1:
            sys.exit(int(args[0]))
        if mode == "sigkill" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    elif mode == "runtime-sigkill":
        import jmp as smp

        smp.init({})
        smp.barrier()
        emit({"rank": rank, "pid": os.getpid()})
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        smp.recv_from(1, smp.RankType.WORLD_RANK)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
