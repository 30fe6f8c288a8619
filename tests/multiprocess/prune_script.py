"""Trains across the launched processes and saves a partial checkpoint every step, keeping the newest two."""

import json
import sys
from pathlib import Path

import torch

import jmp as smp
import jmp.saving


@smp.step
def train_step(model, data):
    loss = model(data).square().mean()
    model.backward(loss)
    return loss


def main(root: str) -> None:
    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Linear(8, 4))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        optimizer.zero_grad()
        train_step(model, torch.ones(4, 8) * (step + 1))
        optimizer.step()
        smp.save_checkpoint(root, f"step{step}", partial=True, model=model, num_kept_partial_checkpoints=2)
    jmp.saving.wait_for_saves()
    smp.barrier()
    print(json.dumps({"rank": smp.rank(), "kept": sorted(p.name for p in Path(root).glob("*_partial"))}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
