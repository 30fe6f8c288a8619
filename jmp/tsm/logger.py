"""``torch.sagemaker.logger.get_logger``: the logger SMP v2 scripts log their own progress with.

It is jmp's logger (``"jmp"``), as SMP v2's is the library's own: the script's lines and jmp's notices go one
way, through jmp's rank filter (INFO and WARNING on the first process only, errors on every one; the scripts
log on rank 0 anyway). ``get_logger`` makes it print INFO and above on stderr, with the time and level, unless
the script has configured the root logger, whose handlers then print them (once).
"""

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
