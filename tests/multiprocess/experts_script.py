"""Expert parallelism across processes: ``tests/multiprocess/test_experts_across_processes.py`` runs this under
``python -m jmp.launch -n 2 --cpu-devices 4 tests/multiprocess/experts_script.py OUT_DIR``.

The ``ep`` axis spans both processes' devices (``expert_parallel_degree`` 8 over 2 x 4), so tokens travel to
experts held by the other process. Each process feeds its half of the batch, as a data loader sharded by
``smp.dp_rank()`` would; each prints one JSON line (its rank, loss and dropped-token count) and process 0
writes the whole gradients (gathered from both processes) to OUT_DIR/grads.npz.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import torch
import torch.nn.functional as F
from jax.experimental import multihost_utils

import jmp as smp
from tests.sharding.models import MoENet

LAYOUT = {"expert_parallel_degree": 8}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (16 sequences of 6 tokens); a process passes its half."""
    generator = torch.Generator().manual_seed(3)
    return torch.randn(16, 6, 12, generator=generator), torch.randint(0, 5, (16,), generator=generator)


def net() -> MoENet:
    torch.manual_seed(0)
    return MoENet()


@smp.step
def classify_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def named_grads(model: smp.DistributedModel) -> dict[str, np.ndarray]:
    """Every gradient by torch parameter name, whole (gathered from every process holding part of it)."""
    flat = jax.tree_util.tree_flatten_with_path(model.grads)[0]
    return {
        ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): np.asarray(
            multihost_utils.process_allgather(leaf, tiled=True)
        )
        for path, leaf in flat
    }


def main(out_dir: str) -> None:
    smp.init(LAYOUT)
    model = smp.DistributedModel(net())
    x, y = batch()
    share = slice(smp.dp_rank() * 16 // smp.dp_size(), (smp.dp_rank() + 1) * 16 // smp.dp_size())
    loss = float(classify_step(model, x[share], y[share]).reduce_mean())
    jax.effects_barrier()
    experts = model.params["moe"]["experts"]["w_in"][...]
    grads = named_grads(model)
    report = {
        "rank": smp.rank(),
        "dp": [smp.dp_rank(), smp.dp_size()],
        "loss": loss,
        "dropped_tokens": int(model.dropped_tokens),
        "experts_here": sorted({s.index[0].start or 0 for s in experts.addressable_shards}),
        "experts_per_device": experts.addressable_shards[0].data.shape[0],
    }
    print(json.dumps(report), flush=True)
    if smp.rank() == 0:
        np.savez(Path(out_dir) / "grads.npz", **grads)


if __name__ == "__main__":
    main(*sys.argv[1:])
