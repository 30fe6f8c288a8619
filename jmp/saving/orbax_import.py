"""Orbax, imported when first needed, under ``root_logging_kept``: absl's first log would configure the root logger."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """Whatever runs inside leaves the root logger's handlers and level as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


@functools.cache
def orbax_checkpoint() -> ModuleType:
    """``orbax.checkpoint``, imported on first use."""
    with root_logging_kept():
        import orbax.checkpoint as ocp
    return ocp


def async_writer(arrays_item: str, json_item: str) -> object:
    """An Orbax ``AsyncCheckpointer`` of ``arrays_item`` (uncompressed: zstd saves little on weights), ``json_item``."""
    ocp = orbax_checkpoint()
    handlers = {arrays_item: ocp.PyTreeCheckpointHandler(use_compression=False), json_item: ocp.JsonCheckpointHandler()}
    handler = ocp.CompositeCheckpointHandler(**handlers)
    return ocp.AsyncCheckpointer(handler)
