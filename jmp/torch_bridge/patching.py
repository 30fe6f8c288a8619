"""A patch shared by every bridge session: installed by the first to enter, restored by the last to exit.

Sessions may run in several threads at once; torch's globals are process-wide, so the patch counts its
users under a lock instead of being installed and removed by each session.
"""

from __future__ import annotations

import threading
from typing import Any


class SharedPatch:
    """Sets ``target.name = replacement`` for each triple while at least one user is inside ``with patch:``.

    The originals are read from each target's own ``__dict__`` when the patch is made, so a descriptor (a
    ``classmethod``) is put back as the descriptor it was. Assumes nothing else patches the same
    attributes meanwhile.
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
