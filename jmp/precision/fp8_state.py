"""FP8 scaling state as model state: each fp8 Linear's scales and amax histories, carried through the step.

With ``fp8`` on, every converted ``nn.Linear`` gets an ``fp8`` child (``Fp8Meta``) holding, for its input, weight
and output gradient, a float32 ``scale`` (initially 1) and an ``amax_history`` of the recipe's length (initially
zeros). They are NNX Variables besides the parameters, so they travel as the model's buffers do: in the training
state's ``rest``, through the compiled step, into checkpoints (``buffers/<path>``). They are not torch buffers:
``state_dict()`` keeps torch's keys.

The forward records the input's and weight's amaxes itself (as a batch norm updates its running statistics). The
output gradient's amax arises in the backward, as the cotangent of ``grad_scale`` (``fp8_matmul``): the step
differentiates the loss with respect to the ``GradientScale`` Variables too (``split_gradient_scales``) and
records those amaxes (``record_gradient_amaxes``). A Linear called twice in one forward records each call's input
amax (its history advances per call) and the sum of the calls' gradient amaxes (a scale that errs small).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp.precision import fp8_matmul, fp8_scaling
from jmp.precision.fp8_scaling import DelayedScaling
from jmp.torch_bridge.variable_writes import write


class Scale(nnx.Variable):
    """A per-tensor fp8 scale (``x * scale`` is quantised), updated by the forward."""


class AmaxHistory(nnx.Variable):
    """A tensor's amaxes, most recent first."""


class GradientScale(nnx.Variable):
    """The output gradient's scale: the step differentiates with respect to it to learn the gradient's amax."""


class Fp8Meta(nnx.Module):
    """One Linear's delayed-scaling state (TE's ``fp8_meta`` of a ``te.Linear``)."""

    def __init__(self, recipe: DelayedScaling):
        self.recipe = recipe
        self.deterministic = False  # NNX's train() / eval() set it: eval mode uses the scales without recording
        length = recipe.amax_history_len
        self.input_scale, self.input_amax_history = Scale(jnp.ones(())), AmaxHistory(jnp.zeros((length,)))
        self.weight_scale, self.weight_amax_history = Scale(jnp.ones(())), AmaxHistory(jnp.zeros((length,)))
        self.grad_scale, self.grad_amax_history = GradientScale(jnp.ones(())), AmaxHistory(jnp.zeros((length,)))

    @property
    def recording(self) -> bool:
        return not self.deterministic

    def linear(self, x: jax.Array, weight: jax.Array, bias: jax.Array | None, across: str | None = None) -> jax.Array:
        """``F.linear`` in fp8 with this state: the converted Linear calls it, so the bridge needs no fp8 import."""
        return fp8_matmul.fp8_linear(self, x, weight, bias, across)

    def record_forward(self, input_amax: jax.Array, weight_amax: jax.Array) -> None:
        dtype = self.recipe.forward_dtype
        for name, new_amax in (("input", input_amax), ("weight", weight_amax)):
            scale, history = getattr(self, f"{name}_scale"), getattr(self, f"{name}_amax_history")
            next_scale, next_history = fp8_scaling.updated(self.recipe, dtype, scale[...], history[...], new_amax)
            write(scale, next_scale)
            write(history, next_history)


def attach(module: nnx.Module, recipe: DelayedScaling, is_linear: Any) -> int:
    """Give every submodule for which ``is_linear(submodule)`` holds an ``fp8`` child; returns how many."""
    linears = [submodule for _, submodule in nnx.iter_graph(module) if is_linear(submodule)]
    for linear in linears:
        linear.fp8 = nnx.data(Fp8Meta(recipe))  # replaces the static None the Linear starts with
    return len(linears)


def split_gradient_scales(rest: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the ``GradientScale`` Variables, everything else) of a module state."""
    return nnx.split_state(rest, GradientScale, ...)


def record_gradient_amaxes(
    recipe: DelayedScaling, scales: nnx.State, amaxes: nnx.State, others: nnx.State
) -> nnx.State:
    """The module state with each output gradient's amax (the cotangent of its ``grad_scale``) recorded.

    A zero amax means no gradient reached that Linear (it did not take part in the loss): its state is kept, as
    TE leaves a module alone that did not run; an all-zero gradient (a zero amax too) would keep its scale anyway.
    """
    histories, by_path = dict(nnx.to_flat_state(others)), dict(nnx.to_flat_state(amaxes))
    new_scales = []
    for path, scale in nnx.to_flat_state(scales):
        history_path = (*path[:-1], "grad_amax_history")
        new_amax, history = by_path[path][...], histories[history_path]
        next_scale, next_history = fp8_scaling.updated(
            recipe, recipe.gradient_dtype, scale[...], history[...], new_amax
        )
        reached = new_amax > 0
        new_scales.append((path, scale.replace(jnp.where(reached, next_scale, scale[...]))))
        histories[history_path] = history.replace(jnp.where(reached, next_history, history[...]))
    return nnx.merge_state(nnx.from_flat_state(list(histories.items())), nnx.from_flat_state(new_scales))
