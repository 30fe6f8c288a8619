"""``DistributedModel`` is an ``nn.Module`` (SMP's is): code that walks it as one works on the user's modules."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

import jmp as smp
from tests.front_end.helpers import SmallNet, batches, torch_train, train_step


def param_groups_by_weight_decay(module: nn.Module) -> list[dict]:
    """AWS's gpt2 train.py's param groups: module by module through ``_parameters``, no decay for biases."""
    decay, no_decay, seen = {"params": []}, {"params": [], "weight_decay": 0.0}, set()
    for module_ in module.modules():
        for name, p in module_._parameters.items():
            if p is not None and id(p) not in seen:
                (no_decay if name == "bias" or isinstance(module_, nn.LayerNorm) else decay)["params"].append(p)
                seen.add(id(p))
    return [decay, no_decay]


def test_the_model_is_a_torch_module_holding_the_users_module_as_module():
    smp.init({})
    net = SmallNet()
    model = smp.DistributedModel(net)
    assert isinstance(model, nn.Module)
    assert model._modules == {"module": net} and model._parameters == {} and model._buffers == {}
    assert list(model.state_dict()) == list(net.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in net.named_modules()]
    model.eval()
    assert not model.training and not net.training
    model.training = True  # what nn.Module.train does to each module
    assert model.training and net.training
    model.step_count = 3  # a plain attribute, not a registered submodule or tensor
    model.extra = nn.Linear(2, 2)
    assert model._modules == {"module": net} and list(model.state_dict()) == list(net.state_dict())


def test_an_optimizer_built_by_walking_the_model_trains_as_in_torch():
    smp.init({})
    net, data = SmallNet(), batches(3)
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(param_groups_by_weight_decay(model), lr=1e-2))
    expected = torch_train(reference, torch.optim.AdamW(param_groups_by_weight_decay(reference), lr=1e-2), data)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        _, loss = train_step(model, x, y)
        optimizer.step()
        losses.append(float(loss.reduce_mean()))
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)


def test_apply_initialises_the_models_values_as_in_torch():
    smp.init({})
    net, data = SmallNet(), batches(1)
    model = smp.DistributedModel(net)

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.01)

    assert model.apply(init) is model
    reference = SmallNet()
    reference.load_state_dict(net.state_dict())
    assert float(reference.fc1.weight.detach()[0, 0]) == np.float32(0.01)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), reference.state_dict()[name].numpy())
    x, y = data[0]
    _, loss = train_step(model, x, y)
    expected = torch.nn.functional.cross_entropy(reference(x), y)
    np.testing.assert_allclose(float(loss.reduce_mean()), float(expected.detach()), rtol=1e-6)


def test_post_step_hooks_run_once_after_the_first_step_with_the_model_and_optimizer():
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    handle = model.register_post_step_hook(lambda m, o: calls.append((m, o, m.grads is not None)))
    model.register_post_step_hook(lambda m, o: calls.append("removed")).remove()
    assert handle is not None and calls == []
    (x, y), *_ = batches(1)
    train_step(model, x, y)
    assert calls == [(model, optimizer, True)]  # after the step: its gradients are there
    train_step(model, x, y)
    assert len(calls) == 1
    assert model.register_post_step_hook(lambda m, o: calls.append(o)) is None  # stepped: runs right away
    assert calls[1] is optimizer


def test_a_post_step_hook_loads_a_saved_optimizer_state_as_hugging_faces_trainer_does():
    smp.init({})
    (x, y), *_ = batches(1)
    model = smp.DistributedModel(SmallNet())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    train_step(model, x, y)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())

    resumed = smp.DistributedModel(SmallNet())
    resumed_optimizer = smp.DistributedOptimizer(torch.optim.Adam(resumed.parameters(), lr=0.1))
    resumed.register_post_step_hook(lambda m, o: o.load_state_dict(saved))
    train_step(resumed, x, y)
    loaded = resumed_optimizer.state_dict()["state"]
    for index, entry in saved["state"].items():
        np.testing.assert_array_equal(loaded[index]["exp_avg"].numpy(), entry["exp_avg"].numpy())
