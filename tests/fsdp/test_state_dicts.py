"""FSDP's state dicts: under ``FULL_STATE_DICT`` the model's are torch's keys and values after training, the
optimizer's (``FSDP.optim_state_dict``) torch's state by parameter name, and saving both then loading them into a
fresh wrapped model and optimizer continues the run where it stopped; ``summon_full_params`` gives the full
values to edit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import jmp as smp
from jmp.fsdp import (
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from tests.fsdp.helpers import STEPS, batches, llama, optimizer_for, pytorch_run, train

pytest.importorskip("transformers")


def test_full_state_dicts_are_pytorchs_and_a_saved_run_resumes_where_it_stopped():
    smp.init({})
    model = FSDP(llama(), sharding_strategy=ShardingStrategy.FULL_SHARD)
    optimizer = optimizer_for(model)
    data = batches()
    losses = train(model, optimizer, data[:-1])
    full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full, FullOptimStateDictConfig(rank0_only=True)):
        saved = copy.deepcopy(model.state_dict())
        saved_optimizer = copy.deepcopy(FSDP.optim_state_dict(model, optimizer))
    assert FSDP.get_state_dict_type(model).state_dict_type is StateDictType.FULL_STATE_DICT
    assert FSDP.get_state_dict_type(model).state_dict_config == FullStateDictConfig()  # restored after the block
    losses += train(model, optimizer, data[-1:])

    expected, state, optimizer_state, _ = pytorch_run()
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    trained = model.state_dict()
    assert list(trained) == list(state)  # torch's keys, in torch's order
    for name, value in state.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5, msg=name)
    by_name = FSDP.optim_state_dict(model, optimizer)
    assert by_name["state"].keys() == optimizer_state.keys()
    for name, entry in optimizer_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(by_name["state"][name][key], entry[key], rtol=1e-4, atol=1e-7, msg=name)
        assert float(by_name["state"][name]["step"]) == STEPS
    assert [sorted(g["params"]) for g in by_name["param_groups"]] == [
        sorted(n for n in optimizer_state if "norm" not in n),
        sorted(n for n in optimizer_state if "norm" in n),
    ]  # the decay / no-decay groups, by name

    resumed = FSDP(llama(), sharding_strategy=ShardingStrategy.FULL_SHARD)
    fresh_optimizer = optimizer_for(resumed)
    with FSDP.state_dict_type(resumed, StateDictType.FULL_STATE_DICT):
        resumed.load_state_dict(saved)
        loadable = FSDP.optim_state_dict_to_load(model=resumed, optim=fresh_optimizer, optim_state_dict=saved_optimizer)
        fresh_optimizer.load_state_dict(loadable)
    np.testing.assert_allclose(train(resumed, fresh_optimizer, data[-1:]), expected[-1:], rtol=1e-5)


def test_sharded_and_local_state_dicts_and_summon_full_params():
    smp.init({})
    model = FSDP(llama())
    full = model.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()  # one process holds every shard: the full tensors
    assert sharded.keys() == full.keys() and all(torch.equal(sharded[k], full[k]) for k in full)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        model.load_state_dict(local)  # taken back on the same layout
    assert local["_smp_is_partial"] is True and torch.equal(local["lm_head.weight"], full["lm_head.weight"])

    with FSDP.summon_full_params(model):  # full values to read and edit, written back at the end
        norm = dict(model.named_parameters())["model.norm.weight"]
        torch.testing.assert_close(norm, full["model.norm.weight"])
        norm.data.fill_(2.0)
    assert torch.equal(model.state_dict()["model.norm.weight"], torch.full((64,), 2.0))
    with FSDP.summon_full_params(model, writeback=False):
        dict(model.named_parameters())["model.norm.weight"].data.fill_(3.0)
    assert torch.equal(model.state_dict()["model.norm.weight"], torch.full((64,), 2.0))
