"""Remat policies: what a checkpointed module keeps for the backward pass, as presets over ``jax.checkpoint_policies``.

``"full"``, ``"save_matmuls"``, ``"save_names:attn,mlp"``, ``"offload_names:attn"``: a name is a submodule's
output by torch path relative to the checkpointed module, or ``"input"``. With ``offload_activations`` what a
checkpoint keeps (inputs, named activations; not matmul outputs) goes to ``pinned_host`` memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jmp.runtime.policy_syntax import INPUT, Policy, RematPolicy

_OFFLOAD = dict(offload_src="device", offload_dst="pinned_host")
# jax's "recompute" answer, read from a public policy that saves nothing (the enum itself is private)
_RECOMPUTE = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(), names_which_can_be_offloaded=(), **_OFFLOAD
)(None)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A policy made concrete for ``jax.checkpoint``: the jax policy and the activations to name for it."""

    jax_policy: Callable[..., Any]
    names: frozenset[str]  # submodule outputs to tag with ``checkpoint_name`` (relative torch paths)
    tag_inputs: bool  # tag the module's inputs as ``INPUT``
    # sharded-data parallelism resharding after the forward: torch name -> the sharding a parameter split over
    # fsdp is gathered to inside the checkpoint, tagged ``GATHERED`` (gathered again in the backward)
    gathered: tuple[tuple[str, Any], ...] = ()

    def with_gathered(self, gathered: tuple[tuple[str, Any], ...]) -> Resolved:
        return dataclasses.replace(self, gathered=gathered)


GATHERED = "jmp_fsdp_gathered"
# the checkpoint of a layer under reshard_after_forward that activation checkpointing does not cover: it keeps
# matmul outputs (``without_weights`` then leaves the gathered weights out) and recomputes elementwise ops,
# which the checkpoint's barriers would otherwise make XLA keep as separate buffers
KEEP_MATMULS = Resolved(jax.checkpoint_policies.dots_saveable, frozenset(), False)


def without_weights(policy: Callable[..., Any], weight_shapes: frozenset[tuple[int, ...]]) -> Callable[..., Any]:
    """``policy``, except that values made from whole weights alone are recomputed from the shards, not kept.

    A value whose every array input is shaped like a region weight counts as one (an activation of that shape is
    recomputed too: time, never correctness).
    """

    def keep(prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name == "sharding_constraint" or (prim.name == "name" and params.get("name") == GATHERED):
            return False
        arrays = [a for a in args if getattr(a, "ndim", 0) > 0]
        if arrays and all(tuple(a.shape) in weight_shapes for a in arrays):
            return False
        return policy(prim, *args, **params)

    return keep


def resolve(policy: Policy, offload: bool) -> Resolved:
    """The jax policy for ``policy``; with ``offload``, what it keeps goes to ``pinned_host`` memory."""
    if not isinstance(policy, RematPolicy):
        if not offload:
            return Resolved(policy, frozenset(), False)
        return Resolved(_first_of(_offloading((INPUT,)), policy), frozenset(), True)
    names = set(policy.names)
    saved = names if policy.preset == "save_names" else set()
    offloaded = names if policy.preset == "offload_names" else set()
    if offload:
        offloaded, saved = offloaded | saved | {INPUT}, set()
    base = jax.checkpoint_policies.dots_saveable if policy.preset == "save_matmuls" else None
    tagged = frozenset((saved | offloaded) - {INPUT})
    tag_inputs = INPUT in saved | offloaded
    if not saved and not offloaded:
        return Resolved(base or jax.checkpoint_policies.nothing_saveable, tagged, tag_inputs)
    named = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=tuple(sorted(saved)), names_which_can_be_offloaded=tuple(sorted(offloaded)), **_OFFLOAD
    )
    return Resolved(named if base is None else _first_of(named, base), tagged, tag_inputs)


def _offloading(names: tuple[str, ...]) -> Callable[..., Any]:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names, **_OFFLOAD
    )


def _first_of(first: Callable[..., Any], second: Callable[..., Any]) -> Callable[..., Any]:
    """``first``'s answer where it keeps or offloads a value, else ``second``'s."""

    def policy(prim: Any, *args: Any, **params: Any) -> Any:
        answer = first(prim, *args, **params)
        if answer is _RECOMPUTE or answer is False:
            return second(prim, *args, **params)
        return answer

    return policy
