"""fp16 loss scaling: SMP's dynamic scaler and smp.amp.GradScaler against torch.amp.GradScaler, overflow by overflow."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import OptimizerError
from jmp.runtime import notices

# 1 = the step's loss is multiplied by inf, so every gradient is inf/nan and the update must be skipped
PATTERN = [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
INIT_SCALE, WINDOW = 2.0**10, 3


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches():
    generator = torch.Generator().manual_seed(3)
    for poisoned in PATTERN:
        x = torch.randn(16, 8, generator=generator)
        y = torch.randn(16, 4, generator=generator)
        yield x, y, torch.full((16,), float("inf") if poisoned else 1.0)


@smp.step
def poisoned_step(model, x, y, poison):
    loss = F.mse_loss(model(x), y) * poison.mean()
    model.backward(loss)
    return loss


def torch_scales(module: nn.Module, dtype: torch.dtype = torch.float16) -> tuple[list[float], dict]:
    """torch's own run: CPU autocast and torch.amp.GradScaler; the scale after each update."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=WINDOW)
    scales = []
    for x, y, poison in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(module(x), y) * poison.mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def torch_reference():
    return torch_scales(net())


def _jmp_dynamic(config=None, **args):
    smp.init(config or {"fp16": True})
    module = net()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(module.parameters(), lr=0.1),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": INIT_SCALE, "scale_window": WINDOW, **args},
    )
    return model, optimizer


def test_dynamic_loss_scale_skips_overflows_like_torch_grad_scaler(torch_reference):
    """SMP's scaler with delayed_shift=1 and scale_window=N is torch's GradScaler with growth_interval=N."""
    expected_scales, expected_state = torch_reference
    model, optimizer = _jmp_dynamic()
    scales, overflows = [], []
    for x, y, poison in batches():
        before = model.state_dict()
        optimizer.zero_grad()
        poisoned_step(model, x, y, poison)
        optimizer.step()
        overflows.append(optimizer.overflow)
        scales.append(optimizer.loss_scale)
        if optimizer.overflow:  # exactly that update skipped
            for name, value in model.state_dict().items():
                torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert overflows == [bool(p) for p in PATTERN]
    assert scales == expected_scales
    for name, value in model.state_dict().items():  # fp16 compute, fp32 masters: close to torch's autocast run
        torch.testing.assert_close(value, expected_state[name], rtol=0, atol=2e-3)


def test_grad_scaler_matches_torch(torch_reference):
    expected_scales, expected_state = torch_reference
    smp.init({"fp16": True})
    module = net()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(init_scale=INIT_SCALE, growth_interval=WINDOW)

    @smp.step
    def step(model, x, y, poison):
        loss = F.mse_loss(model(x), y) * poison.mean()
        model.backward(scaler.scale(loss))
        return loss

    scales = []
    for x, y, poison in batches():
        optimizer.zero_grad()
        step(model, x, y, poison)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == expected_scales
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], rtol=0, atol=2e-3)
    assert scaler.state_dict() == {
        "scale": expected_scales[-1],
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": WINDOW,
        "_growth_tracker": 5 % WINDOW,  # five clean steps since the last overflow
    }


def test_delayed_shift_waits_for_a_second_overflow():
    """delayed_shift=2: the first overflow only spends hysteresis; the second in a row halves the scale."""
    model, optimizer = _jmp_dynamic(delayed_shift=2, scale_window=100)
    scales = []
    for x, y, poison in batches():
        optimizer.zero_grad()
        poisoned_step(model, x, y, poison)
        optimizer.step()
        scales.append(optimizer.loss_scale)
    # overflows at steps 2, 7, 8: 2 spends the hysteresis (not restored: no clean window of 100 since)
    # 7 halves, 8 halves again
    assert scales == [INIT_SCALE] * 7 + [INIT_SCALE / 2] + [INIT_SCALE / 4] * 6


def test_scale_and_masters_survive_state_dict():
    """A new optimizer loaded from state_dict() continues with the same scale sequence and parameters."""
    model, optimizer = _jmp_dynamic()
    data = list(batches())
    for x, y, poison in data[:9]:
        optimizer.zero_grad()
        poisoned_step(model, x, y, poison)
        optimizer.step()
    saved_model, saved_optimizer = model.state_dict(), optimizer.state_dict()
    assert saved_optimizer["dynamic_loss_scale"] is True
    assert saved_optimizer["loss_scaler"]["cur_scale"] == optimizer.loss_scale
    assert saved_optimizer["loss_scaler"]["last_overflow_iter"] == 8

    def finish(model, optimizer):
        scales = []
        for x, y, poison in data[9:]:
            optimizer.zero_grad()
            poisoned_step(model, x, y, poison)
            optimizer.step()
            scales.append(optimizer.loss_scale)
        return scales, model.state_dict()

    resumed_model, resumed_optimizer = _jmp_dynamic()
    resumed_model.load_state_dict(saved_model)
    resumed_optimizer.load_state_dict(saved_optimizer)
    expected = finish(model, optimizer)
    actual = finish(resumed_model, resumed_optimizer)
    assert actual[0] == expected[0]
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=0, atol=0)


def test_clip_master_grads_clips_unscaled_gradients():
    """The norm is of the unscaled gradients (as torch's after GradScaler.unscale_), -1 after an overflow."""
    x, y, _ = next(batches())
    module = net()
    reference = copy.deepcopy(module)
    F.mse_loss(reference(x), y).backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))

    smp.init({})  # float32 with a static scale: the unscaling is exact arithmetic on powers of two
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), static_loss_scale=128.0)
    optimizer.zero_grad()
    poisoned_step(model, x, y, torch.ones(16))
    norm = float(optimizer.clip_master_grads(0.05))
    np.testing.assert_allclose(norm, expected_norm, rtol=1e-5)
    clipped = {n: float(np.linalg.norm(np.asarray(g))) for n, g in model.layout.by_name(model.grads).items()}
    total = np.sqrt(sum(v**2 for v in clipped.values())) / 128.0
    np.testing.assert_allclose(total, 0.05, rtol=1e-4)

    optimizer.zero_grad()
    poisoned_step(model, x, y, torch.full((16,), float("inf")))
    assert float(optimizer.clip_master_grads(0.05)) == -1.0


def test_loss_scaling_arguments_are_checked():
    smp.init({"fp16": True})
    module = net()
    model = smp.DistributedModel(module)  # noqa: F841 - held: optimizers find live models
    with pytest.raises(OptimizerError, match="scale_windw"):
        smp.DistributedOptimizer(
            torch.optim.SGD(module.parameters(), lr=0.1), dynamic_loss_scale=True, dynamic_loss_args={"scale_windw": 3}
        )
    with pytest.raises(OptimizerError, match="choose one"):
        smp.DistributedOptimizer(
            torch.optim.SGD(module.parameters(), lr=0.1), static_loss_scale=8.0, dynamic_loss_scale=True
        )
    with pytest.raises(OptimizerError, match="dynamic_loss_scale=True to use them"):
        smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), init_scale=8.0)
    # SMP's keyword form of the settings
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(module.parameters(), lr=0.1), dynamic_loss_scale=True, init_scale=8.0, min_scale=2.0
    )
    assert optimizer.loss_scale == 8.0 and optimizer.scaling.args.min_scale == 2.0


def test_bf16_turns_dynamic_scaling_off_with_a_warning(caplog):
    smp.init({"bf16": True})
    module = net()
    model = smp.DistributedModel(module)
    with caplog.at_level("WARNING", logger="jmp"):
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), dynamic_loss_scale=True)
    assert optimizer.current_scale is None and model.loss_scaling is None
    assert "does not scale the loss" in caplog.text or "loss-scale:dynamic-bfloat16" in notices._SAID


@pytest.mark.parametrize("clip", ["clip_master_grads", "torch_clip_grad_norm_"])
def test_grad_scaler_unscale_then_clip_like_torch(clip):
    """scaler.unscale_(optimizer) then SMP's clip_master_grads or torch's clip_grad_norm_ on the model's
    parameters: the norm torch's clip_grad_norm_ gives after unscale_."""
    x, y, _ = next(batches())
    reference = net()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    torch_scaler.scale(F.mse_loss(reference(x), y)).backward()
    torch_scaler.unscale_(torch_optimizer)
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    torch_scaler.step(torch_optimizer)
    torch_scaler.update()

    smp.init({})
    module = net()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(init_scale=INIT_SCALE)

    @smp.step
    def step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    step(model, x, y)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    if clip == "clip_master_grads":
        norm = optimizer.clip_master_grads(0.05)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    np.testing.assert_allclose(float(norm), expected_norm, rtol=1e-5)
    scaler.step(optimizer)
    scaler.update()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6)
