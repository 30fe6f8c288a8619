"""Two processes x 4 devices train like one process x 8 devices: the same losses on every process (rel 1e-5),
each process's step outputs are its own rows, and the gathered state_dict() matches; the checkpoint they
save together resumes in one process.

Each process feeds its share of the batch (``smp.dp_rank()`` of ``smp.dp_size()``); the one-process reference
runs here, on the test's 8 devices, on the whole batch.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import jmp as smp
from tests.multiprocess import seed_recipe_script
from tests.multiprocess.reports import json_objects
from tests.multiprocess.train_gpt2 import train
from tests.sharding.models import causal_lm, token_batches

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
FSDP_TP = {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2}
PP_ACROSS_PROCESSES = {"pipeline_parallel_degree": 2, "microbatches": 2, "placement_strategy": "PDT"}
# sharded data and tensor parallelism across the processes, each process's sequences split over two of its own
# devices (context parallelism); the one-process reference runs at FSDP_TP
CP_FSDP_TP = {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}


def _env(**extra: str) -> dict:
    return os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"} | extra


def _reports(result: subprocess.CompletedProcess, processes: int = 2) -> dict[int, dict]:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = [r for r in json_objects(result.stdout) if isinstance(r, dict) and "rank" in r]
    assert sorted(r["rank"] for r in reports) == list(range(processes)), result.stdout
    return {r["rank"]: r for r in reports}


def _launch(*args: str, devices: int = 4, **env: str) -> subprocess.CompletedProcess:
    """``python -m jmp.launch -n 2 --cpu-devices DEVICES ...``"""
    command = [sys.executable, "-m", "jmp.launch", "-n", "2", "--cpu-devices", str(devices), *args]
    return subprocess.run(command, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=300)


def _torchrun_style(*args: str) -> subprocess.CompletedProcess:
    """Two processes started with torchrun's environment by hand (what a cluster launcher sets)."""
    env = _env(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29731", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )  # fmt: skip
    children = [
        subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env | {"RANK": str(i), "LOCAL_RANK": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outputs = [child.communicate(timeout=300) for child in children]
    code = max(abs(child.returncode) for child in children)
    return subprocess.CompletedProcess(args, code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


@pytest.mark.parametrize(
    ("layout", "launcher"),
    [(CP_FSDP_TP, _launch), (PP_ACROSS_PROCESSES, _torchrun_style)],
    ids=["cp2xfsdp2xtp2-jmp.launch", "pp2-across-processes-torchrun-env"],
)
def test_two_processes_train_gpt2_like_one(tmp_path, layout, launcher):
    reports = _reports(launcher("tests/multiprocess/train_gpt2.py", json.dumps(layout), str(tmp_path)))
    expected, logits_per_step = _one_process()  # every layout computes the same (to float rounding)
    for report in reports.values():
        dp_rank, dp_size = report["dp"]
        # as under SMP, each process's loss is its own rows' (the step function ran on them)
        losses = [_loss(logits, ids, dp_rank, dp_size) for logits, ids in zip(logits_per_step, token_batches(3))]
        np.testing.assert_allclose(report["losses"], losses, rtol=1e-5)
        assert report["size"] == 2
        mine = logits_per_step[-1].chunk(dp_size)[dp_rank]  # the rows this process fed
        assert report["logits_shape"] == list(mine.shape)
        assert report["logits_sum"] == pytest.approx(float(mine.sum()), rel=1e-4)
    # the data is split over the processes; pipeline stages across processes: both feed the whole batch
    assert reports[0]["dp"][1] == (1 if layout is PP_ACROSS_PROCESSES else 2)
    for report in reports.values():  # local_state_dict()s hold pieces (fsdp4 x tp2: at most half of the model)
        assert "smp.save_checkpoint" in report["local_load_refused"]
        if layout is not PP_ACROSS_PROCESSES:
            assert report["local_numel"] <= report["numel"] // 2
            assert report["local_moment_numel"] <= report["local_numel"]
        else:
            assert report["local_numel"] == report["numel"]  # a stage's parameters are whole arrays
    gathered = torch.load(tmp_path / "state_dict.pt", weights_only=True)
    assert gathered.keys() == expected.keys()
    # AdamW turns reduction-order noise in near-zero gradients into steps of up to lr (3e-3) per element; the
    # largest difference seen is 1.0e-4 (4.6e-5 before reshard_after_forward reordered fsdp's reductions), in
    # an element of transformer.h.1.mlp.c_fc.weight: lr / 10 bounds it
    for name, value in expected.items():
        torch.testing.assert_close(gathered[name], value, rtol=0, atol=3e-4)
    # the processes' partial checkpoint resumes in this one process, on 8 devices: their values exactly
    smp.init(FSDP_TP)
    fresh = smp.DistributedModel(causal_lm("gpt2"))
    smp.DistributedOptimizer(torch.optim.AdamW(fresh.parameters(), lr=3e-3))
    smp.resume_from_checkpoint(tmp_path / "checkpoints", model=fresh)
    resumed = fresh.state_dict()
    assert all(torch.equal(resumed[name], gathered[name]) for name in gathered)


@functools.cache
def _one_process() -> tuple[dict, list[torch.Tensor]]:
    """(state_dict, each step's logits) of the run on one process with the test's 8 devices."""
    model, _, logits_per_step = train(FSDP_TP)
    return model.state_dict(), logits_per_step


def _loss(logits: torch.Tensor, ids: torch.Tensor, rank: int, size: int) -> float:
    """Hugging Face's causal-LM loss over the rows of ``rank`` of ``size`` equal shares."""
    logits, ids = logits.chunk(size)[rank], ids.chunk(size)[rank]
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def test_the_seed_recipe_with_two_processes_equals_one(monkeypatch):
    config = {"microbatches": 2, "ddp": True}
    # one device per process: data parallel over processes as with four (which makes each step 4x slower on CPU)
    script = "tests/multiprocess/seed_recipe_script.py"
    reports = _reports(_launch(script, devices=1, SM_HP_MP_PARAMETERS=json.dumps(config)))
    # one process, the same global batches: each step joins the two processes' batches of that step
    smp.init(config)
    images, labels = seed_recipe_script.dataset().tensors
    half = seed_recipe_script.ROWS // 2
    torch.manual_seed(0)
    model = smp.DistributedModel(seed_recipe_script.Digits())
    optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=4.0))
    losses = {0: [], 1: []}  # each process's loss is its own rows' (the step function ran on them, as SMP's)
    for step in range(2):
        rows = torch.cat(
            [torch.arange(64 * step, 64 * step + 64), torch.arange(half + 64 * step, half + 64 * step + 64)]
        )
        optimizer.zero_grad()
        output, _ = seed_recipe_script.train_step(model, images[rows], labels[rows])
        optimizer.step()
        for rank, (log_probs, targets) in enumerate(zip(output.concat().chunk(2), labels[rows].chunk(2))):
            losses[rank].append(float(torch.nn.functional.nll_loss(log_probs, targets)))
    for report in reports.values():
        assert report["dp"][1] == 2
        np.testing.assert_allclose(report["losses"], losses[report["dp"][0]], rtol=1e-5)


def test_processes_with_different_configs_all_stop_with_an_error():
    result = _launch("tests/multiprocess/mismatch.py")
    assert result.returncode != 0
    assert "the smp config differs between processes: processes [1]" in result.stderr
    assert "not reached" not in result.stdout
