"""XLA compiler options for step programs: recomputation kept apart, fp8 products on a GPU's fp8 GEMMs.

``jax.checkpoint`` puts an optimization barrier on what the backward pass recomputes from, so that XLA
does not merge the recomputation with the forward pass (which would keep the forward's activations
alive and save nothing). XLA:CPU expands those barriers before its CSE passes, so there the
recomputation merges back; keeping them (disabling the ``cse_barrier_expander`` pass) makes activation
checkpointing save memory on CPU as it does on GPU and TPU. Programs without checkpoints have no
barriers, so the option changes nothing for them.

XLA:CPU (jaxlib 0.10) hands dots, reductions and convolutions to YNNPACK by default, and step programs keep that:
sending convolutions to Eigen (``xla_cpu_experimental_ynn_fusion_type``) was faster on a CNN's filter gradients but
gave wrong gradients (torchvision's shufflenet_v2, 5.7e-2 from float64; ``docs/benchmarks.md`` has the figures).

On a GPU, XLA's Triton GEMM fusion takes products before its cuBLASLt fp8 rewrite can see them, and an fp8
step then never reaches the fp8 tensor cores. On an H100 (jax 0.11.2; a Llama with Llama 3.2 1B's widths, 4 x 2048
tokens), with Triton GEMMs on: written as dots on the fp8 arrays, a 4-layer fp8 step had not compiled after 120 s,
and with autotuning off too 66 of its 87 products ran as generic fp8 dots (417.7 ms a step); written as
``jmp.precision.fp8_matmul`` writes them now, they compiled into bf16 cuBLAS GEMMs with the quantisation elided
(the losses were bf16's, not fp8's). With Triton GEMMs off, all 339 of the 16-layer model's products became
cuBLASLt fp8 GEMMs (168.6 ms a step), and its bf16 step was no slower without them (153.1 ms; 155.6 ms with them in
an earlier session), so an fp8 step turns them off.
"""

from __future__ import annotations

_KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
_FP8_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(platform: str, fp8: bool = False) -> dict[str, str | bool] | None:
    """Options for ``jax.jit(..., compiler_options=...)`` of a step program on devices of ``platform``, one that
    multiplies in fp8 when ``fp8``."""
    if platform == "cpu":
        return dict(_KEEP_BARRIERS)
    if platform == "gpu" and fp8:
        return dict(_FP8_GEMMS)
    return None
