"""CNNs nobody here wrote (torchvision's resnet18 and shufflenet_v2_x0_5, timm's resnet10t), two SGD steps with
momentum under dp8 and sdp8 at 1, 2 and 4 rows a device, with XLA:CPU's real kernels: every parameter and batch-norm
statistic against float64 PyTorch, within ``SLACK`` times float32 PyTorch's own error.

A ReLU or max-pool decision within rounding of its boundary is decided by the last bit, which differs between any
two float32 programs, and one flip in a late stage moves a channel's gradient by 1e-3 (torchvision's resnet18 at
224 x 224 has 84 ReLU inputs within 1e-6 of their tensor's largest). So every ``nn.ReLU`` and ``nn.MaxPool2d`` of
the model is replaced by one that takes a given decision (``Forced``): float64 PyTorch runs first and records its
own; float32 PyTorch (contiguous and channels-last) and jmp then take float64's, passed to jmp's step as arguments.
All three compute the same piecewise-linear function, and what is left is rounding. ``tests/compiled_step/
test_cnn_numerics.py`` does the same the other way round on models of its own (each run's decisions replayed in
float64), without replacing a module. jmp runs with ``scan_layers: False``: a scanned stack traces one layer for all,
and the decisions are taken in call order.

A parameter's error is the root mean square of its change's difference from float64's change over that change's,
floored at ``FLOOR`` times the largest parameter's (a bias that a later batch norm cancels changes by rounding only);
a running statistic's is measured per channel against ``statistic_scale``.

Its environment is ``benchmarks/image_zoo.py``'s (torchvision and timm from PyPI in a venv of their own)::

    /tmp/imgvenv/bin/python -m benchmarks.cnn_numerics                   # every row
    /tmp/imgvenv/bin/python -m benchmarks.cnn_numerics --only torchvision/resnet18

Results in ``benchmarks/results/cnn_numerics.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "cnn_numerics.json"
DEVICES, IMAGE, CLASSES, STEPS, LR, MOMENTUM = 8, 64, 10, 2, 0.05, 0.9
FLOOR, SLACK, ROUNDING = 1e-3, 4.0, 2.0**-20
BN_MOMENTUM = 0.1  # nn.BatchNorm2d's
LAYOUTS = {"dp8": {}, "sdp8": {"sharded_data_parallel_degree": 8}}
ROWS = (1, 2, 4)
MODELS = ("torchvision/resnet18", "torchvision/shufflenet_v2_x0_5", "timm/resnet10t")


def rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def is_statistic(name: str) -> bool:
    return name.endswith(("running_mean", "running_var"))


def statistic_scale(name: str, expected: dict) -> np.ndarray:
    """Per channel, the size of what the steps added to a running statistic. A mean is as accurate as the values it
    averages and cancels where they do (behind a batch norm with no bias a channel's mean is zero in exact
    arithmetic): its error is measured against the added weight times the channel's standard deviation, from
    float64's ``running_var`` (which started at 1); a variance, a mean of squares, against what was added to it."""
    kept = (1 - BN_MOMENTUM) ** STEPS
    added_var = expected[name.replace("running_mean", "running_var")] - kept
    if name.endswith("running_var"):
        return added_var
    return (1 - kept) * np.sqrt(added_var / (1 - kept))


def errors(initial: dict, actual: dict, expected: dict) -> dict[str, float]:
    """Each floating tensor's error after the steps (module docstring)."""
    changes = {k: expected[k] - initial[k] for k in expected}
    largest = max(rms(c) for k, c in changes.items() if not is_statistic(k))
    out = {}
    for k, change in changes.items():
        difference = (actual[k] - initial[k]) - change
        if is_statistic(k):
            out[k] = rms(difference / statistic_scale(k, expected))
        else:
            out[k] = rms(difference) / max(rms(change), FLOOR * largest)
    return out


def failures(record: dict) -> list[str]:
    """The tensors whose jmp error exceeds ``SLACK`` times float32 PyTorch's (the larger of its two runs)."""
    out = []
    for name, error in record["jmp"].items():
        torch_error = max(record["torch"][name], record["torch_channels_last"][name], ROUNDING)
        if error > SLACK * torch_error:
            out.append(f"{name}: {error:.2e} > {SLACK:g} x {torch_error:.2e}")
    return out


def forced(model, decisions):
    """``model`` with each ``nn.ReLU`` / ``nn.MaxPool2d`` replaced by a module taking its decisions from
    ``decisions`` (a ``Decisions``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ForcedReLU(nn.Module):
        def forward(self, x):
            return x * decisions.take(x > 0).to(x.dtype)

    class ForcedMaxPool(nn.Module):
        def __init__(self, pool: nn.MaxPool2d):
            super().__init__()
            self.args = (pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)

        def forward(self, x):
            pooled, indices = F.max_pool2d(x, *self.args, return_indices=True)
            taken = decisions.take(indices).to(torch.int64)
            return x.flatten(2).gather(2, taken.flatten(2)).reshape(pooled.shape)

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.ReLU:
                setattr(module, name, ForcedReLU())
            elif type(child) is nn.MaxPool2d:
                setattr(module, name, ForcedMaxPool(child))
    left = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (nn.ReLU, nn.MaxPool2d))})
    if left:
        raise RuntimeError(f"kinked modules not replaced: {left}")
    return model


class Decisions:
    """Each kink's decision in call order: recorded from the model's own (``given`` None), or taken from ``given``."""

    def __init__(self):
        self.recorded: list = []
        self.given = None

    def take(self, own):
        if self.given is None:
            self.recorded.append(own.detach())
            return own
        return next(self.given)


def _build(key: str):
    source, name = key.split("/")
    if source == "timm":
        import timm

        return timm.create_model(name, pretrained=False, num_classes=CLASSES, drop_rate=0.0)
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=CLASSES)


def run_row(key: str, layout: str, rows: int) -> dict:
    import torch
    import torch.nn.functional as F

    import jmp as smp

    torch.manual_seed(0)
    decisions = Decisions()
    net = forced(_build(key).train(), decisions)
    generator = torch.Generator().manual_seed(1)
    batch = DEVICES * rows
    batches = [
        (
            torch.randn(batch, 3, IMAGE, IMAGE, generator=generator),
            torch.randint(0, CLASSES, (batch,), generator=generator),
        )
        for _ in range(STEPS)
    ]

    def state(module) -> dict:
        return {k: v.detach().double().numpy() for k, v in module.state_dict().items() if v.is_floating_point()}

    def torch_run(dtype, given=None, memory_format=torch.contiguous_format):
        model = copy.deepcopy(net).to(dtype=dtype, memory_format=memory_format)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        taken = []
        for step, (x, y) in enumerate(batches):
            decisions.recorded, decisions.given = [], None if given is None else iter(given[step])
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(dtype).contiguous(memory_format=memory_format)), y).backward()
            optimizer.step()
            taken.append(decisions.recorded)
        decisions.given = None
        return state(model), taken

    initial = state(net)
    float64, given = torch_run(torch.float64)
    float32, _ = torch_run(torch.float32, given)
    float32_cl, _ = torch_run(torch.float32, given, torch.channels_last)

    smp.init({**LAYOUTS[layout], "scan_layers": False})
    model = smp.DistributedModel(copy.deepcopy(net))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))

    @smp.step
    def train_step(model, x, y, *taken):
        decisions.given = iter(taken)
        loss = F.cross_entropy(model(x), y)
        decisions.given = None
        model.backward(loss)
        return loss

    losses = []
    for (x, y), taken in zip(batches, given):
        optimizer.zero_grad()
        losses.append(float(train_step(model, x, y, *taken).reduce_mean()))
        optimizer.step()
    record = {
        "model": key,
        "layout": layout,
        "rows": rows,
        "decisions": sum(len(step) for step in given),
        "jmp": errors(initial, state(model), float64),
        "torch": errors(initial, float32, float64),
        "torch_channels_last": errors(initial, float32_cl, float64),
        "jmp_losses": losses,
    }
    record["failures"] = failures(record)
    record["status"] = "fail" if record["failures"] else "pass"
    return record


def _worker(key: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    from benchmarks.image_zoo import _define_missing_torchvision_ops

    _define_missing_torchvision_ops()
    for layout in LAYOUTS:
        for rows in ROWS:
            print(json.dumps(run_row(key, layout, rows)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(MODELS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    root = Path(__file__).resolve().parents[1]
    for key in args.only:
        start = time.time()
        command = [sys.executable, "-m", "benchmarks.cnn_numerics", "--worker", key]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=3600)
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0:
            rows.append({"model": key, "status": "error", "error": done.stderr[-2000:]})
        for row in rows:
            if "layout" in row:
                results[f"{key} {row['layout']}:{row['rows']}"] = row
                worst = max(row["jmp"], key=lambda k: row["jmp"][k] / max(row["torch"][k], ROUNDING))
                print(
                    f"{key} {row['layout']}:{row['rows']} {row['status']} worst {worst} jmp {row['jmp'][worst]:.2e} "
                    f"torch {row['torch'][worst]:.2e} / {row['torch_channels_last'][worst]:.2e}",
                    flush=True,
                )
            else:
                results[key] = row
                print(f"{key} error: {row['error'][-500:]}", flush=True)
        print(f"{key}: {time.time() - start:.0f} s", flush=True)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
