"""``python -m jmp.launch`` starts a JAX multi-process run on one machine, and SMP's communication helpers
(barrier, broadcast / recv_from, send, allgather) move objects between its processes; a failing process stops
the run instead of leaving the others waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jmp as smp
from jmp import launch
from jmp.launch import child_environment, free_port_pair
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multiprocess/comm_script.py"
TIMEOUT = 180
ENV = os.environ | {"PYTHONPATH": str(ROOT)}
# the launcher's file run alone: `python -m jmp.launch` imports the jmp package (torch and JAX, seconds)
LAUNCHER_ALONE = [sys.executable, "-c", "import runpy; runpy.run_path('jmp/launch.py', run_name='__main__')"]

# each config's group members of process 0 and 1 (2 processes x 4 devices)
MEMBERS = {
    "{}": {"DP_GROUP": "both", "RDP_GROUP": "both", "MP_GROUP": "own", "PP_GROUP": "own", "TP_GROUP": "own"},
    # SMP: a tensor-parallel group is a subset of the data-parallel group; RDP_GROUP holds the same tp slice
    "tp": {"DP_GROUP": "both", "RDP_GROUP": "own", "MP_GROUP": "both", "PP_GROUP": "own", "TP_GROUP": "both"},
    "pp": {"DP_GROUP": "own", "RDP_GROUP": "own", "MP_GROUP": "both", "PP_GROUP": "both", "TP_GROUP": "own"},
}


def _launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jmp.launch", *args],
        cwd=ROOT,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _launch_here(capfd, monkeypatch, *args: str) -> tuple[int, str, str]:
    """Run the launcher in this process (no second import of torch and JAX): (exit code, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    capfd.readouterr()
    code = launch.main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def _records(stdout: str) -> list[dict]:
    return json_objects(stdout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_processes_get_torchrun_ranks_jmp_groups_and_exchange_objects():
    result = _launch("-n", "2", "--cpu-devices", "4", SCRIPT, "check")
    assert result.returncode == 0, result.stderr[-5000:]
    records = _records(result.stdout)
    reports = [r for r in records if "config" in r]
    assert len(reports) == 6, result.stdout
    ports = set()
    for report in reports:
        me, other = report["rank"], 1 - report["rank"]
        layout = "tp" if "tensor_parallel_degree" in report["config"] else "pp" if report["config"] else "{}"
        members = {"WORLD": [0, 1]} | {
            group: [0, 1] if who == "both" else [me] for group, who in MEMBERS[layout].items()
        }
        assert report["members"] == members, layout
        assert report["devices"] == [4, 8] and report["local"] == [me, 2]
        # a process's rank in a group is its smp.x_rank(): the numbering send and recv_from use
        for group, group_members in members.items():
            assert group_members.index(me) == report["ranks"][group], (layout, group)
        assert report["sizes"]["WORLD"] == 2 and report["sizes"]["DP_GROUP"] == len(members["DP_GROUP"])
        shared = [group for group, group_members in members.items() if len(group_members) == 2]
        assert report["received"] == {group: [{"from": other, "group": group}] for group in shared}
        assert report["ring"] == ["ring", other] and report["self"] == {"to": "self"}
        assert report["allgather"] == {
            group: [{"rank": m, "group": group} for m in group_members] for group, group_members in members.items()
        }
        assert report["allgather_twice"] == [0, 10]
        if "env" in report:
            env = report["env"]
            assert env | {"MASTER_PORT": None, "XLA_FLAGS": None} == {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": None,
                "WORLD_SIZE": "2",
                "RANK": str(me),
                "LOCAL_RANK": str(me),
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0",
                "XLA_FLAGS": None,
                "JAX_PLATFORMS": "cpu",
            }
            # the test process's own count flag (8) is replaced, not repeated
            assert env["XLA_FLAGS"].split().count("--xla_force_host_platform_device_count=4") == 1
            assert "device_count=8" not in env["XLA_FLAGS"]
            ports.add(env["MASTER_PORT"])
    assert len(ports) == 1
    # two processes each waiting for the other to send: both fail after JMP_COMM_TIMEOUT, naming the peer
    errors = {r["rank"]: r["timeout_error"] for r in records if "timeout_error" in r}
    for me, message in errors.items():
        assert message.startswith(f"smp.recv_from({1 - me}, WORLD_RANK) on process {me}: waited 2 s")
        assert f"for process {1 - me} (rank {1 - me} of WORLD" in message and "DEADLINE_EXCEEDED" in message
    assert sorted(errors) == [0, 1]


def test_a_process_exiting_non_zero_stops_the_others_and_gives_the_launcher_its_code(capfd, monkeypatch):
    start = time.monotonic()
    code, out, err = _launch_here(capfd, monkeypatch, "-n", "2", "-m", "tests.multiprocess.comm_script", "exit", "3")
    assert code == 3, err
    assert time.monotonic() - start < 60  # rank 0 would sleep 120 s
    assert "jmp.launch: rank 1" in err and "exited with code 3" in err
    assert not any(_alive(r["pid"]) for r in _records(out))


def test_a_process_killed_by_a_signal_gives_the_launcher_128_plus_the_signal(capfd, monkeypatch):
    code, out, err = _launch_here(capfd, monkeypatch, "-n", "2", SCRIPT, "sigkill")
    assert code == 128 + signal.SIGKILL, err
    assert "rank 1" in err and "was killed by SIGKILL (9)" in err
    assert not any(_alive(r["pid"]) for r in _records(out))


def test_sigint_to_the_launcher_is_passed_on_to_the_processes():
    launcher = subprocess.Popen(
        [*LAUNCHER_ALONE, "-n", "2", SCRIPT, "sleep"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = [json.loads(launcher.stdout.readline())["pid"] for _ in range(2)]
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=TIMEOUT)
    assert launcher.returncode == 128 + signal.SIGINT, stderr
    assert "got SIGINT" in stderr
    assert not any(_alive(pid) for pid in pids)


def test_when_a_process_is_killed_the_one_waiting_for_it_fails_with_the_runtimes_heartbeat_error():
    """Without a launcher to stop it, the waiting process learns from JAX's heartbeat timeout that its peer died."""
    port = free_port_pair()
    env = ENV | {"JMP_HEARTBEAT_TIMEOUT": "5", "JMP_COMM_TIMEOUT": "120"}
    processes = [
        subprocess.Popen(
            [sys.executable, SCRIPT, "runtime-sigkill"],
            cwd=ROOT,
            env=child_environment(rank, 2, port, cpu_devices=4, base=env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        (_, stderr), _ = processes[0].communicate(timeout=TIMEOUT), processes[1].wait(timeout=TIMEOUT)
    finally:
        for process in processes:
            process.kill()
    assert processes[1].returncode == -signal.SIGKILL
    assert processes[0].returncode != 0
    assert "stopped sending heartbeats" in stderr, stderr[-5000:]


def test_one_process_alone_is_every_group():
    smp.init({})
    smp.barrier()
    smp.tp_barrier()
    smp.rdp_barrier()
    assert smp.allgather({"a": 1}, smp.DP_GROUP) == [{"a": 1}]
    assert smp.broadcast([1, 2], smp.WORLD) == [1, 2]
    smp.send("to myself", 0, smp.RankType.WORLD_RANK)
    smp.send("again", 0, smp.RankType.TP_RANK)
    assert smp.recv_from(0, smp.RankType.DP_RANK) == "to myself"
    assert smp.recv_from(0, smp.RankType.WORLD_RANK) == "again"
    with pytest.raises(smp.CommError, match="has sent itself nothing"):
        smp.recv_from(0, smp.RankType.WORLD_RANK)
    with pytest.raises(smp.ArgumentTypeError, match="src_rank=1 is not a TP_RANK"):
        smp.recv_from(1, smp.RankType.TP_RANK)
    with pytest.raises(smp.ArgumentTypeError, match="the group of TP_RANK is smp.TP_GROUP"):
        smp.barrier(smp.RankType.TP_RANK)
    with pytest.raises(smp.ArgumentTypeError, match="expected an smp.RankType"):
        smp.send(1, 0, smp.TP_GROUP)


def test_keeping_the_newest_checkpoints_while_training_does_not_wait_on_the_other_processes(tmp_path):
    """Process 0 prunes old checkpoints in the background while every process trains on; reading their metadata
    through Orbax waited for the other processes, and the run hung at its second save."""
    result = _launch("-n", "2", "--cpu-devices", "1", "tests/multiprocess/prune_script.py", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    kept = {r["rank"]: r["kept"] for r in json_objects(result.stdout) if "kept" in r}
    assert kept == {0: ["step2_partial", "step3_partial"], 1: ["step2_partial", "step3_partial"]}
