"""The model-parallel configuration SageMaker hands a training process, read from its environment.

``SM_HP_MP_PARAMETERS`` (a JSON object, where SMP reads it); when absent, ``SM_FRAMEWORK_PARAMS``'s
``mp_parameters`` or ``sagemaker_distribution.smdistributed.modelparallel.parameters``; else the defaults.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jmp.errors import ConfigError

MP_PARAMETERS = "SM_HP_MP_PARAMETERS"
FRAMEWORK_PARAMS = "SM_FRAMEWORK_PARAMS"


def from_environment(env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str | None]:
    """The smp config dict SageMaker passed (``{}`` if none) and the variable it came from (or None)."""
    env = os.environ if env is None else env
    if MP_PARAMETERS in env:
        return _object(env[MP_PARAMETERS], MP_PARAMETERS), MP_PARAMETERS
    if FRAMEWORK_PARAMS in env:
        found = _modelparallel_parameters(_object(env[FRAMEWORK_PARAMS], FRAMEWORK_PARAMS))
        if found is not None:
            return found, FRAMEWORK_PARAMS
    return {}, None


def _modelparallel_parameters(params: dict[str, Any]) -> dict[str, Any] | None:
    if "mp_parameters" in params:
        return _object(params["mp_parameters"], f"{FRAMEWORK_PARAMS}['mp_parameters']")
    node: Any = params.get("sagemaker_distribution")
    for key in ("smdistributed", "modelparallel"):
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get("enabled", True) and "parameters" in node:
        where = f"{FRAMEWORK_PARAMS}['sagemaker_distribution']['smdistributed']['modelparallel']['parameters']"
        return _object(node["parameters"], where)
    return None


def _object(value: Any, where: str) -> dict[str, Any]:
    """``value`` as a dict: SageMaker passes hyperparameters as JSON text, sometimes already decoded."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{where} is not valid JSON ({error}); it should hold the modelparallel parameters as a JSON "
                'object, e.g. {"partitions": 2, "microbatches": 4}'
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object of modelparallel parameters, not {value!r}")
    return value
