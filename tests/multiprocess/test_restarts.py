"""``python -m jmp.launch --max-restarts N`` restarts every process when one fails, as torchrun does, and a
script that resumes from its newest checkpoint ends where an uninterrupted run ends, bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import jmp as smp
from jmp import launch
from jmp.saving import directory
from tests.multiprocess import restart_script
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


def test_a_run_whose_processes_failed_to_connect_is_started_again_without_restarts_asked_for(capfd, monkeypatch):
    code, records, err = _launch_here(capfd, monkeypatch, "-n", "2", SCRIPT, "fail-connecting", "2")
    assert code == 0, err
    assert _starts(records) == [(a, r, 0) for a in range(3) for r in range(2)]
    assert sorted(r["rank"] for r in records if r.get("connected") == 2) == [0, 1]
    assert err.count("while the processes connected (smp.init starting JAX's runtime)") == 2
    assert "start-up retry 1 of 2 (rank 1 exited with code 1)" in err and "start-up retry 2 of 2" in err
    assert "jmp.launch: the run finished after 2 restart(s)" in err


def test_a_hung_step_dumps_the_stacks_names_the_stopped_process_and_stops_the_run(capfd, monkeypatch):
    args = ["-n", "2", "--step-timeout", "1", "--grace", "1", SCRIPT, "hang"]
    code, records, err = _launch_here(capfd, monkeypatch, *args)
    assert code == launch.HUNG_EXIT_CODE, err
    assert "finished no step for 1 s (--step-timeout); rank(s) 1 stopped (SIGSTOP); the processes' Python" in err
    assert 'restart_script.py", line' in err and "in wait_in_a_collective" in err  # rank 0's, from faulthandler
    assert "rank 1 (pid " in err and "is stopped (SIGSTOP); stopping it and the 1 other running process(es)" in err
    assert not any(_alive(r["pid"]) for r in records)


def test_a_run_killed_then_preempted_resumes_and_saves_what_an_uninterrupted_run_computes_bitwise(
    tmp_path, capfd, monkeypatch
):
    """Rank 1 dies by SIGKILL after step 0 while rank 0 waits for it in a barrier, inside JAX's runtime (which
    catches SIGTERM): the launcher stops rank 0 (``--grace``'s SIGKILL) and restarts both, which resume from
    step 1 and compute the uninterrupted run's losses. After step 1 the launcher gets SIGTERM: both processes
    finish step 2, save the preemption checkpoint and exit 0; resumed here, it holds the uninterrupted run's
    parameters after step 2, bitwise."""
    options = ["-n", "2", "--grace", "1", "--preemption-checkpoint-dir", str(tmp_path), "--max-restarts", "1"]
    code, records, err = _launch_here(capfd, monkeypatch, *options, SCRIPT, "train", str(tmp_path))
    assert code == 0, err[-5000:]
    assert _starts(records) == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert "jmp.launch: restart 1 of 1 (rank 1 was killed by SIGKILL (9))" in err
    assert "jmp.launch: got SIGTERM, passed it on to the processes" in err
    assert "preempted (SIGTERM): saved partial checkpoint 'preempted'" in err
    assert (tmp_path / "newest").read_text() == "preempted"
    assert sorted((r["rank"], r["first_step"]) for r in records if "first_step" in r) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    uninterrupted = {r["rank"]: r["uninterrupted"] for r in records if "uninterrupted" in r}
    for rank in (0, 1):
        losses = {str(r["step"]): r["loss"] for r in records if r.get("rank") == rank and "loss" in r}
        assert losses == uninterrupted[rank]["losses"]  # steps 0-2: 0 before the kill, 1-2 after the restart
    # the processes see their own data, so the two ranks' losses differ: the comparison is per process
    assert uninterrupted[0]["losses"] != uninterrupted[1]["losses"]
    assert uninterrupted[0]["parameters"] == uninterrupted[1]["parameters"]
    assert directory.partial_tags(tmp_path) == ["preempted", "step1", "step2"]
    smp.init({})
    model, _ = restart_script.build()
    assert smp.resume_from_checkpoint(tmp_path, model=model) == {"next_step": 3}
    assert restart_script.parameters(model) == uninterrupted[0]["parameters"]
