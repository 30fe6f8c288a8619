"""Two processes feeding the batch, with microbatches, holding one data-parallel replica each or two: each
replica's gradients stay on its device through the microbatch loop and are all-reduced once after it (DDP's
``no_sync``), with DDP's numbers: the mean over the processes of each process's mean over its microbatches, from
PyTorch on the same rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close
from tests.multiprocess.replica_gradients_model import batch, net

ROOT = Path(__file__).resolve().parents[2]
PROCESSES, MICROBATCHES = 2, 2


@pytest.mark.parametrize("replicas_per_process", [1, 2])
def test_each_replica_keeps_its_gradients_through_the_loop_and_reduces_them_once(tmp_path, replicas_per_process):
    devices = str(replicas_per_process)
    command = [sys.executable, "-m", "jmp.launch", "-n", str(PROCESSES), "--cpu-devices", devices]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    result = subprocess.run(
        [*command, "tests/multiprocess/replica_gradients_script.py", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in range(PROCESSES)]

    reference = net()
    images, labels = batch()
    for rank_images, rank_labels in zip(images.chunk(PROCESSES), labels.chunk(PROCESSES)):
        for mb_images, mb_labels in zip(rank_images.chunk(MICROBATCHES), rank_labels.chunk(MICROBATCHES)):
            (F.nll_loss(reference(mb_images), mb_labels) / (PROCESSES * MICROBATCHES)).backward()
    parameter_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    for report in reports:
        assert report["dp"] == [report["rank"], PROCESSES]
        assert report["stacked"]  # the layer list's copies carry the layer axis first
        for name, p in reference.named_parameters():
            assert_close(torch.tensor(report["grads"][name]), p.grad, 1e-5, floor=1e-6)
        # inside the loop only the loss; the gradients once, after it (over the processes and within each)
        assert report["all_reduce_bytes"]["in_loop"] < 0.01 * parameter_bytes
        assert report["all_reduce_bytes"]["outside_loop"] >= parameter_bytes
