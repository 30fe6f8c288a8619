"""Python value checks on traced tensors (``if labels.max() >= n: raise ...``, ``assert``) run as the program runs.

A branch whose body only raises, or an ``assert``, is traced as passing and tested by ``jax.debug.callback``;
any other branch on a traced value stays a ``TracedControlFlowError``.
"""

from __future__ import annotations

import ast
import functools
import linecache
import types

import jax
import numpy as np


class FailedValueCheck(ValueError):
    """A model's own check on its inputs (``if <condition>: raise``) failed on a step's data."""


def raising_branch(frame: types.FrameType | None) -> ast.If | ast.Assert | None:
    """The ``if`` being tested when its body only raises, or the ``assert`` being tested; else None."""
    if frame is None:
        return None
    tree = _parsed(frame.f_code.co_filename)
    line = frame.f_lineno
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.If, ast.Assert)) and node.test.lineno <= line <= (node.test.end_lineno or line):
            if isinstance(node, ast.Assert):
                return node
            return node if all(isinstance(s, ast.Raise) for s in node.body) else None
    return None


def check_at_run_time(condition: jax.Array, frame: types.FrameType, branch: ast.If | ast.Assert) -> bool:
    """Register the runtime check of ``condition``; the value that lets the trace go on (an ``if`` raises when it
    holds: False, the branch not taken; an ``assert`` when it does not: True)."""
    source = linecache.getline(frame.f_code.co_filename, branch.lineno).strip()
    where = f"{frame.f_code.co_filename}:{branch.lineno}"
    passes = isinstance(branch, ast.Assert)
    jax.debug.callback(functools.partial(_raise_when_failed, passes, f"{source} (at {where})"), condition)
    return passes


def _raise_when_failed(is_assert: bool, check: str, condition: np.ndarray) -> None:
    failed = not np.all(condition) if is_assert else np.any(condition)
    if failed:
        raise FailedValueCheck(f"the model's check on its inputs failed on this step's data: {check}")


@functools.cache
def _parsed(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    try:
        return ast.parse(source) if source else None
    except SyntaxError:
        return None
