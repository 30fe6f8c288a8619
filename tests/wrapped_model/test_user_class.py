"""The wrapped model is the module: the user's methods and properties run on ``smp.DistributedModel(module)`` with
``self`` the distributed model, ``isinstance`` of the user's class holds, and ``torch.compile`` gives the model
back. The model is a small GPT of our own with nanoGPT-style helpers (``configure_optimizers`` splitting AdamW
param groups by ndim, ``get_num_params``, ``estimate_mfu``), trained against PyTorch on the same weights."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import ConfigError


@dataclasses.dataclass
class Config:
    vocab: int = 32
    block: int = 8
    width: int = 16
    layers: int = 2


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyGPT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab, config.width),
                wpe=nn.Embedding(config.block, config.width),
                h=nn.ModuleList(Block(config.width) for _ in range(config.layers)),
                ln_f=nn.LayerNorm(config.width),
            )
        )
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    @property
    def depth(self):
        return len(self.transformer.h)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {name: p for name, p in self.named_parameters() if p.requires_grad}
        groups = [
            {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        cfg = self.config
        flops_per_token = 6 * self.get_num_params() + 12 * cfg.layers * cfg.width * cfg.block
        return flops_per_token * cfg.block * fwdbwd_per_iter / dt / 312e12

    def crop_block_size(self, block_size):
        self.config.block = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def retie(self):
        self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach() * 0 + 1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block :])
            idx = torch.cat([idx, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
        return idx


def batches(count: int, rows: int = 8, config: Config = Config()):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab, (count, rows, config.block + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def torch_losses(module: TinyGPT, data) -> list[float]:
    optimizer = module.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    losses = []
    for x, y in data:
        _, loss = module(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("config", [{}, {"tensor_parallel_degree": 2}], ids=["dp8", "tp2"])  # sdp8: the benchmark
def test_the_users_methods_run_on_the_distributed_model_and_train_as_pytorch(config):
    smp.init(config)
    module, data = TinyGPT(Config()), batches(2)
    reference = copy.deepcopy(module)
    model = smp.DistributedModel(module)
    assert isinstance(model, TinyGPT) and isinstance(model, smp.DistributedModel) and isinstance(model, nn.Module)
    assert model.module is module and model.config is module.config and model.depth == 2
    assert model.get_num_params() == reference.get_num_params()
    assert model.get_num_params(non_embedding=False) == sum(p.numel() for p in reference.parameters())
    assert model.estimate_mfu(4, 0.5) == reference.estimate_mfu(4, 0.5)

    torch_optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    assert [len(g["params"]) for g in torch_optimizer.param_groups] == [7, 10]
    optimizer = smp.DistributedOptimizer(torch_optimizer)
    losses = []
    for x, y in data:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    np.testing.assert_allclose(losses, torch_losses(reference, data), rtol=1e-5)
    trained = model.state_dict()
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(trained[name].numpy(), parameter.detach().numpy(), rtol=1e-4, atol=1e-5)
    # a submodule read through the model holds the current values, as model.module's do
    np.testing.assert_allclose(model.lm_head.weight.detach().numpy(), trained["lm_head.weight"].numpy())
    prompt = data[0][0][:2, :4]
    with torch.no_grad():
        np.testing.assert_array_equal(model.generate(prompt, 3).numpy(), reference.generate(prompt, 3).numpy())


def test_a_method_that_changes_the_layout_is_refused_when_it_returns():
    smp.init({})
    model = smp.DistributedModel(TinyGPT(Config()))
    changed = r"TinyGPT\.crop_block_size\(\) changed .*transformer\.wpe\.weight: \(8, 16\) torch.float32 -> \(4, 16\)"
    with pytest.raises(ConfigError, match=changed):
        model.crop_block_size(4)
    model = smp.DistributedModel(TinyGPT(Config()))
    model.retie()  # a tensor replaced by one of the same shape: its values are the model's
    np.testing.assert_array_equal(model.state_dict()["lm_head.weight"].numpy(), np.ones((32, 16), np.float32))


def test_torch_containers_index_the_wrapped_module_and_a_user_property_does_not_hide_the_models_records():
    smp.init({})
    layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = smp.DistributedModel(layers)
    assert isinstance(model, nn.Sequential) and len(model) == 3 and model[0] is layers[0]
    assert list(model) == list(layers)

    class WithLayout(nn.Linear):
        @property
        def layout(self):
            return "the user's"

    model = smp.DistributedModel(WithLayout(4, 4))
    assert set(model.layout.names) == {"weight", "bias"} and model.module.layout == "the user's"


def test_torch_compile_gives_back_the_model_said_once(caplog):
    from jmp.runtime import notices

    notices._SAID.discard("torch-compile")  # said once per process: an earlier test may have said it
    smp.init({})
    model = smp.DistributedModel(TinyGPT(Config()))
    with caplog.at_level(logging.INFO, logger="jmp"):
        assert torch.compile(model) is model
        assert torch.compile(model, mode="max-autotune") is model
        assert torch.compile(mode="reduce-overhead")(model) is model
        assert model.compile() is None
    said = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert torch.compile.__wrapped__.__module__ == "torch"  # anything else goes to torch's own


def test_a_class_the_model_cannot_take_is_said_once_and_its_methods_are_refused_at_the_call(caplog):
    smp.init({})

    class Slotted(nn.Linear):  # slots change the instance layout: no class of the model can have it
        __slots__ = ("extra",)

        def hello(self):
            return "hi"

        def backward(self):  # a name DistributedModel has: its own wins
            return "the user's"

    with caplog.at_level(logging.INFO, logger="jmp"):
        model = smp.DistributedModel(Slotted(2, 2))
        smp.DistributedModel(Slotted(2, 2))
    said = [r.getMessage() for r in caplog.records if "cannot take a subclass of Slotted" in r.getMessage()]
    assert len(said) == 1 and "model.module.<method>()" in said[0]
    assert any("model.backward is DistributedModel's" in r.getMessage() for r in caplog.records)
    assert type(model) is smp.DistributedModel and not isinstance(model, Slotted)
    with pytest.raises(AttributeError, match=r"a DistributedModel is not a Slotted.*model\.module\.hello\(\)"):
        model.hello()
    assert model.module.hello() == "hi"
