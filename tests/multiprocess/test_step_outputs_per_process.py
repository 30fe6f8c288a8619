"""With several processes, StepOutput readings are this process's microbatches (SMP's per-rank meaning):
``reduce_mean()`` / ``reduce_sum()`` reduce the rows this process fed, as ``concat()`` and ``outputs`` give
them; and the main job, summing its held-out figures over the processes, reports the accuracy one process does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.multiprocess import main_job_share_script
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
ENV = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
LAUNCH = [sys.executable, "-m", "jmp.launch", "-n", "2", "--cpu-devices", "4"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def test_reductions_are_over_this_process_rows_like_concat():
    result = _run([*LAUNCH, "tests/multiprocess/step_outputs_script.py"])
    reports = {r["rank"]: r for r in json_objects(result.stdout) if isinstance(r, dict) and "rank" in r}
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        dp_rank, dp_size = report["dp"]
        assert dp_size == 2
        base = 100 * dp_rank
        # 16 rows on this process's 4 devices (4 rows each); each of the 2 microbatches takes an equal slice of
        # every device's rows (microbatches.split): rows 0-1 of each device, then rows 2-3
        first = [base + r for r in (0, 1, 4, 5, 8, 9, 12, 13)]
        second = [v + 2 for v in first]
        assert report["outputs"] == [first, second]
        assert report["concat"] == [base + r for r in range(16)]
        assert report["reduce_sum"] == [a + b for a, b in zip(first, second)]
        assert report["reduce_mean"] == [(a + b) / 2 for a, b in zip(first, second)]
        # the mean of this process's rows (7.5 + base), not of both processes' (57.5)
        assert sum(report["reduce_mean"]) / 8 == pytest.approx(7.5 + base)
        assert report["types"] == ["Tensor"]


def _held_out(stdout: str) -> list[tuple[float, float]]:
    """(loss, accuracy in %) of each 'held-out' line the main job printed."""
    lines = re.findall(r"held-out: loss ([0-9.]+), accuracy ([0-9.]+)%", stdout)
    return [(float(loss), float(accuracy)) for loss, accuracy in lines]


def test_the_main_jobs_processes_train_on_what_one_process_with_their_global_batch_does():
    """2 processes with a per-process batch of 32 (SMP's per-rank batch) against this process with 64: each step's
    loss, averaged over the processes, is the one-process job's (dropout off: its masks are drawn per process)."""
    result = _run([*LAUNCH[:-1], "1", "tests/multiprocess/main_job_share_script.py", "32"])
    per_rank = {r["rank"]: r["losses"] for r in json_objects(result.stdout) if isinstance(r, dict) and "losses" in r}
    assert sorted(per_rank) == [0, 1]
    launched = [(a + b) / 2 for a, b in zip(per_rank[0], per_rank[1])]
    one_process = main_job_share_script.losses(64)
    assert len(launched) == main_job_share_script.STEPS and per_rank[0] != per_rank[1]
    np.testing.assert_allclose(launched, one_process, rtol=2e-5)


def test_the_main_job_under_the_launcher_reports_an_accuracy_over_both_processes_digits():
    # 22 steps of 2 x 32, data parallel over the processes, one device each (four per process make each step 4x
    # slower on this CPU; pipelines across processes: test_training.py, test_pipeline_inputs.py)
    command = [
        *LAUNCH[:-1],
        "1",
        "-m",
        "jmp.examples.mnist",
        "--epochs",
        "1",
        "--partitions",
        "1",
        "--batch-size",
        "32",
    ]
    held_out = _held_out(_run(command).stdout)
    assert len(held_out) == 1  # the job's report, printed by rank 0, of the figures summed over both processes
    (_, accuracy) = held_out[0]
    # counting every process's correct digits over one process's digits gave 157.95% here. One epoch of Adadelta
    # at lr 4.0 with dropout, 22 steps of 2 x 32, lands at 51.25% (the same seeds every run), above chance
    assert 15 < accuracy <= 100, accuracy
