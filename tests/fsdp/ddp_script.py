"""A torchrun DDP script as people write it, with no jmp in it: ``init_process_group``, ``DDP(model,
device_ids=[local_rank])`` from torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, gradient accumulation with
``no_sync()``, an optimizer built on the module before it is wrapped, host-tensor collectives, ``model.module``,
``destroy_process_group``.

``torchrun --nproc-per-node 2 tests/fsdp/ddp_script.py gloo cpu`` runs it on PyTorch's DDP on CPU, ``python -m
jmp.launch -n 2 tests/fsdp/ddp_script.py nccl cuda`` on jmp's, as the script would run on GPUs: the backend is the
script's (jmp starts gloo for any), and ``cuda`` passes ``device_ids=[local_rank]`` (PyTorch's DDP takes them for
GPU modules only). Each process prints one JSON line: what it saw, its losses, and the trained weights
(``tests/fsdp/test_data_parallel.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, ACCUMULATE, ROWS = 3, 2, 4  # ROWS per process per backward


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def rows(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's rows for one backward: different on every process and every backward."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(ROWS, 6, generator=generator), torch.randn(ROWS, 3, generator=generator)


def main(backend: str, device: str) -> None:
    dist.init_process_group(backend)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.manual_seed(rank)  # each process its own initial weights: DDP gives every one process 0's
    module = net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)  # built before wrapping, as often
    model = DDP(module, device_ids=[local_rank] if device == "cuda" else None)
    losses, syncing = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            last = micro == ACCUMULATE - 1
            with contextlib.nullcontext() if last else model.no_sync():
                syncing.append(model.require_backward_grad_sync)
                x, y = rows(rank, step, micro)
                loss = F.mse_loss(model(x), y) / ACCUMULATE
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    dist.barrier()
    report = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": [rank, local_rank, int(os.environ["WORLD_SIZE"])],
        "ddp_class": DDP.__module__,
        "ddp_class_in_distributed": torch.nn.parallel.distributed.DistributedDataParallel.__module__,
        "syncing": syncing,
        "all_reduce": total.item(),
        "losses": losses,
        "weights": {name: value.tolist() for name, value in model.module.state_dict().items()},
    }
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
