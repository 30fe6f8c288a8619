"""The FSDP part of the SMP v2 script ``tests/tsm/launched_script.py`` runs under ``python -m jmp.launch -n 2``
(checked by ``tests/tsm/test_launched.py``, against PyTorch here): each process starts from its own initial weights
(seeded by its rank), wraps them with ``sync_module_states=True``, trains one step, and reads full state dicts with
``rank0_only=True`` and without; then each saves a ``torch.distributed.checkpoint`` with its own one-process group
and the global ``coordinator_rank`` AWS's scripts pass, and loads process 0's; and saves ``get_state_dict``'s sharded
arrays with ``torch.distributed.checkpoint.save`` (jmp's, on Orbax), steps again and loads them back."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

IN, HIDDEN, OUT = 4, 8, 2


class Net(nn.Module):
    """Two linear layers and a buffer (``sync_module_states`` sends buffers too)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)
        self.register_buffer("shift", torch.randn(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x))) + self.shift


def batch(rank: int) -> torch.Tensor:
    return torch.randn(3, IN, generator=torch.Generator().manual_seed(100 + rank))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def optimizer_for(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.05)


def plain(value):
    """``value`` with its tensors as lists, for JSON."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def run(directory: Path) -> dict:
    """What this process saw (JSON-ready), run after ``tsm.init`` with FSDP's sharding over both processes."""
    import torch.distributed as dist
    from torch.distributed import checkpoint
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    rank = dist.get_rank()
    torch.manual_seed(rank)
    net = Net()
    report = {"initial": plain(net.state_dict())}
    model = FSDP(net, sync_module_states=True)
    optimizer = optimizer_for(model.parameters())
    loss = loss_of(model(batch(rank)))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    report["loss"] = float(loss)
    rank0_only = FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *rank0_only):
        report["rank0_only"] = plain(model.state_dict())
        report["optimizer_rank0_only"] = plain(FSDP.optim_state_dict(model, optimizer))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        report["full"] = plain(model.state_dict())

    # hybrid sharding's groups as AWS's checkpoints.py uses them: a process group without global rank 0, and
    # coordinator_rank = min(get_global_ranks(group)), a global rank
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = groups[rank]
    coordinator = min(get_global_ranks(own))
    saved = {"values": torch.full((3,), float(rank)), "step": rank}
    writer = checkpoint.FileSystemWriter(str(directory / f"rank{rank}"))
    checkpoint.save_state_dict(saved, writer, process_group=own, coordinator_rank=coordinator)
    dist.barrier()
    loaded = {"values": torch.zeros(3), "step": -1}
    reader = checkpoint.FileSystemReader(str(directory / "rank0"))
    checkpoint.load_state_dict(loaded, reader, process_group=own, coordinator_rank=coordinator)
    report["coordinator"] = coordinator
    report["loaded"] = plain(loaded)
    report["dcp_names"] = [checkpoint.save_state_dict.__module__, checkpoint.load_state_dict.__module__]
    report |= sharded_checkpoint(model, optimizer, directory / "sharded", rank)
    return report


def sharded_checkpoint(model, optimizer, directory: Path, rank: int) -> dict:
    """torch.distributed.checkpoint on Orbax: ``get_state_dict``'s arrays (on both processes' devices) saved with
    ``save``, one more step, then ``load`` and ``set_state_dict``: the model's full state dict as saved."""
    import jax
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model_state, optim_state = get_state_dict(model, optimizer)
    spanning = sorted(n for n, v in model_state.items() if isinstance(v, jax.Array) and not v.is_fully_addressable)
    checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))
    loss_of(model(batch(rank))).backward()
    optimizer.step()
    optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    checkpoint.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        reloaded = plain(model.state_dict())
    names = [f.__module__ for f in (checkpoint.save, checkpoint.load, checkpoint.async_save, get_state_dict)]
    return {"sharded_spanning": spanning, "sharded_reloaded": reloaded, "sharded_names": names}
