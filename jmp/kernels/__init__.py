"""Fused optimizer kernels (Pallas) exposed as ``optax.GradientTransformation``s.

Built by the optimizer-kernel work; the training front end falls back to plain
optax transformations where no kernel applies.
"""
