"""jmp: SageMaker-style model parallelism for PyTorch models, on JAX/XLA (``import jmp as smp``; see README.md)."""

import sys as _sys

__version__ = "0.1.0"


def _only_the_launcher() -> bool:
    """``python -m jmp.launch`` imports this package before it runs the launcher, which needs the standard library
    only: torch and JAX (2-3 s of CPU) are then left to the processes it starts."""
    argv = getattr(_sys, "orig_argv", [])
    locating = _sys.argv[:1] == ["-m"]  # Python sets this while it finds the module `-m` names
    return locating and any(a == "-m" and b == "jmp.launch" for a, b in zip(argv, argv[1:]))


if _only_the_launcher():

    def __getattr__(name: str):
        from jmp import smp_api

        return getattr(smp_api, name)

else:
    from jmp.runtime import host_memory as _host_memory
    from jmp.runtime import host_threads as _host_threads

    _host_threads.reserve()  # before anything makes JAX's CPU devices
    _host_memory.one_heap()
    from jmp.smp_api import *  # noqa: F403
    from jmp.smp_api import __all__  # noqa: F401
