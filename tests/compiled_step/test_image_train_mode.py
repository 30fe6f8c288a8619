"""A MobileViT-v2-style image model (issue 55, item 6) in train mode, one ``@smp.step`` under data parallelism and
sharded data parallelism, against PyTorch in float64 on the same weights and data.

The pattern timm's and Hugging Face's MobileViT-v2 share: a batch-norm stem, an inverted residual whose last
batch-norm has no activation, a block of linear self-attention (one query channel softmaxed over the patches,
``relu(value) * context``) between group norms over the channels, then a batch-norm projection and a mean over
the positions. Several of its gradients are ill-conditioned in float32: the bias of a norm that a later norm
cancels is zero in exact arithmetic, and one behind a train-mode batch-norm is a sum that cancels to a small
part of its terms, so in the real models (timm's and Hugging Face's at 64 x 64) float32 PyTorch is itself up to
1e-3 off float64 there, and off its own channels-last run by as much; this small one shows the same at ~5e-5.
Compared with float32 PyTorch, jmp looked ~100x beyond float32 rounding while the losses matched;
compared with float64, its error is float32 PyTorch's own. So each gradient is checked against float64 within
a few times float32 PyTorch's error on it (or 1e-4), relative to its largest magnitude floored at 1e-3 of the
model's largest gradient; the batch-norm running statistics (over the whole batch, as SyncBatchNorm) against the
size of what the step added to them (``_statistic_scale``: a mean that cancels to zero has no digits of its own).
``benchmarks/image_zoo.py`` sweeps the real timm and torchvision models the same way.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from tests.front_end.helpers import named_grads

BATCH, IMAGE, CLASSES = 8, 32, 10
GRAD_RTOL, FLOOR, SLACK = 1e-4, 1e-3, 4.0
MOMENTUM = 0.1  # nn.BatchNorm2d's


def _conv_bn(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: bool = True):
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.SiLU()) if act else nn.Sequential(*layers)


class LinearSelfAttention(nn.Module):
    """MobileViT-v2's separable attention: one query channel softmaxed over the patches weights the keys into
    one context vector, which scales ``relu(value)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.qkv_proj = nn.Conv2d(dim, 1 + 2 * dim, 1)
        self.out_proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):  # [B, C, P, N]: P pixels per patch, N patches
        query, key, value = torch.split(self.qkv_proj(x), [1, self.dim, self.dim], dim=1)
        scores = F.softmax(query, dim=-1)
        context = (key * scores).sum(dim=-1, keepdim=True)
        return self.out_proj(F.relu(value) * context.expand_as(value))


class MobileVitV2Block(nn.Module):
    def __init__(self, dim: int, patch: int = 2):
        super().__init__()
        self.patch = patch
        self.conv_kxk = _conv_bn(dim, dim, 3, groups=dim)
        self.norm1 = nn.GroupNorm(1, dim)
        self.attn = LinearSelfAttention(dim)
        self.norm2 = nn.GroupNorm(1, dim)
        self.mlp = nn.Sequential(nn.Conv2d(dim, 2 * dim, 1), nn.SiLU(), nn.Conv2d(2 * dim, dim, 1))
        self.conv_proj = _conv_bn(dim, dim, act=False)

    def forward(self, x):
        b, c, h, w = x.shape
        p = self.patch
        y = self.conv_kxk(x)
        y = y.reshape(b, c, h // p, p, w // p, p).permute(0, 1, 3, 5, 2, 4).reshape(b, c, p * p, -1)
        y = y + self.attn(self.norm1(y))
        y = y + self.mlp(self.norm2(y))
        y = y.reshape(b, c, p, p, h // p, w // p).permute(0, 1, 4, 2, 5, 3).reshape(b, c, h, w)
        return self.conv_proj(y)


class MobileVitV2Style(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = _conv_bn(3, 16, 3, stride=2)
        self.expand = _conv_bn(16, 32)
        self.depthwise = _conv_bn(32, 32, 3, stride=2, groups=32)
        self.reduce = _conv_bn(32, 16, act=False)
        self.block = MobileVitV2Block(16)
        self.head_norm = _conv_bn(16, 32)
        self.classifier = nn.Linear(32, CLASSES)

    def forward(self, x):
        x = self.stem(x)
        x = self.reduce(self.depthwise(self.expand(x)))
        x = self.head_norm(self.block(x))
        return self.classifier(x.mean(dim=(2, 3)))


@smp.step
def train_step(model, images, labels):
    loss = F.cross_entropy(model(images), labels)
    model.backward(loss)
    return loss


def _error(actual, expected, floor: float) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), floor)


def _torch_run(model: nn.Module, images, labels, dtype, memory_format=torch.contiguous_format):
    reference = copy.deepcopy(model).to(dtype=dtype, memory_format=memory_format)
    loss = F.cross_entropy(reference(images.to(dtype).contiguous(memory_format=memory_format)), labels)
    loss.backward()
    grads = {n: p.grad.double().numpy() for n, p in reference.named_parameters()}
    stats = {n: b.double().numpy() for n, b in reference.named_buffers() if n.endswith(("_mean", "_var"))}
    return loss.item(), grads, stats


def _data():
    torch.manual_seed(0)
    model = MobileVitV2Style().train()
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    return model, images, labels


def test_the_pattern_is_ill_conditioned_in_float32_pytorch_itself():
    """What read as jmp's mismatch: float32 PyTorch, contiguous against channels-last, differs by more than 1e-5
    on the gradients the issue named, while the losses agree to float32 rounding."""
    model, images, labels = _data()
    loss, grads, _ = _torch_run(model, images, labels, torch.float32)
    loss_cl, grads_cl, _ = _torch_run(model, images, labels, torch.float32, torch.channels_last)
    floor = FLOOR * max(float(np.max(np.abs(g))) for g in grads.values())
    assert abs(loss - loss_cl) <= 1e-6 * abs(loss)
    assert max(_error(grads_cl[n], g, floor) for n, g in grads.items()) > 1e-5


@pytest.mark.parametrize("config", [{}, {"sharded_data_parallel_degree": 8}], ids=["dp8", "sdp8"])
def test_train_mode_gradients_and_batch_norm_statistics_match_float64_pytorch(config):
    model, images, labels = _data()
    loss64, grads64, stats64 = _torch_run(model, images, labels, torch.float64)
    _, grads32, stats32 = _torch_run(model, images, labels, torch.float32)
    smp.init(config)
    distributed = smp.DistributedModel(model)
    loss = float(train_step(distributed, images, labels).reduce_mean())
    assert abs(loss - loss64) <= 1e-5 * abs(loss64)
    actual = named_grads(distributed.grads)
    floor = FLOOR * max(float(np.max(np.abs(g))) for g in grads64.values())
    for name, expected in grads64.items():
        error, torch_error = _error(actual[name], expected, floor), _error(grads32[name], expected, floor)
        assert error <= max(GRAD_RTOL, SLACK * torch_error), (name, error, torch_error)
    state = distributed.state_dict()
    for name, expected in stats64.items():
        scale = _statistic_scale(name, stats64)
        error = float(np.max(np.abs(np.asarray(state[name], np.float64) - expected) / scale))
        torch_error = float(np.max(np.abs(stats32[name] - expected) / scale))
        assert error <= max(GRAD_RTOL, SLACK * torch_error), (name, error, torch_error)


def _statistic_scale(name: str, stats64: dict) -> np.ndarray:
    """Per channel, what a running statistic's error is measured against: the size of what one step added to it.

    A step adds ``MOMENTUM`` times the batch mean to ``running_mean``, and a mean is only as accurate as the
    values it averages: where the mean cancels (behind a batch norm with no bias, a channel's mean is zero in exact
    arithmetic) its float32 value is rounding of the values' size, on any CPU. So the mean's error is measured
    against ``MOMENTUM`` times the channel's standard deviation (from float64's ``running_var``, which started at
    1), and the variance's against what the step added to it (a sum of squares: no cancellation).
    """
    added_var = stats64[name.replace("running_mean", "running_var")] - (1 - MOMENTUM)
    if name.endswith("running_var"):
        return added_var
    return MOMENTUM * np.sqrt(added_var / MOMENTUM)
