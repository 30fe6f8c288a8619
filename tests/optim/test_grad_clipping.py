"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` in a training loop clip jmp's gradients as torch's."""

import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import OptimizerError
from tests.front_end.helpers import SmallNet, batches


@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def train_with_clipping(module, config, data, clip):
    """A copy of ``module`` trained by jmp (SGD), ``clip(model)`` between each step and update: (model, clips)."""
    smp.init(config)
    model = smp.DistributedModel(copy.deepcopy(module))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    results = []
    for x, y in data:
        optimizer.zero_grad()
        train_step(model, x, y)
        results.append(clip(model))
        optimizer.step()
    return model, results


def no_bias(model):
    return [p for n, p in model.named_parameters() if "bias" not in n]


# name -> (config, what to clip, how): clip(parameters) runs between the backward and the update
CLIPS = {
    "norm-all-fsdp2": ({"sharded_data_parallel_degree": 2}, nn.Module.parameters, lambda ps: _norm(ps, 0.05)),
    "norm-inf-subset": ({}, no_bias, lambda ps: _norm(ps, 0.02, norm_type=float("inf"))),
    "value-tp2": ({"tensor_parallel_degree": 2}, nn.Module.parameters, lambda ps: _value(ps, 0.003)),
}


def _norm(parameters, max_norm, norm_type=2.0):
    return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))


def _value(parameters, clip_value):
    torch.nn.utils.clip_grad_value_(parameters, clip_value)
    return 0.0


@pytest.mark.parametrize("case", CLIPS, ids=list(CLIPS))
def test_clipping_in_the_loop_trains_as_torch(case):
    config, which, clip = CLIPS[case]
    module, data = SmallNet(), batches(3)

    reference = copy.deepcopy(module)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected_norms = []
    for x, y in data:
        torch_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        expected_norms.append(clip(which(reference)))
        torch_optimizer.step()

    model, norms = train_with_clipping(module, config, data, lambda model: clip(which(model)))
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
    if case.startswith("norm"):
        assert min(expected_norms) > 0.05  # above max_norm: every step clipped
    got = model.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_pipelined_model_clips_all_its_gradients():
    module, data = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5)), batches(2)
    reference = copy.deepcopy(module)
    expected = []
    for x, y in data:
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        expected.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)))
        torch.optim.SGD(reference.parameters(), lr=0.5).step()

    model, norms = train_with_clipping(
        module,
        {"partitions": 2, "microbatches": 2},
        data,
        lambda model: float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)),
    )
    np.testing.assert_allclose(norms, expected, rtol=1e-5)
    with pytest.raises(OptimizerError, match="some of a pipelined model's parameters"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:1], 0.01)


def test_other_tensors_are_clipped_by_torch_and_mixing_them_is_an_error():
    tensor = torch.ones(4, requires_grad=True)
    tensor.grad = torch.full((4,), 3.0)
    assert float(torch.nn.utils.clip_grad_norm_([tensor], 1.0)) == pytest.approx(6.0)
    np.testing.assert_allclose(tensor.grad.numpy(), 0.5, rtol=1e-5)
    smp.init({})
    model = smp.DistributedModel(nn.Linear(4, 2))
    with pytest.raises(OptimizerError, match="not parameters of the DistributedModel"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), tensor], 1.0)


def test_clipping_all_parameters_leaves_the_factor_to_the_update():
    """clip_grad_norm_ over all parameters writes no clipped copy of the gradients: the factor waits for the
    optimizer's pass over them, and whatever reads them before (a second clip, model.grads) sees them clipped."""
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    (x, y), *_ = batches(1)
    train_step(model, x, y)
    unclipped = jax.tree.leaves(model.training_state.grads)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
    kept, factor = model.training_state.kept_grads()
    assert all(a is b for a, b in zip(jax.tree.leaves(kept), unclipped, strict=True))  # nothing written
    np.testing.assert_allclose(float(factor), 0.01 / (norm + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)), 0.01, rtol=1e-4)
    clipped = jax.tree.leaves(model.grads)
    for got, before in zip(clipped, unclipped, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(before) * float(factor), rtol=1e-6)
