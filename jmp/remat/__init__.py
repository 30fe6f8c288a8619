"""Activation checkpointing and offloading: ``jax.checkpoint`` around converted modules.

``policies`` (what a checkpoint keeps), ``strategies`` (how a container's layers are grouped), ``context``
(the model a step traces and its twins), ``region`` (one ``jax.checkpoint``), ``groups`` (running a container
group by group) and ``api`` (the smp functions).
"""
