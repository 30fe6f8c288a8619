"""``p.grad`` of a DistributedModel's parameters reads the gradients on the devices as torch's ``.grad``: after a
step function or a loop's ``loss.backward()``, accumulated until ``zero_grad()``, edits on the host reaching the
update, and ``clip_grad_norm_`` returning a norm that waits for the devices only when read."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from jmp.errors import OptimizerError
from jmp.torch_bridge.device_values import DeviceArray
from jmp.wrapped_model.param_grads import DeviceGrad
from tests.front_end.helpers import SmallNet, batches, train_step


def _torch_grads(net, data):
    net.zero_grad()
    for x, y in data:
        F.cross_entropy(net(x), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def test_p_grad_reads_the_accumulated_gradients_until_zero_grad():
    smp.init({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2})
    net = SmallNet()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    data = batches(2)
    assert all(p.grad is None for p in model.parameters())
    for x, y in data:  # two steps before zero_grad: the gradients add up, as torch's do
        train_step(model, x, y)
    expected = _torch_grads(reference, data)
    for name, parameter in model.named_parameters():
        assert isinstance(parameter.grad, DeviceGrad) and parameter.grad.host_value is None  # nothing copied yet
        assert parameter.grad.shape == parameter.shape and parameter.grad.dtype == parameter.dtype
        torch.testing.assert_close(parameter.grad + 0, expected[name], rtol=1e-5, atol=1e-7)
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_edits_of_p_grad_reach_the_update_as_in_torch():
    smp.init({"sharded_data_parallel_degree": 2})
    net = SmallNet()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    x, y = batches(1)[0]
    train_step(model, x, y)
    F.cross_entropy(reference(x), y).backward()
    for module in (net, reference):  # the same edits, each as loops write them
        module.fc1.weight.grad.mul_(0.0)  # in place
        module.fc2.bias.grad = module.fc2.bias.grad * 4  # a new tensor
        module.norm.weight.grad.data.clamp_(-1e-3, 1e-3)  # in place, through .data
    optimizer.step()
    reference_optimizer.step()
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_returns_the_norm_unread_and_p_grad_reads_the_clipped_gradients():
    smp.init({})
    net = SmallNet()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    train_step(model, x, y)
    F.cross_entropy(reference(x), y).backward()
    model.state_dict = None  # model.parameters() handed to clipping copies no values (state_dict() would run)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    del model.state_dict
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    assert isinstance(norm, DeviceArray) and norm.host_value is None and norm.shape == ()
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)
    for (name, parameter), (_, torch_parameter) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(parameter.grad + 0, torch_parameter.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_p_grad_set_to_none_on_some_parameters_is_refused_and_on_all_drops_the_gradients():
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    train_step(model, x, y)
    model.module.fc1.bias.grad = None
    with pytest.raises(OptimizerError, match=r"fc1.bias.grad .* was set to None"):
        optimizer.step()
    torch.optim.Optimizer.zero_grad(optimizer.torch_optimizer)  # torch's own, on the parameters
    assert model.grads is None
