"""``torch.sagemaker.logger.get_logger``: jmp's logger (rank-filtered), printing INFO+ unless the root logger is set."""

from __future__ import annotations

import logging
import sys

FORMAT = "[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"


class StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (a script, or a test's capture, may replace it), while
    the root logger has no handler of its own."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT))
        self.addFilter(lambda record: not logging.getLogger().handlers)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def get_logger() -> logging.Logger:
    """jmp's logger, printing INFO and above (its stderr handler added at the first call)."""
    logger = logging.getLogger("jmp")
    if not any(isinstance(handler, StderrHandler) for handler in logger.handlers):
        logger.addHandler(StderrHandler())
        logger.setLevel(logging.INFO)
    return logger
