"""Notices logged once per process, keyed by what they are about (prefixed by the part of jmp that says them)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("jmp")  # one logger: its rank-0 filter (runtime.rank_zero_logging) sees every notice

_SAID: set[str] = set()


def unsaid(keys: Iterable[str]) -> list[str]:
    """Those of ``keys`` not given before in this process, in order; all of ``keys`` count as given from now on."""
    new = [key for key in dict.fromkeys(keys) if key not in _SAID]
    _SAID.update(new)
    return new


def log_once(key: str, level: int, message: str, *args: Any) -> None:
    """Log ``message % args`` at ``level`` the first time ``key`` is given in this process."""
    if unsaid([key]):
        logger.log(level, message, *args)


def warn_once(key: str, message: str, *args: Any) -> None:
    log_once(key, logging.WARNING, message, *args)


def info_once(key: str, message: str, *args: Any) -> None:
    log_once(key, logging.INFO, message, *args)
