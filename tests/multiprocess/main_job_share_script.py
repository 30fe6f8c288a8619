"""The main job's training (``jmp.examples.mnist``: its GroupedNet, Adadelta, its data sharing by
``ProcessShare``) for ``STEPS`` steps with dropout off, each step's per-process loss printed as JSON. Run by
``test_step_outputs_per_process.py`` under ``python -m jmp.launch`` and, as the one-process reference, in the test."""

from __future__ import annotations

import json
import sys

import torch

import jmp as smp
from jmp.examples.data import ProcessShare, digits
from jmp.examples.mnist import train_step
from jmp.examples.models import GroupedNet

STEPS = 3


def losses(batch_size: int) -> list[float]:
    """This process's ``reduce_mean()`` loss of each step, with a per-process batch of ``batch_size``."""
    smp.init({"partitions": 1, "microbatches": 1, "ddp": True})
    seed = smp.get_config().random_seed
    torch.manual_seed(seed)
    images, labels, _, _ = digits()
    share = ProcessShare(len(labels), batch_size, smp.dp_rank(), smp.dp_size(), shuffle=True, seed=seed)
    net = GroupedNet()
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # dropout's masks are drawn per process: equal in distribution, not bit for bit
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=4.0))
    found = []
    for rows, _ in zip(share, range(STEPS)):
        optimizer.zero_grad()
        _, loss = train_step(model, images[rows], labels[rows])
        optimizer.step()
        found.append(float(loss.reduce_mean()))
    return found


if __name__ == "__main__":
    result = losses(int(sys.argv[1]))
    print(json.dumps({"rank": smp.dp_rank(), "losses": result}), flush=True)
