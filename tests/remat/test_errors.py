"""Misuse of the checkpointing API: each error says what, where, and lists the valid choices."""

import pytest
import torch
from torch import nn

import jmp as smp
from jmp.errors import ActivationCheckpointingError, ConfigError, ModelLookupError
from jmp.patches.checkpoint import checkpoint, checkpoint_sequential
from tests.remat.helpers import gpt2, lm_step, token_batch


class Stack(nn.Module):
    def __init__(self, chained: bool = True):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.chained = chained

    def forward(self, x):
        if self.chained:
            for layer in self.layers:
                x = layer(x)
            return x
        return self.layers[0](x) + self.layers[1](x)  # both layers take x: not a chain


class UsesAStranger(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.helpers = [nn.Linear(4, 4)]  # a plain list: not a submodule

    def forward(self, x):
        return checkpoint(self.helpers[0], self.fc(x))


@smp.step
def sum_step(model, x):
    loss = model(x).sum()
    model.backward(loss)
    return loss


@pytest.fixture
def stack():
    smp.init()
    return smp.DistributedModel(Stack())


def test_unknown_strategy_lists_the_valid_ones(stack):
    with pytest.raises(ConfigError, match="unknown checkpointing strategy 'every'.*'each'.*'contiguous'.*'group_N'"):
        smp.set_activation_checkpointing(stack.module.layers, strategy="every")
    with pytest.raises(ConfigError, match="strategy 'group_0'"):
        checkpoint_sequential(nn.Sequential(nn.Linear(4, 4)), torch.ones(1, 4), strategy="group_0")


def test_unknown_policy_lists_the_presets(stack):
    presets = "'full'.*'save_matmuls'.*'save_names'.*'offload_names'"
    with pytest.raises(ConfigError, match=f"unknown remat policy 'save_all'. Valid policies: {presets}"):
        smp.set_activation_checkpointing(stack.module.layers, policy="save_all")
    with pytest.raises(ConfigError, match="config key 'activation_checkpointing_policy': unknown remat policy 'x'"):
        smp.init({"activation_checkpointing_policy": "x"})
    with pytest.raises(ConfigError, match="'save_names' needs activation names, e.g. 'save_names:attn,mlp'"):
        smp.set_activation_checkpointing(stack.module.layers, policy="save_names")
    with pytest.raises(ConfigError, match="'full' takes no activation names"):
        checkpoint(stack.module.layers[0], torch.ones(1, 4), policy="full:attn")


def test_annotating_a_module_outside_the_model_names_it(stack):
    outside = r"Linear\(in_features=3, out_features=5.* is not part of a model wrapped in"
    with pytest.raises(ModelLookupError, match=outside):
        smp.set_activation_checkpointing(nn.Linear(3, 5))


def test_checkpointing_a_module_outside_the_model_inside_forward_names_it():
    smp.init()
    model = smp.DistributedModel(UsesAStranger())
    stranger = r"smp.checkpoint: the module Linear\(in_features=4.* is not part of the model"
    with pytest.raises(ModelLookupError, match=stranger):
        sum_step(model, torch.ones(8, 4))


def test_grouping_needs_a_container(stack):
    with pytest.raises(
        ConfigError, match="strategy 'group_2' groups the layers of an nn.Sequential or nn.ModuleList.*'layers.0'"
    ):
        smp.set_activation_checkpointing(stack.module.layers[0], strategy="group_2")


def test_grouping_layers_that_the_parent_does_not_chain_is_refused_with_the_way_out():
    smp.init()
    model = smp.DistributedModel(Stack(chained=False))
    smp.set_activation_checkpointing(model.module.layers, strategy="group_2")
    with pytest.raises(
        ActivationCheckpointingError, match="'layers.1' was called with other inputs. Use strategy='each'"
    ):
        sum_step(model, torch.ones(8, 4))
    smp.set_activation_checkpointing(model.module.layers, strategy="each")
    assert float(sum_step(model, torch.ones(8, 4)).reduce_mean()) == pytest.approx(
        float(model.module(torch.ones(8, 4)).sum().detach())
    )


def test_activation_names_that_match_no_submodule_list_the_valid_names():
    smp.init()
    model = smp.DistributedModel(gpt2(layers=1))
    smp.set_activation_checkpointing(model.module.transformer.h, policy="save_names:attention")
    with pytest.raises(
        ConfigError,
        match=r"names \['attention'\] are not submodules.*'transformer.h.0'.*: attn, .*attn.c_attn, .*mlp.c_fc",
    ):
        lm_step(model, token_batch())
