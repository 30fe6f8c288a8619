"""``torch.sagemaker.utils.utils``: ``timeit``, the timer SMP v2 scripts put around model creation and wrapping."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from jmp.tsm.logger import get_logger


@contextlib.contextmanager
def timeit(enabled: bool = True, label: str = "", rank: int | None = None) -> Iterator[None]:
    """Log how long the block took, as ``"<label> took 1.23 s"``, on rank 0 (or when no rank is given)."""
    start = time.perf_counter()
    yield
    if enabled and rank in (None, 0):
        get_logger().info("%s took %.3f s", label or "block", time.perf_counter() - start)
