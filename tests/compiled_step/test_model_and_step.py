"""DistributedModel and @smp.step: outputs, evaluation steps, state dicts, compilation, and misuse."""

import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import StateDictError, StepError
from jmp.runtime import notices
from tests.front_end.helpers import SmallNet, batches, compilations, train_step


@smp.step
def eval_step(model, data):
    return model(data)


@pytest.fixture
def model():
    smp.init({"microbatches": 4})
    return smp.DistributedModel(SmallNet())


def test_step_outputs_hold_each_microbatch_and_concat_restores_the_batch_order(model):
    x, y = batches(1, batch=64)[0]
    output, loss = train_step(model, x, y)
    assert len(loss.outputs) == 4 and isinstance(loss.outputs[0], torch.Tensor)
    expected = model.module(x)
    np.testing.assert_allclose(output.concat(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert tuple(output.stack().shape) == (4, 16, 5)
    per_microbatch = [float(F.cross_entropy(o, t)) for o, t in zip(output.outputs, _microbatch_targets(y))]
    np.testing.assert_allclose([float(v) for v in loss.outputs], per_microbatch, rtol=1e-5)
    np.testing.assert_allclose(float(loss.reduce_mean()), float(F.cross_entropy(expected, y)), rtol=1e-5)
    np.testing.assert_allclose(float(loss.reduce_sum()), 4 * float(loss.reduce_mean()), rtol=1e-5)


def _microbatch_targets(y):
    """The targets of each microbatch: every microbatch takes an equal slice of each of the 8 shards."""
    return [t.reshape(-1) for t in y.reshape(8, 4, 2).transpose(0, 1).unbind(0)]


def test_an_evaluation_step_computes_no_gradients(model):
    model.eval()
    before = model.state_dict()
    x, _ = batches(1, batch=32)[0]
    out = eval_step(model, x)
    assert model.grads is None
    np.testing.assert_allclose(out.concat(), model.module(x).detach(), rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])


def test_train_and_eval_switch_dropout_like_torch():
    smp.init()
    module = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 2))
    model = smp.DistributedModel(module)
    x = torch.randn(16, 8)
    model.train()
    first, second = eval_step(model, x).concat(), eval_step(model, x).concat()
    assert not np.allclose(first, second), "dropout draws new masks each step"
    model.eval()
    np.testing.assert_allclose(eval_step(model, x).concat(), module.eval()(x).detach(), rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_into_a_plain_torch_module(model):
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.module.parameters(), lr=0.5))
    for x, y in batches(3, batch=32):
        optimizer.zero_grad()
        train_step(model, x, y)
        optimizer.step()
    plain = SmallNet()
    plain.load_state_dict(model.state_dict(), strict=True)
    x, _ = batches(1, batch=32, seed=7)[0]
    np.testing.assert_allclose(eval_step(model, x).concat(), plain(x).detach(), rtol=1e-5, atol=1e-6)
    local = model.local_state_dict()
    assert local.pop("_smp_is_partial") is True  # SMP's marker; load_state_dict takes the dict back
    assert local.keys() == model.state_dict().keys()


def test_load_state_dict_lists_what_does_not_fit(model):
    good = SmallNet().state_dict()
    bad = dict(good)
    del bad["fc1.bias"]
    bad["extra.weight"] = torch.zeros(1)
    bad["fc2.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        StateDictError,
        match="missing keys: fc1.bias.*unexpected keys: extra.weight.*fc2.weight: "
        "checkpoint \\(3, 3\\) vs model \\(5, 32\\)",
    ):
        model.load_state_dict(bad)
    del bad["fc2.weight"]
    model.load_state_dict({k: v for k, v in good.items() if k != "fc1.bias"}, strict=False)
    torch.testing.assert_close(model.state_dict()["fc1.weight"], good["fc1.weight"])


def test_one_compilation_per_input_shape_and_aot_lowering(model):
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.module.parameters(), lr=0.1))
    x, y = batches(1, batch=32)[0]
    for _ in range(2):
        optimizer.zero_grad()
        train_step(model, x, y)
        optimizer.step()
    before = compilations()
    optimizer.zero_grad()
    train_step(model, x + 1, y)
    optimizer.step()
    assert compilations() == before
    compiled = train_step.lower(model, x, y).compile()
    assert compiled.memory_analysis() is not None
    assert compiled.cost_analysis()  # flops and bytes of the step program


def test_the_model_outside_a_step_runs_as_a_torch_module_and_smps_backward_stays_inside(model):
    x = torch.randn(32, 10)
    with torch.no_grad():  # outside a step the forward runs at once (tests/eager: the recorded training loop)
        out = model(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, model.module(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(StepError, match="inside an @smp.step function"):
        model.backward(torch.tensor(1.0))


def test_backward_needs_one_scalar_loss(model):
    @smp.step
    def vector_loss(model, data):
        model.backward(model(data).sum(0))

    @smp.step
    def twice(model, data):
        loss = model(data).sum()
        model.backward(loss)
        model.backward(loss)

    x = torch.randn(32, 10)
    with pytest.raises(StepError, match="scalar loss; got shape \\(5,\\)"):
        vector_loss(model, x)
    with pytest.raises(StepError, match="called twice"):
        twice(model, x)


def test_a_batch_that_does_not_divide_gets_the_sizes_and_drop_last_advice(model):
    with pytest.raises(StepError, match="batch size 30 .* 4 microbatches x 8 data-parallel shards = 32.*drop_last"):
        train_step(model, torch.randn(30, 10), torch.randint(0, 5, (30,)))


def test_a_batch_the_data_parallel_devices_cannot_share_runs_whole_on_each_and_trains_as_torch(
    model, monkeypatch, caplog
):
    """One process driving 8 devices is one rank: a batch of 4 (AWS's gpt2 script's default --val_batch_size) or
    a short last batch of 12 is its whole batch, as in a one-process PyTorch run, computed whole on every device."""
    monkeypatch.setattr(notices, "_SAID", set())
    caplog.set_level("INFO", logger="jmp")
    reference = copy.deepcopy(model.module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    model.eval()
    x, _ = batches(1, batch=4)[0]
    np.testing.assert_allclose(eval_step(model, x).concat(), reference(x).detach(), rtol=1e-5, atol=1e-6)
    model.train()
    for x, y in batches(2, batch=12, seed=3):
        expected = [F.cross_entropy(reference(xm), ym) / 4 for xm, ym in zip(x.chunk(4), y.chunk(4))]
        torch_optimizer.zero_grad()
        sum(expected).backward()
        torch_optimizer.step()
        optimizer.zero_grad()
        output, loss = train_step(model, x, y)
        optimizer.step()
        np.testing.assert_allclose([float(v) for v in loss.outputs], [4 * float(v) for v in expected], rtol=1e-5)
        assert tuple(output.concat().shape) == (12, 5)
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6)
    assert caplog.text.count("every device computes the whole batch") == 1


def test_non_split_inputs_and_split_axes(model):
    @smp.step(non_split_inputs=["class_weight"], input_split_axes={"data": 1})
    def weighted(model, data, target, class_weight):
        loss = F.cross_entropy(model(data.transpose(0, 1)), target, weight=class_weight)
        model.backward(loss)
        return loss

    x, y = batches(1, batch=32)[0]
    weight = torch.rand(5)
    loss = weighted(model, x.transpose(0, 1).contiguous(), y, weight)
    expected = [float(F.cross_entropy(model.module(xm), ym, weight=weight)) for xm, ym in zip(_split(x), _split(y))]
    np.testing.assert_allclose([float(v) for v in loss.outputs], expected, rtol=1e-5)


def _split(t):
    return [m.reshape((-1,) + t.shape[1:]) for m in t.reshape((8, 4, 1) + t.shape[1:]).transpose(0, 1).unbind(0)]


def test_optimizer_state_is_laid_out_like_the_parameters(model):
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.module.parameters()))
    params = jax.tree.leaves(model.params)
    for leaf in jax.tree.leaves(optimizer.opt_state):
        assert leaf.sharding.is_equivalent_to(params[0].sharding, leaf.ndim)
