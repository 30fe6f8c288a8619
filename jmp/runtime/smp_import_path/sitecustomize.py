"""Set-up of every Python process ``python -m jmp.launch`` starts: this directory is first on their
``PYTHONPATH``, so Python's start-up imports this ``sitecustomize``. It makes SMP v2 scripts run with no edit
(docs/running_scripts.md, "SMP v2 and PyTorch FSDP scripts"): ``torch.sagemaker`` resolves to ``jmp.tsm`` (a
finder: ``torch`` is a real package, so no directory can stand for it), ``init_process_group`` starts gloo for
any backend (it carries the host tensors a script holds; the model's collectives are XLA's), and the torch FSDP /
DDP / DCP names in ``AFTER_IMPORT`` resolve to ``jmp.fsdp``'s in a script's modules, as SMP v2's container
patches torch's. torch's own modules keep torch's objects: they use FSDP's internals (flat parameters).

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


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``AFTER_IMPORT`` with the other finders and has their loader run a patch once the
    module has run (torch imports them while it is imported itself, so nothing can import jmp here)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        patch = AFTER_IMPORT.get(fullname)
        if patch is None:
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
                patch(module)

            spec.loader.exec_module = exec_module  # this spec's loader only: its module keeps it as __loader__
        return spec


class JmpNames:
    """Makes some of a torch module's names resolve to a jmp module's objects for every module but torch's own.

    The names leave the module's namespace; its ``__getattr__`` (PEP 562, which ``from m import name`` calls too)
    answers for them: torch's own object when torch or jmp asks (the nearest frame outside the import system
    belongs to a module of ``torch`` or ``jmp``: jmp's wrappers call torch's), else the object of that name in
    ``target``, imported at the first such question. While a ``target`` is being imported the answer is torch's
    (what that import brings in gets torch's).
    """

    resolving: list[str] = []  # the names being resolved now, across instances

    def __init__(self, target: str, names: tuple[str, ...]):
        self.target, self.names = target, names

    def __call__(self, module) -> None:
        own = {name: module.__dict__.pop(name) for name in self.names if name in module.__dict__}
        before = module.__dict__.get("__getattr__")
        target, resolving = self.target, self.resolving

        def __getattr__(name: str):
            if name not in own:
                if before is not None:
                    return before(name)
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            if resolving or _asked_by_torch_or_jmp():
                return own[name]
            resolving.append(name)
            try:
                return getattr(importlib.import_module(target), name)
            finally:
                resolving.pop()

        module.__getattr__ = __getattr__


def _asked_by_torch_or_jmp() -> bool:
    frame = sys._getframe(2)  # the caller of the module's __getattr__
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("importlib"):
        frame = frame.f_back
    asking = str(frame.f_globals.get("__name__", "")) if frame is not None else ""
    return asking.partition(".")[0] in ("torch", "jmp")


def patch_init_process_group(distributed) -> None:
    """Make ``distributed.init_process_group`` (and ``distributed_c10d``'s) start gloo whatever backend it is given."""
    given = getattr(distributed, "init_process_group", None)
    if given is None or getattr(given, "jmp_any_backend", False):
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
    """One of jmp's notices, once per job: the launcher's first process says it (jmp, whose logger filters the
    others' notices, is not imported yet; the launcher gives each process its ``RANK``)."""
    if message not in _noted and os.environ.get("RANK", "0") == "0":
        _noted.add(message)
        logging.getLogger("jmp").info(message)


def _run_shadowed_sitecustomize() -> None:
    """Run the ``sitecustomize`` the environment would have run without this directory first on the path."""
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# module -> what to do once it has run
AFTER_IMPORT = {
    _DISTRIBUTED: patch_init_process_group,
    "torch.distributed.fsdp": JmpNames("jmp.fsdp", ("FullyShardedDataParallel", "fully_shard")),
    "torch.distributed.device_mesh": JmpNames("jmp.fsdp", ("init_device_mesh",)),
    "torch.distributed.tensor.parallel": JmpNames("jmp.fsdp", ("parallelize_module",)),
    "torch.nn.parallel": JmpNames("jmp.fsdp", ("DistributedDataParallel",)),
    "torch.nn.parallel.distributed": JmpNames("jmp.fsdp", ("DistributedDataParallel",)),
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper": JmpNames(
        "jmp.fsdp", ("apply_activation_checkpointing", "checkpoint_wrapper", "offload_wrapper")
    ),
    "torch.distributed.checkpoint": JmpNames(
        "jmp.fsdp.distributed_checkpoint", ("save_state_dict", "load_state_dict", "save", "load", "async_save")
    ),
    "torch.distributed.checkpoint.state_dict": JmpNames(
        "jmp.fsdp.dcp_state_dicts",
        (
            "get_state_dict",
            "set_state_dict",
            "get_model_state_dict",
            "get_optimizer_state_dict",
            "set_model_state_dict",
            "set_optimizer_state_dict",
        ),
    ),
    "torch.distributed.checkpoint.optimizer": JmpNames(
        "jmp.fsdp.distributed_checkpoint", ("load_sharded_optimizer_state_dict",)
    ),
}
sys.meta_path.insert(0, AfterImportFinder())
sys.meta_path.insert(0, TorchSagemakerFinder())
_run_shadowed_sitecustomize()
