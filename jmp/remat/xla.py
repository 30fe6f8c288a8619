"""XLA compiler options for step programs: recomputation kept apart, convolutions on XLA:CPU's Eigen path, fp8
products on a GPU's fp8 GEMMs.

``jax.checkpoint`` puts an optimization barrier on what the backward pass recomputes from, so that XLA
does not merge the recomputation with the forward pass (which would keep the forward's activations
alive and save nothing). XLA:CPU expands those barriers before its CSE passes, so there the
recomputation merges back; keeping them (disabling the ``cse_barrier_expander`` pass) makes activation
checkpointing save memory on CPU as it does on GPU and TPU. Programs without checkpoints have no
barriers, so the option changes nothing for them.

XLA:CPU (jaxlib 0.10) hands dots, reductions and convolutions to YNNPACK by default. Its convolutions are slower than
XLA's own (Eigen) ones on a CNN's training step, so step programs list YNNPACK's dots and reductions alone
(``xla_cpu_experimental_ynn_fusion_type``) and convolutions run on Eigen. Side by side on a 2-core AMD EPYC, one
device: GroupedNet (the main job's model, 64 images) 53 against 69 ms a step; a ResNet-18 of width 16 at 160 x 160,
16 images, 141 against 157 ms; small ResNet-10 / ShuffleNet-v2 steps equal. Both paths are as accurate as float32
PyTorch (``tests/compiled_step/test_cnn_numerics.py``, which replays each run's ReLU and max-pool decisions: a
decision within rounding of its boundary is decided by the last bit, so any two float32 programs flip different
ones, and an unreplayed comparison once read such flips in torchvision's shufflenet_v2 as Eigen's error).

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
_LIBRARY_FUSIONS = ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "LIBRARY_FUSION_TYPE_REDUCE")
_YNNPACK_WITHOUT_CONVOLUTIONS = {"xla_cpu_experimental_ynn_fusion_type": ",".join(_LIBRARY_FUSIONS)}
_FP8_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(platform: str, fp8: bool = False) -> dict[str, str | bool] | None:
    """Options for ``jax.jit(..., compiler_options=...)`` of a step program on devices of ``platform``, one that
    multiplies in fp8 when ``fp8``."""
    if platform == "cpu":
        return {**_KEEP_BARRIERS, **_YNNPACK_WITHOUT_CONVOLUTIONS}
    if platform == "gpu" and fp8:
        return dict(_FP8_GEMMS)
    return None
