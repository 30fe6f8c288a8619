"""Memory of reversible residual layers (Reformer's / RevNet's custom Function) against a plain residual stack.

    python -m benchmarks.reversible_memory [--depth 8] [--width 256] [--tokens 4096]
        [--out benchmarks/results/reversible_memory.json]

The same blocks (``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``; f: LayerNorm, Linear, GELU; g: Linear to 4x width,
GELU, Linear back) run as a reversible ``autograd.Function`` (forward under ``no_grad``, the backward inverting
the blocks from the outputs with ``.backward()``, as ``transformers``' ``_ReversibleFunction``) and as plain
code. PyTorch: the bytes autograd keeps for the backward (``saved_tensors_hooks``, each storage once). jmp: the
temporaries of the compiled ``value_and_grad`` (``memory_analysis()``), where the reversible Function is
differentiated through its forward (its backward needs torch autograd), so it keeps what the plain stack keeps;
also the temporaries of ``@smp.step`` with each block checkpointed (``smp.set_activation_checkpointing``), the
JAX way to trade that memory for recomputation.
"""

from __future__ import annotations

import argparse

import jax
import torch
from flax import nnx
from torch import nn

import jmp
import jmp as smp
from benchmarks.harness import machine, write_results
from tests.torch_bridge.test_reversible_layers import ReversibleFunction


class Stack(nn.Module):
    """``depth`` reversible blocks over a doubled input, then a linear head; ``reversible`` picks the Function."""

    def __init__(self, width: int, depth: int, reversible: bool):
        super().__init__()
        self.f = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.g = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(2 * width, 1)
        self.reversible = reversible

    def forward(self, x):
        h = torch.cat([x, x], dim=-1)
        if self.reversible:
            h = ReversibleFunction.apply(h, list(zip(self.f, self.g)))
        else:
            x1, x2 = torch.chunk(h, 2, dim=-1)
            for f, g in zip(self.f, self.g):
                x1 = x1 + f(x2)
                x2 = x2 + g(x1)
            h = torch.cat([x1, x2], dim=-1)
        return self.head(h).square().mean()


def torch_saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, float]:
    """(bytes autograd keeps for the backward, each storage once; the loss) of one forward."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in parameters), float(loss)


def jmp_temp_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, float]:
    """(temporary bytes of the compiled value_and_grad, the loss) of the converted model."""
    converted = jmp.torch_bridge.convert(model)
    graphdef, params, rest = nnx.split(converted, nnx.Param, ...)
    array = jax.numpy.asarray(x.numpy())

    def loss(params):
        return nnx.merge(graphdef, params, rest)(array)

    step = jax.jit(jax.value_and_grad(loss))
    compiled = step.lower(params).compile()
    value, _ = compiled(params)
    return int(compiled.memory_analysis().temp_size_in_bytes), float(value)


@smp.step
def train_step(model, x):
    loss = model(x)
    model.backward(loss)
    return loss


def step_temp_bytes(model: nn.Module, x: torch.Tensor, checkpointed: bool) -> int:
    """Temporary bytes of ``@smp.step``'s compiled step, each block checkpointed (``jmp.remat``) or none."""
    smp.init({})
    distributed = smp.DistributedModel(model)
    for block in (*model.f, *model.g) if checkpointed else ():
        smp.set_activation_checkpointing(block)
    return int(train_step.lower(distributed, x).compile().memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/reversible_memory.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.width)
    rows = {}
    for name, reversible in (("plain residual", False), ("reversible Function", True)):
        torch.manual_seed(1)
        model = Stack(args.width, args.depth, reversible)
        saved, torch_loss = torch_saved_bytes(model, x)
        temp, jmp_loss = jmp_temp_bytes(model, x)
        rows[name] = {"torch_saved_MiB": saved / 2**20, "jmp_temp_MiB": temp / 2**20, "torch_loss": torch_loss}
        rows[name]["jmp_loss"] = jmp_loss
        rows[name]["jmp_step_temp_MiB"] = step_temp_bytes(model, x, checkpointed=False) / 2**20
        rows[name]["jmp_step_each_block_checkpointed_temp_MiB"] = step_temp_bytes(model, x, checkpointed=True) / 2**20
        step, checkpointed = rows[name]["jmp_step_temp_MiB"], rows[name]["jmp_step_each_block_checkpointed_temp_MiB"]
        print(f"{name:20} torch saved {saved / 2**20:7.1f} MiB, jmp temporaries {temp / 2**20:7.1f} MiB", end="")
        print(f" (smp.step {step:.1f} MiB, each block checkpointed {checkpointed:.1f} MiB)")
    activation = args.tokens * args.width * 4 / 2**20
    write_results(args.out, {"machine": machine(), "args": vars(args), "one_activation_MiB": activation, **rows})


if __name__ == "__main__":
    main()
