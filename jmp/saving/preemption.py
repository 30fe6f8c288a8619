"""Preemption: a SIGTERM ends the run at a step boundary with a checkpoint.

With ``JMP_PREEMPTION_CHECKPOINT_DIR`` set, every process reaches JAX's preemption sync point, saves partial
checkpoint ``preempted`` there (with ``smp.set_preemption_user_content``'s content), waits, and exits 0.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import multihost_utils

from jmp.errors import ArgumentTypeError
from jmp.runtime import step_boundary
from jmp.saving import checkpoints, partial

logger = logging.getLogger("jmp")

ENVIRONMENT = "JMP_PREEMPTION_CHECKPOINT_DIR"
TAG = "preempted"

_user_content: Callable[[], Any] | None = None
_step_ids = itertools.count()  # the same sequence on every process: one id per optimizer step
_sigterm = threading.Event()  # a process alone (JAX's preemption notifier watches SIGTERM only in a multi-process run)
_handler_installed = False


def set_preemption_user_content(user_content: Callable[[], Any] | None) -> None:
    """Set the function whose result a preemption checkpoint saves as ``user_content`` (None: none)."""
    global _user_content
    if user_content is not None and not callable(user_content):
        raise ArgumentTypeError(
            "smp.set_preemption_user_content takes a function returning the user_content (e.g. "
            f"lambda: {{'step': step}}), not {type(user_content).__name__}"
        )
    _user_content = user_content


def _after_step(optimizer: Any) -> None:
    root = os.environ.get(ENVIRONMENT)
    if not root or not _reached_sync_point(next(_step_ids)):
        return
    content = _user_content() if _user_content is not None else None
    checkpoints.save_checkpoint(root, TAG, model=optimizer.model, optimizer=optimizer, user_content=content)
    partial.wait_for_saves()
    logger.warning("preempted (SIGTERM): saved partial checkpoint '%s' in %s; exiting with 0", TAG, root)
    raise SystemExit(0)


def _reached_sync_point(step_id: int) -> bool:
    if jax.process_count() > 1:
        return multihost_utils.reached_preemption_sync_point(step_id)
    _watch_sigterm()
    return _sigterm.is_set()


def _watch_sigterm() -> None:
    global _handler_installed
    if _handler_installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, lambda *_: _sigterm.set())
    _handler_installed = True


step_boundary.after_each_step(_after_step)
