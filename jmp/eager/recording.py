"""An implicit step: a ``DistributedModel`` called outside a step function, the torch calls on its outputs, and the
``backward()`` that runs them all as one compiled step.

The recording's ``Plan`` is hashable (the program cache's key); the real tensors it read are the step's inputs,
those with the batch's rows split into microbatches. Gradients accumulate until ``zero_grad()``; values still
referenced come back as ``StepOutput.as_tensor()`` gives them; autocast regions are replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from jmp.compiled_step.function import step
from jmp.compiled_step.outputs import StepOutput
from jmp.eager import generation, plain_optimizers
from jmp.eager.lazy_tensor import LazyTensor
from jmp.errors import StepError
from jmp.runtime import notices


@dataclasses.dataclass(frozen=True)
class Value:
    """A leaf that is value ``index`` of the recording."""

    index: int


@dataclasses.dataclass(frozen=True)
class Input:
    """A leaf that is the step's input ``index`` (a real tensor the recording read)."""

    index: int


@dataclasses.dataclass(frozen=True)
class SliceConstant:
    """A ``slice`` (unhashable before Python 3.12) as a hashable constant."""

    start: Any
    stop: Any
    step: Any


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded torch call: ``func`` on the leaves (``Value``, ``Input`` or constants) of ``spec``; each
    tensor it returned became the value at its place in ``outputs`` (None for what is not a tensor). ``autocast``:
    the (device type, dtype) of the ``torch.autocast`` region it was made in (None: none)."""

    func: Any
    leaves: tuple
    spec: Any
    outputs: tuple
    autocast: tuple[str, torch.dtype] | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an implicit step computes: the model call, the calls on its values, what it differentiates and ``keep``s."""

    model_call: Call
    calls: tuple[Call, ...]
    target: int | None
    gradient: Input | None
    keep: tuple[int, ...] | None
    split: tuple[bool, ...]  # per input: split on its batch axis, or given whole


@step(non_split_inputs=["whole"])
def implicit_step(model, batch: list, whole: list, plan: Plan):
    """The recorded loop as a step function: ``batch`` split into microbatches, ``whole`` given whole."""
    pieces, wholes = iter(batch), iter(whole)
    inputs = [next(pieces) if is_split else next(wholes) for is_split in plan.split]
    values: dict[int, Any] = {}
    returned = _replay(model, plan.model_call, inputs, values)
    if plan.keep is None:
        return returned
    for call in plan.calls:
        _replay(call.func, call, inputs, values)
    if plan.target is not None:
        gradient = None if plan.gradient is None else inputs[plan.gradient.index]
        model.backward(values[plan.target], gradient)
    return [values[i] for i in plan.keep]


def _replay(func: Any, call: Call, inputs: list, values: dict) -> Any:
    leaves = [_resolve(leaf, inputs, values) for leaf in call.leaves]
    args, kwargs = torch_pytree.tree_unflatten(leaves, call.spec)
    # the region the call was recorded in: at backward() the loop has left it, the step enters it again
    region = contextlib.nullcontext() if call.autocast is None else torch.autocast(call.autocast[0], call.autocast[1])
    with region:
        result = func(*args, **kwargs)
    for leaf, index in zip(torch_pytree.tree_leaves(result), call.outputs):
        if index is not None:
            values[index] = leaf
    return result


def _resolve(leaf: Any, inputs: list, values: dict) -> Any:
    if isinstance(leaf, Value):
        return values[leaf.index]
    if isinstance(leaf, Input):
        return inputs[leaf.index]
    if isinstance(leaf, SliceConstant):
        return slice(leaf.start, leaf.stop, leaf.step)
    return leaf


class Recording:
    """One implicit step being recorded (with gradients off, a forward run at once); ``returned``: the call's result."""

    def __init__(self, model: Any, args: tuple, kwargs: dict):
        plain_optimizers.install()
        self.model = model
        self.differentiable = torch.is_grad_enabled()
        self.inputs: list[torch.Tensor] = []
        self.split: list[bool] = []
        self.rows: int | None = None  # the batch's rows: a tensor with as many is split into microbatches
        self.calls: list[Call] = []
        self.lazies: dict[int, weakref.ref] = {}
        self.results: dict[int, torch.Tensor | StepOutput] = {}
        self.ran = False
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        refs = [self._leaf(leaf, model_input=True) for leaf in leaves]
        if not self.differentiable:
            generation.check_no_cache(leaves)
        self.autocast = _autocast_region()
        forward = Plan(Call(None, tuple(refs), spec, (), self.autocast), (), None, None, None, tuple(self.split))
        if not self.differentiable:  # gradients off: nothing to record, the forward runs at once
            self.ran = True
            returned = self._run(forward)
            self.returned = torch_pytree.tree_map(lambda v: v.as_tensor() if isinstance(v, StepOutput) else v, returned)
            return
        shapes = self._run(forward, shapes=True)
        out_leaves, out_spec = torch_pytree.tree_flatten(shapes)
        outputs, indices = self._new_values(out_leaves)
        self.model_call = Call(None, tuple(refs), spec, tuple(indices), self.autocast)
        self.returned = torch_pytree.tree_unflatten(outputs, out_spec)

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on values of this recording: its result as new values (shapes from the ``meta`` device)."""
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        refs = [self._leaf(leaf) for leaf in leaves]
        metas = [_meta(leaf) for leaf in leaves]
        meta_args, meta_kwargs = torch_pytree.tree_unflatten(metas, spec)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*meta_args, **meta_kwargs)
        out_leaves, out_spec = torch_pytree.tree_flatten(result)
        if not any(isinstance(leaf, torch.Tensor) for leaf in out_leaves):
            return result  # sizes, dtypes, dims: answered from the shapes
        outputs, indices = self._new_values(out_leaves)
        self.calls.append(Call(func, tuple(refs), spec, tuple(indices), _autocast_region()))
        in_place = _is_in_place(func) and isinstance(args[0], LazyTensor)
        if in_place:  # the tensor the user holds now stands for the new value, as torch's in-place ops keep it
            args[0].index = indices[0]
            self.lazies[indices[0]] = weakref.ref(args[0])
            return args[0]
        return torch_pytree.tree_unflatten(outputs, out_spec)

    def _leaf(self, leaf: Any, model_input: bool = False) -> Any:
        if isinstance(leaf, LazyTensor):
            if leaf.recording is self:
                return Value(leaf.index)
            leaf = leaf.recording.value(leaf)  # another recording's value is a plain input here
        if isinstance(leaf, torch.Tensor):
            if model_input and self.rows is None and leaf.dim() > 0:
                self.rows = leaf.shape[0]
            split = leaf.dim() > 0 and (model_input or leaf.shape[0] == self.rows)
            if not split and not model_input:
                self._check_not_a_reshaped_batch(leaf)
            self.inputs.append(leaf)
            self.split.append(split)
            return Input(len(self.inputs) - 1)
        if isinstance(leaf, slice):
            return SliceConstant(leaf.start, leaf.stop, leaf.step)
        return leaf

    def _check_not_a_reshaped_batch(self, tensor: torch.Tensor) -> None:
        """A tensor of several times the batch's rows (labels flattened on the host: ``ids[:, 1:].reshape(-1)``)
        cannot be cut into the microbatches the batch is cut into; given whole it would meet every microbatch."""
        microbatches = self.model.layout.config.microbatches
        rows = self.rows or 0
        if microbatches > 1 and tensor.dim() > 0 and rows and tensor.shape[0] % rows == 0:
            raise StepError(
                f"a tensor of {tensor.shape[0]} rows ({tensor.shape[0] // rows} x the batch's {rows}) enters the "
                f"recorded step, which splits the batch into {microbatches} microbatches; a tensor reshaped on the "
                "host cannot be split with it. Keep the batch dimension first, e.g. "
                "cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:]) rather than flattening ids, or use "
                "microbatches=1."
            )

    def _new_values(self, leaves: list) -> tuple[list, list]:
        outputs, indices = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                index = len(self.lazies)
                lazy = LazyTensor(self, index, leaf)
                self.lazies[index] = weakref.ref(lazy)
                outputs.append(lazy)
                indices.append(index)
            else:
                outputs.append(leaf)
                indices.append(None)
        return outputs, indices

    def backward(self, tensor: LazyTensor, gradient: Any = None, retain_graph: Any = None, **rest: Any) -> None:
        """``tensor.backward(gradient)``: run the recording as one step that differentiates ``tensor``."""
        if tensor.recording is not self:
            raise StepError("backward() of a value of another recording")
        if self.ran:
            raise StepError(
                "backward() was called twice on one forward's values; as in torch, run the forward again (call "
                "the model) before the next backward()"
            )
        if not self.differentiable:
            raise StepError(
                "backward() of a value computed under torch.no_grad(): it has no gradient, as in torch (the model "
                "was called with gradients off)"
            )
        if gradient is None and tensor.numel() != 1:
            raise StepError(
                f"backward() needs a scalar (shape {tuple(tensor.shape)} here), as in torch: grad can be implicitly "
                "created only for scalar outputs; reduce it first or pass gradient="
            )
        grad_ref = None
        if gradient is not None:
            self.inputs.append(gradient if isinstance(gradient, torch.Tensor) else torch.as_tensor(gradient))
            self.split.append(False)
            grad_ref = Input(len(self.inputs) - 1)
        self._run_and_keep(tensor.index, grad_ref)
        self.ran = True

    def value(self, lazy: LazyTensor) -> torch.Tensor:
        """The value ``lazy`` stands for; before ``backward()``, from a run of the forward alone."""
        if lazy.index not in self.results:
            if self.ran:
                raise StepError("a value of a recorded step was read after its step ran without it")
            notices.warn_once(
                "eager:early-read",
                "a value of the model's outputs was read before backward(): jmp ran the forward to read it, and "
                "backward() will run it again with the gradients (a sync and a second forward; read values after "
                "backward() to avoid both)",
            )
            self._run_and_keep(None, None)
        result = self.results[lazy.index]
        if isinstance(result, StepOutput):
            result = self.results[lazy.index] = result.as_tensor()
        return result

    def call_on_values(self, func: Any, args: tuple, kwargs: dict) -> Any:
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        real = [self.value(v) if isinstance(v, LazyTensor) and v.recording is self else v for v in leaves]
        real = [v.recording.value(v) if isinstance(v, LazyTensor) else v for v in real]
        real_args, real_kwargs = torch_pytree.tree_unflatten(real, spec)
        return func(*real_args, **real_kwargs)

    def _run_and_keep(self, target: int | None, gradient: Input | None) -> None:
        alive = tuple(i for i, ref in self.lazies.items() if ref() is not None)
        plan = Plan(self.model_call, tuple(self.calls), target, gradient, alive, tuple(self.split))
        self.results.update(zip(alive, self._run(plan)))

    def _run(self, plan: Plan, shapes: bool = False) -> Any:
        split = [t for t, s in zip(self.inputs, self.split) if s]
        whole = [t for t, s in zip(self.inputs, self.split) if not s]
        with torch.set_grad_enabled(self.differentiable):
            if shapes:
                return implicit_step.output_shapes(self.model, split, whole, plan)
            return implicit_step(self.model, split, whole, plan)


def _autocast_region() -> tuple[str, torch.dtype] | None:
    """The ``torch.autocast`` region open where a call is recorded, as (device type, dtype), CUDA's first."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    return None


def _meta(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.empty(tuple(leaf.shape), dtype=leaf.dtype, device="meta")
    return leaf


def _is_in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))
