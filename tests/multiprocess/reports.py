"""Reading what the processes of a launched run printed."""

from __future__ import annotations

import json


def json_objects(text: str) -> list:
    """Every JSON object in ``text``, in order. Processes sharing one stdout can run their lines together
    (one's newline written after the other's line), so objects are found by parsing, not by lines."""
    decoder = json.JSONDecoder()
    found, position = [], 0
    while (start := text.find("{", position)) != -1:
        try:
            value, position = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            position = start + 1
            continue
        found.append(value)
    return found
