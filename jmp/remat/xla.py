"""XLA compiler options that keep recomputation from being undone.

``jax.checkpoint`` puts an optimization barrier on what the backward pass recomputes from, so that XLA
does not merge the recomputation with the forward pass (which would keep the forward's activations
alive and save nothing). XLA:CPU expands those barriers before its CSE passes, so there the
recomputation merges back; keeping them (disabling the ``cse_barrier_expander`` pass) makes activation
checkpointing save memory on CPU as it does on GPU and TPU. Programs without checkpoints have no
barriers, so the option changes nothing for them.
"""

from __future__ import annotations

_KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compiler_options(platform: str) -> dict[str, str] | None:
    """Options for ``jax.jit(..., compiler_options=...)`` of a step program on devices of ``platform``."""
    return dict(_KEEP_BARRIERS) if platform == "cpu" else None
