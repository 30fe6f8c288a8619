"""Context variables set for the extent of a block: how the bridge and the packages above it hold scoped state."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def set_within(variable: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``variable`` holds ``value`` within the block, and what it held before after it."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
