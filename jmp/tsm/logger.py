"""``torch.sagemaker.logger.get_logger``: the logger SMP v2 scripts log their own progress with.

A ``logging.Logger`` that prints INFO and above on stderr on every process (the scripts choose which rank
logs), with the time and level, whatever the root logger's configuration, and not twice when the script
configures the root logger too. jmp's own notices go to the ``jmp`` logger, as everywhere in jmp.
"""

from __future__ import annotations

import logging
import sys

NAME = "torch.sagemaker"
FORMAT = "[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"


class StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (a script, or a test's capture, may replace it)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr


def get_logger(name: str = NAME) -> logging.Logger:
    """The logger ``name`` with one stderr handler at INFO (added at the first call), not propagating to the root."""
    logger = logging.getLogger(name)
    if not any(isinstance(handler, StderrHandler) for handler in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
