"""A script that ``tests/multiprocess/test_pipeline_inputs.py`` starts as 4 processes x 1 device (pp2 x dp2).

As AWS's gpt2 example does, only the processes with ``smp.pp_rank() == 0`` read data; the others pass
placeholders (``DummyDataset``'s empty tensors, and one of yet another shape). Each process prints one JSON line
for ``pipeline_inputs.from_first_stage`` called directly, then, after one SGD step of a tiny pipelined model on
that data, one with the largest difference of its weights from PyTorch's step on every pp-rank-0 process's rows,
and the bytes its compiled step all-reduces over the data-parallel groups inside the schedule's loop and after it.
"""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import torch
import torch.nn.functional as F

import jmp as smp
from benchmarks.harness import all_reduce_bytes
from jmp.compiled_step import pipeline_inputs
from jmp.errors import StepError

ROWS = 8  # per data-parallel process


def _direct() -> dict:
    """What ``from_first_stage`` gives this process for arguments only pp rank 0 fills."""
    first = smp.pp_rank() == 0
    ids = torch.arange(6).reshape(2, 3) + 100 * smp.dp_rank() if first else torch.zeros(4, 0)
    half = torch.full((2,), 1.5 + smp.dp_rank(), dtype=torch.bfloat16) if first else torch.empty(0)
    host = np.arange(3, dtype=np.int32) * (smp.dp_rank() + 1) if first else np.zeros(7)
    got = pipeline_inputs.from_first_stage([ids, "static", half, host], smp.get_mesh())
    report = {
        "ids": got[0].tolist(),
        "static": got[1],
        "half": [str(got[2].dtype), got[2].float().tolist()],
        "host": [str(got[3].dtype), got[3].tolist()],
    }
    try:  # a later stage that passes another structure is told so; pp rank 0's tensors are ignored elsewhere
        pipeline_inputs.from_first_stage([ids, half, host] if first else [ids, half], smp.get_mesh())
        report["mismatch"] = None
    except StepError as error:
        report["mismatch"] = str(error)
    return report


@smp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


if __name__ == "__main__":
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    me = {"rank": smp.rank(), "pp": smp.pp_rank(), "dp": [smp.dp_rank(), smp.dp_size()]}
    print(json.dumps(me | {"direct": _direct()}), flush=True)

    torch.manual_seed(0)  # the same weights on every process
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    generator = torch.Generator().manual_seed(1)
    x_all = torch.randn(ROWS * smp.dp_size(), 4, generator=generator)
    y_all = torch.randint(0, 3, (ROWS * smp.dp_size(),), generator=generator)
    if smp.pp_rank() == 0:
        rows = slice(ROWS * smp.dp_rank(), ROWS * (smp.dp_rank() + 1))
        x, y = x_all[rows], y_all[rows]
    else:
        x, y = torch.zeros(ROWS, 0), torch.empty(3)  # what DummyDataset gives, and another shape
    optimizer.zero_grad()
    train_step(model, x, y)
    optimizer.step()
    trained = model.state_dict()

    # PyTorch on every pp-rank-0 process's rows: the mean loss over all of them, as the step's gradient is
    initial = copy.deepcopy(reference.state_dict())
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference(x_all), y_all).backward()
    torch_optimizer.step()
    expected = reference.state_dict()
    difference = max(float((trained[k] - expected[k]).abs().max()) for k in expected)
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in expected)
    hlo = train_step.lower(model, x, y).compile().as_text()
    reduced = all_reduce_bytes(hlo, smp.dp_size(), jax.device_count())  # over the data-parallel groups
    parameter_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    report = {"max_difference": difference, "step_moved": moved, "parameter_bytes": parameter_bytes}
    print(json.dumps(me | report | {"all_reduce_bytes": reduced}), flush=True)
