"""A script that ``tests/multiprocess/test_step_outputs_per_process.py`` starts as 2 processes x 4 devices.

Each process feeds 16 rows whose first column is ``100 * dp_rank + row`` (its row number in its own batch) to a
step with 2 microbatches that returns that column per row, and prints one JSON line of what each StepOutput
reading gave it.
"""

from __future__ import annotations

import json

import torch

import jmp as smp

ROWS = 16  # per process


@smp.step
def row_ids(model, data):
    model(data)
    return data[:, 0]


if __name__ == "__main__":
    smp.init({"microbatches": 2})
    torch.manual_seed(0)  # the same weights on every process
    model = smp.DistributedModel(torch.nn.Linear(3, 2))
    data = torch.zeros(ROWS, 3)
    data[:, 0] = 100 * smp.dp_rank() + torch.arange(ROWS, dtype=torch.float32)
    ids = row_ids(model, data)
    readings = {
        "reduce_mean": ids.reduce_mean(),
        "reduce_sum": ids.reduce_sum(),
        "concat": ids.concat(),
        "outputs": torch.stack(ids.outputs),
    }
    report = {"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()]}
    report |= {name: value.tolist() for name, value in readings.items()}
    report["types"] = sorted({type(value).__name__ for value in [*readings.values(), *ids.outputs]})
    print(json.dumps(report), flush=True)
