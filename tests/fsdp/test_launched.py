"""jmp's FSDP wrapper over two processes under ``python -m jmp.launch`` (``launched_script.py``), against PyTorch
run here from process 0's initial weights: ``sync_module_states=True`` gives every process process 0's values,
``rank0_only=True`` full state dicts (model and optimizer) reach rank 0 only, and ``torch.distributed.checkpoint``
takes the global ``coordinator_rank`` AWS's SMP v2 scripts pass for a group without global rank 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fsdp.launched_script import Net, batch, loss_of, optimizer_for
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    directory = tmp_path_factory.mktemp("checkpoints")
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    env.pop("SM_FRAMEWORK_PARAMS", None)
    done = subprocess.run(
        [sys.executable, "-m", "jmp.launch", "-n", "2", "tests/fsdp/launched_script.py", str(directory)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found = {r["rank"]: r for r in json_objects(done.stdout) if "rank" in r}
    assert sorted(found) == [0, 1], done.stdout
    return found


@pytest.fixture(scope="module")
def reference(reports) -> dict:
    """One step of PyTorch from process 0's initial weights, the gradient the mean over both processes' batches
    (FSDP's), and the losses each process's batch gives before it."""
    net = Net()
    net.load_state_dict({k: torch.tensor(v) for k, v in reports[0]["initial"].items()})
    optimizer = optimizer_for(net.parameters())
    losses = [loss_of(net(batch(rank))) for rank in (0, 1)]
    (sum(losses) / 2).backward()
    optimizer.step()
    names = [name for name, _ in net.named_parameters()]
    state = {names[i]: entry for i, entry in optimizer.state_dict()["state"].items()}
    return {"losses": [x.item() for x in losses], "values": net.state_dict(), "optimizer": state}


def _close(got, want) -> bool:
    return torch.allclose(torch.tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6)


def test_sync_module_states_gives_every_process_process_0s_values(reports, reference):
    assert not _close(reports[1]["initial"]["inp.weight"], reports[0]["initial"]["inp.weight"])  # not vacuous
    for rank in (0, 1):  # each process's first forward ran on process 0's values
        assert reports[rank]["loss"] == pytest.approx(reference["losses"][rank], rel=1e-5)
        for name, want in reference["values"].items():  # the buffer too
            assert _close(reports[rank]["full"][name], want), (rank, name)


def test_rank0_only_full_state_dicts_reach_rank_0_and_the_others_get_empty_dicts(reports, reference):
    assert reports[1]["rank0_only"] == {} and reports[1]["optimizer_rank0_only"] == {}
    model, optimizer = reports[0]["rank0_only"], reports[0]["optimizer_rank0_only"]
    assert sorted(model) == sorted(reference["values"])
    for name, want in reference["values"].items():
        assert _close(model[name], want), name
    assert sorted(optimizer["state"]) == sorted(reference["optimizer"])
    for name, entry in reference["optimizer"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(optimizer["state"][name][key], entry[key]), (name, key)


def test_a_checkpoint_takes_the_global_coordinator_rank_of_smp_v2_scripts(reports):
    for rank in (0, 1):  # process 1's group is [1]: torch alone reads coordinator_rank=1 as a rank in it
        assert reports[rank]["coordinator"] == rank
        assert reports[rank]["loaded"] == {"values": [0.0, 0.0, 0.0], "step": 0}
        assert reports[rank]["dcp_names"] == ["jmp.fsdp.distributed_checkpoint"] * 2
