"""On CPU, ``smp.init`` has glibc's malloc keep the blocks XLA frees (``jmp.runtime.host_memory``): a program's
temporaries larger than glibc's largest dynamic mmap threshold (32 MiB) then come from the heap on every run
instead of fresh pages, unless the user configured malloc themselves. Counted in page faults, in processes of
their own (malloc's settings are the process's), on one CPU device: with several, XLA's threads also allocate
from malloc arenas of their own, which give wholly free heaps back to the system, and about a fifth of the
faults remain (GroupedNet at dp8: 700-1,000 a step against 9,700; ``jmp.runtime.host_memory``)."""

import os
import subprocess
import sys
import textwrap

_FAULTS_PER_RUN = """
    import resource
    import jax
    import jax.numpy as jnp
    import jmp as smp

    smp.init({})
    program = jax.jit(lambda x, z: jnp.tanh(x @ x.T) @ z)  # a 36 MiB temporary
    x = z = jnp.ones((3072, 4))
    for _ in range(3):
        program(x, z).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        program(x, z).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_run(env: dict[str, str]) -> float:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FAULTS_PER_RUN)],
        capture_output=True, text=True, timeout=300, env=os.environ | {"XLA_FLAGS": ""} | env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split()[-1])


def test_a_programs_temporaries_reuse_heap_memory_unless_the_user_configured_malloc():
    pages = 36 * 2**20 // 4096
    assert _faults_per_run({}) < pages / 100
    assert _faults_per_run({"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}) > pages / 2  # left as the user set it
