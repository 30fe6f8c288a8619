"""jmp's own INFO / WARNING log lines on the first process only (errors everywhere); user loggers are left alone."""

from __future__ import annotations

import logging
import os

import jax

# the variables launchers give a process its rank in, before JAX's runtime knows it
_RANK_VARIABLES = ("RANK", "JAX_PROCESS_ID", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def process_rank() -> int:
    """This process's rank in its job: JAX's once its multi-process runtime has started, else the launcher's."""
    if jax.distributed.is_initialized():
        return jax.process_index()
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class FirstProcessOnly(logging.Filter):
    """Passes every record on the first process, and only errors on the others."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or process_rank() == 0


def install(logger: logging.Logger | None = None) -> None:
    """Put the filter on ``logger`` (default: jmp's), once."""
    logger = logging.getLogger("jmp") if logger is None else logger
    if not any(isinstance(f, FirstProcessOnly) for f in logger.filters):
        logger.addFilter(FirstProcessOnly())
