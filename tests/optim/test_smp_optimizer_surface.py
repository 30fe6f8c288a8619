"""What SMP scripts (and Hugging Face's Trainer under SMP) use of ``DistributedOptimizer`` beyond torch's API:
``optimizer.optimizer``, ``local_state_dict(gather_if_shard=...)``, ``clip_master_grads()`` returning a torch
tensor, ``_global_grad_norm``, and torch optimizers built with ``fused=True`` (Hugging Face's default)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from jmp.errors import OptimizerError
from tests.front_end.helpers import SmallNet, batches, train_step


def test_adamw_fused_and_capturable_train_as_torch():
    module, data = SmallNet(), batches(3)
    reference = copy.deepcopy(module)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for x, y in data:
        torch_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        torch_optimizer.step()

    smp.init({})
    model = smp.DistributedModel(copy.deepcopy(module))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True))
    for x, y in data:
        optimizer.zero_grad()
        train_step(model, x, y)
        optimizer.step()
    got = model.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_differentiable_is_refused_saying_why():
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    with pytest.raises(OptimizerError, match=r"differentiable=True.*autograd.*Remove"):
        smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), differentiable=True))


def test_clip_master_grads_returns_torch_s_norm_as_a_tensor_and_keeps_it_for_logging():
    module, (x, y) = SmallNet(), batches(1)[0]
    reference = copy.deepcopy(module)
    F.cross_entropy(reference(x), y).backward()
    expected = torch.nn.utils.clip_grad.clip_grad_norm_(reference.parameters(), 0.01)

    smp.init({})
    model = smp.DistributedModel(copy.deepcopy(module))
    torch_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = smp.DistributedOptimizer(torch_optimizer)
    assert optimizer.optimizer is torch_optimizer and optimizer._global_grad_norm is None
    train_step(model, x, y)
    norm = optimizer.clip_master_grads(0.01)
    assert isinstance(norm, torch.Tensor) and norm.shape == ()
    np.testing.assert_allclose(float(norm), float(expected), rtol=1e-5)
    assert isinstance(optimizer._global_grad_norm, float)
    np.testing.assert_allclose(optimizer._global_grad_norm, float(expected), rtol=1e-5)


@pytest.mark.parametrize("gather_if_shard", [True, False])
def test_local_state_dict_takes_gather_if_shard(gather_if_shard):
    """One process holds every shard: gathered or not, its local state is the whole state (SMP's meaning on
    one rank); the call is Hugging Face's Trainer's."""
    smp.init({"shard_optimizer_state": True})  # the AdamW moments split over the 8 data-parallel devices
    model = smp.DistributedModel(SmallNet())
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = batches(1)[0]
    train_step(model, x, y)
    optimizer.step()
    local = optimizer.local_state_dict(gather_if_shard=gather_if_shard)
    whole = optimizer.state_dict()
    assert local["_smp_is_partial"] is True
    for index, entries in whole["state"].items():
        for key, value in entries.items():
            np.testing.assert_array_equal(local["state"][index][key].numpy(), value.numpy(), err_msg=f"{index}.{key}")
