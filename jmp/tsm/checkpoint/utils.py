"""``torch.sagemaker.checkpoint.utils``: ``limit_num_subdirs`` keeps a checkpoint directory's newest ``n`` folders."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("jmp")

_INTEGER = re.compile(r"\d+")


def _by_last_int(name: str) -> int:
    """The last integer in ``name`` (-1 without one): ``llama-30steps`` -> 30."""
    found = _INTEGER.findall(os.path.basename(os.path.normpath(name)))
    return int(found[-1]) if found else -1


SORT_BY_LAST_INT: Callable[[str], Any] = _by_last_int


def limit_num_subdirs(
    path: str | os.PathLike,
    num: int | None,
    sort_fn: Callable[[str], Any] | None = None,
    regex: str | None = None,
    log: bool = True,
) -> list[str]:
    """Delete the folders under ``path`` but the newest ``num`` (None or below 1: keep all); returns those deleted.

    Only folders ``regex`` matches count (default: all); newest is the largest ``sort_fn(name)`` (default: mtime).
    """
    root = os.fspath(path)
    if num is None or num < 1 or not os.path.isdir(root):
        return []
    names = [
        name
        for name in os.listdir(root)
        if os.path.isdir(os.path.join(root, name)) and (regex is None or re.search(regex, name))
    ]
    key = sort_fn if sort_fn is not None else (lambda name: os.path.getmtime(os.path.join(root, name)))
    removed = sorted(names, key=key)[: max(0, len(names) - num)]
    for name in removed:
        shutil.rmtree(os.path.join(root, name))
        if log:
            logger.info("limit_num_subdirs: removed %s (keeping the newest %d)", os.path.join(root, name), num)
    return removed
