"""Two launched processes running a plain PyTorch loop (no step function, a torch optimizer) on their own rows train
as SMP's data-parallel ranks do: each process's loss is its own rows' mean, the gradients are the mean of the
processes' (as DDP averages them). The reference is PyTorch in this one process, over the same per-process rows.

The same processes then train a batch-norm net with SMP's step function, as SMP's data-parallel ranks (PyTorch DDP
without SyncBatchNorm) do: each microbatch normalised over its own rows, the running statistics of process 0 kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

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


def _batch_norm_pytorch(processes: int, microbatches: int) -> tuple[list[list[float]], dict]:
    """DDP's rule for the batch-norm net in one PyTorch process: every step starts each process from process 0's
    running statistics (DDP broadcasts its buffers); each microbatch's forward normalises over its own rows and
    updates its process's statistics; the update is from the mean of all the processes' microbatch losses."""
    net = script.batch_norm_net()
    params = dict(net.named_parameters())
    buffers = {name: value.clone() for name, value in net.named_buffers()}
    optimizer = torch.optim.SGD(net.parameters(), lr=script.LR)
    losses: list[list[float]] = [[] for _ in range(processes)]
    for x, y in script.batch_norm_batches():
        total, kept = 0.0, None
        for rank, (xr, yr) in enumerate(zip(x.chunk(processes), y.chunk(processes))):
            mine = {name: value.clone() for name, value in buffers.items()}  # updated in place by each forward
            shares = [
                F.cross_entropy(functional_call(net, params | mine, (xm,)), ym)
                for xm, ym in zip(xr.chunk(microbatches), yr.chunk(microbatches))
            ]
            total = total + sum(shares) / (processes * microbatches)
            losses[rank].append(sum(shares).item() / microbatches)
            kept = mine if rank == 0 else kept
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        buffers = kept
    return losses, {name: value.detach() for name, value in params.items()} | buffers


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

    expected, state = _batch_norm_pytorch(PROCESSES, script.CONFIG["microbatches"])
    for report in reports.values():
        np.testing.assert_allclose(report["batch_norm_losses"], expected[report["dp"][0]], rtol=1e-5)
    trained = torch.load(tmp_path / "batch_norm.pt", weights_only=True)
    assert trained.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the statistics of process 0's rows, not of the whole batch (SyncBatchNorm's): the rows' scale differs
    x, _ = script.batch_norm_batches()[0]
    whole = script.batch_norm_net()[0](x).var(0)
    assert not torch.allclose(whole, script.batch_norm_net()[0](x.chunk(PROCESSES)[0]).var(0), rtol=0.5)
