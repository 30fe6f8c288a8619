"""Hugging Face's ``Trainer`` on its SageMaker model-parallel path, run by ``python -m jmp.launch``, trains as the same
``Trainer`` does in plain PyTorch: the same logged losses, gradient norms and learning rates step by step, and the
same weights at the end, from the same initial weights and data (``hf_trainer_job.py``; 1 process x 2 devices, so
each step's 4 rows are split over a data-parallel pair of devices).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.multiprocess.hf_trainer_job import model_config  # noqa: E402 (needs transformers)
from tests.multiprocess.reports import json_objects  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOB = "tests/multiprocess/hf_trainer_job.py"
SAGEMAKER_ENV = ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS")
TIMEOUT = 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both runs at once (plain PyTorch, and jmp.launch with SMP's parameters): their reports and final weights."""
    root = tmp_path_factory.mktemp("hf_trainer")
    torch.manual_seed(0)
    initial = root / "initial.pt"
    torch.save(transformers.GPT2LMHeadModel(model_config()).state_dict(), initial)
    env = {k: v for k, v in os.environ.items() if k not in SAGEMAKER_ENV} | {"PYTHONPATH": str(ROOT)}
    env |= {"JMP_HEARTBEAT_TIMEOUT": "30", "TOKENIZERS_PARALLELISM": "false"}
    launch = [sys.executable, "-m", "jmp.launch", "-n", "1", "--cpu-devices", "2"]
    commands = {
        "torch": [sys.executable, JOB],
        "smp": [*launch, "--mp-parameters", json.dumps({"partitions": 1, "ddp": True}), JOB],
    }
    started = {}
    for name, command in commands.items():
        (root / name).mkdir()
        started[name] = subprocess.Popen(
            [*command, str(initial), str(root / name)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    found = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=TIMEOUT)
        assert process.returncode == 0, f"{name}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
        (report,) = [r for r in json_objects(stdout) if "log" in r]
        found[name] = report | {"final": torch.load(root / name / "final.pt"), "initial": torch.load(initial)}
    return found


def test_trainer_takes_the_smp_path_under_the_launcher_only(runs):
    assert runs["torch"]["sagemaker_mp_enabled"] is False
    assert runs["torch"]["wrapped"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    smp = runs["smp"]
    assert smp["sagemaker_mp_enabled"] is True
    assert smp["is_smp_distributed_model"] and smp["is_smp_distributed_optimizer"]  # Trainer wrapped both
    # the DistributedModel takes a subclass of the user's class, named after it (as FSDP2's FSDP<Name>)
    assert smp["wrapped"] == "transformers.models.gpt2.modeling_gpt2.DistributedGPT2LMHeadModel"
    assert smp["mesh"]["dp"] == 2  # the process's 4 rows are split over its 2 devices


def test_both_runs_see_the_same_batches_and_parameter_groups(runs):
    assert runs["smp"]["batches"] == runs["torch"]["batches"]
    assert len(runs["torch"]["batches"]) == 4
    assert runs["smp"]["decayed_parameters"] == runs["torch"]["decayed_parameters"] > 0


def test_logged_losses_gradient_norms_and_learning_rates_match_pytorchs(runs):
    smp, reference = runs["smp"]["log"], runs["torch"]["log"]
    assert len(smp) == len(reference) == 4
    for step, (got, expected) in enumerate(zip(smp, reference), 1):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4), f"step {step} {key}: {got} vs {expected}"
        assert got["learning_rate"] == pytest.approx(expected["learning_rate"], rel=1e-6)
    assert reference[0]["grad_norm"] > 1.0  # max_grad_norm=1: the first step's gradients are clipped
    assert len({round(entry["loss"], 4) for entry in reference}) == 4  # every step a different loss


def test_trained_weights_match_pytorchs(runs):
    """Each tensor's update matches PyTorch's to 1e-3 of its size, and each entry to 2e-4 (2% of the learning rate):
    AdamW divides a gradient by its own root mean square, so an entry whose gradient is rounding noise moves by an
    arbitrary fraction of the learning rate in either run (the attention's key bias: the softmax over the keys is
    blind to it, and its entries move 1000 times less than the query's and value's)."""
    final, reference, initial = runs["smp"]["final"], runs["torch"]["final"], runs["torch"]["initial"]
    assert set(final) == set(reference) == set(initial)
    for name, expected in reference.items():
        update, expected_update = final[name] - initial[name], expected - initial[name]
        assert float((update - expected_update).norm()) <= 1e-3 * float(expected_update.norm()), name
        torch.testing.assert_close(final[name], expected, rtol=0, atol=2e-4, msg=name)
    moved = max(float((reference[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-2  # the steps changed the weights by far more than the tolerance
