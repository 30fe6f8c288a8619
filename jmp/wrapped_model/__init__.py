"""``DistributedModel``: the wrapped torch module, its records, its torch-facing surface, delayed init."""
