"""``param.grad`` of a ``DistributedModel``'s parameters: the gradients the model holds on its devices, read as
torch tensors.

A step (``@smp.step`` or a loop's ``loss.backward()``) leaves its gradients sharded on the devices, in the
model's training state. Each torch parameter's ``.grad`` is then a ``DeviceGrad``: a tensor with the parameter's
shape, dtype and device whose value is copied from the devices only when something reads it (``p.grad.norm()``,
``p.grad.abs().max().item()``), so a loop that never looks costs nothing. ``zero_grad()`` leaves ``p.grad`` None,
as torch's does. The gradients read as the model holds them: multiplied by the loss scale until a GradScaler's
``unscale_``, as torch's are.

Edits made on the host reach the devices before the gradients are next used (the optimizer's step, clipping,
the next backward): a read gradient changed in place (``p.grad.mul_(0.5)``, ``p.grad.data.clamp_(-1, 1)``) or
a tensor assigned (``p.grad = p.grad / 4``). Setting one parameter's ``p.grad = None`` while the others keep
theirs has no compiled equivalent (jmp's update takes every parameter), and says so.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import torch

from jmp.errors import OptimizerError
from jmp.torch_bridge.device_values import DeviceValue
from jmp.torch_bridge.interop import array_to_tensor, tensor_to_array


class DeviceGrad(DeviceValue):
    """``p.grad`` of a parameter of a ``DistributedModel``: its gradient on the devices, copied to the host at
    the first read (see the module docstring)."""

    @staticmethod
    def __new__(cls, views: ParamGrads, name: str, like: torch.Tensor):
        return DeviceValue.__new__(cls, tuple(like.shape), like.dtype, like.device)

    def __init__(self, views: ParamGrads, name: str, like: torch.Tensor):
        super().__init__(tuple(like.shape), like.dtype, like.device)
        self.views = weakref.ref(views)  # a strong one would make a cycle through torch's C++ grad field: never freed
        self.param_name = name
        self.host_fetched: torch.Tensor | None = None  # the value as it came from the devices (edits are told by it)

    def fetch(self) -> torch.Tensor:
        views = self.views()
        if views is None:
            raise OptimizerError(
                f"{self.param_name}.grad belongs to a smp.DistributedModel that no longer exists; its gradients went "
                "with it"
            )
        value = views.fetch(self.param_name, self.dtype)
        self.host_fetched = value.clone()
        return value

    def edited(self) -> bool:
        return self.host_value is not None and not torch.equal(self.host_value, self.host_fetched)


class ParamGrads:
    """The ``p.grad`` of one model's torch parameters (``model.training_state.grad_views``)."""

    def __init__(self, model: Any):
        self._model = weakref.ref(model)  # the model holds this through its training state
        self._pairs: list[tuple[torch.nn.Parameter, str]] | None = None
        self._named: tuple[Any, Any, dict[str, jax.Array]] | None = None  # (grads, factor, by name) last read

    def pairs(self) -> list[tuple[torch.nn.Parameter, str]]:
        """Each parameter object once, with its name in the model's layout (a tied weight under its first)."""
        if self._pairs is None:
            model, seen = self._model(), set()
            names = set(model.layout.names)
            self._pairs = []
            for name, parameter in model.torch_module.named_parameters(remove_duplicate=False):
                if name in names and parameter.requires_grad and id(parameter) not in seen:  # torch: frozen: None
                    seen.add(id(parameter))
                    self._pairs.append((parameter, name))
        return self._pairs

    def publish(self, has_grads: bool) -> None:
        """The gradients changed: each ``p.grad`` reads the new ones (None when there are none)."""
        self._named = None
        for parameter, name in self.pairs():
            grad = parameter.grad
            if not has_grads:
                if grad is not None:
                    parameter.grad = None
            elif not (isinstance(grad, DeviceGrad) and grad.views() is self and grad.host_value is None):
                parameter.grad = DeviceGrad(self, name, parameter)

    def fetch(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return array_to_tensor(self._by_name()[name], dtype)

    def _by_name(self) -> dict[str, jax.Array]:
        model = self._model()
        grads, factor = model.training_state.kept_grads_as_computed()
        if self._named is None or self._named[0] is not grads or self._named[1] is not factor:
            named = model.store.named(grads)
            if factor is not None:
                named = _times(named, factor)
            self._named = (grads, factor, named)
        return self._named[2]

    def write_back(self, state: Any) -> None:
        """Put the host's edits of ``p.grad`` into ``state``'s gradients (none: nothing changes)."""
        if not state.has_grads:
            return
        edits, dropped = {}, []
        for parameter, name in self.pairs():
            grad = parameter.grad
            if isinstance(grad, DeviceGrad) and grad.views() is self:
                if grad.edited():
                    edits[name] = grad.host_value
            elif grad is None:
                dropped.append(name)
            else:
                edits[name] = grad
        if dropped and len(dropped) == len(self.pairs()):  # torch's own zero_grad() on the parameters
            state.grads = None
            return
        if dropped:
            raise OptimizerError(
                f"{dropped[0]}.grad (and {len(dropped) - 1} more) was set to None while the model holds gradients "
                "for the others; jmp's compiled update takes every parameter's gradient, so it cannot skip some. "
                "Freeze a parameter before wrapping the model (requires_grad=False), or zero its gradient "
                "(p.grad.zero_())"
            )
        if not edits:
            return
        model = self._model()
        named = dict(self._by_name())
        for name, tensor in edits.items():
            current = named[name]
            named[name] = jax.device_put(tensor_to_array(tensor).astype(current.dtype), current.sharding)
        state.replace_grads(model.store.pack(named))
        for parameter, _ in self.pairs():  # what p.grad holds is now what the devices hold
            if isinstance(parameter.grad, DeviceGrad) and parameter.grad.host_value is not None:
                parameter.grad.host_fetched = parameter.grad.host_value.clone()


@jax.jit
def _times(named: dict[str, jax.Array], factor: jax.Array) -> dict[str, jax.Array]:
    return jax.tree.map(lambda g: (g.astype(jax.numpy.float32) * factor).astype(g.dtype), named)
