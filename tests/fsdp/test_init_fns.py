"""A model built on the meta device and wrapped in FSDP: with ``param_init_fn`` (and SMP v2's
``post_param_init_fn``) its values are the ones PyTorch gives, the script's init code run as FSDP runs it; without,
jmp initialises it directly into its shards with the model's own initialisation code and JAX's random numbers:
the same deterministic values and the same distributions as PyTorch's, not the same draws.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jmp as smp
from jmp.fsdp import FSDP
from tests.fsdp.helpers import llama

transformers = pytest.importorskip("transformers")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))


def init_own_tensors(module: nn.Module) -> None:
    """FSDP's param_init_fn convention: the module's own tensors, materialised then initialised."""
    module.to_empty(device="cpu", recurse=False)
    if any(True for _ in module.parameters(recurse=False)):
        module.reset_parameters()


def test_param_init_fn_gives_the_values_pytorch_gives_on_the_cpu():
    smp.init({})
    torch.manual_seed(3)
    expected = mlp().state_dict()  # reset_parameters at construction, in module order
    with torch.device("meta"):
        net = mlp()
    called = []
    torch.manual_seed(3)
    model = FSDP(net, param_init_fn=init_own_tensors, post_param_init_fn=called.append)
    assert called == [net]  # once, on the root: jmp's one FSDP unit
    values = model.state_dict()
    assert values.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(values[name], value), name


def test_without_param_init_fn_jmp_draws_the_same_distributions_into_the_shards():
    smp.init({})
    reference = llama()
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(reference.config)
    model = FSDP(net)  # initialize_weights() run into the shards, JAX's random numbers
    values = model.state_dict()
    expected = reference.state_dict()
    assert values.keys() == expected.keys()
    for name, value in expected.items():
        if "norm" in name:  # deterministic: equal
            assert torch.equal(values[name], value), name
        else:  # normal(0, initializer_range): the same distribution, other draws
            assert not torch.equal(values[name], value), name
            assert abs(float(values[name].std()) - reference.config.initializer_range) < 2e-3, name
            assert abs(float(values[name].mean())) < 2e-3, name


def test_smp_v2s_delayed_param_initer_is_run_into_the_shards_not_on_the_host():
    from jmp.tsm.delayed_param import DelayedParamIniter

    smp.init({})
    reference = llama()
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(reference.config)
    initer = DelayedParamIniter(net)
    model = FSDP(net, param_init_fn=initer.get_param_init_fn(), post_param_init_fn=initer.get_post_param_init_fn())
    assert all(t.is_meta for t in (*net.parameters(), *net.buffers()))  # no module was materialised on the host
    values = model.state_dict()
    assert torch.equal(values["model.norm.weight"], reference.state_dict()["model.norm.weight"])
    assert abs(float(values["lm_head.weight"].std()) - reference.config.initializer_range) < 2e-3
