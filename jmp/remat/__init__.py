"""Activation checkpointing and offloading: ``jax.checkpoint`` around converted modules."""
