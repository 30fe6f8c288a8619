"""A plain PyTorch loop on a wrapped model, run by each process of a launched job on its own rows.

``PYTHONPATH=. python -m jmp.launch -n 2 --cpu-devices 1 tests/multiprocess/eager_loop_script.py OUT_DIR``: no step
function, the optimizer left as torch's; each process prints one JSON line with its ranks and the losses it read,
and process 0 saves the trained ``state_dict()`` to OUT_DIR/state_dict.pt (``tests/multiprocess/test_eager_loop.py``
compares both with PyTorch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import jmp as smp
from tests.sharding.models import causal_lm, token_batches

STEPS = 3
CONFIG = {"microbatches": 2}
LR = 1.0  # SGD: the update is the gradient itself, so a gradient summed over processes shows


def batches() -> list[torch.Tensor]:
    """The global batches; each process trains on its ``dp_rank()`` share of every one."""
    return token_batches(STEPS, batch=16)


def main(out_dir: str) -> None:
    smp.init(CONFIG)
    model = smp.DistributedModel(causal_lm("gpt2"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        share = ids.chunk(smp.dp_size())[smp.dp_rank()]  # what this process's data loader yields
        loss = model(input_ids=share, labels=share, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state_dict = model.state_dict()  # gathered on every process
    print(json.dumps({"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()], "losses": losses}), flush=True)
    if smp.rank() == 0:
        torch.save(state_dict, Path(out_dir) / "state_dict.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
