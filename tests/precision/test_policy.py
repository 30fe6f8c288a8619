"""Mixed-precision policy: what a model keeps (float32 masters), what it computes in, and bad combinations."""

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import ArgumentTypeError, ConfigError
from jmp.runtime import notices


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


@smp.step
def train_step(model, x, y):
    out = model(x)
    loss = F.cross_entropy(out, y)
    model.backward(loss)
    return loss, out


def data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def test_model_creation_dtype_gives_a_half_module_with_float32_masters():
    smp.init({})
    with smp.model_creation(dtype=torch.bfloat16):
        module = small_net()
    assert torch.get_default_dtype() == torch.float32  # restored
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    model = smp.DistributedModel(module)
    assert model.precision.mixed and model.precision.autocast is None
    assert {str(a.dtype) for a in model.layout.by_name(model.params).values()} == {"float32"}
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values())  # the module's own dtype

    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-3))
    x, y = data()
    loss, out = train_step(model, x.to(torch.bfloat16), y)
    assert out.outputs[0].dtype == torch.bfloat16  # a bf16 module computes in bf16
    grads = model.layout.by_name(model.grads)
    assert {str(g.dtype) for g in grads.values()} == {"bfloat16"}  # kept in the compute dtype
    optimizer.step()
    masters = model.layout.by_name(model.params)
    assert {str(a.dtype) for a in masters.values()} == {"float32"}
    # the update is not rounded to bf16: a small AdamW step moves the masters off the bf16 grid
    off_grid = [n for n, a in masters.items() if bool(jnp.any(a.astype(jnp.bfloat16).astype(jnp.float32) != a))]
    assert off_grid
    # the torch-format optimizer state carries the masters, as SMP's fp16 optimizer does
    saved = optimizer.state_dict()
    assert [t.dtype for t in saved["fp32_from_fp16"][0]] == [torch.float32] * len(list(module.parameters()))


def test_config_bf16_runs_under_autocast_with_float32_masters():
    smp.init({"bf16": True})
    model = smp.DistributedModel(small_net())
    assert model.precision.autocast == torch.bfloat16
    x, y = data()
    loss, out = train_step(model, x, y)
    assert out.outputs[0].dtype == torch.bfloat16  # the last Linear ran in bf16
    assert loss.outputs[0].dtype == torch.float32  # cross_entropy runs in float32 under autocast
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())


def test_config_and_module_dtypes_must_agree():
    smp.init({"fp16": True})
    with smp.model_creation(dtype=torch.bfloat16):
        module = small_net()
    with pytest.raises(ConfigError, match="'fp16'.*bfloat16"):
        smp.DistributedModel(module)
    mixed = small_net()
    mixed[0].to(torch.float16)
    mixed[3].to(torch.bfloat16)
    smp.init({})
    with pytest.raises(ConfigError, match="both bfloat16 and float16"):
        smp.DistributedModel(mixed)


def test_model_creation_refuses_non_floating_dtypes():
    with pytest.raises(ArgumentTypeError, match="floating torch dtype"):
        with smp.model_creation(dtype=torch.int32):
            pass


def test_fp16_without_loss_scaling_warns_once(caplog):
    notices._SAID.discard("loss-scale:fp16-unscaled")
    smp.init({"fp16": True})
    module = small_net()
    model = smp.DistributedModel(module)  # noqa: F841 - held: optimizers find live models
    with caplog.at_level("WARNING", logger="jmp"):
        smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
        smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    assert caplog.text.count("fp16 training without loss scaling") == 1
