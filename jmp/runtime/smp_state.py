"""``smp.state``: SMP's state object, read live from ``smp.init``'s config and mesh.

``cfg.<key>`` is every key's value (aliases too), the rank attributes are ``smp.rank()``'s and its siblings',
and ``module_manager.translate_functions`` is empty (jmp's state dicts already carry torch's keys).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from jmp.runtime import mesh_state
from jmp.runtime.config import ALIASES, Config

_RANKS = (
    "rank size local_rank local_size dp_rank dp_size rdp_rank rdp_size tp_rank tp_size pp_rank pp_size mp_rank mp_size"
).split()


class ConfigView:
    """The run's config by attribute: every key of ``jmp.runtime.config.Config`` and SMP's aliases."""

    def __getattr__(self, name: str) -> Any:
        key = ALIASES.get(name, name)
        keys = [field.name for field in dataclasses.fields(Config)]
        if key not in keys:
            close = difflib.get_close_matches(name, [*keys, *ALIASES], n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise AttributeError(f"smp.state.cfg has no key '{name}': {hint}the keys are {', '.join(keys)}")
        return getattr(mesh_state.get_config(), key)

    def __dir__(self) -> list[str]:
        return [field.name for field in dataclasses.fields(Config)] + list(ALIASES)

    def __repr__(self) -> str:
        return repr(mesh_state.get_config()) if mesh_state.is_initialized() else "<smp.state.cfg: not initialized>"


@dataclasses.dataclass
class ModuleManager:
    """What SMP's module manager offers tools: state-dict translations between SMP's names and the model's."""

    translate_functions: list = dataclasses.field(default_factory=list)


class State:
    """SMP's ``smp.state``: ``cfg``, ``module_manager`` and the rank helpers' values as attributes."""

    def __init__(self):
        self.cfg = ConfigView()
        self.module_manager = ModuleManager()

    @property
    def initialized(self) -> bool:
        return mesh_state.is_initialized()

    def __getattr__(self, name: str) -> Any:
        if name in _RANKS:
            return getattr(mesh_state, name)()
        raise AttributeError(f"smp.state has no attribute '{name}': it has cfg, module_manager, initialized, {_RANKS}")


state = State()
