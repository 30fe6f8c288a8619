"""Under ``python -m jmp.launch`` an SMP v2 script's ``torch.sagemaker`` is jmp's and its
``dist.init_process_group("smddp")`` starts the one default group jmp uses (gloo); ``import jmp.tsm`` in a plain
process leaves torch alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import jmp.tsm  # noqa: F401
from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[2]
MP_PARAMETERS = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}


def test_an_smp_v2_scripts_start_runs_under_jmp_launch():
    command = [sys.executable, "-m", "jmp.launch", "-n", "2", "--mp-parameters", json.dumps(MP_PARAMETERS)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    env.pop("SM_FRAMEWORK_PARAMS", None)
    done = subprocess.run(
        [*command, "tests/tsm/launched_script.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    reports = {r["rank"]: r for r in json_objects(done.stdout) if "rank" in r}
    assert sorted(reports) == [0, 1], done.stdout
    # jmp's notices once per job, not once per process: tsm.init's config line and the launcher's backend notice
    assert done.stderr.count("jmp tsm.init(): the config comes from SM_HP_MP_PARAMETERS") == 1, done.stderr
    assert done.stderr.count("jmp torch.distributed.init_process_group('smddp') starts gloo") == 1, done.stderr
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
