"""Config keys jmp accepts but does not act on, and why; each logs once per process (WARNING if results can differ)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from jmp.runtime import notices

_COMPILED = "XLA schedules the collectives of the compiled step"

NO_EFFECT: dict[str, tuple[int, str]] = {
    "horovod": (logging.INFO, "data parallelism is jax's, not Horovod's"),
    "ddp": (logging.INFO, "data parallelism over the remaining devices is always on"),
    "ddp_port": (logging.INFO, "jax.distributed coordinates the processes, not torch DDP"),
    "ddp_dist_backend": (logging.INFO, "XLA chooses the collectives' transport"),
    "contiguous": (logging.INFO, "a TensorFlow partitioner option; pipeline stages come from jmp's placement"),
    "deterministic_server": (logging.INFO, "the compiled step runs in the same order on every device already"),
    "skip_tracing": (logging.INFO, "jmp traces abstractly (shapes only), which needs no device memory"),
    "static_mode": (logging.INFO, "every step is one compiled program already"),
    "fast_mode": (logging.INFO, _COMPILED),
    "predefined_hooks": (logging.INFO, "tensor-parallel splits come from jmp's rule table"),
    "load_partition": (logging.INFO, "partitions are placed by jmp's pipeline placement"),
    "sdp_reduce_bucket_size": (logging.INFO, _COMPILED),
    "sdp_max_live_parameters": (logging.INFO, _COMPILED),
    "sdp_hierarchical_allgather": (logging.INFO, _COMPILED),
    "fsdp_cache_flush_warnings": (logging.INFO, "there is no PyTorch caching allocator to flush"),
    "allow_empty_shards": (logging.INFO, "a parameter that does not divide over the shards stays whole"),
}
CHANGED_MEANING: dict[str, tuple[int, str]] = {
    "fp16_params": (logging.INFO, "trains in fp16 as 'fp16': True does; float32 master parameters are kept"),
}

_TABLES = (
    (NO_EFFECT, "has no effect in jmp"),
    (CHANGED_MEANING, "is accepted"),
)


def log_once(given: Iterable[str]) -> None:
    """Log, once per process, each of the ``given`` keys that has no effect (or another meaning) here."""
    for key in given:
        for table, effect in _TABLES:
            if key in table:
                level, reason = table[key]
                notices.log_once(f"config-key:{key}", level, "config key '%s' %s: %s", key, effect, reason)
