"""``DistributedOptimizer``: torch optimizers as optax transformations, their state in torch's format."""
