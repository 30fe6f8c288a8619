"""Set-up of every Python process ``python -m jmp.launch`` starts: this directory is first on their
``PYTHONPATH``, so Python's start-up imports this ``sitecustomize``. It makes SMP v2 scripts run with no edit:

- ``torch.sagemaker`` and the names under it resolve to ``jmp.tsm`` (``jmp.runtime.smp_aliases``). ``torch`` is
  a real package, so no directory can stand for its ``sagemaker``; a finder answers for these names instead,
  and imports jmp at the first of them.
- ``torch.distributed.init_process_group`` takes any backend name (``"smddp"``, ``"nccl"``, ...) and starts
  gloo: torch.distributed carries the host tensors a script holds between steps (the model's collectives are
  XLA's, inside the compiled step), and gloo is the backend that carries them on any host. When jmp
  (``tsm.init`` / ``smp.init``) has started it already, the script's call returns without starting a second
  default group.

Then the environment's own ``sitecustomize``, which this one shadows, runs. Standard library only, and nothing
is imported until the script imports it: torch and jmp load when the script asks for them.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys

_TSM = "torch.sagemaker"
_DISTRIBUTED = "torch.distributed"
_HERE = os.path.dirname(os.path.abspath(__file__))


class TorchSagemakerFinder(importlib.abc.MetaPathFinder):
    """Installs jmp's alias finder at the first import of a name under ``torch.sagemaker``, and asks it."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TSM and not fullname.startswith(_TSM + "."):
            return None
        from jmp.runtime import smp_aliases  # torch is imported already: torch.sagemaker's parent

        smp_aliases.install()
        return smp_aliases.SmpAliasFinder().find_spec(fullname, path, target)


class TorchDistributedFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed`` with the other finders and has its loader replace ``init_process_group``
    once the module has run (torch imports it while it is imported itself, so nothing can import jmp here)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DISTRIBUTED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                if hasattr(module, "init_process_group"):
                    patch_init_process_group(module)

            spec.loader.exec_module = exec_module  # this spec's loader only: its module keeps it as __loader__
        return spec


def patch_init_process_group(distributed) -> None:
    """Make ``distributed.init_process_group`` (and ``distributed_c10d``'s) start gloo whatever backend it is given."""
    given = distributed.init_process_group
    if getattr(given, "jmp_any_backend", False):
        return

    @functools.wraps(given)
    def init_process_group(backend=None, *args, **kwargs):
        if distributed.is_initialized():  # jmp started the default group: one per job
            _note(f"torch.distributed.init_process_group({backend!r}): already started (by jmp); kept as it is")
            return None
        if backend not in (None, "gloo"):
            _note(f"torch.distributed.init_process_group({backend!r}) starts gloo: it carries the host tensors")
        return given("gloo", *args, **kwargs)

    init_process_group.jmp_any_backend = True
    distributed.init_process_group = init_process_group
    c10d = getattr(distributed, "distributed_c10d", None)
    if c10d is not None:
        c10d.init_process_group = init_process_group


_noted: set[str] = set()


def _note(message: str) -> None:
    if message not in _noted:
        _noted.add(message)
        logging.getLogger("jmp").info(message)


def _run_shadowed_sitecustomize() -> None:
    """Run the ``sitecustomize`` the environment would have run without this directory first on the path."""
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


sys.meta_path.insert(0, TorchDistributedFinder())
sys.meta_path.insert(0, TorchSagemakerFinder())
_run_shadowed_sitecustomize()
