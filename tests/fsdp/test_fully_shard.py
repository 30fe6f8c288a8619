"""FSDP2 as torchtitan writes it: ``fully_shard`` on each block, then on the model, and the loop keeps calling the
original model object, whose class ``fully_shard`` swapped in place; built on the meta device and given its values
after ``fully_shard`` (``to_empty``, then the script's own initialisation), as torchtitan does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jmp as smp
from jmp.fsdp import FSDP, FSDPModule, MixedPrecisionPolicy, fully_shard
from jmp.fsdp.fully_sharded import model_of
from tests.fsdp.helpers import batches, llama, optimizer_for, pytorch_run, train

transformers = pytest.importorskip("transformers")


def test_the_torchtitan_loop_trains_as_pytorch_eager():
    smp.init({})
    initial = llama()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(initial.config).train()
    for block in model.model.layers:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    fully_shard(model)
    assert type(model).__name__ == "FSDPLlamaForCausalLM" and isinstance(model, FSDPModule)
    assert type(model.model.layers[1]).__name__ == "FSDPLlamaDecoderLayer"
    assert isinstance(model, transformers.LlamaForCausalLM)
    model.to_empty(device="cpu")
    values = dict(initial.named_parameters()) | dict(initial.named_buffers())
    with torch.no_grad():  # the script's initialisation: weights and buffers (the rotary table) after fully_shard
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            tensor.copy_(values[name])
    optimizer = optimizer_for(model)  # on the module's own parameters, before the first call
    assert model_of(model) is None  # the jmp model comes with the root's first call
    losses = train(model, optimizer, batches())
    built = model_of(model)
    assert built is not None and built.layout.mesh.shape["fsdp"] == 8
    assert built.layout.config.reshard_after_forward  # the blocks' default: resharded after their forward
    expected, state, _, _ = pytorch_run()
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    trained = model.state_dict()  # the module's own state_dict, holding the trained values
    assert trained.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5, msg=name)
    with FSDP.summon_full_params(model):  # the full values in the module's own parameters
        torch.testing.assert_close(model.lm_head.weight.detach(), state["lm_head.weight"], rtol=0, atol=2e-5)
    model.eval()
    assert not built.training and not model.model.layers[0].training
