"""On CPU, ``smp.init`` has glibc's malloc keep the blocks freed (``jmp.runtime.host_memory``): a block larger
than glibc's largest dynamic mmap threshold (32 MiB), as XLA:CPU allocates a program's temporaries on every run,
then comes from the heap each time instead of fresh pages, unless the user configured malloc themselves. Counted
in page faults per allocation, in processes of their own (malloc's settings are the process's). What a compile
frees is given back to the system (it would stay resident at the next step's peak)."""

import os
import subprocess
import sys
import textwrap

BLOCK = 36 * 2**20

_FAULTS_PER_BLOCK = f"""
    import ctypes
    import ctypes.util
    import resource
    import jmp as smp

    smp.init({{}})
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    def used_and_freed():
        block = libc.malloc({BLOCK})
        ctypes.memset(block, 1, {BLOCK})
        libc.free(block)

    used_and_freed()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        used_and_freed()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _run(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``script`` in a process of its own (malloc's settings are the process's), which must succeed."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=300, env=os.environ | (env or {}),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _faults_per_block(env: dict[str, str]) -> float:
    return float(_run(_FAULTS_PER_BLOCK, env).stdout.split()[-1])


def test_a_block_freed_is_reused_from_the_heap_unless_the_user_configured_malloc():
    pages = BLOCK // 4096
    assert _faults_per_block({}) < pages / 100
    assert _faults_per_block({"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}) > pages / 2  # left as the user set it


_RESIDENT_AFTER_A_COMPILE = f"""
    import ctypes
    import ctypes.util
    import jax
    import jax.numpy as jnp
    import jmp as smp

    def anonymous():
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * 4096

    smp.init({{}})
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    block = libc.malloc({8 * BLOCK})  # freed memory of the size a compile's working memory takes
    ctypes.memset(block, 1, {8 * BLOCK})
    libc.free(block)
    kept = anonymous()
    jax.jit(lambda x: x + 1)(jnp.ones(3))
    print(kept - anonymous())
"""


def test_the_memory_freed_before_a_compile_is_given_back_to_the_system():
    done = _run(_RESIDENT_AFTER_A_COMPILE)
    # every whole page of the freed block goes (the compile's own allocations are far smaller than one block)
    assert int(done.stdout.split()[-1]) >= 8 * BLOCK - BLOCK


_ALLOCATED_BYTES = f"""
    import ctypes
    import ctypes.util
    import jmp as smp
    from jmp.runtime import host_memory

    smp.init({{}})
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    before = host_memory.allocated_bytes()
    block = libc.malloc({BLOCK})  # no page touched: counted all the same
    held = host_memory.allocated_bytes()
    libc.free(block)
    print(held - before, host_memory.allocated_bytes() - before)
"""


def test_allocated_bytes_counts_a_block_in_use_and_not_one_freed():
    done = _run(_ALLOCATED_BYTES)
    held, freed = (int(n) for n in done.stdout.split()[-2:])
    # the block and its header (other threads may allocate a few bytes meanwhile)
    assert abs(held - BLOCK) <= 2 * 4096, held
    # freed, it is no longer counted, although smp.init has malloc keep its pages for the next block
    assert abs(freed) <= 2 * 4096, freed


_GIVEN_BACK_AFTER_AN_UPDATE = f"""
    import ctypes
    import ctypes.util
    import jmp as smp
    from jmp.runtime import host_memory, step_boundary

    smp.init({{}})
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    def freed_after_use(size):
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        return host_memory.anonymous_resident_bytes()

    assert host_memory.give_back_between_steps in step_boundary._callbacks
    kept = freed_after_use({8 * BLOCK})  # what a large step leaves free
    host_memory.give_back_between_steps()
    large = kept - host_memory.anonymous_resident_bytes()
    kept = freed_after_use({BLOCK // 4})  # less than GIVE_BACK_ABOVE: kept for the next step
    host_memory.give_back_between_steps()
    print(large, kept - host_memory.anonymous_resident_bytes())
"""


def test_what_a_step_left_free_is_given_back_after_the_update_once_it_is_large():
    done = _run(_GIVEN_BACK_AFTER_AN_UPDATE)
    large, small = (int(n) for n in done.stdout.split()[-2:])
    assert large >= 7 * BLOCK, large
    assert abs(small) < BLOCK // 8, small  # the block's pages stay resident, for the next step to reuse


_HEAPS_OF_EIGHT_THREADS = """
    import ctypes
    import ctypes.util
    import os
    import sys
    import threading
    import jmp

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    started = threading.Barrier(8)

    def allocate():
        started.wait()  # all alive at once: none can take the heap of one that ended
        libc.free(libc.malloc(1 << 20))

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.stderr.flush()
    libc.malloc_stats()  # to stderr: one "Arena N:" section a heap
"""


def _heaps(env: dict[str, str]) -> int:
    return _run(_HEAPS_OF_EIGHT_THREADS, env).stderr.count("Arena ")


def test_importing_jmp_gives_the_threads_one_heap_unless_the_user_configured_malloc():
    assert _heaps({}) == 1
    assert _heaps({"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}) > 1  # glibc's default: up to 8 heaps a core
