"""XLA compiler options for step programs.

- Keep the optimization barriers ``jax.checkpoint`` puts on what the backward recomputes from: XLA:CPU expands
  them before CSE (``cse_barrier_expander``), merging the recomputation back into the forward.
- On XLA:CPU, give YNNPACK dots and reductions only (``xla_cpu_experimental_ynn_fusion_type``): convolutions
  are faster on Eigen for CNN training steps, equally accurate (``tests/compiled_step/test_cnn_numerics.py``).
- For an fp8 step on a GPU, turn Triton GEMM fusion off: it takes products before the cuBLASLt fp8 rewrite
  sees them, so they never reach the fp8 tensor cores.
"""

from __future__ import annotations

_KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
_LIBRARY_FUSIONS = ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "LIBRARY_FUSION_TYPE_REDUCE")
_YNNPACK_WITHOUT_CONVOLUTIONS = {"xla_cpu_experimental_ynn_fusion_type": ",".join(_LIBRARY_FUSIONS)}
_FP8_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(platform: str, fp8: bool = False) -> dict[str, str | bool] | None:
    """Options for ``jax.jit(..., compiler_options=...)`` of a step program on ``platform`` (in fp8: ``fp8``)."""
    if platform == "cpu":
        return {**_KEEP_BARRIERS, **_YNNPACK_WITHOUT_CONVOLUTIONS}
    if platform == "gpu" and fp8:
        return dict(_FP8_GEMMS)
    return None
