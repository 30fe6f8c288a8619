"""DistributedOptimizer: torch.optim update rules reproduced exactly, state in torch's format, clipping."""

import copy
import functools

import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from jmp.errors import ModelLookupError, OptimizerError
from tests.front_end.helpers import SmallNet, batches, torch_losses, torch_train


@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def run(model, optimizer, data, clip=None):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = train_step(model, x, y)
        if clip:
            optimizer.clip_master_grads(clip)
        optimizer.step()
        losses.append(float(loss.reduce_mean()))
    return losses


def setup(module, make_optimizer, config=None):
    smp.init(config)
    module = copy.deepcopy(module)
    model = smp.DistributedModel(module)
    torch_optimizer = make_optimizer(module)
    return model, smp.DistributedOptimizer(torch_optimizer), torch_optimizer


RULES = {
    "sgd_dampening_weight_decay": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01
    ),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    "sgd_maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, maximize=True),
    "adam_amsgrad_l2": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3, amsgrad=True, weight_decay=0.05),
    "adam_decoupled": lambda m: torch.optim.Adam(
        m.parameters(), lr=3e-3, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "adamw_amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.8, 0.99), amsgrad=True),
    "adagrad": lambda m: torch.optim.Adagrad(
        m.parameters(), lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1
    ),
    "rmsprop_centered_momentum": lambda m: torch.optim.RMSprop(
        m.parameters(), lr=3e-3, momentum=0.5, centered=True, weight_decay=0.01
    ),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=3e-3),
    # apex's fused optimizers as SMP scripts import them (smp.optimizers), against their eager torch steps
    "apex_fused_adam": lambda m: smp.optimizers.FusedAdam(m.parameters(), lr=3e-3, weight_decay=0.01),
    "apex_fused_adam_l2_uncorrected": lambda m: smp.optimizers.FusedAdam(
        m.parameters(), lr=3e-3, weight_decay=0.05, adam_w_mode=False, bias_correction=False
    ),
    "apex_fused_lamb_two_groups_clipped": lambda m: smp.optimizers.FusedLAMB(
        [
            {"params": [p for p in m.parameters() if p.ndim > 1]},
            {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0},
        ],
        lr=1e-2,
        weight_decay=0.01,
        max_grad_norm=0.05,
    ),  # fmt: skip
    "apex_fused_lamb_l2_nvlamb": lambda m: smp.optimizers.FusedLamb(
        m.parameters(), lr=1e-2, weight_decay=0.0, adam_w_mode=False, grad_averaging=False, use_nvlamb=True
    ),
    "apex_fused_novograd": lambda m: smp.optimizers.FusedNovoGrad(m.parameters(), lr=1e-2, weight_decay=0.01),
    "apex_fused_novograd_paper_form_max_norm": lambda m: smp.optimizers.FusedNovoGrad(
        m.parameters(),
        lr=1e-2,
        betas=(0.95, 0.98),
        weight_decay=0.01,
        reg_inside_moment=True,
        norm_type=0,
        init_zero=True,
        bias_correction=False,
        grad_averaging=False,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_update_rules_match_torch(name):
    module, data = SmallNet(), batches(6)
    expected = torch_losses(module, RULES[name], data)
    model, optimizer, _ = setup(module, RULES[name])
    np.testing.assert_allclose(run(model, optimizer, data), expected, rtol=1e-4)


def test_apex_optimizers_follow_their_published_rules():
    """smp.optimizers' eager steps: FusedAdam is torch's AdamW / Adam; FusedLAMB's first step worked by hand."""
    module, data = SmallNet(), batches(3)
    for adam_w_mode, torch_class in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        make_torch = functools.partial(torch_class, lr=1e-2, weight_decay=0.1)
        make_apex = functools.partial(smp.optimizers.FusedAdam, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
        expected = torch_losses(module, lambda m, make=make_torch: make(m.parameters()), data)
        got = torch_losses(module, lambda m, make=make_apex: make(m.parameters()), data)
        np.testing.assert_allclose(got, expected, rtol=1e-6)

    p = torch.tensor([3.0, 4.0], requires_grad=True)  # ||p|| = 5
    p.grad = torch.tensor([6.0, 8.0])  # global norm 10 > max_grad_norm 2: divided by 5, to [1.2, 1.6]
    smp.optimizers.FusedLAMB([p], lr=0.1, weight_decay=0.5, max_grad_norm=2.0, eps=0.0).step()
    # first step: m / (1 - b1) = g, v / (1 - b2) = g^2, so m / sqrt(v) = sign(g) = [1, 1]; plus 0.5 p = [2.5, 3];
    # its norm sqrt(15.25); trust ratio 5 / sqrt(15.25)
    direction = np.array([2.5, 3.0])
    expected = np.array([3.0, 4.0]) - 0.1 * 5 / np.sqrt(15.25) * direction
    np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-6)

    p = torch.tensor([3.0, 4.0], requires_grad=True)
    p.grad = torch.tensor([6.0, 8.0])  # norm 10, kept as the running norm on the first step
    smp.optimizers.FusedNovoGrad([p], lr=0.5, betas=(0.9, 0.75), eps=0.0, weight_decay=0.1).step()
    # m / (1 - b1) = g; v / sqrt(1 - b2) = 10 / 0.5 = 20; step g / 20 + 0.1 p = [0.6, 0.8], times lr 0.5
    np.testing.assert_allclose(p.detach().numpy(), [2.7, 3.6], rtol=1e-6)


def test_per_tensor_optimizers_are_refused_on_a_pipeline_with_what_to_do():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(SmallNet())
    with pytest.raises(OptimizerError, match="FusedLAMB takes a norm per parameter tensor.*FusedAdam"):
        smp.DistributedOptimizer(smp.optimizers.FusedLAMB(model.module.parameters()))


def test_state_dict_is_torchs_and_training_resumes_from_it_in_jmp_and_in_torch():
    make = RULES["adam_amsgrad_l2"]
    module, data = SmallNet(), batches(8)
    model, optimizer, _ = setup(module, make)
    run(model, optimizer, data[:5])

    reference = copy.deepcopy(module)  # the same 5 steps in torch
    reference_optimizer = make(reference)
    torch_train(reference, reference_optimizer, data[:5])
    saved, expected_state = optimizer.state_dict(), reference_optimizer.state_dict()
    assert saved["param_groups"] == expected_state["param_groups"]
    assert saved["state"].keys() == expected_state["state"].keys()
    for index, entry in expected_state["state"].items():
        assert saved["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            np.testing.assert_allclose(saved["state"][index][key], value, rtol=1e-4, atol=1e-7, err_msg=key)

    # resume in a fresh jmp run from the saved model and optimizer state
    weights = model.state_dict()
    fresh_module = SmallNet()
    fresh_model = smp.DistributedModel(fresh_module)
    fresh_model.load_state_dict(weights)
    fresh_optimizer = smp.DistributedOptimizer(make(fresh_module))
    fresh_optimizer.load_state_dict(saved)
    resumed = run(fresh_model, fresh_optimizer, data[5:])
    continued = run(model, optimizer, data[5:])
    np.testing.assert_allclose(resumed, continued, rtol=1e-6)

    # and in plain torch from the same files
    torch_module = SmallNet()
    torch_module.load_state_dict(weights)
    torch_optimizer = make(torch_module)
    torch_optimizer.load_state_dict(saved)
    np.testing.assert_allclose(torch_train(torch_module, torch_optimizer, data[5:]), continued, rtol=1e-4)


def _torch_clipped_losses(module, make, data, max_norm: float) -> list[float]:
    """torch's training with the gradients' global norm clipped before each step."""
    reference = copy.deepcopy(module)
    reference_optimizer = make(reference)
    losses = []
    for x, y in data:
        reference_optimizer.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        reference_optimizer.step()
        losses.append(float(loss))
    return losses


def test_clip_master_grads_is_global_norm_clipping():
    module, data = SmallNet(), batches(5)
    make = RULES["sgd_nesterov"]
    expected = _torch_clipped_losses(module, make, data, 0.1)
    model, optimizer, _ = setup(module, make)
    np.testing.assert_allclose(run(model, optimizer, data, clip=0.1), expected, rtol=1e-4)


def test_an_optax_transformation_works_directly_and_round_trips_its_state():
    module, data = SmallNet(), batches(4)
    smp.init()
    model = smp.DistributedModel(copy.deepcopy(module))
    optimizer = smp.DistributedOptimizer(optax.adam(1e-3), model=model)
    run(model, optimizer, data[:2])
    saved = optimizer.state_dict()
    clone = smp.DistributedModel(copy.deepcopy(module))
    clone.load_state_dict(model.state_dict())
    with pytest.raises(ModelLookupError, match=r"\d+ live smp.DistributedModels.*pass model="):
        smp.DistributedOptimizer(optax.adam(1e-3))  # two models alive: which one?
    clone_optimizer = smp.DistributedOptimizer(optax.adam(1e-3), model=clone)
    clone_optimizer.load_state_dict(saved)
    np.testing.assert_allclose(run(clone, clone_optimizer, data[2:]), run(model, optimizer, data[2:]), rtol=1e-6)


def test_unsupported_optimizers_are_named_with_the_supported_ones():
    smp.init()
    module = SmallNet()
    smp.DistributedModel(module)
    with pytest.raises(
        OptimizerError, match="torch.optim.lbfgs.LBFGS is not supported.*Supported: torch.optim.SGD.*smp"
    ):
        smp.DistributedOptimizer(torch.optim.LBFGS(module.parameters()))
    with pytest.raises(ModelLookupError, match="parameters belong to no smp.DistributedModel"):
        smp.DistributedOptimizer(torch.optim.SGD(SmallNet().parameters(), lr=0.1))


@pytest.mark.parametrize("fused", [False, True], ids=["optax", "kernels"])
def test_sdp_gradient_clipping_clips_under_sharded_data_parallelism(fused):
    """SMP's key: with sharded data parallelism the update sees gradients clipped to that global norm (on the
    kernels, in their pass)."""
    module, data = SmallNet(), batches(4)
    make = RULES["sgd_nesterov"]
    expected = _torch_clipped_losses(module, make, data, 0.05)
    config = {"sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.05, "fused_optimizer": fused}
    model, optimizer, _ = setup(module, make, config)
    assert (optimizer.fused is not None) == fused
    np.testing.assert_allclose(run(model, optimizer, data), expected, rtol=1e-4)
