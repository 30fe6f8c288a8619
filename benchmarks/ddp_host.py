"""Run a PyTorch DDP example script as torchrun runs it on GPUs, on a host without CUDA, and record what it trained:
``ddp_host.py OUT SCRIPT [args...]`` in each process of ``torchrun`` or ``python -m jmp.launch``.

What this adds around the unmodified script is what a CPU host lacks, each piece only when torch has no CUDA:
``torch.cuda.set_device`` and ``torch.accelerator.set_device_index`` do nothing, ``torch.accelerator`` reports
``LOCAL_WORLD_SIZE`` devices whose type is ``cpu`` (so ``get_default_backend_for_device`` gives gloo), and
``.to(N)`` / ``.to("cuda:N")`` of a module or tensor keeps it on the CPU, and ``pin_memory()`` (a
``DataLoader(pin_memory=True)`` pins for copies to a GPU) gives the tensor back. Where the script's
``DistributedDataParallel`` is PyTorch's own (the reference, under torchrun), its ``device_ids`` are dropped for a
CPU module, as PyTorch's DDP takes them for GPU modules only, and ``init_process_group("nccl")`` starts gloo (NCCL
needs CUDA); jmp's DDP is given them as written, and jmp's launcher starts gloo for any backend itself.

To compare runs: torch's generator is seeded with the process's rank before the script runs (the scripts draw their
data and initial weights unseeded: the same draws under both launchers; DDP gives every process process 0's
weights), each ``backward()``'s tensor and each DDP model are kept, and at ``destroy_process_group`` this process
writes ``OUT/rank{RANK}.json``: the losses backpropagated and the DDP model's ``module.state_dict()``, once wrapped
and at the end.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel  # jmp's under jmp.launch, torch's under torchrun


def _on_cpu(device):
    """``device`` with a CUDA device (an index, ``"cuda:N"``, ``torch.device("cuda", N)``) as the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _keeping_on_cpu(to):
    @functools.wraps(to)
    def call(self, *args, **kwargs):
        args = tuple(_on_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return to(self, *args, **kwargs)

    return call


def stand_in_for_cuda() -> None:
    """What the scripts ask of CUDA and the accelerator API, on a torch without CUDA."""
    if torch.cuda.is_available():
        return
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.cuda.set_device = lambda device: None
    torch.accelerator.is_available = lambda: True
    torch.accelerator.device_count = lambda: devices
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")
    torch.accelerator.set_device_index = lambda device: None
    torch.nn.Module.to = _keeping_on_cpu(torch.nn.Module.to)
    torch.Tensor.to = _keeping_on_cpu(torch.Tensor.to)
    torch.Tensor.pin_memory = lambda self, device=None: self  # DataLoader(pin_memory=True): for copies to a GPU
    if DistributedDataParallel.__module__.startswith("torch."):
        init = DistributedDataParallel.__init__

        @functools.wraps(init)
        def without_gpu_ids(self, module, device_ids=None, *args, **kwargs):
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            init(self, module, None if on_cpu else device_ids, *args, **kwargs)

        DistributedDataParallel.__init__ = without_gpu_ids
        start = dist.init_process_group

        @functools.wraps(start)
        def on_gloo(backend=None, *args, **kwargs):
            return start("gloo" if backend in ("nccl", "cuda:nccl") else backend, *args, **kwargs)

        dist.init_process_group = on_gloo


def record(out: Path) -> None:
    """Keep each ``backward()``'s tensor; write the losses and the DDP model's weights before the group goes."""
    losses: list[torch.Tensor] = []
    backward = torch.Tensor.backward

    @functools.wraps(backward)
    def keeping_the_loss(self, *args, **kwargs):
        losses.append(self)
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = keeping_the_loss
    initial: dict[str, list] = {}  # the first model's weights once wrapped (process 0's, DDP having sent them)
    models: list[torch.nn.Module] = []  # kept alive: a script's model may be gone before destroy_process_group
    init = DistributedDataParallel.__init__

    @functools.wraps(init)
    def keeping_the_model(self, *args, **kwargs):
        init(self, *args, **kwargs)
        models.append(self)
        initial.update({name: value.tolist() for name, value in self.module.state_dict().items()})

    DistributedDataParallel.__init__ = keeping_the_model
    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def reporting_first(*args, **kwargs):
        weights = {name: value.tolist() for name, value in models[0].module.state_dict().items()} if models else {}
        report = {
            "rank": dist.get_rank(),
            "ddp": DistributedDataParallel.__module__,
            "losses": [loss.item() for loss in losses],
            "weights": weights,
            "initial_weights": initial,
        }
        (out / f"rank{report['rank']}.json").write_text(json.dumps(report))
        return destroy(*args, **kwargs)

    dist.destroy_process_group = reporting_first


def main() -> None:
    out, script, *args = sys.argv[1:]
    torch.manual_seed(int(os.environ["RANK"]))
    stand_in_for_cuda()
    record(Path(out).resolve())
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
