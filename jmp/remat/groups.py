"""The call hook of an annotated container: its layers run group by group, each group one checkpoint.

The parent's forward calls the layers one at a time, so the call of a group's first layer runs the whole group
(each layer fed the previous output and the same other arguments) and the parent's later calls return the held
outputs, after checking they were made that way (else an error says to use ``strategy='each'``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from jmp.errors import ActivationCheckpointingError
from jmp.remat import context, region
from jmp.remat.policies import Resolved
from jmp.torch_bridge.module import TorchModule


@dataclasses.dataclass
class _Held:
    """A layer output computed ahead with its group, and the call that will ask for it."""

    first_input: Any
    other_inputs: Any  # (args[1:], kwargs) of the group's first call
    output: Any


class LayerGroups:
    """Call hook for the layers at ``paths``, grouped by ``groups`` (lists of indices into ``paths``)."""

    def __init__(
        self,
        paths: Sequence[str],
        groups: Sequence[Sequence[int]],
        policy: Resolved,
        chain: str,
        strategy: str,
        alike: Hashable = None,
    ):
        self.paths = list(paths)
        self.index = {path: i for i, path in enumerate(paths)}
        self.group_of = {i: list(group) for group in groups for i in group}
        self.policy = policy
        self.chain = chain
        self.strategy = strategy
        self.alike = id(self) if alike is None else alike  # equal for hooks that checkpoint layers alike
        self.held: dict[int, _Held] = {}

    def __call__(self, module: TorchModule, call: Callable, *args: Any, **kwargs: Any) -> Any:
        index = self.index[module.torch_path]
        held = self.held.pop(index, None)
        if held is not None:
            self._check_chained(held, module.torch_path, args, kwargs)
            return held.output
        members = [j for j in self.group_of[index] if j >= index]
        units = [module] + [self._twin(j) for j in members[1:]]
        outputs = region.run(units, [self] * len(units), args, kwargs, self.policy, self.chain)
        for k in range(1, len(units)):
            first = region.next_input(outputs[k - 1], self.chain, self.paths[members[k - 1]])
            self.held[members[k]] = _Held(first, (args[1:], kwargs), outputs[k])
        return outputs[0]

    def stack_signature(self, path: str) -> tuple[str, Hashable, str] | None:
        """For ``jmp.stacks``: layers this hook (or one alike) checkpoints one by one are alike; None if grouped."""
        index = self.index[path]
        return ("checkpoint each", self.alike, self.chain) if self.group_of[index] == [index] else None

    def _twin(self, index: int) -> TorchModule:
        trace = context.current()
        torch_module = trace.modules[self.paths[index]] if trace is not None else None
        twin = context.twin_for(torch_module) if torch_module is not None else None
        if twin is None:
            raise ActivationCheckpointingError(
                f"cannot find the converted layer '{self.paths[index]}' to checkpoint with its group"
            )
        return twin

    def _check_chained(self, held: _Held, path: str, args: tuple, kwargs: dict) -> None:
        chained = bool(args) and args[0] is held.first_input and _same(held.other_inputs, (args[1:], kwargs))
        if not chained:
            raise ActivationCheckpointingError(
                f"strategy '{self.strategy}' checkpoints '{path}' together with the layers before it in its group, "
                "which needs the parent to call each layer as `x = layer(x, *same_other_arguments)` right after "
                f"the previous one; '{path}' was called with other inputs. Use strategy='each' for this container."
            )


def _same(expected: Any, actual: Any) -> bool:
    expected_leaves, expected_spec = torch_pytree.tree_flatten(expected)
    actual_leaves, actual_spec = torch_pytree.tree_flatten(actual)
    if expected_spec != actual_spec:
        return False
    for a, b in zip(expected_leaves, actual_leaves):
        if a is b:
            continue
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False
        try:
            if not bool(a == b):
                return False
        except Exception:
            return False
    return True
