"""ResNet-18, ResNet-10 and ShuffleNet-v2 shaped image classifiers (written here) whose kinks can be replayed.

A ReLU or a max-pool has a gradient that jumps where its input crosses a decision (zero; the largest entry of a
window). At float32 precision some of a CNN's thousands of ReLU inputs lie within rounding of zero, so two float32
programs (PyTorch and XLA, two CPUs, data parallel and sharded) flip a few different decisions, and a flip in a
late stage moves a channel's gradient by about one part in the positions it sums (1e-3 for 7 x 7 x 8 rows): there
no float32 program's gradient is within float32's error of float64's. So each model returns its decisions
(``forward`` gives ``(logits, *decisions)``: each ReLU's mask, each max-pool's argmax, as outputs, so that they
leave a compiled step), and a float64 reference replays a float32 run's decisions (``replay``): the gradient of
the same piecewise-linear branch in exact arithmetic. What is left between the two is rounding, a continuous
function of the inputs, for jmp and for float32 PyTorch alike. ``Replay`` also checks the replayed decisions: one
that float64 would not take must lie within rounding of its boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Replay:
    """Decisions to take, in order, and the largest margin of one taken that is not float64's own: how far, over its
    tensor's largest entry, float64 saw it from the boundary (float32's rounding can flip only those near it)."""

    def __init__(self, decisions):
        self._decisions = iter(decisions)
        self.largest_margin = 0.0
        self.differing = 0  # decisions taken that are not float64's own

    def next(self, like: torch.Tensor) -> torch.Tensor:
        return next(self._decisions).to(like.dtype)

    def note(self, differs: torch.Tensor, margin: torch.Tensor) -> None:
        self.differing += int(differs.sum())
        if differs.any():
            self.largest_margin = max(self.largest_margin, float(margin.detach()[differs].max()))


def relu(x, replay: Replay | None = None):
    """ReLU as ``x * mask``; returns the result and its own mask."""
    mask = x > 0
    taken = mask
    if replay is not None:
        taken = replay.next(mask)
        replay.note(taken != mask, x.abs() / x.abs().max())
    return x * taken.to(x.dtype), mask


def max_pool(x, replay: Replay | None = None):
    """3x3 max-pool, stride 2, padding 1, as a gather at each window's argmax (torch's flat indices); returns the
    result and its own indices."""
    pooled, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    taken = indices if replay is None else replay.next(indices)
    picked = x.flatten(2).gather(2, taken.flatten(2).to(torch.int64)).reshape(pooled.shape)
    if replay is not None:
        replay.note(taken != indices, (pooled - picked) / x.abs().max())
    return picked, indices


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = _conv_bn(cin, cout, 3, stride)
        self.conv2 = _conv_bn(cout, cout, 3)
        self.downsample = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x, replay: Replay | None = None):
        identity = x if self.downsample is None else self.downsample(x)
        y, first = relu(self.conv1(x), replay)
        y, second = relu(self.conv2(y) + identity, replay)
        return y, (first, second)


class _Kinked(nn.Module):
    """``forward(x)`` returns ``(logits, *decisions)``, each kink's own decision in order."""

    def replay(self, x, decisions) -> tuple[torch.Tensor, Replay]:
        """The logits with each kink taking the given decision instead of its own, and what the replay saw."""
        replay = Replay(decisions)
        return self(x, replay)[0], replay


class ResNet(_Kinked):
    """torchvision's ResNet with basic blocks (``blocks`` per stage: (2, 2, 2, 2) is ResNet-18); ``deep_stem``
    is timm's resnet10t stem (three 3x3 convolutions in place of the 7x7)."""

    def __init__(self, blocks=(2, 2, 2, 2), widths=(16, 32, 64, 128), deep_stem=False, classes=10):
        super().__init__()
        if deep_stem:
            half = widths[0] // 2
            stem = [_conv_bn(3, half, 3, 2), _conv_bn(half, half, 3), _conv_bn(half, widths[0], 3)]
        else:
            stem = [_conv_bn(3, widths[0], 7, 2)]
        self.stem = nn.ModuleList(stem)
        layers, cin = [], widths[0]
        for stage, (count, cout) in enumerate(zip(blocks, widths)):
            for i in range(count):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x, replay: Replay | None = None):
        decisions = []
        for conv in self.stem:
            x, mask = relu(conv(x), replay)
            decisions.append(mask)
        x, indices = max_pool(x, replay)
        decisions.append(indices)
        for layer in self.layers:
            x, masks = layer(x, replay)
            decisions.extend(masks)
        return (self.fc(x.mean(dim=(2, 3))), *decisions)


def _shuffle(x, groups: int = 2):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNet-v2's unit: half the channels through 1x1 / depthwise 3x3 / 1x1 (or all of them, and a depthwise
    shortcut, when it downsamples), then a channel shuffle."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.stride = stride
        branch = cout // 2
        into = cin if stride > 1 else branch
        if stride > 1:
            self.branch1 = nn.Sequential(_conv_bn(cin, cin, 3, stride, groups=cin), _conv_bn(cin, branch, 1))
        self.expand = _conv_bn(into, branch, 1)
        self.depthwise = nn.Sequential(_conv_bn(branch, branch, 3, stride, groups=branch), _conv_bn(branch, branch, 1))

    def forward(self, x, replay: Replay | None = None):
        decisions = []
        if self.stride == 1:
            kept, x = x.chunk(2, dim=1)
        else:
            kept, mask = relu(self.branch1(x), replay)
            decisions.append(mask)
        y, first = relu(self.expand(x), replay)
        y, second = relu(self.depthwise(y), replay)
        return _shuffle(torch.cat((kept, y), dim=1)), (*decisions, first, second)


class ShuffleNetV2(_Kinked):
    """torchvision's ShuffleNetV2 layout: conv stem, max-pool, three stages of units, a 1x1 head convolution."""

    def __init__(self, repeats=(2, 2, 2), widths=(8, 16, 32, 64, 128), classes=10):
        super().__init__()
        self.stem = _conv_bn(3, widths[0], 3, 2)
        units, cin = [], widths[0]
        for count, cout in zip(repeats, widths[1:4]):
            for i in range(count):
                units.append(ShuffleUnit(cin, cout, 2 if i == 0 else 1))
                cin = cout
        self.units = nn.ModuleList(units)
        self.head = _conv_bn(cin, widths[4], 1)
        self.fc = nn.Linear(widths[4], classes)

    def forward(self, x, replay: Replay | None = None):
        x, mask = relu(self.stem(x), replay)
        x, indices = max_pool(x, replay)
        decisions = [mask, indices]
        for unit in self.units:
            x, taken = unit(x, replay)
            decisions.extend(taken)
        x, mask = relu(self.head(x), replay)
        return (self.fc(x.mean(dim=(2, 3))), *decisions, mask)


MODELS = {
    "resnet18": lambda: ResNet((2, 2, 2, 2)),
    "resnet10t": lambda: ResNet((1, 1, 1, 1), deep_stem=True),
    "shufflenet_v2": lambda: ShuffleNetV2(),
}
