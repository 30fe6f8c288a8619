"""Run by ``test_tensor_parallel_plans`` under ``python -m jmp.launch -n 1 --cpu-devices 8``: torchtitan's imports
from torch's own modules, its plan and ``fully_shard`` on the test's Llama; prints the names' modules and the losses
of both models as one JSON line."""

import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from tests.fsdp import test_tensor_parallel_plans as case

names = {f.__name__: f.__module__ for f in (init_device_mesh, fully_shard, parallelize_module)}
torch.manual_seed(0)
reference = case.Llama()
model = copy.deepcopy(reference)
mesh = init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp_shard", "tp"))
case.apply_tp(model, mesh["tp"], parallelize_module)
for block in model.layers.values():
    fully_shard(block, mesh=mesh["dp_shard"])
fully_shard(model, mesh=mesh["dp_shard"])
groups = [dist.get_world_size(mesh[name].get_group()) for name in ("tp", "dp_shard")]  # one process: itself
print(json.dumps({"names": names, "groups": groups, "losses": case.train(model), "expected": case.train(reference)}))
