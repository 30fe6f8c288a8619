"""Resolve SMP's public names the way scripts reach them, in a process set up as ``python -m jmp.launch`` sets up
its own (``jmp/runtime/smp_import_path`` first on ``PYTHONPATH``): ``smp_paths_probe.py TABLE.json``.

Each entry of the table (``test_smp_module_paths.PATHS``) is ``[form, module, attribute, kind, same]``:

- form ``"attr"``: ``import module``, then the attribute chain read as a script reads it (``smp.state.cfg.fp16``
  after ``import smdistributed.modelparallel.torch as smp``), with no import on the way;
- form ``"from"``: ``from module import first`` (which imports ``module.first`` when it is no attribute), then the
  rest of the chain;
- form ``"absent"``: ``from module import attribute`` must raise ``ImportError``, which is what the scripts that
  import it catch.

``kind`` says what the object must be (see ``_kind_error``); ``same``, when given, is another entry's
``module:attribute`` that must be the very same object. SMP v1's entries are walked after ``smp.init()``, SMP v2's
after ``tsm.init()``, and the whole table twice: an import by an SMP name must not change what another name reads
(importing ``smdistributed.modelparallel.torch.step`` must leave ``smp.step`` the decorator). Prints one JSON object:
entry index -> the first error met, for the entries that failed.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import sys
import types
from typing import Any

V2 = "torch.sagemaker"


def _import(module: str) -> Any:
    importlib.import_module(module)
    return sys.modules[module]


def _chain(obj: Any, names: list[str]) -> Any:
    for name in names:
        obj = getattr(obj, name)
    return obj


def resolve(form: str, module: str, attribute: str) -> Any:
    """What a script gets for ``module`` / ``attribute`` in the given form."""
    names = attribute.split(".") if attribute else []
    if form == "attr":
        return _chain(_import(module), names)
    top = _import(module)
    if not names:
        return top
    try:  # from module import first
        first = getattr(top, names[0])
    except AttributeError:
        first = _import(f"{module}.{names[0]}")
    return _chain(first, names[1:])


def _dotted(name: str) -> Any:
    """The object a dotted name stands for; a bare name is a builtin (``bool``, ``int``, ``list``, ``object``)."""
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module or "builtins"), attribute)


def _kind_error(obj: Any, kind: str) -> str | None:
    """Why ``obj`` is not of ``kind`` (None when it is): ``module``, ``class`` / ``class:BASE``, ``function`` (a
    callable that is no class), ``contextmanager`` (a function whose result is a context manager: called with no
    argument here), ``instance:TYPE``, ``enum:CLASS_ENTRY`` (a member of that class), ``version>=X``."""
    name, _, detail = kind.partition(":")
    if name == "module":
        return None if isinstance(obj, types.ModuleType) else f"not a module: {obj!r}"
    if name == "class":
        if not inspect.isclass(obj):
            return f"not a class: {obj!r}"
        return None if not detail or issubclass(obj, _dotted(detail)) else f"{obj!r} is no subclass of {detail}"
    if name == "function":
        return None if callable(obj) and not inspect.isclass(obj) else f"not a function: {obj!r}"
    if name == "instance":
        return None if isinstance(obj, _dotted(detail)) else f"{obj!r} is no {detail}"
    if name == "enum":
        return None if isinstance(obj, enum.Enum) else f"not an enum member: {obj!r}"
    if name.startswith("version>="):
        from packaging import version

        floor = name.removeprefix("version>=")
        return None if version.parse(obj) >= version.parse(floor) else f"version {obj!r} < {floor}"
    return f"unknown kind {kind!r}"


def check(entry: list) -> str | None:
    form, module, attribute, kind, same = entry
    if form == "absent":
        try:
            resolve("from", module, attribute)
        except ImportError:
            return None
        except Exception as error:  # noqa: BLE001 (the scripts catch ImportError only: anything else breaks them)
            return f"raised {type(error).__name__}, not ImportError: {error}"
        return "resolves, though it is listed as not provided"
    try:
        obj = resolve(form, module, attribute)
    except Exception as error:  # noqa: BLE001 (reported per entry)
        return f"{type(error).__name__}: {error}"
    if (why := _kind_error(obj, kind)) is not None:
        return why
    if same is not None:
        other_module, _, other_attribute = same.partition(":")
        other = resolve("attr", other_module, other_attribute)
        if other is not obj:
            return f"is {obj!r}, not the same object as {same} ({other!r})"
    return None


def main(table_path: str) -> None:
    table = json.loads(open(table_path).read())
    failures: dict[int, str] = {}
    import smdistributed.modelparallel.torch as smp

    smp.init({})
    v1 = [i for i, entry in enumerate(table) if not entry[1].startswith(V2)]
    v2 = [i for i, entry in enumerate(table) if entry[1].startswith(V2)]
    for i in v1:
        if (error := check(table[i])) is not None:
            failures.setdefault(i, error)
    import torch.sagemaker as tsm

    tsm.init({})
    for _ in range(2):
        for i in v1 + v2:
            if (error := check(table[i])) is not None:
                failures.setdefault(i, error)
    sys.stdout.write(json.dumps(failures) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
