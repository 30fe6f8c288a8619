"""The place for fused optimizer-update kernels (Pallas), each an ``optax.GradientTransformation``.

Empty until those kernels land: today every optimizer update is a plain optax transformation.
"""
