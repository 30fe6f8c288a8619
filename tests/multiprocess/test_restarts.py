"""``python -m jmp.launch --max-restarts N`` restarts every process when one fails, as torchrun does, and a
script that resumes from its newest checkpoint ends where an uninterrupted run ends, bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from jmp import launch
from jmp.saving import directory
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multiprocess/restart_script.py"


def _launch_here(capfd, monkeypatch, *args: str) -> tuple[int, list[dict], str]:
    """Run the launcher in this process: (exit code, the JSON lines printed, stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    capfd.readouterr()
    code = launch.main(list(args))
    out, err = capfd.readouterr()
    return code, json_objects(out), err


def _starts(records: list[dict]) -> list[tuple[int, int, int]]:
    """(attempt, rank, max restarts) of every process started."""
    return sorted((r["restart_count"], r["rank"], r["max_restarts"]) for r in records if "restart_count" in r)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_process_restarts_every_process_with_torchruns_restart_count(capfd, monkeypatch):
    code, records, err = _launch_here(capfd, monkeypatch, "-n", "2", "--max-restarts", "2", SCRIPT, "fail-once")
    assert code == 0, err
    assert _starts(records) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert "rank 1 (pid " in err and "was killed by SIGKILL (9); stopping the 1 other running process(es)" in err
    assert "jmp.launch: restart 1 of 2 (rank 1 was killed by SIGKILL (9)): starting the 2 processes again" in err
    assert "jmp.launch: the run finished after 1 restart(s)" in err
    assert not any(_alive(r["pid"]) for r in records)


def test_without_restarts_left_the_launcher_exits_with_the_failed_processs_code(capfd, monkeypatch):
    code, records, err = _launch_here(capfd, monkeypatch, "-n", "2", "--max-restarts", "1", SCRIPT, "fail-always")
    assert code == 3, err
    assert _starts(records) == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert err.count("exited with code 3") == 3  # twice said at once, once in the restart's line
    assert "(no restarts left: --max-restarts 1)" in err and "restart 1 of 1" in err
    code, records, err = _launch_here(capfd, monkeypatch, "-n", "2", SCRIPT, "fail-once")
    assert code == 128 + signal.SIGKILL, err
    assert _starts(records) == [(0, 0, 0), (0, 1, 0)]  # torchrun's variables without --max-restarts too
    assert "restart" not in err


def test_a_hung_step_dumps_the_stacks_names_the_stopped_process_and_stops_the_run(capfd, monkeypatch):
    args = ["-n", "2", "--step-timeout", "1", "--grace", "1", SCRIPT, "hang"]
    code, records, err = _launch_here(capfd, monkeypatch, *args)
    assert code == launch.HUNG_EXIT_CODE, err
    assert "finished no step for 1 s (--step-timeout); rank(s) 1 stopped (SIGSTOP); the processes' Python" in err
    assert 'restart_script.py", line' in err and "in wait_in_a_collective" in err  # rank 0's, from faulthandler
    assert "rank 1 (pid " in err and "is stopped (SIGSTOP); stopping it and the 1 other running process(es)" in err
    assert not any(_alive(r["pid"]) for r in records)


def test_a_run_killed_then_preempted_resumes_each_time_and_ends_as_an_uninterrupted_run_bitwise(
    tmp_path, capfd, monkeypatch
):
    """Rank 1 dies by SIGKILL after step 0 while rank 0 waits for it in a barrier, inside JAX's runtime (which
    catches SIGTERM): the launcher stops rank 0 (``--grace``'s SIGKILL) and restarts both, which resume from
    step 1. After step 1 the launcher gets SIGTERM: both processes finish step 2, save the preemption checkpoint
    and exit 0. A new launch resumes from it at step 3."""
    options = ["-n", "2", "--grace", "1", "--preemption-checkpoint-dir", str(tmp_path)]
    code, first, err = _launch_here(capfd, monkeypatch, *options, "--max-restarts", "1", SCRIPT, "train", str(tmp_path))
    assert code == 0, err[-5000:]
    assert _starts(first) == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert "jmp.launch: restart 1 of 1 (rank 1 was killed by SIGKILL (9))" in err
    assert "jmp.launch: got SIGTERM, passed it on to the processes" in err
    assert "preempted (SIGTERM): saved partial checkpoint 'preempted'" in err
    assert (tmp_path / "newest").read_text() == "preempted"
    code, last, err = _launch_here(capfd, monkeypatch, *options, SCRIPT, "train", str(tmp_path))
    assert code == 0, err[-5000:]
    records = first + last
    assert sorted((r["rank"], r["first_step"]) for r in records if "first_step" in r) == [
        (0, 0), (0, 1), (0, 3), (1, 0), (1, 1), (1, 3)
    ]  # fmt: skip
    reports = {r["rank"]: r for r in records if "resumed" in r}
    assert sorted(reports) == [0, 1]
    for rank, report in reports.items():
        losses = {str(r["step"]): r["loss"] for r in records if r.get("rank") == rank and "loss" in r}
        assert losses == report["uninterrupted"]["losses"]  # steps 0-4, each computed once
        assert report["resumed"] == report["uninterrupted"]["parameters"]
    # the processes see their own data, so the two ranks' losses differ: the comparison is per process
    assert reports[0]["uninterrupted"]["losses"] != reports[1]["uninterrupted"]["losses"]
    assert directory.partial_tags(tmp_path) == ["preempted", "step1", "step2", "step4", "step5"]
