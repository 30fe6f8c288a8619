"""Two launched processes running a plain PyTorch loop (no step function, a torch optimizer) on their own rows train
as SMP's data-parallel ranks do: each process's loss is its own rows' mean, the gradients are the mean of the
processes' (as DDP averages them). The reference is PyTorch in this one process, over the same per-process rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multiprocess import eager_loop_script as script
from tests.multiprocess.reports import json_objects
from tests.sharding.models import causal_lm

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 2


def _pytorch(processes: int) -> tuple[list[list[float]], dict]:
    """Each process's losses and the trained weights of DDP's rule in one PyTorch process: every step
    differentiates the mean of the processes' losses, each the mean over that process's rows."""
    net = causal_lm("gpt2")
    optimizer = torch.optim.SGD(net.parameters(), lr=script.LR)
    losses: list[list[float]] = [[] for _ in range(processes)]
    for ids in script.batches():
        shares = [net(input_ids=share, labels=share, use_cache=False).loss for share in ids.chunk(processes)]
        (sum(shares) / processes).backward()
        optimizer.step()
        optimizer.zero_grad()
        for rank, loss in enumerate(shares):
            losses[rank].append(loss.item())
    return losses, net.state_dict()


def test_two_processes_running_the_eager_loop_on_their_rows_train_as_ddp(tmp_path):
    command = [
        sys.executable, "-m", "jmp.launch", "-n", str(PROCESSES), "--cpu-devices", "1",
        "tests/multiprocess/eager_loop_script.py", str(tmp_path),
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = {r["rank"]: r for r in json_objects(result.stdout) if isinstance(r, dict) and "rank" in r}
    assert sorted(reports) == list(range(PROCESSES))
    expected, weights = _pytorch(PROCESSES)
    # measured: losses within 1e-7 relative, weights within 6e-8 (gradients summed over the processes instead of
    # averaged would put the weights 0.2 apart)
    for report in reports.values():
        dp_rank, dp_size = report["dp"]
        assert dp_size == PROCESSES
        np.testing.assert_allclose(report["losses"], expected[dp_rank], rtol=1e-6)
    assert expected[0] != expected[1]  # each process read its own rows' loss, not the job's
    trained = torch.load(tmp_path / "state_dict.pt", weights_only=True)
    assert trained.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-6, msg=name)
