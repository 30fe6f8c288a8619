"""torchvision's ShuffleNetV2 (vendored: tests/vendored/torchvision) trains a step in train mode as float64 PyTorch
does. With YNNPACK told to take dots and reductions only (XLA:CPU's convolutions then on Eigen), its gradients were
off by up to 5.7e-2 while the loss matched; with XLA's default library fusions they are within float32's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jmp.remat import xla

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_step_program_keeps_xlas_default_library_fusions():
    assert "xla_cpu_experimental_ynn_fusion_type" not in (xla.compiler_options("cpu") or {})


def test_shufflenet_v2_in_train_mode_steps_as_float64_pytorch_with_xlas_optimisations_on():
    env = os.environ | {"PYTHONPATH": str(ROOT), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    script = [sys.executable, "-m", "tests.compiled_step.shufflenet_step_script"]
    result = subprocess.run(script, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["error"] < 1e-3, found  # float32's own error here is ~3e-5; Eigen's convolutions gave 5.7e-2
