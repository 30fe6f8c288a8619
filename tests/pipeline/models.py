"""Small models for the pipeline tests, and their forward traced and cut into stage programs as a pipelined
step does, without compiling anything.

``python -m tests.pipeline.models`` prints the carry layout of ``Skips``, so that tests can compare the
layouts that separate processes build.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

import jmp as smp
from jmp.pipeline import placement
from jmp.pipeline.graph import defined_vars, module_scopes
from jmp.pipeline.split import StagePrograms
from jmp.torch_bridge import convert, torch_name


@smp.step
def nll_step(model, data, target):
    loss = F.nll_loss(model(data), target)
    model.backward(loss)
    return loss


@smp.step
def predict(model, data):
    return model(data)


class Skips(nn.Module):
    """Three stages; stage 0 sends several values of different shapes on, one of them past stage 1."""

    def __init__(self):
        super().__init__()
        with smp.partition(0):
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 12)
            self.c = nn.Linear(12, 6)
            self.d = nn.Linear(6, 10)
        with smp.partition(1):
            self.e = nn.Linear(12, 16)
            self.f = nn.Linear(6, 16)
            self.g = nn.Linear(10, 16)
        with smp.partition(2):
            self.h = nn.Linear(16, 4)

    def forward(self, x):
        h1 = self.a(x)
        h2 = self.b(h1)
        h3 = self.c(h2)
        h4 = self.d(h3)
        h5 = self.e(h2) + self.f(h3) + self.g(h4)
        return (self.h(h5) * h1.mean()).sum()  # h1 read on stage 2


class RunningCenter(nn.Module):
    """Subtracts a running mean of its inputs, updated after use: the buffer reaches the output."""

    def __init__(self, features: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x):
        out = x - self.mean
        if self.training:
            self.mean.mul_(0.5).add_(0.5 * x.detach().mean(0))
        return out


class NormNet(nn.Module):
    """Linear -> norm -> ReLU -> Linear: the first linear on stage 0, the last on 1, the norm on ``norm_stage``."""

    def __init__(self, norm_stage: int = 0, norm: type[nn.Module] = nn.BatchNorm1d):
        super().__init__()
        with smp.partition(0):
            self.fc1 = nn.Linear(16, 32)
        with smp.partition(norm_stage):
            self.norm = norm(32)
        with smp.partition(1):
            self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.norm(self.fc1(x)))), dim=1)


class Dropping(nn.Module):
    """Dropout on both stages: the random stream is drawn on each."""

    def __init__(self):
        super().__init__()
        with smp.partition(0):
            self.first = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5))
        with smp.partition(1):
            self.second = nn.Sequential(nn.Dropout(0.5), nn.Linear(32, 4))

    def forward(self, x):
        return self.second(self.first(x))


def stage_programs(net: nn.Module, stages: int, *inputs: jax.ShapeDtypeStruct) -> StagePrograms:
    """``net``'s forward traced as a step's (its output summed is the loss) and cut by its ``smp.partition`` marks.

    Like the step's forward it takes (parameters, rest, inputs) and returns [loss, *new rest].
    """
    graphdef, params, rest = nnx.split(convert(net), nnx.Param, ...)
    named = jax.tree_util.tree_leaves_with_path(params)
    rest_leaves, rest_def = jax.tree.flatten(rest)

    def forward(param_list, rest_list, *arrays):
        params_now = jax.tree.unflatten(jax.tree.structure(params), param_list)
        module = nnx.merge(graphdef, params_now, jax.tree.unflatten(rest_def, rest_list))
        loss = jnp.sum(module(*arrays)).astype(jnp.float32)
        return [loss, *jax.tree.leaves(nnx.split(module, nnx.Param, ...)[2])]

    paths = [path for path, _ in net.named_modules()]
    with module_scopes(paths):
        jaxpr = jax.make_jaxpr(forward)([leaf for _, leaf in named], rest_leaves, *inputs)
    stage_of = placement.manual(net, stages, 0).assign(jaxpr.jaxpr.eqns)
    return StagePrograms(jaxpr, stage_of, [torch_name(path) for path, _ in named], len(rest_leaves))


def rest_names(net: nn.Module) -> list[str]:
    """The names of the rest leaves ``stage_programs`` gives the forward, in order (the random stream's too)."""
    _, _, rest = nnx.split(convert(net), nnx.Param, ...)
    return [torch_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(rest)]


def describe(programs: StagePrograms) -> list[str]:
    """The carry layout: each slot's type, and for each travelling value the equation defining it and its slot."""
    defined_by = {v: i for i, eqn in enumerate(programs.jaxpr.jaxpr.eqns) for v in defined_vars([eqn])}
    lines = [f"slot {i}: {s.dtype}{list(s.shape)}" for i, s in enumerate(programs.slots)]
    travelling = sorted((defined_by[v], slot) for v, slot in programs.slot_of.items())
    lines += [f"equation {index} -> slot {slot}" for index, slot in travelling]
    return lines


def skips_layout() -> list[str]:
    torch.manual_seed(0)
    return describe(stage_programs(Skips(), 3, jax.ShapeDtypeStruct((4, 8), jnp.float32)))


if __name__ == "__main__":
    print("\n".join(skips_layout()))
