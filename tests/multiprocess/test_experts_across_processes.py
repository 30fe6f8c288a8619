"""Expert parallelism whose ``ep`` axis spans two processes computes what one process and PyTorch compute:
each process's loss on its half of the batch, and the gradients (the mean of the halves', gathered whole)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.multiprocess import experts_script
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
# the launcher's file run alone: `python -m jmp.launch` would import the jmp package (torch and JAX) beside the two
LAUNCHER_ALONE = [sys.executable, "-c", "import runpy; runpy.run_path('jmp/launch.py', run_name='__main__')"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[dict[int, dict], dict[str, np.ndarray]]:
    """(each rank's report, the gradients process 0 gathered) of the script run over 2 processes x 4 devices."""
    out = tmp_path_factory.mktemp("experts")
    command = [*LAUNCHER_ALONE, "-n", "2", "--cpu-devices", "4", "tests/multiprocess/experts_script.py", str(out)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = {r["rank"]: r for r in json_objects(result.stdout) if "rank" in r}
    assert sorted(reports) == [0, 1], result.stdout
    with np.load(out / "grads.npz") as grads:
        return reports, dict(grads)


def test_each_process_holds_half_the_experts_and_feeds_half_the_batch(launched):
    reports, _ = launched
    assert [reports[r]["dp"] for r in (0, 1)] == [[0, 2], [1, 2]]
    assert reports[0]["experts_here"] == [0, 1, 2, 3] and reports[1]["experts_here"] == [4, 5, 6, 7]
    assert all(reports[r]["experts_per_device"] == 1 and reports[r]["dropped_tokens"] == 0 for r in (0, 1))


def test_losses_and_gradients_equal_pytorch_and_one_process(launched):
    reports, grads = launched
    net = experts_script.net()
    x, y = experts_script.batch()
    halves = (slice(0, 8), slice(8, 16))
    with torch.no_grad():
        torch_losses = [F.cross_entropy(net(x[h]), y[h]).item() for h in halves]
    np.testing.assert_allclose([reports[r]["loss"] for r in (0, 1)], torch_losses, rtol=1e-6)
    F.cross_entropy(net(x), y).backward()  # the halves' mean: both halves have 8 rows
    smp.init(experts_script.LAYOUT)  # the same layout in this process, over its 8 devices
    model = smp.DistributedModel(experts_script.net())
    one_process_loss = float(experts_script.classify_step(model, x, y).reduce_mean())
    one_process = named_grads(model.grads)
    np.testing.assert_allclose(one_process_loss, np.mean(torch_losses), rtol=1e-6)
    assert sorted(grads) == sorted(one_process) == sorted(n for n, _ in net.named_parameters())
    for name, parameter in net.named_parameters():
        expected = parameter.grad.numpy()
        assert np.linalg.norm(grads[name] - expected) <= 1e-6 * np.linalg.norm(expected), name
        np.testing.assert_allclose(grads[name], one_process[name], rtol=1e-5, atol=1e-7, err_msg=name)
