"""XLA compiler options for step programs: recomputation kept apart, convolutions on XLA:CPU's fast path.

``jax.checkpoint`` puts an optimization barrier on what the backward pass recomputes from, so that XLA
does not merge the recomputation with the forward pass (which would keep the forward's activations
alive and save nothing). XLA:CPU expands those barriers before its CSE passes, so there the
recomputation merges back; keeping them (disabling the ``cse_barrier_expander`` pass) makes activation
checkpointing save memory on CPU as it does on GPU and TPU. Programs without checkpoints have no
barriers, so the option changes nothing for them.

XLA:CPU (jaxlib 0.10) hands dots, reductions and convolutions to YNNPACK by default. Its convolutions are
slower than XLA's own (Eigen) ones on the convolutions a CNN's training step has, most of all on filter
gradients (a small output from a large window): GroupedNet's 32->64 3x3 convolution over 64 images of 26x26,
forward and both gradients, took 197 ms through YNNPACK and 105 ms through Eigen side by side on this
2-core machine (``benchmarks/step_speed.py`` has the whole step). So the library fusions are listed
explicitly: YNNPACK's dots and reductions (the defaults) without its convolutions.
"""

from __future__ import annotations

_KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
_LIBRARY_FUSIONS = ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "LIBRARY_FUSION_TYPE_REDUCE")
_YNNPACK_WITHOUT_CONVOLUTIONS = {"xla_cpu_experimental_ynn_fusion_type": ",".join(_LIBRARY_FUSIONS)}


def compiler_options(platform: str) -> dict[str, str] | None:
    """Options for ``jax.jit(..., compiler_options=...)`` of a step program on devices of ``platform``."""
    return {**_KEEP_BARRIERS, **_YNNPACK_WITHOUT_CONVOLUTIONS} if platform == "cpu" else None
