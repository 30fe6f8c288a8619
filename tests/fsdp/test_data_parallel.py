"""A torchrun DDP script (``tests/fsdp/ddp_script.py``: ``no_sync()`` gradient accumulation, torchrun's
environment, host-tensor collectives, each process starting from its own weights) runs under ``python -m jmp.launch``
with no edit, its ``DistributedDataParallel`` jmp's, and trains as PyTorch's DDP does on gloo with the same number
of processes: the same losses on every process and the same final weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.parallel.distributed import _MixedPrecision

import jmp as smp
from jmp.errors import ArgumentTypeError
from jmp.fsdp import DistributedDataParallel
from jmp.runtime import notices
from tests.fsdp import ddp_script
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 2
# float32: each weight is 3 SGD updates of sums of at most 16 x 4 products, rounded (2^-24 relative) in another
# order by XLA than by torch; 1e-5 on values of order 1 is a hundred roundings' worth
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _reports(command: list[str]) -> dict[int, dict]:
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    found = {r["rank"]: r for r in json_objects(done.stdout) if isinstance(r, dict) and "rank" in r}
    assert sorted(found) == list(range(PROCESSES)), done.stdout[-2000:]
    return found


def test_a_torchrun_ddp_script_with_no_sync_trains_under_jmp_launch_as_on_pytorchs_ddp():
    script = "tests/fsdp/ddp_script.py"
    pytorch = _reports(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PROCESSES}", script, "gloo", "cpu"]
    )
    jmp = _reports(
        [sys.executable, "-m", "jmp.launch", "-n", str(PROCESSES), "--cpu-devices", "2", script, "nccl", "cuda"]
    )
    syncing = [False] * (ddp_script.ACCUMULATE - 1) + [True]
    for rank in range(PROCESSES):
        ours, theirs = jmp[rank], pytorch[rank]
        assert theirs["ddp_class"] == "torch.nn.parallel.distributed"
        assert ours["ddp_class"] == ours["ddp_class_in_distributed"] == "jmp.fsdp.data_parallel"
        assert ours["env"] == [rank, rank, PROCESSES] and ours["world"] == PROCESSES
        assert ours["all_reduce"] == theirs["all_reduce"] == 3.0
        assert ours["syncing"] == theirs["syncing"] == syncing * ddp_script.STEPS
        np.testing.assert_allclose(ours["losses"], theirs["losses"], **TOLERANCE)
        assert ours["weights"].keys() == theirs["weights"].keys()
        for name, value in theirs["weights"].items():
            np.testing.assert_allclose(ours["weights"][name], value, **TOLERANCE, err_msg=name)
    assert jmp[0]["losses"] != jmp[1]["losses"]  # each process's loss is its own rows'


def test_ddp_mixed_precision_trains_as_jmps_own_bf16_loop_bit_for_bit():
    def train(model) -> list[float]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        losses = []
        for step in range(2):
            x, y = ddp_script.rows(0, step, 0)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    smp.init({})
    torch.manual_seed(0)
    model = DistributedDataParallel(ddp_script.net(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    assert smp.get_config().bf16 and model.precision.mixed
    losses = train(model)
    smp.init({"bf16": True})
    torch.manual_seed(0)
    assert train(smp.DistributedModel(ddp_script.net())) == losses


def test_ddp_loads_pytorch_ddps_state_dict_keys_and_refuses_what_ddp_does_not_take(caplog, monkeypatch):
    caplog.set_level("INFO", logger="jmp")
    monkeypatch.setattr(notices, "_SAID", set())  # said once per process: as if this were the first wrapper
    smp.init({})
    torch.manual_seed(0)
    net = ddp_script.net()
    model = DistributedDataParallel(ddp_script.net(), device_ids=[0], find_unused_parameters=True)
    assert "DistributedDataParallel(find_unused_parameters=True): has no effect" in caplog.text
    assert "device_ids" not in caplog.text  # what every GPU script passes goes unsaid
    model.load_state_dict({f"module.{name}": value for name, value in net.state_dict().items()})
    for name, value in net.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    assert model.module.state_dict().keys() == net.state_dict().keys()
    with pytest.raises(ArgumentTypeError, match="bucket_size"):
        DistributedDataParallel(ddp_script.net(), bucket_size=1)
    with pytest.raises(ArgumentTypeError, match="already laid out"):
        DistributedDataParallel(model)
