"""``smp.model_creation``: the context a model is built in (its dtype, tensor parallelism), as SMP's."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from jmp.errors import ArgumentTypeError
from jmp.runtime import mesh_state as state
from jmp.sharding import tensor_parallelism as tensor_parallel_context
from jmp.wrapped_model.delayed_init import delay_param_initialization

logger = logging.getLogger("jmp")

_FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False,
    dtype: torch.dtype | None = None,
    distribute_embedding: bool = False,
    **tensor_parallel_config: Any,
) -> Iterator[None]:
    """Build a model inside: its parameters are created in ``dtype`` and its modules marked for tensor parallelism.

    A model created in ``torch.bfloat16`` / ``torch.float16`` trains in that dtype, with float32 master
    parameters kept by jmp (see ``jmp.precision.policy``). With the config key ``delayed_parameter_initialization``
    (``smp.init`` first), the model is built on the meta device and ``smp.DistributedModel`` initialises it
    directly into its shards (see ``smp.delay_param_initialization``).

    Args:
        tensor_parallelism: distribute the modules created inside over ``tp`` (``smp.tensor_parallelism``).
        dtype: torch's default floating dtype while inside (parameters created without a dtype get it).
        distribute_embedding: SMP's switch for splitting embeddings; jmp splits embeddings by its
            tensor-parallel rules either way.
        tensor_parallel_config: SMP's per-module tensor-parallel options; jmp's rules choose the split.
    """
    if dtype is not None and dtype not in _FLOATING:
        raise ArgumentTypeError(f"smp.model_creation(dtype=...) takes a floating torch dtype, not {dtype!r}")
    if distribute_embedding or tensor_parallel_config:
        logger.info(
            "smp.model_creation: distribute_embedding / tensor-parallel options %s have no effect in jmp "
            "(its tensor-parallel rules place every supported module)",
            sorted(tensor_parallel_config) + (["distribute_embedding"] if distribute_embedding else []),
        )
    previous = torch.get_default_dtype()
    delayed = state.is_initialized() and state.get_config().delayed_parameter_initialization
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with (
            tensor_parallel_context(tensor_parallelism) if tensor_parallelism else contextlib.nullcontext(),
            delay_param_initialization(delayed),
        ):
            yield
    finally:
        torch.set_default_dtype(previous)
