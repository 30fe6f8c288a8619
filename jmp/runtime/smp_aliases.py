"""SMP's import paths as aliases: ``smdistributed.modelparallel.torch.X`` is ``jmp.X``, ``torch.sagemaker.X`` is
``jmp.tsm.X``.

The same module object under both names (a copy would hold its own state and classes). ``smp_import_path``'s
``torch`` package installs this finder for ``smdistributed``, the launcher's ``sitecustomize`` for ``torch.sagemaker``.
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
TSM_PACKAGE = "torch.sagemaker"
JMP_TSM_PACKAGE = "jmp.tsm"
# SMP's package -> jmp's. SMP v1's package itself is a file of smp_import_path that replaces itself with jmp;
# torch.sagemaker has no file, so this finder answers for the package too.
PACKAGES = {SMP_PACKAGE: JMP_PACKAGE, TSM_PACKAGE: JMP_TSM_PACKAGE}


def jmp_name(smp_name: str) -> str | None:
    """The jmp module an SMP module name stands for, or None for names outside SMP's packages."""
    for package, target in PACKAGES.items():
        if smp_name == package:
            return target
        if smp_name.startswith(package + "."):
            return target + smp_name[len(package) :]
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
    """Finds ``smdistributed.modelparallel.torch.X`` as ``jmp.X`` and ``torch.sagemaker[.X]`` as ``jmp.tsm[.X]``."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        name = jmp_name(fullname)
        if name is None or fullname == SMP_PACKAGE or importlib.util.find_spec(name) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name), is_package=fullname in PACKAGES)


def register_shadowed(package: str) -> list[str]:
    """Put the jmp submodules whose package name is another object (``jmp.step``) in ``sys.modules`` under ``package``.

    Returns the names put there. Found by this finder instead, the import system would set each on the package,
    and ``smp.step`` would become the module.
    """
    target = PACKAGES[package]
    jmp_package = sys.modules[target]
    shadowed = []
    for name, module in list(sys.modules.items()):
        leaf = name[len(target) + 1 :]
        if name.startswith(target + ".") and "." not in leaf and getattr(jmp_package, leaf, module) is not module:
            sys.modules.setdefault(f"{package}.{leaf}", module)
            shadowed.append(f"{package}.{leaf}")
    return sorted(shadowed)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), so SMP's module names find jmp's modules."""
    if not any(isinstance(finder, SmpAliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, SmpAliasFinder())
