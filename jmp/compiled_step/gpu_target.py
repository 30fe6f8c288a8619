"""GPUs a step can be compiled for from a host without one (``smp.estimate_memory(..., target="h100")``).

JAX's CUDA plugin compiles for a GPU described by XLA's ``GpuTargetConfigProto`` with no GPU attached
(``jax.experimental.topologies``): the devices it makes can lay out a mesh and compile, not run. Each target
here is the datasheet of one GPU (SXM parts), written out as that proto, and the peaks a roofline needs.
Needs ``pip install jax-cuda12-plugin==<jaxlib's version> "nvidia-cudnn-cu12>=9.8,<10"`` (cuDNN: JAX reads
its version before it emits cuDNN's flash attention) and, on a host without CUDA, ``JAX_PLATFORMS=cpu`` (or
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``) before JAX starts, else the plugin fails its CUDA version check unloaded.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import topologies

from jmp.errors import ConfigError, JmpError


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU: what XLA compiles for, and its peaks (dense bf16 FLOP/s; bytes/s of memory, of NVLink one way, and
    of the network between hosts: AWS's p5 / p5e / p4d EFA, 3,200 / 3,200 / 400 Gb/s over 8 GPUs)."""

    name: str
    capability: tuple[int, int]
    cores: int
    memory_bytes: int  # as CUDA reports it (the HBM less what the driver keeps)
    memory_bandwidth: float
    l2_bytes: int
    clock_ghz: float
    shared_memory_per_core: int
    bf16_flops: float
    link_bandwidth: float
    network_bandwidth: float


TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 84_942_979_072, 3.35e12, 50 << 20, 1.98, 228 << 10,
                      989e12, 450e9, 50e9),
    "h200": GpuTarget("NVIDIA H200", (9, 0), 132, 150_110_011_392, 4.8e12, 50 << 20, 1.98, 228 << 10, 989e12,
                      450e9, 50e9),
    "a100": GpuTarget("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_198_045_184, 2.04e12, 40 << 20, 1.41, 164 << 10,
                      312e12, 300e9, 6.25e9),
}  # fmt: skip

# Matmuls as cuBLAS calls: on a GPU, autotuning picks cuBLAS for most training-sized matmuls (the H100 Llama step of
# benchmarks/results/gpu_speed_llama_h100.json called it 195 times); without a GPU nothing is timed and XLA would
# keep each a Triton fusion, which holds less (Llama 1.5B: 2.7 GB less than measured).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def get(target: str | GpuTarget) -> GpuTarget:
    if isinstance(target, GpuTarget):
        return target
    if target.lower() not in TARGETS:
        raise ConfigError(f"target {target!r}: jmp knows the GPUs {', '.join(TARGETS)}")
    return TARGETS[target.lower()]


_LIMITS = (  # CUDA's per-block and per-SM limits, the same on compute capability 8.0 and 9.0
    "threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048 shared_memory_per_block: 49152 "
    "block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 registers_per_core_limit: 65536 "
    "registers_per_block_limit: 65536"
)


def target_config(gpu: GpuTarget) -> str:
    """``gpu`` as XLA's ``GpuTargetConfigProto`` in text form."""
    (major, minor), shared = gpu.capability, gpu.shared_memory_per_core
    return (
        f"gpu_device_info {{ {_LIMITS} core_count: {gpu.cores} fpus_per_core: {128 if major >= 9 else 64} "
        f"shared_memory_per_core: {shared} shared_memory_per_block_optin: {shared - 1024} l2_cache_size: "
        f"{gpu.l2_bytes} memory_bandwidth: {int(gpu.memory_bandwidth)} clock_rate_ghz: {gpu.clock_ghz} "
        f"device_memory_size: {gpu.memory_bytes} cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
        f'platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 }} device_description_str: "{gpu.name}"'
    )


def devices(target: str | GpuTarget, count: int) -> list:
    """``count`` compile-only devices of ``target`` (one host's view of them all, as jmp's emulated devices are)."""
    gpu = get(target)
    try:
        from jax._src.lib import cuda_versions  # the plugin's; what JAX's cuDNN attention asks for its version

        cuda_versions.cudnn_get_version()
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(gpu), topology=f"1x1x{count}"
        )
    except Exception as error:  # no plugin (ImportError, NotImplementedError), no cuDNN (RuntimeError)
        raise JmpError(
            f"compiling for {gpu.name} without one needs JAX's CUDA plugin and cuDNN (pip install "
            f'jax-cuda12-plugin=={jax.__version__} "nvidia-cudnn-cu12>=9.8,<10"), and on a host without CUDA, '
            "JAX_PLATFORMS=cpu or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before JAX starts (the plugin's version check "
            f"fails there and it is not loaded): {type(error).__name__}: {error}"
        ) from error
    return list(topology.devices)
