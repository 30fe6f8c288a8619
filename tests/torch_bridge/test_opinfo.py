"""Lowering coverage checked against PyTorch's own OpInfo database.

Every lowered op that has an OpInfo entry runs on its sample inputs (float32
where supported) and is compared with torch. The only accepted differences are
listed below with their reason.
"""

import jax
import pytest

from jmp.runtime import compilation_cache as compilation
from tests.torch_bridge import opinfo

# (OpInfo name, reason) of samples known to differ from torch.
KNOWN_DIFFERENCES = {
    "tensordot": "torch broadcasts size-1 contraction dimensions; jnp.tensordot requires equal sizes",
    "nn.functional.batch_norm": "batch statistics of an empty (0,)-shaped batch",
}


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("expecttest")  # needed by torch.testing._internal
    # a few programs of 200 samples each and ~100 tiny ones (ops run eagerly): the persistent cache's key and lookup
    # cost more than they save
    cached = jax.config.jax_enable_compilation_cache
    compilation.configure_cache(False)
    try:
        return opinfo.run(limit_samples=1)  # every op on its first sample (the suite's time: two took 50 s)
    finally:
        if cached:
            compilation.configure_cache(True)


def test_lowered_ops_match_torch_on_opinfo_samples(reports):
    ops, passed, total = opinfo.summary(reports)
    print(f"\nOpInfo: {ops} ops lowered; {passed}/{total} samples match torch")
    unexpected = {
        name: report.failed for name, report in reports.items() if report.failed and name not in KNOWN_DIFFERENCES
    }
    assert not unexpected, "\n".join(f"{name}: {failures[0]}" for name, failures in unexpected.items())
    assert ops >= 380, f"only {ops} OpInfo ops are lowered"
