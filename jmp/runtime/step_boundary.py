"""What runs after each optimizer update; packages below the optimizer (saving's preemption) register here.

Under ``jmp.launch --step-timeout`` each step touches ``JMP_PROGRESS_FILE`` and SIGUSR1 dumps Python stacks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

PROGRESS_FILE = "JMP_PROGRESS_FILE"

_callbacks: list[Callable[[Any], None]] = []


def after_each_step(callback: Callable[[Any], None]) -> None:
    """Call ``callback(optimizer)`` after every update of every ``DistributedOptimizer``."""
    _callbacks.append(callback)


def step_ended(optimizer: Any) -> None:
    """Called by the optimizer once its update is issued (and its state in place)."""
    for callback in _callbacks:
        callback(optimizer)


def report_progress(environment: Mapping[str, str] = os.environ) -> bool:
    """With ``JMP_PROGRESS_FILE``: touch it after each step, dump stacks on SIGUSR1; returns whether it was set."""
    path = environment.get(PROGRESS_FILE)
    if not path:
        return False
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    after_each_step(lambda _optimizer: os.utime(path))
    return True


report_progress()
