"""A patch of torch's process-wide globals shared by every bridge session (threads too), counted under a lock."""

from __future__ import annotations

import threading
from typing import Any


class SharedPatch:
    """Sets ``target.name = replacement`` for each triple while at least one user is inside ``with patch:``.

    Originals come from each target's ``__dict__``, so descriptors are restored as they were.
    """

    def __init__(self, *replacements: tuple[Any, str, Any]) -> None:
        self._replacements = replacements
        self._originals = [(target, name, vars(target)[name]) for target, name, _ in replacements]
        self._lock = threading.Lock()
        self._users = 0

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                for target, name, replacement in self._replacements:
                    setattr(target, name, replacement)
            self._users += 1

    def __exit__(self, *exc_info: Any) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for target, name, original in self._originals:
                    setattr(target, name, original)
