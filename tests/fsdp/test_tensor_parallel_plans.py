"""PyTorch tensor parallelism as torchtitan writes it: ``init_device_mesh`` (dp_shard x tp), ``parallelize_module``
with torch's own plan classes (attention q/k/v Colwise, o Rowwise, MLP w1/w3 Colwise, w2 Rowwise, the embedding
Rowwise, the output Colwise, norms SequenceParallel, PrepareModuleInput, ``loss_parallel``), then ``fully_shard``
over the dp_shard mesh: trains as the same model unparallelised in PyTorch, its parameters split as the plan says.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)

import jmp as smp
from jmp.errors import ArgumentTypeError, ConfigError
from jmp.fsdp import fully_shard, init_device_mesh, parallelize_module
from jmp.fsdp.fully_sharded import model_of

VOCAB, DIM, HEADS, HIDDEN, STEPS = 256, 64, 4, 128, 3
ROOT = Path(__file__).resolve().parents[2]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """torchtitan's Llama layout and names (``layers`` a ModuleDict), without rotary embeddings."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model: Llama, tp_mesh, parallelize=parallelize_module) -> None:
    """torchtitan's ``apply_tp`` plan (with loss parallelism)."""
    parallelize(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w*": ColwiseParallel(),  # a wildcard, as torch matches it; w2 is set again below
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize(block, tp_mesh, plan)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (8, 17), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(model: nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for tokens, labels in batches():
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_torchtitans_plan_with_fully_shard_trains_as_pytorch_and_splits_as_planned():
    smp.init({})
    torch.manual_seed(0)
    reference = Llama()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    apply_tp(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])

    losses = train(model)
    expected = train(reference)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        # Adam divides each gradient by its own size, so float32's reordered sums move an element whose gradient is
        # near zero by a fraction of one step (lr 1e-3): 2e-5 is 2% of a step
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5, msg=name)

    built = model_of(model)
    assert dict(built.layout.mesh.shape) == {"pp": 1, "dp": 1, "fsdp": 4, "ep": 1, "tp": 2}
    arrays = built.layout.by_name(built.training_state.params)
    for name, (dim, planned) in {  # each device holds 1/tp of the planned dimension (and 1/fsdp of another)
        "layers.0.attention.wq.weight": (0, "tp"),  # Colwise: output features
        "layers.1.feed_forward.w3.weight": (0, "tp"),
        "layers.0.attention.wo.weight": (1, "tp"),  # Rowwise: input features
        "layers.1.feed_forward.w2.weight": (1, "tp"),
        "tok_embeddings.weight": (0, "tp"),  # Rowwise embedding: the vocabulary
        "output.weight": (0, "tp"),  # Colwise head: the vocabulary
    }.items():
        spec = tuple(built.layout.specs[name])
        assert spec[dim] == planned and "fsdp" in spec[1 - dim], (name, spec)
        array = arrays[name]
        shards = array.addressable_shards
        assert len(shards) == 8 and all(s.data.shape[dim] == array.shape[dim] // 2 for s in shards), name
        assert all(s.data.size == array.size // 8 for s in shards), name
    norm = tuple(built.layout.specs["layers.0.attention_norm.weight"])  # SequenceParallel: whole over tp
    assert "tp" not in norm


@pytest.mark.parametrize("processes, groups", [(1, [1, 1]), (2, [1, 2])])
def test_under_jmp_launch_torchs_mesh_plan_and_fully_shard_names_are_jmps_and_train_as_pytorch(processes, groups):
    devices = str(8 // processes)  # two processes feed the same rows: the job's mean loss is theirs
    command = [sys.executable, "-m", "jmp.launch", "-n", str(processes), "--cpu-devices", devices]
    command.append("tests/fsdp/tp_plan_script.py")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["names"] == {
        "init_device_mesh": "jmp.fsdp.device_mesh",
        "fully_shard": "jmp.fsdp.fully_shard",
        "parallelize_module": "jmp.fsdp.tensor_parallel_plans",
    }
    assert report["groups"] == groups  # the processes of a tp / dp_shard group: a tp pair is on one process
    np.testing.assert_allclose(report["losses"], report["expected"], rtol=1e-5)


def mesh_surface(init) -> dict:
    """What scripts and torchtitan's ``ParallelDims.build_mesh`` read of meshes made by ``init`` (8 ranks, rank 0)."""
    world = init("cpu", (8,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (1, 1, 4, 2), ("pp", "dp_replicate", "fsdp", "tp"))
    loss = dense["dp_replicate", "fsdp"]._flatten("loss")
    hybrid = init("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    return {
        "dense": [list(dense.shape), dense.ndim, dense.size(), dense.size(2), list(dense.mesh_dim_names)],
        "coordinate": dense.get_coordinate(),
        "tp": [dense["tp"].size(), dense["tp"].get_local_rank(), list(dense["tp"].mesh_dim_names)],
        "pair": list(dense["dp_replicate", "fsdp"].shape),
        "loss": [loss.size(), list(loss.mesh_dim_names), world["loss"].size(), loss.get_local_rank()],
        "hybrid": [list(hybrid.shape), hybrid.size(1), hybrid["dp_shard"].get_local_rank(), hybrid.get_local_rank(0)],
    }


_TORCHS = """
import json, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from tests.fsdp.test_tensor_parallel_plans import mesh_surface
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
print(json.dumps(mesh_surface(init_device_mesh)))
"""


def test_device_mesh_reads_as_torchs_on_8_ranks_and_counts_devices():
    smp.init({})
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _TORCHS], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert mesh_surface(init_device_mesh) == json.loads(done.stdout.strip().splitlines()[-1])  # torch's, fake group
    with pytest.raises(ConfigError, match="count devices"):
        init_device_mesh("cpu", (2, 2))
    with pytest.raises(KeyError):
        init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))["tp"]


def test_a_plan_on_a_module_jmp_cannot_split_is_refused():
    smp.init({})
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    with pytest.raises(ArgumentTypeError, match="Linear and Embedding"):
        parallelize_module(Block(), mesh, {"attention": ColwiseParallel()})
    with pytest.raises(ArgumentTypeError, match="1-D"):
        parallelize_module(Block(), None, {"attention.wq": ColwiseParallel()})
