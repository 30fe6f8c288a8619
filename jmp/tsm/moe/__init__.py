"""``torch.sagemaker.moe``: SMP v2's mixture-of-experts configuration (``moe_config.MoEConfig``). Expert parallelism
itself is jmp's (``jmp.sharding.experts``), over the mesh's ``ep`` axis."""
