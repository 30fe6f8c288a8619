"""``tsm.init``: SMP v2's configuration, read as SMP v2 reads it and given to ``jmp.init``.

SMP v2's keys are jmp's. Its defaults differ for ``hybrid_shard_degree`` (0: FSDP's ``sharding_strategy`` decides
without tp, else the largest degree; the mesh's ``fsdp`` spans every data-parallel device either way, and
``tsm.state.hybrid_shard_degree`` says which) and ``activation_loading_horizon`` (2, kept for ``tsm.state`` only).
``tsm.state``'s degrees may be assigned: kept for the next ``tsm.init``, or the mesh is built again with them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.runtime import mesh_state, notices, rank_zero_logging, sagemaker_config
from jmp.runtime.config import ALIASES, Config, parse

logger = logging.getLogger("jmp")

DEGREES = ("tensor_parallel_degree", "expert_parallel_degree", "context_parallel_degree")  # assignable on tsm.state
V2_DEFAULTS = {"hybrid_shard_degree": 0, "activation_loading_horizon": 2}  # where v2's default is not jmp's
_HORIZON = "activation_loading_horizon"


@dataclasses.dataclass(frozen=True)
class V2Run:
    """What ``tsm.init`` made of an SMP v2 config: read by ``tsm.state`` while ``config`` is the run's."""

    config: Config  # the run's config as jmp.init resolved it; another one current means jmp.init ran since
    given: dict[str, Any]  # the v2 config tsm.init was given (with assigned degrees), to build the mesh again
    hybrid_shard_degree: int  # 0: PyTorch FSDP's sharding_strategy decides; else the mesh's fsdp degree
    activation_loading_horizon: int


_run: V2Run | None = None
_assigned: dict[str, int] = {}  # degrees assigned on tsm.state before tsm.init, for the next tsm.init


def init(config: dict[str, Any] | str | os.PathLike | None = None) -> None:
    """SMP v2's ``torch.sagemaker.init``: validate ``config`` and build the run's mesh (``jmp.init``).

    ``config``: a dict, the path of a JSON file holding one, or None (``SM_HP_MP_PARAMETERS``, else the defaults);
    with or without ``torch.distributed`` started. Raises ``ConfigError`` for a bad key, value, file or degrees.
    """
    given, source = _read(config)
    given = {**given, **_assigned}
    _assigned.clear()
    _start(given, source)


def is_initialized() -> bool:
    """Whether the run's mesh is built (``tsm.init`` or ``jmp.init``)."""
    return mesh_state.is_initialized()


def current_run() -> V2Run | None:
    """What the latest ``tsm.init`` made, while its config is still the run's (None after a plain ``jmp.init``)."""
    if _run is None or not mesh_state.is_initialized() or mesh_state.get_config() is not _run.config:
        return None
    return _run


def pending_value(key: str) -> Any:
    """A v2 key's value before ``tsm.init``: assigned on ``tsm.state``, else what ``tsm.init()`` would read from
    the environment, else SMP v2's default."""
    if key in _assigned:
        return _assigned[key]
    given, _ = sagemaker_config.from_environment()
    named = {ALIASES.get(k, k): v for k, v in given.items()}
    name = ALIASES.get(key, key)
    if name in named:
        return named[name]
    return V2_DEFAULTS.get(key, getattr(Config, name))


def assign_degree(key: str, value: int) -> None:
    """``tsm.state.<key> = value`` for a ``DEGREES`` key: kept for the next ``tsm.init``, or the mesh rebuilt."""
    parse({key: value}, f"tsm.state.{key}")
    run = current_run()
    if run is not None:
        _start({**run.given, key: value}, None)
    elif mesh_state.is_initialized():  # a plain jmp.init: its config, with the new degree
        _start({**_given_keys(mesh_state.get_config()), key: value}, None)
    else:
        _assigned[key] = value


def _start(given: dict[str, Any], source: str | None) -> None:
    global _run
    rank_zero_logging.install()  # before this function's own notices, which come ahead of jmp.init's
    horizon = given.get(_HORIZON, V2_DEFAULTS[_HORIZON])
    parse({_HORIZON: horizon}, source)  # a positive integer, checked as jmp checks it
    jmp_config = {key: value for key, value in given.items() if key != _HORIZON}
    if not any(ALIASES.get(key, key) == "sharded_data_parallel_degree" for key in jmp_config):
        jmp_config["hybrid_shard_degree"] = V2_DEFAULTS["hybrid_shard_degree"]
    if _HORIZON in given:
        notices.info_once(
            f"tsm.init:{_HORIZON}",
            f"tsm.init: {_HORIZON}={horizon} has no effect: XLA schedules the copies of offloaded activations "
            "back to the device itself, overlapping them with the backward pass",
        )
    if source is not None:
        logger.info("tsm.init(): the config comes from %s: %s", source, given)
    try:
        mesh_state.init(jmp_config)
    except ConfigError as error:
        if source is None:
            raise
        raise ConfigError(f"{error} (the config came from {source})") from None
    resolved = mesh_state.get_config()
    hybrid = next(v for k, v in jmp_config.items() if ALIASES.get(k, k) == "sharded_data_parallel_degree")
    strategy_decides = hybrid == 0 and resolved.tensor_parallel_degree == 1
    _run = V2Run(
        config=resolved,
        given=dict(given),
        hybrid_shard_degree=0 if strategy_decides else resolved.sharded_data_parallel_degree,
        activation_loading_horizon=horizon,
    )


def _given_keys(config: Config) -> dict[str, Any]:
    """The keys of ``config`` that differ from jmp's defaults (what a config dict would have given), and its
    sharded-data-parallel degree (else v2's default, 0, would take its place)."""
    given = {
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(config)
        if getattr(config, field.name) != field.default
    }
    return given | {"sharded_data_parallel_degree": config.sharded_data_parallel_degree}


def _read(config: Any) -> tuple[dict[str, Any], str | None]:
    """(the config dict, where it came from or None for a dict given)."""
    if config is None:
        return sagemaker_config.from_environment()
    if isinstance(config, dict):
        return dict(config), None
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as file:
                value = json.load(file)
        except OSError as error:
            raise ConfigError(f"tsm.init: cannot read the config file {path}: {error}") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"tsm.init: the config file {path} is not valid JSON ({error})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"tsm.init: the config file {path} must hold a JSON object of config keys")
        return value, path
    raise ArgumentTypeError(
        f"tsm.init takes a dict of config keys, the path of a JSON file, or None, not {type(config).__name__}"
    )
