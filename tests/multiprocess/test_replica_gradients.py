"""Processes feeding the batch, with microbatches, holding one data-parallel replica each or four (4 x 1 and 2 x 4
processes x devices), and with tensor parallelism beside (a replica fed by two processes, or two replicas held by
one): each replica's gradients stay on its device through the microbatch loop and are all-reduced once after it (DDP's
``no_sync``), with DDP's numbers: the mean over the processes of each process's mean over its microbatches, from
PyTorch on the same rows. The same launch trains an fp8 Linear, checked against TE's recipe emulated in torch:
its scales are the whole batch's across processes."""

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
from tests.multiprocess.replica_gradients_model import FP8_FACTORS, FP8_ROWS, batch, fp8_batch, fp8_linear, net
from tests.precision.te_emulation import HISTORY, TorchDelayedScaling

ROOT = Path(__file__).resolve().parents[2]
MICROBATCHES = 2


@pytest.mark.parametrize("processes, devices", [(4, 1), (2, 4)])
def test_each_replica_keeps_its_gradients_through_the_loop_and_reduces_them_once(tmp_path, processes, devices):
    command = [sys.executable, "-m", "jmp.launch", "-n", str(processes), "--cpu-devices", str(devices)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
    result = subprocess.run(
        [*command, "tests/multiprocess/replica_gradients_script.py", str(tmp_path), str(HISTORY)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in range(processes)]

    reference = net()
    images, labels = batch()
    for rank_images, rank_labels in zip(images.chunk(processes), labels.chunk(processes)):
        for mb_images, mb_labels in zip(rank_images.chunk(MICROBATCHES), rank_labels.chunk(MICROBATCHES)):
            (F.nll_loss(reference(mb_images), mb_labels) / (processes * MICROBATCHES)).backward()
    parameter_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    for report in reports:
        assert report["dp"] == [report["rank"], processes]
        assert report["stacked"]  # the layer list's copies carry the layer axis first
        for name, p in reference.named_parameters():
            assert_close(torch.tensor(report["grads"][name]), p.grad, 1e-5, floor=1e-6)
        # inside the loop only the loss; the gradients once, after it (over the processes and within each)
        assert report["all_reduce_bytes"]["in_loop"] < 0.01 * parameter_bytes
        assert report["all_reduce_bytes"]["outside_loop"] >= parameter_bytes
        # tp2, each tensor-parallel rank feeding rows of its own: at 4 x 1 a replica fed by two processes; at 2 x 4
        # a process holding two replicas, whose gradients it sums each microbatch (no copies of split parameters)
        tp = report["tp2"]
        for name, p in reference.named_parameters():
            assert_close(torch.tensor(tp["grads"][name]), p.grad, 1e-5, floor=1e-6)
        # what the loop all-reduced per microbatch beyond the tensor-parallel layers' activations: the gradients
        # (each device's tp shard of them), now reduced once after it
        left_the_loop = tp["all_reduce_bytes_per_microbatch"]["in_loop"] - tp["all_reduce_bytes"]["in_loop"]
        assert left_the_loop >= 0.99 * tp["all_reduce_bytes"]["outside_loop"] >= 0.99 * parameter_bytes / 2
    for microbatches in (1, 2):
        fp8_reports = [report["fp8"][str(microbatches)] for report in reports]
        _check_fp8(fp8_reports, processes, processes * devices, microbatches)


def _microbatch_rows(rows: int, shards: int, microbatches: int) -> list[list[int]]:
    """Each data-parallel shard splits its own rows (a process's share is its shards'): microbatch m takes the m-th
    run of every shard."""
    run = rows // shards // microbatches
    return [[s * rows // shards + m * run + i for s in range(shards) for i in range(run)] for m in range(microbatches)]


def _check_fp8(reports: list[dict], processes: int, shards: int, microbatches: int) -> None:
    """An fp8 Linear: with microbatches, each replica multiplies its rows with its own copy of the weight (no
    weight-gradient all-reduce in the loop), while every scale is the whole microbatch's, as TE's amax reduction
    over the data-parallel group makes it: the torch emulation on all of the microbatch's rows. Summing the
    processes' gradient amaxes instead of taking their maximum puts the gradient scale off from the second step
    on."""
    linear = fp8_linear()
    emulation = TorchDelayedScaling(linear.weight.detach().clone(), linear.bias.detach().clone())
    x, grad_out = fp8_batch()
    for step, factor in enumerate(FP8_FACTORS):
        rows = _microbatch_rows(FP8_ROWS, shards, microbatches)
        expected = [emulation.step(x[microbatch] * factor, grad_out[microbatch] * factor) for microbatch in rows]
        weight_grad = sum(e[1] for e in expected) / (microbatches * processes)
        bias_grad = sum(e[2] for e in expected) / (microbatches * processes)
        for report in reports:
            grads, state = report["steps"][step]["grads"], report["steps"][step]["state"]
            assert_close(torch.tensor(grads["weight"]), weight_grad, 1e-6)
            assert_close(torch.tensor(grads["bias"]), bias_grad, 1e-6, floor=1e-9)
            for name, scaling in (("input", emulation.input), ("grad", emulation.grad)):
                assert_close(torch.tensor(state[f"fp8/{name}_amax_history"]), torch.tensor(scaling.history), 1e-7)
                assert_close(torch.tensor(state[f"fp8/{name}_scale"]), torch.tensor(scaling.scale), 1e-7)
    if microbatches > 1:
        assert all(report["all_reduce_bytes"]["in_loop"] < linear.weight.numel() for report in reports)  # amaxes
