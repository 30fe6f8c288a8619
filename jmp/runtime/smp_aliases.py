"""SMP's import paths as aliases of jmp's: ``smdistributed.modelparallel.torch.X`` is the module ``jmp.X``.

The same module object under both names, not a second copy: a second copy would hold its own state (the
config, registries) and its own classes, which ``isinstance`` would tell apart. ``python -m jmp.launch`` makes
``smdistributed`` importable (``jmp/runtime/smp_import_path``), whose ``torch`` package installs this finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

SMP_PACKAGE = "smdistributed.modelparallel.torch"
JMP_PACKAGE = "jmp"


def jmp_name(smp_name: str) -> str | None:
    """The jmp module an SMP module name stands for, or None for names outside SMP's torch package."""
    if smp_name == SMP_PACKAGE:
        return JMP_PACKAGE
    if smp_name.startswith(SMP_PACKAGE + "."):
        return JMP_PACKAGE + smp_name[len(SMP_PACKAGE) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system the already-imported jmp module instead of executing a new one."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.own_spec  # the import system stamped the alias's spec on it; jmp's name stays


class SmpAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``smdistributed.modelparallel.torch.X`` as ``jmp.X`` (and nothing else)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        name = jmp_name(fullname)
        if name is None or fullname == SMP_PACKAGE or importlib.util.find_spec(name) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), so SMP's submodule names find jmp's modules."""
    if not any(isinstance(finder, SmpAliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, SmpAliasFinder())
