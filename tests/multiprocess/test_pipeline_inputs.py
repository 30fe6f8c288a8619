"""A pipelined step takes its inputs from the pp-rank-0 process of each data-parallel group, as under SMP
(issue 31, item 15: AWS's gpt2 example gives the other pipeline ranks a ``DummyDataset`` of empty tensors).

One launch of ``pipeline_inputs_script.py`` on 4 processes x 1 device (pp2 x dp2): the later stage's processes
pass placeholders of any shape and dtype, and train as PyTorch does on the first stage's processes' rows.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4


@functools.cache
def _run() -> tuple[subprocess.CompletedProcess, dict[int, dict], dict[int, dict]]:
    """The launch (once per test session): its result, and each rank's direct and training reports."""
    command = [sys.executable, "-m", "jmp.launch", "-n", str(PROCESSES), "--cpu-devices", "1"]
    command.append("tests/multiprocess/pipeline_inputs_script.py")
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    reports = [r for r in json_objects(result.stdout) if isinstance(r, dict) and "rank" in r]
    direct = {r["rank"]: r for r in reports if "direct" in r}
    trained = {r["rank"]: r for r in reports if "max_difference" in r}
    return result, direct, trained


def test_later_stages_take_the_first_stages_tensors_whatever_theirs_are():
    result, direct, _ = _run()
    assert sorted(direct) == list(range(PROCESSES)), result.stdout[-2000:] + result.stderr[-4000:]
    assert sorted(r["pp"] for r in direct.values()) == [0, 0, 1, 1]
    for report in direct.values():
        dp_rank, dp_size = report["dp"]
        assert dp_size == 2
        got = report["direct"]
        # pp rank 0 of this data-parallel group passed these; a later stage passed empty tensors of other shapes
        assert got["ids"] == [[100 * dp_rank + i for i in range(3)], [100 * dp_rank + i for i in range(3, 6)]]
        assert got["static"] == "static"  # non-tensor arguments stay each process's own
        assert got["half"] == ["torch.bfloat16", [1.5 + dp_rank] * 2]
        assert got["host"] == ["int32", [0, dp_rank + 1, 2 * (dp_rank + 1)]]
        if report["pp"] == 0:
            assert got["mismatch"] is None
        else:  # called with 2 leaves where pp rank 0 passed 3
            assert "pipeline rank 0" in got["mismatch"] and "same structure" in got["mismatch"], got["mismatch"]


def test_a_pipelined_step_trains_on_the_first_stages_rows_when_later_stages_feed_placeholders():
    result, _, trained = _run()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert sorted(trained) == list(range(PROCESSES))
    for report in trained.values():
        assert report["step_moved"] > 1e-2  # the step changed the weights, and as PyTorch's did
        assert report["max_difference"] < 1e-5, report
        # each process's forward reads its own copy of the parameters: their gradients are reduced once, after the
        # schedule's loop, not at every backward tick
        assert report["all_reduce_bytes"]["in_loop"] < 0.05 * report["parameter_bytes"], report
        assert report["all_reduce_bytes"]["outside_loop"] >= report["parameter_bytes"] / 2, report
