"""Two SGD steps of a kinked CNN (``kinked_cnns``) under jmp and under float32 PyTorch (contiguous and channels-last),
each against float64 PyTorch replaying that run's decisions; prints one JSON line per run.

Run by ``test_cnn_numerics.py`` in a process of its own with XLA's optimisation passes on (the suite's
``conftest`` turns them off; the real kernels, YNNPACK's or Eigen's, are chosen only with them on)::

    python -m tests.compiled_step.cnn_numerics_worker resnet18:dp8:2 shufflenet_v2:sdp8:4

Each run is a model of ``kinked_cnns.MODELS``, a layout (``dp8``: ``{}``; ``sdp8``:
``{"sharded_data_parallel_degree": 8}``) and the rows each of the 8 devices gets. Errors are measured as
``benchmarks.cnn_numerics.errors`` measures them.
"""

from __future__ import annotations

import copy
import json
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np
import torch
import torch.nn.functional as F

import jmp as smp
from benchmarks.cnn_numerics import DEVICES, LAYOUTS, LR, MOMENTUM, STEPS, errors
from tests.compiled_step.kinked_cnns import MODELS

IMAGE = 32


def _batches(rows: int):
    generator = torch.Generator().manual_seed(1)
    batch = DEVICES * rows
    return [
        (torch.randn(batch, 3, IMAGE, IMAGE, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(STEPS)
    ]


def _state(module) -> dict[str, np.ndarray]:
    return {k: v.detach().double().numpy() for k, v in module.state_dict().items() if v.is_floating_point()}


def _torch_float32(net, batches, memory_format=torch.contiguous_format):
    """float32 PyTorch's state after the steps, and each step's decisions."""
    model = copy.deepcopy(net).to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    decisions = []
    for images, labels in batches:
        optimizer.zero_grad()
        logits, *taken = model(images.contiguous(memory_format=memory_format))
        F.cross_entropy(logits, labels).backward()
        optimizer.step()
        decisions.append([d.detach() for d in taken])
    return _state(model), decisions


def _replayed_float64(net, batches, decisions):
    """float64 PyTorch's state after the steps, each forward taking the given decisions; the largest margin of a
    decision taken that float64 would not have taken, and how many there were (``kinked_cnns.Replay``)."""
    model = copy.deepcopy(net).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    largest_margin, differing = 0.0, 0
    for (images, labels), taken in zip(batches, decisions):
        optimizer.zero_grad()
        logits, replay = model.replay(images.double(), taken)
        F.cross_entropy(logits, labels).backward()
        optimizer.step()
        largest_margin, differing = max(largest_margin, replay.largest_margin), differing + replay.differing
    return _state(model), largest_margin, differing


@smp.step
def _train_step(model, images, labels):
    logits, *decisions = model(images)
    loss = F.cross_entropy(logits, labels)
    model.backward(loss)
    return (loss, *decisions)


def _jmp(net, batches, layout: str):
    smp.init(LAYOUTS[layout])
    model = smp.DistributedModel(copy.deepcopy(net))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    decisions = []
    for images, labels in batches:
        optimizer.zero_grad()
        _, *taken = _train_step(model, images, labels)
        optimizer.step()
        decisions.append([d.concat() for d in taken])
    return _state(model), decisions


def run(name: str, layout: str, rows: int) -> dict:
    torch.manual_seed(0)
    net = MODELS[name]().train()
    batches = _batches(rows)
    initial = _state(net)
    torch32, torch_decisions = _torch_float32(net, batches)
    torch32_cl, torch_cl_decisions = _torch_float32(net, batches, torch.channels_last)
    jmp32, jmp_decisions = _jmp(net, batches, layout)
    record = {"model": name, "layout": layout, "rows": rows}
    for run_name, state, decisions in (
        ("jmp", jmp32, jmp_decisions),
        ("torch", torch32, torch_decisions),
        ("torch_channels_last", torch32_cl, torch_cl_decisions),
    ):
        expected, margin, differing = _replayed_float64(net, batches, decisions)
        record[run_name] = errors(initial, state, expected)
        record[f"{run_name}_decisions_not_float64s"] = differing
        record[f"{run_name}_largest_margin"] = margin
    return record


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        model_name, layout, rows = spec.split(":")
        print(json.dumps(run(model_name, layout, int(rows))), flush=True)
