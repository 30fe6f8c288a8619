"""``torch.sagemaker.tensor_parallel``: the class of transformed decoder layers (``transformer.TransformerLayer``).
The split itself is jmp's rule table (``jmp.sharding.tensor_parallel``), applied when the model is wrapped."""
