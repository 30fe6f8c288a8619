"""Normalising torch's flexible argument forms (``view(2, 3)`` vs ``view((2, 3))``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def sizes(args: Sequence[Any]) -> tuple[int, ...]:
    """Sizes given as varargs or as one sequence, as a tuple of Python ints."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = args[0]
    return tuple(int(a) for a in args)  # a traced size raises ConcretizationTypeError -> a clear jmp error


def size_arguments(args: Sequence[Any], keywords: dict) -> tuple[int, ...]:
    """``sizes`` of a factory's ``*size``, or of torch's ``size=`` keyword (which Python leaves in ``keywords``)."""
    if not args and "size" in keywords:
        args = (keywords.pop("size"),)
    return sizes(args)


def dims(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """``dim`` (None, int or sequence) as a tuple of non-negative axes; None means all.

    A 0-d tensor accepts dim 0 / -1 (as torch does) and has no axes to reduce.
    """
    if dim is None:
        return None
    if isinstance(dim, (tuple, list)):
        if len(dim) == 0:
            return None
        axes = tuple(axis(d, ndim) for d in dim)
    else:
        axes = (axis(dim, ndim),)
    return () if ndim == 0 else axes


def axis(dim: int, ndim: int) -> int:
    dim = int(dim)
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"dimension {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % size


def reduction(reduction: str, size_average: Any = None, reduce: Any = None) -> str:
    """Loss reduction from torch's current and legacy (size_average/reduce) arguments."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if not reduce:
        return "none"
    return "mean" if size_average else "sum"


def on_scalars_as_vectors(fn):
    """Run a dim-taking lowering on a 0-d input as a 1-element vector, returning 0-d results.

    Torch lets dim 0 / -1 address the single "axis" of a scalar; JAX has none.
    """
    import functools

    @functools.wraps(fn)
    def lowering(input, *args, **kwargs):
        if getattr(input, "ndim", 1) != 0:
            return fn(input, *args, **kwargs)
        out = fn(input.reshape(1), *args, **kwargs)
        if isinstance(out, tuple):
            return type(out)(tuple(o.reshape(()) if hasattr(o, "reshape") else o for o in out))
        return out.reshape(())

    return lowering
