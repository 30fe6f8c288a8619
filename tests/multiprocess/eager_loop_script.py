"""A plain PyTorch loop on a wrapped model, run by each process of a launched job on its own rows; then a batch-norm
net trained by SMP's step function the same way.

``PYTHONPATH=. python -m jmp.launch -n 2 --cpu-devices 1 tests/multiprocess/eager_loop_script.py OUT_DIR``: no step
function, the optimizer left as torch's; each process prints one JSON line with its ranks and the losses it read,
and process 0 saves the trained ``state_dict()`` to OUT_DIR/state_dict.pt; the batch-norm net's losses are in the
same line and its weights and running statistics in OUT_DIR/batch_norm.pt (``tests/multiprocess/test_eager_loop.py``
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


def batch_norm_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def batch_norm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of the batch-norm net: rows of a different scale per process, so statistics over one
    process's rows differ from statistics over both processes'."""
    generator = torch.Generator().manual_seed(2)
    scale = torch.arange(1, 17, dtype=torch.float32).unsqueeze(1) / 4
    return [
        (torch.randn(16, 6, generator=generator) * scale + shift, torch.randint(0, 3, (16,), generator=generator))
        for shift in (0, 1)
    ]


@smp.step
def batch_norm_step(model, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def train_batch_norm_net() -> tuple[list[float], dict]:
    """SMP v1's loop over the batch-norm net: each process's share, 2 microbatches, SGD."""
    model = smp.DistributedModel(batch_norm_net())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    losses = []
    for x, y in batch_norm_batches():
        rows = slice(smp.dp_rank() * 16 // smp.dp_size(), (smp.dp_rank() + 1) * 16 // smp.dp_size())
        optimizer.zero_grad()
        losses.append(batch_norm_step(model, x[rows], y[rows]).reduce_mean().item())
        optimizer.step()
    return losses, model.state_dict()


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
    batch_norm_losses, batch_norm_state = train_batch_norm_net()
    report = {"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()], "losses": losses}
    print(json.dumps(report | {"batch_norm_losses": batch_norm_losses}), flush=True)
    if smp.rank() == 0:
        torch.save(state_dict, Path(out_dir) / "state_dict.pt")
        torch.save(batch_norm_state, Path(out_dir) / "batch_norm.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
