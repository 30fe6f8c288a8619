"""Under ``python -m jmp.launch`` an SMP v2 script's ``torch.sagemaker`` is jmp's and its
``dist.init_process_group("smddp")`` starts the one default group jmp uses (gloo); ``import jmp.tsm`` in a plain
process leaves torch alone. The same launch (one for the suite's time) trains with jmp's FSDP wrapper over the two
processes, against PyTorch run here from process 0's initial weights: ``sync_module_states=True`` gives every
process process 0's values, ``rank0_only=True`` full state dicts (model and optimizer) reach rank 0 only, and
``torch.distributed.checkpoint`` takes the global ``coordinator_rank`` AWS's SMP v2 scripts pass for a group
without global rank 0; its ``save`` / ``load`` of ``get_state_dict``'s arrays are jmp's, on Orbax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import jmp.tsm  # noqa: F401
from tests.fsdp.launched_fsdp import Net, batch, loss_of, optimizer_for
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
MP_PARAMETERS = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    command = [sys.executable, "-m", "jmp.launch", "-n", "2", "--mp-parameters", json.dumps(MP_PARAMETERS)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    env.pop("SM_FRAMEWORK_PARAMS", None)
    script = ["tests/tsm/launched_script.py", str(tmp_path_factory.mktemp("checkpoints"))]
    done = subprocess.run([*command, *script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found = {r["rank"]: r for r in json_objects(done.stdout) if "rank" in r}
    assert sorted(found) == [0, 1], done.stdout
    # jmp's notices once per job, not once per process: tsm.init's config line and the launcher's backend notice
    assert done.stderr.count("jmp tsm.init(): the config comes from SM_HP_MP_PARAMETERS") == 1, done.stderr
    assert done.stderr.count("jmp torch.distributed.init_process_group('smddp') starts gloo") == 1, done.stderr
    return found


def test_an_smp_v2_scripts_start_runs_under_jmp_launch(reports):
    for rank, report in reports.items():
        assert report["world"] == 2 and report["backend"] == "gloo"
        assert report["torch_sagemaker_is_jmp_tsm"]
        assert all(name.startswith("jmp.tsm.") for name in report["names"]), report["names"]
        # a script's torch FSDP wrapper names are jmp's (SMP v2's container patches torch's FSDP); torch's own
        # modules, and the option types, keep torch's
        assert report["fsdp_names"] == {
            "FullyShardedDataParallel": "jmp.fsdp.fully_sharded",
            "apply_activation_checkpointing": "jmp.fsdp.activation_checkpointing",
            "checkpoint_wrapper": "jmp.fsdp.activation_checkpointing",
            "offload_wrapper": "jmp.fsdp.activation_checkpointing",
            "load_sharded_optimizer_state_dict": "jmp.fsdp.distributed_checkpoint",
        }
        assert report["torch_keeps"] == [
            "torch.distributed.fsdp.api",
            "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
            "torch.distributed.fsdp.fully_sharded_data_parallel",
        ]
        # one device per process, tp 2: the processes are each other's tensor-parallel peers, each its own replica
        assert report["env_config"] == {
            "tp": [rank, 2, 2, 1],
            "tp_group": [0, 1],
            "tp_sum": 3.0,
            "replicas": [[[0], [1]], 0],
        }
        # hybrid shard 1, tp 1: the processes are two data-parallel replicas of the whole model
        assert report["two_replicas"] == {
            "tp": [0, 1, 1, 1],
            "tp_group": [rank],
            "tp_sum": rank + 1.0,
            "replicas": [[[0, 1]], rank],
        }


@pytest.fixture(scope="module")
def reference(reports) -> dict:
    """One step of PyTorch from process 0's initial weights, the gradient the mean over both processes' batches
    (FSDP's), and the losses each process's batch gives before it."""
    net = Net()
    net.load_state_dict({k: torch.tensor(v) for k, v in reports[0]["fsdp"]["initial"].items()})
    optimizer = optimizer_for(net.parameters())
    losses = [loss_of(net(batch(rank))) for rank in (0, 1)]
    (sum(losses) / 2).backward()
    optimizer.step()
    names = [name for name, _ in net.named_parameters()]
    state = {names[i]: entry for i, entry in optimizer.state_dict()["state"].items()}
    return {"losses": [x.item() for x in losses], "values": net.state_dict(), "optimizer": state}


def _close(got, want) -> bool:
    return torch.allclose(torch.tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6)


def test_fsdp_sync_module_states_gives_every_process_process_0s_values(reports, reference):
    fsdp = {rank: report["fsdp"] for rank, report in reports.items()}
    assert not _close(fsdp[1]["initial"]["inp.weight"], fsdp[0]["initial"]["inp.weight"])  # not vacuous
    for rank in (0, 1):  # each process's first forward ran on process 0's values
        assert fsdp[rank]["loss"] == pytest.approx(reference["losses"][rank], rel=1e-5)
        for name, want in reference["values"].items():  # the buffer too
            assert _close(fsdp[rank]["full"][name], want), (rank, name)


def test_fsdp_rank0_only_full_state_dicts_reach_rank_0_and_the_others_get_empty_dicts(reports, reference):
    fsdp = {rank: report["fsdp"] for rank, report in reports.items()}
    assert fsdp[1]["rank0_only"] == {} and fsdp[1]["optimizer_rank0_only"] == {}
    model, optimizer = fsdp[0]["rank0_only"], fsdp[0]["optimizer_rank0_only"]
    assert sorted(model) == sorted(reference["values"])
    for name, want in reference["values"].items():
        assert _close(model[name], want), name
    assert sorted(optimizer["state"]) == sorted(reference["optimizer"])
    for name, entry in reference["optimizer"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(optimizer["state"][name][key], entry[key]), (name, key)


def test_a_distributed_checkpoint_takes_the_global_coordinator_rank_of_smp_v2_scripts(reports):
    for rank in (0, 1):  # process 1's group is [1]: torch alone reads coordinator_rank=1 as a rank in it
        fsdp = reports[rank]["fsdp"]
        assert fsdp["coordinator"] == rank
        assert fsdp["loaded"] == {"values": [0.0, 0.0, 0.0], "step": 0}
        assert fsdp["dcp_names"] == ["jmp.fsdp.distributed_checkpoint"] * 2


def test_a_scripts_dcp_save_and_load_of_get_state_dict_are_jmps_on_orbax_over_both_processes(reports):
    for rank in (0, 1):
        fsdp = reports[rank]["fsdp"]
        assert fsdp["sharded_names"] == ["jmp.fsdp.dcp_orbax"] * 3 + ["jmp.fsdp.dcp_state_dicts"]
        # jmp's arrays, on both processes' devices: Orbax writes and reads them with both
        assert fsdp["sharded_spanning"] == ["inp.bias", "inp.weight", "out.bias", "out.weight", "shift"]
        assert fsdp["sharded_reloaded"] == fsdp["full"]  # the values saved, after a step that changed them


def test_import_jmp_tsm_gives_torch_no_sagemaker_and_keeps_its_init_process_group():
    assert "torch.sagemaker" not in sys.modules and not hasattr(torch, "sagemaker")
    assert not getattr(dist.init_process_group, "jmp_any_backend", False)


def test_import_jmp_fsdp_leaves_torchs_fsdp_names_torchs():
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as wrappers
    import torch.distributed.checkpoint.optimizer as dcp_optimizer
    import torch.distributed.fsdp as fsdp

    import jmp.fsdp  # noqa: F401

    assert fsdp.FullyShardedDataParallel.__module__ == "torch.distributed.fsdp.fully_sharded_data_parallel"
    assert wrappers.offload_wrapper.__module__ == wrappers.__name__
    assert dcp_optimizer.load_sharded_optimizer_state_dict.__module__ == dcp_optimizer.__name__
