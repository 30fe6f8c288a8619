"""SMP's sharded data parallelism as DeepSpeed's ZeRO-3 shows it: ``p.ds_tensor`` and the optimizer's
``fp32_partitioned_groups_flat``, read by AWS's own GPT-2 example (its ``sdp_utils``, vendored, used here)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import jmp as smp
from tests.front_end.helpers import SmallNet, batches, train_step

SDP_UTILS = Path(__file__).resolve().parents[1] / "vendored" / "smp_v1_examples" / "gpt2" / "sdp_utils.py"


def _aws_sdp_utils():
    spec = importlib.util.spec_from_file_location("aws_sdp_utils", SDP_UTILS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _padded_flat(tensor: torch.Tensor, degree: int) -> np.ndarray:
    flat = tensor.detach().float().reshape(-1).numpy()
    padded = np.zeros(math.ceil(flat.size / degree) * degree, np.float32)
    padded[: flat.size] = flat
    return padded


def test_aws_sdp_utils_find_each_parameters_partition_as_it_is_now():
    smp.init({"sharded_data_parallel_degree": 2})
    module = SmallNet()
    model = smp.DistributedModel(module)
    groups = [{"params": [module.fc1.weight, module.fc2.weight]}, {"params": [module.fc1.bias, module.norm.weight]}]
    utils = _aws_sdp_utils()
    offsets = utils.build_param_id_to_offset(groups)  # before the optimizer, as the script does
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(groups, lr=0.5))
    for p in module.parameters():
        if p.requires_grad and hasattr(p, "ds_tensor"):
            assert p.ds_tensor.ds_numel == 2 * math.ceil(p.numel() / 2)  # one process: both sdp ranks' slices
    before = _padded_flat(module.fc1.weight, 2)
    data, target = batches(1)[0]
    optimizer.zero_grad()
    train_step(model, data, target)
    optimizer.step()  # the views are read now: they show the updated parameters
    buffers = utils.build_param_id_to_buffer(optimizer, offsets)
    current = model.state_dict()
    for name, p in module.named_parameters():
        if id(p) in buffers:
            np.testing.assert_array_equal(buffers[id(p)].numpy(), _padded_flat(current[name], 2))
            np.testing.assert_array_equal(p.ds_tensor.data.numpy(), _padded_flat(current[name], 2))
    assert not np.array_equal(before, buffers[id(module.fc1.weight)].numpy())  # read after the update


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
    # whose parameters replace the meta-device ones; each must still carry ds_tensor (train.py:1072)
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
    utils = _aws_sdp_utils()
    offsets = utils.build_param_id_to_offset(groups)
    assert [len(g) for g in offsets] == [3, 3]
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(groups, lr=0.5))
    data, target = batches(1)[0]
    optimizer.zero_grad()
    train_step(model, data, target)
    optimizer.step()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(reference(data), target).backward()
    torch_optimizer.step()
    buffers = utils.build_param_id_to_buffer(optimizer, offsets)
    expected = dict(reference.named_parameters())
    for name, p in held.named_parameters():
        np.testing.assert_allclose(p.ds_tensor.data.numpy(), _padded_flat(expected[name], 2), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(buffers[id(p)].numpy(), _padded_flat(expected[name], 2), rtol=1e-5, atol=1e-6)
