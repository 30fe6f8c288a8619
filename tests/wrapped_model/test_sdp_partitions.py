"""SMP's sharded data parallelism as DeepSpeed's ZeRO-3 shows it: ``p.ds_tensor`` and the optimizer's
``fp32_partitioned_groups_flat``. AWS's SMP v1 GPT-2 and flan-t5 examples read them to log parameter norms: before
``smp.DistributedOptimizer``, each param group's offsets from ``p.ds_tensor.ds_numel``; after it, each parameter's
slice of ``fp32_partitioned_groups_flat[i]`` at its offset, and ``p.ds_tensor.data``. ``offsets`` and ``buffers``
read them that way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import jmp as smp
from tests.front_end.helpers import SmallNet, batches, train_step


def offsets(param_groups: list[dict]) -> list[dict[int, tuple[int, int]]]:
    """Per param group, ``id(p) -> (offset, length)`` of each parameter's partition, in the group's order."""
    found = []
    for group in param_groups:
        offset, mine = 0, {}
        for p in group["params"]:
            mine[id(p)] = (offset, p.ds_tensor.ds_numel)
            offset += p.ds_tensor.ds_numel
        found.append(mine)
    return found


def buffers(optimizer, group_offsets: list[dict[int, tuple[int, int]]]) -> dict[int, torch.Tensor]:
    """``id(p) ->`` its float32 partition, cut from the optimizer's flat group at its offset."""
    flat = optimizer.fp32_partitioned_groups_flat
    return {
        key: flat[i].narrow(0, offset, length)
        for i, group in enumerate(group_offsets)
        for key, (offset, length) in group.items()
    }


def _padded_flat(tensor: torch.Tensor, degree: int) -> np.ndarray:
    flat = tensor.detach().float().reshape(-1).numpy()
    padded = np.zeros(math.ceil(flat.size / degree) * degree, np.float32)
    padded[: flat.size] = flat
    return padded


def test_each_parameters_partition_is_found_at_its_offset_as_it_is_now():
    smp.init({"sharded_data_parallel_degree": 2})
    module = SmallNet()
    model = smp.DistributedModel(module)
    groups = [{"params": [module.fc1.weight, module.fc2.weight]}, {"params": [module.fc1.bias, module.norm.weight]}]
    group_offsets = offsets(groups)  # before the optimizer, as the scripts do
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(groups, lr=0.5))
    for p in module.parameters():
        if p.requires_grad and hasattr(p, "ds_tensor"):
            assert p.ds_tensor.ds_numel == 2 * math.ceil(p.numel() / 2)  # one process: both sdp ranks' slices
    before = _padded_flat(module.fc1.weight, 2)
    data, target = batches(1)[0]
    optimizer.zero_grad()
    train_step(model, data, target)
    optimizer.step()  # the views are read now: they show the updated parameters
    found = buffers(optimizer, group_offsets)
    current = model.state_dict()
    for name, p in module.named_parameters():
        if id(p) in found:
            np.testing.assert_array_equal(found[id(p)].numpy(), _padded_flat(current[name], 2))
            np.testing.assert_array_equal(p.ds_tensor.data.numpy(), _padded_flat(current[name], 2))
    assert not np.array_equal(before, found[id(module.fc1.weight)].numpy())  # read after the update


def test_without_sharded_data_parallelism_there_are_no_partitions():
    smp.init({})
    module = SmallNet()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    assert not hasattr(module.fc1.weight, "ds_tensor")
    with pytest.raises(AttributeError, match="sharded_data_parallel_degree"):
        _ = optimizer.fp32_partitioned_groups_flat


def test_a_model_built_on_the_meta_device_keeps_its_partitions_in_the_module_get_module_returns():
    # AWS's GPT-2 script with delayed_parameter_initialization builds its param groups from model.get_module(),
    # whose parameters replace the meta-device ones; each must still carry ds_tensor (its train.py:1072)
    smp.init({"sharded_data_parallel_degree": 2, "delayed_parameter_initialization": True})
    with smp.delay_param_initialization():
        module = SmallNet()
    model = smp.DistributedModel(module)
    reference = SmallNet()
    reference.load_state_dict(model.state_dict())  # the weights jmp drew; torch trains a copy from them
    held = model.get_module()
    assert not held.fc1.weight.is_meta
    groups = [{"params": [p for n, p in held.named_parameters() if n.endswith("weight")]}]
    groups.append({"params": [p for n, p in held.named_parameters() if not n.endswith("weight")]})
    group_offsets = offsets(groups)
    assert [len(g) for g in group_offsets] == [3, 3]
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(groups, lr=0.5))
    data, target = batches(1)[0]
    optimizer.zero_grad()
    train_step(model, data, target)
    optimizer.step()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(reference(data), target).backward()
    torch_optimizer.step()
    found = buffers(optimizer, group_offsets)
    expected = dict(reference.named_parameters())
    for name, p in held.named_parameters():
        np.testing.assert_allclose(p.ds_tensor.data.numpy(), _padded_flat(expected[name], 2), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(found[id(p)].numpy(), _padded_flat(expected[name], 2), rtol=1e-5, atol=1e-6)
