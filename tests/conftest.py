"""Test setup: 8 emulated CPU devices and XLA flags (set before JAX is imported anywhere)."""

import os
import shutil
import tempfile

# XLA:CPU's LLVM backend without its optimisation passes, and its elemental emitters in place of the MLIR fusion
# emitters: the suite's programs are tiny and the suite waits on compiling them, not running them (optimisation
# level 0: tests/precision's half-precision cases 25-35% less CPU time; without the fusion emitters: two
# tests/sharding/test_parity cases compile in 4.1 s instead of 9.7). Processes the tests launch inherit the flags.
for _flag in (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# a compilation cache of this session's own (jmp turns JAX's persistent cache on): programs compiled by one
# test are loaded by the next, and a run's timing does not depend on what earlier runs left behind
_OWN_CACHE = None
if "JMP_COMPILATION_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["JMP_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jmp-test-xla-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    return f"jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} devices; torch {torch.__version__}"


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The files that take longest (launched processes, notebooks, the OpInfo sweep) go first: pytest-xdist hands out
# whole files in collection order (--dist loadfile), and one of them started last keeps a worker busy while the
# others have nothing left.
_LONG_FIRST = (
    "tests/multiprocess/",
    "tests/notebooks/",
    "tests/front_end/test_aws_smp_",
    "tests/torch_bridge/test_opinfo.py",
    "tests/pipeline/",
)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))  # stable: the order within each kept


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one test process per core, at most 4 (each emulates 8 devices and compiles on every core)."""
    return max(1, min(os.cpu_count() or 1, 4))
