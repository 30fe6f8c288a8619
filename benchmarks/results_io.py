"""What every benchmark records beside its numbers: the machine, and the JSON file it writes."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import flax
import jax
import torch


def machine() -> dict:
    return dict(
        platform=platform.platform(),
        cpus=os.cpu_count(),
        jax=jax.__version__,
        flax=flax.__version__,
        torch=torch.__version__,
        devices=jax.device_count(),
        backend=jax.default_backend(),
    )


def write_results(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
