"""Test setup: 8 emulated CPU devices (set before JAX is imported anywhere)."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    return f"jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} devices; torch {torch.__version__}"
