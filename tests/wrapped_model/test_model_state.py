"""What the model holds between steps: programs reused across train/eval, which model a call means,
parameters that stay valid, and the mesh the model was built with."""

import jax
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import ConfigError, ModelLookupError
from tests.front_end.helpers import SmallNet, batches, compilations, train_step


class DropoutNet(nn.Module):
    """Train and eval modes differ (dropout), so each mode has its own program."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


@smp.step
def evaluate(model, data, target):
    return F.cross_entropy(model(data), target)


def test_train_and_eval_toggled_over_epochs_compile_each_step_once_per_mode():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(DropoutNet())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.module.parameters(), lr=0.1))
    data = batches(2, batch=32)
    after_first_epoch = None
    for _ in range(3):
        model.train()
        for x, y in data:
            optimizer.zero_grad()
            train_step(model, x, y)
            optimizer.step()
        model.eval()
        for x, y in data:
            evaluate(model, x, y).reduce_mean()
        if after_first_epoch is None:
            after_first_epoch = compilations()
    assert compilations() == after_first_epoch  # epochs 2 and 3 compile nothing
    assert len(model.programs) == 2  # one program per (step function, mode)
    assert model.training is False


def test_a_step_without_a_model_argument_needs_exactly_one_live_model():
    smp.init()

    @smp.step
    def loss_of(data, target):
        return F.cross_entropy(only(data), target)

    only = smp.DistributedModel(SmallNet())
    x, y = batches(1)[0]
    np.testing.assert_allclose(float(loss_of(x, y).reduce_mean()), F.cross_entropy(only.module(x), y).item(), rtol=1e-5)
    other = smp.DistributedModel(SmallNet())
    with pytest.raises(ModelLookupError, match=r"step function loss_of cannot tell which of the \d+ live"):
        loss_of(x, y)
    del other


def test_an_optimizer_finds_its_model_by_its_parameters():
    smp.init()
    first, second = SmallNet(), SmallNet()
    first_model = smp.DistributedModel(first)
    second_model = smp.DistributedModel(second)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1))  # created after second
    assert optimizer.model is first_model
    assert smp.DistributedOptimizer(optax.sgd(0.1), model=second_model).model is second_model
    twice = smp.DistributedModel(first)  # the same torch module wrapped again
    with pytest.raises(ModelLookupError, match="belong to 2 smp.DistributedModels.*pass model="):
        smp.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    assert smp.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), model=twice).model is twice


def test_params_handed_out_stay_valid_after_the_optimizer_updates():
    smp.init()
    model = smp.DistributedModel(SmallNet())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.module.parameters(), lr=0.5))
    before = model.params
    kept = np.asarray(before["fc1"]["weight"][...])
    x, y = batches(1)[0]
    train_step(model, x, y)
    optimizer.step()
    leaves = jax.tree.leaves(before)
    assert not any(leaf.is_deleted() for leaf in leaves)
    np.testing.assert_array_equal(np.asarray(before["fc1"]["weight"][...]), kept)
    assert not np.allclose(np.asarray(model.params["fc1"]["weight"][...]), kept)  # the model did move on


def test_a_model_keeps_its_mesh_and_a_later_init_is_a_clear_error():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(SmallNet())
    x, y = batches(1)[0]
    train_step(model, x, y)
    smp.init({"microbatches": 2})  # the same config and devices: the model goes on
    train_step(model, x, y)
    smp.init({"microbatches": 4})
    with pytest.raises(ConfigError, match="smp.init was called again .* Build a new DistributedModel"):
        train_step(model, x, y)
    assert len(jax.tree.leaves(smp.DistributedModel(SmallNet()).params)) == 6  # a new model takes the new config
