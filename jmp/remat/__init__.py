"""Activation checkpointing and offloading: ``jax.checkpoint`` around converted modules.

- ``policies``: what a checkpointed module keeps for the backward pass (presets -> ``jax.checkpoint_policies``);
- ``strategies``: how the layers of a container are grouped into checkpoints;
- ``context``: which model a step is tracing, and the converted twin each torch module's calls reach;
- ``region``: one ``jax.checkpoint`` around a run of converted modules, their state threaded through;
- ``groups``: the call hook that runs an annotated container's layers group by group;
- ``api``: the smp functions (``checkpoint``, ``checkpoint_sequential``, ``set_activation_checkpointing``).
"""
