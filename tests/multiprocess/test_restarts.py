"""``python -m jmp.launch --max-restarts N`` restarts every process when one fails, as torchrun does, and a
script that resumes from its newest checkpoint ends where an uninterrupted run ends, bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from jmp import launch
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


def test_a_run_killed_mid_training_restarts_resumes_and_ends_as_an_uninterrupted_run_bitwise(
    tmp_path, capfd, monkeypatch
):
    """Rank 1 dies by SIGKILL after step 1's checkpoint while rank 0 waits for it in a barrier, inside JAX's
    runtime (which catches SIGTERM): the launcher stops rank 0 (``--grace``'s SIGKILL), restarts both, and they
    resume from step 1."""
    args = ["-n", "2", "--max-restarts", "1", "--grace", "1", SCRIPT, "train", str(tmp_path)]
    code, records, err = _launch_here(capfd, monkeypatch, *args)
    assert code == 0, err[-5000:]
    assert _starts(records) == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert "restart 1 of 1 (rank 1 was killed by SIGKILL (9))" in err
    reports = {r["rank"]: r for r in records if "resumed" in r}
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        resumed, uninterrupted = report["resumed"], report["uninterrupted"]
        assert resumed["first_step"] == 1
        assert resumed["losses"] == {step: uninterrupted["losses"][step] for step in ("1", "2")}
        assert resumed["parameters"] == uninterrupted["parameters"]
    # the processes see their own data, so the two ranks' losses differ: the comparison is per process
    assert reports[0]["uninterrupted"]["losses"] != reports[1]["uninterrupted"]["losses"]
    assert sorted(p.name for p in tmp_path.glob("*_partial")) == [f"step{n}_partial" for n in range(1, 4)]
