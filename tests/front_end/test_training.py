"""Training with smp.DistributedModel / DistributedOptimizer / @smp.step equals plain PyTorch training."""

import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from tests.front_end.helpers import SmallNet, batches, compilations, named_grads, torch_losses, train_step

OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
    "adadelta": lambda m: torch.optim.Adadelta(m.parameters(), lr=4.0),
}


def jmp_losses(module, make_optimizer, data, config=None, devices=None, make_scheduler=None, compiled=None):
    smp.init(config, devices=devices)
    module = copy.deepcopy(module)
    model = smp.DistributedModel(module)
    torch_optimizer = make_optimizer(module)
    optimizer = smp.DistributedOptimizer(torch_optimizer)
    scheduler = make_scheduler(torch_optimizer) if make_scheduler else None
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        _, loss = train_step(model, x, y)
        optimizer.step()
        if scheduler:
            scheduler.step()
        losses.append(float(loss.reduce_mean()))
        if compiled is not None:
            compiled.append(compilations())
    return losses, model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_twenty_steps_track_a_plain_pytorch_loop(name):
    module, data = SmallNet(), batches(20)
    expected = torch_losses(module, OPTIMIZERS[name], data)
    actual, model = jmp_losses(module, OPTIMIZERS[name], data, {"microbatches": 2})
    np.testing.assert_allclose(actual, expected, rtol=1e-4)
    assert expected[-1] < expected[0]  # it learned something: the comparison is not of constants


def test_microbatch_gradients_equal_full_batch_gradients():
    module = SmallNet()
    ((x, y),) = batches(1, batch=64)
    reference = copy.deepcopy(module)
    F.cross_entropy(reference(x), y).backward()
    for microbatches in (1, 4):
        smp.init({"microbatches": microbatches})
        model = smp.DistributedModel(copy.deepcopy(module))
        train_step(model, x, y)
        grads = named_grads(model.grads)
        for name, p in reference.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_eight_data_parallel_devices_equal_one():
    module, data = SmallNet(), batches(5)
    one, _ = jmp_losses(module, OPTIMIZERS["adamw"], data, devices=jax.devices()[:1])
    eight, model = jmp_losses(module, OPTIMIZERS["adamw"], data)
    assert dict(smp.get_mesh().shape)["dp"] == 8
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    weight = model.params["fc1"]["weight"][...]
    assert len(weight.sharding.device_set) == 8


def test_lr_schedulers_take_effect_without_recompiling():
    module, data = SmallNet(), batches(12)
    schedulers = {
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12),
        "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: 1.0 / (1 + epoch)),
        "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12),
    }
    for name, make_scheduler in schedulers.items():
        expected = torch_losses(module, OPTIMIZERS["sgd_momentum"], data, make_scheduler)
        compiled = []
        actual, _ = jmp_losses(
            module, OPTIMIZERS["sgd_momentum"], data, make_scheduler=make_scheduler, compiled=compiled
        )
        np.testing.assert_allclose(actual, expected, rtol=1e-4, err_msg=name)
        assert compiled[1] == compiled[-1], "a new learning rate must not recompile anything"


def test_lr_schedulers_accept_the_distributed_optimizer_itself():
    module, data = SmallNet(), batches(6)
    make_scheduler = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.1)  # noqa: E731
    expected = torch_losses(module, OPTIMIZERS["adamw"], data, make_scheduler)
    smp.init()
    module = copy.deepcopy(module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(OPTIMIZERS["adamw"](module))
    scheduler = make_scheduler(optimizer)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        _, loss = train_step(model, x, y)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.reduce_mean()))
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1**3)


def test_param_groups_keep_their_own_hyperparameters():
    def make(m):
        return torch.optim.SGD(
            [
                {"params": m.fc1.parameters(), "lr": 0.2, "momentum": 0.5},
                {"params": list(m.norm.parameters()) + list(m.fc2.parameters()), "weight_decay": 0.01},
            ],
            lr=0.05,
            momentum=0.9,
        )

    module, data = SmallNet(), batches(8)
    expected = torch_losses(module, make, data)
    actual, _ = jmp_losses(module, make, data)
    np.testing.assert_allclose(actual, expected, rtol=1e-4)


def test_parameters_the_optimizer_does_not_hold_stay_frozen():
    module, data = SmallNet(), batches(3)
    actual, model = jmp_losses(module, lambda m: torch.optim.SGD(m.fc2.parameters(), lr=0.1), data)
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], module.fc1.weight.detach())
    assert not np.allclose(model.state_dict()["fc2.weight"], module.fc2.weight.detach())


def test_gradients_accumulate_until_zero_grad_as_in_torch():
    module, data = SmallNet(), batches(4)
    make = OPTIMIZERS["sgd_momentum"]
    reference = copy.deepcopy(module)
    reference_optimizer = make(reference)
    expected = []
    for i, (x, y) in enumerate(data):
        if i % 2 == 0:
            reference_optimizer.zero_grad()  # two backward passes per update
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        if i % 2 == 1:
            reference_optimizer.step()
        expected.append(loss.item())
    smp.init()
    module = copy.deepcopy(module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(make(module))
    actual = []
    for i, (x, y) in enumerate(data):
        if i % 2 == 0:
            optimizer.zero_grad()
        actual.append(float(train_step(model, x, y)[1].reduce_mean()))
        if i % 2 == 1:
            optimizer.step()
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
